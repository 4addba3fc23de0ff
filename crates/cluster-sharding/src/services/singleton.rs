//! Singletons: a task that runs on exactly one runner of the cluster, the one that holds the
//! lock of its shard (`effect/src/cluster/Singleton.ts`, effect 4.0.3).
//!
//! A singleton's shard is the shard of its name in its shard group. It starts when its runner
//! acquires that shard and stops when the runner lets the shard go: its cancellation token
//! fires, it gets `entity_termination_timeout` to return, then its future is dropped. The
//! shard's lock is released only once the singleton stopped, so the next owner never runs it
//! at the same time. A stopping singleton counts as running: it is not started again until its
//! stop finished.
//!
//! Departure from the reference (a documented gap there): a singleton whose future panics is
//! started again after a backoff (500 ms growing by half, at most 10 s) while its runner still
//! holds the shard, instead of staying dead until the next shard movement. A singleton whose
//! future returns is done: it is not started again until the shard moves.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::backoff::Backoff;
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::{ShardGroup, ShardId};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::api::entity::RuntimeHandle;
use crate::error::RegisterError;
use crate::metrics;
use crate::runtime::delivery::Serving;

/// The restart backoff after a panic.
const RESTART_FIRST: Duration = Duration::from_millis(500);
const RESTART_MAX: Duration = Duration::from_secs(10);

/// How a singleton runs.
#[derive(Clone, Debug, Default)]
pub struct SingletonOptions {
    /// The shard group of the singleton's shard (`default` if `None`).
    pub shard_group: Option<ShardGroup>,
}

/// What a running singleton gets.
///
/// Its `sharding()` method, the runtime to call entities with, is written where that runtime
/// is (`sharding.rs`): singletons sit below the runtime and do not name it.
#[derive(Clone)]
pub struct SingletonContext {
    name: Arc<str>,
    shard: ShardId,
    /// The runtime, a `Sharding`, held erased.
    pub(crate) runtime: RuntimeHandle,
    cancellation: CancellationToken,
}

impl std::fmt::Debug for SingletonContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SingletonContext")
            .field("name", &self.name)
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl SingletonContext {
    /// The singleton's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shard whose lock this runner holds while the singleton runs.
    pub fn shard(&self) -> &ShardId {
        &self.shard
    }

    /// Cancelled when the singleton must stop (its shard is let go, the runner stops); the
    /// future is dropped `entity_termination_timeout` later if it has not returned.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancellation
    }

    /// Waits `duration`, unless the singleton must stop first; whether it waited the whole
    /// of it (`false`: stop now).
    pub async fn pause(&self, duration: Duration) -> bool {
        pause(&self.cancellation, duration).await
    }
}

/// Waits `duration` unless `cancellation` fires first; whether it waited the whole of it.
pub(crate) async fn pause(cancellation: &CancellationToken, duration: Duration) -> bool {
    tokio::select! {
        () = cancellation.cancelled() => false,
        () = tokio::time::sleep(duration) => true,
    }
}

/// A singleton's body, type-erased.
pub(crate) type Run = Arc<dyn Fn(SingletonContext) -> BoxFuture<'static, ()> + Send + Sync>;

/// What singletons need from the runtime they run in: whether it serves a shard, and itself
/// for their contexts.
pub(crate) trait SingletonHost: Serving + Clone + Send + Sync + 'static {
    /// The runtime, for a singleton's context.
    fn handle(&self) -> RuntimeHandle;
}

/// The registered singletons of a runtime: each runs while the runtime serves its shard.
pub(crate) struct Singletons {
    entries: Mutex<BTreeMap<Arc<str>, Entry>>,
    /// How long a stopping singleton may take to return before it is dropped
    /// (`entity_termination_timeout`).
    grace: Duration,
    /// The runtime's tasks: a singleton's task is awaited at shutdown.
    tasks: TaskTracker,
    /// Cancelled when the runtime stops: an ended singleton is not started again.
    shutdown: CancellationToken,
}

struct Entry {
    shard: ShardId,
    run: Run,
    /// Set while the singleton runs or stops here.
    running: Option<Running>,
}

/// A started singleton.
struct Running {
    /// Asks it to stop.
    stop: CancellationToken,
    /// Set when its task ended.
    ended: CancellationToken,
}

impl Singletons {
    /// No singleton yet; they will run on `tasks` until `shutdown`.
    pub(crate) fn new(
        grace: Duration,
        tasks: TaskTracker,
        shutdown: CancellationToken,
    ) -> Singletons {
        Singletons { entries: Mutex::default(), grace, tasks, shutdown }
    }

    /// The number of singletons running (or stopping) here.
    fn running(&self) -> usize {
        lock(&self.entries).values().filter(|entry| entry.running.is_some()).count()
    }

