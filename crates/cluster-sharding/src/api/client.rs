//! [`EntityClient`]: typed calls to one entity, wherever it lives.
//!
//! Each call runs in an `entity_client` span (the reference's client spans, named
//! `<type>.client.<tag>` there and in the span's `otel.name`), with the fields `entity_type`,
//! `entity_id`, `tag` and `request_id`, unless the entity type sets
//! [`Entity::CLIENT_TRACING`] to `false`.

use std::marker::PhantomData;

use std::collections::{BTreeMap, VecDeque};

use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson, Reply, Request, primary_key};
use cluster_core::storage::SaveRequestOptions;
use cluster_core::{ClusterError, EntityAddress, Snowflake};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::api::entity::{Entity, Handler, StreamHandler};
use crate::api::rpc::{CallError, Rpc, StreamRpc};
use crate::runtime::interrupt::InterruptGuard;
use crate::sharding::Sharding;

/// The defect the reference raises for a persisted request on a runtime without storage.
const PERSISTED_WITHOUT_STORAGE: &str =
    "Sharding.sendOutgoing: Persisted messages require MessageStorage";

/// The items of a streamed response, in order.
pub struct ChunkStream<R: StreamRpc> {
    raw: RawChunkStream,
    /// Items of a chunk that [`next`](ChunkStream::next) began.
    buffered: VecDeque<RawJson>,
    request: PhantomData<fn() -> R>,
}

/// The chunks of a streamed response, encoded: what [`ChunkStream`] decodes and what a gateway
/// forwards.
pub(crate) struct RawChunkStream {
    replies: mpsc::Receiver<Reply>,
    acks: Acks,
    /// Chunks below this sequence were read already (a persisted stream may see a chunk again
    /// until its acknowledgement is stored).
    next_sequence: u32,
    finished: bool,
    /// Why the stream ended early, returned after the items already received.
    failed: Option<ClusterError>,
}

/// Why a stream ended before its last item, encoded.
#[derive(Debug)]
pub(crate) enum RawStreamEnd {
    /// The handler failed: its own error, a defect or an interruption.
    Failed(Cause),
    /// The cluster could not deliver the stream.
    Cluster(ClusterError),
    /// The stream's replies stopped before its final reply.
    Interrupted,
}

impl RawStreamEnd {
    fn into_call_error<E: serde::de::DeserializeOwned>(self) -> CallError<E> {
        match self {
            RawStreamEnd::Failed(cause) => failure(cause),
            RawStreamEnd::Cluster(error) => CallError::Cluster(error),
            RawStreamEnd::Interrupted => CallError::Interrupted,
        }
    }
}

/// Where a stream's acknowledgements go, and what interrupts it when dropped early.
enum Acks {
    /// To the local handler, interrupted by cancellation.
    Local { acks: mpsc::Sender<Snowflake>, interrupt: Option<InterruptGuard> },
    /// Through storage, interrupted by a stored interrupt.
    Stored(Box<crate::runtime::persisted::PersistedStream>),
}

impl Acks {
    async fn ack(&self, chunk_id: Snowflake) -> Result<(), ClusterError> {
        match self {
            Acks::Local { acks, .. } => {
                let _ = acks.send(chunk_id).await;
                Ok(())
            }
            Acks::Stored(stream) => stream.ack(chunk_id).await,
        }
    }

    /// Why the stream's replies stopped before its final reply.
    fn ended_early(&self) -> RawStreamEnd {
        match self {
            Acks::Stored(stream) => {
                stream.ended_early().map_or(RawStreamEnd::Interrupted, RawStreamEnd::Cluster)
            }
            Acks::Local { .. } => RawStreamEnd::Interrupted,
        }
    }

    fn finish(&mut self) {
        match self {
            Acks::Local { interrupt, .. } => {
                if let Some(guard) = interrupt.take() {
                    guard.disarm();
                }
            }
            Acks::Stored(stream) => stream.finish(),
        }
    }
}

