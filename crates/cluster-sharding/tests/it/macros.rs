//! Entities written with `#[entity]` on a SQLite runner: persisted requests deduplicated by
//! primary key, volatile and shared requests, a stream, the typed client, and dependencies
//! handed to instances through a registration's factory.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster_core::config::Capacity;
use cluster_core::{ShardingConfig, Timestamp};
use cluster_sharding::{
    CallError, Chunks, Entity, EntityContext, EntityOptions, Never, RequestContext, Rpc, Sharding,
    StreamRpc, Uninterruptible, entity,
};
use serde::{Deserialize, Serialize};

/// Adds `amount`; `key` makes it one deposit however often it is sent.
#[derive(Serialize, Deserialize)]
struct Deposit {
    key: String,
    amount: u64,
}

/// Takes `amount` out, unless the balance is short.
#[derive(Serialize, Deserialize)]
struct Withdraw {
    amount: u64,
}

/// Why a withdrawal failed.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Insufficient {
    balance: u64,
}

/// Streams the amounts deposited so far.
#[derive(Serialize, Deserialize)]
struct History;

/// What every account instance gets from the factory: counters and a barrier of the test.
struct Runs {
    created: AtomicU64,
    deposits: AtomicU64,
    meeting: tokio::sync::Barrier,
}

impl Runs {
    fn new() -> Arc<Runs> {
        Arc::new(Runs {
            created: AtomicU64::new(0),
            deposits: AtomicU64::new(0),
            meeting: tokio::sync::Barrier::new(2),
        })
    }
}

/// An account, with no `create`: instances come from a registration's factory only.
struct Account {
    balance: u64,
    history: Vec<u64>,
    runs: Arc<Runs>,
}

impl Account {
    fn new(runs: Arc<Runs>) -> Account {
        runs.created.fetch_add(1, Ordering::SeqCst);
        Account { balance: 0, history: Vec::new(), runs }
    }
}

#[entity(name = "MacroAccount")]
impl Account {
    /// Adds the deposit; runs once per key.
    #[rpc(persisted, primary_key = key)]
    async fn deposit(&mut self, context: &RequestContext, deposit: Deposit) -> Result<u64, Never> {
        assert_eq!(context.address().entity_type.as_str(), "MacroAccount");
        self.runs.deposits.fetch_add(1, Ordering::SeqCst);
        self.balance += deposit.amount;
        self.history.push(deposit.amount);
        Ok(self.balance)
    }

    #[rpc]
    fn withdraw(&mut self, withdraw: Withdraw) -> Result<u64, Insufficient> {
        if withdraw.amount > self.balance {
            return Err(Insufficient { balance: self.balance });
        }
        self.balance -= withdraw.amount;
        Ok(self.balance)
    }

    /// Reads the balance (volatile, shared). It takes no request: its request type, `Balance`,
    /// is generated.
    #[rpc]
    async fn balance(&self) -> Result<u64, Never> {
        Ok(self.balance)
    }

    /// Waits until `Runs::meeting` lets it through: two of them to one account end only if
    /// they run at the same time. Its request type, `Meet`, is generated too.
    #[rpc]
    async fn meet(&self, context: &RequestContext) -> Result<(), Never> {
        assert_eq!(context.address().entity_type.as_str(), "MacroAccount");
        self.runs.meeting.wait().await;
        Ok(())
    }

    #[rpc(stream)]
    async fn history(&mut self, _: History, chunks: &mut Chunks<'_, u64>) -> Result<(), Never> {
        for amount in &self.history {
            // The caller reads the whole stream: a send fails only if it went away.
            if chunks.send(*amount).await.is_err() {
                break;
            }
        }
        Ok(())
    }
}

/// A counter with its own `create`, a renamed tag and a client of another name.
struct Counter {
    value: u64,
}

/// Adds `by`.
#[derive(Serialize, Deserialize)]
struct Add {
    by: u64,
}

