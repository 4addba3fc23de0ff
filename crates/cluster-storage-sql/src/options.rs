//! What every SQL backend is configured with: the table prefix, the shard lock settings,
//! whether the migrations may add to the reference's schema, and the size limit of stored values.

use std::fmt;
use std::time::Duration;

use cluster_core::error::ConfigError;
use cluster_core::{ShardGroup, ShardingConfig};

/// The longest table prefix. The longest derived name, `<prefix>_replies_request_lookup_idx`,
/// must fit PostgreSQL's 63-byte identifiers.
pub const TABLE_PREFIX_LEN_MAX: usize = 32;

/// A validated table prefix: an ASCII letter or `_`, then letters, digits or `_`, at most
/// [`TABLE_PREFIX_LEN_MAX`] characters. It is spliced into SQL as an identifier, so anything
/// else is refused: configuration can never inject SQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TablePrefix(String);

impl TablePrefix {
    /// `prefix`, if it is a safe identifier.
    pub fn new(prefix: &str) -> Result<TablePrefix, ConfigError> {
        check_identifier("table_prefix", "prefix", prefix, TABLE_PREFIX_LEN_MAX)?;
        Ok(TablePrefix(prefix.to_owned()))
    }

    /// The prefix text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `<prefix>_<name>`.
    pub fn table(&self, name: &str) -> String {
        format!("{}_{name}", self.0)
    }
}

/// Checks that `name` (the `noun` of configuration `key`) is a safe identifier of at most
/// `len_max` characters: an ASCII letter or `_`, then letters, digits or `_`.
pub(crate) fn check_identifier(
    key: &str,
    noun: &str,
    name: &str,
    len_max: usize,
) -> Result<(), ConfigError> {
    let reject = |reason: String| Err(ConfigError::new(key, name, reason));
    let mut chars = name.chars();
    match chars.next() {
        None => return reject(format!("the {noun} is empty")),
        Some(first) if !(first.is_ascii_alphabetic() || first == '_') => {
            return reject(format!("the {noun} must start with an ASCII letter or `_`"));
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return reject(format!("the {noun} may only hold ASCII letters, digits and `_`"));
    }
    if name.len() > len_max {
        return reject(format!("the {noun} is longer than {len_max} characters"));
    }
    Ok(())
}

impl Default for TablePrefix {
    /// The reference's prefix, `cluster`.
    fn default() -> TablePrefix {
        TablePrefix("cluster".to_owned())
    }
}

impl fmt::Display for TablePrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The default of [`SqlStorageOptions::value_bytes_max`]: 16 MiB.
///
/// Generous for payloads and replies, while it bounds what one value costs a runner's memory
/// and a round trip to the database.
pub const VALUE_BYTES_MAX_DEFAULT: ValueBytesMax = ValueBytesMax(16 * 1024 * 1024);

/// The most bytes a stored value may have: a request's payload or headers, a reply's payload
/// (the exit's JSON, or a chunk's array of values), an entity's state, a queue element. At
/// least 1 and at most [`ValueBytesMax::LIMIT`] (1 GiB, about what PostgreSQL and SQLite hold
/// in one value).
///
/// The backends refuse a longer value before sending anything to the database, with
/// [`StorageErrorKind::InvalidInput`](cluster_core::error::StorageErrorKind::InvalidInput). Where
/// the database holds less, the limit is capped: on MySQL by the `TEXT` columns (65,535 bytes)
/// of the messages and replies, and for entity states and the queue's elements at 16,711,680
/// bytes (a `MEDIUMTEXT` row within the default `max_allowed_packet` of 16 MiB); on SQLite at
/// 1,000,000,000 bytes, its longest string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ValueBytesMax(usize);

impl ValueBytesMax {
    /// The largest limit accepted: 1 GiB.
    pub const LIMIT: usize = 1024 * 1024 * 1024;

    /// The smallest limit accepted: 1 KiB. The runtime stores small values of its own that
    /// must always fit, above all the `ReplyNotStored` defect that answers a request whose
    /// reply was refused; under a smaller limit that defect would be refused too, and the
    /// request would run again without end.
    pub const MIN: usize = 1024;

    /// `bytes`, if it is at least [`ValueBytesMax::MIN`] and at most [`ValueBytesMax::LIMIT`].
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for `value_bytes_max` saying what is wrong with `bytes`.
    pub fn new(bytes: usize) -> Result<ValueBytesMax, ConfigError> {
        let reject =
            |reason: String| Err(ConfigError::new("value_bytes_max", bytes.to_string(), reason));
        if bytes < ValueBytesMax::MIN {
            return reject(format!(
                "at least {} bytes (1 KiB): the runtime's own replies, such as the defect that \
                 says why a value was refused, must fit",
                ValueBytesMax::MIN
            ));
        }
        if bytes > ValueBytesMax::LIMIT {
            return reject(format!(
                "at most {} bytes (1 GiB): keep larger values elsewhere and store a reference",
                ValueBytesMax::LIMIT
            ));
        }
        Ok(ValueBytesMax(bytes))
    }

    /// What a column type holds, `bytes`, for the backends' constants: a `const` item that
    /// calls this fails to compile unless `bytes` is a valid limit.
    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    pub(crate) const fn column(bytes: usize) -> ValueBytesMax {
        assert!(
            bytes >= ValueBytesMax::MIN && bytes <= ValueBytesMax::LIMIT,
            "a column holds 1 KiB to 1 GiB"
        );
        ValueBytesMax(bytes)
    }

    /// Any positive `bytes`, below [`ValueBytesMax::MIN`] too: for unit tests of the check.
    #[cfg(test)]
    pub(crate) fn unchecked(bytes: usize) -> ValueBytesMax {
        ValueBytesMax(bytes)
    }

    /// The limit in bytes.
    pub fn get(self) -> usize {
        self.0
    }
}

impl Default for ValueBytesMax {
    /// [`VALUE_BYTES_MAX_DEFAULT`].
    fn default() -> ValueBytesMax {
        VALUE_BYTES_MAX_DEFAULT
    }
}

impl fmt::Display for ValueBytesMax {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes", self.0)
    }
}

