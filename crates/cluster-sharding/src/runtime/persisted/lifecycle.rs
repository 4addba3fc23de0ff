//! The lifecycle of the persisted requests this runner took up, from their claim to their
//! stored outcome, as a pure state machine.
//!
//! It knows no storage, task or lock: the caller (`tracked`) keeps it under one mutex, does the
//! I/O and feeds the outcomes back. Each transition is a method that ends in a check of the
//! invariants, as `cluster_core::ownership` does for the shard sets.
//!
//! # States
//!
//! A request the map does not hold is *absent*: nobody here runs it.
//!
//! - `Reserved`: saved by this runner for direct delivery, which has not claimed it yet.
//!   Direct delivery first checks storage order.
//!   The read loop may take the request over.
//!   Direct delivery then finds it taken and leaves it, so the two never both run it.
//! - `Running`: claimed by one dispatch, on its way to its entity (`delivered` unset) or in its
//!   entity's mailbox (`delivered` set).
//!   Interrupts and acknowledgements go to it.
//!   The read loop leaves its row alone (`AlreadyProcessingMessage`).
//! - `Settling`: its exit is in, and its reply (or its release) is being stored.
//!   Each settling has its own [`Settling`] token: only the end of that storing ends it.
//!   A re-run's own settling is not ended by the end of the first run's.
//!   The read loop releases the claim its read took, in case the outcome was to run again.
//!   This is the reference's per-round `processedRequestIds`.
//! - `Settled`: stored while a read was under way, which may have selected the row before the
//!   reply was stored.
//!   It is forgotten when that read ends.
//!   A later read selects after the reply, so it no longer returns the row.
//!
//! # Transitions
//!
//! | transition         | from                                   | to                         |
//! |--------------------|----------------------------------------|----------------------------|
//! | `reserve`          | absent                                 | `Reserved`                 |
//! | `unreserve`        | `Reserved`                             | absent                     |
//! | `claim` (read)     | absent, `Reserved`                     | `Running`                  |
//! | `claim` (reserved) | `Reserved`                             | `Running`                  |
//! | `claim` (re-run)   | absent, `Settling`                     | `Running`                  |
//! | `deliver`          | `Running`                              | `Running`, delivered       |
//! | `undo_claim`       | `Running`                              | where the claim found it   |
//! | `settle`           | any                                    | `Settling`                 |
//! | `settled`          | `Settling`, with the same token        | `Settled` (reading), absent|
//! | `end_read`         | `Settled`                              | absent                     |
//!
//! A claim the read loop undoes leaves a request it took over from direct delivery absent,
//! not reserved: direct delivery's reservation may be gone already.
//! Direct delivery's own claim ends (kept or undone) before its reservation does: an undone
//! claim puts the request back to `Reserved`, and only the reservation's end removes it.
//!
//! # Invariants
//!
//! - `running` is the number of `Running` requests.
//! - A request is `Settled` only while a read is under way.
//! - A claim succeeds only for a request that no other claim holds: one run per delivery.
//! - A request leaves `Settling` only when the storing that its token stands for ends.

use std::collections::BTreeMap;

use cluster_core::Snowflake;

/// The requests taken up here, and whether a read is under way.
///
/// `F` is what a running request carries (its interrupt signal, its acknowledgements): the
/// state machine only holds it.
#[derive(Debug)]
pub(super) struct Lifecycle<F> {
    /// A read is between its select and the end of its dispatching.
    reading: bool,
    requests: BTreeMap<Snowflake, Track<F>>,
    /// How many requests are `Running`.
    running: usize,
    /// The token of the next settling.
    next_settling: u64,
}

impl<F> Default for Lifecycle<F> {
    fn default() -> Lifecycle<F> {
        Lifecycle { reading: false, requests: BTreeMap::new(), running: 0, next_settling: 0 }
    }
}

/// One settling of a request: what [`Lifecycle::settle`] hands out and
/// [`Lifecycle::settled`] takes back.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) struct Settling(u64);

/// Where a taken-up request is.
#[derive(Debug)]
enum Track<F> {
    Reserved,
    Running {
        /// Set once it is in its entity's mailbox (the claim comes just before).
        delivered: bool,
        flight: F,
    },
    Settling(Settling),
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

/// Why a request could not be claimed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Busy {
    /// It runs here already.
    Running,
    /// Another dispatch claimed it and is handing it to its entity right now.
    /// It is not in the mailbox yet, so a later request to the entity must not go first.
    Arriving,
    /// Its outcome is being stored, or was during the current read.
    /// For direct delivery: its reservation is gone (the read loop took it over).
    Settled,
}

/// Where a claimed request was before its claim: where an undone claim puts it back.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Previous {
    Absent,
    Reserved,
    Settling(Settling),
}

/// Where an earlier request of an entity is, for a later one that would go directly.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Earlier {
    /// It reached the entity here.
    Delivered,
    /// Reserved here for direct delivery, not claimed yet, or claimed and not in the mailbox
    /// yet.
    /// It is about to be delivered or left to the read loop.
    Reserved,
    /// Not taken up here: the read loop delivers it.
    Elsewhere,
}

impl<F> Lifecycle<F> {
    /// Reserves `request_id`, about to be saved, for direct delivery.
    ///
    /// `false` if it is taken up here already (an id seen before).
    pub(super) fn reserve(&mut self, request_id: Snowflake) -> bool {
        let reserved = !self.requests.contains_key(&request_id);
        if reserved {
            self.requests.insert(request_id, Track::Reserved);
        }
        self.check();
        reserved
    }

