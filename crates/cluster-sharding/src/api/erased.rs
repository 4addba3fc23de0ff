//! Requests whose payload is JSON, whatever their type: what a gateway calls (durable-cluster's
//! HTTP ingress). [`rpcs_of`] lists an entity type's request types as [`ErasedRpc`]s, each of
//! which decodes a JSON payload into its request type and sends it as the typed client does
//! (persisted requests with their primary key, so a gateway deduplicates as a Rust caller does).
//!
//! Streaming request types are listed (so that a gateway can say it does not serve them) but not
//! callable here.

use cluster_core::envelope::{Exit, RawJson};
use cluster_core::error::DecodeError;
use cluster_core::future::BoxFuture;
use cluster_core::{ClusterError, EntityId};

use crate::api::client::{RawCall, RawFailure};
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

/// One request type of an entity type, callable with a JSON payload.
#[derive(Clone, Copy)]
pub struct ErasedRpc {
    shape: RpcShape,
    call: CallFn,
}

impl std::fmt::Debug for ErasedRpc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ErasedRpc")
            .field("tag", &self.shape.tag)
            .field("persisted", &self.shape.persisted)
            .field("stream", &self.shape.read.is_none())
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
    /// The request type answers with a stream, which an erased call does not read.
    #[error("the request type `{0}` answers with a stream")]
    Stream(&'static str),
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
        self.shape.read.is_none()
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

    async fn call(
        &self,
        sharding: &Sharding,
        entity_id: EntityId,
        payload: RawJson,
        mode: Mode,
    ) -> Result<Option<Exit>, ErasedError> {
        let read = self.shape.read.ok_or(ErasedError::Stream(self.shape.tag))?;
        let (primary_key, deliver_at) = read(&payload)?;
        // The request's own primary key: the client composes it with the address and tag.
        let options = cluster_core::storage::SaveRequestOptions { primary_key, deliver_at };
        let call = RawCall {
            tag: self.shape.tag,
            payload,
            options,
            persisted: self.shape.persisted,
            uninterruptible: self.shape.uninterruptible,
        };
        (self.call)(sharding.clone(), entity_id, call, mode).await.map_err(
            |failure| match failure {
                RawFailure::Cluster(error) => ErasedError::Cluster(error),
                RawFailure::Defect(defect) => ErasedError::Defect(defect),
            },
        )
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

/// The request types of `E`, in tag order, each callable with a JSON payload.
pub fn rpcs_of<E: Entity>() -> Vec<ErasedRpc> {
    Protocol::<E>::of()
        .shapes()
        .into_iter()
        .map(|shape| ErasedRpc { shape, call: call::<E> })
        .collect()
}
