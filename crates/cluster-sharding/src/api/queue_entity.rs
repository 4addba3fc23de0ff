//! Queue-style entities (the reference's `Entity.toLayerQueue` with its `Replier`): requests go
//! into a queue that the entity's behaviour drains, and each is answered through a [`Replier`],
//! in any order, whenever the behaviour likes.
//!
//! A [`QueueEntity`] declares its requests ([`QueueProtocol`]) and its behaviour, which gets a
//! [`RequestQueue`] and a [`Replier`]. The runtime registers it as the entity type
//! [`Queued<Q>`]: every request runs forked (see [`ForkedHandler`](crate::ForkedHandler)), so
//! the behaviour gets requests while others are pending, without a concurrency cap. If the
//! behaviour fails, panics or returns, every pending request (and every later one of the
//! instance) fails with a defect that says why.
//!
//! ```
//! # use cluster_sharding::{Accepts, EntityContext, QueueEntity, QueueProtocol, Replier,
//! #     RequestQueue, Rpc};
//! # use serde::{Deserialize, Serialize};
//! #[derive(Serialize, Deserialize)]
//! struct Add { n: u64 }
//! impl Rpc for Add {
//!     const TAG: &'static str = "Add";
//!     type Success = u64;
//!     type Error = ();
//! }
//!
//! struct Adder;
//! impl Accepts<Add> for Adder {}
//! impl QueueEntity for Adder {
//!     const TYPE: &'static str = "Adder";
//!     fn protocol(protocol: &mut QueueProtocol<'_, Adder>) { protocol.handle::<Add>(); }
//!     async fn behaviour(
//!         _: EntityContext,
//!         mut requests: RequestQueue,
//!         replier: Replier,
//!     ) -> Result<(), cluster_sharding::BehaviourError> {
//!         let mut total = 0;
//!         while let Some(request) = requests.next().await {
//!             total += request.decode::<Add>()?.n;
//!             replier.succeed::<Add>(&request, total).await;
//!         }
//!         Ok(())
//!     }
//! }
//! // sharding.entity::<Queued<Adder>>().options(options).register(), sharding.client::<Queued<Adder>>(id)
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

use cluster_core::envelope::{Exit, RawJson};
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::{DecodeError, ShardGroup, Snowflake};
use tokio::sync::{mpsc, oneshot};

use crate::api::entity::{
    CallKind, ChunkChannel, ChunkError, Chunks, Entity, EntityContext, ForkedHandler,
    ForkedStreamHandler, HandlerEntry, Protocol, RequestContext, SharedValue, malformed,
    stream_with,
};
use crate::api::rpc::{Rpc, StreamRpc};

/// How many requests wait in a queue entity's queue before handing over another waits.
const QUEUE_CAPACITY: usize = 1024;

/// How many replies of one streaming request wait for its chunk pump.
const STREAM_EVENTS: usize = 16;

/// Why a behaviour stopped; every pending request fails with its message.
pub type BehaviourError = Box<dyn std::error::Error + Send + Sync>;

/// A queue-style entity type: a behaviour that drains a queue of requests and answers each
/// through a [`Replier`]. Register it as [`Queued<Self>`].
pub trait QueueEntity: Sized + Send + Sync + 'static {
    /// The entity type's name, as [`Entity::TYPE`].
    const TYPE: &'static str;

    /// The shard group of an entity id (`default` unless overridden).
    fn shard_group(_entity_id: &str) -> ShardGroup {
        ShardGroup::default_group()
    }

    /// Declares the requests the entity takes: `protocol.handle::<R>()` and
    /// `protocol.stream::<R>()`.
    fn protocol(protocol: &mut QueueProtocol<'_, Self>);

    /// The behaviour of one instance, started when the instance is created and dropped when it
    /// stops. It takes requests from `requests` and answers each through `replier`, in any
    /// order. Returning (with an error or not) or panicking fails every pending request and
    /// every later one of the instance with a defect.
    fn behaviour(
        context: EntityContext,
        requests: RequestQueue,
        replier: Replier,
    ) -> impl Future<Output = Result<(), BehaviourError>> + Send;
}

