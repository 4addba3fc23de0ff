//! The tidy checks on this repository, and tests that each check catches what it should.

use serde_json::json;

use super::*;

#[test]
fn repository_is_tidy() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    if let Err(error) = run(root) {
        panic!("{error:#}");
    }
}

/// A metadata document with packages `names` and `edges` (from, to, kind).
fn metadata(names: &[&str], edges: &[(&str, &str, Option<&str>)]) -> Value {
    let packages: Vec<Value> =
        names.iter().map(|name| json!({ "id": name, "name": name })).collect();
    let nodes: Vec<Value> = names
        .iter()
        .map(|name| {
            let deps: Vec<Value> = edges
                .iter()
                .filter(|(from, _, _)| from == name)
                .map(|(_, to, kind)| json!({ "pkg": to, "dep_kinds": [{ "kind": kind }] }))
                .collect();
            json!({ "id": name, "deps": deps })
        })
        .collect();
    json!({ "packages": packages, "resolve": { "nodes": nodes } })
}

fn violations(names: &[&str], edges: &[(&str, &str, Option<&str>)]) -> Vec<String> {
    dependency_violations(&Graph::from_metadata(&metadata(names, edges)).unwrap())
}

#[test]
fn a_clean_graph_passes() {
    let names =
        ["cluster-core", "serde", "cluster-rpc", "tokio", "cluster-testkit", "cluster-sharding"];
    let edges = [
        ("cluster-core", "serde", None),
        ("cluster-rpc", "cluster-core", None),
        ("cluster-rpc", "tokio", None),
        ("cluster-sharding", "cluster-testkit", Some("dev")),
        ("cluster-core", "tokio", Some("dev")),
    ];
    assert_eq!(violations(&names, &edges), Vec::<String>::new());
}

#[test]
fn core_may_not_reach_a_runtime_even_transitively() {
    let names = ["cluster-core", "some-helper", "tokio"];
    let edges = [("cluster-core", "some-helper", None), ("some-helper", "tokio", None)];
    assert_eq!(
        violations(&names, &edges),
        ["cluster-core depends on `tokio` (no runtime, driver or network crate)"]
    );
}

#[test]
fn storage_and_rpc_stay_apart_and_testkit_is_dev_only() {
    let names = [
        "cluster-core",
        "cluster-storage-sql",
        "cluster-rpc",
        "cluster-testkit",
        "cluster-workflow",
    ];
    let edges = [
        ("cluster-storage-sql", "cluster-rpc", None),
        ("cluster-rpc", "cluster-workflow", None),
        ("cluster-workflow", "cluster-testkit", None),
    ];
    assert_eq!(
        violations(&names, &edges),
        [
            "cluster-storage-sql depends on `cluster-rpc`",
            "cluster-storage-sql depends on `cluster-workflow`",
            "cluster-storage-sql depends on `cluster-testkit`",
            "cluster-rpc depends on `cluster-workflow`",
            "cluster-rpc depends on `cluster-testkit`",
            "cluster-workflow depends on cluster-testkit outside [dev-dependencies]",
        ]
    );
}

#[test]
fn source_rules() {
    assert!(file_violations("a.rs", "//! Doc.\nfn main() {}\n").is_empty());
    let undocumented = file_violations("a.rs", "fn main() {}\n");
    assert_eq!(undocumented, ["a.rs: does not start with a `//!` module doc"]);
    let ignored = format!("//! Doc.\n{}]\nfn t() {{}}\n", concat!("#[", "ignore"));
    assert_eq!(file_violations("a.rs", &ignored).len(), 1);
    let stub = format!("//! Doc.\nfn f() {{ {}) }}\n", concat!("todo", "!("));
    assert_eq!(file_violations("a.rs", &stub).len(), 1);
    let clock = format!("//! Doc.\nlet now = std::time::{}();\n", concat!("SystemTime", "::now"));
    assert_eq!(file_violations("crates/x/src/a.rs", &clock).len(), 1);
    assert!(file_violations("crates/cluster-core/src/clock.rs", &clock).is_empty());
    let copy = format!(
        "//! Doc.\nfn l() {{ m.lock().unwrap_or_else({}); }}\n",
        concat!("PoisonError", "::into_inner")
    );
    assert_eq!(file_violations("crates/x/src/a.rs", &copy).len(), 1);
    assert!(file_violations("crates/cluster-core/src/sync.rs", &copy).is_empty());
    let wiring = format!("//! Doc.\n{}\n}}\n", concat!("impl ", "PersistedDelivery {"));
    let home = "crates/cluster-sharding/src/runtime/persisted.rs";
    assert!(file_violations(home, &wiring).is_empty());
    let elsewhere = "crates/cluster-sharding/src/runtime/persisted/direct.rs";
    assert_eq!(file_violations(elsewhere, &wiring).len(), 1);
    let trait_impl = "//! Doc.\nimpl Drop for PersistedDelivery {}\n";
    assert!(file_violations(elsewhere, trait_impl).is_empty());
    let never = format!("//! Doc.\n{} {{}}\n", concat!("enum ", "Never"));
    assert_eq!(file_violations("crates/x/examples/a.rs", &never).len(), 1);
}

