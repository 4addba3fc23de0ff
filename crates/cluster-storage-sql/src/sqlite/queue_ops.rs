//! The worker side of the persisted queue: the [`QueueOp`] commands
//! [`SqliteQueueStorage`](super::SqliteQueueStorage) sends its worker, the blocking code the
//! worker thread runs for them, and the SQL and migrations of the queue table.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::queue_storage::{
    ClaimBatch, ClaimedItem, LOCK_EXPIRED_FAILURE, MalformedClaim, QueueClaim, QueueItem,
    QueueItemState, TakeOptions,
};
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::queries;
use super::state::{Responder, WorkerState, classify};
use crate::queue::{CLEANUP_BATCH_LEN, QueueTable, attempts, whole_seconds};

/// A queue store command: its table's SQL and the operation.
pub(super) struct QueueOp {
    pub(super) sql: Arc<QueueSql>,
    pub(super) call: QueueCall,
}

/// The queue store operations.
pub(super) enum QueueCall {
    Migrate {
        reply: Responder<Vec<i64>>,
    },
    Offer {
        queue: String,
        id: String,
        element: String,
        reply: Responder<bool>,
    },
    Take {
        queue: String,
        lock: String,
        options: TakeOptions,
        reply: Responder<ClaimBatch>,
    },
    Refresh {
        sequences: String,
        locks: String,
        reply: Responder<u64>,
    },
    Settle {
        sequence: i64,
        lock: String,
        settlement: Settlement,
        reply: Responder<bool>,
    },
    FailExhausted {
        queue: String,
        max_attempts: NonZeroU32,
        lock_expiration: Duration,
        reply: Responder<u64>,
    },
    CleanupBatch {
        state: QueueItemState,
        ttl: Duration,
        reply: Responder<u64>,
    },
    Item {
        queue: String,
        id: String,
        reply: Responder<Option<QueueItem>>,
    },
}

/// How a claim is settled.
pub(super) enum Settlement {
    Complete,
    Retry { delay: Duration, failure: String },
    Fail { failure: String },
    Release,
}

/// Runs a queue operation on the worker thread.
pub(super) fn run_operation(state: &WorkerState, op: QueueOp) {
    let connection = &state.connection;
    let sql = &*op.sql;
    match op.call {
        QueueCall::Migrate { reply } => {
            let _ = reply
                .send(migrate(connection, &sql.table).map_err(|e| classify("queue migrate", e)));
        }
        QueueCall::Offer { queue, id, element, reply } => {
            let result = execute(connection, &sql.offer, params![id, queue, element]);
            let _ = reply.send(result.map(|n| n > 0).map_err(|e| classify("queue offer", e)));
        }
        QueueCall::Take { queue, lock, options, reply } => {
            let result = take(connection, sql, &queue, &lock, &options);
            let _ = reply.send(result.map_err(|e| classify("queue take", e)));
        }
        QueueCall::Refresh { sequences, locks, reply } => {
            let result = execute(connection, &sql.refresh, params![sequences, locks]);
            let _ = reply.send(result.map_err(|e| classify("queue refresh", e)));
        }
        QueueCall::Settle { sequence, lock, settlement, reply } => {
            let result = match settlement {
                Settlement::Complete => execute(connection, &sql.complete, params![sequence, lock]),
                Settlement::Retry { delay, failure } => {
                    let visible = format!("+{} seconds", whole_seconds(delay));
                    execute(connection, &sql.retry, params![sequence, lock, visible, failure])
                }
                Settlement::Fail { failure } => {
                    execute(connection, &sql.fail, params![sequence, lock, failure])
                }
                Settlement::Release => execute(connection, &sql.release, params![sequence, lock]),
            };
            let _ = reply.send(result.map(|n| n > 0).map_err(|e| classify("queue settle", e)));
        }
        QueueCall::FailExhausted { queue, max_attempts, lock_expiration, reply } => {
            let expired = ago(lock_expiration);
            let parameters = params![queue, max_attempts.get(), expired, LOCK_EXPIRED_FAILURE];
            let result = execute(connection, &sql.fail_exhausted, parameters);
            let _ = reply.send(result.map_err(|e| classify("queue fail_exhausted", e)));
        }
        QueueCall::CleanupBatch { state, ttl, reply } => {
            let parameters = params![state.as_str(), ago(ttl), CLEANUP_BATCH_LEN];
            let result = execute(connection, &sql.cleanup, parameters);
            let _ = reply.send(result.map_err(|e| classify("queue cleanup", e)));
        }
        QueueCall::Item { queue, id, reply } => {
            let result = item(connection, sql, &queue, &id);
            let _ = reply.send(result);
        }
    }
}

