//! The persisted queue contract, [`QueueStorage`]: the store under durable queues (the
//! reference's `PersistedQueueStore` in `effect/src/persistence/PersistedQueue.ts`).
//!
//! A queue is a name; its items are rows keyed by `(queue, id)`. Offering an id that is already
//! stored writes nothing, whatever the item's state, so deduplication outlives completion until
//! [`QueueStorage::cleanup`] removes the row.
//!
//! A taker *claims* pending items. A claim counts an attempt (so `attempts` is 1-based: "this is
//! attempt 3") and records a lock of its own, and the item is hidden from other takers while the
//! claim is younger than the lock expiration; a taker renews the claims it still works on with
//! [`QueueStorage::refresh`]. It then settles each claim: completed, retried after a delay,
//! failed (the dead letter, kept with its last failure), or released (an interruption, which
//! does not count the attempt). A settlement applies only to the claim it names: once another
//! taker has re-claimed an item whose claim lapsed, the old claim's settlements and refreshes
//! change nothing.
//!
//! An item that reached the maximum attempts is never claimed again. When its last claim lapsed
//! (its taker died during the final attempt) no settlement will come, so
//! [`QueueStorage::fail_exhausted`] turns it into a failure.
//!
//! Delivery policy (polling, concurrency, retry delays, lock refreshes, what a handler's outcome
//! means) lives above the store, in the durable queue worker of `cluster-workflow`. Time is the
//! store's own: the SQL stores use the database clock and whole seconds, as the reference's SQL
//! store does, so takers with skewed clocks agree on whose claim expired.
//!
//! Every method is a boxed future so that the trait is object safe (`Arc<dyn QueueStorage>`),
//! and each documents its cancel safety.

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::error::{DecodeError, StorageError};
use crate::future::BoxFuture;

/// What [`QueueStorage::take`] claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TakeOptions {
    /// At most this many items.
    pub limit: NonZeroU32,
    /// Items with this many attempts are not claimed again (the reference's `maxAttempts`).
    pub max_attempts: NonZeroU32,
    /// A claim older than this, unless refreshed, no longer hides its item (the reference's
    /// `lockExpiration`).
    pub lock_expiration: Duration,
}

/// One claim of an item: what a settlement or a refresh names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueueClaim {
    /// The item's row (the `sequence` column).
    pub sequence: i64,
    /// The claim's lock, unique to the claim (the `acquired_by` column).
    pub lock: String,
}

/// A claimed item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimedItem {
    /// The claim, to settle.
    pub claim: QueueClaim,
    /// The item's id.
    pub id: String,
    /// The attempts counted so far, this claim included (1 on the first claim).
    pub attempts: u32,
    /// The offered element, as stored (JSON text).
    pub element: String,
}

/// A claimed row whose columns cannot be read. The caller fails it (it can never succeed) and
/// goes on with the other items.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MalformedClaim {
    /// The claim, to settle.
    pub claim: QueueClaim,
    /// Why the row cannot be read.
    pub error: DecodeError,
}

/// The result of [`QueueStorage::take`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimBatch {
    /// The claimed items, oldest visible first.
    pub items: Vec<ClaimedItem>,
    /// Claimed rows that cannot be read.
    pub malformed: Vec<MalformedClaim>,
}

impl ClaimBatch {
    /// The number of claims, readable or not.
    pub fn len(&self) -> usize {
        self.items.len() + self.malformed.len()
    }

    /// Whether nothing was claimed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where an item is in its life (the `state` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueItemState {
    /// Waiting to be claimed, or claimed and not settled yet.
    Pending,
    /// Done; kept for deduplication until cleanup.
    Completed,
    /// The dead letter: never claimed again.
    Failed,
}

impl QueueItemState {
    /// The stored form: `pending`, `completed` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueItemState::Pending => "pending",
            QueueItemState::Completed => "completed",
            QueueItemState::Failed => "failed",
        }
    }

    /// Reads the stored form.
    ///
    /// # Errors
    ///
    /// A [`DecodeError`] naming any other text.
    pub fn parse(text: &str) -> Result<QueueItemState, DecodeError> {
        match text {
            "pending" => Ok(QueueItemState::Pending),
            "completed" => Ok(QueueItemState::Completed),
            "failed" => Ok(QueueItemState::Failed),
            other => Err(DecodeError::new("queue item state", format!("unknown state {other:?}"))),
        }
    }
}

