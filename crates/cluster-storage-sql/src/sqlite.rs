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
//! [`MessageStorage::begin_transaction`]: cluster_core::storage::MessageStorage::begin_transaction
//! [`StorageErrorKind::Unavailable`]: cluster_core::error::StorageErrorKind::Unavailable

use std::num::NonZeroUsize;
use std::time::Duration;

use crate::options::SqlStorageOptions;

mod checkpointer;
mod message_storage;
mod queries;
mod queue_storage;
mod runner_storage;
mod shard_lock;
mod worker;

pub use message_storage::{SqliteMessageStorage, SqliteTransactionGuard, SqliteTransactionHandle};
pub use queue_storage::SqliteQueueStorage;
pub use runner_storage::SqliteRunnerStorage;

const COMMAND_QUEUE_LEN_MAX_DEFAULT: NonZeroUsize = NonZeroUsize::new(1024).unwrap();
const GROUP_COMMIT_LEN_MAX_DEFAULT: NonZeroUsize = NonZeroUsize::new(256).unwrap();
const TRANSACTIONS_OPEN_MAX_DEFAULT: NonZeroUsize = NonZeroUsize::new(16).unwrap();
const CHECKPOINT_INTERVAL_DEFAULT: Duration = Duration::from_millis(25);

/// How hard SQLite works to make a commit durable (`PRAGMA synchronous`), in WAL mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Synchronous {
    /// `FULL`: every commit is fsynced, so an acknowledged message survives a power loss. The
    /// default; group commit keeps it fast (one fsync per batch of saves).
    #[default]
    Full,
    /// `NORMAL`: the WAL is fsynced only at checkpoints. A commit survives a crash of the process
    /// but the last ones may be lost on a power loss or an OS crash. An explicit opt-in.
    Normal,
}

impl Synchronous {
    /// The pragma value.
    pub(crate) fn pragma_value(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// The settings of the SQLite storages.
#[derive(Clone, Debug)]
pub struct SqliteOptions {
    /// The table prefix and shard lock settings shared by the SQL backends (the lock mode is
    /// ignored: SQLite always uses lease rows).
    pub storage: SqlStorageOptions,
    /// Commit durability; [`Synchronous::Full`] by default.
    pub synchronous: Synchronous,
    /// How long a statement waits for another connection's write lock before it fails with
    /// [`StorageErrorKind::Timeout`](cluster_core::error::StorageErrorKind::Timeout).
    pub busy_timeout: Duration,
    /// How many commands may wait in a worker's channel; callers beyond it wait for room.
    pub command_queue_len_max: NonZeroUsize,
    /// The most saves one group commit transaction holds.
    pub group_commit_len_max: NonZeroUsize,
    /// The most user transactions open at once, each on its own connection; further
    /// `begin_transaction` calls wait for one to end.
    pub transactions_open_max: NonZeroUsize,
    /// How often, at most, a background connection checkpoints the write-ahead log of the
    /// message storage while it is written (25 ms by default): the message worker then spends
    /// its time committing, not copying pages into the database file, and its own automatic
    /// checkpoint only starts past 10,000 pages. `None` leaves checkpoints to the message
    /// worker at SQLite's default of 1,000 pages.
    pub checkpoint_interval: Option<Duration>,
}

impl SqliteOptions {
    /// The default settings with `storage`.
    pub fn new(storage: SqlStorageOptions) -> SqliteOptions {
        SqliteOptions { storage, ..SqliteOptions::default() }
    }
}

impl Default for SqliteOptions {
    fn default() -> SqliteOptions {
        SqliteOptions {
            storage: SqlStorageOptions::default(),
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            command_queue_len_max: COMMAND_QUEUE_LEN_MAX_DEFAULT,
            group_commit_len_max: GROUP_COMMIT_LEN_MAX_DEFAULT,
            transactions_open_max: TRANSACTIONS_OPEN_MAX_DEFAULT,
            checkpoint_interval: Some(CHECKPOINT_INTERVAL_DEFAULT),
        }
    }
}
