//! One table test per rule of the ownership sets, a model of `release_lost_shards`, and random
//! operation sequences that check the invariants and the "never activate while gated" rules.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::ids::ShardGroup;

/// Shard `n` of the default group.
fn shard(n: u32) -> ShardId {
    ShardId::new(ShardGroup::default_group(), n)
}

fn shards(numbers: &[u32]) -> Vec<ShardId> {
    numbers.iter().map(|n| shard(*n)).collect()
}

/// A state built directly, for table tests.
fn state(self_shards: &[u32], acquired: &[u32], releasing: &[u32]) -> ShardOwnership {
    let ownership = ShardOwnership {
        self_shards: shards(self_shards).into_iter().collect(),
        acquired: shards(acquired).into_iter().collect(),
        releasing: shards(releasing).into_iter().collect(),
        ..ShardOwnership::new()
    };
    ownership.check_invariants();
    ownership
}

fn numbers<'a>(shards: impl IntoIterator<Item = &'a ShardId>) -> String {
    let numbers: Vec<String> = shards.into_iter().map(|shard| shard.id().to_string()).collect();
    if numbers.is_empty() { "-".to_owned() } else { numbers.join(",") }
}

/// The whole state on one line.
fn render(ownership: &ShardOwnership) -> String {
    let mut line = format!(
        "self {} | acquired {} | releasing {} | force {}",
        numbers(&ownership.self_shards),
        numbers(&ownership.acquired),
        numbers(&ownership.releasing),
        numbers(&ownership.force_releasing),
    );
    if !ownership.locks_healthy {
        line.push_str(" | unhealthy");
    }
    if ownership.forced_release_running {
        line.push_str(" | forced release running");
    }
    line
}

const OPEN: AcquisitionGates = AcquisitionGates { shutting_down: false, joins_pending: false };

#[test]
fn a_new_runner_holds_nothing() {
    let ownership = ShardOwnership::new();
    assert_eq!(render(&ownership), "self - | acquired - | releasing - | force -");
    assert!(ownership.locks_healthy());
    assert!(ownership.is_handed_off());
    assert!(ownership.shards_to_acquire(OPEN).is_empty());
}

#[test]
fn set_assignment_replaces_the_assigned_shards() {
    let mut ownership = state(&[1, 2], &[1], &[]);
    ownership.set_assignment(shards(&[2, 3]));
    // Only the assignment changes: shard 1 stays acquired until the next round.
    assert_eq!(render(&ownership), "self 2,3 | acquired 1 | releasing - | force -");
}

#[test]
fn set_assignment_assigns_nothing_while_locks_are_unhealthy() {
    let mut ownership = state(&[1], &[], &[]);
    ownership.mark_unhealthy();
    ownership.set_assignment(shards(&[1, 2]));
    assert_eq!(render(&ownership), "self - | acquired - | releasing - | force - | unhealthy");
}

#[test]
fn a_round_releases_acquired_shards_no_longer_assigned() {
    let mut ownership = state(&[1, 2], &[1, 3], &[4]);
    assert_eq!(ownership.begin_round(false), shards(&[3]));
    assert_eq!(render(&ownership), "self 1,2 | acquired 1 | releasing 3,4 | force -");
}

#[test]
fn a_round_while_handing_off_releases_every_acquired_shard() {
    let mut ownership = state(&[1, 2], &[1, 2], &[4]);
    assert_eq!(ownership.begin_round(true), shards(&[1, 2]));
    assert_eq!(render(&ownership), "self 1,2 | acquired - | releasing 1,2,4 | force -");
    assert!(!ownership.is_handed_off());
    ownership.release_finished(&shard(1));
    ownership.release_finished(&shard(2));
    ownership.release_finished(&shard(4));
    assert!(ownership.is_handed_off());
}

#[test]
fn shards_to_acquire_are_assigned_neither_acquired_nor_releasing() {
    let ownership = state(&[1, 2, 3, 4], &[1], &[2]);
    assert_eq!(ownership.shards_to_acquire(OPEN), shards(&[3, 4]));
}

