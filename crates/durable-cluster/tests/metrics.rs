//! The metrics a runner exports (feature `ops`), pinned: their names, kinds and label sets, read
//! from `/metrics` over real HTTP after a workload that reaches each of them, on SQLite.
//!
//! The Prometheus recorder is global to the process, so this file is a test binary of its own.
#![cfg(all(feature = "ops", feature = "sqlite", feature = "workflow"))]

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durable_cluster::workflow::{Workflow, WorkflowContext, WorkflowEngine};
use durable_cluster::{
    CallError, Chunks, Entity, EntityContext, Never, Protocol, RequestContext, Rpc, Runner,
    Sharding, StreamHandler, StreamRpc,
};
use serde::{Deserialize, Serialize};

mod support;

/// Every metric the runtime may export: name, kind and label names (`le` and `quantile`
/// left out). A metric not listed here fails the test: add it here and to
/// docs/operations.md.
const PINNED: &[(&str, &str, &[&str])] = &[
    ("effect_cluster_entities", "gauge", &["type"]),
    ("effect_cluster_entity_mailbox_size", "gauge", &["id", "shard", "type"]),
    ("effect_cluster_entity_passivations_total", "counter", &["reason", "type"]),
    ("effect_cluster_singletons", "gauge", &[]),
    ("effect_cluster_runners", "gauge", &[]),
    ("effect_cluster_runners_healthy", "gauge", &[]),
    ("effect_cluster_shards", "gauge", &[]),
    ("effect_cluster_shards_releasing", "gauge", &[]),
    ("effect_cluster_shard_release", "histogram", &[]),
    ("effect_cluster_persisted_in_flight", "gauge", &[]),
    ("effect_cluster_shard_locks_healthy", "gauge", &[]),
    ("effect_cluster_join_debounce_pending", "gauge", &[]),
    ("effect_cluster_shard_locks_lost_total", "counter", &[]),
    ("effect_cluster_shard_acquisitions_total", "counter", &[]),
    ("effect_cluster_shard_losses_total", "counter", &[]),
    ("effect_cluster_shard_lock_refresh_seconds", "histogram", &[]),
    ("effect_cluster_read_loop_lag_seconds", "gauge", &[]),
    ("effect_cluster_persisted_latency_seconds", "histogram", &[]),
    ("effect_cluster_persisted_pushed_total", "counter", &["answer"]),
    ("effect_cluster_persisted_pushed_waiting", "gauge", &[]),
    ("effect_cluster_persisted_pushed_serving", "gauge", &[]),
    ("effect_cluster_requests_received_total", "counter", &["kind", "tag", "type"]),
    ("effect_cluster_requests_answered_total", "counter", &["kind", "tag", "type"]),
    ("effect_cluster_requests_failed_total", "counter", &["kind", "reason", "tag", "type"]),
    ("effect_cluster_handler_duration_seconds", "histogram", &["tag", "type"]),
    ("effect_cluster_storage_operation_seconds", "histogram", &["backend", "operation"]),
    ("effect_cluster_storage_errors_total", "counter", &["backend", "kind", "operation"]),
    ("effect_cluster_workflow_runs_started_total", "counter", &["workflow"]),
    ("effect_cluster_workflow_runs_ended_total", "counter", &["outcome", "workflow"]),
    ("effect_cluster_workflow_activity_attempts_total", "counter", &["workflow"]),
    ("effect_cluster_workflow_activity_retries_total", "counter", &["cause", "workflow"]),
    ("effect_cluster_retention_deleted_total", "counter", &[]),
    ("effect_cluster_workflow_executions_deleted_total", "counter", &[]),
];

/// Samples the workload must have produced, as `name{labels}` prefixes of exported lines
/// (labels in the exporter's order).
const EXPECTED_SAMPLES: &[&str] = &[
    "effect_cluster_requests_received_total{type=\"Counter\",tag=\"Add\",kind=\"volatile\"} 2",
    "effect_cluster_requests_answered_total{type=\"Counter\",tag=\"Add\",kind=\"volatile\"} 1",
    "effect_cluster_requests_failed_total{type=\"Counter\",tag=\"Add\",kind=\"volatile\",reason=\"failure\"} 1",
    "effect_cluster_requests_received_total{type=\"Counter\",tag=\"Save\",kind=\"persisted\"} 1",
    "effect_cluster_requests_answered_total{type=\"Counter\",tag=\"Save\",kind=\"persisted\"} 1",
    "effect_cluster_requests_answered_total{type=\"Counter\",tag=\"Count\",kind=\"stream\"} 1",
    "effect_cluster_handler_duration_seconds_count{type=\"Counter\",tag=\"Add\"} 2",
    "effect_cluster_storage_operation_seconds_count{backend=\"sqlite\",operation=\"save_request\"}",
    "effect_cluster_storage_operation_seconds_count{backend=\"sqlite\",operation=\"acquire\"}",
    "effect_cluster_shard_acquisitions_total ",
    "effect_cluster_shard_lock_refresh_seconds_count ",
    "effect_cluster_persisted_latency_seconds_count ",
    "effect_cluster_workflow_runs_started_total{workflow=\"Flaky\"} 1",
    "effect_cluster_workflow_runs_ended_total{workflow=\"Flaky\",outcome=\"completed\"} 1",
    "effect_cluster_workflow_activity_attempts_total{workflow=\"Flaky\"} 2",
    "effect_cluster_workflow_activity_retries_total{workflow=\"Flaky\",cause=\"failure\"} 1",
];

