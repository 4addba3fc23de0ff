//! The runner's sharding configuration: the reference's `ShardingConfig`
//! (`effect/src/cluster/ShardingConfig.ts`).
//!
//! [`ShardingConfig`] holds every option of the reference, with the reference's defaults
//! ([`ShardingConfig::default`]) and environment variables ([`ShardingConfig::from_env`]). It lives
//! in core because every crate reads it, and because loading it stays pure when the environment
//! is passed in as a function ([`ShardingConfig::from_env_with`]).
//!
//! [`ShardingConfig::validate`] is stricter than the reference, which checks nothing: it rejects
//! values that would break the cluster (colliding advisory lock numbers, a shard id that does not
//! fit its column, an assigned group that is not available, a zero poll interval) and values so
//! large that they are surely mistakes. Each bound is a `*_MAX` constant of this module that says
//! why it is there.
//!
//! # Environment variables
//!
//! The names are the constant case of the reference's config keys, without a prefix. An unset
//! variable, or one set to the empty string, keeps the default.
//!
//! | Variable | Field | Default |
//! | --- | --- | --- |
//! | `HOST`, `PORT` | [`runner_address`](ShardingConfig::runner_address) | `localhost`, `34431` (always `Some` from the environment) |
//! | `LISTEN_HOST`, `LISTEN_PORT` | [`runner_listen_address`](ShardingConfig::runner_listen_address) | `None`; `LISTEN_PORT` defaults to the advertised port (`PORT`) and needs `LISTEN_HOST` |
//! | `RUNNER_SHARD_WEIGHT` | [`runner_shard_weight`](ShardingConfig::runner_shard_weight) | `1` (an integer) |
//! | `AVAILABLE_SHARD_GROUPS` | [`available_shard_groups`](ShardingConfig::available_shard_groups) | `default` |
//! | `SHARD_GROUPS` | [`assigned_shard_groups`](ShardingConfig::assigned_shard_groups) | `default` |
//! | `SHARDS_PER_GROUP` | [`shards_per_group`](ShardingConfig::shards_per_group) | `300` |
//! | `SHARD_LOCK_REFRESH_INTERVAL` | [`shard_lock_refresh_interval`](ShardingConfig::shard_lock_refresh_interval) | `10 seconds` |
//! | `SHARD_LOCK_EXPIRATION` | [`shard_lock_expiration`](ShardingConfig::shard_lock_expiration) | `35 seconds` |
//! | `SHARD_LOCK_DISABLE_ADVISORY` | [`shard_lock_disable_advisory`](ShardingConfig::shard_lock_disable_advisory) | `false` |
//! | `PREEMPTIVE_SHUTDOWN` | [`preemptive_shutdown`](ShardingConfig::preemptive_shutdown) | `true` |
//! | `ENTITY_MAILBOX_CAPACITY` | [`entity_mailbox_capacity`](ShardingConfig::entity_mailbox_capacity) | `4096` |
//! | `ENTITY_MAILBOX_METRICS` | [`entity_mailbox_metrics`](ShardingConfig::entity_mailbox_metrics) | `false` |
//! | `MAX_RESIDENT_ENTITIES` | [`max_resident_entities`](ShardingConfig::max_resident_entities) | `10000` |
//! | `UNPROCESSED_MESSAGE_BATCH_SIZE` | [`unprocessed_message_batch_size`](ShardingConfig::unprocessed_message_batch_size) | `1024` |
//! | `ENTITY_MAX_IDLE_TIME` | [`entity_max_idle_time`](ShardingConfig::entity_max_idle_time) | `1 minute` (`Infinity` = never) |
//! | `ENTITY_REGISTRATION_TIMEOUT` | [`entity_registration_timeout`](ShardingConfig::entity_registration_timeout) | `1 minute` |
//! | `ENTITY_TERMINATION_TIMEOUT` | [`entity_termination_timeout`](ShardingConfig::entity_termination_timeout) | `15 seconds` |
//! | `ENTITY_MESSAGE_POLL_INTERVAL` | [`entity_message_poll_interval`](ShardingConfig::entity_message_poll_interval) | `10 seconds` |
//! | `ENTITY_REPLY_POLL_INTERVAL` | [`entity_reply_poll_interval`](ShardingConfig::entity_reply_poll_interval) | `200 millis` |
//! | `REFRESH_ASSIGNMENTS_INTERVAL` | [`refresh_assignments_interval`](ShardingConfig::refresh_assignments_interval) | `3 seconds` |
//! | `RUNNER_JOIN_DEBOUNCE` | [`runner_join_debounce`](ShardingConfig::runner_join_debounce) | `0 seconds` |
//! | `SEND_RETRY_INTERVAL` | [`send_retry_interval`](ShardingConfig::send_retry_interval) | `100 millis` |
//! | `RUNNER_HEALTH_CHECK_INTERVAL` | [`runner_health_check_interval`](ShardingConfig::runner_health_check_interval) | `1 minute` |
//! | `RUNNER_HEALTH_CHECK` | [`runner_health_check`](ShardingConfig::runner_health_check) | `ping-known` |
//! | `RUNNER_PROBE_INTERVAL` | [`runner_probe_interval`](ShardingConfig::runner_probe_interval) | `1 second` |
//! | `STORAGE_READ_TIMEOUT` | [`storage_read_timeout`](ShardingConfig::storage_read_timeout) | `10 seconds` |
//! | `STORAGE_WRITE_TIMEOUT` | [`storage_write_timeout`](ShardingConfig::storage_write_timeout) | `10 seconds` |
//! | `SIMULATE_REMOTE_SERIALIZATION` | [`simulate_remote_serialization`](ShardingConfig::simulate_remote_serialization) | `true` |
//! | `MESSAGE_RETENTION` | [`message_retention`](ShardingConfig::message_retention) | unset: processed requests are kept |
//! | `WORKFLOW_RETENTION` | [`workflow_retention`](ShardingConfig::workflow_retention) | unset: finished executions are kept |
//!
//! `HOST` and `PORT` are generic names that platforms and other tools also set; a runner reads
//! them all the same, as the reference does.
//!
//! `LISTEN_HOST` without `LISTEN_PORT` listens on the advertised port (`PORT`, or its default).
//! The reference listens on `34431` then, whatever `PORT` says (`listenPort`'s default in
//! `effect/src/cluster/ShardingConfig.ts`); so `PORT=5000 LISTEN_HOST=0.0.0.0`, the usual
//! container setting, would advertise a port it does not listen on.
//!
//! # Value syntax
//!
//! - Integers: decimal, with an optional sign (`300`, `+300`); no exponent, no fraction.
//! - Booleans: `true`, `yes`, `on`, `1`, `y` or `false`, `no`, `off`, `0`, `n` (lower case).
//! - Lists: comma-separated, not trimmed (`a,b`).
//! - Durations: see [`parse_duration`]; `Infinity` only for `ENTITY_MAX_IDLE_TIME`,
//!   `MESSAGE_RETENTION` and `WORKFLOW_RETENTION` (where it means "keep forever").
//! - Health check modes: `ping-known`, `ping` or `heartbeat` (see [`RunnerHealthCheck`]).

use std::collections::BTreeSet;
use std::fmt;
use std::num::{IntErrorKind, NonZeroU32, ParseIntError};
use std::time::Duration;

use crate::error::{ConfigError, ParseError};
use crate::hash;
use crate::ids::{RunnerAddress, RunnerWeight, ShardGroup, ShardId};

/// The host a runner advertises unless `HOST` says otherwise.
pub const DEFAULT_HOST: &str = "localhost";

/// The port a runner advertises and listens on unless `PORT` or `LISTEN_PORT` say otherwise.
pub const DEFAULT_PORT: u16 = 34431;

/// The largest [`shards_per_group`](ShardingConfig::shards_per_group).
///
/// The advisory lock number of shard `s` of the group at index `i` (in the sorted available
/// groups) is `(i + 1) × 1_000_000 + s`, a wire format shared with the reference; a larger
/// shard count would give two shards the same lock.
pub const SHARDS_PER_GROUP_MAX: u32 = 999_999;

/// The largest number of [available shard groups](ShardingConfig::available_shard_groups).
///
/// Advisory lock numbers are `i32` in PostgreSQL: `2146 × 1_000_000 + 999_999` is the largest
/// lock number that fits.
pub const SHARD_GROUPS_MAX: u32 = 2146;

/// The longest shard id string (`group:shard`), in characters.
///
/// The `shard_id` columns of the reference's tables are `VARCHAR(50)`, so a group name may have
/// at most `50 - 1 - digits(shards_per_group)` characters.
pub const SHARD_ID_LEN_MAX: usize = 50;

