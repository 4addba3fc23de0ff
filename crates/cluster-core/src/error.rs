//! Errors of the core vocabulary and of the contracts.
//!
//! [`ClusterError`] is what callers of the cluster see (the reference's `ClusterError`,
//! `effect/src/cluster/ClusterError.ts`). [`StorageError`] is what storage backends return,
//! classified by [`StorageErrorKind`]. [`ParseError`], [`DecodeError`] and [`ConfigError`] report
//! bad input: they name what was wrong and never panic.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use crate::ids::{EntityAddress, RunnerAddress};
use crate::snowflake::Snowflake;

/// An error a caller of the cluster can receive and match on
/// (`effect/src/cluster/ClusterError.ts`).
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// The entity's shard is not held by the runner that was asked, or that runner is shutting
    /// down. Transient while shards move: routing retries it.
    #[error("entity {address} is not assigned to this runner")]
    EntityNotAssignedToRunner {
        /// The entity that was addressed.
        address: EntityAddress,
    },
    /// The runner could not be reached. Transient: routing retries it, and persisted requests
    /// recover their replies from storage.
    #[error("runner {address} is unavailable")]
    RunnerUnavailable {
        /// The runner that could not be reached.
        address: RunnerAddress,
    },
    /// The runner and this process do not accept each other: the transport's handshake failed,
    /// for example because they do not hold the same shared secret, or the runner does not
    /// speak this transport. Not transient: routing does not retry it, and persisted requests
    /// still reach their owner through storage. Fix the configuration that `reason` names.
    /// Not in the reference, whose transports have no handshake.
    #[error("the connection handshake with runner {address} failed: {reason}")]
    HandshakeFailed {
        /// The runner that was asked.
        address: RunnerAddress,
        /// Why, and what to check; never the secret or a value derived from it.
        reason: Arc<str>,
    },
    /// The entity has as many requests in flight as its mailbox holds, or the runner has as many
    /// resident entities as it may.
    #[error("the mailbox of entity {address} is full")]
    MailboxFull {
        /// The entity whose mailbox is full.
        address: EntityAddress,
    },
    /// The request is already running in the entity, or completed since the last storage read.
    #[error("request {envelope_id} is already being processed by entity {address}")]
    AlreadyProcessingMessage {
        /// The request's id.
        envelope_id: Snowflake,
        /// The entity that is processing it.
        address: EntityAddress,
    },
    /// The runner stopped before it answered this persisted request, so this caller will not
    /// get its reply; the request itself stays stored and runs on the next owner of its shard
    /// (the reference's interruption with the `ClusterAbandon` annotation, 4.1.0). Not a
    /// failure of the request: sending it again with the same primary key returns its reply
    /// once there is one.
    #[error("request {request_id} to entity {address} was left stored for the next owner")]
    Abandoned {
        /// The entity the request was addressed to.
        address: EntityAddress,
        /// The request's id.
        request_id: Snowflake,
    },
    /// A storage operation failed.
    #[error("persistence error: {0}")]
    Persistence(#[from] StorageError),
    /// A payload or reply could not be encoded or decoded.
    #[error("malformed message: {0}")]
    MalformedMessage(#[from] DecodeError),
    /// Declared by the reference and never raised there; kept so that both error sets match.
    #[error("runner {address} is not registered")]
    RunnerNotRegistered {
        /// The runner that is not registered.
        address: RunnerAddress,
    },
}

/// What kind of storage failure happened; callers decide on retries from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StorageErrorKind {
    /// A uniqueness rule was violated, for example a second final reply for one request.
    Conflict,
    /// The database could not be reached or the connection was lost.
    Unavailable,
    /// The operation did not finish within its deadline.
    Timeout,
    /// A stored row could not be decoded.
    Malformed,
    /// The input cannot be stored, for example a value that exceeds a column.
    InvalidInput,
    /// A conditional write of an entity's state found another revision than the one its
    /// writer loaded: the state was written elsewhere since (see
    /// [`entity_state`](crate::entity_state)).
    StaleState,
    /// Anything else the database reported.
    Other,
}

impl StorageErrorKind {
    /// The kind as a metric label: lowercase, one word or snake case.
    pub fn as_label(self) -> &'static str {
        match self {
            StorageErrorKind::Conflict => "conflict",
            StorageErrorKind::Unavailable => "unavailable",
            StorageErrorKind::Timeout => "timeout",
            StorageErrorKind::Malformed => "malformed",
            StorageErrorKind::InvalidInput => "invalid_input",
            StorageErrorKind::StaleState => "stale_state",
            StorageErrorKind::Other => "other",
        }
    }
}

