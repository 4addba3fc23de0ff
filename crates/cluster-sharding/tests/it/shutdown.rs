//! `Entity::on_stop` and what it can send while its runner stops (effect's `Sharding.test.ts`, in
//! their 4.1.0 form): the shutdown never waits for a runner that is going away, discards are
//! acknowledged (stored for the next owner when persisted), calls fail typed, and an abandoned
//! chunk acknowledgement is stored and ends the stream.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cluster_core::envelope::Envelope;
use cluster_core::{ClusterError, ShardingConfig, SystemClock};
use cluster_sharding::{
    CallError, Chunks, Entity, EntityClient, EntityContext, EntityOptions, Handler, Protocol,
    RequestContext, Rpc, Sharding, StreamHandler, StreamRpc,
};
use cluster_testkit::memory::MemoryMessageStorage;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::{eventually, unprocessed};

/// What a `Sender`'s `on_stop` does.
#[derive(Clone, Copy, Debug)]
enum Finale {
    /// Discards a `Ping` (persisted or not) to the receiver.
    Discard { persisted: bool },
    /// Sends a `Ping` and waits for its reply.
    Call { persisted: bool },
    /// Lets the receiver's stream send one item, then waits for the consumer started at
    /// creation.
    FinishStream,
    /// Sleeps for this long (then records `Ok`).
    Sleep(Duration),
}

/// How a call made by `on_stop` (or its stream consumer) ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Heard {
    Ok,
    NotAssigned,
    Abandoned,
    Other(String),
}

impl Heard {
    fn of<E: std::fmt::Debug>(result: Result<(), CallError<E>>) -> Heard {
        match result {
            Ok(()) => Heard::Ok,
            Err(CallError::Cluster(ClusterError::EntityNotAssignedToRunner { .. })) => {
                Heard::NotAssigned
            }
            Err(CallError::Cluster(ClusterError::Abandoned { .. })) => Heard::Abandoned,
            Err(other) => Heard::Other(format!("{other:?}")),
        }
    }
}

/// The script and the observations of one test (by sender id; tests run side by side).
#[derive(Default)]
struct Script {
    finale: Mutex<Option<Finale>>,
    heard: Mutex<Option<Heard>>,
    /// `create` and `stop` events of the sender, in order.
    events: Mutex<Vec<&'static str>>,
    /// Items the receiver's stream sends, and whether it started.
    items: Mutex<Option<mpsc::Sender<u64>>>,
    to_send: Mutex<Option<mpsc::Receiver<u64>>>,
    stream_started: AtomicBool,
    /// Items the stream consumer read.
    read: Mutex<Vec<u64>>,
}

impl Script {
    fn of(id: &str) -> Arc<Script> {
        static SCRIPTS: OnceLock<Mutex<BTreeMap<String, Arc<Script>>>> = OnceLock::new();
        let scripts = SCRIPTS.get_or_init(Mutex::default);
        Arc::clone(scripts.lock().unwrap().entry(id.to_owned()).or_default())
    }

    fn heard(&self) -> Option<Heard> {
        self.heard.lock().unwrap().clone()
    }

    fn record(&self, heard: Heard) {
        *self.heard.lock().unwrap() = Some(heard);
    }

    fn event(&self, event: &'static str) {
        self.events.lock().unwrap().push(event);
    }

    fn events(&self) -> Vec<&'static str> {
        self.events.lock().unwrap().clone()
    }
}

/// The entity whose `on_stop` sends. Its receiver has the same entity id.
struct Sender {
    script: Arc<Script>,
    receiver: EntityClient<Receiver>,
    /// This entity itself.
    me: EntityClient<Sender>,
    consumer: Option<tokio::task::JoinHandle<()>>,
}

impl Entity for Sender {
    const TYPE: &'static str = "ShutdownSender";

