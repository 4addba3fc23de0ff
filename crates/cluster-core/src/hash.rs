//! The reference's string hash and the entity-to-shard function (`effect/src/cluster/ShardId.ts`).
//!
//! Changing anything here changes which shard every entity lives on, and breaks a database shared
//! with TypeScript runners. The golden vectors in the tests are the reference's own outputs.

use crate::ids::{ShardGroup, ShardId};

/// The reference's `Hash.string`: a djb2 variant over UTF-16 code units, last to first.
///
/// `h = 5381; for each code unit from the end: h = (h * 33) ^ unit` in wrapping 32-bit signed
/// arithmetic, then bit 30 is replaced by bit 31 (the reference's `optimize`).
pub fn hash_string(input: &str) -> i32 {
    // The code units last to first, without collecting them: the characters last to first,
    // each one's units (one, or a surrogate pair) last to first.
    let mut h: i32 = 5381;
    for c in input.chars().rev() {
        let mut buffer = [0u16; 2];
        for unit in c.encode_utf16(&mut buffer).iter().rev() {
            h = h.wrapping_mul(33) ^ i32::from(*unit);
        }
    }
    optimize(h)
}

/// The reference's `Hash.optimize`: `(h & 0xbfffffff) | ((h >>> 1) & 0x40000000)`.
fn optimize(h: i32) -> i32 {
    let bits = h.cast_unsigned();
    ((bits & 0xbfff_ffff) | ((bits >> 1) & 0x4000_0000)).cast_signed()
}

/// The shard number (`1..=shards_per_group`) of `entity_id`.
///
/// `|hash_string(entity_id) % shards_per_group| + 1`, with the truncating signed remainder of the
/// reference. `shards_per_group` must be at least 1 and fit an `i32`; [`ShardingConfig`] enforces
/// both, and other values are clamped into that range.
///
/// [`ShardingConfig`]: crate::ShardingConfig
pub fn shard_number(entity_id: &str, shards_per_group: u32) -> u32 {
    let modulus = i32::try_from(shards_per_group.max(1)).unwrap_or(i32::MAX);
    (hash_string(entity_id) % modulus).unsigned_abs() + 1
}

/// The shard of `entity_id` in `group`.
pub fn shard_id(entity_id: &str, group: &ShardGroup, shards_per_group: u32) -> ShardId {
    ShardId::new(group.clone(), shard_number(entity_id, shards_per_group))
}

/// 32-bit FNV-1a over the UTF-8 bytes of `input`, as a signed integer.
///
/// The PostgreSQL advisory lock namespace is `fnv1a_32("effect-cluster:<prefix>")`, a permanent
/// wire format shared with the reference (`effect/src/cluster/SqlRunnerStorage.ts`).
pub fn fnv1a_32(input: &str) -> i32 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in input.bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash.cast_signed()
}

#[cfg(test)]
mod tests;
