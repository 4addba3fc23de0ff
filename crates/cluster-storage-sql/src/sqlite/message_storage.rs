//! [`SqliteMessageStorage`]: the mailboxes and replies of `cluster_core::storage::MessageStorage`
//! on a SQLite file (`effect/src/cluster/MessageStorage.ts`), and its user transactions.
//!
//! The async side validates input, maps it to rows (`crate::row`) and decodes the rows that come
//! back; the blocking side (`run_*`, called by the worker thread) runs the SQL. Saves go through
//! group commit; everything that reads and then writes runs in a `BEGIN IMMEDIATE` transaction.

use std::any::Any;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cluster_core::envelope::{AckChunk, Interrupt, MESSAGE_ID_LENGTH_MAX, Reply, Request};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::storage::{
    MessageStorage, MessageTransaction, OrderedSave, SaveRequestOptions, SaveResult,
    UnprocessedBatch, UnprocessedOptions,
};
use cluster_core::sync::lock;
use cluster_core::transaction::TransactionGuard;
use cluster_core::{EntityAddress, ShardId, Snowflake, Timestamp};
use rusqlite::types::ToSql;
use rusqlite::{Connection, OptionalExtension, Row, params};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::SqliteOptions;
use super::queries::{self, MessageSql, MigrationSet, json_integers, json_strings};
use super::worker::{Command, Responder, TransactionState, Worker, WorkerState, classify};
use crate::row::{
    self, LastReplyRow, MessageInsert, MessageRow, ReplyInsert, ReplyRow, id_from_sql, id_to_sql,
    ids_from_sql,
};

/// [`MessageStorage`] on a SQLite file.
///
/// Opened with [`open`](SqliteMessageStorage::open) (which runs the migrations) or
/// [`open_without_migrations`](SqliteMessageStorage::open_without_migrations). It owns one
/// connection on its worker thread, plus up to
/// [`transactions_open_max`](SqliteOptions::transactions_open_max) connections for user
/// transactions. Dropping it stops the worker once queued commands have run;
/// [`close`](SqliteMessageStorage::close) does so and waits.
pub struct SqliteMessageStorage {
    worker: Worker,
    transactions: Arc<TransactionPool>,
}

impl fmt::Debug for SqliteMessageStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteMessageStorage")
            .field("path", &self.transactions.path)
            .field("prefix", &self.transactions.options.storage.prefix)
            .field("worker", &self.worker)
            .finish()
    }
}

impl SqliteMessageStorage {
    /// Opens (creating it if needed) the database file at `path`, brings the message tables up
    /// to date and starts the worker.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped open stops its worker; migrations are transactional.
    pub async fn open(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteMessageStorage, StorageError> {
        let storage = SqliteMessageStorage::open_without_migrations(path, options).await?;
        storage
            .worker
            .call("migrate", |reply| Command::Migrate { set: MigrationSet::Messages, reply })
            .await?;
        Ok(storage)
    }

    /// Opens the database at `path` without creating or changing any table (the reference's
    /// `layerStorage`): for a runtime whose migrations run elsewhere, see
    /// [`migrate`](SqliteMessageStorage::migrate).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn open_without_migrations(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteMessageStorage, StorageError> {
        let path = path.as_ref().to_path_buf();
        let worker = Worker::spawn_writer(&path, &options).await?;
        let permits = Arc::new(Semaphore::new(options.transactions_open_max.get()));
        let transactions =
            Arc::new(TransactionPool { path, options, idle: Mutex::new(Vec::new()), permits });
        Ok(SqliteMessageStorage { worker, transactions })
    }

    /// Brings the message tables of the database at `path` up to date (history
    /// `<prefix>_migrations`, compatible with effect's SQL migrator) and returns the ids of the
    /// migrations that ran: none when the database was already up to date.
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
            .call("migrate", |reply| Command::Migrate { set: MigrationSet::Messages, reply })
            .await;
        worker.shutdown().await;
        ran
    }

    /// Stops the worker and the idle transaction connections once the commands queued before
    /// have run, and waits until their connections are closed. Later calls fail as
    /// [`Unavailable`](StorageErrorKind::Unavailable); open transactions keep their connection
    /// until they end.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the workers stop whether or not the future is awaited to the end.
    pub async fn close(&self) {
        self.worker.shutdown().await;
        self.transactions.close().await;
    }

    async fn write(&self, op: WriteOp) -> Result<WriteOutcome, StorageError> {
        let operation = op.name();
        self.worker.call(operation, |reply| Command::Write(Box::new(Write { op, reply }))).await
    }

    /// Saves a request; with `earlier`, also reads its entity's earlier unprocessed requests in
    /// the same transaction once it is stored.
    async fn save(
        &self,
        request: &Request,
        options: &SaveRequestOptions,
        earlier: Option<EarlierCheck>,
    ) -> Result<OrderedSave, StorageError> {
        let insert = MessageInsert::request(request, options)?;
        // Before keys were hashed, SQLite's unbounded TEXT column stored long keys as they
        // are: such a row must still be found.
        let legacy_message_id = options
            .primary_key
            .as_ref()
            .filter(|key| key.encode_utf16().count() > MESSAGE_ID_LENGTH_MAX)
            .cloned();
        tracing::debug!(
            operation = "save_request",
            request_id = %request.request_id,
            deduplicated = insert.message_id.is_some(),
            "sqlite"
        );
        let values = MessageValues::from(insert);
        let op = WriteOp::Request { values, legacy_message_id, earlier };
        match self.write(op).await? {
            WriteOutcome::Stored => Ok(OrderedSave { saved: SaveResult::Success, earlier: None }),
            WriteOutcome::StoredAfter(ids) => {
                let earlier = ids.and_then(|ids| ids_from_sql(ids).ok());
                Ok(OrderedSave { saved: SaveResult::Success, earlier })
            }
            WriteOutcome::Claimed(_) => Err(mismatched_outcome("save_request")),
            WriteOutcome::Duplicate { id, last_reply } => {
                let original_id = id_from_sql(id).map_err(|error| {
                    StorageError::with_source(
                        StorageErrorKind::Malformed,
                        "unreadable duplicate row",
                        error,
                    )
                })?;
                let last_received_reply = last_reply.map(ReplyRow::decode).transpose()?;
                let saved = SaveResult::Duplicate { original_id, last_received_reply };
                Ok(OrderedSave { saved, earlier: None })
            }
        }
    }

    async fn message_op<T>(
        &self,
        operation: &'static str,
        make: impl FnOnce(Responder<T>) -> MessageOp,
    ) -> Result<T, StorageError> {
        self.worker.call(operation, |reply| Command::Message(make(reply))).await
    }
}

