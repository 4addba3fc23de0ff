//! Values in and out of columns: [`Columns`] reads a row without panicking, and the checks say
//! whether a value fits its column before it is sent.

use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use mysql_async::{Row, Value};

use super::queries;
use crate::options::ValueBytesMax;
use crate::row::ValueLimit;

/// What a `TEXT` column (the messages' payload and headers, the replies' payload) holds.
const TEXT_VALUE_BYTES_MAX: ValueBytesMax = ValueBytesMax::column(queries::TEXT_BYTES_MAX);
/// What the queue's `element` holds: its `MEDIUMTEXT` column (after migration
/// `0002_upgrade_schema`) holds 16,777,215 bytes, but a statement or a row must also fit the
/// server's `max_allowed_packet`, 16 MiB by default on MariaDB. An element within 64 KiB of it
/// cannot be stored (`packet out of order`) or, once stored with a long failure, read back
/// (`packet too large`): such a row would fail every claim of its queue. 64 KiB leaves room for
/// the rest of the row (id, queue name, a failure of the workers' 4,096 characters).
const QUEUE_ELEMENT_BYTES_MAX: ValueBytesMax = ValueBytesMax::column(16 * 1024 * 1024 - 64 * 1024);

/// The limit of the message storage's values: `option`, capped by their `TEXT` columns.
pub(crate) fn text_limit(option: ValueBytesMax) -> ValueLimit {
    ValueLimit::capped(option, "MySQL's TEXT column", TEXT_VALUE_BYTES_MAX)
}

/// The limit of entity states: `option`, capped as the queue's elements are (their
/// `MEDIUMTEXT` column holds more than a row within MariaDB's default `max_allowed_packet`).
pub(crate) fn state_limit(option: ValueBytesMax) -> ValueLimit {
    let row = "a MySQL entity state row within the default max_allowed_packet (16 MiB)";
    ValueLimit::capped(option, row, QUEUE_ELEMENT_BYTES_MAX)
}

/// The limit of the queue's elements: `option`, capped by what a row holds within MariaDB's
/// default `max_allowed_packet`.
pub(crate) fn queue_element_limit(option: ValueBytesMax) -> ValueLimit {
    let row = "a MySQL queue row within the default max_allowed_packet (16 MiB)";
    ValueLimit::capped(option, row, QUEUE_ELEMENT_BYTES_MAX)
}

/// A stored value that cannot be read as what it should be.
fn bad_column(what: &'static str, value: &Value) -> DecodeError {
    DecodeError::new(what, format!("unexpected column value {value:?}"))
}

/// The columns of one row, taken left to right, converted without panicking.
pub(crate) struct Columns(std::vec::IntoIter<Value>);

impl Columns {
    pub(crate) fn new(row: Row) -> Columns {
        Columns(row.unwrap().into_iter())
    }

    fn next(&mut self) -> Result<Value, DecodeError> {
        self.0.next().ok_or_else(|| DecodeError::new("row", "missing column"))
    }

    /// An integer column (binary or text protocol).
    pub(crate) fn int(&mut self) -> Result<Option<i64>, DecodeError> {
        match self.next()? {
            Value::NULL => Ok(None),
            Value::Int(int) => Ok(Some(int)),
            Value::UInt(uint) => {
                i64::try_from(uint).map(Some).map_err(|_| bad_column("integer", &Value::UInt(uint)))
            }
            Value::Bytes(bytes) => std::str::from_utf8(&bytes)
                .ok()
                .and_then(|text| text.parse().ok())
                .map(Some)
                .ok_or_else(|| bad_column("integer", &Value::Bytes(bytes))),
            other => Err(bad_column("integer", &other)),
        }
    }

    /// An `INT` column.
    pub(crate) fn int32(&mut self) -> Result<Option<i32>, DecodeError> {
        match self.int()? {
            None => Ok(None),
            Some(int) => i32::try_from(int)
                .map(Some)
                .map_err(|_| DecodeError::new("row", format!("{int} is not an INT"))),
        }
    }

    /// A `BOOLEAN` (`TINYINT`) column.
    pub(crate) fn boolean(&mut self) -> Result<Option<bool>, DecodeError> {
        Ok(self.int()?.map(|int| int != 0))
    }

    /// A text column; bytes that are not UTF-8 are an error, never silently replaced.
    pub(crate) fn text(&mut self) -> Result<Option<String>, DecodeError> {
        match self.next()? {
            Value::NULL => Ok(None),
            Value::Bytes(bytes) => String::from_utf8(bytes)
                .map(Some)
                .map_err(|error| DecodeError::new("text column", error.to_string())),
            other => Err(bad_column("text", &other)),
        }
    }
}

/// `value` fits a `VARCHAR(len_max)` column (characters, as MySQL counts them).
pub(crate) fn check_chars(column: &str, value: &str, len_max: usize) -> Result<(), StorageError> {
    // Bytes bound characters from above, so most values need no count.
    if value.len() <= len_max {
        return Ok(());
    }
    let len = value.chars().count();
    if len <= len_max {
        return Ok(());
    }
    Err(StorageError::new(
        StorageErrorKind::InvalidInput,
        format!("{column} holds at most {len_max} characters, got {len}"),
    ))
}

/// `value` fits a `TEXT` column.
pub(crate) fn check_bytes(column: &str, value: &str) -> Result<(), StorageError> {
    if value.len() <= queries::TEXT_BYTES_MAX {
        return Ok(());
    }
    Err(StorageError::new(
        StorageErrorKind::InvalidInput,
        format!("{column} holds at most {} bytes, got {}", queries::TEXT_BYTES_MAX, value.len()),
    ))
}
