//! Tests of the save protocol over an in-memory backend: batches and their fallback,
//! duplicates, and reply batches, with each dialect difference switched on and off.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cluster_core::envelope::{Exit, RawJson, TraceContext, WithExit};
use cluster_core::sync::lock;
use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup, ShardId, Snowflake};

use super::*;
use crate::options::ValueBytesMax;

/// A table of requests (`id` → `message_id`) and replies, and a log of the calls made.
#[derive(Default)]
struct Table {
    requests: BTreeMap<i64, Option<String>>,
    /// `(id, request_id, final)`.
    replies: Vec<(i64, i64, bool)>,
    calls: Vec<&'static str>,
}

/// An in-memory backend. `UNKEYED` and `ONE_PER_REQUEST` are its dialect constants; `failing`
/// makes its batch statements fail; `commit_fails` makes its reply batch's commit fail.
#[derive(Default)]
struct Memory<const UNKEYED: bool, const ONE_PER_REQUEST: bool> {
    table: Mutex<Table>,
    failing: bool,
    commit_fails: bool,
    /// A key whose first lookup finds nothing, as if its row had just been deleted.
    vanishing: Option<String>,
}

type Pg = Memory<true, true>;
type MySql = Memory<false, false>;

fn failed(what: &str) -> StorageError {
    StorageError::new(StorageErrorKind::Conflict, format!("{what} failed"))
}

impl<const UNKEYED: bool, const ONE_PER_REQUEST: bool> Memory<UNKEYED, ONE_PER_REQUEST> {
    fn calls(&self) -> Vec<&'static str> {
        lock(&self.table).calls.clone()
    }

    /// Inserts `row` unless its key (or its id, for a keyed row) is taken; a row without a key
    /// whose id is taken is an error.
    fn insert(table: &mut Table, row: &MessageInsert<'_>) -> Result<bool, StorageError> {
        let key = row.message_id.as_deref().map(str::to_owned);
        let key_taken = key.is_some() && table.requests.values().any(|stored| *stored == key);
        if key_taken || (key.is_some() && table.requests.contains_key(&row.id)) {
            return Ok(false);
        }
        if table.requests.contains_key(&row.id) {
            return Err(failed("a reused id"));
        }
        table.requests.insert(row.id, key);
        Ok(true)
    }

    fn write_reply(table: &mut Table, row: &ReplyInsert) -> Result<(), StorageError> {
        let is_final = row.kind.is_some();
        let taken = table.replies.iter().any(|(id, request_id, stored_final)| {
            *id == row.id || (is_final && *stored_final && *request_id == row.request_id)
        });
        if taken {
            return Err(failed("a second reply"));
        }
        table.replies.push((row.id, row.request_id, is_final));
        Ok(())
    }
}

