//! Typed transaction guards in entity handlers on SQLite, PostgreSQL and MySQL: a
//! `WITH_TRANSACTION` handler writes a row of an application table with its backend's guard
//! (`PgTransactionGuard`, `MySqlTransactionGuard`, `SqliteTransactionGuard`), and the row
//! commits with the handler's reply, or rolls back when the handler fails. A handler outside a
//! transaction, or asking for another backend's guard, gets a typed error.

use std::any::type_name;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_core::storage::MessageStorage;
use cluster_core::transaction::TransactionError;
use cluster_sharding::{
    CallError, Entity, EntityContext, Handler, Protocol, RequestContext, Rpc, Sharding,
};
use cluster_storage_sql::mysql::MySqlTransactionGuard;
use cluster_storage_sql::postgres::PgTransactionGuard;
use cluster_storage_sql::sqlite::{SqliteTransactionGuard, SqliteTransactionHandle};
use cluster_testkit::databases::TestDatabase;
use mysql_async::prelude::Queryable;
use serde::{Deserialize, Serialize};

/// An entity whose handlers work in their request's storage transaction.
struct Till;

impl Entity for Till {
    const TYPE: &'static str = "Till";

    async fn create(_: &EntityContext) -> Till {
        Till
    }

    fn protocol(protocol: &mut Protocol<Till>) {
        protocol.handle::<Write>().handle::<Outside>().handle::<Elsewhere>();
    }
}

/// Writes row `key` into `table` on database `kind` through the request's transaction, then
/// fails when `fail` is set.
#[derive(Serialize, Deserialize)]
struct Write {
    kind: String,
    table: String,
    key: String,
    fail: bool,
    /// Bytes of padding the reply gets after the key.
    #[serde(default)]
    pad: usize,
}

impl Rpc for Write {
    const TAG: &'static str = "Write";
    const PERSISTED: bool = true;
    const WITH_TRANSACTION: bool = true;
    type Success = String;
    type Error = String;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl Handler<Write> for Till {
    async fn handle(&mut self, context: &RequestContext, write: Write) -> Result<String, String> {
        match write.kind.as_str() {
            "sqlite" => {
                let transaction =
                    SqliteTransactionGuard::of(context).await.map_err(|error| error.to_string())?;
                let sql = format!("INSERT INTO {} (k) VALUES (?1)", write.table);
                let key = write.key.clone();
                transaction
                    .run(move |connection| connection.execute(&sql, [key]))
                    .await
                    .map_err(|error| error.to_string())?;
            }
            "postgres" => {
                let client =
                    PgTransactionGuard::of(context).await.map_err(|error| error.to_string())?;
                let sql = format!("INSERT INTO {} (k) VALUES ($1)", write.table);
                client.execute(&sql, &[&write.key]).await.map_err(|error| error.to_string())?;
            }
            _ => {
                let mut transaction =
                    MySqlTransactionGuard::of(context).await.map_err(|error| error.to_string())?;
                let sql = format!("INSERT INTO {} (k) VALUES (?)", write.table);
                transaction
                    .exec_drop(sql, (write.key.as_str(),))
                    .await
                    .map_err(|error| error.to_string())?;
            }
        }
        if write.fail {
            return Err("failed after writing".to_owned());
        }
        Ok(format!("{}{}", write.key, "x".repeat(write.pad)))
    }
}

/// A persisted request outside a transaction: answers what its own backend's guard gives.
#[derive(Serialize, Deserialize)]
struct Outside {
    kind: String,
}

impl Rpc for Outside {
    const TAG: &'static str = "Outside";
    const PERSISTED: bool = true;
    type Success = Option<String>;
    type Error = String;
}

impl Handler<Outside> for Till {
    async fn handle(&mut self, context: &RequestContext, request: Outside) -> GuardError {
        let error = match request.kind.as_str() {
            "sqlite" => SqliteTransactionGuard::of(context).await.err(),
            "postgres" => PgTransactionGuard::of(context).await.err(),
            _ => MySqlTransactionGuard::of(context).await.err(),
        };
        Ok(error.map(|error| format!("{error:?}")))
    }
}

/// A `WITH_TRANSACTION` request on database `kind` that asks for another backend's guard.
#[derive(Serialize, Deserialize)]
struct Elsewhere {
    kind: String,
}

impl Rpc for Elsewhere {
    const TAG: &'static str = "Elsewhere";
    const PERSISTED: bool = true;
    const WITH_TRANSACTION: bool = true;
    type Success = Option<String>;
    type Error = String;
}

impl Handler<Elsewhere> for Till {
    async fn handle(&mut self, context: &RequestContext, request: Elsewhere) -> GuardError {
        let error = match request.kind.as_str() {
            "sqlite" => PgTransactionGuard::of(context).await.err(),
            _ => SqliteTransactionGuard::of(context).await.err(),
        };
        Ok(error.map(|error| format!("{error:?}")))
    }
}

/// What the probing handlers answer: the `Debug` form of the guard's error, if any.
type GuardError = Result<Option<String>, String>;

/// The handle type of the guard [`Elsewhere`] asks for on database `kind`.
fn elsewhere_handle(kind: &str) -> &'static str {
    match kind {
        "sqlite" => type_name::<deadpool_postgres::Object>(),
        _ => type_name::<SqliteTransactionHandle>(),
    }
}

