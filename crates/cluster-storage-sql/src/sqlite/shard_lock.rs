//! Shard locks as lease rows in `<prefix>_locks` (`effect/src/cluster/SqlRunnerStorage.ts`,
//! "row-lease mode"): SQLite has no advisory locks, so a shard belongs to the runner whose row
//! names it, until the row is older than the lock expiration and another runner takes it over.
//!
//! This file is the async side: [`SqliteRunnerStorage`]'s lease operations. The worker thread
//! runs their SQL in `lock_ops.rs`. Each operation is bounded by the shard lock interval
//! (`lock::with_deadline`): a wedged worker makes lock storage unhealthy instead of stalling the
//! runner.

use std::collections::BTreeSet;

use cluster_core::error::StorageError;
use cluster_core::{RunnerAddress, ShardId};

use super::lock_ops::{LockKind, LockOp};
use super::runner_storage::SqliteRunnerStorage;
use super::worker::Command;
use crate::lock::with_deadline;

impl SqliteRunnerStorage {
    /// Runs a lease operation within the shard lock interval and maps the shards it reports
    /// back to the requested ones, in request order.
    pub(super) async fn lock(
        &self,
        operation: &'static str,
        address: &RunnerAddress,
        shard_ids: &[ShardId],
        kind: LockKind,
    ) -> Result<Vec<ShardId>, StorageError> {
        tracing::debug!(operation, %address, n_shards = shard_ids.len(), "sqlite shard lock");
        let requested: Vec<String> = shard_ids.iter().map(ToString::to_string).collect();
        let op_shard_ids = requested.clone();
        let call = self.worker.call(operation, |reply| {
            Command::Lock(LockOp {
                kind,
                address: address.to_string(),
                shard_ids: op_shard_ids,
                reply,
            })
        });
        let held: BTreeSet<String> =
            with_deadline(self.lock_deadline, operation, call).await?.into_iter().collect();
        Ok(shard_ids
            .iter()
            .zip(&requested)
            .filter(|(_, text)| held.contains(*text))
            .map(|(shard_id, _)| shard_id.clone())
            .collect())
    }
}
