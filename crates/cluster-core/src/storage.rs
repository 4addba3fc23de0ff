//! The storage contracts: [`MessageStorage`] (mailboxes and replies,
//! `effect/src/cluster/MessageStorage.ts`) and [`RunnerStorage`] (runner registry and shard locks,
//! `effect/src/cluster/RunnerStorage.ts`).
//!
//! Backends work at the *encoded* level: payloads, headers and reply values are
//! [`RawJson`](crate::envelope::RawJson)
//! holes that are stored and returned untouched; decoding with a request's own types happens
//! above. Backends store and fetch rows; delivery policy lives once above them:
//! the reply-handler registry and the transaction notification rule are in
//! [`crate::reply_handlers`], dedup rewriting and polling in the runtime.
//!
//! The reference's decoded-level `MessageStorage` methods map here as follows: `saveRequest` →
//! [`MessageStorage::save_request`]; `saveEnvelope` → [`MessageStorage::save_ack_chunk`] and
//! [`MessageStorage::save_interrupt`]; `saveReply`, `clearReplies`, `repliesFor`,
//! `repliesForUnfiltered`, `requestIdForPrimaryKey`, `unprocessedMessages`,
//! `unprocessedMessagesById`, `resetShards`, `resetRequests`, `resetAddresses` (and
//! `resetAddress`, a one-element list) and `clearAddress` keep their names; `withTransaction` →
//! [`MessageStorage::begin_transaction`] plus [`TransactionNotifications`]; and
//! `registerReplyHandler`, `unregisterReplyHandler(.., interrupt)` and
//! `unregisterShardReplyHandlers` → [`ReplyHandlers`].
//!
//! Every method is a boxed future so that the traits are object safe (`Arc<dyn
//! MessageStorage>`). Each documents its cancel safety: durable writes are keyed (snowflake or
//! primary key), so a dropped future that may or may not have written is safe to retry.
//!
//! [`TransactionNotifications`]: crate::reply_handlers::TransactionNotifications
//! [`ReplyHandlers`]: crate::reply_handlers::ReplyHandlers

use std::any::Any;
use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::clock::Timestamp;
use crate::envelope::{AckChunk, Envelope, Interrupt, Reply, Request};
use crate::error::{DecodeError, StorageError};
use crate::future::BoxFuture;
use crate::ids::{EntityAddress, MachineId, Runner, RunnerAddress, ShardId};
use crate::snowflake::Snowflake;

/// How long a claim on an unprocessed message keeps other readers away
/// (`effect/src/cluster/SqlMessageStorage.ts`).
pub const CLAIM_WINDOW: Duration = Duration::from_secs(10 * 60);

/// The outcome of saving a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaveResult {
    /// The request was stored.
    Success,
    /// A request with the same primary key is already stored; nothing was written.
    Duplicate {
        /// The stored request's id: the caller's replies come under it.
        original_id: Snowflake,
        /// The stored request's latest reply (its final reply, or its latest chunk).
        last_received_reply: Option<Reply>,
    },
}

/// What [`MessageStorage::save_request_ordered`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrderedSave {
    /// The save's outcome.
    pub saved: SaveResult,
    /// The entity's unprocessed requests stored before this one, when it was stored and they
    /// could be read.
    pub earlier: Option<Vec<Snowflake>>,
}

/// Where and when a request is delivered, besides its envelope.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveRequestOptions {
    /// The composed primary key ([`primary_key`](crate::envelope::primary_key)); requests
    /// without one are never deduplicated by content.
    pub primary_key: Option<String>,
    /// Not delivered before this time (compared with the runner's clock by
    /// [`MessageStorage::unprocessed_messages`]).
    pub deliver_at: Option<Timestamp>,
}

/// A stored message handed to its entity, with the last reply it already sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnprocessedMessage {
    /// The envelope as stored.
    pub envelope: Envelope,
    /// For a streaming request resumed after a restart: the last chunk it sent.
    pub last_sent_reply: Option<Reply>,
}

/// A stored message that cannot be decoded. The caller answers its request with a defect, so
/// its caller is not left waiting, and moves on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MalformedMessage {
    /// The row's id.
    pub id: Snowflake,
    /// The request the row belongs to.
    pub request_id: Snowflake,
    /// Why it cannot be decoded.
    pub error: DecodeError,
}

/// The result of reading unprocessed messages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnprocessedBatch {
    /// Messages to deliver, in storage (insertion) order.
    pub messages: Vec<UnprocessedMessage>,
    /// Rows that were read (and claimed) but cannot be decoded.
    pub malformed: Vec<MalformedMessage>,
}

impl UnprocessedBatch {
    /// The number of rows read, decodable or not.
    pub fn len(&self) -> usize {
        self.messages.len() + self.malformed.len()
    }

