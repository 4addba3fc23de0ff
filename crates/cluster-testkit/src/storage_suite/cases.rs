//! The conformance cases. Each takes a fixture with fresh tables and panics on a violation.
//!
//! Ids are small snowflakes in increasing order, so that insertion order and id order agree
//! on every backend (SQLite orders by id, the others by an auto-increment row id).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use cluster_core::encoded::{JsonForm, values_to_json};
use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{
    AckChunk, CauseReason, Chunk, Envelope, Exit, Interrupt, RawJson, Reply, Request, TraceContext,
    WithExit, primary_key,
};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::ids::RunnerWeight;
use cluster_core::inspect::{
    Backlog, BacklogQuery, LIMIT_MAX, LockHolder, RequestQuery, RequestRecord, ShardLock,
};
use cluster_core::retention::{
    ProcessedQuery, ProcessedRequest, PurgeProcessed, WORKFLOW_ENTITY_TYPE_PREFIX, replied_before,
};
use cluster_core::snowflake::{EPOCH, SnowflakeParts};
use cluster_core::storage::{
    MessageStorage, SaveRequestOptions, SaveResult, UnprocessedBatch, UnprocessedOptions,
};
use cluster_core::{
    Clock, EntityAddress, EntityId, EntityType, MachineId, Runner, RunnerAddress, ShardGroup,
    ShardId, Snowflake, SystemClock, Timestamp,
};

use super::{Corruption, StorageFixture};

/// How long a case waits for an eventual condition (a lease expiring) before failing.
const EVENTUAL: Duration = Duration::from_secs(30);
/// The lease expiration of cases that are not about expiry.
const LONG_EXPIRATION: Duration = Duration::from_secs(60);
/// The lease expiration of cases that wait for expiry.
const SHORT_EXPIRATION: Duration = Duration::from_secs(2);

fn shard(id: u32) -> ShardId {
    ShardId::new(ShardGroup::from("default"), id)
}

fn address(entity_id: &str, shard_id: u32) -> EntityAddress {
    EntityAddress {
        shard_id: shard(shard_id),
        entity_type: EntityType::from("TestEntity"),
        entity_id: EntityId::from(entity_id),
    }
}

fn request_to(id: u64, address: EntityAddress) -> Request {
    Request {
        request_id: Snowflake::new(id),
        address,
        tag: "GetUser".into(),
        payload: RawJson::from_json(format!(r#"{{"id":{id},"name":"user \"{id}\""}}"#)).unwrap(),
        headers: RawJson::from_json(r#"{"x-test":"1"}"#.to_owned()).unwrap(),
        trace: TraceContext::default(),
    }
}

/// A request with id `id` to entity `e<entity>` on shard 1.
fn request(id: u64, entity: u32) -> Request {
    request_to(id, address(&format!("e{entity}"), 1))
}

fn key_of(request: &Request, key: &str) -> SaveRequestOptions {
    SaveRequestOptions {
        primary_key: Some(primary_key(&request.address, &request.tag, key)),
        deliver_at: None,
    }
}

async fn save(storage: &dyn MessageStorage, request: &Request) {
    let result = storage.save_request(request, &SaveRequestOptions::default()).await.unwrap();
    assert_eq!(result, SaveResult::Success, "saving {:?}", request.request_id);
}

async fn save_keyed(storage: &dyn MessageStorage, request: &Request, key: &str) -> SaveResult {
    storage.save_request(request, &key_of(request, key)).await.unwrap()
}

fn final_reply(request_id: u64, id: u64) -> Reply {
    Reply::WithExit(WithExit {
        request_id: Snowflake::new(request_id),
        id: Snowflake::new(id),
        exit: Exit::Success(RawJson::from_json(format!(r#"{{"reply":{id}}}"#)).unwrap()),
    })
}

fn chunk(request_id: u64, id: u64, sequence: u32) -> Reply {
    let value = RawJson::from_json(sequence.to_string()).unwrap();
    Reply::Chunk(
        Chunk::new(Snowflake::new(request_id), Snowflake::new(id), sequence, vec![value]).unwrap(),
    )
}

fn ack(id: u64, request: &Request, reply_id: u64) -> AckChunk {
    AckChunk {
        id: Snowflake::new(id),
        address: request.address.clone(),
        request_id: request.request_id,
        reply_id: Snowflake::new(reply_id),
    }
}

fn now() -> Timestamp {
    SystemClock.now()
}

async fn read(storage: &dyn MessageStorage, shards: &[ShardId]) -> UnprocessedBatch {
    storage.unprocessed_messages(shards, now(), UnprocessedOptions::default()).await.unwrap()
}

/// The envelope ids of an unprocessed read of shard 1, asserting nothing was malformed.
async fn read_ids(storage: &dyn MessageStorage) -> Vec<u64> {
    ids(&read(storage, &[shard(1)]).await)
}

fn ids(batch: &UnprocessedBatch) -> Vec<u64> {
    assert!(batch.malformed.is_empty(), "malformed rows: {:?}", batch.malformed);
    batch.messages.iter().map(|message| message.envelope.id().get()).collect()
}

fn reply_ids(replies: &[Reply]) -> Vec<u64> {
    replies.iter().map(|reply| reply.id().get()).collect()
}

fn snowflakes(ids: &[u64]) -> Vec<Snowflake> {
    ids.iter().copied().map(Snowflake::new).collect()
}

fn runner(host: &str) -> Runner {
    Runner::new(
        RunnerAddress::new(host, 34431),
        vec![ShardGroup::from("default")],
        RunnerWeight::ONE,
    )
}

fn sorted(mut shards: Vec<ShardId>) -> Vec<ShardId> {
    shards.sort();
    shards
}

fn shards(ids: &[u32]) -> Vec<ShardId> {
    ids.iter().copied().map(shard).collect()
}

// --- Messages -----------------------------------------------------------------------------------

/// A saved request reads back exactly as it was saved.
pub async fn save_request_then_read_it(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let mut traced = request(1, 1);
    traced.trace = TraceContext {
        trace_id: Some("trace".to_owned()),
        span_id: Some("span".to_owned()),
        sampled: Some(true),
    };
    save(&*storage, &traced).await;
    let void = Request { payload: RawJson::undefined(), ..request(2, 2) };
    save(&*storage, &void).await;
    let batch = read(&*storage, &[shard(1)]).await;
    assert_eq!(ids(&batch), [1, 2]);
    assert_eq!(batch.messages[0].envelope, Envelope::Request(traced));
    assert_eq!(batch.messages[0].last_sent_reply, None);
    assert_eq!(batch.messages[1].envelope, Envelope::Request(void));
    assert!(
        read(&*storage, &[shard(2)]).await.is_empty(),
        "{}: other shards are not read",
        fixture.name()
    );
}

/// A second request with the same primary key is a duplicate of the first (effect's
/// `MessageStorage.test.ts`).
pub async fn detects_duplicates_by_primary_key(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    assert_eq!(save_keyed(&*storage, &request(1, 1), "k").await, SaveResult::Success);
    let duplicate = save_keyed(&*storage, &request(2, 1), "k").await;
    assert_eq!(
        duplicate,
        SaveResult::Duplicate { original_id: Snowflake::new(1), last_received_reply: None }
    );
    // The same key on another entity is another request.
    assert_eq!(save_keyed(&*storage, &request(3, 2), "k").await, SaveResult::Success);
    assert_eq!(read_ids(&*storage).await, [1, 3]);
}

/// A duplicate reports the stored request's latest reply: a chunk, then the final reply (effect's
/// SQL storage tests).
pub async fn duplicate_reports_the_last_reply(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let stream = request(1, 1);
    assert_eq!(save_keyed(&*storage, &stream, "s").await, SaveResult::Success);
    storage.save_reply(&chunk(1, 10, 0)).await.unwrap();
    let duplicate = |id| {
        let storage = Arc::clone(&storage);
        async move { save_keyed(&*storage, &request(id, 1), "s").await }
    };
    assert_eq!(
        duplicate(2).await,
        SaveResult::Duplicate {
            original_id: Snowflake::new(1),
            last_received_reply: Some(chunk(1, 10, 0))
        }
    );
    storage.save_ack_chunk(&ack(11, &stream, 10)).await.unwrap();
    storage.save_reply(&chunk(1, 12, 1)).await.unwrap();
    assert_eq!(
        duplicate(3).await,
        SaveResult::Duplicate {
            original_id: Snowflake::new(1),
            last_received_reply: Some(chunk(1, 12, 1))
        }
    );
    assert_eq!(
        reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()),
        [12],
        "only the unacked chunk"
    );
    storage.save_reply(&final_reply(1, 13)).await.unwrap();
    assert_eq!(
        duplicate(4).await,
        SaveResult::Duplicate {
            original_id: Snowflake::new(1),
            last_received_reply: Some(final_reply(1, 13))
        }
    );
}

/// A request saved again after it completed (a retry) is reported as the duplicate of itself,
/// with its final reply, also when the retry is saved together with other requests (a backend
/// may write concurrent saves with one statement). Told `Success` instead, its caller would wait
/// for a reply that is never delivered again.
pub async fn a_retried_save_among_concurrent_saves_is_a_duplicate(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=3 {
        assert_eq!(
            save_keyed(&*storage, &request(id, 1), &format!("k{id}")).await,
            SaveResult::Success
        );
        storage.save_reply(&final_reply(id, 10 * id)).await.unwrap();
    }
    // The retries in the middle of fresh requests, each of these saved twice (the second save
    // of a request in the same batch is its duplicate too): a batch that holds a retry holds
    // other requests.
    let ids = [100, 100, 101, 1, 101, 102, 102, 103, 2, 103, 104, 104, 105, 3, 105];
    let saves = ids.map(|id| {
        let storage = Arc::clone(&storage);
        async move { (id, save_keyed(&*storage, &request(id, 1), &format!("k{id}")).await) }
    });
    let mut successes: BTreeMap<u64, usize> = BTreeMap::new();
    for (id, result) in join_all(saves).await {
        match result {
            SaveResult::Success => *successes.entry(id).or_default() += 1,
            SaveResult::Duplicate { original_id, last_received_reply } => {
                assert_eq!(original_id, Snowflake::new(id), "{}", fixture.name());
                let expected = (id < 100).then(|| final_reply(id, 10 * id));
                assert_eq!(last_received_reply, expected, "{}: request {id}", fixture.name());
            }
        }
    }
    let expected: BTreeMap<u64, usize> = (100..=105).map(|id| (id, 1)).collect();
    assert_eq!(successes, expected, "{}: each request stored once, no retry", fixture.name());
}

/// Keys longer than the 255-character column are stored as digests and still deduplicate and
/// resolve (effect's SQL storage tests).
pub async fn hashes_primary_keys_longer_than_the_column(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let long_key = "k".repeat(400);
    let first = request(1, 1);
    assert_eq!(save_keyed(&*storage, &first, &long_key).await, SaveResult::Success);
    assert!(
        matches!(save_keyed(&*storage, &request(2, 1), &long_key).await, SaveResult::Duplicate { original_id, .. } if original_id == Snowflake::new(1))
    );
    let composed = primary_key(&first.address, &first.tag, &long_key);
    assert_eq!(
        storage.request_id_for_primary_key(&composed).await.unwrap(),
        Some(Snowflake::new(1))
    );
    // A different long key is a different request.
    let other_key = format!("{long_key}x");
    assert_eq!(save_keyed(&*storage, &request(3, 1), &other_key).await, SaveResult::Success);
}

/// Keys at the column width and one past it both deduplicate and resolve (effect's SQL storage
/// tests).
pub async fn keeps_short_primary_keys_as_plaintext(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    // `TestEntity/e1/GetUser/` is 22 characters: pad the composed key to exactly 255 and 256.
    for (id, length) in [(1_u64, 255_usize), (3, 256)] {
        let req = request(id, 1);
        let key = "p".repeat(length - 22);
        let composed = primary_key(&req.address, &req.tag, &key);
        assert_eq!(composed.chars().count(), length);
        assert_eq!(save_keyed(&*storage, &req, &key).await, SaveResult::Success);
        let duplicate = save_keyed(&*storage, &request(id + 1, 1), &key).await;
        assert!(
            matches!(duplicate, SaveResult::Duplicate { original_id, .. } if original_id == Snowflake::new(id)),
            "{length}"
        );
        assert_eq!(
            storage.request_id_for_primary_key(&composed).await.unwrap(),
            Some(Snowflake::new(id))
        );
    }
}

/// Requests without a primary key are never deduplicated by content
/// (`effect/src/cluster/Sharding.ts`).
pub async fn request_without_primary_key_is_never_deduplicated(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let first = request(1, 1);
    save(&*storage, &first).await;
    let same_content = Request { request_id: Snowflake::new(2), ..first };
    save(&*storage, &same_content).await;
    assert_eq!(read_ids(&*storage).await, [1, 2]);
}

/// A request with a final reply is not returned (effect's `MessageStorage.test.ts`).
pub async fn unprocessed_messages_excludes_complete_requests(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    save(&*storage, &request(1, 1)).await;
    save(&*storage, &request(2, 2)).await;
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    assert_eq!(read_ids(&*storage).await, [2]);
}

/// A limit returns the first rows in insertion order and claims only those (effect's
/// `MessageStorage.test.ts`, effect's SQL storage tests).
pub async fn unprocessed_messages_honors_the_limit(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=5 {
        save(&*storage, &request(id, 1)).await;
    }
    let options = UnprocessedOptions { limit: std::num::NonZeroU32::new(3), addresses: None };
    let first = storage.unprocessed_messages(&[shard(1)], now(), options).await.unwrap();
    assert_eq!(ids(&first), [1, 2, 3]);
    let second = storage.unprocessed_messages(&[shard(1)], now(), options).await.unwrap();
    assert_eq!(ids(&second), [4, 5]);
}

/// A claimed row is not returned again within the claim window; new rows are (effect's SQL storage
/// tests).
pub async fn claimed_messages_are_not_read_twice(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    save(&*storage, &request(1, 1)).await;
    assert_eq!(read_ids(&*storage).await, [1]);
    assert_eq!(read_ids(&*storage).await, Vec::<u64>::new());
    save(&*storage, &request(2, 1)).await;
    assert_eq!(read_ids(&*storage).await, [2]);
}

/// The address filter returns only the given entities, on their own shard (effect's
/// `MessageStorage.test.ts`, effect's SQL storage tests).
pub async fn unprocessed_messages_filters_by_address(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=4_u32 {
        save(&*storage, &request(u64::from(id), id)).await;
    }
    // Entity e4 also has a request on shard 2; the filter names (e4, shard 1) only.
    save(&*storage, &request_to(5, address("e4", 2))).await;
    let wanted = [address("e2", 1), address("e4", 1)];
    let options = UnprocessedOptions { limit: None, addresses: Some(&wanted) };
    let batch = storage.unprocessed_messages(&[shard(1), shard(2)], now(), options).await.unwrap();
    assert_eq!(ids(&batch), [2, 4]);
    // A filter on another entity type matches nothing.
    let other_type = [EntityAddress { entity_type: EntityType::from("Other"), ..address("e1", 1) }];
    let options = UnprocessedOptions { limit: None, addresses: Some(&other_type) };
    assert!(storage.unprocessed_messages(&[shard(1)], now(), options).await.unwrap().is_empty());
}

/// An empty address filter fails closed: nothing is returned or claimed (effect's
/// `MessageStorage.test.ts`).
pub async fn empty_address_filter_matches_nothing(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    save(&*storage, &request(1, 1)).await;
    let options = UnprocessedOptions { limit: None, addresses: Some(&[]) };
    assert!(storage.unprocessed_messages(&[shard(1)], now(), options).await.unwrap().is_empty());
    assert_eq!(read_ids(&*storage).await, [1], "nothing was claimed");
}

/// Empty lists are no-ops; an empty reset releases nothing (effect's `MessageStorage.test.ts`).
pub async fn empty_lists_are_no_ops(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    save(&*storage, &request(1, 1)).await;
    assert!(read(&*storage, &[]).await.is_empty());
    assert_eq!(read_ids(&*storage).await, [1]);
    storage.reset_addresses(&[]).await.unwrap();
    storage.reset_requests(&[]).await.unwrap();
    storage.reset_shards(&[]).await.unwrap();
    assert_eq!(read_ids(&*storage).await, Vec::<u64>::new(), "an empty reset released a claim");
    assert!(storage.replies_for(&[]).await.unwrap().is_empty());
    assert!(storage.replies_for_unfiltered(&[]).await.unwrap().is_empty());
    assert!(storage.unprocessed_messages_by_id(&[], now()).await.unwrap().is_empty());
}

/// Resetting addresses makes their claimed messages eligible again (effect's
/// `MessageStorage.test.ts`).
pub async fn reset_addresses_releases_claims(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=4_u32 {
        save(&*storage, &request(u64::from(id), id)).await;
    }
    let options = UnprocessedOptions { limit: std::num::NonZeroU32::new(3), addresses: None };
    let claimed = storage.unprocessed_messages(&[shard(1)], now(), options).await.unwrap();
    assert_eq!(ids(&claimed), [1, 2, 3]);
    storage.reset_addresses(&[address("e1", 1), address("e3", 1)]).await.unwrap();
    assert_eq!(read_ids(&*storage).await, [1, 3, 4]);
}

/// Resetting shards and requests releases their claims and nothing else.
pub async fn reset_shards_and_requests_release_claims(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    save(&*storage, &request(1, 1)).await;
    save(&*storage, &request_to(2, address("e2", 2))).await;
    save(&*storage, &request(3, 3)).await;
    assert_eq!(ids(&read(&*storage, &[shard(1), shard(2)]).await), [1, 2, 3]);
    storage.reset_shards(&[shard(2)]).await.unwrap();
    assert_eq!(ids(&read(&*storage, &[shard(1), shard(2)]).await), [2]);
    storage.reset_requests(&snowflakes(&[3])).await.unwrap();
    assert_eq!(ids(&read(&*storage, &[shard(1), shard(2)]).await), [3]);
    // A reset never makes a completed request unprocessed.
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    storage.reset_requests(&snowflakes(&[1])).await.unwrap();
    storage.reset_shards(&[shard(1)]).await.unwrap();
    assert_eq!(ids(&read(&*storage, &[shard(1)]).await), [3]);
}

/// A message with `deliver_at` in the future is held until the runner clock passes it.
pub async fn deliver_at_holds_messages_until_due(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let at = now().saturating_add(Duration::from_secs(60));
    let options = SaveRequestOptions { primary_key: None, deliver_at: Some(at) };
    assert_eq!(storage.save_request(&request(1, 1), &options).await.unwrap(), SaveResult::Success);
    save(&*storage, &request(2, 1)).await;
    assert_eq!(read_ids(&*storage).await, [2]);
    let early = storage
        .unprocessed_messages(
            &[shard(1)],
            at.saturating_sub(Duration::from_millis(1)),
            UnprocessedOptions::default(),
        )
        .await
        .unwrap();
    assert!(early.is_empty());
    let due =
        storage.unprocessed_messages(&[shard(1)], at, UnprocessedOptions::default()).await.unwrap();
    assert_eq!(ids(&due), [1]);
    let by_id_early = storage.unprocessed_messages_by_id(&snowflakes(&[1]), now()).await.unwrap();
    assert!(by_id_early.is_empty(), "by id also honours deliver_at");
}

/// A streaming request with an unacknowledged chunk is not re-delivered until the ack is saved;
/// then it comes back with its last chunk, followed by the ack
/// (`effect/src/cluster/SqlMessageStorage.ts`).
pub async fn stream_replies_wait_for_acks(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let stream = request(1, 1);
    save(&*storage, &stream).await;
    assert_eq!(read_ids(&*storage).await, [1]);
    storage.save_reply(&chunk(1, 10, 0)).await.unwrap();
    storage.reset_requests(&snowflakes(&[1])).await.unwrap();
    assert_eq!(read_ids(&*storage).await, Vec::<u64>::new(), "an unacked chunk holds the request");
    storage.save_ack_chunk(&ack(11, &stream, 10)).await.unwrap();
    let batch = read(&*storage, &[shard(1)]).await;
    assert_eq!(ids(&batch), [1, 11]);
    assert_eq!(batch.messages[0].last_sent_reply, Some(chunk(1, 10, 0)));
    assert_eq!(batch.messages[1].envelope, Envelope::AckChunk(ack(11, &stream, 10)));
    // A newer ack supersedes the older one, which is then processed.
    storage.save_reply(&chunk(1, 12, 1)).await.unwrap();
    storage.save_ack_chunk(&ack(13, &stream, 12)).await.unwrap();
    storage.reset_requests(&snowflakes(&[1])).await.unwrap();
    let batch = read(&*storage, &[shard(1)]).await;
    assert_eq!(ids(&batch), [1, 13]);
    assert_eq!(batch.messages[0].last_sent_reply, Some(chunk(1, 12, 1)));
}

/// A request whose id is taken by another request (two processes sharing a machine id made
/// the same snowflake) is a conflict, with or without a primary key: it is not that request's
/// duplicate, whose reply would answer the wrong caller. Nothing of it is stored, and the
/// runtime saves it again under a fresh id.
pub async fn a_request_whose_id_is_taken_is_a_conflict(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let first = request(1, 1);
    let saved = storage.save_request(&first, &key_of(&first, "first")).await.unwrap();
    assert_eq!(saved, SaveResult::Success, "{}", fixture.name());
    let other = request(1, 2);
    for options in [key_of(&other, "other"), SaveRequestOptions::default()] {
        let taken = storage.save_request(&other, &options).await;
        let Err(error) = taken else {
            panic!("{}: a taken id was accepted as {taken:?}", fixture.name());
        };
        assert_eq!(error.kind(), StorageErrorKind::Conflict, "{}: {error}", fixture.name());
    }
    let stored = storage.unprocessed_messages_by_id(&snowflakes(&[1]), now()).await.unwrap();
    assert_eq!(stored.messages.len(), 1, "{}", fixture.name());
    assert_eq!(stored.messages[0].envelope, Envelope::Request(first), "{}", fixture.name());
}

/// At most one final reply per request: a second is a conflict
/// (`effect/src/cluster/SqlMessageStorage.ts`).
pub async fn second_final_reply_is_a_conflict(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    save(&*storage, &request(1, 1)).await;
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    let error = storage.save_reply(&final_reply(1, 11)).await.unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::Conflict, "{}: {error}", fixture.name());
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()), [10]);
}

/// `replies_for` returns final replies and unacknowledged chunks, in insertion order (effect's
/// `MessageStorage.test.ts`).
pub async fn replies_for_returns_exits_and_unacked_chunks(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let stream = request(1, 1);
    save(&*storage, &stream).await;
    save(&*storage, &request(2, 2)).await;
    assert!(storage.replies_for(&snowflakes(&[1, 2])).await.unwrap().is_empty());
    storage.save_reply(&chunk(1, 10, 0)).await.unwrap();
    storage.save_ack_chunk(&ack(11, &stream, 10)).await.unwrap();
    storage.save_reply(&chunk(1, 12, 1)).await.unwrap();
    storage.save_reply(&final_reply(2, 13)).await.unwrap();
    let replies = storage.replies_for(&snowflakes(&[1, 2])).await.unwrap();
    assert_eq!(replies, [chunk(1, 12, 1), final_reply(2, 13)]);
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[2, 99])).await.unwrap()), [13]);
}

