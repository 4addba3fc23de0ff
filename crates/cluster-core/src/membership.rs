//! The decisions of the runner registry sync loop (`effect/src/cluster/Sharding.ts`): from what the
//! registry says to a published shard assignment.
//!
//! Every runner and client polls the registry every `refreshAssignmentsInterval` and computes the
//! shard-to-runner assignment on its own, from one weighted [`HashRing`] per shard group. This
//! module is that loop without its I/O: the caller fetches `(runner, healthy)` pairs from
//! `RunnerStorage::get_runners`, hands them to [`Membership::observe`] with the current time, and
//! carries out the returned [`MembershipStep`] (notify `Transport::on_runner_unavailable`, register
//! again, replace its routing table, wake the acquisition loop).
//!
//! # Why a state machine
//!
//! The rings, the previous observation and the join debounce must survive a failed iteration
//! (a registry timeout restarts the loop): dropping them would publish pending joins early and
//! move shards twice. Keeping them in a value that only changes in [`Membership::observe`] makes
//! that automatic, because a failed fetch never reaches `observe`.
//!
//! # The join debounce (`runnerJoinDebounce`)
//!
//! With a debounce of zero every change is published at once. Otherwise, once a first
//! assignment has been published, runners that become healthy are held in a pending set, out of
//! the rings, until the healthy set has been quiet for the debounce, or at most four times the
//! debounce after the first pending join. A burst of joins (a scale-up, a deployment with a surge)
//! then moves each shard once instead of once per join. Departures and unhealthy runners are
//! published at once, together with whatever joins are pending. A pending runner that leaves
//! owned nothing, so it only restarts the quiet period. While joins are pending no runner takes
//! new shards ([`Membership::has_pending_joins`]); the first assignment never waits.
//!
//! # Departures from the reference
//!
//! - A departing runner is removed from the rings it was *added* to (the groups it listed when
//!   it joined), and a runner that was never healthy is not removed from any ring (it was never
//!   added). The reference removes the departing runner's *address* from the rings of the groups
//!   it lists now, which throws when such a ring does not exist and, on a weight change (a
//!   departure plus a join of the same address), removes the runner that just joined.
//! - Ring removals of an observation are applied before its additions, for the same reason.
//! - The registry is keyed by address; should a fetch list an address twice, only its first
//!   entry counts.
//! - Rings left without runners are dropped; they contribute no shard owners either way.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::clock::Timestamp;
use crate::hash_ring::HashRing;
use crate::ids::{Runner, RunnerAddress, ShardGroup, ShardId};

/// The knobs of the registry sync loop that affect its decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MembershipConfig {
    /// The number of shards in every group (`shardsPerGroup`).
    pub shards_per_group: u32,
    /// How long the healthy set must stay unchanged before joins are published
    /// (`runnerJoinDebounce`); zero publishes every change at once.
    pub join_debounce: Duration,
}

/// The sync loop's memory: hash rings, the previous observation and the pending joins.
#[derive(Clone, Debug)]
pub struct Membership {
    config: MembershipConfig,
    /// One ring per group; holds the healthy runners that are not pending.
    rings: BTreeMap<ShardGroup, HashRing<RunnerAddress>>,
    /// The runners of the previous observation and whether they were healthy (`allRunners`).
    previous: BTreeMap<Runner, bool>,
    /// The healthy runners, as they were when they became healthy: their groups are the rings
    /// they were (or will be, when pending) added to.
    healthy: BTreeSet<Runner>,
    /// Healthy runners held out of the rings by the join debounce.
    pending: BTreeSet<Runner>,
    /// When the first of the current pending joins was observed.
    pending_since: Timestamp,
    /// When the pending set last changed (a join or a pending runner leaving).
    pending_changed_at: Timestamp,
    /// Whether an assignment was ever published; the first one never waits.
    assignments_published: bool,
    /// Whether the rings changed since the last publication. Kept across observations until a
    /// publication happens (an observation that must register again does not publish).
    changed: bool,
}

/// What the caller must do after one observation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MembershipStep {
    /// Runners that left or turned unhealthy: call `Transport::on_runner_unavailable` for each.
    pub unavailable: Vec<RunnerAddress>,
    /// The last pending join left without being published: wake the acquisition loop, which
    /// was holding off while joins were pending.
    pub reopen_acquisition: bool,
    /// This process is a live runner missing from the registry: register again and observe
    /// again at once, without sleeping. Nothing is published in this step; the change is kept
    /// for the next observation.
    pub register_again: bool,
    /// The new assignment, when the healthy set changed. Replaces the previous one wholesale;
    /// the caller recomputes its own shards, wakes the acquisition loop and notifies shard lock
    /// waiters.
    pub assignment: Option<Assignment>,
    /// The number of healthy runners, pending ones included. A runner that sees zero marks
    /// itself healthy in the registry (the deadlock breaker of the reference), unless it must
    /// register again.
    pub healthy_count: usize,
    /// Whether joins are still pending after this step (see [`Membership::has_pending_joins`]).
    pub joins_pending: bool,
}

