//! The storage conformance suite: one set of tests that every [`MessageStorage`] and
//! [`RunnerStorage`] implementation passes.
//!
//! A backend provides a function that makes a [`StorageFixture`] (fresh tables with their own
//! prefix, or `None` when its database is not configured) and invokes
//! [`storage_suite!`](crate::storage_suite!) in its integration tests, which expands into one
//! `#[tokio::test]` per case:
//!
//! ```ignore
//! async fn fixture() -> Option<Box<dyn StorageFixture>> { /* fresh tables */ }
//! cluster_testkit::storage_suite!(fixture);
//! ```
//!
//! The cases cover every method of the contracts in `cluster_core::storage` and the reference's
//! storage tests (effect's `MessageStorage.test.ts`, effect's `RunnerStorage.test.ts`, effect's SQL
//! storage tests), including two runner storages racing for the same shards and lease expiry.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::future::BoxFuture;
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{EntityAddress, Snowflake};

pub mod cases;

/// A way to damage a stored row, to test how storages read bad data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Corruption {
    /// The message row `id` gets a payload that is not JSON.
    MessagePayload(Snowflake),
    /// The reply row `id` gets a payload that is not JSON.
    ReplyPayload(Snowflake),
    /// The state row of the entity (its type and id) gets a value that is not JSON.
    StateValue(EntityAddress),
}

/// Fresh, isolated tables of one backend, for one test case.
pub trait StorageFixture: Send + Sync {
    /// The backend's name, for messages.
    fn name(&self) -> &str;

    /// The message storage on these tables (the same instance on every call).
    fn message_storage(&self) -> Arc<dyn MessageStorage>;

    /// A new runner storage on these tables, as another process would open it: its own
    /// connections and lock session. Leases and heartbeats expire after `expiration`.
    fn runner_storage(&self, expiration: Duration) -> BoxFuture<'_, Arc<dyn RunnerStorage>>;

    /// The process that opened `storage` dies: its database sessions end (advisory locks go
    /// with them), and nothing is released or unregistered. By default the storage is dropped,
    /// which closes its sessions; a fixture that keeps its runner storages lets go of it too.
    fn kill_runner_storage(&self, storage: Arc<dyn RunnerStorage>) -> BoxFuture<'_, ()> {
        drop(storage);
        Box::pin(std::future::ready(()))
    }

    /// Damages a stored row.
    fn corrupt(&self, corruption: Corruption) -> BoxFuture<'_, ()>;

    /// The most bytes a stored value (a request's payload or headers, a reply's payload) may
    /// have on [`message_storage`](StorageFixture::message_storage): the limit it was built
    /// with, or its columns' own when that is smaller (MySQL's `TEXT`).
    fn value_bytes_max(&self) -> usize;

    /// The most bytes an entity's state (its JSON text) may have on
    /// [`message_storage`](StorageFixture::message_storage): by default
    /// [`value_bytes_max`](StorageFixture::value_bytes_max). A backend whose state column holds
    /// another amount says so (MySQL's `MEDIUMTEXT`, whose cap is not the `TEXT` columns').
    fn state_bytes_max(&self) -> usize {
        self.value_bytes_max()
    }

    /// Drops the tables.
    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// Expands into one `#[tokio::test]` per conformance case. `$fixture` is an async function
/// returning `Option<Box<dyn StorageFixture>>`; `None` skips the case (the backend's database is
/// not configured, which the function reports and refuses under `CI=true`).
#[macro_export]
macro_rules! storage_suite {
    ($fixture:path) => {
        $crate::storage_suite!(@cases $fixture;
            save_request_then_read_it,
            detects_duplicates_by_primary_key,
            duplicate_reports_the_last_reply,
            a_retried_save_among_concurrent_saves_is_a_duplicate,
            hashes_primary_keys_longer_than_the_column,
            keeps_short_primary_keys_as_plaintext,
            request_without_primary_key_is_never_deduplicated,
            unprocessed_messages_excludes_complete_requests,
            unprocessed_messages_honors_the_limit,
            claimed_messages_are_not_read_twice,
            unprocessed_messages_filters_by_address,
            empty_address_filter_matches_nothing,
            empty_lists_are_no_ops,
            reset_addresses_releases_claims,
            reset_shards_and_requests_release_claims,
            deliver_at_holds_messages_until_due,
            stream_replies_wait_for_acks,
            a_request_whose_id_is_taken_is_a_conflict,
            second_final_reply_is_a_conflict,
            replies_for_returns_exits_and_unacked_chunks,
            replies_for_unfiltered_returns_everything,
            malformed_reply_becomes_a_defect,
            malformed_message_is_reported_and_does_not_block,
            unprocessed_messages_by_id_does_not_claim,
            unprocessed_before_lists_the_entitys_earlier_requests,
            save_request_ordered_reads_the_earlier_requests_with_the_save,
            concurrent_ordered_saves_each_get_their_earlier_requests,
            unprocessed_messages_ordered_reads_requests_with_their_earlier_requests,
            interrupts_are_delivered_and_cleared,
            clear_replies_resets_a_request,
            clear_replies_with_expected_reply_id_is_conditional,
            request_id_for_primary_key,
            clear_address_removes_everything,
            keys_are_compared_exactly,
            values_at_the_limit_are_stored_whole,
            values_over_the_limit_are_refused,
            a_refused_reply_leaves_its_transaction_usable,
            a_value_over_the_limit_fails_alone_in_a_batch,
            transaction_commits_and_rolls_back,
            transaction_rolls_back_to_its_savepoint,
            entity_state_round_trips,
            a_stale_state_write_is_refused,
            racing_state_writers_one_wins,
            a_reply_with_state_commits_both,
            concurrent_replies_with_state_fail_alone,
            a_stale_state_stores_no_reply,
            a_second_final_reply_writes_no_state,
            state_over_the_limit_is_refused,
            state_in_a_transaction_commits_and_rolls_back,
            states_are_keyed_by_type_and_id,
            malformed_state_is_reported,
            purge_deletes_requests_answered_before_the_cutoff,
            purge_keeps_entity_types_with_a_keep_prefix,
            purge_honors_its_limit,
            a_purged_requests_primary_key_can_be_saved_again,
            entity_state_survives_a_purge,
            processed_requests_filters_and_pages,
            backlog_groups_unprocessed_messages,
            requests_filter_page_and_carry_replies,
            register_and_get_runners,
            runner_records_list_expired_runners,
            shard_locks_name_their_holders,
            runner_health_flips,
            unregister_removes_the_runner,
            expired_heartbeat_hides_the_runner,
            acquire_refresh_release,
            racing_runners_get_disjoint_shards,
            released_shard_can_be_taken,
            expired_lease_is_taken_over,
            release_all_drops_every_lock,
            release_gone_frees_a_gone_runners_locks,
            runner_addresses_are_compared_exactly,
        );
    };
    (@cases $fixture:path; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(fixture) = $fixture().await else { return };
                $crate::storage_suite::cases::$case(&*fixture).await;
                fixture.cleanup().await;
            }
        )*
    };
}
