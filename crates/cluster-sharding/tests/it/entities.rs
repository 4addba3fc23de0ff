//! The test entity and its requests (the volatile part of the reference's `TestEntity`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cluster_core::transaction::TransactionError;
use cluster_sharding::{
    CallError, Chunks, Entity, EntityClient, EntityContext, Handler, Protocol, RequestContext, Rpc,
    StreamHandler, StreamRpc, Uninterruptible,
};
use cluster_storage_sql::sqlite::SqliteTransactionGuard;
use serde::{Deserialize, Serialize};

/// Counters the tests read to observe handlers, one set per entity id (tests run in parallel
/// in one process and use distinct ids).
pub(crate) struct Probes {
    pub(crate) created: AtomicUsize,
    pub(crate) stuck: AtomicUsize,
    pub(crate) probing: AtomicUsize,
    pub(crate) interrupted: AtomicUsize,
    pub(crate) panic_once: AtomicBool,
    pub(crate) deposits: AtomicUsize,
    /// A resumable stream hangs before sending this item (`u64::MAX`: never).
    pub(crate) hang_at: std::sync::atomic::AtomicU64,
    /// The ids of the `Hang` requests this entity ran.
    pub(crate) hung: Mutex<Vec<cluster_core::Snowflake>>,
    /// `Gated` runs started, and the permits they wait for.
    pub(crate) gated_runs: AtomicUsize,
    pub(crate) gate: tokio::sync::Semaphore,
    /// `Book` handler runs.
    pub(crate) booked: AtomicUsize,
    /// The keys of the `Deposit` runs, in the order they ran.
    pub(crate) deposit_keys: Mutex<Vec<String>>,
}

impl Default for Probes {
    fn default() -> Probes {
        Probes {
            created: AtomicUsize::new(0),
            stuck: AtomicUsize::new(0),
            probing: AtomicUsize::new(0),
            interrupted: AtomicUsize::new(0),
            panic_once: AtomicBool::new(false),
            deposits: AtomicUsize::new(0),
            hang_at: std::sync::atomic::AtomicU64::new(u64::MAX),
            hung: Mutex::default(),
            gated_runs: AtomicUsize::new(0),
            gate: tokio::sync::Semaphore::new(0),
            booked: AtomicUsize::new(0),
            deposit_keys: Mutex::default(),
        }
    }
}

impl Probes {
    pub(crate) fn of(entity_id: &str) -> Arc<Probes> {
        static PROBES: OnceLock<Mutex<BTreeMap<String, Arc<Probes>>>> = OnceLock::new();
        let probes = PROBES.get_or_init(Mutex::default);
        let mut probes = probes.lock().unwrap();
        Arc::clone(probes.entry(entity_id.to_owned()).or_default())
    }
}

/// Sends `request` on a task of its own, so that a test can abort the call (which interrupts
/// the request) or watch it while it waits.
pub(crate) fn spawn_send<R: Rpc>(
    client: &EntityClient<Counter>,
    request: R,
) -> tokio::task::JoinHandle<Result<R::Success, CallError<R::Error>>>
where
    Counter: Handler<R>,
{
    let client = client.clone();
    tokio::spawn(async move { client.send(request).await })
}

pub(crate) struct Counter {
    value: u64,
    probes: Arc<Probes>,
}

impl Entity for Counter {
    const TYPE: &'static str = "Counter";

    async fn create(context: &EntityContext) -> Counter {
        let probes = Probes::of(context.address().entity_id.as_str());
        probes.created.fetch_add(1, Ordering::SeqCst);
        Counter { value: 0, probes }
    }

    fn protocol(protocol: &mut Protocol<Counter>) {
        protocol
            .handle::<Increment>()
            .handle::<Get>()
            .handle::<CallerId>()
            .handle::<Gated>()
            .handle::<StoredCallerId>()
            .handle::<Sleep>()
            .handle::<Fail>()
            .handle::<Stuck>()
            .handle::<Probe>()
            .handle::<Persist>()
            .handle::<Deposit>()
            .handle::<Hang>()
            .handle::<Impatient>()
            .stream::<Count>()
            .stream::<Resume>()
            .handle::<Book>()
            .handle::<Stubborn>()
            .handle::<SetKeepAlive>()
            .handle::<Later>()
            .handle::<Oversize>();
    }
}

