//! [`MemoryQueueStorage`]: the persisted queue contract in memory, following the reference's SQL
//! store row for row (`makeStoreSql` in `effect/src/persistence/PersistedQueue.ts`): a claim
//! counts an attempt and records a lock of its own, settlements match that lock, a lapsed claim
//! is claimed again, and completed and failed rows stay for deduplication until cleanup.
//!
//! Time comes from an injected [`Clock`] (the database clock of the SQL stores), without their
//! rounding to whole seconds. Several takers share one store through clones of its `Arc`, as
//! processes share one table. An element longer than the store's limit
//! ([`VALUE_BYTES_MAX_DEFAULT`] unless set otherwise) is refused, as the SQL stores refuse it.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::error::StorageError;
use cluster_core::future::BoxFuture;
use cluster_core::queue_storage::{
    ClaimBatch, ClaimedItem, LOCK_EXPIRED_FAILURE, QueueClaim, QueueItem, QueueItemState,
    QueueStorage, TakeOptions,
};
use cluster_core::{Clock, Timestamp};

use super::{VALUE_BYTES_MAX_DEFAULT, check_value, lock, ready};
use crate::queue_suite::QueueFixture;

/// One row of the queue table.
#[derive(Debug)]
struct Row {
    queue: String,
    id: String,
    element: String,
    state: QueueItemState,
    attempts: u32,
    last_failure: Option<String>,
    visible_at: Timestamp,
    acquired_at: Option<Timestamp>,
    acquired_by: Option<String>,
    updated_at: Timestamp,
}

impl Row {
    /// Whether `claim` is this row's current claim.
    fn held_by(&self, claim: &QueueClaim) -> bool {
        self.acquired_by.as_deref() == Some(claim.lock.as_str())
    }

    /// Whether a claim younger than the expiration hides the row.
    fn live_claim(&self, expired_before: Timestamp) -> bool {
        self.acquired_at.is_some_and(|acquired_at| acquired_at >= expired_before)
    }

    fn settle(&mut self, now: Timestamp) {
        self.acquired_at = None;
        self.acquired_by = None;
        self.updated_at = now;
    }
}

#[derive(Debug, Default)]
struct QueueTable {
    next_sequence: i64,
    next_lock: u64,
    /// Rows by sequence (insertion order).
    rows: BTreeMap<i64, Row>,
    /// `(queue, id)` → sequence: the unique index that deduplicates offers.
    ids: BTreeMap<(String, String), i64>,
}

/// An in-memory [`QueueStorage`]: one table of items, shared by every clone of its `Arc`.
#[derive(Debug)]
pub struct MemoryQueueStorage {
    clock: Arc<dyn Clock>,
    table: Mutex<QueueTable>,
    /// The most bytes of an element.
    value_bytes_max: usize,
}

impl MemoryQueueStorage {
    /// An empty store whose times come from `clock`, with elements limited to
    /// [`VALUE_BYTES_MAX_DEFAULT`].
    pub fn new(clock: Arc<dyn Clock>) -> MemoryQueueStorage {
        MemoryQueueStorage {
            clock,
            table: Mutex::new(QueueTable::default()),
            value_bytes_max: VALUE_BYTES_MAX_DEFAULT,
        }
    }

    /// The store with elements limited to `value_bytes_max` bytes, as
    /// `SqlStorageOptions::value_bytes_max` limits the SQL stores': a longer element is refused
    /// with [`InvalidInput`](cluster_core::error::StorageErrorKind::InvalidInput) and not
    /// stored.
    #[must_use]
    pub fn with_value_bytes_max(self, value_bytes_max: usize) -> MemoryQueueStorage {
        MemoryQueueStorage { value_bytes_max, ..self }
    }

    /// The most bytes an element may have.
    pub fn value_bytes_max(&self) -> usize {
        self.value_bytes_max
    }

