//! The persisted requests this runner has taken up, from their claim to their stored outcome.
//!
//! [`TrackedRequests`] keeps their [`Lifecycle`] under one lock and hands out the guards that
//! move a request through it: a [`Reservation`] for direct delivery, a [`Claim`] for a dispatch,
//! a [`SettleGuard`] while an outcome is stored. The states, transitions and invariants are in
//! `lifecycle`.
//!
//! One lock makes two steps atomic:
//!
//! - the check and the claim of a dispatch;
//! - the move from `Running` to `Settling`, so that no read sees a request in neither state.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use cluster_core::Snowflake;
use cluster_core::envelope::Envelope;
use cluster_core::sync::lock;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::lifecycle::{Busy, Claiming, Earlier, Lifecycle, Previous, Settling};
use crate::metrics;
use crate::runtime::interrupt::InterruptSignal;

/// The requests taken up here (in `PersistedDelivery`).
#[derive(Default)]
pub(super) struct TrackedRequests {
    lifecycle: Mutex<Lifecycle<InFlight>>,
    /// Woken when a request reaches its entity or a reservation ends.
    /// A later request to the entity, waiting for that one to go first, then checks again.
    arrived: Notify,
}

/// A request handed to its entity and not answered yet.
pub(super) struct InFlight {
    /// Interrupts it.
    cancellation: InterruptSignal,
    /// Set once its handler started.
    started: Arc<AtomicBool>,
    /// Where a streaming request's acknowledgements go.
    acks: Option<mpsc::Sender<Snowflake>>,
}

impl InFlight {
    /// A request about to be handed to its entity.
    pub(super) fn new(
        cancellation: InterruptSignal,
        started: Arc<AtomicBool>,
        acks: Option<mpsc::Sender<Snowflake>>,
    ) -> InFlight {
        InFlight { cancellation, started, acks }
    }
}

/// A claimed request.
///
/// Dropped before [`keep`](Claim::keep), the claim is undone.
/// The request goes back to where it was: out of the map, reserved, or settling for a re-run.
pub(super) struct Claim {
    tracked: Arc<TrackedRequests>,
    request_id: Snowflake,
    /// Where the request was before the claim.
    previous: Previous,
    kept: bool,
}

impl Claim {
    /// The request reached its entity: it stays `Running` until its exit is in.
    pub(super) fn keep(mut self) {
        self.kept = true;
        lock(&self.tracked.lifecycle).deliver(self.request_id);
        self.tracked.arrived.notify_waiters();
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        self.tracked.change(|lifecycle| lifecycle.undo_claim(self.request_id, self.previous));
        self.tracked.arrived.notify_waiters();
    }
}

/// A request reserved for direct delivery.
///
/// Dropped, the reservation goes, unless direct delivery or the read loop claimed the request.
pub(super) struct Reservation {
    tracked: Arc<TrackedRequests>,
    request_id: Snowflake,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        lock(&self.tracked.lifecycle).unreserve(self.request_id);
        self.tracked.arrived.notify_waiters();
    }
}

/// Marks a request as settled when its outcome is stored (or the storing task ends).
pub(super) struct SettleGuard {
    tracked: Arc<TrackedRequests>,
    request_id: Snowflake,
    settling: Settling,
}

impl Drop for SettleGuard {
    fn drop(&mut self) {
        lock(&self.tracked.lifecycle).settled(self.request_id, self.settling);
    }
}

impl TrackedRequests {
    /// Applies a transition that may change how many requests run, and sets the in-flight
    /// gauge after it.
    fn change<T>(&self, transition: impl FnOnce(&mut Lifecycle<InFlight>) -> T) -> T {
        let mut lifecycle = lock(&self.lifecycle);
        let outcome = transition(&mut lifecycle);
        metrics::set(metrics::PERSISTED_IN_FLIGHT, lifecycle.running_count());
        outcome
    }

    /// Reserves `request_id`, about to be saved, for direct delivery.
    ///
    /// `None` if it is taken up here already (an id seen before).
    pub(super) fn reserve(self: &Arc<Self>, request_id: Snowflake) -> Option<Reservation> {
        let reserved = lock(&self.lifecycle).reserve(request_id);
        reserved.then(|| Reservation { tracked: Arc::clone(self), request_id })
    }

