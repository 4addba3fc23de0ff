//! Storages that fail on demand: they forward every call to another storage, except the ones a
//! test asked to fail. For the paths that only a failing database reaches:
//! [`FaultyMessageStorage`] (a transaction that cannot begin, a commit whose outcome is
//! unknown) and [`FaultyRunnerStorage`] (a lock lost to another runner, lock storage that does
//! not answer).

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{AckChunk, Interrupt, Reply, Request};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{
    Backlog, BacklogQuery, RequestQuery, RequestRecord, RunnerRecord, ShardLock,
};
use cluster_core::retention::{ProcessedQuery, ProcessedRequest, PurgeProcessed};
use cluster_core::storage::{
    MessageStorage, MessageTransaction, OrderedSave, RunnerStorage, SaveRequestOptions, SaveResult,
    UnprocessedBatch, UnprocessedOptions,
};
use cluster_core::sync::lock;
use cluster_core::{
    EntityAddress, MachineId, Runner, RunnerAddress, ShardId, Snowflake, Timestamp,
};

/// What a [`FaultyMessageStorage`] reports to its observer (see [`Faults::observe`]).
#[derive(Debug)]
pub enum StorageEvent<'a> {
    /// A request was stored (not a duplicate).
    RequestSaved(&'a Request),
    /// A final reply is about to be written (before any injected delay).
    FinalReply(&'a Reply),
    /// A final reply was written.
    FinalReplyStored(&'a Reply),
    /// A reply write failed by injection ([`Faults::fail_reply_saves`]).
    ReplyWriteFailed(&'a Reply),
    /// The storage read loop read the unprocessed messages of these shards.
    Read(&'a [ShardId]),
}

/// A function told about the storage's writes.
pub type Observer = Arc<dyn Fn(StorageEvent<'_>) + Send + Sync>;

/// What to fail next, and how often it was asked for; shared with the test.
#[derive(Default)]
pub struct Faults {
    /// Told about stored requests and final replies.
    observer: std::sync::Mutex<Option<Observer>>,
    begin_transaction: Countdown,
    commit_unacknowledged: Countdown,
    commit_failed: Countdown,
    clear_replies: Countdown,
    reads: Countdown,
    request_saves: Countdown,
    /// Request saves that find their id taken by another message.
    request_ids_taken: Countdown,
    reply_saves: Countdown,
    reply_saves_unacknowledged: Countdown,
    /// Milliseconds every `save_reply` waits before it writes.
    reply_delay_millis: std::sync::atomic::AtomicU64,
    /// Milliseconds every request save, read and reply lookup waits first.
    storage_delay_millis: std::sync::atomic::AtomicU64,
    /// Milliseconds every `begin_transaction` waits first.
    begin_delay_millis: std::sync::atomic::AtomicU64,
    /// While true, every `begin_transaction` waits (after its delay) until it turns false.
    begin_held: tokio::sync::watch::Sender<bool>,
    /// While true, every read of unprocessed messages waits (after its latency) until it turns
    /// false.
    reads_held: tokio::sync::watch::Sender<bool>,
    /// Reads of unprocessed messages waiting because of `reads_held`.
    reads_waiting: AtomicU32,
    /// Milliseconds every `save_ack_chunk` waits first.
    ack_delay_millis: std::sync::atomic::AtomicU64,
    /// Milliseconds every `unprocessed_before` waits first.
    order_check_delay_millis: std::sync::atomic::AtomicU64,
    /// The process died: no call reaches the storage any more.
    dead: std::sync::atomic::AtomicBool,
    begin_transaction_calls: AtomicU32,
    commits: AtomicU32,
    saved_requests: AtomicU32,
    resets: std::sync::Mutex<Vec<Snowflake>>,
}

/// How many of the next calls fail.
#[derive(Debug, Default)]
struct Countdown(AtomicU32);

impl Countdown {
    /// Whether this call fails (and counts it).
    fn fails(&self) -> bool {
        self.0.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| left.checked_sub(1)).is_ok()
    }
}

impl Faults {
    /// The next `times` calls of `begin_transaction` fail (`Unavailable`).
    pub fn fail_begin_transaction(&self, times: u32) {
        self.begin_transaction.0.store(times, Ordering::Release);
    }

    /// The next `times` commits happen, but report an error: the caller cannot tell whether
    /// they did (a connection lost after `COMMIT` was sent).
    pub fn lose_commit_acknowledgement(&self, times: u32) {
        self.commit_unacknowledged.0.store(times, Ordering::Release);
    }

    /// The next `times` commits roll back and report an error.
    pub fn fail_commit(&self, times: u32) {
        self.commit_failed.0.store(times, Ordering::Release);
    }

    /// Reports this storage's stored requests and final replies to `observer` (an invariant
    /// checker of a simulation).
    pub fn observe(&self, observer: Observer) {
        *lock(&self.observer) = Some(observer);
    }

    fn notify(&self, event: StorageEvent<'_>) {
        let observer = lock(&self.observer).clone();
        if let Some(observer) = observer {
            observer(event);
        }
    }

    /// The next `times` calls of `clear_replies` (resets of a request) fail (`Unavailable`).
    pub fn fail_clear_replies(&self, times: u32) {
        self.clear_replies.0.store(times, Ordering::Release);
    }

    /// The next `times` reads of unprocessed messages fail (`Unavailable`).
    pub fn fail_reads(&self, times: u32) {
        self.reads.0.store(times, Ordering::Release);
    }

    /// The next `times` request saves fail (`Unavailable`) without storing anything.
    pub fn fail_request_saves(&self, times: u32) {
        self.request_saves.0.store(times, Ordering::Release);
    }

    /// The next `times` request saves find their id taken by another message (`Conflict`,
    /// as a storage answers a snowflake that two processes with one machine id both made),
    /// without writing.
    pub fn take_request_ids(&self, times: u32) {
        self.request_ids_taken.0.store(times, Ordering::Release);
    }

    /// The next `times` reply writes (`save_reply`, `save_reply_with_state`) fail
    /// (`Unavailable`) without writing.
    pub fn fail_reply_saves(&self, times: u32) {
        self.reply_saves.0.store(times, Ordering::Release);
    }

    /// The next `times` reply writes happen, but report an error (`Unavailable`): the caller
    /// cannot tell whether they did (a connection lost after the write).
    pub fn lose_reply_acknowledgement(&self, times: u32) {
        self.reply_saves_unacknowledged.0.store(times, Ordering::Release);
    }

    /// Every reply write (`save_reply`, `save_reply_with_state`) from now on waits `delay`
    /// before it writes (a slow database, or a fenced write waiting for its lock refresh):
    /// widens the window between a handler's end and its stored reply.
    pub fn delay_replies(&self, delay: std::time::Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.reply_delay_millis.store(millis, Ordering::Release);
    }

    /// Every request save, read of unprocessed messages and reply lookup from now on waits
    /// `delay` first (a latency spike of the database).
    pub fn delay_storage(&self, delay: std::time::Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.storage_delay_millis.store(millis, Ordering::Release);
    }

    /// Every `begin_transaction` from now on waits `delay` first (zero: no wait), so that a
    /// test can drop a caller while its transaction begins.
    pub fn delay_begin_transaction(&self, delay: std::time::Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.begin_delay_millis.store(millis, Ordering::Release);
    }

    /// While `held`, every `begin_transaction` waits until it is released (`false`), so that
    /// a test decides, without a timing assumption, what happens while a transaction begins.
    pub fn hold_begin_transaction(&self, held: bool) {
        self.begin_held.send_replace(held);
    }

    /// While `held`, every read of unprocessed messages (a runner's claim) waits before it
    /// reaches the storage, until it is released (`false`): a test decides what happens while
    /// a read is under way.
    pub fn hold_reads(&self, held: bool) {
        self.reads_held.send_replace(held);
    }

    /// How many reads of unprocessed messages wait because of
    /// [`hold_reads`](Faults::hold_reads) now.
    pub fn reads_waiting(&self) -> u32 {
        self.reads_waiting.load(Ordering::Acquire)
    }

    /// Every `save_ack_chunk` from now on waits `delay` first (zero: no wait): a stream's
    /// consumer that is slow to acknowledge, while the reply poller hands the chunk over again.
    pub fn delay_acks(&self, delay: std::time::Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.ack_delay_millis.store(millis, Ordering::Release);
    }

    /// Every `unprocessed_before` (direct delivery's look at the entity's earlier requests)
    /// from now on waits `delay` first, and every `save_request_ordered` waits it after the
    /// save (zero: no wait).
    pub fn delay_order_checks(&self, delay: std::time::Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.order_check_delay_millis.store(millis, Ordering::Release);
    }

    /// Waits out the latency of [`delay_storage`](Faults::delay_storage).
    async fn latency(&self) {
        let delay = self.storage_delay_millis.load(Ordering::Acquire);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
    }

    /// The process dies: from now on every call of its storage hangs without reaching the
    /// database (a crashed process's tasks have no effect any more, and report nothing).
    pub fn kill(&self) {
        self.dead.store(true, Ordering::Release);
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// How often `begin_transaction` was called, failed calls included.
    pub fn begin_transaction_calls(&self) -> u32 {
        self.begin_transaction_calls.load(Ordering::Acquire)
    }

    /// How many requests were stored (duplicates not counted).
    pub fn saved_requests(&self) -> u32 {
        self.saved_requests.load(Ordering::Acquire)
    }

    /// How often a transaction was committed (or tried to), failed commits included.
    pub fn commits(&self) -> u32 {
        self.commits.load(Ordering::Acquire)
    }

    /// The requests whose claim was released (`reset_requests`), in call order: a runner
    /// that leaves a request for the next owner.
    pub fn resets(&self) -> Vec<Snowflake> {
        lock(&self.resets).clone()
    }
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults").field("commits", &self.commits).finish_non_exhaustive()
    }
}

/// The call of a dead process: it never returns.
fn dead<'a, T: Send + 'a>() -> BoxFuture<'a, T> {
    Box::pin(std::future::pending())
}

fn id_taken(request: &Request) -> StorageError {
    let message = format!("injected: message {} already exists", request.request_id);
    StorageError::new(StorageErrorKind::Conflict, message)
}

fn injected(what: &str) -> StorageError {
    StorageError::new(StorageErrorKind::Unavailable, format!("injected failure: {what}"))
}

/// A storage that fails on demand; see the [module docs](self).
pub struct FaultyMessageStorage {
    inner: Arc<dyn MessageStorage>,
    faults: Arc<Faults>,
}

impl FaultyMessageStorage {
    /// Wraps `inner`; the returned [`Faults`] decide what fails.
    pub fn new(inner: Arc<dyn MessageStorage>) -> (FaultyMessageStorage, Arc<Faults>) {
        let faults = Arc::new(Faults::default());
        (FaultyMessageStorage { inner, faults: Arc::clone(&faults) }, faults)
    }
}

impl FaultyMessageStorage {
    /// `save_reply`, or `save_reply_with_state` with `state`: the injected failures, delays
    /// and events of a reply write.
    fn reply_write<'a>(
        &'a self,
        reply: &'a Reply,
        state: Option<&'a StateWrite>,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        let what = if state.is_some() { "save_reply_with_state" } else { "save_reply" };
        if self.faults.reply_saves.fails() {
            self.faults.notify(StorageEvent::ReplyWriteFailed(reply));
            return Box::pin(std::future::ready(Err(injected(what))));
        }
        if reply.is_final() {
            self.faults.notify(StorageEvent::FinalReply(reply));
        }
        let delay = self.faults.reply_delay_millis.load(Ordering::Acquire);
        Box::pin(async move {
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
                if self.faults.is_dead() {
                    // The process died while its write waited.
                    std::future::pending::<()>().await;
                }
            }
            let saved = match state {
                Some(state) => self.inner.save_reply_with_state(reply, state).await,
                None => self.inner.save_reply(reply).await,
            };
            if saved.is_ok() && reply.is_final() {
                self.faults.notify(StorageEvent::FinalReplyStored(reply));
            }
            if saved.is_ok() && self.faults.reply_saves_unacknowledged.fails() {
                return Err(injected(&format!("{what} (written)")));
            }
            saved
        })
    }
}

impl fmt::Debug for FaultyMessageStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyMessageStorage").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl MessageStorage for FaultyMessageStorage {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        Box::pin(async move {
            self.faults.latency().await;
            if self.faults.request_saves.fails() {
                return Err(injected("save_request"));
            }
            if self.faults.request_ids_taken.fails() {
                return Err(id_taken(request));
            }
            let saved = self.inner.save_request(request, options).await;
            if let Ok(SaveResult::Success) = &saved {
                self.faults.saved_requests.fetch_add(1, Ordering::AcqRel);
                self.faults.notify(StorageEvent::RequestSaved(request));
            }
            saved
        })
    }

    fn save_request_ordered<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedSave, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        let delay = self.faults.order_check_delay_millis.load(Ordering::Acquire);
        Box::pin(async move {
            self.faults.latency().await;
            if self.faults.request_saves.fails() {
                return Err(injected("save_request"));
            }
            if self.faults.request_ids_taken.fails() {
                return Err(id_taken(request));
            }
            let ordered = self.inner.save_request_ordered(request, options, now, limit).await?;
            if let SaveResult::Success = &ordered.saved {
                self.faults.saved_requests.fetch_add(1, Ordering::AcqRel);
                self.faults.notify(StorageEvent::RequestSaved(request));
            }
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            Ok(ordered)
        })
    }

    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        let delay = self.faults.ack_delay_millis.load(Ordering::Acquire);
        Box::pin(async move {
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            self.inner.save_ack_chunk(ack).await
        })
    }

    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.save_interrupt(interrupt)
    }

    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        self.reply_write(reply, None)
    }

    fn load_state<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<Option<StoredState>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        Box::pin(async move {
            self.faults.latency().await;
            self.inner.load_state(address).await
        })
    }

    fn save_state<'a>(&'a self, write: &'a StateWrite) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.save_state(write)
    }

    /// A reply write, as [`save_reply`](MessageStorage::save_reply) is: the same injected
    /// faults and events.
    fn save_reply_with_state<'a>(
        &'a self,
        reply: &'a Reply,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.reply_write(reply, Some(write))
    }

    fn clear_replies(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> BoxFuture<'_, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        if self.faults.clear_replies.fails() {
            return Box::pin(std::future::ready(Err(injected("clear_replies"))));
        }
        self.inner.clear_replies(request_id, expected_reply_id)
    }

    fn request_id_for_primary_key<'a>(
        &'a self,
        primary_key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Snowflake>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.request_id_for_primary_key(primary_key)
    }

    fn replies_for<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        Box::pin(async move {
            self.faults.latency().await;
            self.inner.replies_for(request_ids).await
        })
    }

    fn replies_for_unfiltered<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.replies_for_unfiltered(request_ids)
    }

    fn unprocessed_messages<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'a>,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.faults.notify(StorageEvent::Read(shard_ids));
        if self.faults.reads.fails() {
            return Box::pin(std::future::ready(Err(injected("unprocessed_messages"))));
        }
        Box::pin(async move {
            self.faults.latency().await;
            let mut held = self.faults.reads_held.subscribe();
            if *held.borrow_and_update() {
                self.faults.reads_waiting.fetch_add(1, Ordering::AcqRel);
                // Counted out when the wait ends, or when the read is dropped while it waits.
                let _waiting = Uncount(&self.faults.reads_waiting);
                // The sender lives as long as the faults this call holds: `wait_for` cannot
                // fail.
                let _ = held.wait_for(|held| !*held).await;
            }
            self.inner.unprocessed_messages(shard_ids, now, options).await
        })
    }

    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.unprocessed_messages_by_id(ids, now)
    }

    fn unprocessed_before<'a>(
        &'a self,
        address: &'a EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<Vec<Snowflake>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        let delay = self.faults.order_check_delay_millis.load(Ordering::Acquire);
        Box::pin(async move {
            self.faults.latency().await;
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            self.inner.unprocessed_before(address, request_id, now, limit).await
        })
    }

    fn reset_requests<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        lock(&self.faults.resets).extend_from_slice(request_ids);
        self.inner.reset_requests(request_ids)
    }

    fn reset_addresses<'a>(
        &'a self,
        addresses: &'a [EntityAddress],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.reset_addresses(addresses)
    }

    fn reset_shards<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.reset_shards(shard_ids)
    }

    fn clear_address<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.clear_address(address)
    }

    fn purge_processed<'a>(
        &'a self,
        batch: &'a PurgeProcessed,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.purge_processed(batch)
    }

    fn processed_requests<'a>(
        &'a self,
        query: &'a ProcessedQuery,
    ) -> BoxFuture<'a, Result<Vec<ProcessedRequest>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.processed_requests(query)
    }

    fn backlog<'a>(
        &'a self,
        query: &'a BacklogQuery,
    ) -> BoxFuture<'a, Result<Vec<Backlog>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.backlog(query)
    }

    fn requests<'a>(
        &'a self,
        query: &'a RequestQuery,
    ) -> BoxFuture<'a, Result<Vec<RequestRecord>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        self.inner.requests(query)
    }

    fn begin_transaction(
        &self,
    ) -> BoxFuture<'_, Result<Box<dyn MessageTransaction>, StorageError>> {
        if self.faults.is_dead() {
            return dead();
        }
        Box::pin(async move {
            self.faults.begin_transaction_calls.fetch_add(1, Ordering::AcqRel);
            let delay = self.faults.begin_delay_millis.load(Ordering::Acquire);
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            let mut held = self.faults.begin_held.subscribe();
            // The sender lives as long as the faults this call holds: `wait_for` cannot fail.
            let _ = held.wait_for(|held| !*held).await;
            if self.faults.begin_transaction.fails() {
                return Err(injected("begin_transaction"));
            }
            let inner = self.inner.begin_transaction().await?;
            let faults = Arc::clone(&self.faults);
            Ok(Box::new(FaultyTransaction { inner, faults }) as Box<dyn MessageTransaction>)
        })
    }
}

