//! The SQLite backend's tests: the conformance suite on database files in a temporary directory,
//! then what only SQLite has: the schema against the reference's DDL, the migration history,
//! reopening a file, the worker thread (never blocking the executor, dying into errors), group
//! commit, lenient row reading, the legacy long-key fallback and the `synchronous` option.
//!
//! Each test works on a fresh file in its own directory under the system temp dir and removes
//! it at the end. Direct SQL (to damage rows or hold the write lock) goes through a separate
//! `rusqlite` connection or a user transaction's handle.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use cluster_core::entity_state::StateWrite;
use cluster_core::envelope::{Exit, RawJson, Reply, Request, TraceContext, WithExit, primary_key};
use cluster_core::error::StorageErrorKind;
use cluster_core::future::BoxFuture;
use cluster_core::ids::RunnerWeight;
use cluster_core::storage::{
    MessageStorage, RunnerStorage, SaveRequestOptions, SaveResult, UnprocessedOptions,
};
use cluster_core::{
    EntityAddress, EntityId, EntityType, Runner, RunnerAddress, ShardGroup, ShardId, Snowflake,
    Timestamp,
};
use cluster_storage_sql::sqlite::{
    SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage, SqliteTransactionHandle, Synchronous,
};
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
use cluster_testkit::storage_suite::{Corruption, StorageFixture};
use cluster_testkit::wait::eventually;
use tokio::time::Instant;

use crate::unique_prefix;

/// How long a test waits for a condition before failing.
const EVENTUAL: Duration = Duration::from_secs(30);

// --- Fixture ------------------------------------------------------------------------------------

/// A database file in its own temporary directory, with a unique table prefix.
pub(crate) struct TempDatabase {
    directory: PathBuf,
    pub(crate) path: PathBuf,
    pub(crate) prefix: TablePrefix,
}

impl TempDatabase {
    pub(crate) fn new() -> TempDatabase {
        let prefix = unique_prefix();
        let directory = std::env::temp_dir().join(format!("cluster-sqlite-{prefix}"));
        std::fs::create_dir_all(&directory).expect("create the test directory");
        let path = directory.join("cluster.db");
        TempDatabase { directory, path, prefix }
    }

    pub(crate) fn options(&self) -> SqliteOptions {
        self.options_with(Duration::from_secs(60))
    }

    /// Options whose leases and heartbeats expire after `expiration`. The lock deadline is
    /// generous: these tests are about semantics, not about a slow disk.
    fn options_with(&self, expiration: Duration) -> SqliteOptions {
        SqliteOptions::new(SqlStorageOptions {
            prefix: self.prefix.clone(),
            shard_lock_expiration: expiration,
            shard_lock_interval: Duration::from_secs(10),
            ..SqlStorageOptions::default()
        })
    }

    fn table(&self, name: &str) -> String {
        self.prefix.table(name)
    }

    /// A plain connection to the file, for direct SQL.
    pub(crate) fn connect(&self) -> rusqlite::Connection {
        let connection = rusqlite::Connection::open(&self.path).expect("open the test database");
        connection.busy_timeout(Duration::from_secs(10)).expect("set the busy timeout");
        connection
    }

    fn remove(&self) {
        // A leftover directory in the temp dir is harmless; a failure here must not hide the
        // test's own result.
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// A failing test still removes its directory.
impl Drop for TempDatabase {
    fn drop(&mut self) {
        self.remove();
    }
}

struct SqliteFixture {
    database: TempDatabase,
    storage: Arc<SqliteMessageStorage>,
    runner_storages: std::sync::Mutex<Vec<Arc<SqliteRunnerStorage>>>,
}

async fn fixture() -> Option<Box<dyn StorageFixture>> {
    let database = TempDatabase::new();
    let mut options = database.options();
    options.storage.value_bytes_max = crate::suite_value_bytes_max();
    let storage = SqliteMessageStorage::open(&database.path, options)
        .await
        .expect("open the message storage");
    Some(Box::new(SqliteFixture {
        database,
        storage: Arc::new(storage),
        runner_storages: std::sync::Mutex::new(Vec::new()),
    }))
}

impl StorageFixture for SqliteFixture {
    fn name(&self) -> &str {
        "sqlite"
    }

    fn message_storage(&self) -> Arc<dyn MessageStorage> {
        Arc::clone(&self.storage) as Arc<dyn MessageStorage>
    }

    fn runner_storage(&self, expiration: Duration) -> BoxFuture<'_, Arc<dyn RunnerStorage>> {
        Box::pin(async move {
            let storage = SqliteRunnerStorage::open(
                &self.database.path,
                self.database.options_with(expiration),
            )
            .await
            .expect("open a runner storage");
            let storage = Arc::new(storage);
            self.runner_storages.lock().expect("not poisoned").push(Arc::clone(&storage));
            storage as Arc<dyn RunnerStorage>
        })
    }

    fn value_bytes_max(&self) -> usize {
        self.storage.value_bytes_max().get()
    }

    fn corrupt(&self, corruption: Corruption) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let (table, set, id) = match &corruption {
                Corruption::MessagePayload(id) => ("messages", "payload = 'not json {'", *id),
                Corruption::ReplyPayload(id) => ("replies", "payload = 'not json ['", *id),
                Corruption::StateValue(address) => {
                    let sql = format!(
                        "UPDATE {} SET value = 'not json {{' \
                         WHERE entity_type = ?1 AND entity_id = ?2",
                        self.database.table("entity_state")
                    );
                    let key = [address.entity_type.to_string(), address.entity_id.to_string()];
                    let changed = in_transaction(&*self.storage, move |connection| {
                        connection.execute(&sql, key)
                    })
                    .await;
                    assert_eq!(changed, 1, "corrupting {corruption:?}");
                    return;
                }
            };
            let sql = format!("UPDATE {} SET {set} WHERE id = ?1", self.database.table(table));
            let id = id.to_i64().expect("test ids fit an i64");
            let changed =
                in_transaction(&*self.storage, move |connection| connection.execute(&sql, [id]))
                    .await;
            assert_eq!(changed, 1, "corrupting {corruption:?}");
        })
    }

    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.storage.close().await;
            let runner_storages = std::mem::take(&mut *self.runner_storages.lock().expect("ok"));
            for storage in runner_storages {
                storage.close().await;
            }
            self.database.remove();
        })
    }
}

