//! [`MySqlQueueStorage`]: the persisted queue contract of `cluster_core::queue_storage` on a
//! `mysql_async` pool, in the reference's table (`effect_queue` by default) with its MySQL DDL,
//! SQL and migration history (`makeStoreSql` and `sqlMigrations` in
//! `effect/src/persistence/PersistedQueue.ts`), so a TypeScript worker can share the queue.
//!
//! A claim is a transaction: `SELECT … FOR UPDATE SKIP LOCKED` picks the rows (concurrent takers
//! skip each other's), an `UPDATE` claims them. It runs in `READ COMMITTED`, as the message
//! storage's transactions do, and again when InnoDB picks it as a deadlock victim. Times are the
//! database clock in UTC (`UTC_TIMESTAMP()`, whole seconds: `DATETIME` keeps no time zone, and
//! the session's `NOW()` would move at a daylight saving change). Values are checked against
//! their columns before an `INSERT IGNORE`, which would otherwise truncate them with a mere
//! warning; an element against `value_bytes_max`, capped by what a row holds within MariaDB's
//! default `max_allowed_packet` (16 MiB).

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::queue_storage::{
    ClaimBatch, ClaimedItem, LOCK_EXPIRED_FAILURE, MalformedClaim, QueueClaim, QueueItem,
    QueueItemState, QueueStorage, TakeOptions,
};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, Pool, Row, TxOpts, Value};

use super::classify::{is_deadlock, storage_error};
use super::columns::{Columns, queue_element_limit};
use super::connection;
use super::migrate::run_migrations;
use super::queries::{self, DdlStatement, IN_LIST_LEN_MAX, Migration, placeholders};
use crate::options::ValueBytesMax;
use crate::queue::{CLEANUP_BATCH_LEN, QueueTable, attempts, check_name, new_lock, whole_seconds};
use crate::row::ValueLimit;
/// How often a claim runs when InnoDB keeps choosing it as a deadlock victim.
const DEADLOCK_ATTEMPTS_MAX: u32 = 3;

/// The MySQL (and MariaDB) [`QueueStorage`]. Every method takes a connection from the pool for
/// its duration.
pub struct MySqlQueueStorage {
    pool: Pool,
    sql: QueueSql,
    /// The most bytes of an element: `value_bytes_max`, capped at 16 MiB − 64 KiB.
    limit: ValueLimit,
}

impl fmt::Debug for MySqlQueueStorage {
    /// Names the table only: the pool's options hold the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlQueueStorage").field("table", &self.sql.table).finish_non_exhaustive()
    }
}

impl MySqlQueueStorage {
    /// Connects to the `mysql://` URL `url` with a pool of
    /// [`POOL_SIZE_DEFAULT`](super::POOL_SIZE_DEFAULT) connections ([`pool`](super::pool)),
    /// brings `table` up to date and returns the store.
    ///
    /// # Cancel safety
    ///
    /// As [`migrate`](MySqlQueueStorage::migrate).
    pub async fn connect(url: &str, table: QueueTable) -> Result<MySqlQueueStorage, StorageError> {
        let pool = connection::pool(url, connection::POOL_SIZE_DEFAULT)
            .await
            .map_err(|error| connection::opening_error(url, error))?;
        let opened = MySqlQueueStorage::new(pool, table).await;
        opened.map_err(|error| connection::opening_error(url, error))
    }

    /// Brings `table` up to date on `pool` and returns the store. Its elements are limited to
    /// the default [`value_bytes_max`](crate::SqlStorageOptions::value_bytes_max), capped at
    /// 16,711,680 bytes; see [`with_value_bytes_max`](MySqlQueueStorage::with_value_bytes_max).
    ///
    /// # Cancel safety
    ///
    /// As [`migrate`](MySqlQueueStorage::migrate).
    pub async fn new(pool: Pool, table: QueueTable) -> Result<MySqlQueueStorage, StorageError> {
        MySqlQueueStorage::migrate(&pool, &table).await?;
        Ok(MySqlQueueStorage::without_migrations(pool, table))
    }

    /// The store on a table migrated elsewhere, without running any DDL.
    pub fn without_migrations(pool: Pool, table: QueueTable) -> MySqlQueueStorage {
        let limit = queue_element_limit(ValueBytesMax::default());
        MySqlQueueStorage { pool, sql: QueueSql::new(table), limit }
    }

