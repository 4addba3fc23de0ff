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
}
