//! The queue conformance cases. Each takes a fixture with a fresh table and panics on a
//! violation.
//!
//! The SQL stores count time in whole seconds of the database clock, so a case that needs an
//! item hidden waits for at least two seconds to pass, and a case that needs a claim to lapse
//! waits for it with a deadline.

use std::future::Future;
use std::num::NonZeroU32;
use std::time::Duration;

use tokio::time::Instant;

use cluster_core::queue_storage::{
    ClaimBatch, ClaimedItem, LOCK_EXPIRED_FAILURE, QueueClaim, QueueItem, QueueItemState,
    QueueStorage, TakeOptions,
};

use super::QueueFixture;
use crate::storage_suite::cases::assert_refused;

/// How long a case waits for an eventual condition (a claim lapsing) before failing.
const EVENTUAL: Duration = Duration::from_secs(30);
/// The lock expiration of cases that are not about expiry.
const LONG_EXPIRATION: Duration = Duration::from_secs(60);
/// The lock expiration of cases that wait for expiry.
const SHORT_EXPIRATION: Duration = Duration::from_secs(1);
/// The queue of most cases.
const QUEUE: &str = "DurableQueue/Suite";

fn n(value: u32) -> NonZeroU32 {
    NonZeroU32::new(value).unwrap_or(NonZeroU32::MIN)
}

fn options(limit: u32) -> TakeOptions {
    TakeOptions { limit: n(limit), max_attempts: n(10), lock_expiration: LONG_EXPIRATION }
}

fn element(id: &str) -> String {
    format!(r#"{{"token":"t-{id}","payload":{{"id":"{id}"}}}}"#)
}

async fn offer(storage: &dyn QueueStorage, id: &str) {
    let stored = storage.offer(QUEUE, id, &element(id)).await.unwrap();
    assert!(stored, "offering {id}");
}

async fn take(storage: &dyn QueueStorage, options: &TakeOptions) -> ClaimBatch {
    let batch = storage.take(QUEUE, options).await.unwrap();
    assert!(batch.malformed.is_empty(), "{:?}", batch.malformed);
    batch
}

/// Takes exactly one item.
async fn take_one(storage: &dyn QueueStorage, options: &TakeOptions) -> ClaimedItem {
    let mut batch = take(storage, options).await;
    assert_eq!(batch.items.len(), 1, "{:?}", batch.items);
    batch.items.remove(0)
}

fn ids(batch: &ClaimBatch) -> Vec<&str> {
    batch.items.iter().map(|item| item.id.as_str()).collect()
}

async fn item(storage: &dyn QueueStorage, id: &str) -> QueueItem {
    storage.item(QUEUE, id).await.unwrap().unwrap_or_else(|| panic!("item {id} is stored"))
}

/// A claim with a lock nobody holds (a valid UUID, as PostgreSQL's column wants).
fn foreign(claim: &QueueClaim) -> QueueClaim {
    QueueClaim { sequence: claim.sequence, lock: "00000000-0000-4000-8000-000000000000".into() }
}

/// Retries `check` until it returns `Some`, failing after [`EVENTUAL`].
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + EVENTUAL;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "{what} did not happen within {EVENTUAL:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Items come back oldest first with their element, one attempt counted and a claim recorded.
pub async fn offer_then_take_in_order(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    for id in ["a", "b", "c"] {
        offer(&*storage, id).await;
    }
    let pending = item(&*storage, "a").await;
    assert_eq!(pending.state, QueueItemState::Pending);
    assert_eq!((pending.attempts, pending.claimed), (0, false));
    let batch = take(&*storage, &options(10)).await;
    assert_eq!(ids(&batch), ["a", "b", "c"], "{}", fixture.name());
    for claimed in &batch.items {
        assert_eq!(claimed.attempts, 1);
        assert_eq!(claimed.element, element(&claimed.id));
    }
    let locks: Vec<&str> = batch.items.iter().map(|item| item.claim.lock.as_str()).collect();
    assert!(locks.iter().all(|lock| *lock == locks[0]), "one poll, one lock: {locks:?}");
    let claimed = item(&*storage, "b").await;
    assert_eq!(
        (claimed.state, claimed.attempts, claimed.claimed),
        (QueueItemState::Pending, 1, true)
    );
    assert!(take(&*storage, &options(10)).await.is_empty(), "claimed items are hidden");
}

/// An id is stored once per queue, whether its item is pending, completed or failed.
pub async fn offers_are_deduplicated_by_id_in_every_state(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "a").await;
    assert!(!storage.offer(QUEUE, "a", "{}").await.unwrap(), "a pending duplicate");
    let claimed = take_one(&*storage, &options(10)).await;
    assert!(storage.complete(&claimed.claim).await.unwrap());
    assert!(!storage.offer(QUEUE, "a", "{}").await.unwrap(), "a completed duplicate");
    let stored = item(&*storage, "a").await;
    assert_eq!(stored.state, QueueItemState::Completed);
    assert_eq!(stored.element, element("a"), "the first offer's element is kept");
    assert!(take(&*storage, &options(10)).await.is_empty(), "a duplicate is not queued again");
}

