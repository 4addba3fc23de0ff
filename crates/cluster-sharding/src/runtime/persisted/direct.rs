//! Direct delivery of persisted requests saved by the runner that serves their shard.
//!
//! The reference saves such a request and opens the storage read latch.
//! The read loop then claims it and hands it to its entity, one storage round trip later.
//! Here the saving runner hands it to its entity at once, and the read loop is not woken:
//!
//! - the stored row stays unclaimed;
//! - the read loop skips the row while the request runs and while its reply settles.
//!
//! Storage stays the source of truth.
//! A crash before the final reply leaves the row for the next owner, as before.
//!
//! # Order
//!
//! Order per entity is storage order.
//! A request goes directly only when all of these hold:
//!
//! - **Within the lease.** The shard's lock was confirmed within the lease, as the read loop
//!   requires before it reads the shard (`Shards::delivers`).
//!   A runner frozen past it may have lost the lock without knowing yet, and the row it would
//!   run stays unclaimed: the next owner would run it too.
//! - **Caught up.** The read loop has caught up with the shard's stored backlog.
//!   Its last exhaustive read covered the shard, so nothing older from before this runner took
//!   the shard is unread.
//! - **Nothing held back.** No earlier local request to the same entity was left to the read
//!   loop.
//!   Such a request was saved while direct delivery was off for it, or released by the read
//!   loop (a full mailbox, the residency cap, an unregistered type).
//!   Those requests are tracked by id per address until the read loop delivers or answers them.
//! - **Nothing earlier in storage.** Once the request is saved, every unprocessed request stored
//!   before it for the same entity was taken up here already.
//!   This is read with the save ([`MessageStorage::unprocessed_before`]).
//!   Another process (a client, a TypeScript runner) may have stored one since the last read.
//!
//! Otherwise the request is left to the read loop, which is woken and delivers in storage order.
//!
//! # Exactly once
//!
//! The read loop leaves the rows of requests taken up here alone (see `tracked`).
//!
//! [`MessageStorage::unprocessed_before`]: cluster_core::storage::MessageStorage::unprocessed_before

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

use cluster_core::envelope::{Envelope, Request};
use cluster_core::storage::{SaveRequestOptions, SaveResult, UnprocessedMessage};
use cluster_core::sync::lock;
use cluster_core::{ClusterError, EntityAddress, ShardId, Snowflake};

use cluster_core::Clock;
use cluster_core::storage::MessageStorage;

use super::lifecycle::Claiming;
use super::runs::{Dispatched, Runs, Unregistered};
use super::tracked::{Reservation, TrackedRequests};
use crate::placement::shards::Shards;
use crate::runtime::delivery::ReadLatch;
use crate::runtime::registry::Managers;

/// Direct delivery and what it works with.
pub(super) struct DirectDelivery {
    /// Where a request admitted here goes.
    pub(super) runs: Arc<Runs>,
    /// The order per entity, shared with the read loop.
    pub(super) order: Arc<DirectOrder>,
    pub(super) storage: Arc<dyn MessageStorage>,
    /// The shards served, and the lease of their locks.
    pub(super) serving: Arc<Shards>,
    /// Reserves a request before its save, and waits for the earlier ones.
    pub(super) tracked: Arc<TrackedRequests>,
    pub(super) managers: Arc<Managers>,
    /// Wakes the read loop for the requests left to it.
    pub(super) read_latch: Arc<ReadLatch>,
    pub(super) clock: Arc<dyn Clock>,
}

/// What direct delivery remembers of the order per entity, shared with the read loop.
#[derive(Default)]
pub(super) struct DirectOrder(Mutex<Order>);

#[derive(Default)]
struct Order {
    /// The shards the read loop's last exhaustive read covered.
    caught_up: BTreeSet<ShardId>,
    /// Per entity address, the local requests left to the read loop, not delivered yet.
    pending: BTreeMap<EntityAddress, BTreeSet<Snowflake>>,
}

impl DirectOrder {
    /// Whether the read loop caught up with `address`'s shard and holds nothing back for
    /// `address`: a request to it may go directly.
    fn open(&self, address: &EntityAddress) -> bool {
        let order = lock(&self.0);
        order.caught_up.contains(&address.shard_id) && !order.pending.contains_key(address)
    }

