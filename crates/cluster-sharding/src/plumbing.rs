//! What layers built on the runtime use, apart from the user API: the workflow engine, the
//! HTTP gateway, a transport's server, the simulation.
//!
//! These methods are on a trait of their own so that [`Sharding`]'s page shows what an
//! application calls. Import [`Plumbing`] to use them.

use std::sync::Arc;

use cluster_core::storage::MessageStorage;
use cluster_core::transport::RunnerHandler;

use crate::sharding::{Sharding, WeakSharding};

mod sealed {
    /// Only the runtime has plumbing.
    pub trait Sealed {}
    impl Sealed for crate::sharding::Sharding {}
}

/// The runtime's plumbing, for layers built on it (see the module documentation).
pub trait Plumbing: sealed::Sealed {
    /// The message storage of persisted requests, if the runtime has one (the workflow engine
    /// reads stored replies and deferred completions there).
    fn message_storage(&self) -> Option<&Arc<dyn MessageStorage>>;

    /// Wakes the storage read loop now, instead of at its next poll.
    fn poll_storage(&self);

    /// What a transport calls when a peer's request arrives (the reference's `RunnerServer`).
    /// It does not keep the runtime alive.
    fn runner_handler(&self) -> Arc<dyn RunnerHandler>;

    /// A handle that does not keep the runtime alive.
    ///
    /// A layer whose state the runtime keeps (in an entity factory, a singleton, an
    /// extension) holds this, not a [`Sharding`]: otherwise the runtime and that state keep
    /// each other alive, with the runtime's connections, after every handle is dropped.
    fn downgrade(&self) -> WeakSharding;

    /// Attaches a service to the runtime, one per type (replacing and returning an earlier
    /// one): how a layer, such as the workflow engine, reaches its state from the entities it
    /// registers.
    fn insert_extension<T: Send + Sync + 'static>(&self, value: Arc<T>) -> Option<Arc<T>>;

    /// The service of type `T` attached with
    /// [`insert_extension`](Plumbing::insert_extension).
    fn extension<T: Send + Sync + 'static>(&self) -> Option<Arc<T>>;
}

impl Plumbing for Sharding {
    fn message_storage(&self) -> Option<&Arc<dyn MessageStorage>> {
        Sharding::message_storage(self)
    }

    fn poll_storage(&self) {
        Sharding::poll_storage(self);
    }

    fn downgrade(&self) -> WeakSharding {
        Sharding::downgrade(self)
    }

    fn runner_handler(&self) -> Arc<dyn RunnerHandler> {
        Sharding::runner_handler(self)
    }

    fn insert_extension<T: Send + Sync + 'static>(&self, value: Arc<T>) -> Option<Arc<T>> {
        Sharding::insert_extension(self, value)
    }

    fn extension<T: Send + Sync + 'static>(&self) -> Option<Arc<T>> {
        Sharding::extension(self)
    }
}
