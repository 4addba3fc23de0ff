//! [`PgRunnerStorage`]: the runner registry in `<prefix>_runners` on the pool, and the shard
//! locks on a reserved lock session (`effect/src/cluster/SqlRunnerStorage.ts`).
//!
//! Times are the database's clock in UTC (`NOW() AT TIME ZONE 'UTC'`, whatever the session's
//! `TimeZone`); a heartbeat older than the shard lock expiration (in whole seconds, rounded up)
//! is dead. Every `refresh` with shards also refreshes the heartbeat, on the lock session; an
//! empty `refresh` (the probe used while lock storage is unhealthy) refreshes only the
//! heartbeat, on the pool, so that a wedged lock session cannot block recovery.

use std::fmt;
use std::sync::Arc;

use cluster_core::encoded::JsonForm;
use cluster_core::error::StorageError;
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{RunnerRecord, ShardLock};
use cluster_core::storage::RunnerStorage;
use cluster_core::{MachineId, Runner, RunnerAddress, ShardId};
use deadpool_postgres::Pool;
use postgres_types::ToSql;
use tracing::Instrument;

use crate::lock::{advisory_namespace, with_deadline};
use crate::options::{LockMode, SqlStorageOptions, TablePrefix};
use crate::row::inspect::{self, LeaseRow, RunnerRecordRow};

use super::classify::column_error;
use super::connection::{self, PgConfig, migrate_on_pool, pooled_execute, pooled_query};
use super::queries::{self, MigrationTarget, RunnerQueries};
use super::shard_lock::ShardLocks;

/// The PostgreSQL [`RunnerStorage`].
///
/// Registry statements use the pool. Shard locks use one reserved lock session, opened by the
/// first lock operation and reopened after a failure (see [`LockMode`](crate::LockMode)):
/// advisory locks by default, lease rows in `<prefix>_locks` with
/// [`LockMode::Lease`](crate::LockMode::Lease). Dropping the storage closes the lock session,
/// which releases its advisory locks.
pub struct PgRunnerStorage {
    pool: Pool,
    queries: Arc<RunnerQueries>,
    locks: ShardLocks,
    prefix: TablePrefix,
}

impl fmt::Debug for PgRunnerStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgRunnerStorage")
            .field("prefix", &self.prefix)
            .field("locks", &self.locks)
            .finish_non_exhaustive()
    }
}

