//! Storage metrics and deadlines: the runtime wraps the storages it is given in
//! [`MeteredMessages`] and [`MeteredRunners`], which time every operation and count its errors,
//! by `backend` (the storage's [`backend_name`](MessageStorage::backend_name)) and `operation`
//! (the contract method's name).
//!
//! Every operation has a deadline, by its class ([`Deadlines`]): reads
//! (`storage_read_timeout`), writes (`storage_write_timeout`), lock operations
//! (`shard_lock_interval()`) and the long listings and deletions of the console and retention
//! (30 s). An operation past its deadline fails with `StorageErrorKind::Timeout`; the storage
//! may still complete it, as when a connection drops after a statement was sent.
//!
//! The read loop's claim (`unprocessed_messages`) has none: a claim the database completes after
//! its caller gave up would hide those messages from every runner for `CLAIM_WINDOW`, and the
//! later requests of their entities wait behind them. The read loop waits for its answer
//! instead; `effect_cluster_read_loop_lag_seconds` shows a stalled read.
//!
//! Every method, the contracts' default ones included, goes to the wrapped storage, so that a
//! backend's own version of a default method keeps running. A transaction begun through the
//! wrapper is wrapped too, and hands out the backend's own handle.

use std::any::Any;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::clock::Timestamp;
use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{AckChunk, Interrupt, Reply, Request};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{
    Backlog, BacklogQuery, RequestQuery, RequestRecord, RunnerRecord, ShardLock,
};
use cluster_core::retention::{ProcessedQuery, ProcessedRequest, PurgeProcessed};
use cluster_core::storage::{
    MessageStorage, MessageTransaction, OrderedBatch, OrderedSave, RunnerStorage,
    SaveRequestOptions, SaveResult, UnprocessedBatch, UnprocessedOptions,
};
use cluster_core::{EntityAddress, MachineId, Runner, RunnerAddress, ShardId, Snowflake};

use crate::metrics::{STORAGE_ERRORS, STORAGE_OPERATION};

/// The storage operations, for the `operation` label.
#[derive(Clone, Copy, Debug)]
enum Op {
    SaveRequest,
    SaveRequestOrdered,
    SaveAckChunk,
    SaveInterrupt,
    SaveReply,
    ClearReplies,
    RequestIdForPrimaryKey,
    RepliesFor,
    RepliesForUnfiltered,
    UnprocessedMessages,
    UnprocessedMessagesById,
    UnprocessedBefore,
    UnprocessedMessagesOrdered,
    ResetRequests,
    ResetAddresses,
    ResetShards,
    ClearAddress,
    PurgeProcessed,
    ProcessedRequests,
    Backlog,
    Requests,
    RunnerRecords,
    ShardLocks,
    LoadState,
    SaveState,
    SaveReplyWithState,
    BeginTransaction,
    TransactionSaveReply,
    TransactionSaveState,
    TransactionCommit,
    TransactionRollback,
    Register,
    Unregister,
    GetRunners,
    SetRunnerHealth,
    Acquire,
    Refresh,
    Confirm,
    Release,
    ReleaseAll,
    ReleaseGone,
}

/// The class of an operation, which sets its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// Claims, which are not cancel safe: no deadline.
    Claim,
    Read,
    Write,
    Lock,
    Maintenance,
}

/// The deadline of each class of storage operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Deadlines {
    read: Duration,
    write: Duration,
    lock: Duration,
}

impl Deadlines {
    /// The deadlines `config` sets.
    pub(crate) fn of(config: &cluster_core::ShardingConfig) -> Deadlines {
        Deadlines {
            read: config.storage_read_timeout,
            write: config.storage_write_timeout,
            lock: config.shard_lock_interval(),
        }
    }

