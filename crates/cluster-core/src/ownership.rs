//! A runner's shard ownership sets (`effect/src/cluster/Sharding.ts`): which shards are
//! assigned to it, which it holds the lock of and runs, and which it is letting go of.
//!
//! The shard acquisition loop, the lock refresh loop, the registry sync loop, the per-shard
//! releases and the shutdown handoff all read and change these sets. In the reference they are
//! shared mutable sets touched from several fibers; here they are one value whose transitions are
//! methods, each asserting the invariants, so the rules that keep a shard from running twice are
//! written and tested in one place. The caller does the I/O (lock storage calls, interrupting
//! entities, singletons, latches) and feeds the results back.
//!
//! # The sets
//!
//! - `self_shards`: the shards the current assignment gives this runner. Only the assignment: it
//!   makes nothing active.
//! - `acquired`: the shards whose lock this runner holds and whose entities, storage reads and
//!   singletons may run. The only set that makes a shard active.
//! - `releasing`: shards still locked while their entities stop; their locks are released next.
//!   They still accept acks and interrupts for draining entities, and their lock still fences
//!   final replies.
//! - `force_releasing`: releasing shards whose entities are interrupted without a graceful wait
//!   and whose locks are dropped together by `releaseAll`, after lock storage turned unhealthy.
//!
//! # Invariants
//!
//! - `acquired` and `releasing` are disjoint.
//! - `force_releasing` ⊆ `releasing`.
//! - While lock storage is unhealthy, `acquired` and `self_shards` are empty.
//! - No shard is activated while lock storage is unhealthy, a forced release is pending, joins
//!   are pending (the assignment is about to change) or the runner is shutting down: `releaseAll`
//!   would wipe a freshly acquired lock, and a shard taken for a joining runner would be handed
//!   off again at once.

use std::collections::BTreeSet;

use crate::ids::ShardId;

/// The ownership sets of one runner, and the health of its lock storage.
#[derive(Clone, Debug)]
pub struct ShardOwnership {
    self_shards: BTreeSet<ShardId>,
    acquired: BTreeSet<ShardId>,
    releasing: BTreeSet<ShardId>,
    force_releasing: BTreeSet<ShardId>,
    locks_healthy: bool,
    forced_release_running: bool,
}

/// The conditions outside the ownership sets that stop the acquisition of new shards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AcquisitionGates {
    /// The runner is shutting down: it takes no new shards.
    pub shutting_down: bool,
    /// Runner joins are held by the join debounce, so the assignment is about to change
    /// ([`Membership::has_pending_joins`](crate::membership::Membership::has_pending_joins)).
    pub joins_pending: bool,
}

/// What became of the shards that lock storage reported as acquired.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AcquiredShards {
    /// Now active: entities may be spawned, storage read and singletons run.
    pub activated: Vec<ShardId>,
    /// Locked, but not to be run (the state changed while the locks were being taken): moved to
    /// `releasing`, so they are released without running anything.
    pub to_release: Vec<ShardId>,
}

impl Default for ShardOwnership {
    fn default() -> ShardOwnership {
        ShardOwnership::new()
    }
}

impl ShardOwnership {
    /// No shards, healthy lock storage.
    pub fn new() -> ShardOwnership {
        ShardOwnership {
            self_shards: BTreeSet::new(),
            acquired: BTreeSet::new(),
            releasing: BTreeSet::new(),
            force_releasing: BTreeSet::new(),
            locks_healthy: true,
            forced_release_running: false,
        }
    }

    // --- transitions ---

    /// Replaces the shards assigned to this runner after the assignment was recomputed.
    ///
    /// `self_shards` holds the shards the new assignment gives this runner. While lock storage
    /// is unhealthy they are ignored and no shard counts as assigned, as in the reference;
    /// [`mark_healthy`](Self::mark_healthy) rebuilds them.
    pub fn set_assignment(&mut self, self_shards: impl IntoIterator<Item = ShardId>) {
        self.self_shards =
            if self.locks_healthy { self_shards.into_iter().collect() } else { BTreeSet::new() };
        self.check_invariants();
    }

    /// Step 1 of an acquisition round: every acquired shard that is no longer assigned to this
    /// runner, or every acquired shard while `handing_off`, starts releasing.
    ///
    /// Returns the shards that moved, in order.
    pub fn begin_round(&mut self, handing_off: bool) -> Vec<ShardId> {
        let moved: Vec<ShardId> = self
            .acquired
            .iter()
            .filter(|shard| handing_off || !self.self_shards.contains(*shard))
            .cloned()
            .collect();
        for shard in &moved {
            self.start_releasing(shard);
        }
        self.check_invariants();
        moved
    }

    /// The shards to ask lock storage for: assigned, neither acquired nor releasing.
    ///
    /// Empty while lock storage is unhealthy, a forced release is pending, the runner is
    /// shutting down or joins are pending.
    pub fn shards_to_acquire(&self, gates: AcquisitionGates) -> Vec<ShardId> {
        if !self.may_take_shards(gates) {
            return Vec::new();
        }
        self.self_shards
            .iter()
            .filter(|shard| !self.acquired.contains(*shard) && !self.releasing.contains(*shard))
            .cloned()
            .collect()
    }