    /// The store with its elements limited to `value_bytes_max` bytes, or to 16,711,680 bytes
    /// (16 MiB − 64 KiB) if that is less: a longer element is refused with
    /// [`StorageErrorKind::InvalidInput`] before anything is sent.
    ///
    /// The `element` column is a `MEDIUMTEXT` (16,777,215 bytes), but a statement and a row
    /// must also fit the server's `max_allowed_packet`, 16 MiB by default on MariaDB; the cap
    /// leaves room for the rest of the row. A server with a smaller `max_allowed_packet`
    /// (4 MiB on MySQL 5.7) needs a `value_bytes_max` at least 64 KiB below it.
    pub fn with_value_bytes_max(self, value_bytes_max: ValueBytesMax) -> MySqlQueueStorage {
        MySqlQueueStorage { limit: queue_element_limit(value_bytes_max), ..self }
    }

    /// The most bytes an element may have on this store: `value_bytes_max`, or 16,711,680
    /// bytes if that is less.
    pub fn value_bytes_max(&self) -> ValueBytesMax {
        self.limit.effective()
    }

    /// Creates or upgrades `table`, recording the migrations in `<table>_migrations` as
    /// effect's SQL migrator does. Idempotent; concurrent callers are serialised by a
    /// `GET_LOCK` on the history table's name.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent up to the upgrade's statements: a migration is recorded
    /// only after it ran. A dropped call closes its connection, which releases the migration
    /// lock.
    pub async fn migrate(pool: &Pool, table: &QueueTable) -> Result<(), StorageError> {
        let key_columns = queries::queue_key_columns(table.as_str());
        run_migrations(pool, &table.history(), migrations(table), Vec::new(), key_columns).await
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    async fn conn(&self) -> Result<Conn, StorageError> {
        self.pool.get_conn().await.map_err(|error| storage_error("cannot get a connection", error))
    }

    /// Runs `sql` with `params` and returns the number of rows it changed.
    async fn execute(
        &self,
        what: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<u64, StorageError> {
        let mut conn = self.conn().await?;
        conn.exec_drop(sql, params).await.map_err(|error| storage_error(what, error))?;
        Ok(conn.affected_rows())
    }

    async fn settle(
        &self,
        what: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<bool, StorageError> {
        Ok(self.execute(what, sql, params).await? > 0)
    }

    /// One claim transaction.
    async fn claim(
        &self,
        queue: &str,
        lock: &str,
        options: &TakeOptions,
    ) -> Result<Vec<Row>, StorageError> {
        let mut tx_options = TxOpts::default();
        tx_options.with_isolation_level(IsolationLevel::ReadCommitted);
        let mut tx = self
            .pool
            .start_transaction(tx_options)
            .await
            .map_err(|error| storage_error("cannot start a transaction", error))?;
        let params: Vec<Value> = vec![
            queue.into(),
            options.max_attempts.get().into(),
            whole_seconds(options.lock_expiration).into(),
            options.limit.get().into(),
        ];
        let rows: Vec<Row> = tx
            .exec(self.sql.select_claimable.as_str(), params)
            .await
            .map_err(|error| storage_error("queue take: select", error))?;
        let mut params: Vec<Value> = vec![lock.into()];
        params.extend(rows.iter().filter_map(|row| row.as_ref(0)).cloned());
        let sequences = params.len() - 1;
        if sequences > 0 {
            tx.exec_drop(self.sql.claim(sequences), params)
                .await
                .map_err(|error| storage_error("queue take: claim", error))?;
        }
        tx.commit().await.map_err(|error| storage_error("queue take: commit", error))?;
        Ok(rows)
    }
}

impl QueueStorage for MySqlQueueStorage {
    fn offer<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
        element: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            check_name("id", id)?;
            check_name("queue_name", queue)?;
            self.limit.check("the queue element", element)?;
            let params = vec![id.into(), queue.into(), element.into()];
            Ok(self.execute("queue offer", &self.sql.offer, params).await? > 0)
        })
    }

