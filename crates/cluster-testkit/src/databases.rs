//! Real databases for tests: an SQLite file of the test's own, or PostgreSQL and MySQL tables
//! under a prefix of the test's own, removed when the [`TestDatabase`] is dropped (also when
//! the test panicked).
//!
//! Shut the runners that use a database down before dropping it: the clean-up waits for
//! their open transactions (each clean-up session gives up after [`CLEANUP_LOCK_TIMEOUT`]
//! instead of waiting forever).
//!
//! The PostgreSQL and MySQL URLs come from `CLUSTER_TEST_POSTGRES_URL` and
//! `CLUSTER_TEST_MYSQL_URL`. Without them the database is skipped (`None`), except under
//! `CI=true`, where a missing URL fails the test: CI never passes by skipping a database.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cluster_core::queue_storage::QueueStorage;
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{Clock, ShardingConfig, StorageError, SystemClock};
use cluster_storage_sql::mysql::{MySqlMessageStorage, MySqlQueueStorage, MySqlRunnerStorage};
use cluster_storage_sql::{
    PgMessageStorage, PgQueueStorage, PgRunnerStorage, QueueTable, SqlStorageOptions,
    SqliteMessageStorage, SqliteOptions, SqliteQueueStorage, SqliteRunnerStorage, TablePrefix,
};

/// The URL variable of PostgreSQL tests.
pub const POSTGRES_URL: &str = "CLUSTER_TEST_POSTGRES_URL";
/// The URL variable of MySQL tests.
pub const MYSQL_URL: &str = "CLUSTER_TEST_MYSQL_URL";

/// How long a clean-up waits for the locks of tables still in use.
pub const CLEANUP_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The tables of a prefix, histories included (`queue` is the queue store's).
const TABLES: [&str; 9] = [
    "messages",
    "replies",
    "migrations",
    "runners",
    "locks",
    "runner_migrations",
    "entity_state",
    "queue",
    "queue_migrations",
];

/// A database of one test.
#[derive(Debug)]
pub enum TestDatabase {
    /// An SQLite file in the temporary directory.
    Sqlite {
        /// The file.
        path: PathBuf,
    },
    /// PostgreSQL tables under `prefix`.
    Postgres {
        /// The server.
        url: String,
        /// The test's table prefix.
        prefix: TablePrefix,
    },
    /// MySQL (MariaDB) tables under `prefix`.
    Mysql {
        /// The server.
        url: String,
        /// The test's table prefix.
        prefix: TablePrefix,
    },
}

impl TestDatabase {
    /// A fresh SQLite file named after `label`.
    pub fn sqlite(label: &str) -> TestDatabase {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("{label}-{}-{n}.db", std::process::id());
        TestDatabase::Sqlite { path: std::env::temp_dir().join(name) }
    }

    /// PostgreSQL tables of the test's own, if `CLUSTER_TEST_POSTGRES_URL` is set.
    pub fn postgres() -> Option<TestDatabase> {
        let url = database_url(POSTGRES_URL)?;
        Some(TestDatabase::Postgres { url, prefix: unique_prefix("p") })
    }

    /// MySQL tables of the test's own, if `CLUSTER_TEST_MYSQL_URL` is set.
    pub fn mysql() -> Option<TestDatabase> {
        let url = database_url(MYSQL_URL)?;
        Some(TestDatabase::Mysql { url, prefix: unique_prefix("m") })
    }

    /// The database's kind: `sqlite`, `postgres` or `mysql`.
    pub fn kind(&self) -> &'static str {
        match self {
            TestDatabase::Sqlite { .. } => "sqlite",
            TestDatabase::Postgres { .. } => "postgres",
            TestDatabase::Mysql { .. } => "mysql",
        }
    }

    /// A runner's own storages on the database (their own connections, lock session and
    /// worker, as a separate process would have), configured from `config`.
    ///
    /// # Errors
    ///
    /// The database could not be opened or migrated.
    pub async fn open(
        &self,
        config: &ShardingConfig,
    ) -> Result<(Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>), StorageError> {
        match self {
            TestDatabase::Sqlite { path } => {
                let options = || {
                    SqliteOptions::new(SqlStorageOptions::from_config(
                        config,
                        TablePrefix::default(),
                    ))
                };
                let messages = SqliteMessageStorage::open(path, options()).await?;
                let locks = SqliteRunnerStorage::open(path, options()).await?;
                Ok((Arc::new(messages), Arc::new(locks)))
            }
            TestDatabase::Postgres { url, prefix } => {
                let options = SqlStorageOptions::from_config(config, prefix.clone());
                let messages = PgMessageStorage::connect(url, &options).await?;
                let locks = PgRunnerStorage::connect(url, &options).await?;
                Ok((Arc::new(messages), Arc::new(locks)))
            }
            TestDatabase::Mysql { url, prefix } => {
                let options = SqlStorageOptions::from_config(config, prefix.clone());
                let messages = MySqlMessageStorage::connect(url, &options).await?;
                let locks = MySqlRunnerStorage::connect(url, options).await?;
                Ok((Arc::new(messages), Arc::new(locks)))
            }
        }
    }
}