/// Runs `body` in a user transaction of `storage` and commits.
async fn in_transaction<T: Send + 'static>(
    storage: &dyn MessageStorage,
    body: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T> + Send + 'static,
) -> T {
    let mut transaction = storage.begin_transaction().await.expect("begin");
    let handle = transaction.backend_as::<SqliteTransactionHandle>().expect("SQLite's handle");
    let value = handle.run(body).await.expect("run the statement");
    transaction.commit().await.expect("commit");
    value
}

cluster_testkit::storage_suite!(fixture);

// --- Helpers ------------------------------------------------------------------------------------

fn shard(id: u32) -> ShardId {
    ShardId::new(ShardGroup::from("default"), id)
}

fn address(entity_id: &str) -> EntityAddress {
    EntityAddress {
        shard_id: shard(1),
        entity_type: EntityType::from("TestEntity"),
        entity_id: EntityId::from(entity_id),
    }
}

fn request(id: u64) -> Request {
    Request {
        request_id: Snowflake::new(id),
        address: address("e1"),
        tag: "GetUser".into(),
        payload: RawJson::from_json(format!(r#"{{"id":{id}}}"#)).expect("json"),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    }
}

fn final_reply(request_id: u64, id: u64) -> Reply {
    Reply::WithExit(WithExit {
        request_id: Snowflake::new(request_id),
        id: Snowflake::new(id),
        exit: Exit::void(),
    })
}

fn far_future() -> Timestamp {
    Timestamp::from_unix_millis(i64::MAX / 2)
}

async fn read_ids(storage: &dyn MessageStorage) -> Vec<u64> {
    let batch = storage
        .unprocessed_messages(&[shard(1)], far_future(), UnprocessedOptions::default())
        .await
        .expect("read");
    assert!(batch.malformed.is_empty(), "{:?}", batch.malformed);
    batch.messages.iter().map(|message| message.envelope.id().get()).collect()
}

/// `(name, type, notnull, dflt_value, pk)` of every column of `table`.
fn columns(
    connection: &rusqlite::Connection,
    table: &str,
) -> Vec<(String, String, bool, Option<String>, i64)> {
    let mut statement = connection
        .prepare("SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info(?1) ORDER BY cid")
        .expect("prepare");
    let rows = statement
        .query_map([table], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?))
        })
        .expect("query");
    rows.collect::<Result<_, _>>().expect("rows")
}

type Column = (&'static str, &'static str, bool, Option<&'static str>, i64);

fn expect_columns(connection: &rusqlite::Connection, table: &str, expected: &[Column]) {
    let actual = columns(connection, table);
    let expected: Vec<(String, String, bool, Option<String>, i64)> = expected
        .iter()
        .map(|(name, ty, not_null, default, pk)| {
            ((*name).to_owned(), (*ty).to_owned(), *not_null, default.map(str::to_owned), *pk)
        })
        .collect();
    assert_eq!(actual, expected, "columns of {table}");
}

/// The indexes of `table` are `expected` (`(name, unique)`, in any order).
fn expect_indexes(
    connection: &rusqlite::Connection,
    table: &str,
    mut expected: Vec<(String, bool)>,
) {
    let mut statement =
        connection.prepare("SELECT name, \"unique\" FROM pragma_index_list(?1)").expect("prepare");
    let rows = statement.query_map([table], |row| Ok((row.get(0)?, row.get(1)?))).expect("query");
    let mut actual: Vec<(String, bool)> = rows.collect::<Result<_, _>>().expect("rows");
    actual.sort();
    expected.sort();
    assert_eq!(actual, expected, "indexes of {table}");
}

/// The `(migration_id, name)` rows of a migration history table.
fn history(connection: &rusqlite::Connection, table: &str) -> Vec<(i64, String)> {
    let mut statement = connection
        .prepare(&format!("SELECT migration_id, name FROM {table} ORDER BY migration_id"))
        .expect("prepare");
    let rows = statement.query_map([], |row| Ok((row.get(0)?, row.get(1)?))).expect("query");
    rows.collect::<Result<_, _>>().expect("rows")
}

/// Holds the database's write lock from a separate connection on its own thread until the
/// returned sender is dropped or sent to.
fn hold_write_lock(path: &Path) -> mpsc::Sender<()> {
    let (release, released) = mpsc::channel::<()>();
    let (locked, is_locked) = mpsc::channel::<()>();
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let connection = rusqlite::Connection::open(path).expect("open");
        connection.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
        locked.send(()).expect("the test waits");
        let _ = released.recv();
        connection.execute_batch("COMMIT").expect("release the write lock");
    });
    is_locked.recv().expect("the lock holder started");
    release
}

