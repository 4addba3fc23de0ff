//! The lifecycle's transitions, one by one from each state, and random sequences of them as
//! the read loop, direct delivery and re-runs issue them.

use std::collections::{BTreeMap, BTreeSet};

use cluster_core::Snowflake;
use proptest::prelude::*;

use super::{Busy, Claiming, Earlier, Lifecycle, Previous, Settling};

const ID: Snowflake = Snowflake::new(7);

/// The states a request can be in, each reached through the transitions.
#[derive(Clone, Copy, Debug)]
enum Start {
    Absent,
    Reserved,
    Arriving,
    Running,
    Settling,
    Settled,
}

fn lifecycle_at(start: Start) -> Lifecycle<()> {
    let mut lifecycle = Lifecycle::default();
    match start {
        Start::Absent => {}
        Start::Reserved => assert!(lifecycle.reserve(ID)),
        Start::Arriving => {
            assert_eq!(lifecycle.claim(ID, (), Claiming::Read), Ok(Previous::Absent))
        }
        Start::Running => {
            lifecycle.claim(ID, (), Claiming::Read).unwrap();
            lifecycle.deliver(ID);
        }
        Start::Settling => {
            lifecycle.claim(ID, (), Claiming::Read).unwrap();
            lifecycle.deliver(ID);
            lifecycle.settle(ID);
        }
        Start::Settled => {
            lifecycle.begin_read();
            lifecycle.claim(ID, (), Claiming::Read).unwrap();
            lifecycle.deliver(ID);
            let settling = lifecycle.settle(ID);
            lifecycle.settled(ID, settling);
        }
    }
    lifecycle
}

#[test]
fn each_claimant_claims_only_from_its_states() {
    use Claiming::{Read, Rerun};
    let reserved = Claiming::Reserved;
    let table: [(Start, Claiming, Result<Previous, Busy>); 18] = [
        (Start::Absent, Read, Ok(Previous::Absent)),
        (Start::Absent, reserved, Err(Busy::Settled)),
        (Start::Absent, Rerun, Ok(Previous::Absent)),
        // The read loop takes a reserved request over; undone, it is not reserved again.
        (Start::Reserved, Read, Ok(Previous::Absent)),
        (Start::Reserved, reserved, Ok(Previous::Reserved)),
        (Start::Reserved, Rerun, Err(Busy::Settled)),
        (Start::Arriving, Read, Err(Busy::Arriving)),
        (Start::Arriving, reserved, Err(Busy::Arriving)),
        (Start::Arriving, Rerun, Err(Busy::Arriving)),
        (Start::Running, Read, Err(Busy::Running)),
        (Start::Running, reserved, Err(Busy::Running)),
        (Start::Running, Rerun, Err(Busy::Running)),
        (Start::Settling, Read, Err(Busy::Settled)),
        (Start::Settling, reserved, Err(Busy::Settled)),
        (Start::Settling, Rerun, Ok(Previous::Settling(Settling(0)))),
        (Start::Settled, Read, Err(Busy::Settled)),
        (Start::Settled, reserved, Err(Busy::Settled)),
        (Start::Settled, Rerun, Err(Busy::Settled)),
    ];
    for (start, claiming, expected) in table {
        let mut lifecycle = lifecycle_at(start);
        let running = lifecycle.running_count();
        let claimed = lifecycle.claim(ID, (), claiming);
        assert_eq!(claimed, expected, "{claiming:?} from {start:?}");
        let added = usize::from(claimed.is_ok());
        assert_eq!(lifecycle.running_count(), running + added, "{claiming:?} from {start:?}");
    }
}

