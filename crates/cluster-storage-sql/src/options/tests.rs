//! Tests of `options`.

use super::*;

#[test]
fn prefixes_are_identifiers() {
    assert_eq!(TablePrefix::new("cluster").unwrap().table("messages"), "cluster_messages");
    assert!(TablePrefix::new("_t_1").is_ok());
    assert!(TablePrefix::new(&"a".repeat(TABLE_PREFIX_LEN_MAX)).is_ok());
    for bad in ["", "1abc", "a-b", "a b", "a;drop table x", "a\"b", "é", &"a".repeat(33)] {
        let error = TablePrefix::new(bad).unwrap_err();
        assert_eq!((error.key(), error.value()), ("table_prefix", bad));
    }
}

#[test]
fn options_follow_the_config() {
    let config = ShardingConfig {
        available_shard_groups: vec![ShardGroup::from("z"), ShardGroup::from("a")],
        assigned_shard_groups: vec![ShardGroup::from("a")],
        shard_lock_disable_advisory: true,
        shard_lock_expiration: Duration::from_millis(2_500),
        ..ShardingConfig::default()
    };
    let options = SqlStorageOptions::from_config(&config, TablePrefix::default());
    assert_eq!(options.lock_mode, LockMode::Lease);
    assert_eq!(options.group_index(&ShardGroup::from("a")), Some(0));
    assert_eq!(options.group_index(&ShardGroup::from("z")), Some(1));
    assert_eq!(options.group_index(&ShardGroup::from("q")), None);
    assert_eq!(options.expiration_seconds(), 3);
    assert_eq!(options.shard_lock_interval, Duration::from_nanos(833_333_333));
    assert!(options.extra_indexes, "the default keeps the claim's index");
}

#[test]
fn value_bytes_max_is_at_least_a_kibibyte_and_at_most_a_gibibyte() {
    assert_eq!(SqlStorageOptions::default().value_bytes_max, VALUE_BYTES_MAX_DEFAULT);
    assert_eq!(VALUE_BYTES_MAX_DEFAULT.get(), 16 * 1024 * 1024);
    assert_eq!(ValueBytesMax::default(), VALUE_BYTES_MAX_DEFAULT);
    assert_eq!(ValueBytesMax::new(1024).unwrap().get(), 1024);
    assert_eq!(ValueBytesMax::new(ValueBytesMax::LIMIT).unwrap().get(), 1 << 30);
    for bad in [0, 1, 1023, ValueBytesMax::LIMIT + 1, usize::MAX] {
        let error = ValueBytesMax::new(bad).unwrap_err();
        assert_eq!((error.key(), error.value()), ("value_bytes_max", bad.to_string().as_str()));
        assert!(!error.reason().is_empty());
    }
    assert_eq!(VALUE_BYTES_MAX_DEFAULT.to_string(), "16777216 bytes");
}
