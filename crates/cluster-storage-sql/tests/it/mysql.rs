//! The MySQL backend's tests, against the database in `CLUSTER_TEST_MYSQL_URL` (MariaDB 10.11
//! locally): the conformance suite in both lock modes, then what only this backend has: the
//! schema against the reference's DDL, the migration history and its idempotence, advisory
//! lock sessions that the server ends (`wait_timeout`) or that are killed, killed pool
//! connections, unreadable rows, column widths and the transaction's own connection.
//!
//! Every test works on tables with its own prefix and drops them at the end. Direct SQL (to
//! damage rows, kill sessions, read the schema) goes through a separate pool.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::entity_state::StateWrite;
use cluster_core::envelope::{Exit, RawJson, Reply, Request, TraceContext, WithExit, primary_key};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::ids::RunnerWeight;
use cluster_core::inspect::{LockHolder, ShardLock};
use cluster_core::storage::{
    MessageStorage, RunnerStorage, SaveRequestOptions, SaveResult, UnprocessedOptions,
};
use cluster_core::{
    Clock, EntityAddress, EntityId, EntityType, Runner, RunnerAddress, ShardGroup, ShardId,
    ShardingConfig, Snowflake, SystemClock, Timestamp,
};
use cluster_storage_sql::mysql::{
    MySqlMessageStorage, MySqlRunnerStorage, migrate_messages, migrate_runners,
};
use cluster_storage_sql::options::VALUE_BYTES_MAX_DEFAULT;
use cluster_storage_sql::{LockMode, SqlStorageOptions, TablePrefix};
use cluster_testkit::storage_suite::{Corruption, StorageFixture};
use cluster_testkit::wait::eventually_async;
use mysql_async::prelude::Queryable;
use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts, Row};
use tokio::time::Instant;

use crate::{database_url, unique_prefix};

/// The tables of a prefix, histories included.
const TABLES: [&str; 7] =
    ["messages", "replies", "migrations", "runners", "locks", "runner_migrations", "entity_state"];

/// The lock expiration of tests that are not about expiry.
const LONG_EXPIRATION: Duration = Duration::from_secs(60);

// --- Fixture ------------------------------------------------------------------------------------

/// A connection to the test database with a fresh table prefix.
struct Database {
    opts: Opts,
    prefix: TablePrefix,
    /// For direct SQL only.
    admin: Pool,
}

impl Database {
    /// `None` (after a note) when `CLUSTER_TEST_MYSQL_URL` is not set.
    fn new() -> Option<Database> {
        let url = database_url("CLUSTER_TEST_MYSQL_URL")?;
        let opts = Opts::from_url(&url).expect("CLUSTER_TEST_MYSQL_URL is a MySQL URL");
        let admin = Pool::new(pool_opts(opts.clone(), 2));
        Some(Database { opts, prefix: unique_prefix(), admin })
    }

    /// A pool of at most `max` connections that keeps prepared statements across checkouts.
    fn pool(&self, max: usize) -> Pool {
        Pool::new(pool_opts(self.opts.clone(), max))
    }

    /// Connection options (a pool of at most 4) whose sessions run at the UTC offset `offset`,
    /// such as `-05:00`; the server's global time zone is left alone.
    fn opts_in_zone(&self, offset: &str) -> Opts {
        let set_zone = format!("SET time_zone = '{offset}'");
        Opts::from(pool_opts(self.opts.clone(), 4).init(vec![set_zone]))
    }

    fn options(&self, lock_mode: LockMode, expiration: Duration) -> SqlStorageOptions {
        SqlStorageOptions {
            prefix: self.prefix.clone(),
            lock_mode,
            shard_lock_expiration: expiration,
            // The reference's rule, expiration / 3, with room for a loaded test machine.
            shard_lock_interval: (expiration / 3).max(Duration::from_secs(1)),
            available_groups: vec![ShardGroup::from("default")],
            extra_indexes: true,
            value_bytes_max: VALUE_BYTES_MAX_DEFAULT,
        }
    }

    fn table(&self, name: &str) -> String {
        self.prefix.table(name)
    }

    async fn migrate(&self) {
        migrate_messages(&self.admin, &self.prefix).await.expect("migrate the message tables");
        migrate_runners(&self.admin, &self.prefix).await.expect("migrate the runner tables");
    }

    async fn message_storage(&self, pool: Pool) -> MySqlMessageStorage {
        MySqlMessageStorage::new(pool, &self.prefix).await.expect("open the message storage")
    }

    async fn runner_storage(
        &self,
        lock_mode: LockMode,
        expiration: Duration,
    ) -> MySqlRunnerStorage {
        let options = self.options(lock_mode, expiration);
        MySqlRunnerStorage::new(self.pool(4), self.opts.clone(), options)
            .await
            .expect("open a runner storage")
    }

    async fn exec(&self, sql: &str) {
        let mut conn = self.admin.get_conn().await.expect("an admin connection");
        conn.query_drop(sql).await.unwrap_or_else(|error| panic!("{sql}: {error}"));
    }

    async fn rows(&self, sql: &str) -> Vec<Row> {
        let mut conn = self.admin.get_conn().await.expect("an admin connection");
        conn.query(sql).await.unwrap_or_else(|error| panic!("{sql}: {error}"))
    }

    /// The connection id holding the advisory lock of `shard`, if any.
    async fn lock_holder(&self, shard: &ShardId) -> Option<u64> {
        let name = format!("{}.{shard}", self.prefix);
        let mut conn = self.admin.get_conn().await.expect("an admin connection");
        conn.exec_first::<Option<u64>, _, _>("SELECT IS_USED_LOCK(?)", (name,))
            .await
            .expect("IS_USED_LOCK")
            .flatten()
    }

    async fn drop_tables(self) {
        for name in TABLES {
            self.exec(&format!("DROP TABLE IF EXISTS `{}`", self.table(name))).await;
        }
        // Bounded: a test that failed may still hold connections of this pool.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.admin.disconnect()).await;
    }
}

/// Pool options that keep up to `max` idle connections (with `mysql_async`'s default inactive
/// TTL of zero, a pool with `min = 0` closes every connection it gets back) and their prepared
/// statements (no reset on checkout).
fn pool_opts(opts: Opts, max: usize) -> OptsBuilder {
    let constraints = PoolConstraints::new(0, max).expect("0 <= max and max > 0");
    let pool_opts = PoolOpts::default()
        .with_constraints(constraints)
        .with_inactive_connection_ttl(Duration::from_secs(60))
        .with_reset_connection(false);
    OptsBuilder::from_opts(opts).pool_opts(pool_opts)
}

struct MySqlFixture {
    name: &'static str,
    lock_mode: LockMode,
    database: Database,
    storage: Arc<MySqlMessageStorage>,
    /// Kept so that their lock sessions live until cleanup.
    runner_storages: Mutex<Vec<Arc<MySqlRunnerStorage>>>,
}

