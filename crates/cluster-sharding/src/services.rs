//! Services built on the runtime: singletons, cron jobs and message retention.
//!
//! - `singleton`: a task on the one runner that holds its shard's lock;
//! - `cron`: a job run once per scheduled instant across the cluster;
//! - `retention`: the singleton that deletes old processed requests.

pub(crate) mod cron;
pub(crate) mod retention;
pub(crate) mod singleton;
