//! `durable-cluster admin` (feature `cli`) as an operator runs it: the binary, in its own
//! process, against the storage of a running single runner with a workflow, on SQLite, and on
//! PostgreSQL and MySQL when they are configured.
#![cfg(all(feature = "cli", feature = "sqlite", feature = "postgres", feature = "mysql"))]

use std::process::Output;
use std::time::Duration;

use cluster_core::envelope::{Exit, RawJson, Reply, Request, TraceContext, WithExit};
use cluster_core::storage::{SaveRequestOptions, UnprocessedOptions};
use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup, Snowflake};
use cluster_testkit::databases::TestDatabase;
use durable_cluster::workflow::{ExecutionId, Workflow, WorkflowEngine, WorkflowResult};
use serde_json::Value;

mod support;
use support::{Approval, ApprovalPayload, approve};

/// The CLI's storage arguments for `database`.
fn storage_args(database: &TestDatabase) -> Vec<String> {
    match database {
        TestDatabase::Sqlite { path } => vec![format!("--storage=sqlite:{}", path.display())],
        TestDatabase::Postgres { url, prefix } | TestDatabase::Mysql { url, prefix } => {
            vec![format!("--storage={url}"), format!("--prefix={prefix}")]
        }
    }
}

/// Runs `durable-cluster admin <storage> <args>` and returns what it did.
async fn admin(database: &TestDatabase, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_durable-cluster"));
    command.arg("admin").args(storage_args(database)).args(args);
    command.env_remove("CLUSTER_STORAGE_URL").env_remove("CLUSTER_TABLE_PREFIX");
    tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("the CLI answers within a minute")
        .unwrap()
}

/// Runs a command that must succeed with `--json`, and returns its JSON.
async fn admin_json(database: &TestDatabase, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let output = admin(database, &all).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{args:?}: {stderr}{stdout}");
    serde_json::from_str(&stdout).unwrap_or_else(|error| panic!("{args:?}: {error}: {stdout}"))
}

