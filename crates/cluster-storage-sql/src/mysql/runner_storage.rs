//! [`MySqlRunnerStorage`]: the runner registry (`<prefix>_runners`) on the pool, and the shard
//! locks on the reserved lock session of `shard_lock` (`effect/src/cluster/SqlRunnerStorage.ts`).
//!
//! Every lock operation runs under the deadline `shard_lock_interval`; a failure or a deadline
//! drops the lock session, which the next operation rebuilds. `acquire` retries once after a
//! failure (an idle session may have been ended by the server's `wait_timeout`), and the empty
//! `refresh` (the probe used while lock storage is unhealthy) runs only the heartbeat, on the
//! pool, so that a wedged lock session cannot block recovery.

use std::fmt;
use std::sync::Arc;

use cluster_core::encoded::JsonForm;
use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{RunnerRecord, ShardLock};
use cluster_core::storage::RunnerStorage;
use cluster_core::{MachineId, Runner, RunnerAddress, ShardId};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, Pool, Row};
use tracing::Instrument;

use super::classify::storage_error;
use super::columns::{Columns, check_bytes, check_chars};
use super::connection;
use super::migrate::migrate_runners;
use super::queries::{self, IN_LIST_LEN_MAX, RunnerQueries};
use super::shard_lock::{LockCommand, ShardLocks};
use crate::lock::with_deadline;
use crate::options::{LockMode, SqlStorageOptions};
use crate::row::inspect::{self, LeaseRow, RunnerRecordRow};

/// [`RunnerStorage`] on MySQL or MariaDB (`effect/src/cluster/RunnerStorage.ts`), in either
/// [`LockMode`].
///
/// The registry uses the pool; shard locks use one connection of their own, opened with the
/// same [`Opts`], in both lock modes (as the reference does). Dropping the storage closes that
/// connection, which releases its advisory locks.
///
/// [`LockMode`]: crate::options::LockMode
pub struct MySqlRunnerStorage {
    pool: Pool,
    options: SqlStorageOptions,
    queries: Arc<RunnerQueries>,
    locks: ShardLocks,
}

