//! The HTTP gateway (feature `http`) against the reference's own answers: the requests of
//! `tests/fixtures/http/reference.json` (captured from the reference's `EntityProxyServer` by
//! `interop/typescript/http_capture.mjs`) are sent, in order, over real HTTP to a gateway in
//! front of a runner on SQLite (and again on PostgreSQL) whose `Counter` entity and `Greet`
//! workflow behave as the reference's, and each answer's status and body must be the
//! reference's.
#![cfg(all(feature = "http", feature = "sqlite", feature = "rpc", feature = "workflow"))]

use std::net::SocketAddr;

use cluster_testkit::databases::TestDatabase;
use durable_cluster::http::HttpGateway;
use durable_cluster::workflow::{
    ExecutionId, Token, TokenKey, Workflow, WorkflowContext, WorkflowEngine,
};
use durable_cluster::{Entity, EntityContext, Protocol, RequestContext, Rpc, ShardingConfig};
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod support;

/// The reference's `Counter`: a count, changed by `Increment`, `Deposit` and `Reset`.
struct Counter {
    count: f64,
}

#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[derive(Serialize, Deserialize)]
struct Increment {
    amount: f64,
}

#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[derive(Serialize, Deserialize)]
struct Get;

#[derive(Serialize, Deserialize)]
struct Reset;

#[derive(Serialize, Deserialize)]
struct Whoami;

#[derive(Serialize, Deserialize)]
struct Reject {
    reason: String,
}

#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[derive(Serialize, Deserialize)]
struct Deposit {
    id: String,
    amount: f64,
}

/// The reference's tagged error `NegativeAmount`.
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "_tag", rename = "NegativeAmount")]
struct NegativeAmount {
    amount: f64,
}

/// The reference's tagged error `Rejected` (annotated 409 there; `error_status` here).
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "_tag", rename = "Rejected")]
struct Rejected {
    reason: String,
}

impl Rpc for Increment {
    const TAG: &'static str = "Increment";
    type Success = f64;
    type Error = NegativeAmount;
}

impl Rpc for Get {
    const TAG: &'static str = "Get";
    type Success = f64;
    type Error = durable_cluster::Never;
}

impl Rpc for Reset {
    const TAG: &'static str = "Reset";
    type Success = ();
    type Error = durable_cluster::Never;
}

impl Rpc for Whoami {
    const TAG: &'static str = "Whoami";
    type Success = String;
    type Error = durable_cluster::Never;
}

impl Rpc for Reject {
    const TAG: &'static str = "Reject";
    type Success = ();
    type Error = Rejected;
}

impl Rpc for Deposit {
    const TAG: &'static str = "Deposit";
    const PERSISTED: bool = true;
    type Success = f64;
    type Error = durable_cluster::Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.id.clone())
    }
}

impl Entity for Counter {
    const TYPE: &'static str = "Counter";

    async fn create(_: &EntityContext) -> Counter {
        Counter { count: 0.0 }
    }

    fn protocol(protocol: &mut Protocol<Counter>) {
        protocol
            .handle::<Increment>()
            .handle::<Get>()
            .handle::<Reset>()
            .handle::<Whoami>()
            .handle::<Reject>()
            .handle::<Deposit>();
    }
}

impl durable_cluster::Handler<Increment> for Counter {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Increment,
    ) -> Result<f64, NegativeAmount> {
        if request.amount < 0.0 {
            return Err(NegativeAmount { amount: request.amount });
        }
        self.count += request.amount;
        Ok(self.count)
    }
}

impl durable_cluster::Handler<Get> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Get) -> Result<f64, durable_cluster::Never> {
        Ok(self.count)
    }
}

impl durable_cluster::Handler<Reset> for Counter {
    async fn handle(&mut self, _: &RequestContext, _: Reset) -> Result<(), durable_cluster::Never> {
        self.count = 0.0;
        Ok(())
    }
}

impl durable_cluster::Handler<Whoami> for Counter {
    async fn handle(
        &mut self,
        context: &RequestContext,
        _: Whoami,
    ) -> Result<String, durable_cluster::Never> {
        Ok(context.address().entity_id.as_str().to_owned())
    }
}

impl durable_cluster::Handler<Reject> for Counter {
    async fn handle(&mut self, _: &RequestContext, request: Reject) -> Result<(), Rejected> {
        Err(Rejected { reason: request.reason })
    }
}

impl durable_cluster::Handler<Deposit> for Counter {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Deposit,
    ) -> Result<f64, durable_cluster::Never> {
        self.count += request.amount;
        Ok(self.count)
    }
}

/// The reference's `Greet` workflow: greets `name`; an empty name is refused, `boom` dies.
struct Greet;

