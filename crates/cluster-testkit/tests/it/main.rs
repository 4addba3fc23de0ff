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

/// The faulty wrapper forwards the entity state methods, and fails a reply saved with a state
/// as it fails any reply write.
mod faulty_state {
    use std::sync::{Arc, Mutex};

    use cluster_core::SystemClock;
    use cluster_core::entity_state::{StateWrite, StoredState};
    use cluster_core::envelope::{Exit, RawJson, Reply, Request, TraceContext, WithExit};
    use cluster_core::error::StorageErrorKind;
    use cluster_core::storage::{MessageStorage, SaveRequestOptions};
    use cluster_core::sync::lock;
    use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup, ShardId, Snowflake};
    use cluster_testkit::faulty::{FaultyMessageStorage, StorageEvent};
    use cluster_testkit::memory::MemoryMessageStorage;

    fn address() -> EntityAddress {
        EntityAddress {
            shard_id: ShardId::new(ShardGroup::from("default"), 1),
            entity_type: EntityType::from("TestEntity"),
            entity_id: EntityId::from("e1"),
        }
    }

    fn json(text: &str) -> RawJson {
        RawJson::from_json(text.to_owned()).unwrap()
    }

    #[tokio::test]
    async fn states_are_forwarded_and_reply_faults_apply() {
        let inner = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
        let (storage, faults) = FaultyMessageStorage::new(inner);
        let stored: Arc<Mutex<Vec<Snowflake>>> = Arc::default();
        let seen = Arc::clone(&stored);
        faults.observe(Arc::new(move |event| {
            if let StorageEvent::FinalReplyStored(reply) = event {
                lock(&seen).push(reply.id());
            }
        }));
        let write = StateWrite { address: address(), expected: 0, value: Some(json("1")) };
        storage.save_state(&write).await.unwrap();
        let loaded = storage.load_state(&address()).await.unwrap();
        assert_eq!(loaded, Some(StoredState { value: json("1"), revision: 1 }));
        let request = Request {
            request_id: Snowflake::new(1),
            address: address(),
            tag: "Add".into(),
            payload: json("{}"),
            headers: RawJson::empty_object(),
            trace: TraceContext::default(),
        };
        storage.save_request(&request, &SaveRequestOptions::default()).await.unwrap();
        let reply = Reply::WithExit(WithExit {
            request_id: Snowflake::new(1),
            id: Snowflake::new(2),
            exit: Exit::Success(json("2")),
        });
        let write = StateWrite { address: address(), expected: 1, value: Some(json("2")) };
        faults.fail_reply_saves(1);
        let error = storage.save_reply_with_state(&reply, &write).await.unwrap_err();
        assert_eq!(error.kind(), StorageErrorKind::Unavailable, "{error}");
        assert_eq!(storage.load_state(&address()).await.unwrap().map(|s| s.revision), Some(1));
        storage.save_reply_with_state(&reply, &write).await.unwrap();
        assert_eq!(storage.load_state(&address()).await.unwrap().map(|s| s.revision), Some(2));
        assert_eq!(*lock(&stored), [Snowflake::new(2)]);
        let mut transaction = storage.begin_transaction().await.unwrap();
        let write = StateWrite { address: address(), expected: 2, value: None };
        transaction.save_state(&write).await.unwrap();
        transaction.commit().await.unwrap();
        assert_eq!(storage.load_state(&address()).await.unwrap(), None);
    }
}