/// The error of [`Fail`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Failure {
    pub(crate) reason: String,
}

macro_rules! rpc {
    ($name:ident, $tag:literal, $success:ty, $error:ty $(, $persisted:literal)?) => {
        impl Rpc for $name {
            const TAG: &'static str = $tag;
            $(const PERSISTED: bool = $persisted;)?
            type Success = $success;
            type Error = $error;
        }
    };
}

#[derive(Serialize, Deserialize)]
pub(crate) struct Increment {
    pub(crate) by: u64,
}
rpc!(Increment, "Increment", u64, Failure);

#[derive(Serialize, Deserialize)]
pub(crate) struct Get;
rpc!(Get, "Get", u64, Failure);

/// Sleeps, then adds `by`.
#[derive(Serialize, Deserialize)]
pub(crate) struct Sleep {
    pub(crate) millis: u64,
    pub(crate) by: u64,
}
rpc!(Sleep, "Sleep", u64, Failure);

#[derive(Serialize, Deserialize)]
pub(crate) struct Fail {
    pub(crate) reason: String,
}
rpc!(Fail, "Fail", (), Failure);

/// Never finishes.
#[derive(Serialize, Deserialize)]
pub(crate) struct Stuck;
rpc!(Stuck, "Stuck", (), Failure);

/// Never finishes, and counts its interruption.
#[derive(Serialize, Deserialize)]
pub(crate) struct Probe;
rpc!(Probe, "Probe", (), Failure);

/// A persisted request.
#[derive(Serialize, Deserialize)]
pub(crate) struct Persist;
rpc!(Persist, "Persist", (), Failure, true);

/// Returns the request's `caller-id` header (volatile).
#[derive(Serialize, Deserialize)]
pub(crate) struct CallerId;
rpc!(CallerId, "CallerId", Option<String>, Failure);

/// Returns the request's `caller-id` header (persisted).
#[derive(Serialize, Deserialize)]
pub(crate) struct StoredCallerId;
rpc!(StoredCallerId, "StoredCallerId", Option<String>, Failure, true);

impl Handler<CallerId> for Counter {
    async fn handle(
        &mut self,
        context: &RequestContext,
        _: CallerId,
    ) -> Result<Option<String>, Failure> {
        Ok(context.headers().remove("caller-id"))
    }
}

impl Handler<StoredCallerId> for Counter {
    async fn handle(
        &mut self,
        context: &RequestContext,
        _: StoredCallerId,
    ) -> Result<Option<String>, Failure> {
        Ok(context.headers().remove("caller-id"))
    }
}

impl Handler<Increment> for Counter {
    async fn handle(&mut self, _: &RequestContext, request: Increment) -> Result<u64, Failure> {
        if self.probes.panic_once.swap(false, Ordering::SeqCst) {
            panic!("a defect in the handler");
        }
        self.value += request.by;
        Ok(self.value)
    }
}

impl Handler<Get> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Get) -> Result<u64, Failure> {
        Ok(self.value)
    }
}

impl Handler<Sleep> for Counter {
    async fn handle(&mut self, _: &RequestContext, request: Sleep) -> Result<u64, Failure> {
        tokio::time::sleep(Duration::from_millis(request.millis)).await;
        self.value += request.by;
        Ok(self.value)
    }
}

impl Handler<Fail> for Counter {
    async fn handle(&mut self, _: &RequestContext, request: Fail) -> Result<(), Failure> {
        Err(Failure { reason: request.reason })
    }
}

impl Handler<Stuck> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Stuck) -> Result<(), Failure> {
        self.probes.stuck.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

/// Records the interruption when the handler's future is dropped.
struct OnDrop(Arc<Probes>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.interrupted.fetch_add(1, Ordering::SeqCst);
    }
}

impl Handler<Probe> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Probe) -> Result<(), Failure> {
        let _guard = OnDrop(Arc::clone(&self.probes));
        self.probes.probing.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

impl Handler<Persist> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Persist) -> Result<(), Failure> {
        Ok(())
    }
}

/// A persisted request with a primary key whose reply is `bytes` long; counts its runs.
#[derive(Serialize, Deserialize)]
pub(crate) struct Oversize {
    pub(crate) key: String,
    pub(crate) bytes: usize,
}

