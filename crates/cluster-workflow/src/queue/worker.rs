//! The cluster engine's durable queue workers ([`QueueWorkers`]): offering items to the
//! persisted queue, and one owned task per registered worker that takes, runs and settles them
//! as the reference's `DurableQueue.makeWorker` over `PersistedQueue.take` does
//! (`effect/src/workflow/DurableQueue.ts`, `effect/src/persistence/PersistedQueue.ts`).
//!
//! A worker's loop claims at most as many items as it has room for (its concurrency), runs each
//! in a task of its own and renews their claims every lock refresh interval. An item's outcome
//! settles its claim: completed once its deferred is completed; retried after
//! [`QueueOptions::retry_delay_after`] when the deferred could not be completed, or failed on the
//! last attempt; failed at once when its element or payload cannot be decoded (it never will
//! be); released, without counting the attempt, when the worker stops. Each refresh also fails
//! the items whose last attempt's claim lapsed.
//!
//! [`QueueWorkers::shutdown`] (the engine's shutdown, or the runtime's, which the loop notices
//! within a poll interval) stops the loops, interrupts the items in flight and releases them.
//! Dropping the workers aborts the loops where they are: their claims lapse and the items run
//! again elsewhere, as after a crash.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cluster_core::DecodeError;
use cluster_core::backoff::Backoff;
use cluster_core::envelope::RawJson;
use cluster_core::error::StorageErrorKind;
use cluster_core::queue_storage::{ClaimBatch, ClaimedItem, QueueClaim, QueueStorage, TakeOptions};
use cluster_core::sync::lock;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout};
use tracing::Instrument;

use super::{Element, QueueOptions, persisted_name};
use crate::engine::{Backend, QueueWorker, WorkflowError};
use crate::id::Token;

/// The deadline of one storage call or deferred completion.
const CALL_DEADLINE: Duration = Duration::from_secs(30);
/// How often an offer is tried, and the first and the longest wait between tries.
const OFFER_ATTEMPTS_MAX: u32 = 5;
const OFFER_BACKOFF_MIN: Duration = Duration::from_millis(500);
const OFFER_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The first and the longest wait after a failed take.
const TAKE_BACKOFF_MIN: Duration = Duration::from_millis(500);
const TAKE_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// The first and the longest wait between attempts to settle a claim (the reference's
/// acknowledgement schedule); settling gives up after the lock expiration.
const SETTLE_BACKOFF_MIN: Duration = Duration::from_millis(200);
const SETTLE_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long a stopping worker spends releasing its items, and a shutdown waits for a worker.
const STOP_DEADLINE: Duration = Duration::from_secs(10);
/// The longest failure text recorded on an item.
const FAILURE_LEN_MAX: usize = 4096;
/// The shortest poll and refresh interval and lock expiration, so that a zero never spins a
/// loop (the reference's floor).
const INTERVAL_MIN: Duration = Duration::from_millis(1);

/// Whether the runtime the workers serve has shut down.
pub(crate) type Stopped = Arc<dyn Fn() -> bool + Send + Sync>;

/// The durable queues of one cluster engine: its store, and the workers registered on it.
pub(crate) struct QueueWorkers {
    storage: Option<Arc<dyn QueueStorage>>,
    options: QueueOptions,
    /// The wake-up of each local worker, by queue: offers made here signal it.
    nudges: Mutex<BTreeMap<String, Arc<Notify>>>,
    /// Tells the loops to stop.
    stop: watch::Sender<bool>,
    /// The loops; dropping them aborts them without releasing their items.
    tasks: Mutex<JoinSet<()>>,
}

impl QueueWorkers {
    /// The queues on `storage` (none without one), worked with `options`.
    pub(crate) fn new(
        storage: Option<Arc<dyn QueueStorage>>,
        options: QueueOptions,
    ) -> QueueWorkers {
        QueueWorkers {
            storage,
            options,
            nudges: Mutex::new(BTreeMap::new()),
            stop: watch::Sender::new(false),
            tasks: Mutex::new(JoinSet::new()),
        }
    }

