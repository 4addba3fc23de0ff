//! The connection limit: which connection makes room for a new one.

use std::sync::Arc;

use super::Tracker;

/// At the limit, the connection idle the longest is closed for the new one; a connection with a
/// request in progress never is; with every connection busy the new one is refused.
#[test]
fn at_the_limit_the_connection_idle_the_longest_makes_room() {
    let tracker = Arc::new(Tracker::new(3));
    let first = tracker.admit().unwrap();
    let second = tracker.admit().unwrap();
    let third = tracker.admit().unwrap();
    // The first one is busy; of the idle ones, the second has waited the longest.
    let busy = first.0.busy();
    let fourth = tracker.admit().unwrap();
    assert!(second.0.evict.is_cancelled());
    assert!(!first.0.evict.is_cancelled() && !third.0.evict.is_cancelled());
    // The first one finishes its request: it is now idle more recently than the third.
    drop(busy);
    let fifth = tracker.admit().unwrap();
    assert!(third.0.evict.is_cancelled());
    assert!(!first.0.evict.is_cancelled());
    // Every connection busy: the new one is refused.
    let _busy = [first.0.busy(), fourth.0.busy(), fifth.0.busy()];
    assert!(tracker.admit().is_none());
    // An evicted connection's task ends: its slot was already given to the new one.
    drop((second, third));
    assert_eq!(super::lock(&tracker.open).len(), 3);
}