#[entity(client = pub(crate) Counters)]
impl Counter {
    async fn create(context: &EntityContext) -> Self {
        let start = context.address().entity_id.as_str().len();
        Counter { value: u64::try_from(start).unwrap_or(0) }
    }

    #[rpc(tag = "CounterAdd")]
    async fn add(&mut self, add: Add) -> Result<u64, Never> {
        self.value += add.by;
        Ok(self.value)
    }
}

/// Reads a note.
#[derive(Serialize, Deserialize)]
struct Read;

/// A note whose text an asynchronous factory loads from a store before its first request.
struct Note {
    text: String,
}

#[entity]
impl Note {
    #[rpc]
    async fn read(&mut self, _: Read) -> Result<String, Never> {
        Ok(self.text.clone())
    }
}

/// The store the notes load from: their texts by entity id, behind an asynchronous lock.
type Store = Arc<tokio::sync::Mutex<BTreeMap<String, String>>>;

/// A request with every flag, to check what the macro writes.
#[derive(Serialize, Deserialize)]
struct Flagged {
    id: u64,
    at_millis: Option<i64>,
    transactional: bool,
}

/// The entity handling [`Flagged`]; never registered.
struct Flags;

#[entity(crate = ::cluster_sharding, client_tracing = false)]
impl Flags {
    async fn create() -> Self {
        Flags
    }

    #[rpc(
        persisted,
        primary_key = |flagged| Some(format!("flagged-{}", flagged.id)),
        deliver_at = |flagged: &Flagged| flagged.at_millis.map(Timestamp::from_unix_millis),
        uninterruptible = "server",
        interrupt_on_termination,
        with_transaction = transactional
    )]
    async fn flagged(&mut self, _: Flagged) -> Result<(), Never> {
        Ok(())
    }
}

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(100),
        entity_reply_poll_interval: Duration::from_millis(50),
        ..ShardingConfig::default()
    }
}

/// A SQLite file of the test, removed at the end.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(name: &str) -> TempFile {
        let file = format!("cluster-macros-{name}-{}.db", std::process::id());
        TempFile(std::env::temp_dir().join(file))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
        }
    }
}

/// A single runner on the SQLite file at `path`.
async fn single_runner(path: &std::path::Path, config: ShardingConfig) -> Sharding {
    use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage};
    use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
    let options = SqlStorageOptions::from_config(&config, TablePrefix::default());
    let messages = SqliteMessageStorage::open(path, SqliteOptions::new(options.clone()));
    let runners = SqliteRunnerStorage::open(path, SqliteOptions::new(options));
    Sharding::single_runner(
        config,
        Arc::new(messages.await.unwrap()),
        Arc::new(runners.await.unwrap()),
    )
    .start()
    .await
    .unwrap()
}

/// A runner on `file` with the accounts (their instances sharing `runs`, at most two shared
/// requests at once) and the counters.
async fn runner(file: &TempFile, runs: &Arc<Runs>) -> Sharding {
    let sharding = single_runner(&file.0, config()).await;
    let runs = Arc::clone(runs);
    let options = EntityOptions { concurrency: Capacity::bounded(2), ..EntityOptions::default() };
    sharding
        .entity()
        .options(options)
        .factory(move |_: &EntityContext| Account::new(Arc::clone(&runs)))
        .register()
        .unwrap();
    sharding.entity::<Counter>().register().unwrap();
    sharding
}

/// Bounds a step that would hang if the runtime got it wrong.
async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(20), future).await {
        Ok(value) => value,
        Err(_) => panic!("{what} did not finish within 20 s"),
    }
}

