//! The workloads: an echo entity called volatile (W1) or persisted (W2, W3), the same with a
//! durable state change per request (W2S, W3S), and a workflow of
//! three activities (W4, W5). Each warms up with a tenth of its operations on keys of their
//! own, then measures.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_core::config::Capacity;
use cluster_sharding::{
    Entity, EntityContext, Handler, Never, Protocol, RequestContext, Rpc, Sharding,
};
use cluster_workflow::{Workflow, WorkflowContext, WorkflowEngine};
use serde::{Deserialize, Serialize};

use crate::database::{BenchDatabase, Storages};
use crate::drive::{Measured, drive};
use crate::{Plan, Workload};

/// The echo entity: answers every request with its number.
pub(crate) struct Echo;

/// A volatile request (W1).
#[derive(Serialize, Deserialize)]
pub(crate) struct Ping(u64);

/// A persisted request with a primary key (W2, W3).
#[derive(Serialize, Deserialize)]
pub(crate) struct StoredPing {
    key: String,
    n: u64,
}

impl Rpc for Ping {
    const TAG: &'static str = "Ping";
    type Success = u64;
    type Error = Never;
}

impl Rpc for StoredPing {
    const TAG: &'static str = "StoredPing";
    const PERSISTED: bool = true;
    type Success = u64;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl Entity for Echo {
    const TYPE: &'static str = "Echo";

    async fn create(_context: &EntityContext) -> Echo {
        Echo
    }

    fn protocol(protocol: &mut Protocol<Echo>) {
        protocol.handle::<Ping>();
        protocol.handle::<StoredPing>();
    }
}

impl Handler<Ping> for Echo {
    async fn handle(&mut self, _: &RequestContext, ping: Ping) -> Result<u64, Never> {
        Ok(ping.0)
    }
}

impl Handler<StoredPing> for Echo {
    async fn handle(&mut self, _: &RequestContext, ping: StoredPing) -> Result<u64, Never> {
        Ok(ping.n)
    }
}

/// The entity of W2S, W3S and W6S: W2's echo, and a count of its requests kept as durable
/// state, committed with each reply.
pub(crate) struct Tally {
    count: u64,
}

/// A persisted request that also changes its entity's state (W2S, W3S, W6S).
#[derive(Serialize, Deserialize)]
pub(crate) struct StoredAdd {
    key: String,
    n: u64,
}

impl Rpc for StoredAdd {
    const TAG: &'static str = "StoredAdd";
    const PERSISTED: bool = true;
    type Success = u64;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl Entity for Tally {
    const TYPE: &'static str = "Tally";

    async fn create(_context: &EntityContext) -> Tally {
        Tally { count: 0 }
    }

    fn protocol(protocol: &mut Protocol<Tally>) {
        protocol.durable(|tally| &mut tally.count);
        protocol.handle::<StoredAdd>();
    }
}

impl Handler<StoredAdd> for Tally {
    async fn handle(&mut self, _: &RequestContext, add: StoredAdd) -> Result<u64, Never> {
        self.count += 1;
        Ok(add.n)
    }
}

/// The workflow of W4 and W5: three small activities, each adding one.
pub(crate) struct ThreeSteps;

/// Which execution.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct Job {
    id: u64,
}

/// The workflow never fails.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum JobError {}

impl Workflow for ThreeSteps {
    const NAME: &'static str = "ThreeSteps";
    type Payload = Job;
    type Success = u64;
    type Error = JobError;

