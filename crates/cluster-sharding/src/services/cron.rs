//! Cluster-wide cron jobs (the reference's `ClusterCron`, `effect/src/cluster/ClusterCron.ts`): a
//! job runs once per scheduled instant across the whole cluster, even while runners come and go.
//!
//! A job is a persisted entity type `ClusterCron/<name>` (in the job's shard group) with two
//! requests, and a singleton of the same name:
//!
//! - `run` (persisted, uninterruptible on both sides) carries the instant it is for and is
//!   delivered at that instant (`deliver_at`). Handling it runs the job (unless the instant is
//!   older than `skip_if_older_than`) and then, whatever the job did, schedules the next run.
//! - By default each run goes to the entity whose id is the instant (ISO 8601), with an empty
//!   primary key, so the storage's deduplication keeps exactly one run per instant however
//!   many times it is scheduled. The singleton schedules the run after "now" each time it
//!   starts, and every run schedules the run after "now" when it ends.
//! - With `calculate_next_run_from_previous`, every run goes to the entity `executor`, keyed by
//!   its instant, and the next run follows the previous instant (so runs missed while no runner
//!   was up are caught up, within `skip_if_older_than`). The singleton sends `start`, which
//!   schedules the run after "now" only if this executor activation has not handled a run yet.
//!
//! Scheduling is retried with a backoff (200 ms growing by half, at most 1 min) until it is
//! stored. Cron expressions have five fields, or six with seconds first; times are UTC.
//!
//! Departure from the reference: a job that fails is logged and the next run is scheduled as
//! usual; the reference turns the failure into a defect that restarts the entity and replays
//! the run.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::backoff::Backoff;
use cluster_core::future::BoxFuture;
use cluster_core::{EntityType, ShardGroup, Timestamp};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::api::entity::{Entity, EntityContext, Handler, Protocol, RequestContext, RuntimeHandle};
use crate::api::rpc::{CallError, Rpc, Uninterruptible};
use crate::error::RegisterError;

/// The first pause between scheduling attempts, and the longest.
const SCHEDULE_RETRY_FIRST: Duration = Duration::from_millis(200);
const SCHEDULE_RETRY_MAX: Duration = Duration::from_secs(60);
/// The executor entity of `calculate_next_run_from_previous` jobs.
const EXECUTOR: &str = "executor";

/// How a cron job runs.
#[derive(Clone, Debug)]
pub struct CronOptions {
    /// The shard group of the job's entity and singleton (`default` if `None`).
    pub shard_group: Option<ShardGroup>,
    /// Schedule each run from the previous instant instead of from now (catches up missed
    /// runs).
    pub calculate_next_run_from_previous: bool,
    /// Runs scheduled longer ago than this are skipped (1 day by default).
    pub skip_if_older_than: Duration,
}

impl Default for CronOptions {
    fn default() -> CronOptions {
        CronOptions {
            shard_group: None,
            calculate_next_run_from_previous: false,
            skip_if_older_than: Duration::from_secs(24 * 60 * 60),
        }
    }
}

/// Why a cron job was not registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CronError {
    /// The cron expression does not parse.
    #[error("invalid cron expression {expression:?}: {reason}")]
    InvalidExpression {
        /// The expression.
        expression: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The job's entity type or singleton could not be registered.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// The runtime has no message storage: its runs could not be stored.
    #[error("a cron job needs a message storage")]
    NoMessageStorage,
}

/// What a running job gets.
///
/// Its `sharding()` method, the runtime to call entities with, is written where that runtime
/// is (`sharding.rs`): cron jobs sit below the runtime and do not name it.
#[derive(Clone)]
pub struct CronContext {
    scheduled: Timestamp,
    /// The runtime, a `Sharding`, held erased.
    pub(crate) runtime: RuntimeHandle,
}

impl std::fmt::Debug for CronContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CronContext").field("scheduled", &self.scheduled).finish_non_exhaustive()
    }
}

impl CronContext {
    /// The instant this run is for (the reference's `CurrentScheduledTime`).
    pub fn scheduled(&self) -> Timestamp {
        self.scheduled
    }
}

