//! In-memory storages: [`MemoryMessageStorage`], [`MemoryRunnerStorage`] and
//! [`MemoryQueueStorage`] (in `queue`).
//!
//! They follow the SQL backends' semantics row for row (claims with the 10-minute window, the
//! exit and unacked-chunk filter, at most one final reply per request, leases that expire), so
//! that unit tests and simulations exercise the same rules as production; they pass the same
//! conformance suite ([`mod@crate::storage_suite`]). Unlike the reference's memory runner storage,
//! shard locks here are exclusive and expire, so several simulated runners can share one
//! [`MemoryRunnerDatabase`].
//!
//! Time comes from an injected [`Clock`] (the database clock of the SQL backends).
//!
//! Like the SQL storages, they refuse a value longer than their limit
//! ([`VALUE_BYTES_MAX_DEFAULT`] unless set otherwise) with
//! [`StorageErrorKind::InvalidInput`], measured on the JSON text a SQL storage would write, so
//! that simulations and workflow tests meet the limits production has.
//!
//! Entity states ([`cluster_core::entity_state`]) are rows keyed by entity type and id, with
//! the SQL storages' conditional writes. One difference: a state written in a transaction is
//! checked again at commit, and a commit that finds it stale fails (a SQL transaction would
//! instead hold the row, and the other writer would be the stale one).

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::encoded::{self, JsonForm};
use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{self, AckChunk, Envelope, Interrupt, RawJson, Reply, Request};
use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{
    self, Backlog, BacklogQuery, LockHolder, RequestQuery, RequestRecord, RunnerRecord, ShardLock,
};
use cluster_core::retention::{self, ProcessedQuery, ProcessedRequest, PurgeProcessed};
use cluster_core::storage::{
    CLAIM_WINDOW, MalformedMessage, MessageStorage, MessageTransaction, RunnerStorage,
    SaveRequestOptions, SaveResult, UnprocessedBatch, UnprocessedMessage, UnprocessedOptions,
};
use cluster_core::sync::lock;
use cluster_core::{
    Clock, EntityAddress, MachineId, Runner, RunnerAddress, ShardId, Snowflake, Timestamp,
};

use crate::storage_suite::{Corruption, StorageFixture};

mod queue;

pub use queue::{MemoryQueueFixture, MemoryQueueStorage};

fn ready<'a, T: Send + 'a>(value: T) -> BoxFuture<'a, T> {
    Box::pin(std::future::ready(value))
}

fn conflict(message: String) -> StorageError {
    StorageError::new(StorageErrorKind::Conflict, message)
}

/// The default limit of the memory storages' values: 16 MiB, the default of the SQL storages'
/// `SqlStorageOptions::value_bytes_max`.
pub const VALUE_BYTES_MAX_DEFAULT: usize = 16 * 1024 * 1024;

/// `value`, named `what` in the error, has at most `bytes_max` bytes; `setter` is how the
/// storage's limit is raised. The message is the SQL storages' own.
fn check_value(
    what: &str,
    value: &str,
    bytes_max: usize,
    setter: &str,
) -> Result<(), StorageError> {
    let len = value.len();
    if len <= bytes_max {
        return Ok(());
    }
    Err(StorageError::new(
        StorageErrorKind::InvalidInput,
        format!(
            "{what} has {len} bytes, over the limit of {bytes_max} bytes: raise {setter}, or \
             keep large values elsewhere and store a reference to them"
        ),
    ))
}

/// How [`MemoryMessageStorage`]'s limit is raised, for its errors.
const MESSAGE_SETTER: &str = "MemoryMessageStorage::with_value_bytes_max";

/// The request's payload and headers, as a SQL storage writes them, fit `bytes_max`.
fn check_request(request: &Request, bytes_max: usize) -> Result<(), StorageError> {
    if let Some(payload) = request.payload.json() {
        check_value("the request's payload", payload, bytes_max, MESSAGE_SETTER)?;
    }
    if let Some(headers) = request.headers.json() {
        check_value("the request's headers", headers, bytes_max, MESSAGE_SETTER)?;
    }
    Ok(())
}

/// The reply's payload, as a SQL storage writes it (the exit's JSON, or the chunk's array of
/// values), fits `bytes_max`.
fn check_reply_value(reply: &Reply, bytes_max: usize) -> Result<(), StorageError> {
    match reply {
        Reply::WithExit(with_exit) => {
            let payload = with_exit.exit.to_json();
            check_value("the reply's payload", &payload, bytes_max, MESSAGE_SETTER)
        }
        Reply::Chunk(chunk) => {
            let payload = encoded::values_to_json(chunk.values());
            check_value("the chunk's values", &payload, bytes_max, MESSAGE_SETTER)
        }
    }
}

/// The state's JSON text, as a SQL storage writes it (the undefined value as `null`), fits
/// `bytes_max`; its revision fits a SQL storage's `BIGINT`.
fn check_state_write(write: &StateWrite, bytes_max: usize) -> Result<(), StorageError> {
    if write.expected >= i64::MAX.unsigned_abs() {
        return Err(StorageError::new(
            StorageErrorKind::InvalidInput,
            format!(
                "the state of {} cannot be written at revision {}: revisions are BIGINTs",
                write.address, write.expected
            ),
        ));
    }
    match &write.value {
        Some(value) => {
            let what = format!("the state of {}", write.address);
            check_value(&what, value.json_or_null(), bytes_max, MESSAGE_SETTER)
        }
        None => Ok(()),
    }
}

/// The key of an entity's state row: its type and id (not its shard).
type StateKey = (String, String);

fn state_key(address: &EntityAddress) -> StateKey {
    (address.entity_type.as_str().to_owned(), address.entity_id.as_str().to_owned())
}

/// Whether `write` applies to a row at `revision` (0: no row): a deletion of no row applies
/// anywhere, any other write only at its expected revision.
fn state_applies(write: &StateWrite, revision: u64) -> Result<(), StorageError> {
    if (write.value.is_none() && write.expected == 0) || revision == write.expected {
        Ok(())
    } else {
        Err(write.stale())
    }
}

/// An entity's state row.
#[derive(Debug)]
struct StoredEntityState {
    /// The entity's shard at the last write, as the SQL storages keep it.
    shard_id: ShardId,
    value: RawJson,
    revision: u64,
    corrupted: bool,
}