impl<R: StreamRpc> ChunkStream<R> {
    /// The next item; `None` once the stream ended; an error ends it too.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: an item is only taken when this returns it.
    pub async fn next(&mut self) -> Option<Result<R::Item, CallError<R::Error>>> {
        if self.buffered.is_empty() {
            match self.raw.next_chunk().await? {
                Ok(values) => self.buffered.extend(values),
                Err(end) => return Some(Err(end.into_call_error())),
            }
        }
        let value = self.buffered.pop_front()?;
        Some(value.decode().map_err(|error| CallError::Cluster(error.into())))
    }

    /// The items of the next chunk, as the handler's runtime grouped them (see
    /// [`Chunks`](crate::Chunks)); the items left of a chunk that [`next`](ChunkStream::next)
    /// began; `None` once the stream ended; an error ends it too.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a chunk is only taken when this returns it.
    pub async fn next_chunk(&mut self) -> Option<Result<Vec<R::Item>, CallError<R::Error>>> {
        let values = if self.buffered.is_empty() {
            match self.raw.next_chunk().await? {
                Ok(values) => values,
                Err(end) => return Some(Err(end.into_call_error())),
            }
        } else {
            self.buffered.drain(..).collect()
        };
        let decoded = values
            .into_iter()
            .map(|value| value.decode())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| CallError::Cluster(error.into()));
        Some(decoded)
    }
}

impl RawChunkStream {
    /// The items of the next chunk that has any, encoded; `Some(Err(_))` when the stream
    /// failed (after the items already received); `None` once it ended.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a chunk is only taken when this returns it.
    pub(crate) async fn next_chunk(&mut self) -> Option<Result<Vec<RawJson>, RawStreamEnd>> {
        loop {
            if let Some(error) = self.failed.take() {
                return Some(Err(RawStreamEnd::Cluster(error)));
            }
            if self.finished {
                return None;
            }
            match self.replies.recv().await {
                Some(Reply::Chunk(chunk)) => {
                    if chunk.sequence() < self.next_sequence {
                        continue;
                    }
                    // Acknowledge at once: the handler produces the next chunk meanwhile. If that
                    // fails the stream ends, after the items of this chunk.
                    if let Err(error) = self.acks.ack(chunk.id()).await {
                        self.finished = true;
                        self.failed = Some(error);
                    }
                    self.next_sequence = chunk.sequence() + 1;
                    if !chunk.values().is_empty() {
                        return Some(Ok(chunk.values().to_vec()));
                    }
                }
                Some(Reply::WithExit(with_exit)) => {
                    self.finished = true;
                    self.acks.finish();
                    if let Exit::Failure(cause) = with_exit.exit {
                        return Some(Err(RawStreamEnd::Failed(cause)));
                    }
                }
                // The entity went away without a final reply (the runner stopped).
                None => {
                    self.finished = true;
                    return Some(Err(self.acks.ended_early()));
                }
            }
        }
    }
}

impl<R: StreamRpc> std::fmt::Debug for ChunkStream<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkStream").field("finished", &self.raw.finished).finish_non_exhaustive()
    }
}

/// A typed client for one entity; cheap to clone.
pub struct EntityClient<E> {
    sharding: Sharding,
    address: EntityAddress,
    /// The encoded headers its requests carry, if any.
    headers: Option<RawJson>,
    entity: PhantomData<fn() -> E>,
}

impl<E> Clone for EntityClient<E> {
    fn clone(&self) -> EntityClient<E> {
        EntityClient {
            sharding: self.sharding.clone(),
            address: self.address.clone(),
            headers: self.headers.clone(),
            entity: PhantomData,
        }
    }
}

impl<E> std::fmt::Debug for EntityClient<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityClient").field("address", &self.address).finish()
    }
}

impl<E: Entity> EntityClient<E> {
    pub(crate) fn new(sharding: Sharding, address: EntityAddress) -> EntityClient<E> {
        EntityClient { sharding, address, headers: None, entity: PhantomData }
    }