#[test]
fn nothing_is_acquired_while_gated() {
    let mut ownership = state(&[1, 2], &[], &[]);
    let shutting_down = AcquisitionGates { shutting_down: true, joins_pending: false };
    let joins_pending = AcquisitionGates { shutting_down: false, joins_pending: true };
    assert!(ownership.shards_to_acquire(shutting_down).is_empty());
    assert!(ownership.shards_to_acquire(joins_pending).is_empty());

    ownership.mark_unhealthy();
    assert!(ownership.shards_to_acquire(OPEN).is_empty());

    // A forced release is pending while shards are force-releasing, even when it is not
    // running yet, and while it runs.
    let mut forced = state(&[1, 2], &[3], &[]);
    forced.mark_unhealthy();
    forced.mark_healthy(shards(&[1, 2]));
    assert!(forced.forced_release_pending());
    assert!(forced.shards_to_acquire(OPEN).is_empty());
    let started = forced.start_forced_release().unwrap();
    assert!(forced.shards_to_acquire(OPEN).is_empty());
    forced.finish_forced_release(&started);
    assert_eq!(forced.shards_to_acquire(OPEN), shards(&[1, 2]));
}

#[test]
fn acquired_shards_become_active() {
    let mut ownership = state(&[1, 2, 3], &[], &[]);
    let outcome = ownership.on_acquired(&shards(&[1, 2]), false);
    assert_eq!(outcome, AcquiredShards { activated: shards(&[1, 2]), to_release: vec![] });
    assert_eq!(render(&ownership), "self 1,2,3 | acquired 1,2 | releasing - | force -");
    assert!(ownership.is_acquired(&shard(1)));
}

#[test]
fn shards_locked_while_joins_became_pending_are_released_unused() {
    let mut ownership = state(&[1, 2], &[], &[]);
    let outcome = ownership.on_acquired(&shards(&[1, 2]), true);
    assert_eq!(outcome, AcquiredShards { activated: vec![], to_release: shards(&[1, 2]) });
    assert_eq!(render(&ownership), "self 1,2 | acquired - | releasing 1,2 | force -");
}

#[test]
fn shards_locked_while_locks_turned_unhealthy_are_released_unused() {
    let mut ownership = state(&[1, 2], &[], &[]);
    ownership.mark_unhealthy();
    let outcome = ownership.on_acquired(&shards(&[1]), false);
    assert_eq!(outcome.to_release, shards(&[1]));
    assert_eq!(render(&ownership), "self - | acquired - | releasing 1 | force - | unhealthy");
}

#[test]
fn shards_locked_while_a_forced_release_is_pending_are_released_unused() {
    let mut ownership = state(&[1, 2], &[3], &[]);
    ownership.mark_unhealthy();
    ownership.mark_healthy(shards(&[1, 2]));
    let outcome = ownership.on_acquired(&shards(&[1]), false);
    assert_eq!(outcome.to_release, shards(&[1]));
    assert_eq!(render(&ownership), "self 1,2 | acquired - | releasing 1,3 | force 3");
}

#[test]
fn shards_locked_that_are_releasing_or_unassigned_are_released_unused() {
    let mut ownership = state(&[1, 2], &[], &[2]);
    ownership.set_assignment(shards(&[2]));
    let outcome = ownership.on_acquired(&shards(&[1, 2]), false);
    assert_eq!(outcome, AcquiredShards { activated: vec![], to_release: shards(&[1, 2]) });
    assert_eq!(render(&ownership), "self 2 | acquired - | releasing 1,2 | force -");
}

#[test]
fn shards_locked_twice_or_already_acquired_are_counted_once() {
    let mut ownership = state(&[1, 2], &[1], &[]);
    let outcome = ownership.on_acquired(&shards(&[1, 2, 2]), false);
    assert_eq!(outcome, AcquiredShards { activated: shards(&[2]), to_release: vec![] });
    assert_eq!(render(&ownership), "self 1,2 | acquired 1,2 | releasing - | force -");
}

#[test]
fn a_refresh_releases_shards_it_did_not_return() {
    let mut ownership = state(&[1, 2, 3], &[1, 2, 3], &[]);
    assert!(ownership.release_lost_shards(&shards(&[1, 2, 3]), &shards(&[1, 3])));
    assert_eq!(render(&ownership), "self 1,2,3 | acquired 1,3 | releasing 2 | force -");
}

#[test]
fn a_returned_shard_no_longer_assigned_to_self_is_released() {
    let mut ownership = state(&[1, 2], &[1, 2], &[]);
    ownership.set_assignment(shards(&[1]));
    assert!(ownership.release_lost_shards(&shards(&[1, 2]), &shards(&[1, 2])));
    assert_eq!(render(&ownership), "self 1 | acquired 1 | releasing 2 | force -");
}