async fn fixture(lock_mode: LockMode) -> Option<Box<dyn StorageFixture>> {
    let database = Database::new()?;
    database.migrate().await;
    let storage = Arc::new(database.message_storage(database.pool(8)).await);
    let name = match lock_mode {
        LockMode::Advisory => "mysql (advisory locks)",
        LockMode::Lease => "mysql (lease locks)",
    };
    Some(Box::new(MySqlFixture {
        name,
        lock_mode,
        database,
        storage,
        runner_storages: Mutex::new(Vec::new()),
    }))
}

async fn advisory_fixture() -> Option<Box<dyn StorageFixture>> {
    fixture(LockMode::Advisory).await
}

async fn lease_fixture() -> Option<Box<dyn StorageFixture>> {
    fixture(LockMode::Lease).await
}

impl StorageFixture for MySqlFixture {
    fn name(&self) -> &str {
        self.name
    }

    fn message_storage(&self) -> Arc<dyn MessageStorage> {
        Arc::clone(&self.storage) as Arc<dyn MessageStorage>
    }

    fn runner_storage(&self, expiration: Duration) -> BoxFuture<'_, Arc<dyn RunnerStorage>> {
        Box::pin(async move {
            let storage = Arc::new(self.database.runner_storage(self.lock_mode, expiration).await);
            self.runner_storages.lock().expect("not poisoned").push(Arc::clone(&storage));
            storage as Arc<dyn RunnerStorage>
        })
    }

    fn kill_runner_storage(&self, storage: Arc<dyn RunnerStorage>) -> BoxFuture<'_, ()> {
        let mut kept = self.runner_storages.lock().expect("not poisoned");
        kept.retain(|kept| !std::ptr::addr_eq(Arc::as_ptr(kept), Arc::as_ptr(&storage)));
        drop(kept);
        drop(storage);
        Box::pin(std::future::ready(()))
    }

    /// The default `value_bytes_max`, capped by the `TEXT` columns: 65,535 bytes.
    fn value_bytes_max(&self) -> usize {
        self.storage.value_bytes_max().get()
    }

    /// The default `value_bytes_max`, capped by a row within the default `max_allowed_packet`:
    /// 16,711,680 bytes.
    fn state_bytes_max(&self) -> usize {
        self.storage.state_bytes_max().get()
    }

    fn corrupt(&self, corruption: Corruption) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let (table, set, id) = match &corruption {
                Corruption::MessagePayload(id) => ("messages", "payload = 'not json {'", *id),
                Corruption::ReplyPayload(id) => ("replies", "payload = 'not json ['", *id),
                Corruption::StateValue(address) => {
                    let table = self.database.table("entity_state");
                    let sql = format!(
                        "UPDATE `{table}` SET value = 'not json {{' \
                         WHERE entity_type = ? AND entity_id = ?"
                    );
                    let key = (address.entity_type.as_str(), address.entity_id.as_str());
                    let mut conn = self.database.admin.get_conn().await.expect("a connection");
                    conn.exec_drop(sql, key).await.expect("corrupt the state");
                    assert_eq!(conn.affected_rows(), 1, "corrupting {corruption:?}");
                    return;
                }
            };
            let table = self.database.table(table);
            self.database.exec(&format!("UPDATE `{table}` SET {set} WHERE id = {id}")).await;
        })
    }

    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let MySqlFixture { database, storage, runner_storages, .. } = *self;
            // Close the lock sessions before dropping their tables.
            drop(runner_storages);
            drop(storage);
            database.drop_tables().await;
        })
    }
}

mod advisory {
    cluster_testkit::storage_suite!(super::advisory_fixture);
}

mod lease {
    cluster_testkit::storage_suite!(super::lease_fixture);
}

// --- Helpers ------------------------------------------------------------------------------------

fn shard(id: u32) -> ShardId {
    ShardId::new(ShardGroup::from("default"), id)
}

fn address(entity_id: &str, shard_id: u32) -> EntityAddress {
    EntityAddress {
        shard_id: shard(shard_id),
        entity_type: EntityType::from("TestEntity"),
        entity_id: EntityId::from(entity_id),
    }
}

