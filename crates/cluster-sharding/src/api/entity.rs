//! Entities: keyed, single-writer actors with a typed protocol.
//!
//! An entity is a Rust type that implements [`Entity`] (its type name, how an instance is
//! created, which requests it handles) and one [`Handler`] per request type. The runtime keeps
//! at most one instance per entity id on the runner that owns the id's shard, creates it on the
//! first request, and hands it requests in delivery order. A [`Handler`] takes `&mut self`:
//! it runs alone, one request at a time (the reference's default concurrency of 1), and needs
//! no locks. A [`SharedHandler`] takes `&self`: requests of such types run alongside each
//! other, up to the entity's [`EntityOptions::concurrency`] at once, and an exclusive request
//! waits until they are done (a readers-writer discipline that Rust's borrow rules make
//! explicit; the reference lets any handler run concurrently once `concurrency` is above 1).
//! A [`ForkedHandler`] (the reference's `Rpc.fork`) runs beside all of them, without the cap,
//! on a state taken from the entity when the instance is created.
//!
//! ```
//! # use cluster_sharding::{Entity, EntityContext, Handler, Never, Protocol, RequestContext, Rpc};
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Serialize, Deserialize)]
//! # struct Increment { by: u64 }
//! # impl Rpc for Increment {
//! #     const TAG: &'static str = "Increment";
//! #     type Success = u64;
//! #     type Error = Never;
//! # }
//! struct Counter { value: u64 }
//!
//! impl Entity for Counter {
//!     const TYPE: &'static str = "Counter";
//!     async fn create(_context: &EntityContext) -> Counter { Counter { value: 0 } }
//!     fn protocol(protocol: &mut Protocol<Counter>) { protocol.handle::<Increment>(); }
//! }
//!
//! impl Handler<Increment> for Counter {
//!     async fn handle(&mut self, _: &RequestContext, request: Increment) -> Result<u64, Never> {
//!         self.value += request.by;
//!         Ok(self.value)
//!     }
//! }
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::config::Capacity;
use cluster_core::envelope::{Chunk, Exit, RawJson, Reply};
use cluster_core::error::DecodeError;
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::transaction::{BackendLock, TransactionError, TransactionSource};
use cluster_core::{ClusterError, EntityAddress, ShardGroup, Snowflake};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::api::rpc::{Rpc, StreamRpc};
use crate::api::state::Durability;
use crate::runtime::delivery::TransactionSlot;
use crate::runtime::interrupt::InterruptSignal;
use crate::runtime::keep_alive::KeepAliveHandle;

/// An entity type.
///
/// The [`entity`](crate::entity) macro implements it, with the request types and handlers,
/// from one impl block. By hand, an entity implements it and one [`Handler`] per request type,
/// and its `protocol` declares each of them:
///
/// ```
/// # use cluster_sharding::{Entity, EntityContext, Handler, Never, Protocol, RequestContext, Rpc};
/// # use serde::{Deserialize, Serialize};
/// #[derive(Serialize, Deserialize)]
/// struct Increment { by: u64 }
///
/// impl Rpc for Increment {
///     const TAG: &'static str = "Increment";
///     type Success = u64;
///     type Error = Never;
/// }
///
/// struct Counter { value: u64 }
///
/// impl Entity for Counter {
///     const TYPE: &'static str = "Counter";
///     async fn create(_context: &EntityContext) -> Counter { Counter { value: 0 } }
///     fn protocol(protocol: &mut Protocol<Counter>) { protocol.handle::<Increment>(); }
/// }
///
/// impl Handler<Increment> for Counter {
///     async fn handle(&mut self, _: &RequestContext, request: Increment) -> Result<u64, Never> {
///         self.value += request.by;
///         Ok(self.value)
///     }
/// }
/// ```
pub trait Entity: Sized + Send + 'static {
    /// The entity type's name, such as `Counter`; part of every stored message.
    const TYPE: &'static str;

    /// Whether each call of an [`EntityClient`](crate::EntityClient) of this type runs in an
    /// `entity_client` span with the entity type, id, tag and request id (the reference's
    /// `ClusterSchema.ClientTracingEnabled`, on by default). Set it to `false` for types
    /// called so often that the spans cost more than they tell.
    const CLIENT_TRACING: bool = true;

    /// Whether instances come only from a factory
    /// ([`EntityRegistration::factory`](crate::EntityRegistration::factory) or `factory_async`):
    /// then a registration without one fails to build, and [`create`](Entity::create) never
    /// runs. The [`entity`](crate::entity) macro sets it for an impl block without `create`.
    const FACTORY_ONLY: bool = false;

    /// The shard group of an entity id (`default` unless overridden).
    fn shard_group(_entity_id: &str) -> ShardGroup {
        ShardGroup::default_group()
    }

    /// A new instance for `context.address()`, created on its first request (and again after
    /// it was reaped for idleness, or restarted after a panic). `context.sharding()` is the
    /// runtime, for instances that call other entities.
    ///
    /// A registration ([`Sharding::entity`](crate::Sharding::entity)) makes instances with it;
    /// an entity type registered with a factory gets them from the factory instead, and this is
    /// never called (see
    /// [`FACTORY_ONLY`](Entity::FACTORY_ONLY)).
    fn create(context: &EntityContext) -> impl Future<Output = Self> + Send;

    /// Declares the requests the entity handles: `protocol.handle::<R>()` for each.
    fn protocol(protocol: &mut Protocol<Self>);

    /// Runs when the instance stops: reaped for idleness, or its runner shutting down (once its
    /// requests finished or were interrupted). The reference's entity finalizers: it may send
    /// requests of its own. During shutdown a discard returns `Ok` (a persisted one is stored
    /// for the next owner), a volatile call fails with `EntityNotAssignedToRunner`, and a
    /// persisted call is stored and fails with `Abandoned`, so it never waits for a runner
    /// that is going away. Bounded by [`EntityOptions::on_stop_timeout`]; a panic in it is
    /// logged. Not run when a handler panics (the instance is recreated; `Drop` still runs).
    fn on_stop(&mut self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// What [`Entity::create`] and a registration's factory
/// ([`EntityRegistration::factory`](crate::EntityRegistration::factory)) get.
///
/// Its `sharding()` method, the runtime the instance runs in, is written where that runtime
/// is (`sharding.rs`): the entity layer is below the runtime and does not name it.
#[derive(Clone)]
pub struct EntityContext {
    address: EntityAddress,
    /// The runtime, a `Sharding`, held erased: see [`RuntimeHandle`].
    pub(crate) runtime: RuntimeHandle,
}

impl std::fmt::Debug for EntityContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityContext").field("address", &self.address).finish_non_exhaustive()
    }
}