/// A job's body, type-erased; its error is logged.
pub(crate) type Execute =
    Arc<dyn Fn(CronContext) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// What cron jobs need from the runtime they run in.
pub(crate) trait CronHost: Clone + Send + Sync + 'static {
    /// The time now, on the runtime's clock.
    fn now(&self) -> Timestamp;

    /// Whether the runtime is shutting down.
    fn is_shutdown(&self) -> bool;

    /// The runtime, for a job's context.
    fn handle(&self) -> RuntimeHandle;

    /// Sends `request` to the entity `entity_id` of `job`, without waiting for its reply.
    fn discard<R: Rpc>(
        &self,
        job: &Job,
        entity_id: String,
        request: R,
    ) -> impl Future<Output = Result<(), CallError<R::Error>>> + Send
    where
        CronEntity<Self>: Handler<R>;
}

/// A registered job.
pub(crate) struct Job {
    name: String,
    entity_type: EntityType,
    cron: croner::Cron,
    options: CronOptions,
    execute: Execute,
}

impl Job {
    /// The job `name`, run at the instants of `expression` (five fields, or six with seconds
    /// first; UTC). Its entity type is `ClusterCron/<name>`.
    pub(crate) fn new(
        name: String,
        expression: &str,
        options: CronOptions,
        execute: Execute,
    ) -> Result<Job, CronError> {
        let cron =
            croner::Cron::new(expression).with_seconds_optional().parse().map_err(|error| {
                CronError::InvalidExpression {
                    expression: expression.to_owned(),
                    reason: error.to_string(),
                }
            })?;
        let entity_type = EntityType::from(format!("ClusterCron/{name}").as_str());
        Ok(Job { name, entity_type, cron, options, execute })
    }

    /// The job's entity type, `ClusterCron/<name>`; its singleton has the same name.
    pub(crate) fn entity_type(&self) -> &EntityType {
        &self.entity_type
    }

    /// The shard group of the job's entity and singleton.
    pub(crate) fn shard_group(&self) -> ShardGroup {
        self.options.shard_group.clone().unwrap_or_else(ShardGroup::default_group)
    }

    /// The first scheduled instant strictly after `after`.
    fn next_after(&self, after: Timestamp) -> Option<Timestamp> {
        let after = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(after.unix_millis())?;
        let next = self.cron.find_next_occurrence(&after, false).ok()?;
        Some(Timestamp::from_unix_millis(next.timestamp_millis()))
    }
}

/// An instant as the reference writes it: `2024-01-01T00:00:00.000Z`.
fn iso(instant: Timestamp) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(instant.unix_millis())
        .map(|instant| instant.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
        .unwrap_or_default()
}

/// The instant of an ISO 8601 string.
fn parse_iso(instant: &str) -> Option<Timestamp> {
    let parsed = chrono::DateTime::parse_from_rfc3339(instant).ok()?;
    Some(Timestamp::from_unix_millis(parsed.timestamp_millis()))
}

/// The `run` request: the instant it is for, and whether it goes to the executor entity.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Run {
    #[serde(rename = "dateTime")]
    date_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    executor: Option<bool>,
}

impl Rpc for Run {
    const TAG: &'static str = "run";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Both;
    type Success = ();
    type Error = ();

    fn primary_key(&self) -> Option<String> {
        Some(if self.executor == Some(true) { self.date_time.clone() } else { String::new() })
    }

    fn deliver_at(&self) -> Option<Timestamp> {
        parse_iso(&self.date_time)
    }
}

/// The `start` request of an executor job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Start {}

impl Rpc for Start {
    const TAG: &'static str = "start";
    const PERSISTED: bool = true;
    type Success = ();
    type Error = ();
}

/// One job entity: an instant's run (default) or the executor. Made by the factory that
/// `Sharding::register_cron` registers, with its job and the runtime.
pub(crate) struct CronEntity<H> {
    job: Arc<Job>,
    host: H,
    /// Whether this activation handled a run (executor jobs).
    ran: bool,
}

impl<H: CronHost> CronEntity<H> {
    /// An instance of `job`'s entity type.
    pub(crate) fn new(job: Arc<Job>, host: H) -> CronEntity<H> {
        CronEntity { job, host, ran: false }
    }
}