impl MessageStorage for SqliteMessageStorage {
    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>> {
        Box::pin(async move {
            let ordered = self.save(request, options, None).await?;
            Ok(ordered.saved)
        })
    }

    fn save_request_ordered<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedSave, StorageError>> {
        let earlier = EarlierCheck { now: now.unix_millis(), limit: limit.get() };
        Box::pin(self.save(request, options, Some(earlier)))
    }

    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            let values = MessageValues::from(MessageInsert::ack_chunk(ack)?);
            tracing::debug!(operation = "save_ack_chunk", id = %ack.id, request_id = %ack.request_id, "sqlite");
            self.write(WriteOp::AckChunk(values)).await.map(drop)
        })
    }

    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            let values = MessageValues::from(MessageInsert::interrupt(interrupt)?);
            tracing::debug!(operation = "save_interrupt", id = %interrupt.id, request_id = %interrupt.request_id, "sqlite");
            self.write(WriteOp::Interrupt(values)).await.map(drop)
        })
    }

    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            let row = ReplyInsert::new(reply)?;
            tracing::debug!(operation = "save_reply", id = %reply.id(), request_id = %reply.request_id(), is_final = reply.is_final(), "sqlite");
            self.write(WriteOp::Reply(row)).await.map(drop)
        })
    }

    fn clear_replies(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(async move {
            let request_id_sql = id_to_sql(request_id)?;
            let expected_reply_id = expected_reply_id.map(id_to_sql).transpose()?;
            tracing::debug!(operation = "clear_replies", %request_id, conditional = expected_reply_id.is_some(), "sqlite");
            self.message_op("clear_replies", |reply| MessageOp::ClearReplies {
                request_id: request_id_sql,
                expected_reply_id,
                reply,
            })
            .await
        })
    }

    fn request_id_for_primary_key<'a>(
        &'a self,
        primary_key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Snowflake>, StorageError>> {
        Box::pin(async move {
            let message_id = cluster_core::envelope::message_id(primary_key).into_owned();
            let legacy_message_id = (primary_key.encode_utf16().count() > MESSAGE_ID_LENGTH_MAX)
                .then(|| primary_key.to_owned());
            tracing::debug!(operation = "request_id_for_primary_key", "sqlite");
            let id = self
                .message_op("request_id_for_primary_key", |reply| MessageOp::RequestIdFor {
                    message_id,
                    legacy_message_id,
                    reply,
                })
                .await?;
            id.map(id_from_sql).transpose().map_err(|error| {
                StorageError::with_source(
                    StorageErrorKind::Malformed,
                    "unreadable request id",
                    error,
                )
            })
        })
    }

    fn replies_for<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        Box::pin(self.replies(request_ids, true))
    }

    fn replies_for_unfiltered<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        Box::pin(self.replies(request_ids, false))
    }

    fn unprocessed_messages<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'a>,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        Box::pin(async move {
            if shard_ids.is_empty() || options.addresses.is_some_and(<[EntityAddress]>::is_empty) {
                return Ok(UnprocessedBatch::default());
            }
            let limit = options.limit.map_or(-1, |limit| i64::from(limit.get()));
            let address_groups = options.addresses.map(address_groups).unwrap_or_default();
            let shard_ids_json = json_strings(shard_ids.iter().map(ToString::to_string));
            let claim = WriteOp::Claim(Claim {
                shard_ids: shard_ids_json,
                now: now.unix_millis(),
                limit,
                address_groups,
            });
            let rows = match self.write(claim).await? {
                WriteOutcome::Claimed(rows) => rows,
                WriteOutcome::Stored
                | WriteOutcome::StoredAfter(_)
                | WriteOutcome::Duplicate { .. } => {
                    return Err(mismatched_outcome("unprocessed_messages"));
                }
            };
            let batch = row::into_batch(rows);
            tracing::debug!(
                operation = "unprocessed_messages",
                n_shards = shard_ids.len(),
                n_messages = batch.messages.len(),
                n_malformed = batch.malformed.len(),
                "sqlite"
            );
            Ok(batch)
        })
    }

    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        Box::pin(async move {
            if ids.is_empty() {
                return Ok(UnprocessedBatch::default());
            }
            let ids_json = ids_json(ids)?;
            tracing::debug!(operation = "unprocessed_messages_by_id", n_ids = ids.len(), "sqlite");
            let rows = self
                .message_op("unprocessed_messages_by_id", |reply| MessageOp::UnprocessedById {
                    ids: ids_json,
                    now: now.unix_millis(),
                    reply,
                })
                .await?;
            Ok(row::into_batch(rows))
        })
    }

    fn unprocessed_before<'a>(
        &'a self,
        address: &'a EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<Vec<Snowflake>, StorageError>> {
        Box::pin(async move {
            let request_id = id_to_sql(request_id)?;
            let ids = self
                .message_op("unprocessed_before", |reply| MessageOp::UnprocessedBefore {
                    shard_id: address.shard_id.to_string(),
                    entity_type: address.entity_type.to_string(),
                    entity_id: address.entity_id.to_string(),
                    request_id,
                    now: now.unix_millis(),
                    limit: limit.get(),
                    reply,
                })
                .await?;
            ids_from_sql(ids)
        })
    }

    fn reset_requests<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            if request_ids.is_empty() {
                return Ok(());
            }
            let request_ids_json = ids_json(request_ids)?;
            tracing::debug!(operation = "reset_requests", n_requests = request_ids.len(), "sqlite");
            self.message_op("reset_requests", |reply| MessageOp::ResetRequests {
                request_ids: request_ids_json,
                reply,
            })
            .await
        })
    }

    fn reset_addresses<'a>(
        &'a self,
        addresses: &'a [EntityAddress],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            if addresses.is_empty() {
                return Ok(());
            }
            let address_groups = address_groups(addresses);
            tracing::debug!(operation = "reset_addresses", n_addresses = addresses.len(), "sqlite");
            self.message_op("reset_addresses", |reply| MessageOp::ResetAddresses {
                address_groups,
                reply,
            })
            .await
        })
    }

    fn reset_shards<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            if shard_ids.is_empty() {
                return Ok(());
            }
            let shard_ids_json = json_strings(shard_ids.iter().map(ToString::to_string));
            tracing::debug!(operation = "reset_shards", n_shards = shard_ids.len(), "sqlite");
            self.message_op("reset_shards", |reply| MessageOp::ResetShards {
                shard_ids: shard_ids_json,
                reply,
            })
            .await
        })
    }

    fn clear_address<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            tracing::debug!(operation = "clear_address", %address, "sqlite");
            self.message_op("clear_address", |reply| MessageOp::ClearAddress {
                entity_type: address.entity_type.as_str().to_owned(),
                entity_id: address.entity_id.as_str().to_owned(),
                reply,
            })
            .await
        })
    }

    fn begin_transaction(
        &self,
    ) -> BoxFuture<'_, Result<Box<dyn MessageTransaction>, StorageError>> {
        Box::pin(async move {
            tracing::debug!(operation = "begin_transaction", "sqlite");
            let transaction = self.transactions.begin().await?;
            Ok(Box::new(transaction) as Box<dyn MessageTransaction>)
        })
    }
}

