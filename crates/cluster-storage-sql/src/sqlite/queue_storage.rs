//! [`SqliteQueueStorage`]: the persisted queue contract of `cluster_core::queue_storage` on a
//! SQLite file, in the reference's table (`effect_queue` by default) with its SQLite DDL, SQL and
//! migration history (`makeStoreSql` and `sqlMigrations` in
//! `effect/src/persistence/PersistedQueue.ts`), so a TypeScript worker can share the queue.
//!
//! The store has its own connection worker (see `worker`): each operation is one command, and a
//! claim is one `UPDATE … RETURNING` statement, which SQLite runs atomically. The worker thread
//! runs the SQL and the migrations, in `queue_ops.rs`. Times are the database clock
//! (`CURRENT_TIMESTAMP`, whole seconds). Lists of claims are bound as JSON arrays (`json_each`), as
//! the other SQLite statements do, where the reference splices literals. An element longer than
//! `value_bytes_max` is refused before it reaches the worker.

use std::fmt;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::error::StorageError;
use cluster_core::future::BoxFuture;
use cluster_core::queue_storage::{
    ClaimBatch, QueueClaim, QueueItem, QueueItemState, QueueStorage, TakeOptions,
};

use super::options::SqliteOptions;
use super::queries::{json_integers, json_strings};
use super::queue_ops::{QueueCall, QueueOp, QueueSql, Settlement};
use super::state::Responder;
use super::worker::{Command, Worker};
use crate::options::ValueBytesMax;
use crate::queue::{CLEANUP_BATCH_LEN, QueueTable, new_lock};
use crate::row::ValueLimit;

/// [`QueueStorage`] on a SQLite file.
pub struct SqliteQueueStorage {
    worker: Worker,
    sql: Arc<QueueSql>,
    /// The most bytes of an element (`value_bytes_max`).
    limit: ValueLimit,
}

impl fmt::Debug for SqliteQueueStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteQueueStorage")
            .field("table", &self.sql.table)
            .field("worker", &self.worker)
            .finish()
    }
}

impl SqliteQueueStorage {
    /// Opens (creating it if needed) the database file at `path` with the connection settings
    /// of `options`, brings `table` up to date (history `<table>_migrations`) and starts the
    /// worker.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped open stops its worker; migrations are transactional.
    pub async fn open(
        path: impl AsRef<Path>,
        options: &SqliteOptions,
        table: QueueTable,
    ) -> Result<SqliteQueueStorage, StorageError> {
        let storage = SqliteQueueStorage::open_without_migrations(path, options, table).await?;
        let ran = storage.call("migrate", |reply| QueueCall::Migrate { reply }).await?;
        tracing::debug!(table = %storage.sql.table, ?ran, "sqlite queue migrations");
        Ok(storage)
    }

    /// Opens the database at `path` without creating or changing any table: `table` was
    /// migrated elsewhere.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn open_without_migrations(
        path: impl AsRef<Path>,
        options: &SqliteOptions,
        table: QueueTable,
    ) -> Result<SqliteQueueStorage, StorageError> {
        let worker = Worker::spawn(path.as_ref(), options, "queue").await?;
        let limit = options.value_limit();
        Ok(SqliteQueueStorage { worker, sql: Arc::new(QueueSql::new(table)), limit })
    }

    /// The most bytes an element may have on this store (`value_bytes_max` of its options): a
    /// longer one is refused with
    /// [`StorageErrorKind::InvalidInput`](cluster_core::error::StorageErrorKind::InvalidInput)
    /// before it reaches the worker.
    pub fn value_bytes_max(&self) -> ValueBytesMax {
        self.limit.effective()
    }

    /// Stops the worker once the commands queued before have run and waits until its
    /// connection is closed; later calls fail as
    /// [`Unavailable`](cluster_core::error::StorageErrorKind::Unavailable).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn close(&self) {
        self.worker.shutdown().await;
    }

    async fn call<T>(
        &self,
        operation: &'static str,
        make: impl FnOnce(Responder<T>) -> QueueCall,
    ) -> Result<T, StorageError> {
        let sql = Arc::clone(&self.sql);
        self.worker
            .call(operation, |reply| Command::Queue(QueueOp { sql, call: make(reply) }))
            .await
    }

    async fn settle(
        &self,
        operation: &'static str,
        claim: &QueueClaim,
        settlement: Settlement,
    ) -> Result<bool, StorageError> {
        let (sequence, lock) = (claim.sequence, claim.lock.clone());
        self.call(operation, |reply| QueueCall::Settle { sequence, lock, settlement, reply }).await
    }
}