/// Polls the engine until the execution's result passes `accept`, at most 30 seconds.
async fn wait_for(
    engine: &WorkflowEngine,
    id: &ExecutionId,
    what: &str,
    accept: impl Fn(Option<&WorkflowResult>) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !accept(engine.poll::<Approval>(id).await.unwrap().as_ref()) {
        assert!(tokio::time::Instant::now() < deadline, "{what} within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn reads_and_fixes_a_running_cluster(database: TestDatabase) {
    let kind = database.kind();
    // The CLI cannot wake the runner: it picks the CLI's writes up at its next storage poll.
    let config = durable_cluster::ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(300),
        ..durable_cluster::ShardingConfig::default()
    };
    let (messages, runners) = database.open(&config).await.unwrap();
    let sharding =
        durable_cluster::Sharding::single_runner(config, messages, runners).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    Approval::register(&engine, approve).unwrap();
    let payload = ApprovalPayload { approval_id: format!("admin-{kind}") };
    let id = engine.execute_discard::<Approval>(payload).await.unwrap();
    wait_for(&engine, &id, "the approval suspends", |result| {
        result.is_some_and(WorkflowResult::is_suspended)
    })
    .await;

    // Resume: the run is reset, runs again and suspends again.
    let resumed = admin_json(&database, &["resume", "Approval", id.as_str()]).await;
    assert_eq!(resumed["changed"], true, "{kind}: {resumed}");
    wait_for(&engine, &id, "the approval suspends again", |result| {
        result.is_some_and(WorkflowResult::is_suspended)
    })
    .await;

    // Reads.
    let runners = admin_json(&database, &["runners"]).await;
    assert_eq!(runners.as_array().map(Vec::len), Some(1), "{kind}: {runners}");
    assert_eq!(runners[0]["alive"], true, "{kind}: {runners}");
    let shards = admin_json(&database, &["shards"]).await;
    let shards = shards.as_array().unwrap();
    assert_eq!(shards.len(), 300, "{kind}: the default 300 shards");
    assert!(shards.iter().all(|shard| shard["agrees"] == true), "{kind}: {shards:?}");
    let page = admin_json(&database, &["workflows", "--status", "suspended"]).await;
    let executions = page["executions"].as_array().unwrap();
    assert_eq!(executions.len(), 1, "{kind}: {page}");
    assert_eq!(executions[0]["executionId"], id.as_str(), "{kind}");
    assert_eq!(executions[0]["workflow"], "Approval", "{kind}");
    let none = admin_json(&database, &["workflows", "--status", "completed"]).await;
    assert_eq!(none["executions"], Value::Array(Vec::new()), "{kind}: {none}");
    let text = admin(&database, &["workflow", "Approval", id.as_str()]).await;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("suspended"), "{kind}: {text}");
    let backlog = admin_json(&database, &["backlog"]).await;
    assert!(backlog.is_array(), "{kind}: {backlog}");
    let stuck = admin_json(&database, &["stuck"]).await;
    assert_eq!(stuck["backlogs"], Value::Array(Vec::new()), "{kind}: {stuck}");
    let messages = admin_json(&database, &["messages", "--type", "Workflow/Approval"]).await;
    assert_eq!(messages.as_array().map(Vec::len), Some(1), "{kind}: {messages}");

    // Actions: complete the deferred, once.
    let done = admin_json(
        &database,
        &["complete", "Approval", id.as_str(), "approval", "--value", "\"ops\""],
    )
    .await;
    assert_eq!(done["changed"], true, "{kind}: {done}");
    wait_for(&engine, &id, "the approval completes", |result| {
        matches!(result, Some(WorkflowResult::Complete(_)))
    })
    .await;
    let again = admin_json(
        &database,
        &["complete", "Approval", id.as_str(), "approval", "--value", "\"ops\""],
    )
    .await;
    assert_eq!(again["changed"], false, "{kind}: {again}");
    let interrupt = admin_json(&database, &["interrupt", "Approval", id.as_str()]).await;
    assert_eq!(interrupt["changed"], false, "{kind}: a completed one is left alone");
    let detail = admin_json(&database, &["workflow", "Approval", id.as_str()]).await;
    assert_eq!(detail["execution"]["status"], "completed", "{kind}: {detail}");
    assert_eq!(detail["execution"]["result"]["exit"]["value"], "approved by ops", "{kind}");
    assert_eq!(detail["steps"][0]["kind"], "deferred", "{kind}: {detail}");

    an_execution_is_interrupted(&database, &engine).await;

    // Errors name their cause.
    let missing = admin(&database, &["workflow", "Approval", "nobody"]).await;
    assert_eq!(missing.status.code(), Some(1), "{kind}");
    assert!(String::from_utf8_lossy(&missing.stderr).contains("not found"), "{kind}");
    let reserved = admin(&database, &["complete", "Approval", id.as_str(), "Workflow/x"]).await;
    assert_eq!(reserved.status.code(), Some(1), "{kind}");
    assert!(String::from_utf8_lossy(&reserved.stderr).contains("reserves"), "{kind}");

    // Purge: the execution is gone, and a second purge changes nothing.
    let purged = admin_json(&database, &["purge", "Approval", id.as_str()]).await;
    assert_eq!(purged["changed"], true, "{kind}: {purged}");
    let gone = admin_json(&database, &["workflows"]).await;
    assert_eq!(gone["executions"], Value::Array(Vec::new()), "{kind}: {gone}");
    let twice = admin_json(&database, &["purge", "Approval", id.as_str()]).await;
    assert_eq!(twice["changed"], false, "{kind}: {twice}");
    sharding.shutdown().await;
    requests_are_released_cancelled_and_retried(&database).await;
}

/// `interrupt`: a waiting execution ends interrupted; a second interrupt changes nothing.
async fn an_execution_is_interrupted(database: &TestDatabase, engine: &WorkflowEngine) {
    let kind = database.kind();
    let other = ApprovalPayload { approval_id: format!("admin-{kind}-other") };
    let other = engine.execute_discard::<Approval>(other).await.unwrap();
    wait_for(engine, &other, "the other approval suspends", |result| {
        result.is_some_and(WorkflowResult::is_suspended)
    })
    .await;
    let interrupted = admin_json(database, &["interrupt", "Approval", other.as_str()]).await;
    assert_eq!(interrupted["changed"], true, "{kind}: {interrupted}");
    wait_for(engine, &other, "the interrupt ends it", |result| {
        matches!(result, Some(WorkflowResult::Complete(_)))
    })
    .await;
    let again = admin_json(database, &["interrupt", "Approval", other.as_str()]).await;
    assert_eq!(again["changed"], false, "{kind}: {again}");
    let page = admin_json(database, &["workflows", "--status", "interrupted"]).await;
    assert_eq!(page["executions"][0]["executionId"], other.as_str(), "{kind}: {page}");
    let purged = admin_json(database, &["purge", "Approval", other.as_str()]).await;
    assert_eq!(purged["changed"], true, "{kind}: {purged}");
}

