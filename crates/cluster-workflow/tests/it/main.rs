//! The workflow engine's behaviour (`effect/src/workflow/Workflow.ts`), written once against a
//! [`suite::Harness`] and run on the in-memory engine.

mod cluster;
mod inspect;
mod integration;
mod memory;
mod panics;
mod paused;
mod queue;
mod retention;
mod sql;
mod suite;
mod transaction;