impl<H: CronHost> Entity for CronEntity<H> {
    // The reference's cron entity turns client spans off (`effect/src/cluster/ClusterCron.ts`).
    const CLIENT_TRACING: bool = false;

    const TYPE: &'static str = "ClusterCron";

    // Registered as `ClusterCron/<name>` with a factory only.
    const FACTORY_ONLY: bool = true;

    fn create(_: &EntityContext) -> impl Future<Output = CronEntity<H>> + Send {
        std::future::pending()
    }

    fn protocol(protocol: &mut Protocol<CronEntity<H>>) {
        protocol.handle::<Run>().handle::<Start>();
    }
}

impl<H: CronHost> Handler<Run> for CronEntity<H> {
    async fn handle(&mut self, _: &RequestContext, run: Run) -> Result<(), ()> {
        let job = Arc::clone(&self.job);
        self.ran = true;
        let Some(scheduled) = parse_iso(&run.date_time) else {
            tracing::warn!(cron = %job.name, date_time = %run.date_time, "a run with an unreadable instant");
            return Err(());
        };
        let now = self.host.now();
        if scheduled < now.saturating_sub(job.options.skip_if_older_than) {
            tracing::info!(cron = %job.name, %run.date_time, "run skipped: older than skip_if_older_than");
        } else {
            let context = CronContext { scheduled, runtime: self.host.handle() };
            if let Err(error) = (job.execute)(context).await {
                tracing::warn!(cron = %job.name, %run.date_time, %error, "cron job failed");
            }
        }
        let from = if job.options.calculate_next_run_from_previous { scheduled } else { now };
        schedule(&self.host, &job, from).await;
        Ok(())
    }
}

impl<H: CronHost> Handler<Start> for CronEntity<H> {
    async fn handle(&mut self, _: &RequestContext, _: Start) -> Result<(), ()> {
        if !self.ran {
            // A pending run is delivered first (one message at a time, in storage order), so
            // this schedules only when nothing is pending; otherwise it deduplicates.
            let now = self.host.now();
            schedule(&self.host, &self.job, now).await;
        }
        Ok(())
    }
}

/// Stores the run after `after`, retrying until it is stored.
async fn schedule<H: CronHost>(host: &H, job: &Job, after: Timestamp) {
    let Some(next) = job.next_after(after) else {
        tracing::warn!(cron = %job.name, "the cron expression has no next instant");
        return;
    };
    let date_time = iso(next);
    let (entity_id, executor) = if job.options.calculate_next_run_from_previous {
        (EXECUTOR.to_owned(), Some(true))
    } else {
        (date_time.clone(), None)
    };
    let mut backoff = Backoff::new(SCHEDULE_RETRY_FIRST, SCHEDULE_RETRY_MAX, 3, 2);
    loop {
        let run = Run { date_time: date_time.clone(), executor };
        match host.discard(job, entity_id.clone(), run).await {
            Ok(()) => {
                tracing::debug!(cron = %job.name, next = %date_time, "next run scheduled");
                return;
            }
            Err(error) if !host.is_shutdown() => {
                let pause = backoff.next_delay();
                tracing::warn!(cron = %job.name, %error, retry_in = ?pause, "could not schedule the next run");
                tokio::time::sleep(pause).await;
            }
            // Stopping: the next owner's singleton schedules it.
            Err(_) => return,
        }
    }
}

/// The body of a job's singleton: it schedules the run after now (or, for an executor job,
/// starts the executor), until `cancellation`.
pub(crate) async fn start_schedule<H: CronHost>(
    host: H,
    job: Arc<Job>,
    cancellation: CancellationToken,
) {
    if job.options.calculate_next_run_from_previous {
        let mut backoff = Backoff::new(SCHEDULE_RETRY_FIRST, SCHEDULE_RETRY_MAX, 3, 2);
        while let Err(error) = host.discard(&job, EXECUTOR.to_owned(), Start {}).await {
            if cancellation.is_cancelled() {
                return;
            }
            tracing::warn!(cron = %job.name, %error, "could not start the executor");
            tokio::time::sleep(backoff.next_delay()).await;
        }
    } else {
        let now = host.now();
        schedule(&host, &job, now).await;
    }
}
