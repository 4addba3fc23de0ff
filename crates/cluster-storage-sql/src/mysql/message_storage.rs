//! [`MySqlMessageStorage`]: mailboxes and replies in `<prefix>_messages` and `<prefix>_replies`
//! on a `mysql_async` pool, with the reference's MySQL semantics
//! (`effect/src/cluster/SqlMessageStorage.ts`): dedup with `INSERT IGNORE` and the affected-row
//! count, claims with `SELECT … FOR UPDATE` and an `UPDATE` in one transaction, replies written in
//! a transaction with their message rows.
//!
//! Saves follow the shared protocol of `crate::save` (group commit with a per-row fallback,
//! deduplication by primary key, reply batches); `MySqlSaveBackend` is its MySQL side.
//!
//! Rows are mapped by the shared `row` module; this file only moves values between it and the
//! driver, and checks column widths before writing (`INSERT IGNORE` would otherwise truncate an
//! over-long value with a mere warning). Payloads and headers are checked against one limit:
//! `value_bytes_max`, capped by their `TEXT` columns.
//!
//! Entity states (`cluster_core::entity_state`) live in `<prefix>_entity_state`, a table of
//! ours whose `MEDIUMTEXT` values are limited to `value_bytes_max`, capped as the queue's
//! elements are. Each write is one conditional statement; a stale one changes no row (a stale
//! insert hits the primary key, which fails the statement, not its transaction).
//!
//! Departures from the reference, each for a reason given where it is made: the storage's own
//! transactions run in `READ COMMITTED` and are retried after a deadlock (gap locks of
//! `REPEATABLE READ` deadlocked concurrent claims on different shards); acknowledgements and
//! interrupts are inserted with `INSERT IGNORE` and a retried chunk is accepted, so that
//! retries are idempotent as the contract says; a reply is inserted before its message rows are
//! updated, so a rejected duplicate changes nothing.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};

use cluster_core::clock::Timestamp;
use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{self, AckChunk, Interrupt, Reply, Request};
use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{Backlog, BacklogQuery, RequestQuery, RequestRecord};
use cluster_core::retention::{self, ProcessedQuery, ProcessedRequest, PurgeProcessed};
use cluster_core::storage::{
    MalformedMessage, MessageStorage, MessageTransaction, SaveRequestOptions, SaveResult,
    UnprocessedBatch, UnprocessedOptions,
};
use cluster_core::transaction::TransactionGuard;
use cluster_core::{EntityAddress, ShardId, Snowflake};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, Params, Pool, Row, Transaction, TxOpts, Value};
use tracing::Instrument;

use super::classify::{ER_DUP_ENTRY, is_deadlock, storage_error};
use super::columns::{Columns, check_chars, state_limit, text_limit};
use super::connection;
use super::migrate::migrate_messages;
use super::queries::{self, IN_LIST_LEN_MAX, MessageQueries};
use crate::batch::Batcher;
use crate::options::{TablePrefix, ValueBytesMax};
use crate::row::inspect::{BacklogFilter, BacklogRow, RequestFilter, RequestRow};
use crate::row::{
    self, LastReplyRow, MessageInsert, MessageRow, ProcessedRow, ReplyInsert, ReplyRow,
    StateChange, StateRow, StoredStateRow, ValueLimit,
};
use crate::save::{self, BatchFailure, SaveBackend};

/// The most placeholders one statement may bind (the protocol's limit).
const PARAMS_MAX: usize = 65_535;
/// How often a transaction runs when InnoDB keeps choosing it as a deadlock victim.
const DEADLOCK_ATTEMPTS_MAX: u32 = 3;

/// [`MessageStorage`] on MySQL or MariaDB (`effect/src/cluster/MessageStorage.ts`), sharing its
/// tables with TypeScript runners that use the same prefix.
///
/// Every operation takes a connection from the pool for its duration; the transactions the
/// storage runs itself (claims, replies, acknowledgements, resets) use `READ COMMITTED` and are
/// retried when InnoDB picks them as deadlock victims. [`begin_transaction`] uses the server's
/// default isolation level.
///
/// Pool advice: by default `mysql_async` resets a connection on checkout, which drops its
/// prepared statements, and a pool with `min = 0` and no inactive TTL closes connections as
/// they come back. `PoolOpts::with_reset_connection(false)` and
/// `with_inactive_connection_ttl(..)` avoid both (the tests use them).
///
/// [`begin_transaction`]: MessageStorage::begin_transaction
pub struct MySqlMessageStorage {
    pool: Pool,
    prefix: TablePrefix,
    queries: Arc<MessageQueries>,
    /// The most bytes of a payload or headers: `value_bytes_max`, capped by `TEXT`.
    limit: ValueLimit,
    /// The most bytes of an entity state: `value_bytes_max`, capped by a row within the
    /// default `max_allowed_packet`.
    state_limit: ValueLimit,
    /// The group-commit writers, started on first use (that is, inside the runtime).
    writers: OnceLock<Writers>,
}

/// Group commit: requests saved concurrently go into one multi-row
/// insert, replies saved concurrently into one transaction: one commit per batch.
struct Writers {
    requests: Batcher<(Request, SaveRequestOptions), SaveResult>,
    replies: Batcher<Reply, ()>,
}

/// How many writes wait for a batch writer before callers wait for room.
const WRITE_QUEUE_CAPACITY: usize = 4096;

/// The most rows one batch writes (256 × 15 placeholders stays far below the protocol's limit).
const WRITE_BATCH_SIZE_MAX: usize = 256;

impl Writers {
    fn spawn(pool: &Pool, queries: &Arc<MessageQueries>, limit: ValueLimit) -> Writers {
        let backend =
            Arc::new(MySqlSaveBackend { pool: pool.clone(), queries: Arc::clone(queries) });
        let request_backend = Arc::clone(&backend);
        let requests = Batcher::spawn(WRITE_QUEUE_CAPACITY, WRITE_BATCH_SIZE_MAX, move |inputs| {
            let backend = Arc::clone(&request_backend);
            async move {
                let inputs: Vec<(Request, SaveRequestOptions)> = inputs;
                let requests: Vec<(&Request, &SaveRequestOptions)> =
                    inputs.iter().map(|(request, options)| (request, options)).collect();
                save::save_requests(&*backend, limit, &requests).await
            }
        });
        let replies = Batcher::spawn(WRITE_QUEUE_CAPACITY, WRITE_BATCH_SIZE_MAX, move |inputs| {
            let backend = Arc::clone(&backend);
            async move { save::save_replies(&*backend, limit, &inputs).await }
        });
        Writers { requests, replies }
    }
}

/// The MySQL side of the save protocol ([`save`]): requests are inserted with `INSERT IGNORE`
/// and the affected-row count (the reference's MySQL dedup), replies in `READ COMMITTED`
/// transactions with their message-row updates.
struct MySqlSaveBackend {
    pool: Pool,
    queries: Arc<MessageQueries>,
}

impl MySqlSaveBackend {
    async fn conn(&self) -> Result<Conn, StorageError> {
        self.pool.get_conn().await.map_err(|error| storage_error("cannot get a connection", error))
    }
}

impl SaveBackend for MySqlSaveBackend {
    const REQUEST_BATCH_TAKES_UNKEYED: bool = false;
    const REPLY_BATCH_ONE_PER_REQUEST: bool = false;

    fn check_request(&self, row: &MessageInsert<'_>) -> Result<(), StorageError> {
        check_widths(row)
    }

