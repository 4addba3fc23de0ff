//! Durable entity state on memory, SQLite, PostgreSQL and MySQL: an entity's state survives a
//! restart, commits once with each request that changes it, stays as it was after a failed,
//! panicked or streaming request, is refused when another writer moved it on (and the request
//! then runs again on the state that writer left), is deleted when it comes back to its initial
//! value, and is refused past the storage's value limit.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::entity_state::StateWrite;
use cluster_core::storage::MessageStorage;
use cluster_core::{EntityAddress, RawJson, ShardingConfig};
use cluster_sharding::{
    CallError, Chunks, Entity, EntityContext, Never, Protocol, RegisterError, Sharding, entity,
};
use cluster_testkit::databases::TestDatabase;
use cluster_testkit::memory::MemoryMessageStorage;
use serde::{Deserialize, Serialize};

/// What an account keeps across activations.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Book {
    balance: i64,
    /// Text kept with the balance (to grow the state past a limit).
    memo: String,
}

/// Adds `amount` once per `key`; fails after adding when `fail`, panics after adding when
/// `panic`.
#[derive(Serialize, Deserialize)]
struct Deposit {
    key: String,
    amount: i64,
    #[serde(default)]
    fail: bool,
    #[serde(default)]
    panic: bool,
    /// Bytes of memo the deposit writes.
    #[serde(default)]
    memo: usize,
}

impl Deposit {
    fn of(key: &str, amount: i64) -> Deposit {
        Deposit { key: key.to_owned(), amount, fail: false, panic: false, memo: 0 }
    }
}

/// Adds `amount`, volatile; a memo of `memo` bytes with it.
#[derive(Serialize, Deserialize)]
struct Credit {
    amount: i64,
    #[serde(default)]
    memo: usize,
}

/// Streams the balance after adding one (which a stream may not do).
#[derive(Serialize, Deserialize)]
struct Statement;

/// A bank account whose book is durable state.
struct Account {
    book: Book,
}

#[entity(state = book)]
impl Account {
    async fn create() -> Self {
        Account { book: Book::default() }
    }

    #[rpc(persisted, primary_key = key)]
    async fn deposit(&mut self, deposit: Deposit) -> Result<i64, String> {
        self.book.balance += deposit.amount;
        self.book.memo = "m".repeat(deposit.memo);
        if deposit.fail {
            return Err("refused after adding".to_owned());
        }
        assert!(!deposit.panic, "panicked after adding");
        Ok(self.book.balance)
    }

    #[rpc]
    async fn credit(&mut self, credit: Credit) -> Result<i64, String> {
        self.book.balance += credit.amount;
        self.book.memo = "m".repeat(credit.memo);
        Ok(self.book.balance)
    }

    #[rpc]
    async fn balance(&self) -> Result<i64, Never> {
        Ok(self.book.balance)
    }

    #[rpc(stream)]
    async fn statement(&mut self, _: Statement, chunks: &mut Chunks<'_, i64>) -> Result<(), Never> {
        self.book.balance += 1;
        let _ = chunks.send(self.book.balance).await;
        Ok(())
    }
}

/// Where a case's runner keeps its state.
enum Store {
    Memory(Arc<MemoryMessageStorage>),
    Database(TestDatabase),
}

/// A runner on a store, restartable.
struct Fixture {
    store: Store,
    storage: Arc<dyn MessageStorage>,
    sharding: Sharding,
}

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(50),
        entity_reply_poll_interval: Duration::from_millis(20),
        ..ShardingConfig::default()
    }
}

impl Fixture {
    async fn new(store: Store) -> Fixture {
        let storage = open(&store).await;
        let sharding = start(Arc::clone(&storage)).await;
        Fixture { store, storage, sharding }
    }

    /// Stops the runner and starts another on the same store, as a new process would.
    async fn restart(&mut self) {
        self.sharding.shutdown().await;
        self.storage = open(&self.store).await;
        self.sharding = start(Arc::clone(&self.storage)).await;
    }

    fn accounts(&self) -> AccountClient {
        Account::client(&self.sharding)
    }

    /// The stored book of `id` and its revision.
    async fn stored(&self, id: &str) -> Option<(Book, u64)> {
        self.sharding.client::<Account>(id).stored_state().await.unwrap()
    }

    fn address(&self, id: &str) -> EntityAddress {
        self.sharding.client::<Account>(id).address().clone()
    }

    /// Writes `id`'s book as another runner would, over revision `expected`.
    async fn write_elsewhere(&self, id: &str, expected: u64, book: &Book) {
        let write = StateWrite {
            address: self.address(id),
            expected,
            value: Some(RawJson::encode(book).unwrap()),
        };
        self.storage.save_state(&write).await.unwrap();
    }

    async fn finish(self) {
        self.sharding.shutdown().await;
    }
}

