//! `Runner`: a runner process configured from its variables, on SQLite.
#![cfg(all(feature = "rpc", feature = "sqlite"))]

use durable_cluster::{Runner, RunnerEnv, RunnerError};

mod support;

/// A runner's variables: a fresh SQLite file, the advertised address on loopback at a free port,
/// the listener on every interface at that port, and `extra`.
fn env(name: &str, extra: &[(&str, &str)]) -> RunnerEnv {
    let mut vars = vec![("LISTEN_HOST", "0.0.0.0")];
    vars.extend_from_slice(extra);
    support::env(name, &vars).unwrap()
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
        ("secret", ("CLUSTER_RPC_SECRET", "s3cret-0123456789abcdef0123456789abcdef")),
    ] {
        let runner = Runner::start(&env(name, &[extra]), |_| Ok(()))
            .await
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        runner.shutdown().await;
        support::remove_database(name);
    }
    support::remove_database("refused");
}

/// `LISTEN_HOST` alone listens on the advertised port (`PORT`), where the peers connect, as a
/// container's `PORT=5000 LISTEN_HOST=0.0.0.0` expects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_listens_on_its_advertised_port_when_only_the_listen_host_is_set() {
    let env =
        env("listen-port", &[("CLUSTER_RPC_SECRET", "s3cret-0123456789abcdef0123456789abcdef")]);
    let advertised = env.sharding.runner_address.clone().unwrap();
    assert_eq!(env.sharding.runner_listen_address.as_ref().map(|a| a.host()), Some("0.0.0.0"));
    let runner = Runner::start(&env, |_| Ok(())).await.unwrap();
    let listening = runner.listen_address();
    runner.shutdown().await;
    support::remove_database("listen-port");
    assert_eq!(listening.port(), advertised.port(), "advertised {advertised}");
}

/// The secret shows in no `Debug` output of the settings.
#[test]
fn the_settings_never_show_the_secret() {
    let env = env("debug", &[("CLUSTER_RPC_SECRET", "hunter2-value-0123456789abcdef0123456789")]);
    let shown = format!("{env:?} {env:#?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    support::remove_database("debug");
}
