//! The mapping between domain values and table rows, shared by every backend so that all of
//! them store and read the same columns the same way (`effect/src/cluster/SqlMessageStorage.ts`).
//!
//! Message rows: `kind` 0 = request, 1 = chunk acknowledgement, 2 = interrupt. Reply rows:
//! `kind` 0 = final reply, `NULL` = chunk. Payloads, headers, exits and chunk values are stored
//! as the JSON text the caller encoded, never re-encoded. A row that cannot be decoded becomes
//! a [`MalformedMessage`] (messages) or a defect reply (replies), never a panic.
//!
//! Every value written from a caller (a request's payload and headers, a reply's payload, a
//! queue element) is checked against the storage's [`ValueLimit`] before any SQL is sent, so a
//! refused value never aborts a transaction or a batch.

use std::borrow::Cow;
use std::collections::BTreeMap;

use cluster_core::encoded::{self, JsonForm};
use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{
    self, AckChunk, Chunk, Envelope, Exit, Interrupt, RawJson, Reply, Request, TraceContext,
    WithExit,
};
use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::retention::ProcessedRequest;
use cluster_core::storage::{
    MalformedMessage, SaveRequestOptions, UnprocessedBatch, UnprocessedMessage,
};
use cluster_core::{EntityAddress, EntityId, EntityType, ShardId, Snowflake};

use crate::options::ValueBytesMax;

/// `kind` of a request row.
pub(crate) const MESSAGE_KIND_REQUEST: i32 = 0;
/// `kind` of a chunk acknowledgement row.
pub(crate) const MESSAGE_KIND_ACK_CHUNK: i32 = 1;
/// `kind` of an interrupt row.
pub(crate) const MESSAGE_KIND_INTERRUPT: i32 = 2;
/// `kind` of a final reply row (chunks have `NULL`).
pub(crate) const REPLY_KIND_WITH_EXIT: i32 = 0;

/// A snowflake as a `BIGINT`.
pub(crate) fn id_to_sql(id: Snowflake) -> Result<i64, StorageError> {
    id.to_i64().ok_or_else(|| {
        StorageError::new(StorageErrorKind::InvalidInput, format!("id {id} does not fit a BIGINT"))
    })
}

/// A `BIGINT` as a snowflake.
pub(crate) fn id_from_sql(id: i64) -> Result<Snowflake, DecodeError> {
    Snowflake::from_i64(id).ok_or_else(|| DecodeError::new("row", format!("negative id {id}")))
}

/// `BIGINT` ids read back as snowflakes; a negative one is a malformed row.
pub(crate) fn ids_from_sql(ids: Vec<i64>) -> Result<Vec<Snowflake>, StorageError> {
    ids.into_iter()
        .map(|id| {
            id_from_sql(id).map_err(|error| {
                StorageError::with_source(
                    StorageErrorKind::Malformed,
                    "unreadable message id",
                    error,
                )
            })
        })
        .collect()
}

/// The most bytes a value may have on one storage: the option
/// [`value_bytes_max`](crate::SqlStorageOptions::value_bytes_max), or less when the column holds
/// less (MySQL's `TEXT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ValueLimit {
    bytes_max: ValueBytesMax,
    /// The column, when it holds fewer bytes than the option (then raising the option does not
    /// help, and the message says so).
    column: Option<&'static str>,
}

impl ValueLimit {
    /// The limit of a backend whose columns hold any value up to [`ValueBytesMax::LIMIT`].
    pub(crate) fn new(option: ValueBytesMax) -> ValueLimit {
        ValueLimit { bytes_max: option, column: None }
    }

    /// The limit of a backend whose columns hold `column_bytes_max`, described as `column`
    /// (for example "MySQL's TEXT column"), when the option is `option`: the smaller of the two.
    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    pub(crate) fn capped(
        option: ValueBytesMax,
        column: &'static str,
        column_bytes_max: ValueBytesMax,
    ) -> ValueLimit {
        if column_bytes_max < option {
            ValueLimit { bytes_max: column_bytes_max, column: Some(column) }
        } else {
            ValueLimit::new(option)
        }
    }