#[derive(Debug)]
struct StoredMessage {
    envelope: Envelope,
    message_id: Option<String>,
    processed: bool,
    last_reply_id: Option<Snowflake>,
    last_read: Option<Timestamp>,
    deliver_at: Option<Timestamp>,
    corrupted: bool,
}

#[derive(Debug)]
struct StoredReply {
    reply: Reply,
    acked: bool,
    corrupted: bool,
}

#[derive(Debug, Default)]
struct MessageState {
    next_rowid: u64,
    /// Message rows by insertion order.
    messages: BTreeMap<u64, StoredMessage>,
    /// Message id → row (ids are unique, as the `id` primary key).
    message_rows: BTreeMap<Snowflake, u64>,
    /// Primary key (`message_id`) → row.
    primary_keys: BTreeMap<String, u64>,
    /// Reply rows by insertion order.
    replies: BTreeMap<u64, StoredReply>,
    reply_rows: BTreeMap<Snowflake, u64>,
    /// Entity states by entity type and id.
    states: BTreeMap<StateKey, StoredEntityState>,
}

impl MessageState {
    fn rowid(&mut self) -> u64 {
        self.next_rowid += 1;
        self.next_rowid
    }

    fn insert_message(&mut self, message: StoredMessage) -> Result<(), StorageError> {
        let id = message.envelope.id();
        if self.message_rows.contains_key(&id) {
            return Err(conflict(format!("message {id} already exists")));
        }
        let rowid = self.rowid();
        if let Some(message_id) = &message.message_id {
            self.primary_keys.insert(message_id.clone(), rowid);
        }
        self.message_rows.insert(id, rowid);
        self.messages.insert(rowid, message);
        Ok(())
    }

    fn message(&self, id: Snowflake) -> Option<&StoredMessage> {
        self.message_rows.get(&id).and_then(|rowid| self.messages.get(rowid))
    }

    fn reply(&self, id: Snowflake) -> Option<&StoredReply> {
        self.reply_rows.get(&id).and_then(|rowid| self.replies.get(rowid))
    }

    /// Whether the request has a final reply or an unacknowledged chunk
    /// (`effect/src/cluster/SqlMessageStorage.ts`).
    fn blocks_delivery(&self, request_id: Snowflake) -> bool {
        self.replies.values().any(|stored| {
            stored.reply.request_id() == request_id && (stored.reply.is_final() || !stored.acked)
        })
    }

    fn check_reply(&self, reply: &Reply) -> Result<(), StorageError> {
        let request_id = reply.request_id();
        if self.reply_rows.contains_key(&reply.id()) {
            return Err(conflict(format!("reply {} already exists", reply.id())));
        }
        let clash = self.replies.values().any(|stored| {
            stored.reply.request_id() == request_id
                && match (&stored.reply, reply) {
                    (Reply::WithExit(_), Reply::WithExit(_)) => true,
                    (Reply::Chunk(old), Reply::Chunk(new)) => old.sequence() == new.sequence(),
                    _ => false,
                }
        });
        if clash {
            return Err(conflict(format!("request {request_id} already has this reply")));
        }
        Ok(())
    }

    fn apply_reply(&mut self, reply: &Reply) {
        let request_id = reply.request_id();
        for message in self.messages.values_mut() {
            match reply {
                Reply::Chunk(_) if message.envelope.id() == request_id => {
                    message.last_reply_id = Some(reply.id());
                }
                Reply::WithExit(_) if message.envelope.request_id() == request_id => {
                    message.processed = true;
                    message.last_reply_id = Some(reply.id());
                }
                _ => {}
            }
        }
        let rowid = self.rowid();
        self.reply_rows.insert(reply.id(), rowid);
        self.replies
            .insert(rowid, StoredReply { reply: reply.clone(), acked: false, corrupted: false });
    }

    /// The revision of the entity's state row (0: none).
    fn state_revision(&self, key: &StateKey) -> u64 {
        self.states.get(key).map_or(0, |stored| stored.revision)
    }

    /// Applies a state write that [`state_applies`] accepted.
    fn apply_state(&mut self, write: &StateWrite) {
        let key = state_key(&write.address);
        match &write.value {
            Some(value) => {
                // Stored as the SQL storages store it: its JSON text, undefined as `null`.
                let value = if value.is_undefined() { RawJson::null() } else { value.clone() };
                let stored = StoredEntityState {
                    shard_id: write.address.shard_id.clone(),
                    value,
                    revision: write.revision_after(),
                    corrupted: false,
                };
                self.states.insert(key, stored);
            }
            None if write.expected > 0 => {
                self.states.remove(&key);
            }
            None => {}
        }
    }

    /// The replies to `request_ids` that `keep` accepts, in the order they were saved, as a
    /// reader sees them.
    fn replies_of(
        &self,
        request_ids: &[Snowflake],
        keep: impl Fn(&StoredReply) -> bool,
    ) -> Vec<Reply> {
        let wanted: BTreeSet<Snowflake> = request_ids.iter().copied().collect();
        self.replies
            .values()
            .filter(|stored| wanted.contains(&stored.reply.request_id()) && keep(stored))
            .map(MessageState::decoded_reply)
            .collect()
    }

    fn decoded_reply(stored: &StoredReply) -> Reply {
        if stored.corrupted {
            let error = DecodeError::new("reply", "corrupted by the test");
            return Reply::malformed(stored.reply.request_id(), stored.reply.id(), &error);
        }
        stored.reply.clone()
    }