#[test]
fn an_undone_claim_puts_the_request_back_where_it_was() {
    let table = [
        (Start::Absent, Claiming::Read, Earlier::Elsewhere),
        (Start::Reserved, Claiming::Read, Earlier::Elsewhere),
        (Start::Reserved, Claiming::Reserved, Earlier::Reserved),
        (Start::Settling, Claiming::Rerun, Earlier::Delivered),
    ];
    for (start, claiming, after) in table {
        let mut lifecycle = lifecycle_at(start);
        let previous = lifecycle.claim(ID, (), claiming).unwrap();
        assert_eq!(lifecycle.earlier(ID), Earlier::Reserved, "arriving from {start:?}");
        lifecycle.undo_claim(ID, previous);
        assert_eq!(lifecycle.earlier(ID), after, "{claiming:?} undone from {start:?}");
        assert_eq!(lifecycle.running_count(), 0);
    }
}

#[test]
fn a_request_settled_during_a_read_is_forgotten_when_the_read_ends() {
    let mut lifecycle = lifecycle_at(Start::Settled);
    assert_eq!(lifecycle.earlier(ID), Earlier::Delivered);
    assert!(!lifecycle.reserve(ID), "an id seen in this read is not reserved again");
    lifecycle.end_read();
    assert_eq!(lifecycle.len(), 0);
    // Settled with no read under way: the next read selects after the reply.
    let mut lifecycle = lifecycle_at(Start::Settling);
    lifecycle.settled(ID, Settling(0));
    assert_eq!(lifecycle.len(), 0);
}

#[test]
fn a_rerun_settles_itself_and_its_first_run_does_not() {
    let first = Settling(0);
    let mut lifecycle = lifecycle_at(Start::Settling);
    lifecycle.claim(ID, (), Claiming::Rerun).unwrap();
    lifecycle.deliver(ID);
    // The first run's outcome was stored: the re-run is left running.
    lifecycle.settled(ID, first);
    assert!(lifecycle.running(ID).is_some());
    let rerun = lifecycle.settle(ID);
    lifecycle.settled(ID, rerun);
    assert_eq!((lifecycle.len(), lifecycle.running_count()), (0, 0));
}

/// The re-run's exit came in before the first run's storing ended: the end of the first
/// run's storing leaves the re-run's settling alone, so no read runs the request again while
/// the re-run's reply is stored.
#[test]
fn the_first_runs_storing_ending_after_the_reruns_exit_leaves_the_rerun_settling() {
    let first = Settling(0);
    let mut lifecycle = lifecycle_at(Start::Settling);
    lifecycle.claim(ID, (), Claiming::Rerun).unwrap();
    lifecycle.deliver(ID);
    let rerun = lifecycle.settle(ID);
    lifecycle.settled(ID, first);
    assert_eq!(lifecycle.claim(ID, (), Claiming::Read), Err(Busy::Settled));
    lifecycle.settled(ID, rerun);
    assert_eq!(lifecycle.len(), 0);
}

#[test]
fn an_unreservation_after_a_takeover_leaves_the_claim() {
    let mut lifecycle = lifecycle_at(Start::Reserved);
    lifecycle.claim(ID, (), Claiming::Read).unwrap();
    lifecycle.unreserve(ID);
    assert!(lifecycle.running(ID).is_some());
}

/// One step of a caller, on one of a few requests. Handles refer to what earlier steps
/// returned (a reservation, a claim, a settling), by index modulo how many are held.
#[derive(Clone, Debug)]
enum Op {
    Reserve(u8),
    Unreserve(usize),
    Claim(u8, Claiming),
    /// Direct delivery claims what it reserved.
    ClaimReserved(usize),
    /// A re-run claims the request whose outcome settles.
    ClaimRerun(usize),
    Deliver(usize),
    Undo(usize),
    /// The exit of a delivered claim is in.
    Settle(usize),
    Settled(usize),
    BeginRead,
    EndRead,
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u8..4;
    let handle = 0usize..8;
    prop_oneof![
        id.clone().prop_map(Op::Reserve),
        handle.clone().prop_map(Op::Unreserve),
        (id, prop_oneof![Just(Claiming::Read), Just(Claiming::Rerun)])
            .prop_map(|(id, claiming)| Op::Claim(id, claiming)),
        handle.clone().prop_map(Op::ClaimReserved),
        handle.clone().prop_map(Op::ClaimRerun),
        handle.clone().prop_map(Op::Deliver),
        handle.clone().prop_map(Op::Undo),
        handle.clone().prop_map(Op::Settle),
        handle.prop_map(Op::Settled),
        Just(Op::BeginRead),
        Just(Op::EndRead),
    ]
}

