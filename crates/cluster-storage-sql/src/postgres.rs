//! The PostgreSQL backend: [`PgMessageStorage`] and [`PgRunnerStorage`] on a `deadpool-postgres`
//! pool, with the reference's tables, migration histories and advisory lock keys, so that Rust
//! and TypeScript runners can share one database (`effect/src/cluster/SqlRunnerStorage.ts`,
//! `effect/src/cluster/SqlMessageStorage.ts`).
//!
//! - `message_storage`: mailboxes and replies on the pool; claims with one `UPDATE … FROM
//!   (SELECT … FOR UPDATE)` statement, dedup with `INSERT … ON CONFLICT (message_id) DO NOTHING`.
//! - `runner_storage`: the runner registry on the pool, shard locks delegated to `shard_lock`.
//! - `shard_lock`: the reserved lock session (advisory locks or lease rows), rebuilt after a
//!   failure or a deadline.
//! - `queue_storage`: the persisted queue on the pool, in the reference's `effect_queue` table.
//! - `queries`: every SQL text and the migrations, built once per storage from the validated
//!   [`TablePrefix`](crate::TablePrefix); user values are always bound as parameters.
//!
//! Connections are plain TCP (`NoTls`): TLS is not wired in yet.

mod message_storage;
mod queries;
mod queue_storage;
mod runner_storage;
mod shard_lock;

use std::error::Error as StdError;
use std::time::Duration;

use cluster_core::error::{StorageError, StorageErrorKind};
use deadpool_postgres::{
    ClientWrapper, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime,
};
use postgres_types::ToSql;
use tokio_postgres::{NoTls, Row};

use queries::MigrationTarget;

pub use message_storage::{PgMessageStorage, PgTransaction, PgTransactionGuard};
pub use queue_storage::PgQueueStorage;
pub use runner_storage::PgRunnerStorage;

/// How long a caller waits for a pooled connection before the operation fails with
/// [`StorageErrorKind::Timeout`].
pub const POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long opening a new connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The default number of pooled connections of [`PgMessageStorage::connect`] and
/// [`PgRunnerStorage::connect`].
pub const POOL_SIZE_DEFAULT: usize = 16;

/// Parses a `postgres://` URL (or a `key=value` connection string).
pub fn parse_config(url: &str) -> Result<tokio_postgres::Config, StorageError> {
    url.parse::<tokio_postgres::Config>().map_err(|error| {
        StorageError::with_source(StorageErrorKind::InvalidInput, "invalid PostgreSQL URL", error)
    })
}