    fn idempotency_key(job: &Job) -> String {
        job.id.to_string()
    }
}

pub(crate) async fn three_steps(ctx: WorkflowContext, job: Job) -> Result<u64, JobError> {
    let mut value = job.id;
    for step in ["one", "two", "three"] {
        value = ctx.activity(step, async |_| Ok::<u64, JobError>(value + 1)).await?;
    }
    Ok(value)
}

/// Runs `plan`'s workload: warm-up, then the measured operations.
///
/// # Errors
///
/// The runtime or its storage could not start, or an operation failed.
pub(crate) async fn run(plan: &Plan) -> Result<Measured, String> {
    let database = match plan.workload {
        Workload::W0 => return bare_echo(plan).await,
        Workload::W1 => None,
        Workload::W2 | Workload::W2S | Workload::W4 => Some(BenchDatabase::sqlite()),
        Workload::W3 | Workload::W3S | Workload::W3C | Workload::W5 => {
            Some(BenchDatabase::postgres()?)
        }
        Workload::W6 | Workload::W6S | Workload::W7 | Workload::W8 | Workload::W9 => {
            return Err("W6 to W9 run across processes".to_owned());
        }
    };
    let result = match &database {
        None => volatile_echo(plan).await,
        Some(database) => on_database(plan, database).await,
    };
    if let Some(database) = database {
        database.remove().await?;
    }
    result
}

/// The measured operations start here; the warm-up uses the numbers below.
fn warm_up_size(plan: &Plan) -> usize {
    (plan.ops / 10).max(1)
}

pub(crate) fn entity_id(plan: &Plan, n: usize) -> String {
    format!("echo-{}", n % plan.entities.max(1))
}

/// W1.
async fn volatile_echo(plan: &Plan) -> Result<Measured, String> {
    // Every entity stays resident (the default cap is 10,000): the scaling runs measure the
    // memory of a million.
    let config =
        ShardingConfig { max_resident_entities: Capacity::Unbounded, ..ShardingConfig::default() };
    let sharding = Sharding::volatile(config).start().await.map_err(|error| error.to_string())?;
    sharding.entity::<Echo>().register().map_err(|error| error.to_string())?;
    let measured = volatile_echo_from(plan, &sharding).await;
    sharding.shutdown().await;
    measured
}

/// The volatile echo of W1 (on this runner) and W7 (from a client, to other processes).
pub(crate) async fn volatile_echo_from(
    plan: &Plan,
    sharding: &Sharding,
) -> Result<Measured, String> {
    measure(plan, None, {
        let (sharding, plan) = (sharding.clone(), plan.clone());
        move |n| {
            let client = sharding.client::<Echo>(entity_id(&plan, n));
            async move {
                let echoed = client.send(Ping(n as u64)).await.map_err(|e| e.to_string())?;
                check(echoed, n)
            }
        }
    })
    .await
}

/// W0: what W1 does without the runtime. One task per entity reads a bounded mailbox of
/// (JSON payload, oneshot) pairs, decodes the request, encodes the answer and sends it back;
/// the caller encodes its request and decodes the answer, as an entity client does.
async fn bare_echo(plan: &Plan) -> Result<Measured, String> {
    type Mail = (String, tokio::sync::oneshot::Sender<String>);
    let mailboxes: Arc<Vec<tokio::sync::mpsc::Sender<Mail>>> = Arc::new(
        (0..plan.entities.max(1))
            .map(|_| {
                let (sender, mut receiver) = tokio::sync::mpsc::channel::<Mail>(64);
                tokio::spawn(async move {
                    while let Some((payload, reply)) = receiver.recv().await {
                        let answer = serde_json::from_str::<Ping>(&payload)
                            .map_err(|error| error.to_string())
                            .and_then(|ping| {
                                serde_json::to_string(&ping.0).map_err(|error| error.to_string())
                            });
                        let _ = reply.send(answer.unwrap_or_default());
                    }
                });
                sender
            })
            .collect(),
    );
    measure(plan, None, move |n| {
        let mailboxes = Arc::clone(&mailboxes);
        async move {
            let payload = serde_json::to_string(&Ping(n as u64)).map_err(|e| e.to_string())?;
            let (reply, answer) = tokio::sync::oneshot::channel();
            let mailbox = &mailboxes[n % mailboxes.len()];
            mailbox.send((payload, reply)).await.map_err(|_| "mailbox closed".to_owned())?;
            let answer = answer.await.map_err(|_| "no answer".to_owned())?;
            check(serde_json::from_str(&answer).map_err(|e| e.to_string())?, n)
        }
    })
    .await
}

/// W2 to W5: one runner holding every shard's lock on `database`.
async fn on_database(plan: &Plan, database: &BenchDatabase) -> Result<Measured, String> {
    let config = ShardingConfig::default();
    let (messages, runners) = database.open(&config).await?;
    let sharding = Sharding::single_runner(config, messages, runners)
        .start()
        .await
        .map_err(|error| error.to_string())?;
    let measured = match plan.workload {
        Workload::W2 | Workload::W3 => persisted_echo(plan, database, &sharding).await,
        Workload::W3C => {
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let storages = database.open(&config_of_console()).await?;
            let console = tokio::spawn(console(storages, stopped));
            let measured = persisted_echo(plan, database, &sharding).await;
            let _ = stop.send(());
            let polls = console.await.map_err(|error| error.to_string())??;
            crate::note(&format!("W3C: the console polled {polls} times"));
            measured
        }
        Workload::W2S | Workload::W3S => {
            sharding.entity::<Tally>().register().map_err(|error| error.to_string())?;
            stateful_on(plan, Some(database), &sharding).await
        }
        _ => workflows(plan, database, &sharding).await,
    };
    sharding.shutdown().await;
    measured
}

/// The settings the console reads the cluster with: the runner's.
fn config_of_console() -> ShardingConfig {
    ShardingConfig::default()
}

/// An operator's console on storages of its own: every second, the overview's reads (stuck
/// work, runners, the shard map, the backlog) and a page of workflow executions, until `stop`.
/// Returns how many times it polled.
async fn console(
    (messages, runners): Storages,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<u64, String> {
    use durable_cluster::admin::Admin;
    let admin = Admin::new(messages, runners, config_of_console());
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    let mut polls = 0;
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(polls),
            _ = interval.tick() => {}
        }
        let text = |error: durable_cluster::admin::AdminError| error.to_string();
        admin.stuck(admin.stuck_threshold()).await.map_err(text)?;
        admin.runners().await.map_err(text)?;
        admin.shards().await.map_err(text)?;
        admin.backlog(Duration::from_secs(60), 100).await.map_err(text)?;
        let page = cluster_workflow::inspect::ExecutionQuery::newest(50);
        admin.workflows(&page).await.map_err(text)?;
        polls += 1;
    }
}

