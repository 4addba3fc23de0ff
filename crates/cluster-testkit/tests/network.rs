//! The simulated transport's random faults: delays, lost calls and duplicated calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cluster_core::Snowflake;
use cluster_core::envelope::{Envelope, RawJson, Request, TraceContext};
use cluster_core::error::ClusterError;
use cluster_core::future::BoxFuture;
use cluster_core::ids::{EntityAddress, EntityId, EntityType, RunnerAddress, ShardGroup, ShardId};
use cluster_core::transport::{ReplyStream, RunnerHandler};
use cluster_testkit::transport::{MemoryNetwork, NetworkFaults};

/// Counts what reaches it; requests are refused (only their arrival matters here).
#[derive(Debug, Default)]
struct Counting {
    notified: AtomicU32,
    requested: AtomicU32,
}

impl RunnerHandler for Counting {
    fn notify(&self, _: Envelope, _: bool) -> BoxFuture<'_, Result<(), ClusterError>> {
        self.notified.fetch_add(1, Ordering::SeqCst);
        Box::pin(std::future::ready(Ok(())))
    }

    fn request(
        &self,
        request: Request,
        _: bool,
    ) -> BoxFuture<'_, Result<Box<dyn ReplyStream>, ClusterError>> {
        self.requested.fetch_add(1, Ordering::SeqCst);
        let error = ClusterError::EntityNotAssignedToRunner { address: request.address };
        Box::pin(std::future::ready(Err(error)))
    }

    fn envelope(
        &self,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>> {
        self.notify(envelope, persisted)
    }
}

fn request(id: u64) -> Request {
    Request {
        request_id: Snowflake::new(id),
        address: EntityAddress {
            shard_id: ShardId::new(ShardGroup::from("default"), 1),
            entity_type: EntityType::from("Counter"),
            entity_id: EntityId::from("c"),
        },
        tag: "Add".into(),
        payload: RawJson::null(),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    }
}

fn attached() -> (Arc<MemoryNetwork>, Arc<Counting>, RunnerAddress) {
    let network = MemoryNetwork::new();
    let handler = Arc::new(Counting::default());
    let address = RunnerAddress::new("peer", 1);
    network.attach(address.clone(), Arc::clone(&handler) as Arc<dyn RunnerHandler>);
    (network, handler, address)
}

#[tokio::test(start_paused = true)]
async fn every_call_is_lost_before_or_after_the_peer_gets_it() {
    let (network, handler, address) = attached();
    let faults = NetworkFaults { loss_per_mille: 1_000, ..NetworkFaults::default() };
    network.set_faults(faults, 7);
    let runners = network.transport();
    for id in 0..200 {
        let sent = runners.notify(&address, Envelope::Request(request(id)), false).await;
        assert!(matches!(sent, Err(ClusterError::RunnerUnavailable { .. })), "{sent:?}");
    }
    assert_eq!(network.lost(), 200);
    // About half the lost calls broke after the peer got them.
    let delivered = handler.notified.load(Ordering::SeqCst);
    assert!((60..=140).contains(&delivered), "{delivered} of 200 reached the peer");
    network.clear_faults();
    assert!(runners.notify(&address, Envelope::Request(request(999)), false).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_duplicated_call_reaches_the_peer_twice() {
    let (network, handler, address) = attached();
    let faults = NetworkFaults { duplicate_per_mille: 1_000, ..NetworkFaults::default() };
    network.set_faults(faults, 7);
    let runners = network.transport();
    runners.notify(&address, Envelope::Request(request(1)), true).await.unwrap();
    assert_eq!(handler.notified.load(Ordering::SeqCst), 2);
    let sent = runners.send(&address, request(2), false).await;
    assert!(matches!(sent, Err(ClusterError::EntityNotAssignedToRunner { .. })), "{sent:?}");
    // The second copy runs in the background.
    for _ in 0..100 {
        if handler.requested.load(Ordering::SeqCst) == 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(handler.requested.load(Ordering::SeqCst), 2);
    assert_eq!(network.duplicated(), 2);
}

#[tokio::test(start_paused = true)]
async fn calls_are_delayed_within_the_bounds_and_the_seed_decides() {
    let delays = |seed| async move {
        let (network, _, address) = attached();
        let faults = NetworkFaults {
            delay_min: Duration::from_millis(10),
            delay_max: Duration::from_millis(50),
            ..NetworkFaults::default()
        };
        network.set_faults(faults, seed);
        let runners = network.transport();
        let mut delays = Vec::new();
        for id in 0..20 {
            let start = tokio::time::Instant::now();
            runners.notify(&address, Envelope::Request(request(id)), false).await.unwrap();
            delays.push(start.elapsed());
        }
        delays
    };
    let first = delays(3).await;
    assert!(first.iter().all(|delay| (10..=50).contains(&delay.as_millis())), "{first:?}");
    assert_eq!(first, delays(3).await, "the same seed gives the same delays");
    assert_ne!(first, delays(4).await);
}
