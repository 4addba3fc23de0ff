//! [`PgQueueStorage`]: the persisted queue contract of `cluster_core::queue_storage` on a
//! connection pool, in the reference's table (`effect_queue` by default) with its PostgreSQL
//! DDL, SQL and migration history (`makeStoreSql` and `sqlMigrations` in
//! `effect/src/persistence/PersistedQueue.ts`), so a TypeScript worker can share the queue.
//!
//! A claim is one statement, an `UPDATE` of the rows a `SELECT … FOR UPDATE SKIP LOCKED` picked,
//! so concurrent takers skip each other's rows instead of waiting. Times are the database clock
//! in UTC (`NOW() AT TIME ZONE 'UTC'`: the columns keep no time zone, and the session's local
//! time would move them at a daylight saving change); lock expirations and retry delays are
//! whole seconds, as the reference counts them.
//! Claim locks are bound as text and cast to the `UUID` column.
//! An element longer than `value_bytes_max` is refused before it is sent.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::hash::fnv1a_32;
use cluster_core::queue_storage::{
    ClaimBatch, ClaimedItem, LOCK_EXPIRED_FAILURE, MalformedClaim, QueueClaim, QueueItem,
    QueueItemState, QueueStorage, TakeOptions,
};
use deadpool_postgres::Pool;
use tokio_postgres::Row;

use super::connection::{self, migrate_on_pool, pooled_execute, pooled_query};
use super::queries::{Migration, MigrationTarget};
use crate::options::ValueBytesMax;
use crate::queue::{CLEANUP_BATCH_LEN, QueueTable, attempts, new_lock, whole_seconds};
use crate::row::ValueLimit;

/// The advisory transaction lock key (second half) that serialises the queue's migrations; the
/// first half is the namespace of the table's name.
const QUEUE_MIGRATION_LOCK: i32 = 0;

/// The PostgreSQL [`QueueStorage`].
///
/// Cheap to clone (the pool and the statements are shared). Every method checks a connection
/// out of the pool for one statement and gives it back.
#[derive(Clone)]
pub struct PgQueueStorage {
    pool: Pool,
    sql: Arc<QueueSql>,
    /// The most bytes of an element (`value_bytes_max`).
    limit: ValueLimit,
}

impl fmt::Debug for PgQueueStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgQueueStorage").field("table", &self.sql.table).finish_non_exhaustive()
    }
}

impl PgQueueStorage {
    /// Connects to `url` with a pool of [`POOL_SIZE_DEFAULT`](super::POOL_SIZE_DEFAULT)
    /// connections, brings `table` up to date and returns the store.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn connect(url: &str, table: QueueTable) -> Result<PgQueueStorage, StorageError> {
        let config = connection::parse_config(url)?;
        let pool = connection::pool(config.clone(), connection::POOL_SIZE_DEFAULT)?;
        let opened = PgQueueStorage::new(pool, table).await;
        opened.map_err(|error| connection::opening_error(&config, error))
    }

    /// Brings `table` up to date on `pool` and returns the store. Its elements are limited to
    /// the default [`value_bytes_max`](crate::SqlStorageOptions::value_bytes_max); see
    /// [`with_value_bytes_max`](PgQueueStorage::with_value_bytes_max).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn new(pool: Pool, table: QueueTable) -> Result<PgQueueStorage, StorageError> {
        let ran = PgQueueStorage::migrate(&pool, &table).await?;
        tracing::debug!(%table, ?ran, "postgres queue migrations");
        Ok(PgQueueStorage::without_migrations(pool, table))
    }

    /// The store on a table migrated elsewhere, for a role without DDL rights. Runs no
    /// statement.
    pub fn without_migrations(pool: Pool, table: QueueTable) -> PgQueueStorage {
        let limit = ValueLimit::new(ValueBytesMax::default());
        PgQueueStorage { pool, sql: Arc::new(QueueSql::new(table)), limit }
    }

    /// The store with its elements limited to `value_bytes_max` bytes: a longer element is
    /// refused with [`StorageErrorKind::InvalidInput`] before anything is sent.
    pub fn with_value_bytes_max(self, value_bytes_max: ValueBytesMax) -> PgQueueStorage {
        PgQueueStorage { limit: ValueLimit::new(value_bytes_max), ..self }
    }

    /// The most bytes an element may have on this store.
    pub fn value_bytes_max(&self) -> ValueBytesMax {
        self.limit.effective()
    }

    /// Creates or upgrades `table` (history in `<table>_migrations`), as the reference's
    /// migrator does; returns the ids of the migrations that ran. Idempotent, and safe to run
    /// from several processes at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn migrate(pool: &Pool, table: &QueueTable) -> Result<Vec<i32>, StorageError> {
        let migrations = migrations(table);
        let target = MigrationTarget {
            history: quote(&table.history()),
            lock: (fnv1a_32(&format!("effect-queue:{table}")), QUEUE_MIGRATION_LOCK),
            migrations: &migrations,
            retired: &[],
            extra_tables: &[],
            extra_indexes: &[],
        };
        migrate_on_pool(pool, &target).await
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    async fn settle(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn postgres_types::ToSql + Sync)],
    ) -> Result<bool, StorageError> {
        Ok(pooled_execute(&self.pool, what, sql, params).await? > 0)
    }
}

