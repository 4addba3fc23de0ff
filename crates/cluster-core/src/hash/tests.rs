//! Golden vectors of the reference (effect 4.1.0 and `effect/src/cluster/SqlRunnerStorage.ts`) and
//! range properties.

use proptest::prelude::*;

use super::*;

/// (input, `Hash.string`, shard with 300 shards per group), computed with the 4.1.0 dist.
const VECTORS: [(&str, i32, u32); 10] = [
    ("", 5381, 282),
    ("a", 177_604, 5),
    ("1", 177_556, 257),
    ("entity-1", 707_288_930, 231),
    ("hello", 181_380_007, 8),
    ("user-42", 322_868_671, 272),
    ("ClusterCron/foo", -599_099_050, 251),
    ("effect/cluster/Sharding/RunnerHealth", -439_543_433, 234),
    ("héllo", 181_375_403, 204),
    ("😀", 5_191_800, 1),
];

#[test]
fn hash_string_matches_the_reference() {
    for (input, hash, _) in VECTORS {
        assert_eq!(hash_string(input), hash, "{input:?}");
    }
    assert_eq!(hash_string("shard-0"), -146_079_948);
    assert_eq!(hash_string("10.0.0.1:34431:1"), -215_611_685);
    assert_eq!(hash_string("world"), 164_394_279);
}

#[test]
fn shard_numbers_match_the_reference() {
    for (input, _, shard) in VECTORS {
        assert_eq!(shard_number(input, 300), shard, "{input:?}");
    }
    let shard = shard_id("user-42", &ShardGroup::default_group(), 300);
    assert_eq!(shard.to_string(), "default:272");
}

#[test]
fn advisory_lock_namespace_matches_the_reference() {
    assert_eq!(fnv1a_32("effect-cluster:cluster"), -1_455_371_005);
    assert_eq!(fnv1a_32("effect-cluster:cluster").cast_unsigned(), 2_839_596_291);
}

#[test]
fn degenerate_shard_counts_do_not_panic() {
    assert_eq!(shard_number("x", 0), 1);
    assert_eq!(shard_number("x", 1), 1);
    assert!(shard_number("x", u32::MAX) >= 1);
}

proptest! {
    #[test]
    fn shard_numbers_stay_in_range(entity_id in any::<String>(), shards in 1u32..=1_000_000) {
        let shard = shard_number(&entity_id, shards);
        prop_assert!((1..=shards).contains(&shard));
    }

    #[test]
    fn hash_is_reverse_djb2_over_utf16(entity_id in any::<String>()) {
        // An independent formulation: fold from the right in 64-bit arithmetic, then truncate.
        let mut h: i64 = 5381;
        let units: Vec<u16> = entity_id.encode_utf16().collect();
        for unit in units.into_iter().rev() {
            h = ((h * 33) & 0xffff_ffff) ^ i64::from(unit);
        }
        let low = u32::try_from(h & 0xffff_ffff).unwrap();
        let expected = ((low & 0xbfff_ffff) | ((low >> 1) & 0x4000_0000)).cast_signed();
        prop_assert_eq!(hash_string(&entity_id), expected);
    }
}