    /// Direct delivery let its reservation go: the request is absent again, unless a dispatch
    /// claimed it meanwhile.
    pub(super) fn unreserve(&mut self, request_id: Snowflake) {
        if matches!(self.requests.get(&request_id), Some(Track::Reserved)) {
            self.requests.remove(&request_id);
        }
        self.check();
    }

    /// Claims `request_id` for a dispatch, carrying `flight`, in one step with the check that
    /// nobody else has.
    ///
    /// On success, it tells where the request was, for [`undo_claim`](Lifecycle::undo_claim).
    pub(super) fn claim(
        &mut self,
        request_id: Snowflake,
        flight: F,
        claiming: Claiming,
    ) -> Result<Previous, Busy> {
        let previous = match (self.requests.get(&request_id), claiming) {
            (None, Claiming::Read | Claiming::Rerun) => Previous::Absent,
            // Taken over by the read loop.
            // Undone, the claim leaves the request to the next read, not to direct delivery,
            // whose reservation may be gone already.
            (Some(Track::Reserved), Claiming::Read) => Previous::Absent,
            (Some(Track::Reserved), Claiming::Reserved) => Previous::Reserved,
            (Some(Track::Settling(settling)), Claiming::Rerun) => Previous::Settling(*settling),
            (Some(Track::Running { delivered: false, .. }), _) => return Err(Busy::Arriving),
            (Some(Track::Running { delivered: true, .. }), _) => return Err(Busy::Running),
            (None | Some(Track::Reserved | Track::Settling(_) | Track::Settled), _) => {
                return Err(Busy::Settled);
            }
        };
        self.requests.insert(request_id, Track::Running { delivered: false, flight });
        self.running += 1;
        self.check();
        Ok(previous)
    }

    /// The claimed request reached its entity's mailbox: it stays `Running` until its exit is
    /// in.
    pub(super) fn deliver(&mut self, request_id: Snowflake) {
        if let Some(Track::Running { delivered, .. }) = self.requests.get_mut(&request_id) {
            *delivered = true;
        }
        self.check();
    }

    /// The claim did not reach the entity: the request goes back to `previous`, unless its
    /// exit is in already.
    pub(super) fn undo_claim(&mut self, request_id: Snowflake, previous: Previous) {
        if matches!(self.requests.get(&request_id), Some(Track::Running { .. })) {
            match previous {
                Previous::Absent => self.requests.remove(&request_id),
                Previous::Reserved => self.requests.insert(request_id, Track::Reserved),
                Previous::Settling(settling) => {
                    self.requests.insert(request_id, Track::Settling(settling))
                }
            };
            self.running -= 1;
        }
        self.check();
    }

    /// The request's exit is in: it moves to `Settling` while its outcome is stored.
    ///
    /// The move is one step, so that the read loop never sees the request in neither state.
    pub(super) fn settle(&mut self, request_id: Snowflake) -> Settling {
        let settling = Settling(self.next_settling);
        self.next_settling += 1;
        let previous = self.requests.insert(request_id, Track::Settling(settling));
        if let Some(Track::Running { .. }) = previous {
            self.running -= 1;
        }
        self.check();
        settling
    }

    /// The request's outcome is stored (or its storing ended).
    ///
    /// The current read, if any, may have selected its row before: it stays `Settled` until
    /// that read ends. A request claimed again for a re-run is left to the re-run, and so is
    /// one the re-run settles in its turn: `settling` is no longer its token.
    pub(super) fn settled(&mut self, request_id: Snowflake, settling: Settling) {
        if let Some(Track::Settling(current)) = self.requests.get(&request_id)
            && *current == settling
        {
            if self.reading {
                self.requests.insert(request_id, Track::Settled);
            } else {
                self.requests.remove(&request_id);
            }
        }
        self.check();
    }

    /// A read is about to select.
    pub(super) fn begin_read(&mut self) {
        self.reading = true;
        self.check();
    }

    /// The read dispatched what it selected, or failed.
    ///
    /// The requests settled meanwhile are forgotten.
    /// The next read selects after their replies were stored.
    pub(super) fn end_read(&mut self) {
        self.reading = false;
        self.requests.retain(|_, track| !matches!(track, Track::Settled));
        self.check();
    }

    /// Where the earlier request `request_id` is.
    ///
    /// A settling (or settled) request reached its entity: a request settles only after its
    /// exit.
    pub(super) fn earlier(&self, request_id: Snowflake) -> Earlier {
        match self.requests.get(&request_id) {
            Some(Track::Running { delivered: true, .. } | Track::Settling(_) | Track::Settled) => {
                Earlier::Delivered
            }
            Some(Track::Running { delivered: false, .. } | Track::Reserved) => Earlier::Reserved,
            None => Earlier::Elsewhere,
        }
    }

    /// What the running request `request_id` carries, if it is `Running` here.
    pub(super) fn running(&self, request_id: Snowflake) -> Option<&F> {
        match self.requests.get(&request_id) {
            Some(Track::Running { flight, .. }) => Some(flight),
            _ => None,
        }
    }

    /// How many requests are `Running`.
    pub(super) fn running_count(&self) -> usize {
        self.running
    }

    /// How many requests the map holds, in any state.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.requests.len()
    }

    fn check(&self) {
        debug_assert_eq!(
            self.running,
            self.requests.values().filter(|track| matches!(track, Track::Running { .. })).count(),
            "the running count does not match the running requests"
        );
        debug_assert!(
            self.reading || !self.requests.values().any(|track| matches!(track, Track::Settled)),
            "a request is settled while no read is under way"
        );
    }
}

#[cfg(test)]
mod tests;