#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[derive(Serialize, Deserialize)]
struct GreetPayload {
    name: String,
}

/// The reference's tagged error `GreetRefused`.
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "_tag", rename = "GreetRefused")]
struct GreetRefused {
    name: String,
}

impl Workflow for Greet {
    const NAME: &'static str = "Greet";
    type Payload = GreetPayload;
    type Success = String;
    type Error = GreetRefused;

    fn idempotency_key(payload: &GreetPayload) -> String {
        payload.name.clone()
    }
}

async fn greet(_: WorkflowContext, payload: GreetPayload) -> Result<String, GreetRefused> {
    match payload.name.as_str() {
        "" => Err(GreetRefused { name: payload.name }),
        "boom" => panic!("boom"),
        name => Ok(format!("Hello, {name}!")),
    }
}

use support::{Answer, Approval, approval, approve, exchange};

/// Whether two JSON values are equal, numbers compared as numbers (`5` and `5.0`).
fn same_json(left: &Value, right: &Value) -> bool {
    match (left, right) {
        (Value::Number(left), Value::Number(right)) => left.as_f64() == right.as_f64(),
        (Value::Array(left), Value::Array(right)) => {
            left.len() == right.len() && left.iter().zip(right).all(|(l, r)| same_json(l, r))
        }
        (Value::Object(left), Value::Object(right)) => {
            left.len() == right.len()
                && left.iter().all(|(key, l)| right.get(key).is_some_and(|r| same_json(l, r)))
        }
        _ => left == right,
    }
}

/// Cases of other groups, or whose answer differs on purpose (each with why).
const NOT_REPLAYED: &[(&str, &str)] = &[
    ("boom_defect", "the Rust Counter has no Boom (tests/security.rs answers a panic with 500)"),
    ("boom_defect_entity_still_serves", "follows boom_defect"),
    ("client_boom_defect", "as boom_defect"),
    (
        "amount_nan_string",
        "Rust's f64 reads no \"NaN\" string (the reference's Schema.Number does)",
    ),
    ("amount_infinity_string", "as amount_nan_string"),
    ("large_body_11mb", "the gateway limits bodies (413, tested below); the reference does not"),
    (
        "deposit_persistence_error",
        "a failing storage: a_storage_failure_answers_the_references_persistence_error",
    ),
    ("deposit_persistence_error_discard", "as deposit_persistence_error"),
    ("client_deposit_persistence_error", "as deposit_persistence_error"),
];

/// A gateway serving `Counter` and `Greet` (with `Rejected` answered 409, as the reference's
/// annotation says) in front of a single runner on a database of the test's own.
struct Gateway {
    address: SocketAddr,
    sharding: durable_cluster::Sharding,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    /// Removed (its file or its tables) when the gateway stops.
    database: TestDatabase,
}

impl Gateway {
    /// A gateway on an SQLite file named after `name`.
    async fn start(name: &'static str) -> Gateway {
        Gateway::on(TestDatabase::sqlite(name)).await
    }

    /// A gateway on an SQLite file named after `name` that lets anyone act on an execution, as
    /// the reference's workflow proxy does: what its captured cases and its client expect.
    async fn open_as_the_reference(name: &'static str) -> Gateway {
        Gateway::open_on(TestDatabase::sqlite(name)).await
    }

    /// A gateway on `database`.
    async fn on(database: TestDatabase) -> Gateway {
        Gateway::serve(database, false).await
    }

    /// A gateway on `database` that lets anyone act on an execution.
    async fn open_on(database: TestDatabase) -> Gateway {
        Gateway::serve(database, true).await
    }

    /// A gateway on `database`; `open` lets anyone act on an execution (an authorizer that
    /// says yes), otherwise only the holders of capabilities signed with [`token_key`].
    async fn serve(database: TestDatabase, open: bool) -> Gateway {
        let sharding = support::single_runner(&database).await;
        sharding.entity::<Counter>().register().unwrap();
        let engine = WorkflowEngine::cluster(&sharding).unwrap();
        Greet::register(&engine, greet).unwrap();
        Approval::register(&engine, approve).unwrap();
        let mut gateway = HttpGateway::new(sharding.clone())
            .workflow::<Greet>(&engine)
            .workflow::<Approval>(&engine)
            .workflow_tokens(token_key())
            .entity::<Counter>()
            .error_status("Rejected", 409)
            .unwrap();
        if open {
            gateway = gateway.workflow_authorizer(|_| true);
        }
        let router = gateway.router();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, router).await });
        Gateway { address, sharding, server, database }
    }

    async fn stop(self) {
        self.server.abort();
        self.sharding.shutdown().await;
        drop(self.database);
    }
}

/// The key the test gateway checks capabilities with.
fn token_key() -> TokenKey {
    TokenKey::from_hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f").unwrap()
}