/// Whole seconds as the `double precision` of `make_interval(secs => …)`.
fn seconds(duration: Duration) -> f64 {
    // Whole seconds below 2^53 are exact in an f64.
    whole_seconds(duration) as f64
}

fn count(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

impl QueueStorage for PgQueueStorage {
    fn offer<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
        element: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            self.limit.check("the queue element", element)?;
            let inserted = pooled_execute(
                &self.pool,
                "queue offer",
                &self.sql.offer,
                &[&id, &queue, &element],
            )
            .await?;
            Ok(inserted > 0)
        })
    }

    fn take<'a>(
        &'a self,
        queue: &'a str,
        options: &'a TakeOptions,
    ) -> BoxFuture<'a, Result<ClaimBatch, StorageError>> {
        Box::pin(async move {
            let lock = new_lock()?;
            let limit = i64::from(options.limit.get());
            let params: [&(dyn postgres_types::ToSql + Sync); 5] = [
                &lock,
                &queue,
                &count(options.max_attempts.get()),
                &seconds(options.lock_expiration),
                &limit,
            ];
            let rows = pooled_query(&self.pool, "queue take", &self.sql.take, &params).await?;
            let mut batch = ClaimBatch::default();
            for row in rows {
                let Ok(sequence) = row.try_get::<_, i64>(0) else {
                    tracing::warn!(
                        queue,
                        "a claimed queue row without a readable sequence: skipped"
                    );
                    continue;
                };
                let claim = QueueClaim { sequence, lock: lock.clone() };
                match claimed_item(&row, claim.clone()) {
                    Ok(item) => batch.items.push(item),
                    Err(error) => batch.malformed.push(MalformedClaim { claim, error }),
                }
            }
            Ok(batch)
        })
    }

    fn refresh<'a>(&'a self, claims: &'a [QueueClaim]) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(async move {
            if claims.is_empty() {
                return Ok(0);
            }
            let sequences: Vec<i64> = claims.iter().map(|claim| claim.sequence).collect();
            let locks: Vec<&str> = claims.iter().map(|claim| claim.lock.as_str()).collect();
            pooled_execute(&self.pool, "queue refresh", &self.sql.refresh, &[&sequences, &locks])
                .await
        })
    }

    fn complete<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            self.settle("queue complete", &self.sql.complete, &[&claim.sequence, &claim.lock]).await
        })
    }

    fn retry<'a>(
        &'a self,
        claim: &'a QueueClaim,
        delay: Duration,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            let delay = seconds(delay);
            let params: [&(dyn postgres_types::ToSql + Sync); 4] =
                [&claim.sequence, &claim.lock, &delay, &failure];
            self.settle("queue retry", &self.sql.retry, &params).await
        })
    }

    fn fail<'a>(
        &'a self,
        claim: &'a QueueClaim,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            let params: [&(dyn postgres_types::ToSql + Sync); 3] =
                [&claim.sequence, &claim.lock, &failure];
            self.settle("queue fail", &self.sql.fail, &params).await
        })
    }

    fn release<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            self.settle("queue release", &self.sql.release, &[&claim.sequence, &claim.lock]).await
        })
    }

    fn fail_exhausted<'a>(
        &'a self,
        queue: &'a str,
        max_attempts: NonZeroU32,
        lock_expiration: Duration,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(async move {
            let params: [&(dyn postgres_types::ToSql + Sync); 4] = [
                &queue,
                &count(max_attempts.get()),
                &seconds(lock_expiration),
                &LOCK_EXPIRED_FAILURE,
            ];
            pooled_execute(&self.pool, "queue fail_exhausted", &self.sql.fail_exhausted, &params)
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
                let (state, ttl) = (state.as_str(), seconds(ttl));
                // Batches commit on their own, so a long cleanup never holds many row locks.
                loop {
                    let params: [&(dyn postgres_types::ToSql + Sync); 3] =
                        [&state, &ttl, &CLEANUP_BATCH_LEN];
                    let deleted =
                        pooled_execute(&self.pool, "queue cleanup", &self.sql.cleanup, &params)
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
            let rows =
                pooled_query(&self.pool, "queue item", &self.sql.item, &[&queue, &id]).await?;
            let Some(row) = rows.first() else { return Ok(None) };
            read_item(row).map(Some).map_err(|error| {
                StorageError::with_source(
                    StorageErrorKind::Malformed,
                    format!("queue item {id} of {queue} cannot be read"),
                    error,
                )
            })
        })
    }
}