impl EntityContext {
    pub(crate) fn new(address: EntityAddress, runtime: RuntimeHandle) -> EntityContext {
        EntityContext { address, runtime }
    }

    /// The new instance's address.
    pub fn address(&self) -> &EntityAddress {
        &self.address
    }
}

/// The runtime a context hands to user code, held without naming its type: the layers below
/// the runtime (entities, singletons, cron jobs) hand it out, and the runtime is built on
/// them. Only the runtime makes one, from itself, and reads it back (in `sharding.rs`).
#[derive(Clone)]
pub(crate) struct RuntimeHandle(pub(crate) Arc<dyn std::any::Any + Send + Sync>);

/// Handles one request type `R`.
pub trait Handler<R: Rpc>: Entity {
    /// Handles `request`. Dropping the returned future interrupts the request (the caller
    /// went away, the entity is stopping); `context.cancellation()` tells the same to code that
    /// prefers to check.
    fn handle(
        &mut self,
        context: &RequestContext,
        request: R,
    ) -> impl Future<Output = Result<R::Success, R::Error>> + Send;
}

/// Handles one request type `R` through a shared reference, so that several such requests
/// run at once (up to [`EntityOptions::concurrency`]); state they change needs interior
/// mutability (atomics, a mutex). Register with [`Protocol::handle_shared`]. Every shared
/// handler is also a [`Handler`] (a blanket implementation), so clients send `R` as any
/// other request.
pub trait SharedHandler<R: Rpc>: Entity + Sync {
    /// Handles `request`, as [`Handler::handle`] but with `&self`.
    fn handle(
        &self,
        context: &RequestContext,
        request: R,
    ) -> impl Future<Output = Result<R::Success, R::Error>> + Send;
}

/// A shared handler also handles its requests alone: that is how [`Protocol::handle`] runs it,
/// and what lets clients send `R` (their `send` asks for a [`Handler`]).
impl<E: SharedHandler<R>, R: Rpc> Handler<R> for E {
    fn handle(
        &mut self,
        context: &RequestContext,
        request: R,
    ) -> impl Future<Output = Result<R::Success, R::Error>> + Send {
        SharedHandler::handle(&*self, context, request)
    }
}

/// Handles one request type `R` in a forked run (the reference's `Rpc.fork`): such requests
/// start as soon as they arrive and run beside everything else on the instance, `&mut self`
/// and [`SharedHandler`] requests alike, without the [`EntityOptions::concurrency`] cap.
/// Register with [`Protocol::handle_forked`].
///
/// A forked request cannot borrow the entity (a `&mut self` request may hold it), so it works
/// on a state of its own: [`state`](ForkedHandler::state) is taken from the entity each time
/// an instance is created (for instance a clone of an `Arc` the entity keeps), and every
/// forked request of the instance gets it. Every forked handler is also a [`SharedHandler`]
/// (a blanket implementation), so clients send `R` as any other request.
pub trait ForkedHandler<R: Rpc>: Entity + Sync {
    /// What forked requests of `R` work on.
    type State: Send + Sync + 'static;

    /// The state forked requests of `R` get, taken when an instance is created.
    fn state(&self) -> Arc<Self::State>;

    /// Handles `request`. Dropping the returned future interrupts the request.
    fn handle_forked(
        state: &Self::State,
        context: &RequestContext,
        request: R,
    ) -> impl Future<Output = Result<R::Success, R::Error>> + Send;
}

/// A forked handler also handles its requests through a shared reference, with the state it
/// takes from the entity: that is how [`Protocol::handle_shared`] or [`Protocol::handle`]
/// would run it, and what lets clients send `R`.
impl<E: ForkedHandler<R>, R: Rpc> SharedHandler<R> for E {
    fn handle(
        &self,
        context: &RequestContext,
        request: R,
    ) -> impl Future<Output = Result<R::Success, R::Error>> + Send {
        let state = ForkedHandler::state(self);
        async move { E::handle_forked(&state, context, request).await }
    }
}

/// Handles one streaming request type `R` in a forked run, as [`ForkedHandler`] does for
/// unary requests. Register with [`Protocol::stream_forked`]. Every forked stream handler is
/// also a [`StreamHandler`] (a blanket implementation), so clients stream `R` as any other.
pub trait ForkedStreamHandler<R: StreamRpc>: Entity {
    /// What forked requests of `R` work on.
    type State: Send + Sync + 'static;

    /// The state forked requests of `R` get, taken when an instance is created.
    fn state(&self) -> Arc<Self::State>;

    /// Handles `request`, sending its items with [`Chunks::send`].
    fn handle_forked(
        state: &Self::State,
        context: &RequestContext,
        request: R,
        chunks: &mut Chunks<'_, R::Item>,
    ) -> impl Future<Output = Result<(), R::Error>> + Send;
}

/// A forked stream handler also handles its requests alone, with the state it takes from the
/// entity: that is how [`Protocol::stream`] would run it, and what lets clients stream `R`.
impl<E: ForkedStreamHandler<R>, R: StreamRpc> StreamHandler<R> for E {
    fn handle(
        &mut self,
        context: &RequestContext,
        request: R,
        chunks: &mut Chunks<'_, R::Item>,
    ) -> impl Future<Output = Result<(), R::Error>> + Send {
        let state = ForkedStreamHandler::state(&*self);
        async move { E::handle_forked(&state, context, request, chunks).await }
    }
}

/// Handles one streaming request type `R`.
pub trait StreamHandler<R: StreamRpc>: Entity {
    /// Handles `request`, sending its items with [`Chunks::send`]. Returning ends the stream
    /// (with the error, if any). Dropping the future interrupts the request.
    fn handle(
        &mut self,
        context: &RequestContext,
        request: R,
        chunks: &mut Chunks<'_, R::Item>,
    ) -> impl Future<Output = Result<(), R::Error>> + Send;
}

/// The most items the runtime coalesces into one chunk (see [`Chunks::send`]).
pub const CHUNK_ITEMS_MAX: usize = 256;

