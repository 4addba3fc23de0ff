//! [`TestClient`]: calls to one entity type in process, for application unit tests (the
//! reference's `Entity.makeTestClient`, `effect/src/cluster/Entity.ts`).
//!
//! A test client runs the entity type on a private in-process runtime: no database, no runner
//! registry, no shard locks, no transport. Every entity id gets its own instance, created on its
//! first call and kept as the runtime keeps instances (`entity_max_idle_time`). Persisted
//! requests work too, through an in-memory message store of the client's own.
//!
//! The handler does not see the caller's context: it runs on its instance's task, not the
//! caller's (task-locals and the caller's spans do not reach it), and it reads only the headers
//! the client was given with [`EntityClient::with_headers`].

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::{ShardingConfig, SystemClock};
use cluster_sharding::{Entity, EntityClient, EntityOptions, RegisterError, Sharding, StartError};

use crate::memory::MemoryMessageStorage;

/// Why a [`TestClient`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum TestClientError {
    /// The runtime did not start (an invalid configuration).
    #[error(transparent)]
    Start(#[from] StartError),
    /// The entity type could not be registered (its options are out of bounds).
    #[error(transparent)]
    Register(#[from] RegisterError),
}

/// An in-memory client for the entity type `E`, for unit tests of an application's entities.
///
/// ```text
/// let counters = TestClient::<Counter>::new().await?;
/// assert_eq!(counters.client("a").send(Increment { by: 2 }).await?, 2);
/// counters.shutdown().await;
/// ```
pub struct TestClient<E: Entity> {
    sharding: Sharding,
    entity: PhantomData<fn() -> E>,
}

impl<E: Entity> std::fmt::Debug for TestClient<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestClient").field("entity_type", &E::TYPE).finish()
    }
}

impl<E: Entity> TestClient<E> {
    /// A test client with the default options of the entity type and short poll intervals.
    ///
    /// # Errors
    ///
    /// None with these defaults; the type is shared with
    /// [`with_options`](TestClient::with_options).
    pub async fn new() -> Result<TestClient<E>, TestClientError> {
        TestClient::with_options(TestClient::<E>::config(), EntityOptions::default()).await
    }

    /// A test client with `config` (for example a short `entity_max_idle_time`) and `options`.
    ///
    /// # Errors
    ///
    /// An invalid configuration, or options out of their bounds.
    pub async fn with_options(
        config: ShardingConfig,
        options: EntityOptions,
    ) -> Result<TestClient<E>, TestClientError> {
        let clock = Arc::new(SystemClock);
        let storage = Arc::new(MemoryMessageStorage::new(clock.clone()));
        let sharding = Sharding::standalone(config, storage).clock(clock).start().await?;
        sharding.entity::<E>().options(options).register()?;
        Ok(TestClient { sharding, entity: PhantomData })
    }

    /// The configuration [`new`](TestClient::new) uses: the defaults, with persisted requests
    /// and replies polled every 10 ms.
    pub fn config() -> ShardingConfig {
        ShardingConfig {
            entity_message_poll_interval: Duration::from_millis(10),
            entity_reply_poll_interval: Duration::from_millis(10),
            ..ShardingConfig::default()
        }
    }

    /// A client of the entity `entity_id`.
    pub fn client(&self, entity_id: &str) -> EntityClient<E> {
        self.sharding.client::<E>(entity_id)
    }

    /// The durable state of the entity `entity_id` as stored, decoded as `S`, with its
    /// revision; `None` when it has no row (see `EntityClient::stored_state`).
    ///
    /// # Errors
    ///
    /// The storage failed, or the row does not decode as `S`.
    pub async fn state<S: serde::de::DeserializeOwned>(
        &self,
        entity_id: &str,
    ) -> Result<Option<(S, u64)>, cluster_core::ClusterError> {
        self.client(entity_id).stored_state().await
    }

    /// The number of entity instances alive.
    pub fn active_entity_count(&self) -> usize {
        self.sharding.active_entity_count()
    }

    /// Stops every instance (running their `on_stop`) and the runtime.
    pub async fn shutdown(self) {
        self.sharding.shutdown().await;
    }
}
