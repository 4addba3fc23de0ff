//! Message retention: a cluster singleton that deletes processed requests, with their replies,
//! once they were answered longer ago than
//! [`message_retention`](cluster_core::ShardingConfig::message_retention).
//!
//! The reference keeps every processed message and reply forever. Here a runner with message
//! storage and a retention registers the singleton [`MESSAGE_RETENTION`], so one runner of the
//! cluster sweeps at a time:
//!
//! - A sweep deletes batches of [`PURGE_BATCH`] requests
//!   ([`MessageStorage::purge_processed`]) until a batch finds fewer, then waits for the next
//!   sweep ([`sweep_interval`]).
//! - After each batch it pauses as long as the batch took (at least [`PAUSE_MIN`]), so that it
//!   uses at most half of one connection and never holds locks for long.
//! - A batch that takes longer than [`CALL_DEADLINE`] ends the sweep, as a failed one does.
//! - Workflow executions (entity types `Workflow/…`) are left to the workflow engine, which
//!   deletes an execution as a whole once it completed (`workflow_retention`).
//! - A failed batch is logged and the sweep ends; the next sweep tries again.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::Clock;
use cluster_core::retention::{
    CALL_DEADLINE, PAUSE_MIN, PurgeProcessed, WORKFLOW_ENTITY_TYPE_PREFIX, replied_before,
    sweep_interval,
};
use cluster_core::storage::MessageStorage;
use tokio_util::sync::CancellationToken;

use crate::metrics;
use crate::services::singleton::pause;

/// The singleton's name.
pub(crate) const MESSAGE_RETENTION: &str = "MessageRetention";

/// The most requests one batch deletes.
pub(crate) const PURGE_BATCH: u32 = 1000;

/// Runs the sweeps until `cancellation` fires: the singleton's body.
pub(crate) async fn run(
    storage: Arc<dyn MessageStorage>,
    clock: Arc<dyn Clock>,
    retention: Duration,
    cancellation: CancellationToken,
) {
    tracing::info!(retention = ?retention, "message retention started on this runner");
    loop {
        sweep(&*storage, &*clock, retention, &cancellation).await;
        if !pause(&cancellation, sweep_interval(retention)).await {
            return;
        }
    }
}

/// One sweep: batches until one finds fewer than [`PURGE_BATCH`] requests, a batch fails or
/// takes longer than [`CALL_DEADLINE`], or `cancellation` fires. Returns how many requests it
/// deleted.
pub(crate) async fn sweep(
    storage: &dyn MessageStorage,
    clock: &dyn Clock,
    retention: Duration,
    cancellation: &CancellationToken,
) -> u64 {
    let batch = PurgeProcessed {
        replied_before: replied_before(clock.now().saturating_sub(retention)),
        keep_entity_type_prefixes: vec![WORKFLOW_ENTITY_TYPE_PREFIX.to_owned()],
        limit: PURGE_BATCH,
    };
    let mut deleted = 0;
    loop {
        let started = tokio::time::Instant::now();
        let purged = tokio::select! {
            () = cancellation.cancelled() => break,
            purged = tokio::time::timeout(CALL_DEADLINE, storage.purge_processed(&batch)) => purged,
        };
        match purged {
            Ok(Ok(count)) => {
                deleted += count;
                metrics::count(metrics::RETENTION_DELETED, usize::try_from(count).unwrap_or(0));
                if count < u64::from(PURGE_BATCH) {
                    break;
                }
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, deleted, "message retention batch failed; the next sweep tries again");
                break;
            }
            Err(_) => {
                tracing::warn!(deadline = ?CALL_DEADLINE, deleted, "message retention batch timed out; the next sweep tries again");
                break;
            }
        }
        if !pause(cancellation, started.elapsed().max(PAUSE_MIN)).await {
            break;
        }
    }
    if deleted > 0 {
        tracing::debug!(deleted, "message retention swept processed requests");
    }
    deleted
}

#[cfg(test)]
mod tests {
    use cluster_core::SystemClock;
    use cluster_testkit::faulty::FaultyMessageStorage;
    use cluster_testkit::memory::MemoryMessageStorage;

    use super::*;

    /// A storage that hangs (a database that stopped answering) does not hold a sweep past
    /// the call deadline.
    #[tokio::test(start_paused = true)]
    async fn a_hanging_batch_ends_the_sweep_at_its_deadline() {
        let memory = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
        let (storage, faults) = FaultyMessageStorage::new(memory);
        faults.kill();
        let (started, running) = (tokio::time::Instant::now(), CancellationToken::new());
        let swept = sweep(&storage, &SystemClock, Duration::from_secs(60), &running);
        let deleted = tokio::time::timeout(CALL_DEADLINE * 10, swept).await;
        assert_eq!(deleted, Ok(0), "the sweep waited on the hanging storage");
        assert!(started.elapsed() >= CALL_DEADLINE);
    }
}
