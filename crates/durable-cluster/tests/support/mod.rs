//! What the runner tests share: a runner's settings on an SQLite file of the test's own.
#![allow(dead_code, reason = "each test binary uses a part of it")]

use std::collections::BTreeMap;

use durable_cluster::{Role, RunnerEnv, RunnerError};

/// The SQLite file of the test `name`.
pub(crate) fn database(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("durable-cluster-{name}-{}.db", std::process::id()))
}

/// Removes the SQLite file of the test `name` and its journal files.
pub(crate) fn remove_database(name: &str) {
    let path = database(name);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// A runner's variables on a fresh SQLite file, advertised on loopback at a free port, with
/// `extra` (which may replace them).
pub(crate) fn env(name: &str, extra: &[(&str, &str)]) -> Result<RunnerEnv, RunnerError> {
    remove_database(name);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut vars: BTreeMap<String, String> = [
        ("CLUSTER_STORAGE_URL", format!("sqlite:{}", database(name).display())),
        ("HOST", "127.0.0.1".to_owned()),
        ("PORT", port.to_string()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    for (name, value) in extra {
        vars.insert((*name).to_owned(), (*value).to_owned());
    }
    RunnerEnv::from_lookup(Role::Runner, move |name| vars.get(name).cloned())
}
