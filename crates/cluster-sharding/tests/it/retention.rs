//! Message retention on memory, SQLite, PostgreSQL and MySQL: a runner with `message_retention`
//! deletes the processed requests answered longer ago, so their primary keys run again, and
//! keeps the newer ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster_core::retention::{ProcessedQuery, replied_before};
use cluster_core::storage::MessageStorage;
use cluster_core::{Clock, ShardingConfig, SystemClock, Timestamp};
use cluster_sharding::{Never, Sharding, entity};
use cluster_testkit::databases::TestDatabase;
use cluster_testkit::memory::MemoryMessageStorage;
use serde::{Deserialize, Serialize};

/// The system clock moved on by an offset the test sets.
#[derive(Debug, Default)]
struct ShiftedClock {
    offset_millis: AtomicU64,
}

impl ShiftedClock {
    fn shift(&self, by: Duration) {
        let millis = u64::try_from(by.as_millis()).unwrap();
        self.offset_millis.fetch_add(millis, Ordering::SeqCst);
    }
}

impl Clock for ShiftedClock {
    fn now(&self) -> Timestamp {
        let offset = Duration::from_millis(self.offset_millis.load(Ordering::SeqCst));
        SystemClock.now().saturating_add(offset)
    }
}

/// Counts the keys it was given; in memory only, so a key that runs again counts again.
struct Tally {
    count: u64,
}

/// A persisted request with a primary key.
#[derive(Serialize, Deserialize)]
struct Mark {
    key: String,
}

#[entity]
impl Tally {
    async fn create() -> Self {
        Tally { count: 0 }
    }

    #[rpc(persisted, primary_key = key)]
    async fn mark(&mut self, _: Mark) -> Result<u64, Never> {
        self.count += 1;
        Ok(self.count)
    }
}

fn mark(key: &str) -> Mark {
    Mark { key: key.to_owned() }
}

const RETENTION: Duration = Duration::from_secs(10);

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(50),
        entity_reply_poll_interval: Duration::from_millis(20),
        message_retention: Some(RETENTION),
        ..ShardingConfig::default()
    }
}

/// How many processed requests `storage` holds.
async fn processed(storage: &dyn MessageStorage) -> usize {
    let query = ProcessedQuery {
        entity_type_prefix: String::new(),
        tag: None,
        replied_before: replied_before(Timestamp::from_unix_millis(i64::MAX / 4)),
        after: None,
        limit: 100,
    };
    storage.processed_requests(&query).await.unwrap().len()
}

/// Requests answered before the retention are deleted (their keys run again); a request
/// answered since is kept (its key is still answered from its stored reply).
async fn old_requests_are_deleted(storage: Arc<dyn MessageStorage>) {
    let clock = Arc::new(ShiftedClock::default());
    let sharding = Sharding::standalone(config(), Arc::clone(&storage))
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .start()
        .await
        .unwrap();
    sharding.entity::<Tally>().register().unwrap();
    let tally = Tally::client(&sharding);
    assert_eq!(tally.mark("t", mark("a")).await.unwrap(), 1);
    assert_eq!(tally.mark("t", mark("b")).await.unwrap(), 2);
    assert_eq!(tally.mark("t", mark("a")).await.unwrap(), 1, "answered from its stored reply");
    assert_eq!(processed(&*storage).await, 2);
    clock.shift(RETENTION * 3);
    // The next sweep (within a second) deletes both: `a` then runs again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let rerun = loop {
        let answer = tally.mark("t", mark("a")).await.unwrap();
        if answer != 1 {
            break answer;
        }
        assert!(tokio::time::Instant::now() < deadline, "retention deleted nothing in 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(rerun, 3, "the key ran again once, on the resident instance");
    // `b` was deleted too, and the rerun of `a` is new: answered now, so kept.
    assert_eq!(processed(&*storage).await, 1);
    assert_eq!(tally.mark("t", mark("a")).await.unwrap(), 3, "kept: answered from its reply");
    sharding.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_deletes_old_requests() {
    let storage = MemoryMessageStorage::new(Arc::new(SystemClock));
    old_requests_are_deleted(Arc::new(storage)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_deletes_old_requests() {
    let database = TestDatabase::sqlite("retention");
    old_requests_are_deleted(database.open(&config()).await.unwrap().0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_deletes_old_requests() {
    let Some(database) = TestDatabase::postgres() else { return };
    old_requests_are_deleted(database.open(&config()).await.unwrap().0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_deletes_old_requests() {
    let Some(database) = TestDatabase::mysql() else { return };
    old_requests_are_deleted(database.open(&config()).await.unwrap().0).await;
}
