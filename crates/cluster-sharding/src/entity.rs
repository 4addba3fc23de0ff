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
//!
//! ```
//! # use cluster_sharding::{Entity, EntityContext, Handler, Protocol, RequestContext, Rpc};
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Serialize, Deserialize)]
//! # struct Increment { by: u64 }
//! # #[derive(Serialize, Deserialize)]
//! # enum Never {}
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
use cluster_core::future::BoxFuture;
use cluster_core::storage::MessageTransaction;
use cluster_core::{ClusterError, EntityAddress, ShardGroup, Snowflake};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::interrupt::InterruptSignal;
use crate::keep_alive::KeepAliveHandle;
use crate::rpc::{Rpc, StreamRpc};
use crate::sharding::Sharding;

/// An entity type.
pub trait Entity: Sized + Send + 'static {
    /// The entity type's name, such as `Counter`; part of every stored message.
    const TYPE: &'static str;

    /// Whether each call of an [`EntityClient`](crate::EntityClient) of this type runs in an
    /// `entity_client` span with the entity type, id, tag and request id (the reference's
    /// `ClusterSchema.ClientTracingEnabled`, on by default). Set it to `false` for types
    /// called so often that the spans cost more than they tell.
    const CLIENT_TRACING: bool = true;

    /// The shard group of an entity id (`default` unless overridden).
    fn shard_group(_entity_id: &str) -> ShardGroup {
        ShardGroup::default_group()
    }

    /// A new instance for `context.address()`, created on its first request (and again after
    /// it was reaped for idleness, or restarted after a panic). `context.sharding()` is the
    /// runtime, for instances that call other entities.
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

/// What [`Entity::create`] gets.
#[derive(Clone, Debug)]
pub struct EntityContext {
    address: EntityAddress,
    sharding: Sharding,
}

impl EntityContext {
    pub(crate) fn new(address: EntityAddress, sharding: Sharding) -> EntityContext {
        EntityContext { address, sharding }
    }

    /// The new instance's address.
    pub fn address(&self) -> &EntityAddress {
        &self.address
    }

    /// The runtime the instance runs in: `context.sharding().client::<Other>(id)` calls
    /// another entity. An instance that keeps it keeps the runtime alive until it stops.
    pub fn sharding(&self) -> &Sharding {
        &self.sharding
    }
}

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

