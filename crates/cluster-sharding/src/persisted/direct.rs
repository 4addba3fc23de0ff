//! Direct delivery of persisted requests saved by the runner that serves their shard.
//!
//! The reference saves such a request and opens the storage read latch: the read loop then
//! claims it and hands it to its entity, one storage round trip later. Here the saving runner
//! hands it to its entity at once (the stored row stays unclaimed; the read loop skips it while
//! it runs and its reply settles), and the read loop is not woken. Storage stays the source of
//! truth: a crash before the final reply leaves the row for the next owner, as before.
//!
//! Order per entity is storage order. A request goes directly only when
//! - the read loop has caught up with the shard's stored backlog (its last exhaustive read
//!   covered the shard, so nothing older from before this runner took the shard is unread),
//! - no earlier local request to the same entity was left to the read loop (saved while direct
//!   delivery was off for it, or released by the read loop for a full mailbox, the residency
//!   cap or an unregistered type); those are tracked by id per address until the read loop
//!   delivers or answers them, and
//! - once it is saved, every unprocessed request stored before it for the same entity was
//!   taken up here already ([`MessageStorage::unprocessed_before`]): another process (a client,
//!   a TypeScript runner) may have stored one since the last read.
//!
//! Otherwise the request is left to the read loop, which is woken, and delivers in storage
//! order. Exactly once: the read loop leaves the rows of requests taken up here alone (see
//! `tracked`).
//!
//! [`MessageStorage::unprocessed_before`]: cluster_core::storage::MessageStorage::unprocessed_before

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::Arc;

use cluster_core::envelope::{Envelope, Request};
use cluster_core::storage::{SaveRequestOptions, UnprocessedMessage};
use cluster_core::{EntityAddress, ShardId, Snowflake};
use tracing::Instrument;

use super::tracked::{Claiming, Reservation};
use super::{Dispatched, Persisted, Unregistered, lock};
use crate::sharding::Sharding;

/// What direct delivery remembers (in [`Persisted`]).
#[derive(Default)]
pub(super) struct Direct {
    /// The shards the read loop's last exhaustive read covered.
    caught_up: BTreeSet<ShardId>,
    /// Per entity address, the local requests left to the read loop, not delivered yet.
    pending: BTreeMap<EntityAddress, BTreeSet<Snowflake>>,
}

impl Persisted {
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
    /// storage, and its entity type is registered for a unary request. If so it is reserved
    /// (before the save, so that the read loop, which may read it as soon as it is stored,
    /// and direct delivery never both run it). Otherwise an undelayed request to a served
    /// shard is held for the read loop (call [`Persisted::unhold`] if the save fails or finds
    /// a duplicate).
    pub(super) fn plan_direct(
        &self,
        persisted: &Arc<Persisted>,
        request: &Request,
        options: &SaveRequestOptions,
    ) -> Option<Reservation> {
        let address = &request.address;
        // A delayed request is meant to come after later ones: it neither goes directly nor
        // holds the requests after it back.
        if options.deliver_at.is_some() || !self.serves(&address.shard_id) {
            return None;
        }
        let direct = persisted.may_deliver_directly(address)
            && self
                .registered_manager(&address.entity_type)
                .is_some_and(|manager| !manager.is_stream(&request.tag));
        let reservation = direct.then(|| persisted.reserve(request.request_id)).flatten();
        if reservation.is_none() {
            persisted.hold(address, request.request_id);
        }
        reservation
    }

    /// Hands a request this runner just saved to its entity, once storage shows that every
    /// request stored before it for the entity reached it already. When it cannot go now (an
    /// earlier request unread here, a full mailbox, the residency cap, the shard let go
    /// meanwhile), it is held for the read loop, which is woken.
    pub(super) async fn deliver_directly(
        &self,
        persisted: &Arc<Persisted>,
        request: Request,
        reservation: Reservation,
    ) {
        let address = request.address.clone();
        let request_id = request.request_id;
        // The caller may go away while storage is asked: the stored request is then the read
        // loop's, which is woken at once rather than at its next poll.
        let mut left = LeftOnDrop { persisted, address: &address, request_id, armed: true };
        let in_order = self
            .nothing_undelivered_before(persisted, &request)
            .instrument(tracing::debug_span!("deliver_directly", %request_id))
            .await;
        left.armed = false;
        if !in_order {
            tracing::debug!(%request_id, "an earlier request is unread: left to the read loop");
            persisted.hold(&address, request_id);
            persisted.poll_storage();
            return;
        }
        let message =
            UnprocessedMessage { envelope: Envelope::Request(request), last_sent_reply: None };
        let mut unregistered = Unregistered::default();
        let dispatched = self.dispatch(persisted, message, &mut unregistered, Claiming::Reserved);
        // Claimed (kept by the claim), taken over by the read loop, or left to it.
        drop(reservation);
        unregistered.warn();
        match dispatched {
            Dispatched::Delivered | Dispatched::Skipped | Dispatched::Settled(_) => {}
            Dispatched::Answer(reply) => self.save_final_reply(persisted, reply, None).await,
            Dispatched::Release(_) | Dispatched::Retry(_) | Dispatched::Capped(_) => {
                tracing::debug!(%request_id, "not delivered directly; left to the read loop");
                persisted.hold(&address, request_id);
                persisted.poll_storage();
            }
        }
    }

    /// Whether every unprocessed request stored before `request` for its entity reached the
    /// entity here already (a failed lookup counts as no: the read loop then decides).
    async fn nothing_undelivered_before(&self, persisted: &Persisted, request: &Request) -> bool {
        let now = self.clock().now();
        let earlier = persisted
            .storage
            .unprocessed_before(&request.address, request.request_id, now, EARLIER_LIMIT)
            .await;
        match earlier {
            Ok(earlier) => earlier.iter().all(|id| persisted.was_delivered(*id)),
            Err(error) => {
                tracing::debug!(%error, request_id = %request.request_id, "could not look up earlier requests");
                false
            }
        }
    }
}

/// How many earlier unprocessed requests of an entity the order check reads: more than this
/// many of them running here at once leaves the request to the read loop.
const EARLIER_LIMIT: NonZeroU32 = NonZeroU32::new(16).expect("16 is not zero");

/// Leaves a saved request to the read loop when dropped armed, and wakes the loop.
struct LeftOnDrop<'a> {
    persisted: &'a Persisted,
    address: &'a EntityAddress,
    request_id: Snowflake,
    armed: bool,
}

impl Drop for LeftOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.persisted.hold(self.address, self.request_id);
            self.persisted.poll_storage();
        }
    }
}
