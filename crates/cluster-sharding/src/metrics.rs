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
//! | `effect_cluster_entity_passivations_total` | counter | `type`, `reason` | entity instances stopped while idle: `idle` (after `max_idle_time` without a request) or `capacity` (among the least recently used idle instances when the runner's or the type's residency cap was reached) |
//! | `effect_cluster_persisted_in_flight` | gauge | | persisted requests delivered to entities and not yet answered |
//! | `effect_cluster_shard_locks_healthy` | gauge | | 1 while lock storage answers (0: every shard is being let go) |
//! | `effect_cluster_join_debounce_pending` | gauge | | 1 while runner joins are held back by the join debounce |
//! | `effect_cluster_shard_locks_lost_total` | counter | | shard locks a single runner found taken by another runner |
//! | `effect_cluster_shard_acquisitions_total` | counter | | shard locks this runner acquired |
//! | `effect_cluster_shard_losses_total` | counter | | shard locks a refresh found lost (taken by another runner, or a lock session that ended) |
//! | `effect_cluster_shard_lock_refresh_seconds` | histogram (s) | | how long each periodic lock refresh took, time-outs included |
//! | `effect_cluster_read_loop_lag_seconds` | gauge (s) | | time since the storage read loop last finished a read; it grows while the loop is stuck |
//! | `effect_cluster_persisted_latency_seconds` | histogram (s) | | from a persisted request's save (its id's timestamp) to its stored final reply, on the runner that stored it |
//! | `effect_cluster_persisted_pushed_total` | counter | `answer` | persisted requests this process pushed to their owner, by what answered them: `pushed` (the owner, on the call), `stored` (the reply poller was first), `fallback` (the call failed, or the transport's lane of pushes was full; storage answered or will) |
//! | `effect_cluster_persisted_pushed_waiting` | gauge | | pushed calls this process waits on: the occupancy of its transport's lanes of pushes (`max_pushed_in_flight` per connection) |
//! | `effect_cluster_persisted_pushed_serving` | gauge | | pushed calls this runner answers once their final replies are stored |
//! | `effect_cluster_retention_deleted_total` | counter | | processed requests (with their replies) deleted by message retention on this runner |
//! | `effect_cluster_runners_gone_total` | counter | | peers this runner found gone (their address refused connections twice) and marked unhealthy |
//! | `effect_cluster_shards_unserved` | gauge | | shards this runner sees unserved: those assigned to a peer it found gone, and its own assigned shards whose lock it does not hold yet |
//!
//! Requests, by entity `type`, request `tag` and `kind` (`volatile`, `persisted`, or `stream`
//! for a streaming request type, persisted or not); a request whose tag its type does not
//! declare is not counted, so that no label comes from the wire:
//!
//! | name | kind | labels | meaning |
//! | --- | --- | --- | --- |
//! | `effect_cluster_requests_received_total` | counter | `type`, `tag`, `kind` | requests handed to an entity manager of this runner, admitted or refused |
//! | `effect_cluster_requests_answered_total` | counter | `type`, `tag`, `kind` | requests this runner's handlers answered with success |
//! | `effect_cluster_requests_failed_total` | counter | `type`, `tag`, `kind`, `reason` | requests that ended otherwise: `failure` (the request type's own error), `defect`, `interrupt`, or `refused` (not admitted: mailbox full, shard not served here, manager stopping) |
//! | `effect_cluster_handler_duration_seconds` | histogram (s) | `type`, `tag` | how long each run of a handler took, to its exit |
//!
//! Storage operations, by `backend` (`postgres`, `mysql`, `sqlite`, `memory`, or `custom` for a
//! storage that does not name itself) and `operation` (the storage contract's method, such as
//! `save_request` or `refresh`):
//!
//! | name | kind | labels | meaning |
//! | --- | --- | --- | --- |
//! | `effect_cluster_storage_operation_seconds` | histogram (s) | `backend`, `operation` | how long each storage operation of this process took, failed ones included |
//! | `effect_cluster_storage_errors_total` | counter | `backend`, `operation`, `kind` | storage operations that failed, by the error's kind (`conflict`, `unavailable`, `timeout`, `malformed`, `invalid_input`, `other`) |
//!
//! The reference's `effect_cluster_entity_mailbox_size_max` is not reported. The `metrics`
//! facade cannot remove a series: the mailbox gauge of an entity that stopped is set to 0, and
//! its handle dropped (the runner's operations server keeps these series by handle, and drops
//! each with its entity).

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