/// Items of one queue are invisible to takers of another, and ids are per queue.
pub async fn queues_are_separate(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "a").await;
    assert!(storage.offer("DurableQueue/Other", "a", "{}").await.unwrap(), "ids are per queue");
    let other = storage.take("DurableQueue/Other", &options(10)).await.unwrap();
    assert_eq!(ids(&other), ["a"]);
    assert_eq!(other.items[0].element, "{}");
    assert_eq!(ids(&take(&*storage, &options(10)).await), ["a"]);
}

/// Ids and queue names that differ only in case, accents or trailing spaces are different (a
/// database's default collation would make them one row, as for the message keys).
pub async fn ids_and_queue_names_are_compared_exactly(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    for id in ["Alice", "alice", "José", "Jose", "Bob", "Bob "] {
        assert!(storage.offer(QUEUE, id, "{}").await.unwrap(), "{}: {id:?}", fixture.name());
    }
    let upper = format!("{QUEUE}X");
    let lower = format!("{QUEUE}x");
    assert!(storage.offer(&upper, "a", "{}").await.unwrap(), "{}", fixture.name());
    assert!(storage.offer(&lower, "a", "{}").await.unwrap(), "{}: queue names", fixture.name());
    assert_eq!(ids(&storage.take(&lower, &options(10)).await.unwrap()), ["a"]);
    assert_eq!(take(&*storage, &options(10)).await.items.len(), 6, "{}", fixture.name());
}

/// At most `limit` items are claimed; the rest wait for the next take, from any store.
pub async fn take_honors_the_limit(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    for id in ["a", "b", "c"] {
        offer(&*storage, id).await;
    }
    assert_eq!(ids(&take(&*storage, &options(2)).await), ["a", "b"]);
    let other = fixture.other_storage().await;
    assert_eq!(ids(&take(&*other, &options(2)).await), ["c"]);
    assert!(take(&*other, &options(2)).await.is_empty());
}

/// Two stores taking at once never claim the same item, and together claim every item.
pub async fn racing_takers_get_disjoint_items(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    let other = fixture.other_storage().await;
    let all: Vec<String> = (0..40).map(|index| format!("item-{index:02}")).collect();
    for id in &all {
        offer(&*storage, id).await;
    }
    let mut taken: Vec<String> = Vec::new();
    let three = options(3);
    for _ in 0..10 {
        let (first, second) = tokio::join!(take(&*storage, &three), take(&*other, &three));
        taken.extend(first.items.into_iter().map(|item| item.id));
        taken.extend(second.items.into_iter().map(|item| item.id));
    }
    taken.sort();
    let before = taken.len();
    taken.dedup();
    assert_eq!(before, taken.len(), "an item was claimed twice");
    assert_eq!(taken, all, "{}", fixture.name());
}