    /// One multi-row `INSERT IGNORE`. It reports only how many rows it inserted, so when it
    /// skipped some, the inserted ones are those now stored under their own id and key whose
    /// `rowid` (`AUTO_INCREMENT`) is at least the first one the statement generated for a row it
    /// inserted (the `last_insert_id` of its OK packet): a row stored before with the same id and
    /// key, a retried save, has a smaller one and is left to its own save, which reports it as
    /// the duplicate.
    async fn insert_requests(&self, rows: &[MessageInsert<'_>]) -> Result<Vec<i64>, StorageError> {
        let params: Vec<Value> = rows.iter().flat_map(message_params).collect();
        let mut conn = self.conn().await?;
        conn.exec_drop(self.queries.insert_messages_ignore(rows.len()), params)
            .await
            .map_err(|error| storage_error("save_request: batch", error))?;
        let inserted = conn.affected_rows();
        if inserted == 0 {
            return Ok(Vec::new());
        }
        if usize::try_from(inserted).is_ok_and(|inserted| inserted == rows.len()) {
            return Ok(rows.iter().map(|row| row.id).collect());
        }
        let first_rowid = conn.last_insert_id().and_then(|id| i64::try_from(id).ok()).unwrap_or(0);
        let keys: Vec<Value> =
            rows.iter().map(|row| Value::from(row.message_id.as_deref())).collect();
        let stored: Vec<(i64, String, i64)> = conn
            .exec(self.queries.ids_for_message_ids(rows.len()), keys)
            .await
            .map_err(|error| storage_error("save_request: batch ids", error))?;
        Ok(stored
            .into_iter()
            .filter(|(id, key, rowid)| {
                *rowid >= first_rowid
                    && rows
                        .iter()
                        .any(|row| row.id == *id && row.message_id.as_deref() == Some(key))
            })
            .map(|(id, _, _)| id)
            .collect())
    }

    /// A row with a key: `INSERT IGNORE` and the affected-row count. A row without one: a plain
    /// `INSERT`, since nothing deduplicates it and a second save of its id is a key conflict.
    async fn insert_request(&self, row: &MessageInsert<'_>) -> Result<bool, StorageError> {
        let mut conn = self.conn().await?;
        let sql = match row.message_id {
            Some(_) => &self.queries.insert_message_ignore,
            None => &self.queries.insert_message,
        };
        conn.exec_drop(sql.as_str(), message_params(row))
            .await
            .map_err(|error| storage_error("save_request", error))?;
        Ok(conn.affected_rows() > 0)
    }

    async fn find_duplicate(&self, message_id: &str) -> Result<Option<SaveResult>, StorageError> {
        let mut conn = self.conn().await?;
        let existing: Option<Row> = conn
            .exec_first(self.queries.select_duplicate.as_str(), (message_id,))
            .await
            .map_err(|error| storage_error("save_request: read the duplicate", error))?;
        existing.map(read_duplicate).transpose()
    }

    /// One `READ COMMITTED` transaction of single-reply writes.
    async fn insert_replies(&self, rows: &[&ReplyInsert]) -> Result<(), BatchFailure> {
        let mut tx = begin_read_committed(&self.pool).await.map_err(BatchFailure::RolledBack)?;
        for row in rows {
            // Dropped on error: the pool rolls the transaction back.
            run_body(&mut tx, &self.queries, &TxBody::Reply(row))
                .await
                .map_err(BatchFailure::RolledBack)?;
        }
        tx.commit()
            .await
            .map_err(|error| BatchFailure::CommitFailed(storage_error("commit", error)))
    }

    /// Its own transaction, retried after a deadlock. A retried chunk (the same chunk already
    /// stored) changes nothing and is accepted.
    async fn insert_reply(&self, row: &ReplyInsert) -> Result<(), StorageError> {
        transaction(&self.pool, &self.queries, TxBody::Reply(row)).await.map(drop)
    }
}

impl fmt::Debug for MySqlMessageStorage {
    /// Names the tables only: the pool's options hold the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlMessageStorage").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl MySqlMessageStorage {
    /// Connects to the `mysql://` URL `url` with a pool of
    /// [`POOL_SIZE_DEFAULT`](super::POOL_SIZE_DEFAULT) connections ([`pool`](super::pool)),
    /// runs the migrations and returns the storage, with values limited to
    /// `options.value_bytes_max` (capped by `TEXT`).
    ///
    /// # Cancel safety
    ///
    /// As [`migrate_messages`](super::migrate_messages).
    pub async fn connect(
        url: &str,
        options: &crate::options::SqlStorageOptions,
    ) -> Result<MySqlMessageStorage, StorageError> {
        let pool = connection::pool(url, connection::POOL_SIZE_DEFAULT)
            .await
            .map_err(|error| connection::opening_error(url, error))?;
        let opened = MySqlMessageStorage::new(pool, &options.prefix).await;
        let storage = opened.map_err(|error| connection::opening_error(url, error))?;
        Ok(storage.with_value_bytes_max(options.value_bytes_max))
    }

    /// The storage on `pool` with tables named by `prefix`, after running the migrations
    /// ([`migrate_messages`](super::migrate_messages)). Its values are limited to the default
    /// [`value_bytes_max`](crate::SqlStorageOptions::value_bytes_max), capped by `TEXT`; see
    /// [`with_value_bytes_max`](MySqlMessageStorage::with_value_bytes_max).
    ///
    /// # Cancel safety
    ///
    /// As [`migrate_messages`](super::migrate_messages).
    pub async fn new(
        pool: Pool,
        prefix: &TablePrefix,
    ) -> Result<MySqlMessageStorage, StorageError> {
        migrate_messages(&pool, prefix).await?;
        Ok(MySqlMessageStorage::without_migrations(pool, prefix))
    }

    /// The storage on `pool` without running any DDL: the tables must have been migrated, for
    /// example by a deploy step with a schema owner's connection.
    pub fn without_migrations(pool: Pool, prefix: &TablePrefix) -> MySqlMessageStorage {
        let queries = Arc::new(MessageQueries::new(prefix));
        let limit = text_limit(ValueBytesMax::default());
        let state_limit = state_limit(ValueBytesMax::default());
        MySqlMessageStorage {
            pool,
            prefix: prefix.clone(),
            queries,
            limit,
            state_limit,
            writers: OnceLock::new(),
        }
    }

    /// The storage with its values limited to `value_bytes_max` bytes, or to the 65,535 bytes
    /// of their `TEXT` columns if that is less: a longer payload, headers or reply is refused
    /// with [`StorageErrorKind::InvalidInput`] before anything is sent. Entity states are
    /// limited to `value_bytes_max` too, or to 16,711,680 bytes if that is less (see
    /// [`state_bytes_max`](MySqlMessageStorage::state_bytes_max)).
    pub fn with_value_bytes_max(self, value_bytes_max: ValueBytesMax) -> MySqlMessageStorage {
        // The writers capture the limit: new ones start with the new limit on first use.
        MySqlMessageStorage {
            limit: text_limit(value_bytes_max),
            state_limit: state_limit(value_bytes_max),
            writers: OnceLock::new(),
            ..self
        }
    }

    /// The most bytes a stored value may have on this storage: `value_bytes_max`, or the 65,535
    /// bytes of a `TEXT` column if that is less.
    pub fn value_bytes_max(&self) -> ValueBytesMax {
        self.limit.effective()
    }

    /// The most bytes an entity's state may have on this storage: `value_bytes_max`, or
    /// 16,711,680 bytes (16 MiB − 64 KiB) if that is less. The `value` column is a
    /// `MEDIUMTEXT`, but a row must also fit the server's `max_allowed_packet`, 16 MiB by
    /// default on MariaDB, as the queue's elements must; a longer state is refused with
    /// [`StorageErrorKind::InvalidInput`] before anything is sent.
    pub fn state_bytes_max(&self) -> ValueBytesMax {
        self.state_limit.effective()
    }

    /// The pool the storage runs on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    async fn conn(&self) -> Result<Conn, StorageError> {
        self.pool.get_conn().await.map_err(|error| storage_error("cannot get a connection", error))
    }

