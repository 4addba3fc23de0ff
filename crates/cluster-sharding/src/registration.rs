//! The one way to register an entity type and to reach one registered under another name:
//! [`Sharding::entity`].
//!
//! ```text
//! sharding.entity::<Account>().register()?;                          // Entity::create
//! sharding.entity().options(options).factory(make).register()?;     // a factory
//! sharding.entity::<Job>().named(entity_type).register()?;          // another name
//! sharding.entity::<Job>().named(entity_type).client(id);           // its client
//! ```
//!
//! The instances come from [`Entity::create`] unless a factory is given.
//! An entity type without `create` ([`Entity::FACTORY_ONLY`]) fails to build when registered
//! without a factory.

use std::marker::PhantomData;
use std::sync::Arc;

use cluster_core::future::BoxFuture;
use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup};

use crate::api::client::EntityClient;
use crate::api::entity::{Entity, EntityContext, EntityOptions};
use crate::error::RegisterError;
use crate::runtime::manager::Factory;
use crate::sharding::Sharding;

/// An entity type about to be registered, or reached under its name: see
/// [`Sharding::entity`].
///
/// `F` is where instances come from: [`ByCreate`] until a factory is given, [`ByFactory`]
/// after.
#[must_use = "nothing is registered until `register` is called"]
pub struct EntityRegistration<'a, E: Entity, F = ByCreate> {
    sharding: &'a Sharding,
    entity_type: EntityType,
    options: EntityOptions,
    factory: F,
    entity: PhantomData<fn() -> E>,
}

/// Instances come from [`Entity::create`].
#[derive(Debug)]
pub struct ByCreate;

/// Instances come from a factory ([`EntityRegistration::factory`] or
/// [`EntityRegistration::factory_async`]).
pub struct ByFactory<E>(Factory<E>);

impl<E> std::fmt::Debug for ByFactory<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByFactory").finish_non_exhaustive()
    }
}

impl<E: Entity, F> std::fmt::Debug for EntityRegistration<'_, E, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityRegistration")
            .field("entity_type", &self.entity_type)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

// Here rather than in `sharding.rs`: the runtime does not name its registrations, so the two
// files import in one direction only.
impl Sharding {
    /// Entity type `E`, to register (`.register()`) or to reach under another name
    /// (`.named(..).client(..)`): see [`EntityRegistration`].
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::sync::atomic::{AtomicU64, Ordering};
    /// # use cluster_core::ShardingConfig;
    /// # use cluster_sharding::{EntityOptions, Never, Sharding, entity};
    /// # use serde::{Deserialize, Serialize};
    /// #[derive(Serialize, Deserialize)]
    /// struct Visit;
    ///
    /// /// Counts the visits of every page in one shared counter.
    /// struct Page {
    ///     visits: Arc<AtomicU64>,
    /// }
    ///
    /// // No `create`: instances come from the factory only.
    /// #[entity]
    /// impl Page {
    ///     #[rpc]
    ///     async fn visit(&mut self, _: Visit) -> Result<u64, Never> {
    ///         Ok(self.visits.fetch_add(1, Ordering::Relaxed) + 1)
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let sharding = Sharding::volatile(ShardingConfig::default()).start().await?;
    /// let visits = Arc::new(AtomicU64::new(0));
    /// let shared = Arc::clone(&visits);
    /// sharding
    ///     .entity()
    ///     .options(EntityOptions::default())
    ///     .factory(move |_| Page { visits: Arc::clone(&shared) })
    ///     .register()?;
    /// let pages = Page::client(&sharding);
    /// pages.visit("home", Visit).await?;
    /// pages.visit("about", Visit).await?;
    /// assert_eq!(visits.load(Ordering::Relaxed), 2);
    /// # sharding.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn entity<E: Entity>(&self) -> EntityRegistration<'_, E> {
        EntityRegistration::new(self)
    }
}