/// The `datetime` modifier of `duration` ago, in whole seconds rounded up.
fn ago(duration: Duration) -> String {
    format!("-{} seconds", whole_seconds(duration))
}

fn execute(
    connection: &Connection,
    sql: &str,
    parameters: &[&dyn rusqlite::ToSql],
) -> rusqlite::Result<u64> {
    let changed = connection.prepare_cached(sql)?.execute(parameters)?;
    Ok(u64::try_from(changed).unwrap_or(u64::MAX))
}

/// Claims and reads the items, oldest visible first (`RETURNING` keeps no order).
fn take(
    connection: &Connection,
    sql: &QueueSql,
    queue: &str,
    lock: &str,
    options: &TakeOptions,
) -> rusqlite::Result<ClaimBatch> {
    let mut statement = connection.prepare_cached(&sql.take)?;
    let parameters = params![
        lock,
        queue,
        options.max_attempts.get(),
        ago(options.lock_expiration),
        options.limit.get()
    ];
    let mut rows: Vec<(String, i64, Result<ClaimedItem, DecodeError>)> = Vec::new();
    let mut returned = statement.query(parameters)?;
    while let Some(row) = returned.next()? {
        // A claim is settled by its row's sequence: a row without a readable one cannot be, and
        // is left to `fail_exhausted` once its attempts are used up.
        let ValueRef::Integer(sequence) = row.get_ref(0)? else {
            tracing::warn!(queue, "a claimed queue row without a readable sequence: skipped");
            continue;
        };
        let claim = QueueClaim { sequence, lock: lock.to_owned() };
        let visible_at = queries::text(row.get_ref(4)?).unwrap_or_default();
        rows.push((visible_at, sequence, claimed_item(row, claim)));
    }
    drop(returned);
    rows.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    let mut batch = ClaimBatch::default();
    for (_, sequence, item) in rows {
        match item {
            Ok(item) => batch.items.push(item),
            Err(error) => {
                let claim = QueueClaim { sequence, lock: lock.to_owned() };
                batch.malformed.push(MalformedClaim { claim, error });
            }
        }
    }
    Ok(batch)
}

/// A claimed row (`sequence, id, element, attempts, visible_at`), read leniently.
fn claimed_item(row: &Row<'_>, claim: QueueClaim) -> Result<ClaimedItem, DecodeError> {
    let id =
        queries::text(column(row, 1)?).ok_or_else(|| DecodeError::new("queue row", "no id"))?;
    let element = text_column(column(row, 2)?, "element")?;
    let attempts = read_attempts(column(row, 3)?)?;
    Ok(ClaimedItem { claim, id, attempts, element })
}

/// A text column that must hold UTF-8 text: anything else is a malformed row.
fn text_column(value: ValueRef<'_>, name: &str) -> Result<String, DecodeError> {
    match value {
        ValueRef::Text(bytes) => String::from_utf8(bytes.to_vec())
            .map_err(|_| DecodeError::new("queue row", format!("{name} is not UTF-8"))),
        other => Err(DecodeError::new(
            "queue row",
            format!("{name} is {:?}, not text", other.data_type()),
        )),
    }
}

fn read_attempts(value: ValueRef<'_>) -> Result<u32, DecodeError> {
    match value {
        ValueRef::Integer(integer) => attempts(integer),
        other => Err(DecodeError::new(
            "queue row",
            format!("attempts is {:?}, not an integer", other.data_type()),
        )),
    }
}

fn item(
    connection: &Connection,
    sql: &QueueSql,
    queue: &str,
    id: &str,
) -> Result<Option<QueueItem>, StorageError> {
    let found = connection
        .prepare_cached(&sql.item)
        .and_then(|mut statement| {
            statement.query_row(params![queue, id], |row| Ok(read_item(row))).optional()
        })
        .map_err(|e| classify("queue item", e))?;
    match found {
        None => Ok(None),
        Some(Ok(item)) => Ok(Some(item)),
        Some(Err(error)) => Err(StorageError::with_source(
            StorageErrorKind::Malformed,
            format!("queue item {id} of {queue} cannot be read"),
            error,
        )),
    }
}

