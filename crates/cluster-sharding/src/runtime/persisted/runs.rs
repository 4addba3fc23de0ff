//! Runs: hands a claimed persisted request to its entity and stores what it produced.
//!
//! Every delivery path ends here: the read loop (`read`), direct delivery (`direct`), pushed
//! requests (`pushed`) and re-runs.
//! [`Runs::dispatch`] claims the request (`tracked`), checks the shard's lease, and hands the
//! request to its entity's mailbox without waiting in between.
//! A task of the runtime then stores the outcome ([`Runs::store_outcome`]): the chunks of a
//! stream, then the final reply once the shard's lock is confirmed (fencing).
//!
//! A run takes only what it uses: the storage, the shards served, the entity managers, the
//! tracked requests, the shard write drain and the reply waiters.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{Envelope, Exit, Reply, Request, WithExit};
use cluster_core::future::BoxFuture;
use cluster_core::storage::{MessageStorage, UnprocessedMessage};
use cluster_core::{Clock, ClusterError, EntityType, ShardId, Snowflake};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::lifecycle::{Busy, Claiming};
use super::tracked::{InFlight, TrackedRequests};
use super::waiters::ReplyWaiters;
use super::writes::{ShardWrites, WriteGuard};
use crate::api::entity::Ids;
use crate::api::state::{Committed, StateHandOff};
use crate::placement::shards::Shards;
use crate::runtime::delivery::{
    Delivery, PendingTransaction, ReadLatch, Refused, ReplyTo, StreamReplies,
};
use crate::runtime::interrupt::InterruptSignal;
use crate::runtime::local::STREAM_BUFFER;
use crate::runtime::registry::Managers;

/// How often saving a final reply is tried before the request is left for a later read.
const SAVE_REPLY_ATTEMPTS: u32 = 4;
/// The pause between those attempts (the reference's 200 ms).
const SAVE_REPLY_SPACING: Duration = Duration::from_millis(200);

/// Hands claimed requests to their entities and stores their outcomes.
pub(super) struct Runs {
    pub(super) storage: Arc<dyn MessageStorage>,
    /// The shards this runtime serves: the lease, fencing and shutdown.
    pub(super) serving: Arc<Shards>,
    pub(super) managers: Arc<Managers>,
    /// The requests taken up here, from their claim to their stored outcome.
    pub(super) tracked: Arc<TrackedRequests>,
    /// The requests taken up and not settled, counted per shard.
    pub(super) writes: Arc<ShardWrites>,
    /// The local callers, told of each reply stored here.
    pub(super) waiters: Arc<ReplyWaiters>,
    /// Wakes the storage read loop (a fenced or released request).
    pub(super) read_latch: Arc<ReadLatch>,
    pub(super) ids: Arc<Ids>,
    pub(super) clock: Arc<dyn Clock>,
    /// The runtime's tasks: the outcome writers.
    pub(super) tasks: TaskTracker,
    /// How long messages of an unregistered entity type are held (twice this) before they
    /// are answered with a defect.
    pub(super) registration_timeout: Duration,
    /// The pause before a re-run retries a full mailbox or the residency cap.
    pub(super) retry_interval: Duration,
}

impl Runs {
    /// Wakes the storage read loop.
    fn poll_storage(&self) {
        self.read_latch.wake();
    }

