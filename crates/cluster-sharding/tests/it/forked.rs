//! Forked handlers (the reference's `Rpc.fork`): a forked request starts when it arrives and
//! runs beside every other request of its entity, without the `concurrency` cap, while
//! `&mut self` requests still run one at a time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_sharding::{
    CallError, Entity, EntityContext, ForkedHandler, Handler, Protocol, RequestContext, Rpc,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, Semaphore};

use crate::{eventually, sharding};

/// What forked and exclusive requests of one entity share with the test.
struct Meeting {
    /// Forked requests wait here until two of them are in flight at once.
    barrier: Barrier,
    forked_in_flight: AtomicUsize,
    forked_most: AtomicUsize,
    exclusive_in_flight: AtomicUsize,
    exclusive_most: AtomicUsize,
    /// Exclusive requests wait for a permit each.
    gate: Semaphore,
}

impl Meeting {
    fn of(entity_id: &str) -> Arc<Meeting> {
        static MEETINGS: OnceLock<Mutex<BTreeMap<String, Arc<Meeting>>>> = OnceLock::new();
        let meetings = MEETINGS.get_or_init(Mutex::default);
        let mut meetings = meetings.lock().unwrap();
        Arc::clone(meetings.entry(entity_id.to_owned()).or_insert_with(|| {
            Arc::new(Meeting {
                barrier: Barrier::new(2),
                forked_in_flight: AtomicUsize::new(0),
                forked_most: AtomicUsize::new(0),
                exclusive_in_flight: AtomicUsize::new(0),
                exclusive_most: AtomicUsize::new(0),
                gate: Semaphore::new(0),
            })
        }))
    }
}

struct Room {
    meeting: Arc<Meeting>,
}

impl Entity for Room {
    const TYPE: &'static str = "Room";

    async fn create(context: &EntityContext) -> Room {
        Room { meeting: Meeting::of(context.address().entity_id.as_str()) }
    }

    fn protocol(protocol: &mut Protocol<Room>) {
        protocol.handle_forked::<Meet>().handle::<Hold>();
    }
}

/// A forked request that returns once another one meets it.
#[derive(Serialize, Deserialize)]
struct Meet;

impl Rpc for Meet {
    const TAG: &'static str = "Meet";
    type Success = usize;
    type Error = ();
}

impl ForkedHandler<Meet> for Room {
    type State = Meeting;

    fn state(&self) -> Arc<Meeting> {
        Arc::clone(&self.meeting)
    }

    async fn handle_forked(meeting: &Meeting, _: &RequestContext, _: Meet) -> Result<usize, ()> {
        let now = meeting.forked_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        meeting.forked_most.fetch_max(now, Ordering::SeqCst);
        meeting.barrier.wait().await;
        meeting.forked_in_flight.fetch_sub(1, Ordering::SeqCst);
        Ok(now)
    }
}

/// An exclusive request that holds the entity until the test lets it go.
#[derive(Serialize, Deserialize)]
struct Hold;

impl Rpc for Hold {
    const TAG: &'static str = "Hold";
    type Success = ();
    type Error = ();
}

impl Handler<Hold> for Room {
    async fn handle(&mut self, _: &RequestContext, _: Hold) -> Result<(), ()> {
        let now = self.meeting.exclusive_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.meeting.exclusive_most.fetch_max(now, Ordering::SeqCst);
        self.meeting.gate.acquire().await.map_err(drop)?.forget();
        self.meeting.exclusive_in_flight.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

fn spawn<R: Rpc>(
    client: &cluster_sharding::EntityClient<Room>,
    request: R,
) -> tokio::task::JoinHandle<Result<R::Success, CallError<R::Error>>>
where
    Room: Handler<R>,
{
    let client = client.clone();
    tokio::spawn(async move { client.send(request).await })
}

/// With a concurrency of 1 and an exclusive request holding the entity, two forked requests
/// run at once (each waits on a barrier only both together pass); the exclusive requests still
/// run one at a time.
#[tokio::test(start_paused = true)]
async fn forked_requests_run_together_beside_exclusive_ones() {
    let sharding = sharding(ShardingConfig::default()).await;
    sharding.entity::<Room>().register().unwrap();
    let room = sharding.client::<Room>("forked");
    let meeting = Meeting::of("forked");
    let first_hold = spawn(&room, Hold);
    let second_hold = spawn(&room, Hold);
    eventually("an exclusive request runs", || {
        meeting.exclusive_in_flight.load(Ordering::SeqCst) == 1
    })
    .await;
    let meets = [spawn(&room, Meet), spawn(&room, Meet)];
    for meet in meets {
        let met = tokio::time::timeout(Duration::from_secs(60), meet).await;
        met.expect("the forked requests never met").unwrap().unwrap();
    }
    assert_eq!(meeting.forked_most.load(Ordering::SeqCst), 2, "both in flight at once");
    assert_eq!(meeting.exclusive_in_flight.load(Ordering::SeqCst), 1, "the hold still runs");
    meeting.gate.add_permits(2);
    first_hold.await.unwrap().unwrap();
    second_hold.await.unwrap().unwrap();
    assert_eq!(meeting.exclusive_most.load(Ordering::SeqCst), 1, "exclusive ones serialize");
    sharding.shutdown().await;
}