/// The longest runner address string (`host:port`), in characters: the registry's `address`
/// columns are `VARCHAR(255)`.
pub const RUNNER_ADDRESS_LEN_MAX: usize = 255;

/// The largest [`runner_shard_weight`](ShardingConfig::runner_shard_weight).
///
/// A runner places `weight × 128` points on each group's hash ring, and a runner a thousand times
/// heavier than another is surely a mistake.
pub const RUNNER_SHARD_WEIGHT_MAX: f64 = 1000.0;

/// The largest bounded [`entity_mailbox_capacity`](ShardingConfig::entity_mailbox_capacity).
///
/// More than a million requests in flight for one entity is surely a mistake; use
/// [`Capacity::Unbounded`] to mean "no limit".
pub const ENTITY_MAILBOX_CAPACITY_MAX: u32 = 1 << 20;

/// The largest bounded [`max_resident_entities`](ShardingConfig::max_resident_entities).
///
/// Ten million live entities on one runner is surely a mistake; use [`Capacity::Unbounded`] to
/// mean "no limit".
pub const RESIDENT_ENTITIES_MAX: u32 = 10_000_000;

/// The largest [`unprocessed_message_batch_size`](ShardingConfig::unprocessed_message_batch_size).
///
/// The ids of one claimed batch may be bound as parameters of one statement, and PostgreSQL and
/// MySQL accept at most 65,535 parameters per statement.
pub const UNPROCESSED_MESSAGE_BATCH_SIZE_MAX: u32 = 65_535;

/// The largest interval, timeout, lock expiration or join debounce: one hour.
///
/// A poll that happens less than once an hour, a frozen runner that keeps its shards for more
/// than an hour, or joins that wait more than four hours (the debounce cap) are surely mistakes.
pub const INTERVAL_MAX: Duration = Duration::from_secs(60 * 60);

/// The largest finite [`entity_max_idle_time`](ShardingConfig::entity_max_idle_time): 365 days.
///
/// Timers much further out overflow instant arithmetic on some platforms; `None` (`Infinity`)
/// means "never reap".
pub const ENTITY_MAX_IDLE_TIME_MAX: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The shortest [`message_retention`](ShardingConfig::message_retention) and
/// [`workflow_retention`](ShardingConfig::workflow_retention): 10 seconds.
///
/// A caller waiting on storage for its reply must read it before it is deleted, and a retry of
/// a request must find it to be deduplicated; seconds are already risky, so keep days.
pub const RETENTION_MIN: Duration = Duration::from_secs(10);

/// The longest finite retention: 3,650 days. More is surely a unit mistake; leave the option
/// unset to keep everything.
pub const RETENTION_MAX: Duration = Duration::from_secs(3650 * 24 * 60 * 60);

/// The shortest [`shard_lock_expiration`](ShardingConfig::shard_lock_expiration): one
/// millisecond, the resolution of the cluster's clock and of the lock timestamps it writes.
pub const SHARD_LOCK_EXPIRATION_MIN: Duration = Duration::from_millis(1);

// Advisory lock numbers of the largest configuration fit an `i32` (see `SHARD_GROUPS_MAX`).
const _: () =
    assert!(SHARD_GROUPS_MAX as i64 * 1_000_000 + SHARDS_PER_GROUP_MAX as i64 <= i32::MAX as i64);

/// Every environment variable [`ShardingConfig::from_env`] reads.
pub const ENV_VARS: [&str; 32] = [
    var::HOST,
    var::PORT,
    var::LISTEN_HOST,
    var::LISTEN_PORT,
    var::RUNNER_SHARD_WEIGHT,
    var::AVAILABLE_SHARD_GROUPS,
    var::SHARD_GROUPS,
    var::SHARDS_PER_GROUP,
    var::SHARD_LOCK_REFRESH_INTERVAL,
    var::SHARD_LOCK_EXPIRATION,
    var::SHARD_LOCK_DISABLE_ADVISORY,
    var::PREEMPTIVE_SHUTDOWN,
    var::ENTITY_MAILBOX_CAPACITY,
    var::ENTITY_MAILBOX_METRICS,
    var::MAX_RESIDENT_ENTITIES,
    var::UNPROCESSED_MESSAGE_BATCH_SIZE,
    var::ENTITY_MAX_IDLE_TIME,
    var::ENTITY_REGISTRATION_TIMEOUT,
    var::ENTITY_TERMINATION_TIMEOUT,
    var::ENTITY_MESSAGE_POLL_INTERVAL,
    var::ENTITY_REPLY_POLL_INTERVAL,
    var::REFRESH_ASSIGNMENTS_INTERVAL,
    var::RUNNER_JOIN_DEBOUNCE,
    var::SEND_RETRY_INTERVAL,
    var::RUNNER_HEALTH_CHECK_INTERVAL,
    var::RUNNER_PROBE_INTERVAL,
    var::STORAGE_READ_TIMEOUT,
    var::STORAGE_WRITE_TIMEOUT,
    var::RUNNER_HEALTH_CHECK,
    var::SIMULATE_REMOTE_SERIALIZATION,
    var::MESSAGE_RETENTION,
    var::WORKFLOW_RETENTION,
];

