//! The queue conformance suite: one set of tests that every [`QueueStorage`] implementation
//! passes (memory, SQLite, PostgreSQL, MySQL), with the reference's semantics
//! (`makeStoreSql` in `effect/src/persistence/PersistedQueue.ts`).
//!
//! A backend provides a function that makes a [`QueueFixture`] (a fresh table of its own, or
//! `None` when its database is not configured) and invokes [`queue_suite!`](crate::queue_suite!)
//! in its integration tests, which expands into one `#[tokio::test]` per case:
//!
//! ```ignore
//! async fn fixture() -> Option<Box<dyn QueueFixture>> { /* a fresh table */ }
//! cluster_testkit::queue_suite!(fixture);
//! ```
//!
//! The cases use the real clock: claims expire and retry delays pass in real seconds, as the SQL
//! stores count them.

use std::sync::Arc;

use cluster_core::future::BoxFuture;
use cluster_core::queue_storage::QueueStorage;

pub mod cases;

/// A fresh, isolated queue table of one backend, for one test case.
pub trait QueueFixture: Send + Sync {
    /// The backend's name, for messages.
    fn name(&self) -> &str;

    /// The store on this table (the same instance on every call).
    fn storage(&self) -> Arc<dyn QueueStorage>;

    /// A new store on the same table, as another process would open it (its own connections).
    fn other_storage(&self) -> BoxFuture<'_, Arc<dyn QueueStorage>>;

    /// The most bytes an element may have on [`storage`](QueueFixture::storage): the limit it
    /// was built with, or its column's own when that is smaller (MySQL's `MEDIUMTEXT`).
    fn value_bytes_max(&self) -> usize;

    /// Drops the table.
    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// Expands into one `#[tokio::test]` per queue conformance case. `$fixture` is an async
/// function returning `Option<Box<dyn QueueFixture>>`; `None` skips the case (the backend's
/// database is not configured, which the function reports and refuses under `CI=true`).
#[macro_export]
macro_rules! queue_suite {
    ($fixture:path) => {
        $crate::queue_suite!(@cases $fixture;
            offer_then_take_in_order,
            offers_are_deduplicated_by_id_in_every_state,
            queues_are_separate,
            ids_and_queue_names_are_compared_exactly,
            take_honors_the_limit,
            racing_takers_get_disjoint_items,
            complete_settles_once,
            retry_hides_the_item_until_its_delay,
            max_attempts_stops_claims,
            fail_is_a_dead_letter_that_an_offer_does_not_revive,
            release_gives_the_attempt_back,
            a_lapsed_claim_is_taken_again_and_its_settlements_do_nothing,
            refresh_keeps_a_claim_alive,
            fail_exhausted_fails_lapsed_final_attempts,
            cleanup_removes_old_settled_items,
            empty_refresh_and_unknown_items,
            elements_at_the_limit_are_stored_and_over_it_refused,
        );
    };
    (@cases $fixture:path; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(fixture) = $fixture().await else { return };
                $crate::queue_suite::cases::$case(&*fixture).await;
                fixture.cleanup().await;
            }
        )*
    };
}