/// A published shard assignment: the owner of every shard of every group that has a runner.
///
/// Shards of groups without a healthy runner have no owner.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    owners: BTreeMap<ShardId, RunnerAddress>,
}

impl Membership {
    /// A sync loop that has observed nothing yet.
    pub fn new(config: MembershipConfig) -> Membership {
        Membership {
            config,
            rings: BTreeMap::new(),
            previous: BTreeMap::new(),
            healthy: BTreeSet::new(),
            pending: BTreeSet::new(),
            pending_since: Timestamp::UNIX_EPOCH,
            pending_changed_at: Timestamp::UNIX_EPOCH,
            assignments_published: false,
            changed: false,
        }
    }

    /// The configuration this loop was built with.
    pub fn config(&self) -> MembershipConfig {
        self.config
    }

    /// Whether `self_runner` must (re-)register before the next fetch: it was not in the
    /// previous observation (or nothing was observed yet).
    ///
    /// Only meaningful for a live runner that is not shutting down.
    pub fn needs_registration(&self, self_runner: &Runner) -> bool {
        !self.previous.contains_key(self_runner)
    }

    /// Whether joins are held back by the debounce. While they are, no runner acquires new
    /// shards: the assignment is about to change.
    pub fn has_pending_joins(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The number of healthy runners in the previous observation, pending ones included.
    pub fn healthy_count(&self) -> usize {
        self.healthy.len()
    }

    /// Whether `runner` was healthy in the previous observation (pending or not).
    pub fn is_healthy(&self, runner: &Runner) -> bool {
        self.healthy.contains(runner)
    }

    /// Whether an assignment was ever published.
    pub fn assignments_published(&self) -> bool {
        self.assignments_published
    }

    /// Applies one registry observation taken at `now`.
    ///
    /// `runners` is the result of `get_runners`. `self_runner` is this process's runner when it
    /// is a live runner that is not shutting down, `None` otherwise (clients, shutdown).
    pub fn observe(
        &mut self,
        now: Timestamp,
        runners: &[(Runner, bool)],
        self_runner: Option<&Runner>,
    ) -> MembershipStep {
        let current = dedup_by_address(runners);
        let mut step = MembershipStep::default();

        let to_ring = self.classify_joins(now, &current);
        self.apply_departures(now, &current, &mut step);
        for runner in &to_ring {
            self.add_to_rings(runner);
        }
        self.publish_pending_if_due(now);
        self.rings.retain(|_, ring| !ring.is_empty());
        self.previous = current;
        self.check_invariants();

        step.healthy_count = self.healthy.len();
        step.joins_pending = self.has_pending_joins();
        if self_runner.is_some_and(|runner| !self.previous.contains_key(runner)) {
            step.register_again = true;
            return step;
        }
        if self.changed {
            self.changed = false;
            self.assignments_published = true;
            step.assignment = Some(self.compute_assignment());
        }
        step
    }

    /// Records the runners that became healthy. Returns those that go straight into the rings;
    /// the others wait in `pending`.
    fn classify_joins(&mut self, now: Timestamp, current: &BTreeMap<Runner, bool>) -> Vec<Runner> {
        let debounced = !self.config.join_debounce.is_zero() && self.assignments_published;
        let mut to_ring = Vec::new();
        for (runner, healthy) in current {
            // healthy → healthy and unhealthy → unhealthy are no-ops; healthy → unhealthy is a
            // departure, handled by `apply_departures`.
            if !*healthy || self.healthy.contains(runner) {
                continue;
            }
            self.healthy.insert(runner.clone());
            if debounced {
                if self.pending.is_empty() {
                    self.pending_since = now;
                }
                self.pending_changed_at = now;
                self.pending.insert(runner.clone());
            } else {
                self.changed = true;
                to_ring.push(runner.clone());
            }
        }
        to_ring
    }

    /// Handles the runners of the previous observation that are missing now or turned
    /// unhealthy.
    fn apply_departures(
        &mut self,
        now: Timestamp,
        current: &BTreeMap<Runner, bool>,
        step: &mut MembershipStep,
    ) {
        let departed: Vec<Runner> = self
            .previous
            .keys()
            .filter(|runner| match current.get(*runner) {
                None => true,
                Some(healthy) => !*healthy && self.healthy.contains(*runner),
            })
            .cloned()
            .collect();
        for runner in departed {
            let joined = self.healthy.take(&runner);
            step.unavailable.push(runner.address.clone());
            // A pending runner owns no shards, so its departure only restarts the quiet period
            // instead of publishing the other joins mid-burst.
            if self.pending.remove(&runner) {
                self.pending_changed_at = now;
                if self.pending.is_empty() {
                    step.reopen_acquisition = true;
                }
                continue;
            }
            // Also for a runner that was never healthy: a harmless recompute, as in the reference.
            self.changed = true;
            if let Some(joined) = joined {
                self.remove_from_rings(&joined);
            }
        }
    }

    /// Moves the pending joins into the rings once the healthy set has been quiet for the
    /// debounce, the cap of four debounces is reached, or the assignment is recomputed anyway.
    fn publish_pending_if_due(&mut self, now: Timestamp) {
        if self.pending.is_empty() {
            return;
        }
        let debounce = self.config.join_debounce;
        let quiet = now.saturating_duration_since(self.pending_changed_at) >= debounce;
        let capped =
            now.saturating_duration_since(self.pending_since) >= debounce.saturating_mul(4);
        if !(self.changed || quiet || capped) {
            return;
        }
        self.changed = true;
        for runner in std::mem::take(&mut self.pending) {
            self.add_to_rings(&runner);
        }
    }

    fn add_to_rings(&mut self, runner: &Runner) {
        for group in &runner.groups {
            self.rings
                .entry(group.clone())
                .or_default()
                .add(runner.address.clone(), runner.weight.get());
        }
    }

    fn remove_from_rings(&mut self, runner: &Runner) {
        for group in &runner.groups {
            if let Some(ring) = self.rings.get_mut(group) {
                ring.remove(&runner.address);
            }
        }
    }

    fn compute_assignment(&self) -> Assignment {
        let mut owners = BTreeMap::new();
        for (group, ring) in &self.rings {
            let Some(ring_owners) = ring.get_shards(self.config.shards_per_group) else {
                continue;
            };
            for (shard_number, owner) in (1..=self.config.shards_per_group).zip(ring_owners) {
                owners.insert(ShardId::new(group.clone(), shard_number), owner.clone());
            }
        }
        Assignment { owners }
    }

    /// Asserts that the rings hold exactly the healthy runners that are not pending, and that
    /// the healthy set is exactly the healthy runners of the previous observation.
    fn check_invariants(&self) {
        debug_assert!(self.pending.is_subset(&self.healthy), "a pending runner is not healthy");
        debug_assert!(
            self.healthy
                .iter()
                .eq(self.previous.iter().filter_map(|(runner, healthy)| healthy.then_some(runner))),
            "the healthy set differs from the previous observation"
        );
        debug_assert!(
            {
                let mut expected: BTreeMap<&ShardGroup, BTreeSet<&RunnerAddress>> = BTreeMap::new();
                for runner in self.healthy.difference(&self.pending) {
                    for group in &runner.groups {
                        expected.entry(group).or_default().insert(&runner.address);
                    }
                }
                let actual: BTreeMap<&ShardGroup, BTreeSet<&RunnerAddress>> = self
                    .rings
                    .iter()
                    .map(|(group, ring)| (group, ring.nodes().collect()))
                    .collect();
                expected == actual
            },
            "the rings differ from the healthy runners that are not pending"
        );
    }
}

impl Assignment {
    /// The runner that owns `shard`, if its group has a runner.
    pub fn owner(&self, shard: &ShardId) -> Option<&RunnerAddress> {
        self.owners.get(shard)
    }