/// A runner on the database, with its message storage, the application table (quoted) and the
/// database to drop last.
struct Fixture {
    sharding: Sharding,
    storage: Arc<dyn MessageStorage>,
    table: String,
    database: TestDatabase,
}

impl Fixture {
    async fn new(database: TestDatabase) -> Fixture {
        let config = ShardingConfig {
            entity_message_poll_interval: Duration::from_millis(100),
            entity_reply_poll_interval: Duration::from_millis(50),
            ..ShardingConfig::default()
        };
        let storage = database.open(&config).await.unwrap().0;
        let table = match &database {
            TestDatabase::Sqlite { .. } => "\"till_rows\"".to_owned(),
            TestDatabase::Postgres { prefix, .. } => format!("\"{}\"", prefix.table("till")),
            TestDatabase::Mysql { prefix, .. } => format!("`{}`", prefix.table("till")),
        };
        let create = format!("CREATE TABLE {table} (k VARCHAR(100) NOT NULL)");
        count(&*storage, database.kind(), &create).await;
        let sharding = Sharding::standalone(config, Arc::clone(&storage)).start().await.unwrap();
        sharding.entity::<Till>().register().unwrap();
        Fixture { sharding, storage, table, database }
    }

    fn kind(&self) -> &'static str {
        self.database.kind()
    }

    fn write(&self, key: &str, fail: bool) -> Write {
        let kind = self.kind().to_owned();
        Write { kind, table: self.table.clone(), key: key.to_owned(), fail, pad: 0 }
    }

    /// The committed rows of key `key`.
    async fn rows(&self, key: &str) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {} WHERE k = '{key}'", self.table);
        count(&*self.storage, self.kind(), &sql).await
    }

    async fn finish(self) {
        self.sharding.shutdown().await;
        if !matches!(self.database, TestDatabase::Sqlite { .. }) {
            count(&*self.storage, self.kind(), &format!("DROP TABLE {}", self.table)).await;
        }
    }
}

/// Runs `sql` in a transaction of its own on `storage` (a database of `kind`) and commits;
/// returns the first column of its first row, or 0 when it has none.
async fn count(storage: &dyn MessageStorage, kind: &str, sql: &str) -> i64 {
    let mut transaction = storage.begin_transaction().await.unwrap();
    let value = match kind {
        "sqlite" => {
            let handle = transaction.backend_as::<SqliteTransactionHandle>().unwrap();
            let sql = sql.to_owned();
            handle
                .run(move |connection| {
                    let mut statement = connection.prepare(&sql)?;
                    let mut rows = statement.query([])?;
                    match rows.next()? {
                        Some(row) => row.get(0),
                        None => Ok(0),
                    }
                })
                .await
                .unwrap()
        }
        "postgres" => {
            let client = transaction.backend_as::<deadpool_postgres::Object>().unwrap();
            let rows = client.query(sql, &[]).await.unwrap();
            rows.first().map_or(0, |row| row.get(0))
        }
        _ => {
            let handle = transaction.backend_as::<mysql_async::Transaction<'static>>().unwrap();
            handle.query_first::<i64, _>(sql).await.unwrap().unwrap_or_default()
        }
    };
    transaction.commit().await.unwrap();
    value
}

