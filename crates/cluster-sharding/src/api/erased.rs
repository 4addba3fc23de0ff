//! Requests whose payload is JSON, whatever their type: what a gateway calls (durable-cluster's
//! HTTP ingress). [`rpcs_of`] lists an entity type's request types as [`ErasedRpc`]s, each of
//! which decodes a JSON payload into its request type and sends it as the typed client does
//! (persisted requests with their primary key, so a gateway deduplicates as a Rust caller does).
//!
//! A streaming request type is called with [`ErasedRpc::stream`], whose [`ErasedStream`] gives
//! the chunks' items as JSON, acknowledging each chunk as it is taken (so a slow reader slows
//! the handler down).

use cluster_core::envelope::{Cause, Exit, RawJson};
use cluster_core::error::DecodeError;
use cluster_core::future::BoxFuture;
use cluster_core::{ClusterError, EntityId};

use crate::api::client::{RawCall, RawChunkStream, RawFailure, RawStreamEnd};
use crate::api::entity::{Entity, Protocol, RpcShape};
use crate::sharding::Sharding;

/// How an erased call goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Wait for the exit.
    Send,
    /// Return once the request is delivered (stored, for a persisted request).
    Discard,
}

/// The call of an entity type's client, monomorphized for the type.
type CallFn =
    fn(Sharding, EntityId, RawCall, Mode) -> BoxFuture<'static, Result<Option<Exit>, RawFailure>>;

/// The stream call of an entity type's client, monomorphized for the type.
type StreamFn =
    fn(Sharding, EntityId, RawCall) -> BoxFuture<'static, Result<RawChunkStream, RawFailure>>;

/// One request type of an entity type, callable with a JSON payload.
#[derive(Clone, Copy)]
pub struct ErasedRpc {
    shape: RpcShape,
    call: CallFn,
    stream: StreamFn,
}

impl std::fmt::Debug for ErasedRpc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ErasedRpc")
            .field("tag", &self.shape.tag)
            .field("persisted", &self.shape.persisted)
            .field("stream", &self.shape.stream)
            .finish()
    }
}

/// Why an erased call failed before it had an exit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ErasedError {
    /// The payload is not the request type's JSON.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The cluster could not deliver the request or its reply.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The runtime cannot run the request (a persisted request without storage).
    #[error("{0}")]
    Defect(String),
    /// The request type answers with a stream, which only [`ErasedRpc::stream`] reads.
    #[error("the request type `{0}` answers with a stream")]
    Stream(&'static str),
    /// The request type answers once, which [`ErasedRpc::stream`] does not read.
    #[error("the request type `{0}` does not answer with a stream")]
    NotStream(&'static str),
}

/// The chunks of a streamed answer, encoded; dropping it interrupts the request.
pub struct ErasedStream {
    raw: RawChunkStream,
}

impl std::fmt::Debug for ErasedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ErasedStream").finish_non_exhaustive()
    }
}

/// Why a stream ended before its last item.
#[derive(Debug)]
#[non_exhaustive]
pub enum ErasedStreamEnd {
    /// The handler failed: the request type's own error, a defect or an interruption, as the
    /// cause of its exit.
    Failed(Cause),
    /// The cluster could not deliver the stream (its storage failed, its runner stopped).
    Cluster(ClusterError),
    /// The stream's replies stopped before its final reply.
    Interrupted,
}

impl ErasedStream {
    /// The items of the next chunk, as JSON, acknowledged once taken; `Some(Err(_))` when the
    /// stream failed (after the items already taken); `None` once it ended.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a chunk is only taken when this returns it.
    pub async fn next_chunk(&mut self) -> Option<Result<Vec<RawJson>, ErasedStreamEnd>> {
        let next = self.raw.next_chunk().await?;
        Some(next.map_err(|end| match end {
            RawStreamEnd::Failed(cause) => ErasedStreamEnd::Failed(cause),
            RawStreamEnd::Cluster(error) => ErasedStreamEnd::Cluster(error),
            RawStreamEnd::Interrupted => ErasedStreamEnd::Interrupted,
        }))
    }
}