#[test]
fn a_shard_acquired_during_a_refresh_is_not_released_by_its_result() {
    // The refresh sent shard 1; shard 2 was acquired while it was in flight, so the response
    // does not mention it.
    let mut ownership = state(&[1, 2], &[1], &[]);
    let refreshed = ownership.held();
    ownership.on_acquired(&shards(&[2]), false);
    assert!(!ownership.release_lost_shards(&refreshed, &shards(&[1])));
    assert_eq!(render(&ownership), "self 1,2 | acquired 1,2 | releasing - | force -");
}

#[test]
fn a_refresh_leaves_releasing_shards_alone() {
    let mut ownership = state(&[1], &[1], &[2]);
    // Shard 2 is not returned (its lock is gone) but it is already releasing.
    assert!(ownership.release_lost_shards(&shards(&[1, 2]), &shards(&[1])));
    assert_eq!(render(&ownership), "self 1 | acquired 1 | releasing 2 | force -");
    ownership.release_finished(&shard(2));
    assert!(!ownership.release_lost_shards(&shards(&[1]), &shards(&[1])));
}

#[test]
fn unhealthy_locks_force_release_every_held_shard() {
    let mut ownership = state(&[1, 2, 3], &[1, 2], &[4]);
    assert_eq!(ownership.mark_unhealthy(), Some(shards(&[1, 2, 4])));
    assert_eq!(
        render(&ownership),
        "self - | acquired - | releasing 1,2,4 | force 1,2,4 | unhealthy"
    );
    assert_eq!(ownership.mark_unhealthy(), None);
    assert!(ownership.forced_release_pending());
    assert!(ownership.is_force_releasing(&shard(1)));
}

#[test]
fn healthy_locks_rebuild_the_assigned_shards() {
    let mut ownership = state(&[1], &[1], &[]);
    assert!(!ownership.mark_healthy(shards(&[5])));
    assert_eq!(render(&ownership), "self 1 | acquired 1 | releasing - | force -");
    ownership.mark_unhealthy();
    assert!(ownership.mark_healthy(shards(&[1, 2])));
    assert_eq!(render(&ownership), "self 1,2 | acquired - | releasing 1 | force 1");
}

#[test]
fn a_forced_release_runs_once_at_a_time() {
    let mut ownership = ShardOwnership::new();
    assert_eq!(ownership.start_forced_release(), None);

    let mut ownership = state(&[1, 2], &[1, 2], &[]);
    ownership.mark_unhealthy();
    assert_eq!(ownership.start_forced_release(), Some(shards(&[1, 2])));
    assert_eq!(ownership.start_forced_release(), None);
    assert!(ownership.forced_release_pending());
    ownership.finish_forced_release(&shards(&[1, 2]));
    assert_eq!(render(&ownership), "self - | acquired - | releasing - | force - | unhealthy");
    assert!(!ownership.forced_release_pending());
}

#[test]
fn an_abandoned_forced_release_can_start_again() {
    let mut ownership = state(&[], &[1], &[]);
    ownership.mark_unhealthy();
    assert!(ownership.start_forced_release().is_some());
    ownership.finish_forced_release(&[]);
    assert!(ownership.forced_release_pending());
    assert_eq!(ownership.start_forced_release(), Some(shards(&[1])));
}

#[test]
fn a_per_shard_release_can_finish_a_force_releasing_shard() {
    // A per-shard release started before locks turned unhealthy may finish first.
    let mut ownership = state(&[], &[], &[1, 2]);
    ownership.mark_unhealthy();
    ownership.release_finished(&shard(1));
    assert_eq!(render(&ownership), "self - | acquired - | releasing 2 | force 2 | unhealthy");
}

