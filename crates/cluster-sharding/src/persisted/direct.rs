//! Direct delivery of persisted requests saved by the runner that serves their shard.
//!
//! The reference saves such a request and opens the storage read latch: the read loop then
//! claims it and hands it to its entity, one storage round trip later. Here the saving runner
//! hands it to its entity at once (the stored row stays unclaimed; the read loop skips it while
//! it runs and its reply settles), and the read loop is not woken. Storage stays the source of
//! truth: a crash before the final reply leaves the row for the next owner, as before.
//!
//! Order per entity is kept: a request goes directly only when
//! - the read loop has caught up with the shard's stored backlog (its last exhaustive read
//!   covered the shard, so nothing older from before this runner took the shard is unread), and
//! - no earlier local request to the same entity was left to the read loop (saved while direct
//!   delivery was off for it, or released by the read loop for a full mailbox, the residency
//!   cap or an unregistered type); those are tracked by id per address until the read loop
//!   delivers or answers them.
//!
//! Exactly once: a request is in `in_flight` while it runs and in `settling` from its exit
//! until its outcome is stored (the reference's per-round `processedRequestIds`): the read loop
//! skips both, so a row it read just before the final reply was saved does not run twice.
//! An id settled while a read runs is kept until that read ends (a later read selects after
//! the reply was stored, so it no longer returns the row), otherwise it is forgotten at once;
//! a skipped settled row's claim is released after the read, in case its outcome was to run
//! again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use cluster_core::envelope::{Envelope, Request};
use cluster_core::storage::{SaveRequestOptions, UnprocessedMessage};
use cluster_core::{EntityAddress, ShardId, Snowflake};
use tracing::Instrument;

use super::{Dispatched, Persisted, lock, warn_unregistered};
use crate::sharding::Sharding;

/// What direct delivery remembers (in [`Persisted`]).
#[derive(Default)]
pub(super) struct Direct {
    /// The shards the read loop's last exhaustive read covered.
    caught_up: BTreeSet<ShardId>,
    /// Per entity address, the local requests left to the read loop, not delivered yet.
    pending: BTreeMap<EntityAddress, BTreeSet<Snowflake>>,
}

/// The requests whose outcome is being stored, or was during the current read.
#[derive(Default)]
pub(super) struct Settling {
    /// A read is between its select and the end of its dispatching.
    reading: bool,
    requests: BTreeMap<Snowflake, Settle>,
}

/// Where a request's outcome is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// Its exit is in; its reply (or its release) is being stored.
    Settling,
    /// Stored during the current read; forgotten when it ends.
    Settled,
}

/// Marks a request as settled when its outcome is stored (or the storing task ends).
pub(super) struct SettleGuard {
    persisted: Arc<Persisted>,
    request_id: Snowflake,
}

impl Drop for SettleGuard {
    fn drop(&mut self) {
        let mut settling = lock(&self.persisted.settling);
        if settling.reading {
            // The current read may have selected the row before its reply was stored.
            if let Some(state) = settling.requests.get_mut(&self.request_id) {
                *state = Settle::Settled;
            }
        } else {
            // The next read selects after the reply was stored: it will not return the row.
            settling.requests.remove(&self.request_id);
        }
    }
}

impl Persisted {
    /// The request's exit is in: until the guard drops, and then until the next read begins,
    /// the read loop leaves its row alone. Called before it leaves `in_flight`.
    pub(super) fn begin_settle(self: &Arc<Persisted>, request_id: Snowflake) -> SettleGuard {
        lock(&self.settling).requests.insert(request_id, Settle::Settling);
        SettleGuard { persisted: Arc::clone(self), request_id }
    }

    /// A read is about to select.
    pub(super) fn begin_read(&self) {
        lock(&self.settling).reading = true;
    }

    /// The read dispatched what it selected (or failed): the requests settled meanwhile are
    /// forgotten, as the next read selects after their replies were stored.
    pub(super) fn end_read(&self) {
        let mut settling = lock(&self.settling);
        settling.reading = false;
        settling.requests.retain(|_, state| *state == Settle::Settling);
    }

    /// Whether the read loop must leave this request's row alone (its outcome is being stored,
    /// or was during this read).
    pub(super) fn is_settling(&self, request_id: Snowflake) -> bool {
        lock(&self.settling).requests.contains_key(&request_id)
    }