async fn open(store: &Store) -> Arc<dyn MessageStorage> {
    match store {
        Store::Memory(storage) => Arc::clone(storage) as Arc<dyn MessageStorage>,
        Store::Database(database) => database.open(&config()).await.unwrap().0,
    }
}

async fn start(storage: Arc<dyn MessageStorage>) -> Sharding {
    let sharding = Sharding::standalone(config(), storage).start().await.unwrap();
    sharding.entity::<Account>().register().unwrap();
    sharding
}

fn book(balance: i64) -> Book {
    Book { balance, memo: String::new() }
}

/// Persisted and volatile changes are stored, and a new runner on the same store starts from
/// them.
async fn state_survives_a_restart(mut fixture: Fixture) {
    let accounts = fixture.accounts();
    assert_eq!(accounts.deposit("alice", Deposit::of("a", 5)).await.unwrap(), 5);
    assert_eq!(accounts.deposit("alice", Deposit::of("b", 7)).await.unwrap(), 12);
    assert_eq!(accounts.credit("alice", Credit { amount: 3, memo: 0 }).await.unwrap(), 15);
    // A retried deposit is answered from its stored reply, not applied again.
    assert_eq!(accounts.deposit("alice", Deposit::of("a", 5)).await.unwrap(), 5);
    assert_eq!(fixture.stored("alice").await, Some((book(15), 3)));
    fixture.restart().await;
    let accounts = fixture.accounts();
    assert_eq!(accounts.balance("alice").await.unwrap(), 15);
    assert_eq!(accounts.deposit("alice", Deposit::of("c", 1)).await.unwrap(), 16);
    assert_eq!(fixture.stored("alice").await, Some((book(16), 4)));
    assert_eq!(fixture.stored("bob").await, None, "an entity that never wrote has no row");
    fixture.finish().await;
}

/// A request that fails, panics or streams after changing the state leaves it as committed,
/// in memory and in storage.
async fn a_failed_request_changes_nothing(fixture: Fixture) {
    let accounts = fixture.accounts();
    assert_eq!(accounts.deposit("carol", Deposit::of("a", 5)).await.unwrap(), 5);
    let failed = Deposit { fail: true, ..Deposit::of("b", 100) };
    assert!(matches!(accounts.deposit("carol", failed).await, Err(CallError::Failed(_))));
    assert_eq!(accounts.balance("carol").await.unwrap(), 5);
    let panicked = Deposit { panic: true, ..Deposit::of("c", 100) };
    assert!(matches!(accounts.deposit("carol", panicked).await, Err(CallError::Defect(_))));
    assert_eq!(accounts.balance("carol").await.unwrap(), 5);
    let mut stream = accounts.statement("carol", Statement).await.unwrap();
    let mut ended = None;
    while let Some(item) = stream.next().await {
        if let Err(error) = item {
            ended = Some(error.to_string());
        }
    }
    let ended = ended.expect("the stream ends with a defect");
    assert!(ended.contains("may read it, not change it"), "{ended}");
    assert_eq!(accounts.balance("carol").await.unwrap(), 5);
    assert_eq!(fixture.stored("carol").await, Some((book(5), 1)));
    fixture.finish().await;
}

/// Another writer moved the state on: the resident instance's next write is refused by
/// revision. A volatile request fails; a persisted one is not answered from the stale state but
/// runs again on the state the other writer left.
async fn a_stale_write_is_refused(fixture: Fixture) {
    let accounts = fixture.accounts();
    assert_eq!(accounts.deposit("dave", Deposit::of("a", 5)).await.unwrap(), 5);
    fixture.write_elsewhere("dave", 1, &book(100)).await;
    let stale = accounts.credit("dave", Credit { amount: 1, memo: 0 }).await;
    assert!(
        matches!(&stale, Err(CallError::Defect(defect)) if defect.to_string().contains("written elsewhere")),
        "{stale:?}"
    );
    assert_eq!(accounts.balance("dave").await.unwrap(), 100, "the instance read the state again");
    fixture.write_elsewhere("dave", 2, &book(200)).await;
    assert_eq!(accounts.deposit("dave", Deposit::of("b", 10)).await.unwrap(), 210);
    assert_eq!(fixture.stored("dave").await, Some((book(210), 4)));
    fixture.finish().await;
}

/// A state brought back to the one `create` makes has no row.
async fn the_initial_state_is_not_stored(fixture: Fixture) {
    let accounts = fixture.accounts();
    assert_eq!(accounts.credit("erin", Credit { amount: 5, memo: 0 }).await.unwrap(), 5);
    assert_eq!(fixture.stored("erin").await, Some((book(5), 1)));
    assert_eq!(accounts.credit("erin", Credit { amount: -5, memo: 0 }).await.unwrap(), 0);
    assert_eq!(fixture.stored("erin").await, None);
    assert_eq!(accounts.deposit("erin", Deposit::of("a", 2)).await.unwrap(), 2);
    assert_eq!(fixture.stored("erin").await, Some((book(2), 1)));
    fixture.finish().await;
}