/// Marks a unary request type that the queue entity takes (declare it with
/// [`QueueProtocol::handle`]).
pub trait Accepts<R: Rpc>: QueueEntity {}

/// Marks a streaming request type that the queue entity takes (declare it with
/// [`QueueProtocol::stream`]).
pub trait AcceptsStream<R: StreamRpc>: QueueEntity {}

/// The requests a queue entity takes.
pub struct QueueProtocol<'p, Q: QueueEntity> {
    inner: &'p mut Protocol<Queued<Q>>,
}

impl<Q: QueueEntity> QueueProtocol<'_, Q> {
    /// Declares that the entity takes the unary request `R`.
    pub fn handle<R: Rpc>(&mut self) -> &mut Self
    where
        Q: Accepts<R>,
    {
        let mut entry = HandlerEntry::unary::<R>(CallKind::Forked(queued_call::<R>));
        entry.fork_state = Some(fork_state::<Q>);
        self.inner.insert(R::TAG, entry);
        self
    }

    /// Declares that the entity takes the streaming request `R`.
    pub fn stream<R: StreamRpc>(&mut self) -> &mut Self
    where
        Q: AcceptsStream<R>,
    {
        let call = CallKind::ForkedStream(queued_stream_call::<R>);
        let entry = HandlerEntry::stream(call, Some(fork_state::<Q>));
        self.inner.insert(R::TAG, entry);
        self
    }
}

fn fork_state<Q: QueueEntity>(entity: &Queued<Q>) -> SharedValue {
    Arc::clone(&entity.shared) as SharedValue
}

/// The entity type of a [`QueueEntity`]: register `Queued<Q>` and make clients of it.
pub struct Queued<Q: QueueEntity> {
    shared: Arc<QueueShared>,
    behaviour: tokio::task::JoinHandle<()>,
    entity: PhantomData<fn() -> Q>,
}

impl<Q: QueueEntity> Drop for Queued<Q> {
    fn drop(&mut self) {
        // The instance stops: its behaviour goes, and what it left unanswered is interrupted.
        self.behaviour.abort();
        self.shared.end(Exit::interrupt());
    }
}

impl<Q: QueueEntity> Entity for Queued<Q> {
    const TYPE: &'static str = Q::TYPE;

    fn shard_group(entity_id: &str) -> ShardGroup {
        Q::shard_group(entity_id)
    }

    async fn create(context: &EntityContext) -> Queued<Q> {
        let (queue, receiver) = mpsc::channel(QUEUE_CAPACITY);
        let shared = Arc::new(QueueShared {
            queue,
            state: Mutex::new(QueueState { pending: BTreeMap::new(), ended: None }),
        });
        let replier = Replier { shared: Arc::clone(&shared) };
        let requests = RequestQueue { receiver };
        let context = context.clone();
        let ended = Arc::clone(&shared);
        let entity_type = Q::TYPE;
        let behaviour = tokio::spawn(async move {
            // Called inside the guard: the behaviour may panic before it returns its future.
            let outcome =
                cluster_core::future::guarded(|| Q::behaviour(context, requests, replier)).await;
            let message = match outcome {
                Ok(Ok(())) => format!("the behaviour of queue entity {entity_type} ended"),
                Ok(Err(error)) => {
                    format!("the behaviour of queue entity {entity_type} failed: {error}")
                }
                Err(_) => format!("the behaviour of queue entity {entity_type} panicked"),
            };
            tracing::warn!(entity_type, "{message}");
            ended.end(Exit::die_with_message("Error", &message));
        });
        Queued { shared, behaviour, entity: PhantomData }
    }

    fn protocol(protocol: &mut Protocol<Queued<Q>>) {
        Q::protocol(&mut QueueProtocol { inner: protocol });
    }
}