    fn to_batch<'a>(&self, rows: impl IntoIterator<Item = &'a StoredMessage>) -> UnprocessedBatch {
        let mut batch = UnprocessedBatch::default();
        for message in rows {
            if message.corrupted {
                batch.malformed.push(MalformedMessage {
                    id: message.envelope.id(),
                    request_id: message.envelope.request_id(),
                    error: DecodeError::new("message row", "corrupted by the test"),
                });
                continue;
            }
            let last_sent_reply = match &message.envelope {
                Envelope::Request(_) => message
                    .last_reply_id
                    .and_then(|id| self.reply(id))
                    .map(|stored| stored.reply.clone()),
                _ => None,
            };
            batch
                .messages
                .push(UnprocessedMessage { envelope: message.envelope.clone(), last_sent_reply });
        }
        batch
    }

    fn deliverable(&self, message: &StoredMessage, now: Timestamp) -> bool {
        !message.processed
            && message.deliver_at.is_none_or(|at| at <= now)
            && !self.blocks_delivery(message.envelope.request_id())
    }

    /// The processed requests whose final reply's id is below `replied_before` and that
    /// `keep` accepts, in id order, each with its request row and final reply.
    fn processed(
        &self,
        replied_before: Snowflake,
        keep: impl Fn(&StoredMessage) -> bool,
    ) -> BTreeMap<Snowflake, (&StoredMessage, &StoredReply)> {
        self.replies
            .values()
            .filter(|stored| stored.reply.is_final() && stored.reply.id() < replied_before)
            .filter_map(|stored| {
                let request_id = stored.reply.request_id();
                let message = self.message(request_id)?;
                let is_request = matches!(message.envelope, Envelope::Request(_));
                (is_request && keep(message)).then_some((request_id, (message, stored)))
            })
            .collect()
    }

    /// Deletes every message and reply of `request_ids`.
    fn remove_requests(&mut self, request_ids: &BTreeSet<Snowflake>) {
        let messages: Vec<u64> = self
            .messages
            .iter()
            .filter(|(_, message)| request_ids.contains(&message.envelope.request_id()))
            .map(|(rowid, _)| *rowid)
            .collect();
        for rowid in messages {
            if let Some(message) = self.messages.remove(&rowid) {
                self.message_rows.remove(&message.envelope.id());
                if let Some(message_id) = &message.message_id {
                    self.primary_keys.remove(message_id);
                }
            }
        }
        let replies: Vec<(u64, Snowflake)> = self
            .replies
            .iter()
            .filter(|(_, stored)| request_ids.contains(&stored.reply.request_id()))
            .map(|(rowid, stored)| (*rowid, stored.reply.id()))
            .collect();
        for (rowid, id) in replies {
            self.replies.remove(&rowid);
            self.reply_rows.remove(&id);
        }
    }

    fn reset(&mut self, matches: impl Fn(&StoredMessage) -> bool) {
        for message in self.messages.values_mut().filter(|message| !message.processed) {
            if matches(message) {
                message.last_read = None;
            }
        }
    }
}

fn matches_address(message: &StoredMessage, address: &EntityAddress) -> bool {
    message.envelope.address() == address
}

/// An in-memory [`MessageStorage`].
#[derive(Debug)]
pub struct MemoryMessageStorage {
    state: Arc<Mutex<MessageState>>,
    clock: Arc<dyn Clock>,
    /// Calls of `unprocessed_messages`, for tests that check the read loop's pace.
    reads: AtomicUsize,
    /// The smallest `limit` those calls asked for (`u32::MAX` while none did).
    smallest_limit: AtomicU32,
    /// The most bytes of a payload, headers, reply or entity state.
    value_bytes_max: usize,
}

impl MemoryMessageStorage {
    /// An empty storage whose claims use `clock`, with values limited to
    /// [`VALUE_BYTES_MAX_DEFAULT`].
    pub fn new(clock: Arc<dyn Clock>) -> MemoryMessageStorage {
        MemoryMessageStorage {
            state: Arc::default(),
            clock,
            reads: AtomicUsize::new(0),
            smallest_limit: AtomicU32::new(u32::MAX),
            value_bytes_max: VALUE_BYTES_MAX_DEFAULT,
        }
    }

    /// The storage with values limited to `value_bytes_max` bytes, as
    /// `SqlStorageOptions::value_bytes_max` limits the SQL storages': a longer payload, headers,
    /// reply or entity state (measured as the JSON text a SQL storage writes) is refused with
    /// [`StorageErrorKind::InvalidInput`], and nothing of it is stored.
    #[must_use]
    pub fn with_value_bytes_max(self, value_bytes_max: usize) -> MemoryMessageStorage {
        MemoryMessageStorage { value_bytes_max, ..self }
    }

    /// The most bytes a stored value may have.
    pub fn value_bytes_max(&self) -> usize {
        self.value_bytes_max
    }

