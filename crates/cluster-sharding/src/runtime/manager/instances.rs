//! The resident instances of one entity type, in partitions by shard.
//!
//! Every request looks its instance up under a lock. One map under one mutex made the two
//! worker threads of the W1 benchmark wait on each other (`lock_contended` 2 % of its time),
//! and a lookup among 1,000 ids compared about ten strings. The partitions are picked by the
//! shard's number, which the address already carries (no hashing), so a shard's instances are
//! in one partition: stopping a shard or asking whether it has instances locks only that one.
//! Within a partition the instances are ordered by a 64-bit hash of their id before the id
//! itself, so a lookup compares integers and the id's bytes only once, at the match (ids of
//! one type tend to share a prefix, such as `user-`, which every byte-wise compare walks).

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use cluster_core::{EntityId, ShardId};

use super::lock;

/// How many partitions; a power of two well above the worker count.
const PARTITIONS: usize = 16;

/// The key of an instance within its partition: the hash of its id, then the id.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    hash: u64,
    id: EntityId,
}

impl Key {
    fn of(id: &EntityId) -> Key {
        Key { hash: hash(id.as_str()), id: id.clone() }
    }
}

/// A 64-bit hash of `id` (FNV-1a over 8-byte words, each step followed by a shift-xor mix):
/// fixed, so the map's order does not depend on the process (the simulation's histories
/// replay).
fn hash(id: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325 ^ (id.len() as u64);
    for chunk in id.as_bytes().chunks(8) {
        let mut word = [0_u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        hash = (hash ^ u64::from_le_bytes(word)).wrapping_mul(0x0000_0100_0000_01b3);
        hash ^= hash >> 29;
    }
    hash
}

/// The instances of one type, `I` each, by shard partition and entity id.
pub(super) struct Instances<I> {
    partitions: [Mutex<BTreeMap<Key, I>>; PARTITIONS],
    /// How many there are in all; changed under the lock of the partition that changed.
    count: AtomicUsize,
}

/// One partition, locked.
pub(super) struct Partition<'a, I> {
    map: MutexGuard<'a, BTreeMap<Key, I>>,
    count: &'a AtomicUsize,
}

impl<I> Instances<I> {
    pub(super) fn new() -> Instances<I> {
        Instances {
            partitions: std::array::from_fn(|_| Mutex::new(BTreeMap::new())),
            count: AtomicUsize::new(0),
        }
    }

    /// The partition of `shard`, locked.
    pub(super) fn partition(&self, shard: &ShardId) -> Partition<'_, I> {
        let index = usize::try_from(shard.id()).unwrap_or(0) % PARTITIONS;
        Partition { map: lock(&self.partitions[index]), count: &self.count }
    }

    /// How many instances there are in all.
    pub(super) fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// `f` of every instance, partition by partition (each locked in turn).
    pub(super) fn collect<T>(&self, mut f: impl FnMut(&I) -> T) -> Vec<T> {
        let mut collected = Vec::with_capacity(self.len());
        for partition in &self.partitions {
            collected.extend(lock(partition).values().map(&mut f));
        }
        collected
    }

    /// Calls `f` on every instance, partition by partition (each locked in turn).
    pub(super) fn for_each(&self, mut f: impl FnMut(&I)) {
        for partition in &self.partitions {
            lock(partition).values().for_each(&mut f);
        }
    }

    /// Removes every instance, partition by partition.
    pub(super) fn clear(&self) {
        for partition in &self.partitions {
            let mut map = lock(partition);
            self.count.fetch_sub(map.len(), Ordering::AcqRel);
            map.clear();
        }
    }
}