/// The configuration of sharding on one runner (or client).
///
/// Build it with [`ShardingConfig::default`] and struct update syntax, or load it with
/// [`ShardingConfig::from_env`]; call [`validate`](ShardingConfig::validate) after changing fields.
/// Options marked "cluster-wide" must have the same value on every runner and client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardingConfig {
    /// The address other runners use to reach this runner; `None` makes it a client that sends
    /// messages but owns no shards.
    ///
    /// Default `Some(localhost:34431)`. Environment: `HOST` and `PORT` (each with its default,
    /// so the environment always gives `Some`; `None` is programmatic only).
    pub runner_address: Option<RunnerAddress>,
    /// The address transports bind to, if it differs from `runner_address` (for example
    /// `0.0.0.0`). Port 0 binds an ephemeral port.
    ///
    /// Default `None` (bind `runner_address`). Environment: `LISTEN_HOST` and `LISTEN_PORT`
    /// (neither: `None`; `LISTEN_HOST` alone: the advertised port, `PORT`; `LISTEN_PORT` alone:
    /// an error). The reference listens on 34431 when only `LISTEN_HOST` is set.
    pub runner_listen_address: Option<RunnerAddress>,
    /// This runner's share of the shards relative to other runners: 2 takes twice the shards
    /// of a runner with weight 1. Greater than 0 and at most [`RUNNER_SHARD_WEIGHT_MAX`].
    ///
    /// Default `1`. Environment: `RUNNER_SHARD_WEIGHT` (an integer, as in the reference).
    pub runner_shard_weight: RunnerWeight,
    /// Every shard group of the cluster (cluster-wide). Their sorted order gives each group its
    /// advisory lock numbers; names must be distinct and non-empty.
    ///
    /// Default `["default"]`. Environment: `AVAILABLE_SHARD_GROUPS` (comma-separated).
    pub available_shard_groups: Vec<ShardGroup>,
    /// The shard groups this runner serves. Each must be one of `available_shard_groups`:
    /// [`validate`](ShardingConfig::validate) rejects any other, where the reference ignores it
    /// silently. Repeating a group is harmless.
    ///
    /// Default `["default"]`. Environment: `SHARD_GROUPS` (comma-separated; note the name).
    pub assigned_shard_groups: Vec<ShardGroup>,
    /// The number of shards of every group (cluster-wide), `1..=`[`SHARDS_PER_GROUP_MAX`].
    ///
    /// Default `300`. Environment: `SHARDS_PER_GROUP`.
    pub shards_per_group: u32,
    /// The longest time between two refreshes of this runner's shard locks. The runner refreshes
    /// at [`shard_lock_interval`](ShardingConfig::shard_lock_interval), which is at most a third of
    /// `shard_lock_expiration`, so that it has time to stop its entities if lock storage becomes
    /// unavailable. Greater than 0.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 10 s. Environment: `SHARD_LOCK_REFRESH_INTERVAL`.
    pub shard_lock_refresh_interval: Duration,
    /// How long a shard lock (and a runner's heartbeat) stays valid without a refresh. With
    /// PostgreSQL or MySQL advisory locks the database also ends an idle lock session after
    /// this long, so a frozen runner loses its shards. At least [`SHARD_LOCK_EXPIRATION_MIN`].
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 35 s. Environment: `SHARD_LOCK_EXPIRATION`.
    pub shard_lock_expiration: Duration,
    /// Use lock-table leases instead of PostgreSQL or MySQL advisory locks.
    ///
    /// Default `false`. Environment: `SHARD_LOCK_DISABLE_ADVISORY`.
    pub shard_lock_disable_advisory: bool,
    /// Start shutting the runner down (unregister, stop taking work, hand the shards over) as
    /// soon as shutdown begins, before any entity is stopped. This is what a runner does: it
    /// shuts down when `Sharding::shutdown` is called, and that call starts with the handoff.
    /// The reference's `false` stops entities first and hands the shards over afterwards; the
    /// runtime has no such order, so [`validate`](ShardingConfig::validate) refuses `false`.
    ///
    /// Default `true`. Environment: `PREEMPTIVE_SHUTDOWN`.
    pub preemptive_shutdown: bool,
    /// The default number of requests one entity may have in flight; more fail with
    /// `MailboxFull`. Entity types may override it.
    ///
    /// Default 4096. Environment: `ENTITY_MAILBOX_CAPACITY` (a positive integer; `Unbounded` is
    /// programmatic only).
    pub entity_mailbox_capacity: Capacity,
    /// Report each resident entity's mailbox size as the gauge
    /// `effect_cluster_entity_mailbox_size`, labelled `type`, `id` and `shard`: the requests
    /// admitted to the entity, queued or in flight. One series per resident entity can mean
    /// many series on a busy runner. When its entity stops, a series is set to 0, and the
    /// runner's operations server drops it from `/metrics`. See docs/operations.md for every
    /// metric.
    ///
    /// Default `false`. Environment: `ENTITY_MAILBOX_METRICS`.
    pub entity_mailbox_metrics: bool,
    /// The most entities that may be resident on this runner at once. At the limit a new entity
    /// makes room: the least recently used idle entities (nothing running or queued, no
    /// keep-alive) are passivated, as with Akka's least-recently-used passivation strategy. When
    /// no entity is idle, no new entity starts: persisted messages for new entities stay in
    /// storage until a slot frees up, and volatile sends to new entities fail with
    /// `MailboxFull`. A further cap for one entity type is `EntityOptions::max_resident`.
    ///
    /// Default 10,000. Environment: `MAX_RESIDENT_ENTITIES` (a positive integer; `Unbounded` is
    /// programmatic only).
    pub max_resident_entities: Capacity,
    /// The most unprocessed messages claimed from storage by one read, at most
    /// [`UNPROCESSED_MESSAGE_BATCH_SIZE_MAX`]. The reference treats values below 1 as 1; here the
    /// type rules them out.
    ///
    /// Default 1024. Environment: `UNPROCESSED_MESSAGE_BATCH_SIZE` (a positive integer).
    pub unprocessed_message_batch_size: NonZeroU32,
    /// How long an entity may go without requests in flight before it is stopped; `None` never
    /// stops idle entities. Entity types may override it.
    ///
    /// Default 1 min. Environment: `ENTITY_MAX_IDLE_TIME` (`Infinity` gives `None`).
    pub entity_max_idle_time: Option<Duration>,
    /// How long messages for an entity type that no runner has registered are kept before they
    /// fail.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 1 min. Environment: `ENTITY_REGISTRATION_TIMEOUT`.
    pub entity_registration_timeout: Duration,
    /// How long an entity may take to finish its requests when it is stopped before they are
    /// interrupted (15 s stays within Kubernetes' default grace period).
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 15 s. Environment: `ENTITY_TERMINATION_TIMEOUT`.
    pub entity_termination_timeout: Duration,
    /// How often storage is polled for unprocessed messages (and the acquisition of unlocked
    /// shards retried). Greater than 0.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 10 s. Environment: `ENTITY_MESSAGE_POLL_INTERVAL`.
    pub entity_message_poll_interval: Duration,
    /// How often storage is polled for replies to requests that wait on storage. Greater than 0.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 200 ms. Environment: `ENTITY_REPLY_POLL_INTERVAL`.
    pub entity_reply_poll_interval: Duration,
    /// How often the runner registry is read and shard assignments recomputed. Greater than 0.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 3 s. Environment: `REFRESH_ASSIGNMENTS_INTERVAL`.
    pub refresh_assignments_interval: Duration,
    /// How long the set of healthy runners must stay unchanged before runners that joined are
    /// given shards, so that a burst of joins (a scale-up, a deployment with a large surge) moves
    /// each shard once instead of once per join.
    ///
    /// Only joins wait: the initial assignment, departures and unhealthy runners are published at
    /// once, together with any pending joins. While joins are pending, shards stay where they
    /// are, the new runners stay idle and no runner takes a shard it does not already hold.
    /// Pending joins are published at most four times this duration after the first one; since
    /// the quiet period is checked once per `refresh_assignments_interval`, the worst-case delay
    /// is four times this duration plus one interval.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 0: every change is published at once, which suits load-driven scale-ups where idle
    /// new runners are costly. Environment: `RUNNER_JOIN_DEBOUNCE`.
    pub runner_join_debounce: Duration,
    /// The delay before a send is retried after `EntityNotAssignedToRunner` or
    /// `RunnerUnavailable`. Greater than 0.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 100 ms. Environment: `SEND_RETRY_INTERVAL`.
    pub send_retry_interval: Duration,
    /// How often the runner-health singleton checks the other runners. Greater than 0.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// Default 1 min. Environment: `RUNNER_HEALTH_CHECK_INTERVAL`.
    pub runner_health_check_interval: Duration,
    /// How the runner-health singleton judges the other runners (see [`RunnerHealthCheck`]).
    /// The default pings only the runners that answered this transport's handshake once, and
    /// judges the others by their registry heartbeat alone, so that a runner of the reference,
    /// which does not speak this transport, keeps its shards in a mixed cluster. It only
    /// matters on runners started with a transport; without one there is no health check.
    /// A runner given a check of the application's instead (cluster-sharding's
    /// `ShardingBuilder::runner_health`, or `CLUSTER_RUNNER_HEALTH=kubernetes` for
    /// durable-cluster's `Runner`) asks that check and pings nobody, whatever this mode says.
    ///
    /// Default `ping-known`. Environment: `RUNNER_HEALTH_CHECK` (`ping-known`, `ping` or
    /// `heartbeat`; not read by the reference).
    pub runner_health_check: RunnerHealthCheck,
    /// How often a runner probes its peers' transport addresses for one that is gone.
    /// Greater than 0. At most one hour (`INTERVAL_MAX`).
    ///
    /// - A peer whose address refuses connections twice in a row has no process listening: it
    ///   was killed or crashed.
    ///   The prober marks it unhealthy at once, and lets go of its lease rows in lease mode, so
    ///   that its shards move within seconds rather than when its heartbeat expires.
    /// - A frozen or partitioned peer does not refuse connections (its socket stays open, or
    ///   the connection times out), so it keeps its shards until its locks expire, as before.
    /// - Each runner probes up to 8 of the runners that hold shards in the assignment, those
    ///   that follow it in address order.
    /// - Probes need a transport, and stop with `RUNNER_HEALTH_CHECK=heartbeat`.
    ///
    /// Default 1 s. Environment: `RUNNER_PROBE_INTERVAL` (not read by the reference).
    pub runner_probe_interval: Duration,
    /// How long a read of storage may take: reply, state and primary-key lookups, the
    /// registry. Greater than 0. At most one hour (`INTERVAL_MAX`).
    ///
    /// A read past it fails with `StorageErrorKind::Timeout`, which the runtime handles as any
    /// failed read: a caller's lookup fails, a reply poll tries again.
    /// The read loop's claim of unprocessed messages has no deadline: the database may complete
    /// a claim its caller gave up on, which would hide those messages for 10 minutes
    /// (`CLAIM_WINDOW`). `effect_cluster_read_loop_lag_seconds` shows a stalled read.
    /// Lock operations have `shard_lock_interval()` instead; the listings of the console and
    /// retention's sweeps have 30 s.
    ///
    /// Default 10 s. Environment: `STORAGE_READ_TIMEOUT` (not read by the reference).
    pub storage_read_timeout: Duration,
    /// How long a write to storage may take: requests, replies, acknowledgements, interrupts,
    /// entity state, the steps of a transaction, released claims, the registry. Greater than 0.
    /// At most one hour (`INTERVAL_MAX`).
    ///
    /// A write past it fails with `StorageErrorKind::Timeout`, and its outcome is unknown, as
    /// when a connection drops: a final reply is looked up and retried, a caller's send fails
    /// (send again with the same primary key).
    ///
    /// Default 10 s. Environment: `STORAGE_WRITE_TIMEOUT` (not read by the reference).
    pub storage_write_timeout: Duration,
    /// Encode and decode volatile messages to local entities as if they went to another runner,
    /// so that serialization bugs show up on one machine. The Rust runtime always does (its
    /// requests are type-erased to JSON at the client), so `false` has no effect there; it is
    /// kept for configurations shared with the reference.
    ///
    /// Default `true`. Environment: `SIMULATE_REMOTE_SERIALIZATION`.
    pub simulate_remote_serialization: bool,
    /// How long a processed request and its replies are kept once it was answered; `None`
    /// keeps them forever, as the reference does.
    /// A cluster singleton deletes older ones in small batches (cluster-sharding's retention).
    /// Workflow executions are not touched: see [`workflow_retention`](Self::workflow_retention).
    /// A request deleted this way no longer deduplicates its primary key: the same key sent
    /// again runs again.
    /// From 10 seconds (`RETENTION_MIN`) to 3,650 days (`RETENTION_MAX`).
    ///
    /// Default `None`. Environment: `MESSAGE_RETENTION` (`Infinity` gives `None`; not read by
    /// the reference).
    pub message_retention: Option<Duration>,
    /// How long a completed workflow execution (with its activities, deferreds and clocks) is
    /// kept once it completed; `None` keeps it forever, as the reference does.
    /// The workflow engine on the cluster deletes older ones in small batches.
    /// A deleted execution's id no longer deduplicates: the same execution id runs again.
    /// From 10 seconds (`RETENTION_MIN`) to 3,650 days (`RETENTION_MAX`).
    ///
    /// Default `None`. Environment: `WORKFLOW_RETENTION` (`Infinity` gives `None`; not read by
    /// the reference).
    pub workflow_retention: Option<Duration>,
}