/// The body of the poll, resume and interrupt routes: the execution and its signed handle.
fn on_execution(execution_id: &str) -> String {
    let handle = token_key().sign_execution("Approval", &ExecutionId::from_raw(execution_id));
    serde_json::json!({ "executionId": execution_id, "token": handle }).to_string()
}

/// The reference's captured cases.
fn fixtures() -> Value {
    serde_json::from_str(include_str!("fixtures/http/reference.json")).unwrap()
}

/// Sends the reference's cases to `gateway` and compares each answer with the reference's.
async fn replay_the_references_cases(gateway: Gateway) {
    let fixtures = fixtures();
    let address = gateway.address;

    let mut replayed = 0;
    for case in fixtures.as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let request = &case["request"];
        let path = request["path"].as_str().unwrap();
        let group = path.split('/').find(|segment| !segment.is_empty()).unwrap_or_default();
        // The forced errors, the mailbox entity and the OpenAPI document are not served here.
        let other = ["forced", "sleep", "crash", "openapi.json"]
            .iter()
            .any(|other| group.eq_ignore_ascii_case(other));
        if other || NOT_REPLAYED.iter().any(|(skipped, _)| *skipped == name) {
            continue;
        }
        let headers: Vec<(String, String)> = request["headers"]
            .as_object()
            .map(|headers| {
                headers
                    .iter()
                    .filter(|(name, _)| {
                        !["host", "content-length", "b3", "traceparent", "connection"]
                            .contains(&name.as_str())
                    })
                    .map(|(name, value)| (name.clone(), value.as_str().unwrap().to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let body = request["body"].as_str().unwrap_or_default();
        let method = request["method"].as_str().unwrap();
        let expected = &case["response"];
        let status = expected["status"].as_u64().unwrap();
        let typed = headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("content-type"));
        let headers = if typed || method != "POST" || status == 404 {
            headers
        } else {
            // Unlike the reference, a POST without a content type is refused (a browser sends
            // it without a CORS preflight); with the JSON type it is the reference's case.
            let answer = exchange(address, method, path, &headers, body.as_bytes()).await;
            assert_eq!(answer.status, 415, "{name} without a content type: {answer:?}");
            let mut headers = headers;
            headers.push(("content-type".to_owned(), "application/json".to_owned()));
            headers
        };
        let answer = exchange(address, method, path, &headers, body.as_bytes()).await;
        assert_eq!(u64::from(answer.status), status, "{name}: status; got {answer:?}");
        let expected_body = expected["body"].as_str().unwrap_or_default();
        if status == 400 {
            // The reference answers 400 with an empty body; the gateway says why.
            assert!(answer.body.contains("HttpApiSchemaError"), "{name}: {answer:?}");
        } else if let Some(json) = expected.get("json") {
            let got: Value = serde_json::from_str(&answer.body)
                .unwrap_or_else(|error| panic!("{name}: not JSON ({error}): {answer:?}"));
            assert!(same_json(&got, json), "{name}: body {got} instead of {json}");
            assert_eq!(answer.content_type.as_deref(), Some("application/json"), "{name}");
        } else {
            assert_eq!(answer.body, expected_body, "{name}: body");
        }
        replayed += 1;
    }
    // Most of the entity cases: a regenerated fixture that lost them fails here.
    assert!(replayed >= 85, "only {replayed} cases replayed");

    // Beyond the reference: a body over the limit is refused.
    let big = format!("{{\"amount\":1,\"pad\":\"{}\"}}", "x".repeat(5 * 1024 * 1024));
    let json = [("content-type".to_owned(), "application/json".to_owned())];
    let answer = exchange(address, "POST", "/increment/big", &json, big.as_bytes()).await;
    assert_eq!(answer.status, 413, "{answer:?}");

    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_as_the_reference() {
    replay_the_references_cases(Gateway::open_as_the_reference("http-reference").await).await;
}

/// The same cases with the runner's storage on PostgreSQL (the persisted `Deposit` and the
/// workflows go through its tables).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_as_the_reference_on_postgres() {
    if let Some(database) = TestDatabase::postgres() {
        replay_the_references_cases(Gateway::open_on(database).await).await;
    }
}

/// Client cases whose answer differs on purpose (see `NOT_REPLAYED`).
const CLIENT_NOT_COMPARED: &[&str] = &["client_boom_defect", "client_deposit_persistence_error"];

/// Effect's own `HttpApiClient`, made from the reference's definition of the API
/// (`interop/typescript/http_proxy_server.mjs`), calls the Rust gateway: each call must end as
/// it ended against the reference (the value, or the typed error with its fields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_http_api_client_works_against_the_gateway() {
    let package = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../interop/typescript");
    let node = std::process::Command::new("node").arg("--version").output().is_ok();
    let installed = package.join("node_modules/effect/package.json").is_file();
    if !node || !installed {
        let missing = if node { "interop/typescript/node_modules" } else { "node" };
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{missing} is missing and CI=true: install Node.js and run `npm ci --prefix interop/typescript`"
        );
        #[expect(clippy::print_stderr, reason = "a skipped test says why")]
        {
            eprintln!("skipped: {missing} is missing (`npm ci --prefix interop/typescript`)");
        }
        return;
    }
    let fixtures = fixtures();
    let gateway = Gateway::open_as_the_reference("http-client").await;
    let port = gateway.address.port().to_string();
    let output = tokio::process::Command::new("node")
        .arg("http_capture.mjs")
        .args(["--client-only", &port])
        .current_dir(&package)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(std::time::Duration::from_secs(120), output)
        .await
        .expect("the TypeScript client finishes within 2 minutes")
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let results: Value = serde_json::from_slice(&output.stdout).unwrap();
    let mut compared = 0;
    for result in results.as_array().unwrap() {
        let name = result["name"].as_str().unwrap();
        if CLIENT_NOT_COMPARED.contains(&name) {
            continue;
        }
        let expected = fixtures
            .as_array()
            .unwrap()
            .iter()
            .find(|case| case["name"] == name)
            .unwrap_or_else(|| panic!("{name} is not in the fixtures"));
        assert_eq!(result["status"], expected["response"]["status"], "{name}: status");
        assert!(
            same_json(&result["clientResult"], &expected["clientResult"]),
            "{name}: the client got {} against the gateway, {} against the reference",
            result["clientResult"],
            expected["clientResult"]
        );
        compared += 1;
    }
    assert!(compared >= 12, "only {compared} client calls compared");
    gateway.stop().await;
}

