//! [`SqliteRunnerStorage`]: the runner registry of `cluster_core::storage::RunnerStorage` on a
//! SQLite file (`effect/src/cluster/RunnerStorage.ts`, `effect/src/cluster/SqlRunnerStorage.ts`);
//! its shard locks are lease rows, in `shard_lock.rs`. The worker thread runs the registry's SQL
//! in `runner_ops.rs`.
//!
//! Heartbeats, expiry and lease ages use the database clock (`CURRENT_TIMESTAMP`), never a
//! runner's, so runners with skewed clocks agree on who is alive.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use cluster_core::encoded::JsonForm;
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{RunnerRecord, ShardLock};
use cluster_core::storage::RunnerStorage;
use cluster_core::{MachineId, Runner, RunnerAddress, ShardId};

use super::lock_ops::LockKind;
use super::options::SqliteOptions;
use super::queries::{MigrationSet, json_strings};
use super::runner_ops::RunnerOp;
use super::state::Responder;
use super::worker::{Command, Worker};

/// [`RunnerStorage`] on a SQLite file: the runner registry and lease-row shard locks.
///
/// Every lock operation is bounded by
/// [`shard_lock_interval`](crate::SqlStorageOptions::shard_lock_interval); leases and heartbeats
/// expire after [`shard_lock_expiration`](crate::SqlStorageOptions::shard_lock_expiration),
/// rounded up to whole seconds.
pub struct SqliteRunnerStorage {
    pub(super) worker: Worker,
    pub(super) lock_deadline: Duration,
}

impl fmt::Debug for SqliteRunnerStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteRunnerStorage")
            .field("worker", &self.worker)
            .field("lock_deadline", &self.lock_deadline)
            .finish()
    }
}

impl SqliteRunnerStorage {
    /// Opens (creating it if needed) the database file at `path`, brings the runner tables up
    /// to date and starts the worker.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped open stops its worker; migrations are transactional.
    ///
    /// # Example
    ///
    /// The message and runner storages of one process usually share a file:
    ///
    /// ```
    /// use cluster_core::storage::RunnerStorage;
    /// use cluster_core::{Runner, RunnerAddress, RunnerWeight, ShardGroup, ShardId};
    /// use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let path = std::env::temp_dir().join(format!("doc-sqlite-{}.db", std::process::id()));
    /// let messages = SqliteMessageStorage::open(&path, SqliteOptions::default()).await?;
    /// let runners = SqliteRunnerStorage::open(&path, SqliteOptions::default()).await?;
    ///
    /// let address = RunnerAddress::new("127.0.0.1", 34431);
    /// let groups = vec![ShardGroup::default_group()];
    /// let runner = Runner::new(address.clone(), groups, RunnerWeight::ONE);
    /// runners.register(&runner, true).await?;
    /// let shard = ShardId::new(ShardGroup::default_group(), 1);
    /// assert_eq!(runners.acquire(&address, &[shard.clone()]).await?, vec![shard]);
    ///
    /// runners.close().await;
    /// messages.close().await;
    /// # for suffix in ["", "-wal", "-shm"] {
    /// #     let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    /// # }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn open(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteRunnerStorage, StorageError> {
        let storage = SqliteRunnerStorage::open_without_migrations(path, options).await?;
        storage
            .worker
            .call("migrate", |reply| Command::Migrate { set: MigrationSet::Runners, reply })
            .await?;
        Ok(storage)
    }

    /// Opens the database at `path` without creating or changing any table; see
    /// [`migrate`](SqliteRunnerStorage::migrate).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn open_without_migrations(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteRunnerStorage, StorageError> {
        let worker = Worker::spawn(path.as_ref(), &options, "runners").await?;
        Ok(SqliteRunnerStorage { worker, lock_deadline: options.storage.shard_lock_interval })
    }

    /// Brings the runner tables of the database at `path` up to date (history
    /// `<prefix>_runner_migrations`) and returns the ids of the migrations that ran.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction.
    pub async fn migrate(
        path: impl AsRef<Path>,
        options: &SqliteOptions,
    ) -> Result<Vec<i64>, StorageError> {
        let worker = Worker::spawn(path.as_ref(), options, "migrate").await?;
        let ran = worker
            .call("migrate", |reply| Command::Migrate { set: MigrationSet::Runners, reply })
            .await;
        worker.shutdown().await;
        ran
    }

    /// Stops the worker once the commands queued before have run and waits until its
    /// connection is closed; later calls fail as [`Unavailable`](StorageErrorKind::Unavailable).
    /// Locks are not released: call [`release_all`](RunnerStorage::release_all) first.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn close(&self) {
        self.worker.shutdown().await;
    }

    async fn runner_op<T>(
        &self,
        operation: &'static str,
        make: impl FnOnce(Responder<T>) -> RunnerOp,
    ) -> Result<T, StorageError> {
        self.worker.call(operation, |reply| Command::Runner(make(reply))).await
    }
}