    /// The deadline of `class`, and the setting that sets it; `None` for claims.
    fn of_class(self, class: Class) -> Option<(Duration, &'static str)> {
        Some(match class {
            Class::Claim => return None,
            Class::Read => (self.read, "STORAGE_READ_TIMEOUT"),
            Class::Write => (self.write, "STORAGE_WRITE_TIMEOUT"),
            Class::Lock => (self.lock, "SHARD_LOCK_REFRESH_INTERVAL"),
            Class::Maintenance => {
                (cluster_core::retention::CALL_DEADLINE, "a fixed deadline of listings and purges")
            }
        })
    }
}

impl Op {
    /// The class of the operation (see [`Deadlines`]).
    fn class(self) -> Class {
        match self {
            Op::UnprocessedMessages => Class::Claim,
            Op::RequestIdForPrimaryKey
            | Op::RepliesFor
            | Op::RepliesForUnfiltered
            | Op::UnprocessedMessagesById
            | Op::UnprocessedBefore
            | Op::UnprocessedMessagesOrdered
            | Op::LoadState
            | Op::GetRunners => Class::Read,
            Op::SaveRequest
            | Op::SaveRequestOrdered
            | Op::SaveAckChunk
            | Op::SaveInterrupt
            | Op::SaveReply
            | Op::ClearReplies
            | Op::ResetRequests
            | Op::ResetAddresses
            | Op::ResetShards
            | Op::SaveState
            | Op::SaveReplyWithState
            | Op::BeginTransaction
            | Op::TransactionSaveReply
            | Op::TransactionSaveState
            | Op::TransactionCommit
            | Op::TransactionRollback
            | Op::Register
            | Op::Unregister
            | Op::SetRunnerHealth => Class::Write,
            Op::Acquire
            | Op::Refresh
            | Op::Confirm
            | Op::Release
            | Op::ReleaseAll
            | Op::ReleaseGone => Class::Lock,
            Op::ClearAddress
            | Op::PurgeProcessed
            | Op::ProcessedRequests
            | Op::Backlog
            | Op::Requests
            | Op::RunnerRecords
            | Op::ShardLocks => Class::Maintenance,
        }
    }

    /// Every operation, in declaration order (an operation's histogram is at its index; one
    /// missing here is timed by no histogram, never a panic).
    const ALL: [Op; 41] = [
        Op::SaveRequest,
        Op::SaveRequestOrdered,
        Op::SaveAckChunk,
        Op::SaveInterrupt,
        Op::SaveReply,
        Op::ClearReplies,
        Op::RequestIdForPrimaryKey,
        Op::RepliesFor,
        Op::RepliesForUnfiltered,
        Op::UnprocessedMessages,
        Op::UnprocessedMessagesById,
        Op::UnprocessedBefore,
        Op::UnprocessedMessagesOrdered,
        Op::ResetRequests,
        Op::ResetAddresses,
        Op::ResetShards,
        Op::ClearAddress,
        Op::PurgeProcessed,
        Op::ProcessedRequests,
        Op::Backlog,
        Op::Requests,
        Op::RunnerRecords,
        Op::ShardLocks,
        Op::LoadState,
        Op::SaveState,
        Op::SaveReplyWithState,
        Op::BeginTransaction,
        Op::TransactionSaveReply,
        Op::TransactionSaveState,
        Op::TransactionCommit,
        Op::TransactionRollback,
        Op::Register,
        Op::Unregister,
        Op::GetRunners,
        Op::SetRunnerHealth,
        Op::Acquire,
        Op::Refresh,
        Op::Confirm,
        Op::Release,
        Op::ReleaseAll,
        Op::ReleaseGone,
    ];