impl SqliteMessageStorage {
    async fn replies(
        &self,
        request_ids: &[Snowflake],
        filtered: bool,
    ) -> Result<Vec<Reply>, StorageError> {
        if request_ids.is_empty() {
            return Ok(Vec::new());
        }
        let request_ids_json = ids_json(request_ids)?;
        let operation = if filtered { "replies_for" } else { "replies_for_unfiltered" };
        tracing::debug!(operation, n_requests = request_ids.len(), "sqlite");
        let rows = self
            .message_op(operation, |reply| MessageOp::Replies {
                request_ids: request_ids_json,
                filtered,
                reply,
            })
            .await?;
        rows.into_iter().map(ReplyRow::decode).collect()
    }
}

/// A write answered with another kind of write's outcome: a bug in this module, reported as an
/// error rather than a panic.
fn mismatched_outcome(operation: &str) -> StorageError {
    StorageError::new(
        StorageErrorKind::Other,
        format!("sqlite {operation}: the worker answered with another operation's outcome"),
    )
}

fn ids_json(ids: &[Snowflake]) -> Result<String, StorageError> {
    let ids = ids.iter().map(|id| id_to_sql(*id)).collect::<Result<Vec<i64>, StorageError>>()?;
    Ok(json_integers(ids))
}

fn address_groups(addresses: &[EntityAddress]) -> Vec<AddressGroup> {
    row::group_addresses(addresses)
        .into_iter()
        .map(|(shard_id, entity_type, entity_ids)| AddressGroup {
            shard_id,
            entity_type: entity_type.to_owned(),
            entity_ids: json_strings(entity_ids),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// User transactions
// ---------------------------------------------------------------------------------------------

/// The SQLite storage transaction a handler runs in, locked: it derefs to the
/// [`SqliteTransactionHandle`], which runs the handler's own statements inside the transaction.
///
/// They commit or roll back with the handler's saved result.
/// Hold the guard only while running statements (see [`TransactionGuard`]).
///
/// ```
/// use cluster_core::transaction::TransactionSource;
/// use cluster_storage_sql::sqlite::SqliteTransactionGuard;
///
/// /// Debits an account in the transaction of `context` (a `WITH_TRANSACTION` handler's
/// /// `RequestContext`, or a transactional activity's `ActivityContext`).
/// async fn debit(context: &impl TransactionSource, amount: i64) -> Result<usize, String> {
///     let tx = SqliteTransactionGuard::of(context).await.map_err(|error| error.to_string())?;
///     let sql = "UPDATE accounts SET balance = balance - ?1 WHERE id = 1";
///     tx.run(move |connection| connection.execute(sql, [amount]))
///         .await
///         .map_err(|error| error.to_string())
/// }
/// ```
pub type SqliteTransactionGuard<'a> = TransactionGuard<'a, SqliteTransactionHandle>;

/// What [`MessageTransaction::backend`] returns for SQLite: runs the handler's own statements
/// on the transaction's connection, inside the transaction. A handler reaches it through
/// [`SqliteTransactionGuard`].
///
/// The transaction begins (`BEGIN IMMEDIATE`, taking the database's write lock) at its first
/// statement or saved reply, and holds the lock until commit or rollback: keep it short, other
/// writers wait up to the busy timeout.
pub struct SqliteTransactionHandle {
    worker: Worker,
}

impl fmt::Debug for SqliteTransactionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTransactionHandle").field("worker", &self.worker).finish()
    }
}

impl SqliteTransactionHandle {
    /// Runs `body` on the transaction's connection (on its worker thread) and returns its
    /// result. A failed statement leaves the transaction open, as SQLite does; if SQLite itself
    /// rolled it back, this and every later call fail until the transaction ends.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, `body` still runs inside the transaction; only its result is
    /// lost.
    pub async fn run<T, F>(&self, body: F) -> Result<T, StorageError>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.worker
            .call("transaction statement", |reply| {
                Command::Transaction(TransactionOp::Call(Box::new(move |connection| {
                    let result = connection
                        .and_then(body)
                        .map_err(|error| classify("transaction statement", error));
                    let _ = reply.send(result);
                })))
            })
            .await
    }
}