#[test]
fn queries() {
    let ownership = state(&[1, 2, 3], &[1], &[4]);
    let answers: Vec<String> = (1..=5)
        .map(|n| {
            let shard = shard(n);
            format!(
                "{n}: owned={} awaiting={} awaiting_on_shutdown={} accepts={}",
                ownership.is_owned_or_releasing(&shard),
                ownership.is_awaiting_lock(&shard, false),
                ownership.is_awaiting_lock(&shard, true),
                ownership.accepts_envelope(&shard),
            )
        })
        .collect();
    assert_eq!(
        answers,
        [
            "1: owned=true awaiting=false awaiting_on_shutdown=false accepts=true",
            "2: owned=false awaiting=true awaiting_on_shutdown=false accepts=false",
            "3: owned=false awaiting=true awaiting_on_shutdown=false accepts=false",
            "4: owned=true awaiting=false awaiting_on_shutdown=false accepts=true",
            "5: owned=false awaiting=false awaiting_on_shutdown=false accepts=false",
        ]
    );
    assert_eq!(ownership.held(), shards(&[1, 4]));
    assert_eq!(
        (ownership.n_self_shards(), ownership.n_acquired(), ownership.n_releasing()),
        (3, 1, 1)
    );
    assert_eq!(ownership.n_force_releasing(), 0);
    assert!(!ownership.is_handed_off());
}

// --- properties ---

/// A shard from a small universe spanning two groups.
fn any_shard() -> impl Strategy<Value = ShardId> {
    (0u32..7).prop_map(|idx| {
        if idx < 4 {
            ShardId::new(ShardGroup::from("a"), idx + 1)
        } else {
            ShardId::new(ShardGroup::from("b"), idx - 3)
        }
    })
}

fn any_shards() -> impl Strategy<Value = Vec<ShardId>> {
    proptest::collection::vec(any_shard(), 0..6)
}

fn any_gates() -> impl Strategy<Value = AcquisitionGates> {
    (any::<bool>(), any::<bool>()).prop_map(|(shutting_down, joins_pending)| AcquisitionGates {
        shutting_down,
        joins_pending,
    })
}

#[derive(Clone, Debug)]
enum Op {
    SetAssignment(Vec<ShardId>),
    BeginRound {
        handing_off: bool,
    },
    /// `shards_to_acquire`, then `on_acquired` with the shards kept by `keep` (lock storage
    /// may lock fewer), with joins pending or not by the time the call returns.
    AcquireRound {
        gates: AcquisitionGates,
        keep: Vec<bool>,
        joins_pending_after: bool,
    },
    /// `on_acquired` with arbitrary shards.
    OnAcquired {
        shards: Vec<ShardId>,
        joins_pending: bool,
    },
    /// A refresh of the held shards that lost `lost`.
    Refresh {
        lost: Vec<ShardId>,
    },
    /// `release_lost_shards` with arbitrary inputs.
    ReleaseLost {
        refreshed: Vec<ShardId>,
        returned: Vec<ShardId>,
    },
    MarkUnhealthy,
    MarkHealthy(Vec<ShardId>),
    StartForcedRelease,
    /// Finishes the running forced release with what it started with, if one is running.
    FinishForcedRelease,
    ReleaseFinished(ShardId),
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        any_shards().prop_map(Op::SetAssignment),
        any::<bool>().prop_map(|handing_off| Op::BeginRound { handing_off }),
        (any_gates(), proptest::collection::vec(any::<bool>(), 7), any::<bool>()).prop_map(
            |(gates, keep, joins_pending_after)| Op::AcquireRound {
                gates,
                keep,
                joins_pending_after
            }
        ),
        (any_shards(), any::<bool>())
            .prop_map(|(shards, joins_pending)| Op::OnAcquired { shards, joins_pending }),
        any_shards().prop_map(|lost| Op::Refresh { lost }),
        (any_shards(), any_shards())
            .prop_map(|(refreshed, returned)| Op::ReleaseLost { refreshed, returned }),
        Just(Op::MarkUnhealthy),
        any_shards().prop_map(Op::MarkHealthy),
        Just(Op::StartForcedRelease),
        Just(Op::FinishForcedRelease),
        any_shard().prop_map(Op::ReleaseFinished),
    ]
}

/// An independent record of what must block acquisition: unhealthy locks, and the shards a
/// forced release still owes since the last `mark_unhealthy`.
#[derive(Default)]
struct Model {
    unhealthy: bool,
    owed: BTreeSet<ShardId>,
    running: Option<Vec<ShardId>>,
}

impl Model {
    fn blocks_acquisition(&self) -> bool {
        self.unhealthy || !self.owed.is_empty() || self.running.is_some()
    }
}

