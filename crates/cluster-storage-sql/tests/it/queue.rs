//! The queue stores' tests: the testkit's queue conformance suite on SQLite, PostgreSQL and
//! MySQL, and per database the schema and migration history against the reference's
//! (`sqlMigrations` in `effect/src/persistence/PersistedQueue.ts`), the upgrade of a table a
//! TypeScript runner created with the first migration, and rows that cannot be read.
//!
//! Every test uses a queue table of its own, `<unique prefix>_queue`, and drops it at the end.

use cluster_storage_sql::QueueTable;

/// A queue table no other test uses.
fn unique_table() -> QueueTable {
    let table = format!("{}_queue", crate::unique_prefix());
    QueueTable::new(&table).expect("a generated table name is an identifier")
}

/// The reference's columns after `0002_upgrade_schema`, in the order of the rebuilt SQLite
/// table (PostgreSQL and MySQL add `state` and `visible_at` at the end).
const COLUMNS: [&str; 12] = [
    "sequence",
    "id",
    "queue_name",
    "element",
    "state",
    "attempts",
    "last_failure",
    "visible_at",
    "acquired_at",
    "acquired_by",
    "created_at",
    "updated_at",
];

#[cfg(feature = "sqlite")]
mod sqlite {
    use std::sync::Arc;

    use cluster_core::error::StorageErrorKind;
    use cluster_core::future::BoxFuture;
    use cluster_core::queue_storage::{QueueItemState, QueueStorage, TakeOptions};
    use cluster_storage_sql::{QueueTable, SqliteQueueStorage};
    use cluster_testkit::queue_suite::QueueFixture;

    use super::{COLUMNS, unique_table};
    use crate::sqlite::TempDatabase;

    struct SqliteQueueFixture {
        database: TempDatabase,
        table: QueueTable,
        storage: Arc<SqliteQueueStorage>,
        others: std::sync::Mutex<Vec<Arc<SqliteQueueStorage>>>,
    }

    async fn open(database: &TempDatabase, table: &QueueTable) -> SqliteQueueStorage {
        SqliteQueueStorage::open(&database.path, &database.options(), table.clone())
            .await
            .expect("open the queue store")
    }

    async fn fixture() -> Option<Box<dyn QueueFixture>> {
        let database = TempDatabase::new();
        let table = unique_table();
        let mut options = database.options();
        options.storage.value_bytes_max = crate::suite_value_bytes_max();
        let storage = SqliteQueueStorage::open(&database.path, &options, table.clone());
        let storage = Arc::new(storage.await.expect("open the queue store"));
        Some(Box::new(SqliteQueueFixture {
            database,
            table,
            storage,
            others: std::sync::Mutex::new(Vec::new()),
        }))
    }

    impl QueueFixture for SqliteQueueFixture {
        fn name(&self) -> &str {
            "sqlite"
        }

        fn storage(&self) -> Arc<dyn QueueStorage> {
            Arc::clone(&self.storage) as Arc<dyn QueueStorage>
        }

        fn other_storage(&self) -> BoxFuture<'_, Arc<dyn QueueStorage>> {
            Box::pin(async move {
                let other = Arc::new(open(&self.database, &self.table).await);
                self.others.lock().expect("not poisoned").push(Arc::clone(&other));
                other as Arc<dyn QueueStorage>
            })
        }

        fn value_bytes_max(&self) -> usize {
            self.storage.value_bytes_max().get()
        }

        fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
            Box::pin(async move {
                self.storage.close().await;
                let others = std::mem::take(&mut *self.others.lock().expect("not poisoned"));
                for other in others {
                    other.close().await;
                }
            })
        }
    }

    cluster_testkit::queue_suite!(fixture);

    /// The table, its indexes and its history are the reference's after both migrations, and
    /// opening again runs nothing.
    #[tokio::test]
    async fn the_schema_and_history_are_the_references() {
        let database = TempDatabase::new();
        let table = unique_table();
        let storage = open(&database, &table).await;
        let connection = database.connect();
        let mut statement = connection.prepare(&format!("PRAGMA table_info({table})")).unwrap();
        let columns: Vec<String> =
            statement.query_map([], |row| row.get(1)).unwrap().map(Result::unwrap).collect();
        assert_eq!(columns, COLUMNS);
        let index_sql = |name: String| -> String {
            connection
                .query_row("SELECT sql FROM sqlite_master WHERE name = ?1", [&name], |row| {
                    row.get(0)
                })
                .unwrap()
        };
        let take = index_sql(format!("idx_{table}_take"));
        assert!(take.ends_with("(queue_name, visible_at) WHERE state = 'pending'"), "{take}");
        let id = index_sql(format!("idx_{table}_id"));
        assert!(id.starts_with("CREATE UNIQUE INDEX") && id.ends_with("(id, queue_name)"), "{id}");
        let update = index_sql(format!("idx_{table}_update"));
        assert!(update.ends_with("(sequence, acquired_by)"), "{update}");
        let history = format!("SELECT migration_id, name FROM {table}_migrations ORDER BY 1");
        let mut statement = connection.prepare(&history).unwrap();
        let rows: Vec<(i64, String)> = statement
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(rows, [(1, "create_table".to_owned()), (2, "upgrade_schema".to_owned())]);
        storage.close().await;
        let again = open(&database, &table).await;
        assert!(again.offer("q", "a", "{}").await.unwrap());
        again.close().await;
    }

    /// A table created by a TypeScript runner of the first migration's time is upgraded with
    /// its rows: `completed` becomes the state and `visible_at` the last update.
    #[tokio::test]
    async fn a_table_of_the_first_migration_is_upgraded_with_its_rows() {
        let database = TempDatabase::new();
        let table = unique_table();
        let connection = database.connect();
        connection
            .execute_batch(&format!(
                "CREATE TABLE {table} (
                  sequence INTEGER PRIMARY KEY AUTOINCREMENT,
                  id TEXT NOT NULL,
                  queue_name TEXT NOT NULL,
                  element TEXT NOT NULL,
                  completed BOOLEAN NOT NULL,
                  attempts INTEGER NOT NULL DEFAULT 0,
                  last_failure TEXT NULL,
                  acquired_at DATETIME NULL,
                  acquired_by TEXT NULL,
                  created_at DATETIME NOT NULL,
                  updated_at DATETIME NOT NULL
                );
                CREATE UNIQUE INDEX idx_{table}_id ON {table} (id, queue_name);
                CREATE TABLE {table}_migrations (
                  migration_id integer PRIMARY KEY NOT NULL,
                  created_at datetime NOT NULL DEFAULT current_timestamp,
                  name VARCHAR(255) NOT NULL
                );
                INSERT INTO {table}_migrations (migration_id, name) VALUES (1, 'create_table');
                INSERT INTO {table} (id, queue_name, element, completed, attempts, created_at,
                  updated_at)
                VALUES ('done', 'q', '{{}}', 1, 1, '2024-01-01 00:00:00', '2024-01-01 00:00:00'),
                  ('waiting', 'q', '{{\"a\":1}}', 0, 0, '2024-01-01 00:00:00',
                  '2024-01-01 00:00:01');"
            ))
            .unwrap();
        let storage = open(&database, &table).await;
        let done = storage.item("q", "done").await.unwrap().unwrap();
        assert_eq!((done.state, done.attempts), (QueueItemState::Completed, 1));
        let visible_at: String = connection
            .query_row(&format!("SELECT visible_at FROM {table} WHERE id = 'waiting'"), [], |row| {
                row.get(0)
            })
            .unwrap();
        assert_eq!(visible_at, "2024-01-01 00:00:01");
        let options = TakeOptions {
            limit: std::num::NonZeroU32::MIN,
            max_attempts: std::num::NonZeroU32::MIN,
            lock_expiration: std::time::Duration::from_secs(60),
        };
        let batch = storage.take("q", &options).await.unwrap();
        assert_eq!(batch.items.len(), 1);
        assert_eq!(
            (batch.items[0].id.as_str(), batch.items[0].element.as_str()),
            ("waiting", r#"{"a":1}"#)
        );
        assert!(!storage.offer("q", "done", "{}").await.unwrap(), "ids are still unique");
        storage.close().await;
    }

    /// A claimed row whose element is not text is reported as malformed, not returned as an
    /// item and not a failed take; the other items come through, and the bad one can be failed.
    #[tokio::test]
    async fn a_row_that_cannot_be_read_is_reported_and_skipped() {
        let database = TempDatabase::new();
        let table = unique_table();
        let storage = open(&database, &table).await;
        for id in ["bad", "good"] {
            assert!(storage.offer("q", id, "{}").await.unwrap());
        }
        let connection = database.connect();
        let sql = format!("UPDATE {table} SET element = X'FF00' WHERE id = 'bad'");
        assert_eq!(connection.execute(&sql, []).unwrap(), 1);
        let options = TakeOptions {
            limit: std::num::NonZeroU32::new(10).unwrap(),
            max_attempts: std::num::NonZeroU32::new(10).unwrap(),
            lock_expiration: std::time::Duration::from_secs(60),
        };
        let batch = storage.take("q", &options).await.unwrap();
        let ids: Vec<&str> = batch.items.iter().map(|item| item.id.as_str()).collect();
        assert_eq!(ids, ["good"]);
        assert_eq!(batch.malformed.len(), 1, "{batch:?}");
        let malformed = &batch.malformed[0];
        assert!(malformed.error.message().contains("element"), "{:?}", malformed.error);
        assert!(storage.fail(&malformed.claim, "cannot be read").await.unwrap());
        let error = storage.item("q", "bad").await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::Malformed);
        storage.close().await;
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::sync::Arc;

    use cluster_core::error::StorageErrorKind;
    use cluster_core::future::BoxFuture;
    use cluster_core::queue_storage::{QueueItemState, QueueStorage, TakeOptions};
    use cluster_storage_sql::QueueTable;
    use cluster_storage_sql::postgres::{self, PgQueueStorage};
    use cluster_testkit::queue_suite::QueueFixture;
    use tokio_postgres::NoTls;

    use super::{COLUMNS, unique_table};

    const URL_VARIABLE: &str = "CLUSTER_TEST_POSTGRES_URL";

    /// A plain connection for the test's own statements.
    async fn admin(url: &str) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
        tokio::spawn(async move {
            let _ended = connection.await;
        });
        client
    }

    async fn drop_table(client: &tokio_postgres::Client, table: &QueueTable) {
        let sql = format!("DROP TABLE IF EXISTS \"{table}\", \"{}\"", table.history());
        client.batch_execute(&sql).await.unwrap();
    }

    async fn connect(url: &str, table: &QueueTable) -> PgQueueStorage {
        let pool = postgres::pool(postgres::parse_config(url).unwrap(), 4).unwrap();
        PgQueueStorage::new(pool, table.clone()).await.unwrap()
    }

    struct PgQueueFixture {
        url: String,
        table: QueueTable,
        admin: tokio_postgres::Client,
        storage: Arc<PgQueueStorage>,
    }

    async fn fixture() -> Option<Box<dyn QueueFixture>> {
        let url = crate::database_url(URL_VARIABLE)?;
        let table = unique_table();
        let storage = connect(&url, &table).await;
        let storage = Arc::new(storage.with_value_bytes_max(crate::suite_value_bytes_max()));
        let admin = admin(&url).await;
        Some(Box::new(PgQueueFixture { url, table, admin, storage }))
    }

    impl QueueFixture for PgQueueFixture {
        fn name(&self) -> &str {
            "postgres"
        }

        fn storage(&self) -> Arc<dyn QueueStorage> {
            Arc::clone(&self.storage) as Arc<dyn QueueStorage>
        }

        fn other_storage(&self) -> BoxFuture<'_, Arc<dyn QueueStorage>> {
            Box::pin(async move {
                Arc::new(connect(&self.url, &self.table).await) as Arc<dyn QueueStorage>
            })
        }

        fn value_bytes_max(&self) -> usize {
            self.storage.value_bytes_max().get()
        }

        fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
            Box::pin(async move { drop_table(&self.admin, &self.table).await })
        }
    }

    cluster_testkit::queue_suite!(fixture);

    /// The columns, their types, the indexes and the history are the reference's after both
    /// migrations, and migrating again runs nothing.
    #[tokio::test]
    async fn the_schema_and_history_are_the_references() {
        let Some(url) = crate::database_url(URL_VARIABLE) else { return };
        let table = unique_table();
        let storage = connect(&url, &table).await;
        let client = admin(&url).await;
        let rows = client
            .query(
                "SELECT column_name::text, data_type::text, is_nullable::text \
                 FROM information_schema.columns WHERE table_name = $1 ORDER BY ordinal_position",
                &[&table.as_str()],
            )
            .await
            .unwrap();
        let mut columns: Vec<String> = rows.iter().map(|row| row.get(0)).collect();
        columns.sort();
        let mut expected = COLUMNS.to_vec();
        expected.sort_unstable();
        assert_eq!(columns, expected);
        let types: Vec<(String, String, String)> =
            rows.iter().map(|row| (row.get(0), row.get(1), row.get(2))).collect();
        for (column, data_type, nullable) in [
            ("sequence", "bigint", "NO"),
            ("id", "character varying", "NO"),
            ("state", "character varying", "NO"),
            ("visible_at", "timestamp without time zone", "NO"),
            ("acquired_by", "uuid", "YES"),
        ] {
            let expected = (column.to_owned(), data_type.to_owned(), nullable.to_owned());
            assert!(types.contains(&expected), "{expected:?} in {types:?}");
        }
        let index = client
            .query_one(
                "SELECT indexdef FROM pg_indexes WHERE indexname = $1",
                &[&format!("idx_{table}_take")],
            )
            .await
            .unwrap();
        let index: String = index.get(0);
        assert!(
            index.ends_with("(queue_name, visible_at) WHERE ((state)::text = 'pending'::text)"),
            "{index}"
        );
        let history = client
            .query(
                &format!("SELECT migration_id, name FROM \"{}\" ORDER BY 1", table.history()),
                &[],
            )
            .await
            .unwrap();
        let history: Vec<(i32, String)> =
            history.iter().map(|row| (row.get(0), row.get(1))).collect();
        assert_eq!(history, [(1, "create_table".to_owned()), (2, "upgrade_schema".to_owned())]);
        assert!(PgQueueStorage::migrate(storage.pool(), &table).await.unwrap().is_empty());
        drop_table(&client, &table).await;
    }

    /// A table created by a TypeScript runner of the first migration's time is upgraded with
    /// its rows; a row whose state no store wrote cannot be read, and is not claimed.
    #[tokio::test]
    async fn a_table_of_the_first_migration_is_upgraded_with_its_rows() {
        let Some(url) = crate::database_url(URL_VARIABLE) else { return };
        let table = unique_table();
        let client = admin(&url).await;
        client
            .batch_execute(&format!(
                "CREATE TABLE \"{table}\" (
                  sequence SERIAL PRIMARY KEY,
                  id VARCHAR(36) NOT NULL,
                  queue_name VARCHAR(100) NOT NULL,
                  element TEXT NOT NULL,
                  completed BOOLEAN NOT NULL,
                  attempts INTEGER NOT NULL DEFAULT 0,
                  last_failure TEXT NULL,
                  acquired_at TIMESTAMP NULL,
                  acquired_by UUID NULL,
                  created_at TIMESTAMP NOT NULL,
                  updated_at TIMESTAMP NOT NULL
                );
                CREATE UNIQUE INDEX \"idx_{table}_id\" ON \"{table}\" (id, queue_name);
                CREATE INDEX \"idx_{table}_take\" ON \"{table}\" (queue_name, completed, attempts, acquired_at);
                CREATE TABLE \"{history}\" (
                  migration_id integer primary key,
                  created_at timestamp with time zone not null default now(),
                  name text not null
                );
                INSERT INTO \"{history}\" (migration_id, name) VALUES (1, 'create_table');
                INSERT INTO \"{table}\" (id, queue_name, element, completed, attempts, created_at, updated_at)
                VALUES ('done', 'q', '{{}}', TRUE, 1, NOW(), NOW()),
                  ('waiting', 'q', '{{\"a\":1}}', FALSE, 0, NOW(), NOW());",
                history = table.history(),
            ))
            .await
            .unwrap();
        let storage = connect(&url, &table).await;
        let done = storage.item("q", "done").await.unwrap().unwrap();
        assert_eq!((done.state, done.attempts), (QueueItemState::Completed, 1));
        let options = TakeOptions {
            limit: std::num::NonZeroU32::new(10).unwrap(),
            max_attempts: std::num::NonZeroU32::new(10).unwrap(),
            lock_expiration: std::time::Duration::from_secs(60),
        };
        let batch = storage.take("q", &options).await.unwrap();
        let ids: Vec<&str> = batch.items.iter().map(|item| item.id.as_str()).collect();
        assert_eq!(ids, ["waiting"]);
        let sql = format!("UPDATE \"{table}\" SET state = 'weird' WHERE id = 'done'");
        assert_eq!(client.execute(&sql, &[]).await.unwrap(), 1);
        let error = storage.item("q", "done").await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::Malformed);
        let long = "x".repeat(256);
        let error = storage.offer("q", &long, "{}").await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
        drop_table(&client, &table).await;
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use std::sync::Arc;
    use std::time::Duration;

    use cluster_core::error::StorageErrorKind;
    use cluster_core::future::BoxFuture;
    use cluster_core::queue_storage::{QueueItemState, QueueStorage, TakeOptions};
    use cluster_storage_sql::QueueTable;
    use cluster_storage_sql::mysql::{self, MySqlQueueStorage};
    use cluster_testkit::queue_suite::QueueFixture;
    use mysql_async::Pool;
    use mysql_async::prelude::Queryable;

    use super::{COLUMNS, unique_table};

    const URL_VARIABLE: &str = "CLUSTER_TEST_MYSQL_URL";

    async fn exec(pool: &Pool, sql: &str) {
        let mut conn = pool.get_conn().await.expect("an admin connection");
        conn.query_drop(sql).await.unwrap_or_else(|error| panic!("{sql}: {error}"));
    }

    async fn drop_table(pool: &Pool, table: &QueueTable) {
        exec(pool, &format!("DROP TABLE IF EXISTS `{table}`, `{}`", table.history())).await;
    }

    async fn connect(url: &str, table: &QueueTable) -> MySqlQueueStorage {
        MySqlQueueStorage::new(mysql::pool(url, 4).await.unwrap(), table.clone()).await.unwrap()
    }

    struct MySqlQueueFixture {
        url: String,
        table: QueueTable,
        admin: Pool,
        storage: Arc<MySqlQueueStorage>,
    }

    async fn fixture() -> Option<Box<dyn QueueFixture>> {
        let url = crate::database_url(URL_VARIABLE)?;
        let table = unique_table();
        let storage = Arc::new(connect(&url, &table).await);
        let admin = mysql::pool(&url, 2).await.unwrap();
        Some(Box::new(MySqlQueueFixture { url, table, admin, storage }))
    }

    impl QueueFixture for MySqlQueueFixture {
        fn name(&self) -> &str {
            "mysql"
        }

        fn storage(&self) -> Arc<dyn QueueStorage> {
            Arc::clone(&self.storage) as Arc<dyn QueueStorage>
        }

        fn other_storage(&self) -> BoxFuture<'_, Arc<dyn QueueStorage>> {
            Box::pin(async move {
                Arc::new(connect(&self.url, &self.table).await) as Arc<dyn QueueStorage>
            })
        }

        /// The default `value_bytes_max`, capped at 16 MiB − 64 KiB: 16,711,680 bytes.
        fn value_bytes_max(&self) -> usize {
            self.storage.value_bytes_max().get()
        }

        fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
            Box::pin(async move {
                drop_table(&self.admin, &self.table).await;
                // Bounded: a test that failed may still hold connections of this pool.
                let _ = tokio::time::timeout(Duration::from_secs(5), self.admin.disconnect()).await;
            })
        }
    }

    cluster_testkit::queue_suite!(fixture);

    /// The columns, their types, the indexes and the history are the reference's after both
    /// migrations, and migrating again runs nothing.
    #[tokio::test]
    async fn the_schema_and_history_are_the_references() {
        let Some(url) = crate::database_url(URL_VARIABLE) else { return };
        let table = unique_table();
        let storage = connect(&url, &table).await;
        let admin = mysql::pool(&url, 2).await.unwrap();
        let mut conn = admin.get_conn().await.unwrap();
        let columns: Vec<(String, String, String)> = conn
            .exec(
                "SELECT column_name, column_type, is_nullable FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name = ? ORDER BY ordinal_position",
                (table.as_str(),),
            )
            .await
            .unwrap();
        let mut names: Vec<&str> = columns.iter().map(|(name, _, _)| name.as_str()).collect();
        names.sort_unstable();
        let mut expected = COLUMNS.to_vec();
        expected.sort_unstable();
        assert_eq!(names, expected);
        for column in [
            ("sequence", "bigint(20) unsigned", "NO"),
            ("id", "varchar(255)", "NO"),
            ("element", "mediumtext", "NO"),
            ("state", "varchar(10)", "NO"),
            ("visible_at", "datetime", "NO"),
            ("acquired_by", "varchar(36)", "YES"),
        ] {
            let expected = (column.0.to_owned(), column.1.to_owned(), column.2.to_owned());
            assert!(columns.contains(&expected), "{expected:?} in {columns:?}");
        }
        let take: Vec<String> = conn
            .exec(
                "SELECT column_name FROM information_schema.statistics \
                 WHERE table_schema = DATABASE() AND table_name = ? AND index_name = ? \
                 ORDER BY seq_in_index",
                (table.as_str(), format!("idx_{table}_take")),
            )
            .await
            .unwrap();
        assert_eq!(take, ["queue_name", "state", "visible_at"]);
        let history: Vec<(u32, String)> = conn
            .query(format!("SELECT migration_id, name FROM `{}` ORDER BY 1", table.history()))
            .await
            .unwrap();
        assert_eq!(history, [(1, "create_table".to_owned()), (2, "upgrade_schema".to_owned())]);
        drop(conn);
        MySqlQueueStorage::migrate(storage.pool(), &table).await.unwrap();
        drop_table(&admin, &table).await;
    }

    /// A table created by a TypeScript runner of the first migration's time is upgraded with
    /// its rows; values longer than their columns are refused, not truncated.
    #[tokio::test]
    async fn a_table_of_the_first_migration_is_upgraded_with_its_rows() {
        let Some(url) = crate::database_url(URL_VARIABLE) else { return };
        let table = unique_table();
        let admin = mysql::pool(&url, 2).await.unwrap();
        let history = table.history();
        for statement in [
            format!(
                "CREATE TABLE `{table}` (
                  sequence BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
                  id VARCHAR(36) NOT NULL,
                  queue_name VARCHAR(100) NOT NULL,
                  element TEXT NOT NULL,
                  completed BOOLEAN NOT NULL,
                  attempts INT NOT NULL DEFAULT 0,
                  last_failure TEXT NULL,
                  acquired_at DATETIME NULL,
                  acquired_by VARCHAR(36) NULL,
                  created_at DATETIME NOT NULL,
                  updated_at DATETIME NOT NULL
                )"
            ),
            format!("CREATE UNIQUE INDEX `idx_{table}_id` ON `{table}` (id, queue_name)"),
            format!(
                "CREATE INDEX `idx_{table}_take` ON `{table}` (queue_name, completed, attempts, acquired_at)"
            ),
            format!("CREATE INDEX `idx_{table}_update` ON `{table}` (sequence, acquired_by)"),
            format!(
                "CREATE TABLE `{history}` (
                  migration_id INTEGER UNSIGNED NOT NULL,
                  created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
                  name VARCHAR(255) NOT NULL,
                  PRIMARY KEY (migration_id)
                )"
            ),
            format!("INSERT INTO `{history}` (migration_id, name) VALUES (1, 'create_table')"),
            format!(
                "INSERT INTO `{table}` (id, queue_name, element, completed, attempts, created_at, updated_at) \
                 VALUES ('done', 'q', '{{}}', TRUE, 1, NOW(), NOW()), \
                 ('waiting', 'q', '{{\"a\":1}}', FALSE, 0, NOW(), NOW())"
            ),
        ] {
            exec(&admin, &statement).await;
        }
        let storage = connect(&url, &table).await;
        let done = storage.item("q", "done").await.unwrap().unwrap();
        assert_eq!((done.state, done.attempts), (QueueItemState::Completed, 1));
        let options = TakeOptions {
            limit: std::num::NonZeroU32::new(10).unwrap(),
            max_attempts: std::num::NonZeroU32::new(10).unwrap(),
            lock_expiration: Duration::from_secs(60),
        };
        let batch = storage.take("q", &options).await.unwrap();
        let ids: Vec<&str> = batch.items.iter().map(|item| item.id.as_str()).collect();
        assert_eq!(ids, ["waiting"]);
        assert_eq!(batch.items[0].element, r#"{"a":1}"#);
        let error = storage.offer("q", &"x".repeat(256), "{}").await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
        exec(&admin, &format!("UPDATE `{table}` SET state = 'weird' WHERE id = 'done'")).await;
        let error = storage.item("q", "done").await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::Malformed);
        drop_table(&admin, &table).await;
    }
}