impl MySqlRunnerStorage {
    /// Connects to the `mysql://` URL `url` (the registry on a pool of
    /// [`POOL_SIZE_DEFAULT`](super::POOL_SIZE_DEFAULT) connections, locks on a session of
    /// their own), runs the migrations and returns the storage.
    ///
    /// # Cancel safety
    ///
    /// As [`migrate_runners`](super::migrate_runners).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use cluster_core::ShardingConfig;
    /// use cluster_storage_sql::mysql::{MySqlMessageStorage, MySqlRunnerStorage};
    /// use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
    ///
    /// # async fn open() -> Result<(), Box<dyn std::error::Error>> {
    /// let config = ShardingConfig::from_env()?;
    /// let options = SqlStorageOptions::from_config(&config, TablePrefix::default());
    /// let url = "mysql://cluster@db.internal:3306/app";
    /// let messages = MySqlMessageStorage::connect(url, &options).await?;
    /// let runners = MySqlRunnerStorage::connect(url, options).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(
        url: &str,
        options: SqlStorageOptions,
    ) -> Result<MySqlRunnerStorage, StorageError> {
        let opts =
            connection::opts(url).await.map_err(|error| connection::opening_error(url, error))?;
        let pool = connection::pool_on(opts.clone(), connection::POOL_SIZE_DEFAULT)?;
        let opened = MySqlRunnerStorage::new(pool, opts, options).await;
        opened.map_err(|error| connection::opening_error(url, error))
    }

    /// The storage on `pool` after running the migrations
    /// ([`migrate_runners`](super::migrate_runners)); `opts` (normally the pool's) opens the
    /// reserved lock connection.
    ///
    /// # Cancel safety
    ///
    /// As [`migrate_runners`](super::migrate_runners).
    pub async fn new(
        pool: Pool,
        opts: Opts,
        options: SqlStorageOptions,
    ) -> Result<MySqlRunnerStorage, StorageError> {
        migrate_runners(&pool, &options.prefix).await?;
        Ok(MySqlRunnerStorage::without_migrations(pool, opts, options))
    }

    /// The storage without running any DDL (the tables must have been migrated). The lock
    /// session is opened by the first lock operation.
    pub fn without_migrations(
        pool: Pool,
        opts: Opts,
        options: SqlStorageOptions,
    ) -> MySqlRunnerStorage {
        let queries = Arc::new(RunnerQueries::new(&options.prefix, options.expiration_seconds()));
        let locks = ShardLocks::new(opts, &options, Arc::clone(&queries));
        MySqlRunnerStorage { pool, options, queries, locks }
    }

    async fn conn(&self) -> Result<Conn, StorageError> {
        self.pool.get_conn().await.map_err(|error| storage_error("cannot get a connection", error))
    }

    async fn register_inner(
        &self,
        runner: &Runner,
        healthy: bool,
    ) -> Result<MachineId, StorageError> {
        let address = address_text(&runner.address)?;
        let json = runner.to_json();
        check_bytes("runner", &json)?;
        let mut conn = self.conn().await?;
        conn.exec_drop(self.queries.register.as_str(), (address.as_str(), json.as_str(), healthy))
            .await
            .map_err(|error| storage_error("register", error))?;
        let row: Option<Row> = conn
            .exec_first(self.queries.select_machine_id.as_str(), (address.as_str(),))
            .await
            .map_err(|error| storage_error("register: read the machine id", error))?;
        let machine_id = row
            .map(|row| Columns::new(row).int32())
            .transpose()
            .map_err(|error| {
                StorageError::with_source(StorageErrorKind::Malformed, "machine_id", error)
            })?
            .flatten()
            .ok_or_else(|| {
                // Deleted between the upsert and the read (an unregister racing a register).
                StorageError::new(StorageErrorKind::Conflict, format!("runner {address} vanished"))
            })?;
        Ok(MachineId::new(machine_id))
    }

    async fn get_runners_inner(&self) -> Result<Vec<(Runner, bool)>, StorageError> {
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn
            .exec(self.queries.get_runners.as_str(), ())
            .await
            .map_err(|error| storage_error("get_runners", error))?;
        let mut runners = Vec::with_capacity(rows.len());
        for row in rows {
            let mut columns = Columns::new(row);
            let runner = columns.text();
            let healthy = columns.boolean();
            let decoded = match (runner, healthy) {
                (Ok(Some(runner)), Ok(Some(healthy))) => Runner::from_json(&runner)
                    .map(|runner| (runner, healthy))
                    .map_err(|e| e.to_string()),
                (runner, healthy) => Err(format!("unreadable row: {runner:?}, {healthy:?}")),
            };
            match decoded {
                Ok(entry) => runners.push(entry),
                Err(error) => {
                    tracing::warn!(%error, "skipping a runner row that cannot be decoded")
                }
            }
        }
        Ok(runners)
    }

    async fn runner_records_inner(&self) -> Result<Vec<RunnerRecord>, StorageError> {
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn
            .exec(self.queries.runner_records.as_str(), ())
            .await
            .map_err(|error| storage_error("runner_records", error))?;
        let rows = rows
            .into_iter()
            .filter_map(|row| {
                read_runner_record(row)
                    .inspect_err(|error| {
                        tracing::warn!(%error, "skipping a runner row that cannot be read");
                    })
                    .ok()
            })
            .collect();
        Ok(inspect::runner_records(rows))
    }

    async fn shard_locks_inner(
        &self,
        shard_ids: &[ShardId],
    ) -> Result<Vec<ShardLock>, StorageError> {
        if shard_ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn().await?;
        if self.locks.mode() == LockMode::Advisory {
            return self.locks.holders(&mut conn, shard_ids).await;
        }
        let shards: Vec<String> = shard_ids.iter().map(ToString::to_string).collect();
        let mut leases = Vec::new();
        for chunk in shards.chunks(IN_LIST_LEN_MAX) {
            let rows: Vec<Row> = conn
                .exec(self.queries.lease_rows(chunk.len()), chunk.to_vec())
                .await
                .map_err(|error| storage_error("shard_locks", error))?;
            for row in rows {
                match read_lease(row) {
                    Ok(lease) => leases.push(lease),
                    Err(error) => tracing::warn!(%error, "skipping a lock row that cannot be read"),
                }
            }
        }
        Ok(inspect::shard_locks(leases))
    }

    /// A lock operation under the deadline `shard_lock_interval`.
    async fn locked(
        &self,
        what: &str,
        command: LockCommand<'_>,
    ) -> Result<Vec<ShardId>, StorageError> {
        with_deadline(self.options.shard_lock_interval, what, self.locks.run(command)).await
    }
}

/// The registry's key of a runner: `host:port`.
fn address_text(address: &RunnerAddress) -> Result<String, StorageError> {
    let text = address.to_string();
    check_chars("address", &text, queries::ADDRESS_LEN_MAX)?;
    Ok(text)
}

