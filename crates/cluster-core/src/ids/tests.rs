//! Tests of identifiers: string forms, parsing and runner equality.

use std::collections::BTreeSet;

use super::*;

#[test]
fn shard_id_string_form_round_trips() {
    let shard = ShardId::new(ShardGroup::from("default"), 7);
    assert_eq!(shard.to_string(), "default:7");
    assert_eq!("default:7".parse::<ShardId>(), Ok(shard));
}

#[test]
fn shard_id_is_split_at_the_last_colon() {
    let shard: ShardId = "tenant:eu:12".parse().unwrap();
    assert_eq!(shard.group().as_str(), "tenant:eu");
    assert_eq!(shard.id(), 12);
    let empty_group: ShardId = ":3".parse().unwrap();
    assert_eq!(empty_group.group().as_str(), "");
}

#[test]
fn malformed_shard_ids_are_typed_errors() {
    for (input, reason) in [
        ("default", "expected `group:id`"),
        ("default:", "the id after the last `:` must be a number"),
        ("default:x", "the id after the last `:` must be a number"),
        ("default:-1", "the id after the last `:` must be a number"),
        ("default:1.5", "the id after the last `:` must be a number"),
        ("default:0", "shard numbers start at 1"),
        ("default:99999999999", "the id after the last `:` must be a number"),
    ] {
        let error = input.parse::<ShardId>().unwrap_err();
        assert_eq!(error.what(), "shard id");
        assert_eq!(error.input(), input);
        assert_eq!(error.reason(), reason, "{input}");
    }
}

#[test]
fn runner_address_string_form() {
    let address: RunnerAddress = "10.0.0.1:34431".parse().unwrap();
    assert_eq!(address.host(), "10.0.0.1");
    assert_eq!(address.port(), 34431);
    assert_eq!(address.to_string(), "10.0.0.1:34431");
    let ipv6: RunnerAddress = "::1:34431".parse().unwrap();
    assert_eq!(ipv6.host(), "::1");
    for input in ["localhost", ":80", "host:", "host:65536", "host:port"] {
        assert!(input.parse::<RunnerAddress>().is_err(), "{input}");
    }
}

#[test]
fn runner_equality_ignores_groups() {
    let address = RunnerAddress::new("a", 1);
    let one = Runner::new(address.clone(), vec![ShardGroup::from("x")], RunnerWeight::ONE);
    let other_groups = Runner::new(address.clone(), vec![ShardGroup::from("y")], RunnerWeight::ONE);
    let heavier =
        Runner::new(address, vec![ShardGroup::from("x")], RunnerWeight::new(2.0).unwrap());
    assert_eq!(one, other_groups);
    assert_ne!(one, heavier);
    let set: BTreeSet<Runner> = [one, other_groups, heavier].into_iter().collect();
    assert_eq!(set.len(), 2);
}

#[test]
fn runner_weight_rejects_non_finite_values() {
    assert!(RunnerWeight::new(f64::NAN).is_none());
    assert!(RunnerWeight::new(f64::INFINITY).is_none());
    assert_eq!(RunnerWeight::new(-0.0), RunnerWeight::new(0.0));
}

#[test]
fn machine_id_bits_wrap_at_1024() {
    assert_eq!(MachineId::new(5).snowflake_bits(), 5);
    assert_eq!(MachineId::new(1025).snowflake_bits(), 1);
    assert_eq!(MachineId::new(-1).snowflake_bits(), 1023);
}

#[test]
fn a_static_name_equals_orders_and_hashes_as_the_same_shared_name() {
    use std::collections::hash_map::DefaultHasher;

    let hash = |value: &EntityType| {
        let mut hasher = DefaultHasher::new();
        value.hash(&mut hasher);
        hasher.finish()
    };
    let from_code = EntityType::from_static("Counter");
    let from_wire = EntityType::from(String::from("Counter"));
    assert_eq!(from_code, from_wire);
    assert_eq!(from_code.cmp(&from_wire), std::cmp::Ordering::Equal);
    assert_eq!(hash(&from_code), hash(&from_wire));
    assert!(EntityType::from_static("A") < EntityType::from("B"));
    assert!(EntityType::from("A") < EntityType::from_static("B"));
    assert_eq!(from_code.to_string(), "Counter");
    assert_eq!(format!("{from_code:?}"), "\"Counter\"");
    assert_eq!(ShardGroup::default_group(), ShardGroup::from("default"));
    // A map keyed by one form finds the other.
    let map = std::collections::BTreeMap::from([(from_wire, 1)]);
    assert_eq!(map.get(&from_code), Some(&1));
}

/// An entity id shows its control characters escaped, so that no log line carries them; the id
/// itself is unchanged.
#[test]
fn an_entity_id_shows_its_control_characters_escaped() {
    let forged = EntityId::from("x\nINFO admin login ok\u{1b}[2J\u{0}é");
    let shown = forged.to_string();
    assert_eq!(shown, "x\\nINFO admin login ok\\u{1b}[2J\\0é");
    assert!(!shown.chars().any(char::is_control), "{shown:?}");
    assert_eq!(forged.as_str(), "x\nINFO admin login ok\u{1b}[2J\u{0}é");
    let address = EntityAddress {
        shard_id: ShardId::new(ShardGroup::default_group(), 1),
        entity_type: EntityType::from_static("Counter"),
        entity_id: forged,
    };
    for shown in [address.to_string(), format!("{address:?}")] {
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
    }
    assert_eq!(EntityId::from("plain-id").to_string(), "plain-id");
}
