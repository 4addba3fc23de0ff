//! The runtime's metrics carry the reference's names and labels
//! (`effect/src/cluster/ClusterMetrics.ts`): the `effect_cluster_entities` gauge follows resident
//! instances, `effect_cluster_entity_mailbox_size` follows each entity's mailbox when
//! `entity_mailbox_metrics` is on, and `effect_cluster_shard_release` times shard releases. They
//! are read through a minimal `metrics` recorder installed for this test binary.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cluster_core::{RunnerAddress, ShardingConfig, SystemClock};
use cluster_sharding::{
    Entity, EntityContext, EntityOptions, Handler, Protocol, RequestContext, Sharding,
};
use cluster_testkit::memory::{MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage};
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

use crate::entities::{Failure, Get, Persist};

/// Gauge values and histogram samples by name and labels.
#[derive(Default)]
struct Gauges {
    values: Mutex<BTreeMap<String, Arc<Value>>>,
    samples: Mutex<BTreeMap<String, Arc<Samples>>>,
    /// Every name registered, whatever its kind.
    names: Mutex<BTreeSet<String>>,
}

/// The samples of one histogram.
#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

#[derive(Default)]
struct Value(AtomicU64);

impl GaugeFn for Value {
    fn increment(&self, value: f64) {
        self.set(f64::from_bits(self.0.load(Ordering::SeqCst)) + value);
    }

    fn decrement(&self, value: f64) {
        self.set(f64::from_bits(self.0.load(Ordering::SeqCst)) - value);
    }

    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::SeqCst);
    }
}

/// A counter reads as a gauge of its total.
impl CounterFn for Value {
    fn increment(&self, value: u64) {
        GaugeFn::increment(self, value as f64);
    }

    fn absolute(&self, value: u64) {
        self.set(value as f64);
    }
}