    /// The `operation` label: the contract method's name.
    fn label(self) -> &'static str {
        match self {
            Op::SaveRequest => "save_request",
            Op::SaveRequestOrdered => "save_request_ordered",
            Op::SaveAckChunk => "save_ack_chunk",
            Op::SaveInterrupt => "save_interrupt",
            Op::SaveReply => "save_reply",
            Op::ClearReplies => "clear_replies",
            Op::RequestIdForPrimaryKey => "request_id_for_primary_key",
            Op::RepliesFor => "replies_for",
            Op::RepliesForUnfiltered => "replies_for_unfiltered",
            Op::UnprocessedMessages => "unprocessed_messages",
            Op::UnprocessedMessagesById => "unprocessed_messages_by_id",
            Op::UnprocessedBefore => "unprocessed_before",
            Op::UnprocessedMessagesOrdered => "unprocessed_messages_ordered",
            Op::ResetRequests => "reset_requests",
            Op::ResetAddresses => "reset_addresses",
            Op::ResetShards => "reset_shards",
            Op::ClearAddress => "clear_address",
            Op::PurgeProcessed => "purge_processed",
            Op::ProcessedRequests => "processed_requests",
            Op::Backlog => "backlog",
            Op::Requests => "requests",
            Op::RunnerRecords => "runner_records",
            Op::ShardLocks => "shard_locks",
            Op::LoadState => "load_state",
            Op::SaveState => "save_state",
            Op::SaveReplyWithState => "save_reply_with_state",
            Op::BeginTransaction => "begin_transaction",
            Op::TransactionSaveReply => "transaction_save_reply",
            Op::TransactionSaveState => "transaction_save_state",
            Op::TransactionCommit => "transaction_commit",
            Op::TransactionRollback => "transaction_rollback",
            Op::Register => "register",
            Op::Unregister => "unregister",
            Op::GetRunners => "get_runners",
            Op::SetRunnerHealth => "set_runner_health",
            Op::Acquire => "acquire",
            Op::Refresh => "refresh",
            Op::Confirm => "confirm",
            Op::Release => "release",
            Op::ReleaseAll => "release_all",
            Op::ReleaseGone => "release_gone",
        }
    }
}

/// The latency histograms of one backend, one per operation, registered once, and the
/// deadlines.
struct Meters {
    backend: &'static str,
    latency: [metrics::Histogram; Op::ALL.len()],
    deadlines: Deadlines,
}

impl Meters {
    fn new(backend: &'static str, deadlines: Deadlines) -> Arc<Meters> {
        let latency = Op::ALL.map(|op| {
            metrics::histogram!(STORAGE_OPERATION, "backend" => backend, "operation" => op.label())
        });
        Arc::new(Meters { backend, latency, deadlines })
    }

    /// Runs `operation` within its deadline, recording how long it took and whether it failed.
    async fn measure<T>(
        &self,
        op: Op,
        operation: impl Future<Output = Result<T, StorageError>>,
    ) -> Result<T, StorageError> {
        let began = tokio::time::Instant::now();
        let Some((deadline, setting)) = self.deadlines.of_class(op.class()) else {
            let result = operation.await;
            self.record(op, began, &result);
            return result;
        };
        let result = match tokio::time::timeout(deadline, operation).await {
            Ok(result) => result,
            Err(_) => {
                tracing::debug!(
                    operation = op.label(),
                    ?deadline,
                    "a storage operation passed its deadline"
                );
                Err(StorageError::new(
                    StorageErrorKind::Timeout,
                    format!(
                        "{}: no answer from {} within {deadline:?} ({setting}); the database or \
                         the network to it is slow or stalled, and the operation may still \
                         complete",
                        op.label(),
                        self.backend
                    ),
                ))
            }
        };
        self.record(op, began, &result);
        result
    }

    /// Records how long `op` took and whether it failed.
    fn record<T>(&self, op: Op, began: tokio::time::Instant, result: &Result<T, StorageError>) {
        if let Some(latency) = self.latency.get(op as usize) {
            latency.record(began.elapsed().as_secs_f64());
        }
        if let Err(error) = result {
            metrics::counter!(
                STORAGE_ERRORS,
                "backend" => self.backend,
                "operation" => op.label(),
                "kind" => error.kind().as_label(),
            )
            .increment(1);
        }
    }
}

/// A message storage whose operations are timed and whose errors are counted.
pub(crate) struct MeteredMessages {
    inner: Arc<dyn MessageStorage>,
    meters: Arc<Meters>,
}

