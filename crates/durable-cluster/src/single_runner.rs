//! [`SingleRunner`]: one runner on a SQLite file, in one call.

use std::path::Path;
use std::sync::Arc;

use cluster_core::ShardingConfig;
use cluster_sharding::{Sharding, StartError};
use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage};
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};

/// One-call constructors of a single runner (the reference's `SingleRunner` layer).
#[derive(Debug)]
pub struct SingleRunner;

impl SingleRunner {
    /// A runner on the SQLite file at `path`, created if needed.
    ///
    /// - The tables have the reference's prefix (`cluster`).
    /// - Time is the system clock; there is no transport.
    /// - The runner holds every shard's lock: one process is a complete deployment (see
    ///   [`Sharding::single_runner`](cluster_sharding::Sharding::single_runner)).
    /// - The file's messages survive restarts: a persisted request sent again with its primary
    ///   key is answered from the file.
    ///
    /// # Errors
    ///
    /// The file cannot be opened or migrated, the configuration is invalid, or another live
    /// runner holds shards on the file.
    pub async fn sqlite(
        path: impl AsRef<Path>,
        config: ShardingConfig,
    ) -> Result<Sharding, StartError> {
        let options = SqlStorageOptions::from_config(&config, TablePrefix::default());
        let messages =
            SqliteMessageStorage::open(path.as_ref(), SqliteOptions::new(options.clone())).await?;
        let runners = SqliteRunnerStorage::open(path.as_ref(), SqliteOptions::new(options)).await?;
        Sharding::single_runner(config, Arc::new(messages), Arc::new(runners)).start().await
    }
}
