//! Which shards this runtime serves now, and whether it may store a final reply of one.
//!
//! - **A cluster member** serves the shards whose lock it took (`member`).
//! - **A single runner** serves every shard while its leases are confirmed (`single_runner`).
//! - **A runner on a storage of its own** serves every shard of its groups.
//! - **A client** serves none, and neither does a runtime that is shutting down.

use std::sync::{Arc, OnceLock};

use cluster_core::ShardId;

use crate::placement::member::Member;
use crate::placement::single_runner::HeldLocks;
use crate::runtime::delivery::Serving;
use crate::runtime::interrupt::FlaggedToken;

/// The shards this runtime serves.
pub(crate) struct Shards {
    /// Whether this process hosts entities (it has a runner address).
    runner: bool,
    /// Set when the runtime stops: it serves nothing from then on. Every request reads its
    /// flag.
    shutdown: FlaggedToken,
    /// Membership and shard locks, when several runners share the storage.
    member: Option<Arc<Member>>,
    /// The shard locks of a single runner, if it holds them in a runner storage.
    locks: OnceLock<Arc<HeldLocks>>,
    /// Every shard of the runner's groups: what a runner without a cluster serves.
    all: Vec<ShardId>,
}

impl Shards {
    /// The shards of a runtime that is a runner (or not), a member of `member`'s cluster (or
    /// not), with `all` the shards of its groups.
    pub(crate) fn new(runner: bool, member: Option<Arc<Member>>, all: Vec<ShardId>) -> Shards {
        let shutdown = FlaggedToken::default();
        Shards { runner, shutdown, member, locks: OnceLock::new(), all }
    }

    /// The runtime's shutdown: set when it stops.
    pub(crate) fn shutdown(&self) -> &FlaggedToken {
        &self.shutdown
    }

    /// Whether this process hosts entities (it has a runner address).
    pub(crate) fn is_runner(&self) -> bool {
        self.runner
    }

    /// The cluster member, when several runners share the storage.
    pub(crate) fn member(&self) -> Option<&Arc<Member>> {
        self.member.as_ref()
    }

    /// Keeps `locks`: the shards are served while they confirm them. Set once, by a single
    /// runner's start.
    pub(crate) fn hold_locks(&self, locks: Arc<HeldLocks>) {
        if self.locks.set(locks).is_err() {
            tracing::error!("a single runner's locks were set twice; the first are kept");
        }
    }

    /// The shard locks of a single runner, if it holds them in a runner storage.
    pub(crate) fn held_locks(&self) -> Option<&Arc<HeldLocks>> {
        self.locks.get()
    }

    /// Whether this runner serves requests of `shard` now.
    ///
    /// It does when it holds the shard's lock and is not shutting down.
    /// A single runner holds every lock.
    pub(crate) fn serves(&self, shard: &ShardId) -> bool {
        if self.shutdown.is_cancelled() || !self.runner {
            return false;
        }
        match &self.member {
            Some(member) => member.is_acquired(shard),
            None => self.locks.get().is_none_or(|locks| locks.serves(shard)),
        }
    }

    /// Whether a request of `shard` may be handed to an entity here now.
    ///
    /// - This runner serves the shard ([`Shards::serves`]).
    /// - Its lock was confirmed within the lease (`placement::lock_lease`).
    ///   A runner frozen past the lease (a stopped process, a paused machine) may have lost the
    ///   lock without knowing yet: it hands nothing to an entity until a refresh answers, as its
    ///   read loop reads nothing.
    ///
    /// Every way to an entity checks this: the managers' admission, direct delivery, pushed
    /// requests, volatile ones.
    /// Ownership decisions (whether a shard moved) read [`Shards::serves`].
    pub(crate) fn delivers(&self, shard: &ShardId) -> bool {
        if self.shutdown.is_cancelled() || !self.runner {
            return false;
        }
        match &self.member {
            Some(member) => member.delivers(shard),
            None => self.locks.get().is_none_or(|locks| locks.delivers(shard)),
        }
    }

    /// Waits while `shard` is assigned to this runner but its lock is not taken yet, then
    /// tells whether a request of it may be handed to an entity here ([`Shards::delivers`]).
    ///
    /// The previous owner is still draining the shard (`effect/src/cluster/Sharding.ts`).
    /// The wait lasts at most `shard_lock_expiration`.
    pub(crate) async fn await_shard(&self, shard: &ShardId) -> bool {
        if let Some(member) = &self.member {
            member.await_lock(shard, || self.shutdown.is_cancelled()).await;
        }
        self.delivers(shard)
    }

    /// Whether this runner may store the final reply of a request of `shard`
    /// (`effect/src/cluster/Sharding.ts`, effect 4.1.0).
    ///
    /// - A cluster member confirms the shard's lock with a refresh (see `Member::confirm_lock`).
    /// - A single runner confirms from its leases' last refresh (`single_runner`).
    /// - A runtime without shard locks may always store.
    pub(crate) async fn confirm(&self, shard: &ShardId) -> bool {
        if let Some(member) = &self.member {
            return member.confirm_lock(shard).await;
        }
        let confirmed = self.locks.get().is_none_or(|locks| locks.confirms(shard));
        if !confirmed {
            tracing::warn!(%shard, "shard lock not confirmed: the final reply is left for the next owner");
        }
        confirmed
    }

    /// Every shard of the runner's groups.
    pub(crate) fn all(&self) -> &[ShardId] {
        &self.all
    }

    /// The shards this runner holds the lock of and runs (every shard of its groups for a
    /// single runner; none for a client).
    pub(crate) fn acquired(&self) -> Vec<ShardId> {
        match &self.member {
            Some(member) => member.acquired(),
            None if self.runner && !self.shutdown.is_cancelled() => {
                match self.locks.get().and_then(|locks| locks.served()) {
                    Some(served) => served,
                    None => self.all.clone(),
                }
            }
            None => Vec::new(),
        }
    }
}

/// What a manager checks before it admits a request: the last gate of every way to an entity.
impl Serving for Shards {
    fn serves(&self, shard: &ShardId) -> bool {
        Shards::delivers(self, shard)
    }
}
