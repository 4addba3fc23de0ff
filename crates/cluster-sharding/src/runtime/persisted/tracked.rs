//! The persisted requests this runner has taken up, from their claim to their stored outcome.
//!
//! A request enters the map when a dispatch claims it, before it reaches its entity.
//! It leaves once its outcome is stored.
//! Its states:
//!
//! - `Reserved`: saved by this runner for direct delivery, which has not claimed it yet.
//!   Direct delivery first checks storage order.
//!   The read loop may take the request over.
//!   Direct delivery then finds it taken and leaves it, so the two never both run it.
//! - `Running`: claimed and handed to its entity.
//!   Interrupts and acknowledgements go to it.
//!   The read loop leaves its row alone (`AlreadyProcessingMessage`).
//! - `Settling`: its exit is in, and its reply (or its release) is being stored.
//!   The read loop releases the claim its read took, in case the outcome was to run again.
//!   This is the reference's per-round `processedRequestIds`.
//! - `Settled`: stored while a read was under way, which may have selected the row before the
//!   reply was stored.
//!   It is forgotten when that read ends.
//!   A later read selects after the reply, so it no longer returns the row.
//!
//! One map under one lock makes two steps atomic:
//!
//! - the check and the claim of a dispatch;
//! - the move from `Running` to `Settling`, so that no read sees a request in neither state.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cluster_core::Snowflake;
use tokio::sync::mpsc;

use super::{PersistedDelivery, lock};
use crate::metrics;
use crate::runtime::interrupt::InterruptSignal;

/// The map (in [`PersistedDelivery`]).
#[derive(Default)]
pub(super) struct Tracked {
    /// A read is between its select and the end of its dispatching.
    reading: bool,
    requests: BTreeMap<Snowflake, Track>,
    /// How many requests are `Running`.
    running: usize,
}

/// Where a taken-up request is.
enum Track {
    Reserved,
    Running(InFlight),
    Settling,
    Settled,
}

/// Who claims a request, and so which states it may be claimed from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Claiming {
    /// The read loop: a request nobody here runs (or only reserved for direct delivery).
    Read,
    /// Direct delivery: the request it reserved before saving it, if nobody took it over.
    Reserved,
    /// A re-run: the request whose interrupted outcome is being settled.
    Rerun,
}

/// A request handed to its entity and not answered yet.
pub(super) struct InFlight {
    /// Interrupts it.
    pub(super) cancellation: InterruptSignal,
    /// Set once its handler started.
    pub(super) started: Arc<AtomicBool>,
    /// Where a streaming request's acknowledgements go.
    pub(super) acks: Option<mpsc::Sender<Snowflake>>,
    /// Set once it is in its entity's mailbox (the claim comes just before).
    delivered: bool,
}

impl InFlight {
    /// A request about to be handed to its entity.
    pub(super) fn new(
        cancellation: InterruptSignal,
        started: Arc<AtomicBool>,
        acks: Option<mpsc::Sender<Snowflake>>,
    ) -> InFlight {
        InFlight { cancellation, started, acks, delivered: false }
    }
}

/// Why a request could not be claimed.
pub(super) enum Busy {
    /// It runs here already.
    Running,
    /// Another dispatch claimed it and is handing it to its entity right now.
    /// It is not in the mailbox yet, so a later request to the entity must not go first.
    Arriving,
    /// Its outcome is being stored, or was during the current read.
    Settled,
}

/// A claimed request.
///
/// Dropped before [`keep`](Claim::keep), the claim is undone.
/// The request goes back to where it was: out of the map, reserved, or settling for a re-run.
pub(super) struct Claim {
    persisted: Arc<PersistedDelivery>,
    request_id: Snowflake,
    /// Where the request was before the claim.
    previous: Previous,
    kept: bool,
}

/// Where a claimed request was.
#[derive(Clone, Copy)]
enum Previous {
    Absent,
    Reserved,
    Settling,
}

