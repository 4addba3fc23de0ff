//! The weighted consistent hash ring that assigns shards to runners (`effect/src/HashRing.ts`).
//!
//! Every runner and client computes the shard-to-runner assignment on its own from the runner
//! registry, so this must be bit-identical across processes and with the TypeScript reference:
//! same virtual points, same hash, same tie rules, same balancing passes. The golden tests hold
//! the reference's outputs; changing this module changes routing.
//!
//! The ring is *balanced*: [`HashRing::get_shards`] first gives every shard its nearest runner
//! but stops giving shards to a runner once it has its weighted share, then places the rest. So
//! each runner gets at least `floor(count × weight / total)` shards, and adding a runner moves
//! mostly, but not only, shards to the new runner (3 → 4 equal runners moves 87 of 300 shards,
//! 75 of them to the new one).

use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::hash::hash_string;
use crate::ids::RunnerAddress;

/// Virtual points per unit of weight, the reference's default.
pub const DEFAULT_BASE_WEIGHT: u32 = 128;

/// The smallest weight a node gets (the reference clamps at 0.1).
pub const MIN_WEIGHT: f64 = 0.1;

/// The largest weight a node gets. The reference has no cap; this one bounds the ring's memory
/// (`MAX_WEIGHT × base weight` points per node) against an absurd weight in the registry.
pub const MAX_WEIGHT: f64 = 1_000.0;

/// A node that can be placed on a [`HashRing`]: it has a stable string key.
pub trait RingNode: Clone {
    /// The key that identifies the node and seeds its virtual points (`host:port` for runners).
    fn ring_key(&self) -> Cow<'_, str>;
}

impl RingNode for RunnerAddress {
    fn ring_key(&self) -> Cow<'_, str> {
        Cow::Owned(self.to_string())
    }
}

impl RingNode for String {
    fn ring_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

/// A weighted consistent hash ring.
#[derive(Clone, Debug)]
pub struct HashRing<N> {
    base_weight: u32,
    /// Sum of the node weights, added in key order (floating-point sums depend on order).
    total_weight: f64,
    /// Node key → (node, clamped weight).
    nodes: BTreeMap<Arc<str>, (N, f64)>,
    /// Virtual points sorted by hash, then by node key.
    ring: Vec<(i32, Arc<str>)>,
}

impl<N: RingNode> Default for HashRing<N> {
    fn default() -> HashRing<N> {
        HashRing::new()
    }
}

impl<N: RingNode> HashRing<N> {
    /// An empty ring with [`DEFAULT_BASE_WEIGHT`] points per unit of weight.
    pub fn new() -> HashRing<N> {
        HashRing::with_base_weight(DEFAULT_BASE_WEIGHT)
    }

    /// An empty ring with `base_weight` points per unit of weight (at least 1, at most 4096).
    pub fn with_base_weight(base_weight: u32) -> HashRing<N> {
        HashRing {
            base_weight: base_weight.clamp(1, 4096),
            total_weight: 0.0,
            nodes: BTreeMap::new(),
            ring: Vec::new(),
        }
    }

    /// The number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the ring has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Whether a node with `node`'s key is on the ring.
    pub fn contains(&self, node: &N) -> bool {
        self.nodes.contains_key(&*node.ring_key())
    }

    /// The nodes, in key order.
    pub fn nodes(&self) -> impl Iterator<Item = &N> {
        self.nodes.values().map(|(node, _)| node)
    }