/// How the runner-health singleton judges the other runners
/// ([`runner_health_check`](ShardingConfig::runner_health_check)).
///
/// A runner whose registry heartbeat is older than `shard_lock_expiration` is gone in every
/// mode: the registry no longer lists it. The modes differ for the runners it lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RunnerHealthCheck {
    /// Ping the runners that answered a ping through this runner's transport once; a listed
    /// runner that never answered (a runner of the reference, whose transport is not this one)
    /// is healthy as long as its heartbeat is live. Unknown runners are pinged once per round
    /// to learn whether they speak the transport. `ping-known` in the environment.
    #[default]
    PingKnown,
    /// Ping every listed runner and mark those that do not answer unhealthy, as the
    /// reference's `RunnerHealth.layerPing` does. In a cluster with runners of the reference
    /// those lose their shards. `ping` in the environment.
    Ping,
    /// Ping nobody: every listed runner is healthy, so only an expired heartbeat takes a
    /// runner's shards away. `heartbeat` in the environment.
    Heartbeat,
}

impl RunnerHealthCheck {
    /// The mode's name in the environment.
    pub const fn as_str(self) -> &'static str {
        match self {
            RunnerHealthCheck::PingKnown => "ping-known",
            RunnerHealthCheck::Ping => "ping",
            RunnerHealthCheck::Heartbeat => "heartbeat",
        }
    }

    /// The mode named `input` (`ping-known`, `ping` or `heartbeat`).
    pub fn parse(input: &str) -> Result<RunnerHealthCheck, ParseError> {
        [RunnerHealthCheck::PingKnown, RunnerHealthCheck::Ping, RunnerHealthCheck::Heartbeat]
            .into_iter()
            .find(|mode| mode.as_str() == input)
            .ok_or_else(|| {
                ParseError::new(
                    "runner health check",
                    input,
                    "expected `ping-known`, `ping` or `heartbeat`",
                )
            })
    }
}

impl fmt::Display for RunnerHealthCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A limit that can be switched off: the reference's `number | "unbounded"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Capacity {
    /// At most this many.
    Bounded(NonZeroU32),
    /// No limit (programmatic only; the environment accepts integers).
    Unbounded,
}

/// The shard groups of a configuration, normalised (the reference's `shardGroupConfig`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardGroups {
    /// The available groups, sorted and without duplicates.
    pub available: BTreeSet<ShardGroup>,
    /// The assigned groups that are available.
    pub assigned: BTreeSet<ShardGroup>,
}

/// Parses a duration in the reference's string syntax: `<number> <unit>`.
///
/// - The number is `digits` or `digits.digits`, optionally preceded by `-`.
/// - One or more whitespace characters separate it from the unit.
/// - The unit is one of `nano`, `micro`, `milli`, `second`, `minute`, `hour`, `day`, `week`,
///   optionally with a final `s`.
/// - Nothing else is accepted: no leading or trailing space, no `ms` or `s` shorthand, no
///   exponent.
///
/// Fractions are exact and rounded to the nearest nanosecond, ties away from zero, as in the
/// reference (`1.5 nanos` is 2 ns). Negative durations are an error (`-0 seconds` is zero), as
/// are durations beyond [`Duration::MAX`]. `Infinity` is valid syntax but not a [`Duration`], so
/// it is an error here; [`ShardingConfig::from_env`] accepts it for `ENTITY_MAX_IDLE_TIME`.
///
/// ```
/// use std::time::Duration;
/// use cluster_core::config::parse_duration;
///
/// assert_eq!(parse_duration("1.5 seconds"), Ok(Duration::from_millis(1500)));
/// assert_eq!(parse_duration("200 millis"), Ok(Duration::from_millis(200)));
/// assert!(parse_duration("10s").is_err());
/// ```
pub fn parse_duration(input: &str) -> Result<Duration, ParseError> {
    match parse_duration_input(input)? {
        DurationInput::Finite(duration) => Ok(duration),
        DurationInput::Infinite => {
            Err(ParseError::new(DURATION, input, "`Infinity` is not a finite duration"))
        }
    }
}

/// Formats `duration` in the syntax [`parse_duration`] reads, in the largest unit that keeps it
/// exact (`35 seconds`, `200 millis`, `1 minute`, `1500 millis`).
pub fn format_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    if nanos == 0 {
        return "0 seconds".to_owned();
    }
    let (unit, _, scale) =
        UNITS.iter().rev().find(|(_, _, scale)| nanos.is_multiple_of(*scale)).unwrap_or(&UNITS[0]);
    let count = nanos / scale;
    let plural = if count == 1 { "" } else { "s" };
    format!("{count} {unit}{plural}")
}

impl Default for ShardingConfig {
    /// The reference's defaults.
    fn default() -> ShardingConfig {
        ShardingConfig {
            runner_address: Some(RunnerAddress::new(DEFAULT_HOST, DEFAULT_PORT)),
            runner_listen_address: None,
            runner_shard_weight: RunnerWeight::ONE,
            available_shard_groups: vec![ShardGroup::default_group()],
            assigned_shard_groups: vec![ShardGroup::default_group()],
            shards_per_group: 300,
            shard_lock_refresh_interval: Duration::from_secs(10),
            shard_lock_expiration: Duration::from_secs(35),
            shard_lock_disable_advisory: false,
            preemptive_shutdown: true,
            entity_mailbox_capacity: Capacity::Bounded(DEFAULT_ENTITY_MAILBOX_CAPACITY),
            entity_mailbox_metrics: false,
            max_resident_entities: Capacity::Bounded(DEFAULT_MAX_RESIDENT_ENTITIES),
            unprocessed_message_batch_size: DEFAULT_UNPROCESSED_MESSAGE_BATCH_SIZE,
            entity_max_idle_time: Some(Duration::from_secs(60)),
            entity_registration_timeout: Duration::from_secs(60),
            entity_termination_timeout: Duration::from_secs(15),
            entity_message_poll_interval: Duration::from_secs(10),
            entity_reply_poll_interval: Duration::from_millis(200),
            refresh_assignments_interval: Duration::from_secs(3),
            runner_join_debounce: Duration::ZERO,
            send_retry_interval: Duration::from_millis(100),
            runner_health_check_interval: Duration::from_secs(60),
            runner_probe_interval: Duration::from_secs(1),
            storage_read_timeout: Duration::from_secs(10),
            storage_write_timeout: Duration::from_secs(10),
            runner_health_check: RunnerHealthCheck::PingKnown,
            simulate_remote_serialization: true,
            message_retention: None,
            workflow_retention: None,
        }
    }
}

impl ShardingConfig {
    /// Loads the configuration from the process environment (see the [module docs](self) for the
    /// variables), then [validates](ShardingConfig::validate) it.
    ///
    /// A variable that is not valid UTF-8 is an error.
    pub fn from_env() -> Result<ShardingConfig, ConfigError> {
        for var in ENV_VARS {
            if let Some(value) = std::env::var_os(var)
                && value.to_str().is_none()
            {
                return Err(ConfigError::new(var, value.to_string_lossy(), "is not valid UTF-8"));
            }
        }
        ShardingConfig::from_env_with(|var| std::env::var(var).ok())
    }

