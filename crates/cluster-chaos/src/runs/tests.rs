//! The attribution of re-runs to faults and the order check, on made-up runs.

use std::collections::{BTreeMap, BTreeSet};

use super::{Fault, FaultKind, ProcessId, Run, StoredRequest, check_order, check_reruns};

fn process(runner: &str, process: u32, pid: u32) -> ProcessId {
    ProcessId { runner: runner.to_owned(), process, pid }
}

fn run(seq: i64, key: &str, request_id: i64, in_process: &ProcessId) -> Run {
    Run {
        seq,
        key: key.to_owned(),
        entity: "ledger-1".to_owned(),
        request_id,
        runner: in_process.runner.clone(),
        process: in_process.process,
        pid: in_process.pid,
    }
}

fn committed(entries: &[(&str, i64)]) -> BTreeMap<String, BTreeSet<i64>> {
    let mut committed: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    for (key, seq) in entries {
        committed.entry((*key).to_owned()).or_default().insert(*seq);
    }
    committed
}

fn fault(kind: FaultKind, of: &ProcessId, began: i64, ended: i64) -> Fault {
    Fault { kind, process: of.clone(), began, ended }
}

#[test]
fn a_run_cut_off_by_a_kill_or_a_freeze_is_excused() {
    let (one, two, three) =
        (process("runner-1", 1, 11), process("runner-2", 1, 12), process("runner-3", 1, 13));
    let runs = [
        run(1, "a", 100, &one),
        run(5, "a", 100, &three),
        run(2, "b", 101, &two),
        run(8, "b", 101, &three),
        // A resumed process starting a handler of a shard it lost, after the other's commit.
        run(9, "b", 101, &two),
        run(3, "c", 102, &three),
    ];
    let faults = [
        fault(FaultKind::Kill, &one, 4, 4),
        fault(FaultKind::Freeze { runs_until: 20 }, &two, 6, 10),
        fault(FaultKind::Terminate, &three, 30, 31),
    ];
    let found = check_reruns(&runs, &committed(&[("a", 5), ("b", 8), ("c", 3)]), &faults);
    assert_eq!((found.runs, found.deposits, found.reruns, found.unexcused), (6, 3, 3, 0));
    assert!(found.violations.is_empty(), "{:?}", found.violations);
    assert_eq!(found.excused.get("SIGKILL runner-1 (process 1)"), Some(&1));
    assert_eq!(found.excused.get("SIGSTOP runner-2 (process 1)"), Some(&2));
}

#[test]
fn a_late_commit_of_a_frozen_runner_is_counted_apart_and_nothing_else_is() {
    let (two, three) = (process("runner-2", 1, 12), process("runner-3", 1, 13));
    let runs = [
        // Runner-2 ran "a", froze before its commit, and committed once resumed; runner-3 had
        // taken the shard and ran "a" again, and its run was rolled back.
        run(2, "a", 100, &two),
        run(7, "a", 100, &three),
        // Runner-3 ran "b" before the freeze began: no freeze of runner-2 explains its rerun.
        run(3, "b", 101, &two),
        run(5, "b", 101, &three),
        // Runner-2's committed run of "c" started during the freeze's aftermath, not before.
        run(11, "c", 102, &two),
        run(12, "c", 102, &three),
    ];
    let faults = [fault(FaultKind::Freeze { runs_until: 20 }, &two, 6, 10)];
    let found = check_reruns(&runs, &committed(&[("a", 2), ("b", 3), ("c", 11)]), &faults);
    assert_eq!(found.unexcused, 2, "{:?}", found.violations);
    assert!(found.violations[0].starts_with("b:"), "{:?}", found.violations);
    assert!(found.violations[1].starts_with("c:"), "{:?}", found.violations);
    assert_eq!(found.excused.get("late commit after SIGSTOP runner-2 (process 1)"), Some(&1));
}

#[test]
fn a_rerun_after_a_graceful_stop_or_a_join_is_a_violation() {
    let (three, four) = (process("runner-3", 1, 13), process("runner-4", 1, 14));
    let runs = [run(1, "a", 100, &three), run(3, "a", 100, &four)];
    let faults = [fault(FaultKind::Join, &four, 0, 1), fault(FaultKind::Terminate, &three, 2, 4)];
    let found = check_reruns(&runs, &committed(&[("a", 3)]), &faults);
    assert_eq!((found.reruns, found.unexcused), (1, 1));
    assert!(found.violations[0].contains("SIGTERM runner-3"), "{:?}", found.violations);
}

