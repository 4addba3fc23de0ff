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