fn name(key: &Key) -> String {
    let labels: Vec<String> =
        key.labels().map(|label| format!("{}={}", label.key(), label.value())).collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

struct Capture(Arc<Gauges>);

impl Recorder for Capture {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0.names.lock().unwrap().insert(key.name().to_owned());
        let mut values = self.0.values.lock().unwrap();
        Counter::from_arc(Arc::clone(values.entry(name(key)).or_default()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.0.names.lock().unwrap().insert(key.name().to_owned());
        let mut values = self.0.values.lock().unwrap();
        Gauge::from_arc(Arc::clone(values.entry(name(key)).or_default()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0.names.lock().unwrap().insert(key.name().to_owned());
        let mut samples = self.0.samples.lock().unwrap();
        Histogram::from_arc(Arc::clone(samples.entry(name(key)).or_default()))
    }
}

fn gauges() -> &'static Arc<Gauges> {
    static GAUGES: OnceLock<Arc<Gauges>> = OnceLock::new();
    GAUGES.get_or_init(|| {
        let gauges = Arc::new(Gauges::default());
        metrics::set_global_recorder(Capture(Arc::clone(&gauges))).expect("the only recorder");
        gauges
    })
}

fn gauge(key: &str) -> Option<f64> {
    let values = gauges().values.lock().unwrap();
    values.get(key).map(|value| f64::from_bits(value.0.load(Ordering::SeqCst)))
}

/// An entity type of its own, so no other test touches its gauge series.
struct Meter;

impl Entity for Meter {
    const TYPE: &'static str = "Meter";

    async fn create(_context: &EntityContext) -> Meter {
        Meter
    }

    fn protocol(protocol: &mut Protocol<Meter>) {
        protocol.handle::<Get>();
    }
}

impl Handler<Get> for Meter {
    async fn handle(&mut self, _: &RequestContext, _: Get) -> Result<u64, Failure> {
        Ok(0)
    }
}

#[tokio::test(start_paused = true)]
async fn the_entities_gauge_follows_resident_instances() {
    gauges();
    let config = ShardingConfig {
        entity_max_idle_time: Some(Duration::from_secs(1)),
        ..ShardingConfig::default()
    };
    let sharding = Sharding::volatile(config).start().await.unwrap();
    sharding.entity::<Meter>().register().unwrap();
    for id in ["m1", "m2", "m3"] {
        sharding.client::<Meter>(id).send(Get).await.unwrap();
    }
    assert_eq!(gauge("effect_cluster_entities{type=Meter}"), Some(3.0));
    assert_eq!(gauge("effect_cluster_runners{}"), Some(1.0));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(sharding.active_entity_count(), 0);
    assert_eq!(gauge("effect_cluster_entities{type=Meter}"), Some(0.0));
    let idle = "effect_cluster_entity_passivations_total{type=Meter,reason=idle}";
    assert_eq!(gauge(idle), Some(3.0));
    assert_one_naming_scheme();
}

/// An entity type of its own for the passivation counter.
struct Crowded;

impl Entity for Crowded {
    const TYPE: &'static str = "Crowded";

    async fn create(_context: &EntityContext) -> Crowded {
        Crowded
    }

    fn protocol(protocol: &mut Protocol<Crowded>) {
        protocol.handle::<Get>();
    }
}

impl Handler<Get> for Crowded {
    async fn handle(&mut self, _: &RequestContext, _: Get) -> Result<u64, Failure> {
        Ok(0)
    }
}

#[tokio::test(start_paused = true)]
async fn passivations_to_make_room_are_counted_and_leave_the_entities_gauge() {
    gauges();
    let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    let options = EntityOptions {
        max_resident: cluster_core::config::Capacity::bounded(2),
        max_idle_time: Some(None),
        ..EntityOptions::default()
    };
    sharding.entity::<Crowded>().options(options).register().unwrap();
    for n in 0..5 {
        sharding.client::<Crowded>(format!("crowded-{n}")).send(Get).await.unwrap();
    }
    let capacity = "effect_cluster_entity_passivations_total{type=Crowded,reason=capacity}";
    assert_eq!(gauge(capacity), Some(3.0));
    gauge_reaches("effect_cluster_entities{type=Crowded}", 2.0).await;
    sharding.shutdown().await;
}

/// Every name reported is the reference's scheme, `effect_cluster_*`: no old `cluster_*` name
/// reports the same value a second time.
fn assert_one_naming_scheme() {
    assert_one_naming_scheme_in(gauges());
}

/// [`assert_one_naming_scheme`] for the names `gauges` captured.
fn assert_one_naming_scheme_in(gauges: &Gauges) {
    let names = gauges.names.lock().unwrap().clone();
    assert!(!names.is_empty());
    let other: Vec<&String> =
        names.iter().filter(|name| !name.starts_with("effect_cluster_")).collect();
    assert!(other.is_empty(), "names outside the scheme: {other:?}");
}

/// Requests to `Queued` wait here until the test lets them go.
static GATE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

/// An entity whose requests wait at [`GATE`], so that its mailbox fills.
struct Queued;

impl Entity for Queued {
    const TYPE: &'static str = "Queued";

    async fn create(_context: &EntityContext) -> Queued {
        Queued
    }

    fn protocol(protocol: &mut Protocol<Queued>) {
        protocol.handle::<Get>();
    }
}

impl Handler<Get> for Queued {
    async fn handle(&mut self, _: &RequestContext, _: Get) -> Result<u64, Failure> {
        GATE.acquire().await.expect("never closed").forget();
        Ok(0)
    }
}

/// Waits until `key`'s gauge reads `value`, failing after a deadline.
async fn gauge_reaches(key: &str, value: f64) {
    until(|| gauge(key) == Some(value), || format!("{key} = {:?}, not {value}", gauge(key))).await;
}

/// Waits until `done` holds, failing with `why` after a deadline.
async fn until(done: impl Fn() -> bool, why: impl Fn() -> String) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "{}", why());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mailbox_gauge_follows_each_entity_when_entity_mailbox_metrics_is_on() {
    gauges();
    let config = ShardingConfig { entity_mailbox_metrics: true, ..ShardingConfig::default() };
    let sharding = Sharding::volatile(config).start().await.unwrap();
    sharding.entity::<Queued>().register().unwrap();
    let client = sharding.client::<Queued>("q1");
    let shard = client.address().shard_id.to_string();
    let key = format!("effect_cluster_entity_mailbox_size{{type=Queued,id=q1,shard={shard}}}");
    let calls: Vec<_> = (0..2)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.send(Get).await })
        })
        .collect();
    // One running, one waiting: both count, as the mailbox capacity check counts them.
    gauge_reaches(&key, 2.0).await;
    GATE.add_permits(2);
    for call in calls {
        call.await.unwrap().unwrap();
    }
    gauge_reaches(&key, 0.0).await;

    // Off (the default): no series for the entities of a runtime without it.
    let quiet = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    quiet.entity::<Queued>().register().unwrap();
    let client = quiet.client::<Queued>("q2");
    GATE.add_permits(1);
    client.send(Get).await.unwrap();
    let keys: Vec<String> = gauges().values.lock().unwrap().keys().cloned().collect();
    assert!(!keys.iter().any(|key| key.contains("id=q2")), "{keys:?}");
    assert_one_naming_scheme();
    sharding.shutdown().await;
    quiet.shutdown().await;
}

