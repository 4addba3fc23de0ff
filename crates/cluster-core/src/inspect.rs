//! The read model: what an operator's console and CLI show of the stored cluster.
//!
//! The reference has no such reads: an operator queries its tables by hand. Four storage
//! methods give the same view on every backend, and read only:
//!
//! - [`RunnerStorage::runner_records`](crate::storage::RunnerStorage::runner_records): every
//!   registered runner, with its machine id, health and the age of its heartbeat, expired ones
//!   included;
//! - [`RunnerStorage::shard_locks`](crate::storage::RunnerStorage::shard_locks): who holds
//!   each shard's lock, as the database sees it;
//! - [`MessageStorage::backlog`](crate::storage::MessageStorage::backlog): per entity type and
//!   shard, the unprocessed messages, how long the oldest has waited, and the claims that went
//!   stale;
//! - [`MessageStorage::requests`](crate::storage::MessageStorage::requests): requests with
//!   their final replies, filtered and paged by id. A workflow execution is its `run` request,
//!   and its activities and deferreds are the entity's other requests.
//!
//! Ages are measured by the database's clock where the rows hold the database's time
//! (heartbeats, leases, claims), so that a skewed operator clock does not distort them.

use std::time::Duration;

use crate::Timestamp;
use crate::envelope::{RawJson, WithExit};
use crate::error::{StorageError, StorageErrorKind};
use crate::ids::{EntityAddress, MachineId, Runner, RunnerAddress, ShardId};
use crate::snowflake::Snowflake;

/// The most rows one read model call returns.
pub const LIMIT_MAX: u32 = 1_000;

/// A registered runner, as [`runner_records`](crate::storage::RunnerStorage::runner_records)
/// reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerRecord {
    /// The runner: its address, shard groups and weight.
    pub runner: Runner,
    /// Its machine id (the snowflake generator's).
    pub machine_id: MachineId,
    /// Its health flag.
    pub healthy: bool,
    /// How long ago its last heartbeat was, by the database's clock.
    pub heartbeat_age: Duration,
    /// Whether its heartbeat is younger than the storage's lock expiration: an expired runner
    /// gets no shards and is deleted by the next unregistration.
    pub alive: bool,
}

/// Who holds a shard's lock.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LockHolder {
    /// A runner, by its address.
    Runner(RunnerAddress),
    /// A database session whose runner is not known (an advisory lock taken by a runner that
    /// does not name its session, such as a TypeScript runner): the backend's session id.
    Session(String),
}

impl std::fmt::Display for LockHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockHolder::Runner(address) => write!(f, "{address}"),
            LockHolder::Session(session) => write!(f, "session {session}"),
        }
    }
}

/// A shard's lock, as [`shard_locks`](crate::storage::RunnerStorage::shard_locks) reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLock {
    /// The shard.
    pub shard_id: ShardId,
    /// Its holder.
    pub holder: LockHolder,
    /// How long ago the lease was taken or last refreshed, by the database's clock; `None`
    /// for an advisory lock, which has no lease.
    pub lease_age: Option<Duration>,
    /// Whether the lease is older than the lock expiration: its holder stopped refreshing it
    /// and any runner may take it over. Always `false` for an advisory lock.
    pub expired: bool,
}

/// What [`backlog`](crate::storage::MessageStorage::backlog) reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BacklogQuery {
    /// The operator's time, for the messages' delivery times (`deliver_at`, set by the
    /// runner that sent them): a message whose delivery time is later is scheduled, not late.
    pub now: Timestamp,
    /// A claim older than this, by the database's clock, is stale: the runner that read the
    /// message has not answered it.
    pub stale_after: Duration,
    /// The most groups returned, at least 1 and at most [`LIMIT_MAX`]: the groups whose oldest
    /// due message waited longest come first.
    pub limit: u32,
}