fn decode(error: tokio_postgres::Error) -> DecodeError {
    DecodeError::new("queue row", error.to_string())
}

/// A claimed row (`sequence, id, element, attempts`).
fn claimed_item(row: &Row, claim: QueueClaim) -> Result<ClaimedItem, DecodeError> {
    Ok(ClaimedItem {
        claim,
        id: row.try_get(1).map_err(decode)?,
        element: row.try_get(2).map_err(decode)?,
        attempts: attempts(i64::from(row.try_get::<_, i32>(3).map_err(decode)?))?,
    })
}

/// An item row (`id, state, attempts, claimed, last_failure, element`).
fn read_item(row: &Row) -> Result<QueueItem, DecodeError> {
    Ok(QueueItem {
        id: row.try_get(0).map_err(decode)?,
        state: QueueItemState::parse(row.try_get(1).map_err(decode)?)?,
        attempts: attempts(i64::from(row.try_get::<_, i32>(2).map_err(decode)?))?,
        claimed: row.try_get(3).map_err(decode)?,
        last_failure: row.try_get(4).map_err(decode)?,
        element: row.try_get(5).map_err(decode)?,
    })
}

/// `name` as a quoted identifier; table names are validated identifiers, so there is nothing
/// to escape.
fn quote(name: &str) -> String {
    format!("\"{name}\"")
}

/// Every SQL text of the store on one table. Locks (`$2` of the settlements) are text cast to
/// `UUID`; durations are whole seconds for `make_interval`.
#[derive(Debug)]
struct QueueSql {
    table: QueueTable,
    offer: String,
    take: String,
    refresh: String,
    complete: String,
    retry: String,
    fail: String,
    release: String,
    fail_exhausted: String,
    cleanup: String,
    item: String,
}

impl QueueSql {
    fn new(table: QueueTable) -> QueueSql {
        let t = quote(table.as_str());
        // The columns keep no time zone: every time is UTC, whatever the session's zone.
        let now = "(NOW() AT TIME ZONE 'UTC')";
        let settled = format!("acquired_at = NULL, acquired_by = NULL, updated_at = {now}");
        let held = "WHERE sequence = $1 AND acquired_by = $2::text::uuid";
        QueueSql {
            offer: format!(
                "INSERT INTO {t} \
                 (id, queue_name, element, state, attempts, visible_at, created_at, updated_at) \
                 VALUES ($1, $2, $3, 'pending', 0, {now}, {now}, {now}) \
                 ON CONFLICT (id, queue_name) DO NOTHING"
            ),
            // $1: lock, $2: queue, $3: max attempts, $4: lock expiration, $5: limit.
            take: format!(
                "WITH claimed AS ( \
                   UPDATE {t} \
                   SET acquired_at = {now}, acquired_by = $1::text::uuid, \
                   attempts = attempts + 1 \
                   WHERE sequence IN ( \
                     SELECT sequence FROM {t} \
                     WHERE queue_name = $2 \
                     AND state = 'pending' \
                     AND attempts < $3 \
                     AND visible_at <= {now} \
                     AND (acquired_at IS NULL \
                          OR acquired_at < {now} - make_interval(secs => $4)) \
                     ORDER BY visible_at ASC, sequence ASC \
                     LIMIT $5 \
                     FOR UPDATE SKIP LOCKED \
                   ) \
                   RETURNING sequence, id, element, attempts, visible_at \
                 ) \
                 SELECT sequence, id, element, attempts FROM claimed \
                 ORDER BY visible_at ASC, sequence ASC"
            ),
            // A row only ever carries the lock of the poll that claimed it, so matching every
            // sequence against every lock renews exactly these claims.
            refresh: format!(
                "UPDATE {t} SET acquired_at = {now} \
                 WHERE sequence = ANY($1) AND acquired_by = ANY($2::text[]::uuid[])"
            ),
            complete: format!("UPDATE {t} SET {settled}, state = 'completed' {held}"),
            // $3: delay, $4: failure.
            retry: format!(
                "UPDATE {t} SET {settled}, \
                 visible_at = {now} + make_interval(secs => $3), \
                 last_failure = $4 {held}"
            ),
            fail: format!("UPDATE {t} SET {settled}, state = 'failed', last_failure = $3 {held}"),
            release: format!(
                "UPDATE {t} SET acquired_at = NULL, acquired_by = NULL, attempts = attempts - 1 \
                 {held}"
            ),
            // $1: queue, $2: max attempts, $3: lock expiration, $4: the failure of a lapsed
            // claim.
            fail_exhausted: format!(
                "UPDATE {t} SET state = 'failed', {settled}, \
                 last_failure = COALESCE(last_failure, $4) \
                 WHERE queue_name = $1 \
                 AND state = 'pending' \
                 AND attempts >= $2 \
                 AND (acquired_at IS NULL \
                      OR acquired_at < {now} - make_interval(secs => $3))"
            ),
            // $1: state, $2: time to live, $3: batch size.
            cleanup: format!(
                "DELETE FROM {t} WHERE sequence IN ( \
                   SELECT sequence FROM {t} \
                   WHERE state = $1 \
                   AND updated_at <= {now} - make_interval(secs => $2) \
                   LIMIT $3 \
                 )"
            ),
            item: format!(
                "SELECT id, state, attempts, acquired_by IS NOT NULL, last_failure, element \
                 FROM {t} WHERE queue_name = $1 AND id = $2"
            ),
            table,
        }
    }
}

