//! The MySQL (and MariaDB) backend: [`MySqlMessageStorage`] and [`MySqlRunnerStorage`] on a
//! `mysql_async` pool, with the reference's tables, migrations and lock names, so a database
//! can be shared with TypeScript runners (`effect/src/cluster/SqlRunnerStorage.ts`,
//! `effect/src/cluster/MessageStorage.ts`).
//!
//! - `queries`: every SQL text (DDL and statements), built once per table prefix.
//! - `message_storage`: mailboxes and replies on the pool.
//! - `runner_storage`: the runner registry on the pool, and the deadlines of lock operations.
//! - `shard_lock`: the reserved lock session (advisory `GET_LOCK` or lease rows), rebuilt after
//!   failures.
//! - `queue_storage`: the persisted queue on the pool, in the reference's `effect_queue` table.
//!
//! This module holds what they share: driver error classification, reading columns without
//! panicking, closing a connection without waiting for an unresponsive server, and effect's
//! SQL migrator (`Migrator.ts`, MySQL dialect) guarded by `GET_LOCK`.
//!
//! MariaDB notes: `RELEASE_ALL_LOCKS()` exists from MariaDB 10.5 (MySQL 5.7), and
//! `IS_USED_LOCK` reports the holder's connection id.
//!
//! The reference's text columns take the database's default collation, which ignores case and
//! accents; the migrations here also declare the columns compared for identity with a
//! byte-wise collation (`queries::KEY_COLLATIONS`), outside the reference's history.

mod message_storage;
mod queries;
mod queue_storage;
mod runner_storage;
mod shard_lock;

use std::future::Future;
use std::task::{Context, Waker};
use std::time::Duration;

use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, DriverError, Pool, Row, Value};
use tracing::Instrument;

use crate::options::TablePrefix;

pub use message_storage::{MySqlMessageStorage, MySqlTransactionGuard};
pub use queue_storage::MySqlQueueStorage;
pub use runner_storage::MySqlRunnerStorage;

/// The default number of pooled connections of [`pool`].
pub const POOL_SIZE_DEFAULT: usize = 16;

/// A pool of at most `size_max` connections to the `mysql://` URL `url`, set up as the storages
/// want it: idle connections are kept for a minute (a `mysql_async` pool with no inactive TTL
/// closes every connection it gets back) and are not reset on checkout (a reset drops their
/// prepared statements).
pub fn pool(url: &str, size_max: usize) -> Result<Pool, StorageError> {
    let opts = mysql_async::Opts::from_url(url).map_err(|error| {
        StorageError::with_source(StorageErrorKind::InvalidInput, "invalid MySQL URL", error)
    })?;
    let constraints = mysql_async::PoolConstraints::new(0, size_max.max(1)).ok_or_else(|| {
        StorageError::new(StorageErrorKind::InvalidInput, "invalid MySQL pool size")
    })?;
    let pool_opts = mysql_async::PoolOpts::default()
        .with_constraints(constraints)
        .with_inactive_connection_ttl(Duration::from_secs(60))
        .with_reset_connection(false);
    Ok(Pool::new(mysql_async::OptsBuilder::from_opts(opts).pool_opts(pool_opts)))
}

/// How long a migration waits for another process's migration of the same tables.
const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(60);

/// Creates or upgrades the message storage tables (`<prefix>_messages`, `<prefix>_replies`),
/// recording the migrations in `<prefix>_migrations` as effect's SQL migrator does. Idempotent;
/// concurrent callers are serialised by a `GET_LOCK` on the history table's name.
///
/// Then, on every call and without a history row, the columns compared for identity
/// (`message_id`, `shard_id`, `entity_type`, `entity_id`) get a byte-wise collation if they do
/// not have it: the reference's tables ignore case and accents. Converting existing tables
/// rebuilds them once.
///
/// # Cancel safety
///
/// Not cancel safe, but idempotent: every statement is `IF NOT EXISTS` or has its errors
/// ignored, and a migration is recorded only after it ran, so running again completes it. A
/// dropped call closes its connection, which releases the migration lock.
pub async fn migrate_messages(pool: &Pool, prefix: &TablePrefix) -> Result<(), StorageError> {
    let history = prefix.table("migrations");
    let migrations = queries::message_migrations(prefix);
    run_migrations(pool, &history, migrations, queries::message_key_columns(prefix)).await
}

