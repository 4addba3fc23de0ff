//! The sharding runtime.
//!
//! Application code defines entities ([`Entity`], one [`Handler`] per [`Rpc`] request type),
//! registers them on a [`Sharding`] runtime and calls them through typed clients. The
//! [`entity`] macro writes all of that from one impl block:
//!
//! ```
//! use cluster_core::ShardingConfig;
//! use cluster_sharding::{EntityOptions, Never, Sharding, entity};
//! use serde::{Deserialize, Serialize};
//!
//! /// A request of the counter's protocol.
//! #[derive(Serialize, Deserialize)]
//! struct Increment {
//!     by: u64,
//! }
//!
//! /// The entity: one counter per entity id, created on its first request.
//! struct Counter {
//!     value: u64,
//! }
//!
//! #[entity]
//! impl Counter {
//!     async fn create() -> Self {
//!         Counter { value: 0 }
//!     }
//!
//!     #[rpc]
//!     async fn increment(&mut self, request: Increment) -> Result<u64, Never> {
//!         self.value += request.by;
//!         Ok(self.value)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let sharding = Sharding::volatile(ShardingConfig::default()).start().await?;
//! sharding.entity::<Counter>().register()?;
//!
//! let counters = Counter::client(&sharding);
//! assert_eq!(counters.increment("user-42", Increment { by: 1 }).await?, 1);
//! assert_eq!(counters.increment("user-42", Increment { by: 2 }).await?, 3);
//! // Another id is another instance.
//! assert_eq!(counters.increment("user-7", Increment { by: 5 }).await?, 5);
//!
//! sharding.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! The macro is a shorthand, not a second model: it writes `impl Rpc for Increment`,
//! `impl Handler<Increment> for Counter`, `impl Entity for Counter` (whose `protocol` declares
//! `Increment`) and the typed client `CounterClient`. Those can be written by hand, as the
//! [`Entity`] documentation shows. Either way, [`Sharding::client`] gives the client of one
//! entity ([`EntityClient`], whose `send` takes any request the entity handles).
//! [`Sharding::entity`] registers an entity type, its instances made by `create` or by a
//! factory that hands them dependencies.
//!
//! The requests above are volatile: they live in memory only. A request type with
//! [`Rpc::PERSISTED`] is saved to a message storage first and delivered at least once, answered
//! exactly once per [`Rpc::primary_key`].
//!
//! A process says what it is by the constructor it starts from (see [`ShardingBuilder`]):
//!
//! - [`Sharding::volatile`]: volatile requests to the entities of this process;
//! - [`Sharding::standalone`]: persisted delivery, one runner owning every shard;
//! - [`Sharding::single_runner`]: the only runner, holding every shard's lock;
//! - [`Sharding::member`]: a member of a cluster (membership and the hash-ring assignment,
//!   shard locks with fencing of final replies, the shutdown handoff, singletons and cron
//!   jobs), with a transport for volatile requests to the entities of other runners;
//! - [`Sharding::client_only`] and [`Sharding::cluster_client`]: a process that hosts no
//!   entity.
//!
//! This crate depends on no storage backend and no transport. Applications depend on the
//! `durable-cluster` crate, which re-exports it with the SQL storages, the transport,
//! `SingleRunner::sqlite` (one process on a SQLite file) and `Runner` (a runner process from
//! the environment).

mod api;
mod builder;
mod error;
mod metered;
pub mod metrics;
mod placement;
mod plumbing;
mod registration;
mod runtime;
mod services;
mod sharding;
mod time;
pub mod trace;

pub use api::client::{ChunkStream, EntityClient};
pub use api::entity::{
    CHUNK_BYTES_MAX, CHUNK_ITEMS_MAX, ChunkError, Chunks, DEFAULT_ON_STOP_TIMEOUT, Defects, Entity,
    EntityContext, EntityOptions, ForkedHandler, ForkedStreamHandler, Handler, Protocol,
    RequestContext, SharedHandler, StreamHandler, lock_backend,
};
pub use api::erased::{ErasedError, ErasedRpc, ErasedStream, ErasedStreamEnd, rpcs_of};
pub use api::queue_entity::{
    Accepts, AcceptsStream, BehaviourError, QueueEntity, QueueProtocol, QueueShared, Queued,
    QueuedRequest, Replier, RequestQueue,
};
pub use api::rpc::{CallError, Rpc, StreamRpc, Uninterruptible};
pub use builder::{ShardingBuilder, roles};
pub use cluster_core::Never;
/// Writes an entity from one impl block: its requests' `Rpc` implementations, its handlers, its
/// protocol and a typed client (see the `cluster-macros` crate).
#[cfg(feature = "macros")]
pub use cluster_macros::entity;
pub use error::{RegisterError, StartError};
pub use placement::health::RunnerHealth;
pub use placement::member::Readiness;
pub use plumbing::Plumbing;
pub use registration::{ByCreate, ByFactory, EntityRegistration};
pub use runtime::delivery::TransactionSlot;
pub use services::cron::{CronContext, CronError, CronOptions};
pub use services::singleton::{SingletonContext, SingletonOptions};
pub use sharding::{RegistrationEvent, Sharding, WeakSharding};

/// What the code that [`entity`] generates refers to; not part of the API. A crate that
/// re-exports this one whole (`pub use cluster_sharding::*`) re-exports it too, so that
/// `#[entity(crate = that_crate)]` finds it.
#[doc(hidden)]
pub mod __private {
    pub use cluster_core::{EntityId, ShardGroup, Timestamp};
    /// The request types that `#[rpc]` methods without a request get derive serde's traits
    /// through this path, so the user's crate needs no serde of its own for them.
    pub use serde;
}