/// Entity instances passivated, by `type` and `reason`.
pub const ENTITY_PASSIVATIONS: &str = "effect_cluster_entity_passivations_total";

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
/// Pushed calls this process waits on.
pub const PERSISTED_PUSHED_WAITING: &str = "effect_cluster_persisted_pushed_waiting";
/// Pushed calls this runner serves.
pub const PERSISTED_PUSHED_SERVING: &str = "effect_cluster_persisted_pushed_serving";

/// Processed requests deleted by message retention.
pub const RETENTION_DELETED: &str = "effect_cluster_retention_deleted_total";

/// Peers this runner found gone and marked unhealthy.
pub const RUNNERS_GONE: &str = "effect_cluster_runners_gone_total";
/// Shards this runner sees unserved.
pub const SHARDS_UNSERVED: &str = "effect_cluster_shards_unserved";

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

/// Requests handed to an entity manager, by `type`, `tag` and `kind`.
pub const REQUESTS_RECEIVED: &str = "effect_cluster_requests_received_total";
/// Requests answered with success, by `type`, `tag` and `kind`.
pub const REQUESTS_ANSWERED: &str = "effect_cluster_requests_answered_total";
/// Requests that failed, by `type`, `tag`, `kind` and `reason`.
pub const REQUESTS_FAILED: &str = "effect_cluster_requests_failed_total";
/// How long each run of a handler took, in seconds, by `type` and `tag`.
pub const HANDLER_DURATION: &str = "effect_cluster_handler_duration_seconds";

/// How long each storage operation took, in seconds, by `backend` and `operation`.
pub const STORAGE_OPERATION: &str = "effect_cluster_storage_operation_seconds";
/// Storage operations that failed, by `backend`, `operation` and `kind`.
pub const STORAGE_ERRORS: &str = "effect_cluster_storage_errors_total";

/// How a request reached its entity, for the `kind` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestKind {
    /// In memory, from this runner or over the transport.
    Volatile = 0,
    /// Saved in the message table first.
    Persisted = 1,
}

/// Why a request failed, for the `reason` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailReason {
    /// The request type's own error.
    Failure = 0,
    /// A defect: a panic, a malformed payload, an unexpected error.
    Defect = 1,
    /// An interruption.
    Interrupt = 2,
    /// Not admitted.
    Refused = 3,
}