impl QueueStorage for SqliteQueueStorage {
    fn offer<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
        element: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            self.limit.check("the queue element", element)?;
            let (queue, id, element) = (queue.to_owned(), id.to_owned(), element.to_owned());
            self.call("queue offer", |reply| QueueCall::Offer { queue, id, element, reply }).await
        })
    }

    fn take<'a>(
        &'a self,
        queue: &'a str,
        options: &'a TakeOptions,
    ) -> BoxFuture<'a, Result<ClaimBatch, StorageError>> {
        Box::pin(async move {
            let (queue, lock, options) = (queue.to_owned(), new_lock()?, *options);
            self.call("queue take", |reply| QueueCall::Take { queue, lock, options, reply }).await
        })
    }

    fn refresh<'a>(&'a self, claims: &'a [QueueClaim]) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(async move {
            if claims.is_empty() {
                return Ok(0);
            }
            let sequences = json_integers(claims.iter().map(|claim| claim.sequence));
            let locks = json_strings(claims.iter().map(|claim| claim.lock.as_str()));
            self.call("queue refresh", |reply| QueueCall::Refresh { sequences, locks, reply }).await
        })
    }

    fn complete<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(self.settle("queue complete", claim, Settlement::Complete))
    }

    fn retry<'a>(
        &'a self,
        claim: &'a QueueClaim,
        delay: Duration,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        let settlement = Settlement::Retry { delay, failure: failure.to_owned() };
        Box::pin(self.settle("queue retry", claim, settlement))
    }

    fn fail<'a>(
        &'a self,
        claim: &'a QueueClaim,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        let settlement = Settlement::Fail { failure: failure.to_owned() };
        Box::pin(self.settle("queue fail", claim, settlement))
    }

    fn release<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(self.settle("queue release", claim, Settlement::Release))
    }

    fn fail_exhausted<'a>(
        &'a self,
        queue: &'a str,
        max_attempts: NonZeroU32,
        lock_expiration: Duration,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(async move {
            let queue = queue.to_owned();
            self.call("queue fail_exhausted", |reply| QueueCall::FailExhausted {
                queue,
                max_attempts,
                lock_expiration,
                reply,
            })
            .await
        })
    }

    fn cleanup(
        &self,
        completed_ttl: Duration,
        failed_ttl: Option<Duration>,
    ) -> BoxFuture<'_, Result<u64, StorageError>> {
        Box::pin(async move {
            let mut removed = 0;
            let states = [
                (QueueItemState::Completed, Some(completed_ttl)),
                (QueueItemState::Failed, failed_ttl),
            ];
            for (state, ttl) in states {
                let Some(ttl) = ttl else { continue };
                // One batch per command, so other operations run between the batches.
                loop {
                    let deleted = self
                        .call("queue cleanup", |reply| QueueCall::CleanupBatch {
                            state,
                            ttl,
                            reply,
                        })
                        .await?;
                    removed += deleted;
                    if deleted < CLEANUP_BATCH_LEN.unsigned_abs() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            Ok(removed)
        })
    }

    fn item<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<QueueItem>, StorageError>> {
        Box::pin(async move {
            let (queue, id) = (queue.to_owned(), id.to_owned());
            self.call("queue item", |reply| QueueCall::Item { queue, id, reply }).await
        })
    }
}
