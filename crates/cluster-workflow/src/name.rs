//! The names the engine keeps for its own records, and the check that keeps users' deferreds
//! and activities out of them.
//!
//! The engine stores some of its facts as deferreds and activities of the execution, under the
//! reference's names (`effect/src/workflow/`), which TypeScript runners read too:
//!
//! - a race's winner: deferred `raceAll/<race>` (`DurableDeferred.raceAll`);
//! - a durable sleep: deferred `DurableClock/<clock>` above the in-memory threshold, activity
//!   `DurableClock/<clock>` below it (`DurableClock.sleep`);
//! - a durable queue's item: deferred `DurableQueue/<queue>/<item id>` (`DurableQueue.process`);
//! - an interrupt: deferred `Workflow/InterruptSignal` (`ClusterWorkflowEngine`).
//!
//! A user deferred or activity named like one of them would read or complete the engine's
//! record: a deferred `raceAll/x` would be the winner of `ctx.race("x")`, an activity
//! `DurableClock/nap` would be the short sleep `nap`. So those prefixes are refused where a name
//! is defined ([`ReservedName`]); the engine's own records bypass the check.

/// The prefixes of deferred names the engine keeps for itself.
pub const RESERVED_DEFERRED_PREFIXES: [&str; 4] =
    ["raceAll/", "DurableClock/", "DurableQueue/", "Workflow/"];

/// The prefixes of activity names the engine keeps for itself.
pub const RESERVED_ACTIVITY_PREFIXES: [&str; 1] = ["DurableClock/"];

/// A deferred or activity name that starts with a prefix the engine keeps for its own records.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the {kind} name {name:?} starts with {prefix:?}, which the workflow engine keeps for its own \
     records; choose a name that does not start with it"
)]
pub struct ReservedName {
    /// `deferred` or `activity`.
    pub kind: &'static str,
    /// The refused name.
    pub name: String,
    /// The reserved prefix it starts with.
    pub prefix: &'static str,
}

/// `Ok` unless the deferred name `name` starts with a reserved prefix.
pub(crate) fn check_deferred(name: &str) -> Result<(), ReservedName> {
    check("deferred", name, &RESERVED_DEFERRED_PREFIXES)
}

/// `Ok` unless the activity name `name` starts with a reserved prefix.
pub(crate) fn check_activity(name: &str) -> Result<(), ReservedName> {
    check("activity", name, &RESERVED_ACTIVITY_PREFIXES)
}

fn check(kind: &'static str, name: &str, prefixes: &[&'static str]) -> Result<(), ReservedName> {
    match prefixes.iter().find(|prefix| name.starts_with(**prefix)) {
        Some(prefix) => Err(ReservedName { kind, name: name.to_owned(), prefix }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