    /// The shards owned by `runner`.
    pub fn shards_of(&self, runner: &RunnerAddress) -> BTreeSet<ShardId> {
        self.owners
            .iter()
            .filter(|(_, owner)| *owner == runner)
            .map(|(shard, _)| shard.clone())
            .collect()
    }

    /// The number of shards that have an owner.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Whether no shard has an owner.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    /// Every shard with an owner, in shard order.
    pub fn iter(&self) -> impl Iterator<Item = (&ShardId, &RunnerAddress)> {
        self.owners.iter()
    }

    /// The groups that have owners, in order.
    pub fn groups(&self) -> BTreeSet<&ShardGroup> {
        self.owners.keys().map(ShardId::group).collect()
    }
}

/// An assignment built from its owners, as a tool or a test writes it down.
impl FromIterator<(ShardId, RunnerAddress)> for Assignment {
    fn from_iter<I: IntoIterator<Item = (ShardId, RunnerAddress)>>(owners: I) -> Assignment {
        Assignment { owners: owners.into_iter().collect() }
    }
}

/// The observation as a map, keeping the first entry of an address listed twice.
fn dedup_by_address(runners: &[(Runner, bool)]) -> BTreeMap<Runner, bool> {
    let mut addresses = BTreeSet::new();
    runners
        .iter()
        .filter(|(runner, _)| addresses.insert(&runner.address))
        .map(|(runner, healthy)| (runner.clone(), *healthy))
        .collect()
}

#[cfg(test)]
mod tests;