    /// Takes up one stored message.
    ///
    /// - A request goes to its entity.
    ///   It is claimed first, so that it runs once however many paths find it.
    /// - An interrupt or an acknowledgement goes to the request it belongs to.
    ///
    /// Nothing here waits, so nothing can change between the checks that admit a request and
    /// its arrival in the mailbox.
    /// (A `WITH_TRANSACTION` request's transaction is begun by its instance, not here.)
    /// `claiming` says who dispatches (see [`Claiming`]).
    pub(super) fn dispatch(
        self: &Arc<Self>,
        message: UnprocessedMessage,
        unregistered: &mut Unregistered,
        claiming: Claiming,
    ) -> Dispatched {
        let request = match message.envelope {
            Envelope::Request(request) => request,
            envelope => {
                self.tracked.forward(&envelope);
                return Dispatched::Skipped;
            }
        };
        let request_id = request.request_id;
        let shard = request.address.shard_id.clone();
        let Some(manager) = self.managers.get(&request.address.entity_type) else {
            if !self.serving.serves(&shard) {
                return Dispatched::Release(request_id);
            }
            let timeout = self.registration_timeout;
            return match unregistered.hold(&request.address.entity_type, timeout) {
                true => Dispatched::Release(request_id),
                false => {
                    let message =
                        format!("Entity type '{}' not registered", request.address.entity_type);
                    let defect = Exit::die_with_message("Error", &message);
                    Dispatched::Answer(self.final_reply(request_id, defect))
                }
            };
        };
        unregistered.registered(&request.address.entity_type);
        let cancellation = InterruptSignal::new();
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (acks, reply, outcome) = if manager.is_stream(&request.tag) {
            let last_sent = match message.last_sent_reply {
                Some(Reply::Chunk(chunk)) => Some(chunk),
                _ => None,
            };
            let (replies, replied) = mpsc::channel(STREAM_BUFFER);
            let (acked, acks) = mpsc::channel(STREAM_BUFFER);
            let reply = ReplyTo::Stream(StreamReplies { replies, acks, last_sent });
            (Some(acked), reply, Outcome::Stream(replied))
        } else {
            let (reply, exit) = oneshot::channel();
            (None, ReplyTo::Exit(reply), Outcome::Exit(exit))
        };
        let in_flight = InFlight::new(cancellation.clone(), Arc::clone(&started), acks);
        let claim = match self.tracked.claim(request_id, in_flight, claiming) {
            Ok(claim) => claim,
            // Already being processed (AlreadyProcessingMessage): its reply will complete it.
            Err(Busy::Running) => return Dispatched::Skipped,
            // Another dispatch is handing it to its entity: the read's later requests to that
            // entity wait for the next read, which comes soon, so that they do not go first.
            Err(Busy::Arriving) if claiming == Claiming::Read => {
                return Dispatched::Retry(request_id);
            }
            Err(Busy::Arriving) => return Dispatched::Skipped,
            Err(Busy::Settled) => return Dispatched::Settled(request_id),
        };
        // Before the shard's check.
        // So a release that stops serving the shard after the check waits for this request's
        // outcome before it lets the lock go.
        let write = self.writes.begin(&shard);
        if !self.serving.delivers(&shard) {
            // The shard was let go since the read (its next owner runs the request), or its
            // lease lapsed (the next read after a refresh delivers it).
            return Dispatched::Release(request_id);
        }
        let transaction = manager
            .with_transaction(&request.tag, &request.payload)
            .then(|| PendingTransaction::new(Arc::clone(&self.storage)));
        let rerun = manager.rerun_on_interrupt(&request.tag).then(|| request.clone());
        // A unary request to an entity with durable state hands its state write to
        // `store_outcome`, which commits it with the final reply.
        let (state_sink, state) = match &outcome {
            Outcome::Exit(_) if manager.has_state() => {
                let (sink, state) = oneshot::channel();
                (Some(sink), Some(state))
            }
            _ => (None, None),
        };
        let delivery = Delivery {
            request,
            cancellation,
            reply,
            transaction: transaction.clone(),
            started: Some(started),
            state: state_sink,
        };
        match manager.deliver(Box::new(delivery), &*self.serving) {
            Ok(()) => {
                claim.keep();
                let sent = Sent { request_id, shard, outcome, transaction, rerun, write, state };
                self.tasks.spawn(Arc::clone(self).store_outcome(sent));
                Dispatched::Delivered
            }
            Err(refused) => {
                tracing::debug!(?refused, %request_id, "not delivered; retried on a later read");
                match refused {
                    Refused::ResidencyFull(_) => Dispatched::Capped(request_id),
                    Refused::Cluster(ClusterError::MailboxFull { .. }) => {
                        Dispatched::Retry(request_id)
                    }
                    Refused::Cluster(_) => Dispatched::Release(request_id),
                }
            }
        }
    }