    /// Runs `settle` on the row `claim` holds; whether there was one.
    fn settle_claim(
        &self,
        claim: &QueueClaim,
        settle: impl FnOnce(&mut Row, Timestamp),
    ) -> Result<bool, StorageError> {
        let now = self.clock.now();
        let mut table = lock(&self.table);
        match table.rows.get_mut(&claim.sequence) {
            Some(row) if row.held_by(claim) => {
                settle(row, now);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

impl QueueStorage for MemoryQueueStorage {
    fn offer<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
        element: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        let setter = "MemoryQueueStorage::with_value_bytes_max";
        if let Err(refused) =
            check_value("the queue element", element, self.value_bytes_max, setter)
        {
            return ready(Err(refused));
        }
        let now = self.clock.now();
        let mut table = lock(&self.table);
        let key = (queue.to_owned(), id.to_owned());
        if table.ids.contains_key(&key) {
            return ready(Ok(false));
        }
        table.next_sequence += 1;
        let sequence = table.next_sequence;
        table.ids.insert(key, sequence);
        table.rows.insert(
            sequence,
            Row {
                queue: queue.to_owned(),
                id: id.to_owned(),
                element: element.to_owned(),
                state: QueueItemState::Pending,
                attempts: 0,
                last_failure: None,
                visible_at: now,
                acquired_at: None,
                acquired_by: None,
                updated_at: now,
            },
        );
        ready(Ok(true))
    }

    fn take<'a>(
        &'a self,
        queue: &'a str,
        options: &'a TakeOptions,
    ) -> BoxFuture<'a, Result<ClaimBatch, StorageError>> {
        let now = self.clock.now();
        let expired_before = now.saturating_sub(options.lock_expiration);
        let mut table = lock(&self.table);
        let mut candidates: Vec<(Timestamp, i64)> = table
            .rows
            .iter()
            .filter(|(_, row)| {
                row.queue == queue
                    && row.state == QueueItemState::Pending
                    && row.attempts < options.max_attempts.get()
                    && row.visible_at <= now
                    && !row.live_claim(expired_before)
            })
            .map(|(sequence, row)| (row.visible_at, *sequence))
            .collect();
        candidates.sort_unstable();
        let limit = usize::try_from(options.limit.get()).unwrap_or(usize::MAX);
        table.next_lock += 1;
        let lock_id = format!("memory-lock-{}", table.next_lock);
        let mut batch = ClaimBatch::default();
        for (_, sequence) in candidates.into_iter().take(limit) {
            let Some(row) = table.rows.get_mut(&sequence) else { continue };
            row.attempts += 1;
            row.acquired_at = Some(now);
            row.acquired_by = Some(lock_id.clone());
            batch.items.push(ClaimedItem {
                claim: QueueClaim { sequence, lock: lock_id.clone() },
                id: row.id.clone(),
                attempts: row.attempts,
                element: row.element.clone(),
            });
        }
        ready(Ok(batch))
    }

    fn refresh<'a>(&'a self, claims: &'a [QueueClaim]) -> BoxFuture<'a, Result<u64, StorageError>> {
        let now = self.clock.now();
        let mut table = lock(&self.table);
        let mut refreshed = 0;
        for claim in claims {
            if let Some(row) = table.rows.get_mut(&claim.sequence)
                && row.held_by(claim)
            {
                row.acquired_at = Some(now);
                refreshed += 1;
            }
        }
        ready(Ok(refreshed))
    }

    fn complete<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        ready(self.settle_claim(claim, |row, now| {
            row.settle(now);
            row.state = QueueItemState::Completed;
        }))
    }