    /// The limit in force.
    pub(crate) fn effective(self) -> ValueBytesMax {
        self.bytes_max
    }

    /// `value`, named `what` in the error (for example "the reply's payload"), fits the limit.
    pub(crate) fn check(self, what: &str, value: &str) -> Result<(), StorageError> {
        let (len, bytes_max) = (value.len(), self.bytes_max.get());
        if len <= bytes_max {
            return Ok(());
        }
        let message = match self.column {
            None => format!(
                "{what} has {len} bytes, over the limit of {bytes_max} bytes: raise \
                 SqlStorageOptions::value_bytes_max, or keep large values elsewhere and store \
                 a reference to them"
            ),
            Some(column) => format!(
                "{what} has {len} bytes, over the {bytes_max} bytes of {column}: keep large \
                 values elsewhere and store a reference to them"
            ),
        };
        Err(StorageError::new(StorageErrorKind::InvalidInput, message))
    }
}

/// The column values of a message row to insert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MessageInsert<'a> {
    pub(crate) id: i64,
    /// The primary key, or its digest when longer than the column.
    pub(crate) message_id: Option<Cow<'a, str>>,
    pub(crate) shard_id: String,
    pub(crate) entity_type: &'a str,
    pub(crate) entity_id: &'a str,
    pub(crate) kind: i32,
    pub(crate) tag: Option<&'a str>,
    pub(crate) payload: Option<&'a str>,
    pub(crate) headers: Option<&'a str>,
    pub(crate) trace_id: Option<&'a str>,
    pub(crate) span_id: Option<&'a str>,
    pub(crate) sampled: Option<bool>,
    pub(crate) request_id: i64,
    pub(crate) reply_id: Option<i64>,
    pub(crate) deliver_at: Option<i64>,
}

impl<'a> MessageInsert<'a> {
    /// The row of a request.
    pub(crate) fn request(
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> Result<MessageInsert<'a>, StorageError> {
        let id = id_to_sql(request.request_id)?;
        Ok(MessageInsert {
            id,
            message_id: options.primary_key.as_deref().map(envelope::message_id),
            tag: Some(&request.tag),
            payload: request.payload.json(),
            headers: request.headers.json(),
            trace_id: request.trace.trace_id.as_deref(),
            span_id: request.trace.span_id.as_deref(),
            sampled: request.trace.sampled,
            request_id: id,
            deliver_at: options.deliver_at.map(|at| at.unix_millis()),
            ..MessageInsert::bare(&request.address, MESSAGE_KIND_REQUEST, id)
        })
    }