impl<'a, E: Entity> EntityRegistration<'a, E, ByCreate> {
    /// Entity type `E` under its own name ([`Entity::TYPE`]), with the default options.
    pub(crate) fn new(sharding: &'a Sharding) -> EntityRegistration<'a, E, ByCreate> {
        EntityRegistration {
            sharding,
            entity_type: EntityType::from_static(E::TYPE),
            options: EntityOptions::default(),
            factory: ByCreate,
            entity: PhantomData,
        }
    }

    /// Instances made by `factory` instead of [`Entity::create`]: the way to hand instances
    /// their dependencies (a pool, a client, a counter) without globals.
    ///
    /// The factory runs wherever `create` would: on an instance's first request, after it was
    /// reaped for idleness, and after a panic (a panicking factory is retried with the same
    /// backoff).
    pub fn factory(
        self,
        factory: impl Fn(&EntityContext) -> E + Send + Sync + 'static,
    ) -> EntityRegistration<'a, E, ByFactory<E>> {
        self.made_by(Factory::With(Arc::new(factory)))
    }

    /// Instances made by an asynchronous `factory`: for instances that load something before
    /// their first request (a snapshot of their state, say).
    ///
    /// The factory gets its own handle on the context.
    /// An instance's requests wait until it is made.
    pub fn factory_async<Fut>(
        self,
        factory: impl Fn(EntityContext) -> Fut + Send + Sync + 'static,
    ) -> EntityRegistration<'a, E, ByFactory<E>>
    where
        Fut: Future<Output = E> + Send + 'static,
    {
        let factory = move |context| -> BoxFuture<'static, E> { Box::pin(factory(context)) };
        self.made_by(Factory::WithAsync(Arc::new(factory)))
    }

    fn made_by(self, factory: Factory<E>) -> EntityRegistration<'a, E, ByFactory<E>> {
        EntityRegistration {
            sharding: self.sharding,
            entity_type: self.entity_type,
            options: self.options,
            factory: ByFactory(factory),
            entity: PhantomData,
        }
    }

    /// Registers the entity type: its requests are handled on this runner from now on.
    ///
    /// In a client-only process this is a no-op, as in the reference.
    ///
    /// # Errors
    ///
    /// [`RegisterError`]: the runtime shuts down, the options are invalid, or the name is
    /// registered already.
    pub fn register(self) -> Result<(), RegisterError> {
        const {
            assert!(
                !E::FACTORY_ONLY,
                "this entity type has no `create` (Entity::FACTORY_ONLY): register it with \
                 `.factory(..)` or `.factory_async(..)`, or give it an `async fn create`"
            );
        }
        self.sharding.register_factory(self.entity_type, self.options, Factory::<E>::create())
    }
}

impl<E: Entity> EntityRegistration<'_, E, ByFactory<E>> {
    /// Registers the entity type, its instances made by the factory.
    ///
    /// In a client-only process this is a no-op, as in the reference.
    ///
    /// # Errors
    ///
    /// [`RegisterError`]: the runtime shuts down, the options are invalid, or the name is
    /// registered already.
    pub fn register(self) -> Result<(), RegisterError> {
        self.sharding.register_factory(self.entity_type, self.options, self.factory.0)
    }
}

impl<E: Entity, F> EntityRegistration<'_, E, F> {
    /// Another name than [`Entity::TYPE`]: one Rust type for several entity types, such as the
    /// reference's `ClusterCron/<name>` and `Workflow/<name>`.
    ///
    /// An instance finds its type in its address.
    pub fn named(mut self, entity_type: EntityType) -> Self {
        self.entity_type = entity_type;
        self
    }

    /// The options of the entity type (mailbox, concurrency, idle time, residency).
    pub fn options(mut self, options: EntityOptions) -> Self {
        self.options = options;
        self
    }

    /// A typed client for the entity `entity_id` of this type, in the shard group
    /// [`Entity::shard_group`] gives.
    ///
    /// For a type under its own name, [`Sharding::client`] is the same.
    pub fn client(&self, entity_id: impl Into<EntityId>) -> EntityClient<E> {
        let entity_id = entity_id.into();
        let group = E::shard_group(entity_id.as_str());
        self.client_in(&group, entity_id)
    }

    /// A typed client for the entity `entity_id` of this type, in the shard group `group`.
    pub fn client_in(&self, group: &ShardGroup, entity_id: impl Into<EntityId>) -> EntityClient<E> {
        let entity_id = entity_id.into();
        let shard_id = self.sharding.shard_id(entity_id.as_str(), group);
        let entity_type = self.entity_type.clone();
        EntityClient::new(self.sharding.clone(), EntityAddress { shard_id, entity_type, entity_id })
    }
}