/// The most encoded bytes (the items' JSON, summed) the runtime coalesces into one chunk; an
/// item larger than this goes alone.
pub const CHUNK_BYTES_MAX: usize = 32 * 1024;

/// The sending side of a streamed response.
///
/// Items are queued and sent by a pump that runs beside the handler: it keeps at most one
/// chunk unacknowledged by the caller, and the items queued meanwhile go together into the next
/// chunk, at most [`CHUNK_ITEMS_MAX`] items and [`CHUNK_BYTES_MAX`] encoded bytes. A chunk is a
/// JSON array of items, as in the reference, so a caller on another implementation reads it.
/// When the handler returns, everything queued is sent and acknowledged before the stream's
/// final reply.
pub struct Chunks<'c, T> {
    pump: &'c ChunkPump,
    item: std::marker::PhantomData<fn(T)>,
}

/// Why a chunk was not sent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkError {
    /// The item cannot be encoded.
    #[error("the item cannot be encoded: {0}")]
    Malformed(#[from] cluster_core::DecodeError),
    /// The caller is gone or the request was interrupted.
    #[error("the stream was interrupted")]
    Interrupted,
}

impl<T: Serialize + DeserializeOwned> Chunks<'_, T> {
    /// Queues one item. It returns at once while the chunk being filled has room, and waits
    /// (backpressure) while a full chunk waits for the caller to acknowledge the previous one.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped send has queued nothing.
    pub async fn send(&mut self, item: T) -> Result<(), ChunkError> {
        let value = RawJson::encode(&item)?;
        self.pump.queue(vec![value]).await
    }

    /// Queues `items` to go out together in one chunk, whatever the coalescing bounds (items
    /// queued before may share it when everything fits within them). An empty batch sends
    /// nothing.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped send has queued nothing.
    pub async fn send_batch(
        &mut self,
        items: impl IntoIterator<Item = T>,
    ) -> Result<(), ChunkError> {
        let values =
            items.into_iter().map(|item| RawJson::encode(&item)).collect::<Result<Vec<_>, _>>()?;
        if values.is_empty() {
            return Ok(());
        }
        self.pump.queue(values).await
    }

    /// Waits until every queued item was sent and its chunk acknowledged by the caller (for a
    /// persisted stream: stored, then acknowledged through storage).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the items stay queued.
    pub async fn flush(&mut self) -> Result<(), ChunkError> {
        self.pump.flush().await
    }

    /// The sequence number the next chunk gets: 0 for a fresh stream, one past the last chunk
    /// sent before a restart for a resumed one. With coalescing, a chunk holds one item or
    /// more, so this counts chunks, not items.
    pub fn next_sequence(&self) -> u32 {
        self.pump.lock().next_sequence
    }

    /// The last item of the last chunk sent, such as the item sent before a restart when a
    /// persisted stream resumes.
    pub fn last_sent(&self) -> Option<T> {
        let outbox = self.pump.lock();
        let chunk = outbox.last_sent.as_ref()?;
        chunk.values().last()?.decode().ok()
    }
}

/// The untyped chunk channel of one streaming request: chunk replies go out, acknowledgements
/// (the acknowledged chunk's id) come back.
pub(crate) struct ChunkChannel {
    pub(crate) request_id: Snowflake,
    pub(crate) next_sequence: u32,
    pub(crate) last_sent: Option<Chunk>,
    pub(crate) replies: mpsc::Sender<Reply>,
    pub(crate) acks: mpsc::Receiver<Snowflake>,
    pub(crate) ids: Arc<Ids>,
}

/// What the handler queued and what the pump sent.
struct Outbox {
    /// The items of the next chunk.
    pending: Vec<RawJson>,
    /// Their encoded size.
    pending_bytes: usize,
    /// A chunk was sent and not acknowledged yet.
    in_flight: bool,
    /// The handler is done: the pump ends once everything went out.
    closed: bool,
    /// The caller is gone: nothing more goes out.
    failed: bool,
    next_sequence: u32,
    last_sent: Option<Chunk>,
}

impl Outbox {
    /// Whether `values` may join the pending chunk.
    fn fits(&self, values: &[RawJson], bytes: usize) -> bool {
        self.pending.is_empty()
            || (self.pending.len().saturating_add(values.len()) <= CHUNK_ITEMS_MAX
                && self.pending_bytes.saturating_add(bytes) <= CHUNK_BYTES_MAX)
    }
}

/// The queue between a streaming handler ([`Chunks`]) and its pump ([`ChunkPump::run`]).
pub(crate) struct ChunkPump {
    outbox: std::sync::Mutex<Outbox>,
    /// Wakes the pump: items were queued, or the handler is done.
    queued: tokio::sync::Notify,
    /// Wakes the handler's waits: room was made, a chunk was acknowledged, the caller left.
    changed: tokio::sync::Notify,
}

/// The encoded size of a value.
fn encoded_len(value: &RawJson) -> usize {
    value.json().map_or(0, str::len)
}

impl ChunkPump {
    fn new(channel: &ChunkChannel) -> ChunkPump {
        ChunkPump {
            outbox: std::sync::Mutex::new(Outbox {
                pending: Vec::new(),
                pending_bytes: 0,
                in_flight: false,
                closed: false,
                failed: false,
                next_sequence: channel.next_sequence,
                last_sent: channel.last_sent.clone(),
            }),
            queued: tokio::sync::Notify::new(),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Outbox> {
        // Every critical section leaves the outbox whole: a panic cannot break it.
        lock(&self.outbox)
    }

    /// Queues `values` for one chunk, waiting while the pending chunk has no room for them.
    pub(crate) async fn queue(&self, values: Vec<RawJson>) -> Result<(), ChunkError> {
        let bytes = values.iter().map(encoded_len).fold(0, usize::saturating_add);
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            {
                let mut outbox = self.lock();
                if outbox.failed {
                    return Err(ChunkError::Interrupted);
                }
                if outbox.fits(&values, bytes) {
                    outbox.pending.extend(values);
                    outbox.pending_bytes = outbox.pending_bytes.saturating_add(bytes);
                    drop(outbox);
                    self.queued.notify_one();
                    return Ok(());
                }
            }
            changed.await;
        }
    }

    /// Waits until nothing is pending or unacknowledged.
    async fn flush(&self) -> Result<(), ChunkError> {
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            {
                let outbox = self.lock();
                if outbox.failed {
                    return Err(ChunkError::Interrupted);
                }
                if outbox.pending.is_empty() && !outbox.in_flight {
                    return Ok(());
                }
            }
            changed.await;
        }
    }

