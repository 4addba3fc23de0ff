//! The decoding of stored message and reply rows from arbitrary column values (a row a
//! TypeScript runner, an operator or a bug wrote).
#![no_main]

use cluster_storage_sql::fuzzing::{MessageColumns, ReplyColumns, decode_message, decode_reply};
use libfuzzer_sys::arbitrary::{self, Arbitrary};

#[derive(Arbitrary, Debug)]
struct Message {
    id: i64,
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
    last_reply: Option<(i64, String, Option<i32>)>,
}

#[derive(Arbitrary, Debug)]
struct ReplyRow {
    id: i64,
    kind: Option<i32>,
    request_id: i64,
    payload: String,
    sequence: Option<i32>,
}

#[derive(Arbitrary, Debug)]
enum Row {
    Message(Message),
    Reply(ReplyRow),
}

libfuzzer_sys::fuzz_target!(|row: Row| match row {
    Row::Message(m) => decode_message(MessageColumns {
        id: m.id,
        shard_id: m.shard_id,
        entity_type: m.entity_type,
        entity_id: m.entity_id,
        kind: m.kind,
        tag: m.tag,
        payload: m.payload,
        headers: m.headers,
        trace_id: m.trace_id,
        span_id: m.span_id,
        sampled: m.sampled,
        request_id: m.request_id,
        reply_id: m.reply_id,
        last_reply: m.last_reply,
    }),
    Row::Reply(r) => decode_reply(ReplyColumns {
        id: r.id,
        kind: r.kind,
        request_id: r.request_id,
        payload: r.payload,
        sequence: r.sequence,
    }),
});