/// The unprocessed messages of one entity type on one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backlog {
    /// The entity type.
    pub entity_type: String,
    /// The shard.
    pub shard_id: ShardId,
    /// Unprocessed messages that are due: requests, interrupts and acknowledgements.
    pub due: u64,
    /// Unprocessed messages whose delivery time is later than [`BacklogQuery::now`].
    pub scheduled: u64,
    /// Due messages that a runner read (claimed) and has not answered yet.
    pub claimed: u64,
    /// Claimed messages whose claim is older than [`BacklogQuery::stale_after`].
    pub stale_claims: u64,
    /// Since when the oldest due message has waited: its id's time, or its delivery time when
    /// it has one. `None` when no message is due.
    pub waiting_since: Option<Timestamp>,
}

impl Backlog {
    /// How long the oldest due message has waited at `now` (zero when none is due).
    pub fn oldest_age(&self, now: Timestamp) -> Duration {
        self.waiting_since.map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }
}

/// Which requests [`requests`](crate::storage::MessageStorage::requests) lists.
///
/// Every filter that is set must match. Pages follow the ids: pass a page's last id as
/// `after` (oldest first) or `before` (newest first) to get the next.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestQuery {
    /// Only this request.
    pub request_id: Option<Snowflake>,
    /// Only entity types that start with this (empty: every type).
    pub entity_type_prefix: String,
    /// Only this shard: with an entity's type and id, it lets the storage read the entity's
    /// requests through its shard index instead of scanning the table.
    pub shard_id: Option<ShardId>,
    /// Only this entity type.
    pub entity_type: Option<String>,
    /// Only this entity id.
    pub entity_id: Option<String>,
    /// Only requests with this tag (the RPC's name).
    pub tag: Option<String>,
    /// Only processed requests (`true`) or unprocessed ones (`false`).
    pub processed: Option<bool>,
    /// Only ids above this one.
    pub after: Option<Snowflake>,
    /// Only ids below this one.
    pub before: Option<Snowflake>,
    /// Newest (highest id) first, instead of oldest first.
    pub newest_first: bool,
    /// The most requests listed, at least 1 and at most [`LIMIT_MAX`].
    pub limit: u32,
}

impl RequestQuery {
    /// The first `limit` requests, oldest first, of every type.
    pub fn all(limit: u32) -> RequestQuery {
        RequestQuery { limit, ..RequestQuery::default() }
    }

    /// Whether `request` (with `address`, `tag`, `processed`) passes the filters; for storages
    /// that filter in memory.
    pub fn matches(
        &self,
        request_id: Snowflake,
        address: &EntityAddress,
        tag: &str,
        processed: bool,
    ) -> bool {
        let entity_type = address.entity_type.as_str();
        self.request_id.is_none_or(|id| id == request_id)
            && entity_type.starts_with(self.entity_type_prefix.as_str())
            && self.shard_id.as_ref().is_none_or(|shard| *shard == address.shard_id)
            && self.entity_type.as_deref().is_none_or(|wanted| wanted == entity_type)
            && self.entity_id.as_deref().is_none_or(|wanted| wanted == address.entity_id.as_str())
            && self.tag.as_deref().is_none_or(|wanted| wanted == tag)
            && self.processed.is_none_or(|wanted| wanted == processed)
            && self.after.is_none_or(|after| request_id > after)
            && self.before.is_none_or(|before| request_id < before)
    }
}

/// A request, as [`requests`](crate::storage::MessageStorage::requests) lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    /// The request's id (a snowflake: it holds the time it was sent).
    pub request_id: Snowflake,
    /// Its entity.
    pub address: EntityAddress,
    /// Its shard, as stored.
    pub shard_id: ShardId,
    /// Its tag (the RPC's name).
    pub tag: String,
    /// Its payload, if it is JSON (a damaged row does not stop a listing).
    pub payload: Option<RawJson>,
    /// Whether it was marked processed.
    pub processed: bool,
    /// Whether a runner read it and has not released the claim.
    pub claimed: bool,
    /// Its delivery time, if it was sent for later.
    pub deliver_at: Option<Timestamp>,
    /// Whether an interrupt of it is stored.
    pub interrupted: bool,
    /// Its final reply, if it has one. A reply that cannot be decoded reads as a defect.
    pub reply: Option<WithExit>,
}

