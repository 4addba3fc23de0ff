//! The gauges users watch (`effect/src/cluster/ClusterMetrics.ts`), reported through the `metrics`
//! facade under `cluster_*` names; install any `metrics` recorder (Prometheus, StatsD, ...) to
//! export them.
//!
//! | name | kind | labels | meaning |
//! | --- | --- | --- | --- |
//! | `cluster_entities` | gauge | `type` | resident entity instances of the type on this runner |
//! | `cluster_shards` | gauge | | shards this runner holds |
//! | `cluster_runners` | gauge | | runners this process runs (1 for a runner, 0 for a client) |
//! | `cluster_runners_healthy` | gauge | | 1 while this runner counts itself healthy |
//! | `cluster_persisted_in_flight` | gauge | | persisted requests delivered to entities and not yet answered |
//! | `cluster_shards_releasing` | gauge | | shards whose entities are stopping before their lock is released |
//! | `cluster_shard_locks_healthy` | gauge | | 1 while lock storage answers (0: every shard is being let go) |
//! | `cluster_singletons` | gauge | | singletons running (or stopping) on this runner |
//! | `cluster_join_debounce_pending` | gauge | | 1 while runner joins are held back by the join debounce |
//! | `cluster_shard_locks_lost_total` | counter | | shard locks a single runner found taken by another runner |

/// Resident entity instances, by `type`.
pub const ENTITIES: &str = "cluster_entities";
/// Shards held by this runner.
pub const SHARDS: &str = "cluster_shards";
/// Runners in this process.
pub const RUNNERS: &str = "cluster_runners";
/// Whether this runner counts itself healthy.
pub const RUNNERS_HEALTHY: &str = "cluster_runners_healthy";
/// Persisted requests delivered and not yet answered.
pub const PERSISTED_IN_FLIGHT: &str = "cluster_persisted_in_flight";

/// Singletons running here.
pub const SINGLETONS: &str = "cluster_singletons";
/// Shards being released.
pub const SHARDS_RELEASING: &str = "cluster_shards_releasing";
/// Whether lock storage is healthy.
pub const SHARD_LOCKS_HEALTHY: &str = "cluster_shard_locks_healthy";
/// Whether runner joins are pending.
pub const JOINS_PENDING: &str = "cluster_join_debounce_pending";
/// Shard locks a single runner lost to another runner.
pub const SHARD_LOCKS_LOST: &str = "cluster_shard_locks_lost_total";

/// Sets a gauge from a count.
pub(crate) fn set(name: &'static str, count: usize) {
    metrics::gauge!(name).set(as_gauge(count));
}

/// Sets a gauge labelled with an entity type.
pub(crate) fn set_for_type(name: &'static str, entity_type: &str, count: usize) {
    metrics::gauge!(name, "type" => entity_type.to_owned()).set(as_gauge(count));
}

fn as_gauge(count: usize) -> f64 {
    // Gauges are floating point; counts of entities and shards are far below 2^53.
    u32::try_from(count).map_or(f64::from(u32::MAX), f64::from)
}