impl<const UNKEYED: bool, const ONE_PER_REQUEST: bool> SaveBackend
    for Memory<UNKEYED, ONE_PER_REQUEST>
{
    const REQUEST_BATCH_TAKES_UNKEYED: bool = UNKEYED;
    const REPLY_BATCH_ONE_PER_REQUEST: bool = ONE_PER_REQUEST;

    async fn insert_requests(&self, rows: &[MessageInsert<'_>]) -> Result<Vec<i64>, StorageError> {
        let mut table = lock(&self.table);
        table.calls.push("insert_requests");
        if self.failing {
            return Err(failed("the batch"));
        }
        let mut inserted = Vec::new();
        for row in rows {
            if Memory::<UNKEYED, ONE_PER_REQUEST>::insert(&mut table, row)? {
                inserted.push(row.id);
            }
        }
        Ok(inserted)
    }

    async fn insert_request(&self, row: &MessageInsert<'_>) -> Result<bool, StorageError> {
        let mut table = lock(&self.table);
        table.calls.push("insert_request");
        Memory::<UNKEYED, ONE_PER_REQUEST>::insert(&mut table, row)
    }

    async fn find_duplicate(&self, message_id: &str) -> Result<Option<SaveResult>, StorageError> {
        let mut table = lock(&self.table);
        table.calls.push("find_duplicate");
        if self.vanishing.as_deref() == Some(message_id) {
            // The row is deleted while this lookup runs.
            table.requests.retain(|_, key| key.as_deref() != Some(message_id));
            return Ok(None);
        }
        let found = table.requests.iter().find(|(_, key)| key.as_deref() == Some(message_id));
        Ok(found.map(|(id, _)| SaveResult::Duplicate {
            original_id: Snowflake::from_i64(*id).unwrap(),
            last_received_reply: None,
        }))
    }

    async fn insert_replies(&self, rows: &[&ReplyInsert]) -> Result<(), BatchFailure> {
        let mut table = lock(&self.table);
        table.calls.push("insert_replies");
        if ONE_PER_REQUEST {
            assert!(one_per_request(rows), "a batch with two replies of one request");
        }
        if self.failing {
            return Err(BatchFailure::RolledBack(failed("the batch")));
        }
        let before = table.replies.clone();
        for row in rows {
            if let Err(error) = Memory::<UNKEYED, ONE_PER_REQUEST>::write_reply(&mut table, row) {
                table.replies = before;
                return Err(BatchFailure::RolledBack(error));
            }
        }
        if self.commit_fails {
            return Err(BatchFailure::CommitFailed(failed("the commit")));
        }
        Ok(())
    }

    async fn insert_reply(&self, row: &ReplyInsert) -> Result<(), StorageError> {
        let mut table = lock(&self.table);
        table.calls.push("insert_reply");
        Memory::<UNKEYED, ONE_PER_REQUEST>::write_reply(&mut table, row)
    }
}

fn limit() -> ValueLimit {
    ValueLimit::new(ValueBytesMax::default())
}

fn request(id: u64) -> Request {
    Request {
        request_id: Snowflake::new(id),
        address: EntityAddress {
            shard_id: ShardId::new(ShardGroup::from("default"), 1),
            entity_type: EntityType::from("Test"),
            entity_id: EntityId::from("e1"),
        },
        tag: "Tag".into(),
        payload: RawJson::null(),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    }
}

fn keyed(key: &str) -> SaveRequestOptions {
    SaveRequestOptions { primary_key: Some(key.to_owned()), deliver_at: None }
}

fn final_reply(request_id: u64, id: u64) -> Reply {
    Reply::WithExit(WithExit {
        request_id: Snowflake::new(request_id),
        id: Snowflake::new(id),
        exit: Exit::Success(RawJson::null()),
    })
}

fn duplicate_of(id: u64) -> SaveResult {
    SaveResult::Duplicate { original_id: Snowflake::new(id), last_received_reply: None }
}

async fn save_all<const U: bool, const O: bool>(
    backend: &Memory<U, O>,
    requests: &[(Request, SaveRequestOptions)],
) -> Vec<Result<SaveResult, StorageError>> {
    let requests: Vec<(&Request, &SaveRequestOptions)> =
        requests.iter().map(|(request, options)| (request, options)).collect();
    save_requests(backend, limit(), &requests).await
}

#[tokio::test]
async fn a_batch_inserts_once_and_reports_taken_keys_as_duplicates() {
    let backend = Pg::default();
    let results = save_all(
        &backend,
        &[(request(1), keyed("a")), (request(2), keyed("a")), (request(3), keyed("b"))],
    )
    .await;
    let results: Vec<SaveResult> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(results, [SaveResult::Success, duplicate_of(1), SaveResult::Success]);
    assert_eq!(backend.calls(), ["insert_requests", "insert_request", "find_duplicate"]);
}

#[tokio::test]
async fn a_retry_in_a_batch_is_the_duplicate_of_its_stored_request() {
    let backend = Pg::default();
    save_all(&backend, &[(request(1), keyed("a"))]).await;
    // A retry of the stored request, and a request saved twice within the batch.
    let results = save_all(
        &backend,
        &[(request(1), keyed("a")), (request(2), keyed("b")), (request(2), keyed("b"))],
    )
    .await;
    let results: Vec<SaveResult> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(results, [duplicate_of(1), SaveResult::Success, duplicate_of(2)]);
}

#[tokio::test]
async fn a_failed_batch_saves_each_request_and_only_the_faulty_one_fails() {
    let backend = Pg { failing: true, ..Pg::default() };
    lock(&backend.table).requests.insert(2, None);
    let results = save_all(
        &backend,
        &[(request(1), SaveRequestOptions::default()), (request(2), SaveRequestOptions::default())],
    )
    .await;
    assert_eq!(*results[0].as_ref().unwrap(), SaveResult::Success);
    assert_eq!(results[1].as_ref().unwrap_err().kind(), StorageErrorKind::Conflict);
    assert_eq!(backend.calls(), ["insert_requests", "insert_request", "insert_request"]);
}

#[tokio::test]
async fn requests_without_a_key_stay_out_of_a_batch_that_cannot_take_them() {
    let backend = MySql::default();
    let results = save_all(
        &backend,
        &[(request(1), SaveRequestOptions::default()), (request(2), keyed("a"))],
    )
    .await;
    assert!(results.iter().all(|result| *result.as_ref().unwrap() == SaveResult::Success));
    assert_eq!(backend.calls(), ["insert_requests", "insert_request"]);
    let backend = MySql::default();
    save_all(
        &backend,
        &[(request(1), SaveRequestOptions::default()), (request(2), SaveRequestOptions::default())],
    )
    .await;
    assert_eq!(backend.calls(), ["insert_request", "insert_request"], "no batch statement");
}

#[tokio::test]
async fn a_value_over_the_limit_is_refused_before_any_statement() {
    let backend = Pg::default();
    let mut big = request(2);
    big.payload =
        RawJson::from_json(format!("\"{}\"", "x".repeat(2 * ValueBytesMax::MIN))).unwrap();
    let tight = ValueLimit::new(ValueBytesMax::new(ValueBytesMax::MIN).unwrap());
    let saved =
        save_requests(&backend, tight, &[(&request(1), &keyed("a")), (&big, &keyed("b"))]).await;
    assert_eq!(*saved[0].as_ref().unwrap(), SaveResult::Success);
    assert_eq!(saved[1].as_ref().unwrap_err().kind(), StorageErrorKind::InvalidInput);
    assert_eq!(backend.calls(), ["insert_requests"]);
}

#[tokio::test]
async fn a_duplicate_deleted_while_read_is_inserted_again() {
    let backend = Pg { vanishing: Some("a".to_owned()), ..Pg::default() };
    save_all(&backend, &[(request(1), keyed("a"))]).await;
    let saved = save_request(&backend, limit(), &request(2), &keyed("a")).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    assert_eq!(lock(&backend.table).requests.get(&2), Some(&Some("a".to_owned())));
}

#[tokio::test]
async fn a_keyed_request_whose_id_is_taken_is_a_conflict() {
    let backend = MySql::default();
    save_all(&backend, &[(request(1), keyed("a"))]).await;
    let error = save_request(&backend, limit(), &request(1), &keyed("b")).await.unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::Conflict, "{error}");
}