/// Creates or upgrades the runner storage tables (`<prefix>_runners`, `<prefix>_locks`),
/// recording the migrations in `<prefix>_runner_migrations` (a separate history, because the
/// ids overlap with the message storage's). Idempotent and serialised like
/// [`migrate_messages`], and gives runner addresses and lease rows a byte-wise collation as
/// [`migrate_messages`] does for messages.
///
/// # Cancel safety
///
/// As [`migrate_messages`].
pub async fn migrate_runners(pool: &Pool, prefix: &TablePrefix) -> Result<(), StorageError> {
    let history = prefix.table("runner_migrations");
    let migrations = queries::runner_migrations(prefix);
    run_migrations(pool, &history, migrations, queries::runner_key_columns(prefix)).await
}

/// Effect's migrator, MySQL dialect: ensure the history table, then run every migration newer
/// than the latest recorded one and record it (`migration_id`, `name`).
///
/// Effect records the pending ids first, inside a transaction, and treats a duplicate key as
/// "another process is migrating". MySQL commits implicitly at every DDL statement, so that
/// transaction protects nothing there; we hold a `GET_LOCK` instead and record each migration
/// after it ran. The history rows are the same, so either migrator can run after the other.
/// The key columns' collation is ours and is not recorded there.
pub(crate) async fn run_migrations(
    pool: &Pool,
    history: &str,
    migrations: Vec<queries::Migration>,
    key_columns: Vec<queries::KeyColumn>,
) -> Result<(), StorageError> {
    let span = tracing::debug_span!("mysql.migrate", history);
    migrate_under_lock(pool, history, migrations, key_columns).instrument(span).await
}

async fn migrate_under_lock(
    pool: &Pool,
    history: &str,
    migrations: Vec<queries::Migration>,
    key_columns: Vec<queries::KeyColumn>,
) -> Result<(), StorageError> {
    let conn = pool.get_conn().await.map_err(|error| storage_error("migrate: connect", error))?;
    // Dropped on any error or cancellation: the connection is closed rather than returned to
    // the pool still holding the migration lock.
    let mut conn = ClosingConn::new(conn);
    let lock_name = format!("{history}:migrate");
    conn.get()
        .query_drop(queries::history_table_ddl(history))
        .await
        .map_err(|error| storage_error("migrate: create the history table", error))?;
    let taken: Option<Option<i64>> = conn
        .get()
        .exec_first("SELECT GET_LOCK(?, ?)", (lock_name.as_str(), MIGRATION_LOCK_WAIT.as_secs()))
        .await
        .map_err(|error| storage_error("migrate: take the migration lock", error))?;
    if taken != Some(Some(1)) {
        return Err(StorageError::new(
            StorageErrorKind::Timeout,
            format!("migrate: another process held {lock_name} for {MIGRATION_LOCK_WAIT:?}"),
        ));
    }
    let latest: Option<Option<i64>> = conn
        .get()
        .query_first(format!("SELECT MAX(migration_id) FROM `{history}`"))
        .await
        .map_err(|error| storage_error("migrate: read the history", error))?;
    let latest = latest.flatten().unwrap_or(0);
    for migration in migrations.into_iter().filter(|m| i64::from(m.id) > latest) {
        run_migration(conn.get(), history, &migration).await?;
    }
    // After the reference's migrations, whose `0002` declares `entity_type` again without a
    // collation.
    ensure_key_collations(conn.get(), &key_columns).await?;
    conn.get()
        .exec_drop("SELECT RELEASE_LOCK(?)", (lock_name.as_str(),))
        .await
        .map_err(|error| storage_error("migrate: release the migration lock", error))?;
    // Clean: back to the pool.
    drop(conn.into_inner());
    Ok(())
}