    fn storage(&self) -> Result<&Arc<dyn QueueStorage>, WorkflowError> {
        self.storage.as_ref().ok_or_else(|| {
            WorkflowError::Invalid(
                "durable queues need a queue storage (WorkflowEngine::cluster_with)".into(),
            )
        })
    }

    /// Stores item `item_id` of `queue` unless it is stored already, and wakes this engine's
    /// worker of the queue. Storage failures are retried with backoff a few times (the
    /// reference's `process` retries its offer); then the caller's run breaks off and its
    /// replay offers again. An element the store refuses (`InvalidInput`, over its size limit)
    /// is not retried: the caller's run ends with a defect.
    pub(crate) async fn offer(
        &self,
        queue: &str,
        item_id: &str,
        token: &Token,
        payload: &RawJson,
    ) -> Result<(), WorkflowError> {
        let storage = self.storage()?;
        let element =
            serde_json::to_string(&Element::new(item_id, token, payload)?).map_err(|error| {
                WorkflowError::Malformed(DecodeError::new("queue item", error.to_string()))
            })?;
        let name = persisted_name(queue);
        let mut backoff = Backoff::new(OFFER_BACKOFF_MIN, OFFER_BACKOFF_MAX, 3, 2);
        let mut attempt = 1;
        let stored = loop {
            let error = match timeout(CALL_DEADLINE, storage.offer(&name, item_id, &element)).await
            {
                Ok(Ok(stored)) => break stored,
                // Refused for good (an element over the store's size limit): no retry, and
                // the typed source lets the run end with a defect instead of replaying.
                Ok(Err(error)) if error.kind() == StorageErrorKind::InvalidInput => {
                    let what = format!("offering to {name} was refused");
                    return Err(WorkflowError::cluster_from(&what, error));
                }
                Ok(Err(error)) => error.to_string(),
                Err(_) => format!("no answer within {CALL_DEADLINE:?}"),
            };
            if attempt == OFFER_ATTEMPTS_MAX {
                return Err(WorkflowError::cluster(format!("offering to {name} failed: {error}")));
            }
            let delay = backoff.next_delay();
            tracing::warn!(queue = %name, item_id, %error, retry_in = ?delay, "offering a queue item failed");
            tokio::time::sleep(delay).await;
            attempt += 1;
        };
        if stored {
            tracing::debug!(queue = %name, item_id, "queue item offered");
            if let Some(nudge) = lock(&self.nudges).get(queue) {
                nudge.notify_one();
            }
        } else {
            tracing::debug!(queue = %name, item_id, "queue item offered before");
        }
        Ok(())
    }

    /// Starts the loop of `worker` on `queue`, completing deferreds through `backend`.
    pub(crate) fn register(
        &self,
        queue: &'static str,
        worker: QueueWorker,
        backend: Weak<dyn Backend>,
        stopped: Stopped,
    ) -> Result<(), WorkflowError> {
        let storage = Arc::clone(self.storage()?);
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| WorkflowError::Invalid("a queue worker runs on a tokio runtime".into()))?;
        if *self.stop.borrow() {
            return Err(WorkflowError::ShutDown);
        }
        let nudge = {
            let mut nudges = lock(&self.nudges);
            if nudges.contains_key(queue) {
                return Err(WorkflowError::Invalid(format!("queue {queue} already has a worker")));
            }
            let nudge = Arc::new(Notify::new());
            nudges.insert(queue.to_owned(), Arc::clone(&nudge));
            nudge
        };
        let options = QueueOptions {
            poll_interval: self.options.poll_interval.max(INTERVAL_MIN),
            lock_refresh_interval: self.options.lock_refresh_interval.max(INTERVAL_MIN),
            lock_expiration: self.options.lock_expiration.max(INTERVAL_MIN),
            ..self.options
        };
        let worker_loop = WorkerLoop {
            queue: persisted_name(queue),
            storage,
            options,
            worker,
            backend,
            stopped,
            nudge,
            stop: self.stop.subscribe(),
            held: Mutex::new(BTreeSet::new()),
        };
        let span = tracing::debug_span!("queue.worker", queue = %worker_loop.queue);
        lock(&self.tasks).spawn_on(run(Arc::new(worker_loop)).instrument(span), &runtime);
        Ok(())
    }

    /// Stops the loops: the items in flight are interrupted and released (their attempts are
    /// not counted), and no item is taken afterwards. Bounded by a deadline.
    pub(crate) async fn shutdown(&self) {
        self.stop.send_replace(true);
        let mut tasks = std::mem::take(&mut *lock(&self.tasks));
        let drained = timeout(STOP_DEADLINE.saturating_mul(2), async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!("queue workers did not stop in time; aborted");
        }
    }
}