// --- Schema and migrations ----------------------------------------------------------------------

/// The message tables have exactly the reference's SQLite columns, constraints and indexes
/// (`effect/src/cluster/SqlMessageStorage.ts`).
#[tokio::test]
async fn message_schema_matches_the_reference_ddl() {
    let database = TempDatabase::new();
    let messages = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    let connection = database.connect();
    let (m, r) = (database.table("messages"), database.table("replies"));
    expect_columns(
        &connection,
        &m,
        &[
            ("id", "INTEGER", false, None, 1),
            ("message_id", "TEXT", false, None, 0),
            ("shard_id", "TEXT", true, None, 0),
            ("entity_type", "TEXT", true, None, 0),
            ("entity_id", "TEXT", true, None, 0),
            ("kind", "INTEGER", true, None, 0),
            ("tag", "TEXT", false, None, 0),
            ("payload", "TEXT", false, None, 0),
            ("headers", "TEXT", false, None, 0),
            ("trace_id", "TEXT", false, None, 0),
            ("span_id", "TEXT", false, None, 0),
            ("sampled", "BOOLEAN", false, None, 0),
            ("processed", "BOOLEAN", true, Some("FALSE"), 0),
            ("request_id", "INTEGER", true, None, 0),
            ("reply_id", "INTEGER", false, None, 0),
            ("last_reply_id", "INTEGER", false, None, 0),
            ("last_read", "TEXT", false, None, 0),
            ("deliver_at", "INTEGER", false, None, 0),
        ],
    );
    expect_columns(
        &connection,
        &r,
        &[
            ("id", "INTEGER", false, None, 1),
            ("kind", "INTEGER", false, None, 0),
            ("request_id", "INTEGER", true, None, 0),
            ("payload", "TEXT", true, None, 0),
            ("sequence", "INTEGER", false, None, 0),
            ("acked", "BOOLEAN", true, Some("FALSE"), 0),
        ],
    );
    // `id INTEGER PRIMARY KEY` is the rowid itself: no separate rowid column, no pk index;
    // the `UNIQUE` constraints are SQLite's automatic indexes.
    expect_indexes(
        &connection,
        &m,
        vec![
            (format!("{m}_request_id_idx"), false),
            // Ours, beyond the reference: the read model's index of workflow executions.
            (format!("{m}_run_idx"), false),
            (format!("{m}_shard_idx"), false),
            (format!("sqlite_autoindex_{m}_1"), true),
        ],
    );
    expect_indexes(
        &connection,
        &r,
        vec![
            (format!("{r}_request_lookup_idx"), false),
            (format!("sqlite_autoindex_{r}_1"), true),
            (format!("sqlite_autoindex_{r}_2"), true),
        ],
    );
    messages.close().await;
    database.remove();
}

/// The runner tables and both migration histories have exactly the reference's SQLite columns
/// (`effect/src/cluster/SqlRunnerStorage.ts`; effect's SQL migrator).
#[tokio::test]
async fn runner_schema_matches_the_reference_ddl() {
    let database = TempDatabase::new();
    let messages = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    let runners = SqliteRunnerStorage::open(&database.path, database.options()).await.unwrap();
    let connection = database.connect();
    expect_columns(
        &connection,
        &database.table("runners"),
        &[
            ("machine_id", "INTEGER", false, None, 1),
            ("address", "TEXT", true, None, 0),
            ("runner", "TEXT", true, None, 0),
            ("healthy", "INTEGER", true, Some("1"), 0),
            ("last_heartbeat", "DATETIME", true, Some("CURRENT_TIMESTAMP"), 0),
        ],
    );
    expect_columns(
        &connection,
        &database.table("locks"),
        &[
            ("shard_id", "TEXT", false, None, 1),
            ("address", "TEXT", true, None, 0),
            ("acquired_at", "DATETIME", true, None, 0),
        ],
    );
    for history_table in [database.table("migrations"), database.table("runner_migrations")] {
        expect_columns(
            &connection,
            &history_table,
            &[
                ("migration_id", "INTEGER", true, None, 1),
                ("created_at", "datetime", true, Some("current_timestamp"), 0),
                ("name", "VARCHAR(255)", true, None, 0),
            ],
        );
    }
    let autoincrement: bool = connection
        .query_row(
            "SELECT sql LIKE '%AUTOINCREMENT%' FROM sqlite_master WHERE name = ?1",
            [database.table("runners")],
            |row| row.get(0),
        )
        .unwrap();
    assert!(autoincrement, "machine ids never reuse a deleted runner's id");
    messages.close().await;
    runners.close().await;
    database.remove();
}