/// `GET /openapi.json` lists the reference's operations for the same entity and workflow: the
/// same paths, operation ids (after the group name) and at least the same statuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_lists_the_references_operations() {
    let reference: Value =
        serde_json::from_str(include_str!("fixtures/http/reference-openapi.json")).unwrap();
    let gateway = Gateway::start("http-openapi").await;
    let answer = exchange(gateway.address, "GET", "/openapi.json", &[], b"").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.content_type.as_deref(), Some("application/json"));
    let ours: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(ours["openapi"], "3.1.0");
    let operation_name = |operation: &Value| {
        let id = operation["operationId"].as_str().unwrap_or_default().to_owned();
        id.split_once('.').map(|(_, name)| name.to_owned()).unwrap_or(id)
    };
    let statuses = |operation: &Value| -> std::collections::BTreeSet<String> {
        operation["responses"]
            .as_object()
            .map(|map| map.keys().cloned().collect())
            .unwrap_or_default()
    };
    let mut compared = 0;
    for (path, item) in reference["paths"].as_object().unwrap() {
        // Request types the Rust `Counter` does not have (the reference's defect and mailbox
        // entities).
        if ["/boom", "/sleep", "/crash"].iter().any(|skipped| path.starts_with(skipped)) {
            continue;
        }
        let expected = &item["post"];
        let found = &ours["paths"][path]["post"];
        assert!(found.is_object(), "{path} is missing from {}", ours["paths"]);
        assert_eq!(operation_name(found), operation_name(expected), "{path}: operation id");
        assert!(
            statuses(found).is_superset(&statuses(expected)),
            "{path}: statuses {:?}, the reference's {:?}",
            statuses(found),
            statuses(expected)
        );
        compared += 1;
    }
    assert_eq!(compared, 15);
    // The cluster errors are components under the reference's names.
    for name in [
        "_effect_cluster_ClusterError_MailboxFullEncoded",
        "_effect_cluster_ClusterError_AlreadyProcessingMessageEncoded",
        "_effect_cluster_ClusterError_PersistenceErrorEncoded",
        "_effect_cluster_ClusterError_EntityNotAssignedToRunnerEncoded",
        "_effect_cluster_EntityAddressEncoded",
    ] {
        assert!(ours["components"]["schemas"][name].is_object(), "{name}");
    }
    gateway.stop().await;
}