    fn take<'a>(
        &'a self,
        queue: &'a str,
        options: &'a TakeOptions,
    ) -> BoxFuture<'a, Result<ClaimBatch, StorageError>> {
        Box::pin(async move {
            let lock = new_lock()?;
            let mut attempt = 1;
            let rows = loop {
                match self.claim(queue, &lock, options).await {
                    Ok(rows) => break rows,
                    Err(error) if attempt < DEADLOCK_ATTEMPTS_MAX && is_deadlock(&error) => {
                        tracing::debug!(%error, attempt, "deadlock victim; retrying the claim");
                        attempt += 1;
                    }
                    Err(error) => return Err(error),
                }
            };
            let mut batch = ClaimBatch::default();
            for row in rows {
                let mut columns = Columns::new(row);
                let Ok(Some(sequence)) = columns.int() else {
                    tracing::warn!(
                        queue,
                        "a claimed queue row without a readable sequence: skipped"
                    );
                    continue;
                };
                let claim = QueueClaim { sequence, lock: lock.clone() };
                match claimed_item(&mut columns, claim.clone()) {
                    Ok(item) => batch.items.push(item),
                    Err(error) => batch.malformed.push(MalformedClaim { claim, error }),
                }
            }
            Ok(batch)
        })
    }

    fn refresh<'a>(&'a self, claims: &'a [QueueClaim]) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(async move {
            let mut conn = self.conn().await?;
            let mut held = 0;
            for chunk in claims.chunks(IN_LIST_LEN_MAX) {
                let mut params: Vec<Value> =
                    chunk.iter().map(|claim| claim.sequence.into()).collect();
                params.extend(chunk.iter().map(|claim| Value::from(claim.lock.as_str())));
                conn.exec_drop(self.sql.refresh(chunk.len()), params.clone())
                    .await
                    .map_err(|error| storage_error("queue refresh", error))?;
                // MySQL counts changed rows, and a claim refreshed within its second is not
                // changed: count the claims still held instead.
                let count: Option<i64> = conn
                    .exec_first(self.sql.held(chunk.len()), params)
                    .await
                    .map_err(|error| storage_error("queue refresh: count", error))?;
                held += count.and_then(|count| u64::try_from(count).ok()).unwrap_or(0);
            }
            Ok(held)
        })
    }

    fn complete<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        let params = vec![claim.sequence.into(), claim.lock.as_str().into()];
        Box::pin(self.settle("queue complete", &self.sql.complete, params))
    }

    fn retry<'a>(
        &'a self,
        claim: &'a QueueClaim,
        delay: Duration,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        let params = vec![
            whole_seconds(delay).into(),
            failure.into(),
            claim.sequence.into(),
            claim.lock.as_str().into(),
        ];
        Box::pin(self.settle("queue retry", &self.sql.retry, params))
    }

    fn fail<'a>(
        &'a self,
        claim: &'a QueueClaim,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        let params = vec![failure.into(), claim.sequence.into(), claim.lock.as_str().into()];
        Box::pin(self.settle("queue fail", &self.sql.fail, params))
    }

    fn release<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        let params = vec![claim.sequence.into(), claim.lock.as_str().into()];
        Box::pin(self.settle("queue release", &self.sql.release, params))
    }

    fn fail_exhausted<'a>(
        &'a self,
        queue: &'a str,
        max_attempts: NonZeroU32,
        lock_expiration: Duration,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        let params = vec![
            LOCK_EXPIRED_FAILURE.into(),
            queue.into(),
            max_attempts.get().into(),
            whole_seconds(lock_expiration).into(),
        ];
        Box::pin(self.execute("queue fail_exhausted", &self.sql.fail_exhausted, params))
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
                // Batches commit on their own, so a long cleanup never holds many row locks.
                loop {
                    let params = vec![
                        state.as_str().into(),
                        whole_seconds(ttl).into(),
                        CLEANUP_BATCH_LEN.into(),
                    ];
                    let deleted = self.execute("queue cleanup", &self.sql.cleanup, params).await?;
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
            let mut conn = self.conn().await?;
            let row: Option<Row> = conn
                .exec_first(self.sql.item.as_str(), (queue, id))
                .await
                .map_err(|error| storage_error("queue item", error))?;
            let Some(row) = row else { return Ok(None) };
            read_item(&mut Columns::new(row)).map(Some).map_err(|error| {
                StorageError::with_source(
                    StorageErrorKind::Malformed,
                    format!("queue item {id} of {queue} cannot be read"),
                    error,
                )
            })
        })
    }
}

