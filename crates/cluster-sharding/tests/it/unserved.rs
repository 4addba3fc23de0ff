//! A persisted call whose shard no runner holds: its caller warns while it waits, naming the
//! entity, the shard and what to do, and the call ends once a runner takes the shard.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::{RunnerAddress, ShardingConfig, SystemClock};
use cluster_sharding::Sharding;
use cluster_testkit::logs::Warnings;
use cluster_testkit::memory::{MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage};

use crate::entities::{Counter, Persist};

fn config(runner_address: Option<RunnerAddress>) -> ShardingConfig {
    ShardingConfig {
        runner_address,
        shards_per_group: 4,
        refresh_assignments_interval: Duration::from_millis(20),
        shard_lock_refresh_interval: Duration::from_millis(500),
        entity_message_poll_interval: Duration::from_millis(50),
        entity_reply_poll_interval: Duration::from_millis(20),
        ..ShardingConfig::default()
    }
}

/// A client-only process with no runner: its persisted call warns while it waits, then ends
/// once a runner starts and takes the shard.
#[tokio::test]
async fn a_persisted_call_that_no_runner_serves_warns_while_it_waits() {
    let warnings = Warnings::default();
    let _guard = tracing::dispatcher::set_default(&tracing::Dispatch::new(warnings.clone()));
    let clock = Arc::new(SystemClock);
    let messages = Arc::new(MemoryMessageStorage::new(clock.clone()));
    let registry = MemoryRunnerDatabase::new(clock);
    let expiration = Duration::from_secs(5);
    let client = Sharding::cluster_client(
        config(None),
        messages.clone(),
        Arc::new(MemoryRunnerStorage::new(Arc::clone(&registry), expiration)),
    )
    .start()
    .await
    .unwrap();
    let counter = client.client::<Counter>("nobody-serves-me");
    let mut call = std::pin::pin!(counter.send(Persist));
    let named = |line: &String| {
        line.contains("no runner holds the shard")
            && line.contains("entity_type=Counter")
            && line.contains("entity_id=nobody-serves-me")
            && line.contains(&format!("shard={}", counter.address().shard_id))
            && line.contains("timeout")
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !warnings.logged().iter().any(named) {
        assert!(tokio::time::Instant::now() < deadline, "no warning: {:?}", warnings.logged());
        tokio::select! {
            ended = &mut call => panic!("the call ended without a runner: {ended:?}"),
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
    // A runner comes: it takes the shard, and the call gets its reply.
    let runner = Sharding::member(
        config(Some(RunnerAddress::new("127.0.0.1", 1))),
        messages,
        Arc::new(MemoryRunnerStorage::new(registry, expiration)),
    )
    .start()
    .await
    .unwrap();
    runner.entity::<Counter>().register().unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(20), call).await;
    answered.expect("answered once a runner holds the shard").unwrap();
    client.shutdown().await;
    runner.shutdown().await;
}
