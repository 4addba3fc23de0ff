//! The SQLite backend: [`SqliteMessageStorage`] and [`SqliteRunnerStorage`] on one database
//! file, the embedded default.
//!
//! # Why it is shaped like this
//!
//! `rusqlite` blocks, so every connection lives on its own OS thread (`worker`) fed by a bounded
//! channel of a closed `Command` enum, as sqlx-sqlite's worker is. The
//! async methods only send a command and await its oneshot reply: nothing blocks the tokio
//! executor, and a worker that dies turns into [`StorageErrorKind::Unavailable`] errors, never a
//! hang.
//!
//! - The message storage and the runner storage each open their own worker (and connection) on
//!   the file; SQLite's file locking keeps them consistent, as it keeps several processes on one
//!   file consistent. Every multi-statement write runs in a `BEGIN IMMEDIATE` transaction so that
//!   a read followed by a write never fails on a lock upgrade, and the busy timeout absorbs short
//!   contention.
//! - The message worker groups queued writes (saved requests, acknowledgements, interrupts,
//!   replies, and claims of unprocessed messages) into one transaction, so under
//!   `synchronous=FULL` a burst of concurrent writes costs one fsync (group commit).
//!   When a write of the batch fails, the batch runs again with each write under
//!   its own savepoint, so one failing write fails only its own caller.
//! - A user transaction ([`MessageStorage::begin_transaction`]) spans await points, so it gets a
//!   connection of its own from a small pool of transaction workers; it never captures the shared
//!   worker.
//! - Shard locks are lease rows (`<prefix>_locks`); SQLite has no advisory locks, so
//!   [`SqlStorageOptions::lock_mode`] is ignored.
//!
//! The tables, columns, migration ids and SQL are the reference's SQLite ones
//! (`effect/src/cluster/SqlRunnerStorage.ts`, `effect/src/cluster/SqlMessageStorage.ts`), so a file
//! can be shared with a TypeScript runner. Two differences, both invisible in the schema: lists of
//! ids and shards are passed as one JSON array parameter (`json_each`) instead of literals spliced
//! into the SQL, and ids are read as integers (the reference's `CAST(id AS TEXT)` only works around
//! JavaScript number rounding).
//!
//! # Files
//!
//! The files form layers: each one imports only the ones listed before it.
//!
//! - `options`: [`SqliteOptions`] and [`Synchronous`].
//! - `queries`: the SQL texts, the migrations, and the helpers that run transactions, bind lists
//!   and read columns.
//! - `checkpointer`: the background checkpoints of the message worker's database.
//! - `state`: what a worker thread owns and hands to the operations, and how driver errors are
//!   classified.
//! - `message_ops`, `runner_ops`, `lock_ops`, `queue_ops`: the worker side of each storage.
//!   They hold the operations a `Command` carries and the blocking code that runs them.
//! - `worker`: the thread, the closed `Command` enum, and group commit.
//!   It dispatches each command to its `*_ops` module.
//! - `message_storage`, `runner_storage`, `shard_lock`, `queue_storage`: the async side.
//!   Each validates its input, sends a `Command` to its worker and decodes the reply.
//!
//! [`MessageStorage::begin_transaction`]: cluster_core::storage::MessageStorage::begin_transaction
//! [`StorageErrorKind::Unavailable`]: cluster_core::error::StorageErrorKind::Unavailable
//! [`SqlStorageOptions::lock_mode`]: crate::SqlStorageOptions::lock_mode

mod checkpointer;
mod lock_ops;
mod message_ops;
mod message_storage;
mod options;
mod queries;
mod queue_ops;
mod queue_storage;
mod runner_ops;
mod runner_storage;
mod shard_lock;
mod state;
mod worker;

pub use message_storage::{SqliteMessageStorage, SqliteTransactionGuard, SqliteTransactionHandle};
pub use options::{SqliteOptions, Synchronous};
pub use queue_storage::SqliteQueueStorage;
pub use runner_storage::SqliteRunnerStorage;