fn required<T>(value: Option<T>, column: &str) -> Result<T, DecodeError> {
    value.ok_or_else(|| DecodeError::new("queue row", format!("{column} is NULL")))
}

/// The rest of a claimed row (`id, element, attempts`, after the sequence).
fn claimed_item(columns: &mut Columns, claim: QueueClaim) -> Result<ClaimedItem, DecodeError> {
    let id = required(columns.text()?, "id")?;
    let element = required(columns.text()?, "element")?;
    // The row was read before the claim's update counted the attempt.
    let attempts = attempts(required(columns.int()?, "attempts")?.saturating_add(1))?;
    Ok(ClaimedItem { claim, id, attempts, element })
}

/// An item row (`id, state, attempts, claimed, last_failure, element`).
fn read_item(columns: &mut Columns) -> Result<QueueItem, DecodeError> {
    Ok(QueueItem {
        id: required(columns.text()?, "id")?,
        state: QueueItemState::parse(&required(columns.text()?, "state")?)?,
        attempts: attempts(required(columns.int()?, "attempts")?)?,
        claimed: required(columns.boolean()?, "claimed")?,
        last_failure: columns.text()?,
        element: required(columns.text()?, "element")?,
    })
}

fn quote(name: &str) -> String {
    format!("`{name}`")
}

/// Every SQL text of the store on one table.
#[derive(Debug)]
struct QueueSql {
    table: QueueTable,
    offer: String,
    select_claimable: String,
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
        let settled = "acquired_at = NULL, acquired_by = NULL, updated_at = UTC_TIMESTAMP()";
        let held = "WHERE sequence = ? AND acquired_by = ?";
        QueueSql {
            offer: format!(
                "INSERT IGNORE INTO {t} \
                 (id, queue_name, element, state, attempts, visible_at, created_at, updated_at) \
                 VALUES (?, ?, ?, 'pending', 0, UTC_TIMESTAMP(), UTC_TIMESTAMP(), UTC_TIMESTAMP())"
            ),
            // queue, max attempts, lock expiration (seconds), limit.
            select_claimable: format!(
                "SELECT sequence, id, element, attempts FROM {t} \
                 WHERE queue_name = ? \
                 AND state = 'pending' \
                 AND attempts < ? \
                 AND visible_at <= UTC_TIMESTAMP() \
                 AND (acquired_at IS NULL \
                      OR acquired_at < DATE_SUB(UTC_TIMESTAMP(), INTERVAL ? SECOND)) \
                 ORDER BY visible_at ASC, sequence ASC \
                 LIMIT ? \
                 FOR UPDATE SKIP LOCKED"
            ),
            complete: format!("UPDATE {t} SET {settled}, state = 'completed' {held}"),
            // delay (seconds), failure, then the claim.
            retry: format!(
                "UPDATE {t} SET {settled}, \
                 visible_at = DATE_ADD(UTC_TIMESTAMP(), INTERVAL ? SECOND), \
                 last_failure = ? {held}"
            ),
            fail: format!("UPDATE {t} SET {settled}, state = 'failed', last_failure = ? {held}"),
            release: format!(
                "UPDATE {t} SET acquired_at = NULL, acquired_by = NULL, attempts = attempts - 1 \
                 {held}"
            ),
            // The failure of a lapsed claim, queue, max attempts, lock expiration (seconds).
            fail_exhausted: format!(
                "UPDATE {t} SET state = 'failed', {settled}, \
                 last_failure = COALESCE(last_failure, ?) \
                 WHERE queue_name = ? \
                 AND state = 'pending' \
                 AND attempts >= ? \
                 AND (acquired_at IS NULL \
                      OR acquired_at < DATE_SUB(UTC_TIMESTAMP(), INTERVAL ? SECOND))"
            ),
            // state, time to live (seconds), batch size.
            cleanup: format!(
                "DELETE FROM {t} \
                 WHERE state = ? AND updated_at <= DATE_SUB(UTC_TIMESTAMP(), INTERVAL ? SECOND) \
                 LIMIT ?"
            ),
            item: format!(
                "SELECT id, state, attempts, acquired_by IS NOT NULL, last_failure, element \
                 FROM {t} WHERE queue_name = ? AND id = ?"
            ),
            table,
        }
    }

    /// Claims `n` selected rows: the lock, then their sequences.
    fn claim(&self, n: usize) -> String {
        format!(
            "UPDATE {} SET acquired_at = UTC_TIMESTAMP(), acquired_by = ?, \
             attempts = attempts + 1 WHERE sequence IN ({})",
            quote(self.table.as_str()),
            placeholders(n)
        )
    }

    /// Renews `n` claims: their sequences, then their locks. A row only ever carries the lock
    /// of the poll that claimed it, so matching every sequence against every lock renews
    /// exactly these claims.
    fn refresh(&self, n: usize) -> String {
        format!(
            "UPDATE {} SET acquired_at = UTC_TIMESTAMP() \
             WHERE sequence IN ({}) AND acquired_by IN ({})",
            quote(self.table.as_str()),
            placeholders(n),
            placeholders(n)
        )
    }

    /// Counts which of `n` claims still hold their rows, with [`refresh`](QueueSql::refresh)'s
    /// parameters.
    fn held(&self, n: usize) -> String {
        format!(
            "SELECT COUNT(*) FROM {} WHERE sequence IN ({}) AND acquired_by IN ({})",
            quote(self.table.as_str()),
            placeholders(n),
            placeholders(n)
        )
    }
}

