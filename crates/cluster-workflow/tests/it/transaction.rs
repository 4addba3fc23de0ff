//! Transactional activities (`ActivityCall::with_transaction`, the reference's
//! `ClusterSchema.WithTransaction` on an activity) on SQLite on disk, PostgreSQL and MySQL: the
//! body writes a row of an application table through the storage transaction its result is
//! saved in (with the typed guard of the database), and the row exists exactly when the
//! activity's success was saved.

use std::any::type_name;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cluster_core::ids::RunnerAddress;
use cluster_core::transaction::TransactionError;
use cluster_sharding::Sharding;
use cluster_storage_sql::mysql::MySqlTransactionGuard;
use cluster_storage_sql::postgres::PgTransactionGuard;
use cluster_storage_sql::sqlite::{SqliteTransactionGuard, SqliteTransactionHandle};
use cluster_testkit::databases::TestDatabase;
use cluster_testkit::faulty::{Faults, FaultyMessageStorage};
use cluster_testkit::wait::eventually;
use cluster_workflow::{ActivityContext, DurableDeferred, ExecuteError, Workflow, WorkflowEngine};
use serde::{Deserialize, Serialize};

/// What the test workflow's activity does after writing its row.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Order {
    key: String,
    /// `ok`: succeed; `fail`: fail with its own error; `hang`: never finish on the first run;
    /// `interrupt`: end the first run with an interrupt (retried by the interrupt retry
    /// policy); `wait`: succeed, then the workflow waits for the deferred `Go`.
    mode: String,
}

/// Writes a row in its activity's transaction.
struct Transactional;

impl Workflow for Transactional {
    const NAME: &'static str = "Transactional";
    type Payload = Order;
    type Success = u32;
    type Error = String;

    fn idempotency_key(order: &Order) -> String {
        order.key.clone()
    }
}

/// Reports what its activities get when they lock their transaction: an activity outside a
/// transaction, then a transactional one asking for another backend's guard.
struct Probe;

impl Workflow for Probe {
    const NAME: &'static str = "Probe";
    type Payload = Order;
    type Success = Vec<Option<String>>;
    type Error = String;

    fn idempotency_key(order: &Order) -> String {
        order.key.clone()
    }
}

/// The test's database, its application table and the activity's run count.
struct Fixture {
    database: TestDatabase,
    table: String,
    runs: Arc<AtomicU32>,
}

impl Fixture {
    async fn new(database: TestDatabase) -> Fixture {
        let table = match &database {
            TestDatabase::Sqlite { .. } => "app_rows".to_owned(),
            TestDatabase::Postgres { prefix, .. } | TestDatabase::Mysql { prefix, .. } => {
                prefix.table("app_rows")
            }
        };
        let fixture = Fixture { database, table, runs: Arc::default() };
        fixture
            .statement(&format!("CREATE TABLE {} (k VARCHAR(100) NOT NULL)", fixture.quoted()))
            .await;
        fixture
    }

    fn quoted(&self) -> String {
        match &self.database {
            TestDatabase::Mysql { .. } => format!("`{}`", self.table),
            _ => format!("\"{}\"", self.table),
        }
    }

    /// Runs `sql` on a connection of its own.
    async fn statement(&self, sql: &str) {
        match &self.database {
            TestDatabase::Sqlite { path } => {
                let connection = rusqlite::Connection::open(path).unwrap();
                connection.busy_timeout(Duration::from_secs(10)).unwrap();
                connection.execute_batch(sql).unwrap();
            }
            TestDatabase::Postgres { url, .. } => {
                let (client, connection) =
                    tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
                let connection = tokio::spawn(connection);
                client.batch_execute(sql).await.unwrap();
                drop(client);
                let _ = connection.await;
            }
            TestDatabase::Mysql { url, .. } => {
                use mysql_async::prelude::Queryable;
                let pool = mysql_async::Pool::from_url(url.as_str()).unwrap();
                let mut connection = pool.get_conn().await.unwrap();
                connection.query_drop(sql).await.unwrap();
                drop(connection);
                pool.disconnect().await.unwrap();
            }
        }
    }

