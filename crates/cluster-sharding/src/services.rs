//! Services built on the runtime: singletons and cron jobs.
//!
//! - `singleton`: a task on the one runner that holds its shard's lock;
//! - `cron`: a job run once per scheduled instant across the cluster.

pub(crate) mod cron;
pub(crate) mod singleton;
