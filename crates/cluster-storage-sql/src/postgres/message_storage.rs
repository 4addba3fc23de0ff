//! [`PgMessageStorage`]: mailboxes and replies in `<prefix>_messages` and `<prefix>_replies`, on
//! a connection pool (`effect/src/cluster/SqlMessageStorage.ts`).
//!
//! Multi-step writes are single statements with data-modifying CTEs where the reference uses a
//! transaction of several statements (saving a reply, saving an acknowledgement, clearing an
//! address): PostgreSQL runs one statement atomically, so the effect is the same and it costs
//! one round-trip. Every statement is prepared once per pooled connection.
//!
//! Saves follow the shared protocol of `crate::save` (group commit with a per-row fallback,
//! deduplication by primary key, reply batches); `PgSaveBackend` is its PostgreSQL side.
//!
//! Payloads, headers, replies and entity states longer than `value_bytes_max` are refused
//! before any statement is sent; in a batch, such a value fails alone and the others go on
//! together.
//!
//! Entity states (`cluster_core::entity_state`) live in `<prefix>_entity_state`, a table of
//! ours: each write is one conditional statement that changes no row when it is stale, so a
//! stale write never aborts the transaction it runs in.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, OnceLock};

use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::{AckChunk, Interrupt, Reply, Request};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::inspect::{Backlog, BacklogQuery, RequestQuery, RequestRecord};
use cluster_core::retention::{self, ProcessedQuery, ProcessedRequest, PurgeProcessed};
use cluster_core::storage::{
    MessageStorage, MessageTransaction, OrderedBatch, OrderedSave, SaveRequestOptions, SaveResult,
    UnprocessedBatch, UnprocessedOptions,
};
use cluster_core::transaction::TransactionGuard;
use cluster_core::{EntityAddress, ShardId, Snowflake, Timestamp};
use deadpool_postgres::{ClientWrapper, Object, Pool};
use postgres_types::ToSql;
use tokio_postgres::Row;
use tracing::Instrument;

use crate::batch::Batcher;
use crate::lock::advisory_namespace;
use crate::options::{SqlStorageOptions, TablePrefix, ValueBytesMax};
use crate::row::inspect::{BacklogFilter, BacklogRow, RequestFilter, RequestRow};
use crate::row::{
    self, LastReplyRow, MessageInsert, MessageRow, ProcessedRow, ReplyInsert, ReplyRow,
    StateChange, StateRow, StoredStateRow, ValueLimit, id_from_sql, id_to_sql,
};
use crate::save::{self, BatchFailure, SaveBackend};

use super::classify::{column_error, driver_error, pool_error};
use super::connection::{
    self, GenericPlans, execute, migrate_on_pool, pooled_execute, pooled_query, settle,
};
use super::queries::{self, MessageQueries, MigrationTarget};

/// The PostgreSQL [`MessageStorage`].
///
/// Cheap to clone (the pool and the statements are shared). Every method checks a connection
/// out of the pool for one statement (or one short transaction) and gives it back.
#[derive(Clone)]
pub struct PgMessageStorage {
    pool: Pool,
    queries: Arc<MessageQueries>,
    prefix: TablePrefix,
    /// The most bytes of a payload, headers or reply (`value_bytes_max`).
    limit: ValueLimit,
    /// The group-commit writers, started on first use (that is, inside the runtime).
    writers: Arc<OnceLock<Writers>>,
}

/// Group commit: requests and replies saved concurrently are
/// written together, with one multi-row statement and one commit per batch.
struct Writers {
    requests: Batcher<SaveJob, OrderedSave>,
    replies: Batcher<Reply, ()>,
    /// Final replies with their entities' state writes ([`save_stateful`]), one statement per
    /// batch. One writer, so that one entity's saves stay in order; a second one made smaller
    /// batches and lowered throughput.
    stateful: Batcher<StatefulSave, ()>,
    claims: Batcher<Claim, UnprocessedBatch>,
    reads: Batcher<OrderedRead, OrderedBatch>,
}

/// One caller's save, owned so that it can wait in a batch.
struct SaveJob {
    request: Request,
    options: SaveRequestOptions,
    /// For `save_request_ordered`: read the entity's earlier unprocessed requests due at
    /// `now` (epoch millis), at most `limit`, once the request is stored.
    order: Option<(i64, i64)>,
}

/// One caller's claim (`unprocessed_messages`), owned so that it can wait in a batch.
struct Claim {
    shards: Vec<String>,
    now: i64,
    limit: Option<i64>,
    /// The address filter as parallel columns, if any.
    addresses: Option<(Vec<String>, Vec<String>, Vec<String>)>,
}

/// One caller's `unprocessed_messages_ordered`, owned so that it can wait in a batch.
struct OrderedRead {
    ids: Vec<i64>,
    now: i64,
    limit: i64,
}

/// How many writes wait for a batch writer before callers wait for room.
const WRITE_QUEUE_CAPACITY: usize = 4096;

/// The most rows one batch writes.
const WRITE_BATCH_SIZE_MAX: usize = 256;

impl Writers {
    fn spawn(pool: &Pool, queries: &Arc<MessageQueries>, limit: ValueLimit) -> Writers {
        let backend = Arc::new(PgSaveBackend { pool: pool.clone(), queries: Arc::clone(queries) });
        let (request_backend, earlier_reads) =
            (Arc::clone(&backend), Arc::new(GenericPlans::new(pool.clone())));
        let requests = Batcher::spawn(WRITE_QUEUE_CAPACITY, WRITE_BATCH_SIZE_MAX, move |inputs| {
            let (backend, earlier_reads) =
                (Arc::clone(&request_backend), Arc::clone(&earlier_reads));
            async move { save_requests(&backend, &earlier_reads, limit, inputs).await }
        });
        let replies = Batcher::spawn(WRITE_QUEUE_CAPACITY, WRITE_BATCH_SIZE_MAX, move |inputs| {
            let backend = Arc::clone(&backend);
            async move { save::save_replies(&*backend, limit, &inputs).await }
        });
        let (stateful_connection, stateful_queries) =
            (Arc::new(GenericPlans::new(pool.clone())), Arc::clone(queries));
        let stateful = Batcher::spawn(WRITE_QUEUE_CAPACITY, WRITE_BATCH_SIZE_MAX, move |inputs| {
            let (connection, queries) =
                (Arc::clone(&stateful_connection), Arc::clone(&stateful_queries));
            async move { save_stateful(&connection, &queries, limit, inputs).await }
        });
        let (claim_pool, claim_queries) = (pool.clone(), Arc::clone(queries));
        let claims = Batcher::spawn(WRITE_QUEUE_CAPACITY, WRITE_BATCH_SIZE_MAX, move |inputs| {
            let (pool, queries) = (claim_pool.clone(), Arc::clone(&claim_queries));
            async move { claim_batch(&pool, &queries, inputs).await }
        });
        let (read_connection, read_queries) =
            (Arc::new(GenericPlans::new(pool.clone())), Arc::clone(queries));
        let reads = Batcher::spawn(WRITE_QUEUE_CAPACITY, WRITE_BATCH_SIZE_MAX, move |inputs| {
            let (connection, queries) = (Arc::clone(&read_connection), Arc::clone(&read_queries));
            async move { read_ordered(&connection, &queries, inputs).await }
        });
        Writers { requests, replies, stateful, claims, reads }
    }
}

/// The PostgreSQL side of the save protocol ([`save`]): each method is one statement on a
/// pooled connection.
struct PgSaveBackend {
    pool: Pool,
    queries: Arc<MessageQueries>,
}

impl SaveBackend for PgSaveBackend {
    const REQUEST_BATCH_TAKES_UNKEYED: bool = true;
    const REPLY_BATCH_ONE_PER_REQUEST: bool = true;

