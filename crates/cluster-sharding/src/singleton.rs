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
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::{ShardGroup, ShardId};
use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::RegisterError;
use crate::metrics;
use crate::sharding::Sharding;

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
#[derive(Clone, Debug)]
pub struct SingletonContext {
    name: Arc<str>,
    shard: ShardId,
    sharding: Sharding,
    cancellation: CancellationToken,
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

    /// The runtime, to call entities.
    pub fn sharding(&self) -> &Sharding {
        &self.sharding
    }

    /// Cancelled when the singleton must stop (its shard is let go, the runner stops); the
    /// future is dropped `entity_termination_timeout` later if it has not returned.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancellation
    }
}

/// A singleton's body, type-erased.
type Run = Arc<dyn Fn(SingletonContext) -> BoxFuture<'static, ()> + Send + Sync>;

/// The registered singletons of a runtime.
#[derive(Default)]
pub(crate) struct Singletons {
    entries: Mutex<BTreeMap<Arc<str>, Entry>>,
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
    /// The number of singletons running (or stopping) here.
    fn running(&self) -> usize {
        lock(&self.entries).values().filter(|entry| entry.running.is_some()).count()
    }
}

impl Sharding {
    /// Registers the singleton `name`: `run` is called on the one runner that holds the lock
    /// of the name's shard, again whenever the shard comes back to this runner, and (after a
    /// backoff) when it panics. It stops (its [`SingletonContext::cancellation`] fires, then
    /// it gets `entity_termination_timeout` before it is dropped) before the shard's lock is
    /// released. In a client-only process this is a no-op, as in the reference.
    ///
    /// ```
    /// use cluster_core::ShardingConfig;
    /// use cluster_sharding::{Sharding, SingletonOptions};
    /// use tokio::sync::mpsc;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let sharding = Sharding::builder(ShardingConfig::default()).start().await?;
    /// let (events, mut received) = mpsc::channel(4);
    /// sharding.register_singleton("reaper", SingletonOptions::default(), move |context| {
    ///     let events = events.clone();
    ///     async move {
    ///         let _ = events.send("started").await;
    ///         // Work until the runner stops or hands the singleton's shard over.
    ///         context.cancellation().cancelled().await;
    ///         let _ = events.send("stopped").await;
    ///     }
    /// })?;
    /// assert_eq!(received.recv().await, Some("started"));
    /// sharding.shutdown().await;
    /// assert_eq!(received.recv().await, Some("stopped"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_singleton<F, Fut>(
        &self,
        name: impl Into<String>,
        options: SingletonOptions,
        run: F,
    ) -> Result<(), RegisterError>
    where
        F: Fn(SingletonContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if self.is_shutdown() {
            return Err(RegisterError::ShuttingDown);
        }
        if !self.is_runner() {
            return Ok(());
        }
        let name: Arc<str> = Arc::from(name.into());
        let group = options.shard_group.unwrap_or_else(ShardGroup::default_group);
        let shard = self.shard_id(&name, &group);
        let run: Run = Arc::new(move |context| Box::pin(run(context)));
        {
            let mut entries = lock(&self.singletons().entries);
            if entries.contains_key(&name) {
                return Err(RegisterError::SingletonAlreadyRegistered(name.to_string()));
            }
            entries.insert(Arc::clone(&name), Entry { shard, run, running: None });
        }
        tracing::debug!(singleton = %name, "singleton registered");
        self.publish(crate::RegistrationEvent::SingletonRegistered(name.to_string()));
        self.sync_singletons();
        Ok(())
    }

    /// Starts the singletons whose shard this runner serves and stops the others (without
    /// waiting for them; see [`stop_singletons_in`](Sharding::stop_singletons_in)).
    pub(crate) fn sync_singletons(&self) {
        let mut to_stop = Vec::new();
        {
            let mut entries = lock(&self.singletons().entries);
            for (name, entry) in entries.iter_mut() {
                let serves = self.serves(&entry.shard);
                match (&entry.running, serves) {
                    (None, true) => entry.running = Some(self.start_singleton(name, entry)),
                    (Some(running), false) => to_stop.push(running.stop.clone()),
                    _ => {}
                }
            }
        }
        for stop in to_stop {
            stop.cancel();
        }
        metrics::set(metrics::SINGLETONS, self.singletons().running());
    }

    /// Stops the singletons of `shard` (all of them with `None`) and waits until they ended.
    pub(crate) async fn stop_singletons_in(&self, shard: Option<&ShardId>) {
        let ended: Vec<CancellationToken> = {
            let entries = lock(&self.singletons().entries);
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

    fn start_singleton(&self, name: &Arc<str>, entry: &Entry) -> Running {
        let stop = CancellationToken::new();
        let ended = CancellationToken::new();
        let running = Running { stop: stop.clone(), ended: ended.clone() };
        let sharding = self.clone();
        let name = Arc::clone(name);
        let shard = entry.shard.clone();
        let run = Arc::clone(&entry.run);
        let span = tracing::info_span!("singleton", singleton = %name, %shard);
        self.spawn_owned(
            async move {
                let _ended = ended.drop_guard();
                tracing::info!("singleton started");
                sharding.run_singleton(&name, shard, run, &stop).await;
                tracing::info!("singleton stopped");
                sharding.singleton_ended(&name);
            }
            .instrument(span),
        );
        running
    }

    /// Runs a singleton until it is asked to stop (and the grace period is over), restarting it
    /// after a panic.
    async fn run_singleton(
        &self,
        name: &Arc<str>,
        shard: ShardId,
        run: Run,
        stop: &CancellationToken,
    ) {
        let grace = self.config().entity_termination_timeout;
        let mut backoff = RESTART_FIRST;
        loop {
            let context = SingletonContext {
                name: Arc::clone(name),
                shard: shard.clone(),
                sharding: self.clone(),
                cancellation: stop.child_token(),
            };
            let mut body = AssertUnwindSafe(run(context)).catch_unwind();
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
                    tracing::warn!(retry_in = ?backoff, "singleton panicked; restarting");
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = stop.cancelled() => return,
                    }
                    backoff = backoff.mul_f64(1.5).min(RESTART_MAX);
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
    fn singleton_ended(&self, name: &Arc<str>) {
        {
            let mut entries = lock(&self.singletons().entries);
            if let Some(entry) = entries.get_mut(name) {
                entry.running = None;
            }
        }
        if !self.is_shutdown() {
            self.sync_singletons();
        }
        metrics::set(metrics::SINGLETONS, self.singletons().running());
    }
}
