//! Entity concurrency: `&self` handlers run alongside each other up to the entity's
//! `concurrency`, `&mut self` handlers run alone, and requests start in delivery order (the
//! reference's `concurrency` option, `effect/src/cluster/internal/entityManager.ts`, and the
//! restart of effect's `Sharding.test.ts` with several requests in flight).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_core::config::Capacity;
use cluster_sharding::{
    CallError, Defects, Entity, EntityClient, EntityContext, EntityOptions, Handler, Protocol,
    RequestContext, Rpc, Sharding, SharedHandler,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::{eventually, sharding};

/// What the tests observe of one `Library` entity.
struct Log {
    created: AtomicUsize,
    running: AtomicUsize,
    max_running: AtomicUsize,
    /// Exclusive requests that saw a shared one running.
    overlaps: AtomicUsize,
    /// `start <name>` and `end <name>`, in the order they happened.
    events: Mutex<Vec<String>>,
    /// Waiting reads take a permit each.
    gate: Semaphore,
    panic_once: AtomicBool,
}

impl Default for Log {
    fn default() -> Log {
        Log {
            created: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            max_running: AtomicUsize::new(0),
            overlaps: AtomicUsize::new(0),
            events: Mutex::default(),
            gate: Semaphore::new(0),
            panic_once: AtomicBool::new(false),
        }
    }
}

impl Log {
    fn of(entity_id: &str) -> Arc<Log> {
        static LOGS: OnceLock<Mutex<BTreeMap<String, Arc<Log>>>> = OnceLock::new();
        let logs = LOGS.get_or_init(Mutex::default);
        Arc::clone(logs.lock().unwrap().entry(entity_id.to_owned()).or_default())
    }

    fn event(&self, event: String) {
        self.events.lock().unwrap().push(event);
    }

    fn events(&self) -> Vec<String> {
        self.events.lock().unwrap().clone()
    }

    fn count(&self, event: &str) -> usize {
        self.events().iter().filter(|logged| *logged == event).count()
    }

    fn position(&self, event: &str) -> usize {
        let events = self.events();
        events.iter().position(|logged| logged == event).unwrap_or_else(|| {
            panic!("{event} did not happen: {events:?}");
        })
    }
}

struct Library {
    log: Arc<Log>,
    version: u64,
}

impl Entity for Library {
    const TYPE: &'static str = "Library";

    async fn create(context: &EntityContext) -> Library {
        let log = Log::of(context.address().entity_id.as_str());
        log.created.fetch_add(1, Ordering::SeqCst);
        Library { log, version: 0 }
    }

    fn protocol(protocol: &mut Protocol<Library>) {
        protocol.handle_shared::<Read>().handle::<Write>();
    }
}

/// A shared request; `wait` holds it until the test opens the gate; `panic` panics once.
#[derive(Serialize, Deserialize)]
struct Read {
    name: String,
    wait: bool,
    panic: bool,
}

impl Rpc for Read {
    const TAG: &'static str = "Read";
    type Success = u64;
    type Error = ();
}

impl SharedHandler<Read> for Library {
    async fn handle(&self, _: &RequestContext, request: Read) -> Result<u64, ()> {
        let log = &self.log;
        log.event(format!("start {}", request.name));
        let running = log.running.fetch_add(1, Ordering::SeqCst) + 1;
        log.max_running.fetch_max(running, Ordering::SeqCst);
        let _running = Running(log);
        if request.panic && log.panic_once.swap(false, Ordering::SeqCst) {
            panic!("a defect in a shared handler");
        }
        if request.wait {
            log.gate.acquire().await.map_err(|_| ())?.forget();
        }
        log.event(format!("end {}", request.name));
        Ok(self.version)
    }
}

/// Counts a shared request as running until dropped (it may end by interrupt or panic).
struct Running<'a>(&'a Log);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An exclusive request.
#[derive(Serialize, Deserialize)]
struct Write {
    name: String,
}

impl Rpc for Write {
    const TAG: &'static str = "Write";
    type Success = u64;
    type Error = ();
}

