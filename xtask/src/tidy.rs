//! Repository rules that are not compiler lints, checked as tests (`cargo test -p xtask`) and by
//! `cargo xtask tidy`.
//!
//! - The architecture invariants of ARCHITECTURE.md on the dependency graph: `cluster-core` has no
//!   runtime, database driver or network crate among its normal dependencies (transitively);
//!   `cluster-storage-sql` and `cluster-rpc` never depend on each other, on `cluster-sharding` or
//!   on `cluster-workflow`; nothing depends on `cluster-testkit` except as a dev-dependency.
//! - Every Rust file starts with a `//!` doc.
//! - No ignored tests, no tests that expect a panic, and no `todo` or `unimplemented` stubs.
//! - Only `cluster-core`'s `SystemClock` reads the wall clock.
//! - `PersistedDelivery` is wiring: its inherent `impl` lives in one file.
//! - Locks are taken through `cluster_core::sync` and `Never` is `cluster_core::Never`, each
//!   defined once.
//! - No import circle inside a crate is larger than three files (`circles`).
//! - `cluster-sharding`'s components do not name its handle, and its persisted path reads one
//!   way (`layers`).
//! - Comments and docs cite only what a clone can follow: the reference's own sources
//!   (`effect/src/...`) or paths that exist in this repository, never the design notes the
//!   project started from.
//! - Commit subjects have at most 72 characters (`commits`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Crates `cluster-core` must not depend on, directly or transitively: runtimes, database
/// drivers and network stacks.
const CORE_FORBIDDEN: [&str; 20] = [
    "tokio",
    "tokio-util",
    "async-std",
    "mio",
    "socket2",
    "tokio-postgres",
    "postgres",
    "postgres-types",
    "postgres-protocol",
    "deadpool-postgres",
    "mysql_async",
    "mysql_common",
    "rusqlite",
    "libsqlite3-sys",
    "hyper",
    "reqwest",
    "h2",
    "rustls",
    "tokio-rustls",
    "tonic",
];

/// `(crate, crates it must never depend on, transitively through normal dependencies)`.
const FORBIDDEN_EDGES: [(&str, &[&str]); 2] = [
    (
        "cluster-storage-sql",
        &["cluster-rpc", "cluster-sharding", "cluster-workflow", "cluster-testkit"],
    ),
    (
        "cluster-rpc",
        &["cluster-storage-sql", "cluster-sharding", "cluster-workflow", "cluster-testkit"],
    ),
];

/// Runs every check and fails with the list of violations.
pub(crate) fn run(root: &Path) -> Result<()> {
    let mut violations = dependency_violations(&Graph::load(root)?);
    violations.extend(source_violations(root)?);
    violations.extend(citation_violations_in(root)?);
    violations.extend(circles::circle_violations(root)?);
    violations.extend(layers::layer_violations(root)?);
    violations.extend(commits::commit_violations(root));
    if violations.is_empty() {
        return Ok(());
    }
    bail!("tidy found {} problem(s):\n- {}", violations.len(), violations.join("\n- "))
}

/// The resolved dependency graph: package name → normal (non-dev, non-build) dependencies,
/// and every dependency edge of any kind with its kinds.
#[derive(Debug, Default)]
pub(crate) struct Graph {
    normal: BTreeMap<String, BTreeSet<String>>,
    kinds: BTreeMap<(String, String), BTreeSet<String>>,
}

