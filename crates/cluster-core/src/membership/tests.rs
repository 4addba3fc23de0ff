//! Scripted sync-loop scenarios (one rendered line per observation) and properties of the
//! registry state machine checked against assignments computed from scratch.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use expect_test::{Expect, expect};
use proptest::prelude::*;

use super::*;
use crate::ids::RunnerWeight;

const SHARDS: u32 = 12;

fn config(join_debounce_ms: u64) -> MembershipConfig {
    MembershipConfig {
        shards_per_group: SHARDS,
        join_debounce: Duration::from_millis(join_debounce_ms),
    }
}

fn at(millis: i64) -> Timestamp {
    Timestamp::from_unix_millis(millis)
}

/// Runner `n` at `10.0.0.n:34431`, in the default group, weight 1.
fn runner(n: u8) -> Runner {
    runner_with(n, &["default"], 1.0)
}

fn runner_with(n: u8, groups: &[&str], weight: f64) -> Runner {
    Runner::new(
        RunnerAddress::new(format!("10.0.0.{n}"), 34431),
        groups.iter().map(|group| ShardGroup::from(*group)).collect(),
        RunnerWeight::new(weight).unwrap(),
    )
}

fn healthy(runners: &[Runner]) -> Vec<(Runner, bool)> {
    runners.iter().map(|runner| (runner.clone(), true)).collect()
}

/// The assignment of the healthy runners, computed from scratch with fresh rings.
fn fresh_assignment<'a>(
    healthy: impl IntoIterator<Item = &'a Runner>,
    shards_per_group: u32,
) -> Assignment {
    let mut rings: BTreeMap<ShardGroup, HashRing<RunnerAddress>> = BTreeMap::new();
    for runner in healthy {
        for group in &runner.groups {
            rings
                .entry(group.clone())
                .or_default()
                .add(runner.address.clone(), runner.weight.get());
        }
    }
    let mut owners = BTreeMap::new();
    for (group, ring) in &rings {
        for (idx, owner) in ring.get_shards(shards_per_group).unwrap().into_iter().enumerate() {
            let shard_number = u32::try_from(idx + 1).unwrap();
            owners.insert(ShardId::new(group.clone(), shard_number), owner.clone());
        }
    }
    Assignment { owners }
}

/// One observation of a script: time, registry content, and this process's runner.
struct Poll<'a> {
    millis: i64,
    runners: Vec<(Runner, bool)>,
    self_runner: Option<&'a Runner>,
}

fn poll(millis: i64, runners: &[Runner]) -> Poll<'static> {
    Poll { millis, runners: healthy(runners), self_runner: None }
}

/// The last octet of each runner's host, for compact rendering.
fn octet(address: &RunnerAddress) -> &str {
    address.host().rsplit('.').next().unwrap()
}

fn render(millis: i64, step: &MembershipStep) -> String {
    let mut line = format!("t={millis}:");
    match &step.assignment {
        None => line.push_str(" -"),
        Some(assignment) => {
            let mut counts: BTreeMap<&ShardGroup, BTreeMap<&str, usize>> = BTreeMap::new();
            for (shard, owner) in assignment.iter() {
                *counts.entry(shard.group()).or_default().entry(octet(owner)).or_insert(0) += 1;
            }
            line.push_str(" publish");
            if counts.is_empty() {
                line.push_str(" (empty)");
            }
            for (group, owners) in counts {
                let owners: Vec<String> =
                    owners.iter().map(|(owner, count)| format!("{owner}×{count}")).collect();
                write!(line, " {group}[{}]", owners.join(" ")).unwrap();
            }
        }
    }
    if !step.unavailable.is_empty() {
        let gone: Vec<&str> = step.unavailable.iter().map(octet).collect();
        write!(line, " | unavailable {}", gone.join(",")).unwrap();
    }
    if step.reopen_acquisition {
        line.push_str(" | reopen");
    }
    if step.register_again {
        line.push_str(" | register again");
    }
    if step.joins_pending {
        line.push_str(" | joins pending");
    }
    write!(line, " | healthy {}", step.healthy_count).unwrap();
    line
}

