//! The entity managers of this runner, by entity type: what every delivery looks up.
//!
//! - **Lookup.** A delivery finds its type's manager without a lock for the first
//!   [`FAST_TYPES`] types registered, and under a read lock past them.
//! - **Waiting.** A request for a type that is not registered yet waits for its registration,
//!   up to the registration timeout: the layer that registers it may still be starting.
//! - **Shards.** A shard's release stops its instances on every type.
//!
//! Types are registered once and never removed.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use cluster_core::envelope::Exit;
use cluster_core::sync;
use cluster_core::{ClusterError, EntityAddress, EntityType, ShardId};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::runtime::delivery::{Delivery, ErasedManager, Serving};

/// How many entity types a delivery finds without a lock (see [`Managers`]); the others are
/// found under the registry's read lock.
const FAST_TYPES: usize = 16;

/// The entity managers of this runner, by entity type.
pub(crate) struct Managers {
    by_type: RwLock<BTreeMap<EntityType, Arc<dyn ErasedManager>>>,
    /// The first [`FAST_TYPES`] registered types again, in registration order, each slot set
    /// once: what every delivery reads, without the lock (both workers taking the read lock
    /// on every request made its state bounce between them). Types are never unregistered.
    fast: [OnceLock<(EntityType, Arc<dyn ErasedManager>)>; FAST_TYPES],
    /// Woken whenever an entity type is registered.
    registered: Notify,
}

impl Default for Managers {
    fn default() -> Managers {
        Managers {
            by_type: RwLock::new(BTreeMap::new()),
            fast: std::array::from_fn(|_| OnceLock::new()),
            registered: Notify::new(),
        }
    }
}

impl Managers {
    /// Adds the manager of `entity_type`, made by `make` unless the type is already there.
    /// Returns whether it was added.
    pub(crate) fn insert(
        &self,
        entity_type: &EntityType,
        make: impl FnOnce() -> Arc<dyn ErasedManager>,
    ) -> bool {
        {
            let mut by_type = sync::write(&self.by_type);
            if by_type.contains_key(entity_type) {
                return false;
            }
            let manager = make();
            // Under the write lock, so the slots fill in registration order.
            if let Some(slot) = self.fast.get(by_type.len()) {
                let _ = slot.set((entity_type.clone(), Arc::clone(&manager)));
            }
            by_type.insert(entity_type.clone(), manager);
        }
        self.registered.notify_waiters();
        true
    }

    /// The manager of a registered type, without waiting.
    pub(crate) fn get(&self, entity_type: &EntityType) -> Option<Arc<dyn ErasedManager>> {
        sync::read(&self.by_type).get(entity_type).cloned()
    }

    /// Every registered manager.
    pub(crate) fn all(&self) -> Vec<Arc<dyn ErasedManager>> {
        sync::read(&self.by_type).values().cloned().collect()
    }

    /// Every registered manager, with its type.
    pub(crate) fn all_by_type(&self) -> Vec<(EntityType, Arc<dyn ErasedManager>)> {
        sync::read(&self.by_type)
            .iter()
            .map(|(entity_type, manager)| (entity_type.clone(), Arc::clone(manager)))
            .collect()
    }

    /// The number of resident entity instances, over every type.
    pub(crate) fn active_entities(&self) -> usize {
        self.all().iter().map(|manager| manager.active_entities()).sum()
    }

    /// The addresses of every resident entity instance.
    pub(crate) fn resident_addresses(&self) -> Vec<EntityAddress> {
        self.all().iter().flat_map(|manager| manager.resident_addresses()).collect()
    }

    /// The manager of `address`'s type, waiting up to `timeout` for a type that is not
    /// registered yet; then a defect, as the reference's. Shutting down ends the wait.
    pub(crate) async fn wait_for(
        &self,
        address: &EntityAddress,
        timeout: Duration,
        shutdown: &CancellationToken,
    ) -> Result<Arc<dyn ErasedManager>, Exit> {
        let deadline = crate::time::deadline(timeout);
        loop {
            let registered = self.registered.notified();
            if let Some(manager) = self.get(&address.entity_type) {
                return Ok(manager);
            }
            let timed_out = tokio::select! {
                () = registered => false,
                () = tokio::time::sleep_until(deadline) => true,
                () = shutdown.cancelled() => true,
            };
            if timed_out {
                let message = format!("Entity type '{}' not registered", address.entity_type);
                return Err(Exit::die_with_message("Error", &message));
            }
        }
    }

    /// Hands `delivery` to the manager of its entity type, without waiting: `Err` gives it
    /// back when the type is not registered (yet). The manager is used under the read lock,
    /// without cloning its `Arc` (a reference count every request of every worker would bump).
    pub(crate) fn deliver(
        &self,
        delivery: Box<Delivery>,
        serving: &dyn Serving,
    ) -> Result<Result<(), ClusterError>, Box<Delivery>> {
        let entity_type = &delivery.request.address.entity_type;
        for slot in &self.fast {
            match slot.get() {
                Some((registered, manager)) if registered == entity_type => {
                    return Ok(manager.deliver(delivery, serving).map_err(ClusterError::from));
                }
                Some(_) => {}
                // The slots fill in order: the type is past them, or not registered yet.
                None => break,
            }
        }
        let by_type = sync::read(&self.by_type);
        match by_type.get(entity_type) {
            Some(manager) => Ok(manager.deliver(delivery, serving).map_err(ClusterError::from)),
            None => Err(delivery),
        }
    }

    /// Stops the entities of `shard` on every entity type (see [`ErasedManager::stop_shard`]).
    pub(crate) async fn stop_shard(&self, shard: &ShardId, force: bool, timeout: Duration) {
        let managers = self.all();
        futures_util::future::join_all(
            managers.iter().map(|manager| manager.stop_shard(shard, force, timeout)),
        )
        .await;
    }

    /// The entity types that still have instances in `shards` (named in stuck-release
    /// warnings).
    pub(crate) fn types_in(&self, shards: &[ShardId]) -> Vec<String> {
        self.all_by_type()
            .into_iter()
            .filter(|(_, manager)| shards.iter().any(|shard| manager.has_instances_in(shard)))
            .map(|(entity_type, _)| entity_type.to_string())
            .collect()
    }
}
