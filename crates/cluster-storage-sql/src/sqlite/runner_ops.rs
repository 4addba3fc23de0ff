//! The worker side of the runner registry: the [`RunnerOp`] commands
//! [`SqliteRunnerStorage`](super::SqliteRunnerStorage) sends its worker, and the blocking code
//! the worker thread runs for them.

use rusqlite::params;

use super::queries;
use super::state::{Responder, WorkerState, classify};
use crate::row::inspect::{LeaseRow, RunnerRecordRow};

/// The runner registry operations.
pub(super) enum RunnerOp {
    Register {
        address: String,
        runner: String,
        healthy: bool,
        reply: Responder<i64>,
    },
    Unregister {
        address: String,
        reply: Responder<()>,
    },
    GetRunners {
        reply: Responder<Vec<(String, bool)>>,
    },
    SetHealth {
        address: String,
        healthy: bool,
        reply: Responder<()>,
    },
    /// The read model's runner records.
    Records {
        reply: Responder<Vec<RunnerRecordRow>>,
    },
    /// The read model's lease rows of the shards (a JSON array of their ids).
    Leases {
        shard_ids: String,
        reply: Responder<Vec<LeaseRow>>,
    },
}

/// Runs a registry operation on the worker thread.
pub(super) fn run_operation(state: &WorkerState, op: RunnerOp) {
    let connection = &state.connection;
    let sql = &state.statements.runner;
    match op {
        RunnerOp::Register { address, runner, healthy, reply } => {
            let result = connection
                .prepare_cached(&sql.register)
                .and_then(|mut statement| {
                    statement.query_row(params![address, runner, healthy], |row| row.get(0))
                })
                .map_err(|error| classify("register", error));
            let _ = reply.send(result);
        }
        RunnerOp::Unregister { address, reply } => {
            let result = connection
                .prepare_cached(&sql.unregister)
                .and_then(|mut statement| {
                    statement.execute(params![address, state.expiration_modifier])
                })
                .map(drop)
                .map_err(|error| classify("unregister", error));
            let _ = reply.send(result);
        }
        RunnerOp::GetRunners { reply } => {
            let result = get_runners(state).map_err(|error| classify("get_runners", error));
            let _ = reply.send(result);
        }
        RunnerOp::SetHealth { address, healthy, reply } => {
            let result = connection
                .prepare_cached(&sql.set_health)
                .and_then(|mut statement| statement.execute(params![address, healthy]))
                .map(drop)
                .map_err(|error| classify("set_runner_health", error));
            let _ = reply.send(result);
        }
        RunnerOp::Records { reply } => {
            let result = runner_records(state).map_err(|error| classify("runner_records", error));
            let _ = reply.send(result);
        }
        RunnerOp::Leases { shard_ids, reply } => {
            let result =
                lease_rows(state, &shard_ids).map_err(|error| classify("shard_locks", error));
            let _ = reply.send(result);
        }
    }
}

/// Every runner row, read leniently.
fn runner_records(state: &WorkerState) -> rusqlite::Result<Vec<RunnerRecordRow>> {
    let mut statement = state.connection.prepare_cached(&state.statements.runner.runner_records)?;
    let rows = statement.query_map([&state.expiration_modifier], |row| {
        let number = |idx: usize| row.get_ref(idx).map(|value| queries::integer(value, 0));
        Ok(RunnerRecordRow {
            machine_id: number(0)?.unwrap_or(0),
            runner: queries::text(row.get_ref(1)?).unwrap_or_default(),
            healthy: number(2)?.is_some_and(|healthy| healthy != 0),
            heartbeat_age_ms: number(3)?.unwrap_or(0),
            alive: number(4)?.is_some_and(|alive| alive != 0),
        })
    })?;
    rows.collect()
}

/// The lease rows of `shard_ids` (JSON), read leniently.
fn lease_rows(state: &WorkerState, shard_ids: &str) -> rusqlite::Result<Vec<LeaseRow>> {
    let mut statement = state.connection.prepare_cached(&state.statements.runner.lease_rows)?;
    let rows = statement.query_map(params![state.expiration_modifier, shard_ids], |row| {
        let number = |idx: usize| row.get_ref(idx).map(|value| queries::integer(value, 0));
        Ok(LeaseRow {
            shard_id: queries::text(row.get_ref(0)?).unwrap_or_default(),
            address: queries::text(row.get_ref(1)?).unwrap_or_default(),
            age_ms: number(2)?.unwrap_or(0),
            expired: number(3)?.is_some_and(|expired| expired != 0),
        })
    })?;
    rows.collect()
}

/// The live runners' JSON and health. `healthy` is read leniently (any non-zero integer).
fn get_runners(state: &WorkerState) -> rusqlite::Result<Vec<(String, bool)>> {
    let mut statement = state.connection.prepare_cached(&state.statements.runner.get_runners)?;
    let rows = statement.query_map([&state.expiration_modifier], |row| {
        let runner = queries::text(row.get_ref(0)?).unwrap_or_default();
        let healthy = queries::integer(row.get_ref(1)?, 0).is_some_and(|healthy| healthy != 0);
        Ok((runner, healthy))
    })?;
    rows.collect()
}
