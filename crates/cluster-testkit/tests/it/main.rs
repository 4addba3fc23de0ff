//! The storage conformance suite on the in-memory storages.

use std::sync::Arc;

use cluster_core::SystemClock;
use cluster_testkit::memory::MemoryFixture;
use cluster_testkit::storage_suite::StorageFixture;

async fn memory_fixture() -> Option<Box<dyn StorageFixture>> {
    Some(Box::new(MemoryFixture::new(Arc::new(SystemClock))))
}

cluster_testkit::storage_suite!(memory_fixture);