fn assert_invariants(ownership: &ShardOwnership) {
    assert!(ownership.acquired.is_disjoint(&ownership.releasing), "{}", render(ownership));
    assert!(ownership.force_releasing.is_subset(&ownership.releasing), "{}", render(ownership));
    if !ownership.locks_healthy {
        assert!(ownership.acquired.is_empty(), "{}", render(ownership));
        assert!(ownership.self_shards.is_empty(), "{}", render(ownership));
    }
}

/// Applies `op` to both, checking the activation rules on the way.
fn apply(ownership: &mut ShardOwnership, model: &mut Model, op: Op) {
    match op {
        Op::SetAssignment(shards) => ownership.set_assignment(shards),
        Op::BeginRound { handing_off } => {
            let before = ownership.acquired.clone();
            let moved = ownership.begin_round(handing_off);
            assert!(
                moved.iter().all(|shard| before.contains(shard) && ownership.is_releasing(shard))
            );
            if handing_off {
                assert_eq!(ownership.n_acquired(), 0);
            }
        }
        Op::AcquireRound { gates, keep, joins_pending_after } => {
            let to_acquire = ownership.shards_to_acquire(gates);
            if model.blocks_acquisition() || gates.shutting_down || gates.joins_pending {
                assert!(to_acquire.is_empty(), "{}", render(ownership));
            }
            let locked: Vec<ShardId> = to_acquire
                .into_iter()
                .zip(keep)
                .filter_map(|(shard, keep)| keep.then_some(shard))
                .collect();
            let outcome = ownership.on_acquired(&locked, joins_pending_after);
            check_outcome(model, &locked, joins_pending_after, &outcome);
        }
        Op::OnAcquired { shards, joins_pending } => {
            let outcome = ownership.on_acquired(&shards, joins_pending);
            check_outcome(model, &shards, joins_pending, &outcome);
        }
        Op::Refresh { lost } => {
            let refreshed = ownership.held();
            let returned: Vec<ShardId> =
                refreshed.iter().filter(|shard| !lost.contains(shard)).cloned().collect();
            ownership.release_lost_shards(&refreshed, &returned);
        }
        Op::ReleaseLost { refreshed, returned } => {
            ownership.release_lost_shards(&refreshed, &returned);
        }
        Op::MarkUnhealthy => {
            if let Some(affected) = ownership.mark_unhealthy() {
                model.unhealthy = true;
                model.owed.extend(affected);
            } else {
                assert!(model.unhealthy);
            }
        }
        Op::MarkHealthy(shards) => {
            assert_eq!(ownership.mark_healthy(shards), model.unhealthy);
            model.unhealthy = false;
        }
        Op::StartForcedRelease => {
            if let Some(started) = ownership.start_forced_release() {
                assert!(model.running.is_none());
                assert_eq!(started.iter().cloned().collect::<BTreeSet<_>>(), model.owed);
                model.running = Some(started);
            }
        }
        Op::FinishForcedRelease => {
            if let Some(started) = model.running.take() {
                ownership.finish_forced_release(&started);
                for shard in &started {
                    model.owed.remove(shard);
                }
            }
        }
        Op::ReleaseFinished(shard) => {
            ownership.release_finished(&shard);
            model.owed.remove(&shard);
        }
    }
}

fn check_outcome(model: &Model, locked: &[ShardId], joins_pending: bool, outcome: &AcquiredShards) {
    if model.blocks_acquisition() || joins_pending {
        assert!(outcome.activated.is_empty(), "activated {:?} while gated", outcome.activated);
    }
    let reported: BTreeSet<&ShardId> =
        outcome.activated.iter().chain(&outcome.to_release).collect();
    assert!(reported.iter().all(|shard| locked.contains(shard)));
    assert_eq!(reported.len(), outcome.activated.len() + outcome.to_release.len());
}

