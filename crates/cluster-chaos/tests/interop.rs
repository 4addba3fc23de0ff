//! Interoperability: persisted requests keep flowing through storage when the owner of their
//! shard speaks another protocol (here: a runner whose transport refuses our handshake, as a
//! TypeScript runner of the reference on the same tables would), while volatile requests to
//! it fail at once with `HandshakeFailed`. Neither runner marks the other unhealthy: under the default
//! `runner_health_check` (`ping-known`) a runner that never answered a ping is judged by its
//! registry heartbeat.

use std::time::Duration;

use cluster_chaos::chaos::free_port;
use cluster_chaos::ledger::{Deposit, Echo, Ledger, LedgerDependencies};
use cluster_core::ClusterError;
use cluster_sharding::{CallError, Sharding};
use cluster_testkit::wait::eventually;
use durable_cluster::{Role, Runner, RunnerEnv};

/// The shared secret of "our" runners (at least 32 bytes, as the transport requires).
const OURS: &str = "ours-0123456789abcdef0123456789abcdef";
/// The secret of the runner that stands for a peer speaking another protocol.
const THEIRS: &str = "another-protocol-0123456789abcdef0123456789";

fn env(database: &str, port: u16, secret: &str) -> RunnerEnv {
    // `INTEROP_RUNNER_HEALTH_CHECK=ping` runs the reference's check, under which the test fails.
    let mode = std::env::var("INTEROP_RUNNER_HEALTH_CHECK").unwrap_or_default();
    let vars = [
        ("CLUSTER_STORAGE_URL", format!("sqlite:{database}")),
        ("CLUSTER_RPC_SECRET", secret.to_owned()),
        ("HOST", "127.0.0.1".to_owned()),
        ("PORT", port.to_string()),
        ("SHARDS_PER_GROUP", "30".to_owned()),
        ("SHARD_LOCK_EXPIRATION", "3 seconds".to_owned()),
        ("SHARD_LOCK_REFRESH_INTERVAL", "500 millis".to_owned()),
        ("REFRESH_ASSIGNMENTS_INTERVAL", "100 millis".to_owned()),
        ("ENTITY_MESSAGE_POLL_INTERVAL", "200 millis".to_owned()),
        ("ENTITY_REPLY_POLL_INTERVAL", "100 millis".to_owned()),
        // Pings cross protocols too: each runner checks the other often during the test.
        ("RUNNER_HEALTH_CHECK_INTERVAL", "200 millis".to_owned()),
        ("RUNNER_HEALTH_CHECK", mode),
    ];
    RunnerEnv::from_lookup(Role::Runner, |name| {
        vars.iter().find(|(key, _)| *key == name).map(|(_, value)| value.clone())
    })
    .unwrap()
}

async fn start(env: &RunnerEnv) -> Runner {
    Runner::start(env, |sharding| {
        let factory = Ledger::factory(LedgerDependencies::default());
        sharding.entity().factory(factory).register()?;
        Ok(())
    })
    .await
    .unwrap()
}

/// An entity id whose shard `owner` holds.
fn id_on(owner: &Sharding) -> String {
    let held = owner.acquired_shards();
    (0..10_000)
        .map(|n| format!("interop-{n}"))
        .find(|id| {
            let group = cluster_core::ShardGroup::default_group();
            held.contains(&owner.config().shard_id(id, &group))
        })
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persisted_requests_reach_a_runner_that_refuses_our_transport() {
    let path =
        std::env::temp_dir().join(format!("cluster-chaos-interop-{}.db", std::process::id()));
    let database = path.display().to_string();
    let ours = start(&env(&database, free_port().unwrap(), OURS)).await;
    let theirs = start(&env(&database, free_port().unwrap(), THEIRS)).await;
    eventually("the runners split the shards", || {
        let (a, b) = (ours.sharding.acquired_shards(), theirs.sharding.acquired_shards());
        !a.is_empty() && !b.is_empty() && a.len() + b.len() == 30
    })
    .await;
    let id = id_on(&theirs.sharding);
    let ledger = ours.sharding.client::<Ledger>(id.as_str());
    let deposit = ledger.send(Deposit { key: "through-storage".to_owned() });
    let answer = tokio::time::timeout(Duration::from_secs(20), deposit).await;
    assert_eq!(answer.expect("answered through storage").unwrap(), 1);
    assert_eq!(theirs.sharding.active_entity_count(), 1, "handled by the shard's owner");
    assert_eq!(ours.sharding.active_entity_count(), 0);
    // A volatile request cannot cross: it fails at once, naming the handshake's cause, instead
    // of `RunnerUnavailable` after a lock expiration of retries. So it does for two lock
    // expirations, many health-check rounds, while the peer is in backoff or not.
    let window = tokio::time::Instant::now() + Duration::from_secs(6);
    let mut calls = 0;
    while calls == 0 || tokio::time::Instant::now() < window {
        let sent = tokio::time::Instant::now();
        let echo = tokio::time::timeout(Duration::from_secs(20), ledger.send(Echo { n: 7 })).await;
        match echo.expect("the volatile call ends") {
            Err(CallError::Cluster(ClusterError::HandshakeFailed { reason, .. })) => {
                assert!(reason.contains("CLUSTER_RPC_SECRET"), "{reason}");
                assert!(!reason.contains(OURS) && !reason.contains(THEIRS));
            }
            other => panic!("a volatile request crossed, or failed otherwise: {other:?}"),
        }
        assert!(sent.elapsed() < Duration::from_secs(2), "retried: {:?}", sent.elapsed());
        calls += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The runners still split the shards, and the registry holds both as healthy.
    let (a, b) = (ours.sharding.acquired_shards(), theirs.sharding.acquired_shards());
    assert!(!a.is_empty() && !b.is_empty() && a.len() + b.len() == 30, "{a:?} {b:?}");
    let (_, registry) = env(&database, 1, OURS).open_storages().await.unwrap();
    let runners = registry.get_runners().await.unwrap();
    assert_eq!(runners.len(), 2);
    assert!(runners.iter().all(|(_, healthy)| *healthy), "{runners:?}");
    ours.shutdown().await;
    theirs.shutdown().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{database}{suffix}"));
    }
}

/// A runner whose entities cannot be registered does not start, and leaves the cluster's
/// registry instead of holding shards it cannot serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_cannot_register_its_entities_leaves_the_registry() {
    let path =
        std::env::temp_dir().join(format!("cluster-chaos-refused-{}.db", std::process::id()));
    let database = path.display().to_string();
    let node = env(&database, free_port().unwrap(), OURS);
    let started = Runner::start(&node, |_| Err("no entities".into())).await;
    assert!(
        matches!(&started, Err(durable_cluster::RunnerError::Register(reason)) if reason.to_string() == "no entities"),
        "the registration error is the start error"
    );
    let (_, registry) = node.open_storages().await.unwrap();
    let address = node.sharding.runner_address.clone().unwrap();
    let runners = registry.get_runners().await.unwrap();
    assert!(
        runners.iter().all(|(runner, _)| runner.address != address),
        "the runner stayed registered: {runners:?}"
    );
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{database}{suffix}"));
    }
}