    async fn create(context: &EntityContext) -> Sender {
        let id = context.address().entity_id.as_str();
        let script = Script::of(id);
        script.event("create");
        let receiver = context.sharding().client::<Receiver>(id);
        let me = context.sharding().client::<Sender>(id);
        let finale = *script.finale.lock().unwrap();
        let consumer = matches!(finale, Some(Finale::FinishStream)).then(|| {
            let receiver = receiver.clone();
            let script = Arc::clone(&script);
            tokio::spawn(async move {
                let mut stream = match receiver.stream(Values).await {
                    Ok(stream) => stream,
                    Err(error) => return script.record(Heard::of(Err(error))),
                };
                while let Some(item) = stream.next().await {
                    match item {
                        Ok(item) => script.read.lock().unwrap().push(item),
                        Err(error) => return script.record(Heard::of(Err(error))),
                    }
                }
                script.record(Heard::Ok);
            })
        });
        Sender { script, receiver, me, consumer }
    }

    fn protocol(protocol: &mut Protocol<Sender>) {
        protocol.handle::<Arm>().handle::<AskMyself>().handle::<Myself>();
    }

    async fn on_stop(&mut self) {
        self.script.event("stop");
        let finale = *self.script.finale.lock().unwrap();
        let heard = match finale {
            None => return,
            Some(Finale::Discard { persisted: false }) => {
                Heard::of(self.receiver.discard(Ping).await)
            }
            Some(Finale::Discard { persisted: true }) => {
                Heard::of(self.receiver.discard(StoredPing).await)
            }
            Some(Finale::Call { persisted: false }) => Heard::of(self.receiver.send(Ping).await),
            Some(Finale::Call { persisted: true }) => {
                Heard::of(self.receiver.send(StoredPing).await)
            }
            Some(Finale::FinishStream) => {
                let items = self.script.items.lock().unwrap().clone();
                if let Some(items) = items {
                    items.send(1).await.unwrap();
                }
                if let Some(consumer) = self.consumer.take() {
                    consumer.await.unwrap();
                }
                return;
            }
            Some(Finale::Sleep(duration)) => {
                tokio::time::sleep(duration).await;
                Heard::Ok
            }
        };
        self.script.event("stopped");
        self.script.record(heard);
    }
}

/// Asks the entity itself a persisted question and waits for the answer, which can only come
/// after this request: it waits until shutdown abandons it.
#[derive(Serialize, Deserialize)]
struct AskMyself;

impl Rpc for AskMyself {
    const TAG: &'static str = "AskMyself";
    type Success = ();
    type Error = ();
}

impl Handler<AskMyself> for Sender {
    async fn handle(&mut self, _: &RequestContext, _: AskMyself) -> Result<(), ()> {
        self.script.event("asking");
        let heard = Heard::of(self.me.send(Myself).await);
        self.script.record(heard);
        Ok(())
    }
}

/// The persisted question.
#[derive(Serialize, Deserialize)]
struct Myself;

impl Rpc for Myself {
    const TAG: &'static str = "Myself";
    const PERSISTED: bool = true;
    type Success = ();
    type Error = ();
}

impl Handler<Myself> for Sender {
    async fn handle(&mut self, _: &RequestContext, _: Myself) -> Result<(), ()> {
        Ok(())
    }
}

/// Creates the sender.
#[derive(Serialize, Deserialize)]
struct Arm;

impl Rpc for Arm {
    const TAG: &'static str = "Arm";
    type Success = ();
    type Error = ();
}

impl Handler<Arm> for Sender {
    async fn handle(&mut self, _: &RequestContext, _: Arm) -> Result<(), ()> {
        Ok(())
    }
}

struct Receiver {
    script: Arc<Script>,
}

impl Entity for Receiver {
    const TYPE: &'static str = "ShutdownReceiver";

    async fn create(context: &EntityContext) -> Receiver {
        Receiver { script: Script::of(context.address().entity_id.as_str()) }
    }

    fn protocol(protocol: &mut Protocol<Receiver>) {
        protocol.handle::<Ping>().handle::<StoredPing>().stream::<Values>();
    }
}

#[derive(Serialize, Deserialize)]
struct Ping;

impl Rpc for Ping {
    const TAG: &'static str = "Ping";
    type Success = ();
    type Error = ();
}

