//! What the runtime hands an entity manager: a [`Delivery`] (a request, its interrupt
//! signal and where its outcome goes), and the [`ErasedManager`] interface it is handed
//! through, whatever the entity type.
//!
//! This is the seam between the routing above (local calls, persisted delivery, remote calls)
//! and the managers below: neither side names the other's types.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{Chunk, Exit, RawJson, Reply, Request};
use cluster_core::future::BoxFuture;
use cluster_core::storage::{MessageStorage, MessageTransaction};
use cluster_core::{ClusterError, EntityAddress, ShardId, Snowflake};
use tokio::sync::{mpsc, oneshot};

use crate::api::state::StateSink;
use crate::runtime::interrupt::InterruptSignal;

/// The storage transaction a `WITH_TRANSACTION` request's handler runs in.
pub type TransactionSlot = Arc<tokio::sync::Mutex<Option<Box<dyn MessageTransaction>>>>;

/// Wakes the storage read loop, instead of at its next poll: a request was saved, a shard
/// was taken, an entity type was registered.
#[derive(Debug, Default)]
pub(crate) struct ReadLatch(tokio::sync::Notify);

impl ReadLatch {
    /// Wakes the read loop (once, if it is not waiting now).
    pub(crate) fn wake(&self) {
        self.0.notify_one();
    }

    /// Completes at the next wake.
    pub(crate) fn woken(&self) -> tokio::sync::futures::Notified<'_> {
        self.0.notified()
    }
}

/// Whether this runner serves a shard now: what a manager checks before it admits a request.
pub(crate) trait Serving {
    /// Whether requests of `shard` may run here now.
    fn serves(&self, shard: &ShardId) -> bool;
}

/// A request handed to an instance, with where its exit goes.
pub(crate) struct Delivery {
    pub(crate) request: Request,
    /// Fired when the request is interrupted.
    pub(crate) cancellation: InterruptSignal,
    pub(crate) reply: ReplyTo,
    /// The storage transaction the handler runs in (persisted `WITH_TRANSACTION` requests),
    /// begun by the instance when the request starts.
    pub(crate) transaction: Option<PendingTransaction>,
    /// Set when the handler starts running the request (persisted requests: shutdown abandons
    /// the local callers of requests that never started, reference `abandonUndelivered`).
    pub(crate) started: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Where the instance hands its durable state write, to be committed with the final reply
    /// (persisted unary requests to an entity type with durable state).
    pub(crate) state: Option<StateSink>,
}

impl Delivery {
    /// How the request came, for its metrics: a persisted request carries a start flag.
    pub(crate) fn kind(&self) -> crate::metrics::RequestKind {
        if self.started.is_some() {
            crate::metrics::RequestKind::Persisted
        } else {
            crate::metrics::RequestKind::Volatile
        }
    }

    /// The delivery of a volatile request: no storage transaction, no start flag.
    pub(crate) fn volatile(
        request: Request,
        cancellation: InterruptSignal,
        reply: ReplyTo,
    ) -> Box<Delivery> {
        Box::new(Delivery {
            request,
            cancellation,
            reply,
            transaction: None,
            started: None,
            state: None,
        })
    }
}

/// The storage transaction of a `WITH_TRANSACTION` request. The instance begins it when the
/// request starts, as the reference's handler runs inside `withTransaction`
/// (`effect/src/cluster/internal/entityManager.ts`, `requestWriteOptions`), so that handing a
/// request to its entity never waits: nothing can change between the checks that admit it and
/// its arrival in the mailbox. The runtime takes it back to commit or roll back.
#[derive(Clone)]
pub(crate) struct PendingTransaction {
    storage: Arc<dyn MessageStorage>,
    slot: TransactionSlot,
}

impl PendingTransaction {
    /// A transaction to begin on `storage`.
    pub(crate) fn new(storage: Arc<dyn MessageStorage>) -> PendingTransaction {
        PendingTransaction { storage, slot: TransactionSlot::default() }
    }