/// The connections of user transactions: at most `transactions_open_max` open at once, reused
/// once their transaction ended cleanly.
#[derive(Debug)]
struct TransactionPool {
    path: PathBuf,
    options: SqliteOptions,
    idle: Mutex<Vec<Worker>>,
    permits: Arc<Semaphore>,
}

impl TransactionPool {
    async fn begin(self: &Arc<TransactionPool>) -> Result<SqliteTransaction, StorageError> {
        let permit = Arc::clone(&self.permits).acquire_owned().await.map_err(|_| {
            StorageError::new(StorageErrorKind::Unavailable, "sqlite message storage is closed")
        })?;
        let idle = lock(&self.idle).pop();
        let worker = match idle {
            Some(worker) => worker,
            None => Worker::spawn(&self.path, &self.options, "transaction").await?,
        };
        Ok(SqliteTransaction {
            handle: SqliteTransactionHandle { worker },
            pool: Arc::clone(self),
            _permit: permit,
            finished: false,
        })
    }

    fn put_back(&self, worker: Worker) {
        if !self.permits.is_closed() {
            lock(&self.idle).push(worker);
        }
    }

    async fn close(&self) {
        self.permits.close();
        let idle = std::mem::take(&mut *lock(&self.idle));
        for worker in idle {
            worker.shutdown().await;
        }
    }
}

/// An open user transaction on its own connection. Dropped without commit, it queues a
/// rollback (release on drop is queued, not immediate: the next user of the connection runs
/// after it).
struct SqliteTransaction {
    handle: SqliteTransactionHandle,
    pool: Arc<TransactionPool>,
    _permit: OwnedSemaphorePermit,
    finished: bool,
}

impl SqliteTransaction {
    /// Ends the transaction with `end` and returns the connection to the pool if it ended
    /// cleanly (a connection whose end failed is closed instead).
    async fn end(
        mut self: Box<Self>,
        operation: &'static str,
        end: fn(Responder<()>) -> TransactionOp,
    ) -> Result<(), StorageError> {
        tracing::debug!(operation, "sqlite transaction");
        let result =
            self.handle.worker.call(operation, |reply| Command::Transaction(end(reply))).await;
        self.finished = true;
        if result.is_ok() {
            self.pool.put_back(self.handle.worker.clone());
        }
        result
    }
}

impl MessageTransaction for SqliteTransaction {
    fn save_reply<'a>(&'a mut self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            let row = ReplyInsert::new(reply)?;
            tracing::debug!(operation = "transaction save_reply", id = %reply.id(), request_id = %reply.request_id(), "sqlite");
            self.handle
                .worker
                .call("transaction save_reply", |reply| {
                    Command::Transaction(TransactionOp::SaveReply { row, reply })
                })
                .await
        })
    }

    fn backend(&mut self) -> &mut (dyn Any + Send) {
        &mut self.handle
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        Box::pin(self.end("commit", |reply| TransactionOp::Commit { reply }))
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        Box::pin(self.end("rollback", |reply| TransactionOp::Rollback { reply: Some(reply) }))
    }
}