#[test]
fn a_fault_excuses_only_its_own_process_and_only_what_it_cut_off() {
    let (one, one_again, two) =
        (process("runner-1", 1, 11), process("runner-1", 2, 21), process("runner-2", 1, 12));
    let runs = [
        // Runner-1's second process was never killed: the kill of its first does not count.
        run(6, "a", 100, &one_again),
        run(7, "a", 100, &two),
        // Answered before the kill began: the kill did not cut that run off.
        run(1, "b", 101, &one),
        run(2, "b", 101, &two),
        // Run by the frozen process after its freeze's window closed.
        run(30, "c", 102, &two),
        run(31, "c", 102, &one_again),
    ];
    let faults = [
        fault(FaultKind::Kill, &one, 3, 3),
        fault(FaultKind::Freeze { runs_until: 20 }, &two, 10, 15),
    ];
    let found = check_reruns(&runs, &committed(&[("a", 7), ("b", 2), ("c", 31)]), &faults);
    assert_eq!((found.reruns, found.unexcused), (3, 3), "{:?}", found.violations);
    assert!(found.excused.is_empty());
}

#[test]
fn runs_of_a_deposit_that_was_never_committed_are_violations() {
    let one = process("runner-1", 1, 11);
    let runs = [run(1, "a", 100, &one)];
    let found = check_reruns(&runs, &BTreeMap::new(), &[fault(FaultKind::Kill, &one, 2, 2)]);
    assert_eq!(found.unexcused, 1);
}

fn stored(rowid: i64, id: i64, entity: &str) -> StoredRequest {
    StoredRequest { rowid, id, entity: entity.to_owned() }
}

#[test]
fn first_runs_in_storage_order_pass_and_an_inversion_fails() {
    let one = process("runner-1", 1, 11);
    let requests =
        [stored(1, 100, "ledger-1"), stored(2, 101, "ledger-1"), stored(3, 102, "ledger-2")];
    let mut runs = vec![run(5, "a", 100, &one), run(6, "b", 101, &one), run(2, "c", 102, &one)];
    // A re-run of the earlier request after the later one's first run changes nothing.
    runs.push(run(9, "a", 100, &one));
    let found = check_order(&requests, &runs, &BTreeSet::new());
    assert_eq!((found.entities, found.pairs, found.violation_count), (1, 1, 0));

    let inverted = [run(6, "a", 100, &one), run(5, "b", 101, &one)];
    let found = check_order(&requests, &inverted, &BTreeSet::new());
    assert_eq!(found.violation_count, 1);
    assert!(found.violations[0].contains("b (rowid 2)"), "{:?}", found.violations);
}

#[test]
fn a_run_of_a_request_that_was_not_stored_is_a_violation() {
    let one = process("runner-1", 1, 11);
    let found =
        check_order(&[stored(1, 100, "ledger-1")], &[run(1, "x", 999, &one)], &BTreeSet::new());
    assert_eq!(found.violation_count, 1);
}

#[test]
fn a_run_of_a_purged_deposit_is_counted_and_an_unknown_one_still_fails() {
    let one = process("runner-1", 1, 11);
    // Deposit "a" (request 100) was deleted by retention; "b" and "c" are stored in order.
    let requests = [stored(2, 101, "ledger-1"), stored(3, 102, "ledger-1")];
    let runs = [
        run(1, "a", 100, &one),
        run(2, "a", 100, &one),
        run(3, "b", 101, &one),
        run(4, "c", 102, &one),
    ];
    let purged: BTreeSet<String> = ["a".to_owned()].into();
    let found = check_order(&requests, &runs, &purged);
    assert_eq!((found.purged, found.pairs, found.violation_count), (1, 1, 0), "{found:?}");

    // A request that is gone while its deposit is not one retention deleted is still flagged,
    // and so are the stored ones out of order next to a purged one.
    let mut unknown = runs.to_vec();
    unknown.push(run(5, "x", 999, &one));
    let found = check_order(&requests, &unknown, &purged);
    assert_eq!((found.purged, found.violation_count), (1, 1), "{found:?}");
    assert!(found.violations[0].contains("x: run #5 of request 999"), "{:?}", found.violations);
    let inverted = [run(1, "a", 100, &one), run(4, "b", 101, &one), run(3, "c", 102, &one)];
    let found = check_order(&requests, &inverted, &purged);
    assert_eq!((found.purged, found.violation_count), (1, 1), "{found:?}");
}
