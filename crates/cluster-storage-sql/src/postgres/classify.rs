//! How the PostgreSQL driver's errors become [`StorageError`]s: by SQLSTATE class for a server
//! error, [`Unavailable`](StorageErrorKind::Unavailable) for a lost or unreachable connection,
//! [`Malformed`](StorageErrorKind::Malformed) for a column that cannot be read.

use std::error::Error as StdError;

use cluster_core::error::{StorageError, StorageErrorKind};
use deadpool_postgres::PoolError;

/// A driver error as a [`StorageError`], classified.
pub(crate) fn driver_error(what: &str, error: tokio_postgres::Error) -> StorageError {
    let kind = classify(&error);
    StorageError::with_source(kind, format!("{what} failed"), error)
}

/// A failure to check a connection out of the pool, classified.
pub(crate) fn pool_error(what: &str, error: PoolError) -> StorageError {
    let message = format!("{what}: no connection");
    let kind = match error {
        // The driver's error is the cause; the pool's wrapper adds only noise to the text.
        PoolError::Backend(driver) => {
            return StorageError::with_source(classify(&driver), message, driver);
        }
        PoolError::Timeout(_) => StorageErrorKind::Timeout,
        PoolError::Closed | PoolError::PostCreateHook(_) => StorageErrorKind::Unavailable,
        PoolError::NoRuntimeSpecified => StorageErrorKind::Other,
    };
    StorageError::with_source(kind, message, error)
}

/// The kind of a driver error: SQLSTATE classes for server errors, [`Unavailable`] for a lost
/// or unreachable connection.
///
/// [`Unavailable`]: StorageErrorKind::Unavailable
fn classify(error: &tokio_postgres::Error) -> StorageErrorKind {
    if let Some(db_error) = error.as_db_error() {
        return classify_sqlstate(db_error.code().code());
    }
    if error.is_closed() || has_io_source(error) {
        return StorageErrorKind::Unavailable;
    }
    StorageErrorKind::Other
}

fn classify_sqlstate(code: &str) -> StorageErrorKind {
    match code {
        // unique_violation
        "23505" => StorageErrorKind::Conflict,
        // query_canceled (statement_timeout), lock_not_available (lock_timeout)
        "57014" | "55P03" => StorageErrorKind::Timeout,
        // admin_shutdown (pg_terminate_backend), crash_shutdown, cannot_connect_now,
        // idle_session_timeout, too_many_connections
        "57P01" | "57P02" | "57P03" | "57P05" | "53300" => StorageErrorKind::Unavailable,
        // connection_exception
        code if code.starts_with("08") => StorageErrorKind::Unavailable,
        // data_exception (e.g. a value longer than its column), integrity constraints
        code if code.starts_with("22") || code.starts_with("23") => StorageErrorKind::InvalidInput,
        _ => StorageErrorKind::Other,
    }
}

fn has_io_source(error: &tokio_postgres::Error) -> bool {
    let mut source = error.source();
    while let Some(cause) = source {
        if cause.is::<std::io::Error>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// A column that cannot be read as its expected type: the table holds something no runner
/// wrote.
pub(crate) fn column_error(error: tokio_postgres::Error) -> StorageError {
    StorageError::with_source(StorageErrorKind::Malformed, "unreadable column", error)
}