    async fn begin(&self, options: &TxOpts) -> Result<Transaction<'static>, StorageError> {
        self.pool
            .start_transaction(options.clone())
            .await
            .map_err(|error| storage_error("cannot start a transaction", error))
    }

    /// Runs `body` in a `READ COMMITTED` transaction and commits, retrying the whole
    /// transaction (at most [`DEADLOCK_ATTEMPTS_MAX`] times) when InnoDB chose it as a
    /// deadlock victim, which rolled it back.
    ///
    /// `READ COMMITTED` rather than the default `REPEATABLE READ`: the claim's
    /// `SELECT … FOR UPDATE` and the reply's `UPDATE … WHERE request_id = ?` would otherwise take
    /// gap locks on the shard and request indexes, which make runners claiming different shards
    /// deadlock with each other's inserts. Every statement here reads the latest committed
    /// rows and locks what it changes, so nothing relies on a repeatable snapshot.
    async fn transaction(&self, body: TxBody<'_>) -> Result<TxOutput, StorageError> {
        transaction(&self.pool, &self.queries, body).await
    }

    fn writers(&self) -> &Writers {
        self.writers.get_or_init(|| Writers::spawn(&self.pool, &self.queries, self.limit))
    }

    async fn save_ack_chunk_inner(&self, ack: &AckChunk) -> Result<(), StorageError> {
        let insert = MessageInsert::ack_chunk(ack)?;
        check_widths(&insert)?;
        let reply_id = row::id_to_sql(ack.reply_id)?;
        self.transaction(TxBody::AckChunk { insert: &insert, reply_id }).await?;
        Ok(())
    }

    async fn save_interrupt_inner(&self, interrupt: &Interrupt) -> Result<(), StorageError> {
        let insert = MessageInsert::interrupt(interrupt)?;
        check_widths(&insert)?;
        let mut conn = self.conn().await?;
        conn.exec_drop(self.queries.insert_message_ignore.as_str(), message_params(&insert))
            .await
            .map_err(|error| storage_error("save_interrupt", error))?;
        if conn.affected_rows() == 0 {
            tracing::debug!("interrupt already stored");
        }
        Ok(())
    }

    async fn clear_replies_inner(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> Result<(), StorageError> {
        let id = row::id_to_sql(request_id)?;
        let expected_reply_id = expected_reply_id.map(row::id_to_sql).transpose()?;
        self.transaction(TxBody::ClearReplies { request_id: id, expected_reply_id }).await?;
        Ok(())
    }

    async fn request_id_for_primary_key_inner(
        &self,
        primary_key: &str,
    ) -> Result<Option<Snowflake>, StorageError> {
        let message_id = envelope::message_id(primary_key);
        let mut conn = self.conn().await?;
        let id: Option<Row> = conn
            .exec_first(self.queries.request_id_for_message_id.as_str(), (message_id.as_ref(),))
            .await
            .map_err(|error| storage_error("request_id_for_primary_key", error))?;
        let Some(id) = id else { return Ok(None) };
        let id = required(Columns::new(id).int(), "id")?;
        row::id_from_sql(id).map(Some).map_err(malformed_row)
    }

    async fn unprocessed_before_inner(
        &self,
        address: &EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> Result<Vec<Snowflake>, StorageError> {
        let params: Vec<Value> = vec![
            Value::from(address.shard_id.to_string()),
            Value::from(address.entity_type.as_str()),
            Value::from(address.entity_id.as_str()),
            Value::from(row::id_to_sql(request_id)?),
            Value::from(now.unix_millis()),
            Value::from(limit.get()),
        ];
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn
            .exec(self.queries.unprocessed_before.as_str(), params)
            .await
            .map_err(|error| storage_error("unprocessed_before", error))?;
        let ids = rows
            .into_iter()
            .map(|id| required(Columns::new(id).int(), "id"))
            .collect::<Result<Vec<i64>, StorageError>>()?;
        row::ids_from_sql(ids)
    }

    async fn replies_inner(
        &self,
        request_ids: &[Snowflake],
        unacked_only: bool,
    ) -> Result<Vec<Reply>, StorageError> {
        if request_ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids =
            request_ids.iter().map(|id| row::id_to_sql(*id)).collect::<Result<Vec<_>, _>>()?;
        let mut conn = self.conn().await?;
        let mut replies = Vec::new();
        for chunk in ids.chunks(IN_LIST_LEN_MAX) {
            let sql = self.queries.replies_for(chunk.len(), unacked_only);
            let rows: Vec<Row> = conn
                .exec(sql, chunk.to_vec())
                .await
                .map_err(|error| storage_error("replies_for", error))?;
            for row in rows {
                replies.push(read_reply_row(row)?);
            }
        }
        // Statements over several chunks each return insertion order; merge them.
        replies.sort_by_key(|(rowid, _)| *rowid);
        Ok(replies.into_iter().map(|(_, reply)| reply).collect())
    }

    async fn unprocessed_messages_inner(
        &self,
        shard_ids: &[ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'_>,
    ) -> Result<UnprocessedBatch, StorageError> {
        if shard_ids.is_empty() || options.addresses.is_some_and(<[EntityAddress]>::is_empty) {
            return Ok(UnprocessedBatch::default());
        }
        let groups = options.addresses.map(row::group_addresses);
        let group_sizes: Option<Vec<usize>> =
            groups.as_ref().map(|groups| groups.iter().map(|(_, _, ids)| ids.len()).collect());
        let mut params: Vec<Value> =
            shard_ids.iter().map(|shard_id| Value::from(shard_id.to_string())).collect();
        for (shard_id, entity_type, entity_ids) in groups.iter().flatten() {
            params.push(Value::from(shard_id.as_str()));
            params.push(Value::from(*entity_type));
            params.extend(entity_ids.iter().map(|entity_id| Value::from(*entity_id)));
        }
        params.push(Value::from(now.unix_millis()));
        if let Some(limit) = options.limit {
            params.push(Value::from(limit.get()));
        }
        if params.len() > PARAMS_MAX {
            return Err(StorageError::new(
                StorageErrorKind::InvalidInput,
                format!("unprocessed_messages: {} parameters in one claim", params.len()),
            ));
        }
        let sql = self.queries.claim_select(
            shard_ids.len(),
            group_sizes.as_deref(),
            options.limit.is_some(),
        );
        let read = match self.transaction(TxBody::Claim { sql: &sql, params: &params }).await? {
            TxOutput::Claimed(read) => read,
            TxOutput::Done | TxOutput::Purged(_) => Vec::new(),
        };
        let batch = into_batch(read);
        tracing::debug!(n_messages = batch.messages.len(), n_malformed = batch.malformed.len());
        Ok(batch)
    }

    async fn unprocessed_messages_by_id_inner(
        &self,
        ids: &[Snowflake],
        now: Timestamp,
    ) -> Result<UnprocessedBatch, StorageError> {
        if ids.is_empty() {
            return Ok(UnprocessedBatch::default());
        }
        let ids = ids.iter().map(|id| row::id_to_sql(*id)).collect::<Result<Vec<_>, _>>()?;
        let mut conn = self.conn().await?;
        let mut read = Vec::new();
        for chunk in ids.chunks(IN_LIST_LEN_MAX) {
            let mut params: Vec<Value> = chunk.iter().map(|id| Value::from(*id)).collect();
            params.push(Value::from(now.unix_millis()));
            let rows: Vec<Row> = conn
                .exec(self.queries.unprocessed_by_id(chunk.len()), params)
                .await
                .map_err(|error| storage_error("unprocessed_messages_by_id", error))?;
            for row in rows {
                read.push(read_message_row(row)?);
            }
        }
        read.sort_by_key(|message| message.rowid);
        Ok(into_batch(read))
    }

    /// Runs `sql(n)` once per chunk of `values` (claim releases).
    async fn update_in_chunks(
        &self,
        what: &str,
        values: &[Value],
        sql: impl Fn(usize) -> String,
    ) -> Result<(), StorageError> {
        if values.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn().await?;
        for chunk in values.chunks(IN_LIST_LEN_MAX) {
            conn.exec_drop(sql(chunk.len()), chunk.to_vec())
                .await
                .map_err(|error| storage_error(what, error))?;
        }
        Ok(())
    }

    async fn reset_addresses_inner(&self, addresses: &[EntityAddress]) -> Result<(), StorageError> {
        if addresses.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn().await?;
        for chunk in addresses.chunks(IN_LIST_LEN_MAX) {
            let groups = row::group_addresses(chunk);
            let sizes: Vec<usize> = groups.iter().map(|(_, _, ids)| ids.len()).collect();
            let mut params = Vec::new();
            for (shard_id, entity_type, entity_ids) in &groups {
                params.push(Value::from(shard_id.as_str()));
                params.push(Value::from(*entity_type));
                params.extend(entity_ids.iter().map(|entity_id| Value::from(*entity_id)));
            }
            conn.exec_drop(self.queries.reset_addresses(&sizes), params)
                .await
                .map_err(|error| storage_error("reset_addresses", error))?;
        }
        Ok(())
    }

    async fn load_state_inner(
        &self,
        address: &EntityAddress,
    ) -> Result<Option<StoredState>, StorageError> {
        let mut conn = self.conn().await?;
        let key = (address.entity_type.as_str(), address.entity_id.as_str());
        let row: Option<Row> = conn
            .exec_first(self.queries.load_state.as_str(), key)
            .await
            .map_err(|error| storage_error("load_state", error))?;
        let Some(row) = row else { return Ok(None) };
        let mut columns = Columns::new(row);
        let (value, revision) = (columns.text(), columns.int());
        let unreadable = |error: DecodeError| {
            StorageError::with_source(
                StorageErrorKind::Malformed,
                format!("the stored state of {address} cannot be read"),
                error,
            )
        };
        // A NULL (impossible in this schema) fails to decode like bad JSON, or a revision 0.
        let stored = StoredStateRow {
            value: value.map_err(unreadable)?.unwrap_or_default(),
            revision: revision.map_err(unreadable)?.unwrap_or(0),
        };
        stored.decode(address).map(Some)
    }

    async fn save_state_inner(&self, write: &StateWrite) -> Result<(), StorageError> {
        let row = checked_state(write, self.state_limit)?;
        if row.change == StateChange::Nothing {
            return Ok(());
        }
        write_state(&mut self.conn().await?, &self.queries, &row).await
    }

    /// The state write and the reply in one transaction of their own, retried after a
    /// deadlock as every transaction of the storage is; not batched (PostgreSQL batches them,
    /// MySQL does not yet).
    async fn save_reply_with_state_inner(
        &self,
        reply: &Reply,
        write: &StateWrite,
    ) -> Result<(), StorageError> {
        // Both checked before any statement.
        let insert = ReplyInsert::checked(reply, self.limit)?;
        let row = checked_state(write, self.state_limit)?;
        self.transaction(TxBody::ReplyWithState { state: &row, reply: &insert }).await.map(drop)
    }

    /// One transaction: choose the requests (a plain read), lock those still processed, delete
    /// their replies and message rows.
    async fn purge_processed_inner(&self, batch: &PurgeProcessed) -> Result<u64, StorageError> {
        if batch.limit == 0 {
            return Err(retention::zero_limit("purge_processed"));
        }
        let keep = &batch.keep_entity_type_prefixes;
        let mut params = vec![Value::from(row::id_to_sql(batch.replied_before)?)];
        for prefix in keep {
            params.push(Value::from(prefix.as_str()));
            params.push(Value::from(prefix.as_str()));
        }
        params.push(Value::from(batch.limit));
        let choose = self.queries.purge_choose(keep.len());
        match self.transaction(TxBody::Purge { choose: &choose, params: &params }).await? {
            TxOutput::Purged(deleted) => Ok(deleted),
            TxOutput::Done | TxOutput::Claimed(_) => Err(StorageError::new(
                StorageErrorKind::Other,
                "purge_processed: the transaction returned no count",
            )),
        }
    }

    async fn processed_requests_inner(
        &self,
        query: &ProcessedQuery,
    ) -> Result<Vec<ProcessedRequest>, StorageError> {
        if query.limit == 0 {
            return Err(retention::zero_limit("processed_requests"));
        }
        let prefix = query.entity_type_prefix.as_str();
        let mut params = vec![
            Value::from(row::id_to_sql(query.replied_before)?),
            Value::from(prefix),
            Value::from(prefix),
        ];
        if let Some(tag) = &query.tag {
            params.push(Value::from(tag.as_str()));
        }
        // Ids are never negative: -1 is "from the first".
        params.push(Value::from(query.after.map(row::id_to_sql).transpose()?.unwrap_or(-1)));
        params.push(Value::from(query.limit));
        let sql = self.queries.processed_requests(query.tag.is_some());
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn
            .exec(sql, params)
            .await
            .map_err(|error| storage_error("processed_requests", error))?;
        rows.into_iter().map(read_processed_row).collect()
    }

    async fn backlog_inner(&self, query: &BacklogQuery) -> Result<Vec<Backlog>, StorageError> {
        let filter = BacklogFilter::new(query)?;
        let params = (filter.now_ms, filter.stale_after_ms, filter.limit);
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn
            .exec(self.queries.backlog.as_str(), params)
            .await
            .map_err(|error| storage_error("backlog", error))?;
        rows.into_iter().map(read_backlog_row).collect()
    }

    async fn requests_inner(
        &self,
        query: &RequestQuery,
    ) -> Result<Vec<RequestRecord>, StorageError> {
        let filter = RequestFilter::new(query)?;
        // In the order of `MessageQueries::requests`, which leaves the unset filters out.
        let mut params = Vec::new();
        params.extend(filter.request_id.map(Value::from));
        params.extend(filter.shard_id.as_deref().map(Value::from));
        if !filter.entity_type_prefix.is_empty() {
            params.push(Value::from(filter.entity_type_prefix.as_str()));
            params.push(Value::from(filter.entity_type_prefix.as_str()));
        }
        params.extend(filter.entity_type.as_deref().map(Value::from));
        params.extend(filter.entity_id.as_deref().map(Value::from));
        params.extend(filter.tag.as_deref().map(Value::from));
        params.extend(filter.processed.map(Value::from));
        params.push(Value::from(filter.after));
        params.push(Value::from(filter.before));
        params.push(Value::from(filter.limit));
        let sql = self.queries.requests(&filter);
        let mut conn = self.conn().await?;
        let rows: Vec<Row> =
            conn.exec(sql, params).await.map_err(|error| storage_error("requests", error))?;
        rows.into_iter().map(read_request_row).collect()
    }

    async fn clear_address_inner(&self, address: &EntityAddress) -> Result<(), StorageError> {
        let body = TxBody::ClearAddress {
            entity_type: address.entity_type.as_str(),
            entity_id: address.entity_id.as_str(),
        };
        self.transaction(body).await?;
        Ok(())
    }
}

fn span(operation: &'static str) -> tracing::Span {
    tracing::debug_span!("mysql.message_storage", operation)
}

impl MessageStorage for MySqlMessageStorage {
    fn backend_name(&self) -> &'static str {
        "mysql"
    }

    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>> {
        let span = tracing::debug_span!(
            "mysql.message_storage",
            operation = "save_request",
            request_id = %request.request_id,
        );
        Box::pin(
            self.writers().requests.submit((request.clone(), options.clone())).instrument(span),
        )
    }

    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.save_ack_chunk_inner(ack).instrument(span("save_ack_chunk")))
    }

    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.save_interrupt_inner(interrupt).instrument(span("save_interrupt")))
    }

    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        let span = tracing::debug_span!(
            "mysql.message_storage",
            operation = "save_reply",
            request_id = %reply.request_id(),
            is_final = reply.is_final(),
        );
        Box::pin(self.writers().replies.submit(reply.clone()).instrument(span))
    }

    fn clear_replies(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> BoxFuture<'_, Result<(), StorageError>> {
        let operation = self.clear_replies_inner(request_id, expected_reply_id);
        Box::pin(operation.instrument(span("clear_replies")))
    }

    fn request_id_for_primary_key<'a>(
        &'a self,
        primary_key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Snowflake>, StorageError>> {
        let operation = self.request_id_for_primary_key_inner(primary_key);
        Box::pin(operation.instrument(span("request_id_for_primary_key")))
    }

    fn replies_for<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        Box::pin(self.replies_inner(request_ids, true).instrument(span("replies_for")))
    }

    fn replies_for_unfiltered<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        let operation = self.replies_inner(request_ids, false);
        Box::pin(operation.instrument(span("replies_for_unfiltered")))
    }

    fn unprocessed_messages<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'a>,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        let operation = self.unprocessed_messages_inner(shard_ids, now, options);
        Box::pin(operation.instrument(span("unprocessed_messages")))
    }

    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        let operation = self.unprocessed_messages_by_id_inner(ids, now);
        Box::pin(operation.instrument(span("unprocessed_messages_by_id")))
    }

    fn unprocessed_before<'a>(
        &'a self,
        address: &'a EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<Vec<Snowflake>, StorageError>> {
        let operation = self.unprocessed_before_inner(address, request_id, now, limit);
        Box::pin(operation.instrument(span("unprocessed_before")))
    }

    fn reset_requests<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let ids = request_ids
                    .iter()
                    .map(|id| row::id_to_sql(*id).map(Value::from))
                    .collect::<Result<Vec<_>, _>>()?;
                let queries = &self.queries;
                self.update_in_chunks("reset_requests", &ids, |n| queries.reset_requests(n)).await
            }
            .instrument(span("reset_requests")),
        )
    }

    fn reset_addresses<'a>(
        &'a self,
        addresses: &'a [EntityAddress],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.reset_addresses_inner(addresses).instrument(span("reset_addresses")))
    }

    fn reset_shards<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let shards: Vec<Value> =
                    shard_ids.iter().map(|shard_id| Value::from(shard_id.to_string())).collect();
                let queries = &self.queries;
                self.update_in_chunks("reset_shards", &shards, |n| queries.reset_shards(n)).await
            }
            .instrument(span("reset_shards")),
        )
    }

    fn clear_address<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.clear_address_inner(address).instrument(span("clear_address")))
    }

    fn purge_processed<'a>(
        &'a self,
        batch: &'a PurgeProcessed,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(self.purge_processed_inner(batch).instrument(span("purge_processed")))
    }

    fn processed_requests<'a>(
        &'a self,
        query: &'a ProcessedQuery,
    ) -> BoxFuture<'a, Result<Vec<ProcessedRequest>, StorageError>> {
        Box::pin(self.processed_requests_inner(query).instrument(span("processed_requests")))
    }

    fn backlog<'a>(
        &'a self,
        query: &'a BacklogQuery,
    ) -> BoxFuture<'a, Result<Vec<Backlog>, StorageError>> {
        Box::pin(self.backlog_inner(query).instrument(span("backlog")))
    }

    fn requests<'a>(
        &'a self,
        query: &'a RequestQuery,
    ) -> BoxFuture<'a, Result<Vec<RequestRecord>, StorageError>> {
        Box::pin(self.requests_inner(query).instrument(span("requests")))
    }

    fn load_state<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<Option<StoredState>, StorageError>> {
        Box::pin(self.load_state_inner(address).instrument(span("load_state")))
    }

    fn save_state<'a>(&'a self, write: &'a StateWrite) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.save_state_inner(write).instrument(span("save_state")))
    }

    /// One transaction of its own per call, not the reply batch writer of
    /// [`save_reply`](MessageStorage::save_reply).
    fn save_reply_with_state<'a>(
        &'a self,
        reply: &'a Reply,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        let span = tracing::debug_span!(
            "mysql.message_storage",
            operation = "save_reply_with_state",
            request_id = %reply.request_id(),
            is_final = reply.is_final(),
        );
        Box::pin(self.save_reply_with_state_inner(reply, write).instrument(span))
    }

    fn begin_transaction(
        &self,
    ) -> BoxFuture<'_, Result<Box<dyn MessageTransaction>, StorageError>> {
        Box::pin(
            async move {
                // The caller's transaction: the server's default isolation level.
                let tx = self.begin(&TxOpts::default()).await?;
                let queries = Arc::clone(&self.queries);
                let transaction = MySqlTransaction {
                    tx,
                    queries,
                    limit: self.limit,
                    state_limit: self.state_limit,
                };
                Ok(Box::new(transaction) as Box<dyn MessageTransaction>)
            }
            .instrument(span("begin_transaction")),
        )
    }
}