/// Migrations record the reference's ids and names, run once, and a database migrated before
/// (by us or by a TypeScript runner) is recognised.
#[tokio::test]
async fn migrations_are_recorded_and_idempotent() {
    let database = TempDatabase::new();
    let options = database.options();
    assert_eq!(SqliteMessageStorage::migrate(&database.path, &options).await.unwrap(), [1, 2, 3]);
    assert_eq!(SqliteRunnerStorage::migrate(&database.path, &options).await.unwrap(), [1]);
    assert!(SqliteMessageStorage::migrate(&database.path, &options).await.unwrap().is_empty());
    assert!(SqliteRunnerStorage::migrate(&database.path, &options).await.unwrap().is_empty());
    let connection = database.connect();
    assert_eq!(
        history(&connection, &database.table("migrations")),
        [
            (1, "create_tables".to_owned()),
            (2, "entity_type_size".to_owned()),
            (3, "pg_messages_rowid_index".to_owned()),
        ]
    );
    assert_eq!(
        history(&connection, &database.table("runner_migrations")),
        [(1, "create_tables".to_owned())]
    );
    // Opening with migrations on a migrated database changes nothing and works.
    let storage = SqliteMessageStorage::open(&database.path, options.clone()).await.unwrap();
    storage.save_request(&request(1), &SaveRequestOptions::default()).await.unwrap();
    assert_eq!(history(&connection, &database.table("migrations")).len(), 3);
    storage.close().await;
    database.remove();
}

/// The entity state table is ours: created by the message migrations with the messages'
/// columns for the key, without a history row, and again when it is missing.
#[tokio::test]
async fn the_entity_state_table_is_created_outside_the_history() {
    let database = TempDatabase::new();
    let options = database.options();
    assert_eq!(SqliteMessageStorage::migrate(&database.path, &options).await.unwrap(), [1, 2, 3]);
    let connection = database.connect();
    let state = database.table("entity_state");
    expect_columns(
        &connection,
        &state,
        &[
            ("entity_type", "TEXT", true, None, 1),
            ("entity_id", "TEXT", true, None, 2),
            ("shard_id", "TEXT", true, None, 0),
            ("value", "TEXT", true, None, 0),
            ("revision", "INTEGER", true, None, 0),
            ("updated_at", "TEXT", true, None, 0),
        ],
    );
    expect_indexes(&connection, &state, vec![(format!("sqlite_autoindex_{state}_1"), true)]);
    assert_eq!(history(&connection, &database.table("migrations")).len(), 3);
    connection.execute_batch(&format!("DROP TABLE {state}")).unwrap();
    assert!(SqliteMessageStorage::migrate(&database.path, &options).await.unwrap().is_empty());
    assert_eq!(columns(&connection, &state).len(), 6, "the table is back");
    assert_eq!(history(&connection, &database.table("migrations")).len(), 3);
    // Written on the database clock, in UTC.
    let storage = SqliteMessageStorage::open(&database.path, options).await.unwrap();
    let write = StateWrite { address: address("e1"), expected: 0, value: Some(RawJson::null()) };
    storage.save_state(&write).await.unwrap();
    let (shard_id, age): (String, i64) = connection
        .query_row(
            &format!(
                "SELECT shard_id, abs(strftime('%s', 'now') - strftime('%s', updated_at)) \
                 FROM {state}"
            ),
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .unwrap();
    assert_eq!(shard_id, address("e1").shard_id.to_string());
    assert!(age < 60, "updated_at is UTC, {age} s from now");
    storage.close().await;
    database.remove();
}

/// Tables that exist without a history (deployments older than the history) are migrated in
/// place: `IF NOT EXISTS` keeps their rows.
#[tokio::test]
async fn migrations_adopt_existing_tables() {
    let database = TempDatabase::new();
    let first = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    first.save_request(&request(1), &SaveRequestOptions::default()).await.unwrap();
    first.close().await;
    database
        .connect()
        .execute_batch(&format!("DROP TABLE {}", database.table("migrations")))
        .unwrap();
    assert_eq!(
        SqliteMessageStorage::migrate(&database.path, &database.options()).await.unwrap(),
        [1, 2, 3]
    );
    let storage = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    assert_eq!(read_ids(&storage).await, [1]);
    storage.close().await;
    database.remove();
}

/// A storage opened without migrations does not create tables, and fails cleanly on a
/// database that has none.
#[tokio::test]
async fn open_without_migrations_runs_no_ddl() {
    let database = TempDatabase::new();
    let storage = SqliteMessageStorage::open_without_migrations(&database.path, database.options())
        .await
        .unwrap();
    let error =
        storage.save_request(&request(1), &SaveRequestOptions::default()).await.unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::Other, "{error}");
    let n_tables: i64 = database
        .connect()
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table'", [], |row| row.get(0))
        .unwrap();
    assert_eq!(n_tables, 0);
    storage.close().await;
    database.remove();
}

// --- Files, options, workers --------------------------------------------------------------------