    /// The row of a chunk acknowledgement.
    pub(crate) fn ack_chunk(ack: &'a AckChunk) -> Result<MessageInsert<'a>, StorageError> {
        Ok(MessageInsert {
            request_id: id_to_sql(ack.request_id)?,
            reply_id: Some(id_to_sql(ack.reply_id)?),
            ..MessageInsert::bare(&ack.address, MESSAGE_KIND_ACK_CHUNK, id_to_sql(ack.id)?)
        })
    }

    /// The row of an interrupt.
    pub(crate) fn interrupt(interrupt: &'a Interrupt) -> Result<MessageInsert<'a>, StorageError> {
        Ok(MessageInsert {
            request_id: id_to_sql(interrupt.request_id)?,
            ..MessageInsert::bare(
                &interrupt.address,
                MESSAGE_KIND_INTERRUPT,
                id_to_sql(interrupt.id)?,
            )
        })
    }

    /// The row of a request, if its payload and headers fit `limit`.
    pub(crate) fn checked_request(
        request: &'a Request,
        options: &'a SaveRequestOptions,
        limit: ValueLimit,
    ) -> Result<MessageInsert<'a>, StorageError> {
        let insert = MessageInsert::request(request, options)?;
        insert.check_values(limit)?;
        Ok(insert)
    }

    /// The caller's values of the row (payload and headers) fit `limit`.
    fn check_values(&self, limit: ValueLimit) -> Result<(), StorageError> {
        if let Some(payload) = self.payload {
            limit.check("the request's payload", payload)?;
        }
        if let Some(headers) = self.headers {
            limit.check("the request's headers", headers)?;
        }
        Ok(())
    }

    fn bare(address: &'a EntityAddress, kind: i32, id: i64) -> MessageInsert<'a> {
        MessageInsert {
            id,
            message_id: None,
            shard_id: address.shard_id.to_string(),
            entity_type: address.entity_type.as_str(),
            entity_id: address.entity_id.as_str(),
            kind,
            tag: None,
            payload: None,
            headers: None,
            trace_id: None,
            span_id: None,
            sampled: None,
            request_id: id,
            reply_id: None,
            deliver_at: None,
        }
    }
}

/// The column values of a reply row to insert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReplyInsert {
    pub(crate) id: i64,
    /// `Some(0)` for a final reply, `None` for a chunk.
    pub(crate) kind: Option<i32>,
    pub(crate) request_id: i64,
    /// The exit (final reply) or the values array (chunk), as JSON.
    pub(crate) payload: String,
    /// The chunk's sequence number.
    pub(crate) sequence: Option<i32>,
}

impl ReplyInsert {
    /// The row of `reply`.
    pub(crate) fn new(reply: &Reply) -> Result<ReplyInsert, StorageError> {
        let id = id_to_sql(reply.id())?;
        let request_id = id_to_sql(reply.request_id())?;
        Ok(match reply {
            Reply::WithExit(with_exit) => ReplyInsert {
                id,
                kind: Some(REPLY_KIND_WITH_EXIT),
                request_id,
                payload: with_exit.exit.to_json(),
                sequence: None,
            },
            Reply::Chunk(chunk) => ReplyInsert {
                id,
                kind: None,
                request_id,
                payload: encoded::values_to_json(chunk.values()),
                sequence: Some(i32::try_from(chunk.sequence()).map_err(|_| {
                    StorageError::new(StorageErrorKind::InvalidInput, "chunk sequence over i32")
                })?),
            },
        })
    }

    /// The row of `reply`, if its payload fits `limit`.
    pub(crate) fn checked(reply: &Reply, limit: ValueLimit) -> Result<ReplyInsert, StorageError> {
        let insert = ReplyInsert::new(reply)?;
        let what = if insert.kind.is_some() { "the reply's payload" } else { "the chunk's values" };
        limit.check(what, &insert.payload)?;
        Ok(insert)
    }
}

/// A conditional write of an entity's state, as the backends run it
/// ([`cluster_core::entity_state`]): one statement on the row keyed by the entity's type and id,
/// applied only at the revision its writer loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StateRow<'a> {
    /// The write, for the error of a stale one ([`StateWrite::stale`]).
    pub(crate) write: &'a StateWrite,
    pub(crate) entity_type: &'a str,
    pub(crate) entity_id: &'a str,
    /// The entity's shard, kept in the row for operators.
    pub(crate) shard_id: String,
    /// The revision the writer loaded (0: no row).
    pub(crate) expected: i64,
    pub(crate) change: StateChange<'a>,
}