/// The MySQL storage transaction a handler runs in, locked: it derefs to the
/// [`mysql_async::Transaction`] in which the handler's result is saved.
///
/// The handler's own statements run on it (through [`Queryable`], which needs the guard to be
/// mutable) and commit or roll back with its saved result.
/// The handler must not commit or roll back itself.
/// Hold the guard only while running statements (see [`TransactionGuard`]).
///
/// ```
/// use cluster_core::transaction::TransactionSource;
/// use cluster_storage_sql::mysql::MySqlTransactionGuard;
/// use mysql_async::prelude::Queryable;
///
/// /// Debits an account in the transaction of `context` (a `WITH_TRANSACTION` handler's
/// /// `RequestContext`, or a transactional activity's `ActivityContext`).
/// async fn debit(context: &impl TransactionSource, amount: i64) -> Result<(), String> {
///     let mut tx = MySqlTransactionGuard::of(context).await.map_err(|error| error.to_string())?;
///     let sql = "UPDATE accounts SET balance = balance - ? WHERE id = 1";
///     tx.exec_drop(sql, (amount,)).await.map_err(|error| error.to_string())
/// }
/// ```
pub type MySqlTransactionGuard<'a> = TransactionGuard<'a, Transaction<'static>>;

/// A storage transaction on one pooled connection. [`backend`](MessageTransaction::backend)
/// is the `mysql_async::Transaction<'static>`, which a handler reaches through
/// [`MySqlTransactionGuard`].
///
/// Dropped without commit, `mysql_async` marks the transaction for rollback and the pool rolls
/// it back before the connection is reused.
struct MySqlTransaction {
    tx: Transaction<'static>,
    queries: Arc<MessageQueries>,
    limit: ValueLimit,
    state_limit: ValueLimit,
}