/// A request reserved for direct delivery.
///
/// Dropped, the reservation goes, unless direct delivery or the read loop claimed the request.
pub(super) struct Reservation {
    persisted: Arc<PersistedDelivery>,
    request_id: Snowflake,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        {
            let mut tracked = lock(&self.persisted.tracked);
            if matches!(tracked.requests.get(&self.request_id), Some(Track::Reserved)) {
                tracked.requests.remove(&self.request_id);
            }
        }
        self.persisted.reservation_ended.notify_waiters();
    }
}

/// Where an earlier request of an entity is, for a later one that would go directly.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Earlier {
    /// It reached the entity here.
    Delivered,
    /// Reserved here for direct delivery, not claimed yet.
    /// It is about to be delivered or left to the read loop.
    Reserved,
    /// Not taken up here: the read loop delivers it.
    Elsewhere,
}

impl Claim {
    /// The request reached its entity: it stays `Running` until its exit is in.
    pub(super) fn keep(mut self) {
        self.kept = true;
        {
            let mut tracked = lock(&self.persisted.tracked);
            if let Some(Track::Running(in_flight)) = tracked.requests.get_mut(&self.request_id) {
                in_flight.delivered = true;
            }
        }
        self.persisted.reservation_ended.notify_waiters();
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        {
            let mut tracked = lock(&self.persisted.tracked);
            if matches!(tracked.requests.get(&self.request_id), Some(Track::Running(_))) {
                match self.previous {
                    Previous::Absent => tracked.requests.remove(&self.request_id),
                    Previous::Reserved => tracked.requests.insert(self.request_id, Track::Reserved),
                    Previous::Settling => tracked.requests.insert(self.request_id, Track::Settling),
                };
                tracked.stopped_running();
            }
        }
        self.persisted.reservation_ended.notify_waiters();
    }
}

/// Marks a request as settled when its outcome is stored (or the storing task ends).
pub(super) struct SettleGuard {
    persisted: Arc<PersistedDelivery>,
    request_id: Snowflake,
}

impl Drop for SettleGuard {
    fn drop(&mut self) {
        let mut tracked = lock(&self.persisted.tracked);
        if !matches!(tracked.requests.get(&self.request_id), Some(Track::Settling)) {
            // Running again (a re-run claimed it): the re-run's own guard settles it.
            return;
        }
        if tracked.reading {
            // The current read may have selected the row before its reply was stored.
            tracked.requests.insert(self.request_id, Track::Settled);
        } else {
            // The next read selects after the reply was stored: it will not return the row.
            tracked.requests.remove(&self.request_id);
        }
    }
}

impl Tracked {
    fn stopped_running(&mut self) {
        self.running = self.running.saturating_sub(1);
        metrics::set(metrics::PERSISTED_IN_FLIGHT, self.running);
    }
}

impl PersistedDelivery {
    /// Reserves `request_id`, about to be saved, for direct delivery.
    ///
    /// `None` if it is taken up here already (an id seen before).
    pub(super) fn reserve(
        self: &Arc<PersistedDelivery>,
        request_id: Snowflake,
    ) -> Option<Reservation> {
        let mut tracked = lock(&self.tracked);
        if tracked.requests.contains_key(&request_id) {
            return None;
        }
        tracked.requests.insert(request_id, Track::Reserved);
        Some(Reservation { persisted: Arc::clone(self), request_id })
    }