    /// Leaves `request_id` to the read loop: later local requests to `address` follow it there.
    pub(super) fn hold(&self, address: &EntityAddress, request_id: Snowflake) {
        lock(&self.0).pending.entry(address.clone()).or_default().insert(request_id);
    }

    /// The read loop delivered or answered `request_id` (or it was a duplicate).
    pub(super) fn unhold(&self, address: &EntityAddress, request_id: Snowflake) {
        let mut order = lock(&self.0);
        if let Some(ids) = order.pending.get_mut(address) {
            ids.remove(&request_id);
            if ids.is_empty() {
                order.pending.remove(address);
            }
        }
    }

    /// A read that began with `read` held ended, and `held` are held now.
    ///
    /// - If the read was exhaustive (less than a batch, every address), the backlog of the
    ///   shards in both `read` and `held` is read.
    /// - Holds on shards no longer held are dropped: their next owner orders them.
    /// - Holds on a shard taken during the read stay, so that the next read delivers them
    ///   first.
    pub(super) fn caught_up(&self, read: &[ShardId], held: &[ShardId], exhaustive: bool) {
        let mut order = lock(&self.0);
        let held: BTreeSet<&ShardId> = held.iter().collect();
        order.pending.retain(|address, _| held.contains(&address.shard_id));
        if exhaustive {
            order.caught_up = read.iter().filter(|shard| held.contains(shard)).cloned().collect();
        } else {
            order.caught_up.retain(|shard| held.contains(shard));
        }
    }
}

impl DirectDelivery {
    /// Whether a request about to be saved may go directly to its entity once saved.
    ///
    /// It may when all of these hold:
    ///
    /// - it is not delayed;
    /// - its shard is served, within the lease of its last lock confirmation, and caught up;
    /// - nothing earlier to its entity waits in storage;
    /// - it is a unary request, of an entity type registered here.
    ///
    /// If so, it is reserved before the save.
    /// The read loop may read it as soon as it is stored, and the reservation keeps the read loop
    /// and direct delivery from both running it.
    /// Otherwise an undelayed request to a served shard is held for the read loop.
    /// Call [`DirectOrder::unhold`] if the save fails or finds a duplicate.
    pub(super) fn plan(
        &self,
        request: &Request,
        options: &SaveRequestOptions,
    ) -> Option<Reservation> {
        let address = &request.address;
        // A delayed request is meant to come after later ones.
        // So it neither goes directly nor holds the requests after it back.
        if options.deliver_at.is_some() || !self.serving.serves(&address.shard_id) {
            return None;
        }
        let reservation = self.reserve(request);
        if reservation.is_none() {
            self.order.hold(address, request.request_id);
        }
        reservation
    }

    /// Reserves `request` for direct delivery if [`admits_directly`](Self::admits_directly)
    /// admits it and it is not taken up here already.
    pub(super) fn reserve(&self, request: &Request) -> Option<Reservation> {
        self.admits_directly(request).then(|| self.tracked.reserve(request.request_id)).flatten()
    }

    /// Whether `request` may go to its entity without the read loop now: the one check of
    /// direct delivery, for the requests saved here and those pushed here.
    ///
    /// - Its shard is served, within the lease of its last lock confirmation
    ///   ([`Shards::delivers`](crate::placement::shards::Shards::delivers)).
    ///   A runner frozen past it may have lost the shard, and the request's row is unclaimed,
    ///   so the next owner would run it too.
    /// - The read loop caught up with the shard, and holds back no earlier request of the
    ///   entity.
    /// - It is a unary request of an entity type registered here: a stream goes through the
    ///   read loop, which resumes it after its last stored chunk.
    ///
    /// Every delivery, the read loop's included, checks the lease again once the request is
    /// claimed (`dispatch`).
    fn admits_directly(&self, request: &Request) -> bool {
        let address = &request.address;
        self.serving.delivers(&address.shard_id)
            && self.order.open(address)
            && self
                .managers
                .get(&address.entity_type)
                .is_some_and(|manager| !manager.is_stream(&request.tag))
    }