/// Checks a read model limit: 1 to [`LIMIT_MAX`].
pub fn check_limit(what: &str, limit: u32) -> Result<(), StorageError> {
    if (1..=LIMIT_MAX).contains(&limit) {
        return Ok(());
    }
    Err(StorageError::new(
        StorageErrorKind::InvalidInput,
        format!("{what}: the limit is {limit}; ask for 1 to {LIMIT_MAX} rows and page for more"),
    ))
}

/// The error of a storage that does not implement the read model (the traits' default).
pub fn unsupported(backend: &str, what: &str) -> StorageError {
    StorageError::new(
        StorageErrorKind::Other,
        format!(
            "the {backend} storage cannot list {what}: the read model needs a storage on \
             SQLite, PostgreSQL, MySQL or memory"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{EntityId, EntityType, ShardGroup};

    fn address(entity_type: &str, entity_id: &str) -> EntityAddress {
        EntityAddress {
            shard_id: ShardId::new(ShardGroup::default_group(), 1),
            entity_type: EntityType::from(entity_type),
            entity_id: EntityId::from(entity_id),
        }
    }

    #[test]
    fn a_query_matches_every_filter() {
        let counter = address("Counter", "a");
        let id = Snowflake::new(100);
        let all = RequestQuery::all(10);
        assert!(all.matches(id, &counter, "Increment", false));
        let typed = RequestQuery { entity_type: Some("Counter".into()), ..all.clone() };
        assert!(typed.matches(id, &counter, "Increment", false));
        assert!(!typed.matches(id, &address("Counters", "a"), "Increment", false));
        let prefixed = RequestQuery { entity_type_prefix: "Count".into(), ..all.clone() };
        assert!(prefixed.matches(id, &counter, "Increment", false));
        assert!(!prefixed.matches(id, &address("Workflow/x", "a"), "Increment", false));
        let processed = RequestQuery { processed: Some(true), ..all.clone() };
        assert!(!processed.matches(id, &counter, "Increment", false));
        let after = RequestQuery { after: Some(Snowflake::new(100)), ..all.clone() };
        assert!(!after.matches(id, &counter, "Increment", false));
        let before = RequestQuery { before: Some(Snowflake::new(101)), ..all.clone() };
        assert!(before.matches(id, &counter, "Increment", false));
        let tagged = RequestQuery { tag: Some("Get".into()), ..all };
        assert!(!tagged.matches(id, &counter, "Increment", false));
    }

    #[test]
    fn limits_outside_one_to_the_maximum_are_refused() {
        assert!(check_limit("requests", 0).is_err());
        assert!(check_limit("requests", 1).is_ok());
        assert!(check_limit("requests", LIMIT_MAX).is_ok());
        let error = check_limit("requests", LIMIT_MAX + 1).unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::InvalidInput);
        assert!(error.to_string().contains("page"), "{error}");
    }

    #[test]
    fn the_oldest_age_counts_from_waiting_since() {
        let backlog = Backlog {
            entity_type: "Counter".into(),
            shard_id: ShardId::new(ShardGroup::default_group(), 1),
            due: 1,
            scheduled: 0,
            claimed: 0,
            stale_claims: 0,
            waiting_since: Some(Timestamp::from_unix_millis(1_000)),
        };
        let now = Timestamp::from_unix_millis(4_500);
        assert_eq!(backlog.oldest_age(now), Duration::from_millis(3_500));
        let empty = Backlog { waiting_since: None, ..backlog };
        assert_eq!(empty.oldest_age(now), Duration::ZERO);
    }
}
