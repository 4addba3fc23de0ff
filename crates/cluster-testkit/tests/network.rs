//! The simulated transport's random faults (delays, lost calls and duplicated calls) and its
//! bounded slots.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cluster_core::Snowflake;
use cluster_core::envelope::{Envelope, RawJson, Request, TraceContext};
use cluster_core::error::ClusterError;
use cluster_core::future::BoxFuture;
use cluster_core::ids::{EntityAddress, EntityId, EntityType, RunnerAddress, ShardGroup, ShardId};
use cluster_core::transport::{ReplyStream, RunnerHandler};
use cluster_testkit::transport::{MemoryNetwork, NetworkFaults, Slots};

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

/// Answers requests of tag `Hang` never; refuses the others at once.
#[derive(Debug, Default)]
struct Hanging;

impl RunnerHandler for Hanging {
    fn notify(&self, _: Envelope, _: bool) -> BoxFuture<'_, Result<(), ClusterError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn request(
        &self,
        request: Request,
        _: bool,
    ) -> BoxFuture<'_, Result<Box<dyn ReplyStream>, ClusterError>> {
        if &*request.tag == "Hang" {
            return Box::pin(std::future::ready(Ok(Box::new(Never) as Box<dyn ReplyStream>)));
        }
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

/// A reply stream that never yields.
struct Never;

impl ReplyStream for Never {
    fn next_reply(
        &mut self,
    ) -> BoxFuture<'_, Option<Result<cluster_core::envelope::Reply, ClusterError>>> {
        Box::pin(std::future::pending())
    }
}

/// With bounded slots, as over a TCP connection, pushed persisted requests take slots of their
/// own: held pushes leave the others' slot free, and a push that finds its lane full fails at
/// once; the other calls wait for a free slot.
#[tokio::test(start_paused = true)]
async fn bounded_slots_keep_pushes_apart_and_fail_a_push_at_once_when_its_lane_is_full() {
    let network = MemoryNetwork::new();
    network.bound_slots(Slots { calls: 1, pushed: 1 });
    let address = RunnerAddress::new("peer", 1);
    network.attach(address.clone(), Arc::new(Hanging) as Arc<dyn RunnerHandler>);
    let runners = network.transport();
    let hang = |id| Request { tag: "Hang".into(), ..request(id) };
    let held = {
        let (runners, address, hang) = (Arc::clone(&runners), address.clone(), hang(1));
        tokio::spawn(async move { runners.send(&address, hang, true).await })
    };
    tokio::task::yield_now().await;
    let full = runners.send(&address, request(2), true).await;
    assert!(matches!(full, Err(ClusterError::RunnerUnavailable { .. })), "{full:?}");
    // The other calls' slot is free: a call goes through, and one held takes it.
    assert!(runners.notify(&address, Envelope::Request(request(3)), true).await.is_ok());
    let volatile = {
        let (runners, address, hang) = (Arc::clone(&runners), address.clone(), hang(4));
        tokio::spawn(async move { runners.send(&address, hang, false).await })
    };
    tokio::task::yield_now().await;
    // Now a call waits for that slot.
    let waiting = tokio::time::timeout(Duration::from_secs(1), runners.ping(&address)).await;
    assert!(waiting.is_err(), "a call went past its lane's bound");
    volatile.abort();
    let _ = volatile.await;
    assert!(runners.ping(&address).await.is_ok(), "the slot was given back");
    // Another process has slots of its own.
    let other = network.transport();
    assert!(
        other.send(&address, request(5), true).await.is_err_and(|error| {
            matches!(error, ClusterError::EntityNotAssignedToRunner { .. })
        })
    );
    held.abort();
}