impl Graph {
    fn load(root: &Path) -> Result<Graph> {
        let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
            .args(["metadata", "--format-version", "1", "--locked"])
            .current_dir(root)
            .output()
            .context("cannot run cargo metadata")?;
        if !output.status.success() {
            bail!("cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr));
        }
        let metadata: Value =
            serde_json::from_slice(&output.stdout).context("cargo metadata is not JSON")?;
        Graph::from_metadata(&metadata)
    }

    /// Reads `cargo metadata --format-version 1` output.
    pub(crate) fn from_metadata(metadata: &Value) -> Result<Graph> {
        let mut names = BTreeMap::new();
        for package in metadata["packages"].as_array().context("no packages")? {
            let id = package["id"].as_str().context("package without id")?;
            let name = package["name"].as_str().context("package without name")?;
            names.insert(id.to_owned(), name.to_owned());
        }
        let mut graph = Graph::default();
        for node in metadata["resolve"]["nodes"].as_array().context("no resolve graph")? {
            let from = &names[node["id"].as_str().context("node without id")?];
            for dep in node["deps"].as_array().into_iter().flatten() {
                let to = &names[dep["pkg"].as_str().context("dependency without pkg")?];
                for kind in dep["dep_kinds"].as_array().into_iter().flatten() {
                    let kind = kind["kind"].as_str().unwrap_or("normal").to_owned();
                    if kind == "normal" {
                        graph.normal.entry(from.clone()).or_default().insert(to.clone());
                    }
                    graph.kinds.entry((from.clone(), to.clone())).or_default().insert(kind);
                }
            }
        }
        Ok(graph)
    }

    /// Every crate reachable from `root` through normal dependencies.
    fn normal_closure(&self, root: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![root.to_owned()];
        while let Some(name) = stack.pop() {
            for dep in self.normal.get(&name).into_iter().flatten() {
                if seen.insert(dep.clone()) {
                    stack.push(dep.clone());
                }
            }
        }
        seen
    }
}

/// The architecture invariants on the dependency graph.
pub(crate) fn dependency_violations(graph: &Graph) -> Vec<String> {
    let mut violations = Vec::new();
    let core = graph.normal_closure("cluster-core");
    for forbidden in CORE_FORBIDDEN {
        if core.contains(forbidden) {
            violations.push(format!(
                "cluster-core depends on `{forbidden}` (no runtime, driver or network crate)"
            ));
        }
    }
    for internal in core.iter().filter(|name| name.starts_with("cluster-")) {
        violations.push(format!("cluster-core depends on `{internal}` (core is the lowest crate)"));
    }
    for (from, forbidden) in FORBIDDEN_EDGES {
        let closure = graph.normal_closure(from);
        for to in forbidden.iter().filter(|to| closure.contains(**to)) {
            violations.push(format!("{from} depends on `{to}`"));
        }
    }
    for ((from, to), kinds) in &graph.kinds {
        if to == "cluster-testkit" && kinds.iter().any(|kind| kind != "dev") {
            violations
                .push(format!("{from} depends on cluster-testkit outside [dev-dependencies]"));
        }
    }
    violations
}

/// The rules on source files.
fn source_violations(root: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "examples"] {
        collect_rust_files(&root.join(dir), &mut files)?;
    }
    let mut violations = Vec::new();
    for file in files {
        let text =
            fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
        let relative = file.strip_prefix(root).unwrap_or(&file).display().to_string();
        violations.extend(file_violations(&relative, &text));
    }
    Ok(violations)
}

/// The rules on one source file.
pub(crate) fn file_violations(path: &str, text: &str) -> Vec<String> {
    let mut violations = Vec::new();
    if !text.starts_with("//!") {
        violations.push(format!("{path}: does not start with a `//!` module doc"));
    }
    // The patterns are split so that this file does not match itself.
    let banned = [
        (concat!("#[", "ignore"), "an ignored test never runs"),
        (concat!("#[", "should_panic"), "test the error value, not a panic"),
        (concat!("todo", "!("), "a stub"),
        (concat!("unimplemented", "!("), "a stub"),
    ];
    for (pattern, why) in banned {
        if text.contains(pattern) {
            violations.push(format!("{path}: contains `{pattern}` ({why})"));
        }
    }
    // One home each for the poison-ignoring lock helpers and the error type that has no value.
    let single_homes = [
        (
            concat!("PoisonError", "::into_inner"),
            "crates/cluster-core/src/sync.rs",
            "cluster_core::sync::lock",
        ),
        (concat!("enum ", "Never"), "crates/cluster-core/src/never.rs", "cluster_core::Never"),
    ];
    for (pattern, home, instead) in single_homes {
        if text.contains(pattern) && path != home {
            violations.push(format!("{path}: contains `{pattern}`; use `{instead}`"));
        }
    }
    // Wiring types: their inherent `impl` stays in one file, so the processes they wire keep
    // their state and code of their own instead of growing back into a hub.
    let wiring = [(
        concat!("impl ", "PersistedDelivery {"),
        "crates/cluster-sharding/src/runtime/persisted.rs",
    )];
    for (pattern, home) in wiring {
        if text.contains(pattern) && path != home {
            violations.push(format!(
                "{path}: contains `{pattern}`; it is wiring, whose methods live in {home}: give the \
                 code a component of its own that takes the parts it uses"
            ));
        }
    }
    let wall_clock = concat!("SystemTime", "::now");
    if text.contains(wall_clock) && path != "crates/cluster-core/src/clock.rs" {
        violations.push(format!("{path}: reads the wall clock; inject cluster_core::Clock"));
    }
    violations
}

/// Documents that are not part of a clone: citing them leaves the reader stranded. The
/// patterns are split so that this file does not match itself.
const OUTSIDE_DOCUMENTS: [&str; 7] = [
    concat!("DESIGN", ".md"),
    concat!("STYLE", ".md"),
    concat!("docs/", "style.md"),
    concat!("STYLE", " rule"),
    concat!("../", "shared"),
    concat!("reference/", "cluster.md"),
    concat!("reference/", "workflow.md"),
];