fn request(id: u64, entity_id: &str) -> Request {
    Request {
        request_id: Snowflake::new(id),
        address: address(entity_id, 1),
        tag: "GetUser".into(),
        payload: RawJson::from_json(format!(r#"{{"id":{id}}}"#)).expect("valid JSON"),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    }
}

fn now() -> Timestamp {
    SystemClock.now()
}

fn runner(host: &str) -> Runner {
    Runner::new(
        RunnerAddress::new(host, 34431),
        vec![ShardGroup::from("default")],
        RunnerWeight::ONE,
    )
}

async fn save(storage: &dyn MessageStorage, request: &Request) {
    let saved = storage.save_request(request, &SaveRequestOptions::default()).await;
    assert_eq!(saved.expect("save_request"), SaveResult::Success);
}

/// The ids of the messages an unprocessed read of shard 1 claims.
async fn claim_ids(storage: &dyn MessageStorage) -> Vec<u64> {
    let batch = storage
        .unprocessed_messages(&[shard(1)], now(), UnprocessedOptions::default())
        .await
        .expect("claim");
    batch.messages.iter().map(|message| message.envelope.id().get()).collect()
}

// --- Schema and migrations ----------------------------------------------------------------------

/// One column as the reference's DDL declares it: name, data type, character length,
/// nullable, default (normalised), auto-increment.
type ColumnSpec = (&'static str, &'static str, Option<u64>, bool, Option<&'static str>, bool);

/// The reference's MySQL DDL (`effect/src/cluster/SqlRunnerStorage.ts`,
/// `effect/src/cluster/SqlMessageStorage.ts`; effect's `Migrator.ts` for the histories).
fn reference_schema() -> Vec<(&'static str, Vec<ColumnSpec>)> {
    let (n, y) = (false, true);
    vec![
        (
            "messages",
            vec![
                ("id", "bigint", None, n, None, n),
                ("rowid", "bigint", None, n, None, y),
                ("message_id", "varchar", Some(255), y, None, n),
                ("shard_id", "varchar", Some(50), n, None, n),
                ("entity_type", "varchar", Some(150), n, None, n),
                ("entity_id", "varchar", Some(255), n, None, n),
                ("kind", "int", None, n, None, n),
                ("tag", "varchar", Some(50), y, None, n),
                ("payload", "text", Some(65_535), y, None, n),
                ("headers", "text", Some(65_535), y, None, n),
                ("trace_id", "varchar", Some(32), y, None, n),
                ("span_id", "varchar", Some(16), y, None, n),
                ("sampled", "tinyint", None, y, None, n),
                ("processed", "tinyint", None, n, Some("0"), n),
                ("request_id", "bigint", None, n, None, n),
                ("reply_id", "bigint", None, y, None, n),
                ("last_reply_id", "bigint", None, y, None, n),
                ("last_read", "datetime", None, y, None, n),
                ("deliver_at", "bigint", None, y, None, n),
            ],
        ),
        (
            "replies",
            vec![
                ("id", "bigint", None, n, None, n),
                ("rowid", "bigint", None, n, None, y),
                ("kind", "int", None, y, None, n),
                ("request_id", "bigint", None, n, None, n),
                ("payload", "text", Some(65_535), n, None, n),
                ("sequence", "int", None, y, None, n),
                ("acked", "tinyint", None, n, Some("0"), n),
            ],
        ),
        (
            "runners",
            vec![
                ("machine_id", "int", None, n, None, y),
                ("address", "varchar", Some(255), n, None, n),
                ("runner", "text", Some(65_535), n, None, n),
                ("healthy", "tinyint", None, n, Some("1"), n),
                ("last_heartbeat", "datetime", None, n, Some("current_timestamp"), n),
            ],
        ),
        (
            "locks",
            vec![
                ("shard_id", "varchar", Some(50), n, None, n),
                ("address", "varchar", Some(255), n, None, n),
                ("acquired_at", "datetime", None, n, None, n),
            ],
        ),
        ("migrations", history_columns()),
        ("runner_migrations", history_columns()),
    ]
}

fn history_columns() -> Vec<ColumnSpec> {
    vec![
        ("migration_id", "int", None, false, None, false),
        ("created_at", "timestamp", None, false, Some("current_timestamp"), false),
        ("name", "varchar", Some(255), false, None, false),
    ]
}

/// A column as `information_schema.columns` describes it, normalised across MySQL and
/// MariaDB.
#[derive(Debug, PartialEq, Eq)]
struct Column {
    name: String,
    data_type: String,
    length: Option<u64>,
    nullable: bool,
    default: Option<String>,
    auto_increment: bool,
}

impl Column {
    fn from_spec(spec: ColumnSpec) -> Column {
        let (name, data_type, length, nullable, default, auto_increment) = spec;
        Column {
            name: name.to_owned(),
            data_type: data_type.to_owned(),
            length,
            nullable,
            default: default.map(str::to_owned),
            auto_increment,
        }
    }

    /// A row of `COLUMN_NAME, DATA_TYPE, CHARACTER_MAXIMUM_LENGTH, IS_NULLABLE,
    /// COLUMN_DEFAULT, EXTRA`.
    fn from_row(row: Row) -> Column {
        let (name, data_type, length, nullable, default, extra): ColumnRow =
            mysql_async::from_row(row);
        Column {
            name,
            data_type,
            length,
            nullable: nullable == "YES",
            default: normalised_default(default),
            auto_increment: extra.contains("auto_increment"),
        }
    }
}

type ColumnRow = (String, String, Option<u64>, String, Option<String>, String);

/// MariaDB reports a nullable column without default as the text `NULL` and
/// `CURRENT_TIMESTAMP` as `current_timestamp()`; MySQL as SQL NULL and `CURRENT_TIMESTAMP`.
fn normalised_default(default: Option<String>) -> Option<String> {
    let default = default?;
    if default.eq_ignore_ascii_case("NULL") {
        return None;
    }
    Some(default.to_ascii_lowercase().trim_end_matches("()").to_owned())
}

/// The index columns of a table: `(unique, [columns])`, sorted.
async fn indexes(database: &Database, table: &str) -> Vec<(String, bool, String)> {
    let rows = database
        .rows(&format!(
            "SELECT INDEX_NAME, NON_UNIQUE, GROUP_CONCAT(COLUMN_NAME ORDER BY SEQ_IN_INDEX) \
             FROM information_schema.statistics \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{}' \
             GROUP BY INDEX_NAME, NON_UNIQUE ORDER BY INDEX_NAME",
            database.table(table)
        ))
        .await;
    rows.into_iter()
        .map(|row| {
            let (name, non_unique, columns): (String, i64, String) = mysql_async::from_row(row);
            (name, non_unique == 0, columns)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_matches_the_reference_ddl() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    for (table, expected) in reference_schema() {
        let rows = database
            .rows(&format!(
                "SELECT COLUMN_NAME, DATA_TYPE, CHARACTER_MAXIMUM_LENGTH, IS_NULLABLE, \
                 COLUMN_DEFAULT, EXTRA FROM information_schema.columns \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{}' ORDER BY ORDINAL_POSITION",
                database.table(table)
            ))
            .await;
        let actual: Vec<Column> = rows.into_iter().map(Column::from_row).collect();
        let expected: Vec<Column> = expected.into_iter().map(Column::from_spec).collect();
        assert_eq!(actual, expected, "columns of {table}");
    }
    let messages = database.table("messages");
    let replies = database.table("replies");
    let unique = |columns: &str| (true, columns.to_owned());
    let index_shape = |indexes: Vec<(String, bool, String)>| -> Vec<(bool, String)> {
        let mut shape: Vec<(bool, String)> =
            indexes.into_iter().map(|(_, unique, columns)| (unique, columns)).collect();
        shape.sort();
        shape
    };
    let mut expected = vec![
        unique("rowid"),
        unique("id"),
        unique("message_id"),
        (false, "shard_id,processed,last_read,deliver_at".to_owned()),
        (false, "request_id".to_owned()),
    ];
    expected.sort();
    let message_indexes = indexes(&database, "messages").await;
    assert!(message_indexes.iter().any(|(name, ..)| *name == format!("{messages}_shard_idx")));
    assert!(message_indexes.iter().any(|(name, ..)| *name == format!("{messages}_request_id_idx")));
    assert_eq!(index_shape(message_indexes), expected);
    let mut expected = vec![
        unique("rowid"),
        unique("id"),
        unique("request_id,kind"),
        unique("request_id,sequence"),
        (false, "request_id,kind,acked".to_owned()),
    ];
    expected.sort();
    let reply_indexes = indexes(&database, "replies").await;
    assert!(
        reply_indexes.iter().any(|(name, ..)| *name == format!("{replies}_request_lookup_idx"))
    );
    assert_eq!(index_shape(reply_indexes), expected);
    let mut expected = vec![unique("machine_id"), unique("address")];
    expected.sort();
    assert_eq!(index_shape(indexes(&database, "runners").await), expected);
    assert_eq!(index_shape(indexes(&database, "locks").await), [unique("shard_id")]);
    database.drop_tables().await;
}

async fn history(database: &Database, table: &str) -> Vec<(u32, String)> {
    let rows = database
        .rows(&format!(
            "SELECT migration_id, name FROM `{}` ORDER BY migration_id",
            database.table(table)
        ))
        .await;
    rows.into_iter().map(mysql_async::from_row).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_recorded_and_idempotent() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let messages_history =
        vec![(1, "create_tables".to_owned()), (2, "entity_type_size".to_owned())];
    let runners_history = vec![(1, "create_tables".to_owned())];
    assert_eq!(history(&database, "migrations").await, messages_history);
    assert_eq!(history(&database, "runner_migrations").await, runners_history);
    // Again, and twice at once: nothing changes and nothing fails.
    database.migrate().await;
    let (first, second) = tokio::join!(
        migrate_messages(&database.admin, &database.prefix),
        migrate_messages(&database.admin, &database.prefix)
    );
    first.expect("first concurrent migration");
    second.expect("second concurrent migration");
    assert_eq!(history(&database, "migrations").await, messages_history);
    // Tables that exist without a history (a deployment older than the history) are adopted:
    // the migrations run again and ignore the indexes that exist.
    let storage = database.message_storage(database.pool(2)).await;
    save(&storage, &request(1, "e1")).await;
    database.exec(&format!("DROP TABLE `{}`", database.table("migrations"))).await;
    database.exec(&format!("DROP TABLE `{}`", database.table("runner_migrations"))).await;
    database.migrate().await;
    assert_eq!(history(&database, "migrations").await, messages_history);
    assert_eq!(history(&database, "runner_migrations").await, runners_history);
    let batch = storage
        .unprocessed_messages(&[shard(1)], now(), UnprocessedOptions::default())
        .await
        .expect("read after re-migrating");
    assert_eq!(batch.messages.len(), 1, "the data survived");
    drop(storage);
    database.drop_tables().await;
}

/// The columns compared for identity: `(table, column)`.
const KEY_COLUMNS: [(&str, &str); 10] = [
    ("messages", "message_id"),
    ("messages", "shard_id"),
    ("messages", "entity_type"),
    ("messages", "entity_id"),
    ("runners", "address"),
    ("locks", "shard_id"),
    ("locks", "address"),
    ("entity_state", "entity_type"),
    ("entity_state", "entity_id"),
    ("entity_state", "shard_id"),
];

/// The collation of every column in [`KEY_COLUMNS`], in that order.
async fn key_collations(database: &Database) -> Vec<String> {
    let mut collations = Vec::new();
    for (table, column) in KEY_COLUMNS {
        let rows = database
            .rows(&format!(
                "SELECT COLLATION_NAME FROM information_schema.columns \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{}' AND COLUMN_NAME = '{column}'",
                database.table(table)
            ))
            .await;
        let collation: Vec<String> = rows.into_iter().map(mysql_async::from_row).collect();
        collations.extend(collation);
    }
    collations
}

/// Whether `collation` compares bytes, trailing spaces included (MySQL's `utf8mb4_0900_bin`,
/// MariaDB's `utf8mb4_nopad_bin`).
fn compares_bytes(collation: &str) -> bool {
    collation == "utf8mb4_0900_bin" || collation == "utf8mb4_nopad_bin"
}

/// Every key column compares bytes after a migration, also on tables created with the
/// database's default collation (by the reference, or by an earlier version of this crate):
/// those are converted with their rows, and the reference's history is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_columns_compare_bytes_after_migration() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let collations = key_collations(&database).await;
    assert_eq!(collations.len(), KEY_COLUMNS.len(), "{collations:?}");
    assert!(collations.iter().all(|collation| compares_bytes(collation)), "{collations:?}");
    // The reference's tables (and ours, made by hand): every text column in the database's
    // default collation.
    for table in ["messages", "runners", "locks", "entity_state"] {
        database
            .exec(&format!(
                "ALTER TABLE `{}` CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci",
                database.table(table)
            ))
            .await;
    }
    let collations = key_collations(&database).await;
    assert!(collations.iter().all(|collation| collation == "utf8mb4_general_ci"), "{collations:?}");
    let storage = database.message_storage(database.pool(2)).await;
    let keyed = |request: &Request| SaveRequestOptions {
        primary_key: Some(primary_key(&request.address, &request.tag, "k")),
        deliver_at: None,
    };
    let alice = request(1, "Alice");
    assert_eq!(
        storage.save_request(&alice, &keyed(&alice)).await.expect("save"),
        SaveResult::Success
    );
    drop(storage);
    database.migrate().await;
    let collations = key_collations(&database).await;
    assert!(collations.iter().all(|collation| compares_bytes(collation)), "{collations:?}");
    let messages_history =
        vec![(1, "create_tables".to_owned()), (2, "entity_type_size".to_owned())];
    assert_eq!(history(&database, "migrations").await, messages_history);
    assert_eq!(history(&database, "runner_migrations").await, [(1, "create_tables".to_owned())]);
    let storage = database.message_storage(database.pool(2)).await;
    let lower = request(2, "alice");
    let saved = storage.save_request(&lower, &keyed(&lower)).await.expect("save");
    assert_eq!(saved, SaveResult::Success, "alice's request is not Alice's");
    let again = request(3, "Alice");
    let duplicate = storage.save_request(&again, &keyed(&again)).await.expect("save");
    assert!(
        matches!(duplicate, SaveResult::Duplicate { original_id, .. } if original_id == Snowflake::new(1)),
        "the converted row is still found: {duplicate:?}"
    );
    drop(storage);
    database.drop_tables().await;
}

/// The columns of the entity state table.
async fn state_columns(database: &Database) -> Vec<Column> {
    let rows = database
        .rows(&format!(
            "SELECT COLUMN_NAME, DATA_TYPE, CHARACTER_MAXIMUM_LENGTH, IS_NULLABLE, \
             COLUMN_DEFAULT, EXTRA FROM information_schema.columns \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{}' ORDER BY ORDINAL_POSITION",
            database.table("entity_state")
        ))
        .await;
    rows.into_iter().map(Column::from_row).collect()
}

/// The entity state table is ours: created by the message migrations with the messages'
/// columns for its key (in a byte-wise collation), without a history row, and again when it
/// is missing; its times are the database's clock in UTC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_entity_state_table_is_created_outside_the_history() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let n = false;
    let expected: Vec<Column> = vec![
        ("entity_type", "varchar", Some(150), n, None, n),
        ("entity_id", "varchar", Some(255), n, None, n),
        ("shard_id", "varchar", Some(50), n, None, n),
        ("value", "mediumtext", Some(16_777_215), n, None, n),
        ("revision", "bigint", None, n, None, n),
        ("updated_at", "datetime", None, n, None, n),
    ]
    .into_iter()
    .map(Column::from_spec)
    .collect();
    assert_eq!(state_columns(&database).await, expected);
    let primary = indexes(&database, "entity_state").await;
    assert_eq!(primary, [("PRIMARY".to_owned(), true, "entity_type,entity_id".to_owned())]);
    let messages_history =
        vec![(1, "create_tables".to_owned()), (2, "entity_type_size".to_owned())];
    assert_eq!(history(&database, "migrations").await, messages_history);
    database.exec(&format!("DROP TABLE `{}`", database.table("entity_state"))).await;
    database.migrate().await;
    assert_eq!(state_columns(&database).await, expected, "the table is back");
    assert_eq!(history(&database, "migrations").await, messages_history);
    let storage = database.message_storage(database.pool(2)).await;
    let write = StateWrite { address: address("e1", 7), expected: 0, value: Some(RawJson::null()) };
    storage.save_state(&write).await.expect("save a state");
    let rows = database
        .rows(&format!(
            "SELECT shard_id, ABS(TIMESTAMPDIFF(SECOND, updated_at, UTC_TIMESTAMP())) FROM `{}`",
            database.table("entity_state")
        ))
        .await;
    let (shard_id, age): (String, i64) = mysql_async::from_row(rows.into_iter().next().unwrap());
    assert_eq!(shard_id, shard(7).to_string());
    assert!(age < 60, "updated_at is UTC, {age} s from now");
    drop(storage);
    database.drop_tables().await;
}

// --- Time ---------------------------------------------------------------------------------------

/// Claims, heartbeats and leases are judged in UTC whatever the session's time zone. With
/// local times, the rows of a runner whose sessions are at -05:00 look ten hours old to one at
/// +05:00 (the same happens to one runner when daylight saving time starts): its claims are
/// taken again, its heartbeat looks expired and its leases are taken over. In the other
/// direction an abandoned lease would not expire for ten hours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn times_do_not_depend_on_the_session_time_zone() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let (west, east) = (database.opts_in_zone("-05:00"), database.opts_in_zone("+05:00"));
    for (opts, offset) in [(&west, "-05:00"), (&east, "+05:00")] {
        let mut conn = mysql_async::Conn::new(opts.clone()).await.expect("a connection");
        let zone: Option<String> =
            conn.query_first("SELECT @@session.time_zone").await.expect("the session's zone");
        assert_eq!(zone.as_deref(), Some(offset));
        conn.disconnect().await.expect("disconnect");
    }
    let west_messages = database.message_storage(Pool::new(west.clone())).await;
    let east_messages = database.message_storage(Pool::new(east.clone())).await;
    save(&west_messages, &request(1, "e1")).await;
    assert_eq!(claim_ids(&west_messages).await, [1]);
    assert!(claim_ids(&east_messages).await.is_empty(), "a fresh claim was taken again");

    let runner_storage = |opts: &Opts, expiration: Duration| {
        let (opts, options) = (opts.clone(), database.options(LockMode::Lease, expiration));
        async move {
            MySqlRunnerStorage::new(Pool::new(opts.clone()), opts, options)
                .await
                .expect("open a runner storage")
        }
    };
    let west_runners = runner_storage(&west, LONG_EXPIRATION).await;
    let east_runners = runner_storage(&east, LONG_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    west_runners.register(&a, true).await.expect("register a");
    east_runners.register(&b, true).await.expect("register b");
    for storage in [&west_runners, &east_runners] {
        let mut runners = storage.get_runners().await.expect("get_runners");
        runners.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(runners, [(a.clone(), true), (b.clone(), true)], "a live heartbeat was hidden");
    }
    assert_eq!(west_runners.acquire(&a.address, &[shard(1)]).await.expect("acquire"), [shard(1)]);
    let taken = east_runners.acquire(&b.address, &[shard(1)]).await.expect("acquire");
    assert!(taken.is_empty(), "a live lease was taken over");
    // Unregistering also removes expired runners; a live one stays.
    east_runners.unregister(&b.address).await.expect("unregister b");
    assert_eq!(west_runners.get_runners().await.expect("get_runners"), [(a.clone(), true)]);

    // A lease written at +05:00 and abandoned expires for a runner at -05:00.
    let expiration = Duration::from_secs(2);
    let abandoned = runner_storage(&east, expiration).await;
    let taker = Arc::new(runner_storage(&west, expiration).await);
    assert_eq!(abandoned.acquire(&b.address, &[shard(2)]).await.expect("acquire"), [shard(2)]);
    eventually_async("the abandoned lease expires", || {
        let (taker, a) = (Arc::clone(&taker), a.clone());
        async move { taker.acquire(&a.address, &[shard(2)]).await.is_ok_and(|got| !got.is_empty()) }
    })
    .await;
    drop((west_messages, east_messages, west_runners, east_runners, abandoned, taker));
    database.drop_tables().await;
}

// --- Lock sessions ------------------------------------------------------------------------------

/// A holder that is frozen (acquired, then silent) loses its advisory locks when the server
/// ends its idle session after `wait_timeout` (= the expiration), and another storage gets
/// them; the frozen storage then reports them lost and recovers a working session by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_advisory_holder_loses_its_locks_after_wait_timeout() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let expiration = Duration::from_secs(2);
    let frozen = database.runner_storage(LockMode::Advisory, expiration).await;
    let taker = Arc::new(database.runner_storage(LockMode::Advisory, expiration).await);
    let (a, b) = (runner("a"), runner("b"));
    let wanted = vec![shard(1), shard(2)];
    assert_eq!(frozen.acquire(&a.address, &wanted).await.expect("acquire"), wanted);
    assert!(taker.acquire(&b.address, &wanted).await.expect("acquire").is_empty());
    let started = Instant::now();
    eventually_async("the frozen session ends", || {
        let taker = Arc::clone(&taker);
        let (b, wanted) = (b.clone(), wanted.clone());
        async move { taker.acquire(&b.address, &wanted).await.is_ok_and(|got| got == wanted) }
    })
    .await;
    assert!(started.elapsed() >= Duration::from_secs(1), "taken over before wait_timeout");
    // The frozen storage learns it lost them: an error (its session is gone) or an empty
    // refresh, never a re-acquisition.
    let refreshed = frozen.refresh(&a.address, &wanted).await;
    assert!(!refreshed.as_ref().is_ok_and(|held| !held.is_empty()), "{refreshed:?}");
    let refreshed = frozen.refresh(&a.address, &wanted).await.expect("a rebuilt session");
    assert!(refreshed.is_empty());
    taker.release_all(&b.address).await.expect("release_all");
    assert_eq!(frozen.acquire(&a.address, &wanted).await.expect("acquire again"), wanted);
    drop((frozen, taker));
    database.drop_tables().await;
}

/// Killing the reserved lock session: the next operation fails within its deadline or
/// succeeds on a rebuilt session, and the storage recovers without help. `acquire` retries
/// once, so it succeeds even on the first call after the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_lock_session_is_rebuilt() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let storage = database.runner_storage(LockMode::Advisory, LONG_EXPIRATION).await;
    let deadline = database.options(LockMode::Advisory, LONG_EXPIRATION).shard_lock_interval;
    let a = runner("a");
    let wanted = vec![shard(1)];
    assert_eq!(storage.acquire(&a.address, &wanted).await.expect("acquire"), wanted);
    let first_session = database.lock_holder(&shard(1)).await.expect("shard 1 is held");

    // Kill, then acquire: the retry on a new session takes the lock again (once the server
    // has finished ending the killed session).
    database.exec(&format!("KILL {first_session}")).await;
    let started = Instant::now();
    let acquired = storage.acquire(&a.address, &wanted).await;
    assert!(acquired.is_ok(), "acquire retries on a new session: {acquired:?}");
    assert!(started.elapsed() < deadline + Duration::from_secs(1));
    eventually_async("the lock is taken again", || async {
        storage.acquire(&a.address, &wanted).await.is_ok_and(|got| got == wanted)
    })
    .await;
    let second_session = database.lock_holder(&shard(1)).await.expect("shard 1 is held again");
    assert_ne!(second_session, first_session);

    // Kill, then refresh: it fails within its deadline or reports the lock lost, and the next
    // operations work.
    database.exec(&format!("KILL {second_session}")).await;
    let started = Instant::now();
    let refreshed = storage.refresh(&a.address, &wanted).await;
    assert!(started.elapsed() < deadline + Duration::from_secs(1));
    match &refreshed {
        Ok(held) => assert!(held.is_empty(), "a killed session's lock reported held"),
        Err(error) => assert_storage_error(error),
    }
    eventually_async("the storage recovers", || async {
        storage.acquire(&a.address, &wanted).await.is_ok_and(|got| got == wanted)
    })
    .await;
    assert_eq!(storage.refresh(&a.address, &wanted).await.expect("refresh"), wanted);
    // The probe never touches the lock session.
    assert!(storage.refresh(&a.address, &[]).await.expect("probe").is_empty());
    drop(storage);
    database.drop_tables().await;
}

fn assert_storage_error(error: &StorageError) {
    assert!(
        matches!(error.kind(), StorageErrorKind::Unavailable | StorageErrorKind::Timeout),
        "a lost connection is unavailability or a timeout: {error}"
    );
}

/// Killing a pooled connection: the operation that meets it fails with a storage error or
/// succeeds, and the next operations succeed on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_pool_connection_is_replaced() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    // One connection, so the next operation must meet the killed one.
    let pool = database.pool(1);
    let storage = database.message_storage(pool.clone()).await;
    save(&storage, &request(1, "e1")).await;
    let connection_id = {
        let mut conn = pool.get_conn().await.expect("a connection");
        conn.query_first::<u64, _>("SELECT CONNECTION_ID()").await.expect("id").expect("a row")
    };
    database.exec(&format!("KILL {connection_id}")).await;
    let first = storage.replies_for(&[Snowflake::new(1)]).await;
    if let Err(error) = &first {
        assert_storage_error(error);
    }
    eventually_async("the pool recovers", || async {
        storage.replies_for(&[Snowflake::new(1)]).await.is_ok()
    })
    .await;
    // Killed while in use, inside a transaction: the statement fails with a storage error,
    // and the pool replaces the connection.
    let mut transaction = storage.begin_transaction().await.expect("begin");
    let in_use = transaction
        .backend_as::<mysql_async::Transaction<'static>>()
        .expect("a mysql_async transaction")
        .query_first::<u64, _>("SELECT CONNECTION_ID()")
        .await
        .expect("id")
        .expect("a row");
    database.exec(&format!("KILL {in_use}")).await;
    let reply = Reply::WithExit(WithExit {
        request_id: Snowflake::new(1),
        id: Snowflake::new(10),
        exit: Exit::void(),
    });
    let saved = transaction.save_reply(&reply).await;
    assert_storage_error(&saved.expect_err("the connection was killed"));
    drop(transaction);
    save(&storage, &request(2, "e1")).await;
    let batch = storage
        .unprocessed_messages(&[shard(1)], now(), UnprocessedOptions::default())
        .await
        .expect("read");
    assert_eq!(batch.messages.len(), 2, "the killed transaction's reply was not stored");
    drop(storage);
    database.drop_tables().await;
}

/// Lock names longer than `GET_LOCK` accepts are refused as invalid input, without touching
/// (or losing) the lock session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlong_lock_names_are_invalid_input() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let storage = database.runner_storage(LockMode::Advisory, LONG_EXPIRATION).await;
    let a = runner("a");
    assert_eq!(storage.acquire(&a.address, &[shard(1)]).await.expect("acquire"), [shard(1)]);
    let long_group = ShardId::new(ShardGroup::from("g".repeat(60).as_str()), 1);
    let error = storage.acquire(&a.address, &[long_group]).await.expect_err("too long");
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    assert_eq!(storage.refresh(&a.address, &[shard(1)]).await.expect("refresh"), [shard(1)]);
    drop(storage);
    database.drop_tables().await;
}