/// An item row (`id, state, attempts, acquired_by, last_failure, element`).
fn read_item(row: &Row<'_>) -> Result<QueueItem, DecodeError> {
    Ok(QueueItem {
        id: queries::text(column(row, 0)?).unwrap_or_default(),
        state: QueueItemState::parse(&queries::text(column(row, 1)?).unwrap_or_default())?,
        attempts: read_attempts(column(row, 2)?)?,
        claimed: !matches!(column(row, 3)?, ValueRef::Null),
        last_failure: queries::text(column(row, 4)?),
        element: text_column(column(row, 5)?, "element")?,
    })
}

fn column<'r>(row: &'r Row<'_>, index: usize) -> Result<ValueRef<'r>, DecodeError> {
    row.get_ref(index).map_err(|error| DecodeError::new("queue row", error.to_string()))
}

/// Every SQL text of the store on one table. `?` parameters named `expired` and `visible` take
/// `datetime` modifiers such as `-120 seconds`.
#[derive(Debug)]
pub(super) struct QueueSql {
    pub(super) table: QueueTable,
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
    pub(super) fn new(table: QueueTable) -> QueueSql {
        let t = table.as_str();
        let settled = "acquired_at = NULL, acquired_by = NULL, updated_at = CURRENT_TIMESTAMP";
        let held = "WHERE sequence = ?1 AND acquired_by = ?2";
        QueueSql {
            offer: format!(
                "INSERT OR IGNORE INTO {t} \
                 (id, queue_name, element, state, attempts, visible_at, created_at, updated_at) \
                 VALUES (?1, ?2, ?3, 'pending', 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, \
                 CURRENT_TIMESTAMP)"
            ),
            // ?1: lock, ?2: queue, ?3: max attempts, ?4: expired, ?5: limit.
            take: format!(
                "UPDATE {t} \
                 SET acquired_at = CURRENT_TIMESTAMP, acquired_by = ?1, attempts = attempts + 1 \
                 WHERE sequence IN ( \
                   SELECT sequence FROM {t} \
                   WHERE queue_name = ?2 \
                   AND state = 'pending' \
                   AND attempts < ?3 \
                   AND visible_at <= CURRENT_TIMESTAMP \
                   AND (acquired_at IS NULL OR acquired_at < datetime(CURRENT_TIMESTAMP, ?4)) \
                   ORDER BY visible_at ASC, sequence ASC \
                   LIMIT ?5 \
                 ) \
                 RETURNING sequence, id, element, attempts, visible_at"
            ),
            // A row only ever carries the lock of the poll that claimed it, so matching every
            // sequence against every lock renews exactly these claims.
            refresh: format!(
                "UPDATE {t} SET acquired_at = CURRENT_TIMESTAMP \
                 WHERE sequence IN (SELECT value FROM json_each(?1)) \
                 AND acquired_by IN (SELECT value FROM json_each(?2))"
            ),
            complete: format!("UPDATE {t} SET {settled}, state = 'completed' {held}"),
            // ?3: visible, ?4: failure.
            retry: format!(
                "UPDATE {t} SET {settled}, visible_at = datetime(CURRENT_TIMESTAMP, ?3), \
                 last_failure = ?4 {held}"
            ),
            fail: format!("UPDATE {t} SET {settled}, state = 'failed', last_failure = ?3 {held}"),
            release: format!(
                "UPDATE {t} SET acquired_at = NULL, acquired_by = NULL, attempts = attempts - 1 \
                 {held}"
            ),
            // ?1: queue, ?2: max attempts, ?3: expired, ?4: the failure of a lapsed claim.
            fail_exhausted: format!(
                "UPDATE {t} SET state = 'failed', {settled}, \
                 last_failure = COALESCE(last_failure, ?4) \
                 WHERE queue_name = ?1 \
                 AND state = 'pending' \
                 AND attempts >= ?2 \
                 AND (acquired_at IS NULL OR acquired_at < datetime(CURRENT_TIMESTAMP, ?3))"
            ),
            // ?1: state, ?2: expired, ?3: batch size.
            cleanup: format!(
                "DELETE FROM {t} WHERE sequence IN ( \
                   SELECT sequence FROM {t} \
                   WHERE state = ?1 AND updated_at <= datetime(CURRENT_TIMESTAMP, ?2) \
                   LIMIT ?3 \
                 )"
            ),
            item: format!(
                "SELECT id, state, attempts, acquired_by, last_failure, element FROM {t} \
                 WHERE queue_name = ?1 AND id = ?2"
            ),
            table,
        }
    }
}