    fn retry<'a>(
        &'a self,
        claim: &'a QueueClaim,
        delay: Duration,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        ready(self.settle_claim(claim, |row, now| {
            row.settle(now);
            row.visible_at = now.saturating_add(delay);
            row.last_failure = Some(failure.to_owned());
        }))
    }

    fn fail<'a>(
        &'a self,
        claim: &'a QueueClaim,
        failure: &'a str,
    ) -> BoxFuture<'a, Result<bool, StorageError>> {
        ready(self.settle_claim(claim, |row, now| {
            row.settle(now);
            row.state = QueueItemState::Failed;
            row.last_failure = Some(failure.to_owned());
        }))
    }

    fn release<'a>(&'a self, claim: &'a QueueClaim) -> BoxFuture<'a, Result<bool, StorageError>> {
        // As the reference's `interrupt`: the claim goes, the attempt is given back, and
        // `updated_at` stays.
        ready(self.settle_claim(claim, |row, _| {
            row.acquired_at = None;
            row.acquired_by = None;
            row.attempts = row.attempts.saturating_sub(1);
        }))
    }

    fn fail_exhausted<'a>(
        &'a self,
        queue: &'a str,
        max_attempts: NonZeroU32,
        lock_expiration: Duration,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        let now = self.clock.now();
        let expired_before = now.saturating_sub(lock_expiration);
        let mut table = lock(&self.table);
        let mut failed = 0;
        for row in table.rows.values_mut() {
            if row.queue == queue
                && row.state == QueueItemState::Pending
                && row.attempts >= max_attempts.get()
                && !row.live_claim(expired_before)
            {
                row.settle(now);
                row.state = QueueItemState::Failed;
                row.last_failure.get_or_insert_with(|| LOCK_EXPIRED_FAILURE.to_owned());
                failed += 1;
            }
        }
        ready(Ok(failed))
    }

    fn cleanup(
        &self,
        completed_ttl: Duration,
        failed_ttl: Option<Duration>,
    ) -> BoxFuture<'_, Result<u64, StorageError>> {
        let now = self.clock.now();
        let completed_before = now.saturating_sub(completed_ttl);
        let failed_before = failed_ttl.map(|ttl| now.saturating_sub(ttl));
        let mut table = lock(&self.table);
        let table = &mut *table;
        let mut removed = 0;
        table.rows.retain(|_, row| {
            let cutoff = match row.state {
                QueueItemState::Completed => Some(completed_before),
                QueueItemState::Failed => failed_before,
                QueueItemState::Pending => None,
            };
            let expired = cutoff.is_some_and(|cutoff| row.updated_at <= cutoff);
            if expired {
                table.ids.remove(&(row.queue.clone(), row.id.clone()));
                removed += 1;
            }
            !expired
        });
        ready(Ok(removed))
    }

    fn item<'a>(
        &'a self,
        queue: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<QueueItem>, StorageError>> {
        let table = lock(&self.table);
        let item = table
            .ids
            .get(&(queue.to_owned(), id.to_owned()))
            .and_then(|sequence| table.rows.get(sequence))
            .map(|row| QueueItem {
                id: row.id.clone(),
                state: row.state,
                attempts: row.attempts,
                claimed: row.acquired_by.is_some(),
                last_failure: row.last_failure.clone(),
                element: row.element.clone(),
            });
        ready(Ok(item))
    }
}

/// The queue conformance-suite fixture of [`MemoryQueueStorage`]: both of its stores are the
/// same table.
#[derive(Debug)]
pub struct MemoryQueueFixture {
    storage: Arc<MemoryQueueStorage>,
}

impl MemoryQueueFixture {
    /// A fresh store on `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> MemoryQueueFixture {
        MemoryQueueFixture { storage: Arc::new(MemoryQueueStorage::new(clock)) }
    }
}

impl QueueFixture for MemoryQueueFixture {
    fn name(&self) -> &str {
        "memory"
    }

    fn storage(&self) -> Arc<dyn QueueStorage> {
        Arc::clone(&self.storage) as Arc<dyn QueueStorage>
    }

    fn other_storage(&self) -> BoxFuture<'_, Arc<dyn QueueStorage>> {
        ready(self.storage())
    }

    fn value_bytes_max(&self) -> usize {
        self.storage.value_bytes_max()
    }

    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
        ready(())
    }
}
