//! Keep-alive: an entity asks to stay resident (never reaped for idleness) until it says
//! otherwise (the reference's `Entity.keepAlive` and `KeepAliveLatch`).
//!
//! - **Enabling** closes the instance's latch and sends the internal keep-alive request to the
//!   entity itself.
//!   The request is persisted when the runtime has a message storage.
//!   Left unanswered while the latch is closed, it re-activates the entity after a restart.
//! - **Parking.** The manager parks that request instead of queueing it.
//!   A parked request marks the entity as kept alive.
//! - **Disabling** opens the latch: the parked request is answered, and the entity may be
//!   reaped again.

use std::sync::{Arc, Mutex, MutexGuard};

use cluster_core::envelope::Exit;
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::{ClusterError, EntityAddress};

use crate::runtime::delivery::{Delivery, ReplyTo};

/// The tag of the internal keep-alive request (the reference's `KeepAliveRpc`).
pub(crate) const KEEP_ALIVE_TAG: &str = "Cluster/Entity/keepAlive";

/// Sends the keep-alive request to an entity.
pub(crate) type KeepAliveSender =
    Arc<dyn Fn(EntityAddress) -> BoxFuture<'static, Result<(), ClusterError>> + Send + Sync>;

/// The keep-alive latch of one entity instance.
#[derive(Default)]
pub(crate) struct KeepAlive {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// An open latch answers keep-alive requests at once.
    /// It is closed when an instance starts.
    /// So a stored keep-alive request re-delivered after a restart parks again.
    open: bool,
    /// The keep-alive request waiting for the latch to open.
    /// There is at most one: later ones are answered at once while it waits.
    parked: Option<Delivery>,
}

impl KeepAlive {
    fn state(&self) -> MutexGuard<'_, State> {
        // The critical sections only push, take or set a flag.
        lock(&self.state)
    }

    /// Whether the instance must not be reaped for idleness.
    pub(crate) fn is_enabled(&self) -> bool {
        self.state().parked.is_some()
    }

    /// Closes the latch: the next keep-alive request parks.
    pub(crate) fn close(&self) {
        self.state().open = false;
    }

    /// Opens the latch and answers the parked request.
    pub(crate) fn open(&self) {
        let parked = {
            let mut state = self.state();
            state.open = true;
            state.parked.take()
        };
        if let Some(parked) = parked {
            answer(parked);
        }
    }

    /// Takes a delivered keep-alive request, as the reference's manager does.
    ///
    /// - It is answered at once if keep-alive is already on or the latch is open.
    /// - Otherwise it is parked until the latch opens.
    pub(crate) fn park(&self, delivery: Delivery) {
        let mut state = self.state();
        if state.open || state.parked.is_some() {
            drop(state);
            answer(delivery);
        } else {
            state.parked = Some(delivery);
        }
    }

    /// Drops the parked request without answering it, when the instance ends (shutdown).
    ///
    /// A persisted one stays stored, and re-activates the entity on the next run.
    pub(crate) fn abandon(&self) {
        let parked = self.state().parked.take();
        drop(parked);
    }
}

fn answer(delivery: Delivery) {
    match delivery.reply {
        ReplyTo::Exit(reply) => {
            // The caller (the storage loop) may have gone away at shutdown.
            let _ = reply.send(Exit::void());
        }
        // The keep-alive request is unary; a stream reply channel just closes.
        ReplyTo::Stream(_) => {}
    }
}

/// What a handler's [`RequestContext`](crate::RequestContext) holds to switch keep-alive.
#[derive(Clone)]
pub(crate) struct KeepAliveHandle {
    pub(crate) latch: Arc<KeepAlive>,
    pub(crate) send: KeepAliveSender,
}

impl KeepAliveHandle {
    /// Enables or disables keep-alive for the entity at `address`.
    pub(crate) async fn set(
        &self,
        address: &EntityAddress,
        enabled: bool,
    ) -> Result<(), ClusterError> {
        if !enabled {
            self.latch.open();
            return Ok(());
        }
        self.latch.close();
        (self.send)(address.clone()).await
    }
}