/// What lets clients send `R` to a queue entity. The runtime never runs this handler: the
/// request type is registered with the queue's own call, which also carries defects.
impl<Q: Accepts<R>, R: Rpc> ForkedHandler<R> for Queued<Q> {
    type State = QueueShared;

    fn state(&self) -> Arc<QueueShared> {
        Arc::clone(&self.shared)
    }

    async fn handle_forked(
        _: &QueueShared,
        _: &RequestContext,
        _: R,
    ) -> Result<R::Success, R::Error> {
        unreachable!("queue entity requests run through their registered calls")
    }
}

/// What lets clients stream `R` from a queue entity. The runtime never runs this handler: the
/// request type is registered with the queue's own call, which also carries defects.
impl<Q: AcceptsStream<R>, R: StreamRpc> ForkedStreamHandler<R> for Queued<Q> {
    type State = QueueShared;

    fn state(&self) -> Arc<QueueShared> {
        Arc::clone(&self.shared)
    }

    async fn handle_forked(
        _: &QueueShared,
        _: &RequestContext,
        _: R,
        _: &mut Chunks<'_, R::Item>,
    ) -> Result<(), R::Error> {
        unreachable!("queue entity requests run through their registered calls")
    }
}

/// The queue of one queue entity instance and its requests waiting for a reply.
pub struct QueueShared {
    queue: mpsc::Sender<QueuedRequest>,
    state: Mutex<QueueState>,
}

struct QueueState {
    pending: BTreeMap<Snowflake, Pending>,
    /// Set when the behaviour ended: the exit of every pending and later request.
    ended: Option<Exit>,
}

/// Where the reply of a pending request goes.
enum Pending {
    Unary(oneshot::Sender<Exit>),
    Stream(mpsc::Sender<StreamEvent>),
}

/// A reply to a streaming request.
enum StreamEvent {
    /// Items that go out in one chunk.
    Items(Vec<RawJson>),
    /// The end of the stream.
    End(Exit),
}

impl QueueShared {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // Every critical section only inserts or removes map entries.
        lock(&self.state)
    }

    /// Ends the queue with `exit`: every pending request gets it (a stream as its end), and so
    /// does every later one.
    fn end(&self, exit: Exit) {
        let pending = {
            let mut state = self.lock();
            if state.ended.is_none() {
                state.ended = Some(exit.clone());
            }
            std::mem::take(&mut state.pending)
        };
        for (_, pending) in pending {
            match pending {
                Pending::Unary(reply) => {
                    let _ = reply.send(exit.clone());
                }
                // Its handler reads the end exit once the channel closes.
                Pending::Stream(events) => drop(events),
            }
        }
    }

    /// The exit the queue ended with, if it did.
    fn ended(&self) -> Option<Exit> {
        self.lock().ended.clone()
    }

    /// Puts a request in the queue with where its reply goes; the exit of a queue that ended.
    async fn submit(
        &self,
        request: QueuedRequest,
        pending: Pending,
    ) -> Result<PendingGuard<'_>, Exit> {
        let request_id = request.request_id;
        {
            let mut state = self.lock();
            if let Some(exit) = &state.ended {
                return Err(exit.clone());
            }
            state.pending.insert(request_id, pending);
        }
        let guard = PendingGuard { shared: self, request_id };
        if self.queue.send(request).await.is_err() {
            return Err(self.ended().unwrap_or_else(Exit::interrupt));
        }
        tracing::trace!(%request_id, "queued");
        Ok(guard)
    }

    /// Takes the pending entry of a request (to complete it).
    fn take(&self, request_id: Snowflake) -> Option<Pending> {
        self.lock().pending.remove(&request_id)
    }

    /// The event channel of a pending streaming request.
    fn stream_events(&self, request_id: Snowflake) -> Option<mpsc::Sender<StreamEvent>> {
        match self.lock().pending.get(&request_id) {
            Some(Pending::Stream(events)) => Some(events.clone()),
            _ => None,
        }
    }
}