/// The sending side of a streamed response.
pub struct Chunks<'c, T> {
    channel: &'c mut ChunkChannel,
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
    /// Sends one item as a chunk and waits until the caller acknowledged it (backpressure).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a dropped send may have delivered the chunk.
    pub async fn send(&mut self, item: T) -> Result<(), ChunkError> {
        let value = RawJson::encode(&item)?;
        self.channel.send(vec![value]).await
    }

    /// The sequence number the next chunk gets: 0 for a fresh stream, one past the last chunk
    /// sent before a restart for a resumed one.
    pub fn next_sequence(&self) -> u32 {
        self.channel.next_sequence
    }

    /// The last item sent before a restart, when a persisted stream resumes.
    pub fn last_sent(&self) -> Option<T> {
        let chunk = self.channel.last_sent.as_ref()?;
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

impl ChunkChannel {
    async fn send(&mut self, values: Vec<RawJson>) -> Result<(), ChunkError> {
        let id = self.ids.next();
        let chunk = Chunk::new(self.request_id, id, self.next_sequence, values)
            .ok_or(ChunkError::Interrupted)?;
        self.replies
            .send(Reply::Chunk(chunk.clone()))
            .await
            .map_err(|_| ChunkError::Interrupted)?;
        loop {
            match self.acks.recv().await {
                // An acknowledgement of another chunk is stale: ignored, as in the reference.
                Some(acked) if acked == id => break,
                Some(_) => {}
                None => return Err(ChunkError::Interrupted),
            }
        }
        self.next_sequence += 1;
        self.last_sent = Some(chunk);
        Ok(())
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

/// The storage transaction a `WITH_TRANSACTION` request's handler runs in.
pub type TransactionSlot = Arc<tokio::sync::Mutex<Option<Box<dyn MessageTransaction>>>>;

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

    /// The storage transaction of a persisted `WITH_TRANSACTION` request: lock it and run the
    /// handler's own statements through `MessageTransaction::backend` (downcast to the
    /// backend's handle). `None` for other requests.
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

/// How a request type is handled.
pub(crate) enum CallKind<E> {
    /// One reply, with the entity to itself.
    Unary(Call<E>),
    /// One reply, alongside other shared requests.
    Shared(SharedCall<E>),
    /// Chunks, then the final reply.
    Stream(StreamCall<E>),
}

/// One request type of a protocol.
pub(crate) struct HandlerEntry<E> {
    pub(crate) call: CallKind<E>,
    /// Interrupted as soon as the entity starts stopping.
    pub(crate) interrupt_on_termination: bool,
    /// Runs inside a storage transaction (persisted requests).
    pub(crate) with_transaction: bool,
    /// Runs again when it ends by interrupt (persisted, server-side `Uninterruptible`).
    pub(crate) rerun_on_interrupt: bool,
}

impl<E> HandlerEntry<E> {
    /// The entry of the unary request type `R`, with its flags.
    fn unary<R: Rpc>(call: CallKind<E>) -> HandlerEntry<E> {
        HandlerEntry {
            call,
            interrupt_on_termination: R::INTERRUPT_ON_TERMINATION && !R::UNINTERRUPTIBLE.server(),
            with_transaction: R::WITH_TRANSACTION && R::PERSISTED,
            rerun_on_interrupt: R::UNINTERRUPTIBLE.server() && R::PERSISTED,
        }
    }
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

/// The requests an entity type handles, by tag.
pub struct Protocol<E> {
    handlers: BTreeMap<&'static str, HandlerEntry<E>>,
    sharing: Option<Sharing<E>>,
}

impl<E: Entity> Protocol<E> {
    pub(crate) fn of() -> Protocol<E> {
        let mut protocol = Protocol { handlers: BTreeMap::new(), sharing: None };
        E::protocol(&mut protocol);
        protocol
    }

    /// Declares that the entity handles `R`.
    pub fn handle<R: Rpc>(&mut self) -> &mut Protocol<E>
    where
        E: Handler<R>,
    {
        self.handlers.insert(R::TAG, HandlerEntry::unary::<R>(CallKind::Unary(call::<E, R>)));
        self
    }

    /// Declares that the entity handles `R` through a shared reference: such requests run
    /// alongside each other, up to [`EntityOptions::concurrency`] at once.
    pub fn handle_shared<R: Rpc>(&mut self) -> &mut Protocol<E>
    where
        E: SharedHandler<R>,
    {
        let entry = HandlerEntry::unary::<R>(CallKind::Shared(shared_call::<E, R>));
        self.handlers.insert(R::TAG, entry);
        self.sharing = Some(Sharing { share: share::<E>, unshare: unshare::<E> });
        self
    }

    /// Declares that the entity handles the streaming request `R`.
    pub fn stream<R: StreamRpc>(&mut self) -> &mut Protocol<E>
    where
        E: StreamHandler<R>,
    {
        let entry = HandlerEntry {
            call: CallKind::Stream(stream_call::<E, R>),
            interrupt_on_termination: false,
            with_transaction: false,
            rerun_on_interrupt: false,
        };
        self.handlers.insert(R::TAG, entry);
        self
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
        let mut chunks = Chunks { channel, item: std::marker::PhantomData };
        match entity.handle(context, request, &mut chunks).await {
            Ok(()) => Exit::void(),
            Err(error) => RawJson::encode(&error)
                .map_or_else(|error| malformed(&error.to_string()), Exit::fail),
        }
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