    /// Loads the configuration from `lookup`, which maps an environment variable name to its
    /// value, then [validates](ShardingConfig::validate) it.
    ///
    /// Unset and empty variables keep their defaults. Every error names the variable, its value
    /// and the reason.
    ///
    /// ```
    /// use std::time::Duration;
    /// use cluster_core::config::ShardingConfig;
    ///
    /// let config = ShardingConfig::from_env_with(|var| match var {
    ///     "SHARDS_PER_GROUP" => Some("64".to_owned()),
    ///     "SHARD_LOCK_EXPIRATION" => Some("30 seconds".to_owned()),
    ///     _ => None,
    /// })
    /// .unwrap();
    /// assert_eq!(config.shards_per_group, 64);
    /// assert_eq!(config.shard_lock_expiration, Duration::from_secs(30));
    ///
    /// let error = ShardingConfig::from_env_with(|var| {
    ///     (var == "SHARDS_PER_GROUP").then(|| "abc".to_owned())
    /// })
    /// .unwrap_err();
    /// assert_eq!((error.key(), error.value()), ("SHARDS_PER_GROUP", "abc"));
    /// ```
    pub fn from_env_with(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<ShardingConfig, ConfigError> {
        let env = Env { lookup };
        let mut config = ShardingConfig::default();
        env.read_runner(&mut config)?;
        env.read_groups(&mut config)?;
        env.read_limits(&mut config)?;
        env.read_durations(&mut config)?;
        env.read_flags(&mut config)?;
        env.read_modes(&mut config)?;
        config.check().map_err(|violation| violation.into_env_error(&env))?;
        Ok(config)
    }

    /// Checks every option against the rules in its documentation and the `*_MAX` bounds of this
    /// module. The error names the first offending field (`shards_per_group`, ...).
    ///
    /// The reference checks nothing. In particular it drops assigned groups that are not
    /// available and duplicate available groups silently; both are errors here, because a
    /// misspelt group would otherwise leave its entities without a runner.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check().map_err(Violation::into_field_error)
    }

    /// How often shard locks are refreshed: `min(shard_lock_refresh_interval,
    /// shard_lock_expiration / 3)` (10 s by default).
    pub fn shard_lock_interval(&self) -> Duration {
        self.shard_lock_refresh_interval.min(self.shard_lock_expiration / 3)
    }

    /// The available groups (sorted, deduplicated) and the assigned groups among them.
    pub fn shard_groups(&self) -> ShardGroups {
        let available: BTreeSet<ShardGroup> = self.available_shard_groups.iter().cloned().collect();
        let assigned = self
            .assigned_shard_groups
            .iter()
            .filter(|group| available.contains(*group))
            .cloned()
            .collect();
        ShardGroups { available, assigned }
    }

    /// The position of `group` among the sorted available groups, or `None` if it is not
    /// available. Advisory lock numbers are `(index + 1) × 1_000_000 + shard`.
    pub fn group_index(&self, group: &ShardGroup) -> Option<u32> {
        let available: BTreeSet<&ShardGroup> = self.available_shard_groups.iter().collect();
        let index = available.iter().position(|candidate| *candidate == group)?;
        u32::try_from(index).ok()
    }

    /// The shard of `entity_id` in `group`, with this configuration's `shards_per_group`.
    pub fn shard_id(&self, entity_id: &str, group: &ShardGroup) -> ShardId {
        hash::shard_id(entity_id, group, self.shards_per_group)
    }

    /// The most unprocessed messages one storage read claims (at least 1).
    pub fn batch_size(&self) -> u32 {
        self.unprocessed_message_batch_size.get()
    }
}

impl ShardingConfig {
    fn check(&self) -> Result<(), Violation> {
        self.check_runner()?;
        self.check_groups()?;
        self.check_limits()?;
        self.check_durations()?;
        self.check_flags()
    }

