//! The storage contracts.
//!
//! - [`MessageStorage`] holds the mailboxes and the replies
//!   (`effect/src/cluster/MessageStorage.ts`).
//! - [`RunnerStorage`] holds the runner registry and the shard locks
//!   (`effect/src/cluster/RunnerStorage.ts`).
//!
//! Backends work at the *encoded* level.
//! Payloads, headers and reply values are [`RawJson`](crate::envelope::RawJson) holes.
//! A backend stores and returns them untouched.
//! Decoding with a request's own types happens above the backend.
//!
//! Backends store and fetch rows; delivery policy lives once, above them:
//!
//! - the reply-handler registry and the transaction notification rule are in
//!   [`crate::reply_handlers`];
//! - dedup rewriting and polling are in the runtime.
//!
//! The reference's decoded-level `MessageStorage` methods map here as follows:
//!
//! - `saveRequest` is [`MessageStorage::save_request`].
//! - `saveEnvelope` is [`MessageStorage::save_ack_chunk`] and [`MessageStorage::save_interrupt`].
//! - `withTransaction` is [`MessageStorage::begin_transaction`] plus
//!   [`TransactionNotifications`].
//! - `registerReplyHandler`, `unregisterReplyHandler(.., interrupt)` and
//!   `unregisterShardReplyHandlers` are [`ReplyHandlers`].
//! - These keep their names: `saveReply`, `clearReplies`, `repliesFor`, `repliesForUnfiltered`,
//!   `requestIdForPrimaryKey`, `unprocessedMessages`, `unprocessedMessagesById`, `resetShards`,
//!   `resetRequests`, `resetAddresses` (`resetAddress` is a one-element list) and
//!   `clearAddress`.
//!
//! Every method returns a boxed future, so that the traits are object safe
//! (`Arc<dyn MessageStorage>`).
//! Every method documents its cancel safety.
//! Durable writes are keyed by a snowflake or a primary key.
//! So a dropped future that may or may not have written is safe to retry.
//!
//! [`TransactionNotifications`]: crate::reply_handlers::TransactionNotifications
//! [`ReplyHandlers`]: crate::reply_handlers::ReplyHandlers

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::clock::Timestamp;
use crate::entity_state::{StateWrite, StoredState};
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
    /// The entity's unprocessed requests stored before this one.
    /// `None` when this one was not stored, or when the read failed.
    pub earlier: Option<Vec<Snowflake>>,
}

/// What [`MessageStorage::unprocessed_messages_ordered`] read.
#[derive(Clone, Debug, Default)]
pub struct OrderedBatch {
    /// The unprocessed messages with the asked ids, as
    /// [`unprocessed_messages_by_id`](MessageStorage::unprocessed_messages_by_id) reads them.
    pub batch: UnprocessedBatch,
    /// Per request of `batch`, its entity's unprocessed requests stored before it, as
    /// [`unprocessed_before`](MessageStorage::unprocessed_before) reads them.
    /// A request without an entry has an unknown list: its read failed.
    pub earlier: BTreeMap<Snowflake, Vec<Snowflake>>,
}

/// Where and when a request is delivered, besides its envelope.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveRequestOptions {
    /// The composed primary key ([`primary_key`](crate::envelope::primary_key)).
    /// Requests without one are never deduplicated by content.
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

