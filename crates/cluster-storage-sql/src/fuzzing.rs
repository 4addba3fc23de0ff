//! Entry points for the coverage-guided fuzz targets in `fuzz/` (feature `fuzzing`): the
//! decoding of stored rows, as every backend reads them, fed with arbitrary column values.
//!
//! Each function must return for every input without panicking; none is part of the API.

use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup, ShardId};

use crate::row::{LastReplyRow, MessageRow, ProcessedRow, ReplyRow, StoredStateRow};

/// The columns of a message row joined with its last reply, as read.
#[derive(Clone, Debug, Default, arbitrary::Arbitrary)]
pub struct MessageColumns {
    /// `id`.
    pub id: i64,
    /// `shard_id`.
    pub shard_id: String,
    /// `entity_type`.
    pub entity_type: String,
    /// `entity_id`.
    pub entity_id: String,
    /// `kind`.
    pub kind: i32,
    /// `tag`.
    pub tag: Option<String>,
    /// `payload`.
    pub payload: Option<String>,
    /// `headers`.
    pub headers: Option<String>,
    /// `trace_id`.
    pub trace_id: Option<String>,
    /// `span_id`.
    pub span_id: Option<String>,
    /// `sampled`.
    pub sampled: Option<bool>,
    /// `request_id`.
    pub request_id: i64,
    /// `reply_id`.
    pub reply_id: Option<i64>,
    /// The last reply's `id`, `payload` and `sequence`.
    pub last_reply: Option<(i64, String, Option<i32>)>,
}

/// The columns of a reply row, as read.
#[derive(Clone, Debug, Default, arbitrary::Arbitrary)]
pub struct ReplyColumns {
    /// `id`.
    pub id: i64,
    /// `kind`.
    pub kind: Option<i32>,
    /// `request_id`.
    pub request_id: i64,
    /// `payload`.
    pub payload: String,
    /// `sequence`.
    pub sequence: Option<i32>,
}

/// Decodes a message row: an unprocessed message, or why it is malformed.
pub fn decode_message(columns: MessageColumns) {
    let row = MessageRow {
        id: columns.id,
        shard_id: columns.shard_id,
        entity_type: columns.entity_type,
        entity_id: columns.entity_id,
        kind: columns.kind,
        tag: columns.tag,
        payload: columns.payload,
        headers: columns.headers,
        trace_id: columns.trace_id,
        span_id: columns.span_id,
        sampled: columns.sampled,
        request_id: columns.request_id,
        reply_id: columns.reply_id,
        last_reply: columns.last_reply.map(|(id, payload, sequence)| LastReplyRow {
            id,
            payload,
            sequence,
        }),
    };
    let _ = row.decode();
}

/// Decodes a reply row, and the same columns as a processed request's final reply and as an
/// entity's stored state.
pub fn decode_reply(columns: ReplyColumns) {
    let processed = ProcessedRow {
        request_id: columns.request_id,
        shard_id: columns.payload.chars().take(12).collect(),
        entity_type: "Fuzzed".to_owned(),
        entity_id: columns.id.to_string(),
        tag: columns.kind.map(|kind| kind.to_string()),
        reply_id: columns.id,
        reply_payload: columns.payload.clone(),
        payload: Some(columns.payload.clone()),
    };
    let _ = processed.decode();
    let address = EntityAddress {
        shard_id: ShardId::new(ShardGroup::default_group(), 1),
        entity_type: EntityType::from("Fuzzed"),
        entity_id: EntityId::from("fuzzed"),
    };
    let state = StoredStateRow { value: columns.payload.clone(), revision: columns.request_id };
    let _ = state.decode(&address);
    let row = ReplyRow {
        id: columns.id,
        kind: columns.kind,
        request_id: columns.request_id,
        payload: columns.payload,
        sequence: columns.sequence,
    };
    let _ = row.decode();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_entry_points_return_on_odd_rows() {
        decode_message(MessageColumns::default());
        decode_message(MessageColumns {
            id: -1,
            shard_id: "default:0".to_owned(),
            kind: 7,
            payload: Some("{".to_owned()),
            last_reply: Some((1, "[".to_owned(), Some(-3))),
            ..MessageColumns::default()
        });
        decode_reply(ReplyColumns::default());
        decode_reply(ReplyColumns {
            id: i64::MIN,
            kind: Some(99),
            request_id: -5,
            payload: "\"\\ud800\"".to_owned(),
            sequence: Some(i32::MAX),
        });
    }
}