impl MessageTransaction for MySqlTransaction {
    fn save_reply<'a>(&'a mut self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                // Checked before any statement: a refused reply leaves the transaction usable.
                let insert = ReplyInsert::checked(reply, self.limit)?;
                write_reply(&mut self.tx, &self.queries, &insert).await.map(|_| ())
            }
            .instrument(span("transaction.save_reply")),
        )
    }

    fn save_state<'a>(
        &'a mut self,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                // Checked before any statement, as replies are.
                let row = checked_state(write, self.state_limit)?;
                write_state(&mut self.tx, &self.queries, &row).await
            }
            .instrument(span("transaction.save_state")),
        )
    }

    fn backend(&mut self) -> &mut (dyn Any + Send) {
        &mut self.tx
    }

    fn savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(
            async move {
                let savepoint = self.tx.query_drop(queries::SAVEPOINT).await;
                savepoint.map_err(|error| storage_error("savepoint", error))
            }
            .instrument(span("transaction.savepoint")),
        )
    }

    fn rollback_to_savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(
            async move {
                let rolled_back = self.tx.query_drop(queries::ROLLBACK_TO_SAVEPOINT).await;
                rolled_back.map_err(|error| storage_error("rollback to savepoint", error))
            }
            .instrument(span("transaction.rollback_to_savepoint")),
        )
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        Box::pin(
            async move { self.tx.commit().await.map_err(|error| storage_error("commit", error)) }
                .instrument(span("transaction.commit")),
        )
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        Box::pin(
            async move {
                self.tx.rollback().await.map_err(|error| storage_error("rollback", error))
            }
            .instrument(span("transaction.rollback")),
        )
    }
}

/// Runs `body` in a `READ COMMITTED` transaction and commits, retrying the whole transaction
/// (at most [`DEADLOCK_ATTEMPTS_MAX`] times) when InnoDB chose it as a deadlock victim, which
/// rolled it back.
///
/// `READ COMMITTED` rather than the default `REPEATABLE READ`: the claim's
/// `SELECT … FOR UPDATE` and the reply's `UPDATE … WHERE request_id = ?` would otherwise take
/// gap locks on the shard and request indexes, which make runners claiming different shards
/// deadlock with each other's inserts. Every statement here reads the latest committed rows and
/// locks what it changes, so nothing relies on a repeatable snapshot.
async fn transaction(
    pool: &Pool,
    queries: &MessageQueries,
    body: TxBody<'_>,
) -> Result<TxOutput, StorageError> {
    let mut attempt = 1;
    loop {
        let mut tx = begin_read_committed(pool).await?;
        match run_body(&mut tx, queries, &body).await {
            Ok(output) => {
                tx.commit().await.map_err(|error| storage_error("commit", error))?;
                return Ok(output);
            }
            Err(error) if attempt < DEADLOCK_ATTEMPTS_MAX && is_deadlock(&error) => {
                tracing::debug!(%error, attempt, "deadlock victim; retrying the transaction");
                attempt += 1;
            }
            // Dropped: the pool rolls it back.
            Err(error) => return Err(error),
        }
    }
}