/// A transaction whose commit fails on demand.
struct FaultyTransaction {
    inner: Box<dyn MessageTransaction>,
    faults: Arc<Faults>,
}

impl MessageTransaction for FaultyTransaction {
    fn save_reply<'a>(&'a mut self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        self.inner.save_reply(reply)
    }

    fn save_state<'a>(
        &'a mut self,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.inner.save_state(write)
    }

    fn backend(&mut self) -> &mut (dyn Any + Send) {
        self.inner.backend()
    }

    fn savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        self.inner.savepoint()
    }

    fn rollback_to_savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        self.inner.rollback_to_savepoint()
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        let FaultyTransaction { inner, faults } = *self;
        Box::pin(async move {
            if faults.is_dead() {
                std::future::pending::<()>().await;
            }
            faults.commits.fetch_add(1, Ordering::AcqRel);
            if faults.commit_failed.fails() {
                inner.rollback().await?;
                return Err(injected("commit (rolled back)"));
            }
            let committed = inner.commit().await;
            if committed.is_ok() && faults.commit_unacknowledged.fails() {
                return Err(injected("commit (committed, acknowledgement lost)"));
            }
            committed
        })
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        self.inner.rollback()
    }
}

/// What a [`FaultyRunnerStorage`] fails; shared with the test.
#[derive(Debug, Default)]
pub struct LockFaults {
    /// Shards whose lock this runner lost to another one: refreshes leave them out and
    /// acquisitions do not get them.
    lost: std::sync::Mutex<std::collections::BTreeSet<ShardId>>,
    /// Every refresh fails (lock storage unreachable).
    refresh_fails: std::sync::atomic::AtomicBool,
    /// The runner is dead: nothing it does reaches the storage any more.
    killed: std::sync::atomic::AtomicBool,
    /// Every release fails (`Unavailable`).
    release_fails: std::sync::atomic::AtomicBool,
    /// Lock operations hang while set (a black-holed lock connection).
    blackholed: std::sync::atomic::AtomicBool,
    /// Registrations take this long (milliseconds) before they reach the storage.
    register_delay_ms: std::sync::atomic::AtomicU64,
    /// Lock operations take this long (milliseconds) before they reach the storage.
    lock_delay_ms: std::sync::atomic::AtomicU64,
    registers: AtomicU32,
    acquires: AtomicU32,
    refreshes_with_shards: AtomicU32,
    releases: std::sync::Mutex<Vec<ShardId>>,
    releases_all: AtomicU32,
}

