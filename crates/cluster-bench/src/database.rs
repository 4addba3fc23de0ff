//! The benchmark's databases: an SQLite file in the temporary directory, or PostgreSQL tables
//! under a prefix of the run's own; both removed by [`BenchDatabase::remove`].

use std::path::PathBuf;
use std::sync::Arc;

use cluster_core::ShardingConfig;
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_storage_sql::{
    PgMessageStorage, PgRunnerStorage, SqlStorageOptions, SqliteMessageStorage, SqliteOptions,
    SqliteRunnerStorage, TablePrefix,
};

/// The tables one prefix holds.
const TABLES: [&str; 7] =
    ["messages", "replies", "migrations", "runners", "locks", "runner_migrations", "entity_state"];

/// The local server the README's services provide.
const LOCAL_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/test";

/// A runner's two storages.
pub(crate) type Storages = (Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>);

/// Where a workload's messages live.
#[derive(Debug)]
pub(crate) enum BenchDatabase {
    /// A fresh SQLite file.
    Sqlite(PathBuf),
    /// Fresh PostgreSQL tables.
    Postgres {
        /// The server.
        url: String,
        /// The run's table prefix.
        prefix: TablePrefix,
    },
}

impl BenchDatabase {
    /// A fresh SQLite file for this process.
    pub(crate) fn sqlite() -> BenchDatabase {
        let name = format!("cluster-bench-{}.db", std::process::id());
        BenchDatabase::Sqlite(std::env::temp_dir().join(name))
    }

    /// Fresh PostgreSQL tables for this process, on `CLUSTER_BENCH_POSTGRES_URL`, else
    /// `CLUSTER_TEST_POSTGRES_URL`, else the local server.
    pub(crate) fn postgres() -> Result<BenchDatabase, String> {
        let url = ["CLUSTER_BENCH_POSTGRES_URL", "CLUSTER_TEST_POSTGRES_URL"]
            .iter()
            .find_map(|name| std::env::var(name).ok().filter(|url| !url.is_empty()))
            .unwrap_or_else(|| LOCAL_POSTGRES.to_owned());
        let prefix = TablePrefix::new(&format!("bench{}", std::process::id()))
            .map_err(|error| error.to_string())?;
        Ok(BenchDatabase::Postgres { url, prefix })
    }

    /// A runner's storages on the database, configured from `config`.
    pub(crate) async fn open(&self, config: &ShardingConfig) -> Result<Storages, String> {
        let opened: Result<Storages, cluster_core::StorageError> = async {
            match self {
                BenchDatabase::Sqlite(path) => {
                    let options = || {
                        SqliteOptions::new(SqlStorageOptions::from_config(
                            config,
                            TablePrefix::default(),
                        ))
                    };
                    let messages = SqliteMessageStorage::open(path, options()).await?;
                    let runners = SqliteRunnerStorage::open(path, options()).await?;
                    Ok((Arc::new(messages) as Arc<dyn MessageStorage>, Arc::new(runners) as _))
                }
                BenchDatabase::Postgres { url, prefix } => {
                    let options = SqlStorageOptions::from_config(config, prefix.clone());
                    let messages = PgMessageStorage::connect(url, &options).await?;
                    let runners = PgRunnerStorage::connect(url, &options).await?;
                    Ok((Arc::new(messages) as Arc<dyn MessageStorage>, Arc::new(runners) as _))
                }
            }
        }
        .await;
        opened.map_err(|error| format!("cannot open the {} storage: {error}", self.kind()))
    }

    fn kind(&self) -> &'static str {
        match self {
            BenchDatabase::Sqlite(_) => "sqlite",
            BenchDatabase::Postgres { .. } => "postgres",
        }
    }

    /// Refreshes the planner's statistics of the message tables (PostgreSQL), as autovacuum
    /// does on a table in use: a fresh table has none, and its plans are those of an empty
    /// table. A no-op on SQLite.
    pub(crate) async fn analyze(&self) -> Result<(), String> {
        let BenchDatabase::Postgres { url, prefix } = self else { return Ok(()) };
        let sql =
            format!("ANALYZE \"{}\", \"{}\"", prefix.table("messages"), prefix.table("replies"));
        execute(url, &sql)
            .await
            .map_err(|error| format!("cannot analyze the tables of {prefix}: {error}"))
    }

    /// Removes the file or drops the tables (after the runner shut down).
    pub(crate) async fn remove(&self) -> Result<(), String> {
        match self {
            BenchDatabase::Sqlite(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
                Ok(())
            }
            BenchDatabase::Postgres { url, prefix } => {
                let tables: Vec<String> =
                    TABLES.iter().map(|table| format!("\"{}\"", prefix.table(table))).collect();
                let sql = format!("DROP TABLE IF EXISTS {}", tables.join(", "));
                execute(url, &sql)
                    .await
                    .map_err(|error| format!("cannot drop the tables of {prefix}: {error}"))
            }
        }
    }
}

/// Runs `sql` on a connection of its own.
async fn execute(url: &str, sql: &str) -> Result<(), tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    let connection = tokio::spawn(connection);
    let result = client.batch_execute(sql).await;
    connection.abort();
    result
}