#[tokio::test]
async fn persisted_requests_run_once_per_primary_key() {
    let file = TempFile::new("dedup");
    let runs = Runs::new();
    let sharding = runner(&file, &runs).await;
    let accounts = Account::client(&sharding);
    let deposit = |key: &str, amount| Deposit { key: key.to_owned(), amount };

    assert_eq!(within("a deposit", accounts.deposit("alice", deposit("d-1", 5))).await.unwrap(), 5);
    // The same key again: answered from storage, the handler does not run.
    assert_eq!(within("a repeat", accounts.deposit("alice", deposit("d-1", 5))).await.unwrap(), 5);
    assert_eq!(runs.deposits.load(Ordering::SeqCst), 1);
    // A discard stores it; sending it again waits for its one run.
    within("a discard", accounts.discard("alice", deposit("d-2", 7))).await.unwrap();
    assert_eq!(
        within("the reply", accounts.deposit("alice", deposit("d-2", 7))).await.unwrap(),
        12
    );
    assert_eq!(runs.deposits.load(Ordering::SeqCst), 2);
    // The instance came from the factory once.
    assert_eq!(runs.created.load(Ordering::SeqCst), 1);
    sharding.shutdown().await;
}

#[tokio::test]
async fn volatile_requests_answer_successes_and_errors() {
    let file = TempFile::new("volatile");
    let runs = Runs::new();
    let sharding = runner(&file, &runs).await;
    let accounts = Account::client(&sharding);

    let deposit = Deposit { key: "d-1".to_owned(), amount: 10 };
    within("a deposit", accounts.deposit("bob", deposit)).await.unwrap();
    assert_eq!(
        within("a withdrawal", accounts.withdraw("bob", Withdraw { amount: 4 })).await.unwrap(),
        6
    );
    match within("a failed withdrawal", accounts.withdraw("bob", Withdraw { amount: 7 })).await {
        Err(CallError::Failed(error)) => assert_eq!(error, Insufficient { balance: 6 }),
        other => panic!("expected the handler's error, got {other:?}"),
    }
    assert_eq!(within("a balance", accounts.balance("bob")).await.unwrap(), 6);
    // Another id is another instance, made by the factory.
    assert_eq!(within("another balance", accounts.balance("carol")).await.unwrap(), 0);
    assert_eq!(runs.created.load(Ordering::SeqCst), 2);
    // The untyped client of one entity reaches the same instance.
    assert_eq!(within("a send", accounts.entity("bob").send(Balance)).await.unwrap(), 6);
    sharding.shutdown().await;
}

#[tokio::test]
async fn shared_requests_run_side_by_side() {
    let file = TempFile::new("shared");
    let runs = Runs::new();
    let sharding = runner(&file, &runs).await;
    let accounts = Account::client(&sharding);
    // Each waits for the other: both end only if `&self` made them shared requests.
    let (first, second) = within("two meetings", async {
        tokio::join!(accounts.meet("dave"), accounts.meet("dave"))
    })
    .await;
    first.unwrap();
    second.unwrap();
    sharding.shutdown().await;
}

#[tokio::test]
async fn streams_send_their_items() {
    let file = TempFile::new("stream");
    let runs = Runs::new();
    let sharding = runner(&file, &runs).await;
    let accounts = Account::client(&sharding);
    for (n, amount) in [3, 1, 4].into_iter().enumerate() {
        let deposit = Deposit { key: format!("d-{n}"), amount };
        within("a deposit", accounts.deposit("erin", deposit)).await.unwrap();
    }
    let mut stream = within("the stream", accounts.history("erin", History)).await.unwrap();
    let mut items = Vec::new();
    while let Some(item) = within("an item", stream.next()).await {
        items.push(item.unwrap());
    }
    assert_eq!(items, [3, 1, 4]);
    sharding.shutdown().await;
}