impl Drop for SqliteTransaction {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let rollback = Command::Transaction(TransactionOp::Rollback { reply: None });
        // If the rollback cannot be queued, the connection is not reused: dropping the last
        // handle stops its worker, and closing the connection rolls back.
        if self.handle.worker.try_send(rollback) {
            self.pool.put_back(self.handle.worker.clone());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------------------------

/// The column values of a message row to insert, owned so they can cross to the worker.
#[derive(Debug)]
pub(super) struct MessageValues {
    id: i64,
    message_id: Option<String>,
    shard_id: String,
    entity_type: String,
    entity_id: String,
    kind: i32,
    tag: Option<String>,
    payload: Option<String>,
    headers: Option<String>,
    trace_id: Option<String>,
    span_id: Option<String>,
    sampled: Option<bool>,
    request_id: i64,
    reply_id: Option<i64>,
    deliver_at: Option<i64>,
}

impl From<MessageInsert<'_>> for MessageValues {
    fn from(insert: MessageInsert<'_>) -> MessageValues {
        MessageValues {
            id: insert.id,
            message_id: insert.message_id.map(|message_id| message_id.into_owned()),
            shard_id: insert.shard_id,
            entity_type: insert.entity_type.to_owned(),
            entity_id: insert.entity_id.to_owned(),
            kind: insert.kind,
            tag: insert.tag.map(str::to_owned),
            payload: insert.payload.map(str::to_owned),
            headers: insert.headers.map(str::to_owned),
            trace_id: insert.trace_id.map(str::to_owned),
            span_id: insert.span_id.map(str::to_owned),
            sampled: insert.sampled,
            request_id: insert.request_id,
            reply_id: insert.reply_id,
            deliver_at: insert.deliver_at,
        }
    }
}

/// A write that may share a transaction with other queued writes (group commit): the saves and
/// the claim, the hot path of every request.
#[derive(Debug)]
pub(super) enum WriteOp {
    /// A request; with a `message_id` it is deduplicated. `legacy_message_id` is the plaintext
    /// key of an over-long primary key, looked up first.
    Request {
        values: MessageValues,
        legacy_message_id: Option<String>,
        /// Once stored, read the entity's unprocessed requests stored before it (in the same
        /// transaction: no second trip through the worker).
        earlier: Option<EarlierCheck>,
    },
    /// A chunk acknowledgement.
    AckChunk(MessageValues),
    /// An interrupt.
    Interrupt(MessageValues),
    /// A reply.
    Reply(ReplyInsert),
    /// Select and claim unprocessed messages.
    Claim(Claim),
}

/// The arguments of `unprocessed_before` after a save: the runner's clock and the limit.
#[derive(Debug)]
pub(super) struct EarlierCheck {
    now: i64,
    limit: u32,
}

/// The arguments of a claim (`effect/src/cluster/SqlMessageStorage.ts`).
#[derive(Debug)]
pub(super) struct Claim {
    /// The shards, as a JSON array.
    shard_ids: String,
    /// The runner's clock, for `deliver_at`.
    now: i64,
    /// At most this many rows; `-1` for no limit.
    limit: i64,
    /// The address filter's clauses (none: no filter).
    address_groups: Vec<AddressGroup>,
}

impl WriteOp {
    fn name(&self) -> &'static str {
        match self {
            WriteOp::Request { .. } => "save_request",
            WriteOp::AckChunk(_) => "save_ack_chunk",
            WriteOp::Interrupt(_) => "save_interrupt",
            WriteOp::Reply(_) => "save_reply",
            WriteOp::Claim(_) => "unprocessed_messages",
        }
    }
}

/// A write and where its result goes.
pub(super) struct Write {
    op: WriteOp,
    reply: Responder<WriteOutcome>,
}

/// The result of a write, before decoding.
#[derive(Debug)]
pub(super) enum WriteOutcome {
    Stored,
    /// A request stored, with the ids of its entity's earlier unprocessed requests (`None`:
    /// the read failed).
    StoredAfter(Option<Vec<i64>>),
    /// The rows a claim selected (and claimed).
    Claimed(Vec<MessageRow>),
    /// The request's key (or id) is taken by the stored request `id`.
    Duplicate {
        id: i64,
        last_reply: Option<ReplyRow>,
    },
}

/// One clause of an address filter: a shard, an entity type and its entity ids (JSON).
#[derive(Debug)]
pub(super) struct AddressGroup {
    shard_id: String,
    entity_type: String,
    entity_ids: String,
}

/// The message storage operations other than saves.
pub(super) enum MessageOp {
    ClearReplies {
        request_id: i64,
        expected_reply_id: Option<i64>,
        reply: Responder<()>,
    },
    RequestIdFor {
        message_id: String,
        legacy_message_id: Option<String>,
        reply: Responder<Option<i64>>,
    },
    Replies {
        request_ids: String,
        filtered: bool,
        reply: Responder<Vec<ReplyRow>>,
    },
    UnprocessedById {
        ids: String,
        now: i64,
        reply: Responder<Vec<MessageRow>>,
    },
    UnprocessedBefore {
        shard_id: String,
        entity_type: String,
        entity_id: String,
        request_id: i64,
        now: i64,
        limit: u32,
        reply: Responder<Vec<i64>>,
    },
    ResetRequests {
        request_ids: String,
        reply: Responder<()>,
    },
    ResetShards {
        shard_ids: String,
        reply: Responder<()>,
    },
    ResetAddresses {
        address_groups: Vec<AddressGroup>,
        reply: Responder<()>,
    },
    ClearAddress {
        entity_type: String,
        entity_id: String,
        reply: Responder<()>,
    },
}

impl MessageOp {
    /// Whether the operation only reads. A read queued among saves may run before them
    /// ([`worker`](super::worker)'s group commit): it was issued while they were in flight,
    /// so either order is one its caller could have seen.
    pub(super) fn is_read(&self) -> bool {
        matches!(
            self,
            MessageOp::RequestIdFor { .. }
                | MessageOp::Replies { .. }
                | MessageOp::UnprocessedById { .. }
                | MessageOp::UnprocessedBefore { .. }
        )
    }
}

/// A user statement: given the connection, or why the transaction cannot run statements.
pub(super) type UserStatement = Box<dyn FnOnce(rusqlite::Result<&Connection>) + Send>;

/// The steps of a user transaction.
pub(super) enum TransactionOp {
    SaveReply { row: ReplyInsert, reply: Responder<()> },
    Call(UserStatement),
    Commit { reply: Responder<()> },
    Rollback { reply: Option<Responder<()>> },
}

// ---------------------------------------------------------------------------------------------
// The blocking side, run by the worker thread
// ---------------------------------------------------------------------------------------------

fn respond<T>(reply: Responder<T>, operation: &str, result: rusqlite::Result<T>) {
    let _ = reply.send(result.map_err(|error| classify(operation, error)));
}