    /// The handler is done: the pump ends once everything queued went out.
    fn close(&self) {
        self.lock().closed = true;
        self.queued.notify_one();
    }

    /// The caller is gone: every wait of the handler fails.
    fn fail(&self) {
        self.lock().failed = true;
        self.changed.notify_waiters();
    }

    /// Sends the queued items, one chunk at a time, each once the previous one was
    /// acknowledged; ends when the handler is done and everything went out, or the caller is
    /// gone. Leaves the channel's sequence and last chunk where a restarted run continues.
    async fn run(&self, channel: &mut ChunkChannel) {
        loop {
            let chunk = {
                let mut outbox = self.lock();
                if outbox.pending.is_empty() {
                    if outbox.closed {
                        return;
                    }
                    None
                } else {
                    let values = std::mem::take(&mut outbox.pending);
                    outbox.pending_bytes = 0;
                    let id = channel.ids.next();
                    let chunk = Chunk::new(channel.request_id, id, outbox.next_sequence, values);
                    if let Some(chunk) = &chunk {
                        outbox.next_sequence = outbox.next_sequence.saturating_add(1);
                        outbox.last_sent = Some(chunk.clone());
                        outbox.in_flight = true;
                        // Sequence and last chunk move on when the chunk is sent, as in the
                        // reference's entity manager: a restarted run never reuses a sequence
                        // that the caller may have seen.
                        channel.next_sequence = outbox.next_sequence;
                        channel.last_sent = Some(chunk.clone());
                    }
                    chunk
                }
            };
            let Some(chunk) = chunk else {
                self.queued.notified().await;
                continue;
            };
            // The pending chunk was emptied: waiting senders may fill the next one.
            self.changed.notify_waiters();
            let id = chunk.id();
            let items = chunk.values().len();
            tracing::trace!(request_id = %channel.request_id, sequence = chunk.sequence(), items, "chunk");
            if channel.replies.send(Reply::Chunk(chunk)).await.is_err() {
                return self.fail();
            }
            loop {
                match channel.acks.recv().await {
                    // An acknowledgement of another chunk is stale: ignored, as in the reference.
                    Some(acked) if acked == id => break,
                    Some(_) => {}
                    None => return self.fail(),
                }
            }
            self.lock().in_flight = false;
            self.changed.notify_waiters();
        }
    }
}

/// The source of ids shared by a runtime and its managers.
pub(crate) struct Ids {
    clock: Arc<dyn cluster_core::Clock>,
    /// Lock-free: every request of every worker takes an id.
    generator: cluster_core::SharedSnowflakeGenerator,
}

impl Ids {
    pub(crate) fn new(
        clock: Arc<dyn cluster_core::Clock>,
        generator: cluster_core::SharedSnowflakeGenerator,
    ) -> Ids {
        Ids { clock, generator }
    }

    /// A fresh id.
    pub(crate) fn next(&self) -> Snowflake {
        self.generator.next(self.clock.now())
    }

    /// Stamps new ids with `machine_id`.
    pub(crate) fn set_machine_id(&self, machine_id: cluster_core::MachineId) {
        self.generator.set_machine_id(machine_id);
    }
}

/// Locks the transaction in `slot` and lends its backend handle: the
/// [`TransactionSource::lock_backend`] of a context that holds a slot ([`RequestContext`], and
/// the activity context of `cluster-workflow`).
///
/// # Errors
///
/// [`TransactionError::Missing`] without a slot, [`TransactionError::Finished`] when the
/// transaction was already taken out of it.
///
/// # Cancel safety
///
/// Cancel safe: a dropped future holds no lock.
pub fn lock_backend(
    slot: Option<&TransactionSlot>,
) -> BoxFuture<'_, Result<BackendLock<'_>, TransactionError>> {
    Box::pin(async move {
        let slot = slot.ok_or(TransactionError::Missing)?;
        let transaction = slot.lock().await;
        let backend = tokio::sync::MutexGuard::try_map(transaction, |transaction| {
            transaction.as_mut().map(|transaction| transaction.backend())
        })
        .map_err(|_| TransactionError::Finished)?;
        Ok(Box::new(backend) as BackendLock<'_>)
    })
}

/// What a handler knows about the request it handles.
#[derive(Clone)]
pub struct RequestContext {
    address: EntityAddress,
    request_id: Snowflake,
    cancellation: InterruptSignal,
    transaction: Option<TransactionSlot>,
    keep_alive: KeepAliveHandle,
    /// The request's headers, unless it has none.
    headers: Option<RawJson>,
}

impl std::fmt::Debug for RequestContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestContext")
            .field("address", &self.address)
            .field("request_id", &self.request_id)
            .field("transaction", &self.transaction.is_some())
            .finish_non_exhaustive()
    }
}

/// The handler's storage transaction, for a typed guard such as
/// `cluster_storage_sql::PgTransactionGuard::of(context)`: a `WITH_TRANSACTION` request's
/// handler runs its own statements in the transaction its reply is saved in.
impl TransactionSource for RequestContext {
    fn lock_backend(&self) -> BoxFuture<'_, Result<BackendLock<'_>, TransactionError>> {
        lock_backend(self.transaction.as_ref())
    }
}

impl RequestContext {
    pub(crate) fn new(
        address: EntityAddress,
        request_id: Snowflake,
        cancellation: InterruptSignal,
        transaction: Option<TransactionSlot>,
        keep_alive: KeepAliveHandle,
        headers: &RawJson,
    ) -> RequestContext {
        let headers = match headers.json() {
            None | Some("{}") => None,
            Some(_) => Some(headers.clone()),
        };
        RequestContext { address, request_id, cancellation, transaction, keep_alive, headers }
    }

    /// The request's headers (see `EntityClient::with_headers`); empty when it has none.
    /// Headers that are not an object of strings (a malformed peer) read as empty.
    pub fn headers(&self) -> BTreeMap<String, String> {
        self.headers.as_ref().and_then(|headers| headers.decode().ok()).unwrap_or_default()
    }

