//! The operations server of a `Runner` (feature `ops`), over real HTTP, on SQLite.
#![cfg(all(feature = "ops", feature = "sqlite"))]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::storage::{MessageStorage, RunnerStorage};

use cluster_testkit::databases::TestDatabase;
use durable_cluster::{Runner, RunnerEnv, RunnerError};

mod support;
use tokio::io::AsyncWriteExt;

/// A runner's variables with a secret (a listener beyond loopback would need it) and `extra`.
fn env(name: &str, extra: &[(&str, &str)]) -> Result<RunnerEnv, RunnerError> {
    let mut vars = vec![("CLUSTER_RPC_SECRET", "ops-test-0123456789abcdef0123456789abcdef")];
    vars.extend_from_slice(extra);
    support::env(&format!("ops-{name}"), &vars)
}

/// Removes the SQLite file of the test `name`.
fn remove_database(name: &str) {
    support::remove_database(&format!("ops-{name}"));
}

/// `GET path` over HTTP/1.1: the status and the body.
async fn get(address: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    support::get(address, path).await
}

/// `GET path` until `done` accepts the answer, at most 20 seconds.
async fn get_until(
    address: SocketAddr,
    path: &str,
    done: impl Fn(u16, &str) -> bool,
) -> (u16, String) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = get(address, path).await.unwrap();
        if done(status, &body) {
            return (status, body);
        }
        assert!(tokio::time::Instant::now() < deadline, "{path}: still {status} {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `/healthz`, `/readyz` and `/metrics` of a runner on `database`, an unknown path, and the
/// server gone with the runner.
async fn answers_its_probes(name: &str, database: TestDatabase) {
    let settings = env(name, &[("CLUSTER_OPS_LISTEN", "127.0.0.1:0")]).unwrap();
    let storages = database.open(&settings.sharding).await.unwrap();
    let runner = Runner::start_with(&settings, Some(storages), |_| Ok(())).await.unwrap();
    let ops = runner.ops_address().expect("an operations server");
    assert_eq!(get(ops, "/healthz").await.unwrap(), (200, "ok\n".to_owned()));
    // Ready while it takes its shards (within the bound), then holding all of them.
    let (_, ready) = get_until(ops, "/readyz", |status, body| {
        status == 200 && body.contains("\"not_acquired_shards\":0")
    })
    .await;
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(ready["registered"], true, "{ready}");
    assert!(ready["assigned_shards"].as_u64().unwrap() > 0, "{ready}");
    assert_eq!(ready["unserved_shards"], 0, "{ready}");
    let (status, metrics) =
        get_until(ops, "/metrics", |_, body| body.contains("effect_cluster_shards ")).await;
    assert_eq!(status, 200);
    assert!(metrics.contains("# TYPE effect_cluster_shards gauge"), "{metrics}");
    // Set once, while the runtime starts: the recorder was there before.
    assert!(metrics.contains("effect_cluster_runners 1"), "{metrics}");
    assert_eq!(get(ops, "/nothing-here").await.unwrap().0, 404);
    runner.shutdown().await;
    assert!(get(ops, "/healthz").await.is_err(), "the server stops with the runner");
    drop(database);
    remove_database(name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_on_sqlite_answers_its_probes_and_its_metrics_over_http() {
    answers_its_probes("probes-sqlite", TestDatabase::sqlite("ops-probes")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_on_postgres_answers_its_probes_and_its_metrics_over_http() {
    let Some(database) = TestDatabase::postgres() else { return };
    answers_its_probes("probes-postgres", database).await;
}

/// `/readyz` answers 503, naming the lock storage, while the lock storage does not answer, and
/// 200 again once it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_lock_storage() {
    let quick = [
        ("CLUSTER_OPS_LISTEN", "127.0.0.1:0"),
        ("SHARD_LOCK_REFRESH_INTERVAL", "100 millis"),
        ("SHARD_LOCK_EXPIRATION", "3 seconds"),
    ];
    let settings = env("blackhole", &quick).unwrap();
    let (messages, locks) = settings.open_storages().await.unwrap();
    let (locks, faults) = cluster_testkit::faulty::FaultyRunnerStorage::new(locks);
    let storages: (Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>) = (messages, Arc::new(locks));
    let runner = Runner::start_with(&settings, Some(storages), |_| Ok(())).await.unwrap();
    let ops = runner.ops_address().unwrap();
    get_until(ops, "/readyz", |status, body| {
        status == 200 && body.contains("\"not_acquired_shards\":0")
    })
    .await;
    faults.blackhole(true);
    let (_, body) = get_until(ops, "/readyz", |status, _| status == 503).await;
    assert!(body.contains("the shard lock storage does not answer"), "{body}");
    assert_eq!(get(ops, "/healthz").await.unwrap().0, 200, "the process still runs");
    faults.blackhole(false);
    get_until(ops, "/readyz", |status, _| status == 200).await;
    runner.shutdown().await;
    remove_database("blackhole");
}

/// An operations port in use stops the start with an error that names the variable and the
/// address; a value that is no address is a configuration error naming the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_or_wrong_operations_address_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let busy = env("busy", &[("CLUSTER_OPS_LISTEN", &address)]).unwrap();
    match Runner::start(&busy, |_| Ok(())).await {
        Err(error @ RunnerError::Ops { .. }) => {
            let shown = error.to_string();
            assert!(shown.contains("CLUSTER_OPS_LISTEN") && shown.contains(&address), "{shown}");
        }
        Err(error) => panic!("not the operations server's error: {error}"),
        Ok(runner) => {
            runner.shutdown().await;
            panic!("a runner started on an operations port in use");
        }
    }
    match env("wrong", &[("CLUSTER_OPS_LISTEN", "nine-thousand")]) {
        Err(RunnerError::Config(error)) => {
            assert_eq!((error.key(), error.value()), ("CLUSTER_OPS_LISTEN", "nine-thousand"));
        }
        other => panic!("not a configuration error: {other:?}"),
    }
    remove_database("busy");
    remove_database("wrong");
}

/// A client that keeps a request half sent does not hold the runner's shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_request_does_not_hold_the_shutdown() {
    let settings = env("slow", &[("CLUSTER_OPS_LISTEN", "127.0.0.1:0")]).unwrap();
    let runner = Runner::start(&settings, |_| Ok(())).await.unwrap();
    let ops = runner.ops_address().unwrap();
    let mut slow = tokio::net::TcpStream::connect(ops).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), runner.shutdown())
        .await
        .expect("the shutdown ends with a request still half sent");
    drop(slow);
    remove_database("slow");
}
