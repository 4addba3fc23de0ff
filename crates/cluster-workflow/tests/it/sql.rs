//! Part of the suite on the cluster engine with real storage: one runner holding every shard
//! lock, on SQLite, PostgreSQL and MySQL, on a real clock (the suite's durations divided by
//! [`DIVISOR`]).

use std::sync::Mutex;

use cluster_core::ids::RunnerAddress;
use cluster_sharding::Sharding;
use cluster_testkit::databases::TestDatabase;
use cluster_workflow::{ClusterOptions, WorkflowEngine};

use crate::suite::{self, Harness};

/// Real time runs the suite 20 times faster than its paused-clock durations.
const DIVISOR: u32 = 20;

/// One runner per engine on the test's database (kept until the harness is dropped).
struct OnDatabase {
    database: TestDatabase,
    runners: Mutex<Vec<(Sharding, WorkflowEngine)>>,
}

impl OnDatabase {
    fn new(database: TestDatabase) -> OnDatabase {
        suite::set_time_divisor(DIVISOR);
        OnDatabase { database, runners: Mutex::new(Vec::new()) }
    }

    /// Shuts the runners down, so that no transaction of theirs is open when the database's
    /// tables are dropped.
    async fn finish(self) {
        let runners = std::mem::take(&mut *self.runners.lock().unwrap());
        for (runner, engine) in runners {
            engine.shutdown().await;
            runner.shutdown().await;
        }
    }
}

impl Harness for OnDatabase {
    async fn engine(&self) -> WorkflowEngine {
        // A new engine replaces the previous one (its runner gives the shard locks back).
        let previous = std::mem::take(&mut *self.runners.lock().unwrap());
        for (runner, engine) in previous {
            engine.shutdown().await;
            runner.shutdown().await;
        }
        let config = cluster_core::ShardingConfig {
            runner_address: Some(RunnerAddress::new("127.0.0.1", 1)),
            ..crate::cluster::config()
        };
        let (messages, locks) = self.database.open(&config).await.unwrap();
        let sharding = Sharding::single_runner(config, messages, locks).start().await.unwrap();
        let queue_storage = Some(self.database.queue_storage().await.unwrap());
        let options = ClusterOptions { queue_storage, ..ClusterOptions::default() };
        let engine = WorkflowEngine::cluster_with(&sharding, options).unwrap();
        self.runners.lock().unwrap().push((sharding, engine.clone()));
        engine
    }

    fn is_cluster(&self) -> bool {
        true
    }

    fn value_bytes_max(&self) -> Option<usize> {
        // MySQL's TEXT columns.
        (self.database.kind() == "mysql").then_some(65_535)
    }
}

macro_rules! on_databases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    let harness = super::OnDatabase::new(cluster_testkit::databases::TestDatabase::sqlite("workflow"));
                    crate::suite::$name(&harness).await;
                    harness.finish().await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(database) = cluster_testkit::databases::TestDatabase::postgres() else { return };
                    let harness = super::OnDatabase::new(database);
                    crate::suite::$name(&harness).await;
                    harness.finish().await;
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(database) = cluster_testkit::databases::TestDatabase::mysql() else { return };
                    let harness = super::OnDatabase::new(database);
                    crate::suite::$name(&harness).await;
                    harness.finish().await;
                }
            )*
        }
    };
}

on_databases!(
    executes_and_polls,
    executing_again_attaches_to_the_execution,
    email_workflow_suspends_resumes_and_deduplicates,
    interrupting_a_suspended_execution_runs_its_compensation_once,
    interrupt_unsafe_applies_across_a_suspended_replay,
    compensation_scenario_matrix,
    a_race_replays_its_recorded_winner,
    deferred_race_lets_a_deferred_win_while_a_branch_is_active,
    a_child_completion_wakes_its_parent,
    suspend_on_failure_suspends_and_an_explicit_resume_replays,
    durable_sleep_wakes_the_run,
    concurrent_activities_finish_before_the_run_suspends,
    retries_number_attempts_and_keep_the_last_error,
    an_activity_failing_on_its_own_is_not_retried_on_interrupt,
    an_activity_interrupted_past_its_retries_dies,
    first_completion_wins,
    a_queue_item_is_offered_once_across_replays,
    values_over_the_storage_limit_are_typed_errors,
);
