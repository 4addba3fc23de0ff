//! A runner-health check of the application's (`ShardingBuilder::runner_health`, the reference's
//! `RunnerHealth` service of `effect/src/cluster/RunnerHealth.ts`): the runner-health singleton
//! asks it instead of pinging, with or without a transport.

use cluster_sharding::Plumbing;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::future::BoxFuture;
use cluster_core::{RunnerAddress, ShardingConfig};
use cluster_sharding::{RunnerHealth, Sharding};
use cluster_testkit::transport::MemoryNetwork;

use super::{Net, config, eventually, registry_health, split};
use crate::entities::Counter;

/// A check whose verdicts the test sets: every runner is alive unless marked dead. It counts
/// the questions about each runner.
#[derive(Default)]
struct Verdicts {
    dead: Mutex<BTreeSet<RunnerAddress>>,
    asked: Mutex<BTreeMap<RunnerAddress, u32>>,
}

impl Verdicts {
    fn set_dead(&self, address: &RunnerAddress, dead: bool) {
        let mut set = self.dead.lock().unwrap();
        if dead {
            set.insert(address.clone());
        } else {
            set.remove(address);
        }
    }

    fn asked_about(&self, address: &RunnerAddress) -> u32 {
        self.asked.lock().unwrap().get(address).copied().unwrap_or(0)
    }
}

impl RunnerHealth for Verdicts {
    fn is_alive<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            *self.asked.lock().unwrap().entry(address.clone()).or_default() += 1;
            !self.dead.lock().unwrap().contains(address)
        })
    }
}

/// A runner at `port` whose runner-health singleton asks `health` every 100 ms; on `network`
/// (attached) when given, without a transport otherwise.
async fn runner(
    net: &Net,
    port: u16,
    health: &Arc<Verdicts>,
    network: Option<&Arc<MemoryNetwork>>,
) -> Sharding {
    let (messages, locks) = net.storages().await;
    let address = RunnerAddress::new("127.0.0.1", port);
    let config = ShardingConfig {
        runner_health_check_interval: Duration::from_millis(100),
        shard_lock_expiration: net.expiration,
        ..config(Some(address.clone()))
    };
    let mut builder = Sharding::member(config, messages, locks)
        .runner_health(Arc::clone(health) as Arc<dyn RunnerHealth>);
    if let Some(network) = network {
        builder = builder.transport(network.transport());
    }
    let sharding = builder.start().await.unwrap();
    sharding.entity::<Counter>().register().unwrap();
    if let Some(network) = network {
        network.attach(address, sharding.runner_handler());
    }
    sharding
}

/// Waits until the registry lists the runner at `port` with health `healthy`.
async fn registry_says(net: &Net, port: u16, healthy: bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while registry_health(net, port).await != Some(healthy) {
        assert!(tokio::time::Instant::now() < deadline, "runner {port} never became {healthy}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Without a transport, a runner the check says is dead is marked unhealthy and its shards go
/// to the others; once the check says it is alive it is healthy again and gets shards back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_the_check_says_is_dead_loses_its_shards_until_it_is_alive_again() {
    let net = Net::memory().await.unwrap();
    let health = Arc::new(Verdicts::default());
    let a = runner(&net, 19_001, &health, None).await;
    let b = runner(&net, 19_002, &health, None).await;
    let c = runner(&net, 19_003, &health, None).await;
    let all = [&a, &b, &c];
    eventually("the shards are split three ways", || {
        split(&all) && all.iter().all(|runner| !runner.acquired_shards().is_empty())
    })
    .await;
    let c_address = RunnerAddress::new("127.0.0.1", 19_003);
    health.set_dead(&c_address, true);
    registry_says(&net, 19_003, false).await;
    eventually("the dead runner's shards go to the others", || {
        split(&[&a, &b]) && c.acquired_shards().is_empty()
    })
    .await;
    health.set_dead(&c_address, false);
    registry_says(&net, 19_003, true).await;
    eventually("it gets shards again", || split(&all) && !c.acquired_shards().is_empty()).await;
    for runner in all {
        runner.shutdown().await;
    }
}

/// With a transport too, the check replaces the pings: a runner the transport cannot reach
/// stays healthy while the check says it is alive, and nobody is pinged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_health_check_replaces_the_pings_of_the_transport() {
    let net = Net::memory().await.unwrap();
    let network = MemoryNetwork::new();
    let health = Arc::new(Verdicts::default());
    let a = runner(&net, 19_101, &health, Some(&network)).await;
    let b = runner(&net, 19_102, &health, Some(&network)).await;
    let all = [&a, &b];
    eventually("the shards are split two ways", || {
        split(&all) && all.iter().all(|runner| !runner.acquired_shards().is_empty())
    })
    .await;
    let b_address = RunnerAddress::new("127.0.0.1", 19_102);
    network.detach(&b_address);
    let asked = health.asked_about(&b_address) + 3;
    eventually("the check was asked about it in a few more rounds", || {
        health.asked_about(&b_address) >= asked
    })
    .await;
    assert_eq!(registry_health(&net, 19_102).await, Some(true), "still healthy");
    assert!(split(&all) && !b.acquired_shards().is_empty(), "it keeps its shards");
    assert_eq!(network.pings_to(&b_address), 0, "nobody is pinged");
    for runner in all {
        runner.shutdown().await;
    }
}