    /// Keeps the entity resident, never reaped for idleness, until called with `false` (the
    /// reference's `Entity.keepAlive`). With a message storage the keep-alive is a stored
    /// request that stays unanswered while it lasts, so a restarted runner activates the
    /// entity again without waiting for a request. Enabling fails only if that request cannot
    /// be stored or delivered.
    pub async fn keep_alive(&self, enabled: bool) -> Result<(), ClusterError> {
        self.keep_alive.set(&self.address, enabled).await
    }

    /// The storage transaction of a persisted `WITH_TRANSACTION` request, `None` for other
    /// requests: the slot the runtime saves the reply in, for engines built on the runtime.
    /// A handler runs its own statements through a typed guard instead
    /// ([`TransactionSource`], which this context implements; for example
    /// `cluster_storage_sql::PgTransactionGuard::of(context)`).
    pub fn transaction(&self) -> Option<&TransactionSlot> {
        self.transaction.as_ref()
    }

    /// The entity's address.
    pub fn address(&self) -> &EntityAddress {
        &self.address
    }

    /// The request's id.
    pub fn request_id(&self) -> Snowflake {
        self.request_id
    }

    /// Cancelled when the request is interrupted; cancelling it interrupts the request.
    pub fn cancellation(&self) -> &CancellationToken {
        self.cancellation.token()
    }
}

/// A type-erased handler call: decode the payload, run the handler, encode its outcome.
pub(crate) type Call<E> =
    for<'a> fn(&'a mut E, &'a RequestContext, &'a RawJson) -> BoxFuture<'a, Exit>;

/// A type-erased shared handler call.
pub(crate) type SharedCall<E> =
    for<'a> fn(&'a E, &'a RequestContext, &'a RawJson) -> BoxFuture<'a, Exit>;

/// A type-erased streaming handler call.
pub(crate) type StreamCall<E> = for<'a> fn(
    &'a mut E,
    &'a RequestContext,
    &'a RawJson,
    &'a mut ChunkChannel,
) -> BoxFuture<'a, Exit>;

/// A type-erased forked handler call, on the state of its request type.
pub(crate) type ForkedCall =
    for<'a> fn(&'a SharedValue, &'a RequestContext, &'a RawJson) -> BoxFuture<'a, Exit>;

/// A type-erased forked streaming handler call.
pub(crate) type ForkedStreamCall = for<'a> fn(
    &'a SharedValue,
    &'a RequestContext,
    &'a RawJson,
    &'a mut ChunkChannel,
) -> BoxFuture<'a, Exit>;

/// How a request type is handled.
pub(crate) enum CallKind<E> {
    /// One reply, with the entity to itself.
    Unary(Call<E>),
    /// One reply, alongside other shared requests.
    Shared(SharedCall<E>),
    /// Chunks, then the final reply.
    Stream(StreamCall<E>),
    /// One reply, beside everything else, on the request type's forked state.
    Forked(ForkedCall),
    /// Chunks, then the final reply, beside everything else.
    ForkedStream(ForkedStreamCall),
}

impl<E> CallKind<E> {
    /// Whether the request type runs forked.
    pub(crate) fn is_forked(&self) -> bool {
        matches!(self, CallKind::Forked(_) | CallKind::ForkedStream(_))
    }

    /// Whether the request type is answered with a stream.
    pub(crate) fn is_stream(&self) -> bool {
        matches!(self, CallKind::Stream(_) | CallKind::ForkedStream(_))
    }
}

/// One request type of a protocol.
pub(crate) struct HandlerEntry<E> {
    pub(crate) call: CallKind<E>,
    /// Interrupted as soon as the entity starts stopping.
    pub(crate) interrupt_on_termination: bool,
    /// Whether it runs inside a storage transaction (persisted requests).
    pub(crate) with_transaction: Transactional,
    /// Runs again when it ends by interrupt (persisted, server-side `Uninterruptible`).
    pub(crate) rerun_on_interrupt: bool,
    /// Takes the forked state from a new entity value (forked request types only).
    pub(crate) fork_state: Option<fn(&E) -> SharedValue>,
    /// Its request metrics (no-ops until [`Protocol::measured`]).
    pub(crate) metrics: crate::metrics::RequestMetrics,
}

impl<E> HandlerEntry<E> {
    /// The entry of the unary request type `R`, with its flags.
    pub(crate) fn unary<R: Rpc>(call: CallKind<E>) -> HandlerEntry<E> {
        HandlerEntry {
            call,
            interrupt_on_termination: R::INTERRUPT_ON_TERMINATION && !R::UNINTERRUPTIBLE.server(),
            with_transaction: match (R::PERSISTED, R::WITH_TRANSACTION_PER_REQUEST) {
                (false, _) => Transactional::Never,
                (true, true) => Transactional::PerRequest(transaction_of::<R>),
                (true, false) if R::WITH_TRANSACTION => Transactional::Always,
                (true, false) => Transactional::Never,
            },
            rerun_on_interrupt: R::UNINTERRUPTIBLE.server() && R::PERSISTED,
            fork_state: None,
            metrics: crate::metrics::RequestMetrics::default(),
        }
    }

    /// The entry of a streaming request type: never in a transaction, never re-run on an
    /// interrupt, forked when it has a `fork_state`.
    pub(crate) fn stream(call: CallKind<E>, fork_state: Option<fn(&E) -> SharedValue>) -> Self {
        HandlerEntry {
            call,
            interrupt_on_termination: false,
            with_transaction: Transactional::Never,
            rerun_on_interrupt: false,
            fork_state,
            metrics: crate::metrics::RequestMetrics::default(),
        }
    }
}

/// Whether the requests of one type run inside a storage transaction.
#[derive(Clone, Copy)]
pub(crate) enum Transactional {
    /// Never.
    Never,
    /// Always (`Rpc::WITH_TRANSACTION`).
    Always,
    /// As the decoded request says (`Rpc::with_transaction`).
    PerRequest(fn(&RawJson) -> bool),
}

impl Transactional {
    /// Whether the request with this payload runs inside a transaction. A payload that does
    /// not decode runs without one (its handler answers it as malformed).
    pub(crate) fn of(self, payload: &RawJson) -> bool {
        match self {
            Transactional::Never => false,
            Transactional::Always => true,
            Transactional::PerRequest(decide) => decide(payload),
        }
    }
}

/// Decodes a payload of `R` and asks it whether it runs inside a transaction.
fn transaction_of<R: Rpc>(payload: &RawJson) -> bool {
    payload.decode::<R>().is_ok_and(|request| request.with_transaction())
}