    /// Adds the singleton `name` of `shard`, not started yet (see [`Singletons::sync`]).
    pub(crate) fn insert(
        &self,
        name: &Arc<str>,
        shard: ShardId,
        run: Run,
    ) -> Result<(), RegisterError> {
        let mut entries = lock(&self.entries);
        if entries.contains_key(name) {
            return Err(RegisterError::SingletonAlreadyRegistered(name.to_string()));
        }
        entries.insert(Arc::clone(name), Entry { shard, run, running: None });
        Ok(())
    }

    /// Starts the singletons whose shard `host` serves and stops the others (without waiting
    /// for them; see [`stop_in`](Singletons::stop_in)).
    pub(crate) fn sync<H: SingletonHost>(self: &Arc<Singletons>, host: &H) {
        let mut to_stop = Vec::new();
        {
            let mut entries = lock(&self.entries);
            for (name, entry) in entries.iter_mut() {
                let serves = host.serves(&entry.shard);
                match (&entry.running, serves) {
                    (None, true) => entry.running = Some(self.start(name, entry, host)),
                    (Some(running), false) => to_stop.push(running.stop.clone()),
                    _ => {}
                }
            }
        }
        for stop in to_stop {
            stop.cancel();
        }
        metrics::set(metrics::SINGLETONS, self.running());
    }

    /// Stops the singletons of `shard` (all of them with `None`) and waits until they ended.
    pub(crate) async fn stop_in(&self, shard: Option<&ShardId>) {
        let ended: Vec<CancellationToken> = {
            let entries = lock(&self.entries);
            entries
                .values()
                .filter(|entry| shard.is_none_or(|shard| entry.shard == *shard))
                .filter_map(|entry| entry.running.as_ref())
                .map(|running| {
                    running.stop.cancel();
                    running.ended.clone()
                })
                .collect()
        };
        futures_util::future::join_all(ended.iter().map(CancellationToken::cancelled)).await;
    }

    fn start<H: SingletonHost>(
        self: &Arc<Singletons>,
        name: &Arc<str>,
        entry: &Entry,
        host: &H,
    ) -> Running {
        let stop = CancellationToken::new();
        let ended = CancellationToken::new();
        let running = Running { stop: stop.clone(), ended: ended.clone() };
        let singletons = Arc::clone(self);
        let host = host.clone();
        let name = Arc::clone(name);
        let shard = entry.shard.clone();
        let run = Arc::clone(&entry.run);
        let span = tracing::info_span!("singleton", singleton = %name, %shard);
        self.tasks.spawn(
            async move {
                let _ended = ended.drop_guard();
                tracing::info!("singleton started");
                singletons.run(&name, shard, run, &stop, &host).await;
                tracing::info!("singleton stopped");
                singletons.ended(&name, &host);
            }
            .instrument(span),
        );
        running
    }

    /// Runs a singleton until it is asked to stop (and the grace period is over), restarting it
    /// after a panic.
    async fn run(
        &self,
        name: &Arc<str>,
        shard: ShardId,
        run: Run,
        stop: &CancellationToken,
        host: &impl SingletonHost,
    ) {
        let grace = self.grace;
        let mut backoff = Backoff::new(RESTART_FIRST, RESTART_MAX, 3, 2);
        loop {
            let context = SingletonContext {
                name: Arc::clone(name),
                shard: shard.clone(),
                runtime: host.handle(),
                cancellation: stop.child_token(),
            };
            // Called inside the guard: the closure may panic before it returns its future.
            let mut body = cluster_core::future::guarded(|| run(context));
            let outcome = tokio::select! {
                outcome = &mut body => Some(outcome),
                () = stop.cancelled() => None,
            };
            match outcome {
                // Done: it stays "running" until the shard moves.
                Some(Ok(())) => {
                    stop.cancelled().await;
                    return;
                }
                Some(Err(_)) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(retry_in = ?delay, "singleton panicked; restarting");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = stop.cancelled() => return,
                    }
                }
                // Asked to stop: a grace period to return on its own, then dropped.
                None => {
                    if tokio::time::timeout(grace, body).await.is_err() {
                        tracing::debug!("singleton did not stop within the grace period: dropped");
                    }
                    return;
                }
            }
        }
    }

    /// A singleton's task ended: it may start again (if its shard is still served here).
    fn ended<H: SingletonHost>(self: &Arc<Singletons>, name: &Arc<str>, host: &H) {
        {
            let mut entries = lock(&self.entries);
            if let Some(entry) = entries.get_mut(name) {
                entry.running = None;
            }
        }
        if !self.shutdown.is_cancelled() {
            self.sync(host);
        }
        metrics::set(metrics::SINGLETONS, self.running());
    }
}