impl<I> Partition<'_, I> {
    /// The instance of `id`.
    pub(super) fn get(&self, id: &EntityId) -> Option<&I> {
        self.map.get(&Key::of(id))
    }

    /// The instance of `id`, made with `make` (given the count it will make) if there is none;
    /// `make` may refuse.
    pub(super) fn get_or_try_insert<R>(
        &mut self,
        id: &EntityId,
        make: impl FnOnce(usize) -> Result<I, R>,
    ) -> Result<&mut I, R> {
        // One lookup (the id's clone is a reference count).
        match self.map.entry(Key::of(id)) {
            Entry::Occupied(entry) => Ok(entry.into_mut()),
            Entry::Vacant(entry) => {
                // Counted first, so that concurrent insertions into other partitions each see
                // their own count.
                let count = self.count.fetch_add(1, Ordering::AcqRel) + 1;
                match make(count) {
                    Ok(instance) => Ok(entry.insert(instance)),
                    Err(refused) => {
                        self.count.fetch_sub(1, Ordering::AcqRel);
                        Err(refused)
                    }
                }
            }
        }
    }

    /// Removes the instance of `id`.
    pub(super) fn remove(&mut self, id: &EntityId) -> Option<I> {
        let removed = self.map.remove(&Key::of(id));
        if removed.is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        removed
    }

    /// Removes the instances `select` picks and returns them.
    pub(super) fn remove_where(&mut self, mut select: impl FnMut(&I) -> bool) -> Vec<I> {
        let keys: Vec<Key> = self
            .map
            .iter()
            .filter(|(_, instance)| select(instance))
            .map(|(key, _)| key.clone())
            .collect();
        let removed: Vec<I> = keys.iter().filter_map(|key| self.map.remove(key)).collect();
        self.count.fetch_sub(removed.len(), Ordering::AcqRel);
        removed
    }

    /// Whether an instance `select` picks is here.
    pub(super) fn any(&self, select: impl FnMut(&I) -> bool) -> bool {
        self.map.values().any(select)
    }
}

#[cfg(test)]
mod tests {
    use cluster_core::ShardGroup;

    use super::*;

    fn shard(id: u32) -> ShardId {
        ShardId::new(ShardGroup::from("default"), id)
    }

    #[test]
    fn instances_are_counted_across_partitions_and_found_in_their_shards() {
        let instances: Instances<u32> = Instances::new();
        for n in 1..=40_u32 {
            let id = EntityId::from(format!("e{n}").as_str());
            let made = instances
                .partition(&shard(n))
                .get_or_try_insert(&id, |count| {
                    assert_eq!(count, usize::try_from(n).unwrap());
                    Ok::<_, ()>(n)
                })
                .copied();
            assert_eq!(made, Ok(n));
        }
        assert_eq!(instances.len(), 40);
        // Found again without being made.
        let again = instances
            .partition(&shard(7))
            .get_or_try_insert(&EntityId::from("e7"), |_| Err::<u32, _>("made twice"))
            .copied();
        assert_eq!(again, Ok(7));
        // Shards 7 and 23 share a partition; removing shard 7's leaves shard 23's.
        let removed = instances.partition(&shard(7)).remove_where(|n| *n == 7);
        assert_eq!(removed, [7]);
        assert!(instances.partition(&shard(23)).any(|n| *n == 23));
        assert!(instances.partition(&shard(23)).get(&EntityId::from("e7")).is_none());
        assert_eq!(instances.len(), 39);
        let mut all = instances.collect(|n| *n);
        all.sort_unstable();
        assert_eq!(all, (1..=40).filter(|n| *n != 7).collect::<Vec<_>>());
        instances.clear();
        assert_eq!(instances.len(), 0);
        assert!(instances.collect(|n| *n).is_empty());
    }

    #[test]
    fn the_id_hash_is_fixed_and_tells_similar_ids_apart() {
        // Fixed across processes and runs (the order of a partition does not depend on them):
        // golden values.
        assert_eq!(hash("echo-1"), hash("echo-1"));
        assert_eq!(hash("echo-1"), 0xd79d_941c_73c7_9624);
        assert_eq!(hash(""), 0xcbf2_9ce4_8422_2325);
        let hashes: std::collections::BTreeSet<u64> =
            (0..10_000).map(|n| hash(&format!("echo-{n}"))).collect();
        assert_eq!(hashes.len(), 10_000);
        assert_ne!(hash(""), hash("\0"));
        assert_ne!(hash("a"), hash("a\0"));
    }

    #[test]
    fn a_refused_instance_is_not_counted() {
        let instances: Instances<u32> = Instances::new();
        let refused = instances
            .partition(&shard(1))
            .get_or_try_insert(&EntityId::from("e1"), |_| Err::<u32, _>("full"))
            .copied();
        assert_eq!(refused, Err("full"));
        assert_eq!(instances.len(), 0);
    }
}
