//! The errors of starting a runtime ([`StartError`]) and of registering on it
//! ([`RegisterError`]).

use cluster_core::EntityType;
use cluster_core::error::{ConfigError, StorageError};

/// Why an entity type could not be registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// A type of that name is registered already.
    #[error("entity type {0} is already registered")]
    AlreadyRegistered(EntityType),
    /// The runner is shutting down.
    #[error("the runner is shutting down")]
    ShuttingDown,
    /// A singleton of that name is registered already.
    #[error("singleton '{0}' is already registered")]
    SingletonAlreadyRegistered(String),
    /// The entity type declared durable state (`Protocol::durable`), and the runtime has no
    /// message storage to keep it in.
    #[error(
        "entity type {0} keeps durable state, and this runtime has no message storage: start it \
         with Sharding::standalone, single_runner or member on SQLite, PostgreSQL, MySQL or \
         memory storage"
    )]
    NoStateStorage(EntityType),
    /// The entity type's options are out of bounds.
    #[error("invalid options for entity type {entity_type}: {error}")]
    InvalidOptions {
        /// The type being registered.
        entity_type: EntityType,
        /// The option at fault.
        #[source]
        error: ConfigError,
    },
}

/// Why a runtime did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A storage operation failed.
    #[error("storage error while starting: {0}")]
    Storage(#[from] StorageError),
    /// A runner needs an address (`runner_address` is `None`), or the process is a client.
    #[error("a runner needs a runner address")]
    NoRunnerAddress,
    /// A built-in entity or singleton could not be registered.
    #[error("could not register a built-in: {0}")]
    Register(#[source] RegisterError),
    /// Another live runner holds some of the shards.
    #[error("{held} of {total} shards are locked by another runner")]
    ShardsHeld {
        /// How many shards could not be locked.
        held: usize,
        /// How many shards the runner needs.
        total: usize,
    },
}