    /// Records the shards lock storage locked for this runner (the result of `acquire`).
    ///
    /// The state may have changed while the call was in flight, so each shard is re-checked:
    /// if lock storage turned unhealthy, a forced release is pending, `joins_pending`, the shard
    /// is releasing or no longer assigned, it goes to `releasing` (released without running
    /// anything); otherwise it becomes active. A shard already acquired (not asked for) is left
    /// as it is.
    pub fn on_acquired(&mut self, acquired: &[ShardId], joins_pending: bool) -> AcquiredShards {
        let take = self.may_take_shards(AcquisitionGates { shutting_down: false, joins_pending });
        let mut outcome = AcquiredShards::default();
        let mut seen = BTreeSet::new();
        for shard in acquired {
            if !seen.insert(shard) || self.acquired.contains(shard) {
                continue;
            }
            if take && !self.releasing.contains(shard) && self.self_shards.contains(shard) {
                self.acquired.insert(shard.clone());
                outcome.activated.push(shard.clone());
            } else {
                self.releasing.insert(shard.clone());
                outcome.to_release.push(shard.clone());
            }
        }
        self.check_invariants();
        outcome
    }

    /// Applies the result of a lock refresh (`releaseLostShards`, effect 4.1.0).
    ///
    /// `refreshed` is what was sent (acquired and releasing shards when the call started) and
    /// `returned` what lock storage confirmed. Every refreshed shard still acquired that was not
    /// returned, or was returned but is no longer assigned to this runner, starts releasing.
    /// Shards acquired while the call was in flight are absent from `refreshed` and untouched.
    ///
    /// Returns whether any shard is releasing: the caller then wakes the acquisition loop.
    pub fn release_lost_shards(&mut self, refreshed: &[ShardId], returned: &[ShardId]) -> bool {
        let returned: BTreeSet<&ShardId> = returned.iter().collect();
        for shard in refreshed {
            if self.acquired.contains(shard)
                && (!returned.contains(shard) || !self.self_shards.contains(shard))
            {
                self.start_releasing(shard);
            }
        }
        self.check_invariants();
        !self.releasing.is_empty()
    }

    /// Lock storage failed (a refresh failed or timed out): ownership is uncertain.
    ///
    /// Nothing is assigned or acquired any more; every shard that was acquired or releasing is
    /// releasing and force-releasing. Returns those shards, whose entities the caller
    /// interrupts at once, or `None` when lock storage was already unhealthy.
    pub fn mark_unhealthy(&mut self) -> Option<Vec<ShardId>> {
        if !self.locks_healthy {
            return None;
        }
        self.locks_healthy = false;
        self.self_shards.clear();
        let mut affected = std::mem::take(&mut self.acquired);
        affected.extend(self.releasing.iter().cloned());
        for shard in &affected {
            self.releasing.insert(shard.clone());
            self.force_releasing.insert(shard.clone());
        }
        self.check_invariants();
        Some(affected.into_iter().collect())
    }

    /// Lock storage answered again: `self_shards` is rebuilt from the current assignment.
    ///
    /// Returns whether this changed anything (false when lock storage was already healthy).
    /// Shards are still not taken until the forced release, if any, has finished.
    pub fn mark_healthy(&mut self, self_shards: impl IntoIterator<Item = ShardId>) -> bool {
        if self.locks_healthy {
            return false;
        }
        self.locks_healthy = true;
        self.self_shards = self_shards.into_iter().collect();
        self.check_invariants();
        true
    }

    /// Starts the forced release of the force-releasing shards (their entities are interrupted,
    /// then every lock of the runner is dropped with `releaseAll`).
    ///
    /// Returns the shards to release, or `None` when a forced release is already running or
    /// nothing is force-releasing.
    pub fn start_forced_release(&mut self) -> Option<Vec<ShardId>> {
        if self.forced_release_running || self.force_releasing.is_empty() {
            return None;
        }
        self.forced_release_running = true;
        self.check_invariants();
        Some(self.force_releasing.iter().cloned().collect())
    }

    /// The forced release ended: `released` (the shards returned by
    /// [`start_forced_release`](Self::start_forced_release), or none if it was abandoned) are no
    /// longer held.
    pub fn finish_forced_release(&mut self, released: &[ShardId]) {
        self.forced_release_running = false;
        for shard in released {
            self.releasing.remove(shard);
            self.force_releasing.remove(shard);
        }
        self.check_invariants();
    }

    /// The per-shard release of `shard` finished: its lock is released.
    pub fn release_finished(&mut self, shard: &ShardId) {
        self.releasing.remove(shard);
        self.force_releasing.remove(shard);
        self.check_invariants();
    }

    // --- queries ---

