//! PostgreSQL tests: the conformance suite in both lock modes, the schema against the
//! reference's DDL, migrations, advisory lock namespaces, and faults of the lock session and
//! the pool (a frozen holder, killed backends, malformed rows).
//!
//! They need `CLUSTER_TEST_POSTGRES_URL` (for example `postgres://postgres@127.0.0.1:5432/test`);
//! each test uses tables with its own prefix and drops them.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::entity_state::StateWrite;
use cluster_core::envelope::{RawJson, Request, TraceContext};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::ids::RunnerWeight;
use cluster_core::storage::{
    MessageStorage, RunnerStorage, SaveRequestOptions, SaveResult, UnprocessedBatch,
    UnprocessedOptions,
};
use cluster_core::{
    Clock, EntityAddress, EntityId, EntityType, Runner, RunnerAddress, ShardGroup, ShardId,
    ShardingConfig, Snowflake, SystemClock,
};
use cluster_storage_sql::postgres::{self, PgMessageStorage, PgRunnerStorage};
use cluster_storage_sql::{LockMode, SqlStorageOptions, TablePrefix};
use cluster_testkit::storage_suite::{Corruption, StorageFixture};
use cluster_testkit::wait::eventually_async;
use tokio::task::JoinHandle;
use tokio_postgres::NoTls;

const URL_VARIABLE: &str = "CLUSTER_TEST_POSTGRES_URL";

/// How long a test waits for an eventual condition before failing.
const EVENTUAL: Duration = Duration::from_secs(30);

/// The tables of a prefix, histories included.
const TABLES: [&str; 7] =
    ["messages", "replies", "migrations", "runners", "locks", "runner_migrations", "entity_state"];

fn options(prefix: &TablePrefix, lock_mode: LockMode, expiration: Duration) -> SqlStorageOptions {
    let config = ShardingConfig {
        shard_lock_expiration: expiration,
        shard_lock_disable_advisory: lock_mode == LockMode::Lease,
        ..ShardingConfig::default()
    };
    SqlStorageOptions::from_config(&config, prefix.clone())
}

/// A plain connection for the test's own statements.
struct Admin {
    client: tokio_postgres::Client,
    connection: JoinHandle<()>,
}

impl Admin {
    async fn connect(url: &str) -> Admin {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
        let connection = tokio::spawn(async move {
            let _ended = connection.await;
        });
        Admin { client, connection }
    }

    async fn drop_tables(&self, prefix: &TablePrefix) {
        let tables: Vec<String> =
            TABLES.iter().map(|table| format!("\"{}\"", prefix.table(table))).collect();
        let sql = format!("DROP TABLE IF EXISTS {}", tables.join(", "));
        self.client.batch_execute(&sql).await.unwrap();
    }
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// Fresh tables for one conformance case, in one lock mode.
struct PgFixture {
    url: String,
    prefix: TablePrefix,
    lock_mode: LockMode,
    admin: Admin,
    message_storage: Arc<PgMessageStorage>,
}

async fn pg_fixture(lock_mode: LockMode) -> Option<Box<dyn StorageFixture>> {
    let url = crate::database_url(URL_VARIABLE)?;
    let prefix = crate::unique_prefix();
    let options = SqlStorageOptions {
        value_bytes_max: crate::suite_value_bytes_max(),
        ..options(&prefix, lock_mode, Duration::from_secs(60))
    };
    let pool = postgres::pool(postgres::parse_config(&url).unwrap(), 8).unwrap();
    let message_storage = PgMessageStorage::new(pool, &options).await.unwrap();
    PgRunnerStorage::migrate(message_storage.pool(), &prefix).await.unwrap();
    let admin = Admin::connect(&url).await;
    Some(Box::new(PgFixture {
        url,
        prefix,
        lock_mode,
        admin,
        message_storage: Arc::new(message_storage),
    }))
}

impl StorageFixture for PgFixture {
    fn name(&self) -> &str {
        match self.lock_mode {
            LockMode::Advisory => "postgres (advisory locks)",
            LockMode::Lease => "postgres (lease locks)",
        }
    }

    fn message_storage(&self) -> Arc<dyn MessageStorage> {
        Arc::clone(&self.message_storage) as Arc<dyn MessageStorage>
    }

    fn runner_storage(&self, expiration: Duration) -> BoxFuture<'_, Arc<dyn RunnerStorage>> {
        Box::pin(async move {
            let options = options(&self.prefix, self.lock_mode, expiration);
            let storage = PgRunnerStorage::connect(&self.url, &options).await.unwrap();
            Arc::new(storage) as Arc<dyn RunnerStorage>
        })
    }

    fn value_bytes_max(&self) -> usize {
        self.message_storage.value_bytes_max().get()
    }

    fn corrupt(&self, corruption: Corruption) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let (table, id) = match &corruption {
                Corruption::MessagePayload(id) => ("messages", *id),
                Corruption::ReplyPayload(id) => ("replies", *id),
                Corruption::StateValue(address) => {
                    let sql = format!(
                        "UPDATE \"{}\" SET value = '{{not json' \
                         WHERE entity_type = $1 AND entity_id = $2",
                        self.prefix.table("entity_state")
                    );
                    let key = [address.entity_type.as_str(), address.entity_id.as_str()];
                    let changed = self.admin.client.execute(&sql, &[&key[0], &key[1]]).await;
                    assert_eq!(changed.unwrap(), 1, "corrupting {corruption:?}");
                    return;
                }
            };
            let sql = format!(
                "UPDATE \"{}\" SET payload = '{{not json' WHERE id = $1",
                self.prefix.table(table)
            );
            let id = id.to_i64().unwrap();
            let changed = self.admin.client.execute(&sql, &[&id]).await.unwrap();
            assert_eq!(changed, 1, "corrupting {corruption:?}");
        })
    }

    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { self.admin.drop_tables(&self.prefix).await })
    }
}

mod advisory {
    use super::*;

    async fn fixture() -> Option<Box<dyn StorageFixture>> {
        pg_fixture(LockMode::Advisory).await
    }

    cluster_testkit::storage_suite!(fixture);
}

mod lease {
    use super::*;

    async fn fixture() -> Option<Box<dyn StorageFixture>> {
        pg_fixture(LockMode::Lease).await
    }

    cluster_testkit::storage_suite!(fixture);
}

// --- Helpers of the backend's own tests ------------------------------------------------------

/// A prefix, its URL and an admin connection, with the tables dropped at the end.
struct Scratch {
    url: String,
    prefix: TablePrefix,
    admin: Admin,
}