/// The reference's migrations of the queue table, PostgreSQL dialect: `0001_create_table` and
/// `0002_upgrade_schema`.
fn migrations(table: &QueueTable) -> Vec<Migration> {
    let t = quote(table.as_str());
    let (id_index, take_index, update_index) =
        (quote(&table.index("id")), quote(&table.index("take")), quote(&table.index("update")));
    vec![
        Migration {
            id: 1,
            name: "create_table",
            statements: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} ( \
                       sequence SERIAL PRIMARY KEY, \
                       id VARCHAR(36) NOT NULL, \
                       queue_name VARCHAR(100) NOT NULL, \
                       element TEXT NOT NULL, \
                       completed BOOLEAN NOT NULL, \
                       attempts INTEGER NOT NULL DEFAULT 0, \
                       last_failure TEXT NULL, \
                       acquired_at TIMESTAMP NULL, \
                       acquired_by UUID NULL, \
                       created_at TIMESTAMP NOT NULL, \
                       updated_at TIMESTAMP NOT NULL \
                     )"
                ),
                format!("CREATE UNIQUE INDEX IF NOT EXISTS {id_index} ON {t} (id, queue_name)"),
                format!(
                    "CREATE INDEX IF NOT EXISTS {take_index} \
                     ON {t} (queue_name, completed, attempts, acquired_at)"
                ),
                format!("CREATE INDEX IF NOT EXISTS {update_index} ON {t} (sequence, acquired_by)"),
            ],
        },
        Migration {
            id: 2,
            name: "upgrade_schema",
            statements: vec![
                format!("DROP INDEX IF EXISTS {take_index}"),
                format!(
                    "ALTER TABLE {t} ADD COLUMN state VARCHAR(10), ADD COLUMN visible_at TIMESTAMP"
                ),
                format!(
                    "UPDATE {t} \
                     SET state = CASE WHEN completed THEN 'completed' ELSE 'pending' END, \
                     visible_at = updated_at"
                ),
                format!(
                    "ALTER TABLE {t} \
                     ALTER COLUMN sequence TYPE BIGINT, \
                     ALTER COLUMN id TYPE VARCHAR(255), \
                     ALTER COLUMN queue_name TYPE VARCHAR(255), \
                     ALTER COLUMN state SET NOT NULL, \
                     ALTER COLUMN visible_at SET NOT NULL, \
                     DROP COLUMN completed"
                ),
                // Partial, so that takers never scan settled rows.
                format!(
                    "CREATE INDEX {take_index} ON {t} (queue_name, visible_at) \
                     WHERE state = 'pending'"
                ),
            ],
        },
    ]
}