/// One worker's loop on one queue.
struct WorkerLoop {
    /// The persisted queue, `DurableQueue/<name>`.
    queue: String,
    storage: Arc<dyn QueueStorage>,
    options: QueueOptions,
    worker: QueueWorker,
    backend: Weak<dyn Backend>,
    stopped: Stopped,
    nudge: Arc<Notify>,
    stop: watch::Receiver<bool>,
    /// The claims of the items in flight, renewed every lock refresh interval.
    held: Mutex<BTreeSet<QueueClaim>>,
}

/// What settles a claim.
#[derive(Debug)]
enum Outcome {
    Complete,
    /// Again after the delay, recording the failure.
    Retry(String, Duration),
    Fail(String),
    Release,
}

/// A claim in [`WorkerLoop::held`] while its item is in flight; dropping it (when the item is
/// settled or its task aborted) removes it.
struct Held {
    worker_loop: Arc<WorkerLoop>,
    claim: QueueClaim,
}

impl Held {
    fn new(worker_loop: &Arc<WorkerLoop>, claim: QueueClaim) -> Held {
        lock(&worker_loop.held).insert(claim.clone());
        Held { worker_loop: Arc::clone(worker_loop), claim }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        lock(&self.worker_loop.held).remove(&self.claim);
    }
}

/// The loop: take while there is room, wait for room, a local offer, the poll interval or the
/// next refresh; on stop, interrupt and release.
async fn run(worker_loop: Arc<WorkerLoop>) {
    let concurrency = worker_loop.worker.concurrency.get();
    let mut items: JoinSet<()> = JoinSet::new();
    let mut refresh = tokio::time::interval(worker_loop.options.lock_refresh_interval);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stop = worker_loop.stop.clone();
    let mut backoff = Backoff::doubling(TAKE_BACKOFF_MIN, TAKE_BACKOFF_MAX);
    tracing::debug!(concurrency, "queue worker started");
    loop {
        if worker_loop.stopping() {
            break;
        }
        let in_flight = u32::try_from(items.len()).unwrap_or(u32::MAX);
        let room = concurrency.saturating_sub(in_flight);
        let mut wait = worker_loop.options.poll_interval;
        if let Some(limit) = NonZeroU32::new(room) {
            match worker_loop.take(limit).await {
                Ok(batch) => {
                    backoff.reset();
                    worker_loop.spawn_batch(batch, &mut items);
                }
                Err(error) => {
                    wait = backoff.next_delay();
                    tracing::warn!(%error, retry_in = ?wait, "taking queue items failed");
                }
            }
        }
        tokio::select! {
            Some(joined) = items.join_next(), if !items.is_empty() => {
                if let Err(error) = joined
                    && error.is_panic()
                {
                    tracing::warn!("a queue item's task panicked; its claim will lapse");
                }
            }
            () = worker_loop.nudge.notified(), if room > 0 => {}
            () = tokio::time::sleep(wait) => {}
            _ = refresh.tick() => worker_loop.refresh().await,
            changed = stop.changed() => {
                if changed.is_err() {
                    break;
                }
            }
        }
    }
    worker_loop.stop_items(items).await;
}