impl PgRunnerStorage {
    /// Connects to `url` (a pool of [`POOL_SIZE_DEFAULT`](super::POOL_SIZE_DEFAULT)
    /// connections, and the lock session on demand), runs the migrations and returns the
    /// storage.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    ///
    /// # Example
    ///
    /// Both storages of a runner, on tables prefixed `orders` (`orders_messages`,
    /// `orders_runners`, ...), with the shard-lock settings of its `ShardingConfig`:
    ///
    /// ```no_run
    /// use cluster_core::ShardingConfig;
    /// use cluster_storage_sql::{PgMessageStorage, PgRunnerStorage, SqlStorageOptions, TablePrefix};
    ///
    /// # async fn open() -> Result<(), Box<dyn std::error::Error>> {
    /// let config = ShardingConfig::from_env()?;
    /// let options = SqlStorageOptions::from_config(&config, TablePrefix::new("orders")?);
    /// let url = "postgres://cluster@db.internal:5432/app";
    /// let messages = PgMessageStorage::connect(url, &options).await?;
    /// let runners = PgRunnerStorage::connect(url, &options).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(
        url: &str,
        options: &SqlStorageOptions,
    ) -> Result<PgRunnerStorage, StorageError> {
        let config = connection::parse_config(url)?;
        let pool = connection::pool(config.clone(), connection::POOL_SIZE_DEFAULT)?;
        let opened = PgRunnerStorage::new(pool, config.clone(), options).await;
        opened.map_err(|error| connection::opening_error(&config, error))
    }

    /// Runs the migrations on `pool` and returns the storage, whose lock session connects
    /// with `lock_config` (normally the pool's own configuration).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn new(
        pool: Pool,
        lock_config: PgConfig,
        options: &SqlStorageOptions,
    ) -> Result<PgRunnerStorage, StorageError> {
        PgRunnerStorage::migrate(&pool, &options.prefix).await?;
        Ok(PgRunnerStorage::without_migrations(pool, lock_config, options))
    }

    /// The storage on tables migrated elsewhere (the reference's `layerStorage`). Runs no
    /// statement and opens no connection.
    pub fn without_migrations(
        pool: Pool,
        lock_config: PgConfig,
        options: &SqlStorageOptions,
    ) -> PgRunnerStorage {
        let queries = Arc::new(RunnerQueries::new(&options.prefix, options.expiration_seconds()));
        PgRunnerStorage {
            pool,
            locks: ShardLocks::new(lock_config, options, Arc::clone(&queries)),
            queries,
            prefix: options.prefix.clone(),
        }
    }

    /// Creates `<prefix>_runners` and `<prefix>_locks` (history in
    /// `<prefix>_runner_migrations`); returns the ids of the migrations that ran. Idempotent,
    /// and safe to run from several processes at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn migrate(pool: &Pool, prefix: &TablePrefix) -> Result<Vec<i32>, StorageError> {
        let migrations = queries::runner_migrations(prefix);
        let target = MigrationTarget {
            history: queries::quoted(prefix, "runner_migrations"),
            lock: (advisory_namespace(prefix), queries::RUNNER_MIGRATION_LOCK),
            migrations: &migrations,
            retired: &[],
            extra_tables: &[],
            extra_indexes: &[],
        };
        migrate_on_pool(pool, &target).await
    }

    /// The advisory lock namespace of this storage's prefix: the first key of its shard locks
    /// and `pg_locks.classid` (as an unsigned oid).
    pub fn advisory_namespace(&self) -> i32 {
        self.locks.namespace()
    }

    /// The backend pid of the lock session, while one is open.
    pub fn lock_session_pid(&self) -> Option<i32> {
        self.locks.session_pid()
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    async fn register_inner(
        &self,
        runner: &Runner,
        healthy: bool,
    ) -> Result<MachineId, StorageError> {
        let address = runner.address.to_string();
        let json = runner.to_json();
        let rows = pooled_query(
            &self.pool,
            "register",
            &self.queries.register,
            &[&address, &json, &healthy],
        )
        .await?;
        let machine_id: i32 = match rows.first() {
            Some(row) => row.try_get(0).map_err(column_error)?,
            None => {
                return Err(StorageError::new(
                    cluster_core::error::StorageErrorKind::Other,
                    "register returned no machine id",
                ));
            }
        };
        Ok(MachineId::new(machine_id))
    }

    async fn get_runners_inner(&self) -> Result<Vec<(Runner, bool)>, StorageError> {
        let rows = pooled_query(&self.pool, "get_runners", &self.queries.get_runners, &[]).await?;
        let mut runners = Vec::with_capacity(rows.len());
        for row in rows {
            let json: String = row.try_get(0).map_err(column_error)?;
            let healthy: bool = row.try_get(1).map_err(column_error)?;
            match Runner::from_json(&json) {
                Ok(runner) => runners.push((runner, healthy)),
                Err(error) => {
                    tracing::warn!(%error, "skipping a runner row that cannot be decoded")
                }
            }
        }
        Ok(runners)
    }

    async fn runner_records_inner(&self) -> Result<Vec<RunnerRecord>, StorageError> {
        let sql = &self.queries.runner_records;
        let rows = pooled_query(&self.pool, "runner_records", sql, &[]).await?;
        let rows = rows
            .iter()
            .map(|row| {
                let machine_id: i32 = row.try_get(0).map_err(column_error)?;
                Ok(RunnerRecordRow {
                    machine_id: i64::from(machine_id),
                    runner: row.try_get(1).map_err(column_error)?,
                    healthy: row.try_get(2).map_err(column_error)?,
                    heartbeat_age_ms: row.try_get(3).map_err(column_error)?,
                    alive: row.try_get(4).map_err(column_error)?,
                })
            })
            .collect::<Result<Vec<_>, StorageError>>()?;
        Ok(inspect::runner_records(rows))
    }

    async fn shard_locks_inner(
        &self,
        shard_ids: &[ShardId],
    ) -> Result<Vec<ShardLock>, StorageError> {
        if self.locks.mode() == LockMode::Advisory {
            return self.locks.holders(&self.pool, shard_ids).await;
        }
        let shards: Vec<String> = shard_ids.iter().map(ToString::to_string).collect();
        let sql = &self.queries.lease_rows;
        let rows = pooled_query(&self.pool, "shard_locks", sql, &[&shards]).await?;
        let rows = rows
            .iter()
            .map(|row| {
                Ok(LeaseRow {
                    shard_id: row.try_get(0).map_err(column_error)?,
                    address: row.try_get(1).map_err(column_error)?,
                    age_ms: row.try_get(2).map_err(column_error)?,
                    expired: row.try_get(3).map_err(column_error)?,
                })
            })
            .collect::<Result<Vec<_>, StorageError>>()?;
        Ok(inspect::shard_locks(rows))
    }

    /// The probe: the heartbeat alone, on the pool, under the lock deadline.
    async fn heartbeat(&self, address: &RunnerAddress) -> Result<(), StorageError> {
        let address = address.to_string();
        let params: [&(dyn ToSql + Sync); 1] = [&address];
        let heartbeat = pooled_execute(&self.pool, "heartbeat", &self.queries.heartbeat, &params);
        with_deadline(self.locks.deadline(), "heartbeat", heartbeat).await.map(drop)
    }
}