/// An advisory lock session names its runner with an identity lock: `<prefix>:runner:<address>`
/// when that fits MySQL's 64 characters, a hash of a longer address otherwise; `release_all`
/// drops it and the next `acquire` takes it again. A lock held by a session that names no
/// runner (a TypeScript runner's) reads as that connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_holders_are_named_by_identity_locks() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let short = runner("short");
    let long = runner(&format!("runner-{}", "x".repeat(60)));
    assert!(format!("{}:runner:{}", database.prefix, long.address).len() > 64);
    let (storage_short, storage_long, reader) = (
        database.runner_storage(LockMode::Advisory, LONG_EXPIRATION).await,
        database.runner_storage(LockMode::Advisory, LONG_EXPIRATION).await,
        database.runner_storage(LockMode::Advisory, LONG_EXPIRATION).await,
    );
    storage_short.register(&short, true).await.expect("register");
    storage_long.register(&long, true).await.expect("register");
    assert_eq!(storage_short.acquire(&short.address, &[shard(1)]).await.unwrap(), [shard(1)]);
    assert_eq!(storage_long.acquire(&long.address, &[shard(2)]).await.unwrap(), [shard(2)]);
    // A bare session, as a TypeScript runner's.
    let mut bare = mysql_async::Conn::new(database.opts.clone()).await.expect("a connection");
    let name = format!("{}.{}", database.prefix, shard(3));
    let taken: Option<i64> =
        bare.exec_first("SELECT GET_LOCK(?, 0)", (name,)).await.expect("GET_LOCK");
    assert_eq!(taken, Some(1));
    let bare_id = database.lock_holder(&shard(3)).await.expect("shard 3 is held");

    let holders = |locks: Vec<ShardLock>| -> Vec<(u32, LockHolder)> {
        locks.into_iter().map(|lock| (lock.shard_id.id(), lock.holder)).collect()
    };
    let wanted = [shard(1), shard(2), shard(3), shard(4)];
    assert_eq!(
        holders(reader.shard_locks(&wanted).await.expect("shard_locks")),
        [
            (1, LockHolder::Runner(short.address.clone())),
            (2, LockHolder::Runner(long.address.clone())),
            (3, LockHolder::Session(format!("MySQL connection {bare_id}"))),
        ]
    );
    // The short address's identity lock has the readable name.
    let identity = format!("{}:runner:{}", database.prefix, short.address);
    let mut conn = database.admin.get_conn().await.expect("an admin connection");
    let identity_holder: Option<u64> =
        conn.exec_first("SELECT IS_USED_LOCK(?)", (identity,)).await.expect("IS_USED_LOCK");
    assert_eq!(identity_holder, database.lock_holder(&shard(1)).await);
    drop(conn);
    // Released with everything else, taken again by the next acquire.
    storage_short.release_all(&short.address).await.expect("release_all");
    assert_eq!(storage_short.acquire(&short.address, &[shard(4)]).await.unwrap(), [shard(4)]);
    assert_eq!(
        holders(reader.shard_locks(&[shard(1), shard(4)]).await.expect("shard_locks")),
        [(4, LockHolder::Runner(short.address.clone()))]
    );
    bare.disconnect().await.expect("disconnect");
    drop((storage_short, storage_long, reader));
    database.drop_tables().await;
}