    /// How many times [`MessageStorage::unprocessed_messages`] was called.
    pub fn unprocessed_reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }

    /// The smallest `limit` a call of [`MessageStorage::unprocessed_messages`] asked for, if
    /// any asked for one.
    pub fn smallest_read_limit(&self) -> Option<u32> {
        let smallest = self.smallest_limit.load(Ordering::SeqCst);
        (smallest != u32::MAX).then_some(smallest)
    }

    /// The ids of the requests stored for `address`, in storage order (the order the storage
    /// read loop delivers them in): what a simulation compares the order of handler runs with.
    pub fn request_order(&self, address: &EntityAddress) -> Vec<Snowflake> {
        let state = lock(&self.state);
        state
            .messages
            .values()
            .filter(|message| matches!(message.envelope, Envelope::Request(_)))
            .filter(|message| matches_address(message, address))
            .map(|message| message.envelope.request_id())
            .collect()
    }

    /// What the storage holds for the entities whose id contains `entity_id` (messages in
    /// insertion order, each with its state and replies): a failing simulation's trace.
    pub fn describe(&self, entity_id: &str) -> Vec<String> {
        let state = lock(&self.state);
        let mut lines = Vec::new();
        for message in state.messages.values() {
            let address = message.envelope.address();
            if !address.entity_id.as_str().contains(entity_id) {
                continue;
            }
            let what = match &message.envelope {
                Envelope::Request(request) => {
                    format!("request {} {:?}", request.tag, request.payload)
                }
                Envelope::AckChunk(_) => "ack".to_owned(),
                Envelope::Interrupt(_) => "interrupt".to_owned(),
            };
            let request_id = message.envelope.request_id();
            let replies: Vec<String> = state
                .replies
                .values()
                .filter(|stored| stored.reply.request_id() == request_id)
                .map(|stored| format!("{:?}", stored.reply))
                .collect();
            lines.push(format!(
                "{} {address} key {:?}: {what}, processed {}, last read {:?}, deliver at {:?}, replies {replies:?}",
                message.envelope.id(),
                message.message_id,
                message.processed,
                message.last_read,
                message.deliver_at,
            ));
        }
        lines
    }

    /// Test hook: the message row `id` can no longer be decoded.
    pub fn corrupt_message(&self, id: Snowflake) {
        let mut state = lock(&self.state);
        if let Some(rowid) = state.message_rows.get(&id).copied()
            && let Some(message) = state.messages.get_mut(&rowid)
        {
            message.corrupted = true;
        }
    }

    /// Test hook: the state row of `address`'s entity (if any) can no longer be decoded, until
    /// it is written again.
    pub fn corrupt_state(&self, address: &EntityAddress) {
        if let Some(stored) = lock(&self.state).states.get_mut(&state_key(address)) {
            stored.corrupted = true;
        }
    }

    /// The shard kept in the state row of `address`'s entity, as an operator reads it.
    pub fn state_shard(&self, address: &EntityAddress) -> Option<ShardId> {
        lock(&self.state).states.get(&state_key(address)).map(|stored| stored.shard_id.clone())
    }

    /// Test hook: the reply row `id` can no longer be decoded.
    pub fn corrupt_reply(&self, id: Snowflake) {
        let mut state = lock(&self.state);
        if let Some(rowid) = state.reply_rows.get(&id).copied()
            && let Some(reply) = state.replies.get_mut(&rowid)
        {
            reply.corrupted = true;
        }
    }

    fn save_request_now(
        &self,
        request: &Request,
        options: &SaveRequestOptions,
    ) -> Result<SaveResult, StorageError> {
        check_request(request, self.value_bytes_max)?;
        let mut state = lock(&self.state);
        let message_id =
            options.primary_key.as_deref().map(|key| envelope::message_id(key).into_owned());
        if let Some(rowid) = message_id.as_ref().and_then(|key| state.primary_keys.get(key)) {
            let existing = &state.messages[rowid];
            let last_received_reply = existing
                .last_reply_id
                .and_then(|id| state.reply(id))
                .map(MessageState::decoded_reply);
            return Ok(SaveResult::Duplicate {
                original_id: existing.envelope.id(),
                last_received_reply,
            });
        }
        state.insert_message(StoredMessage {
            envelope: Envelope::Request(request.clone()),
            message_id,
            processed: false,
            last_reply_id: None,
            last_read: None,
            deliver_at: options.deliver_at,
            corrupted: false,
        })?;
        Ok(SaveResult::Success)
    }

    fn save_ack_now(&self, ack: &AckChunk) -> Result<(), StorageError> {
        let mut state = lock(&self.state);
        if state.message_rows.contains_key(&ack.id) {
            return Err(conflict(format!("message {} already exists", ack.id)));
        }
        if let Some(rowid) = state.reply_rows.get(&ack.reply_id).copied()
            && let Some(reply) = state.replies.get_mut(&rowid)
        {
            reply.acked = true;
        }
        for message in state.messages.values_mut() {
            if !message.processed
                && message.envelope.request_id() == ack.request_id
                && matches!(message.envelope, Envelope::AckChunk(_))
            {
                message.processed = true;
            }
        }
        state.insert_message(plain(Envelope::AckChunk(ack.clone())))
    }

    fn save_reply_now(&self, reply: &Reply) -> Result<(), StorageError> {
        check_reply_value(reply, self.value_bytes_max)?;
        let mut state = lock(&self.state);
        state.check_reply(reply)?;
        state.apply_reply(reply);
        Ok(())
    }

    /// One batch of `purge_processed`, under the lock: the chosen requests go at once.
    fn purge_processed_now(&self, batch: &PurgeProcessed) -> Result<u64, StorageError> {
        if batch.limit == 0 {
            return Err(retention::zero_limit("purge_processed"));
        }
        let mut state = lock(&self.state);
        let limit = usize::try_from(batch.limit).unwrap_or(usize::MAX);
        let chosen: BTreeSet<Snowflake> = state
            .processed(batch.replied_before, |message| {
                let entity_type = message.envelope.address().entity_type.as_str();
                message.processed
                    && !batch
                        .keep_entity_type_prefixes
                        .iter()
                        .any(|prefix| entity_type.starts_with(prefix.as_str()))
            })
            .into_keys()
            .take(limit)
            .collect();
        state.remove_requests(&chosen);
        Ok(u64::try_from(chosen.len()).unwrap_or(u64::MAX))
    }

    /// `processed_requests`: a corrupted final reply reads as a defect, as `replies_for` reads
    /// it.
    fn processed_requests_now(
        &self,
        query: &ProcessedQuery,
    ) -> Result<Vec<ProcessedRequest>, StorageError> {
        if query.limit == 0 {
            return Err(retention::zero_limit("processed_requests"));
        }
        let state = lock(&self.state);
        let limit = usize::try_from(query.limit).unwrap_or(usize::MAX);
        let processed = state.processed(query.replied_before, |message| {
            let Envelope::Request(request) = &message.envelope else { return false };
            request.address.entity_type.as_str().starts_with(query.entity_type_prefix.as_str())
                && query.tag.as_ref().is_none_or(|tag| request.tag.as_str() == tag.as_str())
                && query.after.is_none_or(|after| request.request_id > after)
        });
        let mut listed = Vec::new();
        for (request_id, (message, stored)) in processed.into_iter().take(limit) {
            let Envelope::Request(request) = &message.envelope else { continue };
            let Reply::WithExit(reply) = MessageState::decoded_reply(stored) else {
                return Err(StorageError::new(
                    StorageErrorKind::Malformed,
                    format!("the final reply of request {request_id} is a chunk"),
                ));
            };
            listed.push(ProcessedRequest {
                request_id,
                address: request.address.clone(),
                tag: request.tag.as_str().to_owned(),
                payload: Some(request.payload.clone()),
                reply,
            });
        }
        Ok(listed)
    }

    /// `backlog`: the unprocessed messages grouped by entity type and shard.
    fn backlog_now(&self, query: &BacklogQuery) -> Result<Vec<Backlog>, StorageError> {
        inspect::check_limit("backlog", query.limit)?;
        let stale_before = self.clock.now().saturating_sub(query.stale_after);
        let state = lock(&self.state);
        let mut groups: BTreeMap<(String, ShardId), Backlog> = BTreeMap::new();
        for message in state.messages.values().filter(|message| !message.processed) {
            let address = message.envelope.address();
            let key = (address.entity_type.as_str().to_owned(), address.shard_id.clone());
            let group = groups.entry(key).or_insert_with(|| Backlog {
                entity_type: address.entity_type.as_str().to_owned(),
                shard_id: address.shard_id.clone(),
                due: 0,
                scheduled: 0,
                claimed: 0,
                stale_claims: 0,
                waiting_since: None,
            });
            let id_time = message.envelope.id().timestamp();
            let waiting_since = match message.deliver_at {
                None => id_time,
                Some(at) if at <= query.now => at.max(id_time),
                Some(_) => {
                    group.scheduled += 1;
                    continue;
                }
            };
            group.due += 1;
            group.waiting_since =
                Some(group.waiting_since.map_or(waiting_since, |since| since.min(waiting_since)));
            if let Some(read) = message.last_read {
                group.claimed += 1;
                if read < stale_before {
                    group.stale_claims += 1;
                }
            }
        }
        let mut listed: Vec<Backlog> = groups.into_values().collect();
        // The longest wait first; groups with nothing due last.
        listed.sort_by_key(|group| (group.waiting_since.is_none(), group.waiting_since));
        listed.truncate(usize::try_from(query.limit).unwrap_or(usize::MAX));
        Ok(listed)
    }

    /// `requests`: a corrupted payload is left out, a corrupted final reply reads as a defect.
    fn requests_now(&self, query: &RequestQuery) -> Result<Vec<RequestRecord>, StorageError> {
        inspect::check_limit("requests", query.limit)?;
        let state = lock(&self.state);
        let mut listed: Vec<RequestRecord> = Vec::new();
        for message in state.messages.values() {
            let Envelope::Request(request) = &message.envelope else { continue };
            let tag = request.tag.as_str();
            if !query.matches(request.request_id, &request.address, tag, message.processed) {
                continue;
            }
            let reply = state
                .replies
                .values()
                .find(|stored| {
                    stored.reply.request_id() == request.request_id && stored.reply.is_final()
                })
                .and_then(|stored| match MessageState::decoded_reply(stored) {
                    Reply::WithExit(reply) => Some(reply),
                    Reply::Chunk(_) => None,
                });
            let interrupted = state.messages.values().any(|other| {
                matches!(&other.envelope, Envelope::Interrupt(interrupt)
                    if interrupt.request_id == request.request_id)
            });
            listed.push(RequestRecord {
                request_id: request.request_id,
                address: request.address.clone(),
                shard_id: request.address.shard_id.clone(),
                tag: tag.to_owned(),
                payload: (!message.corrupted).then(|| request.payload.clone()),
                processed: message.processed,
                claimed: !message.processed && message.last_read.is_some(),
                deliver_at: message.deliver_at,
                interrupted,
                reply,
            });
        }
        listed.sort_by_key(|record| record.request_id);
        if query.newest_first {
            listed.reverse();
        }
        listed.truncate(usize::try_from(query.limit).unwrap_or(usize::MAX));
        Ok(listed)
    }

    fn load_state_now(&self, address: &EntityAddress) -> Result<Option<StoredState>, StorageError> {
        let state = lock(&self.state);
        let Some(stored) = state.states.get(&state_key(address)) else { return Ok(None) };
        if stored.corrupted {
            return Err(StorageError::new(
                StorageErrorKind::Malformed,
                format!("the stored state of {address} is not JSON (corrupted by the test)"),
            ));
        }
        Ok(Some(StoredState { value: stored.value.clone(), revision: stored.revision }))
    }

    fn save_state_now(&self, write: &StateWrite) -> Result<(), StorageError> {
        check_state_write(write, self.value_bytes_max)?;
        let mut state = lock(&self.state);
        state_applies(write, state.state_revision(&state_key(&write.address)))?;
        state.apply_state(write);
        Ok(())
    }

    fn save_reply_with_state_now(
        &self,
        reply: &Reply,
        write: &StateWrite,
    ) -> Result<(), StorageError> {
        check_reply_value(reply, self.value_bytes_max)?;
        check_state_write(write, self.value_bytes_max)?;
        let mut state = lock(&self.state);
        // The state first, as the SQL storages write it: a stale one stores no reply.
        state_applies(write, state.state_revision(&state_key(&write.address)))?;
        state.check_reply(reply)?;
        state.apply_state(write);
        state.apply_reply(reply);
        Ok(())
    }

    fn clear_replies_now(&self, request_id: Snowflake, expected: Option<Snowflake>) {
        let mut state = lock(&self.state);
        if let Some(expected) = expected
            && state.message(request_id).and_then(|message| message.last_reply_id) != Some(expected)
        {
            return;
        }
        let final_reply = state.replies.iter().find_map(|(rowid, stored)| {
            (stored.reply.request_id() == request_id && stored.reply.is_final()).then_some(*rowid)
        });
        if let Some(rowid) = final_reply
            && let Some(stored) = state.replies.remove(&rowid)
        {
            state.reply_rows.remove(&stored.reply.id());
        }
        if expected.is_none() {
            let interrupts: Vec<(u64, Snowflake)> = state
                .messages
                .iter()
                .filter(|(_, message)| {
                    message.envelope.request_id() == request_id
                        && matches!(message.envelope, Envelope::Interrupt(_))
                })
                .map(|(rowid, message)| (*rowid, message.envelope.id()))
                .collect();
            for (rowid, id) in interrupts {
                state.messages.remove(&rowid);
                state.message_rows.remove(&id);
            }
        }
        for message in state.messages.values_mut() {
            let selected = message.envelope.request_id() == request_id
                && expected.is_none_or(|expected| message.last_reply_id == Some(expected));
            if selected {
                message.processed = false;
                message.last_reply_id = None;
                message.last_read = None;
            }
        }
    }

    fn unprocessed_now(
        &self,
        shard_ids: &[ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'_>,
    ) -> UnprocessedBatch {
        if shard_ids.is_empty() || options.addresses.is_some_and(<[EntityAddress]>::is_empty) {
            return UnprocessedBatch::default();
        }
        let database_now = self.clock.now();
        let claim_expired_before = database_now.saturating_sub(CLAIM_WINDOW);
        let limit = options
            .limit
            .map_or(usize::MAX, |limit| usize::try_from(limit.get()).unwrap_or(usize::MAX));
        let mut state = lock(&self.state);
        let claimed: Vec<u64> = state
            .messages
            .iter()
            .filter(|(_, message)| {
                let address = message.envelope.address();
                shard_ids.contains(&address.shard_id)
                    && options.addresses.is_none_or(|addresses| addresses.contains(address))
                    && message.last_read.is_none_or(|read| read < claim_expired_before)
                    && state.deliverable(message, now)
            })
            .map(|(rowid, _)| *rowid)
            .take(limit)
            .collect();
        for rowid in &claimed {
            if let Some(message) = state.messages.get_mut(rowid) {
                message.last_read = Some(database_now);
            }
        }
        state.to_batch(claimed.iter().filter_map(|rowid| state.messages.get(rowid)))
    }
}