/// Runs a batch of writes: together in one transaction, so the batch costs one commit (one
/// fsync under `synchronous=FULL`). Callers hear back only after their write is committed. Each
/// write sees the ones before it, so two claims in a batch never return the same row.
///
/// The batch first runs without savepoints (a savepoint per write costs two statements and a
/// sub-journal page for every page it touches). If a write fails, that transaction is rolled
/// back and the batch runs again with each write under its own savepoint, so one failing write
/// fails only its own caller; if the shared transaction itself fails (its begin or commit), the
/// writes run one by one.
pub(super) fn run_writes(state: &WorkerState, batch: Vec<Write>) {
    let connection = &state.connection;
    let sql = &state.statements.message;
    if batch.len() > 1 {
        // Whether a write failed (rather than the transaction's begin or commit).
        let mut write_failed = false;
        let optimistic = queries::immediate(connection, |connection| {
            batch
                .iter()
                .map(|save| execute_write(connection, sql, &save.op))
                .collect::<rusqlite::Result<Vec<_>>>()
                .inspect_err(|_| write_failed = true)
        });
        match optimistic {
            Ok(results) => {
                tracing::debug!(n_writes = batch.len(), "sqlite group commit");
                for (save, result) in batch.into_iter().zip(results) {
                    respond(save.reply, save.op.name(), Ok(result));
                }
                return;
            }
            Err(error) => {
                tracing::debug!(%error, n_writes = batch.len(), write_failed, "sqlite group commit failed");
            }
        }
        if write_failed {
            let isolated = queries::immediate(connection, |connection| {
                batch
                    .iter()
                    .map(|save| queries::savepoint(connection, |c| execute_write(c, sql, &save.op)))
                    .collect::<rusqlite::Result<Vec<_>>>()
            });
            match isolated {
                Ok(results) => {
                    for (save, result) in batch.into_iter().zip(results) {
                        respond(save.reply, save.op.name(), result);
                    }
                    return;
                }
                Err(error) => {
                    tracing::debug!(%error, n_writes = batch.len(), "sqlite group commit failed, writing one by one");
                }
            }
        }
    }
    for save in batch {
        let result = queries::immediate(connection, |c| execute_write(c, sql, &save.op));
        respond(save.reply, save.op.name(), result);
    }
}

fn execute_write(
    connection: &Connection,
    sql: &MessageSql,
    op: &WriteOp,
) -> rusqlite::Result<WriteOutcome> {
    match op {
        WriteOp::Request { values, legacy_message_id, earlier } => {
            let outcome = save_request(connection, sql, values, legacy_message_id.as_deref())?;
            match (outcome, earlier) {
                (WriteOutcome::Stored, Some(check)) => {
                    // A failed read leaves the save alone: the caller then asks no further.
                    let address = [&values.shard_id, &values.entity_type, &values.entity_id];
                    let ids = unprocessed_before(
                        connection,
                        sql,
                        address,
                        values.id,
                        check.now,
                        check.limit,
                    );
                    Ok(WriteOutcome::StoredAfter(ids.ok()))
                }
                (outcome, _) => Ok(outcome),
            }
        }
        WriteOp::AckChunk(values) => {
            connection.prepare_cached(&sql.ack_reply)?.execute([values.reply_id])?;
            connection.prepare_cached(&sql.process_older_acks)?.execute([values.request_id])?;
            insert_message(connection, &sql.insert_message, values)?;
            Ok(WriteOutcome::Stored)
        }
        WriteOp::Interrupt(values) => {
            insert_message(connection, &sql.insert_message, values)?;
            Ok(WriteOutcome::Stored)
        }
        WriteOp::Claim(claim) => claim_rows(connection, sql, claim).map(WriteOutcome::Claimed),
        WriteOp::Reply(row) => {
            let update =
                if row.kind.is_some() { &sql.exit_last_reply } else { &sql.chunk_last_reply };
            connection.prepare_cached(update)?.execute([row.id, row.request_id])?;
            connection.prepare_cached(&sql.insert_reply)?.execute(params![
                row.id,
                row.kind,
                row.request_id,
                row.payload,
                row.sequence
            ])?;
            Ok(WriteOutcome::Stored)
        }
    }
}

/// The reference's SQLite dedup, in one transaction: `INSERT OR IGNORE`, and only when the
/// insert was ignored, look the key up (the reference looks first; inserting first saves a
/// statement for every request that is not a duplicate, with the same outcome, since the key
/// is unique). A key that was stored in its legacy plaintext form is looked up first.
fn save_request(
    connection: &Connection,
    sql: &MessageSql,
    values: &MessageValues,
    legacy_message_id: Option<&str>,
) -> rusqlite::Result<WriteOutcome> {
    let Some(message_id) = values.message_id.as_deref() else {
        insert_message(connection, &sql.insert_message, values)?;
        return Ok(WriteOutcome::Stored);
    };
    if let Some(legacy) = legacy_message_id
        && let Some(duplicate) =
            select_duplicate(connection, &sql.select_duplicate_by_message_id, &legacy)?
    {
        return Ok(duplicate);
    }
    if insert_message(connection, &sql.insert_message_or_ignore, values)? > 0 {
        return Ok(WriteOutcome::Stored);
    }
    if let Some(duplicate) =
        select_duplicate(connection, &sql.select_duplicate_by_message_id, &message_id)?
    {
        return Ok(duplicate);
    }
    // Ignored although the key is free: the request id is taken (the same request saved under
    // another key or none). It is the same request, so report the stored one.
    select_duplicate(connection, &sql.select_duplicate_by_id, &values.id)?.ok_or_else(|| {
        rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT),
            Some("the request row was ignored by a constraint".to_owned()),
        )
    })
}

fn select_duplicate(
    connection: &Connection,
    query: &str,
    key: &dyn ToSql,
) -> rusqlite::Result<Option<WriteOutcome>> {
    connection
        .prepare_cached(query)?
        .query_row([key], |row| {
            let id = queries::integer(row.get_ref(0)?, -1).unwrap_or(-1);
            let last_reply = match queries::integer(row.get_ref(1)?, -1) {
                None => None,
                Some(reply_id) => Some(ReplyRow {
                    id: reply_id,
                    kind: queries::small_integer(row.get_ref(2)?, -1),
                    request_id: id,
                    payload: queries::text(row.get_ref(3)?).unwrap_or_default(),
                    sequence: queries::small_integer(row.get_ref(4)?, -1),
                }),
            };
            Ok(WriteOutcome::Duplicate { id, last_reply })
        })
        .optional()
}

