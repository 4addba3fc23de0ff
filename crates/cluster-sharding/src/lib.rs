//! The sharding runtime.
//!
//! Application code defines entities ([`Entity`], one [`Handler`] per [`Rpc`] request type),
//! registers them on a [`Sharding`] runtime and calls them through typed [`EntityClient`]s:
//!
//! ```
//! use std::sync::Arc;
//!
//! use cluster_core::{ShardingConfig, SystemClock};
//! use cluster_sharding::{
//!     Entity, EntityContext, EntityOptions, Handler, Never, Protocol, RequestContext, Rpc,
//!     Sharding,
//! };
//! use serde::{Deserialize, Serialize};
//!
//! /// The entity: one counter per entity id, created on its first request.
//! struct Counter {
//!     value: u64,
//! }
//!
//! /// A request of the counter's protocol.
//! #[derive(Serialize, Deserialize)]
//! struct Increment {
//!     by: u64,
//! }
//!
//!
//! impl Rpc for Increment {
//!     const TAG: &'static str = "Increment";
//!     type Success = u64;
//!     type Error = Never;
//! }
//!
//! impl Entity for Counter {
//!     const TYPE: &'static str = "Counter";
//!
//!     async fn create(_context: &EntityContext) -> Counter {
//!         Counter { value: 0 }
//!     }
//!
//!     fn protocol(protocol: &mut Protocol<Counter>) {
//!         protocol.handle::<Increment>();
//!     }
//! }
//!
//! impl Handler<Increment> for Counter {
//!     async fn handle(&mut self, _: &RequestContext, request: Increment) -> Result<u64, Never> {
//!         self.value += request.by;
//!         Ok(self.value)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let sharding = Sharding::new(ShardingConfig::default(), Arc::new(SystemClock))?;
//! sharding.register::<Counter>(EntityOptions::default())?;
//!
//! let counter = sharding.client::<Counter>("user-42");
//! assert_eq!(counter.send(Increment { by: 1 }).await?, 1);
//! assert_eq!(counter.send(Increment { by: 2 }).await?, 3);
//! // Another id is another instance.
//! assert_eq!(sharding.client::<Counter>("user-7").send(Increment { by: 5 }).await?, 5);
//!
//! sharding.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! The requests above are volatile: they live in memory only. A request type with
//! [`Rpc::PERSISTED`] is saved to a message storage first and delivered at least once, answered
//! exactly once per [`Rpc::primary_key`]; see [`SingleRunner::sqlite`] for one process on a
//! SQLite file and [`Sharding::join`] for several runners on one database.
//!
//! Status: the single-runner core is here: entity managers (mailboxes, idle reaping, the
//! residency cap, panic restarts, a graceful drain at shutdown), typed calls and streams
//! (acknowledgement backpressure) interrupted by drop, and persisted delivery through a
//! `MessageStorage` ([`Sharding::with_storage`]: save first with primary-key dedup, the storage
//! read loop, stored final replies and chunks, durable interrupts and acknowledgements, streams
//! that resume after a restart, a restart picks up what was left), a runner holding every
//! shard's lock ([`Sharding::with_storages`], `SingleRunner::sqlite`), and a client-only mode
//! ([`Sharding::client_only`]), resident-first reads at the residency cap, and
//! [`Rpc::WITH_TRANSACTION`] handlers whose writes commit with their final reply; a persisted
//! request that is uninterruptible on the server runs again when interrupted, and keep-alive
//! ([`RequestContext::keep_alive`]), and [`SharedHandler`]s that run concurrently up to
//! [`EntityOptions::concurrency`]. Several runners share a storage with [`Sharding::join`]:
//! membership and the hash-ring assignment, shard locks with fencing of final replies, the
//! shutdown handoff, singletons ([`Sharding::register_singleton`]) and volatile requests to
//! other runners through a transport ([`Sharding::join_with_transport`]), and cluster-wide
//! cron jobs ([`Sharding::register_cron`]).

mod client;
mod cluster;
mod cron;
mod entity;
mod interrupt;
mod keep_alive;
mod manager;
pub mod metrics;
mod persisted;
mod queue_entity;
mod remote;
mod rpc;
mod sharding;
mod single_runner;
mod singleton;
mod time;

pub use client::{ChunkStream, EntityClient};
pub use cluster_core::Never;
pub use cron::{CronContext, CronError, CronOptions};
pub use entity::{
    CHUNK_BYTES_MAX, CHUNK_ITEMS_MAX, ChunkError, Chunks, DEFAULT_ON_STOP_TIMEOUT, Entity,
    EntityContext, EntityOptions, ForkedHandler, ForkedStreamHandler, Handler, Protocol,
    RequestContext, SharedHandler, StreamHandler, TransactionSlot, lock_backend,
};
pub use queue_entity::{
    Accepts, AcceptsStream, BehaviourError, QueueEntity, QueueProtocol, QueueShared, Queued,
    QueuedRequest, Replier, RequestQueue,
};
pub use rpc::{CallError, Rpc, StreamRpc, Uninterruptible};
pub use sharding::{RegisterError, RegistrationEvent, Sharding, seed_provisional_machine_ids};
#[cfg(feature = "sqlite")]
pub use single_runner::SingleRunner;
pub use single_runner::StartError;
pub use singleton::{SingletonContext, SingletonOptions};