// --- Rows ---------------------------------------------------------------------------------------

/// Rows with a malformed payload, kind or address are reported as malformed, stay claimed,
/// and do not stop the rows after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_rows_do_not_block_the_read() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let storage = database.message_storage(database.pool(2)).await;
    for id in 1..=5 {
        save(&storage, &request(id, &format!("e{id}"))).await;
    }
    let messages = database.table("messages");
    database.exec(&format!("UPDATE `{messages}` SET shard_id = 'no-colon' WHERE id = 2")).await;
    database.exec(&format!("UPDATE `{messages}` SET payload = '{{broken' WHERE id = 3")).await;
    database.exec(&format!("UPDATE `{messages}` SET kind = 9 WHERE id = 4")).await;
    let batch = storage
        .unprocessed_messages(&[shard(1)], now(), UnprocessedOptions::default())
        .await
        .expect("read");
    let delivered: Vec<u64> =
        batch.messages.iter().map(|message| message.envelope.id().get()).collect();
    assert_eq!(delivered, [1, 5]);
    let malformed: Vec<(u64, u64)> =
        batch.malformed.iter().map(|m| (m.id.get(), m.request_id.get())).collect();
    assert_eq!(malformed, [(3, 3), (4, 4)]);
    // The row whose address cannot be parsed is in no shard; reading by id reports it.
    let by_id = storage
        .unprocessed_messages_by_id(&[Snowflake::new(2), Snowflake::new(3)], now())
        .await
        .expect("by id");
    let malformed: Vec<u64> = by_id.malformed.iter().map(|m| m.id.get()).collect();
    assert_eq!(malformed, [2, 3]);
    assert!(by_id.messages.is_empty());
    let again = storage
        .unprocessed_messages(&[shard(1)], now(), UnprocessedOptions::default())
        .await
        .expect("read again");
    assert!(again.is_empty(), "the malformed rows stay claimed");
    drop(storage);
    database.drop_tables().await;
}

