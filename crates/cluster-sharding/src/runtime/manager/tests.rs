//! The manager's admission of requests by id (`AlreadyProcessingMessage`,
//! `effect/src/cluster/internal/entityManager.ts`), its restart backoff, and the quiet period
//! of its scans for idle instances.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{Exit, RawJson};
use cluster_core::{ClusterError, EntityType, ShardingConfig};
use serde::{Deserialize, Serialize};

use crate::{Entity, EntityContext, Handler, Protocol, RequestContext, Rpc, Sharding};

struct Gate {
    open: Arc<tokio::sync::Notify>,
}

impl Entity for Gate {
    const TYPE: &'static str = "Gate";

    async fn create(_: &EntityContext) -> Gate {
        Gate { open: Arc::clone(opener()) }
    }

    fn protocol(protocol: &mut Protocol<Gate>) {
        protocol.handle::<Pass>();
    }
}

fn opener() -> &'static Arc<tokio::sync::Notify> {
    static OPEN: std::sync::OnceLock<Arc<tokio::sync::Notify>> = std::sync::OnceLock::new();
    OPEN.get_or_init(Arc::default)
}

/// Waits until the test opens the gate.
#[derive(Serialize, Deserialize)]
struct Pass;

impl Rpc for Pass {
    const TAG: &'static str = "Pass";
    type Success = ();
    type Error = ();
}

impl Handler<Pass> for Gate {
    async fn handle(&mut self, _: &RequestContext, _: Pass) -> Result<(), ()> {
        self.open.notified().await;
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_id_already_in_the_mailbox_is_refused_until_it_is_answered() {
    let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    sharding.entity::<Gate>().register().unwrap();
    let client = sharding.client::<Gate>("gate");
    let address = client.address().clone();
    assert_eq!(address.entity_type, EntityType::from("Gate"));
    let request = sharding.new_request(address.clone(), Pass::TAG, RawJson::encode(&Pass).unwrap());
    let first = tokio::spawn({
        let sharding = sharding.clone();
        let request = request.clone();
        async move { sharding.send_volatile(request, false).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Running: the same id is refused, typed.
    refused(&sharding, &request).await;
    // Queued behind it: refused as well; another id is admitted.
    let queued = sharding.new_request(address, Pass::TAG, RawJson::encode(&Pass).unwrap());
    sharding.notify_local(queued.clone()).await.unwrap();
    refused(&sharding, &queued).await;
    opener().notify_one();
    assert_eq!(first.await.unwrap().unwrap(), Exit::Success(RawJson::encode(&()).unwrap()));
    opener().notify_one();
    // Answered: the id is free again.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let again = tokio::spawn({
        let sharding = sharding.clone();
        async move { sharding.send_volatile(request, false).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    opener().notify_one();
    again.await.unwrap().unwrap();
}

async fn refused(sharding: &Sharding, request: &cluster_core::envelope::Request) {
    let error = sharding.notify_local(request.clone()).await.unwrap_err();
    let ClusterError::AlreadyProcessingMessage { envelope_id, address } = error else {
        panic!("expected AlreadyProcessingMessage, got {error:?}");
    };
    assert_eq!((envelope_id, &address), (request.request_id, &request.address));
}

#[test]
fn the_restart_backoff_grows_to_its_cap_and_starts_afresh_after_a_quiet_minute() {
    let mut backoff = super::RestartBackoff::default();
    let start = tokio::time::Instant::now();
    let at = |secs: u64| start + Duration::from_secs(secs);
    let delays: Vec<Duration> = (0..12).map(|n| backoff.next(at(n))).collect();
    assert_eq!(delays[0], Duration::from_millis(500));
    assert_eq!(delays[1], Duration::from_millis(750));
    assert!(delays.windows(2).all(|pair| pair[0] <= pair[1]), "{delays:?}");
    assert_eq!(delays[11], Duration::from_secs(10));
    // Restarts less than a minute apart keep the cap.
    assert_eq!(backoff.next(at(11 + 59)), Duration::from_secs(10));
    // A minute without a restart: afresh.
    assert_eq!(backoff.next(at(11 + 59 + 60)), Duration::from_millis(500));
    assert_eq!(backoff.next(at(11 + 59 + 61)), Duration::from_millis(750));
}

#[test]
fn the_active_ids_admit_out_of_order_refuse_duplicates_and_keep_their_bound() {
    use cluster_core::Snowflake;
    use cluster_core::config::Capacity;

    use super::{Active, Admission};

    let active = Active::default();
    let capacity = Capacity::bounded(3).unwrap();
    for id in [20, 10, 30] {
        assert!(matches!(active.admit(Snowflake::new(id), capacity), Admission::Admitted));
    }
    assert!(matches!(active.admit(Snowflake::new(10), capacity), Admission::Duplicate));
    assert!(matches!(active.admit(Snowflake::new(40), capacity), Admission::Full));
    active.finish(Snowflake::new(20));
    // Finishing an id that is not there changes nothing.
    active.finish(Snowflake::new(99));
    assert!(matches!(active.admit(Snowflake::new(15), capacity), Admission::Admitted));
    assert!(matches!(active.admit(Snowflake::new(15), capacity), Admission::Duplicate));
    for id in [10, 15, 30] {
        assert!(!active.is_empty());
        active.finish(Snowflake::new(id));
    }
    assert!(active.is_empty());
    // A burst past the kept room gives it back once answered.
    for id in 0..1_000 {
        assert!(matches!(
            active.admit(Snowflake::new(id), Capacity::Unbounded),
            Admission::Admitted
        ));
    }
    for id in 0..1_000 {
        active.finish(Snowflake::new(id));
    }
    assert!(super::lock(&active.ids).capacity() <= super::ACTIVE_ROOM_KEPT);
}

/// An entity type whose instances are all busy: it counts the scans for idle ones.
#[derive(Default)]
struct AllBusy {
    scans: std::sync::atomic::AtomicUsize,
}

impl super::Passivate for AllBusy {
    fn idle_instances(&self, _manager: usize, _out: &mut Vec<super::Candidate>) {
        self.scans.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    fn passivate(&self, _candidate: &super::Candidate, _residency: &super::Residency) -> bool {
        false
    }
}

#[tokio::test(start_paused = true)]
async fn a_scan_that_finds_nothing_idle_quiets_the_scans_of_the_next_newcomers() {
    use std::sync::atomic::Ordering;

    let residency = super::Residency::new(cluster_core::config::Capacity::bounded(1).unwrap());
    assert!(residency.try_reserve(), "the one slot, taken by a busy instance");
    let busy = Arc::new(AllBusy::default());
    let registered: Arc<dyn super::Passivate> = busy.clone();
    residency.register(Arc::downgrade(&registered));
    // A flood of newcomers while every instance is busy: one scan, not one per newcomer.
    for _ in 0..100 {
        assert!(!residency.make_room());
    }
    assert_eq!(busy.scans.load(Ordering::SeqCst), 1);
    tokio::time::sleep(super::QUIET_AFTER_FRUITLESS_SCAN).await;
    assert!(!residency.make_room());
    assert_eq!(busy.scans.load(Ordering::SeqCst), 2, "scans again after the quiet period");
}