/// An entity value shared by the running `&self` requests of one instance. Type-erased so that
/// only entity types with shared handlers need to be `Sync`.
pub(crate) type SharedValue = Arc<dyn std::any::Any + Send + Sync>;

/// How the value of an entity type with shared handlers is shared and taken back.
pub(crate) struct Sharing<E> {
    /// Shares the value.
    pub(crate) share: fn(E) -> SharedValue,
    /// Takes the value back; fails while other shares exist.
    pub(crate) unshare: fn(SharedValue) -> Result<E, SharedValue>,
}

/// What a request type says about its delivery, for a caller that holds its payload as JSON.
#[derive(Clone, Copy)]
pub(crate) struct RpcShape {
    pub(crate) tag: &'static str,
    pub(crate) persisted: bool,
    /// Uninterruptible on the client side.
    pub(crate) uninterruptible: bool,
    /// Its success is `()`.
    pub(crate) void_success: bool,
    /// It answers with a stream.
    pub(crate) stream: bool,
    /// Reads a payload as the type: its primary key and delivery time.
    pub(crate) read: ReadPayload,
}

/// Decodes a payload as a request type and gives its primary key and delivery time.
pub(crate) type ReadPayload =
    fn(&RawJson) -> Result<(Option<String>, Option<cluster_core::Timestamp>), DecodeError>;

impl RpcShape {
    fn unary<R: Rpc>() -> RpcShape {
        RpcShape {
            tag: R::TAG,
            persisted: R::PERSISTED,
            uninterruptible: R::UNINTERRUPTIBLE.client(),
            void_success: std::any::TypeId::of::<R::Success>() == std::any::TypeId::of::<()>(),
            stream: false,
            read: read_payload::<R>,
        }
    }

    fn stream<R: StreamRpc>() -> RpcShape {
        RpcShape {
            tag: R::TAG,
            persisted: R::PERSISTED,
            uninterruptible: false,
            void_success: false,
            stream: true,
            read: read_stream_payload::<R>,
        }
    }
}

/// Decodes `payload` as `R`: its primary key and delivery time.
fn read_payload<R: Rpc>(
    payload: &RawJson,
) -> Result<(Option<String>, Option<cluster_core::Timestamp>), DecodeError> {
    let request: R = payload.decode()?;
    Ok((request.primary_key(), request.deliver_at()))
}

/// Decodes `payload` as the streaming `R`: its primary key (a stream has no delivery time).
fn read_stream_payload<R: StreamRpc>(
    payload: &RawJson,
) -> Result<(Option<String>, Option<cluster_core::Timestamp>), DecodeError> {
    let request: R = payload.decode()?;
    Ok((request.primary_key(), None))
}

/// The requests an entity type handles, by tag.
pub struct Protocol<E> {
    handlers: BTreeMap<&'static str, HandlerEntry<E>>,
    sharing: Option<Sharing<E>>,
    /// What each request type says about its delivery, by tag, for gateways.
    shapes: BTreeMap<&'static str, RpcShape>,
    /// The entity's durable state, if it declared one.
    durability: Option<Durability<E>>,
}

impl<E: Entity> Protocol<E> {
    pub(crate) fn of() -> Protocol<E> {
        let mut protocol = Protocol {
            handlers: BTreeMap::new(),
            sharing: None,
            shapes: BTreeMap::new(),
            durability: None,
        };
        E::protocol(&mut protocol);
        protocol
    }

    /// Declares that the entity handles `R`.
    pub fn handle<R: Rpc>(&mut self) -> &mut Protocol<E>
    where
        E: Handler<R>,
    {
        self.handlers.insert(R::TAG, HandlerEntry::unary::<R>(CallKind::Unary(call::<E, R>)));
        self.shapes.insert(R::TAG, RpcShape::unary::<R>());
        self
    }

    /// Declares the entity's durable state: the part of the entity value that `field` reaches
    /// (a field, or the whole value with `|entity| entity`), kept in storage across restarts,
    /// moves and crashes.
    ///
    /// - It is loaded once per activation, right after the value is made (`create` or the
    ///   factory), and replaces what `field` reaches then. Without a stored row, the state stays
    ///   as `create` made it.
    /// - After a `&mut self` request that succeeded and changed it, it is written: in the
    ///   transaction of the final reply for a persisted request (exactly once), before the reply
    ///   for a volatile one.
    /// - A request that fails (`Err`, a panic, an interrupt) changes nothing: the value gets
    ///   its committed state back.
    /// - Every write is conditional on the revision that was loaded. A runner that lost the
    ///   entity's shard cannot overwrite what the next owner wrote.
    /// - A state equal to the one `create` makes is not stored: its row is deleted.
    ///
    /// The runtime needs a message storage (SQLite, PostgreSQL, MySQL or memory): registering a
    /// durable entity on a runtime without one fails. `&self` and forked handlers read the
    /// state but do not change it, and a streaming handler that changes it fails with a
    /// defect. See docs/sharding.md, "Entity state".
    ///
    /// ```
    /// # use cluster_sharding::{Entity, EntityContext, Protocol};
    /// struct Account { balance: u64 }
    ///
    /// impl Entity for Account {
    ///     const TYPE: &'static str = "Account";
    ///     async fn create(_: &EntityContext) -> Account { Account { balance: 0 } }
    ///     fn protocol(protocol: &mut Protocol<Account>) {
    ///         protocol.durable(|account| &mut account.balance);
    ///     }
    /// }
    /// ```
    pub fn durable<S>(&mut self, field: fn(&mut E) -> &mut S) -> &mut Protocol<E>
    where
        S: Serialize + DeserializeOwned + 'static,
    {
        self.durability = Some(Durability::of(field));
        self
    }

    /// The entity's durable state, if it declared one.
    pub(crate) fn durability(&self) -> Option<&Durability<E>> {
        self.durability.as_ref()
    }

    /// Declares that the entity handles `R` through a shared reference: such requests run
    /// alongside each other, up to [`EntityOptions::concurrency`] at once.
    pub fn handle_shared<R: Rpc>(&mut self) -> &mut Protocol<E>
    where
        E: SharedHandler<R>,
    {
        let entry = HandlerEntry::unary::<R>(CallKind::Shared(shared_call::<E, R>));
        self.handlers.insert(R::TAG, entry);
        self.shapes.insert(R::TAG, RpcShape::unary::<R>());
        self.sharing = Some(Sharing { share: share::<E>, unshare: unshare::<E> });
        self
    }