fn plain(envelope: Envelope) -> StoredMessage {
    StoredMessage {
        envelope,
        message_id: None,
        processed: false,
        last_reply_id: None,
        last_read: None,
        deliver_at: None,
        corrupted: false,
    }
}

impl MessageStorage for MemoryMessageStorage {
    fn backend_name(&self) -> &'static str {
        "memory"
    }

    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>> {
        ready(self.save_request_now(request, options))
    }

    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>> {
        ready(self.save_ack_now(ack))
    }

    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        ready(lock(&self.state).insert_message(plain(Envelope::Interrupt(interrupt.clone()))))
    }

    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        ready(self.save_reply_now(reply))
    }

    fn clear_replies(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> BoxFuture<'_, Result<(), StorageError>> {
        self.clear_replies_now(request_id, expected_reply_id);
        ready(Ok(()))
    }

    fn request_id_for_primary_key<'a>(
        &'a self,
        primary_key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Snowflake>, StorageError>> {
        let state = lock(&self.state);
        let message_id = envelope::message_id(primary_key);
        let id = state
            .primary_keys
            .get(message_id.as_ref())
            .map(|rowid| state.messages[rowid].envelope.id());
        ready(Ok(id))
    }

    fn replies_for<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        let unacked = |stored: &StoredReply| stored.reply.is_final() || !stored.acked;
        ready(Ok(lock(&self.state).replies_of(request_ids, unacked)))
    }

    fn replies_for_unfiltered<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        ready(Ok(lock(&self.state).replies_of(request_ids, |_| true)))
    }

    fn unprocessed_messages<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'a>,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if let Some(limit) = options.limit {
            self.smallest_limit.fetch_min(limit.get(), Ordering::SeqCst);
        }
        ready(Ok(self.unprocessed_now(shard_ids, now, options)))
    }

    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        let state = lock(&self.state);
        let wanted: BTreeSet<&Snowflake> = ids.iter().collect();
        let rows = state.messages.values().filter(|message| {
            wanted.contains(&message.envelope.id()) && state.deliverable(message, now)
        });
        ready(Ok(state.to_batch(rows)))
    }

    fn unprocessed_before<'a>(
        &'a self,
        address: &'a EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: NonZeroU32,
    ) -> BoxFuture<'a, Result<Vec<Snowflake>, StorageError>> {
        let state = lock(&self.state);
        let Some(&row) = state.message_rows.get(&request_id) else {
            return ready(Ok(Vec::new()));
        };
        let limit = usize::try_from(limit.get()).unwrap_or(usize::MAX);
        let earlier = state
            .messages
            .range(..row)
            .map(|(_, message)| message)
            .filter(|message| {
                matches!(message.envelope, Envelope::Request(_))
                    && matches_address(message, address)
                    && !message.processed
                    && message.deliver_at.is_none_or(|at| at <= now)
            })
            .map(|message| message.envelope.id())
            .take(limit)
            .collect();
        ready(Ok(earlier))
    }

    fn reset_requests<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        lock(&self.state).reset(|message| request_ids.contains(&message.envelope.request_id()));
        ready(Ok(()))
    }

    fn reset_addresses<'a>(
        &'a self,
        addresses: &'a [EntityAddress],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        lock(&self.state)
            .reset(|message| addresses.iter().any(|address| matches_address(message, address)));
        ready(Ok(()))
    }

    fn reset_shards<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        lock(&self.state).reset(|message| shard_ids.contains(&message.envelope.address().shard_id));
        ready(Ok(()))
    }

    fn clear_address<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        let mut state = lock(&self.state);
        // Every message of the entity belongs to one of its requests: deleting those requests
        // deletes them, with their replies.
        let request_ids: BTreeSet<Snowflake> = state
            .messages
            .values()
            .filter(|message| {
                let candidate = message.envelope.address();
                candidate.entity_type == address.entity_type
                    && candidate.entity_id == address.entity_id
            })
            .map(|message| message.envelope.request_id())
            .collect();
        state.remove_requests(&request_ids);
        ready(Ok(()))
    }

    fn purge_processed<'a>(
        &'a self,
        batch: &'a PurgeProcessed,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        ready(self.purge_processed_now(batch))
    }

    fn processed_requests<'a>(
        &'a self,
        query: &'a ProcessedQuery,
    ) -> BoxFuture<'a, Result<Vec<ProcessedRequest>, StorageError>> {
        ready(self.processed_requests_now(query))
    }

    fn backlog<'a>(
        &'a self,
        query: &'a BacklogQuery,
    ) -> BoxFuture<'a, Result<Vec<Backlog>, StorageError>> {
        ready(self.backlog_now(query))
    }

    fn requests<'a>(
        &'a self,
        query: &'a RequestQuery,
    ) -> BoxFuture<'a, Result<Vec<RequestRecord>, StorageError>> {
        ready(self.requests_now(query))
    }

    fn load_state<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<Option<StoredState>, StorageError>> {
        ready(self.load_state_now(address))
    }

    fn save_state<'a>(&'a self, write: &'a StateWrite) -> BoxFuture<'a, Result<(), StorageError>> {
        ready(self.save_state_now(write))
    }

    fn save_reply_with_state<'a>(
        &'a self,
        reply: &'a Reply,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        ready(self.save_reply_with_state_now(reply, write))
    }

    fn begin_transaction(
        &self,
    ) -> BoxFuture<'_, Result<Box<dyn MessageTransaction>, StorageError>> {
        let transaction = MemoryTransaction {
            state: Arc::clone(&self.state),
            value_bytes_max: self.value_bytes_max,
            pending: Vec::new(),
            savepoint: None,
            handle: (),
        };
        ready(Ok(Box::new(transaction) as Box<dyn MessageTransaction>))
    }
}