    async fn insert_requests(&self, rows: &[MessageInsert<'_>]) -> Result<Vec<i64>, StorageError> {
        let column = |f: &dyn Fn(&MessageInsert<'_>) -> Option<String>| -> Vec<Option<String>> {
            rows.iter().map(f).collect()
        };
        let ids: Vec<i64> = rows.iter().map(|row| row.id).collect();
        let message_ids = column(&|row| row.message_id.as_deref().map(str::to_owned));
        let shard_ids = column(&|row| Some(row.shard_id.clone()));
        let entity_types = column(&|row| Some(row.entity_type.to_owned()));
        let entity_ids = column(&|row| Some(row.entity_id.to_owned()));
        let kinds: Vec<i32> = rows.iter().map(|row| row.kind).collect();
        let tags = column(&|row| row.tag.map(str::to_owned));
        let payloads = column(&|row| row.payload.map(str::to_owned));
        let headers = column(&|row| row.headers.map(str::to_owned));
        let trace_ids = column(&|row| row.trace_id.map(str::to_owned));
        let span_ids = column(&|row| row.span_id.map(str::to_owned));
        let sampled: Vec<Option<bool>> = rows.iter().map(|row| row.sampled).collect();
        let request_ids: Vec<i64> = rows.iter().map(|row| row.request_id).collect();
        let reply_ids: Vec<Option<i64>> = rows.iter().map(|row| row.reply_id).collect();
        let deliver_at: Vec<Option<i64>> = rows.iter().map(|row| row.deliver_at).collect();
        let params: [&(dyn ToSql + Sync); 15] = [
            &ids,
            &message_ids,
            &shard_ids,
            &entity_types,
            &entity_ids,
            &kinds,
            &tags,
            &payloads,
            &headers,
            &trace_ids,
            &span_ids,
            &sampled,
            &request_ids,
            &reply_ids,
            &deliver_at,
        ];
        let sql = &self.queries.insert_messages_ignore;
        let inserted = pooled_query(&self.pool, "save_request: batch", sql, &params).await?;
        inserted.iter().map(|row| row.try_get::<_, i64>(0).map_err(column_error)).collect()
    }

    async fn insert_request(&self, row: &MessageInsert<'_>) -> Result<bool, StorageError> {
        let sql = &self.queries.insert_message_ignore;
        let inserted = pooled_query(&self.pool, "save_request", sql, &insert_params(row)).await?;
        Ok(!inserted.is_empty())
    }

    async fn find_duplicate(&self, message_id: &str) -> Result<Option<SaveResult>, StorageError> {
        let sql = &self.queries.select_duplicate;
        let rows = pooled_query(&self.pool, "save_request: duplicate", sql, &[&message_id]).await?;
        rows.first().map(duplicate).transpose()
    }

    async fn insert_replies(&self, rows: &[&ReplyInsert]) -> Result<(), BatchFailure> {
        let columns = ReplyColumns::of(rows);
        let params = columns.params();
        // One statement: if it fails, it wrote nothing.
        pooled_execute(&self.pool, "save_reply: batch", &self.queries.save_replies, &params)
            .await
            .map(drop)
            .map_err(BatchFailure::RolledBack)
    }

    async fn insert_reply(&self, row: &ReplyInsert) -> Result<(), StorageError> {
        let client = self.pool.get().await.map_err(|error| pool_error("save_reply", error))?;
        let result = save_reply_on(&client, &self.queries, row).await;
        settle(client, result.as_ref().err());
        result
    }
}

impl fmt::Debug for PgMessageStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgMessageStorage").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl PgMessageStorage {
    /// Connects to `url` with a pool of [`POOL_SIZE_DEFAULT`](super::POOL_SIZE_DEFAULT)
    /// connections, runs the migrations and returns the storage.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn connect(
        url: &str,
        options: &SqlStorageOptions,
    ) -> Result<PgMessageStorage, StorageError> {
        let config = connection::parse_config(url)?;
        let pool = connection::pool(config.clone(), connection::POOL_SIZE_DEFAULT)?;
        let opened = PgMessageStorage::new(pool, options).await;
        opened.map_err(|error| connection::opening_error(&config, error))
    }

    /// Runs the migrations on `pool` and returns the storage (the reference's `layerWith`).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn new(
        pool: Pool,
        options: &SqlStorageOptions,
    ) -> Result<PgMessageStorage, StorageError> {
        PgMessageStorage::migrate_with(&pool, options).await?;
        Ok(PgMessageStorage::without_migrations(pool, options))
    }

    /// The storage on tables that were migrated elsewhere, for a role without DDL rights (the
    /// reference's `layerStorage`). Runs no statement.
    pub fn without_migrations(pool: Pool, options: &SqlStorageOptions) -> PgMessageStorage {
        PgMessageStorage {
            pool,
            queries: Arc::new(MessageQueries::new(&options.prefix)),
            prefix: options.prefix.clone(),
            limit: ValueLimit::new(options.value_bytes_max),
            writers: Arc::new(OnceLock::new()),
        }
    }

    /// The most bytes a stored value may have on this storage (`options.value_bytes_max`): a
    /// longer payload, headers or reply is refused with [`StorageErrorKind::InvalidInput`]
    /// before anything is sent.
    pub fn value_bytes_max(&self) -> ValueBytesMax {
        self.limit.effective()
    }

    /// Creates or upgrades `<prefix>_messages` and `<prefix>_replies` (history in
    /// `<prefix>_migrations`) with the reference's migrations, creates our entity state table
    /// `<prefix>_entity_state` and the claim's index `<prefix>_messages_unprocessed_idx` if they
    /// are missing; returns the ids of the reference's migrations that ran. Idempotent, and
    /// safe to run from several processes at once: they take turns on an advisory transaction
    /// lock.
    ///
    /// The history holds only the reference's migrations: the table and the index are not
    /// recorded, and a row `4 pg_messages_unprocessed_index` that earlier versions recorded is
    /// removed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn migrate(pool: &Pool, prefix: &TablePrefix) -> Result<Vec<i32>, StorageError> {
        let options = SqlStorageOptions { prefix: prefix.clone(), ..SqlStorageOptions::default() };
        PgMessageStorage::migrate_with(pool, &options).await
    }

    /// [`migrate`](PgMessageStorage::migrate) with `options.prefix`, creating the claim's index
    /// only if `options.extra_indexes` is set (the entity state table always: the storage's
    /// own statements need it).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the migrations run in one transaction, which a dropped future rolls back.
    pub async fn migrate_with(
        pool: &Pool,
        options: &SqlStorageOptions,
    ) -> Result<Vec<i32>, StorageError> {
        let prefix = &options.prefix;
        let migrations = queries::message_migrations(prefix);
        let extra_tables = queries::message_extra_tables(prefix);
        let extra_indexes =
            if options.extra_indexes { queries::message_extra_indexes(prefix) } else { Vec::new() };
        let target = MigrationTarget {
            history: queries::quoted(prefix, "migrations"),
            lock: (advisory_namespace(prefix), queries::MESSAGE_MIGRATION_LOCK),
            migrations: &migrations,
            retired: &queries::RETIRED_MESSAGE_MIGRATIONS,
            extra_tables: &extra_tables,
            extra_indexes: &extra_indexes,
        };
        migrate_on_pool(pool, &target).await
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    async fn client(&self, what: &str) -> Result<Object, StorageError> {
        self.pool.get().await.map_err(|error| pool_error(what, error))
    }

    /// The replies to `request_ids`: with `unacked_only`, the final ones and the chunks not
    /// acknowledged yet (`replies_for`), else all of them.
    async fn replies_inner(
        &self,
        request_ids: &[Snowflake],
        unacked_only: bool,
    ) -> Result<Vec<Reply>, StorageError> {
        if request_ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids = ids_to_sql(request_ids)?;
        let (name, sql) = if unacked_only {
            ("replies_for", &self.queries.replies_for)
        } else {
            ("replies_for_unfiltered", &self.queries.replies_for_unfiltered)
        };
        reply_rows(&self.query(name, sql, &[&ids]).await?)
    }

    async fn query(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StorageError> {
        pooled_query(&self.pool, what, sql, params).await
    }

    async fn execute(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StorageError> {
        pooled_execute(&self.pool, what, sql, params).await
    }

    fn writers(&self) -> &Writers {
        self.writers.get_or_init(|| Writers::spawn(&self.pool, &self.queries, self.limit))
    }

    /// Checks a connection out of the pool and sends `BEGIN` on it.
    async fn begin(&self) -> Result<PgTransaction, StorageError> {
        begin_on(&self.pool, &self.queries, self.limit).await
    }

    async fn load_state_inner(
        &self,
        address: &EntityAddress,
    ) -> Result<Option<StoredState>, StorageError> {
        let key: [&(dyn ToSql + Sync); 2] =
            [&address.entity_type.as_str(), &address.entity_id.as_str()];
        let rows = self.query("load_state", &self.queries.load_state, &key).await?;
        let Some(row) = rows.first() else { return Ok(None) };
        let stored = StoredStateRow {
            value: row.try_get(0).map_err(column_error)?,
            revision: row.try_get(1).map_err(column_error)?,
        };
        stored.decode(address).map(Some)
    }

    async fn purge_processed_inner(&self, batch: &PurgeProcessed) -> Result<u64, StorageError> {
        if batch.limit == 0 {
            return Err(retention::zero_limit("purge_processed"));
        }
        let before = id_to_sql(batch.replied_before)?;
        let keep: Vec<&str> = batch.keep_entity_type_prefixes.iter().map(String::as_str).collect();
        let limit = i64::from(batch.limit);
        let sql = &self.queries.purge_processed;
        let rows = self.query("purge_processed", sql, &[&before, &keep, &limit]).await?;
        let Some(row) = rows.first() else {
            return Err(StorageError::new(
                StorageErrorKind::Other,
                "purge_processed: the statement returned no count",
            ));
        };
        let deleted: i64 = row.try_get(0).map_err(column_error)?;
        Ok(u64::try_from(deleted).unwrap_or(0))
    }

    async fn processed_requests_inner(
        &self,
        query: &ProcessedQuery,
    ) -> Result<Vec<ProcessedRequest>, StorageError> {
        if query.limit == 0 {
            return Err(retention::zero_limit("processed_requests"));
        }
        let before = id_to_sql(query.replied_before)?;
        let prefix = query.entity_type_prefix.as_str();
        let tag = query.tag.as_deref();
        // Ids are never negative: -1 is "from the first".
        let after = query.after.map(id_to_sql).transpose()?.unwrap_or(-1);
        let limit = i64::from(query.limit);
        let params: [&(dyn ToSql + Sync); 5] = [&before, &prefix, &tag, &after, &limit];
        let sql = &self.queries.processed_requests;
        let rows = self.query("processed_requests", sql, &params).await?;
        rows.iter()
            .map(|row| {
                ProcessedRow {
                    request_id: row.try_get(0).map_err(column_error)?,
                    shard_id: row.try_get(1).map_err(column_error)?,
                    entity_type: row.try_get(2).map_err(column_error)?,
                    entity_id: row.try_get(3).map_err(column_error)?,
                    tag: row.try_get(4).map_err(column_error)?,
                    reply_id: row.try_get(5).map_err(column_error)?,
                    reply_payload: row.try_get(6).map_err(column_error)?,
                    payload: row.try_get(7).map_err(column_error)?,
                }
                .decode()
            })
            .collect()
    }

    async fn backlog_inner(&self, query: &BacklogQuery) -> Result<Vec<Backlog>, StorageError> {
        let filter = BacklogFilter::new(query)?;
        let limit = i64::from(filter.limit);
        let params: [&(dyn ToSql + Sync); 3] = [&filter.now_ms, &filter.stale_after_ms, &limit];
        let rows = self.query("backlog", &self.queries.backlog, &params).await?;
        rows.iter()
            .map(|row| {
                BacklogRow {
                    entity_type: row.try_get(0).map_err(column_error)?,
                    shard_id: row.try_get(1).map_err(column_error)?,
                    due: row.try_get(2).map_err(column_error)?,
                    scheduled: row.try_get(3).map_err(column_error)?,
                    claimed: row.try_get(4).map_err(column_error)?,
                    stale_claims: row.try_get(5).map_err(column_error)?,
                    waiting_since: row.try_get(6).map_err(column_error)?,
                }
                .decode()
            })
            .collect()
    }

    async fn requests_inner(
        &self,
        query: &RequestQuery,
    ) -> Result<Vec<RequestRecord>, StorageError> {
        let filter = RequestFilter::new(query)?;
        let (sql, parameters) = queries::requests_sql(&self.queries.requests_head, &filter);
        let params: Vec<&(dyn ToSql + Sync)> =
            parameters.iter().map(|parameter| &**parameter as &(dyn ToSql + Sync)).collect();
        let rows = self.query("requests", &sql, &params).await?;
        rows.iter()
            .map(|row| {
                RequestRow {
                    request_id: row.try_get(0).map_err(column_error)?,
                    shard_id: row.try_get(1).map_err(column_error)?,
                    entity_type: row.try_get(2).map_err(column_error)?,
                    entity_id: row.try_get(3).map_err(column_error)?,
                    tag: row.try_get(4).map_err(column_error)?,
                    payload: row.try_get(5).map_err(column_error)?,
                    processed: row.try_get(6).map_err(column_error)?,
                    claimed: row.try_get(7).map_err(column_error)?,
                    deliver_at: row.try_get(8).map_err(column_error)?,
                    interrupted: row.try_get(9).map_err(column_error)?,
                    reply_id: row.try_get(10).map_err(column_error)?,
                    reply_payload: row.try_get(11).map_err(column_error)?,
                }
                .decode()
            })
            .collect()
    }

    async fn save_state_inner(&self, write: &StateWrite) -> Result<(), StorageError> {
        let row = StateRow::checked(write, self.limit)?;
        if row.change == StateChange::Nothing {
            return Ok(());
        }
        let client = self.client("save_state").await?;
        let result = write_state_on(&client, &self.queries, &row).await;
        settle(client, result.as_ref().err());
        result
    }

    /// The state write and the reply in one statement, through the stateful batch writer
    /// ([`save_stateful`]): concurrent saves share the statement and its commit.
    async fn save_reply_with_state_inner(
        &self,
        reply: &Reply,
        write: &StateWrite,
    ) -> Result<(), StorageError> {
        let save = StatefulSave { reply: reply.clone(), write: write.clone() };
        self.writers().stateful.submit(save).await
    }

    async fn clear_replies_inner(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> Result<(), StorageError> {
        let what = "clear_replies";
        let request_id = id_to_sql(request_id)?;
        let expected_reply_id = expected_reply_id.map(id_to_sql).transpose()?;
        let mut client = self.client(what).await?;
        let result =
            clear_replies_on(&mut client, &self.queries, request_id, expected_reply_id).await;
        settle(client, result.as_ref().err());
        result
    }

    async fn unprocessed_inner(
        &self,
        shard_ids: &[ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'_>,
    ) -> Result<UnprocessedBatch, StorageError> {
        let claim = Claim {
            shards: shard_ids.iter().map(ShardId::to_string).collect(),
            now: now.unix_millis(),
            limit: options.limit.map(|limit| i64::from(limit.get())),
            addresses: options.addresses.map(|addresses| {
                let (shards, types, ids) = address_columns(addresses);
                (
                    shards,
                    types.into_iter().map(str::to_owned).collect(),
                    ids.into_iter().map(str::to_owned).collect(),
                )
            }),
        };
        self.writers().claims.submit(claim).await
    }
}

/// Runs one claim on `client` (a pooled connection, or one inside the batch's transaction).
async fn claim_on(
    client: &impl deadpool_postgres::GenericClient,
    queries: &MessageQueries,
    claim: &Claim,
) -> Result<UnprocessedBatch, StorageError> {
    let what = "unprocessed_messages";
    let fail = |error| driver_error(what, error);
    let rows = match &claim.addresses {
        None => {
            let statement = client.prepare_cached(&queries.claim).await.map_err(fail)?;
            client
                .query(&statement, &[&claim.shards, &claim.now, &claim.limit])
                .await
                .map_err(fail)?
        }
        Some((shards, types, ids)) => {
            let statement =
                client.prepare_cached(&queries.claim_for_addresses).await.map_err(fail)?;
            let params: [&(dyn ToSql + Sync); 6] =
                [&claim.shards, &claim.now, &claim.limit, shards, types, ids];
            client.query(&statement, &params).await.map_err(fail)?
        }
    };
    message_rows(&rows)
}

/// Runs concurrent claims in one transaction (one commit). Each claim sees the rows the earlier
/// ones claimed as claimed, exactly as if they had run one after the other. If one fails, the
/// transaction rolls back and each claim runs on its own.
async fn claim_batch(
    pool: &Pool,
    queries: &MessageQueries,
    claims: Vec<Claim>,
) -> Vec<Result<UnprocessedBatch, StorageError>> {
    if claims.len() > 1
        && let Ok(mut client) = pool.get().await
    {
        let batched = claim_together(&mut client, queries, &claims).await;
        settle(client, batched.as_ref().err());
        if let Ok(batches) = batched {
            return batches.into_iter().map(Ok).collect();
        }
    }
    let mut results = Vec::with_capacity(claims.len());
    for claim in &claims {
        results.push(match pool.get().await {
            Ok(client) => {
                let result = claim_on(&client, queries, claim).await;
                settle(client, result.as_ref().err());
                result
            }
            Err(error) => Err(pool_error("unprocessed_messages", error)),
        });
    }
    results
}

async fn claim_together(
    client: &mut Object,
    queries: &MessageQueries,
    claims: &[Claim],
) -> Result<Vec<UnprocessedBatch>, StorageError> {
    let fail = |error| driver_error("unprocessed_messages: batch", error);
    // Dropped before commit (an error), the transaction sends ROLLBACK.
    let transaction = client.transaction().await.map_err(fail)?;
    let mut batches = Vec::with_capacity(claims.len());
    for claim in claims {
        batches.push(claim_on(&transaction, queries, claim).await?);
    }
    transaction.commit().await.map_err(fail)?;
    Ok(batches)
}

/// Saves a batch of requests with the shared protocol ([`save::save_requests`]: one multi-row
/// insert, then each request it did not insert on its own). The stored requests that asked for
/// their entity's earlier requests get them from one query for the whole batch
/// ([`earlier_requests`]).
async fn save_requests(
    backend: &PgSaveBackend,
    earlier_reads: &GenericPlans,
    limit: ValueLimit,
    jobs: Vec<SaveJob>,
) -> Vec<Result<OrderedSave, StorageError>> {
    let requests: Vec<(&Request, &SaveRequestOptions)> =
        jobs.iter().map(|job| (&job.request, &job.options)).collect();
    let saved = save::save_requests(backend, limit, &requests).await;
    let queries = &backend.queries;
    let ordered: Vec<&SaveJob> = jobs
        .iter()
        .zip(&saved)
        .filter(|(job, saved)| job.order.is_some() && matches!(saved, Ok(SaveResult::Success)))
        .map(|(job, _)| job)
        .collect();
    let mut earlier = if ordered.is_empty() {
        BTreeMap::new()
    } else {
        // A failed read does not fail the saves: their callers leave them to the read loop.
        earlier_requests(earlier_reads, queries, &ordered).await.unwrap_or_else(|error| {
            tracing::debug!(%error, "the earlier requests of saved requests could not be read");
            BTreeMap::new()
        })
    };
    jobs.iter()
        .zip(saved)
        .map(|(job, saved)| {
            let saved = saved?;
            let earlier = match (&saved, job.order) {
                (SaveResult::Success, Some(_)) => earlier.remove(&job.request.request_id),
                _ => None,
            };
            Ok(OrderedSave { saved, earlier })
        })
        .collect()
}

/// The unprocessed requests stored before each of `jobs` (all stored, all asking for it) for
/// its entity, in storage order: what `unprocessed_before` answers for one, in one statement.
/// Every job has an entry, empty when nothing came before it.
///
/// The statement reads at the jobs' bounds ([`batch_bounds`]).
async fn earlier_requests(
    connection: &GenericPlans,
    queries: &MessageQueries,
    jobs: &[&SaveJob],
) -> Result<BTreeMap<Snowflake, Vec<Snowflake>>, StorageError> {
    let ids =
        jobs.iter().map(|job| id_to_sql(job.request.request_id)).collect::<Result<Vec<_>, _>>()?;
    let (now, limit) = batch_bounds(jobs.iter().map(|job| job.order.unwrap_or((0, 0))));
    let sql = &queries.unprocessed_before_many;
    // Planned once, as `read_ordered`'s read.
    let rows =
        connection.query("save_request_ordered: earlier", sql, &[&ids, &now, &limit]).await?;
    let mut lists: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for row in &rows {
        let id: i64 = row.try_get(0).map_err(column_error)?;
        let before: Option<Vec<i64>> = row.try_get(1).map_err(column_error)?;
        lists.insert(id, before.unwrap_or_default());
    }
    let mut earlier = BTreeMap::new();
    for (job, id) in jobs.iter().zip(ids) {
        let (_, limit) = job.order.unwrap_or((0, 0));
        let before = earlier_of_caller(lists.remove(&id).unwrap_or_default(), limit)?;
        earlier.insert(job.request.request_id, before);
    }
    Ok(earlier)
}

/// The `now` and the limit of a statement that answers several callers' `(now, limit)`: the
/// earliest `now` (a message due then is due for every caller) and the largest limit (each
/// caller keeps its own, [`earlier_of_caller`]).
fn batch_bounds(orders: impl Iterator<Item = (i64, i64)>) -> (i64, i64) {
    orders.fold((i64::MAX, 0), |(now, limit), (at, most)| (now.min(at), limit.max(most)))
}

/// A caller's earlier requests from a batch's list: its first `limit`, in storage order.
fn earlier_of_caller(ids: Vec<i64>, limit: i64) -> Result<Vec<Snowflake>, StorageError> {
    let mut ids = ids;
    ids.truncate(usize::try_from(limit).unwrap_or(0));
    row::ids_from_sql(ids)
}

/// Answers concurrent `unprocessed_messages_ordered` calls with one statement.
///
/// - It reads at the batch's bounds ([`batch_bounds`]): a message due later for another caller
///   is left to the read loop.
/// - If it fails, every caller gets the error.
async fn read_ordered(
    connection: &GenericPlans,
    queries: &MessageQueries,
    reads: Vec<OrderedRead>,
) -> Vec<Result<OrderedBatch, StorageError>> {
    let mut ids: Vec<i64> = reads.iter().flat_map(|read| read.ids.iter().copied()).collect();
    ids.sort_unstable();
    ids.dedup();
    let (now, limit) = batch_bounds(reads.iter().map(|read| (read.now, read.limit)));
    let sql = &queries.unprocessed_ordered;
    // Planned once: its custom plans cost more to make than to run (see `GenericPlans`).
    let read = connection.query("unprocessed_messages_ordered", sql, &[&ids, &now, &limit]).await;
    let rows = match read.and_then(|rows| ordered_rows(&rows)) {
        Ok(rows) => rows,
        Err(error) => return reads.iter().map(|_| Err(error.clone())).collect(),
    };
    reads
        .iter()
        .map(|read| {
            let asked: BTreeSet<i64> = read.ids.iter().copied().collect();
            let mut messages = Vec::new();
            let mut earlier = BTreeMap::new();
            for (message, before) in rows.iter().filter(|(message, _)| asked.contains(&message.id))
            {
                // An unreadable id leaves its request without a list: it goes the read loop's
                // way.
                if let Some(before) = before
                    && let Ok(id) = id_from_sql(message.id)
                    && let Ok(before) = earlier_of_caller(before.clone(), read.limit)
                {
                    earlier.insert(id, before);
                }
                messages.push(message.clone());
            }
            Ok(OrderedBatch { batch: row::into_batch(messages), earlier })
        })
        .collect()
}

/// A row of [`read_ordered`]: the message row, and for a request its earlier ids.
type OrderedRow = (MessageRow, Option<Vec<i64>>);

fn ordered_rows(rows: &[Row]) -> Result<Vec<OrderedRow>, StorageError> {
    rows.iter()
        .map(|row| {
            let message = message_row(row)?;
            let earlier: Option<Vec<i64>> = row.try_get(16).map_err(column_error)?;
            let earlier = (message.kind == 0).then(|| earlier.unwrap_or_default());
            Ok((message, earlier))
        })
        .collect()
}

/// The address filter as three parallel columns `(shard_id, entity_type, entity_id)`, from the
/// reference's grouping ([`row::group_addresses`]), matched with `IN (SELECT * FROM
/// unnest(...))`: one prepared statement for any number of addresses and groups, matching the
/// same rows as the reference's `OR` of `(shard, type, ids)` clauses.
fn address_columns(addresses: &[EntityAddress]) -> (Vec<String>, Vec<&str>, Vec<&str>) {
    let mut shards = Vec::with_capacity(addresses.len());
    let mut types = Vec::with_capacity(addresses.len());
    let mut ids = Vec::with_capacity(addresses.len());
    for (shard_id, entity_type, entity_ids) in row::group_addresses(addresses) {
        for entity_id in entity_ids {
            shards.push(shard_id.clone());
            types.push(entity_type);
            ids.push(entity_id);
        }
    }
    (shards, types, ids)
}

/// The parameters `$1..$15` of a message insert.
fn insert_params<'a>(insert: &'a MessageInsert<'_>) -> [&'a (dyn ToSql + Sync); 15] {
    [
        &insert.id,
        &insert.message_id,
        &insert.shard_id,
        &insert.entity_type,
        &insert.entity_id,
        &insert.kind,
        &insert.tag,
        &insert.payload,
        &insert.headers,
        &insert.trace_id,
        &insert.span_id,
        &insert.sampled,
        &insert.request_id,
        &insert.reply_id,
        &insert.deliver_at,
    ]
}

/// `SaveResult::Duplicate` from a `select_duplicate` row (`m.id, r.id, r.kind, r.payload,
/// r.sequence`). The reply is addressed to the stored request, as the reference does.
fn duplicate(row: &Row) -> Result<SaveResult, StorageError> {
    let original_id: i64 = row.try_get(0).map_err(column_error)?;
    let reply_id: Option<i64> = row.try_get(1).map_err(column_error)?;
    let last_received_reply = match reply_id {
        None => None,
        Some(id) => Some(
            ReplyRow {
                id,
                kind: row.try_get(2).map_err(column_error)?,
                request_id: original_id,
                payload: row.try_get(3).map_err(column_error)?,
                sequence: row.try_get(4).map_err(column_error)?,
            }
            .decode()?,
        ),
    };
    let original_id = id_from_sql(original_id).map_err(|error| {
        StorageError::with_source(StorageErrorKind::Malformed, "unreadable message id", error)
    })?;
    Ok(SaveResult::Duplicate { original_id, last_received_reply })
}

/// Begins a transaction on a connection of `pool`.
async fn begin_on(
    pool: &Pool,
    queries: &Arc<MessageQueries>,
    limit: ValueLimit,
) -> Result<PgTransaction, StorageError> {
    let client = pool.get().await.map_err(|error| pool_error("begin_transaction", error))?;
    let transaction = PgTransaction::guarding(client, queries, limit);
    transaction.simple("begin_transaction", "BEGIN").await?;
    Ok(transaction)
}

/// The parameters of the reply batch statement (`save_replies`): one array per column.
struct ReplyColumns<'a> {
    ids: Vec<i64>,
    kinds: Vec<Option<i32>>,
    request_ids: Vec<i64>,
    payloads: Vec<&'a str>,
    sequences: Vec<Option<i32>>,
}

impl<'a> ReplyColumns<'a> {
    fn of(rows: &[&'a ReplyInsert]) -> ReplyColumns<'a> {
        ReplyColumns {
            ids: rows.iter().map(|row| row.id).collect(),
            kinds: rows.iter().map(|row| row.kind).collect(),
            request_ids: rows.iter().map(|row| row.request_id).collect(),
            payloads: rows.iter().map(|row| row.payload.as_str()).collect(),
            sequences: rows.iter().map(|row| row.sequence).collect(),
        }
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 5] {
        [&self.ids, &self.kinds, &self.request_ids, &self.payloads, &self.sequences]
    }
}

/// A final reply to save with its entity's state write (`save_reply_with_state`).
struct StatefulSave {
    reply: Reply,
    write: StateWrite,
}

/// Saves a batch of final replies, each with its entity's state write: both or neither per
/// save.
///
/// - Every value is checked first: one that does not fit fails alone, before anything is sent.
/// - The batch is one statement ([`MessageQueries::save_replies_with_state`]): one round trip
///   and one commit. A stale state write changes nothing, and its save fails with `StaleState`
///   while the others are stored.
/// - If the statement fails (a second final reply, say), it wrote nothing, and each save runs
///   in a statement of its own, so that only the faulty one fails. If the connection fails
///   while the statement runs, every save of the batch gets the error: whether it was written
///   is unknown.
async fn save_stateful(
    connection: &GenericPlans,
    queries: &Arc<MessageQueries>,
    limit: ValueLimit,
    inputs: Vec<StatefulSave>,
) -> Vec<Result<(), StorageError>> {
    let checked: Vec<Result<(ReplyInsert, StateRow<'_>), StorageError>> = inputs
        .iter()
        .map(|input| {
            let reply = ReplyInsert::checked(&input.reply, limit)?;
            Ok((reply, StateRow::checked(&input.write, limit)?))
        })
        .collect();
    let rows: Vec<&(ReplyInsert, StateRow<'_>)> =
        checked.iter().filter_map(|row| row.as_ref().ok()).collect();
    if rows.len() > 1 && distinct(&rows) {
        match save_stateful_rows(connection, queries, &rows).await {
            Ok(mut outcomes) => {
                outcomes.reverse();
                return checked
                    .into_iter()
                    .map(|row| row.and_then(|_| outcomes.pop().unwrap_or(Ok(()))))
                    .collect();
            }
            Err(BatchFailure::CommitFailed(error)) => {
                return checked.into_iter().map(|row| row.and(Err(error.clone()))).collect();
            }
            Err(BatchFailure::RolledBack(error)) => {
                tracing::debug!(%error, n_rows = rows.len(), "stateful batch rolled back");
            }
        }
    }
    let mut results = Vec::with_capacity(checked.len());
    for row in &checked {
        results.push(match row {
            Ok(row) => match save_stateful_rows(connection, queries, &[row]).await {
                Ok(mut outcome) => outcome.pop().unwrap_or(Ok(())),
                Err(BatchFailure::RolledBack(error) | BatchFailure::CommitFailed(error)) => {
                    Err(error)
                }
            },
            Err(refused) => Err(refused.clone()),
        });
    }
    results
}

/// Whether the saves are for distinct requests and distinct entities (one statement may
/// change a row once; two writes of one entity's state in a batch would be ordered by chance).
fn distinct(rows: &[&(ReplyInsert, StateRow<'_>)]) -> bool {
    let requests: BTreeSet<i64> = rows.iter().map(|(reply, _)| reply.request_id).collect();
    let entities: BTreeSet<(&str, &str)> =
        rows.iter().map(|(_, state)| (state.entity_type, state.entity_id)).collect();
    requests.len() == rows.len() && entities.len() == rows.len()
}

/// Saves `rows` (for distinct requests and entities) in one statement: each save's outcome
/// (`Ok`, or its `StaleState`), in order.
///
/// A statement that the server refused wrote nothing (`RolledBack`). A connection that failed
/// or timed out meanwhile leaves the outcome unknown (`CommitFailed`).
async fn save_stateful_rows(
    connection: &GenericPlans,
    queries: &MessageQueries,
    rows: &[&(ReplyInsert, StateRow<'_>)],
) -> Result<Vec<Result<(), StorageError>>, BatchFailure> {
    let what = "save_reply_with_state";
    let replies: Vec<&ReplyInsert> = rows.iter().map(|(reply, _)| reply).collect();
    let columns = ReplyColumns::of(&replies);
    let states = StateColumns::of(rows.iter().map(|(_, state)| state));
    let [ids, kinds, request_ids, payloads, sequences] = columns.params();
    let params: [&(dyn ToSql + Sync); 11] = [
        ids,
        kinds,
        request_ids,
        payloads,
        sequences,
        &states.types,
        &states.ids,
        &states.shards,
        &states.values,
        &states.expected,
        &states.changes,
    ];
    let result = connection.query(what, &queries.save_replies_with_state, &params).await;
    let stored = result.map_err(|error| match error.kind() {
        StorageErrorKind::Unavailable | StorageErrorKind::Timeout => {
            BatchFailure::CommitFailed(error)
        }
        _ => BatchFailure::RolledBack(error),
    })?;
    let stored = stored
        .iter()
        .map(|row| row.try_get::<_, i64>(0))
        .collect::<Result<BTreeSet<i64>, _>>()
        .map_err(|error| BatchFailure::CommitFailed(column_error(error)))?;
    Ok(rows
        .iter()
        .map(
            |(reply, state)| {
                if stored.contains(&reply.request_id) { Ok(()) } else { Err(state.write.stale()) }
            },
        )
        .collect())
}

/// The state writes of a batch as the parallel columns of
/// [`MessageQueries::save_replies_with_state`].
struct StateColumns<'a> {
    types: Vec<&'a str>,
    ids: Vec<&'a str>,
    shards: Vec<&'a str>,
    values: Vec<Option<&'a str>>,
    expected: Vec<i64>,
    changes: Vec<i32>,
}

impl<'a> StateColumns<'a> {
    fn of<'r>(rows: impl Iterator<Item = &'r StateRow<'a>>) -> StateColumns<'r>
    where
        'a: 'r,
    {
        let mut columns = StateColumns {
            types: Vec::new(),
            ids: Vec::new(),
            shards: Vec::new(),
            values: Vec::new(),
            expected: Vec::new(),
            changes: Vec::new(),
        };
        for row in rows {
            let (value, change) = match row.change {
                StateChange::Nothing => (None, queries::STATE_NOTHING),
                StateChange::Insert(value) => (Some(value), queries::STATE_INSERT),
                StateChange::Update(value) => (Some(value), queries::STATE_UPDATE),
                StateChange::Delete => (None, queries::STATE_DELETE),
            };
            columns.types.push(row.entity_type);
            columns.ids.push(row.entity_id);
            columns.shards.push(row.shard_id.as_str());
            columns.values.push(value);
            columns.expected.push(row.expected);
            columns.changes.push(change);
        }
        columns
    }
}

/// Saves the checked reply `insert` on `client` (a pooled connection, or one inside a
/// transaction).
async fn save_reply_on(
    client: &ClientWrapper,
    queries: &MessageQueries,
    insert: &ReplyInsert,
) -> Result<(), StorageError> {
    let sql = if insert.kind.is_some() { &queries.save_exit } else { &queries.save_chunk };
    let params: [&(dyn ToSql + Sync); 5] =
        [&insert.id, &insert.kind, &insert.request_id, &insert.payload, &insert.sequence];
    execute(client, "save_reply", sql, &params).await.map(drop)
}

/// Runs the checked state write `row` (not [`StateChange::Nothing`]) on `client`, a pooled
/// connection or one inside a transaction: one statement, which changes no row when the write
/// is stale (then `StaleState`, and a transaction it ran in goes on).
async fn write_state_on(
    client: &ClientWrapper,
    queries: &MessageQueries,
    row: &StateRow<'_>,
) -> Result<(), StorageError> {
    let (entity_type, entity_id) = (&row.entity_type, &row.entity_id);
    let changed = match row.change {
        StateChange::Nothing => return Ok(()),
        StateChange::Insert(value) => {
            let params: [&(dyn ToSql + Sync); 4] = [entity_type, entity_id, &row.shard_id, &value];
            execute(client, "save_state: insert", &queries.insert_state, &params).await?
        }
        StateChange::Update(value) => {
            let params: [&(dyn ToSql + Sync); 5] =
                [entity_type, entity_id, &row.shard_id, &value, &row.expected];
            execute(client, "save_state: update", &queries.update_state, &params).await?
        }
        StateChange::Delete => {
            let params: [&(dyn ToSql + Sync); 3] = [entity_type, entity_id, &row.expected];
            execute(client, "save_state: delete", &queries.delete_state, &params).await?
        }
    };
    if changed == 0 { Err(row.write.stale()) } else { Ok(()) }
}

/// `clear_replies` in one transaction. With an expected reply id, the request row is locked
/// first and the reset happens only if its latest reply is still that one (a concurrent
/// `save_reply` either commits first, and then the check fails, or waits for this transaction).
async fn clear_replies_on(
    client: &mut ClientWrapper,
    queries: &MessageQueries,
    request_id: i64,
    expected_reply_id: Option<i64>,
) -> Result<(), StorageError> {
    let what = "clear_replies";
    let fail = |error| driver_error(what, error);
    // Dropped before commit (an error, or a dropped future), the transaction sends ROLLBACK.
    let transaction = client.transaction().await.map_err(fail)?;
    if let Some(expected_reply_id) = expected_reply_id {
        // The reference's conditional reset: the final reply goes and the rows whose latest
        // reply it was are reset; interrupts are kept.
        let statement = transaction.prepare_cached(&queries.lock_if_latest).await.map_err(fail)?;
        let latest = transaction
            .query_opt(&statement, &[&request_id, &expected_reply_id])
            .await
            .map_err(fail)?;
        if latest.is_some() {
            let statement = transaction.prepare_cached(&queries.delete_exit).await.map_err(fail)?;
            transaction.execute(&statement, &[&request_id]).await.map_err(fail)?;
            let statement = transaction
                .prepare_cached(&queries.unprocess_request_if_latest)
                .await
                .map_err(fail)?;
            transaction
                .execute(&statement, &[&request_id, &expected_reply_id])
                .await
                .map_err(fail)?;
        }
        return transaction.commit().await.map_err(fail);
    }
    for sql in [&queries.delete_exit, &queries.delete_interrupts, &queries.unprocess_request] {
        let statement = transaction.prepare_cached(sql).await.map_err(fail)?;
        transaction.execute(&statement, &[&request_id]).await.map_err(fail)?;
    }
    transaction.commit().await.map_err(fail)
}

/// Message rows (`MESSAGE_COLUMNS`) as a batch; rows that cannot be decoded are reported
/// as malformed.
fn message_rows(rows: &[Row]) -> Result<UnprocessedBatch, StorageError> {
    let rows = rows.iter().map(message_row).collect::<Result<Vec<_>, _>>()?;
    Ok(row::into_batch(rows))
}

fn message_row(row: &Row) -> Result<MessageRow, StorageError> {
    let last_reply_id: Option<i64> = row.try_get(13).map_err(column_error)?;
    let last_reply = match last_reply_id {
        None => None,
        Some(id) => Some(LastReplyRow {
            id,
            payload: row.try_get(14).map_err(column_error)?,
            sequence: row.try_get(15).map_err(column_error)?,
        }),
    };
    Ok(MessageRow {
        id: row.try_get(0).map_err(column_error)?,
        shard_id: row.try_get(1).map_err(column_error)?,
        entity_type: row.try_get(2).map_err(column_error)?,
        entity_id: row.try_get(3).map_err(column_error)?,
        kind: row.try_get(4).map_err(column_error)?,
        tag: row.try_get(5).map_err(column_error)?,
        payload: row.try_get(6).map_err(column_error)?,
        headers: row.try_get(7).map_err(column_error)?,
        trace_id: row.try_get(8).map_err(column_error)?,
        span_id: row.try_get(9).map_err(column_error)?,
        sampled: row.try_get(10).map_err(column_error)?,
        request_id: row.try_get(11).map_err(column_error)?,
        reply_id: row.try_get(12).map_err(column_error)?,
        last_reply,
    })
}

fn reply_rows(rows: &[Row]) -> Result<Vec<Reply>, StorageError> {
    rows.iter()
        .map(|row| {
            ReplyRow {
                id: row.try_get(0).map_err(column_error)?,
                kind: row.try_get(1).map_err(column_error)?,
                request_id: row.try_get(2).map_err(column_error)?,
                payload: row.try_get(3).map_err(column_error)?,
                sequence: row.try_get(4).map_err(column_error)?,
            }
            .decode()
        })
        .collect()
}

fn ids_to_sql(ids: &[Snowflake]) -> Result<Vec<i64>, StorageError> {
    ids.iter().copied().map(id_to_sql).collect()
}

fn span(operation: &'static str) -> tracing::Span {
    tracing::debug_span!("message_storage", backend = "postgres", operation)
}

impl MessageStorage for PgMessageStorage {
    fn backend_name(&self) -> &'static str {
        "postgres"
    }

    fn save_request<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
    ) -> BoxFuture<'a, Result<SaveResult, StorageError>> {
        let job = SaveJob { request: request.clone(), options: options.clone(), order: None };
        let saved = self.writers().requests.submit(job);
        Box::pin(async move { Ok(saved.await?.saved) }.instrument(span("save_request")))
    }

    /// Saves the request in its group-commit batch and reads the earlier requests of the
    /// batch's stored requests with one more statement, instead of one per request.
    fn save_request_ordered<'a>(
        &'a self,
        request: &'a Request,
        options: &'a SaveRequestOptions,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedSave, StorageError>> {
        let order = Some((now.unix_millis(), i64::from(limit.get())));
        let job = SaveJob { request: request.clone(), options: options.clone(), order };
        Box::pin(self.writers().requests.submit(job).instrument(span("save_request_ordered")))
    }

    fn save_ack_chunk<'a>(&'a self, ack: &'a AckChunk) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let insert = MessageInsert::ack_chunk(ack)?;
                self.execute(
                    "save_ack_chunk",
                    &self.queries.insert_ack_chunk,
                    &insert_params(&insert),
                )
                .await
                .map(drop)
            }
            .instrument(span("save_ack_chunk")),
        )
    }

    fn save_interrupt<'a>(
        &'a self,
        interrupt: &'a Interrupt,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let insert = MessageInsert::interrupt(interrupt)?;
                self.execute(
                    "save_interrupt",
                    &self.queries.insert_interrupt,
                    &insert_params(&insert),
                )
                .await
                .map(drop)
            }
            .instrument(span("save_interrupt")),
        )
    }

    fn save_reply<'a>(&'a self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.writers().replies.submit(reply.clone()).instrument(span("save_reply")))
    }

    fn clear_replies(
        &self,
        request_id: Snowflake,
        expected_reply_id: Option<Snowflake>,
    ) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(
            self.clear_replies_inner(request_id, expected_reply_id)
                .instrument(span("clear_replies")),
        )
    }

    fn request_id_for_primary_key<'a>(
        &'a self,
        primary_key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Snowflake>, StorageError>> {
        Box::pin(
            async move {
                let message_id = cluster_core::envelope::message_id(primary_key);
                let sql = &self.queries.request_id_for_message_id;
                let rows = self.query("request_id_for_primary_key", sql, &[&message_id]).await?;
                let Some(row) = rows.first() else { return Ok(None) };
                let id: i64 = row.try_get(0).map_err(column_error)?;
                id_from_sql(id).map(Some).map_err(|error| {
                    StorageError::with_source(StorageErrorKind::Malformed, "unreadable id", error)
                })
            }
            .instrument(span("request_id_for_primary_key")),
        )
    }

    fn replies_for<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        Box::pin(self.replies_inner(request_ids, true).instrument(span("replies_for")))
    }

    fn replies_for_unfiltered<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<Vec<Reply>, StorageError>> {
        let operation = self.replies_inner(request_ids, false);
        Box::pin(operation.instrument(span("replies_for_unfiltered")))
    }

    fn unprocessed_messages<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
        now: Timestamp,
        options: UnprocessedOptions<'a>,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        Box::pin(
            async move {
                if shard_ids.is_empty() || options.addresses.is_some_and(<[_]>::is_empty) {
                    return Ok(UnprocessedBatch::default());
                }
                self.unprocessed_inner(shard_ids, now, options).await
            }
            .instrument(span("unprocessed_messages")),
        )
    }

    fn unprocessed_messages_by_id<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
    ) -> BoxFuture<'a, Result<UnprocessedBatch, StorageError>> {
        Box::pin(
            async move {
                if ids.is_empty() {
                    return Ok(UnprocessedBatch::default());
                }
                let ids = ids_to_sql(ids)?;
                let now = now.unix_millis();
                let sql = &self.queries.unprocessed_by_id;
                message_rows(&self.query("unprocessed_messages_by_id", sql, &[&ids, &now]).await?)
            }
            .instrument(span("unprocessed_messages_by_id")),
        )
    }

    fn unprocessed_messages_ordered<'a>(
        &'a self,
        ids: &'a [Snowflake],
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<OrderedBatch, StorageError>> {
        Box::pin(
            async move {
                if ids.is_empty() {
                    return Ok(OrderedBatch::default());
                }
                let read = OrderedRead {
                    ids: ids_to_sql(ids)?,
                    now: now.unix_millis(),
                    limit: i64::from(limit.get()),
                };
                self.writers().reads.submit(read).await
            }
            .instrument(span("unprocessed_messages_ordered")),
        )
    }

    fn unprocessed_before<'a>(
        &'a self,
        address: &'a EntityAddress,
        request_id: Snowflake,
        now: Timestamp,
        limit: std::num::NonZeroU32,
    ) -> BoxFuture<'a, Result<Vec<Snowflake>, StorageError>> {
        Box::pin(
            async move {
                let shard_id = address.shard_id.to_string();
                let request_id = id_to_sql(request_id)?;
                let now = now.unix_millis();
                let limit = i64::from(limit.get());
                let sql = &self.queries.unprocessed_before;
                let params: [&(dyn ToSql + Sync); 6] = [
                    &shard_id,
                    &address.entity_type.as_str(),
                    &address.entity_id.as_str(),
                    &request_id,
                    &now,
                    &limit,
                ];
                let rows = self.query("unprocessed_before", sql, &params).await?;
                let ids = rows
                    .iter()
                    .map(|row| row.try_get::<_, i64>(0).map_err(column_error))
                    .collect::<Result<Vec<i64>, StorageError>>()?;
                crate::row::ids_from_sql(ids)
            }
            .instrument(span("unprocessed_before")),
        )
    }

    fn reset_requests<'a>(
        &'a self,
        request_ids: &'a [Snowflake],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                if request_ids.is_empty() {
                    return Ok(());
                }
                let ids = ids_to_sql(request_ids)?;
                self.execute("reset_requests", &self.queries.reset_requests, &[&ids])
                    .await
                    .map(drop)
            }
            .instrument(span("reset_requests")),
        )
    }

    fn reset_addresses<'a>(
        &'a self,
        addresses: &'a [EntityAddress],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                if addresses.is_empty() {
                    return Ok(());
                }
                let (shards, types, ids) = address_columns(addresses);
                let sql = &self.queries.reset_addresses;
                self.execute("reset_addresses", sql, &[&shards, &types, &ids]).await.map(drop)
            }
            .instrument(span("reset_addresses")),
        )
    }

    fn reset_shards<'a>(
        &'a self,
        shard_ids: &'a [ShardId],
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                if shard_ids.is_empty() {
                    return Ok(());
                }
                let shards: Vec<String> = shard_ids.iter().map(ShardId::to_string).collect();
                self.execute("reset_shards", &self.queries.reset_shards, &[&shards]).await.map(drop)
            }
            .instrument(span("reset_shards")),
        )
    }

    fn clear_address<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                let entity_type = address.entity_type.as_str();
                let entity_id = address.entity_id.as_str();
                let sql = &self.queries.clear_address;
                self.execute("clear_address", sql, &[&entity_type, &entity_id]).await.map(drop)
            }
            .instrument(span("clear_address")),
        )
    }

    fn purge_processed<'a>(
        &'a self,
        batch: &'a PurgeProcessed,
    ) -> BoxFuture<'a, Result<u64, StorageError>> {
        Box::pin(self.purge_processed_inner(batch).instrument(span("purge_processed")))
    }

    fn processed_requests<'a>(
        &'a self,
        query: &'a ProcessedQuery,
    ) -> BoxFuture<'a, Result<Vec<ProcessedRequest>, StorageError>> {
        Box::pin(self.processed_requests_inner(query).instrument(span("processed_requests")))
    }

    fn backlog<'a>(
        &'a self,
        query: &'a BacklogQuery,
    ) -> BoxFuture<'a, Result<Vec<Backlog>, StorageError>> {
        Box::pin(self.backlog_inner(query).instrument(span("backlog")))
    }

    fn requests<'a>(
        &'a self,
        query: &'a RequestQuery,
    ) -> BoxFuture<'a, Result<Vec<RequestRecord>, StorageError>> {
        Box::pin(self.requests_inner(query).instrument(span("requests")))
    }

    fn load_state<'a>(
        &'a self,
        address: &'a EntityAddress,
    ) -> BoxFuture<'a, Result<Option<StoredState>, StorageError>> {
        Box::pin(self.load_state_inner(address).instrument(span("load_state")))
    }

    fn save_state<'a>(&'a self, write: &'a StateWrite) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(self.save_state_inner(write).instrument(span("save_state")))
    }

    /// Through the stateful batch writers (`save_stateful`), not the reply batch writer of
    /// [`save_reply`](MessageStorage::save_reply): concurrent saves share a transaction and
    /// its commit.
    fn save_reply_with_state<'a>(
        &'a self,
        reply: &'a Reply,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            self.save_reply_with_state_inner(reply, write)
                .instrument(span("save_reply_with_state")),
        )
    }

    fn begin_transaction(
        &self,
    ) -> BoxFuture<'_, Result<Box<dyn MessageTransaction>, StorageError>> {
        Box::pin(
            async move {
                let transaction = self.begin().await?;
                Ok(Box::new(transaction) as Box<dyn MessageTransaction>)
            }
            .instrument(span("begin_transaction")),
        )
    }
}