/// `replies_for_unfiltered` returns every reply, acknowledged or not.
pub async fn replies_for_unfiltered_returns_everything(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let stream = request(1, 1);
    save(&*storage, &stream).await;
    save(&*storage, &request(2, 2)).await;
    storage.save_reply(&chunk(1, 10, 0)).await.unwrap();
    storage.save_ack_chunk(&ack(11, &stream, 10)).await.unwrap();
    storage.save_reply(&chunk(1, 12, 1)).await.unwrap();
    storage.save_reply(&final_reply(2, 13)).await.unwrap();
    let replies = storage.replies_for_unfiltered(&snowflakes(&[1, 2])).await.unwrap();
    assert_eq!(replies, [chunk(1, 10, 0), chunk(1, 12, 1), final_reply(2, 13)]);
}

/// A stored reply that cannot be decoded is answered as a defect for its request.
pub async fn malformed_reply_becomes_a_defect(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    save(&*storage, &request(1, 1)).await;
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    fixture.corrupt(Corruption::ReplyPayload(Snowflake::new(10))).await;
    let replies = storage.replies_for(&snowflakes(&[1])).await.unwrap();
    let [Reply::WithExit(WithExit { request_id, id, exit: Exit::Failure(cause) })] =
        replies.as_slice()
    else {
        panic!("{}: expected one defect reply, got {replies:?}", fixture.name())
    };
    assert_eq!((*request_id, *id), (Snowflake::new(1), Snowflake::new(10)));
    assert!(
        matches!(&cause.0[0], CauseReason::Die(defect) if defect.json().unwrap_or("").contains("MalformedMessage"))
    );
}

/// A stored message that cannot be decoded is reported for its request and does not stop the
/// read or come back (effect's cluster integration test, "defects a malformed persisted envelope
/// without wedging").
pub async fn malformed_message_is_reported_and_does_not_block(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=3 {
        save(&*storage, &request(id, 1)).await;
    }
    fixture.corrupt(Corruption::MessagePayload(Snowflake::new(2))).await;
    let batch = read(&*storage, &[shard(1)]).await;
    let delivered: Vec<u64> =
        batch.messages.iter().map(|message| message.envelope.id().get()).collect();
    assert_eq!(delivered, [1, 3]);
    assert_eq!(batch.malformed.len(), 1);
    assert_eq!(
        (batch.malformed[0].id, batch.malformed[0].request_id),
        (Snowflake::new(2), Snowflake::new(2))
    );
    assert!(read(&*storage, &[shard(1)]).await.is_empty(), "the malformed row stays claimed");
    let by_id = storage.unprocessed_messages_by_id(&snowflakes(&[2]), now()).await.unwrap();
    assert_eq!((by_id.messages.len(), by_id.malformed.len()), (0, 1));
    // Answering it (a defect reply) completes it.
    storage
        .save_reply(&Reply::WithExit(WithExit {
            request_id: Snowflake::new(2),
            id: Snowflake::new(20),
            exit: Exit::die_with_message("MalformedMessage", "bad payload"),
        }))
        .await
        .unwrap();
    storage.reset_shards(&[shard(1)]).await.unwrap();
    assert_eq!(ids(&read(&*storage, &[shard(1)]).await), [1, 3]);
}

/// Reading by id applies the filters but does not claim (effect's SQL storage tests).
pub async fn unprocessed_messages_by_id_does_not_claim(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=3 {
        save(&*storage, &request(id, 1)).await;
    }
    storage.save_reply(&final_reply(2, 10)).await.unwrap();
    let batch =
        storage.unprocessed_messages_by_id(&snowflakes(&[1, 2, 3, 99]), now()).await.unwrap();
    assert_eq!(ids(&batch), [1, 3]);
    assert_eq!(read_ids(&*storage).await, [1, 3], "reading by id claimed nothing");
    let claimed = storage.unprocessed_messages_by_id(&snowflakes(&[1]), now()).await.unwrap();
    assert_eq!(ids(&claimed), [1], "a claimed row is still returned by id");
}

/// `unprocessed_before` lists the entity's unprocessed, due requests stored before a given one,
/// in the read's order, claimed or not; not other entities', not acknowledgements, not
/// answered ones, not delayed ones, not later ones; at most `limit`.
pub async fn unprocessed_before_lists_the_entitys_earlier_requests(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let entity = address("e1", 1);
    let limit = |n: u32| std::num::NonZeroU32::new(n).unwrap();
    let before = |id: u64, n: u32| {
        let storage = Arc::clone(&storage);
        let entity = entity.clone();
        async move {
            let earlier = storage.unprocessed_before(&entity, Snowflake::new(id), now(), limit(n));
            earlier.await.unwrap().into_iter().map(Snowflake::get).collect::<Vec<u64>>()
        }
    };
    save(&*storage, &request(1, 1)).await;
    save(&*storage, &request(2, 2)).await;
    save(&*storage, &request(3, 1)).await;
    let later = SaveRequestOptions {
        primary_key: None,
        deliver_at: Some(now().saturating_add(Duration::from_secs(60))),
    };
    assert_eq!(storage.save_request(&request(4, 1), &later).await.unwrap(), SaveResult::Success);
    save(&*storage, &request(5, 1)).await;
    save(&*storage, &request(6, 1)).await;
    assert_eq!(before(6, 10).await, [1, 3, 5], "the entity's earlier, due requests");
    assert_eq!(before(6, 2).await, [1, 3], "at most the limit, oldest first");
    assert_eq!(before(1, 10).await, Vec::<u64>::new(), "nothing before the first");
    // Claimed rows still count; answered ones and acknowledgements do not.
    assert_eq!(read_ids(&*storage).await, [1, 2, 3, 5, 6]);
    storage.save_reply(&final_reply(3, 100)).await.unwrap();
    storage.save_ack_chunk(&ack(7, &request(1, 1), 99)).await.unwrap();
    save(&*storage, &request(8, 1)).await;
    assert_eq!(before(8, 10).await, [1, 5, 6]);
}