    /// Whether nothing was read.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Filters of [`MessageStorage::unprocessed_messages`].
#[derive(Clone, Copy, Debug, Default)]
pub struct UnprocessedOptions<'a> {
    /// At most this many rows.
    pub limit: Option<NonZeroU32>,
    /// Only messages for these entities; `Some(&[])` matches nothing.
    pub addresses: Option<&'a [EntityAddress]>,
}

/// Durable mailboxes: requests, acknowledgements, interrupts and replies, partitioned by shard.
///
/// Implemented by `cluster-storage-sql` (Postgres, MySQL, SQLite) and by `cluster-testkit` (in
/// memory); both run the testkit's conformance suite. Rules shared by all methods:
///
/// - A message row is *unprocessed* until its request has a final reply (or the row is an
///   acknowledgement superseded by a newer one).
/// - A *claim* (`last_read`) keeps a row from being read again for [`CLAIM_WINDOW`]; the
///   `reset_*` methods release claims without touching replies or processed flags.
/// - Empty id, shard or address lists are no-ops that return nothing, without a round-trip.
/// - Storage failures are [`StorageError`]s; a second final reply for one request is a
///   [`StorageErrorKind::Conflict`](crate::error::StorageErrorKind::Conflict).
pub trait MessageStorage: Send + Sync + fmt::Debug {
    /// Stores `request` unless one with the same primary key exists (then nothing is written
    /// and the stored request's id and latest reply come back as [`SaveResult::Duplicate`]).
    /// Primary keys longer than the column are stored as their digest
    /// ([`message_id`](crate::envelope::message_id)).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent for requests with a primary key: if the future is
    /// dropped the request may or may not be stored, and saving it again is correct (the
    /// second save reports the first as a duplicate).
    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>>;

    /// Stores a stream acknowledgement, in one transaction: marks the acknowledged chunk
    /// `acked`, marks the request's older acknowledgements processed, inserts `ack`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: the row is keyed by `ack.id`.
    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Stores an interrupt of a request.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: the row is keyed by `interrupt.id`.
    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Stores a reply. A chunk becomes the request's latest reply; a final reply also marks the
    /// request and its acknowledgements and interrupts processed. Notifying waiters is the
    /// caller's job ([`ReplyHandlers`](crate::reply_handlers::ReplyHandlers)).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: the row is keyed by the reply id, and a final reply
    /// saved twice is rejected as a conflict, never stored twice.
    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Resets a request so it runs again: deletes its final reply and its interrupts, and marks
    /// all its rows unprocessed and unclaimed with no latest reply. Chunks are kept.
    ///
    /// With `expected_reply_id` it is the reference's conditional reset, which protects workflow
    /// resumes: only if that is still the request's latest reply (checked atomically in
    /// storage), its final reply is deleted and the rows whose latest reply it is (the request
    /// and the acknowledgements and interrupts it completed) become unprocessed and unclaimed;
    /// interrupts are kept.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent.
    fn clear_replies(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> BoxFuture<'_, Result<(), StorageError>>;

    /// The id of the stored request with this composed primary key.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn request_id_for_primary_key<'a>(
        &'a self,
        primary_key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Snowflake>, StorageError>>;

    /// The final replies and unacknowledged chunks of these requests, in insertion order. A
    /// reply row that cannot be decoded is returned as [`Reply::malformed`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn replies_for<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>>;

    /// Every stored reply of these requests, acknowledged or not, in insertion order.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn replies_for_unfiltered<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>>;

    /// Claims and returns unprocessed messages of `shard_ids`
    /// (`effect/src/cluster/SqlMessageStorage.ts`): not processed, no final reply and no
    /// unacknowledged chunk for the request, not claimed within [`CLAIM_WINDOW`], due (`deliver_at
    /// <= now`), in insertion order, at most `limit`. Only the returned rows are claimed.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, rows may have been claimed and not returned.
    /// They become readable again when the claim window passes or a `reset_*` releases them.
    fn unprocessed_messages<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'a>,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>>;

    /// Unprocessed messages with these ids, with the same filters but without claiming them.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>>;

    /// The ids of the requests of `address` stored before the stored request `request_id`, in
    /// the order [`unprocessed_messages`](MessageStorage::unprocessed_messages) returns rows,
    /// at most `limit`: those not processed and due (`deliver_at <= now`), claimed or not.
    /// They must reach the entity before `request_id` does (per-entity storage order).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn unprocessed_before<'a>(
        &'a self,
        address: &'a EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: NonZeroU32,
    ) -> BoxFuture<'a, Result<Vec<Snowflake>, StorageError>>;