impl Scratch {
    async fn new() -> Option<Scratch> {
        let url = crate::database_url(URL_VARIABLE)?;
        let admin = Admin::connect(&url).await;
        Some(Scratch { url, prefix: crate::unique_prefix(), admin })
    }

    fn options(&self, lock_mode: LockMode, expiration: Duration) -> SqlStorageOptions {
        options(&self.prefix, lock_mode, expiration)
    }

    async fn message_storage(&self) -> PgMessageStorage {
        let options = self.options(LockMode::Advisory, Duration::from_secs(60));
        PgMessageStorage::connect(&self.url, &options).await.unwrap()
    }

    async fn runner_storage(&self, lock_mode: LockMode, expiration: Duration) -> PgRunnerStorage {
        PgRunnerStorage::connect(&self.url, &self.options(lock_mode, expiration)).await.unwrap()
    }

    fn table(&self, name: &str) -> String {
        self.prefix.table(name)
    }

    async fn cleanup(self) {
        self.admin.drop_tables(&self.prefix).await;
    }
}

fn shard(id: u32) -> ShardId {
    ShardId::new(ShardGroup::from("default"), id)
}

fn shards(ids: &[u32]) -> Vec<ShardId> {
    ids.iter().copied().map(shard).collect()
}

fn request(id: u64, entity: &str) -> Request {
    Request {
        request_id: Snowflake::new(id),
        address: EntityAddress {
            shard_id: shard(1),
            entity_type: EntityType::from("TestEntity"),
            entity_id: EntityId::from(entity),
        },
        tag: "GetUser".into(),
        payload: RawJson::from_json(format!(r#"{{"id":{id}}}"#)).unwrap(),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    }
}

async fn read(storage: &PgMessageStorage) -> Result<UnprocessedBatch, StorageError> {
    storage
        .unprocessed_messages(&[shard(1)], SystemClock.now(), UnprocessedOptions::default())
        .await
}

fn message_ids(batch: &UnprocessedBatch) -> Vec<u64> {
    batch.messages.iter().map(|message| message.envelope.id().get()).collect()
}

// --- Schema and migrations --------------------------------------------------------------------

/// Every column of a table as `name type nullability default`, in column order.
async fn columns(admin: &Admin, table: &str) -> Vec<String> {
    let rows = admin
        .client
        .query(
            "SELECT column_name::text, data_type::text, character_maximum_length, \
                    is_nullable::text, column_default::text \
             FROM information_schema.columns WHERE table_name = $1 ORDER BY ordinal_position",
            &[&table],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|row| {
            let name: String = row.get(0);
            let data_type: String = row.get(1);
            let length: Option<i32> = row.get(2);
            let nullable: String = row.get(3);
            let default: Option<String> = row.get(4);
            let data_type = match length {
                Some(length) => format!("{data_type}({length})"),
                None => data_type,
            };
            let nullable = if nullable == "YES" { "null" } else { "not null" };
            // A serial column's default names its sequence; only its kind matters.
            let default = match default {
                Some(default) if default.starts_with("nextval(") => " default nextval".to_owned(),
                Some(default) => format!(" default {default}"),
                None => String::new(),
            };
            format!("{name} {data_type} {nullable}{default}")
        })
        .collect()
}

/// The indexes of a table: `name: definition` with the table name replaced by `T`.
async fn indexes(admin: &Admin, table: &str) -> Vec<String> {
    let rows = admin
        .client
        .query(
            "SELECT indexname::text, indexdef FROM pg_indexes WHERE tablename = $1 ORDER BY indexname",
            &[&table],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|row| {
            let name: String = row.get(0);
            let definition: String = row.get(1);
            format!("{}: {}", name.replace(table, "T"), definition.replace(table, "T"))
        })
        .collect()
}

/// The created tables have the reference's columns, types, nullability, defaults, unique
/// constraints and indexes (`effect/src/cluster/SqlRunnerStorage.ts`,
/// `effect/src/cluster/SqlMessageStorage.ts`; PostgreSQL DDL of effect 4.1.0).
#[tokio::test]
#[expect(clippy::too_many_lines, reason = "every table's expected schema, one after another")]
async fn schema_matches_the_reference() {
    let Some(scratch) = Scratch::new().await else { return };
    let _messages = scratch.message_storage().await;
    let _runners = scratch.runner_storage(LockMode::Advisory, Duration::from_secs(30)).await;
    let admin = &scratch.admin;
    assert_eq!(
        columns(admin, &scratch.table("messages")).await,
        [
            "id bigint not null",
            "rowid bigint not null default nextval",
            "message_id character varying(255) null",
            "shard_id character varying(50) not null",
            "entity_type character varying(150) not null",
            "entity_id character varying(255) not null",
            "kind integer not null",
            "tag character varying(50) null",
            "payload text null",
            "headers text null",
            "trace_id character varying(32) null",
            "span_id character varying(16) null",
            "sampled boolean null",
            "processed boolean not null default false",
            "request_id bigint not null",
            "reply_id bigint null",
            "last_reply_id bigint null",
            "last_read timestamp without time zone null",
            "deliver_at bigint null",
        ]
    );
    assert_eq!(
        columns(admin, &scratch.table("replies")).await,
        [
            "id bigint not null",
            "rowid bigint not null default nextval",
            "kind integer null",
            "request_id bigint not null",
            "payload text not null",
            "sequence integer null",
            "acked boolean not null default false",
        ]
    );
    assert_eq!(
        columns(admin, &scratch.table("runners")).await,
        [
            "machine_id integer not null default nextval",
            "address character varying(255) not null",
            "runner text not null",
            "healthy boolean not null default true",
            "last_heartbeat timestamp without time zone not null default now()",
        ]
    );
    assert_eq!(
        columns(admin, &scratch.table("locks")).await,
        [
            "shard_id character varying(50) not null",
            "address character varying(255) not null",
            "acquired_at timestamp without time zone not null",
        ]
    );
    for history in ["migrations", "runner_migrations"] {
        assert_eq!(
            columns(admin, &scratch.table(history)).await,
            [
                "migration_id integer not null",
                "created_at timestamp with time zone not null default now()",
                "name text not null",
            ]
        );
    }
    assert_eq!(
        indexes(admin, &scratch.table("messages")).await,
        [
            "T_message_id_key: CREATE UNIQUE INDEX T_message_id_key ON public.T USING btree (message_id)",
            "T_pkey: CREATE UNIQUE INDEX T_pkey ON public.T USING btree (id)",
            "T_request_id_idx: CREATE INDEX T_request_id_idx ON public.T USING btree (request_id)",
            "T_rowid_idx: CREATE INDEX T_rowid_idx ON public.T USING btree (rowid)",
            // `run_idx` and `unprocessed_idx` are ours, not in the reference's history.
            "T_run_idx: CREATE INDEX T_run_idx ON public.T USING btree (id) WHERE ((kind = 0) AND ((tag)::text = 'run'::text))",
            "T_shard_idx: CREATE INDEX T_shard_idx ON public.T USING btree (shard_id, processed, last_read, deliver_at)",
            "T_unprocessed_idx: CREATE INDEX T_unprocessed_idx ON public.T USING btree (rowid) WHERE (processed = false)",
        ]
    );
    assert_eq!(
        indexes(admin, &scratch.table("replies")).await,
        [
            "T_pkey: CREATE UNIQUE INDEX T_pkey ON public.T USING btree (id)",
            "T_request_id_kind_key: CREATE UNIQUE INDEX T_request_id_kind_key ON public.T USING btree (request_id, kind)",
            "T_request_id_sequence_key: CREATE UNIQUE INDEX T_request_id_sequence_key ON public.T USING btree (request_id, sequence)",
            "T_request_lookup_idx: CREATE INDEX T_request_lookup_idx ON public.T USING btree (request_id, kind, acked)",
        ]
    );
    assert_eq!(
        indexes(admin, &scratch.table("runners")).await,
        [
            "T_address_key: CREATE UNIQUE INDEX T_address_key ON public.T USING btree (address)",
            "T_pkey: CREATE UNIQUE INDEX T_pkey ON public.T USING btree (machine_id)",
        ]
    );
    assert_eq!(
        indexes(admin, &scratch.table("locks")).await,
        ["T_pkey: CREATE UNIQUE INDEX T_pkey ON public.T USING btree (shard_id)"]
    );
    scratch.cleanup().await;
}

async fn history(admin: &Admin, table: &str) -> Vec<(i32, String)> {
    let sql = format!("SELECT migration_id, name FROM \"{table}\" ORDER BY migration_id");
    let rows = admin.client.query(&sql, &[]).await.unwrap();
    rows.iter().map(|row| (row.get(0), row.get(1))).collect()
}

/// The reference's message history, exactly as its migrator writes it: nothing of ours.
fn reference_message_history() -> Vec<(i32, String)> {
    vec![
        (1, "create_tables".to_owned()),
        (2, "entity_type_size".to_owned()),
        (3, "pg_messages_rowid_index".to_owned()),
    ]
}

/// The definition of the index `name`, if it exists.
async fn index_definition(admin: &Admin, name: &str) -> Option<String> {
    let rows =
        admin.client.query("SELECT indexdef FROM pg_indexes WHERE indexname = $1", &[&name]).await;
    rows.unwrap().first().map(|row| row.get(0))
}

/// Migrations are recorded as the reference's migrator records them, run once, are safe to run
/// concurrently, and a second storage on the prefix shares the tables. The claim's index, which
/// the reference does not have, is created without a history row.
#[tokio::test]
async fn migrations_are_idempotent_and_shared() {
    let Some(scratch) = Scratch::new().await else { return };
    let pool = postgres::pool(postgres::parse_config(&scratch.url).unwrap(), 4).unwrap();
    // Two migrators at once: one runs the migrations, the other waits and finds none to run.
    let (first, second) = tokio::join!(
        PgMessageStorage::migrate(&pool, &scratch.prefix),
        PgMessageStorage::migrate(&pool, &scratch.prefix),
    );
    let mut ran = [first.unwrap(), second.unwrap()];
    ran.sort();
    assert_eq!(ran, [vec![], vec![1, 2, 3]]);
    let (first, second) = tokio::join!(
        PgRunnerStorage::migrate(&pool, &scratch.prefix),
        PgRunnerStorage::migrate(&pool, &scratch.prefix),
    );
    let mut ran = [first.unwrap(), second.unwrap()];
    ran.sort();
    assert_eq!(ran, [vec![], vec![1]]);
    assert!(PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap().is_empty());
    assert!(PgRunnerStorage::migrate(&pool, &scratch.prefix).await.unwrap().is_empty());
    let messages_history = history(&scratch.admin, &scratch.table("migrations")).await;
    assert_eq!(messages_history, reference_message_history());
    assert_eq!(
        history(&scratch.admin, &scratch.table("runner_migrations")).await,
        [(1, "create_tables".to_owned())]
    );
    let index = scratch.table("messages_unprocessed_idx");
    let definition = index_definition(&scratch.admin, &index).await.expect("the claim's index");
    assert!(definition.ends_with("(rowid) WHERE (processed = false)"), "{definition}");

    // A second storage (another process) on the prefix sees the first one's rows.
    let first = scratch.message_storage().await;
    let second = scratch.message_storage().await;
    let saved = first.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    assert_eq!(message_ids(&read(&second).await.unwrap()), [1]);
    // Tables created by someone else without a history (the reference's case of existing
    // deployments) are adopted: the history is rewritten and the DDL is a no-op.
    scratch
        .admin
        .client
        .batch_execute(&format!("DELETE FROM \"{}\"", scratch.table("migrations")))
        .await
        .unwrap();
    assert_eq!(PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap(), [1, 2, 3]);
    // Tables migrated by the reference (no claim index) get the index, and no history row.
    scratch.admin.client.batch_execute(&format!("DROP INDEX \"{index}\"")).await.unwrap();
    assert!(PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap().is_empty());
    assert!(index_definition(&scratch.admin, &index).await.is_some(), "the index is back");
    let messages_history = history(&scratch.admin, &scratch.table("migrations")).await;
    assert_eq!(messages_history, reference_message_history());
    assert_eq!(
        message_ids(
            &second
                .unprocessed_messages_by_id(&[Snowflake::new(1)], SystemClock.now())
                .await
                .unwrap()
        ),
        [1]
    );
    scratch.cleanup().await;
}

/// The entity state table is ours: created by the message migrations with the messages'
/// columns for its key, without a history row, and again when it is missing; its times are
/// the database's clock in UTC.
#[tokio::test]
async fn the_entity_state_table_is_created_outside_the_history() {
    let Some(scratch) = Scratch::new().await else { return };
    let pool = postgres::pool(postgres::parse_config(&scratch.url).unwrap(), 2).unwrap();
    assert_eq!(PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap(), [1, 2, 3]);
    let state = scratch.table("entity_state");
    assert_eq!(
        columns(&scratch.admin, &state).await,
        [
            "entity_type character varying(150) not null",
            "entity_id character varying(255) not null",
            "shard_id character varying(50) not null",
            "value text not null",
            "revision bigint not null",
            "updated_at timestamp without time zone not null",
        ]
    );
    assert_eq!(
        indexes(&scratch.admin, &state).await,
        ["T_pkey: CREATE UNIQUE INDEX T_pkey ON public.T USING btree (entity_type, entity_id)"]
    );
    let migrations = scratch.table("migrations");
    assert_eq!(history(&scratch.admin, &migrations).await, reference_message_history());
    scratch.admin.client.batch_execute(&format!("DROP TABLE \"{state}\"")).await.unwrap();
    assert!(PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap().is_empty());
    assert_eq!(columns(&scratch.admin, &state).await.len(), 6, "the table is back");
    assert_eq!(history(&scratch.admin, &migrations).await, reference_message_history());
    let storage = scratch.message_storage().await;
    let address = EntityAddress {
        shard_id: shard(7),
        entity_type: EntityType::from("TestEntity"),
        entity_id: EntityId::from("e1"),
    };
    let write = StateWrite { address, expected: 0, value: Some(RawJson::null()) };
    storage.save_state(&write).await.unwrap();
    let row = scratch
        .admin
        .client
        .query_one(
            &format!(
                "SELECT shard_id, abs(extract(epoch FROM \
                 (NOW() AT TIME ZONE 'UTC') - updated_at))::float8 FROM \"{state}\""
            ),
            &[],
        )
        .await
        .unwrap();
    let (shard_id, age): (String, f64) = (row.get(0), row.get(1));
    assert_eq!(shard_id, shard(7).to_string());
    assert!(age < 60.0, "updated_at is UTC, {age} s from now");
    scratch.cleanup().await;
}

/// Earlier versions recorded the claim's index as migration `4 pg_messages_unprocessed_index`
/// in the reference's history, where a later effect release's own migration 4 would then be
/// skipped. A migration removes that row (and only that row): the history becomes the
/// reference's again, and the index stays.
#[tokio::test]
async fn history_row_4_of_an_earlier_version_is_removed() {
    let Some(scratch) = Scratch::new().await else { return };
    let pool = postgres::pool(postgres::parse_config(&scratch.url).unwrap(), 2).unwrap();
    PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap();
    let migrations = scratch.table("migrations");
    let record = |id: i32, name: &str| {
        format!(
            "INSERT INTO \"{migrations}\" (migration_id, name) VALUES ({id}, '{name}') \
             ON CONFLICT (migration_id) DO NOTHING"
        )
    };
    scratch.admin.client.batch_execute(&record(4, "pg_messages_unprocessed_index")).await.unwrap();
    assert!(PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap().is_empty());
    assert_eq!(history(&scratch.admin, &migrations).await, reference_message_history());
    let index = scratch.table("messages_unprocessed_idx");
    assert!(index_definition(&scratch.admin, &index).await.is_some(), "the index stays");
    // A row 4 of another name is someone else's (a later reference release): it stays.
    scratch.admin.client.batch_execute(&record(4, "a_later_migration")).await.unwrap();
    assert!(PgMessageStorage::migrate(&pool, &scratch.prefix).await.unwrap().is_empty());
    let mut expected = reference_message_history();
    expected.push((4, "a_later_migration".to_owned()));
    assert_eq!(history(&scratch.admin, &migrations).await, expected);
    scratch.cleanup().await;
}

/// With `extra_indexes` off, the migrations create the reference's schema: no claim index,
/// the reference's history; the storage still works (its claim reads the shard index). Our
/// entity state table is created all the same: the storage's statements need it.
#[tokio::test]
async fn extra_indexes_off_adds_nothing_to_the_reference_schema() {
    let Some(scratch) = Scratch::new().await else { return };
    let options = SqlStorageOptions {
        extra_indexes: false,
        ..scratch.options(LockMode::Advisory, Duration::from_secs(60))
    };
    let storage = PgMessageStorage::connect(&scratch.url, &options).await.unwrap();
    let index = scratch.table("messages_unprocessed_idx");
    assert_eq!(index_definition(&scratch.admin, &index).await, None);
    let names: Vec<String> = indexes(&scratch.admin, &scratch.table("messages"))
        .await
        .into_iter()
        .map(|index| index.split(':').next().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        names,
        ["T_message_id_key", "T_pkey", "T_request_id_idx", "T_rowid_idx", "T_shard_idx"]
    );
    let migrations = scratch.table("migrations");
    assert_eq!(history(&scratch.admin, &migrations).await, reference_message_history());
    let saved = storage.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    assert_eq!(message_ids(&read(&storage).await.unwrap()), [1]);
    scratch.cleanup().await;
}

/// A prefix with upper-case letters names its own (quoted) tables, as the reference's quoted
/// identifiers do.
#[tokio::test]
async fn mixed_case_prefix_is_quoted() {
    let Some(url) = crate::database_url(URL_VARIABLE) else { return };
    let prefix = TablePrefix::new(&format!("Mixed{}", crate::unique_prefix())).unwrap();
    let options = options(&prefix, LockMode::Advisory, Duration::from_secs(30));
    let storage = PgMessageStorage::connect(&url, &options).await.unwrap();
    let saved = storage.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    let admin = Admin::connect(&url).await;
    let rows = admin
        .client
        .query("SELECT 1 FROM pg_tables WHERE tablename = $1", &[&prefix.table("messages")])
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "the table keeps the prefix's case");
    admin.drop_tables(&prefix).await;
}

// --- Time -------------------------------------------------------------------------------------

/// Storages whose sessions run in the time zone `zone` (e.g. `Etc/GMT+5`, that is UTC-05:00),
/// set per connection; the server's setting is left alone.
struct Zoned {
    config: postgres::PgConfig,
}

impl Zoned {
    fn new(url: &str, zone: &str) -> Zoned {
        let mut config = postgres::parse_config(url).unwrap();
        config.driver_mut().options(format!("-c TimeZone={zone}"));
        Zoned { config }
    }

    fn pool(&self) -> deadpool_postgres::Pool {
        postgres::pool(self.config.clone(), 4).unwrap()
    }

    async fn message_storage(&self, options: &SqlStorageOptions) -> PgMessageStorage {
        PgMessageStorage::new(self.pool(), options).await.unwrap()
    }

    async fn runner_storage(&self, options: &SqlStorageOptions) -> PgRunnerStorage {
        PgRunnerStorage::new(self.pool(), self.config.clone(), options).await.unwrap()
    }
}

fn runner(host: &str) -> Runner {
    Runner::new(RunnerAddress::new(host, 1), vec![ShardGroup::from("default")], RunnerWeight::ONE)
}

/// Claims, heartbeats and leases are judged in UTC whatever the session's `TimeZone`. The
/// columns are `TIMESTAMP` without time zone, so `NOW()` stores the session's local time: the
/// rows of a runner whose sessions are at UTC-05:00 look ten hours old to one at UTC+05:00 (and
/// to itself an hour old when daylight saving time starts), and in the other direction an
/// abandoned lease would not expire for ten hours.
#[tokio::test]
async fn times_do_not_depend_on_the_session_time_zone() {
    let Some(scratch) = Scratch::new().await else { return };
    let (west, east) =
        (Zoned::new(&scratch.url, "Etc/GMT+5"), Zoned::new(&scratch.url, "Etc/GMT-5"));
    for (zoned, zone) in [(&west, "Etc/GMT+5"), (&east, "Etc/GMT-5")] {
        let client = zoned.pool().get().await.unwrap();
        let row = client.query_one("SELECT current_setting('TimeZone')", &[]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), zone);
    }
    let options = scratch.options(LockMode::Lease, Duration::from_secs(60));
    let west_messages = west.message_storage(&options).await;
    let east_messages = east.message_storage(&options).await;
    let saved = west_messages.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    assert_eq!(message_ids(&read(&west_messages).await.unwrap()), [1]);
    assert!(read(&east_messages).await.unwrap().is_empty(), "a fresh claim was taken again");

    let west_runners = west.runner_storage(&options).await;
    let east_runners = east.runner_storage(&options).await;
    let (a, b) = (runner("a"), runner("b"));
    west_runners.register(&a, true).await.unwrap();
    east_runners.register(&b, true).await.unwrap();
    for storage in [&west_runners, &east_runners] {
        let mut runners = storage.get_runners().await.unwrap();
        runners.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(runners, [(a.clone(), true), (b.clone(), true)], "a live heartbeat was hidden");
    }
    assert_eq!(west_runners.acquire(&a.address, &shards(&[1])).await.unwrap(), shards(&[1]));
    let taken = east_runners.acquire(&b.address, &shards(&[1])).await.unwrap();
    assert!(taken.is_empty(), "a live lease was taken over");
    // Unregistering also removes expired runners; a live one stays.
    east_runners.unregister(&b.address).await.unwrap();
    assert_eq!(west_runners.get_runners().await.unwrap(), [(a.clone(), true)]);

    // A lease written at UTC+05:00 and abandoned expires for a runner at UTC-05:00.
    let short = scratch.options(LockMode::Lease, Duration::from_secs(2));
    let abandoned = east.runner_storage(&short).await;
    let taker = west.runner_storage(&short).await;
    assert_eq!(abandoned.acquire(&b.address, &shards(&[2])).await.unwrap(), shards(&[2]));
    eventually_async("the abandoned lease expires", || async {
        taker.acquire(&a.address, &shards(&[2])).await.is_ok_and(|got| !got.is_empty())
    })
    .await;
    scratch.cleanup().await;
}

// --- Advisory locks ---------------------------------------------------------------------------

/// The advisory locks `pid` holds, as `(classid, objid)`.
async fn advisory_locks_of(admin: &Admin, pid: i32) -> Vec<(u32, u32)> {
    let rows = admin
        .client
        .query(
            "SELECT classid, objid FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND pid = $1 \
             ORDER BY classid, objid",
            &[&pid],
        )
        .await
        .unwrap();
    rows.iter().map(|row| (row.get(0), row.get(1))).collect()
}

/// Storages with different prefixes lock the same shard independently, under their own
/// namespaces; the default prefix's namespace is the reference's.
#[tokio::test]
async fn prefixes_have_disjoint_advisory_namespaces() {
    let Some(first) = Scratch::new().await else { return };
    let Some(second) = Scratch::new().await else { return };
    let expiration = Duration::from_secs(30);
    let a = first.runner_storage(LockMode::Advisory, expiration).await;
    let b = second.runner_storage(LockMode::Advisory, expiration).await;
    assert_ne!(a.advisory_namespace(), b.advisory_namespace());
    let address = RunnerAddress::new("a", 1);
    assert_eq!(a.acquire(&address, &shards(&[1, 2])).await.unwrap(), shards(&[1, 2]));
    assert_eq!(b.acquire(&address, &shards(&[1, 2])).await.unwrap(), shards(&[1, 2]));
    // Lock number of shard default:n with one group: 1_000_000 + n.
    let a_pid = a.lock_session_pid().unwrap();
    let b_pid = b.lock_session_pid().unwrap();
    assert_ne!(a_pid, b_pid);
    let a_namespace = a.advisory_namespace().cast_unsigned();
    let b_namespace = b.advisory_namespace().cast_unsigned();
    assert_eq!(
        advisory_locks_of(&first.admin, a_pid).await,
        [(a_namespace, 1_000_001), (a_namespace, 1_000_002)]
    );
    assert_eq!(
        advisory_locks_of(&first.admin, b_pid).await,
        [(b_namespace, 1_000_001), (b_namespace, 1_000_002)]
    );
    // A third storage on the first prefix is excluded by the first.
    let c = first.runner_storage(LockMode::Advisory, expiration).await;
    assert!(
        c.acquire(&RunnerAddress::new("c", 1), &shards(&[1, 2, 3])).await.unwrap() == shards(&[3])
    );
    // The reference's namespace of the default prefix (a permanent wire format).
    let default_prefix = SqlStorageOptions::default();
    let pool = postgres::pool(postgres::parse_config(&first.url).unwrap(), 1).unwrap();
    let default_storage = PgRunnerStorage::without_migrations(
        pool,
        postgres::parse_config(&first.url).unwrap(),
        &default_prefix,
    );
    assert_eq!(default_storage.advisory_namespace(), -1_455_371_005);
    first.cleanup().await;
    second.cleanup().await;
}

/// A runner that acquired shards and then froze loses them when the server ends its idle lock
/// session (`idle_session_timeout` = the lock expiration); another runner then takes them.
#[tokio::test]
async fn frozen_lock_holder_loses_its_locks_after_idle_session_timeout() {
    let Some(scratch) = Scratch::new().await else { return };
    let expiration = Duration::from_secs(2);
    let frozen = scratch.runner_storage(LockMode::Advisory, expiration).await;
    let taker = scratch.runner_storage(LockMode::Advisory, expiration).await;
    let (a, b) = (RunnerAddress::new("a", 1), RunnerAddress::new("b", 1));
    assert_eq!(frozen.acquire(&a, &shards(&[1, 2])).await.unwrap(), shards(&[1, 2]));
    let frozen_pid = frozen.lock_session_pid().unwrap();
    let timeout: String = scratch
        .admin
        .client
        .query_one("SELECT setting FROM pg_settings WHERE name = 'idle_session_timeout'", &[])
        .await
        .map(|row| row.get(0))
        .unwrap();
    assert_eq!(timeout, "0", "the admin session keeps the server default");
    assert!(taker.acquire(&b, &shards(&[1, 2])).await.unwrap().is_empty());
    eventually_async("the frozen session's locks are released", || async {
        taker.acquire(&b, &shards(&[1, 2])).await.is_ok_and(|held| held == shards(&[1, 2]))
    })
    .await;
    let alive = scratch
        .admin
        .client
        .query("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&frozen_pid])
        .await
        .unwrap();
    assert!(alive.is_empty(), "the server ended the frozen session");
    // The frozen runner, when it wakes, learns that it lost them, and cannot take them back.
    assert!(frozen.refresh(&a, &shards(&[1, 2])).await.unwrap().is_empty());
    assert!(frozen.acquire(&a, &shards(&[1, 2])).await.unwrap().is_empty());
    scratch.cleanup().await;
}

/// Ends the server session `pid`, as an operator's `pg_terminate_backend` does.
async fn terminate(admin: &Admin, pid: i32) {
    let terminated: bool =
        admin.client.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await.unwrap().get(0);
    assert!(terminated, "session {pid} was not terminated");
}

/// A terminated lock session: the next lock operation fails within the deadline or reports
/// the loss, never a stale "held"; the storage reconnects by itself and can lock again.
#[tokio::test]
async fn terminated_lock_session_is_rebuilt() {
    let Some(scratch) = Scratch::new().await else { return };
    let expiration = Duration::from_secs(6);
    let storage = scratch.runner_storage(LockMode::Advisory, expiration).await;
    let deadline = scratch.options(LockMode::Advisory, expiration).shard_lock_interval;
    let address = RunnerAddress::new("a", 1);
    assert_eq!(storage.acquire(&address, &shards(&[1, 2])).await.unwrap(), shards(&[1, 2]));
    let first_pid = storage.lock_session_pid().unwrap();
    terminate(&scratch.admin, first_pid).await;
    // Bounded: the lock deadline plus a margin for scheduling.
    let refreshed = tokio::time::timeout(
        deadline + Duration::from_secs(1),
        storage.refresh(&address, &shards(&[1, 2])),
    )
    .await
    .expect("refresh is bounded by the lock deadline");
    match refreshed {
        Ok(held) => assert!(held.is_empty(), "a new session holds nothing: {held:?}"),
        Err(error) => assert!(
            matches!(error.kind(), StorageErrorKind::Unavailable | StorageErrorKind::Timeout),
            "{error}"
        ),
    }
    assert_eq!(storage.acquire(&address, &shards(&[1, 2])).await.unwrap(), shards(&[1, 2]));
    let second_pid = storage.lock_session_pid().unwrap();
    assert_ne!(first_pid, second_pid);
    assert_eq!(advisory_locks_of(&scratch.admin, second_pid).await.len(), 2);
    scratch.cleanup().await;
}

/// A pooled connection killed while a statement runs on it: that operation fails with a
/// storage error, and the pool replaces the connection (later operations succeed).
#[tokio::test]
async fn killed_pool_connection_is_replaced() {
    let Some(scratch) = Scratch::new().await else { return };
    let storage = Arc::new(scratch.message_storage().await);
    let saved = storage.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    // Hold the row so that a claim blocks on it, mid-use of its pooled connection.
    let (mut blocker, blocker_connection) =
        tokio_postgres::connect(&scratch.url, NoTls).await.unwrap();
    let blocker_connection = tokio::spawn(async move {
        let _ended = blocker_connection.await;
    });
    let transaction = blocker.transaction().await.unwrap();
    let lock = format!("SELECT 1 FROM \"{}\" WHERE id = 1 FOR UPDATE", scratch.table("messages"));
    transaction.execute(&lock, &[]).await.unwrap();
    let claim = tokio::spawn({
        let storage = Arc::clone(&storage);
        async move { read(&storage).await }
    });
    let waiting = "SELECT pid FROM pg_stat_activity \
                   WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'";
    let messages_table = scratch.table("messages");
    let victim: i32 = tokio::time::timeout(EVENTUAL, async {
        loop {
            let rows = scratch.admin.client.query(waiting, &[&messages_table]).await.unwrap();
            if let Some(row) = rows.first() {
                break row.get(0);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the claim waits on the row lock");
    let terminate = "SELECT pg_terminate_backend($1)";
    scratch.admin.client.execute(terminate, &[&victim]).await.unwrap();
    let claimed = tokio::time::timeout(EVENTUAL, claim).await.unwrap().unwrap();
    let error = claimed.expect_err("the claim's connection was killed");
    assert_eq!(error.kind(), StorageErrorKind::Unavailable, "{error}");
    transaction.rollback().await.unwrap();
    drop(blocker);
    blocker_connection.abort();
    // Every later operation gets a live connection.
    for _ in 0..20 {
        assert_eq!(message_ids(&read(&storage).await.unwrap()).len(), 1);
        storage.reset_requests(&[Snowflake::new(1)]).await.unwrap();
    }
    scratch.cleanup().await;
}

// --- Malformed rows ---------------------------------------------------------------------------

/// Rows no runner could have written (an unknown kind, an unparsable shard id, a bad last
/// chunk) are reported as malformed for their request, stay claimed, and do not hold up the
/// rows after them.
#[tokio::test]
async fn malformed_rows_are_reported_and_skipped() {
    let Some(scratch) = Scratch::new().await else { return };
    let storage = scratch.message_storage().await;
    for (id, entity) in [(1, "e1"), (2, "e2"), (3, "e3"), (4, "e4")] {
        let saved =
            storage.save_request(&request(id, entity), &SaveRequestOptions::default()).await;
        assert_eq!(saved.unwrap(), SaveResult::Success);
    }
    let messages = format!("\"{}\"", scratch.table("messages"));
    let admin = &scratch.admin.client;
    admin.execute(&format!("UPDATE {messages} SET kind = 7 WHERE id = 2"), &[]).await.unwrap();
    admin
        .execute(&format!("UPDATE {messages} SET shard_id = 'default:x' WHERE id = 3"), &[])
        .await
        .unwrap();
    admin.execute(&format!("UPDATE {messages} SET headers = '[' WHERE id = 4"), &[]).await.unwrap();
    let batch = read(&storage).await.unwrap();
    assert_eq!(message_ids(&batch), [1]);
    let malformed: Vec<(u64, u64)> =
        batch.malformed.iter().map(|row| (row.id.get(), row.request_id.get())).collect();
    assert_eq!(malformed, [(2, 2), (4, 4)], "row 3 is on no readable shard");
    assert!(read(&storage).await.unwrap().is_empty(), "malformed rows stay claimed");
    // Read by id, the row with the unparsable shard is reported too.
    let by_id = storage.unprocessed_messages_by_id(&[Snowflake::new(3)], SystemClock.now()).await;
    let by_id = by_id.unwrap();
    assert_eq!(by_id.malformed.len(), 1);
    assert_eq!(by_id.malformed[0].request_id, Snowflake::new(3));
    // Newer rows are still delivered.
    let saved = storage.save_request(&request(5, "e5"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    assert_eq!(message_ids(&read(&storage).await.unwrap()), [5]);
    scratch.cleanup().await;
}

/// Values that do not fit their columns are invalid input, not a lost connection.
#[tokio::test]
async fn oversized_values_are_invalid_input() {
    let Some(scratch) = Scratch::new().await else { return };
    let storage = scratch.message_storage().await;
    let mut long_tag = request(1, "e1");
    long_tag.tag = "t".repeat(51).into();
    let error = storage.save_request(&long_tag, &SaveRequestOptions::default()).await.unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    let saved = storage.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    let again = storage.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(again.unwrap_err().kind(), StorageErrorKind::Conflict, "a reused request id");
    scratch.cleanup().await;
}

/// Saves retried after a dropped future are correct: a request with a primary key reports
/// itself as the duplicate, and an acknowledgement or interrupt is stored once.
#[tokio::test]
async fn retried_saves_are_idempotent() {
    let Some(scratch) = Scratch::new().await else { return };
    let storage = scratch.message_storage().await;
    let first = request(1, "e1");
    let keyed = SaveRequestOptions {
        primary_key: Some("TestEntity/e1/GetUser/k".to_owned()),
        deliver_at: None,
    };
    assert_eq!(storage.save_request(&first, &keyed).await.unwrap(), SaveResult::Success);
    assert_eq!(
        storage.save_request(&first, &keyed).await.unwrap(),
        SaveResult::Duplicate { original_id: Snowflake::new(1), last_received_reply: None }
    );
    let chunk = cluster_core::Reply::Chunk(
        cluster_core::envelope::Chunk::new(
            Snowflake::new(1),
            Snowflake::new(10),
            0,
            vec![RawJson::null()],
        )
        .unwrap(),
    );
    storage.save_reply(&chunk).await.unwrap();
    let ack = cluster_core::envelope::AckChunk {
        id: Snowflake::new(11),
        address: first.address.clone(),
        request_id: Snowflake::new(1),
        reply_id: Snowflake::new(10),
    };
    storage.save_ack_chunk(&ack).await.unwrap();
    storage.save_ack_chunk(&ack).await.unwrap();
    let interrupt = cluster_core::envelope::Interrupt {
        id: Snowflake::new(12),
        address: first.address.clone(),
        request_id: Snowflake::new(1),
    };
    storage.save_interrupt(&interrupt).await.unwrap();
    storage.save_interrupt(&interrupt).await.unwrap();
    // The retried ack did not mark itself processed: request, ack and interrupt are delivered.
    assert_eq!(message_ids(&read(&storage).await.unwrap()), [1, 11, 12]);
    scratch.cleanup().await;
}

/// A transaction whose handler statement failed is never reported as committed.
#[tokio::test]
async fn failed_transaction_does_not_commit() {
    let Some(scratch) = Scratch::new().await else { return };
    let storage = scratch.message_storage().await;
    let saved = storage.save_request(&request(1, "e1"), &SaveRequestOptions::default()).await;
    assert_eq!(saved.unwrap(), SaveResult::Success);
    let mut transaction = storage.begin_transaction().await.unwrap();
    let reply = cluster_core::Reply::WithExit(cluster_core::envelope::WithExit {
        request_id: Snowflake::new(1),
        id: Snowflake::new(10),
        exit: cluster_core::Exit::void(),
    });
    transaction.save_reply(&reply).await.unwrap();
    let client = transaction.backend_as::<deadpool_postgres::Object>().unwrap();
    assert!(client.batch_execute("SELECT 1/0").await.is_err());
    assert!(transaction.commit().await.is_err());
    assert!(storage.replies_for(&[Snowflake::new(1)]).await.unwrap().is_empty());
    scratch.cleanup().await;
}

/// Fencing confirms a shard's lock before each final reply. `confirm` reports the locks still
/// held, as `refresh` does, without writing the runner's heartbeat: that is one registry row,
/// and one write of it per reply made the row the cluster's bottleneck.
#[tokio::test]
async fn confirm_reports_the_held_locks_without_a_heartbeat() {
    let Some(scratch) = Scratch::new().await else { return };
    let runners_table = scratch.table("runners");
    for (mode, host) in
        [(LockMode::Advisory, "confirm-advisory"), (LockMode::Lease, "confirm-lease")]
    {
        let runners = scratch.runner_storage(mode, Duration::from_secs(60)).await;
        let owner = runner(host);
        runners.register(&owner, true).await.unwrap();
        assert_eq!(
            runners.acquire(&owner.address, &shards(&[1, 2])).await.unwrap(),
            shards(&[1, 2])
        );
        let sql =
            format!("SELECT last_heartbeat::text FROM \"{runners_table}\" WHERE address = $1");
        let address = owner.address.to_string();
        let heartbeat = || async {
            let row = scratch.admin.client.query_one(sql.as_str(), &[&address]).await.unwrap();
            row.get::<_, String>(0)
        };
        let before = heartbeat().await;
        let confirmed = runners.confirm(&owner.address, &shards(&[1, 2, 3])).await.unwrap();
        assert_eq!(confirmed, shards(&[1, 2]), "{mode:?}");
        assert_eq!(heartbeat().await, before, "{mode:?}: confirm wrote the heartbeat");
        let refreshed = runners.refresh(&owner.address, &shards(&[1, 2, 3])).await.unwrap();
        assert_eq!(refreshed, shards(&[1, 2]), "{mode:?}");
        assert_ne!(heartbeat().await, before, "{mode:?}: refresh keeps the heartbeat");
        runners.release_all(&owner.address).await.unwrap();
    }
    scratch.cleanup().await;
}

/// In advisory mode `confirm` answers from the locks the session was seen to hold, after a sign
/// of life of the session: a released lock, or every lock of an ended session, is never
/// confirmed, and a lock the session lost is not confirmed on its new session either.
#[tokio::test]
async fn confirm_never_reports_a_lock_the_session_let_go_or_lost() {
    let Some(scratch) = Scratch::new().await else { return };
    let expiration = Duration::from_secs(6);
    let storage = scratch.runner_storage(LockMode::Advisory, expiration).await;
    let other = scratch.runner_storage(LockMode::Advisory, expiration).await;
    let (address, other_address) = (RunnerAddress::new("a", 1), RunnerAddress::new("b", 1));
    assert_eq!(storage.acquire(&address, &shards(&[1, 2, 3])).await.unwrap(), shards(&[1, 2, 3]));
    assert_eq!(other.acquire(&other_address, &shards(&[4])).await.unwrap(), shards(&[4]));
    let confirmed = storage.confirm(&address, &shards(&[1, 2, 3, 4])).await.unwrap();
    assert_eq!(confirmed, shards(&[1, 2, 3]), "another session's lock is not confirmed");
    storage.release(&address, &shard(2)).await.unwrap();
    assert_eq!(storage.confirm(&address, &shards(&[1, 2, 3])).await.unwrap(), shards(&[1, 3]));
    storage.release_all(&address).await.unwrap();
    assert!(storage.confirm(&address, &shards(&[1, 3])).await.unwrap().is_empty());
    assert_eq!(storage.acquire(&address, &shards(&[1])).await.unwrap(), shards(&[1]));
    let pid = storage.lock_session_pid().unwrap();
    terminate(&scratch.admin, pid).await;
    // The ended session's locks are free: another runner takes one of them.
    eventually_async("the ended session's lock is free", || async {
        other.acquire(&other_address, &shards(&[1])).await.is_ok_and(|held| held == shards(&[1]))
    })
    .await;
    match storage.confirm(&address, &shards(&[1])).await {
        Ok(held) => assert!(held.is_empty(), "a lost lock was confirmed: {held:?}"),
        Err(error) => assert!(
            matches!(error.kind(), StorageErrorKind::Unavailable | StorageErrorKind::Timeout),
            "{error}"
        ),
    }
    assert!(
        storage.confirm(&address, &shards(&[1])).await.unwrap().is_empty(),
        "a new session confirms nothing it did not lock"
    );
    other.release_all(&other_address).await.unwrap();
    scratch.cleanup().await;
}

/// The owner's ordered reads run on a session of their own (planned once there, see
/// `GenericPlans`): terminating it fails at most the read under way, and the next read takes a
/// new session and answers as before.
#[tokio::test]
async fn a_terminated_ordered_read_session_is_replaced() {
    let Some(scratch) = Scratch::new().await else { return };
    let storage = scratch.message_storage().await;
    for id in 1..=3 {
        let saved = storage.save_request(&request(id, "e1"), &SaveRequestOptions::default()).await;
        assert_eq!(saved.unwrap(), SaveResult::Success);
    }
    let now = cluster_core::clock::Timestamp::from_unix_millis(i64::MAX / 2);
    let limit = std::num::NonZeroU32::new(16).unwrap();
    let ids = [Snowflake::new(3)];
    let expected = vec![Snowflake::new(1), Snowflake::new(2)];
    let read = storage.unprocessed_messages_ordered(&ids, now, limit).await.unwrap();
    assert_eq!(read.earlier.get(&Snowflake::new(3)), Some(&expected));
    let sessions = "SELECT pid FROM pg_stat_activity WHERE query LIKE '%array_agg%' \
                    AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()";
    let messages_table = scratch.table("messages");
    let pids = |rows: Vec<tokio_postgres::Row>| rows.iter().map(|row| row.get(0)).collect();
    let first: Vec<i32> =
        pids(scratch.admin.client.query(sessions, &[&messages_table]).await.unwrap());
    assert_eq!(first.len(), 1, "one session runs the ordered reads: {first:?}");
    terminate(&scratch.admin, first[0]).await;
    match storage.unprocessed_messages_ordered(&ids, now, limit).await {
        Ok(read) => assert_eq!(read.earlier.get(&Snowflake::new(3)), Some(&expected)),
        Err(error) => assert_eq!(error.kind(), StorageErrorKind::Unavailable, "{error}"),
    }
    let read = storage.unprocessed_messages_ordered(&ids, now, limit).await.unwrap();
    assert_eq!(read.earlier.get(&Snowflake::new(3)), Some(&expected));
    let second: Vec<i32> =
        pids(scratch.admin.client.query(sessions, &[&messages_table]).await.unwrap());
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(first, second, "a new session");
    scratch.cleanup().await;
}

/// A storage that cannot open names the server it tried, the cause (the OS error, or the
/// server's own message) and what to check, so that a new user need not guess.
#[tokio::test]
async fn a_failed_connect_names_the_server_the_cause_and_the_fix() {
    let options =
        SqlStorageOptions::from_config(&ShardingConfig::default(), crate::unique_prefix());
    let port = crate::closed_port();
    let down = format!("postgres://postgres@127.0.0.1:{port}/test");
    let Err(error) = PgMessageStorage::connect(&down, &options).await else {
        panic!("connected to a closed port");
    };
    let shown = error.to_string();
    assert_eq!(error.kind(), StorageErrorKind::Unavailable, "{shown}");
    assert!(shown.contains(&format!("127.0.0.1:{port}")), "the host and port: {shown}");
    assert!(shown.contains("os error"), "the OS error: {shown}");
    assert!(shown.contains("check that PostgreSQL"), "what to do: {shown}");

    let Some(url) = crate::database_url(URL_VARIABLE) else { return };
    let config = postgres::parse_config(&url).unwrap();
    let wrong = wrong_database(config.driver(), "cluster_no_such_database");
    let Err(error) = PgRunnerStorage::connect(&wrong, &options).await else {
        panic!("connected to a database that does not exist");
    };
    let shown = error.to_string();
    assert!(
        shown.contains("database \"cluster_no_such_database\" does not exist"),
        "the server's message: {shown}"
    );
    assert!(shown.contains("create the database"), "what to do: {shown}");
}

/// `config`'s connection string with the database `name`.
fn wrong_database(config: &tokio_postgres::Config, name: &str) -> String {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("postgres");
    let mut text = format!("host={host} port={port} user={user} dbname={name}");
    if let Some(password) = config.get_password() {
        text.push_str(&format!(" password={}", String::from_utf8_lossy(password)));
    }
    text
}
