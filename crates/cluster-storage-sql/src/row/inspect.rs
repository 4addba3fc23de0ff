//! The rows of the read model ([`cluster_core::inspect`]), as every backend reads them: runner
//! records, lease rows, backlog groups and requests with their final replies.
//!
//! Ages arrive in milliseconds, computed by the database from its own clock. A row that cannot
//! be decoded is skipped with a warning (runners, leases) or is an error that names it
//! (backlogs, requests); a damaged payload or reply never stops a listing.

use std::time::Duration;

use cluster_core::encoded::JsonForm;
use cluster_core::envelope::{RawJson, Reply};
use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::inspect::{Backlog, LockHolder, RequestRecord, RunnerRecord, ShardLock};
use cluster_core::{
    EntityAddress, EntityId, EntityType, MachineId, Runner, RunnerAddress, ShardId, Timestamp,
};

use super::{REPLY_KIND_WITH_EXIT, ReplyRow, id_from_sql};

/// A database age in milliseconds as a duration; a negative one (clock rounding) is zero.
pub(crate) fn age(millis: i64) -> Duration {
    Duration::from_millis(u64::try_from(millis).unwrap_or(0))
}

/// A counter as read (`count(*)` or `SUM`); a negative one reads as zero.
pub(crate) fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// A runner row: `machine_id, runner, healthy`, the heartbeat's age and whether it is alive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RunnerRecordRow {
    pub(crate) machine_id: i64,
    pub(crate) runner: String,
    pub(crate) healthy: bool,
    pub(crate) heartbeat_age_ms: i64,
    pub(crate) alive: bool,
}

impl RunnerRecordRow {
    /// The record, or `None` (with a warning) for a row that cannot be decoded.
    pub(crate) fn decode(self) -> Option<RunnerRecord> {
        let runner = match Runner::from_json(&self.runner) {
            Ok(runner) => runner,
            Err(error) => {
                tracing::warn!(%error, runner = %self.runner, "skipping a runner row that cannot be decoded");
                return None;
            }
        };
        let Ok(machine_id) = i32::try_from(self.machine_id) else {
            tracing::warn!(
                machine_id = self.machine_id,
                "skipping a runner row whose machine id is out of range"
            );
            return None;
        };
        Some(RunnerRecord {
            runner,
            machine_id: MachineId::new(machine_id),
            healthy: self.healthy,
            heartbeat_age: age(self.heartbeat_age_ms),
            alive: self.alive,
        })
    }
}

/// A lease row: `shard_id, address`, the lease's age and whether it expired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LeaseRow {
    pub(crate) shard_id: String,
    pub(crate) address: String,
    pub(crate) age_ms: i64,
    pub(crate) expired: bool,
}

impl LeaseRow {
    /// The lock, or `None` (with a warning) for a row that cannot be decoded.
    pub(crate) fn decode(self) -> Option<ShardLock> {
        let (Ok(shard_id), Ok(address)) =
            (self.shard_id.parse::<ShardId>(), self.address.parse::<RunnerAddress>())
        else {
            tracing::warn!(shard_id = %self.shard_id, address = %self.address, "skipping a lock row that cannot be decoded");
            return None;
        };
        Some(ShardLock {
            shard_id,
            holder: LockHolder::Runner(address),
            lease_age: Some(age(self.age_ms)),
            expired: self.expired,
        })
    }
}

/// A backlog group: `entity_type, shard_id`, the counts and the oldest due message's wait
/// start (epoch milliseconds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BacklogRow {
    pub(crate) entity_type: String,
    pub(crate) shard_id: String,
    pub(crate) due: i64,
    pub(crate) scheduled: i64,
    pub(crate) claimed: i64,
    pub(crate) stale_claims: i64,
    pub(crate) waiting_since: Option<i64>,
}

impl BacklogRow {
    /// The group; a shard id that cannot be read is a malformed row.
    pub(crate) fn decode(self) -> Result<Backlog, StorageError> {
        let shard_id = self.shard_id.parse::<ShardId>().map_err(|error| {
            StorageError::with_source(
                StorageErrorKind::Malformed,
                format!("the messages of entity type {} have a bad shard id", self.entity_type),
                DecodeError::from(error),
            )
        })?;
        Ok(Backlog {
            entity_type: self.entity_type,
            shard_id,
            due: count(self.due),
            scheduled: count(self.scheduled),
            claimed: count(self.claimed),
            stale_claims: count(self.stale_claims),
            waiting_since: self.waiting_since.map(Timestamp::from_unix_millis),
        })
    }
}

/// A request row with its final reply, as `requests` reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RequestRow {
    pub(crate) request_id: i64,
    pub(crate) shard_id: String,
    pub(crate) entity_type: String,
    pub(crate) entity_id: String,
    pub(crate) tag: Option<String>,
    pub(crate) payload: Option<String>,
    pub(crate) processed: bool,
    pub(crate) claimed: bool,
    pub(crate) deliver_at: Option<i64>,
    pub(crate) interrupted: bool,
    pub(crate) reply_id: Option<i64>,
    pub(crate) reply_payload: Option<String>,
}