/// A transaction of [`MemoryMessageStorage`]: replies and states are held and applied
/// together at commit.
struct MemoryTransaction {
    state: Arc<Mutex<MessageState>>,
    value_bytes_max: usize,
    pending: Vec<Pending>,
    /// How many writes were pending at the savepoint.
    savepoint: Option<usize>,
    handle: (),
}

/// A write of a [`MemoryTransaction`], applied at commit.
enum Pending {
    Reply(Reply),
    State(StateWrite),
}

/// The revisions the pending state writes leave (0: deleted), where they wrote: over the
/// stored ones, what the transaction sees. A deletion of no row writes nothing.
fn revisions_after<'a>(pending: impl IntoIterator<Item = &'a Pending>) -> BTreeMap<StateKey, u64> {
    let mut revisions = BTreeMap::new();
    for write in pending {
        if let Pending::State(write) = write
            && (write.value.is_some() || write.expected > 0)
        {
            revisions.insert(state_key(&write.address), write.revision_after());
        }
    }
    revisions
}

impl MemoryTransaction {
    /// Checks the pending writes in order against the stored rows, as commit applies them.
    fn check_pending(&self, state: &MessageState) -> Result<(), StorageError> {
        let mut revisions: BTreeMap<StateKey, u64> = BTreeMap::new();
        for write in &self.pending {
            match write {
                Pending::Reply(reply) => state.check_reply(reply)?,
                Pending::State(write) => {
                    let key = state_key(&write.address);
                    let revision =
                        revisions.get(&key).copied().unwrap_or_else(|| state.state_revision(&key));
                    state_applies(write, revision)?;
                    if write.value.is_some() || write.expected > 0 {
                        revisions.insert(key, write.revision_after());
                    }
                }
            }
        }
        Ok(())
    }
}