fn insert_message(
    connection: &Connection,
    query: &str,
    values: &MessageValues,
) -> rusqlite::Result<usize> {
    connection.prepare_cached(query)?.execute(params![
        values.id,
        values.message_id,
        values.shard_id,
        values.entity_type,
        values.entity_id,
        values.kind,
        values.tag,
        values.payload,
        values.headers,
        values.trace_id,
        values.span_id,
        values.sampled,
        values.request_id,
        values.reply_id,
        values.deliver_at,
    ])
}

/// Runs a message storage operation other than a save.
pub(super) fn run_operation(state: &WorkerState, op: MessageOp) {
    let connection = &state.connection;
    let sql = &state.statements.message;
    match op {
        MessageOp::ClearReplies { request_id, expected_reply_id, reply } => {
            let result = queries::immediate(connection, |c| {
                clear_replies(c, sql, request_id, expected_reply_id)
            });
            respond(reply, "clear_replies", result);
        }
        MessageOp::RequestIdFor { message_id, legacy_message_id, reply } => {
            let result = request_id_for(connection, sql, &message_id, legacy_message_id.as_deref());
            respond(reply, "request_id_for_primary_key", result);
        }
        MessageOp::Replies { request_ids, filtered, reply } => {
            let query = if filtered { &sql.replies_for } else { &sql.replies_for_unfiltered };
            let result = query_rows(connection, query, &[&request_ids], read_reply_row);
            respond(reply, "replies_for", result);
        }
        MessageOp::UnprocessedById { ids, now, reply } => {
            let result =
                query_rows(connection, &sql.unprocessed_by_id, &[&ids, &now], read_message_row);
            respond(reply, "unprocessed_messages_by_id", result);
        }
        MessageOp::UnprocessedBefore {
            shard_id,
            entity_type,
            entity_id,
            request_id,
            now,
            limit,
            reply,
        } => {
            let address = [&shard_id, &entity_type, &entity_id];
            let result = unprocessed_before(connection, sql, address, request_id, now, limit);
            respond(reply, "unprocessed_before", result);
        }
        MessageOp::ResetRequests { request_ids, reply } => {
            let result = execute(connection, &sql.reset_requests, &[&request_ids]);
            respond(reply, "reset_requests", result);
        }
        MessageOp::ResetShards { shard_ids, reply } => {
            let result = execute(connection, &sql.reset_shards, &[&shard_ids]);
            respond(reply, "reset_shards", result);
        }
        MessageOp::ResetAddresses { address_groups, reply } => {
            let query = sql.reset_addresses(address_groups.len());
            let result = execute(connection, &query, &address_parameters(&address_groups));
            respond(reply, "reset_addresses", result);
        }
        MessageOp::ClearAddress { entity_type, entity_id, reply } => {
            let result = queries::immediate(connection, |c| {
                execute(c, &sql.clear_address_replies, &[&entity_type, &entity_id])?;
                execute(c, &sql.clear_address_messages, &[&entity_type, &entity_id])
            });
            respond(reply, "clear_address", result);
        }
    }
}

fn execute(
    connection: &Connection,
    query: &str,
    parameters: &[&dyn ToSql],
) -> rusqlite::Result<()> {
    connection.prepare_cached(query)?.execute(parameters)?;
    Ok(())
}

/// The ids of the unprocessed, due requests of the entity at `address` (shard, type, id)
/// stored before `request_id`, oldest first, at most `limit`.
fn unprocessed_before(
    connection: &Connection,
    sql: &MessageSql,
    address: [&String; 3],
    request_id: i64,
    now: i64,
    limit: u32,
) -> rusqlite::Result<Vec<i64>> {
    let [shard_id, entity_type, entity_id] = address;
    let parameters: [&dyn ToSql; 5] = [shard_id, entity_type, entity_id, &request_id, &now];
    let mut statement = connection.prepare_cached(&sql.unprocessed_before)?;
    let rows = statement.query_map(parameters.as_slice(), |row| row.get::<_, i64>(0))?;
    rows.take(usize::try_from(limit).unwrap_or(usize::MAX)).collect()
}

