//! The sharding runtime.
//!
//! Application code defines entities ([`Entity`], one [`Handler`] per [`Rpc`] request type),
//! registers them on a [`Sharding`] runtime and calls them through typed [`EntityClient`]s:
//!
//! ```ignore
//! let sharding = Sharding::new(ShardingConfig::default(), Arc::new(SystemClock))?;
//! sharding.register::<Counter>(EntityOptions::default())?;
//! let counter = sharding.client::<Counter>("user-42");
//! let value = counter.send(Increment { by: 1 }).await?;
//! ```
//!
//! Status: the single-runner core is here (entity managers with mailboxes, idle reaping, the
//! residency cap and panic restarts; typed volatile calls with interruption by drop). Persisted
//! delivery through `MessageStorage`, the storage read loop, the SQLite `SingleRunner`, and the
//! multi-runner half (membership, shard locks, handoff, singletons, cron) are still to come.

mod client;
mod entity;
mod manager;
mod rpc;
mod sharding;

pub use client::EntityClient;
pub use entity::{Entity, EntityOptions, Handler, Protocol, RequestContext};
pub use rpc::{CallError, Rpc, Uninterruptible};
pub use sharding::{RegisterError, Sharding};