/// How shard locks are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    /// Session advisory locks (PostgreSQL `pg_try_advisory_lock`, MySQL `GET_LOCK`) on one
    /// reserved connection; they live as long as the session. The default on PostgreSQL and
    /// MySQL. SQLite has none and always uses leases.
    Advisory,
    /// Rows in the `<prefix>_locks` table with an acquisition time; a lease older than the
    /// shard lock expiration can be taken over (`shardLockDisableAdvisory`).
    Lease,
}

/// The settings shared by the SQL backends.
#[derive(Clone, Debug)]
pub struct SqlStorageOptions {
    /// The table prefix (`cluster` by default).
    pub prefix: TablePrefix,
    /// How shard locks are held (ignored by SQLite, which always uses leases).
    pub lock_mode: LockMode,
    /// How long a lease lasts, how old a heartbeat may be, and the advisory lock session's idle
    /// timeout.
    pub shard_lock_expiration: Duration,
    /// The deadline of every lock operation: `min(refresh interval, expiration / 3)`.
    pub shard_lock_interval: Duration,
    /// All shard groups of the cluster, sorted: a group's index gives its advisory lock numbers.
    pub available_groups: Vec<ShardGroup>,
    /// Whether the migrations create the indexes this crate adds to the reference's schema
    /// (`true` by default). They are created when missing and never recorded in the reference's
    /// migration history. There is one, on PostgreSQL: `<prefix>_messages_unprocessed_idx`,
    /// which the claim walks; without it the claim goes through `<prefix>_messages_shard_idx`,
    /// where processed rows and dead versions pile up until vacuum, and is slower
    /// (`docs/storage.md`). MySQL and SQLite have none. With `false` no index is created, and an
    /// index created earlier is kept. (The entity state table, `<prefix>_entity_state`, is
    /// created either way: the storages' own statements need it.)
    pub extra_indexes: bool,
    /// The most bytes a stored value may have ([`VALUE_BYTES_MAX_DEFAULT`], 16 MiB, by
    /// default): a request's payload and headers, a reply's payload, an entity's state, a queue
    /// element. A longer one is refused before it reaches the database (see [`ValueBytesMax`]).
    pub value_bytes_max: ValueBytesMax,
}

impl SqlStorageOptions {
    /// The options of a runner configured with `config`, using `prefix`.
    pub fn from_config(config: &ShardingConfig, prefix: TablePrefix) -> SqlStorageOptions {
        let mut available_groups = config.available_shard_groups.clone();
        available_groups.sort();
        available_groups.dedup();
        SqlStorageOptions {
            prefix,
            lock_mode: if config.shard_lock_disable_advisory {
                LockMode::Lease
            } else {
                LockMode::Advisory
            },
            shard_lock_expiration: config.shard_lock_expiration,
            shard_lock_interval: config.shard_lock_interval(),
            available_groups,
            extra_indexes: true,
            value_bytes_max: VALUE_BYTES_MAX_DEFAULT,
        }
    }

    /// The index of `group` among the sorted available groups.
    pub fn group_index(&self, group: &ShardGroup) -> Option<u32> {
        let index = self.available_groups.binary_search(group).ok()?;
        u32::try_from(index).ok()
    }

    /// The shard lock expiration in whole seconds, rounded up (at least 1), as the reference
    /// uses it for heartbeats, leases and MySQL's `wait_timeout`.
    pub fn expiration_seconds(&self) -> u64 {
        let expiration = self.shard_lock_expiration;
        let seconds = expiration.as_secs() + u64::from(expiration.subsec_nanos() > 0);
        seconds.max(1)
    }
}

impl Default for SqlStorageOptions {
    fn default() -> SqlStorageOptions {
        SqlStorageOptions::from_config(&ShardingConfig::default(), TablePrefix::default())
    }
}

#[cfg(test)]
mod tests;
