//! [`EntityClient`]: typed calls to one entity, wherever it lives.

use std::marker::PhantomData;

use cluster_core::envelope::{CauseReason, Exit, RawJson, Request, TraceContext, primary_key};
use cluster_core::storage::SaveRequestOptions;
use cluster_core::{ClusterError, EntityAddress};

use crate::entity::{Entity, Handler};
use crate::rpc::{CallError, Rpc};
use crate::sharding::Sharding;

/// The defect the reference raises for a persisted request on a runtime without storage.
const PERSISTED_WITHOUT_STORAGE: &str =
    "Sharding.sendOutgoing: Persisted messages require MessageStorage";

/// A typed client for one entity; cheap to clone.
pub struct EntityClient<E> {
    sharding: Sharding,
    address: EntityAddress,
    entity: PhantomData<fn() -> E>,
}

impl<E> Clone for EntityClient<E> {
    fn clone(&self) -> EntityClient<E> {
        EntityClient {
            sharding: self.sharding.clone(),
            address: self.address.clone(),
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
        EntityClient { sharding, address, entity: PhantomData }
    }

    /// The entity's address.
    pub fn address(&self) -> &EntityAddress {
        &self.address
    }

    /// Sends `request` and waits for its reply.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future interrupts the request (unless `R` is client-side uninterruptible):
    /// the handler's future is dropped.
    pub async fn send<R: Rpc>(&self, request: R) -> Result<R::Success, CallError<R::Error>>
    where
        E: Handler<R>,
    {
        let options = self.save_options(&request);
        let request = self.request(&request).map_err(CallError::Cluster)?;
        let uninterruptible = R::UNINTERRUPTIBLE.client();
        let exit = if R::PERSISTED {
            if self.sharding.persisted().is_none() {
                return Err(CallError::Defect(PERSISTED_WITHOUT_STORAGE.to_owned()));
            }
            self.sharding.send_persisted(request, options, uninterruptible).await?
        } else {
            self.sharding.send_local(request, uninterruptible).await?
        };
        decode_exit::<R>(exit)
    }

    /// Sends `request` without waiting for its reply: returns once the request is delivered
    /// (seed 000: a discarded call is acknowledged once its message is sent).
    pub async fn discard<R: Rpc>(&self, request: R) -> Result<(), CallError<R::Error>>
    where
        E: Handler<R>,
    {
        let options = self.save_options(&request);
        let request = self.request(&request).map_err(CallError::Cluster)?;
        if R::PERSISTED {
            if self.sharding.persisted().is_none() {
                return Err(CallError::Defect(PERSISTED_WITHOUT_STORAGE.to_owned()));
            }
            return Ok(self.sharding.notify_persisted(request, options).await?);
        }
        Ok(self.sharding.notify_local(request).await?)
    }

    /// The primary key (composed with the address and tag) and delivery time of a persisted
    /// request.
    fn save_options<R: Rpc>(&self, request: &R) -> SaveRequestOptions {
        SaveRequestOptions {
            primary_key: request.primary_key().map(|key| primary_key(&self.address, R::TAG, &key)),
            deliver_at: request.deliver_at(),
        }
    }

    fn request<R: Rpc>(&self, request: &R) -> Result<Request, ClusterError> {
        Ok(Request {
            request_id: self.sharding.next_id(),
            address: self.address.clone(),
            tag: R::TAG.into(),
            payload: RawJson::encode(request)?,
            headers: RawJson::empty_object(),
            trace: TraceContext::default(),
        })
    }
}

/// The typed outcome of an exit: the success value, the request's own error (if any reason is
/// one), a defect (if any reason is one), else an interruption.
fn decode_exit<R: Rpc>(exit: Exit) -> Result<R::Success, CallError<R::Error>> {
    match exit {
        Exit::Success(value) => value.decode().map_err(|error| CallError::Cluster(error.into())),
        Exit::Failure(cause) => {
            let reasons = &cause.0;
            if let Some(error) = reasons.iter().find_map(|reason| match reason {
                CauseReason::Fail(error) => Some(error),
                _ => None,
            }) {
                return Err(match error.decode() {
                    Ok(error) => CallError::Failed(error),
                    Err(decode) => CallError::Cluster(decode.into()),
                });
            }
            if let Some(defect) = reasons.iter().find_map(|reason| match reason {
                CauseReason::Die(defect) => Some(defect),
                _ => None,
            }) {
                return Err(CallError::Defect(defect.json_or_null().to_owned()));
            }
            Err(CallError::Interrupted)
        }
    }
}
