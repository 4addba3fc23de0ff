//! Storage metrics: the runtime wraps the storages it is given in [`MeteredMessages`] and
//! [`MeteredRunners`], which time every operation and count its errors, by `backend` (the
//! storage's [`backend_name`](MessageStorage::backend_name)) and `operation` (the contract
//! method's name).
//!
//! Every method, the contracts' default ones included, goes to the wrapped storage, so that a
//! backend's own version of a default method keeps running. A transaction begun through the
//! wrapper is wrapped too, and hands out the backend's own handle.

use std::any::Any;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;

use cluster_core::clock::Timestamp;
use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{AckChunk, Interrupt, Reply, Request};
use cluster_core::error::StorageError;
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
}

impl Op {
    /// Every operation, in declaration order (an operation's histogram is at its index; one
    /// missing here is timed by no histogram, never a panic).
    const ALL: [Op; 40] = [
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
        }
    }
}

/// The latency histograms of one backend, one per operation, registered once.
struct Meters {
    backend: &'static str,
    latency: [metrics::Histogram; Op::ALL.len()],
}

impl Meters {
    fn new(backend: &'static str) -> Arc<Meters> {
        let latency = Op::ALL.map(|op| {
            metrics::histogram!(STORAGE_OPERATION, "backend" => backend, "operation" => op.label())
        });
        Arc::new(Meters { backend, latency })
    }

    /// Runs `operation`, recording how long it took and whether it failed.
    async fn measure<T>(
        &self,
        op: Op,
        operation: impl Future<Output = Result<T, StorageError>>,
    ) -> Result<T, StorageError> {
        let began = tokio::time::Instant::now();
        let result = operation.await;
        if let Some(latency) = self.latency.get(op as usize) {
            latency.record(began.elapsed().as_secs_f64());
        }
        if let Err(error) = &result {
            metrics::counter!(
                STORAGE_ERRORS,
                "backend" => self.backend,
                "operation" => op.label(),
                "kind" => error.kind().as_label(),
            )
            .increment(1);
        }
        result
    }
}

/// A message storage whose operations are timed and whose errors are counted.
pub(crate) struct MeteredMessages {
    inner: Arc<dyn MessageStorage>,
    meters: Arc<Meters>,
}

impl MeteredMessages {
    /// Wraps `inner`.
    pub(crate) fn wrap(inner: Arc<dyn MessageStorage>) -> Arc<dyn MessageStorage> {
        let meters = Meters::new(inner.backend_name());
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
    pub(crate) fn wrap(inner: Arc<dyn RunnerStorage>) -> Arc<dyn RunnerStorage> {
        let meters = Meters::new(inner.backend_name());
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
}

#[cfg(test)]
mod tests {
    use super::Op;

    #[test]
    fn the_operations_are_listed_in_order_with_distinct_labels() {
        for (index, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, index, "{op:?} is at its own index");
        }
        let labels: std::collections::BTreeSet<_> = Op::ALL.iter().map(|op| op.label()).collect();
        assert_eq!(labels.len(), Op::ALL.len());
    }
}
