//! The metrics of the runtime (`effect/src/cluster/ClusterMetrics.ts`), reported through the
//! `metrics` facade under the reference's `effect_cluster_*` names and labels; install any
//! `metrics` recorder (Prometheus, StatsD, ...) to export them.
//!
//! The reference's set:
//!
//! | name | kind | labels | meaning |
//! | --- | --- | --- | --- |
//! | `effect_cluster_entities` | gauge | `type` | resident entity instances of the type on this runner |
//! | `effect_cluster_entity_mailbox_size` | gauge | `type`, `id`, `shard` | requests admitted to one resident entity, queued or in flight; only with `entity_mailbox_metrics` |
//! | `effect_cluster_singletons` | gauge | | singletons running (or stopping) on this runner |
//! | `effect_cluster_runners` | gauge | | runners this process runs (1 for a runner, 0 for a client) |
//! | `effect_cluster_runners_healthy` | gauge | | 1 while this runner counts itself healthy |
//! | `effect_cluster_shards` | gauge | | shards this runner holds |
//! | `effect_cluster_shards_releasing` | gauge | | shards whose entities are stopping before their lock is released |
//! | `effect_cluster_shard_release` | histogram (ms) | | how long each completed release of one shard took |
//!
//! Reported by this runtime only, under the same prefix:
//!
//! | name | kind | labels | meaning |
//! | --- | --- | --- | --- |
//! | `effect_cluster_persisted_in_flight` | gauge | | persisted requests delivered to entities and not yet answered |
//! | `effect_cluster_shard_locks_healthy` | gauge | | 1 while lock storage answers (0: every shard is being let go) |
//! | `effect_cluster_join_debounce_pending` | gauge | | 1 while runner joins are held back by the join debounce |
//! | `effect_cluster_shard_locks_lost_total` | counter | | shard locks a single runner found taken by another runner |
//! | `effect_cluster_shard_acquisitions_total` | counter | | shard locks this runner acquired |
//! | `effect_cluster_shard_losses_total` | counter | | shard locks a refresh found lost (taken by another runner, or a lock session that ended) |
//! | `effect_cluster_shard_lock_refresh_seconds` | histogram (s) | | how long each periodic lock refresh took, time-outs included |
//! | `effect_cluster_read_loop_lag_seconds` | gauge (s) | | time since the storage read loop last finished a read; it grows while the loop is stuck |
//! | `effect_cluster_persisted_latency_seconds` | histogram (s) | | from a persisted request's save (its id's timestamp) to its stored final reply, on the runner that stored it |
//! | `effect_cluster_persisted_pushed_total` | counter | `answer` | persisted requests this process pushed to their owner, by what answered them: `pushed` (the owner, on the call), `stored` (the reply poller was first), `fallback` (the call failed; storage answered or will) |
//!
//! The reference's `effect_cluster_entity_mailbox_size_max` is not reported. The `metrics`
//! facade cannot remove a series: the mailbox gauge of an entity that stopped is set to 0.

use std::time::Duration;

/// Resident entity instances, by `type`.
pub const ENTITIES: &str = "effect_cluster_entities";
/// Requests admitted to one resident entity, by `type`, `id` and `shard`.
pub const ENTITY_MAILBOX_SIZE: &str = "effect_cluster_entity_mailbox_size";
/// Shards held by this runner.
pub const SHARDS: &str = "effect_cluster_shards";
/// Runners in this process.
pub const RUNNERS: &str = "effect_cluster_runners";
/// Whether this runner counts itself healthy.
pub const RUNNERS_HEALTHY: &str = "effect_cluster_runners_healthy";
/// Singletons running here.
pub const SINGLETONS: &str = "effect_cluster_singletons";
/// Shards being released.
pub const SHARDS_RELEASING: &str = "effect_cluster_shards_releasing";
/// How long each completed release of one shard took, in milliseconds.
pub const SHARD_RELEASE: &str = "effect_cluster_shard_release";

/// Persisted requests delivered and not yet answered.
pub const PERSISTED_IN_FLIGHT: &str = "effect_cluster_persisted_in_flight";
/// Whether lock storage is healthy.
pub const SHARD_LOCKS_HEALTHY: &str = "effect_cluster_shard_locks_healthy";
/// Whether runner joins are pending.
pub const JOINS_PENDING: &str = "effect_cluster_join_debounce_pending";
/// Shard locks a single runner lost to another runner.
pub const SHARD_LOCKS_LOST: &str = "effect_cluster_shard_locks_lost_total";
/// Persisted requests pushed to their owner, by `answer`: `pushed`, `stored` or `fallback`.
pub const PERSISTED_PUSHED: &str = "effect_cluster_persisted_pushed_total";

/// Shard locks acquired.
pub const SHARD_ACQUISITIONS: &str = "effect_cluster_shard_acquisitions_total";
/// Shard locks a refresh found lost.
pub const SHARD_LOSSES: &str = "effect_cluster_shard_losses_total";
/// How long each periodic lock refresh took, in seconds.
pub const SHARD_LOCK_REFRESH: &str = "effect_cluster_shard_lock_refresh_seconds";

/// Time since the storage read loop last finished a read, in seconds.
pub const READ_LOOP_LAG: &str = "effect_cluster_read_loop_lag_seconds";

/// From a persisted request's save to its stored final reply, in seconds.
pub const PERSISTED_LATENCY: &str = "effect_cluster_persisted_latency_seconds";

/// Adds `count` to a counter.
pub(crate) fn count(name: &'static str, count: usize) {
    metrics::counter!(name).increment(u64::try_from(count).unwrap_or(u64::MAX));
}

/// Records a duration in seconds in a histogram.
pub(crate) fn record_seconds(name: &'static str, duration: Duration) {
    metrics::histogram!(name).record(duration.as_secs_f64());
}

/// Sets a gauge from a count.
pub(crate) fn set(name: &'static str, count: usize) {
    metrics::gauge!(name).set(as_gauge(count));
}

/// Sets a gauge labelled with an entity type.
pub(crate) fn set_for_type(name: &'static str, entity_type: &str, count: usize) {
    metrics::gauge!(name, "type" => entity_type.to_owned()).set(as_gauge(count));
}

/// The mailbox gauge of one entity.
pub(crate) fn mailbox_gauge(entity_type: &str, entity_id: &str, shard: &str) -> metrics::Gauge {
    metrics::gauge!(
        ENTITY_MAILBOX_SIZE,
        "type" => entity_type.to_owned(),
        "id" => entity_id.to_owned(),
        "shard" => shard.to_owned(),
    )
}

/// Sets a mailbox gauge.
pub(crate) fn set_mailbox(gauge: &metrics::Gauge, size: usize) {
    gauge.set(as_gauge(size));
}

/// Records how long the release of one shard took.
pub(crate) fn record_shard_release(took: Duration) {
    metrics::describe_histogram!(
        SHARD_RELEASE,
        metrics::Unit::Milliseconds,
        "Time taken to release a shard, including entity teardown, retries and lock storage recovery"
    );
    metrics::histogram!(SHARD_RELEASE).record(took.as_secs_f64() * 1000.0);
}

fn as_gauge(count: usize) -> f64 {
    // Gauges are floating point; counts of entities and shards are far below 2^53.
    u32::try_from(count).map_or(f64::from(u32::MAX), f64::from)
}