/// What a [`StateRow`] does to its row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StateChange<'a> {
    /// No row was loaded: insert one at revision 1, unless one exists (then the write is
    /// stale).
    Insert(&'a str),
    /// Set the value of the row at revision `expected`, which becomes `expected + 1`.
    Update(&'a str),
    /// Delete the row at revision `expected`.
    Delete,
    /// No row was loaded and none is wanted: nothing to write.
    Nothing,
}

impl<'a> StateRow<'a> {
    /// The row of `write`, if its value fits `limit` and its revision a `BIGINT`. The value is
    /// the JSON text (the undefined value is stored as `null`), checked before any statement so
    /// that a refused value never aborts a transaction.
    pub(crate) fn checked(
        write: &'a StateWrite,
        limit: ValueLimit,
    ) -> Result<StateRow<'a>, StorageError> {
        let expected = i64::try_from(write.expected)
            .ok()
            .filter(|expected| *expected < i64::MAX)
            .ok_or_else(|| {
            StorageError::new(
                StorageErrorKind::InvalidInput,
                format!(
                    "the state of {} cannot be written at revision {}: revisions are \
                         BIGINTs",
                    write.address, write.expected
                ),
            )
        })?;
        let change = match (&write.value, expected) {
            (Some(value), expected) => {
                let json = value.json_or_null();
                limit.check(&format!("the state of {}", write.address), json)?;
                if expected == 0 { StateChange::Insert(json) } else { StateChange::Update(json) }
            }
            (None, 0) => StateChange::Nothing,
            (None, _) => StateChange::Delete,
        };
        Ok(StateRow {
            write,
            entity_type: write.address.entity_type.as_str(),
            entity_id: write.address.entity_id.as_str(),
            shard_id: write.address.shard_id.to_string(),
            expected,
            change,
        })
    }
}

/// An entity's state row as read (`value, revision`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredStateRow {
    pub(crate) value: String,
    pub(crate) revision: i64,
}

impl StoredStateRow {
    /// The stored state of `address`; a value that is not JSON or a revision below 1 is a
    /// malformed row that names the entity (never a panic).
    pub(crate) fn decode(self, address: &EntityAddress) -> Result<StoredState, StorageError> {
        let revision = u64::try_from(self.revision).ok().filter(|revision| *revision > 0);
        let Some(revision) = revision else {
            return Err(StorageError::new(
                StorageErrorKind::Malformed,
                format!("the stored state of {address} has revision {}", self.revision),
            ));
        };
        let value = RawJson::from_json(self.value).map_err(|error| {
            StorageError::with_source(
                StorageErrorKind::Malformed,
                format!("the stored state of {address} is not JSON"),
                error,
            )
        })?;
        Ok(StoredState { value, revision })
    }
}

/// A reply row as read (`id, kind, request_id, payload, sequence`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReplyRow {
    pub(crate) id: i64,
    pub(crate) kind: Option<i32>,
    pub(crate) request_id: i64,
    pub(crate) payload: String,
    pub(crate) sequence: Option<i32>,
}

impl ReplyRow {
    /// The reply; a row that cannot be decoded becomes a defect reply for its request (reference
    /// `effect/src/cluster/MessageStorage.ts`), so its caller is answered instead of left waiting.
    pub(crate) fn decode(self) -> Result<Reply, StorageError> {
        let request_id = id_from_sql(self.request_id).map_err(malformed_row)?;
        let id = id_from_sql(self.id).map_err(malformed_row)?;
        Ok(match self.decode_parts(request_id, id) {
            Ok(reply) => reply,
            Err(error) => Reply::malformed(request_id, id, &error),
        })
    }

    fn decode_parts(&self, request_id: Snowflake, id: Snowflake) -> Result<Reply, DecodeError> {
        match self.kind {
            Some(REPLY_KIND_WITH_EXIT) => {
                let exit = Exit::from_json(&self.payload)?;
                Ok(Reply::WithExit(WithExit { request_id, id, exit }))
            }
            None => Ok(Reply::Chunk(decode_chunk(request_id, id, &self.payload, self.sequence)?)),
            Some(other) => Err(DecodeError::new("reply", format!("unknown reply kind {other}"))),
        }
    }
}

fn decode_chunk(
    request_id: Snowflake,
    id: Snowflake,
    payload: &str,
    sequence: Option<i32>,
) -> Result<Chunk, DecodeError> {
    let values = encoded::values_from_json(payload)?;
    let sequence = sequence
        .and_then(|sequence| u32::try_from(sequence).ok())
        .ok_or_else(|| DecodeError::new("chunk", "missing or negative sequence"))?;
    Chunk::new(request_id, id, sequence, values)
        .ok_or_else(|| DecodeError::new("chunk", "a chunk needs at least one value"))
}