/// Removes a request's pending entry when its handler ends (answered, interrupted or dropped).
struct PendingGuard<'s> {
    shared: &'s QueueShared,
    request_id: Snowflake,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.take(self.request_id);
    }
}

fn queued_call<'a, R: Rpc>(
    state: &'a SharedValue,
    context: &'a RequestContext,
    payload: &'a RawJson,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let Some(shared) = state.downcast_ref::<QueueShared>() else {
            return malformed("a queue entity without its queue");
        };
        let (reply, exit) = oneshot::channel();
        let request = QueuedRequest::new(R::TAG, context, payload);
        let _guard = match shared.submit(request, Pending::Unary(reply)).await {
            Ok(guard) => guard,
            Err(exit) => return exit,
        };
        match exit.await {
            Ok(exit) => exit,
            Err(_) => shared.ended().unwrap_or_else(Exit::interrupt),
        }
    })
}

fn queued_stream_call<'a, R: StreamRpc>(
    state: &'a SharedValue,
    context: &'a RequestContext,
    payload: &'a RawJson,
    channel: &'a mut ChunkChannel,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let Ok(shared) = Arc::clone(state).downcast::<QueueShared>() else {
            return malformed("a queue entity without its queue");
        };
        let (events, mut received) = mpsc::channel(STREAM_EVENTS);
        let request = QueuedRequest::new(R::TAG, context, payload);
        let _guard = match shared.submit(request, Pending::Stream(events)).await {
            Ok(guard) => guard,
            Err(exit) => return exit,
        };
        let ended = Arc::clone(&shared);
        stream_with(channel, move |pump| {
            Box::pin(async move {
                loop {
                    match received.recv().await {
                        Some(StreamEvent::Items(values)) => {
                            if pump.queue(values).await.is_err() {
                                return Exit::interrupt();
                            }
                        }
                        Some(StreamEvent::End(exit)) => return exit,
                        None => return ended.ended().unwrap_or_else(Exit::interrupt),
                    }
                }
            })
        })
        .await
    })
}

/// The requests of one queue entity instance, in arrival order.
pub struct RequestQueue {
    receiver: mpsc::Receiver<QueuedRequest>,
}

impl RequestQueue {
    /// The next request; `None` once the instance stops.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a request is only taken when this returns it.
    pub async fn next(&mut self) -> Option<QueuedRequest> {
        self.receiver.recv().await
    }
}

impl std::fmt::Debug for RequestQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestQueue").finish_non_exhaustive()
    }
}

/// One request in a queue entity's queue.
#[derive(Debug)]
pub struct QueuedRequest {
    tag: &'static str,
    request_id: Snowflake,
    payload: RawJson,
    context: RequestContext,
}

impl QueuedRequest {
    fn new(tag: &'static str, context: &RequestContext, payload: &RawJson) -> QueuedRequest {
        QueuedRequest {
            tag,
            request_id: context.request_id(),
            payload: payload.clone(),
            context: context.clone(),
        }
    }

    /// The request's tag (`R::TAG` of its type).
    pub fn tag(&self) -> &'static str {
        self.tag
    }

    /// Whether it is a request of the unary type `R`.
    pub fn is<R: Rpc>(&self) -> bool {
        self.tag == R::TAG
    }

    /// Whether it is a request of the streaming type `R`.
    pub fn is_stream<R: StreamRpc>(&self) -> bool {
        self.tag == R::TAG
    }

    /// The request, as the unary type `R`.
    ///
    /// # Errors
    ///
    /// It is of another type, or its payload does not decode as `R`.
    pub fn decode<R: Rpc>(&self) -> Result<R, DecodeError> {
        self.decode_as(R::TAG)
    }

    /// The request, as the streaming type `R`.
    ///
    /// # Errors
    ///
    /// It is of another type, or its payload does not decode as `R`.
    pub fn decode_stream<R: StreamRpc>(&self) -> Result<R, DecodeError> {
        self.decode_as(R::TAG)
    }

    fn decode_as<T: serde::de::DeserializeOwned>(&self, tag: &str) -> Result<T, DecodeError> {
        if self.tag != tag {
            let message = format!("a {} request read as {tag}", self.tag);
            return Err(DecodeError::new("queued request", message));
        }
        self.payload.decode()
    }

    /// What a handler of the request would know: its address, id, headers and interruption.
    pub fn context(&self) -> &RequestContext {
        &self.context
    }
}

