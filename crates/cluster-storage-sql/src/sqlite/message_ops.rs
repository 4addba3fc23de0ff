//! The worker side of the message storage: the commands
//! [`SqliteMessageStorage`](super::SqliteMessageStorage) sends its worker, and the blocking code
//! the worker thread runs for them.
//!
//! - `run_writes` runs a batch of saves and claims in one transaction (group commit).
//! - `run_operation` runs every other operation.
//! - `run_transaction_operation` runs the steps of a user transaction on its own connection.
//!
//! Everything that reads and then writes runs in a `BEGIN IMMEDIATE` transaction.

use rusqlite::types::ToSql;
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::queries::{self, MessageQueries, json_integers};
use super::state::{Responder, TransactionState, WorkerState, classify};
use crate::row::inspect::{BacklogFilter, BacklogRow, RequestFilter, RequestRow};
use crate::row::{
    LastReplyRow, MessageInsert, MessageRow, ProcessedRow, ReplyInsert, ReplyRow, StateChange,
    StateRow, StoredStateRow,
};

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

/// The column values of a conditional state write (`StateRow`), owned so they can cross to the
/// worker.
#[derive(Debug)]
pub(super) struct StateValues {
    entity_type: String,
    entity_id: String,
    shard_id: String,
    expected: i64,
    change: StateValue,
}

/// What a [`StateValues`] does to its row (`StateChange`, owned).
#[derive(Debug)]
enum StateValue {
    Insert(String),
    Update(String),
    Delete,
    Nothing,
}

impl From<StateRow<'_>> for StateValues {
    fn from(row: StateRow<'_>) -> StateValues {
        StateValues {
            entity_type: row.entity_type.to_owned(),
            entity_id: row.entity_id.to_owned(),
            shard_id: row.shard_id,
            expected: row.expected,
            change: match row.change {
                StateChange::Insert(value) => StateValue::Insert(value.to_owned()),
                StateChange::Update(value) => StateValue::Update(value.to_owned()),
                StateChange::Delete => StateValue::Delete,
                StateChange::Nothing => StateValue::Nothing,
            },
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
    /// An entity's state, alone.
    State(StateValues),
    /// An entity's state, then a reply: both or neither (a stale state writes no reply; a
    /// reply that fails undoes the state, with the rest of its write).
    ReplyWithState { reply: ReplyInsert, state: StateValues },
    /// Select and claim unprocessed messages.
    Claim(Claim),
}

/// The arguments of `unprocessed_before` after a save: the runner's clock and the limit.
#[derive(Debug)]
pub(super) struct EarlierCheck {
    pub(super) now: i64,
    pub(super) limit: u32,
}

/// The arguments of a claim (`effect/src/cluster/SqlMessageStorage.ts`).
#[derive(Debug)]
pub(super) struct Claim {
    /// The shards, as a JSON array.
    pub(super) shard_ids: String,
    /// The runner's clock, for `deliver_at`.
    pub(super) now: i64,
    /// At most this many rows; `-1` for no limit.
    pub(super) limit: i64,
    /// The address filter's clauses (none: no filter).
    pub(super) address_groups: Vec<AddressGroup>,
}

impl WriteOp {
    pub(super) fn name(&self) -> &'static str {
        match self {
            WriteOp::Request { .. } => "save_request",
            WriteOp::AckChunk(_) => "save_ack_chunk",
            WriteOp::Interrupt(_) => "save_interrupt",
            WriteOp::Reply(_) => "save_reply",
            WriteOp::State(_) => "save_state",
            WriteOp::ReplyWithState { .. } => "save_reply_with_state",
            WriteOp::Claim(_) => "unprocessed_messages",
        }
    }
}

/// A write and where its result goes.
pub(super) struct Write {
    pub(super) op: WriteOp,
    pub(super) reply: Responder<WriteOutcome>,
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
    /// A state write found another revision than the expected one: nothing was written.
    Stale,
}