/// A row whose ids cannot even be read: the database holds something no runner wrote.
fn malformed_row(error: DecodeError) -> StorageError {
    StorageError::with_source(StorageErrorKind::Malformed, "unreadable reply row", error)
}

/// A processed request as `processed_requests` reads it: the request row's address and tag,
/// and its final reply's id and payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ProcessedRow {
    pub(crate) request_id: i64,
    pub(crate) shard_id: String,
    pub(crate) entity_type: String,
    pub(crate) entity_id: String,
    pub(crate) tag: Option<String>,
    pub(crate) reply_id: i64,
    pub(crate) reply_payload: String,
    /// The request's payload.
    pub(crate) payload: Option<String>,
}

impl ProcessedRow {
    /// The processed request. An address or tag that cannot be read is a malformed row that
    /// names the request (never a panic); a final reply that cannot be decoded becomes a defect
    /// reply, as [`ReplyRow::decode`] makes it.
    pub(crate) fn decode(self) -> Result<ProcessedRequest, StorageError> {
        let row = self.request_id;
        let malformed = |error: DecodeError| {
            StorageError::with_source(
                StorageErrorKind::Malformed,
                format!("the processed request row {row} cannot be read"),
                error,
            )
        };
        let request_id = id_from_sql(self.request_id).map_err(malformed)?;
        let shard_id =
            self.shard_id.parse::<ShardId>().map_err(|e| malformed(DecodeError::from(e)))?;
        let tag = self.tag.ok_or_else(|| malformed(DecodeError::new("request row", "no tag")))?;
        let reply = ReplyRow {
            id: self.reply_id,
            kind: Some(REPLY_KIND_WITH_EXIT),
            request_id: self.request_id,
            payload: self.reply_payload,
            sequence: None,
        }
        .decode()
        .map_err(|error| {
            StorageError::with_source(
                StorageErrorKind::Malformed,
                format!("the final reply of the processed request row {row} cannot be read"),
                error,
            )
        })?;
        let Reply::WithExit(reply) = reply else {
            return Err(malformed(DecodeError::new("reply row", "a chunk, not a final reply")));
        };
        Ok(ProcessedRequest {
            request_id,
            address: EntityAddress {
                shard_id,
                entity_type: EntityType::from(self.entity_type),
                entity_id: EntityId::from(self.entity_id),
            },
            tag,
            payload: self.payload.and_then(|payload| RawJson::from_json(payload).ok()),
            reply,
        })
    }
}

/// The reply a message row's `last_reply_id` points at (always a chunk for a message that is
/// still unprocessed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LastReplyRow {
    pub(crate) id: i64,
    pub(crate) payload: String,
    pub(crate) sequence: Option<i32>,
}

/// A message row as read, joined with its last reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MessageRow {
    pub(crate) id: i64,
    pub(crate) shard_id: String,
    pub(crate) entity_type: String,
    pub(crate) entity_id: String,
    pub(crate) kind: i32,
    pub(crate) tag: Option<String>,
    pub(crate) payload: Option<String>,
    pub(crate) headers: Option<String>,
    pub(crate) trace_id: Option<String>,
    pub(crate) span_id: Option<String>,
    pub(crate) sampled: Option<bool>,
    pub(crate) request_id: i64,
    pub(crate) reply_id: Option<i64>,
    pub(crate) last_reply: Option<LastReplyRow>,
}

impl MessageRow {
    /// The stored message, or why it cannot be decoded.
    pub(crate) fn decode(self) -> Result<UnprocessedMessage, MalformedMessage> {
        let id = Snowflake::from_i64(self.id).unwrap_or(Snowflake::new(0));
        let request_id = Snowflake::from_i64(self.request_id).unwrap_or(Snowflake::new(0));
        self.decode_inner().map_err(|error| MalformedMessage { id, request_id, error })
    }