impl RequestRow {
    /// The record. An address or tag that cannot be read is a malformed row that names the
    /// request; a payload that is not JSON is left out; a final reply that cannot be decoded
    /// becomes a defect reply, as [`ReplyRow::decode`] makes it.
    pub(crate) fn decode(self) -> Result<RequestRecord, StorageError> {
        let row = self.request_id;
        let malformed = |error: DecodeError| {
            StorageError::with_source(
                StorageErrorKind::Malformed,
                format!("the request row {row} cannot be read"),
                error,
            )
        };
        let request_id = id_from_sql(self.request_id).map_err(malformed)?;
        let shard_id =
            self.shard_id.parse::<ShardId>().map_err(|e| malformed(DecodeError::from(e)))?;
        let tag = self.tag.ok_or_else(|| malformed(DecodeError::new("request row", "no tag")))?;
        let reply = match self.reply_id {
            None => None,
            Some(reply_id) => {
                let reply = ReplyRow {
                    id: reply_id,
                    kind: Some(REPLY_KIND_WITH_EXIT),
                    request_id: self.request_id,
                    payload: self.reply_payload.unwrap_or_default(),
                    sequence: None,
                }
                .decode()
                .map_err(|error| {
                    StorageError::with_source(
                        StorageErrorKind::Malformed,
                        format!("the final reply of the request row {row} cannot be read"),
                        error,
                    )
                })?;
                match reply {
                    Reply::WithExit(reply) => Some(reply),
                    Reply::Chunk(_) => None,
                }
            }
        };
        Ok(RequestRecord {
            request_id,
            address: EntityAddress {
                shard_id: shard_id.clone(),
                entity_type: EntityType::from(self.entity_type),
                entity_id: EntityId::from(self.entity_id),
            },
            shard_id,
            tag,
            payload: self.payload.and_then(|payload| RawJson::from_json(payload).ok()),
            processed: self.processed,
            claimed: self.claimed,
            deliver_at: self.deliver_at.map(Timestamp::from_unix_millis),
            interrupted: self.interrupted,
            reply,
        })
    }
}

/// A [`RequestQuery`](cluster_core::inspect::RequestQuery) as SQL parameters: ids as `BIGINT`s
/// (`after` -1 and `before` the largest `BIGINT` when unset), the limit checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RequestFilter {
    pub(crate) request_id: Option<i64>,
    pub(crate) entity_type_prefix: String,
    pub(crate) shard_id: Option<String>,
    pub(crate) entity_type: Option<String>,
    pub(crate) entity_id: Option<String>,
    pub(crate) tag: Option<String>,
    pub(crate) processed: Option<bool>,
    pub(crate) after: i64,
    pub(crate) before: i64,
    pub(crate) newest_first: bool,
    pub(crate) limit: u32,
}

impl RequestFilter {
    /// The parameters of `query`, or why it cannot run (a limit out of range, an id past a
    /// `BIGINT`).
    pub(crate) fn new(
        query: &cluster_core::inspect::RequestQuery,
    ) -> Result<RequestFilter, StorageError> {
        cluster_core::inspect::check_limit("requests", query.limit)?;
        let to_sql = |id: cluster_core::Snowflake| super::id_to_sql(id);
        Ok(RequestFilter {
            request_id: query.request_id.map(to_sql).transpose()?,
            entity_type_prefix: query.entity_type_prefix.clone(),
            shard_id: query.shard_id.as_ref().map(ToString::to_string),
            entity_type: query.entity_type.clone(),
            entity_id: query.entity_id.clone(),
            tag: query.tag.clone(),
            processed: query.processed,
            // Ids are never negative.
            after: query.after.map(to_sql).transpose()?.unwrap_or(-1),
            // An id at or above the largest `BIGINT` leaves every stored id below it.
            before: query.before.map_or(i64::MAX, |before| before.to_i64().unwrap_or(i64::MAX)),
            newest_first: query.newest_first,
            limit: query.limit,
        })
    }
}

/// A [`BacklogQuery`](cluster_core::inspect::BacklogQuery) as SQL parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BacklogFilter {
    /// The operator's time in epoch milliseconds, for `deliver_at`.
    pub(crate) now_ms: i64,
    /// The claim age past which a claim is stale, in milliseconds.
    pub(crate) stale_after_ms: i64,
    pub(crate) limit: u32,
}

impl BacklogFilter {
    /// The parameters of `query`, or why it cannot run (a limit out of range).
    pub(crate) fn new(
        query: &cluster_core::inspect::BacklogQuery,
    ) -> Result<BacklogFilter, StorageError> {
        cluster_core::inspect::check_limit("backlog", query.limit)?;
        Ok(BacklogFilter {
            now_ms: query.now.unix_millis(),
            stale_after_ms: i64::try_from(query.stale_after.as_millis()).unwrap_or(i64::MAX),
            limit: query.limit,
        })
    }
}

/// The SQL expression of a message's wait start (epoch milliseconds) for the backlog: its id's
/// time (the snowflake's top 42 bits after the epoch), or its delivery time when it has one and
/// that is later; `NULL` for a message not yet due (its delivery time after `now`). `greatest`
/// is the backend's two-argument maximum (`GREATEST`, or SQLite's `MAX`).
pub(crate) fn waiting_since_sql(now: &str, greatest: &str) -> String {
    let epoch = cluster_core::snowflake::EPOCH.unix_millis();
    let id_time = format!("((id >> 22) + {epoch})");
    format!(
        "CASE WHEN deliver_at IS NULL THEN {id_time} \
         WHEN deliver_at <= {now} THEN {greatest}(deliver_at, {id_time}) END"
    )
}

/// The decodable runner records of `rows`, in address order.
pub(crate) fn runner_records(rows: Vec<RunnerRecordRow>) -> Vec<RunnerRecord> {
    let mut records: Vec<RunnerRecord> =
        rows.into_iter().filter_map(RunnerRecordRow::decode).collect();
    records.sort_by(|a, b| a.runner.address.cmp(&b.runner.address));
    records
}

/// The decodable locks of `rows`, in shard order.
pub(crate) fn shard_locks(rows: Vec<LeaseRow>) -> Vec<ShardLock> {
    let mut locks: Vec<ShardLock> = rows.into_iter().filter_map(LeaseRow::decode).collect();
    locks.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
    locks
}
