//! How the MySQL driver's errors become [`StorageError`]s: by server error code, or by the
//! driver's own error kind.

use cluster_core::error::{StorageError, StorageErrorKind};
use mysql_async::DriverError;

/// MySQL's duplicate key error.
pub(crate) const ER_DUP_ENTRY: u16 = 1062;
/// InnoDB rolled the transaction back to break a deadlock.
const ER_LOCK_DEADLOCK: u16 = 1213;

/// Whether `error` is InnoDB rolling the transaction back to break a deadlock: nothing of it
/// was applied, so running it again is safe.
pub(crate) fn is_deadlock(error: &StorageError) -> bool {
    let source = std::error::Error::source(error);
    matches!(
        source.and_then(|source| source.downcast_ref::<mysql_async::Error>()),
        Some(mysql_async::Error::Server(server)) if server.code == ER_LOCK_DEADLOCK
    )
}

/// A driver error as a [`StorageError`] of the right kind: duplicate keys are conflicts, lost
/// connections are unavailability, server-side timeouts are timeouts, values that do not fit
/// are invalid input.
pub(crate) fn storage_error(what: &str, error: mysql_async::Error) -> StorageError {
    let kind = match &error {
        mysql_async::Error::Io(_) => StorageErrorKind::Unavailable,
        mysql_async::Error::Driver(driver) => match driver {
            DriverError::ConnectionClosed
            | DriverError::PoolDisconnected
            | DriverError::PacketOutOfOrder
            | DriverError::UnexpectedPacket { .. } => StorageErrorKind::Unavailable,
            DriverError::StmtParamsNumberExceedsLimit { .. } | DriverError::PacketTooLarge => {
                StorageErrorKind::InvalidInput
            }
            _ => StorageErrorKind::Other,
        },
        mysql_async::Error::Server(server) => server_error_kind(server.code),
        mysql_async::Error::Url(_) => StorageErrorKind::InvalidInput,
        mysql_async::Error::Other(_) => StorageErrorKind::Other,
    };
    StorageError::with_source(kind, what, error)
}

fn server_error_kind(code: u16) -> StorageErrorKind {
    match code {
        // Duplicate entry / key, foreign key duplicates.
        1022 | 1062 | 1557 | 1586 => StorageErrorKind::Conflict,
        // Lock wait timeout; statement timeouts (MariaDB, MySQL).
        1205 | 1969 | 3024 => StorageErrorKind::Timeout,
        // Too many connections, shutdown in progress, aborted or killed connections,
        // interrupted query, read-only server.
        1040 | 1053 | 1077 | 1078 | 1079 | 1080 | 1152 | 1153 | 1154 | 1155 | 1156 | 1157
        | 1158 | 1159 | 1160 | 1161 | 1184 | 1290 | 1317 | 1836 | 1927 => {
            StorageErrorKind::Unavailable
        }
        // Out of range, too long, incorrect value.
        1264 | 1292 | 1366 | 1406 => StorageErrorKind::InvalidInput,
        _ => StorageErrorKind::Other,
    }
}