#[test]
fn citations_name_only_what_a_clone_can_follow() {
    let exists = |cited: &str| cited == "docs/concepts.md";
    let check = |path: &str, text: &str| citation_violations(path, text, &exists);
    // The reference's own sources, repository paths that exist, and code are fine.
    assert!(check("a.rs", "//! As `effect/src/cluster/Sharding.ts` does.\n").is_empty());
    assert!(check("a.rs", "//! See docs/concepts.md.\n").is_empty());
    assert!(check("a.rs", "let s = \"docs/gone.md\"; // a string, not a comment\n").is_empty());
    assert!(check("a.md", "Served at https://example.com/a/b.md.\n").is_empty());
    // Outside documents and their numbered parts.
    let design = format!("//! As {} says.\n", concat!("DESIGN", ".md"));
    assert_eq!(check("a.rs", &design).len(), 1);
    let section = format!("/// The claim (reference {}5.3).\n", "§");
    assert_eq!(check("a.rs", &section).len(), 1);
    let seed = format!("Since {} 000.\n", "Seed");
    assert_eq!(check("a.md", &seed).len(), 1);
    let invariant = format!("// Kept ({} 41).\n", "invariant");
    assert_eq!(check("a.rs", &invariant).len(), 1);
    let style = format!("# See {}.\n", concat!("docs/", "style.md"));
    assert_eq!(check("clippy.toml", &style).len(), 2);
    // A path that does not exist, in a comment or in Markdown.
    let gone = check("a.rs", "/// Read `docs/gone.md`.\n");
    assert_eq!(gone, ["a.rs:1: cites `docs/gone.md`, which does not exist"]);
    assert_eq!(check("a.md", "See [the guide](docs/gone.md#top).\n").len(), 1);
}

/// The modules `(path, text)` as a crate's module set.
fn modules(files: &[(&str, &str)]) -> circles::Modules {
    files.iter().map(|(path, text)| ((*path).to_owned(), (*text).to_owned())).collect()
}

#[test]
fn a_circle_through_use_items_and_inline_paths_is_found() {
    let crate_modules = modules(&[
        ("", "mod a;\nmod b;\nmod c;\nmod d;\npub use d::Face;\n"),
        ("a", "use crate::b::{Bee, inner::{X as Y}};\n"),
        ("b", "fn f() { crate::c::call(); }\n"),
        ("c", "use crate::Face; // crate::a::Ignored in a comment\n"),
        ("d", "use super::a;\n"),
    ]);
    let edges = circles::edges(&crate_modules);
    assert_eq!(edges["a"], BTreeSet::from(["b".to_owned()]));
    assert_eq!(edges["c"], BTreeSet::from(["d".to_owned()]), "a root re-export names its module");
    assert_eq!(
        circles::circles(&edges),
        [vec!["a".to_owned(), "b".to_owned(), "c".to_owned(), "d".to_owned()]]
    );
}

#[test]
fn tests_and_other_crates_do_not_make_circles() {
    let crate_modules = modules(&[
        ("a", "use other_crate::b::Thing;\nuse child::Item;\n"),
        ("a::child", "use super::Parent;\n"),
        (
            "b",
            "use crate::a::Thing;\n#[cfg(test)]\nmod tests { use crate::b::Own; use crate::a::X; }\n",
        ),
    ]);
    let edges = circles::edges(&crate_modules);
    assert_eq!(edges["b"], BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        circles::circles(&edges),
        [vec!["a".to_owned(), "a::child".to_owned()]],
        "a parent and its child import each other; nothing else does"
    );
}

#[test]
fn code_after_a_test_module_declaration_still_counts() {
    let crate_modules = modules(&[
        ("a", "#[cfg(test)]\nmod tests;\n\nuse crate::b::Thing;\n"),
        ("b", "#[cfg(test)]\nfn helper() { crate::a::X; }\nuse crate::a::Other;\n"),
    ]);
    let edges = circles::edges(&crate_modules);
    assert_eq!(edges["a"], BTreeSet::from(["b".to_owned()]));
    assert_eq!(edges["b"], BTreeSet::from(["a".to_owned()]), "only the test function is left out");
}

#[test]
fn a_component_that_names_the_handle_or_persisted_delivery_backwards_is_reported() {
    let crate_modules = modules(&[
        ("", "mod sharding;\npub use sharding::Sharding;\n"),
        ("sharding", "use crate::runtime::manager::Manager;\n"),
        ("runtime::manager", "use crate::Sharding;\nuse crate::runtime::persisted::Stored;\n"),
        ("runtime::persisted", "use crate::runtime::manager::Manager;\n"),
        ("runtime::persisted::direct", "use super::Stored;\n"),
        ("api::client", "use crate::sharding::Sharding;\n"),
    ]);
    let edges = circles::edges(&crate_modules);
    let found = layers::violations_in("cluster-sharding", &edges, &layers::rules());
    assert_eq!(
        found,
        [
            "cluster-sharding: `runtime::manager` imports `sharding` (a component does not name \
             the handle)",
            "cluster-sharding: `runtime::manager` imports `runtime::persisted` (the persisted \
             path reads one way)",
        ],
        "the client may name the handle, and persisted delivery may name the manager"
    );
    assert!(layers::violations_in("other-crate", &edges, &layers::rules()).is_empty());
}

#[test]
fn commit_subjects_over_72_characters_are_named() {
    let ok = "a".repeat(72);
    let long = "b".repeat(73);
    let accented = "é".repeat(72);
    let log = format!("1111111 {ok}\n2222222 {long}\n3333333 {accented}\n4444444\n");
    let violations = commits::subject_violations(&log);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].starts_with("commit 2222222: its subject has 73 characters"));
}
