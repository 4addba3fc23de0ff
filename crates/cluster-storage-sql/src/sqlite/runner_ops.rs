//! The worker side of the runner registry: the [`RunnerOp`] commands
//! [`SqliteRunnerStorage`](super::SqliteRunnerStorage) sends its worker, and the blocking code
//! the worker thread runs for them.

use rusqlite::params;

use super::queries;
use super::state::{Responder, WorkerState, classify};

/// The runner registry operations.
pub(super) enum RunnerOp {
    Register { address: String, runner: String, healthy: bool, reply: Responder<i64> },
    Unregister { address: String, reply: Responder<()> },
    GetRunners { reply: Responder<Vec<(String, bool)>> },
    SetHealth { address: String, healthy: bool, reply: Responder<()> },
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
    }
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