    /// This client, with requests that carry `headers` (names and values, such as a caller id
    /// or a tenant), replacing any it had. A handler reads them with
    /// [`RequestContext::headers`](crate::RequestContext::headers); they belong to each
    /// request (an entity never keeps the headers of the call that created it) and are stored
    /// with persisted requests.
    pub fn with_headers<K: Into<String>, V: Into<String>>(
        &self,
        headers: impl IntoIterator<Item = (K, V)>,
    ) -> EntityClient<E> {
        let headers: BTreeMap<String, String> =
            headers.into_iter().map(|(name, value)| (name.into(), value.into())).collect();
        // A map of strings always encodes.
        let headers = (!headers.is_empty()).then(|| RawJson::encode(&headers).ok()).flatten();
        EntityClient { headers, ..self.clone() }
    }

    /// The entity's address.
    pub fn address(&self) -> &EntityAddress {
        &self.address
    }

    /// The entity's durable state as stored ([`Protocol::durable`](crate::Protocol::durable)),
    /// decoded as `S`, with its revision; `None` when it has no row (its state is the one its
    /// `create` makes). For tests and operations: it reads storage, not the resident instance,
    /// and so sees only committed changes.
    ///
    /// # Errors
    ///
    /// [`ClusterError::Persistence`] when the runtime has no message storage or the storage
    /// fails, [`ClusterError::MalformedMessage`] when the row does not decode as `S`.
    pub async fn stored_state<S: DeserializeOwned>(
        &self,
    ) -> Result<Option<(S, u64)>, ClusterError> {
        let Some(storage) = self.sharding.message_storage() else {
            return Err(ClusterError::Persistence(cluster_core::entity_state::unsupported(
                "runtime's (it has none)",
            )));
        };
        let Some(stored) = storage.load_state(&self.address).await? else {
            return Ok(None);
        };
        Ok(Some((stored.value.decode()?, stored.revision)))
    }

    /// Sends `request` and waits for its reply.
    ///
    /// The verbs are the reference's: `send` is `Sharding.send` (request and reply) and
    /// [`discard`](EntityClient::discard) is a call with `discard: true` (fire and forget)
    /// (`effect/src/cluster/Sharding.ts`).
    /// They keep code and traces readable next to the TypeScript runners'.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future interrupts the request (unless `R` is client-side uninterruptible):
    /// the handler's future is dropped.
    pub async fn send<R: Rpc>(&self, request: R) -> Result<R::Success, CallError<R::Error>>
    where
        E: Handler<R>,
    {
        decode_exit::<R>(self.exit_of(request).await?)
    }

    /// Sends `request` and waits for its exit, not decoded: what [`send`](EntityClient::send)
    /// decodes. The handler bound is left to the callers.
    pub(crate) async fn exit_of<R: Rpc>(&self, request: R) -> Result<Exit, CallError<R::Error>> {
        let call = self.raw_call(&request).map_err(CallError::Cluster)?;
        self.exit_of_raw(call).await.map_err(RawFailure::into_call_error)
    }

    /// Sends an encoded request and waits for its exit.
    pub(crate) async fn exit_of_raw(&self, call: RawCall) -> Result<Exit, RawFailure> {
        let RawCall { tag, payload, options, persisted, uninterruptible } = call;
        let mut request = self.with_headers_of(tag, payload);
        let span = self.span(tag, &mut request);
        let exit = if persisted {
            if self.sharding.persisted().is_none() {
                return Err(RawFailure::Defect(PERSISTED_WITHOUT_STORAGE.to_owned()));
            }
            let call = self.sharding.send_persisted(request, options, uninterruptible);
            Box::pin(call.instrument(span)).await?
        } else {
            // Not boxed: the volatile call's future is small (its rare steps are boxed inside).
            self.sharding.send_volatile(request, uninterruptible).instrument(span).await?
        };
        Ok(exit)
    }