    /// Saves a request.
    ///
    /// - With `direct`, the save also reads the entity's earlier unprocessed requests, in one
    ///   call ([`MessageStorage::save_request_ordered`]).
    ///   Direct delivery then checks them.
    /// - A caller that goes away meanwhile leaves the stored request to the read loop.
    ///   The read loop is woken at once rather than at its next poll.
    ///
    /// [`MessageStorage::save_request_ordered`]: cluster_core::storage::MessageStorage::save_request_ordered
    pub(super) async fn save(
        &self,
        request: &Request,
        options: &SaveRequestOptions,
        direct: bool,
    ) -> (Result<SaveResult, ClusterError>, Option<Vec<Snowflake>>) {
        if !direct {
            return (self.storage.save_request(request, options).await.map_err(Into::into), None);
        }
        let mut wake = WakeOnDrop(Some(&self.read_latch));
        let now = self.clock.now();
        let ordered = self.storage.save_request_ordered(request, options, now, EARLIER_LIMIT).await;
        wake.0 = None;
        match ordered {
            Ok(ordered) => (Ok(ordered.saved), ordered.earlier),
            Err(error) => (Err(error.into()), None),
        }
    }

    /// Hands a request that this runner just saved to its entity.
    ///
    /// It goes only if every unprocessed request stored before it for the entity already
    /// reached the entity here.
    /// Those are `earlier`, `None` when unknown.
    /// When the request cannot go now, it is held for the read loop, which is woken.
    /// That happens for an earlier request unread here, a full mailbox, the residency cap, or
    /// the shard let go meanwhile.
    pub(super) async fn deliver(
        &self,
        request: Request,
        reservation: Reservation,
        earlier: Option<Vec<Snowflake>>,
    ) {
        let address = request.address.clone();
        let request_id = request.request_id;
        let in_order = match earlier {
            // A full read may have left later ones out: those are unread here.
            Some(earlier)
                if u32::try_from(earlier.len()).unwrap_or(u32::MAX) >= EARLIER_LIMIT.get() =>
            {
                false
            }
            Some(earlier) => {
                let deadline = crate::time::deadline(EARLIER_WAIT);
                Box::pin(self.tracked.earlier_delivered(&earlier, deadline)).await
            }
            None => false,
        };
        if !in_order {
            tracing::debug!(%request_id, "an earlier request is unread here: left to the read loop");
            self.order.hold(&address, request_id);
            self.read_latch.wake();
            return;
        }
        let message =
            UnprocessedMessage { envelope: Envelope::Request(request), last_sent_reply: None };
        let mut unregistered = Unregistered::default();
        let span = tracing::debug_span!("deliver_directly", %request_id);
        let dispatched =
            span.in_scope(|| self.runs.dispatch(message, &mut unregistered, Claiming::Reserved));
        // Claimed (kept by the claim), taken over by the read loop, or left to it.
        drop(reservation);
        unregistered.warn();
        match dispatched {
            Dispatched::Delivered | Dispatched::Skipped | Dispatched::Settled(_) => {}
            Dispatched::Answer(reply) => self.runs.save_final_reply(reply, None).await,
            Dispatched::Release(_) | Dispatched::Retry(_) | Dispatched::Capped(_) => {
                tracing::debug!(%request_id, "not delivered directly; left to the read loop");
                self.order.hold(&address, request_id);
                self.read_latch.wake();
            }
        }
    }
}

/// How long a request waits for an earlier request of its entity, reserved here for direct
/// delivery.
///
/// It waits for the earlier request to reach the entity, or to be left to the read loop.
/// Past this wait, the later request is left to the read loop too.
const EARLIER_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// How many earlier unprocessed requests of an entity the order check reads.
///
/// When it finds this many, more may lie beyond them, so the request is left to the read loop.
pub(super) const EARLIER_LIMIT: NonZeroU32 = NonZeroU32::new(16).expect("16 is not zero");

/// Wakes the storage read loop when dropped armed.
struct WakeOnDrop<'a>(Option<&'a ReadLatch>);

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(read_latch) = self.0 {
            read_latch.wake();
        }
    }
}
