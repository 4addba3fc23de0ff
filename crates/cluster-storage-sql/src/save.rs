//! The save protocol of the networked message storages, written once: batching with a per-row
//! fallback, deduplication by primary key, and reply saving, over [`SaveBackend`], the narrow
//! trait each database implements (the shape of sqlx's `Migrator` over `Migrate`: the policy
//! here, the statements in the driver).
//!
//! A backend only inserts rows and reads the duplicate of a primary key; every decision is
//! taken here, so PostgreSQL and MySQL cannot drift apart again:
//!
//! - **Requests** ([`save_request`], [`save_requests`]). Each value is checked against the
//!   storage's limit (and the backend's columns, [`SaveBackend::check_request`]) before any
//!   statement. A batch of concurrent saves goes into one multi-row insert; a request counts as
//!   stored only if that statement inserted it (a retry of a stored request is reported as its
//!   duplicate, batched or not), and every other request is saved on its own, which resolves
//!   duplicates, refuses what does not fit, and isolates a faulty row when the batch statement
//!   failed.
//! - **Deduplication.** An insert skipped because the primary key is taken reads the stored
//!   request with that key and reports it as [`SaveResult::Duplicate`], with its latest reply
//!   (reference `effect/src/cluster/SqlMessageStorage.ts`, `saveEnvelope`). When no row has the
//!   key any more (it was deleted in between, by `clear_address`), the insert runs once more,
//!   and a second skip is a conflict: the reference reports success there although nothing was
//!   stored.
//! - **Replies** ([`save_replies`]). A batch of concurrent replies is written together (one
//!   commit); if a reply of the batch fails (a second final reply), the batch is rolled back and
//!   each reply is saved on its own, so only the faulty one fails; if the commit itself fails,
//!   every caller of the batch gets the error.
//!
//! The differences between the dialects are named on the trait: whether the batch insert may hold
//! requests without a primary key ([`SaveBackend::REQUEST_BATCH_TAKES_UNKEYED`]), and whether a
//! reply batch must hold at most one reply per request
//! ([`SaveBackend::REPLY_BATCH_ONE_PER_REQUEST`]). How a backend treats a chunk saved twice is
//! its own: MySQL accepts the retry, PostgreSQL rejects it as a conflict, as the contract of
//! `MessageStorage::save_reply` allows.
//!
//! SQLite does not use this module, for three reasons:
//!
//! - Its group commit is one transaction on the worker thread that holds saved requests,
//!   replies, acknowledgements, interrupts and claims together: one fsync for all of them under
//!   `synchronous=FULL`. Batching saves here, apart from the rest, would cost a commit more per
//!   batch.
//! - Its writes are blocking `rusqlite` calls on that thread, where the async methods of
//!   [`SaveBackend`] cannot be awaited (and blocking calls never run on the executor).
//! - Its fallback is a savepoint per write inside the same transaction, not a statement per row
//!   on its own connection, and its deduplication also looks up keys stored in their legacy
//!   plaintext form (the reference's `mayHaveLegacyRow`, SQLite only). A request whose id is
//!   taken by another message is a conflict there too (the conformance suite's
//!   `a_request_whose_id_is_taken_is_a_conflict`).
//!
//! Its steps are in `sqlite/message_ops.rs` (`save_request`, `run_writes`).

use std::collections::BTreeMap;
use std::future::Future;

use cluster_core::envelope::{Reply, Request};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::storage::{SaveRequestOptions, SaveResult};

use crate::row::{MessageInsert, ReplyInsert, ValueLimit, id_to_sql};

/// Why a batch write failed.
#[derive(Debug)]
pub(crate) enum BatchFailure {
    /// Nothing of the batch was written (its statement or transaction failed and was rolled
    /// back): each row is then written on its own, so only a faulty row fails.
    RolledBack(StorageError),
    /// The batch's commit failed, so whether it was written is unknown: every caller of the batch
    /// gets the error.
    #[cfg_attr(
        not(feature = "mysql"),
        allow(dead_code, reason = "only MySQL's reply batch is a transaction with its own commit")
    )]
    CommitFailed(StorageError),
}

