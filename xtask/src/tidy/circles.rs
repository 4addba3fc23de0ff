//! Import circles inside a crate: files that reach each other through `use crate::…`,
//! `super::…` and `self::…` paths.
//!
//! A circle of many files is a hub in disguise: none of its files can be read, tested or
//! changed alone. The rule allows circles of at most [`CIRCLE_FILES_MAX`] files.
//!
//! How a file's imports are read, as text (no macro expansion):
//!
//! - Comments are dropped, and so is every item marked `#[cfg(test)]`: tests are not part of
//!   the structure.
//! - Every `use` item is expanded (braces included) into paths; so is every inline path that
//!   starts with `crate::`, `super::` or `self::`.
//! - A path names the deepest module file it reaches. A path that reaches only the crate root
//!   names the module the root re-exports that name from (`pub use module::Name`), or nothing.
//! - Files named `tests.rs`, test-suite `cases.rs` files and the crate root itself are not
//!   nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};

/// The largest import circle a crate may have, in files.
pub(crate) const CIRCLE_FILES_MAX: usize = 3;

/// A crate's module files: module path → source text.
pub(crate) type Modules = BTreeMap<String, String>;

/// Reads the module files of the crate whose `src` folder is `src`.
pub(crate) fn load_modules(src: &Path) -> Result<Modules> {
    let mut modules = Modules::new();
    let mut files = Vec::new();
    super::collect_rust_files(src, &mut files)?;
    for file in files {
        let relative = file.strip_prefix(src).unwrap_or(&file);
        let mut parts: Vec<String> = relative
            .components()
            .map(|part| part.as_os_str().to_string_lossy().into_owned())
            .collect();
        let Some(last) = parts.pop() else { continue };
        let stem = last.trim_end_matches(".rs").to_owned();
        if matches!(stem.as_str(), "tests" | "cases" | "main") || parts.iter().any(|p| p == "tests")
        {
            continue;
        }
        if stem != "mod" && !(parts.is_empty() && stem == "lib") {
            parts.push(stem);
        }
        let text =
            fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
        modules.insert(parts.join("::"), text);
    }
    Ok(modules)
}

/// The import edges between the modules (root excluded): module → modules it names.
pub(crate) fn edges(modules: &Modules) -> BTreeMap<String, BTreeSet<String>> {
    let reexports = modules.get("").map(|root| root_reexports(&code_of(root))).unwrap_or_default();
    let mut edges = BTreeMap::new();
    for (module, text) in modules {
        if module.is_empty() {
            continue;
        }
        let mut targets = BTreeSet::new();
        for path in paths_in(&code_of(text)) {
            let Some(absolute) = absolute(module, &path, modules) else { continue };
            if let Some(target) = resolve(&absolute, modules, &reexports)
                && target != *module
            {
                targets.insert(target);
            }
        }
        edges.insert(module.clone(), targets);
    }
    edges
}

/// The circles (strongly connected sets of two or more modules), largest first.
pub(crate) fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let nodes: Vec<&String> = edges.keys().collect();
    let index: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let reach = |from: usize| -> BTreeSet<usize> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from];
        while let Some(node) = stack.pop() {
            for next in edges.get(nodes[node]).into_iter().flatten() {
                if let Some(&next) = index.get(next)
                    && seen.insert(next)
                {
                    stack.push(next);
                }
            }
        }
        seen
    };
    let reaches: Vec<BTreeSet<usize>> = (0..nodes.len()).map(reach).collect();
    let mut assigned = BTreeSet::new();
    let mut found = Vec::new();
    for node in 0..nodes.len() {
        if assigned.contains(&node) {
            continue;
        }
        let circle: Vec<usize> = (0..nodes.len())
            .filter(|&other| {
                other == node || (reaches[node].contains(&other) && reaches[other].contains(&node))
            })
            .collect();
        if circle.len() > 1 {
            assigned.extend(circle.iter().copied());
            found.push(circle.iter().map(|&i| nodes[i].clone()).collect::<Vec<_>>());
        }
    }
    found.sort_by_key(|circle| std::cmp::Reverse(circle.len()));
    found
}

/// The violations of every crate under `crates/`.
pub(crate) fn circle_violations(root: &Path) -> Result<Vec<String>> {
    let mut violations = Vec::new();
    for entry in fs::read_dir(root.join("crates")).context("cannot list crates/")? {
        let dir = entry?.path();
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let largest = circles(&edges(&load_modules(&src)?)).into_iter().next();
        let Some(largest) = largest else { continue };
        let max = CIRCLE_FILES_MAX;
        if largest.len() > max {
            violations.push(format!(
                "{name}: an import circle of {} files (at most {max}): {}",
                largest.len(),
                largest.join(", ")
            ));
        }
    }
    Ok(violations)
}

/// `text` without comments and without the items marked `#[cfg(test)]`.
pub(crate) fn code_of(text: &str) -> String {
    let mut code = String::with_capacity(text.len());
    for line in text.lines() {
        let line = match line.find("//") {
            // A `//` inside a string literal is rare in paths' neighbourhood; cut anyway.
            Some(at) => &line[..at],
            None => line,
        };
        code.push_str(line);
        code.push('\n');
    }
    without_test_items(&code)
}