    /// Whether a request to `address` may go directly to its entity now.
    fn may_deliver_directly(&self, address: &EntityAddress) -> bool {
        let direct = lock(&self.direct);
        direct.caught_up.contains(&address.shard_id) && !direct.pending.contains_key(address)
    }

    /// Leaves `request_id` to the read loop: later local requests to `address` follow it there.
    pub(super) fn hold(&self, address: &EntityAddress, request_id: Snowflake) {
        lock(&self.direct).pending.entry(address.clone()).or_default().insert(request_id);
    }

    /// The read loop delivered or answered `request_id` (or it was a duplicate).
    pub(super) fn unhold(&self, address: &EntityAddress, request_id: Snowflake) {
        let mut direct = lock(&self.direct);
        if let Some(ids) = direct.pending.get_mut(address) {
            ids.remove(&request_id);
            if ids.is_empty() {
                direct.pending.remove(address);
            }
        }
    }

    /// A read that began with `read` held ended, and `held` are held now. If it was
    /// exhaustive (less than a batch, every address), the backlog of the shards in both is
    /// read. Holds on shards no longer held are dropped (their next owner orders them); holds
    /// on a shard taken during the read stay, so that the next read delivers them first.
    pub(super) fn caught_up(&self, read: &[ShardId], held: &[ShardId], exhaustive: bool) {
        let mut direct = lock(&self.direct);
        let held: BTreeSet<&ShardId> = held.iter().collect();
        direct.pending.retain(|address, _| held.contains(&address.shard_id));
        if exhaustive {
            direct.caught_up = read.iter().filter(|shard| held.contains(shard)).cloned().collect();
        } else {
            direct.caught_up.retain(|shard| held.contains(shard));
        }
    }
}

impl Sharding {
    /// Whether a request about to be saved may go directly to its entity once saved: it is not
    /// delayed, its shard is served and caught up, nothing earlier to its entity waits in
    /// storage, and its entity type is registered for a unary request. Otherwise an undelayed
    /// request to a served shard is held for the read loop (call [`Persisted::unhold`] if the
    /// save fails or finds a duplicate).
    pub(super) fn plan_direct(
        &self,
        persisted: &Persisted,
        request: &Request,
        options: &SaveRequestOptions,
    ) -> bool {
        let address = &request.address;
        // A delayed request is meant to come after later ones: it neither goes directly nor
        // holds the requests after it back.
        if options.deliver_at.is_some() || !self.serves(&address.shard_id) {
            return false;
        }
        let direct = persisted.may_deliver_directly(address)
            && self
                .registered_manager(&address.entity_type)
                .is_some_and(|manager| !manager.is_stream(&request.tag));
        if !direct {
            persisted.hold(address, request.request_id);
        }
        direct
    }

    /// Hands a request this runner just saved to its entity. When it cannot go now (a full
    /// mailbox, the residency cap, the shard let go meanwhile), it is held for the read loop,
    /// which is woken.
    pub(super) async fn deliver_directly(&self, persisted: &Arc<Persisted>, request: Request) {
        let address = request.address.clone();
        let request_id = request.request_id;
        let message =
            UnprocessedMessage { envelope: Envelope::Request(request), last_sent_reply: None };
        let mut held = BTreeMap::new();
        // The caller may go away while the dispatch waits (for a transaction to begin): the
        // stored request is then the read loop's, which is woken at once rather than at its
        // next poll.
        let mut wake = WakeOnDrop(Some(persisted));
        let dispatched = self
            .dispatch(persisted, message, (&mut None, &mut held))
            .instrument(tracing::debug_span!("deliver_directly", %request_id))
            .await;
        wake.0 = None;
        warn_unregistered(held);
        match dispatched {
            Dispatched::Delivered | Dispatched::Skipped => {}
            Dispatched::Answer(reply) => self.save_final_reply(persisted, reply, None).await,
            Dispatched::Release(_) | Dispatched::Retry(_) | Dispatched::Capped(_) => {
                tracing::debug!(%request_id, "not delivered directly; left to the read loop");
                persisted.hold(&address, request_id);
                persisted.poll_storage();
            }
        }
    }
}

/// Wakes the storage read loop when dropped armed.
struct WakeOnDrop<'a>(Option<&'a Persisted>);

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(persisted) = self.0 {
            persisted.poll_storage();
        }
    }
}