/// Values wider than their columns are refused as invalid input, never truncated (which
/// `INSERT IGNORE` would do with a mere warning).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlong_values_are_invalid_input() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let storage = database.message_storage(database.pool(2)).await;
    let keyed = SaveRequestOptions { primary_key: Some("k".to_owned()), deliver_at: None };
    let long_tag = Request { tag: "t".repeat(51).into(), ..request(1, "e1") };
    let error = storage.save_request(&long_tag, &keyed).await.expect_err("tag too long");
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    let big = format!("\"{}\"", "x".repeat(70_000));
    let big_payload =
        Request { payload: RawJson::from_json(big.clone()).expect("JSON"), ..request(2, "e1") };
    let error = storage.save_request(&big_payload, &keyed).await.expect_err("payload too big");
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    // Multi-byte characters count as characters, as the column does.
    let wide = Request { tag: "é".repeat(50).into(), ..request(3, "e1") };
    assert_eq!(storage.save_request(&wide, &keyed).await.expect("fits"), SaveResult::Success);
    save(&storage, &request(4, "e1")).await;
    let big_reply = Reply::WithExit(WithExit {
        request_id: Snowflake::new(4),
        id: Snowflake::new(40),
        exit: Exit::Success(RawJson::from_json(big).expect("JSON")),
    });
    let error = storage.save_reply(&big_reply).await.expect_err("reply too big");
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    drop(storage);
    database.drop_tables().await;
}