impl Handler<Write> for Library {
    async fn handle(&mut self, _: &RequestContext, request: Write) -> Result<u64, ()> {
        self.log.event(format!("start {}", request.name));
        if self.log.running.load(Ordering::SeqCst) != 0 {
            self.log.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.version += 1;
        self.log.event(format!("end {}", request.name));
        Ok(self.version)
    }
}

async fn library(concurrency: Option<Capacity>) -> Sharding {
    library_with(concurrency, None).await
}

async fn library_with(concurrency: Option<Capacity>, defects: Option<Defects>) -> Sharding {
    let sharding = sharding(ShardingConfig::default()).await;
    sharding
        .entity::<Library>()
        .options(EntityOptions { concurrency, defects, ..EntityOptions::default() })
        .register()
        .unwrap();
    sharding
}

fn read(name: &str, wait: bool) -> Read {
    Read { name: name.to_owned(), wait, panic: false }
}

/// Sends on a task of its own, then lets the runtime deliver it (delivery order is send order).
async fn spawn<R: Rpc>(
    client: &EntityClient<Library>,
    request: R,
) -> tokio::task::JoinHandle<Result<R::Success, cluster_sharding::CallError<R::Error>>>
where
    Library: Handler<R>,
{
    let client = client.clone();
    let call = tokio::spawn(async move { client.send(request).await });
    tokio::time::sleep(Duration::from_millis(1)).await;
    call
}

/// Waits until `log` has `running` shared requests running, then checks that no more start.
async fn settles_at(log: &Log, running: usize) {
    eventually("the shared requests start", || log.running.load(Ordering::SeqCst) == running).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(log.running.load(Ordering::SeqCst), running, "{:?}", log.events());
}

#[tokio::test(start_paused = true)]
async fn shared_requests_run_together_up_to_the_concurrency_limit() {
    let sharding = library(Capacity::bounded(3)).await;
    let client = sharding.client::<Library>("three");
    let log = Log::of("three");
    let mut calls = Vec::new();
    for name in ["a", "b", "c", "d", "e"] {
        calls.push(spawn(&client, read(name, true)).await);
    }
    settles_at(&log, 3).await;
    // The first three delivered are the ones running.
    for name in ["a", "b", "c"] {
        assert_eq!(log.count(&format!("start {name}")), 1);
    }
    log.gate.add_permits(5);
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 0);
    }
    assert_eq!(log.max_running.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn shared_requests_run_one_at_a_time_by_default() {
    let sharding = library(None).await;
    let client = sharding.client::<Library>("one");
    let log = Log::of("one");
    let mut calls = Vec::new();
    for name in ["a", "b", "c"] {
        calls.push(spawn(&client, read(name, true)).await);
    }
    settles_at(&log, 1).await;
    log.gate.add_permits(3);
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert_eq!(log.max_running.load(Ordering::SeqCst), 1);
    assert_eq!(log.events(), ["start a", "end a", "start b", "end b", "start c", "end c"]);
}

#[tokio::test(start_paused = true)]
async fn unbounded_concurrency_runs_every_shared_request_at_once() {
    let sharding = library(Some(Capacity::Unbounded)).await;
    let client = sharding.client::<Library>("unbounded");
    let log = Log::of("unbounded");
    let mut calls = Vec::new();
    for index in 0..20 {
        calls.push(spawn(&client, read(&index.to_string(), true)).await);
    }
    settles_at(&log, 20).await;
    log.gate.add_permits(20);
    for call in calls {
        call.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn an_exclusive_request_runs_alone_and_requests_start_in_delivery_order() {
    let sharding = library(Some(Capacity::Unbounded)).await;
    let client = sharding.client::<Library>("ordered");
    let log = Log::of("ordered");
    let a = spawn(&client, read("a", true)).await;
    let b = spawn(&client, read("b", true)).await;
    let w = spawn(&client, Write { name: "w".to_owned() }).await;
    // Delivered after the write: it must not overtake it, though it could run beside a and b.
    let c = spawn(&client, read("c", false)).await;
    settles_at(&log, 2).await;
    assert_eq!(log.count("start w"), 0, "{:?}", log.events());
    assert_eq!(log.count("start c"), 0, "{:?}", log.events());
    log.gate.add_permits(2);
    assert_eq!(a.await.unwrap().unwrap(), 0);
    assert_eq!(b.await.unwrap().unwrap(), 0);
    assert_eq!(w.await.unwrap().unwrap(), 1);
    // The shared request sees the exclusive one's change.
    assert_eq!(c.await.unwrap().unwrap(), 1);
    assert!(log.position("start w") > log.position("end a"));
    assert!(log.position("start w") > log.position("end b"));
    assert!(log.position("start c") > log.position("end w"));
    assert_eq!(log.overlaps.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_panic_restarts_the_entity_and_replays_every_request_in_flight() {
    let sharding = library_with(Capacity::bounded(2), Some(Defects::Replay)).await;
    let client = sharding.client::<Library>("restarts");
    let log = Log::of("restarts");
    let waiting = spawn(&client, read("waiting", true)).await;
    eventually("the first request runs", || log.count("start waiting") == 1).await;
    log.panic_once.store(true, Ordering::SeqCst);
    let panicking =
        spawn(&client, Read { name: "panics".to_owned(), wait: false, panic: true }).await;
    // The restart (after its backoff) replays both: the one in flight and the one that panicked.
    eventually("both are replayed", || {
        log.count("start waiting") == 2 && log.count("start panics") == 2
    })
    .await;
    assert_eq!(log.created.load(Ordering::SeqCst), 2);
    log.gate.add_permits(1);
    assert_eq!(waiting.await.unwrap().unwrap(), 0);
    assert_eq!(panicking.await.unwrap().unwrap(), 0);
    assert_eq!(log.count("end waiting"), 1);
}

/// By default the request that panicked is answered with a defect at once, and the one in
/// flight beside it runs again on the recreated instance.
#[tokio::test(start_paused = true)]
async fn a_panic_answers_its_request_and_replays_the_others_in_flight() {
    let sharding = library(Capacity::bounded(2)).await;
    let client = sharding.client::<Library>("answers");
    let log = Log::of("answers");
    let waiting = spawn(&client, read("waiting", true)).await;
    eventually("the first request runs", || log.count("start waiting") == 1).await;
    log.panic_once.store(true, Ordering::SeqCst);
    let panicking =
        spawn(&client, Read { name: "panics".to_owned(), wait: false, panic: true }).await;
    let error = panicking.await.unwrap().unwrap_err();
    assert!(matches!(error, CallError::Defect(_)), "{error:?}");
    eventually("the one in flight is replayed", || log.count("start waiting") == 2).await;
    assert_eq!(log.count("start panics"), 1);
    log.gate.add_permits(1);
    assert_eq!(waiting.await.unwrap().unwrap(), 0);
}