/// A stored message that cannot be decoded.
///
/// The caller answers its request with a defect and moves on.
/// So the request's own caller is not left waiting.
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
/// memory).
/// Both run the testkit's conformance suite.
///
/// Rules shared by all methods:
///
/// - **Unprocessed rows.** A message row is *unprocessed* until its request has a final reply.
///   An acknowledgement row also stops being unprocessed when a newer one supersedes it.
/// - **Claims.** A *claim* (`last_read`) keeps a row from being read again for
///   [`CLAIM_WINDOW`].
///   The `reset_*` methods release claims.
///   They touch neither replies nor processed flags.
/// - **Empty lists.** Empty id, shard or address lists are no-ops.
///   They return nothing, without a round trip.
/// - **Errors.** Storage failures are [`StorageError`]s.
///   A second final reply for one request is a
///   [`StorageErrorKind::Conflict`](crate::error::StorageErrorKind::Conflict).
pub trait MessageStorage: Send + Sync + fmt::Debug {
    /// A short fixed name of the backend (`postgres`, `mysql`, `sqlite`, `memory`), the
    /// `backend` label of the storage metrics. It must not depend on configuration.
    fn backend_name(&self) -> &'static str {
        "custom"
    }

    /// Stores `request` unless a request with the same primary key is stored.
    ///
    /// - **Dedup.** When the primary key is taken, nothing is written.
    ///   The stored request's id and latest reply come back as [`SaveResult::Duplicate`].
    /// - **Taken ids.** When the request's id is taken by another message (another key, or
    ///   none), nothing is written and the save is a
    ///   [`StorageErrorKind::Conflict`](crate::error::StorageErrorKind::Conflict): it is not
    ///   that message's duplicate.
    /// - **Long keys.** A primary key longer than the column is stored as its digest
    ///   ([`message_id`](crate::envelope::message_id)).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent for requests with a primary key.
    /// If the future is dropped, the request may or may not be stored.
    /// Saving it again is correct: the second save reports the first as a duplicate.
    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>>;

    /// Stores a stream acknowledgement.
    ///
    /// In one transaction, it:
    ///
    /// - marks the acknowledged chunk `acked`;
    /// - marks the request's older acknowledgements processed;
    /// - inserts `ack`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: the row is keyed by `ack.id`, so it is never stored
    /// twice.
    /// Depending on the backend, a retry returns `Ok` or a `Conflict`.
    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Stores an interrupt of a request.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: the row is keyed by `interrupt.id`, so it is never
    /// stored twice.
    /// Depending on the backend, a retry returns `Ok` or a `Conflict`.
    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Stores a reply.
    ///
    /// - A chunk becomes the request's latest reply.
    /// - A final reply also marks the request, its acknowledgements and its interrupts
    ///   processed.
    /// - Notifying waiters is the caller's job
    ///   ([`ReplyHandlers`](crate::reply_handlers::ReplyHandlers)).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent: the row is keyed by the reply id, so it is never stored
    /// twice.
    /// A final reply saved twice is rejected as a conflict.
    /// A chunk saved twice is accepted or rejected as a conflict, depending on the backend.
    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>>;

    /// Resets a request so that it runs again.
    ///
    /// Without `expected_reply_id`:
    ///
    /// - the request's final reply and its interrupts are deleted;
    /// - all its rows become unprocessed and unclaimed, with no latest reply;
    /// - its chunks are kept.
    ///
    /// With `expected_reply_id`, it is the reference's conditional reset, which protects workflow
    /// resumes:
    ///
    /// - nothing happens unless `expected_reply_id` is still the request's latest reply;
    /// - storage checks that atomically with the reset;
    /// - the final reply is deleted;
    /// - the rows whose latest reply it is become unprocessed and unclaimed: the request, and
    ///   the acknowledgements and interrupts it completed;
    /// - interrupts are kept.
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

    /// The final replies and unacknowledged chunks of these requests, in insertion order.
    ///
    /// A reply row that cannot be decoded is returned as [`Reply::malformed`].
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
    /// (`effect/src/cluster/SqlMessageStorage.ts`).
    ///
    /// A row is returned when:
    ///
    /// - it is not processed;
    /// - its request has no final reply and no unacknowledged chunk;
    /// - it was not claimed within [`CLAIM_WINDOW`];
    /// - it is due (`deliver_at <= now`);
    /// - it belongs to one of `options.addresses`, when that is given.
    ///
    /// Rows come in insertion order, at most `options.limit` of them.
    /// Only the returned rows are claimed.
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

    /// The unprocessed messages with these ids, in insertion order, without claiming them.
    ///
    /// The filters are those of [`unprocessed_messages`](MessageStorage::unprocessed_messages)
    /// except the claim: a claimed row is returned too.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>>;

    /// The ids of the requests of `address` stored before the stored request `request_id`.
    ///
    /// - Only requests that are not processed and are due (`deliver_at <= now`) are listed,
    ///   claimed or not.
    /// - They come in the order [`unprocessed_messages`](MessageStorage::unprocessed_messages)
    ///   returns rows, at most `limit` of them.
    /// - They must reach the entity before `request_id` does (per-entity storage order).
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

    /// Reads the unprocessed messages with these ids, as
    /// [`unprocessed_messages_by_id`](MessageStorage::unprocessed_messages_by_id) does.
    /// For each request read, also reads its entity's earlier requests, as
    /// [`unprocessed_before`](MessageStorage::unprocessed_before) does (at `now`, at most
    /// `limit`).
    ///
    /// A runner needs both to hand a request that another process stored to its entity
    /// directly, in storage order.
    ///
    /// - A failed read of the earlier requests leaves that request without an entry.
    /// - The default makes the calls one by one; a backend may answer concurrent calls in one
    ///   round trip.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn unprocessed_messages_ordered<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
        limit: NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedBatch, StorageError>> {
        Box::pin(async move {
            let batch = self.unprocessed_messages_by_id(ids, now).await?;
            let mut earlier = BTreeMap::new();
            for message in &batch.messages {
                if let Envelope::Request(request) = &message.envelope
                    && let Ok(ids) = self
                        .unprocessed_before(&request.address, request.request_id, now, limit)
                        .await
                {
                    earlier.insert(request.request_id, ids);
                }
            }
            Ok(OrderedBatch { batch, earlier })
        })
    }

    /// Saves `request` as [`save_request`](MessageStorage::save_request) does.
    /// When it was stored, also reads [`unprocessed_before`](MessageStorage::unprocessed_before)
    /// it (at `now`, at most `limit`).
    ///
    /// A runner needs both to hand its own request to the entity directly, in storage order.
    ///
    /// - `earlier` is `None` when the request was not stored or the read failed.
    /// - A failed read does not make the save fail.
    /// - The default makes the two calls; a backend may answer both in one round trip.
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

    /// Releases the claims of these shards' unprocessed rows.
    ///
    /// A new owner of the shards calls it.
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

    /// Deletes one batch of processed requests whose final reply is older than
    /// `batch.replied_before`, with every message and reply of each (interrupts,
    /// acknowledgements, chunks); returns how many requests it deleted
    /// ([`retention`](crate::retention)).
    ///
    /// - Requests of entity types that start with one of `batch.keep_entity_type_prefixes` are
    ///   kept, and so is every request without a final reply.
    /// - At most `batch.limit` requests, the oldest first; fewer than the limit means that no
    ///   more are due. A limit of 0 is an `InvalidInput`.
    /// - Each batch is short: one statement or one short transaction, so that it holds no lock
    ///   for long.
    ///
    /// A storage without retention fails (the default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call deletes its batch or nothing.
    fn purge_processed<'a>(
        &'a self,
        batch: &'a crate::retention::PurgeProcessed,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        let _ = batch;
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::retention::unsupported(backend)) })
    }

    /// Lists processed requests with their final replies, as `query` selects them, in request
    /// id order ([`retention`](crate::retention)).
    ///
    /// A limit of 0 is an `InvalidInput`. A storage without retention fails (the default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn processed_requests<'a>(
        &'a self,
        query: &'a crate::retention::ProcessedQuery,
    ) -> BoxFuture<'a, Result<Vec<crate::retention::ProcessedRequest>, StorageError>> {
        let _ = query;
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::retention::unsupported(backend)) })
    }

    /// Per entity type and shard, the unprocessed messages: how many are due, scheduled and
    /// claimed, how many claims went stale, and since when the oldest due one has waited
    /// ([`inspect`](crate::inspect)).
    ///
    /// - Groups without an unprocessed message are left out.
    /// - The groups whose oldest due message waited longest come first; at most
    ///   `query.limit` (1 to [`LIMIT_MAX`](crate::inspect::LIMIT_MAX), else `InvalidInput`).
    ///
    /// A storage without the read model fails (the default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn backlog<'a>(
        &'a self,
        query: &'a crate::inspect::BacklogQuery,
    ) -> BoxFuture<'a, Result<Vec<crate::inspect::Backlog>, StorageError>> {
        let _ = query;
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::inspect::unsupported(backend, "backlogs")) })
    }

    /// Lists requests with their final replies, as `query` selects them, in id order (newest
    /// first if asked) ([`inspect`](crate::inspect)).
    ///
    /// - A limit outside 1 to [`LIMIT_MAX`](crate::inspect::LIMIT_MAX) is an `InvalidInput`.
    /// - A payload that is not JSON is left out; a final reply that cannot be decoded reads as
    ///   a defect. One damaged row does not stop a listing.
    ///
    /// A storage without the read model fails (the default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn requests<'a>(
        &'a self,
        query: &'a crate::inspect::RequestQuery,
    ) -> BoxFuture<'a, Result<Vec<crate::inspect::RequestRecord>, StorageError>> {
        let _ = query;
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::inspect::unsupported(backend, "requests")) })
    }

    /// The durable state of `address`'s entity, if it has a row
    /// ([`entity_state`](crate::entity_state)). The row's key is the entity type and id.
    ///
    /// A storage that keeps no entity state fails (the default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn load_state<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<Option<StoredState>, StorageError>> {
        let _ = address;
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::entity_state::unsupported(backend)) })
    }

    /// Writes an entity's state alone, if its row still has the revision `write.expected`
    /// (0: there is no row).
    ///
    /// - Another revision (or a row where none was expected) is a
    ///   [`StorageErrorKind::StaleState`](crate::error::StorageErrorKind::StaleState), and
    ///   nothing is written.
    /// - A value longer than the storage's value limit is an `InvalidInput`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, the write may or may not have happened.
    /// Load the state again before writing it again.
    fn save_state<'a>(&'a self, write: &'a StateWrite) -> BoxFuture<'a, Result<(), StorageError>> {
        let _ = write;
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::entity_state::unsupported(backend)) })
    }

    /// Saves a final reply and an entity's state in one transaction: both or neither.
    ///
    /// - The state is written as [`save_state`](MessageStorage::save_state) writes it; a stale
    ///   revision fails with `StaleState` and stores no reply.
    /// - The reply is saved as [`save_reply`](MessageStorage::save_reply) saves it; a second
    ///   final reply fails with `Conflict` and writes no state.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, the outcome is unknown. A stored final reply
    /// means that both were written.
    fn save_reply_with_state<'a>(
        &'a self,
        reply: &'a Reply,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        let _ = (reply, write);
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::entity_state::unsupported(backend)) })
    }

    /// Starts a transaction in which replies are saved atomically with the handler's own writes.
    ///
    /// This is the reference's `withTransaction` (`effect/src/cluster/SqlMessageStorage.ts`).
    ///
    /// - Nested use shares the outer transaction.
    /// - [`TransactionNotifications`](crate::reply_handlers::TransactionNotifications) defers
    ///   final-reply notifications to the outermost commit.
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

    /// [`MessageStorage::save_state`] inside this transaction: a stale revision fails with
    /// `StaleState`, and the caller rolls the transaction back.
    ///
    /// A storage that keeps no entity state fails (the default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is visible before commit.
    fn save_state<'a>(
        &'a mut self,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        let _ = write;
        Box::pin(async move { Err(crate::entity_state::unsupported("transaction's")) })
    }

    /// The backend's own transaction handle, for the handler's own statements.
    ///
    /// - Its type is the backend's (for example a pooled Postgres client).
    /// - It stays the same for the transaction's whole life.
    /// - A handler reaches it typed through
    ///   [`TransactionGuard`](crate::transaction::TransactionGuard); code that holds the
    ///   transaction reaches it through `backend_as`.
    fn backend(&mut self) -> &mut (dyn Any + Send);

    /// Marks the transaction's state now (SQL `SAVEPOINT`), so that
    /// [`rollback_to_savepoint`](MessageTransaction::rollback_to_savepoint) can return to it.
    ///
    /// - There is one savepoint: a later call moves it.
    /// - What the transaction holds before it stays.
    /// - A transactional activity marks its transaction before its body runs, so that an
    ///   attempt run again starts from the same state.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, whether the savepoint exists is unknown.
    /// Roll the whole transaction back then.
    fn savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>>;

    /// Undoes every statement since the [`savepoint`](MessageTransaction::savepoint), the
    /// handler's own and the saved replies alike; the savepoint stays.
    ///
    /// It also clears a failed statement's error, so that the transaction can go on.
    /// Without a savepoint it fails.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, the transaction's state is unknown.
    /// Roll the whole transaction back then.
    fn rollback_to_savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>>;

    /// Commits.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, the outcome is unknown.
    /// Callers then check storage: a stored final reply means that the commit happened
    /// (`effect/src/cluster/SqlMessageStorage.ts`).
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
/// Implemented by `cluster-storage-sql` and by `cluster-testkit`.
/// The SQL backends hold a lock as an advisory lock (Postgres and MySQL) or as a lease row
/// (every database).
///
/// - **Heartbeat.** Every [`refresh`](RunnerStorage::refresh) refreshes the runner's heartbeat
///   in the registry.
/// - **Liveness.** [`get_runners`](RunnerStorage::get_runners) leaves out the runners whose
///   heartbeat is older than the lock expiration.
/// - **Exclusive locks.** At most one runner holds a shard's lock at a time.
///   [`acquire`](RunnerStorage::acquire) never returns a shard that another runner holds.
/// - **Expiry.** A lock is held until its holder releases it, or stops refreshing it for the
///   lock expiration.
///   Then a lease row may be taken over, and the server ends an advisory lock's session.
pub trait RunnerStorage: Send + Sync + fmt::Debug {
    /// A short fixed name of the backend, as [`MessageStorage::backend_name`].
    fn backend_name(&self) -> &'static str {
        "custom"
    }

    /// Registers (upserts) `runner` with `healthy` and a fresh heartbeat.
    ///
    /// Returns the runner's machine id, which stays the same for a live address.
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

    /// The runners with a live heartbeat, and their health.
    ///
    /// Rows that cannot be decoded are skipped.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn get_runners(&self) -> BoxFuture<'_, Result<Vec<(Runner, bool)>, StorageError>>;

    /// Every registered runner, expired ones included, with its machine id, health and the
    /// age of its heartbeat ([`inspect`](crate::inspect)), in address order.
    ///
    /// Rows that cannot be decoded are skipped. A storage without the read model fails (the
    /// default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn runner_records(
        &self,
    ) -> BoxFuture<'_, Result<Vec<crate::inspect::RunnerRecord>, StorageError>> {
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::inspect::unsupported(backend, "runners")) })
    }

    /// The locks held on `shard_ids`, as the database sees them, in shard order
    /// ([`inspect`](crate::inspect)).
    ///
    /// - A shard nobody locks is left out.
    /// - An expired lease is listed, marked expired, until a runner takes it over.
    /// - An advisory lock names its runner when the runner named its session, and the
    ///   database session otherwise.
    ///
    /// A storage without the read model fails (the default).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    fn shard_locks<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<crate::inspect::ShardLock>, StorageError>> {
        let _ = shard_ids;
        let backend = self.backend_name();
        Box::pin(async move { Err(crate::inspect::unsupported(backend, "shard locks")) })
    }

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

    /// Tries to lock `shard_ids` for `address`.
    ///
    /// Returns the subset now held by `address`, including shards it already held.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if the future is dropped, some locks may be held that the caller does
    /// not know of.
    /// They are released by [`release_all`](RunnerStorage::release_all), or expire, or are
    /// reported by the next `acquire`.
    fn acquire<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>>;

    /// Refreshes the heartbeat and confirms the locks on `shard_ids`.
    ///
    /// - It returns the subset still held.
    /// - It extends the leases of lease rows.
    /// - It never re-acquires a lost lock.
    /// - An empty list is a pure heartbeat: the probe used while lock storage is unhealthy.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped refresh is a missed refresh.
    fn refresh<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>>;

    /// Confirms the locks on `shard_ids`, as [`refresh`](RunnerStorage::refresh) does, without
    /// the heartbeat.
    ///
    /// - It returns the subset still held.
    /// - It extends the leases of lease rows.
    /// - Fencing asks it before final replies, many times a second; the refresh loop keeps the
    ///   heartbeat.
    ///   A heartbeat per reply would write the runner's one registry row each time.
    /// - The default refreshes.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as `refresh`.
    fn confirm<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        self.refresh(address, shard_ids)
    }

    /// Releases one lock, verified: `address` does not hold it afterwards.
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

    /// Lets go of the locks of `address`, a runner another one found gone: its address refuses
    /// connections, so no process of it runs (see `Transport::probe`).
    ///
    /// - Locks that end with their holder's database session (advisory locks) are gone already:
    ///   this does nothing, and must not touch the caller's own session.
    /// - Lease rows would count until they expire: they are deleted, so that the next owner
    ///   takes the shards at once.
    /// - The default does nothing: the locks then expire as they would.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent.
    fn release_gone<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        let _ = address;
        Box::pin(std::future::ready(Ok(())))
    }
}
