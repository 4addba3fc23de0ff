//! Shard locks as lease rows in `<prefix>_locks` (`effect/src/cluster/SqlRunnerStorage.ts`,
//! "row-lease mode"): SQLite has no advisory locks, so a shard belongs to the runner whose row
//! names it, until the row is older than the lock expiration and another runner takes it over.
//!
//! - `acquire` inserts a row per free shard, and takes over a shard that is already its own or
//!   whose lease expired, in one statement (`INSERT … SELECT … WHERE NOT EXISTS (a live lease of
//!   another runner) ON CONFLICT DO UPDATE`), then reads back which requested leases it holds.
//! - `refresh` beats the heartbeat and extends its own leases (`UPDATE … RETURNING`); it never
//!   takes a shard it lost.
//! - `release` and `release_all` delete its own rows.
//!
//! Each runs in one `BEGIN IMMEDIATE` transaction, so concurrent runners are serialised by the
//! database's write lock, and each is bounded by the shard lock interval (`lock::with_deadline`):
//! a wedged worker makes lock storage unhealthy instead of stalling the runner.

use std::collections::BTreeSet;

use cluster_core::error::StorageError;
use cluster_core::{RunnerAddress, ShardId};
use rusqlite::params;

use super::queries::{self, json_strings};
use super::runner_storage::SqliteRunnerStorage;
use super::worker::{Command, Responder, WorkerState, classify};
use crate::lock::with_deadline;

/// Which lease operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LockKind {
    /// Take the free, own and expired shards among the requested ones.
    Acquire,
    /// Heartbeat, and extend the own leases among the requested ones (none: heartbeat only).
    Refresh,
    /// Delete the own lease of the requested shard.
    Release,
    /// Delete every own lease.
    ReleaseAll,
}

impl LockKind {
    fn name(self) -> &'static str {
        match self {
            LockKind::Acquire => "acquire",
            LockKind::Refresh => "refresh",
            LockKind::Release => "release",
            LockKind::ReleaseAll => "release_all",
        }
    }
}

/// A lease operation for `address` on `shard_ids`; replies with the requested shards it holds
/// afterwards (empty for releases).
pub(super) struct LockOp {
    kind: LockKind,
    address: String,
    shard_ids: Vec<String>,
    reply: Responder<Vec<String>>,
}

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

/// Runs a lease operation on the worker thread.
pub(super) fn run_operation(state: &WorkerState, op: LockOp) {
    let LockOp { kind, address, shard_ids, reply } = op;
    let result = queries::immediate(&state.connection, |connection| {
        let sql = &state.statements.runner;
        match kind {
            LockKind::Acquire => {
                let shard_ids = json_strings(&shard_ids);
                connection.prepare_cached(&sql.acquire)?.execute(params![
                    address,
                    shard_ids,
                    state.expiration_seconds
                ])?;
                let mut statement = connection.prepare_cached(&sql.acquired)?;
                let rows = statement
                    .query_map(params![address, state.expiration_modifier, shard_ids], |row| {
                        row.get::<_, String>(0)
                    })?;
                rows.collect()
            }
            LockKind::Refresh => {
                connection.prepare_cached(&sql.heartbeat)?.execute([&address])?;
                if shard_ids.is_empty() {
                    return Ok(Vec::new());
                }
                let mut statement = connection.prepare_cached(&sql.refresh)?;
                let rows = statement
                    .query_map(params![address, json_strings(&shard_ids)], |row| {
                        row.get::<_, String>(0)
                    })?;
                rows.collect()
            }
            LockKind::Release => {
                let mut statement = connection.prepare_cached(&sql.release)?;
                for shard_id in &shard_ids {
                    statement.execute(params![address, shard_id])?;
                }
                Ok(Vec::new())
            }
            LockKind::ReleaseAll => {
                connection.prepare_cached(&sql.release_all)?.execute([&address])?;
                Ok(Vec::new())
            }
        }
    });
    let _ = reply.send(result.map_err(|error| classify(kind.name(), error)));
}