    /// The call's `entity_client` span, or a disabled one when the type turned client spans
    /// off; the request carries its trace context (see
    /// [`crate::trace`]), so that the handler's span is its child.
    fn span(&self, tag: &'static str, request: &mut Request) -> tracing::Span {
        if !E::CLIENT_TRACING {
            return tracing::Span::none();
        }
        let span = tracing::info_span!(
            "entity_client",
            otel.name = %format_args!("{}.client.{tag}", E::TYPE),
            entity_type = E::TYPE,
            entity_id = %self.address.entity_id,
            tag,
            request_id = %request.request_id,
        );
        if !span.is_disabled() {
            crate::trace::stamp(&span, &mut request.trace);
        }
        span
    }

    /// Sends `request` without waiting for its reply: returns once the request is delivered
    /// (effect 4.1.0: a discarded call is acknowledged once its message is sent).
    pub async fn discard<R: Rpc>(&self, request: R) -> Result<(), CallError<R::Error>>
    where
        E: Handler<R>,
    {
        self.discard_unchecked(request).await
    }

    /// [`discard`](EntityClient::discard), the handler bound left to the callers.
    pub(crate) async fn discard_unchecked<R: Rpc>(
        &self,
        request: R,
    ) -> Result<(), CallError<R::Error>> {
        let call = self.raw_call(&request).map_err(CallError::Cluster)?;
        self.discard_raw(call).await.map_err(RawFailure::into_call_error)
    }

    /// Sends an encoded request without waiting for its reply.
    pub(crate) async fn discard_raw(&self, call: RawCall) -> Result<(), RawFailure> {
        let RawCall { tag, payload, options, persisted, .. } = call;
        let mut request = self.with_headers_of(tag, payload);
        let span = self.span(tag, &mut request);
        if persisted {
            if self.sharding.persisted().is_none() {
                return Err(RawFailure::Defect(PERSISTED_WITHOUT_STORAGE.to_owned()));
            }
            return Ok(self.sharding.notify_persisted(request, options).instrument(span).await?);
        }
        match self.sharding.notify_volatile(request).instrument(span.clone()).await {
            // The abandon path of the reference (`effect/src/cluster/Sharding.ts`): a volatile
            // discard sent while this runner stops (from an entity's `on_stop`) is dropped, not
            // failed.
            Err(ClusterError::EntityNotAssignedToRunner { address })
                if self.sharding.is_shutdown() =>
            {
                let _entered = span.enter();
                tracing::warn!(%address, tag, "volatile discard sent during shutdown: dropped");
                Ok(())
            }
            sent => Ok(sent?),
        }
    }

    /// The encoded call of `request`, with what its type says about its delivery.
    fn raw_call<R: Rpc>(&self, request: &R) -> Result<RawCall, ClusterError> {
        Ok(RawCall {
            tag: R::TAG,
            payload: RawJson::encode(request)?,
            options: self.save_options_of(R::TAG, request.primary_key(), request.deliver_at()),
            persisted: R::PERSISTED,
            uninterruptible: R::UNINTERRUPTIBLE.client(),
        })
    }

    /// The save options of a request with `primary_key` (the request's own, composed here with
    /// the address and tag) and `deliver_at`.
    pub(crate) fn save_options_of(
        &self,
        tag: &'static str,
        primary_key: Option<String>,
        deliver_at: Option<cluster_core::Timestamp>,
    ) -> SaveRequestOptions {
        SaveRequestOptions {
            primary_key: primary_key.map(|key| self::primary_key(&self.address, tag, &key)),
            deliver_at,
        }
    }

    /// A request of `tag` with `payload` and this client's headers.
    fn with_headers_of(&self, tag: &'static str, payload: RawJson) -> Request {
        let mut request = self.sharding.new_request(self.address.clone(), tag, payload);
        if let Some(headers) = &self.headers {
            request.headers = headers.clone();
        }
        request
    }