impl ErasedRpc {
    /// The request type's tag.
    pub fn tag(&self) -> &'static str {
        self.shape.tag
    }

    /// Whether its requests are persisted.
    pub fn is_persisted(&self) -> bool {
        self.shape.persisted
    }

    /// Whether it answers with a stream.
    pub fn is_stream(&self) -> bool {
        self.shape.stream
    }

    /// Whether its success is `()` (a void success).
    pub fn is_void(&self) -> bool {
        self.shape.void_success
    }

    /// Decodes `payload` and sends it to `entity_id`, then waits for the exit, which holds the
    /// encoded success or failure as the handler made it. The payload goes as it came (fields
    /// the type does not read included).
    ///
    /// # Errors
    ///
    /// [`ErasedError`]: the payload does not decode, the cluster failed, or the type streams.
    ///
    /// # Cancel safety
    ///
    /// As [`EntityClient::send`](crate::EntityClient::send): dropping the future interrupts the
    /// request, unless its type is uninterruptible.
    pub async fn send(
        &self,
        sharding: &Sharding,
        entity_id: EntityId,
        payload: RawJson,
    ) -> Result<Exit, ErasedError> {
        let exit = self.call(sharding, entity_id, payload, Mode::Send).await?;
        // A send always has an exit.
        exit.ok_or_else(|| ErasedError::Defect("a call ended without an exit".to_owned()))
    }

    /// Decodes `payload` and sends it to `entity_id` without waiting for its reply (as
    /// [`EntityClient::discard`](crate::EntityClient::discard)).
    ///
    /// # Errors
    ///
    /// As [`send`](ErasedRpc::send).
    ///
    /// # Cancel safety
    ///
    /// As [`EntityClient::discard`](crate::EntityClient::discard).
    pub async fn discard(
        &self,
        sharding: &Sharding,
        entity_id: EntityId,
        payload: RawJson,
    ) -> Result<(), ErasedError> {
        self.call(sharding, entity_id, payload, Mode::Discard).await.map(|_| ())
    }

    /// Decodes `payload` and sends it to `entity_id` as a streaming request; returns once the
    /// stream started (its request sent, and stored for a persisted one).
    ///
    /// # Errors
    ///
    /// [`ErasedError`]: the payload does not decode, the cluster failed, or the type does not
    /// stream.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future or the returned stream interrupts the request.
    pub async fn stream(
        &self,
        sharding: &Sharding,
        entity_id: EntityId,
        payload: RawJson,
    ) -> Result<ErasedStream, ErasedError> {
        if !self.shape.stream {
            return Err(ErasedError::NotStream(self.shape.tag));
        }
        let call = self.raw_call(payload)?;
        let raw = (self.stream)(sharding.clone(), entity_id, call).await.map_err(erased)?;
        Ok(ErasedStream { raw })
    }

    async fn call(
        &self,
        sharding: &Sharding,
        entity_id: EntityId,
        payload: RawJson,
        mode: Mode,
    ) -> Result<Option<Exit>, ErasedError> {
        if self.shape.stream {
            return Err(ErasedError::Stream(self.shape.tag));
        }
        let call = self.raw_call(payload)?;
        (self.call)(sharding.clone(), entity_id, call, mode).await.map_err(erased)
    }

    /// The call of `payload`, decoded as the request type for its primary key (the request's
    /// own: the client composes it with the address and tag) and delivery time.
    fn raw_call(&self, payload: RawJson) -> Result<RawCall, ErasedError> {
        let (primary_key, deliver_at) = (self.shape.read)(&payload)?;
        let options = cluster_core::storage::SaveRequestOptions { primary_key, deliver_at };
        Ok(RawCall {
            tag: self.shape.tag,
            payload,
            options,
            persisted: self.shape.persisted,
            uninterruptible: self.shape.uninterruptible,
        })
    }
}

/// The erased error of a raw failure.
fn erased(failure: RawFailure) -> ErasedError {
    match failure {
        RawFailure::Cluster(error) => ErasedError::Cluster(error),
        RawFailure::Defect(defect) => ErasedError::Defect(defect),
    }
}

/// Sends `call` with the client of `E` for `entity_id`; the primary key in its options is the
/// request's own, composed here with the address and tag.
fn call<E: Entity>(
    sharding: Sharding,
    entity_id: EntityId,
    call: RawCall,
    mode: Mode,
) -> BoxFuture<'static, Result<Option<Exit>, RawFailure>> {
    Box::pin(async move {
        let client = sharding.client::<E>(entity_id);
        let own = call.options;
        let options = client.save_options_of(call.tag, own.primary_key, own.deliver_at);
        let call = RawCall { options, ..call };
        match mode {
            Mode::Send => client.exit_of_raw(call).await.map(Some),
            Mode::Discard => client.discard_raw(call).await.map(|()| None),
        }
    })
}

/// Starts `call` as a stream with the client of `E` for `entity_id`.
fn stream<E: Entity>(
    sharding: Sharding,
    entity_id: EntityId,
    call: RawCall,
) -> BoxFuture<'static, Result<RawChunkStream, RawFailure>> {
    Box::pin(async move {
        let client = sharding.client::<E>(entity_id);
        let own = call.options;
        let options = client.save_options_of(call.tag, own.primary_key, own.deliver_at);
        client.stream_raw(RawCall { options, ..call }).await
    })
}

/// The request types of `E`, in tag order, each callable with a JSON payload.
pub fn rpcs_of<E: Entity>() -> Vec<ErasedRpc> {
    Protocol::<E>::of()
        .shapes()
        .into_iter()
        .map(|shape| ErasedRpc { shape, call: call::<E>, stream: stream::<E> })
        .collect()
}