/// One clause of an address filter: a shard, an entity type and its entity ids (JSON).
#[derive(Debug)]
pub(super) struct AddressGroup {
    pub(super) shard_id: String,
    pub(super) entity_type: String,
    pub(super) entity_ids: String,
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
    LoadState {
        entity_type: String,
        entity_id: String,
        reply: Responder<Option<StoredStateRow>>,
    },
    /// One batch of `purge_processed`; replies with how many requests it deleted.
    PurgeProcessed {
        replied_before: i64,
        /// The keep prefixes, as a JSON array.
        keep_prefixes: String,
        limit: u32,
        reply: Responder<u64>,
    },
    /// `processed_requests`; `after` is -1 for "from the first".
    ProcessedRequests {
        replied_before: i64,
        entity_type_prefix: String,
        tag: Option<String>,
        after: i64,
        limit: u32,
        reply: Responder<Vec<ProcessedRow>>,
    },
    /// The read model's `backlog`.
    Backlog {
        filter: BacklogFilter,
        reply: Responder<Vec<BacklogRow>>,
    },
    /// The read model's `requests`.
    Requests {
        filter: RequestFilter,
        reply: Responder<Vec<RequestRow>>,
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
                | MessageOp::LoadState { .. }
                | MessageOp::ProcessedRequests { .. }
                | MessageOp::Backlog { .. }
                | MessageOp::Requests { .. }
        )
    }
}

/// A user statement: given the connection, or why the transaction cannot run statements.
pub(super) type UserStatement = Box<dyn FnOnce(rusqlite::Result<&Connection>) + Send>;

/// The steps of a user transaction.
pub(super) enum TransactionOp {
    SaveReply {
        row: ReplyInsert,
        reply: Responder<()>,
    },
    /// A state write; `false`: stale, nothing written.
    SaveState {
        state: StateValues,
        reply: Responder<bool>,
    },
    Call(UserStatement),
    Commit {
        reply: Responder<()>,
    },
    Rollback {
        reply: Option<Responder<()>>,
    },
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
    sql: &MessageQueries,
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
            write_reply(connection, sql, row)?;
            Ok(WriteOutcome::Stored)
        }
        WriteOp::State(state) => Ok(if write_state(connection, sql, state)? {
            WriteOutcome::Stored
        } else {
            WriteOutcome::Stale
        }),
        WriteOp::ReplyWithState { reply, state } => {
            // A stale state changed nothing: there is nothing to undo.
            if !write_state(connection, sql, state)? {
                return Ok(WriteOutcome::Stale);
            }
            // A failing reply fails this write, whose savepoint (or transaction) then undoes
            // the state too.
            write_reply(connection, sql, reply)?;
            Ok(WriteOutcome::Stored)
        }
    }
}

/// Stores a reply with its message-row updates: a chunk becomes its request's latest reply; a
/// final reply also marks the request and its acknowledgements and interrupts processed.
fn write_reply(
    connection: &Connection,
    sql: &MessageQueries,
    row: &ReplyInsert,
) -> rusqlite::Result<()> {
    let update = if row.kind.is_some() { &sql.exit_processed } else { &sql.chunk_last_reply };
    connection.prepare_cached(update)?.execute([row.id, row.request_id])?;
    connection.prepare_cached(&sql.insert_reply)?.execute(params![
        row.id,
        row.kind,
        row.request_id,
        row.payload,
        row.sequence
    ])?;
    Ok(())
}

/// Runs a conditional state write: one statement, which changes no row when the write is stale
/// (`false`).
fn write_state(
    connection: &Connection,
    sql: &MessageQueries,
    state: &StateValues,
) -> rusqlite::Result<bool> {
    let StateValues { entity_type, entity_id, shard_id, expected, change } = state;
    let changed =
        match change {
            StateValue::Nothing => return Ok(true),
            StateValue::Insert(value) => connection
                .prepare_cached(&sql.insert_state)?
                .execute(params![entity_type, entity_id, shard_id, value])?,
            StateValue::Update(value) => connection
                .prepare_cached(&sql.update_state)?
                .execute(params![entity_type, entity_id, shard_id, value, expected])?,
            StateValue::Delete => connection
                .prepare_cached(&sql.delete_state)?
                .execute(params![entity_type, entity_id, expected])?,
        };
    Ok(changed > 0)
}

/// The state row of an entity (type, id), read leniently: a damaged row becomes a malformed
/// state when decoded, never a failed query.
fn load_state(
    connection: &Connection,
    sql: &MessageQueries,
    entity_type: &str,
    entity_id: &str,
) -> rusqlite::Result<Option<StoredStateRow>> {
    connection
        .prepare_cached(&sql.load_state)?
        .query_row([entity_type, entity_id], |row| {
            Ok(StoredStateRow {
                value: queries::text(row.get_ref(0)?).unwrap_or_default(),
                revision: queries::integer(row.get_ref(1)?, -1).unwrap_or(-1),
            })
        })
        .optional()
}