    /// Sends the streaming `request` and returns its items as they come. Each chunk is
    /// acknowledged when it is received, which lets the handler send the next.
    ///
    /// # Cancel safety
    ///
    /// Dropping the returned stream interrupts the request.
    pub async fn stream<R: StreamRpc>(
        &self,
        request: R,
    ) -> Result<ChunkStream<R>, CallError<R::Error>>
    where
        E: StreamHandler<R>,
    {
        let options = self.save_options_of(R::TAG, request.primary_key(), None);
        let payload =
            RawJson::encode(&request).map_err(|error| CallError::Cluster(error.into()))?;
        let call = RawCall {
            tag: R::TAG,
            payload,
            options,
            persisted: R::PERSISTED,
            uninterruptible: false,
        };
        let raw = self.stream_raw(call).await.map_err(RawFailure::into_call_error)?;
        Ok(ChunkStream { raw, buffered: VecDeque::new(), request: PhantomData })
    }

    /// Sends an encoded streaming request and returns its chunks as they come.
    pub(crate) async fn stream_raw(&self, call: RawCall) -> Result<RawChunkStream, RawFailure> {
        let RawCall { tag, payload, options, persisted, .. } = call;
        let mut request = self.with_headers_of(tag, payload);
        // The span covers the start of the stream; its items are read later.
        let span = self.span(tag, &mut request);
        let (replies, acks) = if persisted {
            if self.sharding.persisted().is_none() {
                return Err(RawFailure::Defect(PERSISTED_WITHOUT_STORAGE.to_owned()));
            }
            let mut stream =
                self.sharding.stream_persisted(request, options).instrument(span).await?;
            let replies = std::mem::replace(&mut stream.replies, mpsc::channel(1).1);
            (replies, Acks::Stored(Box::new(stream)))
        } else {
            let (replies, acks, cancellation) =
                self.sharding.stream_volatile(request).instrument(span).await?;
            (replies, Acks::Local { acks, interrupt: Some(cancellation.drop_guard()) })
        };
        Ok(RawChunkStream { replies, acks, next_sequence: 0, finished: false, failed: None })
    }
}

/// An encoded request and what its type says about its delivery.
pub(crate) struct RawCall {
    pub(crate) tag: &'static str,
    pub(crate) payload: RawJson,
    pub(crate) options: SaveRequestOptions,
    pub(crate) persisted: bool,
    pub(crate) uninterruptible: bool,
}

/// Why an encoded call failed before its exit.
#[derive(Debug)]
pub(crate) enum RawFailure {
    /// The cluster could not deliver the request or its reply.
    Cluster(ClusterError),
    /// The runtime cannot run it (a persisted request without storage).
    Defect(String),
}

impl From<ClusterError> for RawFailure {
    fn from(error: ClusterError) -> RawFailure {
        RawFailure::Cluster(error)
    }
}

impl RawFailure {
    fn into_call_error<E>(self) -> CallError<E> {
        match self {
            RawFailure::Cluster(error) => CallError::Cluster(error),
            RawFailure::Defect(defect) => CallError::Defect(defect),
        }
    }
}

/// The typed outcome of an exit: the success value, or the failure (see [`failure`]).
fn decode_exit<R: Rpc>(exit: Exit) -> Result<R::Success, CallError<R::Error>> {
    match exit {
        Exit::Success(value) => value.decode().map_err(|error| CallError::Cluster(error.into())),
        Exit::Failure(cause) => Err(failure(cause)),
    }
}

/// The typed failure of a cause: the request's own error (if any reason is one), a defect (if
/// any reason is one), else an interruption.
fn failure<E: serde::de::DeserializeOwned>(cause: Cause) -> CallError<E> {
    let reasons = &cause.0;
    if let Some(error) = reasons.iter().find_map(|reason| match reason {
        CauseReason::Fail(error) => Some(error),
        _ => None,
    }) {
        return match error.decode() {
            Ok(error) => CallError::Failed(error),
            Err(decode) => CallError::Cluster(decode.into()),
        };
    }
    if let Some(defect) = reasons.iter().find_map(|reason| match reason {
        CauseReason::Die(defect) => Some(defect),
        _ => None,
    }) {
        return CallError::Defect(defect.json_or_null().to_owned());
    }
    CallError::Interrupted
}
