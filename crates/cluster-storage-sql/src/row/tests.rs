//! Tests of the row mapping: what every backend writes and how malformed rows are read.

use cluster_core::envelope::CauseReason;
use cluster_core::{ShardGroup, Timestamp};

use super::*;

fn address() -> EntityAddress {
    EntityAddress {
        shard_id: ShardId::new(ShardGroup::from("default"), 7),
        entity_type: EntityType::from("Counter"),
        entity_id: EntityId::from("c-1"),
    }
}

fn request() -> Request {
    Request {
        request_id: Snowflake::new(123),
        address: address(),
        tag: "Increment".into(),
        payload: RawJson::from_json(r#"{"by":1}"#.to_owned()).unwrap(),
        headers: RawJson::empty_object(),
        trace: TraceContext {
            trace_id: Some("t".to_owned()),
            span_id: Some("s".to_owned()),
            sampled: Some(true),
        },
    }
}

fn message_row(kind: i32) -> MessageRow {
    MessageRow {
        id: 123,
        shard_id: "default:7".to_owned(),
        entity_type: "Counter".to_owned(),
        entity_id: "c-1".to_owned(),
        kind,
        tag: Some("Increment".to_owned()),
        payload: Some(r#"{"by":1}"#.to_owned()),
        headers: Some("{}".to_owned()),
        trace_id: Some("t".to_owned()),
        span_id: Some("s".to_owned()),
        sampled: Some(true),
        request_id: 123,
        reply_id: None,
        last_reply: None,
    }
}

#[test]
fn request_rows_round_trip() {
    let options = SaveRequestOptions {
        primary_key: Some("Counter/c-1/Increment/k1".to_owned()),
        deliver_at: Some(Timestamp::from_unix_millis(5)),
    };
    let request = request();
    let insert = MessageInsert::request(&request, &options).unwrap();
    assert_eq!(insert.shard_id, "default:7");
    assert_eq!(insert.message_id.as_deref(), Some("Counter/c-1/Increment/k1"));
    assert_eq!((insert.kind, insert.id, insert.request_id), (MESSAGE_KIND_REQUEST, 123, 123));
    assert_eq!(insert.deliver_at, Some(5));
    let message = message_row(MESSAGE_KIND_REQUEST).decode().unwrap();
    assert_eq!(message.envelope, Envelope::Request(request));
    assert_eq!(message.last_sent_reply, None);
}

#[test]
fn long_primary_keys_are_stored_as_digests() {
    let options = SaveRequestOptions { primary_key: Some("k".repeat(300)), deliver_at: None };
    let request = request();
    let insert = MessageInsert::request(&request, &options).unwrap();
    assert_eq!(insert.message_id.unwrap().len(), 64);
}

#[test]
fn ack_and_interrupt_rows() {
    let ack = AckChunk {
        id: Snowflake::new(5),
        address: address(),
        request_id: Snowflake::new(123),
        reply_id: Snowflake::new(9),
    };
    let insert = MessageInsert::ack_chunk(&ack).unwrap();
    assert_eq!((insert.id, insert.request_id, insert.reply_id), (5, 123, Some(9)));
    assert_eq!((insert.tag, insert.payload), (None, None));
    let row = MessageRow { id: 5, reply_id: Some(9), tag: None, payload: None, ..message_row(1) };
    assert_eq!(row.decode().unwrap().envelope, Envelope::AckChunk(ack));

    let interrupt =
        Interrupt { id: Snowflake::new(6), address: address(), request_id: Snowflake::new(123) };
    assert_eq!(MessageInsert::interrupt(&interrupt).unwrap().kind, MESSAGE_KIND_INTERRUPT);
    let row = MessageRow { id: 6, ..message_row(2) };
    assert_eq!(row.decode().unwrap().envelope, Envelope::Interrupt(interrupt));
}

#[test]
fn a_resumed_stream_carries_its_last_chunk() {
    let row = MessageRow {
        last_reply: Some(LastReplyRow { id: 44, payload: "[3]".to_owned(), sequence: Some(2) }),
        ..message_row(MESSAGE_KIND_REQUEST)
    };
    let Some(Reply::Chunk(chunk)) = row.decode().unwrap().last_sent_reply else {
        panic!("a chunk")
    };
    assert_eq!(
        (chunk.request_id(), chunk.id(), chunk.sequence()),
        (Snowflake::new(123), Snowflake::new(44), 2)
    );
}

#[test]
fn null_payload_is_undefined_and_trace_needs_a_trace_id() {
    let row = MessageRow { payload: None, trace_id: None, ..message_row(MESSAGE_KIND_REQUEST) };
    let Envelope::Request(request) = row.decode().unwrap().envelope else { panic!("a request") };
    assert!(request.payload.is_undefined());
    assert_eq!(request.trace, TraceContext::default());
}

#[test]
fn malformed_message_rows_are_reported_not_panicked() {
    let cases = [
        MessageRow { shard_id: "no-colon".to_owned(), ..message_row(0) },
        MessageRow { payload: Some("{".to_owned()), ..message_row(0) },
        MessageRow { headers: Some("not json".to_owned()), ..message_row(0) },
        MessageRow { tag: None, ..message_row(0) },
        MessageRow { kind: 7, ..message_row(0) },
        MessageRow { reply_id: None, ..message_row(1) },
        MessageRow { id: -1, ..message_row(0) },
        MessageRow {
            last_reply: Some(LastReplyRow { id: 1, payload: "[]".to_owned(), sequence: Some(0) }),
            ..message_row(0)
        },
    ];
    for row in cases {
        let described = format!("{row:?}");
        let malformed = row.decode().unwrap_err();
        assert_eq!(malformed.request_id, Snowflake::new(123), "{described}");
    }
    let batch = into_batch([message_row(0), MessageRow { kind: 9, ..message_row(0) }]);
    assert_eq!((batch.messages.len(), batch.malformed.len()), (1, 1));
}

#[test]
fn reply_rows_round_trip_and_malformed_ones_become_defects() {
    let final_reply = Reply::WithExit(WithExit {
        request_id: Snowflake::new(1),
        id: Snowflake::new(2),
        exit: Exit::void(),
    });
    let insert = ReplyInsert::new(&final_reply).unwrap();
    assert_eq!(insert.payload, r#"{"_tag":"Success","value":null}"#);
    assert_eq!((insert.kind, insert.sequence), (Some(REPLY_KIND_WITH_EXIT), None));
    let row = ReplyRow {
        id: 2,
        kind: insert.kind,
        request_id: 1,
        payload: insert.payload,
        sequence: None,
    };
    assert_eq!(row.decode().unwrap(), final_reply);

    let chunk = Reply::Chunk(Chunk::empty_from(Snowflake::new(1)));
    let insert = ReplyInsert::new(&chunk).unwrap();
    assert_eq!((insert.kind, insert.payload.as_str(), insert.sequence), (None, "[null]", Some(0)));

    let broken =
        ReplyRow { id: 2, kind: Some(0), request_id: 1, payload: "{".to_owned(), sequence: None };
    let Reply::WithExit(WithExit { exit: Exit::Failure(cause), request_id, .. }) =
        broken.decode().unwrap()
    else {
        panic!("a defect")
    };
    assert_eq!(request_id, Snowflake::new(1));
    assert!(matches!(&cause.0[0], CauseReason::Die(_)));
    let negative =
        ReplyRow { id: -2, kind: Some(0), request_id: 1, payload: "{}".to_owned(), sequence: None };
    assert_eq!(negative.decode().unwrap_err().kind(), StorageErrorKind::Malformed);
}

#[test]
fn ids_past_bigint_are_refused() {
    assert_eq!(
        id_to_sql(Snowflake::new(u64::MAX)).unwrap_err().kind(),
        StorageErrorKind::InvalidInput
    );
    assert_eq!(id_to_sql(Snowflake::new(7)).unwrap(), 7);
}

#[test]
fn addresses_group_by_shard_and_type() {
    let mut other = address();
    other.entity_id = EntityId::from("c-2");
    let mut elsewhere = address();
    elsewhere.entity_type = EntityType::from("Other");
    let addresses = [address(), other, elsewhere];
    let groups = group_addresses(&addresses);
    assert_eq!(
        groups,
        [
            ("default:7".to_owned(), "Counter", vec!["c-1", "c-2"]),
            ("default:7".to_owned(), "Other", vec!["c-1"])
        ]
    );
}

fn limit(bytes: usize) -> ValueBytesMax {
    ValueBytesMax::unchecked(bytes)
}

#[test]
fn a_value_limit_counts_bytes_and_names_the_fix() {
    let value_limit = ValueLimit::new(limit(4));
    assert_eq!(value_limit.effective(), limit(4));
    assert!(value_limit.check("the payload", "abcd").is_ok());
    // Bytes, not characters: "é" is two.
    let error = value_limit.check("the payload", "abcé").unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput);
    let message = error.to_string();
    for expected in ["the payload", "5 bytes", "limit of 4 bytes", "value_bytes_max", "reference"] {
        assert!(message.contains(expected), "{expected:?} is not in {message:?}");
    }
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
#[test]
fn a_smaller_column_caps_the_limit_and_says_so() {
    let column = ValueBytesMax::unchecked(3);
    let capped = ValueLimit::capped(limit(4), "a small column", column);
    assert_eq!(capped.effective(), limit(3));
    let message = capped.check("the payload", "abcd").unwrap_err().to_string();
    assert!(message.contains("over the 3 bytes of a small column"), "{message}");
    assert!(!message.contains("value_bytes_max"), "raising the option would not help: {message}");
    // A larger column leaves the option in force.
    let uncapped = ValueLimit::capped(limit(2), "a large column", column);
    assert_eq!(uncapped, ValueLimit::new(limit(2)));
}

#[test]
fn checked_rows_refuse_values_over_the_limit_before_any_sql() {
    let request = request();
    let options = SaveRequestOptions::default();
    let payload_len = request.payload.json().unwrap().len();
    assert!(
        MessageInsert::checked_request(&request, &options, ValueLimit::new(limit(payload_len)))
            .is_ok()
    );
    let error =
        MessageInsert::checked_request(&request, &options, ValueLimit::new(limit(payload_len - 1)))
            .unwrap_err();
    assert!(error.to_string().contains("the request's payload"), "{error}");
    let headers =
        Request { headers: RawJson::from_json(r#"{"a":"bc"}"#.to_owned()).unwrap(), ..request };
    let error =
        MessageInsert::checked_request(&headers, &options, ValueLimit::new(limit(payload_len)))
            .unwrap_err();
    assert!(error.to_string().contains("the request's headers"), "{error}");
    let exit = Reply::WithExit(WithExit {
        request_id: Snowflake::new(1),
        id: Snowflake::new(2),
        exit: Exit::void(),
    });
    let exit_len = ReplyInsert::new(&exit).unwrap().payload.len();
    assert!(ReplyInsert::checked(&exit, ValueLimit::new(limit(exit_len))).is_ok());
    let error = ReplyInsert::checked(&exit, ValueLimit::new(limit(exit_len - 1))).unwrap_err();
    assert!(error.to_string().contains("the reply's payload"), "{error}");
    let values = vec![RawJson::from_json("1".to_owned()).unwrap()];
    let chunk = Reply::Chunk(Chunk::new(Snowflake::new(1), Snowflake::new(3), 0, values).unwrap());
    // `[1]`: three bytes.
    assert!(ReplyInsert::checked(&chunk, ValueLimit::new(limit(3))).is_ok());
    let error = ReplyInsert::checked(&chunk, ValueLimit::new(limit(2))).unwrap_err();
    assert!(error.to_string().contains("the chunk's values"), "{error}");
}

fn state_write(expected: u64, value: Option<&str>) -> StateWrite {
    StateWrite {
        address: address(),
        expected,
        value: value.map(|value| RawJson::from_json(value.to_owned()).unwrap()),
    }
}

#[test]
fn a_state_write_becomes_one_conditional_statement() {
    let limit = ValueLimit::new(limit(64));
    let cases = [
        (state_write(0, Some("1")), StateChange::Insert("1")),
        (state_write(3, Some(r#"{"n":1}"#)), StateChange::Update(r#"{"n":1}"#)),
        (state_write(3, None), StateChange::Delete),
        (state_write(0, None), StateChange::Nothing),
    ];
    for (write, change) in &cases {
        let row = StateRow::checked(write, limit).unwrap();
        assert_eq!(row.change, *change, "{write:?}");
        assert_eq!(row.expected, i64::try_from(write.expected).unwrap());
        assert_eq!((row.entity_type, row.entity_id), ("Counter", "c-1"));
        assert_eq!(row.shard_id, "default:7");
    }
    // The undefined value is stored as `null`, as JSON.stringify would leave it in an array.
    let undefined =
        StateWrite { address: address(), expected: 0, value: Some(RawJson::undefined()) };
    assert_eq!(StateRow::checked(&undefined, limit).unwrap().change, StateChange::Insert("null"));
}

#[test]
fn a_state_write_is_refused_before_any_sql() {
    let over = state_write(1, Some(r#""abcdef""#));
    let error = StateRow::checked(&over, ValueLimit::new(limit(7))).unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput);
    let message = error.to_string();
    for expected in ["the state of Counter/c-1", "8 bytes", "limit of 7 bytes"] {
        assert!(message.contains(expected), "{expected:?} is not in {message:?}");
    }
    // Revisions are BIGINTs, and the last one cannot move on.
    for expected in [u64::MAX, i64::MAX.unsigned_abs()] {
        let write = state_write(expected, Some("1"));
        let error = StateRow::checked(&write, ValueLimit::new(limit(64))).unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    }
}

#[test]
fn a_stored_state_decodes_or_is_malformed_naming_its_entity() {
    let stored = StoredStateRow { value: r#"{"n":1}"#.to_owned(), revision: 2 };
    let state = stored.decode(&address()).unwrap();
    assert_eq!(state.revision, 2);
    assert_eq!(state.value.json(), Some(r#"{"n":1}"#));
    let not_json = StoredStateRow { value: "{not json".to_owned(), revision: 1 };
    let no_revision = StoredStateRow { value: "1".to_owned(), revision: 0 };
    for row in [not_json, no_revision] {
        let error = row.clone().decode(&address()).unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::Malformed, "{row:?}");
        assert!(error.to_string().contains("Counter/c-1"), "{error}");
    }
}
