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

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::{EntityType, ShardGroup, Timestamp};
use serde::{Deserialize, Serialize};

use crate::entity::{Entity, EntityContext, EntityOptions, Handler, Protocol, RequestContext};
use crate::error::RegisterError;
use crate::rpc::{Rpc, Uninterruptible};
use crate::sharding::Sharding;
use crate::singleton::SingletonOptions;

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
#[derive(Clone, Debug)]
pub struct CronContext {
    scheduled: Timestamp,
    sharding: Sharding,
}

impl CronContext {
    /// The instant this run is for (the reference's `CurrentScheduledTime`).
    pub fn scheduled(&self) -> Timestamp {
        self.scheduled
    }

    /// The runtime, to call entities.
    pub fn sharding(&self) -> &Sharding {
        &self.sharding
    }
}

type Execute = Arc<dyn Fn(CronContext) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// A registered job.
struct Job {
    name: String,
    entity_type: EntityType,
    cron: croner::Cron,
    options: CronOptions,
    execute: Execute,
}

impl Job {
    /// The first scheduled instant strictly after `after`.
    fn next_after(&self, after: Timestamp) -> Option<Timestamp> {
        let after = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(after.unix_millis())?;
        let next = self.cron.find_next_occurrence(&after, false).ok()?;
        Some(Timestamp::from_unix_millis(next.timestamp_millis()))
    }
}

/// The jobs of a runtime, by entity type (what the job entities are made from).
#[derive(Default)]
pub(crate) struct CronJobs {
    jobs: Mutex<BTreeMap<EntityType, Arc<Job>>>,
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
struct Run {
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
struct Start {}

impl Rpc for Start {
    const TAG: &'static str = "start";
    const PERSISTED: bool = true;
    type Success = ();
    type Error = ();
}

/// One job entity: an instant's run (default) or the executor.
struct CronEntity {
    job: Option<Arc<Job>>,
    sharding: Sharding,
    /// Whether this activation handled a run (executor jobs).
    ran: bool,
}

impl Entity for CronEntity {
    // The reference's cron entity turns client spans off (`effect/src/cluster/ClusterCron.ts`).
    const CLIENT_TRACING: bool = false;

    const TYPE: &'static str = "ClusterCron";

    async fn create(context: &EntityContext) -> CronEntity {
        let sharding = context.sharding().clone();
        let job = lock(&sharding.cron_jobs().jobs).get(&context.address().entity_type).cloned();
        CronEntity { job, sharding, ran: false }
    }

    fn protocol(protocol: &mut Protocol<CronEntity>) {
        protocol.handle::<Run>().handle::<Start>();
    }
}

impl Handler<Run> for CronEntity {
    async fn handle(&mut self, _: &RequestContext, run: Run) -> Result<(), ()> {
        let Some(job) = self.job.clone() else { return Err(()) };
        self.ran = true;
        let Some(scheduled) = parse_iso(&run.date_time) else {
            tracing::warn!(cron = %job.name, date_time = %run.date_time, "a run with an unreadable instant");
            return Err(());
        };
        let now = self.sharding.clock().now();
        if scheduled < now.saturating_sub(job.options.skip_if_older_than) {
            tracing::info!(cron = %job.name, %run.date_time, "run skipped: older than skip_if_older_than");
        } else {
            let context = CronContext { scheduled, sharding: self.sharding.clone() };
            if let Err(error) = (job.execute)(context).await {
                tracing::warn!(cron = %job.name, %run.date_time, %error, "cron job failed");
            }
        }
        let from = if job.options.calculate_next_run_from_previous { scheduled } else { now };
        schedule(&self.sharding, &job, from).await;
        Ok(())
    }
}

impl Handler<Start> for CronEntity {
    async fn handle(&mut self, _: &RequestContext, _: Start) -> Result<(), ()> {
        let Some(job) = self.job.clone() else { return Err(()) };
        if !self.ran {
            // A pending run is delivered first (one message at a time, in storage order), so
            // this schedules only when nothing is pending; otherwise it deduplicates.
            let now = self.sharding.clock().now();
            schedule(&self.sharding, &job, now).await;
        }
        Ok(())
    }
}

/// Stores the run after `after`, retrying until it is stored.
async fn schedule(sharding: &Sharding, job: &Job, after: Timestamp) {
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
    let group = job.options.shard_group.clone().unwrap_or_else(ShardGroup::default_group);
    let client = sharding.client_in::<CronEntity>(job.entity_type.clone(), &group, entity_id);
    let mut pause = SCHEDULE_RETRY_FIRST;
    loop {
        let run = Run { date_time: date_time.clone(), executor };
        match client.discard(run).await {
            Ok(()) => {
                tracing::debug!(cron = %job.name, next = %date_time, "next run scheduled");
                return;
            }
            Err(error) if !sharding.is_shutdown() => {
                tracing::warn!(cron = %job.name, %error, retry_in = ?pause, "could not schedule the next run");
                tokio::time::sleep(pause).await;
                pause = pause.mul_f64(1.5).min(SCHEDULE_RETRY_MAX);
            }
            // Stopping: the next owner's singleton schedules it.
            Err(_) => return,
        }
    }
}

impl Sharding {
    /// The registered cron jobs.
    fn cron_jobs(&self) -> &CronJobs {
        self.cron_jobs_registry()
    }