#[derive(Serialize, Deserialize)]
struct StoredPing;

impl Rpc for StoredPing {
    const TAG: &'static str = "StoredPing";
    const PERSISTED: bool = true;
    type Success = ();
    type Error = ();
}

impl Handler<Ping> for Receiver {
    async fn handle(&mut self, _: &RequestContext, _: Ping) -> Result<(), ()> {
        Ok(())
    }
}

impl Handler<StoredPing> for Receiver {
    async fn handle(&mut self, _: &RequestContext, _: StoredPing) -> Result<(), ()> {
        Ok(())
    }
}

/// A persisted stream of the items the test lets through.
#[derive(Serialize, Deserialize)]
struct Values;

impl StreamRpc for Values {
    const TAG: &'static str = "Values";
    const PERSISTED: bool = true;
    type Item = u64;
    type Error = ();
}

impl StreamHandler<Values> for Receiver {
    async fn handle(
        &mut self,
        _: &RequestContext,
        _: Values,
        chunks: &mut Chunks<'_, u64>,
    ) -> Result<(), ()> {
        let items = self.script.to_send.lock().unwrap().take();
        let Some(mut items) = items else { return Err(()) };
        self.script.stream_started.store(true, Ordering::SeqCst);
        while let Some(item) = items.recv().await {
            chunks.send(item).await.map_err(|_| ())?;
        }
        Ok(())
    }
}

async fn runner(config: ShardingConfig) -> (Sharding, Arc<MemoryMessageStorage>) {
    let storage = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
    let sharding = Sharding::standalone(config, Arc::clone(&storage) as _).start().await.unwrap();
    sharding.entity::<Sender>().register().unwrap();
    sharding.entity::<Receiver>().register().unwrap();
    (sharding, storage)
}

/// Starts a sender scripted with `finale`, shuts the runner down and returns what its
/// `on_stop` heard and the stored messages left for the next owner.
async fn stop_with(
    id: &str,
    finale: Finale,
    config: ShardingConfig,
) -> (Heard, Vec<cluster_core::storage::UnprocessedMessage>) {
    let script = Script::of(id);
    *script.finale.lock().unwrap() = Some(finale);
    let (sharding, storage) = runner(config).await;
    if matches!(finale, Finale::FinishStream) {
        let (items, to_send) = mpsc::channel(4);
        *script.items.lock().unwrap() = Some(items);
        *script.to_send.lock().unwrap() = Some(to_send);
    }
    sharding.client::<Sender>(id).send(Arm).await.unwrap();
    if matches!(finale, Finale::FinishStream) {
        eventually("the stream starts", || script.stream_started.load(Ordering::SeqCst)).await;
    }
    tokio::time::timeout(Duration::from_secs(4), sharding.shutdown())
        .await
        .expect("the shutdown completes (no deadlock)");
    let heard = script.heard().expect("on_stop ran and recorded what it heard");
    (heard, unprocessed(&*storage).await)
}

fn stopping() -> ShardingConfig {
    ShardingConfig { entity_termination_timeout: Duration::ZERO, ..ShardingConfig::default() }
}

fn requests(left: &[cluster_core::storage::UnprocessedMessage]) -> usize {
    left.iter().filter(|message| matches!(message.envelope, Envelope::Request(_))).count()
}

/// #7–10: a volatile discard from `on_stop` is acknowledged and dropped.
#[tokio::test(start_paused = true)]
async fn a_volatile_discard_from_on_stop_is_acknowledged_during_shutdown() {
    let (heard, left) =
        stop_with("discard-volatile", Finale::Discard { persisted: false }, stopping()).await;
    assert_eq!(heard, Heard::Ok);
    assert_eq!(requests(&left), 0, "{left:?}");
}

/// #7–10: a persisted discard from `on_stop` is stored for the next owner.
#[tokio::test(start_paused = true)]
async fn a_persisted_discard_from_on_stop_is_stored_for_the_next_owner() {
    let (heard, left) =
        stop_with("discard-persisted", Finale::Discard { persisted: true }, stopping()).await;
    assert_eq!(heard, Heard::Ok);
    assert_eq!(requests(&left), 1, "{left:?}");
}