impl RunnerStorage for SqliteRunnerStorage {
    fn backend_name(&self) -> &'static str {
        "sqlite"
    }

    fn register<'a>(
        &'a self,
        runner: &'a Runner,
        healthy: bool,
    ) -> BoxFuture<'a, Result<MachineId, StorageError>> {
        Box::pin(async move {
            tracing::debug!(operation = "register", address = %runner.address, healthy, "sqlite");
            let machine_id = self
                .runner_op("register", |reply| RunnerOp::Register {
                    address: runner.address.to_string(),
                    runner: runner.to_json(),
                    healthy,
                    reply,
                })
                .await?;
            i32::try_from(machine_id).map(MachineId::new).map_err(|_| {
                StorageError::new(
                    StorageErrorKind::Malformed,
                    format!("machine id {machine_id} does not fit an i32"),
                )
            })
        })
    }

    fn unregister<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            tracing::debug!(operation = "unregister", %address, "sqlite");
            self.runner_op("unregister", |reply| RunnerOp::Unregister {
                address: address.to_string(),
                reply,
            })
            .await
        })
    }

    fn get_runners(&self) -> BoxFuture<'_, Result<Vec<(Runner, bool)>, StorageError>> {
        Box::pin(async move {
            let rows =
                self.runner_op("get_runners", |reply| RunnerOp::GetRunners { reply }).await?;
            let mut runners = Vec::with_capacity(rows.len());
            for (json, healthy) in rows {
                match Runner::from_json(&json) {
                    Ok(runner) => runners.push((runner, healthy)),
                    Err(error) => {
                        tracing::warn!(%error, runner = %json, "skipping a runner row that cannot be decoded");
                    }
                }
            }
            tracing::debug!(operation = "get_runners", n_runners = runners.len(), "sqlite");
            Ok(runners)
        })
    }

    fn runner_records(&self) -> BoxFuture<'_, Result<Vec<RunnerRecord>, StorageError>> {
        Box::pin(async move {
            let rows =
                self.runner_op("runner_records", |reply| RunnerOp::Records { reply }).await?;
            tracing::debug!(operation = "runner_records", n_runners = rows.len(), "sqlite");
            Ok(crate::row::inspect::runner_records(rows))
        })
    }

    fn shard_locks<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardLock>, StorageError>> {
        Box::pin(async move {
            let ids = json_strings(shard_ids.iter().map(ToString::to_string));
            let rows = self
                .runner_op("shard_locks", |reply| RunnerOp::Leases { shard_ids: ids, reply })
                .await?;
            tracing::debug!(operation = "shard_locks", n_locks = rows.len(), "sqlite");
            Ok(crate::row::inspect::shard_locks(rows))
        })
    }

    fn set_runner_health<'a>(
        &'a self,
        address: &'a RunnerAddress,
        healthy: bool,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            tracing::debug!(operation = "set_runner_health", %address, healthy, "sqlite");
            self.runner_op("set_runner_health", |reply| RunnerOp::SetHealth {
                address: address.to_string(),
                healthy,
                reply,
            })
            .await
        })
    }

    fn acquire<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(async move {
            if shard_ids.is_empty() {
                return Ok(Vec::new());
            }
            self.lock("acquire", address, shard_ids, LockKind::Acquire).await
        })
    }

    fn refresh<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(self.lock("refresh", address, shard_ids, LockKind::Refresh))
    }

    fn release<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_id: &'a ShardId,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            self.lock("release", address, std::slice::from_ref(shard_id), LockKind::Release)
                .await
                .map(drop)
        })
    }

    fn release_all<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            self.lock("release_all", address, &[], LockKind::ReleaseAll).await.map(drop)
        })
    }

    /// Lease rows are the only locks here: deleted, as `release_all` deletes them.
    fn release_gone<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.release_all(address)
    }
}