async fn run_migration(
    conn: &mut Conn,
    history: &str,
    migration: &queries::Migration,
) -> Result<(), StorageError> {
    let id = migration.id;
    let name = migration.name;
    tracing::debug!(history, id, name, "running migration");
    for statement in &migration.statements {
        match conn.query_drop(statement.sql.as_str()).await {
            Ok(()) => {}
            Err(mysql_async::Error::Server(error)) if statement.ignore_server_errors => {
                // The reference ignores these (an index that already exists, a column that is
                // already resized).
                tracing::debug!(history, id, code = error.code, "ignored: {}", error.message);
            }
            Err(error) => {
                return Err(storage_error(&format!("migration {id:04}_{name} failed"), error));
            }
        }
    }
    let record = format!("INSERT INTO `{history}` (migration_id, name) VALUES (?, ?)");
    match conn.exec_drop(record, (id, name)).await {
        Ok(()) => Ok(()),
        // Recorded meanwhile by a migrator that does not take our lock (effect's own).
        Err(mysql_async::Error::Server(error)) if error.code == ER_DUP_ENTRY => Ok(()),
        Err(error) => Err(storage_error("migrate: record the migration", error)),
    }
}

/// Declares every key column that lacks it with the best byte-wise collation the server has,
/// one `ALTER TABLE` per table. Columns that have it are left alone, so this is a catalog read
/// on every call but the first.
async fn ensure_key_collations(
    conn: &mut Conn,
    key_columns: &[queries::KeyColumn],
) -> Result<(), StorageError> {
    let names: Vec<Value> = queries::KEY_COLLATIONS.iter().map(|name| Value::from(*name)).collect();
    let rows: Vec<Row> = conn
        .exec(queries::available_collations(), names)
        .await
        .map_err(|error| storage_error("migrate: read the collations", error))?;
    let mut available = Vec::with_capacity(rows.len());
    for row in rows {
        available.extend(Columns::new(row).text().map_err(malformed_catalog)?);
    }
    let Some(collation) =
        queries::KEY_COLLATIONS.into_iter().find(|name| available.iter().any(|a| a == name))
    else {
        return Err(StorageError::new(
            StorageErrorKind::Other,
            "migrate: the server has no byte-wise utf8mb4 collation",
        ));
    };
    let mut tables: Vec<&str> = key_columns.iter().map(|key| key.table.as_str()).collect();
    tables.dedup();
    for table in tables {
        let rows: Vec<Row> = conn
            .exec(queries::COLUMN_COLLATIONS, (table,))
            .await
            .map_err(|error| storage_error("migrate: read the column collations", error))?;
        let mut current = Vec::with_capacity(rows.len());
        for row in rows {
            let mut columns = Columns::new(row);
            let name = columns.text().map_err(malformed_catalog)?;
            current.push((name, columns.text().map_err(malformed_catalog)?));
        }
        let stale: Vec<&queries::KeyColumn> = key_columns
            .iter()
            .filter(|key| key.table == table)
            .filter(|key| {
                !current.iter().any(|(name, current)| {
                    name.as_deref() == Some(key.column) && current.as_deref() == Some(collation)
                })
            })
            .collect();
        if stale.is_empty() {
            continue;
        }
        let columns: Vec<&str> = stale.iter().map(|key| key.column).collect();
        tracing::info!(
            table,
            ?columns,
            collation,
            "declaring key columns with a byte-wise collation"
        );
        conn.query_drop(queries::alter_key_collation(table, &stale, collation))
            .await
            .map_err(|error| storage_error(&format!("migrate: collation of {table}"), error))?;
    }
    Ok(())
}

/// A catalog row that cannot be read.
fn malformed_catalog(error: DecodeError) -> StorageError {
    StorageError::with_source(StorageErrorKind::Malformed, "migrate: unreadable catalog row", error)
}