    /// Declares that the entity handles the streaming request `R`.
    pub fn stream<R: StreamRpc>(&mut self) -> &mut Protocol<E>
    where
        E: StreamHandler<R>,
    {
        let entry = HandlerEntry::stream(CallKind::Stream(stream_call::<E, R>), None);
        self.handlers.insert(R::TAG, entry);
        self.shapes.insert(R::TAG, RpcShape::stream::<R>());
        self
    }

    /// Declares that the entity handles `R` in forked runs: each such request starts when it
    /// arrives and runs beside every other request of the instance, without the
    /// [`EntityOptions::concurrency`] cap (the reference's `Rpc.fork`).
    pub fn handle_forked<R: Rpc>(&mut self) -> &mut Protocol<E>
    where
        E: ForkedHandler<R>,
    {
        let mut entry = HandlerEntry::unary::<R>(CallKind::Forked(forked_call::<E, R>));
        entry.fork_state = Some(|entity: &E| -> SharedValue { ForkedHandler::<R>::state(entity) });
        self.handlers.insert(R::TAG, entry);
        self.shapes.insert(R::TAG, RpcShape::unary::<R>());
        self
    }

    /// Declares that the entity handles the streaming request `R` in forked runs, as
    /// [`handle_forked`](Protocol::handle_forked) does for unary requests.
    pub fn stream_forked<R: StreamRpc>(&mut self) -> &mut Protocol<E>
    where
        E: ForkedStreamHandler<R>,
    {
        let fork_state = |entity: &E| -> SharedValue { ForkedStreamHandler::<R>::state(entity) };
        let call = CallKind::ForkedStream(forked_stream_call::<E, R>);
        let entry = HandlerEntry::stream(call, Some(fork_state));
        self.handlers.insert(R::TAG, entry);
        self.shapes.insert(R::TAG, RpcShape::stream::<R>());
        self
    }

    /// Registers the request metrics of every request type, labelled with `entity_type`.
    pub(crate) fn measured(mut self, entity_type: &str) -> Protocol<E> {
        for (tag, entry) in &mut self.handlers {
            let stream = entry.call.is_stream();
            entry.metrics = crate::metrics::RequestMetrics::register(entity_type, tag, stream);
        }
        self
    }

    /// What each request type says about its delivery, in tag order.
    pub(crate) fn shapes(&self) -> Vec<RpcShape> {
        self.shapes.values().copied().collect()
    }

    /// The forked states of a new entity value, by request tag.
    pub(crate) fn fork_states(&self, entity: &E) -> BTreeMap<&'static str, SharedValue> {
        self.handlers
            .iter()
            .filter_map(|(tag, entry)| entry.fork_state.map(|state| (*tag, state(entity))))
            .collect()
    }

    /// Whether some request type runs forked.
    pub(crate) fn has_forked(&self) -> bool {
        self.handlers.values().any(|entry| entry.call.is_forked())
    }

    /// Declares the request type `tag` with its entry.
    pub(crate) fn insert(&mut self, tag: &'static str, entry: HandlerEntry<E>) {
        self.handlers.insert(tag, entry);
    }

    pub(crate) fn get(&self, tag: &str) -> Option<&HandlerEntry<E>> {
        self.handlers.get(tag)
    }

    /// How values are shared, if the type has shared handlers.
    pub(crate) fn sharing(&self) -> Option<&Sharing<E>> {
        self.sharing.as_ref()
    }
}

fn share<E: Entity + Sync>(entity: E) -> SharedValue {
    Arc::new(entity)
}

fn unshare<E: Entity + Sync>(value: SharedValue) -> Result<E, SharedValue> {
    let entity: Arc<E> = value.downcast().map_err(|value| value as SharedValue)?;
    Arc::try_unwrap(entity).map_err(|entity| entity as SharedValue)
}

fn call<'a, E: Handler<R>, R: Rpc>(
    entity: &'a mut E,
    context: &'a RequestContext,
    payload: &'a RawJson,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let request: R = match payload.decode() {
            Ok(request) => request,
            Err(error) => return malformed(&error.to_string()),
        };
        exit_of::<R>(Handler::handle(entity, context, request).await)
    })
}

fn shared_call<'a, E: SharedHandler<R>, R: Rpc>(
    entity: &'a E,
    context: &'a RequestContext,
    payload: &'a RawJson,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let request: R = match payload.decode() {
            Ok(request) => request,
            Err(error) => return malformed(&error.to_string()),
        };
        exit_of::<R>(SharedHandler::handle(entity, context, request).await)
    })
}

fn forked_call<'a, E: ForkedHandler<R>, R: Rpc>(
    state: &'a SharedValue,
    context: &'a RequestContext,
    payload: &'a RawJson,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let Some(state) = state.downcast_ref::<<E as ForkedHandler<R>>::State>() else {
            return malformed("a forked state of another type");
        };
        let request: R = match payload.decode() {
            Ok(request) => request,
            Err(error) => return malformed(&error.to_string()),
        };
        exit_of::<R>(E::handle_forked(state, context, request).await)
    })
}

fn forked_stream_call<'a, E: ForkedStreamHandler<R>, R: StreamRpc>(
    state: &'a SharedValue,
    context: &'a RequestContext,
    payload: &'a RawJson,
    channel: &'a mut ChunkChannel,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let Some(state) = state.downcast_ref::<<E as ForkedStreamHandler<R>>::State>() else {
            return malformed("a forked state of another type");
        };
        let request: R = match payload.decode() {
            Ok(request) => request,
            Err(error) => return malformed(&error.to_string()),
        };
        let pump = ChunkPump::new(channel);
        let handled = async {
            let mut chunks = Chunks { pump: &pump, item: std::marker::PhantomData };
            let result = E::handle_forked(state, context, request, &mut chunks).await;
            // Everything queued goes out before the final reply.
            pump.close();
            result
        };
        let (result, ()) = tokio::join!(handled, pump.run(channel));
        stream_exit(&pump, result)
    })
}