impl LockFaults {
    fn lost(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<ShardId>> {
        lock(&self.lost)
    }

    /// The runner's lock on `shard` is gone (its lease expired and another runner took it)
    /// until [`restore`](LockFaults::restore).
    pub fn lose(&self, shard: ShardId) {
        self.lost().insert(shard);
    }

    /// Every lost lock can be taken again.
    pub fn restore(&self) {
        self.lost().clear();
    }

    /// Makes every refresh fail (`Unavailable`) or work again.
    pub fn fail_refresh(&self, failing: bool) {
        self.refresh_fails.store(failing, Ordering::Release);
    }

    /// The runner dies without cleaning up: from now on its refreshes fail (no heartbeat, no
    /// lock kept fresh) and its releases and unregistration do nothing, so the others wait
    /// for its locks and registration to expire, as after a crash.
    pub fn kill(&self) {
        self.killed.store(true, Ordering::Release);
        self.refresh_fails.store(true, Ordering::Release);
    }

    /// Makes the lock operations (`acquire`, `refresh`, `release`, `release_all`) hang until
    /// called with `false`, like a lock connection whose packets are dropped.
    pub fn blackhole(&self, on: bool) {
        self.blackholed.store(on, Ordering::Release);
    }

    /// Waits while the lock connection is black-holed, then the lock latency.
    async fn through_the_blackhole(&self) {
        while self.blackholed.load(Ordering::Acquire) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let delay = self.lock_delay_ms.load(Ordering::Acquire);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
    }

    /// The lock operations (`acquire`, `refresh`, `release`, `release_all`) take `delay`
    /// before they reach the storage (a latency spike of the lock connection).
    pub fn delay_locks(&self, delay: std::time::Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.lock_delay_ms.store(millis, Ordering::Release);
    }

    /// Makes every `release` and `release_all` fail (`Unavailable`) or work again.
    pub fn fail_release(&self, failing: bool) {
        self.release_fails.store(failing, Ordering::Release);
    }

    /// Registrations take `delay` before they reach the storage (a slow registry).
    pub fn delay_register(&self, delay: std::time::Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.register_delay_ms.store(millis, Ordering::Release);
    }

    /// How often `register` was called.
    pub fn registers(&self) -> u32 {
        self.registers.load(Ordering::Acquire)
    }

    fn is_killed(&self) -> bool {
        self.killed.load(Ordering::Acquire)
    }

    /// How often `acquire` was called.
    pub fn acquires(&self) -> u32 {
        self.acquires.load(Ordering::Acquire)
    }

    /// How often `refresh` was called with shards (not a bare heartbeat), failed calls
    /// included.
    pub fn refreshes_with_shards(&self) -> u32 {
        self.refreshes_with_shards.load(Ordering::Acquire)
    }

    /// The shards passed to `release`, in call order.
    pub fn releases(&self) -> Vec<ShardId> {
        lock(&self.releases).clone()
    }

    /// How often `release_all` was called.
    pub fn releases_all(&self) -> u32 {
        self.releases_all.load(Ordering::Acquire)
    }
}

/// A [`RunnerStorage`] that loses locks and fails refreshes on demand, forwarding everything
/// else to another storage.
pub struct FaultyRunnerStorage {
    inner: Arc<dyn RunnerStorage>,
    faults: Arc<LockFaults>,
}

impl FaultyRunnerStorage {
    /// Wraps `inner`; the returned [`LockFaults`] decide what fails.
    pub fn new(inner: Arc<dyn RunnerStorage>) -> (FaultyRunnerStorage, Arc<LockFaults>) {
        let faults = Arc::new(LockFaults::default());
        (FaultyRunnerStorage { inner, faults: Arc::clone(&faults) }, faults)
    }