/// The handler's write commits with its reply; a second send of the same key is answered from
/// the stored reply without running again.
async fn a_handlers_write_commits_with_its_reply(fixture: Fixture) {
    let till = fixture.sharding.client::<Till>("commit");
    assert_eq!(till.send(fixture.write("kept", false)).await.unwrap(), "kept");
    assert_eq!(till.send(fixture.write("kept", false)).await.unwrap(), "kept");
    assert_eq!(fixture.rows("kept").await, 1, "the write committed once, with the reply");
    fixture.finish().await;
}

/// A handler that fails after writing: its write rolls back, its failure is the reply.
async fn a_failed_handlers_write_rolls_back(fixture: Fixture) {
    let till = fixture.sharding.client::<Till>("rollback");
    let failed = till.send(fixture.write("dropped", true)).await;
    assert!(
        matches!(&failed, Err(CallError::Failed(reason)) if reason == "failed after writing"),
        "{failed:?}"
    );
    assert_eq!(fixture.rows("dropped").await, 0, "the failed handler's write rolled back");
    fixture.finish().await;
}

/// A reply over the storage's limit is never committed: the handler's write rolls back and the
/// request is answered with a `ReplyNotStored` defect, once. Before the fix the refused commit
/// released the request, which ran again without end.
async fn a_reply_over_the_storage_limit_rolls_back_and_is_a_defect(fixture: Fixture) {
    // MySQL's TEXT column; the other backends take far larger values.
    if fixture.kind() != "mysql" {
        return fixture.finish().await;
    }
    let till = fixture.sharding.client::<Till>("oversized");
    let write = || Write { pad: 70_000, ..fixture.write("big", false) };
    let answer = tokio::time::timeout(Duration::from_secs(30), till.send(write())).await;
    let defect = |answer: &Result<String, CallError<String>>| matches!(answer, Err(CallError::Defect(defect)) if defect.contains("ReplyNotStored"));
    assert!(matches!(&answer, Ok(answer) if defect(answer)), "{answer:?}");
    assert_eq!(fixture.rows("big").await, 0, "the write of the unstored reply rolled back");
    let again = till.send(write()).await;
    assert!(defect(&again), "{again:?}");
    assert_eq!(fixture.rows("big").await, 0, "it did not run again");
    fixture.finish().await;
}

/// A request that is not `WITH_TRANSACTION` gets `Missing`; a `WITH_TRANSACTION` request asking
/// for another backend's guard gets `WrongBackend`, naming the handle it asked for.
async fn guards_report_a_missing_transaction_and_another_backend(fixture: Fixture) {
    let till = fixture.sharding.client::<Till>("errors");
    let kind = fixture.kind().to_owned();
    let missing = till.send(Outside { kind: kind.clone() }).await.unwrap();
    assert_eq!(missing, Some(format!("{:?}", TransactionError::Missing)));
    let wrong = till.send(Elsewhere { kind: kind.clone() }).await.unwrap();
    let expected = TransactionError::WrongBackend { expected: elsewhere_handle(&kind) };
    assert_eq!(wrong, Some(format!("{expected:?}")));
    fixture.finish().await;
}

macro_rules! on_databases {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let database = TestDatabase::sqlite(concat!("till-", stringify!($case)));
                    super::$case(super::Fixture::new(database).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(database) = TestDatabase::postgres() else { return };
                    super::$case(super::Fixture::new(database).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(database) = TestDatabase::mysql() else { return };
                    super::$case(super::Fixture::new(database).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
    };
}

on_databases!(
    a_handlers_write_commits_with_its_reply,
    a_failed_handlers_write_rolls_back,
    a_reply_over_the_storage_limit_rolls_back_and_is_a_defect,
    guards_report_a_missing_transaction_and_another_backend,
);