    /// Claims `request_id` for a dispatch, in one step with the check that nobody else has.
    ///
    /// It is `Busy` when:
    ///
    /// - the request runs here already, or is settling;
    /// - for direct delivery, its reservation is gone: the read loop took it over, and may have
    ///   answered it already.
    pub(super) fn claim(
        self: &Arc<PersistedDelivery>,
        request_id: Snowflake,
        in_flight: InFlight,
        claiming: Claiming,
    ) -> Result<Claim, Busy> {
        let mut tracked = lock(&self.tracked);
        let previous = match (tracked.requests.get(&request_id), claiming) {
            (None, Claiming::Read | Claiming::Rerun) => Previous::Absent,
            // Taken over by the read loop.
            // Undone, the claim leaves the request to the next read, not to direct delivery,
            // whose reservation may be gone already.
            (Some(Track::Reserved), Claiming::Read) => Previous::Absent,
            (Some(Track::Reserved), Claiming::Reserved) => Previous::Reserved,
            (Some(Track::Settling), Claiming::Rerun) => Previous::Settling,
            (Some(Track::Running(in_flight)), _) if !in_flight.delivered => {
                return Err(Busy::Arriving);
            }
            (Some(Track::Running(_)), _) => return Err(Busy::Running),
            (None | Some(Track::Reserved | Track::Settling | Track::Settled), _) => {
                return Err(Busy::Settled);
            }
        };
        tracked.requests.insert(request_id, Track::Running(in_flight));
        tracked.running += 1;
        metrics::set(metrics::PERSISTED_IN_FLIGHT, tracked.running);
        Ok(Claim { persisted: Arc::clone(self), request_id, previous, kept: false })
    }

    /// The request's exit is in: it moves from `Running` to `Settling`.
    ///
    /// The move is one step, so that the read loop never sees the request in neither state.
    /// The read loop leaves its row alone until the guard drops, and then until the current
    /// read ends.
    pub(super) fn settle(self: &Arc<PersistedDelivery>, request_id: Snowflake) -> SettleGuard {
        let mut tracked = lock(&self.tracked);
        if let Some(Track::Running(_)) = tracked.requests.insert(request_id, Track::Settling) {
            tracked.stopped_running();
        }
        SettleGuard { persisted: Arc::clone(self), request_id }
    }

    /// A read is about to select.
    pub(super) fn begin_read(&self) {
        lock(&self.tracked).reading = true;
    }

    /// The read dispatched what it selected, or failed.
    ///
    /// The requests settled meanwhile are forgotten.
    /// The next read selects after their replies were stored.
    pub(super) fn end_read(&self) {
        let mut tracked = lock(&self.tracked);
        tracked.reading = false;
        tracked.requests.retain(|_, track| !matches!(track, Track::Settled));
    }

    /// Where the earlier request `request_id` is.
    ///
    /// A later request to the entity may follow it directly once it reached the entity here.
    /// A settling (or settled) request reached it: a request settles only after its exit.
    /// The later request need not wait for its reply's write, or for a re-run of it (an
    /// interrupted server-uninterruptible request), which comes after the requests queued
    /// meanwhile in any case (`effect/src/cluster/internal/entityManager.ts` offers it to the
    /// entity again behind them).
    pub(super) fn earlier(&self, request_id: Snowflake) -> Earlier {
        match lock(&self.tracked).requests.get(&request_id) {
            Some(Track::Running(in_flight)) if in_flight.delivered => Earlier::Delivered,
            Some(Track::Settling | Track::Settled) => Earlier::Delivered,
            Some(Track::Running(_) | Track::Reserved) => Earlier::Reserved,
            None => Earlier::Elsewhere,
        }
    }

    /// Interrupts `request_id` if it runs here.
    pub(super) fn interrupt(&self, request_id: Snowflake) {
        if let Some(Track::Running(in_flight)) = lock(&self.tracked).requests.get(&request_id) {
            in_flight.cancellation.cancel();
        }
    }

    /// Hands the acknowledgement of chunk `reply_id` to the streaming request `request_id`, if
    /// it runs here.
    pub(super) fn acknowledge(&self, request_id: Snowflake, reply_id: Snowflake) {
        let tracked = lock(&self.tracked);
        if let Some(Track::Running(InFlight { acks: Some(acks), .. })) =
            tracked.requests.get(&request_id)
        {
            // Full only if the caller acknowledged faster than chunks went out.
            // The handler only waits for the latest chunk's acknowledgement.
            let _ = acks.try_send(reply_id);
        }
    }

    /// Whether the handler of `request_id` started here.
    pub(super) fn has_started(&self, request_id: Snowflake) -> bool {
        matches!(
            lock(&self.tracked).requests.get(&request_id),
            Some(Track::Running(in_flight)) if in_flight.started.load(Ordering::Acquire)
        )
    }
}
