//! The storage and queue conformance suites on the in-memory storages.

use std::sync::Arc;

use cluster_core::SystemClock;
use cluster_testkit::memory::MemoryFixture;
use cluster_testkit::storage_suite::StorageFixture;

async fn memory_fixture() -> Option<Box<dyn StorageFixture>> {
    Some(Box::new(MemoryFixture::new(Arc::new(SystemClock))))
}

cluster_testkit::storage_suite!(memory_fixture);

mod queue {
    use std::sync::Arc;

    use cluster_core::SystemClock;
    use cluster_testkit::memory::MemoryQueueFixture;
    use cluster_testkit::queue_suite::QueueFixture;

    async fn memory_fixture() -> Option<Box<dyn QueueFixture>> {
        Some(Box::new(MemoryQueueFixture::new(Arc::new(SystemClock))))
    }

    cluster_testkit::queue_suite!(memory_fixture);
}

/// The memory storages' limit is settable, as the SQL storages' `value_bytes_max` is; the
/// suites above run them with the default.
mod limits {
    use std::sync::Arc;

    use cluster_core::SystemClock;
    use cluster_core::envelope::{RawJson, Request, TraceContext};
    use cluster_core::error::StorageErrorKind;
    use cluster_core::queue_storage::QueueStorage;
    use cluster_core::storage::{MessageStorage, SaveRequestOptions, SaveResult};
    use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup, ShardId, Snowflake};
    use cluster_testkit::memory::{
        MemoryMessageStorage, MemoryQueueStorage, VALUE_BYTES_MAX_DEFAULT,
    };

    /// A JSON string of exactly `bytes` bytes.
    fn json_text(bytes: usize) -> String {
        format!("\"{}\"", "a".repeat(bytes - 2))
    }

    fn request(id: u64, payload_bytes: usize) -> Request {
        Request {
            request_id: Snowflake::new(id),
            address: EntityAddress {
                shard_id: ShardId::new(ShardGroup::from("default"), 1),
                entity_type: EntityType::from("TestEntity"),
                entity_id: EntityId::from("e1"),
            },
            tag: "GetUser".into(),
            payload: RawJson::from_json(json_text(payload_bytes)).unwrap(),
            headers: RawJson::empty_object(),
            trace: TraceContext::default(),
        }
    }

    #[tokio::test]
    async fn the_limit_is_settable() {
        let storage = MemoryMessageStorage::new(Arc::new(SystemClock));
        assert_eq!(storage.value_bytes_max(), VALUE_BYTES_MAX_DEFAULT);
        let storage = storage.with_value_bytes_max(16);
        assert_eq!(storage.value_bytes_max(), 16);
        let options = SaveRequestOptions::default();
        let error = storage.save_request(&request(1, 17), &options).await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
        assert!(
            error.to_string().contains("MemoryMessageStorage::with_value_bytes_max"),
            "{error}"
        );
        let saved = storage.save_request(&request(1, 16), &options).await.unwrap();
        assert_eq!(saved, SaveResult::Success);

        let queue = MemoryQueueStorage::new(Arc::new(SystemClock));
        assert_eq!(queue.value_bytes_max(), VALUE_BYTES_MAX_DEFAULT);
        let queue = queue.with_value_bytes_max(16);
        let error = queue.offer("q", "i", &json_text(17)).await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
        assert!(queue.offer("q", "i", &json_text(16)).await.unwrap());
    }
}