impl Rpc for Oversize {
    const TAG: &'static str = "Oversize";
    const PERSISTED: bool = true;
    type Success = String;
    type Error = Failure;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// How often [`Oversize`] ran, in this test process.
pub(crate) static OVERSIZE_RUNS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

impl Handler<Oversize> for Counter {
    async fn handle(&mut self, _: &RequestContext, request: Oversize) -> Result<String, Failure> {
        OVERSIZE_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok("x".repeat(request.bytes))
    }
}

/// A persisted request with a primary key: adds `amount` once per key.
#[derive(Serialize, Deserialize)]
pub(crate) struct Deposit {
    pub(crate) key: String,
    pub(crate) amount: u64,
}

impl Rpc for Deposit {
    const TAG: &'static str = "Deposit";
    const PERSISTED: bool = true;
    type Success = u64;
    type Error = Failure;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// A persisted request that never finishes, and counts its runs and interruptions.
#[derive(Serialize, Deserialize)]
pub(crate) struct Hang;
rpc!(Hang, "Hang", (), Failure, true);

impl Handler<Deposit> for Counter {
    async fn handle(&mut self, _: &RequestContext, request: Deposit) -> Result<u64, Failure> {
        self.probes.deposits.fetch_add(1, Ordering::SeqCst);
        self.probes.deposit_keys.lock().unwrap().push(request.key.clone());
        self.value += request.amount;
        Ok(self.value)
    }
}

impl Handler<Hang> for Counter {
    async fn handle(&mut self, context: &RequestContext, _: Hang) -> Result<(), Failure> {
        self.probes.hung.lock().unwrap().push(context.request_id());
        let _guard = OnDrop(Arc::clone(&self.probes));
        self.probes.probing.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

/// A persisted request (one per entity: its primary key is `gate`) that waits for a permit of
/// its entity's gate, then answers with the number of runs so far.
#[derive(Serialize, Deserialize)]
pub(crate) struct Gated;

impl Rpc for Gated {
    const TAG: &'static str = "Gated";
    const PERSISTED: bool = true;
    type Success = usize;
    type Error = Failure;

    fn primary_key(&self) -> Option<String> {
        Some("gate".to_owned())
    }
}

impl Handler<Gated> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Gated) -> Result<usize, Failure> {
        let runs = self.probes.gated_runs.fetch_add(1, Ordering::SeqCst) + 1;
        let permit = self.probes.gate.acquire().await;
        permit.map_err(|_| Failure { reason: "gate closed".to_owned() })?.forget();
        Ok(runs)
    }
}

/// A volatile request that never finishes and is interrupted as soon as the runner stops.
#[derive(Serialize, Deserialize)]
pub(crate) struct Impatient;

impl Rpc for Impatient {
    const TAG: &'static str = "Impatient";
    const INTERRUPT_ON_TERMINATION: bool = true;
    type Success = ();
    type Error = Failure;
}

impl Handler<Impatient> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Impatient) -> Result<(), Failure> {
        self.probes.probing.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

/// Streams `0..n`, failing after `fail_after` items if set.
#[derive(Serialize, Deserialize)]
pub(crate) struct Count {
    pub(crate) n: u64,
    pub(crate) fail_after: Option<u64>,
}

impl StreamRpc for Count {
    const TAG: &'static str = "Count";
    type Item = u64;
    type Error = Failure;
}

impl StreamHandler<Count> for Counter {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Count,
        chunks: &mut Chunks<'_, u64>,
    ) -> Result<(), Failure> {
        let _guard = OnDrop(Arc::clone(&self.probes));
        assert_eq!((chunks.next_sequence(), chunks.last_sent()), (0, None));
        for item in 0..request.n {
            if request.fail_after == Some(item) {
                return Err(Failure { reason: format!("stopped at {item}") });
            }
            chunks.send(item).await.map_err(|error| Failure { reason: error.to_string() })?;
            self.probes.probing.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// A persisted stream of `0..n` that resumes after its last sent item.
#[derive(Serialize, Deserialize)]
pub(crate) struct Resume {
    pub(crate) key: String,
    pub(crate) n: u64,
}

impl StreamRpc for Resume {
    const TAG: &'static str = "Resume";
    const PERSISTED: bool = true;
    type Item = u64;
    type Error = Failure;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl StreamHandler<Resume> for Counter {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Resume,
        chunks: &mut Chunks<'_, u64>,
    ) -> Result<(), Failure> {
        let start = chunks.last_sent().map_or(0, |last: u64| last + 1);
        assert_eq!(chunks.next_sequence() == 0, start == 0, "a fresh stream has sent nothing");
        for item in start..request.n {
            if self.probes.hang_at.load(Ordering::SeqCst) == item {
                std::future::pending::<()>().await;
            }
            chunks.send(item).await.map_err(|error| Failure { reason: error.to_string() })?;
            // One item per chunk: the resumption test stops between two of them.
            chunks.flush().await.map_err(|error| Failure { reason: error.to_string() })?;
        }
        Ok(())
    }
}

/// A persisted request whose handler writes a ledger row in the request's storage transaction,
/// and fails afterwards when `fail` is set.
#[derive(Serialize, Deserialize)]
pub(crate) struct Book {
    pub(crate) key: String,
    pub(crate) fail: bool,
}

impl Rpc for Book {
    const TAG: &'static str = "Book";
    const PERSISTED: bool = true;
    const WITH_TRANSACTION: bool = true;
    type Success = u64;
    type Error = Failure;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl Handler<Book> for Counter {
    async fn handle(&mut self, context: &RequestContext, request: Book) -> Result<u64, Failure> {
        self.probes.booked.fetch_add(1, Ordering::SeqCst);
        let failure = |reason: &str| Failure { reason: reason.to_owned() };
        match SqliteTransactionGuard::of(context).await {
            Ok(sqlite) => {
                let key = request.key.clone();
                sqlite
                    .run(move |connection| {
                        connection
                            .execute("CREATE TABLE IF NOT EXISTS ledger (key TEXT NOT NULL)", [])?;
                        connection.execute("INSERT INTO ledger (key) VALUES (?1)", [key])
                    })
                    .await
                    .map_err(|error| failure(&error.to_string()))?;
            }
            // Other backends (memory, PostgreSQL, MySQL): the ledger is SQLite's only.
            Err(TransactionError::WrongBackend { .. }) => {}
            Err(error) => return Err(failure(&error.to_string())),
        }
        if request.fail {
            return Err(failure("failed after writing"));
        }
        self.value += 1;
        Ok(self.value)
    }
}

/// A persisted, server-side uninterruptible request (one per entity, by primary key): its
/// first run hangs until interrupted, a later run answers with its run number.
#[derive(Serialize, Deserialize)]
pub(crate) struct Stubborn;

impl Rpc for Stubborn {
    const TAG: &'static str = "Stubborn";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Server;
    type Success = usize;
    type Error = Failure;

    fn primary_key(&self) -> Option<String> {
        Some("stubborn".to_owned())
    }
}

impl Handler<Stubborn> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Stubborn) -> Result<usize, Failure> {
        let run = self.probes.probing.fetch_add(1, Ordering::SeqCst) + 1;
        if run == 1 {
            let _guard = OnDrop(Arc::clone(&self.probes));
            std::future::pending::<()>().await;
        }
        Ok(run)
    }
}

/// Switches the entity's keep-alive.
#[derive(Serialize, Deserialize)]
pub(crate) struct SetKeepAlive {
    pub(crate) enabled: bool,
}
rpc!(SetKeepAlive, "SetKeepAlive", (), Failure);

impl Handler<SetKeepAlive> for Counter {
    async fn handle(
        &mut self,
        context: &RequestContext,
        request: SetKeepAlive,
    ) -> Result<(), Failure> {
        context
            .keep_alive(request.enabled)
            .await
            .map_err(|error| Failure { reason: error.to_string() })
    }
}

/// A persisted request not to be delivered before `at` (Unix milliseconds).
#[derive(Serialize, Deserialize)]
pub(crate) struct Later {
    pub(crate) at: i64,
}

impl Rpc for Later {
    const TAG: &'static str = "Later";
    const PERSISTED: bool = true;
    type Success = ();
    type Error = Failure;

    fn deliver_at(&self) -> Option<cluster_core::Timestamp> {
        Some(cluster_core::Timestamp::from_unix_millis(self.at))
    }
}

impl Handler<Later> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Later) -> Result<(), Failure> {
        self.probes.probing.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