    fn decode_inner(self) -> Result<UnprocessedMessage, DecodeError> {
        let id = id_from_sql(self.id)?;
        let request_id = id_from_sql(self.request_id)?;
        let address = EntityAddress {
            shard_id: self.shard_id.parse::<ShardId>()?,
            entity_type: EntityType::from(self.entity_type),
            entity_id: EntityId::from(self.entity_id),
        };
        match self.kind {
            MESSAGE_KIND_REQUEST => {
                let tag = self.tag.ok_or_else(|| DecodeError::new("request row", "no tag"))?;
                let trace = match self.trace_id {
                    // The reference restores the trace only when it has a trace id.
                    Some(trace_id) if !trace_id.is_empty() => TraceContext {
                        trace_id: Some(trace_id),
                        span_id: self.span_id,
                        sampled: Some(self.sampled.unwrap_or(false)),
                    },
                    _ => TraceContext::default(),
                };
                let last_sent_reply = match self.last_reply {
                    Some(last) => {
                        let reply_id = id_from_sql(last.id)?;
                        Some(Reply::Chunk(decode_chunk(
                            request_id,
                            reply_id,
                            &last.payload,
                            last.sequence,
                        )?))
                    }
                    None => None,
                };
                let request = Request {
                    request_id: id,
                    address,
                    tag: tag.into(),
                    payload: raw_column(self.payload)?,
                    headers: match self.headers {
                        Some(headers) => RawJson::from_json(headers)?,
                        None => RawJson::empty_object(),
                    },
                    trace,
                };
                Ok(UnprocessedMessage { envelope: Envelope::Request(request), last_sent_reply })
            }
            MESSAGE_KIND_ACK_CHUNK => {
                let reply_id = self
                    .reply_id
                    .ok_or_else(|| DecodeError::new("ack row", "no reply id"))
                    .and_then(id_from_sql)?;
                let ack = AckChunk { id, address, request_id, reply_id };
                Ok(UnprocessedMessage { envelope: Envelope::AckChunk(ack), last_sent_reply: None })
            }
            MESSAGE_KIND_INTERRUPT => {
                let interrupt = Interrupt { id, address, request_id };
                Ok(UnprocessedMessage {
                    envelope: Envelope::Interrupt(interrupt),
                    last_sent_reply: None,
                })
            }
            other => Err(DecodeError::new("message row", format!("unknown message kind {other}"))),
        }
    }
}

/// A nullable JSON column: `NULL` is the undefined value (the reference stores an undefined
/// payload as `NULL`).
fn raw_column(column: Option<String>) -> Result<RawJson, DecodeError> {
    column.map_or_else(|| Ok(RawJson::undefined()), RawJson::from_json)
}

/// Splits decoded rows into messages and malformed rows, keeping storage order.
pub(crate) fn into_batch(rows: impl IntoIterator<Item = MessageRow>) -> UnprocessedBatch {
    let mut batch = UnprocessedBatch::default();
    for row in rows {
        match row.decode() {
            Ok(message) => batch.messages.push(message),
            Err(malformed) => batch.malformed.push(malformed),
        }
    }
    batch
}

/// The address filter of `unprocessed_messages`, grouped as the reference groups it: one
/// `(shard_id, entity_type, [entity_id, ...])` clause per shard and type.
pub(crate) fn group_addresses(addresses: &[EntityAddress]) -> Vec<(String, &str, Vec<&str>)> {
    let mut groups: BTreeMap<(String, &str), Vec<&str>> = BTreeMap::new();
    for address in addresses {
        let key = (address.shard_id.to_string(), address.entity_type.as_str());
        groups.entry(key).or_default().push(address.entity_id.as_str());
    }
    groups.into_iter().map(|((shard_id, entity_type), ids)| (shard_id, entity_type, ids)).collect()
}

pub(crate) mod inspect;

#[cfg(test)]
mod tests;
