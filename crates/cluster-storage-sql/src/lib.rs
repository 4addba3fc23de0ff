//! SQL implementations of the storage contracts of `cluster-core`:
//! [`MessageStorage`](cluster_core::storage::MessageStorage),
//! [`RunnerStorage`](cluster_core::storage::RunnerStorage) and
//! [`QueueStorage`](cluster_core::queue_storage::QueueStorage) for PostgreSQL, MySQL and SQLite.
//!
//! Each database is a module behind the cargo feature of the same name (`sqlite` is the
//! default), with the same file set: `message_storage.rs`, `runner_storage.rs`, `shard_lock.rs`,
//! `queue_storage.rs` and `queries.rs`. Their public types are prefixed `Pg*`,
//! `MySql*` and `Sqlite*`.
//!
//! A handler that runs in a storage transaction (a `WITH_TRANSACTION` request, a transactional
//! workflow activity) reaches it, typed, in one call: `PgTransactionGuard::of(context)`,
//! `MySqlTransactionGuard::of(context)` or `SqliteTransactionGuard::of(context)`
//! (see [`cluster_core::transaction`]).
//!
//! The queue stores keep durable queue items in the reference's persisted-queue table
//! (`effect_queue` by default, [`QueueTable`]), with its columns and migration history, so that
//! TypeScript and Rust workers share one queue.
//!
//! The tables, columns, migration-history tables and lock keys are the reference's (effect
//! 4.1.0, `SqlMessageStorage.ts` and `SqlRunnerStorage.ts`), so a database can be shared with
//! TypeScript runners. The only additions, kept out of the reference's histories, are the
//! claim's index on PostgreSQL (see [`SqlStorageOptions::extra_indexes`]), byte-wise
//! collations of MySQL's key columns, and a table of ours per prefix for durable entity state
//! (`<prefix>_entity_state`, see [`cluster_core::entity_state`]), which TypeScript runners
//! neither read nor write. All backends store and read rows through the same mapping (`row`),
//! so they agree on every column.

// The helpers the backends share are unused when no backend is compiled in.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code, unused_imports)
)]

pub mod options;

#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod batch;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod lock;
pub mod queue;
pub(crate) mod row;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod save;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod tls;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use options::{LockMode, SqlStorageOptions, TablePrefix, ValueBytesMax};
#[cfg(feature = "postgres")]
pub use postgres::{PgMessageStorage, PgQueueStorage, PgRunnerStorage, PgTransactionGuard};
pub use queue::QueueTable;
#[cfg(feature = "sqlite")]
pub use sqlite::{
    SqliteMessageStorage, SqliteOptions, SqliteQueueStorage, SqliteRunnerStorage,
    SqliteTransactionGuard, Synchronous,
};
