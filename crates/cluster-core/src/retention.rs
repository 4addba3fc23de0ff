//! Retention: deleting processed requests, with their replies, once they are old enough.
//!
//! The reference never deletes a processed message or reply, so its tables grow without bound.
//! This is our own addition, through two storage methods:
//!
//! - [`MessageStorage::purge_processed`](crate::storage::MessageStorage::purge_processed)
//!   deletes, in one bounded batch, requests whose final reply is older than a cutoff, with
//!   every message and reply of those requests (interrupts, acknowledgements, chunks).
//! - [`MessageStorage::processed_requests`](crate::storage::MessageStorage::processed_requests)
//!   lists such requests with their final replies, paged by request id, so that a caller can
//!   decide by the reply (a workflow execution that completed, say) and then delete the whole
//!   entity with [`clear_address`](crate::storage::MessageStorage::clear_address).
//!
//! Age comes from the final reply's id: a snowflake holds the time its runner made it
//! ([`Snowflake::timestamp`]), which is when the request was answered. So the tables need no
//! new column, and TypeScript runners' rows age the same way.
//!
//! A request with no final reply is never deleted, however old: it is not processed, or it
//! was marked processed without an answer and its age is unknown.

use std::time::Duration;

use crate::error::{StorageError, StorageErrorKind};
use crate::ids::EntityAddress;
use crate::snowflake::{Snowflake, SnowflakeParts};
use crate::{MachineId, Timestamp};

/// The shortest pause between two batches of a sweep. A sweep pauses as long as its last
/// batch took, at least this: it uses at most half of one connection.
pub const PAUSE_MIN: Duration = Duration::from_millis(10);

/// The longest one retention call (a batch, a page, one execution's deletion) may take. Past
/// it the sweep stops and the next one starts over: a database that hangs does not hold the
/// sweep forever.
pub const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// How long a retention sweep waits for the next: a tenth of the retention, from 1 s to 1 min.
/// So rows outlive the retention by at most a tenth of it (or a minute), plus the sweep's own
/// time.
pub fn sweep_interval(retention: Duration) -> Duration {
    (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// The entity types that [`PurgeProcessed::keep_entity_type_prefixes`] names by default: the
/// workflow executions (their activity results are replayed until the execution completes).
pub const WORKFLOW_ENTITY_TYPE_PREFIX: &str = "Workflow/";

/// One batch of [`purge_processed`](crate::storage::MessageStorage::purge_processed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PurgeProcessed {
    /// Only requests whose final reply's id is below this one: answered before its
    /// timestamp ([`replied_before`]).
    pub replied_before: Snowflake,
    /// Requests of entity types that start with one of these are kept.
    pub keep_entity_type_prefixes: Vec<String>,
    /// The most requests deleted by one call, at least 1. The oldest (lowest request id) go
    /// first.
    pub limit: u32,
}

/// Which requests [`processed_requests`](crate::storage::MessageStorage::processed_requests)
/// lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessedQuery {
    /// Only entity types that start with this (empty: every type).
    pub entity_type_prefix: String,
    /// Only requests with this tag (the RPC's name), if set.
    pub tag: Option<String>,
    /// Only requests whose final reply's id is below this one.
    pub replied_before: Snowflake,
    /// Only requests whose id is above this one: the last id of the previous page.
    pub after: Option<Snowflake>,
    /// The most requests listed, at least 1. In request id order.
    pub limit: u32,
}

/// A processed request, as [`processed_requests`](crate::storage::MessageStorage::processed_requests)
/// lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessedRequest {
    /// The request's id.
    pub request_id: Snowflake,
    /// Its entity.
    pub address: EntityAddress,
    /// Its tag (the RPC's name).
    pub tag: String,
    /// Its payload, if it has one that is JSON (a payload that is not is left out, so that
    /// one damaged row does not stop a listing).
    pub payload: Option<crate::envelope::RawJson>,
    /// Its final reply.
    pub reply: crate::envelope::WithExit,
}

/// The smallest snowflake made at `time` or later: requests answered before `time` have final
/// replies whose ids are below it. A time before the snowflake epoch gives the smallest id; a
/// time past the largest id that a `BIGINT` column holds gives that id (every stored reply is
/// then before it).
pub fn replied_before(time: Timestamp) -> Snowflake {
    let parts = SnowflakeParts { timestamp: time, machine_id: MachineId::new(0), sequence: 0 };
    let largest = u64::try_from(i64::MAX).unwrap_or(u64::MAX);
    Snowflake::new(Snowflake::from_parts(parts).get().min(largest))
}

/// A limit of 0, refused before anything is sent.
pub fn zero_limit(what: &str) -> StorageError {
    StorageError::new(
        StorageErrorKind::InvalidInput,
        format!("{what}: the limit is 0; ask for at least one request"),
    )
}

/// The error of a storage that does not implement retention (the trait's default).
pub fn unsupported(backend: &str) -> StorageError {
    StorageError::new(
        StorageErrorKind::Other,
        format!(
            "the {backend} storage does not delete processed requests: retention needs a \
             message storage on SQLite, PostgreSQL, MySQL or memory"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_interval_is_a_tenth_of_the_retention_within_bounds() {
        assert_eq!(sweep_interval(Duration::from_secs(10)), Duration::from_secs(1));
        assert_eq!(sweep_interval(Duration::from_secs(300)), Duration::from_secs(30));
        assert_eq!(sweep_interval(Duration::from_secs(86_400)), Duration::from_secs(60));
    }

    #[test]
    fn replied_before_stays_within_a_bigint() {
        let far = replied_before(Timestamp::from_unix_millis(i64::MAX / 2));
        assert_eq!(far.to_i64(), Some(i64::MAX));
        let now = Timestamp::from_unix_millis(1_800_000_000_000);
        let cutoff = replied_before(now);
        assert_eq!(cutoff.timestamp(), now);
        assert_eq!((cutoff.machine_id(), cutoff.sequence()), (MachineId::new(0), 0));
    }
}
