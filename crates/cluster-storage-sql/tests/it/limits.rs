//! The default value limit on each backend, and the limits each backend holds to.
//!
//! The conformance suites check values at and over the limit on every backend, with a small
//! `value_bytes_max` on SQLite and PostgreSQL. These tests show that the default is in force:
//! a value one byte over it is refused before any statement, on storages that could not run one
//! (no tables, or no server), so an answer other than `InvalidInput` would mean a round trip.

use cluster_core::envelope::{Exit, RawJson, Reply, Request, TraceContext, WithExit};
use cluster_core::error::{StorageError, StorageErrorKind};
use cluster_core::storage::{MessageStorage, SaveRequestOptions, SaveResult};
use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup, ShardId, Snowflake};
use cluster_storage_sql::options::VALUE_BYTES_MAX_DEFAULT;

/// A JSON string of exactly `bytes` bytes.
fn json_text(bytes: usize) -> String {
    format!("\"{}\"", "a".repeat(bytes - 2))
}

/// A request whose payload is `bytes` bytes of JSON.
fn request_of_size(bytes: usize) -> Request {
    Request {
        request_id: Snowflake::new(1),
        address: EntityAddress {
            shard_id: ShardId::new(ShardGroup::from("default"), 1),
            entity_type: EntityType::from("TestEntity"),
            entity_id: EntityId::from("e1"),
        },
        tag: "GetUser".into(),
        payload: RawJson::from_json(json_text(bytes)).expect("JSON"),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    }
}

/// Saves a request whose payload is `bytes` bytes of JSON.
async fn save_request_of_size(
    storage: &dyn MessageStorage,
    bytes: usize,
) -> Result<SaveResult, StorageError> {
    storage.save_request(&request_of_size(bytes), &SaveRequestOptions::default()).await
}

/// A final reply whose value is `bytes` bytes of JSON (its exit's JSON is a little longer).
fn reply_of_size(bytes: usize) -> Reply {
    Reply::WithExit(WithExit {
        request_id: Snowflake::new(1),
        id: Snowflake::new(2),
        exit: Exit::Success(RawJson::from_json(json_text(bytes)).expect("JSON")),
    })
}

/// Asserts that `result` is a refusal whose message contains each of `expected`.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, StorageError>, expected: &[&str]) {
    let error = match result {
        Err(error) => error,
        Ok(stored) => panic!("accepted: {stored:?}"),
    };
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    let message = error.to_string();
    for expected in expected {
        assert!(message.contains(expected), "{expected:?} is not in {message:?}");
    }
}