impl MeteredMessages {
    /// Wraps `inner`.
    pub(crate) fn wrap(
        inner: Arc<dyn MessageStorage>,
        deadlines: Deadlines,
    ) -> Arc<dyn MessageStorage> {
        let meters = Meters::new(inner.backend_name(), deadlines);
        Arc::new(MeteredMessages { inner, meters })
    }
}

impl fmt::Debug for MeteredMessages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The wrapped storage is what a reader wants to see.
        self.inner.fmt(f)
    }
}

impl MessageStorage for MeteredMessages {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>> {
        Box::pin(self.meters.measure(Op::SaveRequest, self.inner.save_request(request, options)))
    }

    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::SaveAckChunk, self.inner.save_ack_chunk(ack)))
    }

    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::SaveInterrupt, self.inner.save_interrupt(interrupt)))
    }

    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::SaveReply, self.inner.save_reply(reply)))
    }

    fn clear_replies(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> BoxFuture<'_, Result<(), StorageError>> {
        let cleared = self.inner.clear_replies(request_id, expected_reply_id);
        Box::pin(self.meters.measure(Op::ClearReplies, cleared))
    }

    fn request_id_for_primary_key<'a>(
        &'a self,
        primary_key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Snowflake>, StorageError>> {
        let found = self.inner.request_id_for_primary_key(primary_key);
        Box::pin(self.meters.measure(Op::RequestIdForPrimaryKey, found))
    }

    fn replies_for<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        Box::pin(self.meters.measure(Op::RepliesFor, self.inner.replies_for(request_ids)))
    }

    fn replies_for_unfiltered<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        let replies = self.inner.replies_for_unfiltered(request_ids);
        Box::pin(self.meters.measure(Op::RepliesForUnfiltered, replies))
    }

    fn unprocessed_messages<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'a>,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        let read = self.inner.unprocessed_messages(shard_ids, now, options);
        Box::pin(self.meters.measure(Op::UnprocessedMessages, read))
    }

    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        let read = self.inner.unprocessed_messages_by_id(ids, now);
        Box::pin(self.meters.measure(Op::UnprocessedMessagesById, read))
    }

    fn unprocessed_before<'a>(
        &'a self,
        address: &'a EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: NonZeroU32,
    ) -> BoxFuture<'a, Result<Vec<Snowflake>, StorageError>> {
        let read = self.inner.unprocessed_before(address, request_id, now, limit);
        Box::pin(self.meters.measure(Op::UnprocessedBefore, read))
    }

    fn unprocessed_messages_ordered<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
        limit: NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedBatch, StorageError>> {
        let read = self.inner.unprocessed_messages_ordered(ids, now, limit);
        Box::pin(self.meters.measure(Op::UnprocessedMessagesOrdered, read))
    }

    fn save_request_ordered<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
        now: Timestamp,
        limit: NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedSave, StorageError>> {
        let saved = self.inner.save_request_ordered(request, options, now, limit);
        Box::pin(self.meters.measure(Op::SaveRequestOrdered, saved))
    }

    fn reset_requests<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::ResetRequests, self.inner.reset_requests(request_ids)))
    }

    fn reset_addresses<'a>(
        &'a self,
        addresses: &'a [EntityAddress],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::ResetAddresses, self.inner.reset_addresses(addresses)))
    }

    fn reset_shards<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::ResetShards, self.inner.reset_shards(shard_ids)))
    }

    fn clear_address<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::ClearAddress, self.inner.clear_address(address)))
    }

    fn purge_processed<'a>(
        &'a self,
        batch: &'a PurgeProcessed,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(self.meters.measure(Op::PurgeProcessed, self.inner.purge_processed(batch)))
    }

    fn processed_requests<'a>(
        &'a self,
        query: &'a ProcessedQuery,
    ) -> BoxFuture<'a, Result<Vec<ProcessedRequest>, StorageError>> {
        let listed = self.inner.processed_requests(query);
        Box::pin(self.meters.measure(Op::ProcessedRequests, listed))
    }

    fn backlog<'a>(
        &'a self,
        query: &'a BacklogQuery,
    ) -> BoxFuture<'a, Result<Vec<Backlog>, StorageError>> {
        Box::pin(self.meters.measure(Op::Backlog, self.inner.backlog(query)))
    }

    fn requests<'a>(
        &'a self,
        query: &'a RequestQuery,
    ) -> BoxFuture<'a, Result<Vec<RequestRecord>, StorageError>> {
        Box::pin(self.meters.measure(Op::Requests, self.inner.requests(query)))
    }

    fn load_state<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<Option<StoredState>, StorageError>> {
        Box::pin(self.meters.measure(Op::LoadState, self.inner.load_state(address)))
    }

    fn save_state<'a>(&'a self, write: &'a StateWrite) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::SaveState, self.inner.save_state(write)))
    }

    fn save_reply_with_state<'a>(
        &'a self,
        reply: &'a Reply,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        let saved = self.inner.save_reply_with_state(reply, write);
        Box::pin(self.meters.measure(Op::SaveReplyWithState, saved))
    }

    fn begin_transaction(
        &self,
    ) -> BoxFuture<'_, Result<Box<dyn MessageTransaction>, StorageError>> {
        Box::pin(async move {
            let begun = self.meters.measure(Op::BeginTransaction, self.inner.begin_transaction());
            let inner = begun.await?;
            let meters = Arc::clone(&self.meters);
            Ok(Box::new(MeteredTransaction { inner, meters }) as Box<dyn MessageTransaction>)
        })
    }
}

