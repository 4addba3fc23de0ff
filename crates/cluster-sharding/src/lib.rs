//! The sharding runtime.
//!
//! Application code defines entities ([`Entity`], one [`Handler`] per [`Rpc`] request type),
//! registers them on a [`Sharding`] runtime and calls them through typed [`EntityClient`]s:
//!
//! ```
//! use cluster_core::ShardingConfig;
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
//! let sharding = Sharding::builder(ShardingConfig::default()).start().await?;
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
//! exactly once per [`Rpc::primary_key`].
//!
//! [`Sharding::builder`] puts a process together from its parts; what it is given decides what
//! the process is (see [`ShardingBuilder`]):
//!
//! - nothing: volatile requests to the entities of this process;
//! - a message storage: persisted delivery, one runner owning every shard;
//! - a message storage and a runner storage: a member of a cluster (membership and the
//!   hash-ring assignment, shard locks with fencing of final replies, the shutdown handoff,
//!   singletons and cron jobs), or with [`ShardingBuilder::single_runner`] the only runner;
//! - a transport besides: volatile requests to the entities of other runners;
//! - [`ShardingBuilder::client_only`]: a process that hosts no entity.
//!
//! This crate depends on no storage backend and no transport. Applications depend on the
//! `durable-cluster` crate, which re-exports it with the SQL storages, the transport,
//! `SingleRunner::sqlite` (one process on a SQLite file) and `Runner` (a runner process from
//! the environment).

mod builder;
mod client;
mod cron;
mod entity;
mod error;
mod interrupt;
mod keep_alive;
mod manager;
mod member;
pub mod metrics;
mod persisted;
mod queue_entity;
mod remote;
mod rpc;
mod sharding;
mod single_runner;
mod singleton;
mod time;

pub use builder::ShardingBuilder;
pub use client::{ChunkStream, EntityClient};
pub use cluster_core::Never;
pub use cron::{CronContext, CronError, CronOptions};
pub use entity::{
    CHUNK_BYTES_MAX, CHUNK_ITEMS_MAX, ChunkError, Chunks, DEFAULT_ON_STOP_TIMEOUT, Entity,
    EntityContext, EntityOptions, ForkedHandler, ForkedStreamHandler, Handler, Protocol,
    RequestContext, SharedHandler, StreamHandler, TransactionSlot,
};
pub use error::{RegisterError, StartError};
pub use queue_entity::{
    Accepts, AcceptsStream, BehaviourError, QueueEntity, QueueProtocol, QueueShared, Queued,
    QueuedRequest, Replier, RequestQueue,
};
pub use rpc::{CallError, Rpc, StreamRpc, Uninterruptible};
pub use sharding::{RegistrationEvent, Sharding, seed_provisional_machine_ids};
pub use singleton::{SingletonContext, SingletonOptions};