impl TestDatabase {
    /// A process's own queue store on the database (its own connections, as a separate process
    /// would have): the reference's `effect_queue` table in an SQLite file, the table
    /// `<prefix>_queue` on PostgreSQL and MySQL.
    ///
    /// # Errors
    ///
    /// The database could not be opened or migrated.
    pub async fn queue_storage(&self) -> Result<Arc<dyn QueueStorage>, StorageError> {
        match self {
            TestDatabase::Sqlite { path } => {
                let options = SqliteOptions::default();
                let storage = SqliteQueueStorage::open(path, &options, QueueTable::default());
                Ok(Arc::new(storage.await?))
            }
            TestDatabase::Postgres { url, prefix } => {
                let storage = PgQueueStorage::connect(url, queue_table(prefix)?).await?;
                Ok(Arc::new(storage))
            }
            TestDatabase::Mysql { url, prefix } => {
                let storage = MySqlQueueStorage::connect(url, queue_table(prefix)?).await?;
                Ok(Arc::new(storage))
            }
        }
    }
}

/// The queue table of a test prefix, `<prefix>_queue`.
fn queue_table(prefix: &TablePrefix) -> Result<QueueTable, StorageError> {
    QueueTable::new(&prefix.table("queue")).map_err(|error| {
        StorageError::new(cluster_core::error::StorageErrorKind::InvalidInput, error.to_string())
    })
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        match self {
            TestDatabase::Sqlite { path } => {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
            }
            TestDatabase::Postgres { url, prefix } => {
                let tables: Vec<String> =
                    TABLES.iter().map(|table| format!("\"{}\"", prefix.table(table))).collect();
                let sql = format!("DROP TABLE IF EXISTS {}", tables.join(", "));
                let url = url.clone();
                on_own_runtime(async move {
                    let (client, connection) =
                        tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
                    let connection = tokio::spawn(connection);
                    let timeout = CLEANUP_LOCK_TIMEOUT.as_millis();
                    client.batch_execute(&format!("SET lock_timeout = {timeout}; {sql}")).await?;
                    connection.abort();
                    Ok::<(), tokio_postgres::Error>(())
                });
            }
            TestDatabase::Mysql { url, prefix } => {
                let statements: Vec<String> = TABLES
                    .iter()
                    .map(|table| format!("DROP TABLE IF EXISTS `{}`", prefix.table(table)))
                    .collect();
                let url = url.clone();
                on_own_runtime(async move {
                    use mysql_async::prelude::Queryable;
                    let pool = mysql_async::Pool::from_url(url.as_str())?;
                    let mut connection = pool.get_conn().await?;
                    let timeout = CLEANUP_LOCK_TIMEOUT.as_secs();
                    connection
                        .query_drop(format!("SET SESSION lock_wait_timeout = {timeout}"))
                        .await?;
                    for statement in statements {
                        connection.query_drop(statement).await?;
                    }
                    drop(connection);
                    pool.disconnect().await?;
                    Ok::<(), mysql_async::Error>(())
                });
            }
        }
    }
}

/// Runs a clean-up on a thread and runtime of its own (the test's runtime may be gone).
fn on_own_runtime<E: std::fmt::Display>(
    work: impl std::future::Future<Output = Result<(), E>> + Send + 'static,
) {
    let done = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
        if let Ok(runtime) = runtime
            && let Err(error) = runtime.block_on(work)
        {
            tracing_free_warning(&error.to_string());
        }
    });
    let _ = done.join();
}

/// Reports a failed clean-up (the tables stay; the next runs use other prefixes).
#[expect(clippy::print_stderr, reason = "a test helper's report, outside any test output")]
fn tracing_free_warning(error: &str) {
    eprintln!("could not drop a test database's tables: {error}");
}

/// The database URL in `variable`, or `None` when it is not set.
///
/// # Panics
///
/// Under `CI=true` when the variable is missing: CI never passes by skipping a database.
pub fn database_url(variable: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{variable} is not set and CI=true: these tests must run"
            );
            None
        }
    }
}

/// A table prefix of the test's own: `<letter><pid>_<n>_<millis>`.
pub fn unique_prefix(letter: &str) -> TablePrefix {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let millis = SystemClock.now().unix_millis() % 100_000;
    match TablePrefix::new(&format!("{letter}{}_{n}_{millis}", std::process::id())) {
        Ok(prefix) => prefix,
        Err(error) => panic!("a generated table prefix is valid: {error}"),
    }
}