/// A completed item is never taken again; settling the same claim twice changes nothing.
pub async fn complete_settles_once(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "a").await;
    let claimed = take_one(&*storage, &options(10)).await;
    assert!(!storage.complete(&foreign(&claimed.claim)).await.unwrap(), "another lock");
    assert!(storage.complete(&claimed.claim).await.unwrap());
    assert!(!storage.complete(&claimed.claim).await.unwrap(), "settled already");
    assert!(!storage.fail(&claimed.claim, "late").await.unwrap(), "settled already");
    let stored = item(&*storage, "a").await;
    assert_eq!(
        (stored.state, stored.attempts, stored.claimed),
        (QueueItemState::Completed, 1, false)
    );
    assert_eq!(stored.last_failure, None);
    let expired = TakeOptions { lock_expiration: Duration::ZERO, ..options(10) };
    assert!(take(&*storage, &expired).await.is_empty());
}

/// A retried item records its failure, keeps its attempts and is hidden until its delay passed.
pub async fn retry_hides_the_item_until_its_delay(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "a").await;
    let first = take_one(&*storage, &options(10)).await;
    assert!(storage.retry(&first.claim, Duration::from_secs(2), "boom").await.unwrap());
    let stored = item(&*storage, "a").await;
    assert_eq!(
        (stored.state, stored.attempts, stored.claimed),
        (QueueItemState::Pending, 1, false)
    );
    assert_eq!(stored.last_failure.as_deref(), Some("boom"));
    assert!(take(&*storage, &options(10)).await.is_empty(), "hidden during its delay");
    let second = eventually("the retry delay passing", || async {
        take(&*storage, &options(10)).await.items.pop()
    })
    .await;
    assert_eq!((second.id.as_str(), second.attempts), ("a", 2));
    assert_ne!(second.claim.lock, first.claim.lock, "each claim has its own lock");
}

/// An item with `max_attempts` attempts is not claimed; a higher maximum claims it again.
pub async fn max_attempts_stops_claims(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "a").await;
    let once = TakeOptions { max_attempts: n(1), ..options(10) };
    let claimed = take_one(&*storage, &once).await;
    assert!(storage.retry(&claimed.claim, Duration::ZERO, "boom").await.unwrap());
    assert!(take(&*storage, &once).await.is_empty(), "the attempts are used up");
    let twice = TakeOptions { max_attempts: n(2), ..options(10) };
    assert_eq!(take_one(&*storage, &twice).await.attempts, 2);
}

/// A failed item is kept with its failure, never taken again, and not revived by an offer.
pub async fn fail_is_a_dead_letter_that_an_offer_does_not_revive(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "a").await;
    let claimed = take_one(&*storage, &options(10)).await;
    assert!(storage.fail(&claimed.claim, "cannot decode").await.unwrap());
    assert!(!storage.offer(QUEUE, "a", &element("a")).await.unwrap());
    let stored = item(&*storage, "a").await;
    assert_eq!((stored.state, stored.attempts, stored.claimed), (QueueItemState::Failed, 1, false));
    assert_eq!(stored.last_failure.as_deref(), Some("cannot decode"));
    let expired = TakeOptions { lock_expiration: Duration::ZERO, ..options(10) };
    assert!(take(&*storage, &expired).await.is_empty());
}

/// A released item (an interrupted handler) is visible at once and its attempt is not counted.
pub async fn release_gives_the_attempt_back(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "a").await;
    let claimed = take_one(&*storage, &options(10)).await;
    assert!(storage.release(&claimed.claim).await.unwrap());
    let stored = item(&*storage, "a").await;
    assert_eq!(
        (stored.state, stored.attempts, stored.claimed),
        (QueueItemState::Pending, 0, false)
    );
    assert_eq!(take_one(&*storage, &options(10)).await.attempts, 1);
}