/// The PostgreSQL storage transaction a handler runs in, locked: it derefs to the pooled
/// [`deadpool_postgres::Object`] (a `tokio_postgres::Client` through `Deref`) on which the
/// transaction is open.
///
/// The handler's own statements run on it and commit or roll back with its saved result.
/// The handler must not send `COMMIT` or `ROLLBACK` itself.
/// Hold the guard only while running statements (see [`TransactionGuard`]).
///
/// ```
/// use cluster_core::transaction::{TransactionError, TransactionSource};
/// use cluster_storage_sql::postgres::PgTransactionGuard;
///
/// /// Debits an account in the transaction of `context` (a `WITH_TRANSACTION` handler's
/// /// `RequestContext`, or a transactional activity's `ActivityContext`).
/// async fn debit(context: &impl TransactionSource, amount: i64) -> Result<u64, String> {
///     let client = PgTransactionGuard::of(context).await.map_err(|error| error.to_string())?;
///     let sql = "UPDATE accounts SET balance = balance - $1 WHERE id = 1";
///     client.execute(sql, &[&amount]).await.map_err(|error| error.to_string())
/// }
/// ```
pub type PgTransactionGuard<'a> = TransactionGuard<'a, Object>;

/// An open transaction on one pooled connection (`BEGIN` was sent).
///
/// [`backend`](MessageTransaction::backend) is the [`deadpool_postgres::Object`], which a
/// handler reaches through [`PgTransactionGuard`].
///
/// Dropped without [`commit`](MessageTransaction::commit) or
/// [`rollback`](MessageTransaction::rollback), the connection is closed rather than given back
/// to the pool, and the server rolls the transaction back when the session ends.
pub struct PgTransaction {
    /// `None` once committed or rolled back (both consume the transaction).
    client: Option<Object>,
    queries: Arc<MessageQueries>,
    limit: ValueLimit,
    /// What [`MessageTransaction::backend`] lends when there is no connection.
    closed: (),
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransaction").field("open", &self.client.is_some()).finish()
    }
}

