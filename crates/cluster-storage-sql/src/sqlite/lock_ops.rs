//! The worker side of the shard locks: the lease operations
//! [`SqliteRunnerStorage`](super::SqliteRunnerStorage) sends its worker, and the blocking code
//! the worker thread runs for them.
//!
//! - `acquire` inserts a row per free shard, and takes over a shard that is already its own or
//!   whose lease expired, in one statement (`INSERT … SELECT … WHERE NOT EXISTS (a live lease of
//!   another runner) ON CONFLICT DO UPDATE`), then reads back which requested leases it holds.
//! - `refresh` beats the heartbeat and extends its own leases (`UPDATE … RETURNING`); it never
//!   takes a shard it lost.
//! - `release` and `release_all` delete its own rows.
//!
//! Each runs in one `BEGIN IMMEDIATE` transaction, so concurrent runners are serialised by the
//! database's write lock.

use rusqlite::params;

use super::queries::{self, json_strings};
use super::state::{Responder, WorkerState, classify};

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
    pub(super) kind: LockKind,
    pub(super) address: String,
    pub(super) shard_ids: Vec<String>,
    pub(super) reply: Responder<Vec<String>>,
}

/// Runs a lease operation on the worker thread.
pub(super) fn run_operation(state: &WorkerState, op: LockOp) {
    let LockOp { kind, address, shard_ids, reply } = op;
    let result = queries::immediate(&state.connection, |connection| {
        let sql = &state.statements.runner;
        match kind {
            LockKind::Acquire => {
                let shard_ids = json_strings(&shard_ids);
                connection.prepare_cached(&sql.lease_acquire)?.execute(params![
                    address,
                    shard_ids,
                    state.expiration_seconds
                ])?;
                let mut statement = connection.prepare_cached(&sql.lease_held)?;
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
                let mut statement = connection.prepare_cached(&sql.lease_refresh)?;
                let rows = statement
                    .query_map(params![address, json_strings(&shard_ids)], |row| {
                        row.get::<_, String>(0)
                    })?;
                rows.collect()
            }
            LockKind::Release => {
                let mut statement = connection.prepare_cached(&sql.lease_release)?;
                for shard_id in &shard_ids {
                    statement.execute(params![address, shard_id])?;
                }
                Ok(Vec::new())
            }
            LockKind::ReleaseAll => {
                connection.prepare_cached(&sql.lease_release_all)?.execute([&address])?;
                Ok(Vec::new())
            }
        }
    });
    let _ = reply.send(result.map_err(|error| classify(kind.name(), error)));
}