/// `save_request_ordered` stores a request as `save_request` does and, when it stored it,
/// answers what `unprocessed_before` would; a duplicate has no earlier list.
pub async fn save_request_ordered_reads_the_earlier_requests_with_the_save(
    fixture: &dyn StorageFixture,
) {
    let storage = fixture.message_storage();
    let limit = std::num::NonZeroU32::new(10).unwrap();
    save(&*storage, &request(1, 1)).await;
    save(&*storage, &request(2, 2)).await;
    let ordered = storage
        .save_request_ordered(&request(3, 1), &key_of(&request(3, 1), "k3"), now(), limit)
        .await
        .unwrap();
    assert_eq!(ordered.saved, SaveResult::Success, "{}", fixture.name());
    let earlier: Option<Vec<u64>> =
        ordered.earlier.map(|ids| ids.into_iter().map(Snowflake::get).collect());
    assert_eq!(earlier, Some(vec![1]), "{}: the entity's earlier request", fixture.name());
    assert_eq!(read_ids(&*storage).await, [1, 2, 3], "stored as by save_request");
    let again = storage
        .save_request_ordered(&request(4, 1), &key_of(&request(4, 1), "k3"), now(), limit)
        .await
        .unwrap();
    assert!(matches!(again.saved, SaveResult::Duplicate { .. }), "{:?}", again.saved);
    assert_eq!(again.earlier, None, "a duplicate has no earlier list");
}

/// Concurrent `save_request_ordered` calls (a backend may answer them in one batch) each get
/// what `unprocessed_before` answers for their request once all are stored: the entity's
/// earlier requests, those saved alongside included, and no other entity's.
pub async fn concurrent_ordered_saves_each_get_their_earlier_requests(
    fixture: &dyn StorageFixture,
) {
    let storage = fixture.message_storage();
    let limit = std::num::NonZeroU32::new(64).unwrap();
    save(&*storage, &request(1, 1)).await;
    let saves = (2..=40u64).map(|id| {
        let storage = Arc::clone(&storage);
        // Three entities of one shard, their requests interleaved.
        let target = request(id, u32::try_from(id % 3).unwrap());
        async move {
            let options = key_of(&target, &format!("k{id}"));
            let ordered = storage.save_request_ordered(&target, &options, now(), limit).await;
            (target, ordered.unwrap())
        }
    });
    let saved = futures_util::future::join_all(saves).await;
    for (target, ordered) in saved {
        assert_eq!(ordered.saved, SaveResult::Success, "{}", fixture.name());
        let expected = storage
            .unprocessed_before(&target.address, target.request_id, now(), limit)
            .await
            .unwrap();
        assert_eq!(
            ordered.earlier,
            Some(expected),
            "{}: the earlier requests of {}",
            fixture.name(),
            target.request_id
        );
    }
}

/// Concurrent `unprocessed_messages_ordered` calls (a backend may answer them in one batch)
/// each read what `unprocessed_messages_by_id` reads for their ids, and for each request what
/// `unprocessed_before` answers.
pub async fn unprocessed_messages_ordered_reads_requests_with_their_earlier_requests(
    fixture: &dyn StorageFixture,
) {
    let storage = fixture.message_storage();
    // Calls read together may ask for different limits.
    let limit =
        |call: usize| std::num::NonZeroU32::new(u32::try_from(call % 3 + 1).unwrap()).unwrap();
    // Three entities of one shard, their requests interleaved.
    for id in 1..=12u64 {
        save(&*storage, &request(id, u32::try_from(id % 3).unwrap())).await;
    }
    storage.save_reply(&final_reply(4, 100)).await.unwrap();
    storage.save_ack_chunk(&ack(13, &request(1, 1), 99)).await.unwrap();
    let later = SaveRequestOptions {
        primary_key: None,
        deliver_at: Some(now().saturating_add(Duration::from_secs(60))),
    };
    assert_eq!(storage.save_request(&request(14, 2), &later).await.unwrap(), SaveResult::Success);
    let asked: Vec<Vec<u64>> =
        vec![vec![12], vec![4, 10], vec![11, 14, 99], vec![1, 2, 3], vec![13], vec![7, 8, 9]];
    let reads = asked.iter().enumerate().map(|(call, ids)| {
        let storage = Arc::clone(&storage);
        let ids = snowflakes(ids);
        async move { storage.unprocessed_messages_ordered(&ids, now(), limit(call)).await.unwrap() }
    });
    let read = futures_util::future::join_all(reads).await;
    for (call, (wanted, ordered)) in asked.iter().zip(read).enumerate() {
        let expected =
            storage.unprocessed_messages_by_id(&snowflakes(wanted), now()).await.unwrap();
        assert_eq!(ids(&ordered.batch), ids(&expected), "{}: {wanted:?}", fixture.name());
        let mut lists = BTreeMap::new();
        for message in &expected.messages {
            if let Envelope::Request(target) = &message.envelope {
                let before = storage
                    .unprocessed_before(&target.address, target.request_id, now(), limit(call))
                    .await
                    .unwrap();
                lists.insert(target.request_id, before);
            }
        }
        assert_eq!(
            ordered.earlier,
            lists,
            "{}: the earlier requests of {wanted:?}",
            fixture.name()
        );
    }
    let none = storage.unprocessed_messages_ordered(&[], now(), limit(0)).await.unwrap();
    assert!(none.batch.is_empty() && none.earlier.is_empty());
}

/// Interrupts are stored and delivered; resetting the request deletes them
/// (`effect/src/cluster/MessageStorage.ts`).
pub async fn interrupts_are_delivered_and_cleared(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let target = request(1, 1);
    save(&*storage, &target).await;
    assert_eq!(read_ids(&*storage).await, [1]);
    let interrupt = Interrupt {
        id: Snowflake::new(2),
        address: target.address.clone(),
        request_id: Snowflake::new(1),
    };
    storage.save_interrupt(&interrupt).await.unwrap();
    let batch = read(&*storage, &[shard(1)]).await;
    assert_eq!(
        batch.messages.iter().map(|message| message.envelope.clone()).collect::<Vec<_>>(),
        [Envelope::Interrupt(interrupt)]
    );
    storage.clear_replies(Snowflake::new(1), None).await.unwrap();
    assert_eq!(read_ids(&*storage).await, [1], "the interrupt is gone and the request unclaimed");
}

/// Clearing replies resets a request: its final reply is deleted, its chunks are kept, and it
/// is unprocessed and unclaimed again (`effect/src/cluster/MessageStorage.ts`).
pub async fn clear_replies_resets_a_request(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let stream = request(1, 1);
    save(&*storage, &stream).await;
    assert_eq!(read_ids(&*storage).await, [1]);
    storage.save_reply(&chunk(1, 10, 0)).await.unwrap();
    storage.save_ack_chunk(&ack(11, &stream, 10)).await.unwrap();
    storage.save_reply(&final_reply(1, 12)).await.unwrap();
    assert!(read(&*storage, &[shard(1)]).await.is_empty());
    storage.clear_replies(Snowflake::new(1), None).await.unwrap();
    assert!(storage.replies_for(&snowflakes(&[1])).await.unwrap().is_empty());
    assert_eq!(reply_ids(&storage.replies_for_unfiltered(&snowflakes(&[1])).await.unwrap()), [10]);
    let batch = read(&*storage, &[shard(1)]).await;
    assert_eq!(ids(&batch), [1, 11]);
    assert_eq!(batch.messages[0].last_sent_reply, None, "no last reply after a reset");
    // The request can be answered again.
    storage.save_reply(&final_reply(1, 13)).await.unwrap();
}

/// With an expected reply id, the reset only happens if that is still the latest reply.
pub async fn clear_replies_with_expected_reply_id_is_conditional(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let target = request(1, 1);
    save(&*storage, &target).await;
    assert_eq!(read_ids(&*storage).await, [1]);
    let interrupt = Interrupt {
        id: Snowflake::new(2),
        address: target.address.clone(),
        request_id: Snowflake::new(1),
    };
    storage.save_interrupt(&interrupt).await.unwrap();
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    storage.clear_replies(Snowflake::new(1), Some(Snowflake::new(99))).await.unwrap();
    assert_eq!(
        reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()),
        [10],
        "a stale reset did nothing"
    );
    assert!(read(&*storage, &[shard(1)]).await.is_empty());
    storage.clear_replies(Snowflake::new(1), Some(Snowflake::new(10))).await.unwrap();
    assert!(storage.replies_for(&snowflakes(&[1])).await.unwrap().is_empty());
    // Unlike the unconditional reset, the conditional one keeps the interrupt the final reply
    // completed, and makes it unprocessed again with the request (the reference's behaviour).
    assert_eq!(read_ids(&*storage).await, [1, 2]);
}

/// The request id of a stored primary key, and none for an unknown key.
pub async fn request_id_for_primary_key(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let first = request(7, 1);
    assert_eq!(save_keyed(&*storage, &first, "k1").await, SaveResult::Success);
    let key = primary_key(&first.address, &first.tag, "k1");
    assert_eq!(key, "TestEntity/e1/GetUser/k1");
    assert_eq!(storage.request_id_for_primary_key(&key).await.unwrap(), Some(Snowflake::new(7)));
    assert_eq!(storage.request_id_for_primary_key("TestEntity/e1/GetUser/k2").await.unwrap(), None);
}

/// Clearing an address deletes its messages and replies, and frees its primary keys (effect's
/// `MessageStorage.test.ts`).
pub async fn clear_address_removes_everything(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let cleared = request(1, 1);
    assert_eq!(save_keyed(&*storage, &cleared, "k").await, SaveResult::Success);
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    save(&*storage, &request(2, 1)).await;
    save(&*storage, &request(3, 2)).await;
    storage.clear_address(&address("e1", 1)).await.unwrap();
    assert!(storage.replies_for_unfiltered(&snowflakes(&[1])).await.unwrap().is_empty());
    assert_eq!(read_ids(&*storage).await, [3]);
    assert_eq!(save_keyed(&*storage, &request(4, 1), "k").await, SaveResult::Success);
}

/// Entity ids and primary keys are compared exactly: ids that differ only in case, accents or
/// trailing spaces are different entities, and keys that differ only in case (deferred names
/// `Approve` and `approve`) are different requests. A collation that confuses them would make
/// one entity's request a duplicate of another's, or clear the other's rows.
pub async fn keys_are_compared_exactly(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let entities = ["Alice", "alice", "José", "Jose", "Bob", "Bob "];
    for (id, entity) in (1_u64..).zip(entities) {
        let saved = save_keyed(&*storage, &request_to(id, address(entity, 1)), "k").await;
        assert_eq!(saved, SaveResult::Success, "{}: entity {entity:?}", fixture.name());
    }
    for (id, key) in [(7_u64, "Approve"), (8, "approve")] {
        let saved = save_keyed(&*storage, &request(id, 1), key).await;
        assert_eq!(saved, SaveResult::Success, "{}: key {key:?}", fixture.name());
    }
    // The address filter of one entity claims only its own request.
    let alice = [address("Alice", 1)];
    let options = UnprocessedOptions { limit: None, addresses: Some(&alice) };
    let batch = storage.unprocessed_messages(&[shard(1)], now(), options).await.unwrap();
    assert_eq!(ids(&batch), [1], "{}", fixture.name());
    assert_eq!(read_ids(&*storage).await, [2, 3, 4, 5, 6, 7, 8], "{}", fixture.name());
    // Clearing one entity leaves the others' rows and keys.
    storage.clear_address(&address("alice", 1)).await.unwrap();
    let key_of_entity = |entity: &str| primary_key(&address(entity, 1), "GetUser", "k");
    let stored = |entity: &'static str| {
        let (storage, key) = (Arc::clone(&storage), key_of_entity(entity));
        async move { storage.request_id_for_primary_key(&key).await.unwrap() }
    };
    assert_eq!(stored("Alice").await, Some(Snowflake::new(1)), "{}", fixture.name());
    assert_eq!(stored("alice").await, None, "{}", fixture.name());
    assert_eq!(stored("Bob").await, Some(Snowflake::new(5)), "{}", fixture.name());
    assert_eq!(stored("Bob ").await, Some(Snowflake::new(6)), "{}", fixture.name());
}

// --- Value limits -------------------------------------------------------------------------------

/// A JSON string of exactly `bytes` bytes (`"aaa…"`; at least 2, the quotes).
fn json_string(bytes: usize) -> RawJson {
    assert!(bytes >= 2, "a JSON string has at least its two quotes");
    RawJson::from_json(format!("\"{}\"", "a".repeat(bytes - 2))).unwrap()
}

/// A request to entity `e<entity>` on shard 1 whose payload is exactly `bytes` bytes of JSON.
fn request_with_payload(id: u64, entity: u32, bytes: usize) -> Request {
    Request { payload: json_string(bytes), ..request(id, entity) }
}

/// A request to entity `e<entity>` on shard 1 whose headers are exactly `bytes` bytes of JSON.
fn request_with_headers(id: u64, entity: u32, bytes: usize) -> Request {
    Request { headers: json_string(bytes), ..request(id, entity) }
}

/// A final reply whose stored payload, the exit's JSON (which wraps the value), is exactly
/// `bytes` bytes.
fn final_reply_of_size(request_id: u64, id: u64, bytes: usize) -> Reply {
    let wrapping = Exit::Success(json_string(2)).to_json().len() - 2;
    let exit = Exit::Success(json_string(bytes - wrapping));
    assert_eq!(exit.to_json().len(), bytes, "the exit's JSON has the size asked for");
    Reply::WithExit(WithExit {
        request_id: Snowflake::new(request_id),
        id: Snowflake::new(id),
        exit,
    })
}