impl PgTransaction {
    fn connection(&self) -> Result<&ClientWrapper, StorageError> {
        self.client.as_deref().ok_or_else(|| {
            StorageError::new(StorageErrorKind::Other, "the transaction is already finished")
        })
    }

    async fn simple(&self, what: &str, sql: &str) -> Result<(), StorageError> {
        let client = self.connection()?;
        client.batch_execute(sql).await.map_err(|error| driver_error(what, error))
    }

    /// The transaction about to begin on `client`. It exists before `BEGIN` is sent: if a
    /// future is dropped while `BEGIN` is in flight, the connection is closed instead of going
    /// back to the pool inside a transaction.
    fn guarding(client: Object, queries: &Arc<MessageQueries>, limit: ValueLimit) -> PgTransaction {
        PgTransaction { client: Some(client), queries: Arc::clone(queries), limit, closed: () }
    }

    /// Runs the checked state write `row` in the transaction: a stale one fails with
    /// `StaleState` and leaves the transaction usable (it changed nothing).
    async fn write_state(&self, row: &StateRow<'_>) -> Result<(), StorageError> {
        write_state_on(self.connection()?, &self.queries, row).await
    }

    /// Sends `sql` (`COMMIT` or `ROLLBACK`) and gives the connection back, or closes it if the
    /// statement failed.
    async fn finish(mut self, what: &str, sql: &str) -> Result<(), StorageError> {
        let result = self.simple(what, sql).await;
        if let Some(client) = self.client.take() {
            if result.is_ok() {
                drop(client);
            } else {
                // The session may still be inside the transaction: never reuse it.
                drop(Object::take(client));
            }
        }
        result
    }
}