/// A pool of at most `size_max` connections to `config`, with bounded waits: a caller waits at
/// most [`POOL_WAIT_TIMEOUT`] for a connection and a new connection is opened within
/// [`CONNECT_TIMEOUT`]. A connection whose socket closed is discarded when it is next checked
/// out.
pub fn pool(config: tokio_postgres::Config, size_max: usize) -> Result<Pool, StorageError> {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig { recycling_method: RecyclingMethod::Fast },
    );
    Pool::builder(manager)
        .max_size(size_max.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(POOL_WAIT_TIMEOUT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .recycle_timeout(Some(CONNECT_TIMEOUT))
        .build()
        .map_err(|error| {
            StorageError::with_source(StorageErrorKind::Other, "cannot build the pool", error)
        })
}

/// A driver error as a [`StorageError`], classified.
pub(crate) fn driver_error(what: &str, error: tokio_postgres::Error) -> StorageError {
    let kind = classify(&error);
    StorageError::with_source(kind, format!("{what} failed"), error)
}

/// A failure to check a connection out of the pool, classified.
pub(crate) fn pool_error(what: &str, error: PoolError) -> StorageError {
    let kind = match &error {
        PoolError::Timeout(_) => StorageErrorKind::Timeout,
        PoolError::Backend(driver) => classify(driver),
        PoolError::Closed | PoolError::PostCreateHook(_) => StorageErrorKind::Unavailable,
        PoolError::NoRuntimeSpecified => StorageErrorKind::Other,
    };
    StorageError::with_source(kind, format!("{what}: no connection"), error)
}

/// The kind of a driver error: SQLSTATE classes for server errors, [`Unavailable`] for a lost
/// or unreachable connection.
///
/// [`Unavailable`]: StorageErrorKind::Unavailable
fn classify(error: &tokio_postgres::Error) -> StorageErrorKind {
    if let Some(db_error) = error.as_db_error() {
        return classify_sqlstate(db_error.code().code());
    }
    if error.is_closed() || has_io_source(error) {
        return StorageErrorKind::Unavailable;
    }
    StorageErrorKind::Other
}

fn classify_sqlstate(code: &str) -> StorageErrorKind {
    match code {
        // unique_violation
        "23505" => StorageErrorKind::Conflict,
        // query_canceled (statement_timeout), lock_not_available (lock_timeout)
        "57014" | "55P03" => StorageErrorKind::Timeout,
        // admin_shutdown (pg_terminate_backend), crash_shutdown, cannot_connect_now,
        // idle_session_timeout, too_many_connections
        "57P01" | "57P02" | "57P03" | "57P05" | "53300" => StorageErrorKind::Unavailable,
        // connection_exception
        code if code.starts_with("08") => StorageErrorKind::Unavailable,
        // data_exception (e.g. a value longer than its column), integrity constraints
        code if code.starts_with("22") || code.starts_with("23") => StorageErrorKind::InvalidInput,
        _ => StorageErrorKind::Other,
    }
}

fn has_io_source(error: &tokio_postgres::Error) -> bool {
    let mut source = error.source();
    while let Some(cause) = source {
        if cause.is::<std::io::Error>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// A column that cannot be read as its expected type: the table holds something no runner
/// wrote.
pub(crate) fn column_error(error: tokio_postgres::Error) -> StorageError {
    StorageError::with_source(StorageErrorKind::Malformed, "unreadable column", error)
}

/// Runs `sql` on a connection from `pool` and returns its rows.
pub(crate) async fn pooled_query(
    pool: &Pool,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, StorageError> {
    let client = pool.get().await.map_err(|error| pool_error(what, error))?;
    let result = query(&client, what, sql, params).await;
    settle(client, result.as_ref().err());
    result
}

/// Runs `sql` on a connection from `pool` and returns the number of rows it changed.
pub(crate) async fn pooled_execute(
    pool: &Pool,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, StorageError> {
    let client = pool.get().await.map_err(|error| pool_error(what, error))?;
    let result = execute(&client, what, sql, params).await;
    settle(client, result.as_ref().err());
    result
}

/// Runs the migrations of `target` on a pooled connection; a lost race with another migrator
/// creating the history table is retried once.
pub(crate) async fn migrate_on_pool(
    pool: &Pool,
    target: &MigrationTarget<'_>,
) -> Result<Vec<i32>, StorageError> {
    let mut attempt = 0;
    loop {
        let mut client = pool.get().await.map_err(|error| pool_error("migrate", error))?;
        let result = queries::migrate(&mut client, target).await;
        settle(client, result.as_ref().err());
        match result {
            Err(error) if error.kind() == StorageErrorKind::Conflict && attempt == 0 => {
                attempt += 1;
                tracing::debug!(%error, "migration raced another migrator; retrying");
            }
            result => return result,
        }
    }
}

/// Gives a connection back to the pool, unless `error` says it is lost: then it is closed and
/// the pool opens a new one when needed.
pub(crate) fn settle(client: Object, error: Option<&StorageError>) {
    if error.is_some_and(|error| error.kind() == StorageErrorKind::Unavailable) {
        drop(Object::take(client));
    }
}
async fn query(
    client: &ClientWrapper,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, StorageError> {
    let statement = client.prepare_cached(sql).await.map_err(|error| driver_error(what, error))?;
    client.query(&statement, params).await.map_err(|error| driver_error(what, error))
}

async fn execute(
    client: &ClientWrapper,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, StorageError> {
    let statement = client.prepare_cached(sql).await.map_err(|error| driver_error(what, error))?;
    client.execute(&statement, params).await.map_err(|error| driver_error(what, error))
}