    fn without_lost(&self, shards: Vec<ShardId>) -> Vec<ShardId> {
        let lost = self.faults.lost();
        shards.into_iter().filter(|shard| !lost.contains(shard)).collect()
    }
}

impl fmt::Debug for FaultyRunnerStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyRunnerStorage").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl RunnerStorage for FaultyRunnerStorage {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn register<'a>(
        &'a self,
        runner: &'a Runner,
        healthy: bool,
    ) -> BoxFuture<'a, Result<MachineId, StorageError>> {
        Box::pin(async move {
            self.faults.registers.fetch_add(1, Ordering::AcqRel);
            let delay = self.faults.register_delay_ms.load(Ordering::Acquire);
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            if self.faults.is_killed() {
                return Err(injected("register (killed)"));
            }
            self.inner.register(runner, healthy).await
        })
    }

    fn unregister<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_killed() {
            return Box::pin(async { Ok(()) });
        }
        self.inner.unregister(address)
    }

    fn get_runners(&self) -> BoxFuture<'_, Result<Vec<(Runner, bool)>, StorageError>> {
        self.inner.get_runners()
    }

    fn runner_records(&self) -> BoxFuture<'_, Result<Vec<RunnerRecord>, StorageError>> {
        self.inner.runner_records()
    }

    fn shard_locks<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardLock>, StorageError>> {
        self.inner.shard_locks(shard_ids)
    }

    fn set_runner_health<'a>(
        &'a self,
        address: &'a RunnerAddress,
        healthy: bool,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.inner.set_runner_health(address, healthy)
    }

    fn acquire<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(async move {
            self.faults.acquires.fetch_add(1, Ordering::AcqRel);
            self.faults.through_the_blackhole().await;
            if self.faults.is_killed() {
                return Err(injected("acquire (killed)"));
            }
            let wanted = self.without_lost(shard_ids.to_vec());
            let acquired = self.inner.acquire(address, &wanted).await?;
            Ok(self.without_lost(acquired))
        })
    }

    fn refresh<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(async move {
            if !shard_ids.is_empty() {
                self.faults.refreshes_with_shards.fetch_add(1, Ordering::AcqRel);
            }
            self.faults.through_the_blackhole().await;
            if self.faults.refresh_fails.load(Ordering::Acquire) {
                return Err(injected("refresh"));
            }
            let refreshed = self.inner.refresh(address, shard_ids).await?;
            Ok(self.without_lost(refreshed))
        })
    }

    fn confirm<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(async move {
            self.faults.through_the_blackhole().await;
            if self.faults.refresh_fails.load(Ordering::Acquire) {
                return Err(injected("confirm"));
            }
            let confirmed = self.inner.confirm(address, shard_ids).await?;
            Ok(self.without_lost(confirmed))
        })
    }

    fn release<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_id: &'a ShardId,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        lock(&self.faults.releases).push(shard_id.clone());
        if self.faults.is_killed() {
            return Box::pin(async { Ok(()) });
        }
        if self.faults.release_fails.load(Ordering::Acquire) {
            return Box::pin(async { Err(injected("release")) });
        }
        Box::pin(async move {
            self.faults.through_the_blackhole().await;
            self.inner.release(address, shard_id).await
        })
    }

    fn release_all<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.faults.releases_all.fetch_add(1, Ordering::AcqRel);
        if self.faults.is_killed() {
            return Box::pin(async { Ok(()) });
        }
        if self.faults.release_fails.load(Ordering::Acquire) {
            return Box::pin(async { Err(injected("release_all")) });
        }
        Box::pin(async move {
            self.faults.through_the_blackhole().await;
            self.inner.release_all(address).await
        })
    }

    fn release_gone<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if self.faults.is_killed() {
            return Box::pin(async { Err(injected("release_gone")) });
        }
        Box::pin(async move {
            self.faults.through_the_blackhole().await;
            self.inner.release_gone(address).await
        })
    }
}

/// Takes one from a counter when dropped.
struct Uncount<'a>(&'a AtomicU32);

impl Drop for Uncount<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