/// A chunk whose stored payload, the JSON array of its values, is exactly `bytes` bytes.
fn chunk_of_size(request_id: u64, id: u64, sequence: u32, bytes: usize) -> Reply {
    let wrapping = values_to_json(&[json_string(2)]).len() - 2;
    let values = vec![json_string(bytes - wrapping)];
    assert_eq!(values_to_json(&values).len(), bytes, "the chunk's JSON has the size asked for");
    let chunk = Chunk::new(Snowflake::new(request_id), Snowflake::new(id), sequence, values);
    Reply::Chunk(chunk.unwrap())
}

/// Asserts that `result` refused `what`, a value of `bytes` bytes over the limit `limit`, as
/// invalid input with a message that names the value, its size, the limit and the way out.
pub(crate) fn assert_refused<T: std::fmt::Debug>(
    backend: &str,
    result: Result<T, StorageError>,
    what: &str,
    bytes: usize,
    limit: usize,
) {
    let error = match result {
        Err(error) => error,
        Ok(stored) => panic!("{backend}: {what} of {bytes} bytes was accepted: {stored:?}"),
    };
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{backend}: {what}: {error}");
    let message = error.to_string();
    for expected in [what, &bytes.to_string(), &limit.to_string(), "store a reference"] {
        assert!(message.contains(expected), "{backend}: {expected:?} is not in {message:?}");
    }
}

/// A request's payload and headers, a final reply, a chunk and a reply saved in a transaction,
/// each exactly at the limit, are stored and read back byte for byte.
pub async fn values_at_the_limit_are_stored_whole(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let limit = fixture.value_bytes_max();
    let payload_at = request_with_payload(1, 1, limit);
    let headers_at = request_with_headers(2, 2, limit);
    let stream = request(3, 3);
    for request in [&payload_at, &headers_at, &stream, &request(4, 4)] {
        let saved = save_keyed(&*storage, request, "k").await;
        assert_eq!(saved, SaveResult::Success, "{}", fixture.name());
    }
    let batch = read(&*storage, &[shard(1)]).await;
    assert_eq!(ids(&batch), [1, 2, 3, 4], "{}", fixture.name());
    assert!(batch.messages[0].envelope == Envelope::Request(payload_at), "{}", fixture.name());
    assert!(batch.messages[1].envelope == Envelope::Request(headers_at), "{}", fixture.name());
    let final_at = final_reply_of_size(1, 10, limit);
    storage.save_reply(&final_at).await.unwrap();
    let chunk_at = chunk_of_size(3, 11, 0, limit);
    storage.save_reply(&chunk_at).await.unwrap();
    let transactional_at = final_reply_of_size(4, 12, limit);
    let mut transaction = storage.begin_transaction().await.unwrap();
    transaction.save_reply(&transactional_at).await.unwrap();
    transaction.commit().await.unwrap();
    let replies = storage.replies_for(&snowflakes(&[1, 3, 4])).await.unwrap();
    assert_eq!(reply_ids(&replies), [10, 11, 12], "{}", fixture.name());
    assert!(replies == [final_at, chunk_at.clone(), transactional_at], "{}", fixture.name());
    // A duplicate of the stream reads its chunk back whole too.
    let duplicate = save_keyed(&*storage, &request(5, 3), "k").await;
    let expected = SaveResult::Duplicate {
        original_id: Snowflake::new(3),
        last_received_reply: Some(chunk_at),
    };
    assert!(duplicate == expected, "{}: the duplicate's last reply", fixture.name());
}

/// A value one byte over the limit is refused as invalid input, with a message that says why
/// and what to do; nothing of it is stored, and the storage goes on working: the same ids are
/// saved afterwards with values that fit.
pub async fn values_over_the_limit_are_refused(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let limit = fixture.value_bytes_max();
    let over = limit + 1;
    let payload_over = request_with_payload(1, 1, over);
    let refused = storage.save_request(&payload_over, &key_of(&payload_over, "k")).await;
    assert_refused(name, refused, "the request's payload", over, limit);
    let headers_over = request_with_headers(1, 1, over);
    let refused = storage.save_request(&headers_over, &SaveRequestOptions::default()).await;
    assert_refused(name, refused, "the request's headers", over, limit);
    assert_eq!(read_ids(&*storage).await, Vec::<u64>::new(), "{name}: nothing was stored");
    let composed = primary_key(&payload_over.address, &payload_over.tag, "k");
    assert_eq!(storage.request_id_for_primary_key(&composed).await.unwrap(), None, "{name}");
    // The same id and key, with a payload that fits.
    assert_eq!(save_keyed(&*storage, &request(1, 1), "k").await, SaveResult::Success, "{name}");
    save(&*storage, &request(2, 2)).await;
    save(&*storage, &request(3, 3)).await;
    let refused = storage.save_reply(&final_reply_of_size(1, 10, over)).await;
    assert_refused(name, refused, "the reply's payload", over, limit);
    let refused = storage.save_reply(&chunk_of_size(2, 11, 0, over)).await;
    assert_refused(name, refused, "the chunk's values", over, limit);
    let stored = storage.replies_for_unfiltered(&snowflakes(&[1, 2])).await.unwrap();
    assert!(stored.is_empty(), "{name}: a refused reply was stored: {stored:?}");
    assert_eq!(read_ids(&*storage).await, [1, 2, 3], "{name}: the requests wait for replies");
    // The same reply ids, with values that fit.
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    storage.save_reply(&chunk(2, 11, 0)).await.unwrap();
    let stored = storage.replies_for_unfiltered(&snowflakes(&[1, 2])).await.unwrap();
    assert_eq!(reply_ids(&stored), [10, 11], "{name}");
}

/// A reply refused in a transaction is refused before anything reaches the database: the
/// transaction goes on, and commits the replies saved before and after it.
pub async fn a_refused_reply_leaves_its_transaction_usable(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let limit = fixture.value_bytes_max();
    let over = limit + 1;
    for id in 1..=3 {
        save(&*storage, &request(id, 1)).await;
    }
    let mut transaction = storage.begin_transaction().await.unwrap();
    transaction.save_reply(&final_reply(1, 10)).await.unwrap();
    let refused = transaction.save_reply(&final_reply_of_size(2, 11, over)).await;
    assert_refused(name, refused, "the reply's payload", over, limit);
    let refused = transaction.save_reply(&chunk_of_size(2, 12, 0, over)).await;
    assert_refused(name, refused, "the chunk's values", over, limit);
    transaction.save_reply(&final_reply(3, 13)).await.unwrap();
    transaction.commit().await.unwrap();
    let stored = storage.replies_for_unfiltered(&snowflakes(&[1, 2, 3])).await.unwrap();
    assert_eq!(reply_ids(&stored), [10, 13], "{name}");
    // The refused request is answered later with a reply that fits.
    storage.save_reply(&final_reply(2, 11)).await.unwrap();
}

/// Saved together (one group commit on the backends that batch), a request and a reply over the
/// limit fail alone: every other save of their batches is stored.
pub async fn a_value_over_the_limit_fails_alone_in_a_batch(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let limit = fixture.value_bytes_max();
    let over = limit + 1;
    // Keyed and unkeyed requests: MySQL batches only the keyed ones.
    let requests: Vec<(Request, SaveRequestOptions)> = (1..=8_u32)
        .map(|entity| {
            let id = u64::from(entity);
            let request =
                if id == 4 { request_with_payload(id, entity, over) } else { request(id, entity) };
            let options =
                if id % 2 == 0 { key_of(&request, "k") } else { SaveRequestOptions::default() };
            (request, options)
        })
        .collect();
    let saves = requests.iter().map(|(request, options)| storage.save_request(request, options));
    for ((request, _), saved) in requests.iter().zip(join_all(saves).await) {
        if request.request_id == Snowflake::new(4) {
            assert_refused(name, saved, "the request's payload", over, limit);
        } else {
            assert_eq!(saved.unwrap(), SaveResult::Success, "{name}: {:?}", request.request_id);
        }
    }
    // Saved concurrently, the requests have no order of their own (MySQL stores the keyed
    // ones of a batch first).
    let mut stored = read_ids(&*storage).await;
    stored.sort_unstable();
    assert_eq!(stored, [1, 2, 3, 5, 6, 7, 8], "{name}");
    let answered = [1_u64, 2, 3, 5, 6, 7, 8];
    let replies: Vec<Reply> = answered
        .iter()
        .map(
            |&id| if id == 5 { final_reply_of_size(5, 15, over) } else { final_reply(id, id + 10) },
        )
        .collect();
    let saves = replies.iter().map(|reply| storage.save_reply(reply));
    for (reply, saved) in replies.iter().zip(join_all(saves).await) {
        if reply.request_id() == Snowflake::new(5) {
            assert_refused(name, saved, "the reply's payload", over, limit);
        } else {
            assert!(saved.is_ok(), "{name}: the reply to {}: {saved:?}", reply.request_id());
        }
    }
    let stored = storage.replies_for_unfiltered(&snowflakes(&answered)).await.unwrap();
    let mut stored = reply_ids(&stored);
    stored.sort_unstable();
    assert_eq!(stored, [11, 12, 13, 16, 17, 18], "{name}");
}

/// Replies saved in a transaction are invisible until commit, gone on rollback, and a
/// transaction dropped without commit rolls back and releases what it locked.
pub async fn transaction_commits_and_rolls_back(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=3 {
        save(&*storage, &request(id, 1)).await;
    }
    let mut committed = storage.begin_transaction().await.unwrap();
    committed.save_reply(&final_reply(1, 10)).await.unwrap();
    assert!(
        storage.replies_for(&snowflakes(&[1])).await.unwrap().is_empty(),
        "visible before commit"
    );
    committed.commit().await.unwrap();
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()), [10]);

    let mut rolled_back = storage.begin_transaction().await.unwrap();
    rolled_back.save_reply(&final_reply(2, 11)).await.unwrap();
    rolled_back.rollback().await.unwrap();
    assert!(storage.replies_for(&snowflakes(&[2])).await.unwrap().is_empty());

    let mut dropped = storage.begin_transaction().await.unwrap();
    dropped.save_reply(&final_reply(3, 12)).await.unwrap();
    drop(dropped);
    // The same final reply saved outside must not wait on the abandoned transaction's locks.
    let saved = tokio::time::timeout(EVENTUAL, storage.save_reply(&final_reply(3, 13))).await;
    assert!(matches!(saved, Ok(Ok(()))), "{}: {saved:?}", fixture.name());
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[1, 2, 3])).await.unwrap()), [10, 13]);
}

/// A transaction returns to its savepoint as often as asked: what was saved after the
/// savepoint is undone, what was saved before it commits. Without a savepoint the rollback to
/// one fails.
pub async fn transaction_rolls_back_to_its_savepoint(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    for id in 1..=3 {
        save(&*storage, &request(id, 1)).await;
    }
    let mut transaction = storage.begin_transaction().await.unwrap();
    transaction.save_reply(&final_reply(1, 10)).await.unwrap();
    transaction.savepoint().await.unwrap();
    transaction.save_reply(&final_reply(2, 11)).await.unwrap();
    transaction.rollback_to_savepoint().await.unwrap();
    transaction.save_reply(&final_reply(3, 12)).await.unwrap();
    transaction.rollback_to_savepoint().await.unwrap();
    transaction.save_reply(&final_reply(3, 13)).await.unwrap();
    transaction.commit().await.unwrap();
    let replies = storage.replies_for(&snowflakes(&[1, 2, 3])).await.unwrap();
    assert_eq!(reply_ids(&replies), [10, 13], "{}", fixture.name());

    let mut without = storage.begin_transaction().await.unwrap();
    let refused = without.rollback_to_savepoint().await;
    assert!(refused.is_err(), "{}: {refused:?}", fixture.name());
    let _ = without.rollback().await;
}

// --- Entity state -------------------------------------------------------------------------------

fn json(text: &str) -> RawJson {
    RawJson::from_json(text.to_owned()).unwrap()
}

/// A write of `value` (`None`: a deletion) to `address`'s state, loaded at revision `expected`.
fn state_write(address: &EntityAddress, expected: u64, value: Option<&str>) -> StateWrite {
    StateWrite { address: address.clone(), expected, value: value.map(json) }
}

fn stored_state(value: &str, revision: u64) -> Option<StoredState> {
    Some(StoredState { value: json(value), revision })
}

async fn load_state(storage: &dyn MessageStorage, address: &EntityAddress) -> Option<StoredState> {
    storage.load_state(address).await.unwrap()
}

/// Asserts that `result` is a stale state write of `address`'s entity.
fn assert_stale(backend: &str, result: Result<(), StorageError>, address: &EntityAddress) {
    let Err(error) = result else {
        panic!("{backend}: a stale write of the state of {address} was accepted");
    };
    assert_eq!(error.kind(), StorageErrorKind::StaleState, "{backend}: {error}");
    let message = error.to_string();
    assert!(message.contains(&address.to_string()), "{backend}: {message:?} names no entity");
}

/// A state is inserted at revision 1, each write moves it on by one, a deletion removes it, and
/// a state written after a deletion starts again at revision 1. The JSON text reads back byte
/// for byte.
pub async fn entity_state_round_trips(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let entity = address("e1", 1);
    assert_eq!(load_state(&*storage, &entity).await, None, "{name}");
    // A deletion of no row, by a writer that found none, writes nothing.
    storage.save_state(&state_write(&entity, 0, None)).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, None, "{name}");
    let first = r#"{"name":"José \"J\"","items":[1,2.5,{"a":null}],"empty":{}}"#;
    storage.save_state(&state_write(&entity, 0, Some(first))).await.unwrap();
    let loaded = load_state(&*storage, &entity).await;
    assert_eq!(loaded, stored_state(first, 1), "{name}");
    assert_eq!(loaded.unwrap().value.json(), Some(first), "{name}: the text is kept");
    storage.save_state(&state_write(&entity, 1, Some(r#"{"n":2}"#))).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state(r#"{"n":2}"#, 2), "{name}");
    storage.save_state(&state_write(&entity, 2, Some("3"))).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state("3", 3), "{name}");
    storage.save_state(&state_write(&entity, 3, None)).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, None, "{name}");
    storage.save_state(&state_write(&entity, 0, Some("[]"))).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state("[]", 1), "{name}");
    assert_eq!(load_state(&*storage, &address("e2", 1)).await, None, "{name}: another entity");
}