/// What a database does for the save protocol: insert rows and read the duplicate of a primary
/// key. Each method is one statement or one short transaction; none decides what a result means
/// for the caller.
pub(crate) trait SaveBackend: Send + Sync {
    /// Whether [`insert_requests`](SaveBackend::insert_requests) may get requests without a
    /// primary key.
    ///
    /// PostgreSQL: yes. Its insert skips only a taken `message_id` (`ON CONFLICT (message_id)`),
    /// so a reused id fails the statement and the fallback reports it.
    /// MySQL: no. `INSERT IGNORE` also skips a row whose id is taken, which for a request without
    /// a key must be an error, so such a request is saved on its own with a plain `INSERT`.
    const REQUEST_BATCH_TAKES_UNKEYED: bool;

    /// Whether [`insert_replies`](SaveBackend::insert_replies) must get at most one reply per
    /// request.
    ///
    /// PostgreSQL: yes. Its batch is one statement whose CTEs update each request's rows, and a
    /// statement may update a row only once.
    /// MySQL: no. Its batch is a transaction of single-reply writes, which see each other.
    const REPLY_BATCH_ONE_PER_REQUEST: bool;

    /// Refuses a request row that the backend's columns cannot hold, beyond the value limit
    /// checked before (MySQL's column widths: `INSERT IGNORE` would truncate a wider value with a
    /// mere warning). By default every row fits.
    fn check_request(&self, row: &MessageInsert<'_>) -> Result<(), StorageError> {
        let _ = row;
        Ok(())
    }