/// The transaction's backend handle is the `mysql_async` transaction: the handler's own
/// statements commit and roll back with the reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_backend_runs_the_handlers_statements() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let side = database.table("side");
    database.exec(&format!("CREATE TABLE `{side}` (v INT NOT NULL)")).await;
    let storage = database.message_storage(database.pool(2)).await;
    save(&storage, &request(1, "e1")).await;
    save(&storage, &request(2, "e1")).await;
    for (request_id, commit) in [(1_u64, true), (2, false)] {
        let mut transaction = storage.begin_transaction().await.expect("begin");
        let handle = transaction
            .backend_as::<mysql_async::Transaction<'static>>()
            .expect("a mysql_async transaction");
        handle
            .exec_drop(format!("INSERT INTO `{side}` (v) VALUES (?)"), (request_id,))
            .await
            .expect("the handler's statement");
        let reply = Reply::WithExit(WithExit {
            request_id: Snowflake::new(request_id),
            id: Snowflake::new(request_id * 10),
            exit: Exit::void(),
        });
        transaction.save_reply(&reply).await.expect("save_reply");
        if commit {
            transaction.commit().await.expect("commit");
        } else {
            drop(transaction);
        }
    }
    let rows = database.rows(&format!("SELECT v FROM `{side}` ORDER BY v")).await;
    let values: Vec<u64> = rows.into_iter().map(mysql_async::from_row).collect();
    assert_eq!(values, [1], "the committed statement only");
    let replies =
        storage.replies_for(&[Snowflake::new(1), Snowflake::new(2)]).await.expect("replies");
    assert_eq!(replies.iter().map(|reply| reply.id().get()).collect::<Vec<_>>(), [10]);
    database.exec(&format!("DROP TABLE `{side}`")).await;
    drop(storage);
    database.drop_tables().await;
}

