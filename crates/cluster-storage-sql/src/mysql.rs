//! The MySQL (and MariaDB) backend: [`MySqlMessageStorage`] and [`MySqlRunnerStorage`] on a
//! `mysql_async` pool, with the reference's tables, migrations and lock names, so a database
//! can be shared with TypeScript runners (`effect/src/cluster/SqlRunnerStorage.ts`,
//! `effect/src/cluster/MessageStorage.ts`).
//!
//! - `queries`: every SQL text (DDL and statements), built once per table prefix.
//! - `message_storage`: mailboxes and replies on the pool.
//! - `runner_storage`: the runner registry on the pool, and the deadlines of lock operations.
//! - `shard_lock`: the reserved lock session (advisory `GET_LOCK` or lease rows), rebuilt after
//!   failures.
//! - `queue_storage`: the persisted queue on the pool, in the reference's `effect_queue` table.
//!
//! What they share has files of its own:
//!
//! - `connection`: the options of a URL ([`opts`]), the pool ([`pool`]), and closing a
//!   connection without waiting for an unresponsive server.
//! - `tls`: the URL's `ssl-mode` and `ssl-ca`, applied to `mysql_async`'s rustls support
//!   (feature `tls`).
//! - `classify`: driver error classification.
//! - `columns`: reading columns without panicking, and checking that a value fits its column.
//! - `migrate`: effect's SQL migrator (`Migrator.ts`, MySQL dialect) guarded by `GET_LOCK`.
//!
//! MariaDB notes: `RELEASE_ALL_LOCKS()` exists from MariaDB 10.5 (MySQL 5.7), and
//! `IS_USED_LOCK` reports the holder's connection id.
//!
//! The reference's text columns take the database's default collation, which ignores case and
//! accents; the migrations here also declare the columns compared for identity with a
//! byte-wise collation (`queries::KEY_COLLATIONS`), outside the reference's history.

mod classify;
mod columns;
mod connection;
mod message_storage;
mod migrate;
mod queries;
mod queue_storage;
mod runner_storage;
mod shard_lock;
mod tls;

pub use connection::{CONNECT_TIMEOUT, POOL_SIZE_DEFAULT, opts, pool};
pub use message_storage::{MySqlMessageStorage, MySqlTransactionGuard};
pub use migrate::{migrate_messages, migrate_runners};
pub use queue_storage::MySqlQueueStorage;
pub use runner_storage::MySqlRunnerStorage;