impl WorkerLoop {
    fn stopping(&self) -> bool {
        *self.stop.borrow() || (self.stopped)()
    }

    /// Claims at most `limit` items.
    async fn take(&self, limit: NonZeroU32) -> Result<ClaimBatch, String> {
        let options = TakeOptions {
            limit,
            max_attempts: self.options.max_attempts,
            lock_expiration: self.options.lock_expiration,
        };
        match timeout(CALL_DEADLINE, self.storage.take(&self.queue, &options)).await {
            Ok(result) => result.map_err(|error| error.to_string()),
            Err(_) => Err(format!("no answer within {CALL_DEADLINE:?}")),
        }
    }

    /// Runs each claimed item in a task of its own; fails the rows that cannot be read.
    fn spawn_batch(self: &Arc<Self>, batch: ClaimBatch, items: &mut JoinSet<()>) {
        if !batch.is_empty() {
            tracing::debug!(claimed = batch.len(), "queue items claimed");
        }
        for malformed in batch.malformed {
            let error = malformed.error;
            tracing::warn!(%error, "a claimed queue row cannot be read: dead-lettered");
            let held = Held::new(self, malformed.claim);
            let failure = Outcome::Fail(format!("the row cannot be read: {error}"));
            items.spawn(async move {
                let worker_loop = Arc::clone(&held.worker_loop);
                worker_loop.settle(&held.claim, "(unreadable)", failure).await;
            });
        }
        for item in batch.items {
            let held = Held::new(self, item.claim.clone());
            items.spawn(async move {
                let worker_loop = Arc::clone(&held.worker_loop);
                let outcome = worker_loop.process(&item).await;
                worker_loop.settle(&held.claim, &item.id, outcome).await;
            });
        }
    }

    /// Runs an item and completes its deferred with the result.
    async fn process(&self, item: &ClaimedItem) -> Outcome {
        let (id, attempts) = (item.id.as_str(), item.attempts);
        let element: Element = match serde_json::from_str(&item.element) {
            Ok(element) => element,
            Err(error) => {
                return dead_letter(id, &format!("the element cannot be decoded: {error}"));
            }
        };
        let token = match Token::parse(&element.token) {
            Ok(token) => token,
            Err(error) => return dead_letter(id, &error.to_string()),
        };
        let payload = match RawJson::from_json(element.payload.get().to_owned()) {
            Ok(payload) => payload,
            Err(error) => return dead_letter(id, &format!("the payload cannot be read: {error}")),
        };
        tracing::debug!(item_id = id, attempts, "running a queue item");
        let exit = match (self.worker.run)(payload).await {
            Ok(exit) => exit,
            Err(error) => {
                return dead_letter(id, &format!("the payload cannot be decoded: {error}"));
            }
        };
        let Some(backend) = self.backend.upgrade() else { return Outcome::Release };
        let completed = timeout(CALL_DEADLINE, backend.deferred_done(None, token, exit)).await;
        let error = match completed {
            Ok(Ok(())) => return Outcome::Complete,
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("completing the deferred took over {CALL_DEADLINE:?}"),
        };
        if self.stopping() {
            return Outcome::Release;
        }
        let failure = failure_text(&error);
        if attempts >= self.options.max_attempts.get() {
            tracing::warn!(item_id = id, attempts, %error, "a queue item's last attempt failed: dead-lettered");
            Outcome::Fail(failure)
        } else {
            let retry_in = self.options.retry_delay_after(attempts);
            tracing::warn!(item_id = id, attempts, %error, ?retry_in, "a queue item's result was not recorded: retried");
            Outcome::Retry(failure, retry_in)
        }
    }