/// What was saved survives closing the storages and opening the file again.
#[tokio::test]
async fn data_survives_reopening_the_file() {
    let database = TempDatabase::new();
    let storage = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    let key = SaveRequestOptions {
        primary_key: Some("TestEntity/e1/GetUser/k".to_owned()),
        deliver_at: None,
    };
    assert_eq!(storage.save_request(&request(1), &key).await.unwrap(), SaveResult::Success);
    storage.save_request(&request(2), &SaveRequestOptions::default()).await.unwrap();
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    let runners = SqliteRunnerStorage::open(&database.path, database.options()).await.unwrap();
    let runner = Runner::new(
        RunnerAddress::new("a", 1),
        vec![ShardGroup::from("default")],
        RunnerWeight::ONE,
    );
    let machine_id = runners.register(&runner, true).await.unwrap();
    assert_eq!(runners.acquire(&runner.address, &[shard(1)]).await.unwrap(), [shard(1)]);
    storage.close().await;
    runners.close().await;
    // Closed storages answer, with an error.
    let closed = storage.replies_for(&[Snowflake::new(1)]).await.unwrap_err();
    assert_eq!(closed.kind(), StorageErrorKind::Unavailable);

    let storage = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    assert_eq!(storage.replies_for(&[Snowflake::new(1)]).await.unwrap(), [final_reply(1, 10)]);
    assert_eq!(read_ids(&storage).await, [2]);
    assert_eq!(
        storage.save_request(&request(3), &key).await.unwrap(),
        SaveResult::Duplicate {
            original_id: Snowflake::new(1),
            last_received_reply: Some(final_reply(1, 10))
        }
    );
    let runners = SqliteRunnerStorage::open(&database.path, database.options()).await.unwrap();
    assert_eq!(runners.register(&runner, true).await.unwrap(), machine_id);
    assert_eq!(runners.refresh(&runner.address, &[shard(1)]).await.unwrap(), [shard(1)]);
    storage.close().await;
    runners.close().await;
    database.remove();
}

/// `synchronous` is `FULL` by default and `NORMAL` when asked; the journal is in WAL mode.
#[tokio::test]
async fn synchronous_option_is_applied() {
    let database = TempDatabase::new();
    for (synchronous, expected) in [(Synchronous::Full, 2), (Synchronous::Normal, 1)] {
        let options = SqliteOptions { synchronous, ..database.options() };
        let storage = SqliteMessageStorage::open(&database.path, options).await.unwrap();
        let (pragma, journal_mode) = in_transaction(&storage, |connection| {
            let pragma: i64 = connection.query_row("PRAGMA synchronous", [], |row| row.get(0))?;
            let journal_mode: String =
                connection.query_row("PRAGMA journal_mode", [], |row| row.get(0))?;
            Ok((pragma, journal_mode))
        })
        .await;
        assert_eq!(pragma, expected, "{synchronous:?}");
        assert_eq!(journal_mode, "wal");
        storage.close().await;
    }
    assert_eq!(SqliteOptions::default().synchronous, Synchronous::Full);
    database.remove();
}