/// Words that, followed by a number, cite a numbered part of those documents (lower case).
const NUMBERED_CITATIONS: [&str; 5] = ["§", "seed 00", "seed-00", "seeds 00", "invariant "];

/// Extensions of the files a comment or doc may name by path.
const CITED_EXTENSIONS: [&str; 12] =
    ["md", "rs", "toml", "ts", "sh", "json", "yml", "yaml", "sql", "svg", "txt", "js"];

/// The citation rule over the repository's Rust, Markdown and TOML files.
fn citation_violations_in(root: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    collect_files(root, &["rs", "md", "toml"], &mut files)?;
    let mut bases = vec![PathBuf::new(), PathBuf::from("xtask"), PathBuf::from("xtask/src")];
    for entry in fs::read_dir(root.join("crates")).context("cannot list crates")? {
        let name = entry?.file_name();
        bases.push(Path::new("crates").join(&name));
        bases.push(Path::new("crates").join(&name).join("src"));
    }
    let mut violations = Vec::new();
    for file in files {
        let text =
            fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
        let relative = file.strip_prefix(root).unwrap_or(&file).to_path_buf();
        let directory = relative.parent().map(Path::to_path_buf).unwrap_or_default();
        let exists = |cited: &str| {
            let cited = cited.strip_prefix("./").unwrap_or(cited);
            std::iter::once(&directory)
                .chain(&bases)
                .any(|base| root.join(base).join(cited).exists())
        };
        violations.extend(citation_violations(&relative.display().to_string(), &text, &exists));
    }
    Ok(violations)
}

/// The citation rule on one file: in its comments (Rust and TOML) or its whole text
/// (Markdown), no citation of an outside document, and every cited path exists (`exists`).
/// The reference's sources (`effect/src/...`), URLs and absolute paths are not checked.
pub(crate) fn citation_violations(
    path: &str,
    text: &str,
    exists: &dyn Fn(&str) -> bool,
) -> Vec<String> {
    let markdown = path.ends_with(".md");
    let comment = if path.ends_with(".toml") { "#" } else { "//" };
    let mut violations = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if !markdown && !line.trim_start().starts_with(comment) {
            continue;
        }
        let at = format!("{path}:{}", index + 1);
        for document in OUTSIDE_DOCUMENTS {
            if line.contains(document) {
                violations
                    .push(format!("{at}: cites `{document}`, which is not in the repository"));
            }
        }
        let lower = line.to_lowercase();
        for words in NUMBERED_CITATIONS {
            let numbered = lower.match_indices(words).any(|(start, _)| {
                lower[start + words.len()..].chars().next().is_some_and(|c| c.is_ascii_digit())
            });
            if numbered {
                violations.push(format!(
                    "{at}: cites `{}<number>` of a document outside the repository; cite the \
                     reference's source file and function, or a document in the repository",
                    words.trim_end()
                ));
            }
        }
        for cited in cited_paths(line) {
            if !exists(cited) {
                violations.push(format!("{at}: cites `{cited}`, which does not exist"));
            }
        }
    }
    violations
}

/// The relative file paths a line names: words with a `/` and a known extension, without the
/// reference's sources, URLs, absolute paths and patterns.
fn cited_paths(line: &str) -> Vec<&str> {
    let separators = |c: char| c.is_whitespace() || "()[]<>\"'`,;|".contains(c);
    line.split(separators)
        .map(|word| word.trim_end_matches(['.', ':']))
        .map(|word| word.split('#').next().unwrap_or(word))
        .filter(|word| word.contains('/'))
        .filter(|word| {
            word.rsplit_once('.')
                .is_some_and(|(_, extension)| CITED_EXTENSIONS.contains(&extension))
        })
        .filter(|word| {
            !["http", "effect/", "packages/", "@", "/", "~", "$"]
                .iter()
                .any(|prefix| word.starts_with(prefix))
        })
        .filter(|word| !word.contains(['*', '{', '}']) && !word.contains("..."))
        .collect()
}

/// Files under `dir` with one of `extensions`, skipping build output, dependencies and
/// hidden folders.
fn collect_files(dir: &Path, extensions: &[&str], files: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        if path.is_dir() {
            if name == "target" || name == "node_modules" || name.starts_with('.') {
                continue;
            }
            collect_files(&path, extensions, files)?;
        } else if path
            .extension()
            .and_then(|extension| extension.to_str())
            .is_some_and(|extension| extensions.contains(&extension))
        {
            files.push(path);
        }
    }
    files.sort();
    Ok(())
}

fn collect_rust_files(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for entry in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|name| name == "target") {
                continue;
            }
            collect_rust_files(&path, files)?;
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            files.push(path);
        }
    }
    files.sort();
    Ok(())
}

mod circles;
mod commits;
mod layers;
#[cfg(test)]
mod tests;