    /// Settles `claim` with `outcome`, retrying storage failures with backoff until the lock
    /// expiration; after it the claim has lapsed and the item runs again anyway.
    async fn settle(&self, claim: &QueueClaim, id: &str, outcome: Outcome) {
        let deadline = Instant::now() + self.options.lock_expiration;
        let mut backoff = Backoff::new(SETTLE_BACKOFF_MIN, SETTLE_BACKOFF_MAX, 3, 2);
        loop {
            let settled = match &outcome {
                Outcome::Complete => self.storage.complete(claim),
                Outcome::Retry(failure, delay) => self.storage.retry(claim, *delay, failure),
                Outcome::Fail(failure) => self.storage.fail(claim, failure),
                Outcome::Release => self.storage.release(claim),
            };
            match timeout(CALL_DEADLINE, settled).await {
                Ok(Ok(true)) => {
                    tracing::debug!(item_id = id, ?outcome, "queue item settled");
                    return;
                }
                Ok(Ok(false)) => {
                    tracing::warn!(
                        item_id = id,
                        ?outcome,
                        "a queue item's claim lapsed before it was settled: another worker has it"
                    );
                    return;
                }
                Ok(Err(error)) => {
                    tracing::warn!(item_id = id, %error, "settling a queue item failed")
                }
                Err(_) => tracing::warn!(item_id = id, "settling a queue item timed out"),
            }
            let delay = backoff.next_delay();
            if Instant::now() + delay > deadline {
                tracing::warn!(
                    item_id = id,
                    ?outcome,
                    "gave up settling a queue item: its claim lapses and it runs again"
                );
                return;
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// Renews the claims in flight and fails the items whose last attempt's claim lapsed.
    async fn refresh(&self) {
        let claims: Vec<QueueClaim> = lock(&self.held).iter().cloned().collect();
        if !claims.is_empty() {
            match timeout(CALL_DEADLINE, self.storage.refresh(&claims)).await {
                Ok(Ok(renewed)) if usize::try_from(renewed).is_ok_and(|n| n < claims.len()) => {
                    tracing::warn!(renewed, held = claims.len(), "some queue claims lapsed");
                }
                Ok(Ok(_)) => {}
                Ok(Err(error)) => tracing::warn!(%error, "renewing queue claims failed"),
                Err(_) => tracing::warn!("renewing queue claims timed out"),
            }
        }
        let options = &self.options;
        let exhausted =
            self.storage.fail_exhausted(&self.queue, options.max_attempts, options.lock_expiration);
        match timeout(CALL_DEADLINE, exhausted).await {
            Ok(Ok(0)) => {}
            Ok(Ok(failed)) => tracing::warn!(
                failed,
                "queue items dead-lettered: the claim of their last attempt lapsed"
            ),
            Ok(Err(error)) => tracing::warn!(%error, "failing exhausted queue items failed"),
            Err(_) => tracing::warn!("failing exhausted queue items timed out"),
        }
    }

    /// Interrupts the items in flight and releases their claims.
    async fn stop_items(&self, mut items: JoinSet<()>) {
        let claims: Vec<QueueClaim> = lock(&self.held).iter().cloned().collect();
        items.shutdown().await;
        let releases =
            claims.iter().map(|claim| timeout(STOP_DEADLINE, self.storage.release(claim)));
        let mut released = 0;
        for result in futures_util::future::join_all(releases).await {
            match result {
                Ok(Ok(true)) => released += 1,
                Ok(Ok(false)) => {}
                Ok(Err(error)) => tracing::warn!(%error, "releasing a queue item failed"),
                Err(_) => tracing::warn!("releasing a queue item timed out"),
            }
        }
        tracing::debug!(released, "queue worker stopped");
    }
}

/// An item that can never succeed: failed at once, with `failure`.
fn dead_letter(id: &str, failure: &str) -> Outcome {
    tracing::warn!(item_id = id, failure, "a queue item cannot be run: dead-lettered");
    Outcome::Fail(failure_text(failure))
}

/// `failure`, cut to [`FAILURE_LEN_MAX`] characters.
fn failure_text(failure: &str) -> String {
    match failure.char_indices().nth(FAILURE_LEN_MAX) {
        Some((end, _)) => failure[..end].to_owned(),
        None => failure.to_owned(),
    }
}