/// The reference's migrations of the queue table, SQLite dialect: `0001_create_table` and
/// `0002_upgrade_schema` (which rebuilds the table, as the reference does on SQLite).
fn migrations(table: &QueueTable) -> Vec<(i64, &'static str, Vec<String>)> {
    let t = table.as_str();
    let upgrade = format!("{t}_upgrade");
    let (id_index, take_index, update_index) =
        (table.index("id"), table.index("take"), table.index("update"));
    let create_table = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
              sequence INTEGER PRIMARY KEY AUTOINCREMENT,
              id TEXT NOT NULL,
              queue_name TEXT NOT NULL,
              element TEXT NOT NULL,
              completed BOOLEAN NOT NULL,
              attempts INTEGER NOT NULL DEFAULT 0,
              last_failure TEXT NULL,
              acquired_at DATETIME NULL,
              acquired_by TEXT NULL,
              created_at DATETIME NOT NULL,
              updated_at DATETIME NOT NULL
            )"
        ),
        format!("CREATE UNIQUE INDEX IF NOT EXISTS {id_index} ON {t} (id, queue_name)"),
        format!(
            "CREATE INDEX IF NOT EXISTS {take_index} \
             ON {t} (queue_name, completed, attempts, acquired_at)"
        ),
        format!("CREATE INDEX IF NOT EXISTS {update_index} ON {t} (sequence, acquired_by)"),
    ];
    let upgrade_schema = vec![
        format!("DROP INDEX IF EXISTS {take_index}"),
        format!(
            "CREATE TABLE {upgrade} (
              sequence INTEGER PRIMARY KEY AUTOINCREMENT,
              id TEXT NOT NULL,
              queue_name TEXT NOT NULL,
              element TEXT NOT NULL,
              state TEXT NOT NULL,
              attempts INTEGER NOT NULL DEFAULT 0,
              last_failure TEXT NULL,
              visible_at DATETIME NOT NULL,
              acquired_at DATETIME NULL,
              acquired_by TEXT NULL,
              created_at DATETIME NOT NULL,
              updated_at DATETIME NOT NULL
            )"
        ),
        format!(
            "INSERT INTO {upgrade} \
             (sequence, id, queue_name, element, state, attempts, last_failure, visible_at, \
               acquired_at, acquired_by, created_at, updated_at) \
             SELECT sequence, id, queue_name, element, \
               CASE WHEN completed THEN 'completed' ELSE 'pending' END, \
               attempts, last_failure, updated_at, acquired_at, acquired_by, created_at, updated_at \
             FROM {t}"
        ),
        format!("DROP TABLE {t}"),
        format!("ALTER TABLE {upgrade} RENAME TO {t}"),
        format!("CREATE UNIQUE INDEX {id_index} ON {t} (id, queue_name)"),
        format!("CREATE INDEX {update_index} ON {t} (sequence, acquired_by)"),
        // Partial, so that takers never scan settled rows.
        format!(
            "CREATE INDEX {take_index} ON {t} (queue_name, visible_at) WHERE state = 'pending'"
        ),
    ];
    vec![(1, "create_table", create_table), (2, "upgrade_schema", upgrade_schema)]
}

/// Brings the table up to date the way effect's SQL migrator does, with the same history as the
/// message and runner tables (see `queries::migrate`): in one transaction, the migrations above
/// the latest recorded id are recorded first and then run; a concurrent migrator that recorded
/// them first makes this one a no-op. Returns the ids that ran.
fn migrate(connection: &Connection, table: &QueueTable) -> rusqlite::Result<Vec<i64>> {
    let history = table.history();
    connection.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {history} (
          migration_id integer PRIMARY KEY NOT NULL,
          created_at datetime NOT NULL DEFAULT current_timestamp,
          name VARCHAR(255) NOT NULL
        )"
    ))?;
    let result = queries::immediate(connection, |connection| {
        let latest: i64 = connection
            .query_row(
                &format!("SELECT migration_id FROM {history} ORDER BY migration_id DESC LIMIT 1"),
                [],
                |row| row.get(0),
            )
            .optional()?
            .unwrap_or(0);
        let required: Vec<_> =
            migrations(table).into_iter().filter(|(id, _, _)| *id > latest).collect();
        let insert = format!("INSERT INTO {history} (migration_id, name) VALUES (?1, ?2)");
        for (id, name, _) in &required {
            connection.execute(&insert, params![id, name])?;
        }
        for (_, _, statements) in &required {
            for statement in statements {
                connection.execute_batch(statement)?;
            }
        }
        Ok(required.iter().map(|(id, _, _)| *id).collect())
    });
    match result {
        Err(error) if queries::is_unique_violation(&error) => Ok(Vec::new()),
        other => other,
    }
}