impl FailReason {
    const LABELS: [&'static str; 4] = ["failure", "defect", "interrupt", "refused"];

    /// The reason of a failed exit: its first reason decides (a defect beside an interruption
    /// is a defect).
    pub(crate) fn of(cause: &cluster_core::envelope::Cause) -> FailReason {
        use cluster_core::envelope::CauseReason;
        if cause.0.iter().any(|reason| matches!(reason, CauseReason::Die(_))) {
            FailReason::Defect
        } else if cause.0.iter().any(|reason| matches!(reason, CauseReason::Fail(_))) {
            FailReason::Failure
        } else {
            FailReason::Interrupt
        }
    }
}

/// The request metrics of one request type of one entity type, registered once, so that
/// counting a request is an increment on a handle, not a lookup in the recorder.
///
/// The handles come from the recorder installed when the entity type is registered: install
/// the recorder before starting the runtime.
pub(crate) struct RequestMetrics {
    received: [metrics::Counter; 2],
    answered: [metrics::Counter; 2],
    failed: [[metrics::Counter; 4]; 2],
    duration: metrics::Histogram,
}

impl Default for RequestMetrics {
    fn default() -> RequestMetrics {
        RequestMetrics {
            received: [metrics::Counter::noop(), metrics::Counter::noop()],
            answered: [metrics::Counter::noop(), metrics::Counter::noop()],
            failed: std::array::from_fn(|_| std::array::from_fn(|_| metrics::Counter::noop())),
            duration: metrics::Histogram::noop(),
        }
    }
}

impl RequestMetrics {
    /// The handles of request type `tag` of `entity_type`; a streaming type's requests all
    /// count under the kind `stream`.
    pub(crate) fn register(entity_type: &str, tag: &'static str, stream: bool) -> RequestMetrics {
        let kinds = [RequestKind::Volatile, RequestKind::Persisted];
        let labels = |kind: RequestKind| {
            [
                metrics::Label::new("type", entity_type.to_owned()),
                metrics::Label::from_static_parts("tag", tag),
                metrics::Label::from_static_parts("kind", kind_label(kind, stream)),
            ]
        };
        RequestMetrics {
            received: kinds.map(|kind| metrics::counter!(REQUESTS_RECEIVED, labels(kind).to_vec())),
            answered: kinds.map(|kind| metrics::counter!(REQUESTS_ANSWERED, labels(kind).to_vec())),
            failed: kinds.map(|kind| {
                FailReason::LABELS.map(|reason| {
                    let mut labels = labels(kind).to_vec();
                    labels.push(metrics::Label::from_static_parts("reason", reason));
                    metrics::counter!(REQUESTS_FAILED, labels)
                })
            }),
            duration: metrics::histogram!(
                HANDLER_DURATION,
                vec![
                    metrics::Label::new("type", entity_type.to_owned()),
                    metrics::Label::from_static_parts("tag", tag),
                ]
            ),
        }
    }

    /// Counts a request handed to the manager.
    pub(crate) fn received(&self, kind: RequestKind) {
        self.received[kind as usize].increment(1);
    }

    /// Counts a request's exit.
    pub(crate) fn exited(&self, kind: RequestKind, exit: &cluster_core::envelope::Exit) {
        match exit {
            cluster_core::envelope::Exit::Success(_) => self.answered[kind as usize].increment(1),
            cluster_core::envelope::Exit::Failure(cause) => {
                self.failed(kind, FailReason::of(cause))
            }
        }
    }

    /// Counts a failed request.
    pub(crate) fn failed(&self, kind: RequestKind, reason: FailReason) {
        self.failed[kind as usize][reason as usize].increment(1);
    }

    /// Records how long a run of the handler took.
    pub(crate) fn handled(&self, took: Duration) {
        self.duration.record(took.as_secs_f64());
    }
}

/// The `kind` label.
fn kind_label(kind: RequestKind, stream: bool) -> &'static str {
    match (stream, kind) {
        (true, _) => "stream",
        (false, RequestKind::Volatile) => "volatile",
        (false, RequestKind::Persisted) => "persisted",
    }
}

/// Adds `count` to a counter.
pub(crate) fn count(name: &'static str, count: usize) {
    metrics::counter!(name).increment(u64::try_from(count).unwrap_or(u64::MAX));
}

/// One more in a gauge while alive (a call in flight, say).
pub(crate) struct Occupied(metrics::Gauge);

impl Occupied {
    /// Counts one more in `name` until dropped.
    pub(crate) fn of(name: &'static str) -> Occupied {
        let gauge = metrics::gauge!(name);
        gauge.increment(1.0);
        Occupied(gauge)
    }
}

impl Drop for Occupied {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
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

/// Why an entity instance was passivated.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Passivation {
    /// It went `max_idle_time` without a request.
    Idle,
    /// It was among the least recently used idle instances when a cap was reached.
    Capacity,
}

/// Counts one passivation of an instance of `entity_type`.
pub(crate) fn passivated(entity_type: &str, reason: Passivation) {
    let reason = match reason {
        Passivation::Idle => "idle",
        Passivation::Capacity => "capacity",
    };
    metrics::counter!(ENTITY_PASSIVATIONS, "type" => entity_type.to_owned(), "reason" => reason)
        .increment(1);
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