#[tokio::test]
async fn an_asynchronous_factory_loads_each_instance_before_its_first_request() {
    let sharding = Sharding::volatile(config()).start().await.unwrap();
    let store: Store = Arc::default();
    store.lock().await.insert("greeting".to_owned(), "hello".to_owned());
    let loads = Arc::new(AtomicU64::new(0));
    let (factory_store, factory_loads) = (Arc::clone(&store), Arc::clone(&loads));
    sharding
        .entity()
        .factory_async(move |context: EntityContext| {
            let (store, loads) = (Arc::clone(&factory_store), Arc::clone(&factory_loads));
            async move {
                let id = context.address().entity_id.as_str().to_owned();
                let text = store.lock().await.get(&id).cloned().unwrap_or_default();
                loads.fetch_add(1, Ordering::SeqCst);
                Note { text }
            }
        })
        .register()
        .unwrap();
    let notes = Note::client(&sharding);
    assert_eq!(within("a read", notes.read("greeting", Read)).await.unwrap(), "hello");
    // The instance keeps what it loaded: a change in the store is not read again.
    store.lock().await.insert("greeting".to_owned(), "changed".to_owned());
    assert_eq!(within("a read", notes.read("greeting", Read)).await.unwrap(), "hello");
    assert_eq!(within("a read", notes.read("empty", Read)).await.unwrap(), "");
    assert_eq!(loads.load(Ordering::SeqCst), 2);
    sharding.shutdown().await;
}

#[tokio::test]
async fn create_makes_instances_of_entities_registered_without_a_factory() {
    let file = TempFile::new("create");
    let runs = Runs::new();
    let sharding = runner(&file, &runs).await;
    let counters: Counters = Counter::client(&sharding);
    // `create` starts each counter at its id's length.
    assert_eq!(within("an addition", counters.add("abc", Add { by: 1 })).await.unwrap(), 4);
    assert_eq!(within("an addition", counters.add("abc", Add { by: 1 })).await.unwrap(), 5);
    assert_eq!(within("an addition", counters.add("z", Add { by: 1 })).await.unwrap(), 2);
    sharding.shutdown().await;
}

// The flags the attributes set, checked when the test builds.
const _: () = {
    assert!(Account::CLIENT_TRACING);
    assert!(!Flags::CLIENT_TRACING);
    assert!(<Deposit as Rpc>::PERSISTED);
    assert!(!<Balance as Rpc>::PERSISTED);
    assert!(!<History as StreamRpc>::PERSISTED);
    assert!(<Flagged as Rpc>::PERSISTED);
    assert!(matches!(<Flagged as Rpc>::UNINTERRUPTIBLE, Uninterruptible::Server));
    assert!(<Flagged as Rpc>::INTERRUPT_ON_TERMINATION);
    assert!(<Flagged as Rpc>::WITH_TRANSACTION_PER_REQUEST);
};

#[test]
fn the_attributes_set_names_tags_and_what_requests_read() {
    assert_eq!(Account::TYPE, "MacroAccount");
    assert_eq!(Counter::TYPE, "Counter");
    assert_eq!(<Deposit as Rpc>::TAG, "Deposit");
    assert_eq!(<Add as Rpc>::TAG, "CounterAdd");
    assert_eq!(<History as StreamRpc>::TAG, "History");
    let deposit = Deposit { key: "k".to_owned(), amount: 1 };
    assert_eq!(deposit.primary_key().as_deref(), Some("k"));
    assert_eq!(Balance.primary_key(), None);
    // A generated request is a unit struct: stored as `null`, as a hand-written one is.
    assert_eq!(<Balance as Rpc>::TAG, "Balance");
    assert_eq!(serde_json::to_string(&Balance).unwrap(), "null");
    assert_eq!(serde_json::from_str::<Meet>("null").unwrap(), Meet);

    let flagged = Flagged { id: 7, at_millis: Some(1_000), transactional: true };
    assert_eq!(flagged.primary_key().as_deref(), Some("flagged-7"));
    assert_eq!(flagged.deliver_at(), Some(Timestamp::from_unix_millis(1_000)));
    assert!(flagged.with_transaction());
    let flagged = Flagged { id: 8, at_millis: None, transactional: false };
    assert_eq!(flagged.deliver_at(), None);
    assert!(!flagged.with_transaction());
}
