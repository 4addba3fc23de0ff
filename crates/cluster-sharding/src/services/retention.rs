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
//! - Workflow executions (entity types `Workflow/…`) are left to the workflow engine, which
//!   deletes an execution as a whole once it completed (`workflow_retention`).
//! - A failed batch is logged and the sweep ends; the next sweep tries again.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::Clock;
use cluster_core::retention::{PurgeProcessed, WORKFLOW_ENTITY_TYPE_PREFIX, replied_before};
use cluster_core::storage::MessageStorage;
use tokio_util::sync::CancellationToken;

use crate::metrics;

/// The singleton's name.
pub(crate) const MESSAGE_RETENTION: &str = "MessageRetention";

/// The most requests one batch deletes.
pub(crate) const PURGE_BATCH: u32 = 1000;

/// The shortest pause between two batches of a sweep.
pub(crate) const PAUSE_MIN: Duration = Duration::from_millis(10);

/// The longest wait between two sweeps.
const SWEEP_INTERVAL_MAX: Duration = Duration::from_secs(60);

/// The shortest wait between two sweeps.
const SWEEP_INTERVAL_MIN: Duration = Duration::from_secs(1);

/// How long a sweep waits for the next: a tenth of the retention, from 1 s to 1 min. So rows
/// outlive the retention by at most a tenth of it (or a minute), plus the sweep's own time.
pub(crate) fn sweep_interval(retention: Duration) -> Duration {
    (retention / 10).clamp(SWEEP_INTERVAL_MIN, SWEEP_INTERVAL_MAX)
}

/// Runs the sweeps until `cancellation` fires: the singleton's body.
pub(crate) async fn run(
    storage: Arc<dyn MessageStorage>,
    clock: Arc<dyn Clock>,
    retention: Duration,
    cancellation: CancellationToken,
) {
    tracing::info!(retention = ?retention, "message retention started on this runner");
    let interval = sweep_interval(retention);
    loop {
        sweep(&*storage, &*clock, retention, &cancellation).await;
        tokio::select! {
            () = cancellation.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// One sweep: batches until one finds fewer than [`PURGE_BATCH`] requests, a batch fails, or
/// `cancellation` fires. Returns how many requests it deleted.
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
            purged = storage.purge_processed(&batch) => purged,
        };
        match purged {
            Ok(count) => {
                deleted += count;
                metrics::count(metrics::RETENTION_DELETED, usize::try_from(count).unwrap_or(0));
                if count < u64::from(PURGE_BATCH) {
                    break;
                }
            }
            Err(error) => {
                tracing::warn!(%error, deleted, "message retention batch failed; the next sweep tries again");
                break;
            }
        }
        let pause = started.elapsed().max(PAUSE_MIN);
        tokio::select! {
            () = cancellation.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
        }
    }
    if deleted > 0 {
        tracing::debug!(deleted, "message retention swept processed requests");
    }
    deleted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_interval_is_a_tenth_of_the_retention_within_bounds() {
        assert_eq!(sweep_interval(Duration::from_secs(10)), Duration::from_secs(1));
        assert_eq!(sweep_interval(Duration::from_secs(300)), Duration::from_secs(30));
        assert_eq!(sweep_interval(Duration::from_secs(86_400)), Duration::from_secs(60));
    }
}
