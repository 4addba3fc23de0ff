//! The workflow engine's behaviour (reference/workflow.md §4–§6), written once against a
//! [`suite::Harness`] and run on the in-memory engine.

mod cluster;
mod integration;
mod memory;
mod queue;
mod sql;
mod suite;
