//! `Runner`: a runner process configured from its variables, on SQLite.
#![cfg(all(feature = "rpc", feature = "sqlite"))]

use std::collections::BTreeMap;

use durable_cluster::{Role, Runner, RunnerEnv, RunnerError};

/// A runner's variables: a fresh SQLite file, the advertised address on loopback, the listener
/// on every interface, and `extra`.
fn env(name: &str, extra: &[(&str, &str)]) -> RunnerEnv {
    remove_database(name);
    let path = database(name);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut vars: BTreeMap<String, String> = [
        ("CLUSTER_STORAGE_URL", format!("sqlite:{}", path.display())),
        ("HOST", "127.0.0.1".to_owned()),
        ("PORT", port.to_string()),
        ("LISTEN_HOST", "0.0.0.0".to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    for (name, value) in extra {
        vars.insert((*name).to_owned(), (*value).to_owned());
    }
    RunnerEnv::from_lookup(Role::Runner, move |name| vars.get(name).cloned()).unwrap()
}

/// The SQLite file of the test `name`.
fn database(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("durable-cluster-{name}-{}.db", std::process::id()))
}

/// Removes the SQLite file of the test `name` and its journal files.
fn remove_database(name: &str) {
    let path = database(name);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// A runner whose transport listens beyond loopback does not start without a secret; with
/// `CLUSTER_RPC_INSECURE=true` it starts, and with a secret it starts too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_listening_beyond_loopback_needs_a_secret_or_an_explicit_opt_out() {
    let refused = Runner::start(&env("refused", &[]), |_| Ok(())).await;
    match refused {
        Err(RunnerError::Transport(error)) => {
            let shown = error.to_string();
            assert!(shown.contains("CLUSTER_RPC_SECRET"), "{shown}");
            assert!(shown.contains("0.0.0.0"), "{shown}");
        }
        Err(error) => panic!("not the transport's refusal: {error}"),
        Ok(runner) => {
            runner.shutdown().await;
            panic!("a runner without a secret started on 0.0.0.0");
        }
    }
    for (name, extra) in [
        ("insecure", ("CLUSTER_RPC_INSECURE", "true")),
        ("secret", ("CLUSTER_RPC_SECRET", "s3cret")),
    ] {
        let runner = Runner::start(&env(name, &[extra]), |_| Ok(()))
            .await
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        runner.shutdown().await;
        remove_database(name);
    }
    remove_database("refused");
}

/// The secret shows in no `Debug` output of the settings.
#[test]
fn the_settings_never_show_the_secret() {
    let env = env("debug", &[("CLUSTER_RPC_SECRET", "hunter2-value")]);
    let shown = format!("{env:?} {env:#?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    remove_database("debug");
}