/// Runs an untyped streaming handler beside its chunk pump; its exit, once everything it
/// queued went out (an interrupt if the caller went away first).
pub(crate) async fn stream_with(
    channel: &mut ChunkChannel,
    handler: impl for<'p> FnOnce(&'p ChunkPump) -> BoxFuture<'p, Exit>,
) -> Exit {
    let pump = ChunkPump::new(channel);
    let handled = async {
        let exit = handler(&pump).await;
        pump.close();
        exit
    };
    let (exit, ()) = tokio::join!(handled, pump.run(channel));
    if exit.is_success() && pump.lock().failed { Exit::interrupt() } else { exit }
}

/// The exit of a streaming handler's result, once its pump ended: an interrupt if the caller
/// went away before everything went out.
fn stream_exit<Err: Serialize>(pump: &ChunkPump, result: Result<(), Err>) -> Exit {
    match result {
        Ok(()) if pump.lock().failed => Exit::interrupt(),
        Ok(()) => Exit::void(),
        Err(error) => {
            RawJson::encode(&error).map_or_else(|error| malformed(&error.to_string()), Exit::fail)
        }
    }
}

/// The exit of a handler's result.
fn exit_of<R: Rpc>(result: Result<R::Success, R::Error>) -> Exit {
    match result {
        Ok(success) => RawJson::encode(&success)
            .map_or_else(|error| malformed(&error.to_string()), Exit::Success),
        Err(error) => {
            RawJson::encode(&error).map_or_else(|error| malformed(&error.to_string()), Exit::fail)
        }
    }
}

fn stream_call<'a, E: StreamHandler<R>, R: StreamRpc>(
    entity: &'a mut E,
    context: &'a RequestContext,
    payload: &'a RawJson,
    channel: &'a mut ChunkChannel,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let request: R = match payload.decode() {
            Ok(request) => request,
            Err(error) => return malformed(&error.to_string()),
        };
        let pump = ChunkPump::new(channel);
        let handled = async {
            let mut chunks = Chunks { pump: &pump, item: std::marker::PhantomData };
            let result = entity.handle(context, request, &mut chunks).await;
            // Everything queued goes out before the final reply.
            pump.close();
            result
        };
        let (result, ()) = tokio::join!(handled, pump.run(channel));
        stream_exit(&pump, result)
    })
}

/// The defect of a payload or reply that cannot be encoded or decoded
/// (`effect/src/cluster/internal/entityManager.ts`).
pub(crate) fn malformed(message: &str) -> Exit {
    Exit::die_with_message("MalformedMessage", message)
}

/// How an entity type runs; `None` fields take the runner's [`ShardingConfig`] default.
///
/// [`ShardingConfig`]: cluster_core::ShardingConfig
#[derive(Clone, Copy, Debug, Default)]
pub struct EntityOptions {
    /// How long an instance with no request in flight lives before it is reaped; `Some(None)`
    /// never reaps (`entity_max_idle_time` by default).
    pub max_idle_time: Option<Option<Duration>>,
    /// How many requests an instance holds, running and waiting, before further ones fail with
    /// `MailboxFull` (`entity_mailbox_capacity` by default).
    pub mailbox_capacity: Option<Capacity>,
    /// How many [`SharedHandler`] requests of one instance run at once (1 by default, as in the
    /// reference). Requests to `&mut self` [`Handler`]s always run alone.
    pub concurrency: Option<Capacity>,
    /// How long [`Entity::on_stop`] may run before it is dropped ([`DEFAULT_ON_STOP_TIMEOUT`]
    /// by default), at most [`INTERVAL_MAX`](cluster_core::config::INTERVAL_MAX).
    pub on_stop_timeout: Option<Duration>,
    /// What a handler's panic does to its request ([`Defects::Answer`] by default).
    pub defects: Option<Defects>,
    /// How many instances of this type may be resident on one runner, besides the runner-wide
    /// `max_resident_entities` (unbounded by default). At either cap, a new instance makes
    /// room by passivating the least recently used idle instances; when none is idle, the
    /// request fails with `MailboxFull` (a persisted one waits in storage).
    pub max_resident: Option<Capacity>,
}

/// What a handler's panic does to the request it was handling ([`EntityOptions::defects`]).
/// Either way the instance is recreated after the type's backoff (its state may be half
/// changed), and the other requests it was running run again on the new one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Defects {
    /// The request ends with a defect at once (its caller gets `CallError::Defect`, an HTTP
    /// caller 500; a persisted request stores it as its final reply). The reference's
    /// `disableFatalDefects: true`. The default: a panic is a bug, and running the request
    /// again would most often panic again, holding the entity's other requests and the caller
    /// until its timeout.
    #[default]
    Answer,
    /// The request runs again on the recreated instance, after the backoff, without a limit
    /// (its caller waits): the reference's default (fatal defects). For handlers whose panics
    /// are transient, and for the workflow engine, whose runs are replayed this way.
    Replay,
}

impl EntityOptions {
    /// Checks the options against the bounds of the runner's configuration: an idle time of at
    /// most [`ENTITY_MAX_IDLE_TIME_MAX`](cluster_core::config::ENTITY_MAX_IDLE_TIME_MAX) (use
    /// `Some(None)` to never reap), an `on_stop` timeout of at most an hour.
    ///
    /// # Errors
    ///
    /// The first option out of its bounds, named as `EntityOptions::<field>`.
    pub fn validate(&self) -> Result<(), cluster_core::error::ConfigError> {
        use cluster_core::config::{ENTITY_MAX_IDLE_TIME_MAX, INTERVAL_MAX, format_duration};
        let out_of_bounds = |field: &str, value: Duration, max: Duration, hint: &str| {
            cluster_core::error::ConfigError::new(
                format!("EntityOptions::{field}"),
                format_duration(value),
                format!("must be at most {}; {hint}", format_duration(max)),
            )
        };
        if let Some(Some(idle)) = self.max_idle_time
            && idle > ENTITY_MAX_IDLE_TIME_MAX
        {
            let hint = "use Some(None) to never stop idle entities";
            return Err(out_of_bounds("max_idle_time", idle, ENTITY_MAX_IDLE_TIME_MAX, hint));
        }
        if let Some(timeout) = self.on_stop_timeout
            && timeout > INTERVAL_MAX
        {
            let hint = "a longer one is surely a mistake";
            return Err(out_of_bounds("on_stop_timeout", timeout, INTERVAL_MAX, hint));
        }
        Ok(())
    }
}

/// The default of [`EntityOptions::on_stop_timeout`]: 10 seconds.
pub const DEFAULT_ON_STOP_TIMEOUT: Duration = Duration::from_secs(10);