    /// The committed rows of key `key`.
    async fn rows(&self, key: &str) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {} WHERE k = '{key}'", self.quoted());
        match &self.database {
            TestDatabase::Sqlite { path } => {
                let connection = rusqlite::Connection::open(path).unwrap();
                connection.busy_timeout(Duration::from_secs(10)).unwrap();
                connection.query_row(&sql, [], |row| row.get(0)).unwrap()
            }
            TestDatabase::Postgres { url, .. } => {
                let (client, connection) =
                    tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
                let connection = tokio::spawn(connection);
                let count: i64 = client.query_one(&sql, &[]).await.unwrap().get(0);
                drop(client);
                let _ = connection.await;
                count
            }
            TestDatabase::Mysql { url, .. } => {
                use mysql_async::prelude::Queryable;
                let pool = mysql_async::Pool::from_url(url.as_str()).unwrap();
                let mut connection = pool.get_conn().await.unwrap();
                let count: Option<i64> = connection.query_first(sql).await.unwrap();
                drop(connection);
                pool.disconnect().await.unwrap();
                count.unwrap_or_default()
            }
        }
    }

    fn runs(&self) -> u32 {
        self.runs.load(Ordering::SeqCst)
    }

    /// A runner holding every shard, its storage failing on demand, with the workflow
    /// registered.
    async fn runner(&self) -> (Sharding, WorkflowEngine, Arc<Faults>) {
        let config = cluster_core::ShardingConfig {
            runner_address: Some(RunnerAddress::new("127.0.0.1", 1)),
            ..crate::cluster::config()
        };
        let (messages, locks) = self.database.open(&config).await.unwrap();
        let (faulty, faults) = FaultyMessageStorage::new(messages);
        let sharding =
            Sharding::single_runner(config, Arc::new(faulty), locks).start().await.unwrap();
        let engine = WorkflowEngine::cluster(&sharding).unwrap();
        let (table, runs, kind) = (self.quoted(), Arc::clone(&self.runs), self.database.kind());
        Transactional::register(&engine, move |ctx, order| {
            let (table, runs) = (table.clone(), Arc::clone(&runs));
            async move {
                let value = ctx
                    .activity("write", async |activity| {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        insert(&activity, kind, &table, &order.key).await?;
                        match order.mode.as_str() {
                            "fail" => Err("refused".to_owned()),
                            "hang" if run == 1 => std::future::pending().await,
                            "interrupt" if run == 1 => activity.interrupt().await,
                            _ => Ok(run),
                        }
                    })
                    .with_transaction()
                    .await?;
                if order.mode == "wait" {
                    ctx.await_deferred(&DurableDeferred::<(), String>::new("Go").unwrap()).await?;
                }
                Ok(value)
            }
        })
        .unwrap();
        Probe::register(&engine, move |ctx, _| async move {
            let outside = ctx.activity("outside", async |activity| {
                Ok::<_, String>(guard_error(&activity, kind).await)
            });
            let inside = ctx.activity("inside", async |activity| {
                Ok::<_, String>(wrong_guard_error(&activity, kind).await)
            });
            Ok(vec![outside.await?, inside.with_transaction().await?])
        })
        .unwrap();
        (sharding, engine, faults)
    }

    /// Drops the application table (the database's own tables go with the fixture).
    async fn finish(self) {
        if !matches!(self.database, TestDatabase::Sqlite { .. }) {
            self.statement(&format!("DROP TABLE {}", self.quoted())).await;
        }
    }
}

/// Inserts row `key` through the activity's transaction, with the typed guard of the
/// database `kind` the test runs on.
async fn insert(
    activity: &ActivityContext,
    kind: &str,
    table: &str,
    key: &str,
) -> Result<(), String> {
    match kind {
        "sqlite" => {
            let transaction =
                SqliteTransactionGuard::of(activity).await.map_err(|error| error.to_string())?;
            let (sql, key) = (format!("INSERT INTO {table} (k) VALUES (?1)"), key.to_owned());
            transaction
                .run(move |connection| connection.execute(&sql, [key]).map(|_| ()))
                .await
                .map_err(|error| error.to_string())
        }
        "postgres" => {
            let client =
                PgTransactionGuard::of(activity).await.map_err(|error| error.to_string())?;
            let sql = format!("INSERT INTO {table} (k) VALUES ($1)");
            client.execute(&sql, &[&key]).await.map(|_| ()).map_err(|error| error.to_string())
        }
        _ => {
            use mysql_async::prelude::Queryable;
            let mut transaction =
                MySqlTransactionGuard::of(activity).await.map_err(|error| error.to_string())?;
            let sql = format!("INSERT INTO {table} (k) VALUES (?)");
            transaction.exec_drop(sql, (key,)).await.map_err(|error| error.to_string())
        }
    }
}