    /// Stores what a delivered request produced: its chunks (a stream) and its final reply.
    ///
    /// A request interrupted by shutdown, or whose entity went away, is left stored for the
    /// next run.
    fn store_outcome(self: Arc<Self>, sent: Sent) -> BoxFuture<'static, ()> {
        // Boxed: a re-run dispatches again, which spawns another `store_outcome`.
        Box::pin(async move {
            let Sent { request_id, shard, outcome, transaction, rerun, write, state } = sent;
            let exit = match outcome {
                Outcome::Exit(exit) => exit.await.ok(),
                Outcome::Stream(mut replies) => {
                    let mut exit = None;
                    while let Some(reply) = replies.recv().await {
                        match reply {
                            Reply::Chunk(_) => {
                                // A chunk the storage refuses is never stored, so never
                                // acknowledged: the stream ends here with a defect, and the
                                // handler's next send fails once `replies` is dropped.
                                if let Err(refused) = self.save_reply_retrying(&reply).await {
                                    let message = format!(
                                        "a chunk of the stream could not be stored: {refused}"
                                    );
                                    exit = Some(Exit::die_with_message("ReplyNotStored", &message));
                                    break;
                                }
                            }
                            Reply::WithExit(with_exit) => {
                                exit = Some(with_exit.exit);
                                break;
                            }
                        }
                    }
                    exit
                }
            };
            // The instance hands a state write over before the exit: it is here by now.
            let state = state.and_then(|mut state| state.try_recv().ok());
            // The read loop must not take it up again while its outcome is stored.
            let _settle = self.tracked.settle(request_id);
            // Held from the claim to here: the shard's release waits for the outcome.
            let _write = write;
            let transaction = match transaction {
                Some(transaction) => transaction.take().await,
                None => None,
            };
            if let Some(transaction) = transaction {
                match exit {
                    Some(exit) if exit.is_success() => {
                        if !self.serving.confirm(&shard).await {
                            let _ = transaction.rollback().await;
                            return self.fenced(request_id, &shard).await;
                        }
                        let reply = self.final_reply(request_id, exit);
                        self.commit_final_reply(transaction, reply, &shard, state).await;
                        return;
                    }
                    // A failure is saved after the rollback
                    // (`effect/src/cluster/SqlMessageStorage.ts`).
                    _ => {
                        if let Err(error) = transaction.rollback().await {
                            tracing::debug!(%error, %request_id, "rollback failed");
                        }
                    }
                }
            }
            match exit {
                // Interrupted because this runner stops serving the shard (shutdown, a
                // rebalance, lost locks).
                // It is left stored for the next owner.
                Some(Exit::Failure(cause))
                    if cause.has_interrupts_only() && !self.serving.serves(&shard) =>
                {
                    let _ = self.storage.reset_requests(&[request_id]).await;
                }
                // Server-side uninterruptible: an interrupt runs it again instead of answering it.
                Some(Exit::Failure(cause)) if cause.has_interrupts_only() && rerun.is_some() => {
                    if let Some(request) = rerun {
                        self.rerun(request).await;
                    }
                }
                Some(_) if !self.serving.confirm(&shard).await => {
                    self.fenced(request_id, &shard).await;
                }
                Some(exit) => {
                    let reply = self.final_reply(request_id, exit);
                    self.save_final_reply_with(reply, Some(&shard), state).await;
                }
                None => {
                    let _ = self.storage.reset_requests(&[request_id]).await;
                }
            }
        })
    }

    /// The lock of `shard` was not confirmed (effect 4.1.0 fencing).
    ///
    /// - The final reply is not stored.
    /// - The claim is released for the shard's next owner.
    /// - The next owner may be this runner: only the confirmation may have failed (a storage
    ///   call that failed or timed out), the lock still held.
    ///   So the lock is confirmed once more, and if it is held the read loop is woken: its next
    ///   read runs the request again, rather than its next poll.
    ///   Otherwise nothing is woken: a runner whose lock storage fails would run the request
    ///   again and again, each run fenced.
    ///   A shard that moved is read by its new owner when it takes it.
    /// - Local callers keep waiting; they read the reply from storage once that owner stores it.
    async fn fenced(self: &Arc<Self>, request_id: Snowflake, shard: &ShardId) {
        if let Err(error) = self.storage.reset_requests(&[request_id]).await {
            tracing::debug!(%error, %request_id, "could not release a fenced request's claim");
        }
        if self.serving.confirm(shard).await {
            tracing::debug!(%request_id, "fenced request released; its lock is held: reading storage again");
            self.poll_storage();
        }
    }

    /// Hands an interrupted server-side uninterruptible request to its entity again
    /// (`effect/src/cluster/internal/entityManager.ts`).
    ///
    /// It waits out a full mailbox or the residency cap.
    /// If the runner stops first, the request stays stored for the next run.
    async fn rerun(self: &Arc<Self>, request: Request) {
        let request_id = request.request_id;
        tracing::debug!(%request_id, "interrupted uninterruptible request runs again");
        loop {
            if self.serving.shutdown().is_cancelled() {
                let _ = self.storage.reset_requests(&[request_id]).await;
                return;
            }
            let message = UnprocessedMessage {
                envelope: Envelope::Request(request.clone()),
                last_sent_reply: None,
            };
            let mut unregistered = Unregistered::default();
            let dispatched = self.dispatch(message, &mut unregistered, Claiming::Rerun);
            unregistered.warn();
            match dispatched {
                Dispatched::Delivered | Dispatched::Skipped | Dispatched::Settled(_) => return,
                Dispatched::Answer(reply) => {
                    return self.save_final_reply(reply, None).await;
                }
                Dispatched::Release(_) => {
                    let _ = self.storage.reset_requests(&[request_id]).await;
                    self.poll_storage();
                    return;
                }
                Dispatched::Retry(_) | Dispatched::Capped(_) => {
                    tokio::time::sleep(self.retry_interval).await;
                }
            }
        }
    }

    /// Saves a successful request's final reply inside its transaction, and commits.
    ///
    /// - The local waiters hear of the reply only after the commit (effect 4.0.3).
    /// - If the commit's outcome is unknown, storage decides.
    ///   A stored final reply means that the commit happened; otherwise the request runs again.
    /// - A reply the storage refuses (a value over its limit) is never committed: the
    ///   transaction rolls back, and the request is answered with a `ReplyNotStored` defect,
    ///   as outside a transaction ([`save_final_reply`](Self::save_final_reply)).
    /// - An entity's state write (`state`) goes into the same transaction, before the reply.
    ///   A stale revision rolls everything back, and the request is left for the shard's owner.
    async fn commit_final_reply(
        self: &Arc<Self>,
        mut transaction: Box<dyn cluster_core::storage::MessageTransaction>,
        reply: Reply,
        shard: &ShardId,
        state: Option<StateHandOff>,
    ) {
        let request_id = reply.request_id();
        let written = match &state {
            Some(state) => transaction.save_state(&state.write).await,
            None => Ok(()),
        };
        let saved = match written {
            Ok(()) => transaction.save_reply(&reply).await,
            Err(error) => Err(error),
        };
        let committed = match saved {
            Ok(()) => transaction.commit().await,
            Err(error) => {
                let _ = transaction.rollback().await;
                if error.kind() == cluster_core::error::StorageErrorKind::StaleState {
                    tracing::warn!(%error, %request_id, "stale entity state: the reply is not stored");
                    return self.fenced(request_id, shard).await;
                }
                if error.kind() == cluster_core::error::StorageErrorKind::InvalidInput {
                    tracing::warn!(%error, %request_id, "a transactional reply cannot be stored: its writes are rolled back");
                    return self.save_final_reply(reply, Some(shard)).await;
                }
                Err(error)
            }
        };
        match committed {
            Ok(()) => {
                self.record_answered(&reply);
                self.waiters.on_reply_saved(&reply);
                if let Some(state) = state {
                    let _ = state.committed.send(Committed::Yes);
                }
            }
            Err(error) => {
                tracing::warn!(%error, %request_id, "could not commit a reply");
                let stored = self.storage.replies_for(&[request_id]).await.unwrap_or_default();
                match stored.into_iter().find(Reply::is_final) {
                    Some(final_reply) => {
                        self.waiters.on_reply_saved(&final_reply);
                    }
                    None => {
                        let _ = self.storage.reset_requests(&[request_id]).await;
                        self.poll_storage();
                    }
                }
            }
        }
    }

    /// Records the time from a request's save (its id's timestamp) to its stored final reply.
    fn record_answered(&self, reply: &Reply) {
        let saved = reply.request_id().timestamp();
        let took = self.clock.now().saturating_duration_since(saved);
        ::metrics::histogram!(crate::metrics::PERSISTED_LATENCY).record(took.as_secs_f64());
    }

    /// Stores a chunk (retrying a few times) and hands it to local waiters.
    ///
    /// `Err` is a chunk the storage refuses for good (`InvalidInput`, over its size limit);
    /// other failures are logged once the retries are spent.
    async fn save_reply_retrying(
        self: &Arc<Self>,
        reply: &Reply,
    ) -> Result<(), cluster_core::StorageError> {
        for attempt in 1..=SAVE_REPLY_ATTEMPTS {
            match self.storage.save_reply(reply).await {
                Ok(()) => {
                    self.waiters.on_reply_saved(reply);
                    return Ok(());
                }
                // A conflict is not a passing failure: no retry stores the chunk.
                // Either an earlier attempt stored it and its acknowledgement was lost (a
                // storage that rejects the same chunk twice says so).
                // Or a chunk of another run holds its sequence.
                Err(error) if error.kind() == cluster_core::error::StorageErrorKind::Conflict => {
                    self.chunk_conflict(reply, &error).await;
                    return Ok(());
                }
                // The storage cannot hold this chunk (a value over its limit): no retry would.
                Err(error)
                    if error.kind() == cluster_core::error::StorageErrorKind::InvalidInput =>
                {
                    tracing::warn!(%error, request_id = %reply.request_id(), "a chunk cannot be stored; ending the stream with a defect");
                    return Err(error);
                }
                Err(error) if attempt < SAVE_REPLY_ATTEMPTS => {
                    tracing::debug!(%error, attempt, "could not save a chunk, retrying");
                    tokio::time::sleep(SAVE_REPLY_SPACING).await;
                }
                // The caller never sees this chunk and so never acknowledges it: the stream
                // stalls until the request is interrupted or the runner restarts.
                Err(error) => {
                    tracing::warn!(%error, request_id = %reply.request_id(), "could not save a chunk")
                }
            }
        }
        Ok(())
    }

    /// A chunk's save hit a stored reply.
    ///
    /// - If it is this chunk, an attempt whose acknowledgement was lost stored it.
    ///   The local waiters get it as if this save had succeeded.
    ///   (Otherwise only the reply poller would hand it over.)
    /// - Otherwise the conflict is logged.
    async fn chunk_conflict(self: &Arc<Self>, reply: &Reply, error: &cluster_core::StorageError) {
        let request_id = reply.request_id();
        match self.storage.replies_for_unfiltered(&[request_id]).await {
            Ok(stored) if stored.iter().any(|stored| stored.id() == reply.id()) => {
                tracing::debug!(%request_id, reply_id = %reply.id(), "chunk already stored");
                self.waiters.on_reply_saved(reply);
            }
            Ok(_) => {
                tracing::warn!(%error, %request_id, "a chunk conflicts with one of another run");
            }
            Err(read) => {
                tracing::warn!(%error, %read, %request_id, "a chunk conflicts; storage unreadable");
            }
        }
    }

    pub(super) fn final_reply(self: &Arc<Self>, request_id: Snowflake, exit: Exit) -> Reply {
        Reply::WithExit(WithExit { request_id, id: self.ids.next(), exit })
    }

    /// Stores a final reply, retrying a few times, and wakes the local waiters.
    ///
    /// `fence` is the shard whose lock was just confirmed for this reply, if any.
    /// With it, a failed write is retried only after the lock is confirmed again.
    /// So a retry never lands after this runner lost or let go of the shard.
    /// When the lock is not confirmed, the request is left for the next owner.
    pub(super) async fn save_final_reply(self: &Arc<Self>, reply: Reply, fence: Option<&ShardId>) {
        self.save_final_reply_with(reply, fence, None).await;
    }

    /// [`save_final_reply`](Self::save_final_reply) with an entity's state write, committed in
    /// the reply's transaction (both or neither).
    ///
    /// - A stale revision stores nothing: the state was written elsewhere, so this runner lost
    ///   the entity. The request is left for the shard's owner, as a fenced one is.
    /// - A reply or a state the storage refuses (over its limit) is answered with a defect,
    ///   and the state is not written.
    /// - The instance hears whether the write committed; when it did not, or when that is
    ///   unknown, it reads its state again.
    async fn save_final_reply_with(
        self: &Arc<Self>,
        mut reply: Reply,
        fence: Option<&ShardId>,
        mut state: Option<StateHandOff>,
    ) {
        let mut replaced = false;
        let mut attempt = 0;
        while attempt < SAVE_REPLY_ATTEMPTS {
            attempt += 1;
            if let Some(shard) = fence
                && attempt > 1
                && !self.serving.confirm(shard).await
            {
                return self.fenced(reply.request_id(), shard).await;
            }
            let saved = match &state {
                Some(state) => self.storage.save_reply_with_state(&reply, &state.write).await,
                None => self.storage.save_reply(&reply).await,
            };
            match saved {
                Ok(()) => {
                    self.record_answered(&reply);
                    self.waiters.on_reply_saved(&reply);
                    if let Some(state) = state {
                        let _ = state.committed.send(Committed::Yes);
                    }
                    return;
                }
                Err(error) if error.kind() == cluster_core::error::StorageErrorKind::Conflict => {
                    tracing::debug!(%error, request_id = %reply.request_id(), "request already answered");
                    return;
                }
                Err(error) if error.kind() == cluster_core::error::StorageErrorKind::StaleState => {
                    tracing::warn!(%error, request_id = %reply.request_id(), "stale entity state: the reply is not stored");
                    if let Some(shard) = fence {
                        return self.fenced(reply.request_id(), shard).await;
                    }
                    let _ = self.storage.reset_requests(&[reply.request_id()]).await;
                    return self.poll_storage();
                }
                // The storage cannot hold this reply: a value beyond a column, such as a reply
                // over 64 KiB in MySQL's TEXT.
                // No retry or rerun would store it.
                // So the request is answered with a defect that says why, instead of running
                // again forever.
                Err(error)
                    if error.kind() == cluster_core::error::StorageErrorKind::InvalidInput
                        && !replaced =>
                {
                    tracing::warn!(%error, request_id = %reply.request_id(), "the reply cannot be stored; answering with a defect");
                    let message = match state.take() {
                        Some(_) => {
                            format!("the reply or the entity state could not be stored: {error}")
                        }
                        None => format!("the reply could not be stored: {error}"),
                    };
                    reply = self.final_reply(
                        reply.request_id(),
                        Exit::die_with_message("ReplyNotStored", &message),
                    );
                    replaced = true;
                    // The defect's first write is not a retry of the refused one.
                    attempt -= 1;
                }
                Err(error) if attempt < SAVE_REPLY_ATTEMPTS => {
                    tracing::debug!(%error, attempt, "could not save a reply, retrying");
                    tokio::time::sleep(SAVE_REPLY_SPACING).await;
                }
                Err(error) => {
                    tracing::warn!(%error, request_id = %reply.request_id(), "could not save a reply; the request runs again later");
                    let _ = self.storage.reset_requests(&[reply.request_id()]).await;
                }
            }
        }
    }
}