/// Runs `polls` through a fresh machine and renders one line per step.
fn check(join_debounce_ms: u64, polls: &[Poll<'_>], expect: Expect) {
    let mut membership = Membership::new(config(join_debounce_ms));
    let mut actual = String::new();
    for poll in polls {
        let step = membership.observe(at(poll.millis), &poll.runners, poll.self_runner);
        if let Some(assignment) = &step.assignment {
            let ringed: Vec<&Runner> = membership.healthy.difference(&membership.pending).collect();
            assert_eq!(*assignment, fresh_assignment(ringed, SHARDS));
        }
        actual.push_str(&render(poll.millis, &step));
        actual.push('\n');
    }
    expect.assert_eq(&actual);
}

#[test]
fn without_debounce_every_change_publishes_at_once() {
    check(
        0,
        &[
            poll(0, &[runner(1)]),
            poll(3000, &[runner(1), runner(2)]),
            poll(6000, &[runner(1), runner(2)]),
            poll(9000, &[runner(1), runner(2), runner(3)]),
            poll(12000, &[runner(1), runner(3)]),
        ],
        expect![[r#"
            t=0: publish default[1×12] | healthy 1
            t=3000: publish default[1×6 2×6] | healthy 2
            t=6000: - | healthy 2
            t=9000: publish default[1×4 2×4 3×4] | healthy 3
            t=12000: publish default[1×6 3×6] | unavailable 2 | healthy 2
        "#]],
    );
}

#[test]
fn an_empty_registry_publishes_nothing() {
    check(
        10_000,
        &[poll(0, &[]), poll(3000, &[runner(1), runner(2)])],
        expect![[r#"
            t=0: - | healthy 0
            t=3000: publish default[1×6 2×6] | healthy 2
        "#]],
    );
}

#[test]
fn the_first_assignment_never_waits() {
    check(
        10_000,
        &[poll(0, &[runner(1), runner(2)]), poll(1, &[runner(1), runner(2)])],
        expect![[r#"
            t=0: publish default[1×6 2×6] | healthy 2
            t=1: - | healthy 2
        "#]],
    );
}

#[test]
fn joins_wait_for_a_quiet_period() {
    check(
        10_000,
        &[
            poll(0, &[runner(1)]),
            poll(3000, &[runner(1), runner(2)]),
            poll(6000, &[runner(1), runner(2), runner(3)]),
            poll(9000, &[runner(1), runner(2), runner(3)]),
            poll(15_999, &[runner(1), runner(2), runner(3)]),
            poll(16_000, &[runner(1), runner(2), runner(3)]),
            poll(19_000, &[runner(1), runner(2), runner(3)]),
        ],
        expect![[r#"
            t=0: publish default[1×12] | healthy 1
            t=3000: - | joins pending | healthy 2
            t=6000: - | joins pending | healthy 3
            t=9000: - | joins pending | healthy 3
            t=15999: - | joins pending | healthy 3
            t=16000: publish default[1×4 2×4 3×4] | healthy 3
            t=19000: - | healthy 3
        "#]],
    );
}

#[test]
fn joins_arriving_every_poll_are_published_at_four_debounces() {
    // Debounce 1 s, a poll every 500 ms and a join at every poll: the first join is at 500 ms,
    // so the cap publishes at 4500 ms although the quiet period never elapses.
    let mut polls = vec![poll(0, &[runner(1)])];
    let mut present = vec![runner(1)];
    for n in 2..=10 {
        present.push(runner(n));
        polls.push(poll(500 * i64::from(n - 1), &present));
    }
    check(
        1000,
        &polls,
        expect![[r#"
            t=0: publish default[1×12] | healthy 1
            t=500: - | joins pending | healthy 2
            t=1000: - | joins pending | healthy 3
            t=1500: - | joins pending | healthy 4
            t=2000: - | joins pending | healthy 5
            t=2500: - | joins pending | healthy 6
            t=3000: - | joins pending | healthy 7
            t=3500: - | joins pending | healthy 8
            t=4000: - | joins pending | healthy 9
            t=4500: publish default[1×2 10×1 2×1 3×1 4×1 5×1 6×1 7×2 8×1 9×1] | healthy 10
        "#]],
    );
}

#[test]
fn a_departure_publishes_at_once_with_the_pending_joins() {
    check(
        10_000,
        &[
            poll(0, &[runner(1), runner(2)]),
            poll(3000, &[runner(1), runner(2), runner(3)]),
            poll(4000, &[runner(1), runner(3)]),
        ],
        expect![[r#"
            t=0: publish default[1×6 2×6] | healthy 2
            t=3000: - | joins pending | healthy 3
            t=4000: publish default[1×6 3×6] | unavailable 2 | healthy 2
        "#]],
    );
}

#[test]
fn an_unhealthy_runner_publishes_at_once_with_the_pending_joins() {
    let unhealthy_2 = Poll {
        millis: 4000,
        runners: vec![(runner(1), true), (runner(2), false), (runner(3), true)],
        self_runner: None,
    };
    check(
        10_000,
        &[
            poll(0, &[runner(1), runner(2)]),
            poll(3000, &[runner(1), runner(2), runner(3)]),
            unhealthy_2,
        ],
        expect![[r#"
            t=0: publish default[1×6 2×6] | healthy 2
            t=3000: - | joins pending | healthy 3
            t=4000: publish default[1×6 3×6] | unavailable 2 | healthy 2
        "#]],
    );
}

#[test]
fn a_pending_runner_that_leaves_only_restarts_the_quiet_period() {
    check(
        10_000,
        &[
            poll(0, &[runner(1)]),
            poll(1000, &[runner(1), runner(2), runner(3)]),
            poll(5000, &[runner(1), runner(3)]),
            poll(14_999, &[runner(1), runner(3)]),
            poll(15_000, &[runner(1), runner(3)]),
        ],
        expect![[r#"
            t=0: publish default[1×12] | healthy 1
            t=1000: - | joins pending | healthy 3
            t=5000: - | unavailable 2 | joins pending | healthy 2
            t=14999: - | joins pending | healthy 2
            t=15000: publish default[1×6 3×6] | healthy 2
        "#]],
    );
}

#[test]
fn the_last_pending_runner_leaving_reopens_acquisition() {
    check(
        10_000,
        &[
            poll(0, &[runner(1)]),
            poll(1000, &[runner(1), runner(2)]),
            poll(5000, &[runner(1)]),
            poll(20_000, &[runner(1)]),
        ],
        expect![[r#"
            t=0: publish default[1×12] | healthy 1
            t=1000: - | joins pending | healthy 2
            t=5000: - | unavailable 2 | reopen | healthy 1
            t=20000: - | healthy 1
        "#]],
    );
}

#[test]
fn register_again_keeps_the_change_for_the_next_observation() {
    let me = runner(1);
    let mut membership = Membership::new(config(10_000));
    assert!(membership.needs_registration(&me));

    // Runner 2 joined, but this runner is missing: nothing is published yet.
    let step = membership.observe(at(0), &healthy(&[runner(2)]), Some(&me));
    assert!(step.register_again);
    assert_eq!(step.assignment, None);
    assert!(membership.needs_registration(&me));
    assert!(!membership.assignments_published());

    // Registered, but (say) marked unhealthy: nothing changes in this observation, yet the
    // kept change publishes, and runner 2 did not wait for the debounce.
    let step = membership.observe(at(1), &[(runner(2), true), (me.clone(), false)], Some(&me));
    assert!(!step.register_again);
    assert!(!membership.needs_registration(&me));
    assert_eq!(step.assignment, Some(fresh_assignment([&runner(2)], SHARDS)));
}

#[test]
fn a_never_healthy_runner_leaving_recomputes_the_same_assignment() {
    let mut membership = Membership::new(config(0));
    let first = membership.observe(at(0), &[(runner(1), true), (runner(2), false)], None);
    let second = membership.observe(at(1), &healthy(&[runner(1)]), None);
    assert_eq!(second.unavailable, vec![runner(2).address]);
    assert!(first.assignment.is_some());
    assert_eq!(first.assignment, second.assignment);
}

#[test]
fn a_weight_change_replaces_the_runner_in_the_rings() {
    let heavy = runner_with(1, &["default"], 2.0);
    check(
        10_000,
        &[poll(0, &[runner(1), runner(2)]), poll(3000, &[heavy, runner(2)])],
        expect![[r#"
            t=0: publish default[1×6 2×6] | healthy 2
            t=3000: publish default[1×8 2×4] | unavailable 1 | healthy 2
        "#]],
    );
}

#[test]
fn a_departure_leaves_the_rings_the_runner_joined() {
    // Runner 1 re-registers with another group but the same address and weight: the same
    // runner, so its rings do not change; when it leaves, it leaves the ring it joined.
    let polls = [
        poll(0, &[runner_with(1, &["a"], 1.0), runner_with(2, &["a", "b"], 1.0)]),
        poll(1000, &[runner_with(1, &["a", "c"], 1.0), runner_with(2, &["a", "b"], 1.0)]),
        poll(2000, &[runner_with(2, &["a", "b"], 1.0)]),
    ];
    check(
        0,
        &polls,
        expect![[r#"
            t=0: publish a[1×6 2×6] b[2×12] | healthy 2
            t=1000: - | healthy 2
            t=2000: publish a[2×12] b[2×12] | unavailable 1 | healthy 1
        "#]],
    );
}

#[test]
fn groups_without_runners_lose_their_owners() {
    check(
        0,
        &[
            poll(0, &[runner_with(1, &["a"], 1.0), runner_with(2, &["b"], 1.0)]),
            poll(1000, &[runner_with(2, &["b"], 1.0)]),
            poll(2000, &[]),
        ],
        expect![[r#"
            t=0: publish a[1×12] b[2×12] | healthy 2
            t=1000: publish b[2×12] | unavailable 1 | healthy 1
            t=2000: publish (empty) | unavailable 2 | healthy 0
        "#]],
    );
}

#[test]
fn an_address_listed_twice_counts_once() {
    let mut membership = Membership::new(config(0));
    let step = membership.observe(
        at(0),
        &[(runner(1), true), (runner_with(1, &["default"], 3.0), true), (runner(2), true)],
        None,
    );
    assert_eq!(step.healthy_count, 2);
    assert_eq!(step.assignment, Some(fresh_assignment([&runner(1), &runner(2)], SHARDS)));
}

#[test]
fn assignment_queries() {
    let assignment = fresh_assignment([&runner(1), &runner(2)], SHARDS);
    assert_eq!(assignment.len(), 12);
    assert!(!assignment.is_empty());
    let mine = assignment.shards_of(&runner(1).address);
    let theirs = assignment.shards_of(&runner(2).address);
    assert_eq!(mine.len() + theirs.len(), 12);
    assert!(mine.is_disjoint(&theirs));
    for shard in &mine {
        assert_eq!(assignment.owner(shard), Some(&runner(1).address));
    }
    assert_eq!(assignment.owner(&ShardId::new(ShardGroup::from("other"), 1)), None);
    assert_eq!(assignment.groups(), BTreeSet::from([&ShardGroup::default_group()]));
}

// --- properties ---

/// Runner `idx` (0..6) serves groups depending on `idx`; the weight is 1 or 2.
fn generated_runner(idx: u8, heavy: bool) -> Runner {
    let groups: &[&str] = match idx % 3 {
        0 => &["a"],
        1 => &["b"],
        _ => &["a", "b"],
    };
    runner_with(idx, groups, if heavy { 2.0 } else { 1.0 })
}

/// One registry content: at most one entry per address, each healthy or not.
fn observation() -> impl Strategy<Value = Vec<(Runner, bool)>> {
    proptest::collection::btree_map(0u8..6, (any::<bool>(), any::<bool>()), 0..6).prop_map(
        |entries| {
            entries
                .into_iter()
                .map(|(idx, (heavy, healthy))| (generated_runner(idx, heavy), healthy))
                .collect()
        },
    )
}

/// Observations with the milliseconds elapsed before each.
fn history() -> impl Strategy<Value = Vec<(u16, Vec<(Runner, bool)>)>> {
    proptest::collection::vec((0u16..4000, observation()), 0..12)
}

fn healthy_set(observation: &[(Runner, bool)]) -> BTreeSet<Runner> {
    observation.iter().filter(|(_, healthy)| *healthy).map(|(runner, _)| runner.clone()).collect()
}

/// Runs `history`, checking that every publication covers exactly the shards of the groups
/// served by the runners in the rings. Returns the machine, the time of the last observation
/// and the last published assignment.
fn run_history(
    join_debounce_ms: u64,
    history: &[(u16, Vec<(Runner, bool)>)],
) -> (Membership, i64, Option<Assignment>) {
    let mut membership = Membership::new(config(join_debounce_ms));
    let mut millis = 0;
    let mut published = None;
    for (elapsed, observation) in history {
        millis += i64::from(*elapsed);
        let step = membership.observe(at(millis), observation, None);
        assert!(!step.register_again);
        if let Some(assignment) = step.assignment {
            check_coverage(&membership, &assignment);
            published = Some(assignment);
        }
    }
    (membership, millis, published)
}

fn check_coverage(membership: &Membership, assignment: &Assignment) {
    let ringed: Vec<&Runner> = membership.healthy.difference(&membership.pending).collect();
    let served: BTreeSet<&ShardGroup> = ringed.iter().flat_map(|runner| &runner.groups).collect();
    let expected_shards: BTreeSet<ShardId> = served
        .iter()
        .flat_map(|group| (1..=SHARDS).map(|number| ShardId::new((*group).clone(), number)))
        .collect();
    let actual_shards: BTreeSet<ShardId> =
        assignment.iter().map(|(shard, _)| shard.clone()).collect();
    assert_eq!(actual_shards, expected_shards);
    for (shard, owner) in assignment.iter() {
        assert!(
            ringed
                .iter()
                .any(|runner| runner.address == *owner && runner.groups.contains(shard.group())),
            "{shard} is owned by {owner}, which does not serve its group"
        );
    }
}

fn join_debounce_ms() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), Just(1000), Just(5000)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn without_debounce_the_assignment_follows_the_healthy_runners(history in history()) {
        let mut membership = Membership::new(config(0));
        let mut previous: BTreeMap<Runner, bool> = BTreeMap::new();
        let mut millis = 0;
        for (elapsed, observation) in &history {
            millis += i64::from(*elapsed);
            let step = membership.observe(at(millis), observation, None);
            let current: BTreeMap<Runner, bool> = observation.iter().cloned().collect();
            let mut departed: Vec<RunnerAddress> = previous
                .iter()
                .filter(|(runner, was_healthy)| match current.get(*runner) {
                    None => true,
                    Some(healthy) => **was_healthy && !*healthy,
                })
                .map(|(runner, _)| runner.address.clone())
                .collect();
            let joined = current
                .iter()
                .any(|(runner, healthy)| *healthy && previous.get(runner) != Some(&true));
            departed.sort();
            let mut unavailable = step.unavailable.clone();
            unavailable.sort();
            prop_assert_eq!(&unavailable, &departed);
            prop_assert_eq!(step.assignment.is_some(), joined || !departed.is_empty());
            prop_assert!(!step.joins_pending);
            if let Some(assignment) = step.assignment {
                prop_assert_eq!(assignment, fresh_assignment(&healthy_set(observation), SHARDS));
            }
            prop_assert_eq!(step.healthy_count, healthy_set(observation).len());
            previous = current;
        }
    }

    #[test]
    fn the_first_assignment_never_waits_for_the_debounce(
        observation in observation(),
        join_debounce_ms in join_debounce_ms(),
    ) {
        let mut membership = Membership::new(config(join_debounce_ms));
        let step = membership.observe(at(0), &observation, None);
        let healthy = healthy_set(&observation);
        prop_assert_eq!(step.assignment.is_some(), !healthy.is_empty());
        prop_assert!(!step.joins_pending);
        if let Some(assignment) = step.assignment {
            prop_assert_eq!(assignment, fresh_assignment(&healthy, SHARDS));
        }
    }

    #[test]
    fn the_settled_assignment_depends_only_on_the_healthy_runners(
        join_debounce_ms in join_debounce_ms(),
        history in history(),
        last in observation(),
        rotate_by in 0usize..6,
    ) {
        let (mut membership, millis, mut published) = run_history(join_debounce_ms, &history);
        // Observe the final registry content once, then again after the longest wait.
        let mut last_rotated = last.clone();
        last_rotated.rotate_left(rotate_by.min(last.len()));
        let settle_ms = 4 * i64::try_from(join_debounce_ms).unwrap() + 1;
        for (offset, observation) in [(1, &last), (1 + settle_ms, &last_rotated)] {
            let step = membership.observe(at(millis + offset), observation, None);
            if let Some(assignment) = step.assignment {
                published = Some(assignment);
            }
        }
        prop_assert!(!membership.has_pending_joins());
        let expected = fresh_assignment(&healthy_set(&last), SHARDS);
        prop_assert_eq!(&published.unwrap_or_default(), &expected);

        // A machine that only ever saw the final content agrees.
        let mut direct = Membership::new(config(join_debounce_ms));
        let direct_step = direct.observe(at(0), &last, None);
        prop_assert_eq!(direct_step.assignment.unwrap_or_default(), expected);
    }

    #[test]
    fn nothing_is_published_while_nothing_changes(
        join_debounce_ms in join_debounce_ms(),
        history in history(),
        last in observation(),
        gaps in proptest::collection::vec(0u16..20_000, 1..6),
    ) {
        let (mut membership, mut millis, _) = run_history(join_debounce_ms, &history);
        // Settle: observe the final content and wait out the debounce cap.
        membership.observe(at(millis + 1), &last, None);
        millis += 2 + 4 * i64::try_from(join_debounce_ms).unwrap();
        membership.observe(at(millis), &last, None);
        prop_assert!(!membership.has_pending_joins());
        for gap in gaps {
            millis += i64::from(gap);
            let step = membership.observe(at(millis), &last, None);
            prop_assert_eq!(step, MembershipStep {
                healthy_count: healthy_set(&last).len(),
                ..MembershipStep::default()
            });
        }
    }

    #[test]
    fn assignments_cover_exactly_the_served_groups(
        join_debounce_ms in join_debounce_ms(),
        history in history(),
    ) {
        // `run_history` checks every publication; with no debounce the rings hold every
        // healthy runner, so check that case against the registry content directly too.
        let (membership, _, published) = run_history(join_debounce_ms, &history);
        if join_debounce_ms == 0 {
            let served: BTreeSet<&ShardGroup> =
                membership.healthy.iter().flat_map(|runner| &runner.groups).collect();
            let published = published.unwrap_or_default();
            prop_assert_eq!(published.len(), served.len() * usize::try_from(SHARDS).unwrap());
            prop_assert_eq!(published.groups(), served);
        }
    }

    #[test]
    fn joins_within_the_debounce_are_not_published(
        joins in proptest::collection::vec(1u16..1000, 1..4),
    ) {
        // Debounce 1 s: joins arrive less than 1 s apart and within 4 s of the first, so
        // nothing is published until a poll 1 s after the last join.
        let mut membership = Membership::new(config(1000));
        let mut present = vec![runner(1)];
        membership.observe(at(0), &healthy(&present), None);
        let mut millis = 0;
        for (idx, gap) in joins.iter().enumerate() {
            millis += i64::from(*gap);
            present.push(runner(u8::try_from(idx + 2).unwrap()));
            let step = membership.observe(at(millis), &healthy(&present), None);
            prop_assert_eq!(step.assignment, None);
            prop_assert!(step.joins_pending);
        }
        let step = membership.observe(at(millis + 999), &healthy(&present), None);
        prop_assert_eq!(step.assignment, None);
        let step = membership.observe(at(millis + 1000), &healthy(&present), None);
        prop_assert_eq!(step.assignment, Some(fresh_assignment(&present, SHARDS)));
    }
}
