//! Tests of the domain forms: the opaque hole, exits and primary keys.

use super::*;
use crate::ids::{EntityId, EntityType, ShardGroup, ShardId};

fn address() -> EntityAddress {
    EntityAddress {
        shard_id: ShardId::new(ShardGroup::from("default"), 7),
        entity_type: EntityType::from("Counter"),
        entity_id: EntityId::from("c-1"),
    }
}

#[test]
fn raw_json_keeps_text_untouched() {
    let raw = RawJson::from_json(r#"{ "b":1,  "a":[1.50, "x"] }"#.to_owned()).unwrap();
    assert_eq!(raw.json(), Some(r#"{ "b":1,  "a":[1.50, "x"] }"#));
    let decoded: serde_json::Value = raw.decode().unwrap();
    assert_eq!(decoded["b"], 1);
}

#[test]
fn raw_json_rejects_malformed_text() {
    for bad in ["", "{", "1 2", "nul", "{\"a\":}"] {
        let error = RawJson::from_json(bad.to_owned()).unwrap_err();
        assert_eq!(error.what(), "JSON value", "{bad:?}");
    }
}

#[test]
fn undefined_is_distinct_from_null() {
    assert!(RawJson::undefined().is_undefined());
    assert_eq!(RawJson::undefined().json(), None);
    assert_eq!(RawJson::undefined().json_or_null(), "null");
    assert_eq!(RawJson::null().json(), Some("null"));
    assert_ne!(RawJson::undefined(), RawJson::null());
    let unit: () = RawJson::undefined().decode().unwrap();
    assert_eq!(unit, ());
}

#[test]
fn exits() {
    assert!(Exit::void().is_success());
    assert_eq!(Exit::void(), Exit::Success(RawJson::null()));
    let Exit::Failure(cause) = Exit::interrupt() else { panic!("an interrupt is a failure") };
    assert!(cause.has_interrupts_only());
    let mixed =
        Cause(vec![CauseReason::Interrupt { fiber_id: None }, CauseReason::Die(RawJson::null())]);
    assert!(!mixed.has_interrupts_only());
    assert!(mixed.has_interrupts());
    assert!(!Cause(Vec::new()).has_interrupts_only());
    let Exit::Failure(cause) = Exit::die_with_message("MalformedMessage", "bad \"payload\"") else {
        panic!("a defect is a failure")
    };
    let CauseReason::Die(defect) = &cause.0[0] else { panic!("a die reason") };
    assert_eq!(defect.json(), Some(r#"{"name":"MalformedMessage","message":"bad \"payload\""}"#));
}

#[test]
fn chunks_are_never_empty() {
    assert!(Chunk::new(Snowflake::new(1), Snowflake::new(2), 0, Vec::new()).is_none());
    let chunk = Chunk::new(Snowflake::new(1), Snowflake::new(2), 3, vec![RawJson::null()]).unwrap();
    assert_eq!((chunk.sequence(), chunk.values().len()), (3, 1));
    assert_eq!(chunk.with_request_id(Snowflake::new(9)).request_id(), Snowflake::new(9));
    let empty = Chunk::empty_from(Snowflake::new(4));
    assert_eq!((empty.id(), empty.sequence()), (Snowflake::new(0), 0));
    assert!(empty.values()[0].is_undefined());
}

#[test]
fn malformed_replies_become_defects() {
    let reply = Reply::malformed(
        Snowflake::new(1),
        Snowflake::new(2),
        &DecodeError::new("reply", "missing field `exit`"),
    );
    assert!(reply.is_final());
    assert_eq!((reply.request_id(), reply.id()), (Snowflake::new(1), Snowflake::new(2)));
    let Reply::WithExit(WithExit { exit: Exit::Failure(cause), .. }) = reply else {
        panic!("a failure")
    };
    assert!(
        matches!(&cause.0[0], CauseReason::Die(defect) if defect.json().unwrap().contains("MalformedMessage"))
    );
}

#[test]
fn envelope_accessors() {
    let interrupt = Envelope::Interrupt(Interrupt {
        id: Snowflake::new(6),
        address: address(),
        request_id: Snowflake::new(123),
    });
    assert_eq!((interrupt.id(), interrupt.request_id()), (Snowflake::new(6), Snowflake::new(123)));
    assert_eq!(interrupt.address(), &address());
}

#[test]
fn primary_keys_compose_and_hash_when_long() {
    let key = primary_key(&address(), "Increment", "k1");
    assert_eq!(key, "Counter/c-1/Increment/k1");
    assert_eq!(message_id(&key), "Counter/c-1/Increment/k1");

    let at_limit = "k".repeat(MESSAGE_ID_LENGTH_MAX);
    assert_eq!(message_id(&at_limit), at_limit.as_str());
    let long = "k".repeat(MESSAGE_ID_LENGTH_MAX + 1);
    let hashed = message_id(&long);
    assert_eq!(hashed.len(), 64);
    assert!(hashed.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    assert!(!hashed.contains('/'));
    // sha256("abc"), a published test vector, through the same hex path.
    let abc_digest = Sha256::digest(b"abc");
    assert_eq!(
        abc_digest.iter().map(|byte| format!("{byte:02x}")).collect::<String>(),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let mut hex = String::new();
    for byte in Sha256::digest(long.as_bytes()) {
        hex.push_str(&format!("{byte:02x}"));
    }
    assert_eq!(hashed, hex);
    // The length is counted in UTF-16 code units, like the reference: 128 emoji are 256 units.
    let emoji = "😀".repeat(128);
    assert_eq!(message_id(&emoji).len(), 64);
}

#[test]
fn constant_values_read_and_compare_as_parsed_ones() {
    let empty = RawJson::empty_object();
    assert_eq!(empty.json(), Some("{}"));
    assert_eq!(empty, RawJson::from_json("{}".to_owned()).unwrap());
    assert_eq!(empty.clone(), empty);
    assert!(!empty.is_undefined());
    let null = RawJson::null();
    assert_eq!(null.json(), Some("null"));
    assert_eq!(null.decode::<Option<u32>>().unwrap(), None);
    assert_eq!(null, RawJson::encode(&()).unwrap());
    assert_ne!(null, RawJson::undefined());
    assert_eq!(RawJson::undefined().json_or_null(), "null");
}