impl MessageTransaction for MemoryTransaction {
    fn save_reply<'a>(&'a mut self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        if let Err(refused) = check_reply_value(reply, self.value_bytes_max) {
            return ready(Err(refused));
        }
        let checked = lock(&self.state).check_reply(reply);
        if checked.is_ok() {
            self.pending.push(Pending::Reply(reply.clone()));
        }
        ready(checked)
    }

    fn save_state<'a>(
        &'a mut self,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        if let Err(refused) = check_state_write(write, self.value_bytes_max) {
            return ready(Err(refused));
        }
        let checked = {
            let state = lock(&self.state);
            let key = state_key(&write.address);
            // The transaction sees its own writes.
            let revision = revisions_after(&self.pending)
                .get(&key)
                .copied()
                .unwrap_or_else(|| state.state_revision(&key));
            state_applies(write, revision)
        };
        if checked.is_ok() {
            self.pending.push(Pending::State(write.clone()));
        }
        ready(checked)
    }

    fn backend(&mut self) -> &mut (dyn Any + Send) {
        &mut self.handle
    }

    fn savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        self.savepoint = Some(self.pending.len());
        ready(Ok(()))
    }

    fn rollback_to_savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        let Some(savepoint) = self.savepoint else {
            return ready(Err(StorageError::new(
                StorageErrorKind::Other,
                "rollback to a savepoint in a transaction without one",
            )));
        };
        self.pending.truncate(savepoint);
        ready(Ok(()))
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        let mut state = lock(&self.state);
        if let Err(error) = self.check_pending(&state) {
            return ready(Err(error));
        }
        for write in &self.pending {
            match write {
                Pending::Reply(reply) => state.apply_reply(reply),
                Pending::State(write) => state.apply_state(write),
            }
        }
        ready(Ok(()))
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        ready(Ok(()))
    }
}

#[derive(Debug)]
struct RunnerRow {
    runner: Runner,
    healthy: bool,
    heartbeat: Timestamp,
    machine_id: MachineId,
}

#[derive(Debug)]
struct RunnerState {
    next_machine_id: i32,
    runners: BTreeMap<RunnerAddress, RunnerRow>,
    /// Shard → (holder, acquired at).
    locks: BTreeMap<ShardId, (RunnerAddress, Timestamp)>,
}

/// The shared state behind [`MemoryRunnerStorage`] handles: a runner registry and lease
/// table, as one database would hold them.
#[derive(Debug)]
pub struct MemoryRunnerDatabase {
    state: Mutex<RunnerState>,
    clock: Arc<dyn Clock>,
}

impl MemoryRunnerDatabase {
    /// An empty database whose heartbeats and leases use `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Arc<MemoryRunnerDatabase> {
        Arc::new(MemoryRunnerDatabase {
            state: Mutex::new(RunnerState {
                next_machine_id: 1,
                runners: BTreeMap::new(),
                locks: BTreeMap::new(),
            }),
            clock,
        })
    }
}

impl MemoryRunnerDatabase {
    /// The runner whose lease on `shard` is live now (leases last `expiration` from their
    /// last refresh), as the database sees it.
    pub fn lock_holder(&self, shard: &ShardId, expiration: Duration) -> Option<RunnerAddress> {
        let expired_before = self.clock.now().saturating_sub(expiration);
        let state = lock(&self.state);
        state
            .locks
            .get(shard)
            .filter(|(_, refreshed)| *refreshed > expired_before)
            .map(|(holder, _)| holder.clone())
    }
}

/// An in-memory [`RunnerStorage`]: one runner's handle on a [`MemoryRunnerDatabase`]. Leases
/// and heartbeats older than its expiration are expired.
#[derive(Debug, Clone)]
pub struct MemoryRunnerStorage {
    database: Arc<MemoryRunnerDatabase>,
    expiration: Duration,
}

impl MemoryRunnerStorage {
    /// A handle on `database` whose leases and heartbeats last `expiration`.
    pub fn new(database: Arc<MemoryRunnerDatabase>, expiration: Duration) -> MemoryRunnerStorage {
        MemoryRunnerStorage { database, expiration }
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut RunnerState, Timestamp, Timestamp) -> T) -> T {
        let now = self.database.clock.now();
        let expired_before = now.saturating_sub(self.expiration);
        f(&mut lock(&self.database.state), now, expired_before)
    }
}

