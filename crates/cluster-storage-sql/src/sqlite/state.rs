//! What the operations of a connection worker work with: the state its thread owns
//! ([`WorkerState`]), where a command's result goes ([`Responder`]), and how a driver error is
//! classified ([`classify`]).
//!
//! The worker hands its state to the `*_ops` modules, which run the operations.
//! This module sits below both, so that the operations never import the worker.

use cluster_core::error::{StorageError, StorageErrorKind};
use rusqlite::{Connection, ErrorCode};
use tokio::sync::oneshot;

use super::checkpointer::Checkpointer;
use super::queries::{self, Statements};

/// Where a worker sends the result of a command.
pub(super) type Responder<T> = oneshot::Sender<Result<T, StorageError>>;

/// The state of a transaction worker's user transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TransactionState {
    /// No transaction: the next statement begins one.
    Idle,
    /// `BEGIN IMMEDIATE` ran; statements run inside it.
    Open,
    /// SQLite rolled the transaction back on its own (after an I/O error, say). Everything
    /// until the caller's commit or rollback fails, so that no later statement runs outside the
    /// transaction.
    Aborted,
}

/// What a worker thread owns.
pub(super) struct WorkerState {
    pub(super) connection: Connection,
    pub(super) statements: Statements,
    /// The shard lock expiration in whole seconds.
    pub(super) expiration_seconds: i64,
    /// The same as a `datetime` modifier, `-<n> seconds`.
    pub(super) expiration_modifier: String,
    pub(super) group_commit_len_max: usize,
    pub(super) transaction: TransactionState,
    /// The background checkpointer of the message worker (see
    /// [`checkpointer`](super::checkpointer)).
    pub(super) checkpointer: Option<Checkpointer>,
}

/// Classifies a driver error: a uniqueness violation is a conflict, a lock
/// still held by another connection after the busy timeout is a timeout, a file that cannot be
/// read or written makes the database unavailable, a column of the wrong type is a malformed
/// row.
pub(super) fn classify(operation: &str, error: rusqlite::Error) -> StorageError {
    let kind = match &error {
        rusqlite::Error::SqliteFailure(failure, _) => match failure.code {
            ErrorCode::ConstraintViolation if queries::is_unique_violation(&error) => {
                StorageErrorKind::Conflict
            }
            ErrorCode::ConstraintViolation | ErrorCode::TooBig => StorageErrorKind::InvalidInput,
            ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => StorageErrorKind::Timeout,
            ErrorCode::CannotOpen
            | ErrorCode::SystemIoFailure
            | ErrorCode::DiskFull
            | ErrorCode::ReadOnly
            | ErrorCode::PermissionDenied
            | ErrorCode::NotADatabase
            | ErrorCode::FileLockingProtocolFailed
            | ErrorCode::NoLargeFileSupport => StorageErrorKind::Unavailable,
            _ => StorageErrorKind::Other,
        },
        rusqlite::Error::FromSqlConversionFailure(..)
        | rusqlite::Error::InvalidColumnType(..)
        | rusqlite::Error::IntegralValueOutOfRange(..) => StorageErrorKind::Malformed,
        _ => StorageErrorKind::Other,
    };
    StorageError::with_source(kind, format!("sqlite {operation} failed"), error)
}
