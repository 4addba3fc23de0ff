//! Singletons on one runner: started at registration, stopped at shutdown, restarted after a
//! panic (a gap of the reference, `effect/src/cluster/Singleton.ts`), unique by name. The
//! cluster-wide cases are in `cluster.rs`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_sharding::{RegisterError, RegistrationEvent, Sharding, SingletonOptions};

use crate::{eventually, sharding};

/// What the tests observe of one singleton (by name; tests run side by side).
#[derive(Default)]
pub(crate) struct Tally {
    /// Instances running right now, on any runner.
    pub(crate) running: AtomicUsize,
    /// The most that ever ran at once.
    pub(crate) max_running: AtomicUsize,
    pub(crate) starts: AtomicUsize,
    /// Runs that saw their cancellation and returned.
    pub(crate) stopped: AtomicUsize,
    /// Runs left to panic.
    pub(crate) panics: AtomicUsize,
}

impl Tally {
    pub(crate) fn of(name: &str) -> Arc<Tally> {
        static TALLIES: OnceLock<Mutex<BTreeMap<String, Arc<Tally>>>> = OnceLock::new();
        let tallies = TALLIES.get_or_init(Mutex::default);
        Arc::clone(tallies.lock().unwrap().entry(name.to_owned()).or_default())
    }
}

/// Counts a run as running until dropped (it may end by cancellation or by being dropped).
struct Run(Arc<Tally>);

impl Drop for Run {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Registers a singleton that runs until cancelled (or panics once per `panics`).
pub(crate) fn register(sharding: &Sharding, name: &str) -> Result<(), RegisterError> {
    let tally = Tally::of(name);
    sharding.register_singleton(name, SingletonOptions::default(), move |context| {
        let tally = Arc::clone(&tally);
        async move {
            tally.starts.fetch_add(1, Ordering::SeqCst);
            let running = tally.running.fetch_add(1, Ordering::SeqCst) + 1;
            tally.max_running.fetch_max(running, Ordering::SeqCst);
            let _run = Run(Arc::clone(&tally));
            if tally.panics.load(Ordering::SeqCst) > 0 {
                tally.panics.fetch_sub(1, Ordering::SeqCst);
                panic!("a defect in the singleton");
            }
            context.cancellation().cancelled().await;
            // Stopping takes a while: the next owner must wait for it.
            tokio::time::sleep(Duration::from_millis(100)).await;
            tally.stopped.fetch_add(1, Ordering::SeqCst);
        }
    })
}

#[tokio::test(start_paused = true)]
async fn a_singleton_runs_from_registration_to_shutdown() {
    let sharding = sharding(ShardingConfig::default()).await;
    let mut events = sharding.registration_events();
    register(&sharding, "lonely").unwrap();
    let tally = Tally::of("lonely");
    eventually("the singleton starts", || tally.running.load(Ordering::SeqCst) == 1).await;
    assert_eq!(
        events.recv().await.unwrap(),
        RegistrationEvent::SingletonRegistered("lonely".to_owned())
    );
    let again = register(&sharding, "lonely");
    assert!(
        matches!(again, Err(RegisterError::SingletonAlreadyRegistered(ref name)) if name == "lonely")
    );
    sharding.shutdown().await;
    assert_eq!(tally.running.load(Ordering::SeqCst), 0);
    assert_eq!(tally.stopped.load(Ordering::SeqCst), 1, "it saw its cancellation");
    assert_eq!(tally.starts.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_singleton_is_started_again() {
    let sharding = sharding(ShardingConfig::default()).await;
    let tally = Tally::of("fragile");
    tally.panics.store(2, Ordering::SeqCst);
    register(&sharding, "fragile").unwrap();
    eventually("it runs after two panics", || {
        tally.starts.load(Ordering::SeqCst) == 3 && tally.running.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(tally.max_running.load(Ordering::SeqCst), 1);
    sharding.shutdown().await;
}

/// A singleton closure that panics before it returns its future is started again, as one that
/// panics while it runs.
#[tokio::test(start_paused = true)]
async fn a_singleton_panicking_before_its_future_is_started_again() {
    let sharding = sharding(ShardingConfig::default()).await;
    let (calls, running) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (counted, runs) = (Arc::clone(&calls), Arc::clone(&running));
    sharding
        .register_singleton("hasty", SingletonOptions::default(), move |context| {
            if counted.fetch_add(1, Ordering::SeqCst) < 2 {
                std::panic::panic_any("a singleton that panics before returning its future");
            }
            let running = Arc::clone(&runs);
            async move {
                running.fetch_add(1, Ordering::SeqCst);
                context.cancellation().cancelled().await;
            }
        })
        .unwrap();
    eventually("it runs after two panics", || running.load(Ordering::SeqCst) == 1).await;
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_singleton_that_ignores_its_cancellation_is_dropped_after_the_grace_period() {
    let config = ShardingConfig {
        entity_termination_timeout: Duration::from_secs(3),
        ..ShardingConfig::default()
    };
    let sharding = sharding(config).await;
    let dropped = Arc::new(AtomicUsize::new(0));
    let tally = Arc::clone(&dropped);
    sharding
        .register_singleton("stubborn", SingletonOptions::default(), move |_| {
            let dropped = Arc::clone(&tally);
            async move {
                let _guard = Dropped(dropped);
                std::future::pending::<()>().await;
            }
        })
        .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    sharding.shutdown().await;
    assert!(started.elapsed() >= Duration::from_secs(3), "it got the grace period");
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
}

struct Dropped(Arc<AtomicUsize>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_only_process_runs_no_singleton() {
    let sharding =
        sharding(ShardingConfig { runner_address: None, ..ShardingConfig::default() }).await;
    register(&sharding, "nowhere").unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(Tally::of("nowhere").starts.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_cron_job_with_a_bad_expression_or_a_taken_name_is_refused() {
    use cluster_sharding::{CronError, CronOptions};

    let never = |_| async { Ok::<(), std::convert::Infallible>(()) };
    let volatile = sharding(ShardingConfig::default()).await;
    let stored = volatile.register_cron("stored", "0 3 * * *", CronOptions::default(), never);
    assert!(matches!(stored, Err(CronError::NoMessageStorage)), "{stored:?}");
    let (sharding, _storage) = crate::on_memory_storage(ShardingConfig::default()).await;
    let bad = sharding.register_cron("bad", "every tuesday", CronOptions::default(), never);
    assert!(
        matches!(bad, Err(CronError::InvalidExpression { ref expression, .. }) if expression == "every tuesday"),
        "{bad:?}"
    );
    sharding.register_cron("nightly", "0 3 * * *", CronOptions::default(), never).unwrap();
    let again = sharding.register_cron("nightly", "0 4 * * *", CronOptions::default(), never);
    assert!(
        matches!(again, Err(CronError::Register(RegisterError::AlreadyRegistered(_)))),
        "{again:?}"
    );
    sharding.shutdown().await;
}
