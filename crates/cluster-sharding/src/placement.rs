//! Where requests run: the runners of a cluster, the shards each serves, and routing.
//!
//! - `member`: this process as a cluster member: membership, shard locks and the handoff;
//! - `health`: the application's runner-health check, instead of the transport's pings;
//! - `single_runner`: one runner holding every shard's lock;
//! - `shards`: the shards served now, and whether a final reply may be stored;
//! - `remote`: volatile requests routed to the owner of their shard;
//! - `unserved`: the warning of a persisted call whose shard no runner holds.

pub(crate) mod health;
pub(crate) mod member;
pub(crate) mod remote;
pub(crate) mod shards;
pub(crate) mod single_runner;
pub(crate) mod unserved;

use std::time::Duration;

use cluster_core::ShardingConfig;

/// The time a lock must have left, at least, for its shard to be served or read.
///
/// - A final reply confirmed now is written within it.
/// - SQLite's lease times are whole seconds.
///   As the database sees it, a lease may start up to a second before the refresh was sent.
/// - A read of the shard's messages that passed the check reaches the database within it.
const LEASE_MARGIN_MIN: Duration = Duration::from_secs(2);

/// How long after a lock operation was sent its answer confirms the shard's lock: the
/// expiration, less a margin of at least one refresh interval.
///
/// Another runner can take the lock only once it expired.
/// That is `shard_lock_expiration` after the last refresh reached the database, at the
/// earliest, which is after it was sent.
/// So a runner that checks its lease before it reads or answers does so while it holds the lock,
/// even if it was frozen (a stopped process, a paused machine) in between.
pub(crate) fn lock_lease(config: &ShardingConfig) -> Duration {
    let expiration = config.shard_lock_expiration;
    // At most half the expiration, so that a lease outlives the refresh interval.
    let margin = config.shard_lock_interval().max(LEASE_MARGIN_MIN.min(expiration / 2));
    expiration.saturating_sub(margin)
}