    /// Saves `request` as [`save_request`](MessageStorage::save_request) does and, when it was
    /// stored, reads [`unprocessed_before`](MessageStorage::unprocessed_before) it (at `now`,
    /// at most `limit`): what a runner needs to hand its own request to the entity directly,
    /// in storage order. `earlier` is `None` when the request was not stored or the read
    /// failed (a failed read does not make the save fail). The default makes the two calls;
    /// a backend may answer both in one round trip.
    ///
    /// # Cancel safety
    ///
    /// As [`save_request`](MessageStorage::save_request).
    fn save_request_ordered<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
        now: Timestamp,
        limit: NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedSave, StorageError>> {
        Box::pin(async move {
            let saved = self.save_request(request, options).await?;
            let earlier = match saved {
                SaveResult::Success => self
                    .unprocessed_before(&request.address, request.request_id, now, limit)
                    .await
                    .ok(),
                SaveResult::Duplicate { .. } => None,
            };
            Ok(OrderedSave { saved, earlier })
        })
    }

    /// Releases the claims of these requests' unprocessed rows.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe and idempotent.
    fn reset_requests<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Releases the claims of these entities' unprocessed rows.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe and idempotent.
    fn reset_addresses<'a>(
        &'a self,
        addresses: &'a [EntityAddress],
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Releases the claims of these shards' unprocessed rows (a new owner took the shards).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe and idempotent.
    fn reset_shards<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Deletes every message and reply of the entity, in any shard.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent.
    fn clear_address<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Starts a transaction in which replies are saved atomically with the handler's own writes
    /// (the reference's `withTransaction`, `effect/src/cluster/SqlMessageStorage.ts`). Nested use
    /// shares the outer transaction;
    /// [`TransactionNotifications`](crate::reply_handlers::TransactionNotifications) defers
    /// final-reply notifications to the outermost commit.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future, or the transaction before `commit`, rolls back.
    fn begin_transaction(&self)
    -> BoxFuture<'_, Result<Box<dyn MessageTransaction>, StorageError>>;
}

/// An open storage transaction (see [`MessageStorage::begin_transaction`]).
///
/// Dropped without [`commit`](MessageTransaction::commit), it rolls back.
pub trait MessageTransaction: Send {
    /// [`MessageStorage::save_reply`] inside this transaction.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is visible before commit.
    fn save_reply<'a>(&'a mut self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>>;

    /// The backend's own transaction handle, for the handler's own statements. Its type is the
    /// backend's (for example a pooled Postgres client) and stays the same for the
    /// transaction's whole life; a handler reaches it typed through
    /// [`TransactionGuard`](crate::transaction::TransactionGuard), code that holds the
    /// transaction through `backend_as`.
    fn backend(&mut self) -> &mut (dyn Any + Send);

    /// Commits.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped the outcome is unknown; callers check storage
    /// (a stored final reply means the commit happened, `effect/src/cluster/SqlMessageStorage.ts`).
    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>>;

    /// Rolls back.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a transaction that is never committed is rolled back.
    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>>;
}

/// The runner registry and the shard locks (`effect/src/cluster/RunnerStorage.ts`).
///
/// Implemented by `cluster-storage-sql` (advisory locks on Postgres and MySQL, lease rows
/// everywhere) and by `cluster-testkit`. The registry's heartbeat is refreshed by every
/// [`refresh`](RunnerStorage::refresh); runners whose heartbeat is older than the lock
/// expiration are not returned by [`get_runners`](RunnerStorage::get_runners).
pub trait RunnerStorage: Send + Sync + fmt::Debug {
    /// Registers (upserts) `runner` with `healthy` and a fresh heartbeat; returns its machine
    /// id, which stays the same for a live address.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: an upsert by address.
    fn register<'a>(
        &'a self,
        runner: &'a Runner,
        healthy: bool,
    ) -> BoxFuture<'a, Result<MachineId, StorageError>>;

    /// Removes the runner (and any runner whose heartbeat expired).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent.
    fn unregister<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// The runners with a live heartbeat and their health. Rows that cannot be decoded are
    /// skipped.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn get_runners(&self) -> BoxFuture<'_, Result<Vec<(Runner, bool)>, StorageError>>;

    /// Sets the runner's health flag.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent.
    fn set_runner_health<'a>(
        &'a self,
        address: &'a RunnerAddress,
        healthy: bool,
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Tries to lock `shard_ids` for `address`; returns the subset now held by it, including
    /// shards it already held.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, some locks may be held that the caller does
    /// not know of. They are released by [`release_all`](RunnerStorage::release_all), expire,
    /// or are reported by the next `acquire`.
    fn acquire<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>>;

    /// Refreshes the heartbeat and confirms (and for leases, extends) the locks on
    /// `shard_ids`; returns the subset still held. It never re-acquires a lost lock. An empty
    /// list is a pure heartbeat (the probe used while lock storage is unhealthy).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped refresh is a missed refresh.
    fn refresh<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>>;

    /// Releases one lock, verified (it is not held by `address` afterwards).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: releasing a lock that is not held does nothing.
    fn release<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_id: &'a ShardId,
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Releases every lock held by `address`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent.
    fn release_all<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>>;
}