/// What a delivered request will produce.
enum Outcome {
    /// The exit of a unary request.
    Exit(oneshot::Receiver<Exit>),
    /// The chunks and final reply of a streaming request.
    Stream(mpsc::Receiver<Reply>),
}

/// The messages of entity types not registered here (yet).
///
/// - Each type's messages are held for twice the registration timeout from the first one seen.
///   A layer may still be registering the type (the storage read loop of
///   `effect/src/cluster/Sharding.ts`).
/// - Then they are answered with a defect.
/// - The deadline belongs to each type and is forgotten when the type registers.
///   So a type added later (a rolling update) gets its own.
#[derive(Default)]
pub(super) struct Unregistered {
    /// When a message for each type was first seen.
    since: BTreeMap<EntityType, Instant>,
    /// The messages held since the last warning, per type.
    held: BTreeMap<EntityType, usize>,
}

impl Unregistered {
    /// Whether a message of `entity_type` is held for now (`false`: its deadline passed).
    pub(super) fn hold(&mut self, entity_type: &EntityType, timeout: Duration) -> bool {
        let since = *self.since.entry(entity_type.clone()).or_insert_with(Instant::now);
        if since.elapsed() >= timeout.saturating_mul(2) {
            return false;
        }
        *self.held.entry(entity_type.clone()).or_default() += 1;
        true
    }