    /// Where the handler finds the transaction once it is begun.
    pub(crate) fn slot(&self) -> &TransactionSlot {
        &self.slot
    }

    /// The transaction, if it was begun and not taken yet.
    pub(crate) async fn take(&self) -> Option<Box<dyn MessageTransaction>> {
        self.slot.lock().await.take()
    }

    /// Begins the transaction and keeps it in the slot.
    pub(crate) async fn begin(&self) -> Result<(), cluster_core::error::StorageError> {
        let transaction = self.storage.begin_transaction().await?;
        *self.slot.lock().await = Some(transaction);
        Ok(())
    }
}

/// Where the outcome of a request goes.
pub(crate) enum ReplyTo {
    /// The exit of a unary request.
    Exit(oneshot::Sender<Exit>),
    /// The chunks and then the final reply of a streaming request, and its acknowledgements.
    Stream(StreamReplies),
}

/// The channels of a streaming request.
pub(crate) struct StreamReplies {
    /// Chunks, then the final reply.
    pub(crate) replies: mpsc::Sender<Reply>,
    /// The ids of acknowledged chunks.
    pub(crate) acks: mpsc::Receiver<Snowflake>,
    /// The last chunk sent before a restart, for a resumed stream.
    pub(crate) last_sent: Option<Chunk>,
}

/// Why a delivery was refused.
#[derive(Debug)]
pub(crate) enum Refused {
    /// The runner holds as many instances as it may (`max_resident_entities`): retry once one
    /// is reaped. Callers see `MailboxFull`.
    ResidencyFull(EntityAddress),
    /// Anything else (the instance's mailbox is full, the manager is stopping).
    Cluster(ClusterError),
}

impl From<Refused> for ClusterError {
    fn from(refused: Refused) -> ClusterError {
        match refused {
            Refused::ResidencyFull(address) => ClusterError::MailboxFull { address },
            Refused::Cluster(error) => error,
        }
    }
}

/// What the runtime needs from a manager, whatever its entity type.
pub(crate) trait ErasedManager: Send + Sync {
    /// Hands `delivery` to its instance, creating it if needed, if `serving` serves its shard.
    /// The shard is checked under the lock that a shard's stop takes to remove its instances:
    /// a delivery either reaches an instance that the stop will see, or is refused.
    fn deliver(&self, delivery: Box<Delivery>, serving: &dyn Serving) -> Result<(), Refused>;

    /// The addresses of the resident instances.
    fn resident_addresses(&self) -> Vec<EntityAddress>;

    /// The number of resident instances.
    fn active_entities(&self) -> usize;

    /// Whether requests tagged `tag` are streaming requests.
    fn is_stream(&self, tag: &str) -> bool;

    /// Whether the request tagged `tag` with `payload` runs inside a storage transaction.
    fn with_transaction(&self, tag: &str, payload: &RawJson) -> bool;

    /// Whether the entity type declared durable state.
    fn has_state(&self) -> bool;

    /// Whether requests tagged `tag` run again when they end by interrupt.
    fn rerun_on_interrupt(&self, tag: &str) -> bool;

    /// Stops every instance and waits for them to end: no new request is admitted, the ones
    /// already delivered get `termination_timeout` to finish (the reference's graceful drain,
    /// `entityTerminationTimeout`), then the rest are interrupted.
    fn shutdown(&self, termination_timeout: Duration) -> BoxFuture<'_, ()>;

    /// Stops the instances of `shard` and waits for them to end
    /// (`effect/src/cluster/internal/entityManager.ts`): the same drain as
    /// [`shutdown`](ErasedManager::shutdown), or an immediate interruption when `force`. Instances
    /// the shard gets meanwhile are stopped too.
    fn stop_shard<'a>(
        &'a self,
        shard: &'a ShardId,
        force: bool,
        termination_timeout: Duration,
    ) -> BoxFuture<'a, ()>;

    /// Whether `shard` has instances of this type (what a stuck release waits for).
    fn has_instances_in(&self, shard: &ShardId) -> bool;
}