/// `code` without each `#[cfg(test)]` item: up to its `;` (`mod tests;`, a `use`), or to the
/// end of its first braced block (`mod tests { .. }`, a function).
fn without_test_items(code: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut kept = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find(MARK) {
        kept.push_str(&rest[..at]);
        let item = &rest[at + MARK.len()..];
        let end = match (item.find(';'), item.find('{')) {
            (Some(semicolon), Some(brace)) if semicolon < brace => semicolon + 1,
            (Some(semicolon), None) => semicolon + 1,
            (_, Some(brace)) => block_end(item, brace),
            (None, None) => item.len(),
        };
        rest = &item[end..];
    }
    kept.push_str(rest);
    kept
}

/// The index just past the block that opens at `open` (the whole rest when unbalanced).
fn block_end(text: &str, open: usize) -> usize {
    let mut depth = 0_usize;
    for (at, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return open + at + 1;
                }
            }
            _ => {}
        }
    }
    text.len()
}

/// The names the crate root re-exports, each with the module path it comes from.
fn root_reexports(code: &str) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    for item in use_items(code) {
        for path in expand(&item) {
            let segments: Vec<&str> = path.split("::").collect();
            if let Some((name, module)) = segments.split_last()
                && !module.is_empty()
            {
                let module = module.join("::");
                let module = module.trim_start_matches("crate::").to_owned();
                found.insert((*name).to_owned(), module);
            }
        }
    }
    found
}

/// Every path of `code` that may name a module of this crate: expanded `use` items, and
/// inline `crate::`, `super::` and `self::` paths.
fn paths_in(code: &str) -> Vec<String> {
    let mut paths: Vec<String> = use_items(code).iter().flat_map(|item| expand(item)).collect();
    for start in ["crate::", "super::", "self::"] {
        let mut rest = code;
        while let Some(at) = rest.find(start) {
            let preceded = rest[..at].chars().next_back();
            let tail = &rest[at..];
            if preceded.is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == ':')) {
                let end = tail
                    .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .unwrap_or(tail.len());
                paths.push(tail[..end].trim_end_matches(':').to_owned());
            }
            rest = &tail[start.len()..];
        }
    }
    paths
}

/// The bodies of the `use` items of `code` (what is between `use` and `;`).
fn use_items(code: &str) -> Vec<String> {
    let mut items = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let preceded = rest[..at].chars().next_back();
        let tail = &rest[at + 4..];
        if preceded.is_none_or(|c| c.is_whitespace() || c == ';' || c == '{' || c == '}')
            && let Some(end) = tail.find(';')
        {
            items.push(tail[..end].split_whitespace().collect::<Vec<_>>().join(" "));
            rest = &tail[end..];
        } else {
            rest = tail;
        }
    }
    items
}

/// A `use` body with its braces expanded: `a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`.
fn expand(item: &str) -> Vec<String> {
    let item = without_renames(item).replace(' ', "");
    let Some(open) = item.find('{') else {
        return vec![item];
    };
    let prefix = &item[..open];
    let inner = item[open + 1..].strip_suffix('}').unwrap_or(&item[open + 1..]);
    let mut parts = Vec::new();
    let mut depth = 0;
    let mut current = String::new();
    for c in inner.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    parts.push(current);
    parts
        .into_iter()
        .filter(|part| !part.is_empty())
        .flat_map(|part| expand(&format!("{prefix}{part}")))
        .map(|path| path.trim_end_matches("::self").to_owned())
        .collect()
}

/// `item` without its renames (`a::b as c` → `a::b`).
fn without_renames(item: &str) -> String {
    let mut out = String::with_capacity(item.len());
    let mut rest = item;
    while let Some(at) = rest.find(" as ") {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 4..];
        let end = tail.find([',', '}']).unwrap_or(tail.len());
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// `path`, written in `module`, as a path from the crate root (without `crate::`); `None` for
/// a path into another crate.
fn absolute(module: &str, path: &str, modules: &Modules) -> Option<String> {
    let mut base: Vec<&str> =
        if module.is_empty() { Vec::new() } else { module.split("::").collect() };
    let mut segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    match segments.first().copied() {
        Some("crate") => {
            segments.remove(0);
            return Some(segments.join("::"));
        }
        Some("self") => {
            segments.remove(0);
        }
        Some("super") => {
            while segments.first() == Some(&"super") {
                segments.remove(0);
                base.pop();
            }
        }
        Some(first) => {
            // A relative path names a child module of this one, or another crate.
            let child =
                if base.is_empty() { first.to_owned() } else { format!("{module}::{first}") };
            if !modules.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    base.extend(segments);
    Some(base.join("::"))
}

/// The module file `absolute` reaches: the deepest module on its way, or for a path that
/// reaches only the root, the module the root re-exports its name from.
fn resolve(
    absolute: &str,
    modules: &Modules,
    reexports: &BTreeMap<String, String>,
) -> Option<String> {
    let segments: Vec<&str> = absolute.split("::").filter(|s| !s.is_empty()).collect();
    for len in (1..=segments.len()).rev() {
        let candidate = segments[..len].join("::");
        if modules.contains_key(&candidate) {
            return Some(candidate);
        }
    }
    let first = segments.first()?;
    let module = reexports.get(*first)?;
    resolve(module, modules, &BTreeMap::new())
}