impl fmt::Display for QueueItemState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An item as stored, for inspection ([`QueueStorage::item`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueItem {
    /// The item's id.
    pub id: String,
    /// Its state.
    pub state: QueueItemState,
    /// The attempts counted so far.
    pub attempts: u32,
    /// Whether a claim is recorded on it (live or lapsed).
    pub claimed: bool,
    /// The last failure a retry or a failure recorded.
    pub last_failure: Option<String>,
    /// The offered element.
    pub element: String,
}

/// Persisted queues: items offered by id, claimed with counted attempts, settled by claim.
///
/// Implemented by `cluster-storage-sql` (PostgreSQL, MySQL, SQLite, on the reference's table so
/// that TypeScript and Rust workers share a queue) and by `cluster-testkit` (in memory); all pass
/// the testkit's queue conformance suite. Storage failures are [`StorageError`]s.
pub trait QueueStorage: Send + Sync + fmt::Debug {
    /// Stores `element` (JSON text) as item `id` of `queue`, visible at once, unless the queue
    /// already holds `id` in any state: then nothing is written. Returns whether it was stored.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: if the future is dropped the item may or may not be
    /// stored, and offering it again is correct.
    fn offer<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
        element: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>>;

    /// Claims at most `options.limit` items of `queue`, oldest visible first: pending, visible
    /// (their retry delay passed), with fewer than `options.max_attempts` attempts, and not
    /// claimed within `options.lock_expiration`. Each claim counts an attempt and gets a lock
    /// of its own.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, items may have been claimed and not returned.
    /// Their attempts are counted, and they are claimed again once the lock expires.
    fn take<'a>(
        &'a self,
        queue: &'a str,
        options: &'a TakeOptions,
    ) -> BoxFuture<'a, Result<ClaimBatch, StorageError>>;

    /// Renews these claims (they start their lock expiration again); a claim that lapsed and
    /// was re-claimed by another taker is left alone. Returns how many were renewed. An empty
    /// list is a no-op without a round-trip.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped refresh is a missed refresh.
    fn refresh<'a>(&'a self, claims: &'a [QueueClaim]) -> BoxFuture<'a, Result<u64, StorageError>>;

    /// Marks the claimed item completed. Returns whether the claim still held the item.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: settling again after a dropped call is correct (a
    /// settled claim no longer holds its item, so the second call returns `false`).
    fn complete<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>>;

    /// Releases the claimed item to be claimed again once `delay` has passed (rounded up to
    /// whole seconds by the SQL stores), recording `failure`. Returns whether the claim still
    /// held the item.
    ///
    /// # Cancel safety
    ///
    /// As [`complete`](QueueStorage::complete).
    fn retry<'a>(
        &'a self,
        claim: &'a QueueClaim,
        delay: Duration,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>>;

    /// Marks the claimed item failed (the dead letter), recording `failure`. Returns whether the
    /// claim still held the item.
    ///
    /// # Cancel safety
    ///
    /// As [`complete`](QueueStorage::complete).
    fn fail<'a>(
        &'a self,
        claim: &'a QueueClaim,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>>;

    /// Releases the claimed item at once without counting the attempt (its handler was
    /// interrupted). Returns whether the claim still held the item.
    ///
    /// # Cancel safety
    ///
    /// As [`complete`](QueueStorage::complete).
    fn release<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>>;

    /// Fails the pending items of `queue` that have `max_attempts` attempts and no live claim
    /// (never claimed again, and no settlement will come), recording "Lock expired after final
    /// attempt" unless they already hold a failure. Returns how many were failed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe and idempotent.
    fn fail_exhausted<'a>(
        &'a self,
        queue: &'a str,
        max_attempts: NonZeroU32,
        lock_expiration: Duration,
    ) -> BoxFuture<'a, Result<u64, StorageError>>;

    /// Removes, in every queue, the items completed longer than `completed_ttl` ago and, with
    /// `failed_ttl`, the items failed longer than that ago; their ids can be offered again.
    /// Returns how many were removed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe and idempotent: removals are batched and each batch commits on its own.
    fn cleanup(
        &self,
        completed_ttl: Duration,
        failed_ttl: Option<Duration>,
    ) -> BoxFuture<'_, Result<u64, StorageError>>;

    /// Item `id` of `queue`, as stored.
    ///
    /// # Errors
    ///
    /// A [`StorageErrorKind::Malformed`](crate::error::StorageErrorKind::Malformed) error when
    /// its row cannot be read.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn item<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<QueueItem>, StorageError>>;
}

/// The text [`QueueStorage::fail_exhausted`] records on an item that had no failure yet.
pub const LOCK_EXPIRED_FAILURE: &str = "Lock expired after final attempt";
