//! The settings of the SQLite storages: [`SqliteOptions`], and the commit durability it
//! chooses, [`Synchronous`].

use std::num::NonZeroUsize;
use std::time::Duration;

use crate::options::{SqlStorageOptions, ValueBytesMax};
use crate::row::ValueLimit;

const COMMAND_QUEUE_LEN_MAX_DEFAULT: NonZeroUsize = NonZeroUsize::new(1024).unwrap();
const GROUP_COMMIT_LEN_MAX_DEFAULT: NonZeroUsize = NonZeroUsize::new(256).unwrap();
const TRANSACTIONS_OPEN_MAX_DEFAULT: NonZeroUsize = NonZeroUsize::new(16).unwrap();
const CHECKPOINT_INTERVAL_DEFAULT: Duration = Duration::from_millis(25);
/// The longest string SQLite stores (`SQLITE_MAX_LENGTH`, as the bundled library is built).
const SQLITE_VALUE_BYTES_MAX: ValueBytesMax = ValueBytesMax::column(1_000_000_000);

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

    /// The limit of stored values: `storage.value_bytes_max`, capped by the longest string
    /// SQLite stores.
    pub(crate) fn value_limit(&self) -> ValueLimit {
        let option = self.storage.value_bytes_max;
        ValueLimit::capped(option, "SQLite's longest string", SQLITE_VALUE_BYTES_MAX)
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