/// A claim that was not refreshed lapses: another store claims the item with a new attempt,
/// and the old claim's refreshes and settlements change nothing.
pub async fn a_lapsed_claim_is_taken_again_and_its_settlements_do_nothing(
    fixture: &dyn QueueFixture,
) {
    let storage = fixture.storage();
    let other = fixture.other_storage().await;
    offer(&*storage, "a").await;
    let short = TakeOptions { lock_expiration: SHORT_EXPIRATION, ..options(10) };
    let first = take_one(&*storage, &short).await;
    assert!(take(&*other, &short).await.is_empty(), "the claim is live");
    let second =
        eventually("the claim lapsing", || async { take(&*other, &short).await.items.pop() }).await;
    assert_eq!(second.attempts, 2);
    assert_eq!(storage.refresh(std::slice::from_ref(&first.claim)).await.unwrap(), 0);
    assert!(!storage.complete(&first.claim).await.unwrap());
    assert!(!storage.retry(&first.claim, Duration::ZERO, "late").await.unwrap());
    assert!(!storage.fail(&first.claim, "late").await.unwrap());
    assert!(!storage.release(&first.claim).await.unwrap());
    let stored = item(&*storage, "a").await;
    assert_eq!((stored.state, stored.attempts, stored.claimed), (QueueItemState::Pending, 2, true));
    assert!(other.complete(&second.claim).await.unwrap());
    assert_eq!(item(&*storage, "a").await.state, QueueItemState::Completed);
}

/// A claim refreshed within its expiration keeps its item from other takers.
pub async fn refresh_keeps_a_claim_alive(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    let other = fixture.other_storage().await;
    offer(&*storage, "a").await;
    offer(&*storage, "b").await;
    let short = TakeOptions { lock_expiration: Duration::from_secs(2), ..options(1) };
    let refreshed = take_one(&*storage, &short).await;
    let lapsing = take_one(&*storage, &short).await;
    // Past the expiration with refreshes every half second: "b" lapses, "a" does not.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let claims = std::slice::from_ref(&refreshed.claim);
        assert_eq!(storage.refresh(claims).await.unwrap(), 1);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let retaken =
        eventually("b's claim lapsing", || async { take(&*other, &short).await.items.pop() }).await;
    assert_eq!(retaken.id, lapsing.id);
    assert!(take(&*other, &short).await.is_empty(), "a's refreshed claim is live");
    assert!(storage.complete(&refreshed.claim).await.unwrap());
}

/// An exhausted item whose last claim lapsed is failed with the lock-expiry failure; one
/// settled on its last attempt keeps the failure it recorded; live claims are left alone.
pub async fn fail_exhausted_fails_lapsed_final_attempts(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    offer(&*storage, "crashed").await;
    offer(&*storage, "retried").await;
    let once = TakeOptions { max_attempts: n(1), lock_expiration: SHORT_EXPIRATION, ..options(1) };
    let crashed = take_one(&*storage, &once).await;
    let retried = take_one(&*storage, &once).await;
    assert_eq!((crashed.id.as_str(), retried.id.as_str()), ("crashed", "retried"));
    assert!(storage.retry(&retried.claim, Duration::ZERO, "boom").await.unwrap());
    let failed = storage.fail_exhausted(QUEUE, n(1), SHORT_EXPIRATION).await.unwrap();
    assert_eq!(failed, 1, "only the settled item: the other claim is live");
    let stored = item(&*storage, "retried").await;
    assert_eq!(stored.state, QueueItemState::Failed);
    assert_eq!(stored.last_failure.as_deref(), Some("boom"));
    assert_eq!(item(&*storage, "crashed").await.state, QueueItemState::Pending);
    eventually("the final claim lapsing", || async {
        let failed = storage.fail_exhausted(QUEUE, n(1), SHORT_EXPIRATION).await.unwrap();
        (failed == 1).then_some(())
    })
    .await;
    let stored = item(&*storage, "crashed").await;
    assert_eq!((stored.state, stored.claimed), (QueueItemState::Failed, false));
    assert_eq!(stored.last_failure.as_deref(), Some(LOCK_EXPIRED_FAILURE));
    assert!(!storage.complete(&crashed.claim).await.unwrap(), "the claim is gone");
    assert_eq!(storage.fail_exhausted(QUEUE, n(1), SHORT_EXPIRATION).await.unwrap(), 0);
}