    /// Registers the cron job `name`: `execute` runs once per instant of `expression` (five
    /// fields, or six with seconds first; UTC) across the cluster, on whichever runner stores
    /// and reads its runs (docs/sharding.md, "Cron jobs"). Register it on every runner. On a
    /// client-only process nothing runs.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    ///
    /// use cluster_core::ShardingConfig;
    /// use cluster_sharding::{CronOptions, Sharding};
    /// use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions};
    /// use tokio::sync::mpsc;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let path = std::env::temp_dir().join(format!("doc-cron-{}.db", std::process::id()));
    /// // Runs are stored messages: a short poll interval finds the first one sooner.
    /// let config = ShardingConfig {
    ///     entity_message_poll_interval: Duration::from_millis(100),
    ///     ..ShardingConfig::default()
    /// };
    /// let messages = SqliteMessageStorage::open(&path, SqliteOptions::default()).await?;
    /// let sharding = Sharding::builder(config).messages(Arc::new(messages)).start().await?;
    /// let (runs, mut ran) = mpsc::channel(16);
    /// // Every second (six fields: seconds first).
    /// sharding.register_cron("heartbeat", "* * * * * *", CronOptions::default(), move |context| {
    ///     let runs = runs.clone();
    ///     async move {
    ///         let _ = runs.send(context.scheduled()).await;
    ///         Ok::<(), String>(())
    ///     }
    /// })?;
    /// let first = tokio::time::timeout(Duration::from_secs(30), ran.recv()).await?;
    /// assert!(first.is_some());
    /// sharding.shutdown().await;
    /// # for suffix in ["", "-wal", "-shm"] {
    /// #     let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    /// # }
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_cron<F, Fut, E>(
        &self,
        name: impl Into<String>,
        expression: &str,
        options: CronOptions,
        execute: F,
    ) -> Result<(), CronError>
    where
        F: Fn(CronContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: std::fmt::Display + 'static,
    {
        let name = name.into();
        if self.persisted().is_none() {
            return Err(CronError::NoMessageStorage);
        }
        let cron =
            croner::Cron::new(expression).with_seconds_optional().parse().map_err(|error| {
                CronError::InvalidExpression {
                    expression: expression.to_owned(),
                    reason: error.to_string(),
                }
            })?;
        let entity_type = EntityType::from(format!("ClusterCron/{name}").as_str());
        let execute: Execute = Arc::new(move |context| {
            let run = execute(context);
            Box::pin(async move { run.await.map_err(|error| error.to_string()) })
        });
        let job = Arc::new(Job {
            name: name.clone(),
            entity_type: entity_type.clone(),
            cron,
            options: options.clone(),
            execute,
        });
        {
            let mut jobs = lock(&self.cron_jobs().jobs);
            if jobs.contains_key(&entity_type) {
                return Err(CronError::Register(RegisterError::AlreadyRegistered(entity_type)));
            }
            // Before the entity type: its first request may arrive at once.
            jobs.insert(entity_type.clone(), Arc::clone(&job));
        }
        let entity_options = EntityOptions::default();
        self.register_as::<CronEntity>(entity_type, entity_options)?;
        let singleton = SingletonOptions { shard_group: options.shard_group };
        self.register_singleton(format!("ClusterCron/{name}"), singleton, move |context| {
            let job = Arc::clone(&job);
            async move {
                let sharding = context.sharding().clone();
                if job.options.calculate_next_run_from_previous {
                    let group =
                        job.options.shard_group.clone().unwrap_or_else(ShardGroup::default_group);
                    let executor =
                        sharding.client_in::<CronEntity>(job.entity_type.clone(), &group, EXECUTOR);
                    let mut pause = SCHEDULE_RETRY_FIRST;
                    while let Err(error) = executor.discard(Start {}).await {
                        if context.cancellation().is_cancelled() {
                            return;
                        }
                        tracing::warn!(cron = %job.name, %error, "could not start the executor");
                        tokio::time::sleep(pause).await;
                        pause = pause.mul_f64(1.5).min(SCHEDULE_RETRY_MAX);
                    }
                } else {
                    let now = sharding.clock().now();
                    schedule(&sharding, &job, now).await;
                }
            }
        })?;
        Ok(())
    }
}