/// A `runner_records` row: `machine_id, runner, healthy`, the heartbeat's age (ms) and
/// whether it is alive.
fn read_runner_record(row: Row) -> Result<RunnerRecordRow, DecodeError> {
    let mut columns = Columns::new(row);
    Ok(RunnerRecordRow {
        machine_id: not_null(columns.int(), "machine_id")?,
        runner: not_null(columns.text(), "runner")?,
        healthy: not_null(columns.boolean(), "healthy")?,
        heartbeat_age_ms: not_null(columns.int(), "heartbeat age")?,
        alive: not_null(columns.boolean(), "alive")?,
    })
}

/// A `lease_rows` row: `shard_id, address`, the lease's age (ms) and whether it expired.
fn read_lease(row: Row) -> Result<LeaseRow, DecodeError> {
    let mut columns = Columns::new(row);
    Ok(LeaseRow {
        shard_id: not_null(columns.text(), "shard_id")?,
        address: not_null(columns.text(), "address")?,
        age_ms: not_null(columns.int(), "lease age")?,
        expired: not_null(columns.boolean(), "expired")?,
    })
}

/// A column that is never `NULL` (a `NULL` is a row that cannot be read).
fn not_null<T>(column: Result<Option<T>, DecodeError>, name: &str) -> Result<T, DecodeError> {
    column?.ok_or_else(|| DecodeError::new("row", format!("{name} is NULL")))
}

impl fmt::Debug for MySqlRunnerStorage {
    /// The options and the lock session only: the pool's options hold the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlRunnerStorage")
            .field("options", &self.options)
            .field("locks", &self.locks)
            .finish_non_exhaustive()
    }
}

fn span(operation: &'static str) -> tracing::Span {
    tracing::debug_span!("mysql.runner_storage", operation)
}

impl RunnerStorage for MySqlRunnerStorage {
    fn backend_name(&self) -> &'static str {
        "mysql"
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
                let address = address_text(address)?;
                let mut conn = self.conn().await?;
                conn.exec_drop(self.queries.unregister.as_str(), (address,))
                    .await
                    .map_err(|error| storage_error("unregister", error))
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
                let address = address_text(address)?;
                let mut conn = self.conn().await?;
                conn.exec_drop(self.queries.set_health.as_str(), (healthy, address))
                    .await
                    .map_err(|error| storage_error("set_runner_health", error))
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
                let address = address_text(address)?;
                let command = LockCommand::Acquire { address: &address, shard_ids };
                let attempts = async {
                    match self.locks.run(command).await {
                        Err(error) if error.kind() != StorageErrorKind::InvalidInput => {
                            // The failed session is gone; acquiring does not depend on it.
                            tracing::debug!(%error, "acquire failed; retrying on a new session");
                            self.locks.run(command).await
                        }
                        result => result,
                    }
                };
                let acquired =
                    with_deadline(self.options.shard_lock_interval, "acquire", attempts).await?;
                tracing::debug!(n_requested = shard_ids.len(), n_held = acquired.len());
                Ok(acquired)
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
                let address = address_text(address)?;
                if shard_ids.is_empty() {
                    // The probe: heartbeat only, on the pool.
                    let heartbeat = async {
                        let mut conn = self.conn().await?;
                        conn.exec_drop(self.queries.heartbeat.as_str(), (address.as_str(),))
                            .await
                            .map_err(|error| storage_error("refresh: heartbeat", error))
                    };
                    with_deadline(self.options.shard_lock_interval, "refresh", heartbeat).await?;
                    return Ok(Vec::new());
                }
                let command =
                    LockCommand::Refresh { address: &address, shard_ids, heartbeat: true };
                let held = self.locked("refresh", command).await?;
                tracing::debug!(n_requested = shard_ids.len(), n_held = held.len());
                Ok(held)
            }
            .instrument(span("refresh")),
        )
    }

    fn confirm<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(
            async move {
                if shard_ids.is_empty() {
                    return Ok(Vec::new());
                }
                let address = address_text(address)?;
                let command =
                    LockCommand::Refresh { address: &address, shard_ids, heartbeat: false };
                self.locked("confirm", command).await
            }
            .instrument(span("confirm")),
        )
    }

    fn release<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_id: &'a ShardId,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let address = address_text(address)?;
                self.locked("release", LockCommand::Release { address: &address, shard_id })
                    .await?;
                Ok(())
            }
            .instrument(span("release")),
        )
    }

    fn release_all<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let address = address_text(address)?;
                self.locked("release_all", LockCommand::ReleaseAll { address: &address }).await?;
                Ok(())
            }
            .instrument(span("release_all")),
        )
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