/// The error of locking the activity's transaction with the guard of its own database `kind`
/// (`None`: the guard was given).
async fn guard_error(activity: &ActivityContext, kind: &str) -> Option<String> {
    let error = match kind {
        "sqlite" => SqliteTransactionGuard::of(activity).await.err(),
        "postgres" => PgTransactionGuard::of(activity).await.err(),
        _ => MySqlTransactionGuard::of(activity).await.err(),
    };
    error.map(|error| format!("{error:?}"))
}

/// The error of locking the activity's transaction with the guard of another database than
/// its own, `kind`.
async fn wrong_guard_error(activity: &ActivityContext, kind: &str) -> Option<String> {
    let error = match kind {
        "sqlite" => PgTransactionGuard::of(activity).await.err(),
        _ => SqliteTransactionGuard::of(activity).await.err(),
    };
    error.map(|error| format!("{error:?}"))
}

/// The handle type of the guard [`wrong_guard_error`] asks for on database `kind`.
fn wrong_handle(kind: &str) -> &'static str {
    match kind {
        "sqlite" => type_name::<deadpool_postgres::Object>(),
        _ => type_name::<SqliteTransactionHandle>(),
    }
}

fn order(key: &str, mode: &str) -> Order {
    Order { key: key.to_owned(), mode: mode.to_owned() }
}

async fn stop(sharding: Sharding, engine: WorkflowEngine) {
    engine.shutdown().await;
    sharding.shutdown().await;
}

/// A success commits the row with the stored result; executing again and a replay read the
/// result without running the body again.
async fn commits_the_writes_with_the_result(fixture: Fixture) {
    let (sharding, engine, faults) = fixture.runner().await;
    let id = Transactional::execution_id(&order("ok", "wait"));
    engine.execute_discard::<Transactional>(order("ok", "wait")).await.unwrap();
    eventually("the activity ran", || fixture.runs() == 1).await;
    // Suspended on the deferred once the activity's result (and its row) committed.
    crate::suite::suspended::<Transactional>(&engine, &id).await;
    assert_eq!(fixture.rows("ok").await, 1, "the row committed with the activity's result");
    assert!(faults.commits() >= 1, "the result was saved in a transaction");
    let token = DurableDeferred::<(), String>::new("Go").unwrap().token_for::<Transactional>(&id);
    engine.complete(&token, Ok::<(), String>(())).await.unwrap();
    // The replay reads the stored result: the body does not run again.
    assert_eq!(engine.execute::<Transactional>(order("ok", "wait")).await.unwrap(), 1);
    assert_eq!(fixture.runs(), 1);
    assert_eq!(fixture.rows("ok").await, 1);
    stop(sharding, engine).await;
    fixture.finish().await;
}

/// The commit of the result fails: the row rolls back with it, and the activity runs again
/// (the result was not saved), so the row is written once in the end.
async fn a_failed_commit_rolls_the_writes_back(fixture: Fixture) {
    let (sharding, engine, faults) = fixture.runner().await;
    faults.fail_commit(1);
    assert_eq!(engine.execute::<Transactional>(order("commit", "ok")).await.unwrap(), 2);
    assert_eq!(fixture.runs(), 2, "the activity ran again after its commit failed");
    assert_eq!(fixture.rows("commit").await, 1, "the first run's row was rolled back");
    stop(sharding, engine).await;
    fixture.finish().await;
}

/// The activity fails on its own: its row rolls back, its failure is stored (a second execute
/// returns it without running the body).
async fn a_failure_rolls_the_writes_back(fixture: Fixture) {
    let (sharding, engine, _) = fixture.runner().await;
    let failed = engine.execute::<Transactional>(order("fail", "fail")).await;
    assert!(
        matches!(&failed, Err(ExecuteError::Failed(error)) if error == "refused"),
        "{failed:?}"
    );
    assert_eq!(fixture.rows("fail").await, 0, "a failed activity's writes roll back");
    let again = engine.execute::<Transactional>(order("fail", "fail")).await;
    assert!(matches!(&again, Err(ExecuteError::Failed(error)) if error == "refused"), "{again:?}");
    assert_eq!(fixture.runs(), 1, "the stored failure is not run again");
    stop(sharding, engine).await;
    fixture.finish().await;
}