    /// `entity_type` is registered: its deadline is forgotten.
    pub(super) fn registered(&mut self, entity_type: &EntityType) {
        if !self.since.is_empty() {
            self.since.remove(entity_type);
        }
    }

    /// Warns about the messages held: once per type and read, not once per message.
    pub(super) fn warn(&mut self) {
        for (entity_type, messages) in std::mem::take(&mut self.held) {
            tracing::warn!(%entity_type, messages, "Could not find entity manager for address, retrying");
        }
    }
}

/// A request handed to its entity, and what the runtime keeps to store its outcome.
struct Sent {
    request_id: Snowflake,
    /// The request's shard, whose lock must be confirmed before its final reply is stored.
    shard: ShardId,
    outcome: Outcome,
    transaction: Option<PendingTransaction>,
    /// Where the instance hands the request's state write (durable entities).
    state: Option<oneshot::Receiver<StateHandOff>>,
    /// The request itself, kept when an interrupt runs it again.
    rerun: Option<Request>,
    /// Holds the shard's release until the outcome is stored.
    write: WriteGuard,
}

/// What a dispatch did with one stored message.
pub(super) enum Dispatched {
    /// Handed to its entity.
    Delivered,
    /// Nothing to do now.
    Skipped,
    /// Its outcome is being stored, or was during the current read.
    /// Release the claim a read took, in case the outcome was to run again.
    Settled(Snowflake),
    /// Not deliverable now: release its claim so a later read retries it.
    Release(Snowflake),
    /// The entity's mailbox is full: release its claim and read again soon.
    Retry(Snowflake),
    /// The runner holds as many entities as it may.
    /// Release its claim, and read again once an entity is reaped.
    Capped(Snowflake),
    /// Answer it at once with this final reply.
    Answer(Reply),
}