async fn begin_read_committed(pool: &Pool) -> Result<Transaction<'static>, StorageError> {
    let mut options = TxOpts::default();
    options.with_isolation_level(IsolationLevel::ReadCommitted);
    pool.start_transaction(options)
        .await
        .map_err(|error| storage_error("cannot start a transaction", error))
}

/// The transactions of the storage (a closed set, run by
/// [`MySqlMessageStorage::transaction`]).
enum TxBody<'a> {
    /// Store an acknowledgement: insert it, mark its chunk acked, retire older acks.
    AckChunk { insert: &'a MessageInsert<'a>, reply_id: i64 },
    /// Store a reply with its message-row updates.
    Reply(&'a ReplyInsert),
    /// Reset a request, unconditionally or if `expected_reply_id` is its latest reply.
    ClearReplies { request_id: i64, expected_reply_id: Option<i64> },
    /// Claim: the locking read `sql`, then mark the rows read.
    Claim { sql: &'a str, params: &'a [Value] },
    /// Delete an entity's messages and replies.
    ClearAddress { entity_type: &'a str, entity_id: &'a str },
    /// Write an entity's state, then store a reply with its message-row updates; a stale
    /// state fails the transaction.
    ReplyWithState { state: &'a StateRow<'a>, reply: &'a ReplyInsert },
    /// Delete a batch of processed requests: the plain read `choose` picks them, then those
    /// still processed are locked and deleted with their replies and message rows.
    Purge { choose: &'a str, params: &'a [Value] },
}

/// What a [`TxBody`] produced.
enum TxOutput {
    Done,
    Claimed(Vec<ReadMessage>),
    /// How many requests a purge deleted.
    Purged(u64),
}

async fn run_body(
    tx: &mut Transaction<'static>,
    queries: &MessageQueries,
    body: &TxBody<'_>,
) -> Result<TxOutput, StorageError> {
    match body {
        TxBody::AckChunk { insert, reply_id } => {
            // Inserted first (the reference inserts last, in the same transaction): a retried
            // acknowledgement finds its row and changes nothing, instead of marking its own
            // first copy processed.
            tx.exec_drop(queries.insert_message_ignore.as_str(), message_params(insert))
                .await
                .map_err(|error| storage_error("save_ack_chunk", error))?;
            if tx.affected_rows() == 0 {
                tracing::debug!("acknowledgement already stored");
                return Ok(TxOutput::Done);
            }
            tx.exec_drop(queries.ack_reply.as_str(), (*reply_id,))
                .await
                .map_err(|error| storage_error("save_ack_chunk: mark the chunk acked", error))?;
            tx.exec_drop(queries.process_older_acks.as_str(), (insert.request_id, insert.id))
                .await
                .map_err(|error| storage_error("save_ack_chunk: retire older acks", error))?;
        }
        TxBody::Reply(insert) => {
            write_reply(tx, queries, insert).await?;
        }
        TxBody::ReplyWithState { state, reply } => {
            write_state(tx, queries, state).await?;
            write_reply(tx, queries, reply).await?;
        }
        TxBody::ClearReplies { request_id, expected_reply_id } => {
            clear_replies(tx, queries, *request_id, *expected_reply_id).await?;
        }
        TxBody::Claim { sql, params } => {
            let rows: Vec<Row> = tx
                .exec(*sql, params.to_vec())
                .await
                .map_err(|error| storage_error("unprocessed_messages: claim", error))?;
            let read = rows.into_iter().map(read_message_row).collect::<Result<Vec<_>, _>>()?;
            let ids: Vec<i64> = read.iter().map(|message| message.id).collect();
            for chunk in ids.chunks(IN_LIST_LEN_MAX) {
                tx.exec_drop(queries.claim_update(chunk.len()), chunk.to_vec())
                    .await
                    .map_err(|error| storage_error("unprocessed_messages: mark read", error))?;
            }
            return Ok(TxOutput::Claimed(read));
        }
        TxBody::Purge { choose, params } => {
            return purge(tx, queries, choose, params).await.map(TxOutput::Purged);
        }
        TxBody::ClearAddress { entity_type, entity_id } => {
            let key = (*entity_type, *entity_id);
            tx.exec_drop(queries.clear_address_replies.as_str(), key)
                .await
                .map_err(|error| storage_error("clear_address: replies", error))?;
            tx.exec_drop(queries.clear_address_messages.as_str(), key)
                .await
                .map_err(|error| storage_error("clear_address: messages", error))?;
        }
    }
    Ok(TxOutput::Done)
}

/// Deletes the processed requests that `choose` picks, with their replies and message rows;
/// returns how many requests it deleted. A request reset between the read and the lock (no
/// longer processed) is kept.
async fn purge(
    tx: &mut Transaction<'static>,
    queries: &MessageQueries,
    choose: &str,
    params: &[Value],
) -> Result<u64, StorageError> {
    let rows: Vec<Row> = tx
        .exec(choose, params.to_vec())
        .await
        .map_err(|error| storage_error("purge_processed: choose", error))?;
    let chosen = rows
        .into_iter()
        .map(|id| required(Columns::new(id).int(), "id"))
        .collect::<Result<Vec<i64>, StorageError>>()?;
    let mut deleted = 0_u64;
    for chunk in chosen.chunks(IN_LIST_LEN_MAX) {
        let rows: Vec<Row> = tx
            .exec(queries.purge_lock(chunk.len()), chunk.to_vec())
            .await
            .map_err(|error| storage_error("purge_processed: lock", error))?;
        let locked = rows
            .into_iter()
            .map(|id| required(Columns::new(id).int(), "id"))
            .collect::<Result<Vec<i64>, StorageError>>()?;
        if locked.is_empty() {
            continue;
        }
        tx.exec_drop(queries.purge_replies(locked.len()), locked.clone())
            .await
            .map_err(|error| storage_error("purge_processed: replies", error))?;
        tx.exec_drop(queries.purge_messages(locked.len()), locked.clone())
            .await
            .map_err(|error| storage_error("purge_processed: messages", error))?;
        deleted += u64::try_from(locked.len()).unwrap_or(u64::MAX);
    }
    Ok(deleted)
}

/// Resets a request (`effect/src/cluster/MessageStorage.ts`); with `expected_reply_id`, only if
/// that is still its latest reply, checked here, in storage, not at the caller's earlier read.
async fn clear_replies(
    tx: &mut Transaction<'static>,
    queries: &MessageQueries,
    id: i64,
    expected_reply_id: Option<i64>,
) -> Result<(), StorageError> {
    let error = |error| storage_error("clear_replies", error);
    match expected_reply_id {
        None => {
            tx.exec_drop(queries.delete_exit.as_str(), (id,)).await.map_err(error)?;
            tx.exec_drop(queries.delete_interrupts.as_str(), (id,)).await.map_err(error)?;
            tx.exec_drop(queries.unprocess_request.as_str(), (id,)).await.map_err(error)
        }
        Some(expected) => {
            tx.exec_drop(queries.delete_exit_if_latest.as_str(), (id, id, expected))
                .await
                .map_err(error)?;
            tx.exec_drop(queries.unprocess_request_if_latest.as_str(), (id, expected))
                .await
                .map_err(error)
        }
    }
}

/// What [`write_reply`] did.
enum ReplyWrite {
    Written,
    /// The same chunk (same id, same request) was already stored: a retry. Nothing changed.
    AlreadyStored,
}

/// Inserts a reply and updates its message rows (`effect/src/cluster/SqlMessageStorage.ts`): a
/// chunk becomes the request's latest reply; a final reply also marks the request and its
/// acknowledgements and interrupts processed. The insert goes first, so a rejected duplicate
/// changes nothing.
async fn write_reply<Q: Queryable>(
    conn: &mut Q,
    queries: &MessageQueries,
    insert: &ReplyInsert,
) -> Result<ReplyWrite, StorageError> {
    let params =
        (insert.id, insert.kind, insert.request_id, insert.payload.as_str(), insert.sequence);
    match conn.exec_drop(queries.insert_reply.as_str(), params).await {
        Ok(()) => {}
        Err(mysql_async::Error::Server(error)) if error.code == ER_DUP_ENTRY => {
            return duplicate_reply(conn, queries, insert, error).await;
        }
        Err(error) => return Err(storage_error("save_reply", error)),
    }
    let update =
        if insert.kind.is_some() { &queries.exit_processed } else { &queries.chunk_last_reply };
    conn.exec_drop(update.as_str(), (insert.id, insert.request_id))
        .await
        .map_err(|error| storage_error("save_reply: update the message rows", error))?;
    Ok(ReplyWrite::Written)
}

/// A reply insert hit a unique key. A second final reply is a conflict (the contract); the
/// same chunk saved again is a retry.
async fn duplicate_reply<Q: Queryable>(
    conn: &mut Q,
    queries: &MessageQueries,
    insert: &ReplyInsert,
    error: mysql_async::ServerError,
) -> Result<ReplyWrite, StorageError> {
    let conflict = |message: String| {
        StorageError::with_source(
            StorageErrorKind::Conflict,
            message,
            mysql_async::Error::Server(error.clone()),
        )
    };
    if insert.kind.is_some() {
        return Err(conflict(format!("request {} already has a final reply", insert.request_id)));
    }
    let existing: Option<Row> = conn
        .exec_first(queries.select_reply_owner.as_str(), (insert.id,))
        .await
        .map_err(|error| storage_error("save_reply: read the duplicate", error))?;
    if let Some(existing) = existing {
        let mut columns = Columns::new(existing);
        let same_request = columns.int().ok().flatten() == Some(insert.request_id);
        let is_chunk = matches!(columns.int(), Ok(None));
        if same_request && is_chunk {
            tracing::debug!(reply_id = insert.id, "chunk already stored");
            return Ok(ReplyWrite::AlreadyStored);
        }
    }
    Err(conflict(format!("a reply of request {} conflicts with a stored one", insert.request_id)))
}

/// Runs the checked state write `row` on `conn` (a pooled connection or a transaction): one
/// statement, which changes no row when the write is stale. Then it fails with `StaleState`,
/// and a transaction it ran in goes on.
async fn write_state<Q: Queryable>(
    conn: &mut Q,
    queries: &MessageQueries,
    row: &StateRow<'_>,
) -> Result<(), StorageError> {
    let (entity_type, entity_id, shard_id) = (row.entity_type, row.entity_id, &row.shard_id);
    let changed = match row.change {
        StateChange::Nothing => return Ok(()),
        StateChange::Insert(value) => {
            let params = (entity_type, entity_id, shard_id.as_str(), value);
            match affected_rows(conn, &queries.insert_state, params.into()).await {
                Err(mysql_async::Error::Server(error)) if error.code == ER_DUP_ENTRY => {
                    return Err(row.write.stale());
                }
                inserted => inserted.map_err(|error| storage_error("save_state: insert", error))?,
            }
        }
        StateChange::Update(value) => {
            let params = (shard_id.as_str(), value, entity_type, entity_id, row.expected);
            affected_rows(conn, &queries.update_state, params.into())
                .await
                .map_err(|error| storage_error("save_state: update", error))?
        }
        StateChange::Delete => {
            let params = (entity_type, entity_id, row.expected);
            affected_rows(conn, &queries.delete_state, params.into())
                .await
                .map_err(|error| storage_error("save_state: delete", error))?
        }
    };
    // The update always changes the revision: the count is the same with or without
    // `CLIENT_FOUND_ROWS`.
    if changed == 0 { Err(row.write.stale()) } else { Ok(()) }
}

/// Runs the statement `sql` on `conn` and returns how many rows it changed.
async fn affected_rows<Q: Queryable>(
    conn: &mut Q,
    sql: &str,
    params: Params,
) -> Result<u64, mysql_async::Error> {
    let result = conn.exec_iter(sql, params).await?;
    let affected = result.affected_rows();
    result.drop_result().await?;
    Ok(affected)
}

/// The row of `write`: its value within `limit` (`StateRow::checked`) and its key within the
/// columns' widths, checked before any statement.
fn checked_state(write: &StateWrite, limit: ValueLimit) -> Result<StateRow<'_>, StorageError> {
    let row = StateRow::checked(write, limit)?;
    check_state_widths(&row)?;
    Ok(row)
}