/// A storage that fails while the gateway saves a persisted request: the reference's
/// `PersistenceError` form, the storage's own message never shown, and the next request served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storage_failure_answers_the_references_persistence_error() {
    use durable_cluster::storage::sqlite::{
        SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage,
    };
    use durable_cluster::storage::{SqlStorageOptions, TablePrefix};

    let name = "http-persistence";
    support::remove_database(name);
    let path = support::database(name);
    let config = ShardingConfig::default();
    let options = SqlStorageOptions::from_config(&config, TablePrefix::default());
    let messages =
        SqliteMessageStorage::open(&path, SqliteOptions::new(options.clone())).await.unwrap();
    let runners = SqliteRunnerStorage::open(&path, SqliteOptions::new(options)).await.unwrap();
    let (messages, faults) =
        cluster_testkit::faulty::FaultyMessageStorage::new(std::sync::Arc::new(messages));
    let sharding = durable_cluster::Sharding::single_runner(
        config,
        std::sync::Arc::new(messages),
        std::sync::Arc::new(runners),
    )
    .start()
    .await
    .unwrap();
    sharding.entity::<Counter>().register().unwrap();
    let router = HttpGateway::new(sharding.clone()).entity::<Counter>().router();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let json = [("content-type".to_owned(), "application/json".to_owned())];
    let body = br#"{"id":"d1","amount":2}"#;

    faults.fail_request_saves(1_000);
    for path in ["/deposit/e1", "/deposit/e1/discard"] {
        let answer = exchange(address, "POST", path, &json, body).await;
        assert_eq!(answer.status, 500, "{path}: {answer:?}");
        let error: Value = serde_json::from_str(&answer.body).unwrap();
        assert_eq!(error["_tag"], "PersistenceError", "{path}: {error}");
        assert_eq!(error["cause"]["name"], "Error", "{path}: {error}");
        assert!(
            !answer.body.contains("injected"),
            "{path}: the storage's message is shown: {error}"
        );
    }
    faults.fail_request_saves(0);
    let answer = exchange(address, "POST", "/deposit/e1", &json, body).await;
    assert_eq!((answer.status, answer.body.as_str()), (200, "2.0"), "{answer:?}");

    server.abort();
    sharding.shutdown().await;
    support::remove_database(name);
}