/// What the callers hold: the handles the runtime's guards stand for.
#[derive(Default)]
struct Callers {
    reservations: Vec<Snowflake>,
    /// Claims not kept or undone yet, with where they found the request.
    arriving: Vec<(Snowflake, Previous)>,
    /// Claims in their entity's mailbox, exit not in yet.
    delivered: Vec<Snowflake>,
    /// Outcomes being stored.
    settling: Vec<(Snowflake, Settling)>,
    /// The latest settling of each request.
    latest: BTreeMap<Snowflake, Settling>,
    /// Settlings whose re-run reached the entity: their storing task only ends after that
    /// (`store_outcome` returns once `rerun` delivered), storing nothing more.
    superseded: BTreeSet<Settling>,
    reading: bool,
    /// Requests whose outcome was stored during the current read.
    settled_in_read: BTreeSet<Snowflake>,
}

fn take<T: Copy>(held: &mut Vec<T>, index: usize) -> Option<T> {
    (!held.is_empty()).then(|| held.remove(index % held.len()))
}

impl Callers {
    /// The claims that hold `id` now.
    fn holding(&self, id: Snowflake) -> usize {
        self.arriving.iter().filter(|(held, _)| *held == id).count()
            + self.delivered.iter().filter(|held| **held == id).count()
    }

    /// Takes a reservation that no arriving claim was made from.
    ///
    /// Claims are made and ended within one synchronous dispatch, which direct delivery and a
    /// re-run call while they hold the reservation or the settling: a claim made from either
    /// ends before it does.
    fn take_reservation(&mut self, handle: usize) -> Option<Snowflake> {
        let claimed = |id: Snowflake| self.arriving.contains(&(id, Previous::Reserved));
        let free: Vec<usize> =
            (0..self.reservations.len()).filter(|at| !claimed(self.reservations[*at])).collect();
        let index = *free.get(handle % free.len().max(1))?;
        Some(self.reservations.remove(index))
    }

    /// Takes a settling that no arriving claim was made from (see above).
    fn take_settling(&mut self, handle: usize) -> Option<(Snowflake, Settling)> {
        let claimed = |(id, settling): (Snowflake, Settling)| {
            self.arriving.contains(&(id, Previous::Settling(settling)))
        };
        let free: Vec<usize> =
            (0..self.settling.len()).filter(|at| !claimed(self.settling[*at])).collect();
        let index = *free.get(handle % free.len().max(1))?;
        Some(self.settling.remove(index))
    }

    fn claimed(&mut self, lifecycle: &mut Lifecycle<()>, id: Snowflake, claiming: Claiming) {
        let holding = self.holding(id);
        let settling = self
            .settling
            .iter()
            .any(|(held, settling)| *held == id && !self.superseded.contains(settling));
        let claimed = lifecycle.claim(id, (), claiming);
        if let Ok(previous) = claimed {
            assert_eq!(holding, 0, "{id} claimed twice");
            if claiming == Claiming::Read {
                assert!(!settling, "{id} read while its outcome is stored");
                assert!(!self.settled_in_read.contains(&id), "{id} read again in its read");
            }
            self.arriving.push((id, previous));
        }
    }

