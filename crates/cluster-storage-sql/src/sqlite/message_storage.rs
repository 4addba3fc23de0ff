//! [`SqliteMessageStorage`]: the mailboxes and replies of `cluster_core::storage::MessageStorage`
//! on a SQLite file (`effect/src/cluster/MessageStorage.ts`), and its user transactions.
//!
//! The async side, here, validates input, maps it to rows (`crate::row`) and decodes the rows
//! that come back; the blocking side (`run_*` in `message_ops.rs`, called by the worker thread)
//! runs the SQL. Saves go through group commit; everything that reads and then writes runs in a
//! `BEGIN IMMEDIATE` transaction.
//!
//! Payloads, headers, replies and entity states longer than `value_bytes_max` are refused here,
//! before a command reaches the worker: a group commit never holds a value it would have to
//! refuse.
//!
//! Entity states (`cluster_core::entity_state`) live in `<prefix>_entity_state`, a table of
//! ours. Their writes join the group commit as the replies do, a reply with its state as one
//! write; a stale write changes no row, so it fails only its own caller.

use std::any::Any;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{AckChunk, Interrupt, MESSAGE_ID_LENGTH_MAX, Reply, Request};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{Backlog, BacklogQuery, RequestQuery, RequestRecord};
use cluster_core::retention::{self, ProcessedQuery, ProcessedRequest, PurgeProcessed};
use cluster_core::storage::{
    MessageStorage, MessageTransaction, OrderedSave, SaveRequestOptions, SaveResult,
    UnprocessedBatch, UnprocessedOptions,
};
use cluster_core::sync::lock;
use cluster_core::transaction::TransactionGuard;
use cluster_core::{EntityAddress, ShardId, Snowflake, Timestamp};
use rusqlite::Connection;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::message_ops::{
    AddressGroup, Claim, EarlierCheck, MessageOp, MessageValues, StateValues, TransactionOp, Write,
    WriteOp, WriteOutcome,
};
use super::options::SqliteOptions;
use super::queries::{self, MigrationSet, json_integers, json_strings};
use super::state::{Responder, classify};
use super::worker::{Command, Worker};
use crate::options::ValueBytesMax;
use crate::row::inspect::{BacklogFilter, BacklogRow, RequestFilter, RequestRow};
use crate::row::{
    self, MessageInsert, ProcessedRow, ReplyInsert, ReplyRow, StateChange, StateRow, ValueLimit,
    id_from_sql, id_to_sql, ids_from_sql,
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
    /// The most bytes of a payload, headers or reply (`value_bytes_max`).
    limit: ValueLimit,
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
        let limit = options.value_limit();
        let transactions =
            Arc::new(TransactionPool { path, options, idle: Mutex::new(Vec::new()), permits });
        Ok(SqliteMessageStorage { worker, transactions, limit })
    }

    /// The most bytes a stored value may have on this storage (`value_bytes_max` of its
    /// options): a longer payload, headers or reply is refused with
    /// [`StorageErrorKind::InvalidInput`] before it reaches the worker.
    pub fn value_bytes_max(&self) -> ValueBytesMax {
        self.limit.effective()
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
        let insert = MessageInsert::checked_request(request, options, self.limit)?;
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
            WriteOutcome::Claimed(_) | WriteOutcome::Stale => {
                Err(mismatched_outcome("save_request"))
            }
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
    fn backend_name(&self) -> &'static str {
        "sqlite"
    }

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
            let row = ReplyInsert::checked(reply, self.limit)?;
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
                | WriteOutcome::Duplicate { .. }
                | WriteOutcome::Stale => {
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
                    entity_id: address.entity_id.as_str().to_owned(),
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

    fn purge_processed<'a>(
        &'a self,
        batch: &'a PurgeProcessed,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(async move {
            if batch.limit == 0 {
                return Err(retention::zero_limit("purge_processed"));
            }
            let replied_before = id_to_sql(batch.replied_before)?;
            tracing::debug!(operation = "purge_processed", limit = batch.limit, "sqlite");
            self.message_op("purge_processed", |reply| MessageOp::PurgeProcessed {
                replied_before,
                keep_prefixes: json_strings(&batch.keep_entity_type_prefixes),
                limit: batch.limit,
                reply,
            })
            .await
        })
    }

    fn processed_requests<'a>(
        &'a self,
        query: &'a ProcessedQuery,
    ) -> BoxFuture<'a, Result<Vec<ProcessedRequest>, StorageError>> {
        Box::pin(async move {
            if query.limit == 0 {
                return Err(retention::zero_limit("processed_requests"));
            }
            let replied_before = id_to_sql(query.replied_before)?;
            // Ids are never negative: -1 is "from the first".
            let after = query.after.map(id_to_sql).transpose()?.unwrap_or(-1);
            tracing::debug!(operation = "processed_requests", limit = query.limit, "sqlite");
            let rows = self
                .message_op("processed_requests", |reply| MessageOp::ProcessedRequests {
                    replied_before,
                    entity_type_prefix: query.entity_type_prefix.clone(),
                    tag: query.tag.clone(),
                    after,
                    limit: query.limit,
                    reply,
                })
                .await?;
            rows.into_iter().map(ProcessedRow::decode).collect()
        })
    }

    fn backlog<'a>(
        &'a self,
        query: &'a BacklogQuery,
    ) -> BoxFuture<'a, Result<Vec<Backlog>, StorageError>> {
        Box::pin(async move {
            let filter = BacklogFilter::new(query)?;
            tracing::debug!(operation = "backlog", limit = query.limit, "sqlite");
            let rows =
                self.message_op("backlog", |reply| MessageOp::Backlog { filter, reply }).await?;
            rows.into_iter().map(BacklogRow::decode).collect()
        })
    }

    fn requests<'a>(
        &'a self,
        query: &'a RequestQuery,
    ) -> BoxFuture<'a, Result<Vec<RequestRecord>, StorageError>> {
        Box::pin(async move {
            let filter = RequestFilter::new(query)?;
            tracing::debug!(operation = "requests", limit = query.limit, "sqlite");
            let rows =
                self.message_op("requests", |reply| MessageOp::Requests { filter, reply }).await?;
            rows.into_iter().map(RequestRow::decode).collect()
        })
    }

    fn load_state<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<Option<StoredState>, StorageError>> {
        Box::pin(async move {
            tracing::debug!(operation = "load_state", %address, "sqlite");
            let row = self
                .message_op("load_state", |reply| MessageOp::LoadState {
                    entity_type: address.entity_type.as_str().to_owned(),
                    entity_id: address.entity_id.as_str().to_owned(),
                    reply,
                })
                .await?;
            row.map(|row| row.decode(address)).transpose()
        })
    }

    fn save_state<'a>(&'a self, write: &'a StateWrite) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            let row = StateRow::checked(write, self.limit)?;
            if row.change == StateChange::Nothing {
                return Ok(());
            }
            tracing::debug!(operation = "save_state", address = %write.address, expected = write.expected, "sqlite");
            match self.write(WriteOp::State(StateValues::from(row))).await? {
                WriteOutcome::Stored => Ok(()),
                WriteOutcome::Stale => Err(write.stale()),
                _ => Err(mismatched_outcome("save_state")),
            }
        })
    }

    /// One write of the group commit, as a reply alone is.
    fn save_reply_with_state<'a>(
        &'a self,
        reply: &'a Reply,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            let row = ReplyInsert::checked(reply, self.limit)?;
            let state = StateValues::from(StateRow::checked(write, self.limit)?);
            tracing::debug!(operation = "save_reply_with_state", id = %reply.id(), request_id = %reply.request_id(), address = %write.address, expected = write.expected, "sqlite");
            match self.write(WriteOp::ReplyWithState { reply: row, state }).await? {
                WriteOutcome::Stored => Ok(()),
                WriteOutcome::Stale => Err(write.stale()),
                _ => Err(mismatched_outcome("save_reply_with_state")),
            }
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
            // Checked before the worker sees it, as every save is.
            let row = ReplyInsert::checked(reply, self.pool.options.value_limit())?;
            tracing::debug!(operation = "transaction save_reply", id = %reply.id(), request_id = %reply.request_id(), "sqlite");
            self.handle
                .worker
                .call("transaction save_reply", |reply| {
                    Command::Transaction(TransactionOp::SaveReply { row, reply })
                })
                .await
        })
    }

    fn save_state<'a>(
        &'a mut self,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(async move {
            // Checked before the worker sees it, as every save is.
            let row = StateRow::checked(write, self.pool.options.value_limit())?;
            if row.change == StateChange::Nothing {
                return Ok(());
            }
            tracing::debug!(operation = "transaction save_state", address = %write.address, expected = write.expected, "sqlite");
            let state = StateValues::from(row);
            let written = self
                .handle
                .worker
                .call("transaction save_state", |reply| {
                    Command::Transaction(TransactionOp::SaveState { state, reply })
                })
                .await?;
            if written { Ok(()) } else { Err(write.stale()) }
        })
    }

    fn backend(&mut self) -> &mut (dyn Any + Send) {
        &mut self.handle
    }

    fn savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(self.handle.run(|connection| connection.execute_batch(queries::SAVEPOINT)))
    }

    fn rollback_to_savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(
            self.handle.run(|connection| connection.execute_batch(queries::ROLLBACK_TO_SAVEPOINT)),
        )
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