/// The memory storages of the testkit have the SQL storages' default, so that simulations and
/// workflow tests meet production's limit.
#[test]
fn the_memory_storages_have_the_same_default() {
    assert_eq!(cluster_testkit::memory::VALUE_BYTES_MAX_DEFAULT, VALUE_BYTES_MAX_DEFAULT.get());
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use cluster_core::queue_storage::QueueStorage;
    use cluster_core::storage::MessageStorage;
    use cluster_storage_sql::options::VALUE_BYTES_MAX_DEFAULT;
    use cluster_storage_sql::{QueueTable, SqliteMessageStorage, SqliteQueueStorage};

    use super::{assert_refused, json_text, reply_of_size, save_request_of_size};
    use crate::sqlite::TempDatabase;

    /// On a file without tables, the default limit refuses a value one byte over it.
    #[tokio::test]
    async fn the_default_limit_is_in_force() {
        let database = TempDatabase::new();
        let options = database.options();
        let storage = SqliteMessageStorage::open_without_migrations(&database.path, options)
            .await
            .expect("open");
        assert_eq!(storage.value_bytes_max(), VALUE_BYTES_MAX_DEFAULT);
        let over = VALUE_BYTES_MAX_DEFAULT.get() + 1;
        let saved = save_request_of_size(&storage, over).await;
        let size = over.to_string();
        assert_refused(saved, &["the request's payload", &size, "value_bytes_max"]);
        assert_refused(storage.save_reply(&reply_of_size(over)).await, &["the reply's payload"]);
        let queue = SqliteQueueStorage::open_without_migrations(
            &database.path,
            &database.options(),
            QueueTable::default(),
        )
        .await
        .expect("open");
        assert_eq!(queue.value_bytes_max(), VALUE_BYTES_MAX_DEFAULT);
        assert_refused(queue.offer("q", "i", &json_text(over)).await, &["the queue element"]);
        queue.close().await;
        storage.close().await;
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use cluster_core::queue_storage::QueueStorage;
    use cluster_core::storage::MessageStorage;
    use cluster_storage_sql::options::VALUE_BYTES_MAX_DEFAULT;
    use cluster_storage_sql::postgres::{self, PgMessageStorage, PgQueueStorage};
    use cluster_storage_sql::{QueueTable, SqlStorageOptions, ValueBytesMax};

    use super::{assert_refused, json_text, reply_of_size, save_request_of_size};

    /// Without a server (nothing listens on port 1), the default limit refuses a value one
    /// byte over it.
    #[tokio::test]
    async fn the_default_limit_is_in_force() {
        let config = postgres::parse_config("postgres://postgres@127.0.0.1:1/none").expect("URL");
        let unreachable_pool = || postgres::pool(config.clone(), 1).expect("a lazy pool");
        let storage =
            PgMessageStorage::without_migrations(unreachable_pool(), &SqlStorageOptions::default());
        assert_eq!(storage.value_bytes_max(), VALUE_BYTES_MAX_DEFAULT);
        let over = VALUE_BYTES_MAX_DEFAULT.get() + 1;
        let saved = save_request_of_size(&storage, over).await;
        let size = over.to_string();
        assert_refused(saved, &["the request's payload", &size, "value_bytes_max"]);
        assert_refused(storage.save_reply(&reply_of_size(over)).await, &["the reply's payload"]);
        let queue = PgQueueStorage::without_migrations(unreachable_pool(), QueueTable::default());
        assert_eq!(queue.value_bytes_max(), VALUE_BYTES_MAX_DEFAULT);
        assert_refused(queue.offer("q", "i", &json_text(over)).await, &["the queue element"]);
        let small = ValueBytesMax::new(1_024).expect("a limit");
        let queue = queue.with_value_bytes_max(small);
        assert_eq!(queue.value_bytes_max(), small);
        assert_refused(
            queue.offer("q", "i", &json_text(1_025)).await,
            &["1025 bytes", "1024 bytes"],
        );
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use cluster_core::queue_storage::QueueStorage;
    use cluster_core::storage::MessageStorage;
    use cluster_storage_sql::mysql::{self, MySqlMessageStorage, MySqlQueueStorage};
    use cluster_storage_sql::{QueueTable, TablePrefix, ValueBytesMax};

    use super::{assert_refused, json_text, reply_of_size, save_request_of_size};

    /// A pool whose connections would all fail: nothing listens on port 1. Without TLS, the
    /// pool connects lazily (`PREFERRED` would connect once to ask for TLS).
    async fn unreachable_pool() -> mysql_async::Pool {
        let url = "mysql://root@127.0.0.1:1/none?ssl-mode=DISABLED";
        mysql::pool(url, 1).await.expect("a pool, which connects lazily")
    }

    /// The messages' values are capped by their `TEXT` columns: 65,535 bytes, whatever the
    /// option above it; below it, the option is in force.
    #[tokio::test]
    async fn the_text_columns_cap_the_message_values() {
        let storage = MySqlMessageStorage::without_migrations(
            unreachable_pool().await,
            &TablePrefix::default(),
        );
        assert_eq!(storage.value_bytes_max().get(), 65_535);
        let saved = save_request_of_size(&storage, 65_536).await;
        let expected =
            ["the request's payload", "65536 bytes", "65535 bytes of MySQL's TEXT column"];
        assert_refused(saved, &expected);
        assert_refused(storage.save_reply(&reply_of_size(65_536)).await, &["the reply's payload"]);
        let small = ValueBytesMax::new(1_100).expect("a limit");
        let storage = storage.with_value_bytes_max(small);
        assert_eq!(storage.value_bytes_max(), small);
        let saved = save_request_of_size(&storage, 1_101).await;
        assert_refused(saved, &["1101 bytes", "limit of 1100 bytes", "value_bytes_max"]);
    }

    /// The queue's elements are capped at 16 MiB − 64 KiB, what a row holds within the default
    /// `max_allowed_packet` (the suite stores and reads one back at that size).
    #[tokio::test]
    async fn a_queue_row_caps_the_elements() {
        let queue =
            MySqlQueueStorage::without_migrations(unreachable_pool().await, QueueTable::default());
        assert_eq!(queue.value_bytes_max().get(), 16 * 1024 * 1024 - 64 * 1024);
        let over = queue.value_bytes_max().get() + 1;
        let expected = ["the queue element", "16711681 bytes", "max_allowed_packet"];
        assert_refused(queue.offer("q", "i", &json_text(over)).await, &expected);
        let small = ValueBytesMax::new(1_024).expect("a limit");
        let queue = queue.with_value_bytes_max(small);
        assert_eq!(queue.value_bytes_max(), small);
        assert_refused(
            queue.offer("q", "i", &json_text(1_025)).await,
            &["1025 bytes", "1024 bytes"],
        );
    }
}