#[tokio::test]
async fn replies_of_one_request_are_batched_only_where_the_dialect_allows() {
    let replies = [final_reply(1, 10), final_reply(1, 11), final_reply(2, 20)];
    let pg = Pg::default();
    let results = save_replies(&pg, limit(), &replies).await;
    assert_eq!(pg.calls(), ["insert_reply", "insert_reply", "insert_reply"]);
    assert!(results[0].is_ok() && results[1].is_err() && results[2].is_ok(), "{results:?}");
    let mysql = MySql::default();
    let results = save_replies(&mysql, limit(), &replies).await;
    // The batch failed on the second final reply and was rolled back: each on its own.
    assert_eq!(mysql.calls(), ["insert_replies", "insert_reply", "insert_reply", "insert_reply"]);
    assert!(results[0].is_ok() && results[1].is_err() && results[2].is_ok(), "{results:?}");
}

#[tokio::test]
async fn a_failed_reply_commit_fails_every_caller_of_the_batch() {
    let backend = MySql { commit_fails: true, ..MySql::default() };
    let tight = ValueLimit::new(ValueBytesMax::new(ValueBytesMax::MIN).unwrap());
    let big = Reply::WithExit(WithExit {
        request_id: Snowflake::new(3),
        id: Snowflake::new(30),
        exit: Exit::Success(
            RawJson::from_json(format!("\"{}\"", "x".repeat(2 * ValueBytesMax::MIN))).unwrap(),
        ),
    });
    let results =
        save_replies(&backend, tight, &[final_reply(1, 10), final_reply(2, 20), big]).await;
    let kinds: Vec<StorageErrorKind> =
        results.iter().map(|result| result.as_ref().unwrap_err().kind()).collect();
    assert_eq!(
        kinds,
        [StorageErrorKind::Conflict, StorageErrorKind::Conflict, StorageErrorKind::InvalidInput]
    );
    assert_eq!(backend.calls(), ["insert_replies"]);
}