fn span(operation: &'static str) -> tracing::Span {
    tracing::debug_span!("runner_storage", backend = "postgres", operation)
}

impl RunnerStorage for PgRunnerStorage {
    fn backend_name(&self) -> &'static str {
        "postgres"
    }

    fn register<'a>(
        &'a self,
        runner: &'a Runner,
        healthy: bool,
    ) -> BoxFuture<'a, Result<MachineId, StorageError>> {
        Box::pin(self.register_inner(runner, healthy).instrument(span("register")))
    }

    fn unregister<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let address = address.to_string();
                let sql = &self.queries.unregister;
                pooled_execute(&self.pool, "unregister", sql, &[&address]).await.map(drop)
            }
            .instrument(span("unregister")),
        )
    }

    fn get_runners(&self) -> BoxFuture<'_, Result<Vec<(Runner, bool)>, StorageError>> {
        Box::pin(self.get_runners_inner().instrument(span("get_runners")))
    }

    fn runner_records(&self) -> BoxFuture<'_, Result<Vec<RunnerRecord>, StorageError>> {
        Box::pin(self.runner_records_inner().instrument(span("runner_records")))
    }

    fn shard_locks<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardLock>, StorageError>> {
        Box::pin(self.shard_locks_inner(shard_ids).instrument(span("shard_locks")))
    }

    fn set_runner_health<'a>(
        &'a self,
        address: &'a RunnerAddress,
        healthy: bool,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let address = address.to_string();
                let sql = &self.queries.set_health;
                pooled_execute(&self.pool, "set_runner_health", sql, &[&address, &healthy])
                    .await
                    .map(drop)
            }
            .instrument(span("set_runner_health")),
        )
    }

    fn acquire<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(
            async move {
                if shard_ids.is_empty() {
                    return Ok(Vec::new());
                }
                self.locks.acquire(address, shard_ids).await
            }
            .instrument(span("acquire")),
        )
    }

    fn refresh<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(
            async move {
                if shard_ids.is_empty() {
                    self.heartbeat(address).await?;
                    return Ok(Vec::new());
                }
                self.locks.refresh(address, shard_ids, true).await
            }
            .instrument(span("refresh")),
        )
    }

    fn confirm<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(self.locks.confirm(address, shard_ids).instrument(span("confirm")))
    }

    fn release<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_id: &'a ShardId,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.locks.release(address, shard_id).instrument(span("release")))
    }

    fn release_all<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.locks.release_all(address).instrument(span("release_all")))
    }

    /// Lease rows only: advisory locks ended with the gone runner's session.
    fn release_gone<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.locks.mode() == LockMode::Advisory {
            return Box::pin(std::future::ready(Ok(())));
        }
        self.release_all(address)
    }
}