/// Cleanup removes completed items past their time to live (failed ones only when asked) in
/// every queue; their ids can be offered again; pending items stay.
pub async fn cleanup_removes_old_settled_items(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    for id in ["done", "dead", "waiting"] {
        offer(&*storage, id).await;
    }
    let batch = take(&*storage, &options(2)).await;
    assert_eq!(ids(&batch), ["done", "dead"]);
    assert!(storage.complete(&batch.items[0].claim).await.unwrap());
    assert!(storage.fail(&batch.items[1].claim, "bad").await.unwrap());
    let hour = Duration::from_secs(3600);
    assert_eq!(storage.cleanup(hour, Some(hour)).await.unwrap(), 0, "too young");
    assert_eq!(storage.cleanup(Duration::ZERO, None).await.unwrap(), 1);
    assert_eq!(storage.item(QUEUE, "done").await.unwrap(), None);
    assert_eq!(item(&*storage, "dead").await.state, QueueItemState::Failed);
    assert_eq!(storage.cleanup(Duration::ZERO, Some(Duration::ZERO)).await.unwrap(), 1);
    assert_eq!(storage.item(QUEUE, "dead").await.unwrap(), None);
    assert_eq!(item(&*storage, "waiting").await.state, QueueItemState::Pending);
    assert!(storage.offer(QUEUE, "done", &element("done")).await.unwrap(), "offered again");
    assert_eq!(ids(&take(&*storage, &options(10)).await), ["waiting", "done"]);
}

/// An empty refresh is a no-op; an unknown item is `None`.
pub async fn empty_refresh_and_unknown_items(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    assert_eq!(storage.refresh(&[]).await.unwrap(), 0);
    assert_eq!(storage.item(QUEUE, "missing").await.unwrap(), None);
    assert!(take(&*storage, &options(10)).await.is_empty());
    assert_eq!(storage.fail_exhausted(QUEUE, n(1), LONG_EXPIRATION).await.unwrap(), 0);
}

/// An element exactly at the limit is stored and taken back byte for byte; one byte over it is
/// refused as invalid input, nothing of it is stored, and its id can then be offered with an
/// element that fits.
pub async fn elements_at_the_limit_are_stored_and_over_it_refused(fixture: &dyn QueueFixture) {
    let storage = fixture.storage();
    let limit = fixture.value_bytes_max();
    let json_string = |bytes: usize| format!("\"{}\"", "e".repeat(bytes - 2));
    let at = json_string(limit);
    assert!(storage.offer(QUEUE, "at", &at).await.unwrap(), "{}", fixture.name());
    let over = limit + 1;
    let refused = storage.offer(QUEUE, "over", &json_string(over)).await;
    assert_refused(fixture.name(), refused, "the queue element", over, limit);
    assert_eq!(storage.item(QUEUE, "over").await.unwrap(), None, "{}", fixture.name());
    offer(&*storage, "over").await;
    let batch = take(&*storage, &options(10)).await;
    assert_eq!(ids(&batch), ["at", "over"], "{}", fixture.name());
    // Compared without printing: a failure would print megabytes.
    assert!(batch.items[0].element == at, "{}: the element changed", fixture.name());
    assert_eq!(batch.items[1].element, element("over"));
    assert!(item(&*storage, "at").await.element == at, "{}", fixture.name());
}
