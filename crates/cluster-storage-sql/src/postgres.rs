//! The PostgreSQL backend: [`PgMessageStorage`] and [`PgRunnerStorage`] on a `deadpool-postgres`
//! pool, with the reference's tables, migration histories and advisory lock keys, so that Rust
//! and TypeScript runners can share one database (`effect/src/cluster/SqlRunnerStorage.ts`,
//! `effect/src/cluster/SqlMessageStorage.ts`).
//!
//! - `message_storage`: mailboxes and replies on the pool; claims with one `UPDATE … FROM
//!   (SELECT … FOR UPDATE)` statement, dedup with `INSERT … ON CONFLICT (message_id) DO NOTHING`.
//! - `runner_storage`: the runner registry on the pool, shard locks delegated to `shard_lock`.
//! - `shard_lock`: the reserved lock session (advisory locks or lease rows), rebuilt after a
//!   failure or a deadline.
//! - `queue_storage`: the persisted queue on the pool, in the reference's `effect_queue` table.
//! - `queries`: every SQL text and the migrations, built once per storage from the validated
//!   [`TablePrefix`](crate::TablePrefix); user values are always bound as parameters.
//! - `connection`: the configuration of a URL ([`PgConfig`]), the pool ([`pool`]), statements
//!   and migrations on a pooled connection.
//! - `tls`: the URL's `sslmode` and `sslrootcert`, read as libpq reads them, and the rustls
//!   connector (feature `tls`) of the pool and the lock session.
//! - `classify`: how driver and pool errors become `StorageError`s.
//!
//! Without the feature `tls`, connections are plain TCP, and a URL that requires TLS is
//! refused.

mod classify;
mod connection;
mod message_storage;
mod queries;
mod queue_storage;
mod runner_storage;
mod shard_lock;
mod tls;

pub use connection::{
    CONNECT_TIMEOUT, POOL_SIZE_DEFAULT, POOL_WAIT_TIMEOUT, PgConfig, parse_config, pool,
};
pub use message_storage::{PgMessageStorage, PgTransaction, PgTransactionGuard};
pub use queue_storage::PgQueueStorage;
pub use runner_storage::PgRunnerStorage;