/// The runner stops while the activity runs (its shards go): the row, written but not
/// committed, rolls back; the next runner runs the activity again and the workflow completes
/// with its result.
async fn a_cut_off_activity_leaves_no_writes_and_runs_again(fixture: Fixture) {
    let (sharding, engine, _) = fixture.runner().await;
    engine.execute_discard::<Transactional>(order("cut", "hang")).await.unwrap();
    eventually("the activity ran", || fixture.runs() == 1).await;
    stop(sharding, engine).await;
    assert_eq!(fixture.rows("cut").await, 0, "the cut-off run's row was rolled back");
    let (sharding, engine, _) = fixture.runner().await;
    assert_eq!(engine.execute::<Transactional>(order("cut", "hang")).await.unwrap(), 2);
    assert_eq!(fixture.rows("cut").await, 1);
    stop(sharding, engine).await;
    fixture.finish().await;
}

/// A body cut off by an interrupt runs again under the interrupt retry policy in a clean
/// transaction: the writes of the interrupted run are rolled back, so the row is written once.
async fn an_interrupted_run_leaves_no_writes_for_its_retry(fixture: Fixture) {
    let (sharding, engine, _) = fixture.runner().await;
    assert_eq!(engine.execute::<Transactional>(order("retried", "interrupt")).await.unwrap(), 2);
    assert_eq!(fixture.runs(), 2, "the interrupted run ran again");
    assert_eq!(fixture.rows("retried").await, 1, "the interrupted run's row was rolled back");
    stop(sharding, engine).await;
    fixture.finish().await;
}

/// An activity outside a transaction gets [`TransactionError::Missing`] from its backend's
/// guard; a transactional activity asking for another backend's guard gets
/// [`TransactionError::WrongBackend`], and its own guard works.
async fn guards_report_a_missing_transaction_and_another_backend(fixture: Fixture) {
    let (sharding, engine, _) = fixture.runner().await;
    let kind = fixture.database.kind();
    let errors = engine.execute::<Probe>(order("probe", "ok")).await.unwrap();
    let wrong = TransactionError::WrongBackend { expected: wrong_handle(kind) };
    assert_eq!(
        errors,
        [Some(format!("{:?}", TransactionError::Missing)), Some(format!("{wrong:?}"))]
    );
    // The backend's own guard in a transactional activity: the row commits with the result.
    assert_eq!(engine.execute::<Transactional>(order("own", "ok")).await.unwrap(), 1);
    assert_eq!(fixture.rows("own").await, 1);
    stop(sharding, engine).await;
    fixture.finish().await;
}

/// The in-memory engine has no storage: even a transactional activity has no transaction.
#[tokio::test]
async fn the_memory_engine_has_no_transaction() {
    let engine = WorkflowEngine::memory();
    Probe::register(&engine, |ctx, _| async move {
        let inside = ctx
            .activity("inside", async |activity| {
                Ok::<_, String>(guard_error(&activity, "postgres").await)
            })
            .with_transaction()
            .await?;
        Ok(vec![inside])
    })
    .unwrap();
    let errors = engine.execute::<Probe>(order("memory", "ok")).await.unwrap();
    assert_eq!(errors, [Some(format!("{:?}", TransactionError::Missing))]);
}

macro_rules! on_databases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let database = TestDatabase::sqlite("workflow-transaction");
                    super::$name(super::Fixture::new(database).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(database) = TestDatabase::postgres() else { return };
                    super::$name(super::Fixture::new(database).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(database) = TestDatabase::mysql() else { return };
                    super::$name(super::Fixture::new(database).await).await;
                }
            )*
            use cluster_testkit::databases::TestDatabase;
        }
    };
}

on_databases!(
    commits_the_writes_with_the_result,
    a_failed_commit_rolls_the_writes_back,
    a_failure_rolls_the_writes_back,
    a_cut_off_activity_leaves_no_writes_and_runs_again,
    an_interrupted_run_leaves_no_writes_for_its_retry,
    guards_report_a_missing_transaction_and_another_backend,
);