impl fmt::Display for StorageErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StorageErrorKind::Conflict => "conflict",
            StorageErrorKind::Unavailable => "unavailable",
            StorageErrorKind::Timeout => "timeout",
            StorageErrorKind::Malformed => "malformed row",
            StorageErrorKind::InvalidInput => "invalid input",
            StorageErrorKind::StaleState => "stale state",
            StorageErrorKind::Other => "error",
        })
    }
}

/// A failed storage operation (the reference's `PersistenceError`).
///
/// The driver's own error is kept as the [`source`](StdError::source) and classified by
/// [`kind`](StorageError::kind). Cloning is cheap, so one failure can be reported to several
/// waiters.
#[derive(Clone, Debug)]
pub struct StorageError {
    kind: StorageErrorKind,
    message: Arc<str>,
    source: Option<Arc<dyn StdError + Send + Sync>>,
}

impl StorageError {
    /// A storage error of `kind` described by `message`.
    pub fn new(kind: StorageErrorKind, message: impl Into<String>) -> StorageError {
        StorageError { kind, message: Arc::from(message.into()), source: None }
    }

    /// A storage error of `kind` caused by the driver error `source`.
    pub fn with_source(
        kind: StorageErrorKind,
        message: impl Into<String>,
        source: impl StdError + Send + Sync + 'static,
    ) -> StorageError {
        StorageError { kind, message: Arc::from(message.into()), source: Some(Arc::new(source)) }
    }

    /// The classification of this failure.
    pub fn kind(&self) -> StorageErrorKind {
        self.kind
    }

    /// The description of this failure, without its source.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The message, the kind, then every cause down the [`source`](StdError::source) chain: a
/// driver's error often says only "error connecting to server", and the OS error or the
/// server's own message is its source.
///
/// A cause whose text is already shown (an error that prints its own source) is not repeated,
/// and a `StorageError` cause shows only its own message and kind, its causes following.
impl fmt::Display for StorageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = format!("{} ({})", self.message, self.kind);
        let mut cause = StdError::source(self);
        while let Some(error) = cause {
            let text = match error.downcast_ref::<StorageError>() {
                Some(storage) => format!("{} ({})", storage.message, storage.kind),
                None => error.to_string(),
            };
            if !text.is_empty() && !shown.contains(&text) {
                shown.push_str(": ");
                shown.push_str(&text);
            }
            cause = error.source();
        }
        f.write_str(&shown)
    }
}

impl StdError for StorageError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source.as_deref().map(|source| source as &(dyn StdError + 'static))
    }
}

/// A string that does not parse as the identifier it should be.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {input:?}: {reason}")]
pub struct ParseError {
    what: &'static str,
    input: String,
    reason: &'static str,
}

impl ParseError {
    pub(crate) fn new(what: &'static str, input: &str, reason: &'static str) -> ParseError {
        ParseError { what, input: input.to_owned(), reason }
    }

    /// What was being parsed, for example `"shard id"`.
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// The input that did not parse.
    pub fn input(&self) -> &str {
        &self.input
    }

    /// Why it did not parse.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

/// An encoded envelope, reply, exit or runner record that cannot be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot decode {what}: {message}")]
pub struct DecodeError {
    what: &'static str,
    message: String,
}

impl DecodeError {
    /// A decode failure of `what` (for example `"envelope"`), described by `message`.
    pub fn new(what: &'static str, message: impl Into<String>) -> DecodeError {
        DecodeError { what, message: message.into() }
    }

    /// What was being decoded.
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// Why it could not be decoded.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<ParseError> for DecodeError {
    fn from(error: ParseError) -> DecodeError {
        DecodeError::new(error.what, error.to_string())
    }
}

/// A configuration value that is missing, malformed or out of range.
///
/// It names the option (its environment variable when loaded from the environment) and the
/// offending value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration {key}={value:?}: {reason}")]
pub struct ConfigError {
    key: String,
    value: String,
    reason: String,
}

impl ConfigError {
    /// An error for option `key` with value `value`, explained by `reason`.
    pub fn new(
        key: impl Into<String>,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> ConfigError {
        ConfigError { key: key.into(), value: value.into(), reason: reason.into() }
    }

    /// The option or environment variable at fault.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The offending value (empty if the value is missing).
    pub fn value(&self) -> &str {
        &self.value
    }

    /// Why the value is not accepted.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

#[cfg(test)]
mod tests;