impl RunnerStorage for MemoryRunnerStorage {
    fn backend_name(&self) -> &'static str {
        "memory"
    }

    fn register<'a>(
        &'a self,
        runner: &'a Runner,
        healthy: bool,
    ) -> BoxFuture<'a, Result<MachineId, StorageError>> {
        let machine_id = self.with_state(|state, now, _| {
            let next = &mut state.next_machine_id;
            let row = state.runners.entry(runner.address.clone()).or_insert_with(|| {
                let machine_id = MachineId::new(*next);
                *next += 1;
                RunnerRow { runner: runner.clone(), healthy, heartbeat: now, machine_id }
            });
            row.runner = runner.clone();
            row.healthy = healthy;
            row.heartbeat = now;
            row.machine_id
        });
        ready(Ok(machine_id))
    }

    fn unregister<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.with_state(|state, _, expired_before| {
            state
                .runners
                .retain(|candidate, row| candidate != address && row.heartbeat >= expired_before);
        });
        ready(Ok(()))
    }

    fn get_runners(&self) -> BoxFuture<'_, Result<Vec<(Runner, bool)>, StorageError>> {
        let runners = self.with_state(|state, _, expired_before| {
            state
                .runners
                .values()
                .filter(|row| row.heartbeat > expired_before)
                .map(|row| (row.runner.clone(), row.healthy))
                .collect()
        });
        ready(Ok(runners))
    }

    fn runner_records(&self) -> BoxFuture<'_, Result<Vec<RunnerRecord>, StorageError>> {
        let records = self.with_state(|state, now, expired_before| {
            state
                .runners
                .values()
                .map(|row| RunnerRecord {
                    runner: row.runner.clone(),
                    machine_id: row.machine_id,
                    healthy: row.healthy,
                    heartbeat_age: now.saturating_duration_since(row.heartbeat),
                    alive: row.heartbeat > expired_before,
                })
                .collect()
        });
        ready(Ok(records))
    }

    fn shard_locks<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardLock>, StorageError>> {
        let wanted: BTreeSet<&ShardId> = shard_ids.iter().collect();
        let locks = self.with_state(|state, now, expired_before| {
            state
                .locks
                .iter()
                .filter(|(shard, _)| wanted.contains(shard))
                .map(|(shard, (holder, refreshed))| ShardLock {
                    shard_id: shard.clone(),
                    holder: LockHolder::Runner(holder.clone()),
                    lease_age: Some(now.saturating_duration_since(*refreshed)),
                    expired: *refreshed < expired_before,
                })
                .collect()
        });
        ready(Ok(locks))
    }

    fn set_runner_health<'a>(
        &'a self,
        address: &'a RunnerAddress,
        healthy: bool,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.with_state(|state, _, _| {
            if let Some(row) = state.runners.get_mut(address) {
                row.healthy = healthy;
            }
        });
        ready(Ok(()))
    }

    fn acquire<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        let acquired = self.with_state(|state, now, expired_before| {
            let mut acquired = Vec::new();
            for shard in shard_ids {
                let free = match state.locks.get(shard) {
                    None => true,
                    Some((holder, acquired_at)) => {
                        holder == address || *acquired_at < expired_before
                    }
                };
                if free {
                    state.locks.insert(shard.clone(), (address.clone(), now));
                    acquired.push(shard.clone());
                }
            }
            acquired
        });
        ready(Ok(acquired))
    }

    fn refresh<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<Vec<ShardId>, StorageError>> {
        let held = self.with_state(|state, now, _| {
            if let Some(row) = state.runners.get_mut(address) {
                row.heartbeat = now;
            }
            let mut held = Vec::new();
            for shard in shard_ids {
                if let Some((holder, acquired_at)) = state.locks.get_mut(shard)
                    && holder == address
                {
                    *acquired_at = now;
                    held.push(shard.clone());
                }
            }
            held
        });
        ready(Ok(held))
    }

    fn release<'a>(
        &'a self,
        address: &'a RunnerAddress,
        shard_id: &'a ShardId,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.with_state(|state, _, _| {
            if state.locks.get(shard_id).is_some_and(|(holder, _)| holder == address) {
                state.locks.remove(shard_id);
            }
        });
        ready(Ok(()))
    }

    fn release_all<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.with_state(|state, _, _| state.locks.retain(|_, (holder, _)| holder != address));
        ready(Ok(()))
    }

    /// Leases, as lease rows: deleted.
    fn release_gone<'a>(
        &'a self,
        address: &'a RunnerAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        self.release_all(address)
    }
}

/// The conformance-suite fixture of the memory storages.
#[derive(Debug)]
pub struct MemoryFixture {
    messages: Arc<MemoryMessageStorage>,
    runners: Arc<MemoryRunnerDatabase>,
}

impl MemoryFixture {
    /// Fresh memory storages on `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> MemoryFixture {
        MemoryFixture {
            messages: Arc::new(MemoryMessageStorage::new(Arc::clone(&clock))),
            runners: MemoryRunnerDatabase::new(clock),
        }
    }
}

impl StorageFixture for MemoryFixture {
    fn name(&self) -> &str {
        "memory"
    }

    fn message_storage(&self) -> Arc<dyn MessageStorage> {
        Arc::clone(&self.messages) as Arc<dyn MessageStorage>
    }

    fn runner_storage(&self, expiration: Duration) -> BoxFuture<'_, Arc<dyn RunnerStorage>> {
        let storage = MemoryRunnerStorage::new(Arc::clone(&self.runners), expiration);
        ready(Arc::new(storage) as Arc<dyn RunnerStorage>)
    }

    fn value_bytes_max(&self) -> usize {
        self.messages.value_bytes_max()
    }

    fn corrupt(&self, corruption: Corruption) -> BoxFuture<'_, ()> {
        match corruption {
            Corruption::MessagePayload(id) => self.messages.corrupt_message(id),
            Corruption::ReplyPayload(id) => self.messages.corrupt_reply(id),
            Corruption::StateValue(address) => self.messages.corrupt_state(&address),
        }
        ready(())
    }

    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
        ready(())
    }
}