/// A write at a revision the row does not have is stale and changes nothing: an update or a
/// deletion at another revision, an insert over an existing row, an update of no row.
pub async fn a_stale_state_write_is_refused(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let entity = address("e1", 1);
    storage.save_state(&state_write(&entity, 0, Some(r#"{"n":1}"#))).await.unwrap();
    storage.save_state(&state_write(&entity, 1, Some(r#"{"n":2}"#))).await.unwrap();
    let stale = [
        state_write(&entity, 1, Some(r#"{"stale":"older"}"#)),
        state_write(&entity, 3, Some(r#"{"stale":"newer"}"#)),
        state_write(&entity, 0, Some(r#"{"stale":"insert"}"#)),
        state_write(&entity, 1, None),
        state_write(&entity, 5, None),
    ];
    for write in &stale {
        assert_stale(name, storage.save_state(write).await, &entity);
        let loaded = load_state(&*storage, &entity).await;
        assert_eq!(loaded, stored_state(r#"{"n":2}"#, 2), "{name}: after {write:?}");
    }
    let missing = address("e2", 1);
    assert_stale(name, storage.save_state(&state_write(&missing, 1, Some("1"))).await, &missing);
    assert_stale(name, storage.save_state(&state_write(&missing, 1, None)).await, &missing);
    assert_eq!(load_state(&*storage, &missing).await, None, "{name}");
    // The writer that loaded the latest revision goes on.
    storage.save_state(&state_write(&entity, 2, Some(r#"{"n":3}"#))).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state(r#"{"n":3}"#, 3), "{name}");
}

/// Writers racing with the same loaded revision: exactly one wins, the others are stale, and
/// the row holds the winner's value.
pub async fn racing_state_writers_one_wins(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let entity = address("e1", 1);
    for expected in [0_u64, 1] {
        let writes: Vec<StateWrite> = (0..4)
            .map(|writer| {
                state_write(&entity, expected, Some(&format!(r#"{{"writer":{writer}}}"#)))
            })
            .collect();
        let results = join_all(writes.iter().map(|write| storage.save_state(write))).await;
        let mut winners = Vec::new();
        for (write, result) in writes.iter().zip(results) {
            match result {
                Ok(()) => winners.push(write),
                Err(error) => {
                    assert_eq!(error.kind(), StorageErrorKind::StaleState, "{name}: {error}");
                }
            }
        }
        let [winner] = winners.as_slice() else {
            panic!("{name}: {} writers of revision {expected} won", winners.len());
        };
        let loaded = load_state(&*storage, &entity).await.unwrap();
        assert_eq!(loaded.revision, expected + 1, "{name}");
        assert_eq!(Some(&loaded.value), winner.value.as_ref(), "{name}");
    }
}

/// A final reply saved with a state stores both: the reply is there, the request (with its
/// interrupt) is processed, the state is written; the next one updates the state.
pub async fn a_reply_with_state_commits_both(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let target = request(1, 1);
    save(&*storage, &target).await;
    save(&*storage, &request(2, 1)).await;
    assert_eq!(read_ids(&*storage).await, [1, 2], "{name}");
    let interrupt = Interrupt {
        id: Snowflake::new(3),
        address: target.address.clone(),
        request_id: target.request_id,
    };
    storage.save_interrupt(&interrupt).await.unwrap();
    let entity = &target.address;
    let write = state_write(entity, 0, Some(r#"{"count":1}"#));
    storage.save_reply_with_state(&final_reply(1, 10), &write).await.unwrap();
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()), [10], "{name}");
    assert_eq!(load_state(&*storage, entity).await, stored_state(r#"{"count":1}"#, 1), "{name}");
    let write = state_write(entity, 1, Some(r#"{"count":2}"#));
    storage.save_reply_with_state(&final_reply(2, 11), &write).await.unwrap();
    assert_eq!(load_state(&*storage, entity).await, stored_state(r#"{"count":2}"#, 2), "{name}");
    // Both requests, and the interrupt, are processed: released claims bring nothing back.
    storage.reset_shards(&[shard(1)]).await.unwrap();
    assert_eq!(read_ids(&*storage).await, Vec::<u64>::new(), "{name}");
    let replies = storage.replies_for(&snowflakes(&[1, 2])).await.unwrap();
    assert_eq!(replies, [final_reply(1, 10), final_reply(2, 11)], "{name}");
    // A deletion with a reply.
    save(&*storage, &request(4, 1)).await;
    storage
        .save_reply_with_state(&final_reply(4, 12), &state_write(entity, 2, None))
        .await
        .unwrap();
    assert_eq!(load_state(&*storage, entity).await, None, "{name}");
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[4])).await.unwrap()), [12], "{name}");
}

/// Concurrent saves of replies with states (one batch, on a storage that batches them) fail
/// alone: a stale state with `StaleState`, a second final reply with `Conflict`, each writing
/// nothing; the others store their reply and their state.
pub async fn concurrent_replies_with_state_fail_alone(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let entity = |id: u64| request(id, u32::try_from(id).unwrap()).address;
    for id in 1..=10 {
        save(&*storage, &request(id, u32::try_from(id).unwrap())).await;
    }
    // Entities 5 and 10 have a row: their saves, which expect none, are stale.
    for id in [5, 10] {
        storage.save_state(&state_write(&entity(id), 0, Some("1"))).await.unwrap();
    }
    // Request 9 is answered already: its save is a second final reply.
    storage.save_reply(&final_reply(9, 100)).await.unwrap();
    // A round with a stale save only, then one with a conflict too.
    for round in [1..=5, 6..=10] {
        let saves: Vec<(u64, Reply, StateWrite)> = round
            .map(|id| (id, final_reply(id, 10 + id), state_write(&entity(id), 0, Some("7"))))
            .collect();
        let results = futures_util::future::join_all(
            saves.iter().map(|(_, reply, write)| storage.save_reply_with_state(reply, write)),
        )
        .await;
        for ((id, reply, _), result) in saves.iter().zip(results) {
            let replies = storage.replies_for(&snowflakes(&[*id])).await.unwrap();
            let state = load_state(&*storage, &entity(*id)).await;
            match id {
                5 | 10 => {
                    assert_stale(name, result, &entity(*id));
                    assert_eq!(replies, [], "{name}: request {id} got no reply");
                    assert_eq!(state, stored_state("1", 1), "{name}: entity {id}");
                }
                9 => {
                    let error = result.expect_err("a second final reply");
                    assert_eq!(error.kind(), StorageErrorKind::Conflict, "{name}: {error}");
                    assert_eq!(replies, [final_reply(9, 100)], "{name}");
                    assert_eq!(state, None, "{name}: the conflict rolled its state back");
                }
                _ => {
                    result.unwrap_or_else(|error| panic!("{name}: request {id}: {error}"));
                    assert_eq!(replies, std::slice::from_ref(reply), "{name}: request {id}");
                    assert_eq!(state, stored_state("7", 1), "{name}: entity {id}");
                }
            }
        }
    }
}

/// A stale state stores no reply: the request stays unprocessed, the state unchanged; saved
/// again at the stored revision, both are written.
pub async fn a_stale_state_stores_no_reply(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let target = request(1, 1);
    save(&*storage, &target).await;
    let entity = &target.address;
    storage.save_state(&state_write(entity, 0, Some(r#"{"by":"owner"}"#))).await.unwrap();
    for expected in [0, 2] {
        let write = state_write(entity, expected, Some(r#"{"by":"stale"}"#));
        assert_stale(
            name,
            storage.save_reply_with_state(&final_reply(1, 10), &write).await,
            entity,
        );
    }
    let stored = storage.replies_for_unfiltered(&snowflakes(&[1])).await.unwrap();
    assert!(stored.is_empty(), "{name}: a reply was stored: {stored:?}");
    assert_eq!(load_state(&*storage, entity).await, stored_state(r#"{"by":"owner"}"#, 1), "{name}");
    assert_eq!(read_ids(&*storage).await, [1], "{name}: the request waits for its reply");
    let write = state_write(entity, 1, Some(r#"{"by":"next"}"#));
    storage.save_reply_with_state(&final_reply(1, 10), &write).await.unwrap();
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()), [10], "{name}");
    assert_eq!(load_state(&*storage, entity).await, stored_state(r#"{"by":"next"}"#, 2), "{name}");
}

/// A second final reply is a conflict with a state too, and then the state is not written: no
/// row is made, and a row is not changed.
pub async fn a_second_final_reply_writes_no_state(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let target = request(1, 1);
    save(&*storage, &target).await;
    let entity = &target.address;
    storage.save_reply(&final_reply(1, 10)).await.unwrap();
    let write = state_write(entity, 0, Some(r#"{"n":1}"#));
    let error = storage.save_reply_with_state(&final_reply(1, 11), &write).await.unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::Conflict, "{name}: {error}");
    assert_eq!(load_state(&*storage, entity).await, None, "{name}");
    storage.save_state(&write).await.unwrap();
    let update = state_write(entity, 1, Some(r#"{"n":2}"#));
    let error = storage.save_reply_with_state(&final_reply(1, 12), &update).await.unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::Conflict, "{name}: {error}");
    assert_eq!(load_state(&*storage, entity).await, stored_state(r#"{"n":1}"#, 1), "{name}");
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()), [10], "{name}");
    // The state goes on at the revision it has.
    storage.save_state(&update).await.unwrap();
}

/// A state at the limit is stored whole; one byte over it is refused as invalid input, with a
/// message that names the entity, the size and the limit, alone, with a reply and in a
/// transaction (which goes on): nothing of it is written.
pub async fn state_over_the_limit_is_refused(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let limit = fixture.state_bytes_max();
    let over = limit + 1;
    let entity = address("e1", 1);
    let what = format!("the state of {entity}");
    let at_limit = json_string(limit);
    let write = StateWrite { address: entity.clone(), expected: 0, value: Some(at_limit.clone()) };
    storage.save_state(&write).await.unwrap();
    let loaded = load_state(&*storage, &entity).await.unwrap();
    assert!(loaded.value == at_limit && loaded.revision == 1, "{name}: the state at the limit");
    let over_limit =
        |expected| StateWrite { address: entity.clone(), expected, value: Some(json_string(over)) };
    assert_refused(name, storage.save_state(&over_limit(1)).await, &what, over, limit);
    assert_refused(name, storage.save_state(&over_limit(0)).await, &what, over, limit);
    save(&*storage, &request(1, 1)).await;
    let refused = storage.save_reply_with_state(&final_reply(1, 10), &over_limit(1)).await;
    assert_refused(name, refused, &what, over, limit);
    let stored = storage.replies_for_unfiltered(&snowflakes(&[1])).await.unwrap();
    assert!(stored.is_empty(), "{name}: a reply was stored: {stored:?}");
    let mut transaction = storage.begin_transaction().await.unwrap();
    assert_refused(name, transaction.save_state(&over_limit(1)).await, &what, over, limit);
    transaction.save_state(&state_write(&entity, 1, Some("1"))).await.unwrap();
    transaction.commit().await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state("1", 2), "{name}");
}

/// States written in a transaction are invisible until commit and gone on rollback or back to
/// a savepoint; the transaction sees its own writes, refuses a stale one, and commits a state
/// with a reply.
pub async fn state_in_a_transaction_commits_and_rolls_back(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let entity = address("e1", 1);
    let mut committed = storage.begin_transaction().await.unwrap();
    committed.save_state(&state_write(&entity, 0, Some(r#"{"n":1}"#))).await.unwrap();
    committed.save_state(&state_write(&entity, 1, Some(r#"{"n":2}"#))).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, None, "{name}: visible before commit");
    committed.commit().await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state(r#"{"n":2}"#, 2), "{name}");

    let mut rolled_back = storage.begin_transaction().await.unwrap();
    rolled_back.save_state(&state_write(&entity, 2, Some(r#"{"n":3}"#))).await.unwrap();
    rolled_back.rollback().await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state(r#"{"n":2}"#, 2), "{name}");

    let mut stale = storage.begin_transaction().await.unwrap();
    assert_stale(name, stale.save_state(&state_write(&entity, 1, Some("1"))).await, &entity);
    assert_stale(name, stale.save_state(&state_write(&entity, 0, Some("1"))).await, &entity);
    stale.rollback().await.unwrap();

    save(&*storage, &request(1, 1)).await;
    let mut with_reply = storage.begin_transaction().await.unwrap();
    with_reply.save_state(&state_write(&entity, 2, Some(r#"{"n":3}"#))).await.unwrap();
    with_reply.savepoint().await.unwrap();
    with_reply.save_state(&state_write(&entity, 3, None)).await.unwrap();
    with_reply.rollback_to_savepoint().await.unwrap();
    with_reply.save_reply(&final_reply(1, 10)).await.unwrap();
    with_reply.commit().await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state(r#"{"n":3}"#, 3), "{name}");
    assert_eq!(reply_ids(&storage.replies_for(&snowflakes(&[1])).await.unwrap()), [10], "{name}");

    // Deleted in a transaction.
    let mut deleting = storage.begin_transaction().await.unwrap();
    deleting.save_state(&state_write(&entity, 3, None)).await.unwrap();
    deleting.commit().await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, None, "{name}");
}

/// A state row is keyed by the entity's type and id, compared exactly (as
/// `keys_are_compared_exactly` compares them): the same id of another type is another row, ids
/// differing in case, accents or a trailing space are other rows; the same type and id on
/// another shard is the same row.
pub async fn states_are_keyed_by_type_and_id(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let of_type = |entity_type: &str, entity_id: &str| EntityAddress {
        shard_id: shard(1),
        entity_type: EntityType::from(entity_type),
        entity_id: EntityId::from(entity_id),
    };
    let mut entities: Vec<EntityAddress> =
        ["Alice", "alice", "José", "Jose", "Bob", "Bob "].iter().map(|id| address(id, 1)).collect();
    entities.push(of_type("OtherEntity", "Alice"));
    entities.push(of_type("testentity", "Alice"));
    for (n, entity) in entities.iter().enumerate() {
        let write = state_write(entity, 0, Some(&n.to_string()));
        storage
            .save_state(&write)
            .await
            .unwrap_or_else(|error| panic!("{name}: {entity}: {error}"));
    }
    for (n, entity) in entities.iter().enumerate() {
        let loaded = load_state(&*storage, entity).await;
        assert_eq!(loaded, stored_state(&n.to_string(), 1), "{name}: {entity}");
    }
    // Another shard, the same entity: its row.
    let moved = address("Alice", 2);
    assert_eq!(load_state(&*storage, &moved).await, stored_state("0", 1), "{name}");
    storage.save_state(&state_write(&moved, 1, Some(r#""moved""#))).await.unwrap();
    assert_eq!(load_state(&*storage, &entities[0]).await, stored_state(r#""moved""#, 2), "{name}");
    // Deleting one leaves the others.
    storage.save_state(&state_write(&entities[1], 1, None)).await.unwrap();
    assert_eq!(load_state(&*storage, &entities[1]).await, None, "{name}");
    for (n, entity) in entities.iter().enumerate().skip(2) {
        assert_eq!(load_state(&*storage, entity).await, stored_state(&n.to_string(), 1), "{name}");
    }
}

/// A stored state that is not JSON is a malformed row named by its entity, not a panic; a
/// write at its revision replaces it.
pub async fn malformed_state_is_reported(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let entity = address("e1", 1);
    storage.save_state(&state_write(&entity, 0, Some(r#"{"n":1}"#))).await.unwrap();
    fixture.corrupt(Corruption::StateValue(entity.clone())).await;
    let error = storage.load_state(&entity).await.unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::Malformed, "{name}: {error}");
    assert!(error.to_string().contains(&entity.to_string()), "{name}: {error} names no entity");
    assert_eq!(load_state(&*storage, &address("e2", 1)).await, None, "{name}: others read");
    storage.save_state(&state_write(&entity, 1, Some(r#"{"n":2}"#))).await.unwrap();
    assert_eq!(load_state(&*storage, &entity).await, stored_state(r#"{"n":2}"#, 2), "{name}");
}

// --- Retention ----------------------------------------------------------------------------------

/// Day `n` after the snowflake epoch, the clock of the retention cases.
fn day(n: u64) -> Timestamp {
    EPOCH.saturating_add(Duration::from_secs(n * 86_400))
}

/// The cutoff of the retention cases: replies made before day 10.
fn cutoff() -> Snowflake {
    replied_before(day(10))
}

/// A reply id made on day `n` (sequence `sequence`): ids of later days are higher.
fn made_on(n: u64, sequence: u16) -> u64 {
    let parts = SnowflakeParts { timestamp: day(n), machine_id: MachineId::new(1), sequence };
    Snowflake::from_parts(parts).get()
}

/// An address of entity type `entity_type` on shard 1.
fn typed(entity_type: &str, entity_id: &str) -> EntityAddress {
    EntityAddress { entity_type: EntityType::from(entity_type), ..address(entity_id, 1) }
}

/// A request `id` to `address` with `tag`.
fn tagged(id: u64, address: EntityAddress, tag: &str) -> Request {
    Request { tag: tag.into(), ..request_to(id, address) }
}

fn purge_batch(keep: &[&str], limit: u32) -> PurgeProcessed {
    PurgeProcessed {
        replied_before: cutoff(),
        keep_entity_type_prefixes: keep.iter().map(|prefix| (*prefix).to_owned()).collect(),
        limit,
    }
}

/// Every request answered at any time, of any type: what a purge left.
fn everything() -> ProcessedQuery {
    ProcessedQuery {
        entity_type_prefix: String::new(),
        tag: None,
        replied_before: replied_before(day(10_000)),
        after: None,
        limit: 1_000,
    }
}

async fn processed_ids(storage: &dyn MessageStorage, query: &ProcessedQuery) -> Vec<u64> {
    let listed = storage.processed_requests(query).await.unwrap();
    listed.iter().map(|processed| processed.request_id.get()).collect()
}

/// The ids of the unprocessed, deliverable rows among `rows`, without claiming them.
async fn deliverable(storage: &dyn MessageStorage, rows: &[u64]) -> Vec<u64> {
    let batch = storage.unprocessed_messages_by_id(&snowflakes(rows), now()).await.unwrap();
    ids(&batch)
}

/// Asserts that `result` is an `InvalidInput`.
fn assert_invalid<T: std::fmt::Debug>(backend: &str, result: Result<T, StorageError>) {
    let error = result.expect_err("a limit of 0");
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{backend}: {error}");
}

/// A purge deletes the requests answered before the cutoff, with their interrupts,
/// acknowledgements, chunks and final reply; it keeps unprocessed requests, requests with
/// chunks but no final reply, and requests answered at or after the cutoff.
pub async fn purge_deletes_requests_answered_before_the_cutoff(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let old = request(1, 1);
    for id in 1..=6 {
        save(&*storage, &request(id, 1)).await;
    }
    // Request 1: a chunk, its final reply on day 1, then an acknowledgement and an interrupt
    // that came after it (rows still unprocessed, held back by the final reply).
    storage.save_reply(&chunk(1, 11, 0)).await.unwrap();
    storage.save_reply(&final_reply(1, made_on(1, 0))).await.unwrap();
    storage.save_ack_chunk(&ack(101, &old, 11)).await.unwrap();
    let interrupt = Interrupt {
        id: Snowflake::new(102),
        address: old.address.clone(),
        request_id: old.request_id,
    };
    storage.save_interrupt(&interrupt).await.unwrap();
    // Request 2 is unprocessed; request 3 has a chunk and no final reply.
    storage.save_reply(&chunk(3, 12, 0)).await.unwrap();
    // Request 6 was answered just before the cutoff, request 5 at the cutoff exactly,
    // request 4 on day 20 (saved in id order, which is insertion order on every backend).
    storage.save_reply(&final_reply(6, cutoff().get() - 1)).await.unwrap();
    storage.save_reply(&final_reply(5, cutoff().get())).await.unwrap();
    storage.save_reply(&final_reply(4, made_on(20, 0))).await.unwrap();
    let rows = [1, 2, 3, 4, 5, 6, 101, 102];
    assert_eq!(deliverable(&*storage, &rows).await, [2], "{name}");

    assert_eq!(storage.purge_processed(&purge_batch(&[], 100)).await.unwrap(), 2, "{name}");
    assert_eq!(
        storage.replies_for_unfiltered(&snowflakes(&[1, 6])).await.unwrap(),
        [],
        "{name}: the chunk and the final replies are gone"
    );
    // The acknowledgement and the interrupt went too: left alone, without their final reply,
    // they would now be delivered.
    assert_eq!(deliverable(&*storage, &rows).await, [2], "{name}");
    assert_eq!(processed_ids(&*storage, &everything()).await, [4, 5], "{name}");
    let kept = storage.replies_for_unfiltered(&snowflakes(&[3, 4, 5])).await.unwrap();
    assert_eq!(
        kept,
        [chunk(3, 12, 0), final_reply(5, cutoff().get()), final_reply(4, made_on(20, 0))],
        "{name}"
    );
    assert_eq!(storage.purge_processed(&purge_batch(&[], 100)).await.unwrap(), 0, "{name}");
    // Request 2 is still delivered, with its id.
    assert_eq!(read_ids(&*storage).await, [2], "{name}");
}

/// A purge keeps the requests of entity types that start with a keep prefix, compared byte
/// for byte: no case folding, and `%` or `_` are no wildcards.
pub async fn purge_keeps_entity_types_with_a_keep_prefix(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let types = [
        "Workflow/Order",
        "workflow/Order",
        "Workflows",
        "Pay%Plan",
        "PayPlan",
        "TestEntity",
        "Pay_Day",
        "PayXDay",
    ];
    for (id, entity_type) in (1_u64..).zip(types) {
        save(&*storage, &request_to(id, typed(entity_type, "e1"))).await;
        storage.save_reply(&final_reply(id, made_on(id, 0))).await.unwrap();
    }
    let keep = [WORKFLOW_ENTITY_TYPE_PREFIX, "Pay%", "Pay_D"];
    assert_eq!(storage.purge_processed(&purge_batch(&keep, 100)).await.unwrap(), 5, "{name}");
    assert_eq!(processed_ids(&*storage, &everything()).await, [1, 4, 7], "{name}");
}

/// A purge deletes at most its limit, the lowest request ids first (whenever they were
/// answered); repeated calls drain what is due, the last one deleting fewer than the limit. A
/// limit of 0 is refused and deletes nothing.
pub async fn purge_honors_its_limit(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    for id in 1..=5 {
        save(&*storage, &request(id, 1)).await;
        // The lowest request was answered last.
        storage.save_reply(&final_reply(id, made_on(6 - id, 0))).await.unwrap();
    }
    assert_invalid(name, storage.purge_processed(&purge_batch(&[], 0)).await);
    assert_eq!(processed_ids(&*storage, &everything()).await, [1, 2, 3, 4, 5], "{name}");
    assert_eq!(storage.purge_processed(&purge_batch(&[], 2)).await.unwrap(), 2, "{name}");
    assert_eq!(processed_ids(&*storage, &everything()).await, [3, 4, 5], "{name}");
    assert_eq!(storage.purge_processed(&purge_batch(&[], 2)).await.unwrap(), 2, "{name}");
    assert_eq!(storage.purge_processed(&purge_batch(&[], 2)).await.unwrap(), 1, "{name}");
    assert_eq!(storage.purge_processed(&purge_batch(&[], 2)).await.unwrap(), 0, "{name}");
    assert_eq!(processed_ids(&*storage, &everything()).await, [0_u64; 0], "{name}");
}

/// A purged request's primary key is free: a request saved with it again is a new request,
/// not its duplicate.
pub async fn a_purged_requests_primary_key_can_be_saved_again(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let first = request(1, 1);
    assert_eq!(save_keyed(&*storage, &first, "k").await, SaveResult::Success, "{name}");
    storage.save_reply(&final_reply(1, made_on(1, 0))).await.unwrap();
    let duplicate = save_keyed(&*storage, &request(2, 1), "k").await;
    let SaveResult::Duplicate { original_id, .. } = duplicate else {
        panic!("{name}: expected a duplicate before the purge, got {duplicate:?}")
    };
    assert_eq!(original_id, Snowflake::new(1), "{name}");
    assert_eq!(storage.purge_processed(&purge_batch(&[], 10)).await.unwrap(), 1, "{name}");
    let key = primary_key(&first.address, &first.tag, "k");
    assert_eq!(storage.request_id_for_primary_key(&key).await.unwrap(), None, "{name}");
    assert_eq!(save_keyed(&*storage, &request(3, 1), "k").await, SaveResult::Success, "{name}");
    assert_eq!(storage.request_id_for_primary_key(&key).await.unwrap(), Some(Snowflake::new(3)));
    assert_eq!(read_ids(&*storage).await, [3], "{name}");
}

/// A purge never touches entity state: the state written with a purged request's reply stays.
pub async fn entity_state_survives_a_purge(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let entity = address("e1", 1);
    save(&*storage, &request(1, 1)).await;
    let write = state_write(&entity, 0, Some(r#"{"n":1}"#));
    storage.save_reply_with_state(&final_reply(1, made_on(1, 0)), &write).await.unwrap();
    assert_eq!(storage.purge_processed(&purge_batch(&[], 10)).await.unwrap(), 1, "{name}");
    assert_eq!(storage.replies_for(&snowflakes(&[1])).await.unwrap(), [], "{name}");
    assert_eq!(load_state(&*storage, &entity).await, stored_state(r#"{"n":1}"#, 1), "{name}");
}

/// The processed requests are listed by entity type prefix, tag and cutoff, in request id
/// order, paged with `after`, each with its address, tag and decoded final reply (a reply that
/// cannot be decoded reads as a defect). Listing deletes nothing; a limit of 0 is refused.
pub async fn processed_requests_filters_and_pages(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let on_shard_2 = EntityAddress { shard_id: shard(2), ..typed("TestEntity", "e2") };
    let requests = [
        tagged(1, typed("TestEntity", "e1"), "GetUser"),
        tagged(2, typed("TestEntity", "e1"), "SetUser"),
        tagged(3, typed("Other", "e1"), "GetUser"),
        tagged(4, typed("TestEntity", "e1"), "GetUser"),
        tagged(5, typed("TestEntity", "e1"), "GetUser"),
        tagged(6, on_shard_2, "GetUser"),
        tagged(7, typed("TestEntityX", "e1"), "getuser"),
    ];
    for request in &requests {
        save(&*storage, request).await;
    }
    // Request 4 is answered after the cutoff, request 5 not at all.
    let replies: BTreeMap<u64, Reply> = [(1, 1), (2, 2), (3, 3), (4, 20), (6, 4), (7, 5)]
        .into_iter()
        .map(|(id, day)| (id, final_reply(id, made_on(day, 0))))
        .collect();
    for reply in replies.values() {
        storage.save_reply(reply).await.unwrap();
    }
    let query = ProcessedQuery {
        entity_type_prefix: "TestEntity".to_owned(),
        tag: None,
        replied_before: cutoff(),
        after: None,
        limit: 10,
    };
    let listed = storage.processed_requests(&query).await.unwrap();
    let expected: Vec<ProcessedRequest> = [1, 2, 6, 7]
        .into_iter()
        .map(|id| {
            let request = &requests[usize::try_from(id - 1).unwrap()];
            let Reply::WithExit(reply) = replies[&id].clone() else {
                panic!("request {id}'s reply is a final reply")
            };
            ProcessedRequest {
                request_id: request.request_id,
                address: request.address.clone(),
                tag: request.tag.as_str().to_owned(),
                payload: Some(request.payload.clone()),
                reply,
            }
        })
        .collect();
    assert_eq!(listed, expected, "{name}");
    // The tag is compared exactly.
    let by_tag = ProcessedQuery { tag: Some("GetUser".to_owned()), ..query.clone() };
    assert_eq!(processed_ids(&*storage, &by_tag).await, [1, 6], "{name}");
    let lower_tag = ProcessedQuery { tag: Some("getuser".to_owned()), ..query.clone() };
    assert_eq!(processed_ids(&*storage, &lower_tag).await, [7], "{name}");
    let other = ProcessedQuery { entity_type_prefix: "Oth".to_owned(), ..query.clone() };
    assert_eq!(processed_ids(&*storage, &other).await, [3], "{name}");
    let lower = ProcessedQuery { entity_type_prefix: "testentity".to_owned(), ..query.clone() };
    assert_eq!(processed_ids(&*storage, &lower).await, [0_u64; 0], "{name}");
    // The cutoff: a later one lists request 4 too.
    let later = ProcessedQuery { replied_before: replied_before(day(21)), ..query.clone() };
    assert_eq!(processed_ids(&*storage, &later).await, [1, 2, 4, 6, 7], "{name}");
    // Pages of two, over every type.
    let mut page = ProcessedQuery { entity_type_prefix: String::new(), limit: 2, ..query.clone() };
    let mut pages = Vec::new();
    loop {
        let ids = processed_ids(&*storage, &page).await;
        let Some(last) = ids.last() else { break };
        page.after = Some(Snowflake::new(*last));
        pages.push(ids);
    }
    assert_eq!(pages, [vec![1, 2], vec![3, 6], vec![7]], "{name}");
    assert_invalid(
        name,
        storage.processed_requests(&ProcessedQuery { limit: 0, ..query.clone() }).await,
    );
    // Listing deleted nothing.
    let all: Vec<u64> = replies.keys().copied().collect();
    assert_eq!(storage.replies_for(&snowflakes(&all)).await.unwrap().len(), 6, "{name}");
    // A final reply that cannot be decoded is listed as a defect.
    fixture.corrupt(Corruption::ReplyPayload(Snowflake::new(made_on(2, 0)))).await;
    let listed = storage.processed_requests(&only(&query, 2)).await.unwrap();
    let [ProcessedRequest { request_id, reply: WithExit { exit: Exit::Failure(cause), .. }, .. }] =
        listed.as_slice()
    else {
        panic!("{name}: expected request 2 with a defect reply, got {listed:?}")
    };
    assert_eq!(*request_id, Snowflake::new(2), "{name}");
    assert!(
        matches!(&cause.0[0], CauseReason::Die(defect) if defect.json().unwrap_or("").contains("MalformedMessage")),
        "{name}: {cause:?}"
    );
}

/// `query` narrowed to the request `id`, if it lists it: one request after `id - 1`.
fn only(query: &ProcessedQuery, id: u64) -> ProcessedQuery {
    ProcessedQuery { after: Some(Snowflake::new(id - 1)), limit: 1, ..query.clone() }
}

// --- Runners and shard locks --------------------------------------------------------------------

/// Registration upserts by address and keeps the machine id of a live address (effect's SQL storage
/// tests).
pub async fn register_and_get_runners(fixture: &dyn StorageFixture) {
    let storage = fixture.runner_storage(LONG_EXPIRATION).await;
    assert!(storage.get_runners().await.unwrap().is_empty());
    let a = runner("a");
    let first = storage.register(&a, true).await.unwrap();
    assert_eq!(first.get(), 1, "{}: the first machine id", fixture.name());
    assert_eq!(storage.get_runners().await.unwrap(), [(a.clone(), true)]);
    assert_eq!(storage.register(&a, true).await.unwrap(), first, "re-registering keeps the id");
    let b = runner("b");
    let second = storage.register(&b, true).await.unwrap();
    assert_ne!(second, first);
    let mut runners = storage.get_runners().await.unwrap();
    runners.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(runners, [(a, true), (b, true)]);
}

/// The health flag is stored and read back (effect's `RunnerStorage.test.ts`).
pub async fn runner_health_flips(fixture: &dyn StorageFixture) {
    let storage = fixture.runner_storage(LONG_EXPIRATION).await;
    let a = runner("a");
    storage.register(&a, false).await.unwrap();
    assert_eq!(storage.get_runners().await.unwrap(), [(a.clone(), false)]);
    storage.set_runner_health(&a.address, true).await.unwrap();
    assert_eq!(storage.get_runners().await.unwrap(), [(a.clone(), true)]);
    storage.set_runner_health(&a.address, false).await.unwrap();
    assert_eq!(storage.get_runners().await.unwrap(), [(a, false)]);
}

/// Unregistering removes the runner; registering again gives a new, larger machine id.
pub async fn unregister_removes_the_runner(fixture: &dyn StorageFixture) {
    let storage = fixture.runner_storage(LONG_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    let first = storage.register(&a, true).await.unwrap();
    storage.register(&b, true).await.unwrap();
    storage.unregister(&a.address).await.unwrap();
    assert_eq!(storage.get_runners().await.unwrap(), [(b, true)]);
    let again = storage.register(&a, true).await.unwrap();
    assert!(again > first, "{}: {again} after {first}", fixture.name());
}

/// A runner whose heartbeat is older than the expiration is not returned.
pub async fn expired_heartbeat_hides_the_runner(fixture: &dyn StorageFixture) {
    let storage = fixture.runner_storage(SHORT_EXPIRATION).await;
    let a = runner("a");
    storage.register(&a, true).await.unwrap();
    assert_eq!(storage.get_runners().await.unwrap().len(), 1);
    eventually(fixture, "the heartbeat expires", || {
        let storage = Arc::clone(&storage);
        async move { storage.get_runners().await.is_ok_and(|runners| runners.is_empty()) }
    })
    .await;
    // A refresh is a heartbeat: the runner is back.
    storage.register(&a, true).await.unwrap();
    storage.refresh(&a.address, &[]).await.unwrap();
    assert_eq!(storage.get_runners().await.unwrap().len(), 1);
}

/// Acquire is idempotent, refresh reports held shards, release drops one (effect's SQL storage
/// tests).
pub async fn acquire_refresh_release(fixture: &dyn StorageFixture) {
    let storage = fixture.runner_storage(LONG_EXPIRATION).await;
    let a = runner("a");
    storage.register(&a, true).await.unwrap();
    let wanted = shards(&[1, 2, 3]);
    assert_eq!(sorted(storage.acquire(&a.address, &wanted).await.unwrap()), wanted);
    assert_eq!(
        sorted(storage.acquire(&a.address, &wanted).await.unwrap()),
        wanted,
        "acquire is idempotent"
    );
    assert_eq!(sorted(storage.refresh(&a.address, &wanted).await.unwrap()), wanted);
    storage.release(&a.address, &shard(2)).await.unwrap();
    assert_eq!(sorted(storage.refresh(&a.address, &wanted).await.unwrap()), shards(&[1, 3]));
    assert!(storage.refresh(&a.address, &[]).await.unwrap().is_empty(), "a probe holds nothing");
    assert!(storage.acquire(&a.address, &[]).await.unwrap().is_empty());
    storage.release(&a.address, &shard(2)).await.unwrap();
}

/// Two runners racing for the same shards end up with disjoint sets that cover them all.
pub async fn racing_runners_get_disjoint_shards(fixture: &dyn StorageFixture) {
    let first = fixture.runner_storage(LONG_EXPIRATION).await;
    let second = fixture.runner_storage(LONG_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    first.register(&a, true).await.unwrap();
    second.register(&b, true).await.unwrap();
    let wanted = shards(&(1..=20).collect::<Vec<u32>>());
    let (got_a, got_b) =
        tokio::join!(first.acquire(&a.address, &wanted), second.acquire(&b.address, &wanted));
    let (got_a, got_b) = (sorted(got_a.unwrap()), sorted(got_b.unwrap()));
    assert!(
        got_a.iter().all(|shard| !got_b.contains(shard)),
        "{}: both hold a shard: {got_a:?} {got_b:?}",
        fixture.name()
    );
    assert_eq!(
        sorted([got_a.clone(), got_b.clone()].concat()),
        wanted,
        "every shard has one owner"
    );
    // Trying again changes nothing; each refresh reports its own.
    assert_eq!(sorted(second.acquire(&b.address, &wanted).await.unwrap()), got_b);
    assert_eq!(sorted(first.refresh(&a.address, &wanted).await.unwrap()), got_a);
    assert_eq!(sorted(second.refresh(&b.address, &wanted).await.unwrap()), got_b);
}

/// A held shard is refused to others until it is released.
pub async fn released_shard_can_be_taken(fixture: &dyn StorageFixture) {
    let first = fixture.runner_storage(LONG_EXPIRATION).await;
    let second = fixture.runner_storage(LONG_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    first.register(&a, true).await.unwrap();
    second.register(&b, true).await.unwrap();
    assert_eq!(first.acquire(&a.address, &shards(&[1])).await.unwrap(), shards(&[1]));
    assert!(second.acquire(&b.address, &shards(&[1])).await.unwrap().is_empty());
    first.release(&a.address, &shard(1)).await.unwrap();
    assert_eq!(second.acquire(&b.address, &shards(&[1])).await.unwrap(), shards(&[1]));
    assert!(
        first.refresh(&a.address, &shards(&[1])).await.unwrap().is_empty(),
        "refresh never re-acquires"
    );
}

/// A holder that stops refreshing loses its shard after the expiration, to another runner.
pub async fn expired_lease_is_taken_over(fixture: &dyn StorageFixture) {
    let frozen = fixture.runner_storage(SHORT_EXPIRATION).await;
    let taker = fixture.runner_storage(SHORT_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    frozen.register(&a, true).await.unwrap();
    taker.register(&b, true).await.unwrap();
    assert_eq!(frozen.acquire(&a.address, &shards(&[1])).await.unwrap(), shards(&[1]));
    assert!(taker.acquire(&b.address, &shards(&[1])).await.unwrap().is_empty());
    let started = Instant::now();
    eventually(fixture, "the lease expires", || {
        let taker = Arc::clone(&taker);
        let b = b.clone();
        async move {
            taker.acquire(&b.address, &shards(&[1])).await.is_ok_and(|got| got == shards(&[1]))
        }
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "{}: taken over too early",
        fixture.name()
    );
    let refreshed = frozen.refresh(&a.address, &shards(&[1])).await;
    assert!(
        !refreshed.as_ref().is_ok_and(|held| held.contains(&shard(1))),
        "{}: both hold shard 1",
        fixture.name()
    );
}

/// Runner addresses are compared exactly: two runners whose hosts differ only in case are two
/// registrations, and one never takes, refreshes or releases the other's locks.
pub async fn runner_addresses_are_compared_exactly(fixture: &dyn StorageFixture) {
    let first = fixture.runner_storage(LONG_EXPIRATION).await;
    let second = fixture.runner_storage(LONG_EXPIRATION).await;
    let (upper, lower) = (runner("Host"), runner("host"));
    first.register(&upper, true).await.unwrap();
    second.register(&lower, true).await.unwrap();
    let mut runners = first.get_runners().await.unwrap();
    runners.sort_by(|x, y| x.0.cmp(&y.0));
    let mut expected = vec![(upper.clone(), true), (lower.clone(), true)];
    expected.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(runners, expected, "{}: two registrations", fixture.name());
    assert_eq!(first.acquire(&upper.address, &shards(&[1])).await.unwrap(), shards(&[1]));
    assert!(
        second.acquire(&lower.address, &shards(&[1])).await.unwrap().is_empty(),
        "{}: the other runner's lock was taken",
        fixture.name()
    );
    assert!(second.refresh(&lower.address, &shards(&[1])).await.unwrap().is_empty());
    second.release_all(&lower.address).await.unwrap();
    assert_eq!(
        first.refresh(&upper.address, &shards(&[1])).await.unwrap(),
        shards(&[1]),
        "{}: released by the other runner",
        fixture.name()
    );
    second.unregister(&lower.address).await.unwrap();
    assert_eq!(first.get_runners().await.unwrap(), [(upper, true)], "{}", fixture.name());
}

/// `release_all` drops every lock of the runner.
pub async fn release_all_drops_every_lock(fixture: &dyn StorageFixture) {
    let first = fixture.runner_storage(LONG_EXPIRATION).await;
    let second = fixture.runner_storage(LONG_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    first.register(&a, true).await.unwrap();
    second.register(&b, true).await.unwrap();
    assert_eq!(sorted(first.acquire(&a.address, &shards(&[1, 2])).await.unwrap()), shards(&[1, 2]));
    first.release_all(&a.address).await.unwrap();
    assert_eq!(
        sorted(second.acquire(&b.address, &shards(&[1, 2])).await.unwrap()),
        shards(&[1, 2])
    );
    assert!(first.refresh(&a.address, &shards(&[1, 2])).await.unwrap().is_empty());
    // The runner can take locks again after a release_all.
    second.release_all(&b.address).await.unwrap();
    assert_eq!(sorted(first.acquire(&a.address, &shards(&[1, 2])).await.unwrap()), shards(&[1, 2]));
}

/// `release_gone` frees the locks of a runner whose process is gone, at once, and leaves the
/// caller's own locks alone (advisory locks live in the caller's session).
pub async fn release_gone_frees_a_gone_runners_locks(fixture: &dyn StorageFixture) {
    let gone = fixture.runner_storage(LONG_EXPIRATION).await;
    let prober = fixture.runner_storage(LONG_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    gone.register(&a, true).await.unwrap();
    prober.register(&b, true).await.unwrap();
    assert_eq!(sorted(gone.acquire(&a.address, &shards(&[1, 2])).await.unwrap()), shards(&[1, 2]));
    assert_eq!(prober.acquire(&b.address, &shards(&[3])).await.unwrap(), shards(&[3]));
    // The process dies: its database sessions go with it.
    fixture.kill_runner_storage(gone).await;
    prober.release_gone(&a.address).await.unwrap();
    // Idempotent.
    prober.release_gone(&a.address).await.unwrap();
    eventually(fixture, "b takes a's shards", || async {
        sorted(prober.acquire(&b.address, &shards(&[1, 2])).await.unwrap()) == shards(&[1, 2])
    })
    .await;
    assert_eq!(
        prober.refresh(&b.address, &shards(&[1, 2, 3])).await.unwrap().len(),
        3,
        "{}: release_gone let go of the caller's own locks",
        fixture.name()
    );
    let third = fixture.runner_storage(LONG_EXPIRATION).await;
    let c = runner("c");
    third.register(&c, true).await.unwrap();
    assert!(
        third.acquire(&c.address, &shards(&[1, 2, 3])).await.unwrap().is_empty(),
        "{}: a third runner took b's shards",
        fixture.name()
    );
}

/// Waits until `condition` holds, polling every 100 ms, for at most [`EVENTUAL`].
async fn eventually<F, Fut>(fixture: &dyn StorageFixture, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + EVENTUAL;
    while !condition().await {
        assert!(
            Instant::now() < deadline,
            "{}: {what} did not happen within {EVENTUAL:?}",
            fixture.name()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// --- The read model ------------------------------------------------------------------------------

/// A request `id` to `address` with `tag`, saved for delivery at `deliver_at`.
async fn save_at(storage: &dyn MessageStorage, request: &Request, deliver_at: Timestamp) {
    let options = SaveRequestOptions { primary_key: None, deliver_at: Some(deliver_at) };
    let result = storage.save_request(request, &options).await.unwrap();
    assert_eq!(result, SaveResult::Success, "saving {:?}", request.request_id);
}

fn backlog_query(stale_after: Duration, limit: u32) -> BacklogQuery {
    BacklogQuery { now: now(), stale_after, limit }
}

/// The backlog groups unprocessed messages (requests and interrupts) by entity type and shard:
/// due and scheduled ones apart, claims counted and, once older than `stale_after`, counted as
/// stale; the group whose oldest due message waited longest first, groups with nothing due
/// last. Processed requests are not counted; limits outside 1 to the maximum are refused.
pub async fn backlog_groups_unprocessed_messages(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let later = now().saturating_add(Duration::from_secs(3_600));
    let on_shard_2 = EntityAddress { shard_id: shard(2), ..typed("TestEntity", "e4") };
    let on_shard_3 = EntityAddress { shard_id: shard(3), ..typed("Workflow/x", "w1") };
    save(&*storage, &request_to(made_on(3, 0), typed("TestEntity", "e1"))).await;
    save(&*storage, &request_to(made_on(4, 0), typed("TestEntity", "e2"))).await;
    save(&*storage, &request_to(made_on(1, 0), typed("TestEntity", "e3"))).await;
    storage.save_reply(&final_reply(made_on(1, 0), made_on(1, 5))).await.unwrap();
    save_at(&*storage, &request_to(made_on(2, 0), typed("Other", "o1")), day(5)).await;
    save_at(&*storage, &request_to(made_on(2, 1), typed("Other", "o2")), later).await;
    let interrupted = request_to(made_on(6, 0), on_shard_2.clone());
    save(&*storage, &interrupted).await;
    let interrupt = Interrupt {
        id: Snowflake::new(made_on(7, 0)),
        address: on_shard_2,
        request_id: interrupted.request_id,
    };
    storage.save_interrupt(&interrupt).await.unwrap();
    save_at(&*storage, &request_to(made_on(1, 1), on_shard_3), later).await;
    // Claims every due message of shard 1.
    assert_eq!(read(&*storage, &[shard(1)]).await.messages.len(), 3, "{name}");

    let listed = storage.backlog(&backlog_query(Duration::from_secs(3_600), 10)).await.unwrap();
    let group =
        |entity_type: &str, shard_id: u32, counts: [u64; 3], since: Option<Timestamp>| Backlog {
            entity_type: entity_type.to_owned(),
            shard_id: shard(shard_id),
            due: counts[0],
            scheduled: counts[1],
            claimed: counts[2],
            stale_claims: 0,
            waiting_since: since,
        };
    let expected = [
        group("TestEntity", 1, [2, 0, 2], Some(day(3))),
        group("Other", 1, [1, 1, 1], Some(day(5))),
        group("TestEntity", 2, [2, 0, 0], Some(day(6))),
        group("Workflow/x", 3, [0, 1, 0], None),
    ];
    assert_eq!(listed, expected, "{name}");
    assert_eq!(
        listed[0].oldest_age(day(4)),
        Duration::from_secs(86_400),
        "{name}: the oldest waited a day at day 4"
    );
    // Claims go stale once older than `stale_after`.
    eventually(fixture, "the claims go stale", || {
        let storage = Arc::clone(&storage);
        async move {
            let listed = storage.backlog(&backlog_query(Duration::ZERO, 10)).await.unwrap();
            listed.iter().all(|group| group.stale_claims == group.claimed)
        }
    })
    .await;
    let only_first = storage.backlog(&backlog_query(Duration::from_secs(3_600), 1)).await.unwrap();
    assert_eq!(only_first, expected[..1], "{name}");
    assert_invalid(name, storage.backlog(&backlog_query(Duration::ZERO, 0)).await);
    assert_invalid(name, storage.backlog(&backlog_query(Duration::ZERO, LIMIT_MAX + 1)).await);
}

async fn request_ids(storage: &dyn MessageStorage, query: &RequestQuery) -> Vec<u64> {
    let listed = storage.requests(query).await.unwrap();
    listed.iter().map(|record| record.request_id.get()).collect()
}

/// Requests are listed with their shard, tag, payload, processed and claimed flags, delivery
/// time, interrupt and final reply; every filter narrows the list; pages follow the ids both
/// ways; a damaged payload is left out and a damaged reply reads as a defect; interrupts are
/// not requests; limits outside 1 to the maximum are refused.
pub async fn requests_filter_page_and_carry_replies(fixture: &dyn StorageFixture) {
    let storage = fixture.message_storage();
    let name = fixture.name();
    let later = now().saturating_add(Duration::from_secs(3_600));
    let on_shard_2 = EntityAddress { shard_id: shard(2), ..typed("TestEntity", "e2") };
    let requests = [
        tagged(1, typed("TestEntity", "e1"), "GetUser"),
        tagged(2, typed("TestEntity", "e1"), "SetUser"),
        tagged(3, typed("Other", "e1"), "GetUser"),
        tagged(4, on_shard_2.clone(), "GetUser"),
        tagged(6, typed("TestEntityX", "e1"), "GetUser"),
    ];
    for request in &requests {
        if request.request_id.get() == 3 {
            save_at(&*storage, request, later).await;
        } else {
            save(&*storage, request).await;
        }
    }
    let interrupt =
        Interrupt { id: Snowflake::new(5), address: on_shard_2, request_id: Snowflake::new(4) };
    storage.save_interrupt(&interrupt).await.unwrap();
    let replies: BTreeMap<u64, Reply> =
        [(1, final_reply(1, 101)), (6, final_reply(6, 102))].into_iter().collect();
    for reply in replies.values() {
        storage.save_reply(reply).await.unwrap();
    }
    // Claims request 2 (1 is processed, 3 is not due).
    assert_eq!(read_ids(&*storage).await, [2], "{name}");

    let record = |request: &Request| {
        let id = request.request_id.get();
        RequestRecord {
            request_id: request.request_id,
            address: request.address.clone(),
            shard_id: request.address.shard_id.clone(),
            tag: request.tag.as_str().to_owned(),
            payload: Some(request.payload.clone()),
            processed: replies.contains_key(&id),
            claimed: id == 2,
            deliver_at: (id == 3).then_some(later),
            interrupted: id == 4,
            reply: replies.get(&id).map(|reply| match reply {
                Reply::WithExit(reply) => reply.clone(),
                Reply::Chunk(_) => panic!("a final reply"),
            }),
        }
    };
    let all = RequestQuery::all(10);
    let listed = storage.requests(&all).await.unwrap();
    assert_eq!(listed, requests.iter().map(record).collect::<Vec<_>>(), "{name}");
    let newest = RequestQuery { newest_first: true, ..all.clone() };
    assert_eq!(request_ids(&*storage, &newest).await, [6, 4, 3, 2, 1], "{name}");
    let cases: [(RequestQuery, &[u64]); 10] = [
        (RequestQuery { shard_id: Some(shard(2)), ..all.clone() }, &[4]),
        (RequestQuery { tag: Some("run".into()), ..all.clone() }, &[]),
        (RequestQuery { entity_type_prefix: "TestEntity".into(), ..all.clone() }, &[1, 2, 4, 6]),
        (RequestQuery { entity_type: Some("TestEntity".into()), ..all.clone() }, &[1, 2, 4]),
        (RequestQuery { entity_type: Some("testentity".into()), ..all.clone() }, &[]),
        (RequestQuery { entity_id: Some("e1".into()), ..all.clone() }, &[1, 2, 3, 6]),
        (RequestQuery { tag: Some("GetUser".into()), ..all.clone() }, &[1, 3, 4, 6]),
        (RequestQuery { processed: Some(true), ..all.clone() }, &[1, 6]),
        (RequestQuery { processed: Some(false), ..all.clone() }, &[2, 3, 4]),
        (RequestQuery { request_id: Some(Snowflake::new(3)), ..all.clone() }, &[3]),
    ];
    for (query, expected) in cases {
        assert_eq!(request_ids(&*storage, &query).await, expected, "{name}: {query:?}");
    }
    // Pages of two, both ways.
    let mut page = RequestQuery::all(2);
    let mut pages = Vec::new();
    loop {
        let ids = request_ids(&*storage, &page).await;
        let Some(last) = ids.last() else { break };
        page.after = Some(Snowflake::new(*last));
        pages.push(ids);
    }
    assert_eq!(pages, [vec![1, 2], vec![3, 4], vec![6]], "{name}");
    let mut page = RequestQuery { newest_first: true, ..RequestQuery::all(2) };
    let mut pages = Vec::new();
    loop {
        let ids = request_ids(&*storage, &page).await;
        let Some(last) = ids.last() else { break };
        page.before = Some(Snowflake::new(*last));
        pages.push(ids);
    }
    assert_eq!(pages, [vec![6, 4], vec![3, 2], vec![1]], "{name}");
    assert_invalid(name, storage.requests(&RequestQuery::all(0)).await);
    assert_invalid(name, storage.requests(&RequestQuery::all(LIMIT_MAX + 1)).await);
    // Damaged rows are listed: the payload left out, the reply a defect.
    fixture.corrupt(Corruption::MessagePayload(Snowflake::new(2))).await;
    fixture.corrupt(Corruption::ReplyPayload(Snowflake::new(101))).await;
    let listed = storage.requests(&RequestQuery::all(2)).await.unwrap();
    assert_eq!(listed.len(), 2, "{name}: {listed:?}");
    assert_eq!(listed[1].payload, None, "{name}");
    let Some(WithExit { exit: Exit::Failure(cause), .. }) = &listed[0].reply else {
        panic!("{name}: expected a defect reply, got {:?}", listed[0].reply)
    };
    assert!(
        matches!(&cause.0[0], CauseReason::Die(defect) if defect.json().unwrap_or("").contains("MalformedMessage")),
        "{name}: {cause:?}"
    );
}

/// Every registered runner is listed with its machine id, health and heartbeat age; a runner
/// whose heartbeat expired is still listed, as not alive, while `get_runners` leaves it out.
pub async fn runner_records_list_expired_runners(fixture: &dyn StorageFixture) {
    let name = fixture.name();
    let storage = fixture.runner_storage(LONG_EXPIRATION).await;
    let (a, b) = (runner("a"), runner("b"));
    let machine_a = storage.register(&a, true).await.unwrap();
    let machine_b = storage.register(&b, false).await.unwrap();
    let records = storage.runner_records().await.unwrap();
    assert_eq!(records.len(), 2, "{name}: {records:?}");
    for (record, (runner, machine_id, healthy)) in
        records.iter().zip([(&a, machine_a, true), (&b, machine_b, false)])
    {
        assert_eq!(record.runner, *runner, "{name}");
        assert_eq!(record.machine_id, machine_id, "{name}");
        assert_eq!(record.healthy, healthy, "{name}");
        assert!(record.alive, "{name}: {record:?}");
        assert!(record.heartbeat_age < LONG_EXPIRATION, "{name}: {record:?}");
    }
    let short = fixture.runner_storage(SHORT_EXPIRATION).await;
    eventually(fixture, "the heartbeats expire", || {
        let short = Arc::clone(&short);
        async move {
            short.runner_records().await.is_ok_and(|records| {
                records.len() == 2
                    && records
                        .iter()
                        .all(|record| !record.alive && record.heartbeat_age >= SHORT_EXPIRATION)
            })
        }
    })
    .await;
    assert!(short.get_runners().await.unwrap().is_empty(), "{name}");
}

/// The shard locks name their holders, whichever session reads them; a released lock is gone;
/// a lease that is not refreshed is listed as expired until it is taken over.
pub async fn shard_locks_name_their_holders(fixture: &dyn StorageFixture) {
    let name = fixture.name();
    let (a, b) = (runner("a"), runner("b"));
    let storage_a = fixture.runner_storage(LONG_EXPIRATION).await;
    let storage_b = fixture.runner_storage(LONG_EXPIRATION).await;
    let reader = fixture.runner_storage(LONG_EXPIRATION).await;
    storage_a.register(&a, true).await.unwrap();
    storage_b.register(&b, true).await.unwrap();
    assert_eq!(sorted(storage_a.acquire(&a.address, &shards(&[1, 2])).await.unwrap()).len(), 2);
    assert_eq!(storage_b.acquire(&b.address, &shards(&[3])).await.unwrap().len(), 1);
    let holders = |locks: Vec<ShardLock>| -> Vec<(u32, LockHolder)> {
        locks
            .into_iter()
            .map(|lock| {
                assert!(!lock.expired, "{name}: {lock:?}");
                assert!(lock.lease_age.is_none_or(|age| age < LONG_EXPIRATION), "{name}: {lock:?}");
                (lock.shard_id.id(), lock.holder)
            })
            .collect()
    };
    let wanted = shards(&[1, 2, 3, 4, 5]);
    let holder_a = LockHolder::Runner(a.address.clone());
    let holder_b = LockHolder::Runner(b.address.clone());
    assert_eq!(
        holders(reader.shard_locks(&wanted).await.unwrap()),
        [(1, holder_a.clone()), (2, holder_a.clone()), (3, holder_b.clone())],
        "{name}"
    );
    assert_eq!(
        holders(reader.shard_locks(&shards(&[2])).await.unwrap()),
        [(2, holder_a.clone())],
        "{name}: only the shards asked for"
    );
    storage_a.release(&a.address, &shard(2)).await.unwrap();
    assert_eq!(
        holders(storage_b.shard_locks(&wanted).await.unwrap()),
        [(1, holder_a), (3, holder_b.clone())],
        "{name}"
    );
    storage_a.release_all(&a.address).await.unwrap();
    assert_eq!(holders(reader.shard_locks(&wanted).await.unwrap()), [(3, holder_b)], "{name}");
    // A lease nobody refreshes expires (an advisory lock has no lease: it is held until its
    // session ends).
    let short = fixture.runner_storage(SHORT_EXPIRATION).await;
    let c = runner("c");
    short.register(&c, true).await.unwrap();
    assert_eq!(short.acquire(&c.address, &shards(&[4])).await.unwrap().len(), 1);
    let lock = reader.shard_locks(&shards(&[4])).await.unwrap();
    assert_eq!(lock.len(), 1, "{name}: {lock:?}");
    if lock[0].lease_age.is_some() {
        eventually(fixture, "the lease expires", || {
            let short = Arc::clone(&short);
            async move {
                short
                    .shard_locks(&shards(&[4]))
                    .await
                    .is_ok_and(|locks| locks.len() == 1 && locks[0].expired)
            }
        })
        .await;
    }
}