/// The reference's SQLite dedup, in one transaction: `INSERT OR IGNORE`, and only when the
/// insert was ignored, look the key up (the reference looks first; inserting first saves a
/// statement for every request that is not a duplicate, with the same outcome, since the key
/// is unique). A key that was stored in its legacy plaintext form is looked up first.
fn save_request(
    connection: &Connection,
    sql: &MessageQueries,
    values: &MessageValues,
    legacy_message_id: Option<&str>,
) -> rusqlite::Result<WriteOutcome> {
    let Some(message_id) = values.message_id.as_deref() else {
        insert_message(connection, &sql.insert_message, values)?;
        return Ok(WriteOutcome::Stored);
    };
    if let Some(legacy) = legacy_message_id
        && let Some(duplicate) = select_duplicate(connection, &sql.select_duplicate, &legacy)?
    {
        return Ok(duplicate);
    }
    if insert_message(connection, &sql.insert_message_ignore, values)? > 0 {
        return Ok(WriteOutcome::Stored);
    }
    if let Some(duplicate) = select_duplicate(connection, &sql.select_duplicate, &message_id)? {
        return Ok(duplicate);
    }
    // Ignored although the key is free: the request id is taken by another message (two
    // processes sharing a machine id made the same snowflake). It is not this request's
    // duplicate, whose reply would answer the wrong caller: a conflict, as on the other
    // backends, and the runtime saves the request again under a fresh id.
    Err(rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY),
        Some("the request's id is taken by another message".to_owned()),
    ))
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
        MessageOp::LoadState { entity_type, entity_id, reply } => {
            let result = load_state(connection, sql, &entity_type, &entity_id);
            respond(reply, "load_state", result);
        }
        MessageOp::PurgeProcessed { replied_before, keep_prefixes, limit, reply } => {
            let result = queries::immediate(connection, |c| {
                purge_processed(c, sql, replied_before, &keep_prefixes, limit)
            });
            respond(reply, "purge_processed", result);
        }
        MessageOp::ProcessedRequests {
            replied_before,
            entity_type_prefix,
            tag,
            after,
            limit,
            reply,
        } => {
            let parameters: [&dyn ToSql; 5] =
                [&replied_before, &entity_type_prefix, &tag, &after, &limit];
            let result =
                query_rows(connection, &sql.processed_requests, &parameters, read_processed_row);
            respond(reply, "processed_requests", result);
        }
        MessageOp::Backlog { filter, reply } => {
            respond(reply, "backlog", backlog(connection, sql, &filter));
        }
        MessageOp::Requests { filter, reply } => {
            respond(reply, "requests", requests(connection, sql, &filter));
        }
    }
}

/// The read model's backlog groups.
fn backlog(
    connection: &Connection,
    sql: &MessageQueries,
    filter: &BacklogFilter,
) -> rusqlite::Result<Vec<BacklogRow>> {
    // A `datetime` modifier: the claim age past which a claim is stale.
    let stale =
        format!("-{}.{:03} seconds", filter.stale_after_ms / 1_000, filter.stale_after_ms % 1_000);
    let parameters: [&dyn ToSql; 3] = [&filter.now_ms, &stale, &filter.limit];
    query_rows(connection, &sql.backlog, &parameters, read_backlog_row)
}

/// The read model's requests.
fn requests(
    connection: &Connection,
    sql: &MessageQueries,
    filter: &RequestFilter,
) -> rusqlite::Result<Vec<RequestRow>> {
    let (query, parameters) = queries::requests_sql(&sql.requests_head, filter);
    let mut statement = connection.prepare_cached(&query)?;
    let rows = statement.query_map(rusqlite::params_from_iter(parameters), read_request_row)?;
    rows.collect()
}

/// A backlog row, read leniently (a count that cannot be read is zero).
fn read_backlog_row(row: &Row<'_>) -> rusqlite::Result<BacklogRow> {
    let text = |idx: usize| row.get_ref(idx).map(queries::text);
    let number = |idx: usize| row.get_ref(idx).map(|value| queries::integer(value, 0));
    Ok(BacklogRow {
        entity_type: text(0)?.unwrap_or_default(),
        shard_id: text(1)?.unwrap_or_default(),
        due: number(2)?.unwrap_or(0),
        scheduled: number(3)?.unwrap_or(0),
        claimed: number(4)?.unwrap_or(0),
        stale_claims: number(5)?.unwrap_or(0),
        waiting_since: number(6)?,
    })
}