/// MySQL's duplicate key error.
pub(crate) const ER_DUP_ENTRY: u16 = 1062;
/// InnoDB rolled the transaction back to break a deadlock.
const ER_LOCK_DEADLOCK: u16 = 1213;

/// Whether `error` is InnoDB rolling the transaction back to break a deadlock: nothing of it
/// was applied, so running it again is safe.
pub(crate) fn is_deadlock(error: &StorageError) -> bool {
    let source = std::error::Error::source(error);
    matches!(
        source.and_then(|source| source.downcast_ref::<mysql_async::Error>()),
        Some(mysql_async::Error::Server(server)) if server.code == ER_LOCK_DEADLOCK
    )
}

/// A driver error as a [`StorageError`] of the right kind: duplicate keys are conflicts, lost
/// connections are unavailability, server-side timeouts are timeouts, values that do not fit
/// are invalid input.
pub(crate) fn storage_error(what: &str, error: mysql_async::Error) -> StorageError {
    let kind = match &error {
        mysql_async::Error::Io(_) => StorageErrorKind::Unavailable,
        mysql_async::Error::Driver(driver) => match driver {
            DriverError::ConnectionClosed
            | DriverError::PoolDisconnected
            | DriverError::PacketOutOfOrder
            | DriverError::UnexpectedPacket { .. } => StorageErrorKind::Unavailable,
            DriverError::StmtParamsNumberExceedsLimit { .. } | DriverError::PacketTooLarge => {
                StorageErrorKind::InvalidInput
            }
            _ => StorageErrorKind::Other,
        },
        mysql_async::Error::Server(server) => server_error_kind(server.code),
        mysql_async::Error::Url(_) => StorageErrorKind::InvalidInput,
        mysql_async::Error::Other(_) => StorageErrorKind::Other,
    };
    StorageError::with_source(kind, what, error)
}

fn server_error_kind(code: u16) -> StorageErrorKind {
    match code {
        // Duplicate entry / key, foreign key duplicates.
        1022 | 1062 | 1557 | 1586 => StorageErrorKind::Conflict,
        // Lock wait timeout; statement timeouts (MariaDB, MySQL).
        1205 | 1969 | 3024 => StorageErrorKind::Timeout,
        // Too many connections, shutdown in progress, aborted or killed connections,
        // interrupted query, read-only server.
        1040 | 1053 | 1077 | 1078 | 1079 | 1080 | 1152 | 1153 | 1154 | 1155 | 1156 | 1157
        | 1158 | 1159 | 1160 | 1161 | 1184 | 1290 | 1317 | 1836 | 1927 => {
            StorageErrorKind::Unavailable
        }
        // Out of range, too long, incorrect value.
        1264 | 1292 | 1366 | 1406 => StorageErrorKind::InvalidInput,
        _ => StorageErrorKind::Other,
    }
}

/// A stored value that cannot be read as what it should be.
fn bad_column(what: &'static str, value: &Value) -> DecodeError {
    DecodeError::new(what, format!("unexpected column value {value:?}"))
}

/// The columns of one row, taken left to right, converted without panicking.
pub(crate) struct Columns(std::vec::IntoIter<Value>);

impl Columns {
    pub(crate) fn new(row: Row) -> Columns {
        Columns(row.unwrap().into_iter())
    }

    fn next(&mut self) -> Result<Value, DecodeError> {
        self.0.next().ok_or_else(|| DecodeError::new("row", "missing column"))
    }

    /// An integer column (binary or text protocol).
    pub(crate) fn int(&mut self) -> Result<Option<i64>, DecodeError> {
        match self.next()? {
            Value::NULL => Ok(None),
            Value::Int(int) => Ok(Some(int)),
            Value::UInt(uint) => {
                i64::try_from(uint).map(Some).map_err(|_| bad_column("integer", &Value::UInt(uint)))
            }
            Value::Bytes(bytes) => std::str::from_utf8(&bytes)
                .ok()
                .and_then(|text| text.parse().ok())
                .map(Some)
                .ok_or_else(|| bad_column("integer", &Value::Bytes(bytes))),
            other => Err(bad_column("integer", &other)),
        }
    }