/// A counter entity: `Add` (volatile, fails on a negative amount), `Save` (persisted) and
/// `Count` (a stream).
struct Counter {
    value: i64,
}

#[derive(Serialize, Deserialize)]
struct Add(i64);

#[derive(Serialize, Deserialize)]
struct Save(String);

#[derive(Serialize, Deserialize)]
struct Count(u32);

impl Rpc for Add {
    const TAG: &'static str = "Add";
    type Success = i64;
    type Error = String;
}

impl Rpc for Save {
    const TAG: &'static str = "Save";
    const PERSISTED: bool = true;
    type Success = i64;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.0.clone())
    }
}

impl StreamRpc for Count {
    const TAG: &'static str = "Count";
    type Item = u32;
    type Error = Never;
}

impl Entity for Counter {
    const TYPE: &'static str = "Counter";

    async fn create(_: &EntityContext) -> Counter {
        Counter { value: 0 }
    }

    fn protocol(protocol: &mut Protocol<Counter>) {
        protocol.handle::<Add>().handle::<Save>().stream::<Count>();
    }
}

impl durable_cluster::Handler<Add> for Counter {
    async fn handle(&mut self, _: &RequestContext, Add(amount): Add) -> Result<i64, String> {
        if amount < 0 {
            return Err("negative".to_owned());
        }
        self.value += amount;
        Ok(self.value)
    }
}

impl durable_cluster::Handler<Save> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Save) -> Result<i64, Never> {
        Ok(self.value)
    }
}

impl StreamHandler<Count> for Counter {
    async fn handle(
        &mut self,
        _: &RequestContext,
        Count(count): Count,
        chunks: &mut Chunks<'_, u32>,
    ) -> Result<(), Never> {
        for n in 0..count {
            if chunks.send(n).await.is_err() {
                break;
            }
        }
        Ok(())
    }
}

/// A workflow whose one activity fails on its first attempt and is retried once.
struct Flaky;

/// The payload of [`Flaky`] (the cluster engine stores a payload as a JSON object).
#[derive(Serialize, Deserialize)]
struct Job {
    id: String,
}

impl Workflow for Flaky {
    const NAME: &'static str = "Flaky";
    type Payload = Job;
    type Success = u32;
    type Error = String;

    fn idempotency_key(job: &Job) -> String {
        job.id.clone()
    }
}

/// Attempts of the activity, in this process.
static ATTEMPTS: AtomicU32 = AtomicU32::new(0);

async fn flaky(ctx: WorkflowContext, _: Job) -> Result<u32, String> {
    ctx.activity("flaky", async |_| match ATTEMPTS.fetch_add(1, Ordering::SeqCst) {
        0 => Err("first attempt".to_owned()),
        attempt => Ok(attempt + 1),
    })
    .retry(1)
    .await
}

/// `GET path` over HTTP/1.1: the status and the body.
async fn get(address: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    support::get(address, path).await
}