    fn apply(&mut self, lifecycle: &mut Lifecycle<()>, op: Op) {
        let raw = |id: u8| Snowflake::new(u64::from(id));
        match op {
            Op::Reserve(id) => {
                if lifecycle.reserve(raw(id)) {
                    self.reservations.push(raw(id));
                }
            }
            Op::Unreserve(handle) => {
                if let Some(id) = self.take_reservation(handle) {
                    lifecycle.unreserve(id);
                }
            }
            Op::Claim(id, claiming) => self.claimed(lifecycle, raw(id), claiming),
            Op::ClaimReserved(handle) => {
                if let Some(&id) = self.reservations.get(handle % self.reservations.len().max(1)) {
                    self.claimed(lifecycle, id, Claiming::Reserved);
                }
            }
            Op::ClaimRerun(handle) => {
                // A re-run claims again only while its earlier claims were not delivered.
                let live: Vec<Snowflake> = self
                    .settling
                    .iter()
                    .filter(|(_, settling)| !self.superseded.contains(settling))
                    .map(|(id, _)| *id)
                    .collect();
                if let Some(&id) = live.get(handle % live.len().max(1)) {
                    self.claimed(lifecycle, id, Claiming::Rerun);
                }
            }
            Op::Deliver(handle) => {
                if let Some((id, previous)) = take(&mut self.arriving, handle) {
                    if let Previous::Settling(settling) = previous {
                        self.superseded.insert(settling);
                    }
                    lifecycle.deliver(id);
                    assert_eq!(lifecycle.earlier(id), Earlier::Delivered);
                    self.delivered.push(id);
                }
            }
            Op::Undo(handle) => {
                if let Some((id, previous)) = take(&mut self.arriving, handle) {
                    lifecycle.undo_claim(id, previous);
                    assert!(lifecycle.running(id).is_none(), "{id} still running after undo");
                }
            }
            Op::Settle(handle) => {
                if let Some(id) = take(&mut self.delivered, handle) {
                    let settling = lifecycle.settle(id);
                    self.latest.insert(id, settling);
                    self.settling.push((id, settling));
                }
            }
            Op::Settled(handle) => {
                if let Some((id, settling)) = self.take_settling(handle) {
                    // The request leaves `Settling` only if this is its latest settling and no
                    // re-run holds it.
                    let current = self.latest.get(&id) == Some(&settling) && self.holding(id) == 0;
                    lifecycle.settled(id, settling);
                    if self.reading && current {
                        self.settled_in_read.insert(id);
                    }
                }
            }
            Op::BeginRead => {
                if !self.reading {
                    lifecycle.begin_read();
                    self.reading = true;
                }
            }
            Op::EndRead => {
                if self.reading {
                    lifecycle.end_read();
                    self.reading = false;
                    self.settled_in_read.clear();
                }
            }
        }
        let held = self.arriving.len() + self.delivered.len();
        assert_eq!(lifecycle.running_count(), held, "running count after {op:?}");
    }

    /// Every caller lets go: claims settle, reservations end, the read ends.
    fn finish(&mut self, lifecycle: &mut Lifecycle<()>) {
        for (id, _) in std::mem::take(&mut self.arriving) {
            lifecycle.deliver(id);
            self.delivered.push(id);
        }
        for id in std::mem::take(&mut self.delivered) {
            let settling = lifecycle.settle(id);
            self.settling.push((id, settling));
        }
        for (id, settling) in std::mem::take(&mut self.settling) {
            lifecycle.settled(id, settling);
        }
        for id in std::mem::take(&mut self.reservations) {
            lifecycle.unreserve(id);
        }
        lifecycle.end_read();
    }
}

proptest! {
    /// Whatever the callers do, a request is claimed by one dispatch at a time, a read never
    /// claims a request whose outcome is (or was, in that read) being stored, the running count
    /// holds, and nothing stays in the map once every caller let go.
    #[test]
    fn one_claim_at_a_time_and_nothing_left_behind(ops in proptest::collection::vec(op(), 0..80)) {
        let mut lifecycle = Lifecycle::default();
        let mut callers = Callers::default();
        for op in ops {
            callers.apply(&mut lifecycle, op);
        }
        callers.finish(&mut lifecycle);
        prop_assert_eq!(lifecycle.len(), 0);
        prop_assert_eq!(lifecycle.running_count(), 0);
    }
}