    /// Inserts `rows` with one statement (one commit), skipping a row whose primary key is
    /// taken, and returns the ids of the rows this statement inserted: not those of rows stored
    /// before with the same id and key. An id may appear once per row inserted.
    fn insert_requests(
        &self,
        rows: &[MessageInsert<'_>],
    ) -> impl Future<Output = Result<Vec<i64>, StorageError>> + Send;

    /// Inserts `row`: `Ok(true)` if it was inserted, `Ok(false)` if it was skipped because its
    /// primary key is taken (MySQL also skips a keyed row whose id is taken). A row without a key
    /// is never skipped: its taken id is an error.
    fn insert_request(
        &self,
        row: &MessageInsert<'_>,
    ) -> impl Future<Output = Result<bool, StorageError>> + Send;

    /// The stored request whose `message_id` is `message_id`, as [`SaveResult::Duplicate`] with
    /// the reply at its `last_reply_id`, addressed to it; `None` if no row has that key.
    fn find_duplicate(
        &self,
        message_id: &str,
    ) -> impl Future<Output = Result<Option<SaveResult>, StorageError>> + Send;

    /// Writes `rows` (each with its message-row updates) together, in one commit.
    fn insert_replies(
        &self,
        rows: &[&ReplyInsert],
    ) -> impl Future<Output = Result<(), BatchFailure>> + Send;

    /// Writes `row` with its message-row updates: a chunk becomes its request's latest reply; a
    /// final reply also marks the request and its acknowledgements and interrupts processed.
    fn insert_reply(
        &self,
        row: &ReplyInsert,
    ) -> impl Future<Output = Result<(), StorageError>> + Send;
}

/// Saves one request: inserts it, or reports the stored request with the same primary key.
pub(crate) async fn save_request<B: SaveBackend>(
    backend: &B,
    limit: ValueLimit,
    request: &Request,
    options: &SaveRequestOptions,
) -> Result<SaveResult, StorageError> {
    let row = MessageInsert::checked_request(request, options, limit)?;
    backend.check_request(&row)?;
    if backend.insert_request(&row).await? {
        return Ok(SaveResult::Success);
    }
    let Some(message_id) = row.message_id.as_deref() else {
        return Err(StorageError::new(
            StorageErrorKind::Other,
            "a request without a primary key was not inserted",
        ));
    };
    // Skipped: the key is taken. The insert waited for a concurrent writer of the same key to
    // commit, so this read sees its row.
    if let Some(duplicate) = backend.find_duplicate(message_id).await? {
        tracing::debug!(request_id = %request.request_id, "duplicate request");
        return Ok(duplicate);
    }
    // No row has the key: the one that conflicted was deleted in between (`clear_address`), or
    // (MySQL) the request's id is taken. Once more.
    if backend.insert_request(&row).await? {
        return Ok(SaveResult::Success);
    }
    Err(StorageError::new(
        StorageErrorKind::Conflict,
        format!(
            "request {} was not stored and no stored request has its primary key: its id is \
             taken by a request stored under another key or none",
            request.request_id
        ),
    ))
}

/// Saves a batch of requests: one multi-row insert for the batch, then each request that it
/// did not insert on its own ([`save_request`]). Results are in the order of `requests`.
pub(crate) async fn save_requests<B: SaveBackend>(
    backend: &B,
    limit: ValueLimit,
    requests: &[(&Request, &SaveRequestOptions)],
) -> Vec<Result<SaveResult, StorageError>> {
    let ids =
        if requests.len() > 1 { insert_batch(backend, limit, requests).await } else { vec![] };
    // How many rows the batch inserted per id.
    let mut inserted: BTreeMap<i64, usize> = BTreeMap::new();
    for id in ids {
        *inserted.entry(id).or_default() += 1;
    }
    let mut results = Vec::with_capacity(requests.len());
    for (request, options) in requests {
        // Each inserted row answers one caller: a second caller with the same request (a retry
        // queued in the same batch) is told it is a duplicate.
        let row = id_to_sql(request.request_id).ok().and_then(|id| inserted.get_mut(&id));
        results.push(match row {
            Some(rows) if *rows > 0 => {
                *rows -= 1;
                Ok(SaveResult::Success)
            }
            _ => save_request(backend, limit, request, options).await,
        });
    }
    results
}

/// The batch's multi-row insert: the ids it inserted. Rows that fail their checks are left out,
/// for their own save to refuse; a failed statement inserted nothing.
async fn insert_batch<B: SaveBackend>(
    backend: &B,
    limit: ValueLimit,
    requests: &[(&Request, &SaveRequestOptions)],
) -> Vec<i64> {
    let rows: Vec<MessageInsert<'_>> = requests
        .iter()
        .filter_map(|(request, options)| {
            MessageInsert::checked_request(request, options, limit).ok()
        })
        .filter(|row| B::REQUEST_BATCH_TAKES_UNKEYED || row.message_id.is_some())
        .filter(|row| backend.check_request(row).is_ok())
        .collect();
    if rows.is_empty() {
        return Vec::new();
    }
    backend.insert_requests(&rows).await.unwrap_or_else(|error| {
        tracing::debug!(%error, n_rows = rows.len(), "batch insert failed; saving one by one");
        Vec::new()
    })
}

/// Saves a batch of replies: together when the backend can take them in one batch, else (or if
/// the batch was rolled back) each on its own. A reply over the limit is refused before any
/// statement and fails alone. Results are in the order of `replies`.
pub(crate) async fn save_replies<B: SaveBackend>(
    backend: &B,
    limit: ValueLimit,
    replies: &[Reply],
) -> Vec<Result<(), StorageError>> {
    let rows: Vec<Result<ReplyInsert, StorageError>> =
        replies.iter().map(|reply| ReplyInsert::checked(reply, limit)).collect();
    let checked: Vec<&ReplyInsert> = rows.iter().filter_map(|row| row.as_ref().ok()).collect();
    if checked.len() > 1 && (!B::REPLY_BATCH_ONE_PER_REQUEST || one_per_request(&checked)) {
        match backend.insert_replies(&checked).await {
            Ok(()) => return rows.into_iter().map(|row| row.map(drop)).collect(),
            Err(BatchFailure::CommitFailed(error)) => {
                return rows.into_iter().map(|row| row.and(Err(error.clone()))).collect();
            }
            Err(BatchFailure::RolledBack(error)) => {
                tracing::debug!(%error, n_rows = checked.len(), "reply batch rolled back");
            }
        }
    }
    let mut results = Vec::with_capacity(rows.len());
    for row in rows {
        results.push(match row {
            Ok(row) => backend.insert_reply(&row).await,
            Err(refused) => Err(refused),
        });
    }
    results
}

/// Whether `rows` belong to distinct requests.
fn one_per_request(rows: &[&ReplyInsert]) -> bool {
    let mut request_ids: Vec<i64> = rows.iter().map(|row| row.request_id).collect();
    request_ids.sort_unstable();
    request_ids.dedup();
    request_ids.len() == rows.len()
}

#[cfg(test)]
mod tests;