/// Checks the column widths of a state row's key (see the module docs); its value is checked
/// against the storage's limit when the row is made (`StateRow::checked`).
fn check_state_widths(row: &StateRow<'_>) -> Result<(), StorageError> {
    check_chars("shard_id", &row.shard_id, queries::SHARD_ID_LEN_MAX)?;
    check_chars("entity_type", row.entity_type, queries::ENTITY_TYPE_LEN_MAX)?;
    check_chars("entity_id", row.entity_id, queries::ENTITY_ID_LEN_MAX)
}

/// Checks the column widths of a message row (see the module docs); its payload and headers are
/// checked against the storage's limit when the row is made (`MessageInsert::checked_request`).
fn check_widths(insert: &MessageInsert<'_>) -> Result<(), StorageError> {
    check_chars("shard_id", &insert.shard_id, queries::SHARD_ID_LEN_MAX)?;
    check_chars("entity_type", insert.entity_type, queries::ENTITY_TYPE_LEN_MAX)?;
    check_chars("entity_id", insert.entity_id, queries::ENTITY_ID_LEN_MAX)?;
    let optional = [
        ("message_id", insert.message_id.as_deref(), queries::MESSAGE_ID_LEN_MAX),
        ("tag", insert.tag, queries::TAG_LEN_MAX),
        ("trace_id", insert.trace_id, queries::TRACE_ID_LEN_MAX),
        ("span_id", insert.span_id, queries::SPAN_ID_LEN_MAX),
    ];
    for (column, value, len_max) in optional {
        if let Some(value) = value {
            check_chars(column, value, len_max)?;
        }
    }
    Ok(())
}

/// The parameters of `insert_message`, in its column order.
fn message_params(insert: &MessageInsert<'_>) -> Vec<Value> {
    vec![
        Value::from(insert.id),
        Value::from(insert.message_id.as_deref()),
        Value::from(insert.shard_id.as_str()),
        Value::from(insert.entity_type),
        Value::from(insert.entity_id),
        Value::from(insert.kind),
        Value::from(insert.tag),
        Value::from(insert.payload),
        Value::from(insert.headers),
        Value::from(insert.trace_id),
        Value::from(insert.span_id),
        Value::from(insert.sampled),
        Value::from(insert.request_id),
        Value::from(insert.reply_id),
        Value::from(insert.deliver_at),
    ]
}

/// A row whose ids cannot be read: the database holds something no runner wrote.
fn malformed_row(error: DecodeError) -> StorageError {
    StorageError::with_source(StorageErrorKind::Malformed, "unreadable row", error)
}

/// A column every row has.
fn required(column: Result<Option<i64>, DecodeError>, name: &str) -> Result<i64, StorageError> {
    column.map_err(malformed_row)?.ok_or_else(|| {
        StorageError::new(StorageErrorKind::Malformed, format!("column {name} is NULL"))
    })
}

/// A `NOT NULL` text column.
fn present(column: Result<Option<String>, DecodeError>, name: &str) -> Result<String, DecodeError> {
    column?.ok_or_else(|| DecodeError::new("message row", format!("{name} is NULL")))
}

/// A reply row's `kind`, `payload` and `sequence`, or why they cannot be read.
type ReplyColumns = Result<(Option<i32>, Option<String>, Option<i32>), DecodeError>;

/// The reply a row describes; a row whose ids are readable but whose other columns are not
/// becomes a defect reply, as `ReplyRow::decode` does for bad JSON.
fn read_reply(id: i64, request_id: i64, rest: ReplyColumns) -> Result<Reply, StorageError> {
    match rest {
        Ok((kind, payload, sequence)) => {
            // A NULL payload (impossible in this schema) fails to decode like bad JSON.
            let payload = payload.unwrap_or_default();
            ReplyRow { id, kind, request_id, payload, sequence }.decode()
        }
        Err(error) => {
            let request_id = row::id_from_sql(request_id).map_err(malformed_row)?;
            let id = row::id_from_sql(id).map_err(malformed_row)?;
            Ok(Reply::malformed(request_id, id, &error))
        }
    }
}