/// #11: a volatile call from `on_stop` fails typed at once.
#[tokio::test(start_paused = true)]
async fn a_volatile_call_from_on_stop_fails_with_entity_not_assigned() {
    let (heard, left) =
        stop_with("call-volatile", Finale::Call { persisted: false }, stopping()).await;
    assert_eq!(heard, Heard::NotAssigned);
    assert_eq!(requests(&left), 0, "{left:?}");
}

/// #12 (4.1.0): a persisted call from `on_stop` is stored and its caller told it was abandoned.
#[tokio::test(start_paused = true)]
async fn a_persisted_call_from_on_stop_is_stored_and_abandoned() {
    let (heard, left) =
        stop_with("call-persisted", Finale::Call { persisted: true }, stopping()).await;
    assert_eq!(heard, Heard::Abandoned);
    assert_eq!(requests(&left), 1, "{left:?}");
}

/// #13: a chunk acknowledged during shutdown is stored, and the stream ends with
/// `EntityNotAssignedToRunner` after the chunk's item.
#[tokio::test(start_paused = true)]
async fn an_acknowledgement_abandoned_during_shutdown_is_stored_and_ends_the_stream() {
    let config = ShardingConfig {
        entity_termination_timeout: Duration::from_secs(1),
        ..ShardingConfig::default()
    };
    let (heard, left) = stop_with("stream", Finale::FinishStream, config).await;
    assert_eq!(heard, Heard::NotAssigned);
    assert_eq!(*Script::of("stream").read.lock().unwrap(), [1]);
    let acks = left.iter().filter(|message| matches!(message.envelope, Envelope::AckChunk(_)));
    assert_eq!(acks.count(), 1, "{left:?}");
    assert_eq!(requests(&left), 1, "the stream is left for the next owner: {left:?}");
}

/// An `on_stop` that does not finish is dropped after `on_stop_timeout`.
#[tokio::test(start_paused = true)]
async fn on_stop_is_bounded_by_its_timeout() {
    let script = Script::of("slow-stop");
    *script.finale.lock().unwrap() = Some(Finale::Sleep(Duration::from_secs(3600)));
    let storage = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
    let sharding = Sharding::standalone(stopping(), storage as _).start().await.unwrap();
    let options =
        EntityOptions { on_stop_timeout: Some(Duration::from_secs(2)), ..EntityOptions::default() };
    sharding.entity::<Sender>().options(options).register().unwrap();
    sharding.client::<Sender>("slow-stop").send(Arm).await.unwrap();
    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(60), sharding.shutdown()).await.unwrap();
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(3), "{took:?}");
    assert_eq!(script.events(), ["create", "stop"], "dropped before it finished");
}

/// An idle instance runs `on_stop` when reaped; a request that arrives meanwhile waits for it
/// and gets a fresh instance: the id never has two live values.
#[tokio::test(start_paused = true)]
async fn a_request_during_on_stop_waits_for_it_and_gets_a_fresh_instance() {
    let script = Script::of("reaped");
    *script.finale.lock().unwrap() = Some(Finale::Sleep(Duration::from_secs(5)));
    let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    let options = EntityOptions {
        max_idle_time: Some(Some(Duration::from_secs(1))),
        ..EntityOptions::default()
    };
    sharding.entity::<Sender>().options(options).register().unwrap();
    let sender = sharding.client::<Sender>("reaped");
    sender.send(Arm).await.unwrap();
    eventually("the idle instance stops", || script.events() == ["create", "stop"]).await;
    assert_eq!(sharding.active_entity_count(), 1, "resident while on_stop runs");
    sender.send(Arm).await.unwrap();
    assert_eq!(script.events(), ["create", "stop", "stopped", "create"]);
    eventually("the fresh instance is reaped in turn", || script.events().len() == 6).await;
    assert_eq!(sharding.active_entity_count(), 0);
    sharding.shutdown().await;
}