    /// Adds `node` with `weight` (clamped to [`MIN_WEIGHT`]..=[`MAX_WEIGHT`]).
    ///
    /// Adding a node that is already present replaces the stored node value, and its virtual
    /// points if the weight differs.
    pub fn add(&mut self, node: N, weight: f64) {
        let weight = clamp_weight(weight);
        let key: Arc<str> = Arc::from(node.ring_key());
        if let Some(entry) = self.nodes.get_mut(&key) {
            entry.0 = node;
            if entry.1 == weight {
                return;
            }
            entry.1 = weight;
            self.ring.retain(|(_, point_key)| *point_key != key);
        } else {
            self.nodes.insert(Arc::clone(&key), (node, weight));
        }
        let n_points = points_for(weight, self.base_weight);
        self.ring.reserve(n_points as usize);
        for point_idx in (1..=n_points).rev() {
            self.ring.push((hash_string(&format!("{key}:{point_idx}")), Arc::clone(&key)));
        }
        self.ring.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| cmp_utf16(&a.1, &b.1)));
        self.update_total_weight();
    }

    /// Removes the node with `node`'s key and all its points.
    pub fn remove(&mut self, node: &N) {
        let key = node.ring_key();
        if self.nodes.remove(&*key).is_some() {
            self.ring.retain(|(_, point_key)| **point_key != *key);
            self.update_total_weight();
        }
    }

    /// The node whose virtual point is nearest to the hash of `input`, or `None` on an empty
    /// ring. Plain consistent hashing: adding a node only moves inputs to that node.
    pub fn get(&self, input: &str) -> Option<&N> {
        if self.ring.is_empty() {
            return None;
        }
        let (point_idx, _) = self.nearest_point(hash_string(input), None);
        Some(self.node_of_point(point_idx))
    }

    /// The owners of `count` shards, balanced by weight: element `s` is the owner of shard
    /// number `s + 1`. `None` on an empty ring.
    pub fn get_shards(&self, count: u32) -> Option<Vec<&N>> {
        if self.ring.is_empty() {
            return None;
        }
        let shard_hashes: Vec<i32> =
            (0..count).map(|shard_idx| hash_string(&format!("shard-{shard_idx}"))).collect();
        let mut owners: Vec<Option<&Arc<str>>> = vec![None; shard_hashes.len()];
        let mut balance = Balance::new(count);

        // First pass: nearest point, in order of distance, until each node has its share.
        let mut distances: Vec<(usize, &Arc<str>, i64)> = shard_hashes
            .iter()
            .enumerate()
            .map(|(shard_idx, hash)| {
                let (point_idx, distance) = self.nearest_point(*hash, None);
                (shard_idx, &self.ring[point_idx].1, distance)
            })
            .collect();
        distances.sort_by_key(|(_, _, distance)| *distance); // stable, like the reference
        for (shard_idx, key, _) in distances {
            if balance.excluded.contains(key) {
                continue;
            }
            owners[shard_idx] = Some(key);
            balance.count(self, key);
        }

        // Second pass: the rest in shard order, nearest node not yet at its share.
        let mut all_at_max = balance.excluded.len() == self.nodes.len();
        for (shard_idx, owner) in owners.iter_mut().enumerate() {
            if owner.is_some() {
                continue;
            }
            let exclude = if all_at_max { None } else { Some(&balance.excluded) };
            let (point_idx, _) = self.nearest_point(shard_hashes[shard_idx], exclude);
            let key = &self.ring[point_idx].1;
            *owner = Some(key);
            if all_at_max {
                continue;
            }
            balance.count(self, key);
            all_at_max = balance.excluded.len() == self.nodes.len();
        }

        Some(owners.into_iter().flatten().map(|key| &self.nodes[key].0).collect())
    }

    fn node_of_point(&self, point_idx: usize) -> &N {
        &self.nodes[&self.ring[point_idx].1].0
    }

    /// The index of the point nearest to `hash` and its distance, with the reference's rules:
    /// the candidates are the first point at or after `hash` (`a`, or the last point) and the
    /// one before it (`b`); ties go to `a`. With exclusions, `a` is taken if allowed, else the
    /// search alternates outwards, `lo - i` before `lo + i`.
    fn nearest_point(&self, hash: i32, exclude: Option<&BTreeSet<&Arc<str>>>) -> (usize, i64) {
        let len = self.ring.len();
        let lo = self.ring.partition_point(|(point_hash, _)| *point_hash < hash);
        let a = if lo == len { lo - 1 } else { lo };
        let distance =
            |point_idx: usize| (i64::from(self.ring[point_idx].0) - i64::from(hash)).abs();
        let dist_a = distance(a);
        let Some(exclude) = exclude else {
            if lo == 0 {
                return (a, dist_a);
            }
            let dist_b = distance(lo - 1);
            return if dist_a <= dist_b { (a, dist_a) } else { (lo - 1, dist_b) };
        };
        let allowed = |point_idx: usize| !exclude.contains(&self.ring[point_idx].1);
        if allowed(a) {
            return (a, dist_a);
        }
        let range = lo.max(len - lo);
        for step in 1..=range {
            if let Some(below) = lo.checked_sub(step).filter(|idx| *idx < len && allowed(*idx)) {
                return (below, distance(below));
            }
            let above = lo + step;
            if above < len && allowed(above) {
                return (above, distance(above));
            }
        }
        (a, dist_a)
    }

    fn update_total_weight(&mut self) {
        let mut keys: Vec<&Arc<str>> = self.nodes.keys().collect();
        keys.sort_by(|a, b| cmp_utf16(a, b));
        self.total_weight = keys.into_iter().map(|key| self.nodes[key].1).sum();
    }
}

/// Per-node shard counts of one `get_shards` call and the nodes that reached their share.
struct Balance<'a> {
    count: u32,
    allocations: BTreeMap<&'a Arc<str>, u32>,
    excluded: BTreeSet<&'a Arc<str>>,
}

impl<'a> Balance<'a> {
    fn new(count: u32) -> Balance<'a> {
        Balance { count, allocations: BTreeMap::new(), excluded: BTreeSet::new() }
    }

    fn count<N>(&mut self, ring: &'a HashRing<N>, key: &'a Arc<str>) {
        let allocated = self.allocations.entry(key).or_insert(0);
        *allocated += 1;
        let weight = ring.nodes[key].1;
        let max_per_node = (f64::from(self.count) * (weight / ring.total_weight)).floor().max(1.0);
        if f64::from(*allocated) >= max_per_node {
            self.excluded.insert(key);
        }
    }
}

fn clamp_weight(weight: f64) -> f64 {
    if weight.is_nan() { MIN_WEIGHT } else { weight.clamp(MIN_WEIGHT, MAX_WEIGHT) }
}

#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "the weight is clamped to MIN_WEIGHT..=MAX_WEIGHT and the base weight to 1..=4096"
)]
fn points_for(weight: f64, base_weight: u32) -> u32 {
    // JavaScript's Math.round and f64::round agree on positive numbers.
    (weight * f64::from(base_weight)).round() as u32
}

/// String order of the reference: lexicographic over UTF-16 code units.
fn cmp_utf16(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

#[cfg(test)]
mod tests;