/// Retried writes are idempotent: the same acknowledgement, interrupt or chunk saved twice is
/// stored once and changes nothing the second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_writes_are_idempotent() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let storage = database.message_storage(database.pool(2)).await;
    let stream = request(1, "e1");
    save(&storage, &stream).await;
    let chunk = |id: u64, sequence: u32| {
        let value = RawJson::from_json(sequence.to_string()).expect("JSON");
        Reply::Chunk(
            cluster_core::envelope::Chunk::new(
                Snowflake::new(1),
                Snowflake::new(id),
                sequence,
                vec![value],
            )
            .expect("a chunk"),
        )
    };
    storage.save_reply(&chunk(10, 0)).await.expect("chunk");
    let ack = cluster_core::envelope::AckChunk {
        id: Snowflake::new(11),
        address: stream.address.clone(),
        request_id: Snowflake::new(1),
        reply_id: Snowflake::new(10),
    };
    storage.save_ack_chunk(&ack).await.expect("ack");
    storage.save_ack_chunk(&ack).await.expect("the same ack again");
    storage.save_reply(&chunk(12, 1)).await.expect("second chunk");
    storage.save_reply(&chunk(10, 0)).await.expect("the first chunk again");
    let duplicate = storage
        .save_request(&request(2, "e1"), &SaveRequestOptions::default())
        .await
        .expect("another request");
    assert_eq!(duplicate, SaveResult::Success);
    // The retried first chunk did not become the latest reply again.
    let keyed = SaveRequestOptions { primary_key: Some("s".to_owned()), deliver_at: None };
    let keyed_stream = request(3, "e1");
    assert_eq!(
        storage.save_request(&keyed_stream, &keyed).await.expect("save"),
        SaveResult::Success
    );
    let chunk3 = |id: u64, sequence: u32| {
        let value = RawJson::from_json(sequence.to_string()).expect("JSON");
        Reply::Chunk(
            cluster_core::envelope::Chunk::new(
                Snowflake::new(3),
                Snowflake::new(id),
                sequence,
                vec![value],
            )
            .expect("a chunk"),
        )
    };
    storage.save_reply(&chunk3(30, 0)).await.expect("chunk");
    storage.save_reply(&chunk3(31, 1)).await.expect("chunk");
    storage.save_reply(&chunk3(30, 0)).await.expect("retried chunk");
    let result = storage.save_request(&request(4, "e1"), &keyed).await.expect("duplicate");
    assert_eq!(
        result,
        SaveResult::Duplicate {
            original_id: Snowflake::new(3),
            last_received_reply: Some(chunk3(31, 1))
        }
    );
    let all = storage.replies_for_unfiltered(&[Snowflake::new(1)]).await.expect("replies");
    assert_eq!(all.iter().map(|reply| reply.id().get()).collect::<Vec<_>>(), [10, 12]);
    let batch = storage
        .unprocessed_messages(&[shard(1)], now(), UnprocessedOptions::default())
        .await
        .expect("read");
    let ids: Vec<u64> = batch.messages.iter().map(|message| message.envelope.id().get()).collect();
    assert_eq!(ids, [2], "request 1 waits for its second chunk's ack; its ack row 11 is pending");
    drop(storage);
    database.drop_tables().await;
}

/// Fencing confirms a shard's lock before each final reply. `confirm` reports the locks still
/// held, as `refresh` does, without writing the runner's heartbeat: that is one registry row,
/// and one write of it per reply made the row the cluster's bottleneck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_reports_the_held_locks_without_a_heartbeat() {
    let Some(database) = Database::new() else { return };
    database.migrate().await;
    let runners_table = database.table("runners");
    for (mode, host) in
        [(LockMode::Advisory, "confirm-advisory"), (LockMode::Lease, "confirm-lease")]
    {
        let runners = database.runner_storage(mode, Duration::from_secs(60)).await;
        let owner = runner(host);
        runners.register(&owner, true).await.unwrap();
        let held = vec![shard(1), shard(2)];
        assert_eq!(runners.acquire(&owner.address, &held).await.unwrap(), held);
        // An old heartbeat: any write of it shows.
        let address = owner.address.to_string();
        database
            .exec(&format!(
                "UPDATE `{runners_table}` SET last_heartbeat = '2000-01-01 00:00:00' \
                 WHERE address = '{address}'"
            ))
            .await;
        let heartbeat_sql = format!(
            "SELECT CAST(last_heartbeat AS CHAR) FROM `{runners_table}` WHERE address = '{address}'"
        );
        let heartbeat = || async {
            let rows = database.rows(&heartbeat_sql).await;
            rows.first().and_then(|row| row.get::<String, _>(0)).unwrap_or_default()
        };
        let asked = vec![shard(1), shard(2), shard(3)];
        assert_eq!(runners.confirm(&owner.address, &asked).await.unwrap(), held, "{mode:?}");
        assert!(
            heartbeat().await.starts_with("2000-01-01"),
            "{mode:?}: confirm wrote the heartbeat"
        );
        assert_eq!(runners.refresh(&owner.address, &asked).await.unwrap(), held, "{mode:?}");
        assert!(
            !heartbeat().await.starts_with("2000-01-01"),
            "{mode:?}: refresh keeps the heartbeat"
        );
        runners.release_all(&owner.address).await.unwrap();
    }
    database.drop_tables().await;
}

/// A storage that cannot open names the server it tried, the cause (the OS error, or the
/// server's own message) and what to check, so that a new user need not guess.
#[tokio::test]
async fn a_failed_connect_names_the_server_the_cause_and_the_fix() {
    let options = SqlStorageOptions::from_config(&ShardingConfig::default(), unique_prefix());
    let port = crate::closed_port();
    let down = format!("mysql://root@127.0.0.1:{port}/test");
    let Err(error) = MySqlMessageStorage::connect(&down, &options).await else {
        panic!("connected to a closed port");
    };
    let shown = error.to_string();
    assert_eq!(error.kind(), StorageErrorKind::Unavailable, "{shown}");
    assert!(shown.contains(&format!("127.0.0.1:{port}")), "the host and port: {shown}");
    assert!(shown.contains("os error"), "the OS error: {shown}");
    assert!(shown.contains("check that MySQL"), "what to do: {shown}");

    let Some(url) = database_url("CLUSTER_TEST_MYSQL_URL") else { return };
    let opts = Opts::from_url(&url).unwrap();
    let password = opts.pass().map(|password| format!(":{password}")).unwrap_or_default();
    let wrong = format!(
        "mysql://{}{password}@{}:{}/cluster_no_such_database",
        opts.user().unwrap_or("root"),
        opts.ip_or_hostname(),
        opts.tcp_port()
    );
    let Err(error) = MySqlRunnerStorage::connect(&wrong, options).await else {
        panic!("connected to a database that does not exist");
    };
    let shown = error.to_string();
    assert!(shown.contains("cluster_no_such_database"), "the server's message: {shown}");
    assert!(shown.contains("create the database"), "what to do: {shown}");
}
