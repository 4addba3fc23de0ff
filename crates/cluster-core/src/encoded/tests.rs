//! Round trips against JSON literals produced by the reference's 4.1.0 dist.

use super::*;
use crate::envelope::{CauseReason, Exit};

/// Decodes `json`, checks it re-encodes byte for byte, and returns the value.
fn round_trip<T: JsonForm + std::fmt::Debug>(json: &str) -> T {
    let value = T::from_json(json).unwrap_or_else(|error| panic!("{json}: {error}"));
    assert_eq!(value.to_json(), json);
    value
}

const ADDRESS: &str =
    r#"{"shardId":{"group":"default","id":7},"entityType":"Counter","entityId":"c-1"}"#;

#[test]
fn request_envelopes() {
    let json = format!(
        r#"{{"_tag":"Request","requestId":"123","address":{ADDRESS},"tag":"Increment","payload":{{"by":1}},"headers":{{}},"traceId":"t","spanId":"s","sampled":true}}"#
    );
    let Envelope::Request(request) = round_trip::<Envelope>(&json) else { panic!("a request") };
    assert_eq!(request.request_id, Snowflake::new(123));
    assert_eq!(request.address.shard_id.to_string(), "default:7");
    assert_eq!(&*request.tag, "Increment");
    assert_eq!(request.payload.json(), Some(r#"{"by":1}"#));
    assert_eq!(request.trace.sampled, Some(true));

    let with_headers = format!(
        r#"{{"_tag":"Request","requestId":"123","address":{ADDRESS},"tag":"Increment","payload":{{"by":1}},"headers":{{"x-a":"1"}},"traceId":"t","spanId":"s","sampled":true}}"#
    );
    round_trip::<Envelope>(&with_headers);

    // A void payload is undefined: the reference leaves the key out.
    let void = format!(
        r#"{{"_tag":"Request","requestId":"123","address":{ADDRESS},"tag":"Start","headers":{{}}}}"#
    );
    let Envelope::Request(request) = round_trip::<Envelope>(&void) else { panic!("a request") };
    assert!(request.payload.is_undefined());
    assert_eq!(request.trace, TraceContext::default());
}

#[test]
fn payload_holes_are_not_re_encoded() {
    let json = format!(
        r#"{{"_tag":"Request","requestId":"1","address":{ADDRESS},"tag":"T","payload":{{"z": 1.50,"a" :[ ]}},"headers":{{}}}}"#
    );
    let Envelope::Request(request) = round_trip::<Envelope>(&json) else { panic!("a request") };
    assert_eq!(request.payload.json(), Some(r#"{"z": 1.50,"a" :[ ]}"#));
}

#[test]
fn ack_and_interrupt_envelopes() {
    let ack = format!(
        r#"{{"_tag":"AckChunk","id":"5","address":{ADDRESS},"requestId":"123","replyId":"9"}}"#
    );
    let Envelope::AckChunk(decoded) = round_trip::<Envelope>(&ack) else { panic!("an ack") };
    assert_eq!((decoded.id, decoded.reply_id), (Snowflake::new(5), Snowflake::new(9)));
    let interrupt =
        format!(r#"{{"_tag":"Interrupt","id":"6","address":{ADDRESS},"requestId":"123"}}"#);
    assert!(matches!(round_trip::<Envelope>(&interrupt), Envelope::Interrupt(_)));
}

#[test]
fn replies_and_exits() {
    let success =
        r#"{"_tag":"WithExit","requestId":"1","id":"2","exit":{"_tag":"Success","value":42}}"#;
    assert!(matches!(
        round_trip::<Reply>(success),
        Reply::WithExit(WithExit { exit: Exit::Success(_), .. })
    ));
    let void =
        r#"{"_tag":"WithExit","requestId":"1","id":"2","exit":{"_tag":"Success","value":null}}"#;
    let Reply::WithExit(with_exit) = round_trip::<Reply>(void) else { panic!("a final reply") };
    assert_eq!(with_exit.exit, Exit::void());
    let fail = r#"{"_tag":"WithExit","requestId":"1","id":"2","exit":{"_tag":"Failure","cause":[{"_tag":"Fail","error":"boom"}]}}"#;
    round_trip::<Reply>(fail);
    let die = r#"{"_tag":"WithExit","requestId":"1","id":"2","exit":{"_tag":"Failure","cause":[{"_tag":"Die","defect":{"name":"Error","message":"bad"}}]}}"#;
    round_trip::<Reply>(die);
    let interrupt = r#"{"_tag":"WithExit","requestId":"1","id":"2","exit":{"_tag":"Failure","cause":[{"_tag":"Interrupt","fiberId":null}]}}"#;
    let Reply::WithExit(with_exit) = round_trip::<Reply>(interrupt) else {
        panic!("a final reply")
    };
    assert_eq!(with_exit.exit, Exit::interrupt());
    let chunk = r#"{"_tag":"Chunk","requestId":"1","id":"3","sequence":0,"values":[1,2]}"#;
    let Reply::Chunk(decoded) = round_trip::<Reply>(chunk) else { panic!("a chunk") };
    assert_eq!(decoded.values().len(), 2);
}

#[test]
fn exits_written_by_rust_match_the_reference() {
    assert_eq!(
        Exit::interrupt().to_json(),
        r#"{"_tag":"Failure","cause":[{"_tag":"Interrupt","fiberId":null}]}"#
    );
    assert_eq!(Exit::void().to_json(), r#"{"_tag":"Success","value":null}"#);
    assert_eq!(
        Exit::die_with_message("Error", "bad").to_json(),
        r#"{"_tag":"Failure","cause":[{"_tag":"Die","defect":{"name":"Error","message":"bad"}}]}"#
    );
    // Interrupts with a fiber id (written by TypeScript) and without the key both decode.
    let with_fiber =
        Exit::from_json(r#"{"_tag":"Failure","cause":[{"_tag":"Interrupt","fiberId":12}]}"#)
            .unwrap();
    assert_eq!(
        with_fiber,
        Exit::Failure(Cause(vec![CauseReason::Interrupt { fiber_id: Some(12) }]))
    );
    let without = Exit::from_json(r#"{"_tag":"Failure","cause":[{"_tag":"Interrupt"}]}"#).unwrap();
    assert_eq!(without, Exit::interrupt());
    // An undefined success value stays undefined.
    let undefined = round_trip::<Exit>(r#"{"_tag":"Success"}"#);
    assert_eq!(undefined, Exit::Success(RawJson::undefined()));
}

#[test]
fn empty_chunk_from_writes_undefined_as_null() {
    let reply = Reply::Chunk(Chunk::empty_from(Snowflake::new(4)));
    assert_eq!(
        reply.to_json(),
        r#"{"_tag":"Chunk","requestId":"4","id":"0","sequence":0,"values":[null]}"#
    );
}

#[test]
fn chunk_values_columns() {
    let values = values_from_json("[1, {\"a\":2},null]").unwrap();
    assert_eq!(values.len(), 3);
    assert_eq!(values[1].json(), Some("{\"a\":2}"));
    assert_eq!(values_to_json(&values), "[1,{\"a\":2},null]");
    assert_eq!(values_to_json(&[RawJson::undefined()]), "[null]");
    assert!(values_from_json("{}").is_err());
    assert!(values_from_json("[1,").is_err());
}

#[test]
fn runners() {
    let runner = round_trip::<Runner>(
        r#"{"address":{"host":"127.0.0.1","port":34431},"groups":["default"],"weight":1}"#,
    );
    assert_eq!(runner.address.to_string(), "127.0.0.1:34431");
    assert_eq!(runner.weight, RunnerWeight::ONE);
    round_trip::<Runner>(r#"{"address":{"host":"h","port":1},"groups":[],"weight":0.5}"#);
    // `2.0` decodes; it is written back the way JavaScript prints it.
    let heavy =
        Runner::from_json(r#"{"address":{"host":"h","port":1},"groups":["a"],"weight":2.0}"#)
            .unwrap();
    assert_eq!(heavy.to_json(), r#"{"address":{"host":"h","port":1},"groups":["a"],"weight":2}"#);
}

#[test]
fn snowflakes_may_be_integers_but_not_negative() {
    let ack = format!(
        r#"{{"_tag":"AckChunk","id":5,"address":{ADDRESS},"requestId":"123","replyId":"9"}}"#
    );
    assert_eq!(Envelope::from_json(&ack).unwrap().id(), Snowflake::new(5));
    let negative = format!(
        r#"{{"_tag":"AckChunk","id":-5,"address":{ADDRESS},"requestId":"123","replyId":"9"}}"#
    );
    assert!(Envelope::from_json(&negative).is_err());
}

#[test]
fn malformed_input_is_a_typed_error() {
    type Decode = fn(&str) -> Result<(), DecodeError>;
    let cases: [(&str, Decode); 20] = [
        ("", |json| Envelope::from_json(json).map(drop)),
        ("[]", |json| Envelope::from_json(json).map(drop)),
        (r#"{"_tag":"Request"}"#, |json| Envelope::from_json(json).map(drop)),
        (
            r#"{"_tag":"Nope","requestId":"1","address":{"shardId":{"group":"g","id":1},"entityType":"t","entityId":"i"}}"#,
            |json| Envelope::from_json(json).map(drop),
        ),
        (
            r#"{"_tag":"Request","requestId":"1","address":{"shardId":{"group":"g","id":0},"entityType":"t","entityId":"i"},"tag":"T"}"#,
            |json| Envelope::from_json(json).map(drop),
        ),
        (
            r#"{"_tag":"Request","requestId":"1","address":{"shardId":{"group":"g","id":1.5},"entityType":"t","entityId":"i"},"tag":"T"}"#,
            |json| Envelope::from_json(json).map(drop),
        ),
        (
            r#"{"_tag":"Request","requestId":"x","address":{"shardId":{"group":"g","id":1},"entityType":"t","entityId":"i"},"tag":"T"}"#,
            |json| Envelope::from_json(json).map(drop),
        ),
        (
            r#"{"_tag":"Request","requestId":"1","address":{"shardId":{"group":"g","id":1},"entityType":"t","entityId":"i"}}"#,
            |json| Envelope::from_json(json).map(drop),
        ),
        (
            r#"{"_tag":"AckChunk","id":"1","requestId":"1","address":{"shardId":{"group":"g","id":1},"entityType":"t","entityId":"i"}}"#,
            |json| Envelope::from_json(json).map(drop),
        ),
        (
            r#"{"_tag":"Interrupt","requestId":"1","address":{"shardId":{"group":"g","id":1},"entityType":"t","entityId":"i"}}"#,
            |json| Envelope::from_json(json).map(drop),
        ),
        (r#"{"_tag":"Chunk","requestId":"1","id":"2","sequence":0,"values":[]}"#, |json| {
            Reply::from_json(json).map(drop)
        }),
        (r#"{"_tag":"Chunk","requestId":"1","id":"2","values":[1]}"#, |json| {
            Reply::from_json(json).map(drop)
        }),
        (r#"{"_tag":"Chunk","requestId":"1","id":"2","sequence":-1,"values":[1]}"#, |json| {
            Reply::from_json(json).map(drop)
        }),
        (r#"{"_tag":"WithExit","requestId":"1","id":"2"}"#, |json| {
            Reply::from_json(json).map(drop)
        }),
        (r#"{"_tag":"WithExit","requestId":"1","id":"2","exit":{"_tag":"Failure"}}"#, |json| {
            Reply::from_json(json).map(drop)
        }),
        (r#"{"_tag":"Failure","cause":[{"_tag":"Oops"}]}"#, |json| Exit::from_json(json).map(drop)),
        (r#"{"_tag":"Maybe"}"#, |json| Exit::from_json(json).map(drop)),
        (r#"{"address":{"host":"h","port":70000},"groups":[],"weight":1}"#, |json| {
            Runner::from_json(json).map(drop)
        }),
        (r#"{"address":{"host":"h","port":1},"groups":[],"weight":"1"}"#, |json| {
            Runner::from_json(json).map(drop)
        }),
        (r#"{"address":{"host":"h","port":1},"weight":1}"#, |json| {
            Runner::from_json(json).map(drop)
        }),
    ];
    for (json, decode) in cases {
        assert!(decode(json).is_err(), "{json}");
    }
}

mod properties {
    use proptest::prelude::*;

    use super::*;
    use crate::ids::{EntityAddress, EntityId, EntityType, ShardGroup, ShardId};

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            ".*".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(".*", inner, 0..4)
                    .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn requests_round_trip(
            request_id in any::<u64>(),
            group in ".*",
            shard in 1u32..,
            entity_type in ".*",
            entity_id in ".*",
            tag in ".*",
            payload in json_value(),
            trace_id in proptest::option::of(".*"),
        ) {
            let envelope = Envelope::Request(Request {
                request_id: Snowflake::new(request_id),
                address: EntityAddress {
                    shard_id: ShardId::new(ShardGroup::from(group), shard),
                    entity_type: EntityType::from(entity_type),
                    entity_id: EntityId::from(entity_id),
                },
                tag: tag.into(),
                payload: RawJson::encode(&payload).unwrap(),
                headers: RawJson::from_json("{}".to_owned()).unwrap(),
                trace: TraceContext { trace_id, span_id: None, sampled: None },
            });
            let json = envelope.to_json();
            let decoded = Envelope::from_json(&json).unwrap();
            prop_assert_eq!(&decoded, &envelope);
            prop_assert_eq!(decoded.to_json(), json);
        }

        #[test]
        fn decoding_arbitrary_text_never_panics(text in ".*") {
            let _ = Envelope::from_json(&text);
            let _ = Reply::from_json(&text);
            let _ = Exit::from_json(&text);
            let _ = Runner::from_json(&text);
        }
    }
}
