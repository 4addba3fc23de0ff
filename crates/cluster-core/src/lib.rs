//! Pure vocabulary and contracts of the cluster.
//!
//! Everything here is deterministic and free of I/O: there is no runtime, no database driver, no
//! socket and no wall clock (except [`clock::SystemClock`], the one allow-listed reader).
//! Time enters as an argument (`now`), randomness as a seed, and every effect as a trait that
//! another crate implements.
//!
//! - Ids and addresses: [`ShardId`], [`EntityAddress`], [`RunnerAddress`], [`Runner`], ...
//! - [`hash`]: the entity-to-shard hash, bit-identical to the reference.
//! - [`HashRing`]: the weighted consistent hash ring that assigns shards to runners.
//! - [`Snowflake`] and [`SnowflakeGenerator`]: 64-bit ids that never go backwards.
//! - [`envelope`] (domain form) and [`encoded`] (the reference's JSON form) of envelopes, replies
//!   and exits.
//! - [`ShardingConfig`]: every option of the reference with its default, environment loading and
//!   validation.
//! - Contracts: [`storage::MessageStorage`], [`storage::RunnerStorage`],
//!   [`queue_storage::QueueStorage`], [`transport::Transport`], [`clock::Clock`].
//! - [`transaction`]: a handler's typed access to the storage transaction it runs in
//!   ([`transaction::TransactionGuard`]).
//! - [`backoff::Backoff`], the one type for the delays between retries.
//! - [`Never`], the error type of what cannot fail, and [`sync::lock`], the one way to take a
//!   mutex.
//! - Pure state machines: [`membership`] (registry observations to published assignments, with
//!   the join debounce) and [`ownership`] (assigned, acquired and releasing shards).

pub mod backoff;
pub mod clock;
pub mod config;
pub mod encoded;
pub mod entity_state;
pub mod envelope;
pub mod error;
pub mod future;
pub mod hash;
pub mod hash_ring;
pub mod ids;
pub mod inspect;
pub mod membership;
pub mod never;
pub mod ownership;
pub mod queue_storage;
pub mod reply_handlers;
pub mod retention;
pub mod snowflake;
pub mod storage;
pub mod sync;
pub mod transaction;
pub mod transport;

pub use clock::{Clock, SystemClock, Timestamp};
pub use config::ShardingConfig;
pub use envelope::{Envelope, Exit, RawJson, Reply};
pub use error::{ClusterError, ConfigError, DecodeError, ParseError, StorageError};
pub use hash_ring::HashRing;
pub use ids::{
    EntityAddress, EntityId, EntityType, MachineId, Runner, RunnerAddress, RunnerWeight,
    ShardGroup, ShardId, SingletonAddress, Tag,
};
pub use never::Never;
pub use snowflake::{SharedSnowflakeGenerator, Snowflake, SnowflakeGenerator};
