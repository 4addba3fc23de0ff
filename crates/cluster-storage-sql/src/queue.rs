//! What the SQL queue stores share: the table's name ([`QueueTable`]), the reference's limits,
//! and the claim locks.
//!
//! The table, its columns, indexes and migration history are those of the reference's SQL store
//! (`makeStoreSql` and `sqlMigrations` in `effect/src/persistence/PersistedQueue.ts`), so a
//! TypeScript worker and a Rust worker can take items of one queue from the same table.

use std::fmt::{self, Write as _};
use std::time::Duration;

use cluster_core::error::{ConfigError, StorageError, StorageErrorKind};

use crate::options::check_identifier;

/// The longest table name: `idx_<table>_update`, the longest derived name, must fit the 63
/// bytes of a PostgreSQL identifier and the 64 characters of a MySQL index name.
pub const QUEUE_TABLE_LEN_MAX: usize = 48;

/// `id VARCHAR(255)` and `queue_name VARCHAR(255)` (after migration `0002_upgrade_schema`).
#[cfg(feature = "mysql")]
pub(crate) const NAME_LEN_MAX: usize = 255;

/// How many rows one cleanup statement deletes (the reference's `sqlCleanupBatchSize`).
pub(crate) const CLEANUP_BATCH_LEN: i64 = 1000;

/// The validated name of a queue table: an ASCII letter or `_`, then letters, digits or `_`, at
/// most [`QUEUE_TABLE_LEN_MAX`] characters; `effect_queue` by default (the reference's
/// `tableName`). Its migration history is `<table>_migrations`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueTable(String);

impl QueueTable {
    /// `name`, if it is a safe identifier.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for `queue_table` saying what is wrong with `name`.
    pub fn new(name: &str) -> Result<QueueTable, ConfigError> {
        check_identifier("queue_table", "table name", name, QUEUE_TABLE_LEN_MAX)?;
        Ok(QueueTable(name.to_owned()))
    }

    /// The table name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The migration history table, `<table>_migrations`.
    pub fn history(&self) -> String {
        format!("{}_migrations", self.0)
    }

    /// The index `idx_<table>_<suffix>`.
    pub(crate) fn index(&self, suffix: &str) -> String {
        format!("idx_{}_{suffix}", self.0)
    }
}

impl Default for QueueTable {
    /// The reference's table, `effect_queue`.
    fn default() -> QueueTable {
        QueueTable("effect_queue".to_owned())
    }
}

impl fmt::Display for QueueTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A fresh claim lock: a random UUID v4, as the reference's `SecureRandom.uuidV4` (PostgreSQL's
/// `acquired_by` column is a `UUID`).
pub(crate) fn new_lock() -> Result<String, StorageError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|error| {
        StorageError::new(
            StorageErrorKind::Unavailable,
            format!("no randomness for a queue claim lock: {error}"),
        )
    })?;
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let mut lock = String::with_capacity(36);
    for (index, byte) in bytes.iter().enumerate() {
        if matches!(index, 4 | 6 | 8 | 10) {
            lock.push('-');
        }
        let _ = write!(lock, "{byte:02x}");
    }
    Ok(lock)
}

/// `duration` in whole seconds, rounded up, as the reference's SQL store counts lock
/// expirations and retry delays.
pub(crate) fn whole_seconds(duration: Duration) -> i64 {
    let seconds = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    i64::try_from(seconds).unwrap_or(i64::MAX)
}

/// A value longer than its `VARCHAR(255)` column is refused before it reaches the database.
#[cfg(feature = "mysql")]
pub(crate) fn check_name(column: &str, value: &str) -> Result<(), StorageError> {
    if value.chars().count() <= NAME_LEN_MAX {
        return Ok(());
    }
    Err(StorageError::new(
        StorageErrorKind::InvalidInput,
        format!("queue {column} holds at most {NAME_LEN_MAX} characters"),
    ))
}

/// An attempt count read from a row, refused when negative.
pub(crate) fn attempts(value: i64) -> Result<u32, cluster_core::DecodeError> {
    u32::try_from(value).map_err(|_| {
        cluster_core::DecodeError::new("queue row", format!("attempts {value} is not a count"))
    })
}

#[cfg(test)]
mod tests;