/// `POST /{name}/poll` until `done` accepts the stored result, at most 20 seconds.
async fn poll_until(
    address: SocketAddr,
    execution_id: &str,
    done: impl Fn(&str) -> bool,
) -> String {
    let json = [("content-type".to_owned(), "application/json".to_owned())];
    let body = on_execution(execution_id);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let answer = exchange(address, "POST", "/approval/poll", &json, body.as_bytes()).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        if done(&answer.body) {
            return answer.body;
        }
        assert!(tokio::time::Instant::now() < deadline, "still {}", answer.body);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Beyond the reference's routes: an execution is polled, a deferred completed from its token
/// (as a webhook would), and another execution interrupted, all over HTTP.
async fn deferred_poll_and_interrupt(gateway: Gateway) {
    let address = gateway.address;
    let json = [("content-type".to_owned(), "application/json".to_owned())];
    let started =
        exchange(address, "POST", "/approval/discard", &json, br#"{"approval_id":"a1"}"#).await;
    assert_eq!(started.status, 200, "{started:?}");
    let execution_id: String = serde_json::from_str(&started.body).unwrap();
    let suspended = poll_until(address, &execution_id, |body| body.contains("Suspended")).await;
    assert!(suspended.starts_with(r#"{"_tag":"Suspended""#), "{suspended}");

    let token = approval().token_for::<Approval>(&ExecutionId::from_raw(execution_id.clone()));
    let path = format!("/deferred/{}", token_key().sign(&token));
    let completed = exchange(address, "POST", &path, &json, br#""alice""#).await;
    assert_eq!(completed.status, 204, "{completed:?}");
    let executed = exchange(address, "POST", "/approval", &json, br#"{"approval_id":"a1"}"#).await;
    assert_eq!((executed.status, executed.body.as_str()), (200, r#""approved by alice""#));
    let result = poll_until(address, &execution_id, |body| body.contains("Complete")).await;
    assert!(result.contains("approved by alice"), "{result}");

    // A token that does not read, and one of a workflow not served here.
    let bad = exchange(address, "POST", "/deferred/not-a-token!", &json, b"1").await;
    assert_eq!(bad.status, 400, "{bad:?}");
    let other = Token {
        workflow: "Elsewhere".to_owned(),
        execution_id: ExecutionId::from_raw("x"),
        deferred: "approval".to_owned(),
    };
    let path = format!("/deferred/{}", other.encode());
    assert_eq!(exchange(address, "POST", &path, &json, b"1").await.status, 404);

    // Another execution, interrupted while it waits.
    let started =
        exchange(address, "POST", "/approval/discard", &json, br#"{"approval_id":"a2"}"#).await;
    let execution_id: String = serde_json::from_str(&started.body).unwrap();
    poll_until(address, &execution_id, |body| body.contains("Suspended")).await;
    let body = on_execution(&execution_id);
    let interrupted =
        exchange(address, "POST", "/approval/interrupt", &json, body.as_bytes()).await;
    assert_eq!(interrupted.status, 204, "{interrupted:?}");
    let result = poll_until(address, &execution_id, |body| body.contains("Complete")).await;
    assert!(result.contains("Interrupt"), "{result}");
    gateway.stop().await;
}

/// The workflow routes that act on an existing execution take capabilities, not names: a
/// plain or forged token, another key's, one bent to another deferred or execution, a name the
/// engine keeps for itself, and an execution that does not exist yet are all refused, and
/// nothing reaches the execution. Before capabilities each of these was 204 (an outsider
/// approved someone else's execution, or interrupted it through `Workflow/InterruptSignal`).
async fn workflow_routes_need_a_capability(gateway: Gateway) {
    let address = gateway.address;
    let json = [("content-type".to_owned(), "application/json".to_owned())];
    let started =
        exchange(address, "POST", "/approval/discard", &json, br#"{"approval_id":"c1"}"#).await;
    let execution_id: String = serde_json::from_str(&started.body).unwrap();
    let execution = ExecutionId::from_raw(execution_id.clone());
    poll_until(address, &execution_id, |body| body.contains("Suspended")).await;
    let deferred = |name: &str| Token {
        workflow: "Approval".to_owned(),
        execution_id: execution.clone(),
        deferred: name.to_owned(),
    };
    let other_key = TokenKey::new(&[9; 32]).unwrap();
    let signed = token_key().sign(&deferred("approval"));
    let (_, tag) = signed.rsplit_once('.').unwrap();
    let later = ExecutionId::derive("Approval", "not-started-yet");
    let refused = [
        (deferred("approval").encode(), 403, "a plain token"),
        (other_key.sign(&deferred("approval")), 403, "another key's token"),
        (format!("{}.{tag}", deferred("other").encode()), 403, "a tag moved to another deferred"),
        (token_key().sign(&deferred("Workflow/InterruptSignal")), 403, "the interrupt signal"),
        (
            token_key().sign(&Token { execution_id: later, ..deferred("approval") }),
            404,
            "an execution that does not exist yet",
        ),
    ];
    for (token, status, what) in refused {
        let path = format!("/deferred/{token}");
        let answer = exchange(address, "POST", &path, &json, br#""mallory""#).await;
        assert_eq!(answer.status, status, "{what}: {answer:?}");
    }
    // Acting on the execution: no handle, another execution's, another key's.
    let other = token_key().sign_execution("Approval", &ExecutionId::from_raw("elsewhere"));
    let bodies = [
        serde_json::json!({ "executionId": execution_id }),
        serde_json::json!({ "executionId": execution_id, "token": other }),
        serde_json::json!({
            "executionId": execution_id,
            "token": other_key.sign_execution("Approval", &execution),
        }),
    ];
    for route in ["/approval/interrupt", "/approval/resume", "/approval/poll"] {
        for body in &bodies {
            let answer = exchange(address, "POST", route, &json, body.to_string().as_bytes()).await;
            assert_eq!(answer.status, 403, "{route} with {body}: {answer:?}");
        }
    }
    // Untouched: still waiting; the genuine capability completes it.
    let still = poll_until(address, &execution_id, |body| body.contains("Suspended")).await;
    assert!(still.starts_with(r#"{"_tag":"Suspended""#), "{still}");
    let path = format!("/deferred/{signed}");
    assert_eq!(exchange(address, "POST", &path, &json, br#""alice""#).await.status, 204);
    let result = poll_until(address, &execution_id, |body| body.contains("Complete")).await;
    assert!(result.contains("approved by alice"), "{result}");
    // Sent again, the capability changes nothing: the first completion won.
    assert_eq!(exchange(address, "POST", &path, &json, br#""mallory""#).await.status, 204);
    let result = poll_until(address, &execution_id, |body| body.contains("Complete")).await;
    assert!(result.contains("approved by alice"), "{result}");
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflow_routes_need_a_capability_on_sqlite() {
    workflow_routes_need_a_capability(Gateway::start("http-capabilities").await).await;
}

/// A gateway with neither a token key nor an authorizer refuses every route that acts on an
/// existing execution; an authorizer decides them from the request's headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_the_authorizer_decides_and_without_either_nothing_passes() {
    let database = TestDatabase::sqlite("http-authorizer");
    let sharding = support::single_runner(&database).await;
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    Approval::register(&engine, approve).unwrap();
    let serve = |router: axum::Router| async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        (address, tokio::spawn(async move { axum::serve(listener, router).await }))
    };
    let closed = HttpGateway::new(sharding.clone()).workflow::<Approval>(&engine).router();
    let admins = HttpGateway::new(sharding.clone())
        .workflow::<Approval>(&engine)
        .workflow_authorizer(|access| access.headers.get("x-role").is_some_and(|r| r == "admin"))
        .router();
    let ((closed, closed_server), (admins, admins_server)) =
        (serve(closed).await, serve(admins).await);
    let json = [("content-type".to_owned(), "application/json".to_owned())];
    let started =
        exchange(closed, "POST", "/approval/discard", &json, br#"{"approval_id":"z1"}"#).await;
    assert_eq!(started.status, 200, "starting needs no capability: {started:?}");
    let execution_id: String = serde_json::from_str(&started.body).unwrap();
    let body = serde_json::json!({ "executionId": execution_id }).to_string();
    let token = approval().token_for::<Approval>(&ExecutionId::from_raw(execution_id.clone()));
    let path = format!("/deferred/{}", token.encode());
    for address in [closed, admins] {
        assert_eq!(
            exchange(address, "POST", "/approval/poll", &json, body.as_bytes()).await.status,
            403
        );
        assert_eq!(exchange(address, "POST", &path, &json, br#""x""#).await.status, 403);
    }
    let admin = [
        ("content-type".to_owned(), "application/json".to_owned()),
        ("x-role".to_owned(), "admin".to_owned()),
    ];
    let polled = exchange(admins, "POST", "/approval/poll", &admin, body.as_bytes()).await;
    assert_eq!(polled.status, 200, "{polled:?}");
    assert_eq!(exchange(admins, "POST", &path, &admin, br#""root""#).await.status, 204);
    closed_server.abort();
    admins_server.abort();
    sharding.shutdown().await;
    drop(database);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_is_completed_from_its_token_and_executions_polled_and_interrupted() {
    deferred_poll_and_interrupt(Gateway::start("http-deferred").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_is_completed_and_executions_polled_and_interrupted_on_postgres() {
    if let Some(database) = TestDatabase::postgres() {
        deferred_poll_and_interrupt(Gateway::on(database).await).await;
    }
}

/// Arbitrary JSON values, nested a few levels.
fn any_json() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(
            |number| serde_json::Number::from_f64(number).map_or(Value::Null, Value::Number)
        ),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map("(amount|id|reason|name|[a-z]{1,6})", inner, 0..4)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// An answer is never a 5xx unless it carries a handler's own typed error.
fn only_typed_errors_are_5xx(answer: &Answer) -> Result<(), String> {
    if answer.status < 500 {
        return Ok(());
    }
    let tag = serde_json::from_str::<Value>(&answer.body)
        .ok()
        .and_then(|body| body.get("_tag").and_then(Value::as_str).map(str::to_owned));
    match tag.as_deref() {
        Some("NegativeAmount" | "GreetRefused") => Ok(()),
        _ => Err(format!("a 5xx that is not a typed error: {answer:?}")),
    }
}

/// The JSON boundary: arbitrary bytes and arbitrary JSON sent to every route of the gateway's
/// OpenAPI document, and arbitrary paths, never give a 5xx other than a handler's own error
/// (and never a panic: the gateway keeps answering).
#[test]
fn arbitrary_input_never_gives_a_server_error() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let gateway = runtime.block_on(Gateway::start("http-boundary"));
    let address = gateway.address;
    let json = [("content-type".to_owned(), "application/json".to_owned())];
    // A runner counts its successes across runs: one per property.
    let runner = || TestRunner::new(Config { cases: 200, ..Config::default() });
    // The routes come from the gateway's OpenAPI document: every operation it lists is tried.
    let document = runtime.block_on(exchange(address, "GET", "/openapi.json", &[], b""));
    let document: Value = serde_json::from_str(&document.body).unwrap();
    let routes: Vec<String> = document["paths"].as_object().unwrap().keys().cloned().collect();
    assert!(routes.len() >= 15, "{routes:?}");
    let route = || proptest::sample::select(routes.clone());
    let sent = std::sync::atomic::AtomicUsize::new(0);
    let path_of = |route: &str, id: &str| route.replace("{entityId}", id);

    let bodies = (route(), proptest::collection::vec(any::<u8>(), 0..64));
    runner()
        .run(&bodies, |(route, body)| {
            sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let answer =
                runtime.block_on(exchange(address, "POST", &path_of(&route, "p1"), &json, &body));
            only_typed_errors_are_5xx(&answer).map_err(TestCaseError::fail)
        })
        .unwrap();

    let values = (route(), any_json(), "[ -~]{1,8}");
    runner()
        .run(&values, |(route, value, id)| {
            let id: String = id.chars().filter(char::is_ascii_alphanumeric).collect();
            let id = if id.is_empty() { "p2".to_owned() } else { id };
            let body = value.to_string();
            let path = path_of(&route, &id);
            sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let answer = runtime.block_on(exchange(address, "POST", &path, &json, body.as_bytes()));
            only_typed_errors_are_5xx(&answer).map_err(TestCaseError::fail)
        })
        .unwrap();

    // Paths of arbitrary printable segments (escapes included), valid or not.
    let paths = proptest::collection::vec("[ -~]{0,12}", 0..5);
    runner()
        .run(&paths, |segments| {
            let path: String = segments
                .iter()
                .map(|segment| format!("/{}", segment.replace([' ', '#', '?'], "%20")))
                .collect();
            let path = if path.is_empty() { "/".to_owned() } else { path };
            sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let answer = runtime.block_on(exchange(address, "POST", &path, &json, b"{}"));
            only_typed_errors_are_5xx(&answer).map_err(TestCaseError::fail)
        })
        .unwrap();

    // Every case ran (a strategy that rejects its values would run none).
    let sent = sent.into_inner();
    assert!(sent >= 600, "{sent} cases sent");
    runtime.block_on(gateway.stop());
}

/// The schemas documented with `schemars` take the place of the open ones: the payload, the
/// success and the typed error of a call route, the payload only of its discard route (whose
/// cluster errors stay), the components they refer to; a `Never` error is left out; a type not
/// documented keeps open schemas; a workflow's payload, success and error.
#[cfg(feature = "schemars")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_schemas_take_the_place_of_the_open_ones() {
    let database = TestDatabase::sqlite("http-schemas");
    let sharding = support::single_runner(&database).await;
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    let document = HttpGateway::new(sharding.clone())
        .entity::<Counter>()
        .workflow::<Greet>(&engine)
        .schemas::<Counter, Increment>()
        .schemas::<Counter, Deposit>()
        .workflow_schemas::<Greet>()
        .openapi();
    let operation = |path: &str| document["paths"][path]["post"].clone();
    let body = |path: &str| {
        operation(path)["requestBody"]["content"]["application/json"]["schema"].clone()
    };
    let answer = |path: &str, status: &str| {
        operation(path)["responses"][status]["content"]["application/json"]["schema"].clone()
    };
    let reference =
        |name: &str| serde_json::json!({ "$ref": format!("#/components/schemas/{name}") });
    let cluster = |name: &str| reference(&format!("_effect_cluster_ClusterError_{name}Encoded"));

    assert_eq!(body("/increment/{entityId}"), reference("Increment"));
    assert_eq!(answer("/increment/{entityId}", "200")["type"], "number");
    let errors = answer("/increment/{entityId}", "500")["anyOf"].clone();
    assert_eq!(errors[0], reference("NegativeAmount"), "{errors}");
    assert_eq!(errors.as_array().unwrap().len(), 5, "{errors}");
    let increment = &document["components"]["schemas"]["Increment"];
    assert_eq!(increment["properties"]["amount"]["type"], "number", "{increment}");
    assert_eq!(increment["required"], serde_json::json!(["amount"]), "{increment}");
    assert!(document["components"]["schemas"].get("NegativeAmount").is_some());

    // The discard route: the payload; its cluster errors untouched.
    assert_eq!(body("/increment/{entityId}/discard"), reference("Increment"));
    let errors = answer("/increment/{entityId}/discard", "500")["anyOf"].clone();
    let expected = ["MailboxFull", "AlreadyProcessingMessage", "PersistenceError"].map(cluster);
    assert_eq!(errors, serde_json::json!(expected));

    // `Deposit` cannot fail: its 500 answers the cluster errors only.
    let errors = answer("/deposit/{entityId}", "500")["anyOf"].clone();
    assert_eq!(errors.as_array().unwrap().len(), 4, "{errors}");
    assert_eq!(errors[0], cluster("MailboxFull"), "{errors}");

    // `Get` is not documented: open schemas.
    assert_eq!(body("/get/{entityId}"), serde_json::json!({}));
    assert_eq!(answer("/get/{entityId}", "200"), serde_json::json!({}));

    // The workflow: payload, success and error; its discard route's payload.
    assert_eq!(body("/greet"), reference("GreetPayload"));
    assert_eq!(body("/greet/discard"), reference("GreetPayload"));
    assert_eq!(answer("/greet", "200")["type"], "string");
    assert_eq!(answer("/greet", "500"), reference("GreetRefused"));
    // The gateway's own answers are documented on every route.
    for path in ["/increment/{entityId}", "/greet", "/greet/discard", "/deferred/{token}"] {
        assert_eq!(answer(path, "400"), reference("HttpApiSchemaError"), "{path}");
        let responses = &operation(path)["responses"];
        for status in ["413", "415", "504"] {
            assert!(responses.get(status).is_some(), "{path} {status}: {responses}");
        }
    }

    sharding.shutdown().await;
}