/// `release`, `cancel` and `retry` on requests of an entity type nobody serves, written and
/// claimed directly in the storage (no runner runs).
async fn requests_are_released_cancelled_and_retried(database: &TestDatabase) {
    let kind = database.kind();
    let config = durable_cluster::ShardingConfig::default();
    let (messages, _) = database.open(&config).await.unwrap();
    let shard = config.shard_id("g1", &ShardGroup::default_group());
    let address = EntityAddress {
        shard_id: shard.clone(),
        entity_type: EntityType::from("Ghost"),
        entity_id: EntityId::from("g1"),
    };
    let request = |id: u64| Request {
        request_id: Snowflake::new(id),
        address: address.clone(),
        tag: "Haunt".into(),
        payload: RawJson::empty_object(),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    };
    let options = SaveRequestOptions::default();
    for id in [101, 102, 103] {
        messages.save_request(&request(id), &options).await.unwrap();
    }
    let answer = |id: u64, exit: Exit| {
        Reply::WithExit(WithExit {
            request_id: Snowflake::new(id),
            id: Snowflake::new(id + 1_000),
            exit,
        })
    };
    messages.save_reply(&answer(102, Exit::die_with_message("Error", "boom"))).await.unwrap();
    messages.save_reply(&answer(103, Exit::void())).await.unwrap();
    let now = cluster_core::Clock::now(&cluster_core::SystemClock);
    let claimed =
        messages.unprocessed_messages(&[shard], now, UnprocessedOptions::default()).await.unwrap();
    assert_eq!(claimed.messages.len(), 1, "{kind}: request 101 is claimed");

    let release = admin_json(database, &["release", "101"]).await;
    assert_eq!(release["changed"], true, "{kind}: {release}");
    let again = admin_json(database, &["release", "101"]).await;
    assert_eq!(again["changed"], false, "{kind}: {again}");
    let cancel = admin_json(database, &["cancel", "101"]).await;
    assert_eq!(cancel["changed"], true, "{kind}: {cancel}");
    let shown = admin_json(database, &["message", "101"]).await;
    assert_eq!(shown["interrupted"], true, "{kind}: {shown}");
    let again = admin_json(database, &["cancel", "101"]).await;
    assert_eq!(again["changed"], false, "{kind}: {again}");

    let retry = admin_json(database, &["retry", "102"]).await;
    assert_eq!(retry["changed"], true, "{kind}: {retry}");
    let shown = admin_json(database, &["message", "102"]).await;
    assert_eq!(shown["reply"], Value::Null, "{kind}: the defect is gone: {shown}");
    let again = admin_json(database, &["retry", "102"]).await;
    assert_eq!(again["changed"], false, "{kind}: {again}");
    let refused = admin(database, &["retry", "103"]).await;
    assert_eq!(refused.status.code(), Some(1), "{kind}: a success is not retried");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not a defect"), "{kind}");
    let missing = admin(database, &["release", "999"]).await;
    assert_eq!(missing.status.code(), Some(1), "{kind}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_fixes_a_running_cluster_on_sqlite() {
    reads_and_fixes_a_running_cluster(TestDatabase::sqlite("admin-cli")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_fixes_a_running_cluster_on_postgres() {
    if let Some(database) = TestDatabase::postgres() {
        reads_and_fixes_a_running_cluster(database).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_fixes_a_running_cluster_on_mysql() {
    if let Some(database) = TestDatabase::mysql() {
        reads_and_fixes_a_running_cluster(database).await;
    }
}

/// A URL that is not a storage, or names a file that does not exist, is a usage error (exit 2)
/// that names it and shows no password.
#[tokio::test]
async fn a_bad_storage_url_is_a_usage_error() {
    let run = |url: &'static str| async move {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_durable-cluster"))
            .args(["admin", "--storage", url, "runners"])
            .output()
            .await
            .unwrap();
        (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
    };
    let (code, stderr) = run("redis://user:hunter2@db:6379").await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("not postgres://"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "no password in an error: {stderr}");
    let (code, stderr) = run("sqlite:/nonexistent/cluster.db").await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no such database file"), "{stderr}");
}

/// A database that accepts the connection and never answers: the command gives up at its
/// `--timeout`, says so and exits 1, instead of waiting for ever.
#[tokio::test]
async fn a_silent_database_is_given_up_at_the_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accepts and holds every connection, answering nothing.
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let started = tokio::time::Instant::now();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_durable-cluster"))
        .args(["admin", "--timeout", "1 second"])
        .arg(format!("--storage=postgres://ops@127.0.0.1:{port}/app"))
        .arg("runners")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("did not answer within 1s"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    held.abort();
}