    /// An `INT` column.
    pub(crate) fn int32(&mut self) -> Result<Option<i32>, DecodeError> {
        match self.int()? {
            None => Ok(None),
            Some(int) => i32::try_from(int)
                .map(Some)
                .map_err(|_| DecodeError::new("row", format!("{int} is not an INT"))),
        }
    }

    /// A `BOOLEAN` (`TINYINT`) column.
    pub(crate) fn boolean(&mut self) -> Result<Option<bool>, DecodeError> {
        Ok(self.int()?.map(|int| int != 0))
    }

    /// A text column; bytes that are not UTF-8 are an error, never silently replaced.
    pub(crate) fn text(&mut self) -> Result<Option<String>, DecodeError> {
        match self.next()? {
            Value::NULL => Ok(None),
            Value::Bytes(bytes) => String::from_utf8(bytes)
                .map(Some)
                .map_err(|error| DecodeError::new("text column", error.to_string())),
            other => Err(bad_column("text", &other)),
        }
    }
}

/// A connection that is closed, not returned to its pool, if it is dropped before
/// [`into_inner`](ClosingConn::into_inner): after a failure or a cancellation its session
/// state (named locks, a half-read result) must not be reused.
pub(crate) struct ClosingConn(Option<Conn>);

impl ClosingConn {
    pub(crate) fn new(conn: Conn) -> ClosingConn {
        ClosingConn(Some(conn))
    }

    pub(crate) fn get(&mut self) -> &mut Conn {
        // Present from `new` until `into_inner` consumes self or `drop` runs.
        self.0.as_mut().expect("a ClosingConn holds its connection until it is consumed")
    }

    /// The connection, now dropped normally (a pooled one returns to its pool).
    pub(crate) fn into_inner(mut self) -> Conn {
        self.0.take().expect("a ClosingConn holds its connection until it is consumed")
    }
}

impl Drop for ClosingConn {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            close_now(conn);
        }
    }
}

/// Closes `conn` without waiting for the server.
///
/// Dropping a `Conn` makes `mysql_async` spawn a task that first drains any pending result and
/// then says goodbye; with an unresponsive server that task can wait for minutes and keep the
/// session (and its named locks) alive. Instead, start `disconnect` and poll it once: it marks
/// the connection disconnected before its first await, so dropping it afterwards closes the
/// socket at once (a pooled connection is discarded by its pool, not reused).
fn close_now(conn: Conn) {
    if tokio::runtime::Handle::try_current().is_err() {
        // Outside a runtime the socket cannot be polled; the driver's drop closes it.
        drop(conn);
        return;
    }
    let mut disconnect = std::pin::pin!(conn.disconnect());
    let mut context = Context::from_waker(Waker::noop());
    // Ready or not, the outcome does not matter: the socket closes when the future drops.
    let _poll = disconnect.as_mut().poll(&mut context);
}

/// `value` fits a `VARCHAR(len_max)` column (characters, as MySQL counts them).
pub(crate) fn check_chars(column: &str, value: &str, len_max: usize) -> Result<(), StorageError> {
    // Bytes bound characters from above, so most values need no count.
    if value.len() <= len_max {
        return Ok(());
    }
    let len = value.chars().count();
    if len <= len_max {
        return Ok(());
    }
    Err(StorageError::new(
        StorageErrorKind::InvalidInput,
        format!("{column} holds at most {len_max} characters, got {len}"),
    ))
}

/// `value` fits a `TEXT` column.
pub(crate) fn check_bytes(column: &str, value: &str) -> Result<(), StorageError> {
    if value.len() <= queries::TEXT_BYTES_MAX {
        return Ok(());
    }
    Err(StorageError::new(
        StorageErrorKind::InvalidInput,
        format!("{column} holds at most {} bytes, got {}", queries::TEXT_BYTES_MAX, value.len()),
    ))
}