/// The reference's migrations of the queue table, MySQL dialect: `0001_create_table` (whose
/// index creations ignore errors, MySQL having no `IF NOT EXISTS` for them) and
/// `0002_upgrade_schema`.
fn migrations(table: &QueueTable) -> Vec<Migration> {
    let t = quote(table.as_str());
    let (id_index, take_index, update_index) =
        (quote(&table.index("id")), quote(&table.index("take")), quote(&table.index("update")));
    let strict = |sql: String| DdlStatement { sql, ignore_server_errors: false };
    let lenient = |sql: String| DdlStatement { sql, ignore_server_errors: true };
    vec![
        Migration {
            id: 1,
            name: "create_table",
            statements: vec![
                strict(format!(
                    "CREATE TABLE IF NOT EXISTS {t} (
                      sequence BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
                      id VARCHAR(36) NOT NULL,
                      queue_name VARCHAR(100) NOT NULL,
                      element TEXT NOT NULL,
                      completed BOOLEAN NOT NULL,
                      attempts INT NOT NULL DEFAULT 0,
                      last_failure TEXT NULL,
                      acquired_at DATETIME NULL,
                      acquired_by VARCHAR(36) NULL,
                      created_at DATETIME NOT NULL,
                      updated_at DATETIME NOT NULL
                    )"
                )),
                lenient(format!("CREATE UNIQUE INDEX {id_index} ON {t} (id, queue_name)")),
                lenient(format!(
                    "CREATE INDEX {take_index} ON {t} (queue_name, completed, attempts, acquired_at)"
                )),
                lenient(format!("CREATE INDEX {update_index} ON {t} (sequence, acquired_by)")),
            ],
        },
        Migration {
            id: 2,
            name: "upgrade_schema",
            statements: vec![
                strict(format!("DROP INDEX {take_index} ON {t}")),
                strict(format!(
                    "ALTER TABLE {t} \
                     MODIFY COLUMN id VARCHAR(255) NOT NULL, \
                     MODIFY COLUMN queue_name VARCHAR(255) NOT NULL, \
                     MODIFY COLUMN element MEDIUMTEXT NOT NULL, \
                     MODIFY COLUMN last_failure MEDIUMTEXT NULL, \
                     ADD COLUMN state VARCHAR(10) NULL, \
                     ADD COLUMN visible_at DATETIME NULL"
                )),
                strict(format!(
                    "UPDATE {t} \
                     SET state = CASE WHEN completed THEN 'completed' ELSE 'pending' END, \
                     visible_at = updated_at"
                )),
                strict(format!(
                    "ALTER TABLE {t} \
                     MODIFY COLUMN state VARCHAR(10) NOT NULL, \
                     MODIFY COLUMN visible_at DATETIME NOT NULL, \
                     DROP COLUMN completed"
                )),
                strict(format!("CREATE INDEX {take_index} ON {t} (queue_name, state, visible_at)")),
            ],
        },
    ]
}