    /// Whether `shard` is active on this runner (locked and running).
    pub fn is_acquired(&self, shard: &ShardId) -> bool {
        self.acquired.contains(shard)
    }

    /// Whether `shard` is still held while its entities stop.
    pub fn is_releasing(&self, shard: &ShardId) -> bool {
        self.releasing.contains(shard)
    }

    /// Whether `shard` is being force-released.
    pub fn is_force_releasing(&self, shard: &ShardId) -> bool {
        self.force_releasing.contains(shard)
    }

    /// Whether `shard` is assigned to this runner by the current assignment.
    pub fn is_assigned(&self, shard: &ShardId) -> bool {
        self.self_shards.contains(shard)
    }

    /// Whether this runner may still hold `shard`'s lock (acquired or releasing): the
    /// precondition for confirming the lock before storing a final reply
    /// (`effect/src/cluster/Sharding.ts`). Otherwise the reply is fenced without asking lock
    /// storage.
    pub fn is_owned_or_releasing(&self, shard: &ShardId) -> bool {
        self.acquired.contains(shard) || self.releasing.contains(shard)
    }

    /// Whether a request for `shard` should wait for its lock rather than bounce
    /// (`effect/src/cluster/Sharding.ts`): the shard is assigned to this runner, not yet acquired,
    /// and the runner is not shutting down.
    pub fn is_awaiting_lock(&self, shard: &ShardId, shutting_down: bool) -> bool {
        !shutting_down && self.self_shards.contains(shard) && !self.acquired.contains(shard)
    }

    /// Whether acks and interrupts for `shard` are accepted (`effect/src/cluster/Sharding.ts`): it
    /// is acquired, or releasing with entities still draining.
    pub fn accepts_envelope(&self, shard: &ShardId) -> bool {
        self.is_owned_or_releasing(shard)
    }

    /// Whether the shutdown handoff is complete (`effect/src/cluster/Sharding.ts`): nothing
    /// acquired, nothing releasing and no forced release pending.
    pub fn is_handed_off(&self) -> bool {
        self.acquired.is_empty() && self.releasing.is_empty() && !self.forced_release_pending()
    }

    /// Whether a forced release is running or waiting to start. No shard is taken meanwhile,
    /// because its `releaseAll` would drop the new lock.
    pub fn forced_release_pending(&self) -> bool {
        self.forced_release_running || !self.force_releasing.is_empty()
    }

    /// Whether lock storage is considered healthy.
    pub fn locks_healthy(&self) -> bool {
        self.locks_healthy
    }

    /// The shards assigned to this runner, in order.
    pub fn self_shards(&self) -> impl Iterator<Item = &ShardId> {
        self.self_shards.iter()
    }

    /// The active shards, in order.
    pub fn acquired(&self) -> impl Iterator<Item = &ShardId> {
        self.acquired.iter()
    }

    /// The releasing shards (force-releasing ones included), in order.
    pub fn releasing(&self) -> impl Iterator<Item = &ShardId> {
        self.releasing.iter()
    }

    /// Every shard whose lock this runner holds: acquired, then releasing. This is what a lock
    /// refresh sends and what the shutdown handoff interrupts.
    pub fn held(&self) -> Vec<ShardId> {
        self.acquired.iter().chain(&self.releasing).cloned().collect()
    }

    /// The number of assigned shards.
    pub fn n_self_shards(&self) -> usize {
        self.self_shards.len()
    }

    /// The number of active shards (the `effect_cluster_shards` gauge).
    pub fn n_acquired(&self) -> usize {
        self.acquired.len()
    }

    /// The number of releasing shards (the `effect_cluster_shards_releasing` gauge).
    pub fn n_releasing(&self) -> usize {
        self.releasing.len()
    }

    /// The number of force-releasing shards.
    pub fn n_force_releasing(&self) -> usize {
        self.force_releasing.len()
    }

    // --- internals ---

    /// Whether new shards may become active, ignoring the per-shard conditions.
    fn may_take_shards(&self, gates: AcquisitionGates) -> bool {
        self.locks_healthy
            && !self.forced_release_pending()
            && !gates.shutting_down
            && !gates.joins_pending
    }

    fn start_releasing(&mut self, shard: &ShardId) {
        self.acquired.remove(shard);
        self.releasing.insert(shard.clone());
    }

    fn check_invariants(&self) {
        debug_assert!(
            self.acquired.is_disjoint(&self.releasing),
            "acquired and releasing overlap: {:?}",
            self.acquired.intersection(&self.releasing).collect::<Vec<_>>()
        );
        debug_assert!(
            self.force_releasing.is_subset(&self.releasing),
            "force-releasing shards that are not releasing: {:?}",
            self.force_releasing.difference(&self.releasing).collect::<Vec<_>>()
        );
        debug_assert!(
            self.locks_healthy || (self.acquired.is_empty() && self.self_shards.is_empty()),
            "shards assigned or acquired while lock storage is unhealthy"
        );
    }
}

#[cfg(test)]
mod tests;