/// A state past the storage's value limit is refused with a defect that says so, and the
/// state stays as it was.
async fn state_over_the_limit_is_refused(fixture: Fixture) {
    let accounts = fixture.accounts();
    assert_eq!(accounts.credit("fay", Credit { amount: 5, memo: 0 }).await.unwrap(), 5);
    let over = 17 * 1024 * 1024;
    let refused = accounts.credit("fay", Credit { amount: 1, memo: over }).await;
    assert!(
        matches!(&refused, Err(CallError::Defect(defect)) if defect.to_string().contains("could not be saved")),
        "{refused:?}"
    );
    let refused = accounts.deposit("fay", Deposit { memo: over, ..Deposit::of("a", 1) }).await;
    assert!(
        matches!(&refused, Err(CallError::Defect(defect)) if defect.to_string().contains("entity state could not be stored")),
        "{refused:?}"
    );
    assert_eq!(accounts.balance("fay").await.unwrap(), 5);
    assert_eq!(fixture.stored("fay").await, Some((book(5), 1)));
    fixture.finish().await;
}

/// A stored state that does not decode as the entity's (an incompatible change of its type)
/// holds the entity's requests, losing nothing, until the row is fixed; then they run on it.
async fn an_undecodable_state_holds_its_requests_until_fixed(mut fixture: Fixture) {
    let accounts = fixture.accounts();
    assert_eq!(accounts.credit("gus", Credit { amount: 5, memo: 0 }).await.unwrap(), 5);
    let address = fixture.address("gus");
    let nonsense = StateWrite {
        address: address.clone(),
        expected: 1,
        value: Some(RawJson::encode("not a book").unwrap()),
    };
    fixture.storage.save_state(&nonsense).await.unwrap();
    // A new runner: the instance loads the state anew.
    fixture.restart().await;
    let balance = tokio::spawn({
        let accounts = fixture.accounts();
        async move { accounts.balance("gus").await }
    });
    // Held: not answered, and no defect, while the row does not decode.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!balance.is_finished(), "a request ran on a state that does not decode");
    fixture.write_elsewhere("gus", 2, &book(9)).await;
    let answered = tokio::time::timeout(Duration::from_secs(30), balance).await;
    assert_eq!(answered.expect("answered once the row decodes").unwrap().unwrap(), 9);
    fixture.finish().await;
}

/// Durable state needs a storage: a runtime without one refuses the registration.
#[tokio::test]
async fn a_runtime_without_storage_refuses_durable_entities() {
    let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    let refused = sharding.entity::<Account>().register();
    assert!(matches!(&refused, Err(RegisterError::NoStateStorage(_))), "{refused:?}");
    let message = refused.unwrap_err().to_string();
    assert!(message.contains("no message storage"), "{message}");
    sharding.shutdown().await;
}

/// A hand-written entity declares its state in `protocol`.
struct Tally {
    count: u32,
}

impl Entity for Tally {
    const TYPE: &'static str = "Tally";

    async fn create(_: &EntityContext) -> Tally {
        Tally { count: 0 }
    }

    fn protocol(protocol: &mut Protocol<Tally>) {
        protocol.durable(|tally| &mut tally.count);
    }
}

#[test]
fn a_hand_written_entity_declares_its_state() {
    // Registration on a runtime without storage is refused, which shows the declaration.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
        let refused = sharding.entity::<Tally>().register();
        assert!(matches!(refused, Err(RegisterError::NoStateStorage(_))));
        sharding.shutdown().await;
    });
}

macro_rules! on_stores {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let storage = MemoryMessageStorage::new(Arc::new(SystemClock));
                    let store = super::Store::Memory(Arc::new(storage));
                    super::$case(super::Fixture::new(store).await).await;
                }
            )*
            use std::sync::Arc;
            use cluster_core::SystemClock;
            use cluster_testkit::memory::MemoryMessageStorage;
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let database = TestDatabase::sqlite(concat!("state-", stringify!($case)));
                    super::$case(super::Fixture::new(super::Store::Database(database)).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(database) = TestDatabase::postgres() else { return };
                    super::$case(super::Fixture::new(super::Store::Database(database)).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(database) = TestDatabase::mysql() else { return };
                    super::$case(super::Fixture::new(super::Store::Database(database)).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
    };
}

on_stores!(
    state_survives_a_restart,
    a_failed_request_changes_nothing,
    a_stale_write_is_refused,
    the_initial_state_is_not_stored,
    state_over_the_limit_is_refused,
    an_undecodable_state_holds_its_requests_until_fixed,
);