/// Effect 4.1.0's `abandonUndelivered`: at shutdown the local callers of persisted requests that no
/// handler started are told at once that their requests are left stored, so a handler the
/// drain waits for is not stuck on one (here: on a request to its own entity, queued behind
/// it) until the termination timeout.
#[tokio::test(start_paused = true)]
async fn shutdown_abandons_the_callers_of_requests_no_handler_started() {
    let config = ShardingConfig {
        entity_termination_timeout: Duration::from_secs(60),
        ..ShardingConfig::default()
    };
    let (sharding, storage) = runner(config).await;
    let script = Script::of("asks-itself");
    let asking = tokio::spawn({
        let client = sharding.client::<Sender>("asks-itself");
        async move { client.send(AskMyself).await }
    });
    eventually("the handler waits for its own entity", || script.events().contains(&"asking"))
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = tokio::time::Instant::now();
    sharding.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(60), "the drain waited for the timeout");
    assert_eq!(script.heard(), Some(Heard::Abandoned));
    asking.await.unwrap().unwrap();
    // Its caller gone, the question still ran in the drain: nothing is lost.
    let left = unprocessed(&*storage).await;
    assert_eq!(requests(&left), 0, "{left:?}");
}

/// An entity whose `on_stop` panics before it returns its future.
struct HastyStop;

/// Answered with 1.
#[derive(Serialize, Deserialize)]
struct Touch;

impl Rpc for Touch {
    const TAG: &'static str = "Touch";
    type Success = u32;
    type Error = String;
}

impl Entity for HastyStop {
    const TYPE: &'static str = "HastyStop";

    async fn create(_: &EntityContext) -> HastyStop {
        HastyStop
    }

    fn protocol(protocol: &mut Protocol<HastyStop>) {
        protocol.handle::<Touch>();
    }

    fn on_stop(&mut self) -> impl std::future::Future<Output = ()> + Send {
        if HASTY_STOPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < u32::MAX {
            std::panic::panic_any("an on_stop that panics before returning its future");
        }
        std::future::ready(())
    }
}

static HASTY_STOPS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl Handler<Touch> for HastyStop {
    async fn handle(&mut self, _: &RequestContext, _: Touch) -> Result<u32, String> {
        Ok(1)
    }
}

/// An `on_stop` that panics before it returns its future is logged like one that panics while
/// it runs: the entity type goes on serving, and the shutdown completes.
#[tokio::test(start_paused = true)]
async fn an_on_stop_panicking_before_its_future_is_contained() {
    let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    let options = EntityOptions {
        max_idle_time: Some(Some(Duration::from_secs(1))),
        ..EntityOptions::default()
    };
    sharding.entity::<HastyStop>().options(options).register().unwrap();
    let first = sharding.client::<HastyStop>("first");
    assert_eq!(first.send(Touch).await.unwrap(), 1);
    eventually("the idle instance stopped", || {
        HASTY_STOPS.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    let again = tokio::time::timeout(Duration::from_secs(30), first.send(Touch)).await;
    assert!(matches!(again, Ok(Ok(1))), "{again:?}");
    let other = sharding.client::<HastyStop>("other");
    let other = tokio::time::timeout(Duration::from_secs(30), other.send(Touch)).await;
    assert!(matches!(other, Ok(Ok(1))), "{other:?}");
    tokio::time::timeout(Duration::from_secs(60), sharding.shutdown())
        .await
        .expect("the shutdown never ended");
}

/// The last handle dropped without `shutdown` stops the runtime's loops, as in a process that
/// exits: they let go of the storage instead of reading it forever.
#[tokio::test]
async fn the_last_handle_dropped_without_a_shutdown_stops_the_loops() {
    let storage = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
    let config = ShardingConfig::default();
    let sharding = Sharding::standalone(config, storage.clone()).start().await.unwrap();
    assert!(Arc::strong_count(&storage) > 1, "the runtime holds its storage");
    drop(sharding);
    let released = || Arc::strong_count(&storage) == 1;
    let deadline = Duration::from_secs(5);
    cluster_testkit::wait::eventually_within("the loops let go of the storage", deadline, released)
        .await;
}