/// Each exported metric's kind and label names, from Prometheus text.
fn exported(text: &str) -> BTreeMap<String, (String, BTreeSet<String>)> {
    let mut metrics: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
    for line in text.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let (name, kind) = declared.split_once(' ').unwrap();
            metrics.entry(name.to_owned()).or_default().0 = kind.to_owned();
        }
    }
    for line in text.lines().filter(|line| !line.starts_with('#') && !line.is_empty()) {
        let series = line.rsplit_once(' ').unwrap().0;
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix).filter(|base| metrics.contains_key(*base)))
            .unwrap_or(name);
        let names = labels
            .trim_end_matches('}')
            .split(',')
            .filter_map(|pair| pair.split_once('=').map(|(name, _)| name.to_owned()))
            .filter(|name| name != "le" && name != "quantile");
        metrics.entry(base.to_owned()).or_default().1.extend(names);
    }
    metrics
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_exported_metric_has_its_pinned_name_kind_and_labels() {
    let name = "metrics-pinned";
    let settings = support::env(
        name,
        &[("CLUSTER_OPS_LISTEN", "127.0.0.1:0"), ("SHARD_LOCK_REFRESH_INTERVAL", "200 millis")],
    )
    .unwrap();
    let handles: Arc<Mutex<Option<(Sharding, WorkflowEngine)>>> = Arc::default();
    let kept = Arc::clone(&handles);
    let runner = Runner::start(&settings, move |sharding| {
        sharding.entity::<Counter>().register()?;
        let engine = WorkflowEngine::cluster(sharding)?;
        Flaky::register(&engine, flaky)?;
        *kept.lock().unwrap() = Some((sharding.clone(), engine));
        Ok(())
    })
    .await
    .unwrap();
    let (sharding, engine) = handles.lock().unwrap().take().unwrap();
    let ops = runner.ops_address().unwrap();

    let counter = sharding.client::<Counter>("c-1");
    assert_eq!(counter.send(Add(2)).await.unwrap(), 2);
    assert!(matches!(counter.send(Add(-1)).await, Err(CallError::Failed(_))));
    assert_eq!(counter.send(Save("s-1".to_owned())).await.unwrap(), 2);
    let mut stream = counter.stream(Count(3)).await.unwrap();
    let mut items = Vec::new();
    while let Some(item) = stream.next().await {
        items.push(item.unwrap());
    }
    assert_eq!(items, [0, 1, 2]);
    assert_eq!(engine.execute::<Flaky>(Job { id: "w-1".to_owned() }).await.unwrap(), 2);

    // The lock refresh runs on its own schedule: wait for it (and for everything else).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let text = loop {
        let (status, text) = get(ops, "/metrics").await.unwrap();
        assert_eq!(status, 200);
        let missing: Vec<_> =
            EXPECTED_SAMPLES.iter().filter(|sample| !text.contains(**sample)).collect();
        if missing.is_empty() {
            break text;
        }
        assert!(tokio::time::Instant::now() < deadline, "missing {missing:?} in\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let pinned: BTreeMap<&str, (&str, BTreeSet<String>)> = PINNED
        .iter()
        .map(|(name, kind, labels)| {
            (*name, (*kind, labels.iter().map(|label| (*label).to_owned()).collect()))
        })
        .collect();
    for (name, (kind, labels)) in exported(&text) {
        let Some((pinned_kind, pinned_labels)) = pinned.get(name.as_str()) else {
            panic!("{name} ({kind}, labels {labels:?}) is exported but not pinned");
        };
        assert_eq!(kind, *pinned_kind, "{name}'s kind");
        assert_eq!(&labels, pinned_labels, "{name}'s labels");
    }
    runner.shutdown().await;
    support::remove_database(name);
}

/// With `ENTITY_MAILBOX_METRICS=true`, an entity's mailbox series leaves `/metrics` when the
/// entity stops: a flood of ids does not grow the page for the life of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mailbox_series_of_stopped_entities_leave_metrics() {
    let name = "metrics-mailbox-series";
    let settings = support::env(
        name,
        &[
            ("CLUSTER_OPS_LISTEN", "127.0.0.1:0"),
            ("ENTITY_MAILBOX_METRICS", "true"),
            ("ENTITY_MAX_IDLE_TIME", "300 millis"),
        ],
    )
    .unwrap();
    let handles: Arc<Mutex<Option<Sharding>>> = Arc::default();
    let kept = Arc::clone(&handles);
    let runner = Runner::start(&settings, move |sharding| {
        sharding.entity::<Counter>().register()?;
        *kept.lock().unwrap() = Some(sharding.clone());
        Ok(())
    })
    .await
    .unwrap();
    let sharding = handles.lock().unwrap().take().unwrap();
    let ops = runner.ops_address().unwrap();
    for n in 0..50 {
        sharding.client::<Counter>(format!("series-{n}")).send(Add(1)).await.unwrap();
    }
    let (status, text) = get(ops, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("id=\"series-49\""), "a resident entity's series:\n{text}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, text) = get(ops, "/metrics").await.unwrap();
        let left = text.lines().filter(|line| line.contains("id=\"series-")).count();
        if left == 0 {
            assert!(text.contains("effect_cluster_entity_passivations_total{"), "{text}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} series of stopped entities");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    runner.shutdown().await;
    support::remove_database(name);
}