    fn check_flags(&self) -> Result<(), Violation> {
        if !self.preemptive_shutdown {
            return Err(Violation::new(
                "preemptive_shutdown",
                var::PREEMPTIVE_SHUTDOWN,
                "false".to_owned(),
                "is not supported: a runner always hands its shards over as soon as shutdown \
                 begins, before stopping entities; remove the setting or set it to true"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    fn check_runner(&self) -> Result<(), Violation> {
        if let Some(address) = &self.runner_address {
            let value = address.to_string();
            let violation = |env_var, reason: String| {
                Err(Violation::new("runner_address", env_var, value.clone(), reason))
            };
            if address.host().is_empty() {
                return violation(var::HOST, "the host is empty".to_owned());
            }
            if address.port() == 0 {
                return violation(var::PORT, "other runners cannot reach port 0".to_owned());
            }
            let len = value.chars().count();
            if len > RUNNER_ADDRESS_LEN_MAX {
                return violation(
                    var::HOST,
                    format!(
                        "`host:port` has {len} characters; the runner registry stores at most \
                         {RUNNER_ADDRESS_LEN_MAX}"
                    ),
                );
            }
        }
        if let Some(address) = &self.runner_listen_address
            && address.host().is_empty()
        {
            return Err(Violation::new(
                "runner_listen_address",
                var::LISTEN_HOST,
                address.to_string(),
                "the host is empty".to_owned(),
            ));
        }
        let weight = self.runner_shard_weight.get();
        if !(weight.is_finite() && weight > 0.0 && weight <= RUNNER_SHARD_WEIGHT_MAX) {
            return Err(Violation::new(
                "runner_shard_weight",
                var::RUNNER_SHARD_WEIGHT,
                weight.to_string(),
                format!("must be greater than 0 and at most {RUNNER_SHARD_WEIGHT_MAX}"),
            ));
        }
        Ok(())
    }

    fn check_groups(&self) -> Result<(), Violation> {
        let shards = self.shards_per_group;
        if !(1..=SHARDS_PER_GROUP_MAX).contains(&shards) {
            return Err(Violation::new(
                "shards_per_group",
                var::SHARDS_PER_GROUP,
                shards.to_string(),
                shards_per_group_reason(),
            ));
        }
        let available = &self.available_shard_groups;
        let violation = |reason: String| {
            Err(Violation::new(
                "available_shard_groups",
                var::AVAILABLE_SHARD_GROUPS,
                join_groups(available),
                reason,
            ))
        };
        if available.is_empty() {
            return violation("at least one shard group is required".to_owned());
        }
        if !u32::try_from(available.len()).is_ok_and(|n_groups| n_groups <= SHARD_GROUPS_MAX) {
            return violation(format!(
                "{} shard groups; advisory lock numbers fit an i32 for at most {SHARD_GROUPS_MAX}",
                available.len()
            ));
        }
        for group in available {
            if let Some(reason) = group_name_problem(group, shards) {
                return violation(reason);
            }
        }
        let mut sorted: Vec<&ShardGroup> = available.iter().collect();
        sorted.sort();
        for pair in sorted.windows(2) {
            if let [first, second] = pair
                && first == second
            {
                return violation(format!("shard group `{first}` is listed twice"));
            }
        }
        for group in &self.assigned_shard_groups {
            if !available.contains(group) {
                return Err(Violation::new(
                    "assigned_shard_groups",
                    var::SHARD_GROUPS,
                    join_groups(&self.assigned_shard_groups),
                    format!(
                        "shard group `{group}` is not one of the available shard groups ({}); \
                         every assigned group must be available",
                        join_groups(available)
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_limits(&self) -> Result<(), Violation> {
        let capacities = [
            (
                "entity_mailbox_capacity",
                var::ENTITY_MAILBOX_CAPACITY,
                self.entity_mailbox_capacity,
                ENTITY_MAILBOX_CAPACITY_MAX,
            ),
            (
                "max_resident_entities",
                var::MAX_RESIDENT_ENTITIES,
                self.max_resident_entities,
                RESIDENT_ENTITIES_MAX,
            ),
        ];
        for (field, env_var, capacity, max) in capacities {
            if let Capacity::Bounded(limit) = capacity
                && limit.get() > max
            {
                return Err(Violation::new(
                    field,
                    env_var,
                    limit.to_string(),
                    format!("must be at most {max}; use Capacity::Unbounded for no limit"),
                ));
            }
        }
        let batch_size = self.batch_size();
        if batch_size > UNPROCESSED_MESSAGE_BATCH_SIZE_MAX {
            return Err(Violation::new(
                "unprocessed_message_batch_size",
                var::UNPROCESSED_MESSAGE_BATCH_SIZE,
                batch_size.to_string(),
                format!("must be at most {UNPROCESSED_MESSAGE_BATCH_SIZE_MAX}"),
            ));
        }
        Ok(())
    }

    fn check_durations(&self) -> Result<(), Violation> {
        let positive = Duration::from_nanos(1);
        // Greater than 0, at most `INTERVAL_MAX`.
        let intervals = [
            (
                "shard_lock_refresh_interval",
                var::SHARD_LOCK_REFRESH_INTERVAL,
                self.shard_lock_refresh_interval,
            ),
            (
                "entity_message_poll_interval",
                var::ENTITY_MESSAGE_POLL_INTERVAL,
                self.entity_message_poll_interval,
            ),
            (
                "entity_reply_poll_interval",
                var::ENTITY_REPLY_POLL_INTERVAL,
                self.entity_reply_poll_interval,
            ),
            (
                "refresh_assignments_interval",
                var::REFRESH_ASSIGNMENTS_INTERVAL,
                self.refresh_assignments_interval,
            ),
            ("send_retry_interval", var::SEND_RETRY_INTERVAL, self.send_retry_interval),
            (
                "runner_health_check_interval",
                var::RUNNER_HEALTH_CHECK_INTERVAL,
                self.runner_health_check_interval,
            ),
            ("runner_probe_interval", var::RUNNER_PROBE_INTERVAL, self.runner_probe_interval),
            ("storage_read_timeout", var::STORAGE_READ_TIMEOUT, self.storage_read_timeout),
            ("storage_write_timeout", var::STORAGE_WRITE_TIMEOUT, self.storage_write_timeout),
        ]
        .map(|(field, env_var, value)| {
            DurationBound::new(field, env_var, value).at_least(positive)
        });
        let others = [
            DurationBound::new(
                "shard_lock_expiration",
                var::SHARD_LOCK_EXPIRATION,
                self.shard_lock_expiration,
            )
            .at_least(SHARD_LOCK_EXPIRATION_MIN),
            DurationBound::new(
                "entity_registration_timeout",
                var::ENTITY_REGISTRATION_TIMEOUT,
                self.entity_registration_timeout,
            ),
            DurationBound::new(
                "entity_termination_timeout",
                var::ENTITY_TERMINATION_TIMEOUT,
                self.entity_termination_timeout,
            ),
            DurationBound::new(
                "runner_join_debounce",
                var::RUNNER_JOIN_DEBOUNCE,
                self.runner_join_debounce,
            ),
        ];
        let bounds = intervals.into_iter().chain(others);
        for bound in bounds {
            bound.check()?;
        }
        if let Some(idle_time) = self.entity_max_idle_time {
            DurationBound::new("entity_max_idle_time", var::ENTITY_MAX_IDLE_TIME, idle_time)
                .at_most(
                    ENTITY_MAX_IDLE_TIME_MAX,
                    "use None (`Infinity`) to never stop idle entities",
                )
                .check()?;
        }
        let retentions = [
            ("message_retention", var::MESSAGE_RETENTION, self.message_retention),
            ("workflow_retention", var::WORKFLOW_RETENTION, self.workflow_retention),
        ];
        for (field, env_var, retention) in retentions {
            if let Some(retention) = retention {
                DurationBound::new(field, env_var, retention)
                    .at_least(RETENTION_MIN)
                    .at_most(RETENTION_MAX, "use None (`Infinity`) to keep everything")
                    .check()?;
            }
        }
        Ok(())
    }
}

impl Capacity {
    /// At most `limit`, or `None` if `limit` is 0.
    pub const fn bounded(limit: u32) -> Option<Capacity> {
        match NonZeroU32::new(limit) {
            Some(limit) => Some(Capacity::Bounded(limit)),
            None => None,
        }
    }

    /// The limit, or `None` if unbounded.
    pub const fn limit(self) -> Option<NonZeroU32> {
        match self {
            Capacity::Bounded(limit) => Some(limit),
            Capacity::Unbounded => None,
        }
    }

    /// Whether `len` items already reach the limit, so that no more may be added.
    pub fn is_full(self, len: usize) -> bool {
        match self {
            Capacity::Bounded(limit) => {
                usize::try_from(limit.get()).is_ok_and(|limit| len >= limit)
            }
            Capacity::Unbounded => false,
        }
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Capacity::Bounded(limit) => fmt::Display::fmt(limit, f),
            Capacity::Unbounded => f.write_str("unbounded"),
        }
    }
}

/// The environment variable names.
mod var {
    pub(super) const HOST: &str = "HOST";
    pub(super) const PORT: &str = "PORT";
    pub(super) const LISTEN_HOST: &str = "LISTEN_HOST";
    pub(super) const LISTEN_PORT: &str = "LISTEN_PORT";
    pub(super) const RUNNER_SHARD_WEIGHT: &str = "RUNNER_SHARD_WEIGHT";
    pub(super) const AVAILABLE_SHARD_GROUPS: &str = "AVAILABLE_SHARD_GROUPS";
    pub(super) const SHARD_GROUPS: &str = "SHARD_GROUPS";
    pub(super) const SHARDS_PER_GROUP: &str = "SHARDS_PER_GROUP";
    pub(super) const SHARD_LOCK_REFRESH_INTERVAL: &str = "SHARD_LOCK_REFRESH_INTERVAL";
    pub(super) const SHARD_LOCK_EXPIRATION: &str = "SHARD_LOCK_EXPIRATION";
    pub(super) const SHARD_LOCK_DISABLE_ADVISORY: &str = "SHARD_LOCK_DISABLE_ADVISORY";
    pub(super) const PREEMPTIVE_SHUTDOWN: &str = "PREEMPTIVE_SHUTDOWN";
    pub(super) const ENTITY_MAILBOX_CAPACITY: &str = "ENTITY_MAILBOX_CAPACITY";
    pub(super) const ENTITY_MAILBOX_METRICS: &str = "ENTITY_MAILBOX_METRICS";
    pub(super) const MAX_RESIDENT_ENTITIES: &str = "MAX_RESIDENT_ENTITIES";
    pub(super) const UNPROCESSED_MESSAGE_BATCH_SIZE: &str = "UNPROCESSED_MESSAGE_BATCH_SIZE";
    pub(super) const ENTITY_MAX_IDLE_TIME: &str = "ENTITY_MAX_IDLE_TIME";
    pub(super) const ENTITY_REGISTRATION_TIMEOUT: &str = "ENTITY_REGISTRATION_TIMEOUT";
    pub(super) const ENTITY_TERMINATION_TIMEOUT: &str = "ENTITY_TERMINATION_TIMEOUT";
    pub(super) const ENTITY_MESSAGE_POLL_INTERVAL: &str = "ENTITY_MESSAGE_POLL_INTERVAL";
    pub(super) const ENTITY_REPLY_POLL_INTERVAL: &str = "ENTITY_REPLY_POLL_INTERVAL";
    pub(super) const REFRESH_ASSIGNMENTS_INTERVAL: &str = "REFRESH_ASSIGNMENTS_INTERVAL";
    pub(super) const RUNNER_JOIN_DEBOUNCE: &str = "RUNNER_JOIN_DEBOUNCE";
    pub(super) const SEND_RETRY_INTERVAL: &str = "SEND_RETRY_INTERVAL";
    pub(super) const RUNNER_HEALTH_CHECK_INTERVAL: &str = "RUNNER_HEALTH_CHECK_INTERVAL";
    pub(super) const RUNNER_PROBE_INTERVAL: &str = "RUNNER_PROBE_INTERVAL";
    pub(super) const STORAGE_READ_TIMEOUT: &str = "STORAGE_READ_TIMEOUT";
    pub(super) const STORAGE_WRITE_TIMEOUT: &str = "STORAGE_WRITE_TIMEOUT";
    pub(super) const RUNNER_HEALTH_CHECK: &str = "RUNNER_HEALTH_CHECK";
    pub(super) const SIMULATE_REMOTE_SERIALIZATION: &str = "SIMULATE_REMOTE_SERIALIZATION";
    pub(super) const MESSAGE_RETENTION: &str = "MESSAGE_RETENTION";
    pub(super) const WORKFLOW_RETENTION: &str = "WORKFLOW_RETENTION";
}

// The reference's defaults that are not zero by construction (checked at compile time).
const DEFAULT_ENTITY_MAILBOX_CAPACITY: NonZeroU32 = NonZeroU32::new(4096).expect("not zero");
const DEFAULT_MAX_RESIDENT_ENTITIES: NonZeroU32 = NonZeroU32::new(10_000).expect("not zero");
const DEFAULT_UNPROCESSED_MESSAGE_BATCH_SIZE: NonZeroU32 = NonZeroU32::new(1024).expect("not zero");

/// What `ParseError::what` says for durations.
const DURATION: &str = "duration";

/// Duration units: singular name, plural name, nanoseconds. Ascending.
const UNITS: [(&str, &str, u128); 8] = [
    ("nano", "nanos", 1),
    ("micro", "micros", 1_000),
    ("milli", "millis", 1_000_000),
    ("second", "seconds", 1_000_000_000),
    ("minute", "minutes", 60 * 1_000_000_000),
    ("hour", "hours", 60 * 60 * 1_000_000_000),
    ("day", "days", 24 * 60 * 60 * 1_000_000_000),
    ("week", "weeks", 7 * 24 * 60 * 60 * 1_000_000_000),
];

/// A parsed duration string: finite, or `Infinity`.
enum DurationInput {
    Finite(Duration),
    Infinite,
}

fn parse_duration_input(input: &str) -> Result<DurationInput, ParseError> {
    let error = |reason| Err(ParseError::new(DURATION, input, reason));
    match input {
        "Infinity" => return Ok(DurationInput::Infinite),
        "-Infinity" => return error("negative durations are not accepted"),
        _ => {}
    }
    let Some(space) = input.find(is_js_whitespace) else {
        return error("expected `<number> <unit>`, for example `10 seconds`");
    };
    let (number, rest) = input.split_at(space);
    let unit = rest.trim_start_matches(is_js_whitespace);
    let Some(&(_, _, scale)) =
        UNITS.iter().find(|(singular, plural, _)| unit == *singular || unit == *plural)
    else {
        return error(
            "the unit must be one of nanos, micros, millis, seconds, minutes, hours, days, weeks",
        );
    };
    let (negative, magnitude) = match number.strip_prefix('-') {
        Some(magnitude) => (true, magnitude),
        None => (false, number),
    };
    let (whole, fraction) = magnitude.split_once('.').unwrap_or((magnitude, ""));
    let is_digits = |digits: &str| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    if !is_digits(whole) || (magnitude.contains('.') && !is_digits(fraction)) {
        return error("the number must be digits, optionally with a fraction (`1.5`)");
    }
    let Some(nanos) = whole_nanos(whole, scale)
        .and_then(|nanos| nanos.checked_add(fraction_nanos(fraction, scale)))
    else {
        return error("the duration is too large");
    };
    if negative && nanos > 0 {
        return error("negative durations are not accepted");
    }
    let (Ok(secs), Ok(subsec_nanos)) =
        (u64::try_from(nanos / 1_000_000_000), u32::try_from(nanos % 1_000_000_000))
    else {
        return error("the duration is too large");
    };
    Ok(DurationInput::Finite(Duration::new(secs, subsec_nanos)))
}

/// The reference's `\s`: Unicode white space and U+FEFF, but not U+0085.
fn is_js_whitespace(c: char) -> bool {
    c != '\u{85}' && (c.is_whitespace() || c == '\u{feff}')
}

/// `whole × scale` for a string of ASCII digits, or `None` on overflow.
fn whole_nanos(whole: &str, scale: u128) -> Option<u128> {
    let mut value: u128 = 0;
    for digit in whole.bytes() {
        let digit = char::from(digit).to_digit(10)?;
        value = value.checked_mul(10)?.checked_add(u128::from(digit))?;
    }
    value.checked_mul(scale)
}

/// `0.fraction × scale` rounded to the nearest integer, ties up, exactly and without overflow.
///
/// Horner's rule from the last digit: with `y_j = (d_j × scale + y_{j+1}) / 10`, the integer part
/// of each `y_j` only depends on the integer part of `y_{j+1}`, and `y_1` is at least one half
/// past its integer part exactly when the last remainder is at least 5. Every `y_j` is below
/// `scale`, so nothing overflows however long the fraction is.
fn fraction_nanos(fraction: &str, scale: u128) -> u128 {
    let mut whole: u128 = 0;
    let mut remainder: u128 = 0;
    for digit in fraction.bytes().rev() {
        let digit = char::from(digit).to_digit(10).unwrap_or(0);
        let sum = u128::from(digit) * scale + whole;
        whole = sum / 10;
        remainder = sum % 10;
    }
    whole + u128::from(remainder >= 5)
}

fn parse_bool(input: &str) -> Option<bool> {
    match input {
        "true" | "yes" | "on" | "1" | "y" => Some(true),
        "false" | "no" | "off" | "0" | "n" => Some(false),
        _ => None,
    }
}

fn join_groups(groups: &[ShardGroup]) -> String {
    groups.iter().map(ShardGroup::as_str).collect::<Vec<_>>().join(",")
}

fn shards_per_group_reason() -> String {
    format!(
        "must be from 1 to {SHARDS_PER_GROUP_MAX}: advisory lock numbers are \
         (group index + 1) × 1000000 + shard"
    )
}

/// Why `group` cannot be a shard group name with `shards` shards per group, if it cannot.
fn group_name_problem(group: &ShardGroup, shards: u32) -> Option<String> {
    let name = group.as_str();
    if name.is_empty() {
        return Some("a shard group name is empty".to_owned());
    }
    if name.starts_with(char::is_whitespace) || name.ends_with(char::is_whitespace) {
        return Some(format!(
            "shard group `{name}` starts or ends with white space; lists are not trimmed"
        ));
    }
    let shard_digits = usize::try_from(shards.checked_ilog10().unwrap_or(0) + 1).unwrap_or(0);
    let name_len_max = SHARD_ID_LEN_MAX.saturating_sub(1 + shard_digits);
    if name.chars().count() > name_len_max {
        return Some(format!(
            "shard group `{name}` is too long: shard ids `group:shard` are stored in \
             {SHARD_ID_LEN_MAX} characters, which leaves {name_len_max} for the group name \
             with {shards} shards per group"
        ));
    }
    None
}

/// A broken rule, named both by field (programmatic) and by environment variable.
struct Violation {
    field: &'static str,
    env_var: &'static str,
    value: String,
    reason: String,
}

impl Violation {
    fn new(field: &'static str, env_var: &'static str, value: String, reason: String) -> Violation {
        Violation { field, env_var, value, reason }
    }

    fn into_field_error(self) -> ConfigError {
        ConfigError::new(self.field, self.value, self.reason)
    }

    /// The error naming the variable, with its raw value if it is set (otherwise the value came
    /// from the default, and the formatted value is reported).
    fn into_env_error<F: Fn(&str) -> Option<String>>(self, env: &Env<F>) -> ConfigError {
        let value = env.get(self.env_var).unwrap_or(self.value);
        ConfigError::new(self.env_var, value, self.reason)
    }
}

/// The allowed range of one duration field.
struct DurationBound {
    field: &'static str,
    env_var: &'static str,
    value: Duration,
    min: Duration,
    max: Duration,
    max_hint: &'static str,
}

impl DurationBound {
    fn new(field: &'static str, env_var: &'static str, value: Duration) -> DurationBound {
        DurationBound {
            field,
            env_var,
            value,
            min: Duration::ZERO,
            max: INTERVAL_MAX,
            max_hint: "a longer one is surely a mistake",
        }
    }

    fn at_least(self, min: Duration) -> DurationBound {
        DurationBound { min, ..self }
    }

    fn at_most(self, max: Duration, max_hint: &'static str) -> DurationBound {
        DurationBound { max, max_hint, ..self }
    }

    fn check(&self) -> Result<(), Violation> {
        let reason = if self.value < self.min {
            if self.min == Duration::from_nanos(1) {
                "must be greater than zero".to_owned()
            } else {
                format!("must be at least {}", format_duration(self.min))
            }
        } else if self.value > self.max {
            format!("must be at most {}; {}", format_duration(self.max), self.max_hint)
        } else {
            return Ok(());
        };
        Err(Violation::new(self.field, self.env_var, format_duration(self.value), reason))
    }
}

/// The environment, seen through a lookup function.
struct Env<F> {
    lookup: F,
}

impl<F: Fn(&str) -> Option<String>> Env<F> {
    /// The value of `var`; the empty string counts as unset, as in the reference.
    fn get(&self, var: &str) -> Option<String> {
        (self.lookup)(var).filter(|value| !value.is_empty())
    }

    /// `var` as an integer in `min..=max`.
    fn integer<T>(&self, var: &'static str, min: T, max: T) -> Result<Option<T>, ConfigError>
    where
        T: Copy + fmt::Display + Into<i64> + TryFrom<i64>,
    {
        let Some(raw) = self.get(var) else { return Ok(None) };
        let range = || format!("must be an integer from {min} to {max}");
        let value: i64 = raw.parse().map_err(|error: ParseIntError| {
            let reason = match error.kind() {
                IntErrorKind::PosOverflow | IntErrorKind::NegOverflow => range(),
                _ if raw == "unbounded" => {
                    format!("{}; `unbounded` can only be set programmatically", range())
                }
                _ => format!("is not a decimal integer; {}", range()),
            };
            ConfigError::new(var, &raw, reason)
        })?;
        if value < min.into() || value > max.into() {
            return Err(ConfigError::new(var, raw, range()));
        }
        T::try_from(value).map(Some).map_err(|_| ConfigError::new(var, raw, range()))
    }

    fn capacity(&self, var: &'static str, max: u32) -> Result<Option<Capacity>, ConfigError> {
        Ok(self.integer(var, 1, max)?.and_then(Capacity::bounded))
    }

    fn boolean(&self, var: &'static str) -> Result<Option<bool>, ConfigError> {
        let Some(raw) = self.get(var) else { return Ok(None) };
        parse_bool(&raw).map(Some).ok_or_else(|| {
            ConfigError::new(
                var,
                raw,
                "is not a boolean: expected true, yes, on, 1, y, false, no, off, 0 or n",
            )
        })
    }

    fn duration_input(&self, var: &'static str) -> Result<Option<DurationInput>, ConfigError> {
        let Some(raw) = self.get(var) else { return Ok(None) };
        parse_duration_input(&raw)
            .map(Some)
            .map_err(|error| ConfigError::new(var, &raw, error.reason()))
    }

    fn duration(&self, var: &'static str) -> Result<Option<Duration>, ConfigError> {
        match self.duration_input(var)? {
            None => Ok(None),
            Some(DurationInput::Finite(duration)) => Ok(Some(duration)),
            Some(DurationInput::Infinite) => Err(ConfigError::new(
                var,
                "Infinity",
                format!(
                    "only {}, {} and {} accept `Infinity`; give a finite duration such as \
                     `10 seconds`",
                    var::ENTITY_MAX_IDLE_TIME,
                    var::MESSAGE_RETENTION,
                    var::WORKFLOW_RETENTION
                ),
            )),
        }
    }

    fn groups(&self, var: &'static str) -> Option<Vec<ShardGroup>> {
        self.get(var).map(|raw| raw.split(',').map(ShardGroup::from).collect())
    }

    fn read_runner(&self, config: &mut ShardingConfig) -> Result<(), ConfigError> {
        let host = self.get(var::HOST).unwrap_or_else(|| DEFAULT_HOST.to_owned());
        let advertised_port = self.integer(var::PORT, 1, u16::MAX)?.unwrap_or(DEFAULT_PORT);
        config.runner_address = Some(RunnerAddress::new(host, advertised_port));
        let listen_port = self.integer(var::LISTEN_PORT, 0, u16::MAX)?;
        config.runner_listen_address = match (self.get(var::LISTEN_HOST), listen_port) {
            (None, None) => None,
            // The advertised port, not the reference's fixed 34431: a runner listens where
            // its peers connect.
            (Some(host), port) => Some(RunnerAddress::new(host, port.unwrap_or(advertised_port))),
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    var::LISTEN_PORT,
                    self.get(var::LISTEN_PORT).unwrap_or_default(),
                    format!("is set without {}; set both or neither", var::LISTEN_HOST),
                ));
            }
        };
        // An integer, as in the reference; 1000 is `RUNNER_SHARD_WEIGHT_MAX`.
        if let Some(weight) = self.integer(var::RUNNER_SHARD_WEIGHT, 1, 1000_u16)? {
            config.runner_shard_weight =
                RunnerWeight::new(f64::from(weight)).unwrap_or(RunnerWeight::ONE);
        }
        Ok(())
    }

    fn read_groups(&self, config: &mut ShardingConfig) -> Result<(), ConfigError> {
        if let Some(groups) = self.groups(var::AVAILABLE_SHARD_GROUPS) {
            config.available_shard_groups = groups;
        }
        if let Some(groups) = self.groups(var::SHARD_GROUPS) {
            config.assigned_shard_groups = groups;
        }
        if let Some(shards) = self.integer(var::SHARDS_PER_GROUP, 1, SHARDS_PER_GROUP_MAX)? {
            config.shards_per_group = shards;
        }
        Ok(())
    }

    fn read_limits(&self, config: &mut ShardingConfig) -> Result<(), ConfigError> {
        let mailbox = self.capacity(var::ENTITY_MAILBOX_CAPACITY, ENTITY_MAILBOX_CAPACITY_MAX)?;
        if let Some(capacity) = mailbox {
            config.entity_mailbox_capacity = capacity;
        }
        if let Some(capacity) = self.capacity(var::MAX_RESIDENT_ENTITIES, RESIDENT_ENTITIES_MAX)? {
            config.max_resident_entities = capacity;
        }
        let batch_size = self.integer(
            var::UNPROCESSED_MESSAGE_BATCH_SIZE,
            1,
            UNPROCESSED_MESSAGE_BATCH_SIZE_MAX,
        )?;
        if let Some(batch_size) = batch_size.and_then(NonZeroU32::new) {
            config.unprocessed_message_batch_size = batch_size;
        }
        Ok(())
    }

    fn read_durations(&self, config: &mut ShardingConfig) -> Result<(), ConfigError> {
        let fields = [
            (var::SHARD_LOCK_REFRESH_INTERVAL, &mut config.shard_lock_refresh_interval),
            (var::SHARD_LOCK_EXPIRATION, &mut config.shard_lock_expiration),
            (var::ENTITY_REGISTRATION_TIMEOUT, &mut config.entity_registration_timeout),
            (var::ENTITY_TERMINATION_TIMEOUT, &mut config.entity_termination_timeout),
            (var::ENTITY_MESSAGE_POLL_INTERVAL, &mut config.entity_message_poll_interval),
            (var::ENTITY_REPLY_POLL_INTERVAL, &mut config.entity_reply_poll_interval),
            (var::REFRESH_ASSIGNMENTS_INTERVAL, &mut config.refresh_assignments_interval),
            (var::RUNNER_JOIN_DEBOUNCE, &mut config.runner_join_debounce),
            (var::SEND_RETRY_INTERVAL, &mut config.send_retry_interval),
            (var::RUNNER_HEALTH_CHECK_INTERVAL, &mut config.runner_health_check_interval),
            (var::RUNNER_PROBE_INTERVAL, &mut config.runner_probe_interval),
            (var::STORAGE_READ_TIMEOUT, &mut config.storage_read_timeout),
            (var::STORAGE_WRITE_TIMEOUT, &mut config.storage_write_timeout),
        ];
        for (var, field) in fields {
            if let Some(duration) = self.duration(var)? {
                *field = duration;
            }
        }
        let optional = [
            (var::ENTITY_MAX_IDLE_TIME, &mut config.entity_max_idle_time),
            (var::MESSAGE_RETENTION, &mut config.message_retention),
            (var::WORKFLOW_RETENTION, &mut config.workflow_retention),
        ];
        for (var, field) in optional {
            match self.duration_input(var)? {
                None => {}
                Some(DurationInput::Finite(duration)) => *field = Some(duration),
                Some(DurationInput::Infinite) => *field = None,
            }
        }
        Ok(())
    }

    fn read_flags(&self, config: &mut ShardingConfig) -> Result<(), ConfigError> {
        let fields = [
            (var::SHARD_LOCK_DISABLE_ADVISORY, &mut config.shard_lock_disable_advisory),
            (var::PREEMPTIVE_SHUTDOWN, &mut config.preemptive_shutdown),
            (var::ENTITY_MAILBOX_METRICS, &mut config.entity_mailbox_metrics),
            (var::SIMULATE_REMOTE_SERIALIZATION, &mut config.simulate_remote_serialization),
        ];
        for (var, field) in fields {
            if let Some(value) = self.boolean(var)? {
                *field = value;
            }
        }
        Ok(())
    }

    fn read_modes(&self, config: &mut ShardingConfig) -> Result<(), ConfigError> {
        if let Some(raw) = self.get(var::RUNNER_HEALTH_CHECK) {
            config.runner_health_check = RunnerHealthCheck::parse(&raw).map_err(|error| {
                ConfigError::new(var::RUNNER_HEALTH_CHECK, &raw, error.reason())
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