/// A `requests` row, read leniently: a damaged row becomes a malformed row when decoded, never
/// a failed query.
fn read_request_row(row: &Row<'_>) -> rusqlite::Result<RequestRow> {
    let text = |idx: usize| row.get_ref(idx).map(queries::text);
    let number = |idx: usize| row.get_ref(idx).map(|value| queries::integer(value, -1));
    let flag = |idx: usize| number(idx).map(|value| value.is_some_and(|value| value != 0));
    Ok(RequestRow {
        request_id: number(0)?.unwrap_or(-1),
        shard_id: text(1)?.unwrap_or_default(),
        entity_type: text(2)?.unwrap_or_default(),
        entity_id: text(3)?.unwrap_or_default(),
        tag: text(4)?,
        payload: text(5)?,
        processed: flag(6)?,
        claimed: flag(7)?,
        deliver_at: number(8)?,
        interrupted: flag(9)?,
        reply_id: number(10)?,
        reply_payload: text(11)?,
    })
}

/// Deletes the processed requests that `purge_choose` picks, with their replies and message
/// rows; returns how many requests it deleted. Run in a `BEGIN IMMEDIATE` transaction, so
/// nothing changes between the choice and the deletes.
fn purge_processed(
    connection: &Connection,
    sql: &MessageQueries,
    replied_before: i64,
    keep_prefixes: &str,
    limit: u32,
) -> rusqlite::Result<u64> {
    let parameters: [&dyn ToSql; 3] = [&replied_before, &keep_prefixes, &limit];
    let chosen =
        query_rows(connection, &sql.purge_choose, &parameters, |row| row.get::<_, i64>(0))?;
    if chosen.is_empty() {
        return Ok(0);
    }
    let ids = json_integers(chosen.iter().copied());
    execute(connection, &sql.purge_replies, &[&ids])?;
    execute(connection, &sql.purge_messages, &[&ids])?;
    Ok(u64::try_from(chosen.len()).unwrap_or(u64::MAX))
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
    sql: &MessageQueries,
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
    sql: &MessageQueries,
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
    sql: &MessageQueries,
    message_id: &str,
    legacy_message_id: Option<&str>,
) -> rusqlite::Result<Option<i64>> {
    for key in [Some(message_id), legacy_message_id].into_iter().flatten() {
        let id = connection
            .prepare_cached(&sql.request_id_for_message_id)?
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
    sql: &MessageQueries,
    claim: &Claim,
) -> rusqlite::Result<Vec<MessageRow>> {
    let query = sql.claim_select(claim.address_groups.len());
    let mut parameters: Vec<&dyn ToSql> = vec![&claim.shard_ids, &claim.now, &claim.limit];
    parameters.extend(address_parameters(&claim.address_groups));
    let rows = query_rows(connection, &query, &parameters, read_message_row)?;
    if !rows.is_empty() {
        let ids = json_integers(rows.iter().map(|row| row.id));
        execute(connection, &sql.claim_update, &[&ids])?;
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

/// A `processed_requests` row, read leniently: a damaged row becomes a malformed row when
/// decoded, never a failed query.
fn read_processed_row(row: &Row<'_>) -> rusqlite::Result<ProcessedRow> {
    let text = |idx: usize| row.get_ref(idx).map(queries::text);
    Ok(ProcessedRow {
        request_id: queries::integer(row.get_ref(0)?, -1).unwrap_or(-1),
        shard_id: text(1)?.unwrap_or_default(),
        entity_type: text(2)?.unwrap_or_default(),
        entity_id: text(3)?.unwrap_or_default(),
        tag: text(4)?,
        reply_id: queries::integer(row.get_ref(5)?, -1).unwrap_or(-1),
        reply_payload: text(6)?.unwrap_or_default(),
        payload: text(7)?,
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
        TransactionOp::SaveState { state: values, reply } => {
            let result = begin_if_idle(state)
                .and_then(|()| write_state(&state.connection, &state.statements.message, &values));
            note_abort(state);
            respond(reply, "transaction save_state", result);
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