    /// Claims `request_id` for a dispatch, in one step with the check that nobody else has.
    ///
    /// It is `Busy` when:
    ///
    /// - the request runs here already, or is settling;
    /// - for direct delivery, its reservation is gone: the read loop took it over, and may have
    ///   answered it already.
    pub(super) fn claim(
        self: &Arc<Self>,
        request_id: Snowflake,
        in_flight: InFlight,
        claiming: Claiming,
    ) -> Result<Claim, Busy> {
        let previous = self.change(|lifecycle| lifecycle.claim(request_id, in_flight, claiming))?;
        Ok(Claim { tracked: Arc::clone(self), request_id, previous, kept: false })
    }

    /// The request's exit is in: it moves from `Running` to `Settling`.
    ///
    /// The read loop leaves its row alone until the guard drops, and then until the current
    /// read ends.
    pub(super) fn settle(self: &Arc<Self>, request_id: Snowflake) -> SettleGuard {
        let settling = self.change(|lifecycle| lifecycle.settle(request_id));
        SettleGuard { tracked: Arc::clone(self), request_id, settling }
    }

    /// A read is about to select.
    pub(super) fn begin_read(&self) {
        lock(&self.lifecycle).begin_read();
    }

    /// The read dispatched what it selected, or failed.
    pub(super) fn end_read(&self) {
        lock(&self.lifecycle).end_read();
    }

    /// Whether every one of `earlier` (an entity's requests stored before a new one) reached
    /// the entity here.
    ///
    /// Those reserved here for direct delivery (saved together with the new one, say) are
    /// waited for until `deadline`.
    /// Each of them is about to be delivered or left to the read loop.
    ///
    /// A settling request reached the entity.
    /// The later request need not wait for its reply's write, or for a re-run of it (an
    /// interrupted server-uninterruptible request), which comes after the requests queued
    /// meanwhile in any case (`effect/src/cluster/internal/entityManager.ts` offers it to the
    /// entity again behind them).
    pub(super) async fn earlier_delivered(&self, earlier: &[Snowflake], deadline: Instant) -> bool {
        loop {
            let arrived = self.arrived.notified();
            let mut reserved = false;
            {
                let lifecycle = lock(&self.lifecycle);
                for id in earlier {
                    match lifecycle.earlier(*id) {
                        Earlier::Delivered => {}
                        Earlier::Reserved => reserved = true,
                        Earlier::Elsewhere => return false,
                    }
                }
            }
            if !reserved {
                return true;
            }
            tokio::select! {
                () = arrived => {}
                () = tokio::time::sleep_until(deadline) => return false,
            }
        }
    }

    /// Hands an interrupt or acknowledgement to the request it belongs to, if that request
    /// runs here.
    pub(super) fn forward(&self, envelope: &Envelope) {
        match envelope {
            Envelope::Interrupt(interrupt) => self.interrupt(interrupt.request_id),
            Envelope::AckChunk(ack) => self.acknowledge(ack.request_id, ack.reply_id),
            Envelope::Request(_) => {}
        }
    }

    /// Interrupts `request_id` if it runs here.
    fn interrupt(&self, request_id: Snowflake) {
        if let Some(in_flight) = lock(&self.lifecycle).running(request_id) {
            in_flight.cancellation.cancel();
        }
    }

    /// Hands the acknowledgement of chunk `reply_id` to the streaming request `request_id`, if
    /// it runs here.
    fn acknowledge(&self, request_id: Snowflake, reply_id: Snowflake) {
        let lifecycle = lock(&self.lifecycle);
        if let Some(InFlight { acks: Some(acks), .. }) = lifecycle.running(request_id) {
            // Full only if the caller acknowledged faster than chunks went out.
            // The handler only waits for the latest chunk's acknowledgement.
            let _ = acks.try_send(reply_id);
        }
    }

    /// Whether the handler of `request_id` started here.
    pub(super) fn has_started(&self, request_id: Snowflake) -> bool {
        lock(&self.lifecycle)
            .running(request_id)
            .is_some_and(|in_flight| in_flight.started.load(Ordering::Acquire))
    }
}