/// A `replies_for` row: `id, kind, request_id, payload, sequence, rowid`.
fn read_reply_row(row: Row) -> Result<(i64, Reply), StorageError> {
    let mut columns = Columns::new(row);
    let id = columns.int();
    let kind = columns.int32();
    let request_id = columns.int();
    let payload = columns.text();
    let sequence = columns.int32();
    let rowid = required(columns.int(), "rowid")?;
    let id = required(id, "id")?;
    let request_id = required(request_id, "request_id")?;
    let rest = kind.and_then(|kind| Ok((kind, payload?, sequence?)));
    Ok((rowid, read_reply(id, request_id, rest)?))
}

/// A `processed_requests` row: `id, shard_id, entity_type, entity_id, tag`, the final
/// reply's `id, payload`, and the request's `payload`; a column that cannot be read is a malformed row named by its id.
fn read_processed_row(row: Row) -> Result<ProcessedRequest, StorageError> {
    let mut columns = Columns::new(row);
    let request_id = required(columns.int(), "id")?;
    let unreadable = |error: DecodeError| {
        StorageError::with_source(
            StorageErrorKind::Malformed,
            format!("the processed request row {request_id} cannot be read"),
            error,
        )
    };
    let mut text = |name: &str| present(columns.text(), name).map_err(unreadable);
    let shard_id = text("shard_id")?;
    let entity_type = text("entity_type")?;
    let entity_id = text("entity_id")?;
    let tag = columns.text().map_err(unreadable)?;
    let reply_id = required(columns.int(), "the final reply's id")?;
    let reply_payload = columns.text().map_err(unreadable)?.unwrap_or_default();
    // A payload that cannot be read is left out, as one that is not JSON.
    let payload = columns.text().ok().flatten();
    ProcessedRow {
        request_id,
        shard_id,
        entity_type,
        entity_id,
        tag,
        reply_id,
        reply_payload,
        payload,
    }
    .decode()
}

/// A `backlog` row: `entity_type, shard_id`, the four counts and the wait start; a column that
/// cannot be read is a malformed row.
fn read_backlog_row(row: Row) -> Result<Backlog, StorageError> {
    let mut columns = Columns::new(row);
    let entity_type = present(columns.text(), "entity_type").map_err(malformed_row)?;
    let shard_id = present(columns.text(), "shard_id").map_err(malformed_row)?;
    let mut count = |name: &str| required(columns.int(), name);
    let due = count("due")?;
    let scheduled = count("scheduled")?;
    let claimed = count("claimed")?;
    let stale_claims = count("stale_claims")?;
    let waiting_since = columns.int().map_err(malformed_row)?;
    BacklogRow { entity_type, shard_id, due, scheduled, claimed, stale_claims, waiting_since }
        .decode()
}

/// A `requests` row (see `MessageQueries::requests`); a column that cannot be read is a
/// malformed row named by its id, except the payload, which is left out.
fn read_request_row(row: Row) -> Result<RequestRecord, StorageError> {
    let mut columns = Columns::new(row);
    let request_id = required(columns.int(), "id")?;
    let unreadable = |error: DecodeError| {
        StorageError::with_source(
            StorageErrorKind::Malformed,
            format!("the request row {request_id} cannot be read"),
            error,
        )
    };
    let shard_id = present(columns.text(), "shard_id").map_err(unreadable)?;
    let entity_type = present(columns.text(), "entity_type").map_err(unreadable)?;
    let entity_id = present(columns.text(), "entity_id").map_err(unreadable)?;
    let tag = columns.text().map_err(unreadable)?;
    // A payload that cannot be read is left out, as one that is not JSON.
    let payload = columns.text().ok().flatten();
    let mut flag = |name: &str| {
        columns
            .boolean()
            .map_err(unreadable)?
            .ok_or_else(|| unreadable(DecodeError::new("request row", format!("{name} is NULL"))))
    };
    let processed = flag("processed")?;
    let claimed = flag("claimed")?;
    let deliver_at = columns.int().map_err(unreadable)?;
    let interrupted = columns.boolean().map_err(unreadable)?.unwrap_or(false);
    let reply_id = columns.int().map_err(unreadable)?;
    // A reply payload that cannot be read decodes as a defect, as one that is not JSON.
    let reply_payload = columns.text().ok().flatten();
    RequestRow {
        request_id,
        shard_id,
        entity_type,
        entity_id,
        tag,
        payload,
        processed,
        claimed,
        deliver_at,
        interrupted,
        reply_id,
        reply_payload,
    }
    .decode()
}

/// A duplicate's row: `m.id, r.id, r.kind, r.payload, r.sequence`.
fn read_duplicate(row: Row) -> Result<SaveResult, StorageError> {
    let mut columns = Columns::new(row);
    let original = required(columns.int(), "id")?;
    let reply_id = columns.int().map_err(malformed_row)?;
    let kind = columns.int32();
    let payload = columns.text();
    let sequence = columns.int32();
    let original_id = row::id_from_sql(original).map_err(malformed_row)?;
    let last_received_reply = match reply_id {
        None => None,
        Some(reply_id) => {
            let rest = kind.and_then(|kind| Ok((kind, payload?, sequence?)));
            Some(read_reply(reply_id, original, rest)?)
        }
    };
    tracing::debug!(%original_id, "duplicate request");
    Ok(SaveResult::Duplicate { original_id, last_received_reply })
}

/// A message row as read: its ordering key and id (always readable), and the row or why it
/// cannot be read.
struct ReadMessage {
    rowid: i64,
    id: i64,
    row: Result<MessageRow, MalformedMessage>,
}

/// A message row with its last reply and rowid, in `queries::MESSAGE_COLUMNS` order.
fn read_message_row(row: Row) -> Result<ReadMessage, StorageError> {
    let mut columns = Columns::new(row);
    let id = columns.int();
    let shard_id = columns.text();
    let entity_type = columns.text();
    let entity_id = columns.text();
    let kind = columns.int32();
    let tag = columns.text();
    let payload = columns.text();
    let headers = columns.text();
    let trace_id = columns.text();
    let span_id = columns.text();
    let sampled = columns.boolean();
    let request_id = columns.int();
    let reply_id = columns.int();
    let last_reply_id = columns.int();
    let last_reply_payload = columns.text();
    let last_reply_sequence = columns.int32();
    let rowid = required(columns.int(), "rowid")?;
    let id = required(id, "id")?;
    let request_id = required(request_id, "request_id")?;
    let read = || -> Result<MessageRow, DecodeError> {
        let last_reply = match last_reply_id? {
            None => None,
            Some(id) => Some(LastReplyRow {
                id,
                payload: last_reply_payload?.unwrap_or_default(),
                sequence: last_reply_sequence?,
            }),
        };
        Ok(MessageRow {
            id,
            shard_id: present(shard_id, "shard_id")?,
            entity_type: present(entity_type, "entity_type")?,
            entity_id: present(entity_id, "entity_id")?,
            kind: kind?.ok_or_else(|| DecodeError::new("message row", "kind is NULL"))?,
            tag: tag?,
            payload: payload?,
            headers: headers?,
            trace_id: trace_id?,
            span_id: span_id?,
            sampled: sampled?,
            request_id,
            reply_id: reply_id?,
            last_reply,
        })
    };
    let row = read().map_err(|error| MalformedMessage {
        id: Snowflake::from_i64(id).unwrap_or(Snowflake::new(0)),
        request_id: Snowflake::from_i64(request_id).unwrap_or(Snowflake::new(0)),
        error,
    });
    Ok(ReadMessage { rowid, id, row })
}

/// Splits read rows into messages and malformed rows with `row::into_batch`, keeping storage
/// order; rows whose columns could not even be read (text that is not UTF-8) join the
/// malformed ones after it.
fn into_batch(read: Vec<ReadMessage>) -> UnprocessedBatch {
    let mut unreadable = Vec::new();
    let rows: Vec<MessageRow> = read
        .into_iter()
        .filter_map(|message| message.row.map_err(|malformed| unreadable.push(malformed)).ok())
        .collect();
    let mut batch = row::into_batch(rows);
    batch.malformed.extend(unreadable);
    batch
}