/// A transaction of a [`MeteredMessages`].
struct MeteredTransaction {
    inner: Box<dyn MessageTransaction>,
    meters: Arc<Meters>,
}

impl MessageTransaction for MeteredTransaction {
    fn save_reply<'a>(&'a mut self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::TransactionSaveReply, self.inner.save_reply(reply)))
    }

    fn save_state<'a>(
        &'a mut self,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::TransactionSaveState, self.inner.save_state(write)))
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
        let MeteredTransaction { inner, meters } = *self;
        Box::pin(async move { meters.measure(Op::TransactionCommit, inner.commit()).await })
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        let MeteredTransaction { inner, meters } = *self;
        Box::pin(async move { meters.measure(Op::TransactionRollback, inner.rollback()).await })
    }
}

/// A runner storage whose operations are timed and whose errors are counted.
pub(crate) struct MeteredRunners {
    inner: Arc<dyn RunnerStorage>,
    meters: Arc<Meters>,
}

impl MeteredRunners {
    /// Wraps `inner`.
    pub(crate) fn wrap(
        inner: Arc<dyn RunnerStorage>,
        deadlines: Deadlines,
    ) -> Arc<dyn RunnerStorage> {
        let meters = Meters::new(inner.backend_name(), deadlines);
        Arc::new(MeteredRunners { inner, meters })
    }
}