/// A state that satisfies the invariants: each shard of the universe is in none, one of
/// acquired / releasing / force-releasing, and assigned or not.
fn any_state() -> impl Strategy<Value = ShardOwnership> {
    (proptest::collection::vec((0u8..4, any::<bool>()), 7), any::<bool>()).prop_map(
        |(placement, healthy)| {
            let mut ownership = ShardOwnership::new();
            for (idx, (place, assigned)) in placement.into_iter().enumerate() {
                let shard = if idx < 4 {
                    ShardId::new(ShardGroup::from("a"), u32::try_from(idx + 1).unwrap())
                } else {
                    ShardId::new(ShardGroup::from("b"), u32::try_from(idx - 3).unwrap())
                };
                if assigned && healthy {
                    ownership.self_shards.insert(shard.clone());
                }
                match place {
                    1 if healthy => {
                        ownership.acquired.insert(shard);
                    }
                    2 => {
                        ownership.releasing.insert(shard);
                    }
                    3 => {
                        ownership.releasing.insert(shard.clone());
                        ownership.force_releasing.insert(shard);
                    }
                    _ => {}
                }
            }
            ownership.locks_healthy = healthy;
            ownership
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_operations_keep_the_invariants_and_the_activation_rules(
        ops in proptest::collection::vec(any_op(), 0..40),
    ) {
        let mut ownership = ShardOwnership::new();
        let mut model = Model::default();
        for op in ops {
            apply(&mut ownership, &mut model, op);
            assert_invariants(&ownership);
            prop_assert_eq!(ownership.locks_healthy(), !model.unhealthy);
            prop_assert_eq!(&ownership.force_releasing, &model.owed);
            prop_assert_eq!(
                ownership.forced_release_pending(),
                !model.owed.is_empty() || model.running.is_some()
            );
            if model.blocks_acquisition() {
                prop_assert!(ownership.shards_to_acquire(OPEN).is_empty());
            }
        }
    }

    #[test]
    fn release_lost_shards_matches_its_specification(
        mut ownership in any_state(),
        refreshed in any_shards(),
        returned in any_shards(),
    ) {
        let before = ownership.clone();
        let any_releasing = ownership.release_lost_shards(&refreshed, &returned);

        let lost: BTreeSet<ShardId> = refreshed
            .iter()
            .filter(|shard| before.acquired.contains(*shard))
            .filter(|shard| !returned.contains(shard) || !before.self_shards.contains(*shard))
            .cloned()
            .collect();
        let acquired: BTreeSet<ShardId> = before.acquired.difference(&lost).cloned().collect();
        let releasing: BTreeSet<ShardId> = before.releasing.union(&lost).cloned().collect();
        prop_assert_eq!(&ownership.acquired, &acquired);
        prop_assert_eq!(&ownership.releasing, &releasing);
        prop_assert_eq!(&ownership.self_shards, &before.self_shards);
        prop_assert_eq!(&ownership.force_releasing, &before.force_releasing);
        prop_assert_eq!(any_releasing, !releasing.is_empty());
    }

    #[test]
    fn after_unhealthy_locks_nothing_is_acquired_until_healthy_and_released(
        ops in proptest::collection::vec(any_op(), 0..20),
        assigned in any_shards(),
    ) {
        let mut ownership = ShardOwnership::new();
        let mut model = Model::default();
        for op in ops {
            apply(&mut ownership, &mut model, op);
        }
        // Let a forced release that is already running end first.
        apply(&mut ownership, &mut model, Op::FinishForcedRelease);
        let was_healthy = ownership.locks_healthy();
        let held_before: BTreeSet<ShardId> = ownership.held().into_iter().collect();

        let affected = ownership.mark_unhealthy();
        prop_assert_eq!(affected.is_some(), was_healthy);
        if let Some(affected) = affected {
            prop_assert_eq!(affected.into_iter().collect::<BTreeSet<_>>(), held_before);
        }
        prop_assert!(ownership.shards_to_acquire(OPEN).is_empty());
        let forcing = ownership.n_force_releasing() > 0;
        let started = ownership.start_forced_release();
        prop_assert_eq!(started.is_some(), forcing);
        prop_assert!(ownership.shards_to_acquire(OPEN).is_empty());
        ownership.mark_healthy(assigned.clone());
        if let Some(started) = started {
            prop_assert!(ownership.shards_to_acquire(OPEN).is_empty());
            ownership.finish_forced_release(&started);
        }
        // Shards locked while unhealthy are released one by one, not by the forced release.
        for shard in ownership.releasing().cloned().collect::<Vec<_>>() {
            prop_assert!(!ownership.is_force_releasing(&shard));
            ownership.release_finished(&shard);
        }
        // Nothing is held any more, so everything assigned can be taken again.
        let assigned: BTreeSet<ShardId> = assigned.into_iter().collect();
        prop_assert_eq!(
            ownership.shards_to_acquire(OPEN),
            assigned.into_iter().collect::<Vec<_>>()
        );
        prop_assert!(ownership.is_handed_off());
    }
}
