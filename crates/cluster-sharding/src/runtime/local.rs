//! Local delivery: a request handed to the manager of its entity type on this runner.
//!
//! - **The common case** (a served shard, a registered type) reads no clock and waits for
//!   nothing.
//! - **A shard being taken over** is waited for, at most `shard_lock_expiration` (see
//!   [`Shards::await_shard`]).
//! - **A type not registered yet** is waited for, at most `entity_registration_timeout`; then
//!   the request ends with a defect, as in the reference.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{Exit, Reply, Request, WithExit};
use cluster_core::{ClusterError, EntityAddress, Snowflake};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::api::entity::Ids;
use crate::placement::shards::Shards;
use crate::runtime::delivery::{Delivery, ErasedManager, ReplyTo, StreamReplies};
use crate::runtime::interrupt::InterruptSignal;
use crate::runtime::registry::Managers;

/// The buffer of a stream's reply and acknowledgement channels.
pub(crate) const STREAM_BUFFER: usize = 4;

/// A streaming request's replies (chunks, then the final reply), where the caller's
/// acknowledgements go, and what interrupts it.
pub(crate) type StreamCall = (mpsc::Receiver<Reply>, mpsc::Sender<Snowflake>, InterruptSignal);

/// Delivers requests to the entities of this runner.
pub(crate) struct LocalDelivery {
    managers: Arc<Managers>,
    shards: Arc<Shards>,
    ids: Arc<Ids>,
    /// How long a request waits for its entity type's registration.
    registration_timeout: Duration,
    /// Ends the waits when the runtime stops.
    shutdown: CancellationToken,
}

impl LocalDelivery {
    /// Delivery to `managers` of the requests of the shards `shards` serves.
    pub(crate) fn new(
        managers: Arc<Managers>,
        shards: Arc<Shards>,
        ids: Arc<Ids>,
        registration_timeout: Duration,
        shutdown: CancellationToken,
    ) -> LocalDelivery {
        LocalDelivery { managers, shards, ids, registration_timeout, shutdown }
    }

    /// Delivers a volatile request to the local entity and waits for its exit. Dropping the
    /// returned future interrupts the request, unless `uninterruptible`.
    pub(crate) async fn send(
        &self,
        request: Request,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        let (delivery, call) = LocalCall::new(request);
        self.deliver(delivery).await?;
        call.exit(uninterruptible).await
    }

    /// Delivers a volatile streaming request to the local entity.
    pub(crate) async fn stream(&self, request: Request) -> Result<StreamCall, ClusterError> {
        let address = request.address.clone();
        if !self.shards.await_shard(&address.shard_id).await {
            return Err(ClusterError::EntityNotAssignedToRunner { address });
        }
        // One chunk in flight at a time (the handler waits for its acknowledgement), plus the
        // final reply.
        let (replies, replied) = mpsc::channel(STREAM_BUFFER);
        let (acked, acks) = mpsc::channel(STREAM_BUFFER);
        let cancellation = InterruptSignal::new();
        let manager = match self.manager_for(&address).await {
            Ok(manager) => manager,
            Err(defect) => {
                let id = self.ids.next();
                let with_exit = WithExit { request_id: request.request_id, id, exit: defect };
                let _ = replies.send(Reply::WithExit(with_exit)).await;
                return Ok((replied, acked, cancellation));
            }
        };
        let stream = StreamReplies { replies, acks, last_sent: None };
        let delivery = Delivery::volatile(request, cancellation.clone(), ReplyTo::Stream(stream));
        manager.deliver(delivery, &*self.shards)?;
        Ok((replied, acked, cancellation))
    }

    /// Delivers a volatile request without waiting for its exit (a discarded call).
    pub(crate) async fn notify(&self, request: Request) -> Result<(), ClusterError> {
        let (reply, _ignored) = oneshot::channel();
        self.deliver(Delivery::volatile(request, InterruptSignal::new(), ReplyTo::Exit(reply)))
            .await
    }

    /// Delivers a request to the local entity, waiting (boxed, rare) for its shard's lock or
    /// its type's registration.
    pub(crate) async fn deliver(&self, delivery: Box<Delivery>) -> Result<(), ClusterError> {
        // The common case (a held shard, a registered type) reads no clock and waits for
        // nothing; the waits are boxed so that they do not grow every call's future.
        let shard = &delivery.request.address.shard_id;
        if !self.shards.delivers(shard) && !Box::pin(self.shards.await_shard(shard)).await {
            let address = delivery.request.address.clone();
            return Err(ClusterError::EntityNotAssignedToRunner { address });
        }
        let delivery = match self.deliver_registered(delivery) {
            Ok(delivered) => return delivered,
            Err(unregistered) => unregistered,
        };
        match Box::pin(self.manager_for(&delivery.request.address)).await {
            Ok(manager) => Ok(manager.deliver(delivery, &*self.shards)?),
            Err(defect) => {
                // The caller gets the defect as the request's exit.
                if let ReplyTo::Exit(reply) = delivery.reply {
                    let _ = reply.send(defect);
                }
                Ok(())
            }
        }
    }

    /// Hands `delivery` to the manager of its entity type, without waiting: `Err` gives it
    /// back when the type is not registered (yet).
    pub(crate) fn deliver_registered(
        &self,
        delivery: Box<Delivery>,
    ) -> Result<Result<(), ClusterError>, Box<Delivery>> {
        self.managers.deliver(delivery, &*self.shards)
    }

    /// The manager of `address`'s type, waiting up to the registration timeout for an entity
    /// type that is not registered yet (its layer may still be starting); then a defect.
    async fn manager_for(&self, address: &EntityAddress) -> Result<Arc<dyn ErasedManager>, Exit> {
        self.managers.wait_for(address, self.registration_timeout, &self.shutdown).await
    }
}

/// A volatile unary request about to be handed to a local entity, and how its exit comes back.
pub(crate) struct LocalCall {
    exit: oneshot::Receiver<Exit>,
    interrupt: InterruptSignal,
    /// For the error of an instance that went away without answering.
    address: EntityAddress,
}

impl LocalCall {
    /// The delivery of `request` and the call that waits for its exit.
    pub(crate) fn new(request: Request) -> (Box<Delivery>, LocalCall) {
        let (reply, exit) = oneshot::channel();
        let interrupt = InterruptSignal::new();
        let address = request.address.clone();
        let delivery = Delivery::volatile(request, interrupt.clone(), ReplyTo::Exit(reply));
        (delivery, LocalCall { exit, interrupt, address })
    }

    /// Waits for the exit of the delivered request. Dropping the future interrupts the
    /// request, unless `uninterruptible`; an instance that went away without answering (the
    /// runner stopped) is `EntityNotAssignedToRunner`.
    pub(crate) async fn exit(self, uninterruptible: bool) -> Result<Exit, ClusterError> {
        let LocalCall { exit, interrupt, address } = self;
        // Dropped before the exit arrives (the caller went away): interrupt the request.
        let interrupt_on_drop = (!uninterruptible).then(|| interrupt.drop_guard());
        let exit = exit.await.map_err(|_| ClusterError::EntityNotAssignedToRunner { address });
        if let Some(guard) = interrupt_on_drop {
            guard.disarm();
        }
        exit
    }
}