/// On a one-thread runtime with a recorder of its own on that thread: under `cargo test`, the
/// other tests of this binary release shards into the global recorder at the same time.
#[tokio::test(flavor = "current_thread")]
async fn the_shard_release_timer_records_each_release_of_the_shutdown_handoff() {
    use cluster_testkit::memory::{
        MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage,
    };

    let own = Arc::new(Gauges::default());
    let recorder = Capture(Arc::clone(&own));
    let _recording = metrics::set_default_local_recorder(&recorder);
    let gauge = |key: &str| {
        let values = own.values.lock().unwrap();
        values.get(key).map(|value| f64::from_bits(value.0.load(Ordering::SeqCst)))
    };
    let clock = Arc::new(SystemClock);
    let messages = Arc::new(MemoryMessageStorage::new(clock.clone()));
    let registry = MemoryRunnerDatabase::new(clock.clone());
    let expiration = Duration::from_secs(30);
    let locks = Arc::new(MemoryRunnerStorage::new(registry, expiration));
    let config = ShardingConfig {
        shards_per_group: 4,
        refresh_assignments_interval: Duration::from_millis(50),
        entity_message_poll_interval: Duration::from_millis(50),
        ..ShardingConfig::default()
    };
    let sharding = Sharding::member(config, messages, locks).clock(clock).start().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sharding.acquired_shards().len() < 4 {
        assert!(tokio::time::Instant::now() < deadline, "the runner never held its shards");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(gauge("effect_cluster_shards{}"), Some(4.0));
    sharding.shutdown().await;
    let samples = own.samples.lock().unwrap().get("effect_cluster_shard_release{}").cloned();
    let samples = samples.expect("the timer was registered").0.lock().unwrap().clone();
    assert_eq!(samples.len(), 4, "one sample per shard released: {samples:?}");
    assert!(samples.iter().all(|ms| ms.is_finite() && *ms >= 0.0), "{samples:?}");
    assert_eq!(gauge("effect_cluster_shards{}"), Some(0.0));
    assert_one_naming_scheme_in(&own);
}

/// An entity type of its own with a persisted request.
struct Stored;

impl Entity for Stored {
    const TYPE: &'static str = "Stored";

    async fn create(_context: &EntityContext) -> Stored {
        Stored
    }

    fn protocol(protocol: &mut Protocol<Stored>) {
        protocol.handle::<Persist>();
    }
}

impl Handler<Persist> for Stored {
    async fn handle(&mut self, _: &RequestContext, _: Persist) -> Result<(), Failure> {
        Ok(())
    }
}

/// Waits until `name` has been registered with the recorder, failing after a deadline.
async fn registered(name: &str) {
    until(
        || gauges().names.lock().unwrap().contains(name),
        || format!("{name} was never reported"),
    )
    .await;
}

/// A cluster member reports its shard acquisitions, how long its lock refreshes take, its
/// read loop's lag and the latency of its persisted requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_member_reports_its_locks_its_read_loop_and_its_persisted_latency() {
    gauges();
    let clock = Arc::new(SystemClock);
    let messages = Arc::new(MemoryMessageStorage::new(clock.clone()));
    let registry = MemoryRunnerDatabase::new(clock);
    let locks = Arc::new(MemoryRunnerStorage::new(registry, Duration::from_secs(5)));
    let config = ShardingConfig {
        runner_address: Some(RunnerAddress::new("127.0.0.1", 1)),
        shards_per_group: 8,
        refresh_assignments_interval: Duration::from_millis(50),
        shard_lock_refresh_interval: Duration::from_millis(100),
        entity_message_poll_interval: Duration::from_millis(50),
        ..ShardingConfig::default()
    };
    let sharding = Sharding::member(config, messages, locks).start().await.unwrap();
    sharding.entity::<Stored>().register().unwrap();
    sharding.client::<Stored>("s1").send(Persist).await.unwrap();
    for name in [
        "effect_cluster_shard_acquisitions_total",
        "effect_cluster_shard_lock_refresh_seconds",
        "effect_cluster_read_loop_lag_seconds",
        "effect_cluster_persisted_latency_seconds",
    ] {
        registered(name).await;
    }
    let latencies = gauges().samples.lock().unwrap()["effect_cluster_persisted_latency_seconds{}"]
        .0
        .lock()
        .unwrap()
        .clone();
    assert!(latencies.iter().all(|took| (0.0..10.0).contains(took)), "{latencies:?}");
    let lag = gauge("effect_cluster_read_loop_lag_seconds{}").unwrap();
    assert!(lag < 5.0, "a reading loop lags {lag} s");
    sharding.shutdown().await;
}