/// Storage calls never block the executor: on a current-thread runtime, a save that waits for
/// another connection's write lock leaves the runtime free to run other tasks.
#[tokio::test(flavor = "current_thread")]
async fn storage_calls_never_block_the_executor() {
    let database = TempDatabase::new();
    let storage =
        Arc::new(SqliteMessageStorage::open(&database.path, database.options()).await.unwrap());
    let ticks = Arc::new(AtomicU64::new(0));
    let ticker = tokio::spawn({
        let ticks = Arc::clone(&ticks);
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                ticks.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let release = hold_write_lock(&database.path);
    let save = tokio::spawn({
        let storage = Arc::clone(&storage);
        async move { storage.save_request(&request(1), &SaveRequestOptions::default()).await }
    });
    let ticks_before = ticks.load(Ordering::Relaxed);
    // Reads do not need the write lock: they complete while the save waits.
    assert!(storage.replies_for(&[Snowflake::new(1)]).await.unwrap().is_empty());
    eventually("the ticker runs while the save waits", || {
        ticks.load(Ordering::Relaxed) >= ticks_before + 20
    })
    .await;
    assert!(!save.is_finished(), "the save cannot finish while the write lock is held");
    drop(release);
    assert_eq!(save.await.unwrap().unwrap(), SaveResult::Success);
    ticker.abort();
    assert_eq!(read_ids(&*storage).await, [1]);
    storage.close().await;
    database.remove();
}

/// A worker thread that dies (here: a panic in a user statement) turns into `Unavailable`
/// errors, for the call that killed it and every later one, never a hang.
#[tokio::test]
async fn a_dead_worker_is_unavailable_not_a_hang() {
    let database = TempDatabase::new();
    let storage = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    let mut transaction = storage.begin_transaction().await.unwrap();
    let handle = transaction.backend_as::<SqliteTransactionHandle>().unwrap();
    let died = tokio::time::timeout(
        EVENTUAL,
        handle.run(|_connection| -> rusqlite::Result<()> { panic!("a bug in a user statement") }),
    )
    .await
    .expect("answered, not hung");
    assert_eq!(died.unwrap_err().kind(), StorageErrorKind::Unavailable);
    let again = tokio::time::timeout(EVENTUAL, handle.run(|_connection| Ok(())))
        .await
        .expect("answered, not hung");
    assert_eq!(again.unwrap_err().kind(), StorageErrorKind::Unavailable);
    let commit = tokio::time::timeout(EVENTUAL, transaction.commit()).await.expect("answered");
    assert_eq!(commit.unwrap_err().kind(), StorageErrorKind::Unavailable);
    // The storage itself, and its next transactions, are unaffected.
    storage.save_request(&request(1), &SaveRequestOptions::default()).await.unwrap();
    let n_rows: i64 = in_transaction(&storage, {
        let messages = database.table("messages");
        move |connection| {
            connection.query_row(&format!("SELECT count(*) FROM {messages}"), [], |row| row.get(0))
        }
    })
    .await;
    assert_eq!(n_rows, 1);
    storage.close().await;
    database.remove();
}

/// The message storage's write-ahead log is copied into the database file by a background
/// connection: the file receives the saved requests although the log stays far below the
/// writer's own checkpoint threshold (10,000 pages while the checkpointer runs).
#[tokio::test]
async fn a_background_connection_checkpoints_the_log() {
    let database = TempDatabase::new();
    let storage = save_large_requests(&database, database.options()).await;
    eventually("the database file holds the saved requests", || {
        file_length(&database.path) > 4_000_000
    })
    .await;
    let log = file_length(&database.path.with_extension("db-wal"));
    assert!(log < 10_000 * 4_096, "the log grew to {log} bytes");
    storage.close().await;
    database.remove();
}

/// Without the background connection (`checkpoint_interval: None`) the writer checkpoints at
/// SQLite's 1,000 pages: the log stays near that size, and the database file receives what it
/// copied.
#[tokio::test]
async fn the_writer_checkpoints_when_there_is_no_background_connection() {
    let database = TempDatabase::new();
    let options = SqliteOptions { checkpoint_interval: None, ..database.options() };
    let storage = save_large_requests(&database, options).await;
    let log = file_length(&database.path.with_extension("db-wal"));
    assert!(log < 2_000 * 4_096, "the log grew to {log} bytes");
    assert!(file_length(&database.path) > 2_000_000, "the writer checkpointed");
    assert_eq!(read_ids(&*storage).await.len(), 1_000);
    storage.close().await;
    database.remove();
}

fn file_length(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |metadata| metadata.len())
}

/// Opens the message storage with `options` and saves 1,000 requests of 4 KiB (a little over
/// 1,000 pages of table, index and log), concurrently.
async fn save_large_requests(
    database: &TempDatabase,
    options: SqliteOptions,
) -> Arc<SqliteMessageStorage> {
    let storage = Arc::new(SqliteMessageStorage::open(&database.path, options).await.unwrap());
    let mut saves = tokio::task::JoinSet::new();
    for id in 1..=1_000_u64 {
        let storage = Arc::clone(&storage);
        saves.spawn(async move {
            let mut request = request(id);
            request.payload = RawJson::encode(&"x".repeat(4_096)).expect("json");
            storage.save_request(&request, &SaveRequestOptions::default()).await
        });
    }
    while let Some(saved) = saves.join_next().await {
        assert_eq!(saved.unwrap().unwrap(), SaveResult::Success);
    }
    storage
}

/// Saves queued together share one transaction, and each caller still gets its own result:
/// a conflicting save fails alone.
///
/// The write lock is held while the saves are queued, so the worker is stuck on the first one
/// and drains the others into one batch when the lock is freed. On a current-thread runtime,
/// a few yields let every spawned save run up to its reply (each is queued without waiting:
/// the channel has room), so the batch is deterministic.
#[tokio::test(flavor = "current_thread")]
async fn group_commit_isolates_failures() {
    let database = TempDatabase::new();
    let storage =
        Arc::new(SqliteMessageStorage::open(&database.path, database.options()).await.unwrap());
    storage.save_request(&request(1), &SaveRequestOptions::default()).await.unwrap();
    storage.save_reply(&final_reply(1, 1000)).await.unwrap();
    let release = hold_write_lock(&database.path);
    let mut saves = tokio::task::JoinSet::new();
    for id in 2..=64_u64 {
        let storage = Arc::clone(&storage);
        saves.spawn(async move {
            let result = match id {
                // A second final reply for request 1: a conflict.
                10 => storage.save_reply(&final_reply(1, 1010)).await.map(|()| SaveResult::Success),
                // A request id that is taken, without a primary key: a conflict.
                20 => storage.save_request(&request(1), &SaveRequestOptions::default()).await,
                _ => storage.save_request(&request(id), &SaveRequestOptions::default()).await,
            };
            (id, result)
        });
    }
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    drop(release);
    let mut n_saved = 0;
    while let Some(joined) = saves.join_next().await {
        let (id, result) = joined.unwrap();
        match id {
            10 | 20 => assert_eq!(result.unwrap_err().kind(), StorageErrorKind::Conflict, "{id}"),
            _ => {
                assert_eq!(result.unwrap(), SaveResult::Success, "{id}");
                n_saved += 1;
            }
        }
    }
    assert_eq!(n_saved, 61);
    let mut expected: Vec<u64> = (2..=64).filter(|id| *id != 10 && *id != 20).collect();
    expected.sort_unstable();
    assert_eq!(read_ids(&*storage).await, expected);
    assert_eq!(storage.replies_for(&[Snowflake::new(1)]).await.unwrap(), [final_reply(1, 1000)]);
    storage.close().await;
    database.remove();
}

/// Reads queued among saves do not cut them into separate commits: the saves still share one
/// transaction and each read gets its answer.
///
/// As in the test above, the write lock holds the worker on the first save while saves and
/// reads alternate in its queue; once freed, the worker commits the first save, then the rest
/// at once. The commits are counted in the write-ahead log (checkpoints are off, so it keeps
/// every frame): a read that ended a batch would make one commit per save.
#[tokio::test(flavor = "current_thread")]
async fn reads_among_saves_share_their_group_commit() {
    let database = TempDatabase::new();
    let options = SqliteOptions { checkpoint_interval: None, ..database.options() };
    let storage = Arc::new(SqliteMessageStorage::open(&database.path, options).await.unwrap());
    let key = "TestEntity/e1/GetUser/k".to_owned();
    let keyed = SaveRequestOptions { primary_key: Some(key.clone()), deliver_at: None };
    storage.save_request(&request(1), &keyed).await.unwrap();
    storage.save_reply(&final_reply(1, 1000)).await.unwrap();
    let wal = database.path.with_extension("db-wal");
    let commits_before = wal_commits(&wal);
    let release = hold_write_lock(&database.path);
    let mut calls = tokio::task::JoinSet::new();
    for id in 2..=33_u64 {
        let saver = Arc::clone(&storage);
        let key = key.clone();
        calls.spawn(async move {
            saver.save_request(&request(id), &SaveRequestOptions::default()).await.unwrap();
            assert_eq!(
                saver.request_id_for_primary_key(&key).await.unwrap(),
                Some(Snowflake::new(1))
            );
        });
        let reader = Arc::clone(&storage);
        calls.spawn(async move {
            assert_eq!(
                reader.replies_for(&[Snowflake::new(1)]).await.unwrap(),
                [final_reply(1, 1000)]
            );
        });
    }
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    drop(release);
    while let Some(joined) = calls.join_next().await {
        joined.unwrap();
    }
    let commits = wal_commits(&wal) - commits_before;
    assert!(commits <= 2, "32 saves among 32 reads took {commits} commits");
    // Request 1 has its final reply: only the new ones are unprocessed.
    assert_eq!(read_ids(&*storage).await, (2..=33).collect::<Vec<u64>>());
    storage.close().await;
    database.remove();
}

/// How many commits the write-ahead log at `path` holds: the frames of its current generation
/// (their salts match the header's) that end a transaction (a non-zero database size).
fn wal_commits(path: &Path) -> usize {
    let log = std::fs::read(path).expect("read the write-ahead log");
    let word = |at: usize| u32::from_be_bytes(log[at..at + 4].try_into().expect("4 bytes"));
    let page_size = word(8) as usize;
    let salts = (word(16), word(20));
    let mut commits = 0;
    let mut at = 32;
    while at + 24 + page_size <= log.len() {
        if (word(at + 8), word(at + 12)) == salts && word(at + 4) != 0 {
            commits += 1;
        }
        at += 24 + page_size;
    }
    commits
}

/// Every lock operation is bounded by the shard lock interval: while another connection holds
/// the write lock, lease operations fail with `Timeout` instead of waiting out the busy timeout.
#[tokio::test]
async fn lock_operations_are_bounded_by_the_interval() {
    let database = TempDatabase::new();
    let options = SqliteOptions {
        storage: SqlStorageOptions {
            shard_lock_interval: Duration::from_millis(200),
            ..database.options().storage
        },
        busy_timeout: Duration::from_secs(60),
        ..database.options()
    };
    let runners = SqliteRunnerStorage::open(&database.path, options).await.unwrap();
    let address = RunnerAddress::new("a", 1);
    let release = hold_write_lock(&database.path);
    let started = Instant::now();
    let acquired = runners.acquire(&address, &[shard(1)]).await;
    assert_eq!(acquired.unwrap_err().kind(), StorageErrorKind::Timeout);
    let refreshed = runners.refresh(&address, &[]).await;
    assert_eq!(refreshed.unwrap_err().kind(), StorageErrorKind::Timeout);
    assert!(started.elapsed() < EVENTUAL);
    drop(release);
    // Once the lock is free the queued operations run and new ones succeed.
    let deadline = Instant::now() + EVENTUAL;
    loop {
        match runners.acquire(&address, &[shard(1)]).await {
            Ok(held) => {
                assert_eq!(held, [shard(1)]);
                break;
            }
            Err(error) => {
                assert_eq!(error.kind(), StorageErrorKind::Timeout);
                assert!(Instant::now() < deadline, "never recovered: {error}");
            }
        }
    }
    runners.close().await;
    database.remove();
}

// --- Rows ---------------------------------------------------------------------------------------

/// Rows damaged in ways no runner writes (a text in an integer column, an unknown kind, headers
/// that are not JSON) become malformed messages, still claimed, and the rows after them are
/// delivered.
#[tokio::test]
async fn damaged_rows_are_malformed_messages_not_failed_reads() {
    let database = TempDatabase::new();
    let storage = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    for id in 1..=4 {
        storage.save_request(&request(id), &SaveRequestOptions::default()).await.unwrap();
    }
    let messages = database.table("messages");
    let changed = database.connect().execute_batch(&format!(
        "UPDATE {messages} SET kind = 7 WHERE id = 1;
             UPDATE {messages} SET headers = 'not json' WHERE id = 2;
             UPDATE {messages} SET tag = NULL, sampled = 'yes', reply_id = 'x' WHERE id = 3;"
    ));
    changed.unwrap();
    let batch = storage
        .unprocessed_messages(&[shard(1)], far_future(), UnprocessedOptions::default())
        .await
        .unwrap();
    let delivered: Vec<u64> =
        batch.messages.iter().map(|message| message.envelope.id().get()).collect();
    assert_eq!(delivered, [4]);
    let malformed: Vec<(u64, u64)> = batch
        .malformed
        .iter()
        .map(|malformed| (malformed.id.get(), malformed.request_id.get()))
        .collect();
    assert_eq!(malformed, [(1, 1), (2, 2), (3, 3)]);
    assert!(read_ids(&storage).await.is_empty(), "malformed rows stay claimed");
    storage.close().await;
    database.remove();
}

/// A row written before long keys were hashed, with the over-long key as plaintext, is still
/// found: saving the same key is a duplicate of it and the key resolves to it
/// (`effect/src/cluster/SqlMessageStorage.ts`).
#[tokio::test]
async fn legacy_plaintext_long_keys_are_found() {
    let database = TempDatabase::new();
    let storage = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    let legacy = request(1);
    let key = primary_key(&legacy.address, &legacy.tag, &"k".repeat(300));
    assert!(key.len() > 255);
    storage.save_request(&legacy, &SaveRequestOptions::default()).await.unwrap();
    // As the reference stored it before digests: the key itself in `message_id`.
    let changed = database
        .connect()
        .execute(
            &format!("UPDATE {} SET message_id = ?1 WHERE id = 1", database.table("messages")),
            [&key],
        )
        .unwrap();
    assert_eq!(changed, 1);
    let keyed = SaveRequestOptions { primary_key: Some(key.clone()), deliver_at: None };
    assert_eq!(
        storage.save_request(&request(2), &keyed).await.unwrap(),
        SaveResult::Duplicate { original_id: Snowflake::new(1), last_received_reply: None }
    );
    assert_eq!(storage.request_id_for_primary_key(&key).await.unwrap(), Some(Snowflake::new(1)));
    // New rows with long keys store the digest, not the plaintext.
    let other_key = primary_key(&legacy.address, &legacy.tag, &"j".repeat(300));
    let other = SaveRequestOptions { primary_key: Some(other_key.clone()), deliver_at: None };
    assert_eq!(storage.save_request(&request(3), &other).await.unwrap(), SaveResult::Success);
    let stored: String = database
        .connect()
        .query_row(
            &format!("SELECT message_id FROM {} WHERE id = 3", database.table("messages")),
            [],
            |row| row.get(0),
        )
        .unwrap();
    assert_eq!(stored.len(), 64);
    assert_ne!(stored, other_key);
    storage.close().await;
    database.remove();
}

/// A runner row whose JSON cannot be decoded is skipped; the others are returned.
#[tokio::test]
async fn undecodable_runner_rows_are_skipped() {
    let database = TempDatabase::new();
    let runners = SqliteRunnerStorage::open(&database.path, database.options()).await.unwrap();
    let runner = Runner::new(
        RunnerAddress::new("a", 1),
        vec![ShardGroup::from("default")],
        RunnerWeight::ONE,
    );
    runners.register(&runner, true).await.unwrap();
    database
        .connect()
        .execute(
            &format!(
                "INSERT INTO {} (address, runner, healthy) VALUES ('b:1', '{{not json', 1)",
                database.table("runners")
            ),
            [],
        )
        .unwrap();
    assert_eq!(runners.get_runners().await.unwrap(), [(runner, true)]);
    runners.close().await;
    database.remove();
}

/// The message and runner storages share one file; dropping a user transaction rolls it back
/// and frees the write lock for the others.
#[tokio::test]
async fn dropped_transaction_rolls_back_and_frees_the_lock() {
    let database = TempDatabase::new();
    let storage = SqliteMessageStorage::open(&database.path, database.options()).await.unwrap();
    let runners = SqliteRunnerStorage::open(&database.path, database.options()).await.unwrap();
    storage.save_request(&request(1), &SaveRequestOptions::default()).await.unwrap();
    let mut transaction = storage.begin_transaction().await.unwrap();
    transaction.save_reply(&final_reply(1, 10)).await.unwrap();
    let handle = transaction.backend_as::<SqliteTransactionHandle>().unwrap();
    let messages = database.table("messages");
    handle
        .run(move |connection| {
            connection.execute(&format!("DELETE FROM {messages} WHERE id = 1"), [])
        })
        .await
        .unwrap();
    drop(transaction);
    // The runner storage needs the write lock the transaction held.
    let address = RunnerAddress::new("a", 1);
    assert_eq!(runners.acquire(&address, &[shard(1)]).await.unwrap(), [shard(1)]);
    assert!(storage.replies_for(&[Snowflake::new(1)]).await.unwrap().is_empty());
    assert_eq!(read_ids(&storage).await, [1], "the delete was rolled back");
    storage.close().await;
    runners.close().await;
    database.remove();
}