fn query_rows<T>(
    connection: &Connection,
    query: &str,
    parameters: &[&dyn ToSql],
    read: fn(&Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<Vec<T>> {
    let mut statement = connection.prepare_cached(query)?;
    let rows = statement.query_map(parameters, read)?;
    rows.collect()
}

fn address_parameters(address_groups: &[AddressGroup]) -> Vec<&dyn ToSql> {
    address_groups
        .iter()
        .flat_map(|group| -> [&dyn ToSql; 3] {
            [&group.shard_id, &group.entity_type, &group.entity_ids]
        })
        .collect()
}

fn clear_replies(
    connection: &Connection,
    sql: &MessageSql,
    request_id: i64,
    expected_reply_id: Option<i64>,
) -> rusqlite::Result<()> {
    match expected_reply_id {
        None => {
            execute(connection, &sql.delete_exit, &[&request_id])?;
            execute(connection, &sql.delete_interrupts, &[&request_id])?;
            execute(connection, &sql.unprocess_request, &[&request_id])
        }
        // Checked here, at the storage boundary, not at the caller's earlier read.
        Some(expected) => {
            execute(connection, &sql.delete_exit_if_latest, &[&request_id, &expected])?;
            execute(connection, &sql.unprocess_request_if_latest, &[&request_id, &expected])
        }
    }
}

fn request_id_for(
    connection: &Connection,
    sql: &MessageSql,
    message_id: &str,
    legacy_message_id: Option<&str>,
) -> rusqlite::Result<Option<i64>> {
    for key in [Some(message_id), legacy_message_id].into_iter().flatten() {
        let id = connection
            .prepare_cached(&sql.select_id_by_message_id)?
            .query_row([key], |row| row.get::<_, i64>(0))
            .optional()?;
        if id.is_some() {
            return Ok(id);
        }
    }
    Ok(None)
}

/// Selects and claims (`effect/src/cluster/SqlMessageStorage.ts`): the rows are read and their
/// `last_read` set in one transaction, so two readers never claim the same row.
fn claim_rows(
    connection: &Connection,
    sql: &MessageSql,
    claim: &Claim,
) -> rusqlite::Result<Vec<MessageRow>> {
    let query = sql.unprocessed(claim.address_groups.len());
    let mut parameters: Vec<&dyn ToSql> = vec![&claim.shard_ids, &claim.now, &claim.limit];
    parameters.extend(address_parameters(&claim.address_groups));
    let rows = query_rows(connection, &query, &parameters, read_message_row)?;
    if !rows.is_empty() {
        let ids = json_integers(rows.iter().map(|row| row.id));
        execute(connection, &sql.claim, &[&ids])?;
    }
    Ok(rows)
}

/// A message row as `MESSAGE_COLUMNS` lists it. Every column is read leniently: a damaged row
/// becomes a malformed message when decoded, never a failed query.
fn read_message_row(row: &Row<'_>) -> rusqlite::Result<MessageRow> {
    let text = |idx: usize| row.get_ref(idx).map(queries::text);
    let last_reply = match queries::integer(row.get_ref(13)?, -1) {
        None => None,
        Some(id) => Some(LastReplyRow {
            id,
            payload: text(14)?.unwrap_or_default(),
            sequence: queries::small_integer(row.get_ref(15)?, -1),
        }),
    };
    Ok(MessageRow {
        id: queries::integer(row.get_ref(0)?, -1).unwrap_or(-1),
        shard_id: text(1)?.unwrap_or_default(),
        entity_type: text(2)?.unwrap_or_default(),
        entity_id: text(3)?.unwrap_or_default(),
        kind: queries::small_integer(row.get_ref(4)?, -1).unwrap_or(-1),
        tag: text(5)?,
        payload: text(6)?,
        headers: text(7)?,
        trace_id: text(8)?,
        span_id: text(9)?,
        sampled: queries::integer(row.get_ref(10)?, 0).map(|sampled| sampled != 0),
        request_id: queries::integer(row.get_ref(11)?, -1).unwrap_or(-1),
        reply_id: queries::integer(row.get_ref(12)?, -1),
        last_reply,
    })
}

/// A reply row (`id, kind, request_id, payload, sequence`), read leniently.
fn read_reply_row(row: &Row<'_>) -> rusqlite::Result<ReplyRow> {
    Ok(ReplyRow {
        id: queries::integer(row.get_ref(0)?, -1).unwrap_or(-1),
        kind: queries::small_integer(row.get_ref(1)?, -1),
        request_id: queries::integer(row.get_ref(2)?, -1).unwrap_or(-1),
        payload: row.get_ref(3).map(queries::text)?.unwrap_or_default(),
        sequence: queries::small_integer(row.get_ref(4)?, -1),
    })
}

/// Runs a step of a user transaction. The transaction begins at its first statement.
pub(super) fn run_transaction_operation(state: &mut WorkerState, op: TransactionOp) {
    match op {
        TransactionOp::SaveReply { row, reply } => {
            let result = begin_if_idle(state).and_then(|()| {
                let op = WriteOp::Reply(row);
                let sql = &state.statements.message;
                queries::savepoint(&state.connection, |c| execute_write(c, sql, &op))?.map(drop)
            });
            note_abort(state);
            respond(reply, "transaction save_reply", result);
        }
        TransactionOp::Call(statement) => {
            match begin_if_idle(state) {
                Ok(()) => statement(Ok(&state.connection)),
                Err(error) => statement(Err(error)),
            }
            note_abort(state);
        }
        TransactionOp::Commit { reply } => {
            let result = match state.transaction {
                TransactionState::Idle => Ok(()),
                TransactionState::Open => {
                    let committed = state.connection.execute_batch("COMMIT");
                    queries::rollback(&state.connection);
                    committed
                }
                TransactionState::Aborted => Err(aborted()),
            };
            state.transaction = TransactionState::Idle;
            respond(reply, "commit", result);
        }
        TransactionOp::Rollback { reply } => {
            queries::rollback(&state.connection);
            state.transaction = TransactionState::Idle;
            if let Some(reply) = reply {
                let _ = reply.send(Ok(()));
            }
        }
    }
}

fn begin_if_idle(state: &mut WorkerState) -> rusqlite::Result<()> {
    match state.transaction {
        TransactionState::Idle => {
            state.connection.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
            state.transaction = TransactionState::Open;
            Ok(())
        }
        TransactionState::Open => Ok(()),
        TransactionState::Aborted => Err(aborted()),
    }
}

/// SQLite rolls a transaction back on its own after some errors; from then on nothing may run
/// as if it were still inside it.
fn note_abort(state: &mut WorkerState) {
    if state.transaction == TransactionState::Open && state.connection.is_autocommit() {
        state.transaction = TransactionState::Aborted;
    }
}

fn aborted() -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
        Some("the transaction was rolled back by SQLite".to_owned()),
    )
}
