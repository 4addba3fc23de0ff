//! The probe for runners that are gone (`runner_probe_interval`): a killed runner's address
//! refuses connections, so the others mark it unhealthy and take its shards in seconds, long
//! before its locks and heartbeat expire; an unreachable runner (frozen or partitioned) keeps
//! its shards.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::{RunnerAddress, ShardingConfig};
use cluster_sharding::{Plumbing, Sharding};
use cluster_testkit::faulty::{FaultyRunnerStorage, LockFaults};
use cluster_testkit::transport::MemoryNetwork;
use cluster_testkit::wait::eventually_within;

use super::{Net, config, eventually, registry_health, split};
use crate::entities::{Counter, Deposit};

/// Locks and heartbeats that outlive the test: only the probe can move the shards in time.
const LONG_EXPIRATION: Duration = Duration::from_secs(120);

/// How long a failover may take here: a few probe rounds and registry syncs.
const FAILOVER_WITHIN: Duration = Duration::from_secs(10);

/// A runner at `port` on `network` (attached), probing every 100 ms, with the health check
/// out of the way (once a minute); its lock storage can be killed.
async fn probing_runner(
    net: &Net,
    port: u16,
    network: &Arc<MemoryNetwork>,
) -> (Sharding, Arc<LockFaults>) {
    let (messages, locks) = net.storages().await;
    let (locks, faults) = FaultyRunnerStorage::new(locks);
    let address = RunnerAddress::new("127.0.0.1", port);
    let config = ShardingConfig {
        runner_probe_interval: Duration::from_millis(100),
        runner_health_check_interval: Duration::from_secs(60),
        shard_lock_expiration: net.expiration,
        ..config(Some(address.clone()))
    };
    let sharding = Sharding::member(config, messages, Arc::new(locks))
        .transport(network.transport())
        .start()
        .await
        .unwrap();
    sharding.entity::<Counter>().register().unwrap();
    network.attach(address, sharding.runner_handler());
    (sharding, faults)
}

pub(super) async fn a_killed_runner_loses_its_shards_in_seconds_through_the_probe(mut net: Net) {
    net.expiration = LONG_EXPIRATION;
    let network = MemoryNetwork::new();
    let ports = [15_001, 15_002, 15_003];
    let mut runners = Vec::new();
    let mut killers = Vec::new();
    for port in ports {
        let (runner, faults) = probing_runner(&net, port, &network).await;
        runners.push(runner);
        killers.push(faults);
    }
    {
        let all: Vec<&Sharding> = runners.iter().collect();
        eventually("the shards are split three ways", || {
            split(&all) && all.iter().all(|runner| !runner.acquired_shards().is_empty())
        })
        .await;
    }
    let client = net.client().await;
    let id = net.id("probed");
    let counter = client.client::<Counter>(id.as_str());
    assert_eq!(counter.send(Deposit { key: "before".to_owned(), amount: 1 }).await.unwrap(), 1);
    let shard = counter.address().shard_id.clone();
    let owner =
        runners.iter().position(|runner| runner.acquired_shards().contains(&shard)).unwrap();
    let port = ports[owner];
    // The process dies: no release, no unregistration, no heartbeat; its address refuses.
    killers[owner].kill();
    network.refuse(&RunnerAddress::new("127.0.0.1", port));
    let dead = runners.remove(owner);
    dead.shutdown().await;
    drop(dead);

    let after = tokio::time::timeout(
        FAILOVER_WITHIN,
        counter.send(Deposit { key: "after".to_owned(), amount: 5 }),
    )
    .await
    .expect("answered within seconds, long before the dead runner's locks expire");
    // A new instance, with fresh state.
    assert_eq!(after.unwrap(), 5);
    assert_eq!(registry_health(&net, port).await, Some(false), "the dead runner is unhealthy");
    let alive: Vec<&Sharding> = runners.iter().collect();
    eventually_within("the survivors hold every shard", FAILOVER_WITHIN, || split(&alive)).await;
    assert!(alive.iter().all(|runner| runner.readiness().unserved == 0), "no shard left unserved");
    assert_eq!(net.final_replies(&counter, "Deposit", "before").await, 1);
    assert_eq!(net.final_replies(&counter, "Deposit", "after").await, 1);
    client.shutdown().await;
    for runner in runners {
        runner.shutdown().await;
    }
}

pub(super) async fn an_unreachable_runner_is_not_taken_for_gone_by_the_probe(mut net: Net) {
    net.expiration = LONG_EXPIRATION;
    let network = MemoryNetwork::new();
    let (a, _) = probing_runner(&net, 15_101, &network).await;
    let (b, _) = probing_runner(&net, 15_102, &network).await;
    eventually("the shards are split", || {
        split(&[&a, &b]) && !a.acquired_shards().is_empty() && !b.acquired_shards().is_empty()
    })
    .await;
    // Frozen or cut off: calls fail and probes cannot tell, but nothing refuses.
    let b_address = RunnerAddress::new("127.0.0.1", 15_102);
    network.detach(&b_address);
    let probed = network.probes_to(&b_address);
    eventually("ten more probe rounds", || network.probes_to(&b_address) >= probed + 10).await;
    assert_eq!(registry_health(&net, 15_102).await, Some(true), "marked unhealthy");
    assert!(split(&[&a, &b]) && !b.acquired_shards().is_empty(), "its shards moved");
    network.attach(b_address, b.runner_handler());
    a.shutdown().await;
    b.shutdown().await;
}