/// Answers the requests of one queue entity instance (the reference's `Replier`). Answering a
/// request that was answered already, or whose caller went away, does nothing.
#[derive(Clone)]
pub struct Replier {
    shared: Arc<QueueShared>,
}

impl std::fmt::Debug for Replier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replier").finish_non_exhaustive()
    }
}

impl Replier {
    /// Answers the unary `request` with `value`.
    pub async fn succeed<R: Rpc>(&self, request: &QueuedRequest, value: R::Success) {
        let exit = RawJson::encode(&value)
            .map_or_else(|error| malformed(&error.to_string()), Exit::Success);
        self.finish(request, exit).await;
    }

    /// Answers `request` with the request type's own error (a streaming request ends with it).
    pub async fn fail<R: Rpc>(&self, request: &QueuedRequest, error: R::Error) {
        let exit =
            RawJson::encode(&error).map_or_else(|error| malformed(&error.to_string()), Exit::fail);
        self.finish(request, exit).await;
    }

    /// Ends the streaming `request` with the request type's own error.
    pub async fn fail_stream<R: StreamRpc>(&self, request: &QueuedRequest, error: R::Error) {
        let exit =
            RawJson::encode(&error).map_or_else(|error| malformed(&error.to_string()), Exit::fail);
        self.finish(request, exit).await;
    }

    /// Answers `request` with a defect (the reference's `failCause` with a `Die`): the caller
    /// gets `CallError::Defect` with the message.
    pub async fn fail_cause(&self, request: &QueuedRequest, defect: impl std::fmt::Display) {
        self.finish(request, Exit::die_with_message("Error", &defect.to_string())).await;
    }

    /// Ends the streaming `request` successfully, after the items sent before. A unary request
    /// needs a value ([`succeed`](Replier::succeed)): completing one answers it with a defect.
    pub async fn complete(&self, request: &QueuedRequest) {
        let exit = match self.shared.lock().pending.get(&request.request_id) {
            Some(Pending::Unary(_)) => {
                Exit::die_with_message("Error", "a unary request completed without a value")
            }
            _ => Exit::void(),
        };
        self.finish(request, exit).await;
    }

    /// Sends `items` of the streaming `request` in one chunk; waits while the caller is
    /// behind (backpressure).
    ///
    /// # Errors
    ///
    /// An item cannot be encoded, or the request is no longer pending (answered, or its
    /// caller went away).
    pub async fn chunk<R: StreamRpc>(
        &self,
        request: &QueuedRequest,
        items: impl IntoIterator<Item = R::Item>,
    ) -> Result<(), ChunkError> {
        let values =
            items.into_iter().map(|item| RawJson::encode(&item)).collect::<Result<Vec<_>, _>>()?;
        if values.is_empty() {
            return Ok(());
        }
        let events =
            self.shared.stream_events(request.request_id).ok_or(ChunkError::Interrupted)?;
        events.send(StreamEvent::Items(values)).await.map_err(|_| ChunkError::Interrupted)
    }

    /// Completes a pending request with `exit`.
    async fn finish(&self, request: &QueuedRequest, exit: Exit) {
        match self.shared.take(request.request_id) {
            Some(Pending::Unary(reply)) => {
                let _ = reply.send(exit);
            }
            // After the items sent before: the events go in order.
            Some(Pending::Stream(events)) => {
                let _ = events.send(StreamEvent::End(exit)).await;
            }
            None => {
                tracing::debug!(request_id = %request.request_id, "reply to a request no longer pending");
            }
        }
    }
}
