//! `Sharding::readiness` of a single runner, a client and a cluster member: what a readiness
//! probe reads.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::{RunnerAddress, ShardingConfig, SystemClock};
use cluster_sharding::Sharding;
use cluster_testkit::memory::{MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage};

#[tokio::test]
async fn a_single_runner_is_ready_with_every_shard_and_a_client_holds_none() {
    let config = ShardingConfig { shards_per_group: 4, ..ShardingConfig::default() };
    let runner = Sharding::volatile(config.clone()).start().await.unwrap();
    let ready = runner.readiness();
    assert!(ready.runner && ready.registered && ready.lock_storage_healthy, "{ready:?}");
    assert_eq!((ready.assigned, ready.not_acquired), (4, 0));
    runner.shutdown().await;
    let client = Sharding::volatile(ShardingConfig { runner_address: None, ..config })
        .start()
        .await
        .unwrap();
    let ready = client.readiness();
    assert!(!ready.runner && !ready.registered && ready.lock_storage_healthy, "{ready:?}");
    assert_eq!((ready.assigned, ready.not_acquired), (0, 0));
    client.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_member_is_registered_and_takes_its_assigned_shards() {
    let clock = Arc::new(SystemClock);
    let messages = Arc::new(MemoryMessageStorage::new(clock.clone()));
    let locks = Arc::new(MemoryRunnerStorage::new(
        MemoryRunnerDatabase::new(clock),
        Duration::from_secs(5),
    ));
    let config = ShardingConfig {
        runner_address: Some(RunnerAddress::new("127.0.0.1", 1)),
        shards_per_group: 6,
        refresh_assignments_interval: Duration::from_millis(50),
        ..ShardingConfig::default()
    };
    let member = Sharding::member(config, messages, locks).start().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ready = member.readiness();
        if ready.registered && ready.assigned == 6 && ready.not_acquired == 0 {
            assert!(ready.runner && ready.lock_storage_healthy, "{ready:?}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not ready: {ready:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    member.shutdown().await;
}