impl Drop for PgTransaction {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            tracing::debug!("transaction dropped while open: closing its connection");
            drop(Object::take(client));
        }
    }
}

impl MessageTransaction for PgTransaction {
    fn save_reply<'a>(&'a mut self, reply: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                // Checked before any statement: a refused reply would otherwise abort the
                // transaction, and with it the replies saved before.
                let insert = ReplyInsert::checked(reply, self.limit)?;
                save_reply_on(self.connection()?, &self.queries, &insert).await
            }
            .instrument(span("transaction.save_reply")),
        )
    }

    fn save_state<'a>(
        &'a mut self,
        write: &'a StateWrite,
    ) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(
            async move {
                // Checked before any statement, as replies are.
                let row = StateRow::checked(write, self.limit)?;
                self.write_state(&row).await
            }
            .instrument(span("transaction.save_state")),
        )
    }

    fn backend(&mut self) -> &mut (dyn Any + Send) {
        match &mut self.client {
            Some(client) => client,
            None => &mut self.closed,
        }
    }

    fn savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(
            async move { self.simple("savepoint", queries::SAVEPOINT).await }
                .instrument(span("transaction.savepoint")),
        )
    }

    fn rollback_to_savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(
            async move {
                self.simple("rollback to savepoint", queries::ROLLBACK_TO_SAVEPOINT).await
            }
            .instrument(span("transaction.rollback_to_savepoint")),
        )
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        // `SELECT 1` first: in a transaction that already failed, PostgreSQL answers a bare
        // `COMMIT` by rolling back without an error; the `SELECT` fails instead (SQLSTATE
        // 25P02), so a failed transaction is never reported as committed.
        Box::pin((*self).finish("commit", "SELECT 1; COMMIT").instrument(span("commit")))
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        Box::pin((*self).finish("rollback", "ROLLBACK").instrument(span("rollback")))
    }
}