/// W2, W3.
async fn persisted_echo(
    plan: &Plan,
    database: &BenchDatabase,
    sharding: &Sharding,
) -> Result<Measured, String> {
    sharding.entity::<Echo>().register().map_err(|error| error.to_string())?;
    persisted_echo_on(plan, Some(database), sharding).await
}

/// The persisted echo's operations, on a runner (W2, W3) or from a client to the runner
/// processes (W6); `database`'s statistics, if given, are refreshed after the warm-up.
pub(crate) async fn persisted_echo_on(
    plan: &Plan,
    database: Option<&BenchDatabase>,
    sharding: &Sharding,
) -> Result<Measured, String> {
    persisted_on::<Echo, _>(plan, database, sharding, stored_ping).await
}

/// W3's persisted request number `n`: primary key `ping-<n>`, answered with `n`.
pub(crate) fn stored_ping(n: usize) -> StoredPing {
    StoredPing { key: format!("ping-{n}"), n: n as u64 }
}

/// The persisted requests that change state, on a runner (W2S, W3S) or from a client to the
/// runner processes (W6S).
pub(crate) async fn stateful_on(
    plan: &Plan,
    database: Option<&BenchDatabase>,
    sharding: &Sharding,
) -> Result<Measured, String> {
    persisted_on::<Tally, _>(plan, database, sharding, |n| StoredAdd {
        key: format!("add-{n}"),
        n: n as u64,
    })
    .await
}

/// Operation `n` sends `request(n)` to an entity of type `E` and checks that it answers `n`.
async fn persisted_on<E, R>(
    plan: &Plan,
    database: Option<&BenchDatabase>,
    sharding: &Sharding,
    request: fn(usize) -> R,
) -> Result<Measured, String>
where
    E: Handler<R>,
    R: Rpc<Success = u64> + Send + 'static,
{
    measure(plan, database, {
        let (sharding, plan) = (sharding.clone(), plan.clone());
        move |n| {
            let client = sharding.client::<E>(entity_id(&plan, n));
            async move {
                let echoed = client.send(request(n)).await.map_err(|e| e.to_string())?;
                check(echoed, n)
            }
        }
    })
    .await
}

/// W4, W5.
async fn workflows(
    plan: &Plan,
    database: &BenchDatabase,
    sharding: &Sharding,
) -> Result<Measured, String> {
    workflows_on(plan, Some(database), sharding).await
}

/// The workflow executions, on a runner (W4, W5) or started from a client and run by the
/// runner processes (W8); `database`'s statistics, if given, are refreshed after the warm-up.
pub(crate) async fn workflows_on(
    plan: &Plan,
    database: Option<&BenchDatabase>,
    sharding: &Sharding,
) -> Result<Measured, String> {
    let engine = WorkflowEngine::cluster(sharding).map_err(|error| error.to_string())?;
    ThreeSteps::register(&engine, three_steps).map_err(|error| error.to_string())?;
    measure(plan, database, move |n| {
        let engine = engine.clone();
        async move {
            let id = n as u64;
            let result = engine.execute::<ThreeSteps>(Job { id }).await;
            check(result.map_err(|error| format!("{error:?}"))?, n + 3)
        }
    })
    .await
}

/// The warm-up on numbers after the measured ones, the tables' statistics, then the
/// measurement.
pub(crate) async fn measure<F, Fut>(
    plan: &Plan,
    database: Option<&BenchDatabase>,
    op: F,
) -> Result<Measured, String>
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    drive(plan.ops, warm_up_size(plan), plan.in_flight, op.clone()).await?;
    if let Some(database) = database {
        database.analyze().await?;
    }
    drive(0, plan.ops, plan.in_flight, op).await
}

pub(crate) fn check(echoed: u64, n: usize) -> Result<(), String> {
    if echoed == n as u64 { Ok(()) } else { Err(format!("expected {n}, got {echoed}")) }
}