impl fmt::Debug for MeteredRunners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl RunnerStorage for MeteredRunners {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn register<'a>(
        &'a self,
        runner: &'a Runner,
        healthy: bool,
    ) -> BoxFuture<'a, Result<MachineId, StorageError>> {
        Box::pin(self.meters.measure(Op::Register, self.inner.register(runner, healthy)))
    }

    fn unregister<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::Unregister, self.inner.unregister(address)))
    }

    fn get_runners(&self) -> BoxFuture<'_, Result<Vec<(Runner, bool)>, StorageError>> {
        Box::pin(self.meters.measure(Op::GetRunners, self.inner.get_runners()))
    }

    fn runner_records(&self) -> BoxFuture<'_, Result<Vec<RunnerRecord>, StorageError>> {
        Box::pin(self.meters.measure(Op::RunnerRecords, self.inner.runner_records()))
    }

    fn shard_locks<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardLock>, StorageError>> {
        Box::pin(self.meters.measure(Op::ShardLocks, self.inner.shard_locks(shard_ids)))
    }

    fn set_runner_health<'a>(
        &'a self,
        address: &'a RunnerAddress,
        healthy: bool,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        let set = self.inner.set_runner_health(address, healthy);
        Box::pin(self.meters.measure(Op::SetRunnerHealth, set))
    }

    fn acquire<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(self.meters.measure(Op::Acquire, self.inner.acquire(address, shard_ids)))
    }

    fn refresh<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(self.meters.measure(Op::Refresh, self.inner.refresh(address, shard_ids)))
    }

    fn confirm<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        Box::pin(self.meters.measure(Op::Confirm, self.inner.confirm(address, shard_ids)))
    }

    fn release<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_id: &'a ShardId,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::Release, self.inner.release(address, shard_id)))
    }

    fn release_all<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::ReleaseAll, self.inner.release_all(address)))
    }

    fn release_gone<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.meters.measure(Op::ReleaseGone, self.inner.release_gone(address)))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cluster_core::error::StorageErrorKind;

    use super::{Class, Deadlines, Meters, Op};

    fn deadlines() -> Deadlines {
        Deadlines {
            read: Duration::from_secs(3),
            write: Duration::from_secs(5),
            lock: Duration::from_secs(1),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_operation_past_its_deadline_fails_with_a_timeout_that_names_the_setting() {
        let meters = Meters::new("test", deadlines());
        let began = tokio::time::Instant::now();
        let hung = meters
            .measure(Op::SaveReply, std::future::pending::<Result<(), super::StorageError>>())
            .await;
        let error = hung.expect_err("a hung write fails");
        assert_eq!(error.kind(), StorageErrorKind::Timeout);
        assert_eq!(began.elapsed(), Duration::from_secs(5), "the write deadline");
        assert!(error.to_string().contains("STORAGE_WRITE_TIMEOUT"), "{error}");
        assert!(error.to_string().contains("save_reply"), "{error}");

        let began = tokio::time::Instant::now();
        let read = meters.measure(Op::RepliesFor, std::future::pending::<Result<(), _>>()).await;
        assert_eq!(read.map_err(|error| error.kind()), Err(StorageErrorKind::Timeout));
        assert_eq!(began.elapsed(), Duration::from_secs(3), "the read deadline");

        // An answer in time passes through.
        let answered = meters.measure(Op::Refresh, async { Ok::<_, super::StorageError>(7) }).await;
        assert_eq!(answered.ok(), Some(7));

        // A claim waits for its answer, however long it takes.
        let began = tokio::time::Instant::now();
        let slow_claim = async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, super::StorageError>(1)
        };
        assert_eq!(meters.measure(Op::UnprocessedMessages, slow_claim).await.ok(), Some(1));
        assert_eq!(began.elapsed(), Duration::from_secs(60));
    }

    #[test]
    fn every_class_has_its_deadline() {
        let deadlines = deadlines();
        let deadline = |class| deadlines.of_class(class).map(|(deadline, _)| deadline);
        assert_eq!(deadline(Class::Read), Some(Duration::from_secs(3)));
        assert_eq!(deadline(Class::Write), Some(Duration::from_secs(5)));
        assert_eq!(deadline(Class::Lock), Some(Duration::from_secs(1)));
        assert_eq!(deadline(Class::Maintenance), Some(cluster_core::retention::CALL_DEADLINE));
        assert_eq!(deadline(Class::Claim), None, "a claim is not cancel safe");
        assert_eq!(Op::UnprocessedMessages.class(), Class::Claim);
        assert_eq!(Op::UnprocessedMessagesById.class(), Class::Read);
        assert_eq!(Op::TransactionCommit.class(), Class::Write);
        assert_eq!(Op::ReleaseGone.class(), Class::Lock);
        assert_eq!(Op::PurgeProcessed.class(), Class::Maintenance);
    }

    #[test]
    fn the_operations_are_listed_in_order_with_distinct_labels() {
        for (index, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, index, "{op:?} is at its own index");
        }
        let labels: std::collections::BTreeSet<_> = Op::ALL.iter().map(|op| op.label()).collect();
        assert_eq!(labels.len(), Op::ALL.len());
    }
}
