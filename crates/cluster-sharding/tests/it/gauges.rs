//! The `cluster_entities` gauge follows resident instances
//! (`effect/src/cluster/ClusterMetrics.ts`), read through a minimal `metrics` recorder installed
//! for this test binary.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cluster_core::{ShardingConfig, SystemClock};
use cluster_sharding::{
    Entity, EntityContext, EntityOptions, Handler, Protocol, RequestContext, Sharding,
};
use metrics::{
    Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

use crate::entities::{Failure, Get};

/// Gauge values by name and labels.
#[derive(Default)]
struct Gauges {
    values: Mutex<BTreeMap<String, Arc<Value>>>,
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

    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let mut values = self.0.values.lock().unwrap();
        Gauge::from_arc(Arc::clone(values.entry(name(key)).or_default()))
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
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
    let sharding = Sharding::new(config, Arc::new(SystemClock)).unwrap();
    sharding.register::<Meter>(EntityOptions::default()).unwrap();
    for id in ["m1", "m2", "m3"] {
        sharding.client::<Meter>(id).send(Get).await.unwrap();
    }
    assert_eq!(gauge("cluster_entities{type=Meter}"), Some(3.0));
    assert_eq!(gauge("cluster_runners{}"), Some(1.0));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(sharding.active_entity_count(), 0);
    assert_eq!(gauge("cluster_entities{type=Meter}"), Some(0.0));
}
