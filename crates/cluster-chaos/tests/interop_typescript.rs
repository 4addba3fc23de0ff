//! Interoperability with a real TypeScript runner of the reference: effect 4.1.0 on Node.js
//! (`interop/typescript/runner.mjs`), on one PostgreSQL database with a Rust runner
//! (`durable_cluster::Runner`).
//!
//! Both sides declare the entity type `InteropEcho` with the same names and JSON forms: the
//! persisted request `Echo` (deduplicated by its `key`) and the volatile request `Ping`.
//!
//! - `a_typescript_client_gets_every_reply_from_a_rust_runner`: a client-only TypeScript
//!   process sends persisted requests to a Rust runner that owns every shard, and gets every
//!   reply once, a typed error included; the two sides compute the same shard for every id.
//! - `a_rust_runner_and_a_typescript_runner_share_the_shards`: a TypeScript runner and a Rust
//!   runner split the shards as the hash ring says; persisted requests cross both ways and
//!   are deduplicated across sides; a volatile request to the TypeScript runner fails with
//!   `RunnerUnavailable`; when the TypeScript runner leaves, the Rust runner takes its shards.
//! - `a_typescript_runner_keeps_its_shards_while_a_rust_runner_checks_health`: a Rust runner
//!   that holds the runner-health singleton and checks every half second never marks the
//!   TypeScript runner, which its transport cannot reach, unhealthy (the default
//!   `runner_health_check`, `ping-known`).
//!
//! What the tests need: `CLUSTER_TEST_POSTGRES_URL`, `node` on the `PATH` and the packages of
//! `interop/typescript` (`npm ci --prefix interop/typescript`). Without them a test says why
//! and passes, except under `CI=true`, where it fails.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_chaos::chaos::free_port;
use cluster_core::{Clock, ClusterError, HashRing, RunnerAddress, ShardGroup, SystemClock};
use cluster_sharding::{
    CallError, Entity, EntityContext, Handler, Protocol, RequestContext, Rpc, Sharding,
};
use cluster_storage_sql::TablePrefix;
use cluster_testkit::wait::eventually;
use durable_cluster::{Role, Runner, RunnerEnv};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::time::Instant;

/// Shards per group on both sides (small, so that both runners get some quickly).
const SHARDS: u32 = 30;

/// How long a test waits for a condition before failing.
const DEADLINE: Duration = Duration::from_secs(60);

/// The tables of a prefix, histories included.
const TABLES: [&str; 7] =
    ["messages", "replies", "migrations", "runners", "locks", "runner_migrations", "entity_state"];

// ------------------------------------------------------------------------------------------
// The entity, as runner.mjs declares it
// ------------------------------------------------------------------------------------------

/// The entity type both sides serve.
struct InteropEcho;

/// A persisted request, deduplicated by `key`.
#[derive(Serialize, Deserialize)]
struct Echo {
    key: String,
    text: String,
    n: i64,
}

/// The reply to [`Echo`]: the request, who handled it and the shard in its address.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Echoed {
    key: String,
    text: String,
    n: i64,
    handled_by: String,
    entity_id: String,
    shard: String,
}

/// The typed error of an [`Echo`] with a negative `n`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct EchoRefused {
    reason: String,
}

impl Rpc for Echo {
    const TAG: &'static str = "Echo";
    const PERSISTED: bool = true;
    type Success = Echoed;
    type Error = EchoRefused;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// A volatile request answered with its number.
#[derive(Serialize, Deserialize)]
struct Ping {
    n: i64,
}

impl Rpc for Ping {
    const TAG: &'static str = "Ping";
    type Success = i64;
    type Error = EchoRefused;
}

/// How often the Rust handlers ran, by key.
static HANDLED: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());

impl Entity for InteropEcho {
    const TYPE: &'static str = "InteropEcho";

    async fn create(_: &EntityContext) -> InteropEcho {
        InteropEcho
    }

    fn protocol(protocol: &mut Protocol<InteropEcho>) {
        protocol.handle::<Echo>();
        protocol.handle::<Ping>();
    }
}

impl Handler<Echo> for InteropEcho {
    async fn handle(
        &mut self,
        context: &RequestContext,
        echo: Echo,
    ) -> Result<Echoed, EchoRefused> {
        *HANDLED.lock().unwrap().entry(echo.key.clone()).or_default() += 1;
        if echo.n < 0 {
            return Err(EchoRefused { reason: format!("refused {}", echo.n) });
        }
        let address = context.address();
        Ok(Echoed {
            key: echo.key,
            text: echo.text,
            n: echo.n,
            handled_by: "rust".to_owned(),
            entity_id: address.entity_id.as_str().to_owned(),
            shard: address.shard_id.to_string(),
        })
    }
}

impl Handler<Ping> for InteropEcho {
    async fn handle(&mut self, _: &RequestContext, ping: Ping) -> Result<i64, EchoRefused> {
        Ok(ping.n)
    }
}

fn handled_in_rust(key: &str) -> u32 {
    HANDLED.lock().unwrap().get(key).copied().unwrap_or(0)
}

// ------------------------------------------------------------------------------------------
// The fixture: tables of the test's own, the Rust runner and the TypeScript processes
// ------------------------------------------------------------------------------------------

/// The database and the TypeScript package of one test; drops the tables when dropped.
struct Interop {
    url: String,
    prefix: TablePrefix,
    package: PathBuf,
}

impl Interop {
    /// The fixture, or `None` (after saying why) when PostgreSQL, Node.js or the packages
    /// are missing outside CI.
    fn new(label: &str) -> Option<Interop> {
        let ci = std::env::var("CI").as_deref() == Ok("true");
        let url = match std::env::var("CLUSTER_TEST_POSTGRES_URL") {
            Ok(url) if !url.is_empty() => url,
            _ => {
                assert!(
                    !ci,
                    "CLUSTER_TEST_POSTGRES_URL is not set and CI=true: this test must run"
                );
                report("skipped: CLUSTER_TEST_POSTGRES_URL is not set");
                return None;
            }
        };
        let package = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../interop/typescript");
        let node = std::process::Command::new("node")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        let installed = package.join("node_modules/effect/package.json").is_file();
        if !node || !installed {
            let missing = if node { "interop/typescript/node_modules" } else { "node" };
            assert!(
                !ci,
                "{missing} is missing and CI=true: install Node.js and run \
                 `npm ci --prefix interop/typescript`"
            );
            report(&format!(
                "skipped: {missing} is missing (install Node.js and run \
                 `npm ci --prefix interop/typescript`)"
            ));
            return None;
        }
        let millis = SystemClock.now().unix_millis() % 100_000;
        let prefix = format!("ts{label}{}_{millis}", std::process::id());
        let prefix = TablePrefix::new(&prefix).unwrap();
        Some(Interop { url, prefix, package })
    }

    /// The settings both sides read, by the same names; `port` is the runner's own.
    fn shared_env(&self, port: u16) -> Vec<(&'static str, String)> {
        vec![
            ("CLUSTER_STORAGE_URL", self.url.clone()),
            ("CLUSTER_TABLE_PREFIX", self.prefix.as_str().to_owned()),
            ("HOST", "127.0.0.1".to_owned()),
            ("PORT", port.to_string()),
            ("SHARDS_PER_GROUP", SHARDS.to_string()),
            ("SHARD_LOCK_EXPIRATION", "6 seconds".to_owned()),
            ("SHARD_LOCK_REFRESH_INTERVAL", "1 second".to_owned()),
            ("REFRESH_ASSIGNMENTS_INTERVAL", "200 millis".to_owned()),
            ("ENTITY_MESSAGE_POLL_INTERVAL", "200 millis".to_owned()),
            ("ENTITY_REPLY_POLL_INTERVAL", "100 millis".to_owned()),
        ]
    }

    /// The Rust runner's settings, with `extra` added.
    fn rust_env(&self, port: u16, extra: &[(&'static str, &str)]) -> RunnerEnv {
        let mut vars = self.shared_env(port);
        vars.push(("CLUSTER_RPC_SECRET", "interop-0123456789abcdef0123456789abcdef".to_owned()));
        vars.extend(extra.iter().map(|(name, value)| (*name, (*value).to_owned())));
        RunnerEnv::from_lookup(Role::Runner, |name| {
            vars.iter().find(|(key, _)| *key == name).map(|(_, value)| value.clone())
        })
        .unwrap()
    }

    /// Starts the Rust runner, serving `InteropEcho`.
    async fn start_rust(&self, port: u16) -> Runner {
        self.start_rust_with(port, &[]).await
    }

    /// Starts the Rust runner with `extra` settings, serving `InteropEcho`.
    async fn start_rust_with(&self, port: u16, extra: &[(&'static str, &str)]) -> Runner {
        Runner::start(&self.rust_env(port, extra), |sharding| {
            sharding.entity::<InteropEcho>().register()?;
            Ok(())
        })
        .await
        .unwrap()
    }

    /// The ids recorded in `<prefix>_migrations`.
    async fn migrations(&self) -> Vec<i64> {
        let (client, connection) =
            tokio_postgres::connect(&self.url, tokio_postgres::NoTls).await.unwrap();
        let connection = tokio::spawn(connection);
        let table = self.prefix.table("migrations");
        let sql = format!("SELECT migration_id::BIGINT FROM \"{table}\" ORDER BY 1");
        let rows = client.query(&sql, &[]).await.unwrap();
        connection.abort();
        rows.iter().map(|row| row.get(0)).collect()
    }

    /// The health flag the registry holds for the runner at `port`.
    async fn registry_health(&self, port: u16) -> Option<bool> {
        let (client, connection) =
            tokio_postgres::connect(&self.url, tokio_postgres::NoTls).await.unwrap();
        let connection = tokio::spawn(connection);
        let table = self.prefix.table("runners");
        let sql = format!("SELECT healthy FROM \"{table}\" WHERE address = $1");
        let address = format!("127.0.0.1:{port}");
        let rows = client.query(&sql, &[&address]).await.unwrap();
        connection.abort();
        rows.first().map(|row| row.get(0))
    }

    /// The names of the indexes on the messages table.
    async fn message_indexes(&self) -> Vec<String> {
        let (client, connection) =
            tokio_postgres::connect(&self.url, tokio_postgres::NoTls).await.unwrap();
        let connection = tokio::spawn(connection);
        let table = self.prefix.table("messages");
        let sql = "SELECT indexname::TEXT FROM pg_indexes WHERE tablename = $1 ORDER BY 1";
        let rows = client.query(sql, &[&table]).await.unwrap();
        connection.abort();
        rows.iter().map(|row| row.get(0)).collect()
    }

    /// Starts `node runner.mjs` in `mode`; `ids` and `requests` are its `INTEROP_IDS` and
    /// `INTEROP_REQUESTS`.
    fn spawn(&self, mode: &str, port: u16, ids: &[String], requests: &[Value]) -> TypeScript {
        // Warnings and errors only, unless the test's environment asks for more.
        let log_level = std::env::var("INTEROP_LOG_LEVEL").unwrap_or_else(|_| "Warn".to_owned());
        let mut command = Command::new("node");
        command
            .arg("runner.mjs")
            .current_dir(&self.package)
            .env_clear()
            .envs(self.shared_env(port))
            .env("INTEROP_MODE", mode)
            .env("INTEROP_IDS", ids.join(","))
            .env("INTEROP_REQUESTS", Value::from(requests.to_vec()).to_string())
            .env("INTEROP_LOG_LEVEL", log_level)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        if let Some(path) = std::env::var_os("PATH") {
            command.env("PATH", path);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let event = serde_json::from_str(&line)
                    .unwrap_or_else(|_| json!({ "event": "unparsed", "line": line }));
                sink.lock().unwrap().push(event);
            }
        });
        TypeScript { mode: mode.to_owned(), child, stdin, events, reader }
    }
}

impl Drop for Interop {
    fn drop(&mut self) {
        let tables: Vec<String> =
            TABLES.iter().map(|table| format!("\"{}\"", self.prefix.table(table))).collect();
        let sql = format!("SET lock_timeout = 10000; DROP TABLE IF EXISTS {}", tables.join(", "));
        let url = self.url.clone();
        // On a runtime of its own: the test's runtime may be gone (a panic).
        let done = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            runtime.unwrap().block_on(async move {
                let (client, connection) =
                    tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
                let connection = tokio::spawn(connection);
                let dropped = client.batch_execute(&sql).await;
                connection.abort();
                dropped
            })
        });
        if let Ok(Err(error)) = done.join() {
            report(&format!("could not drop the test's tables: {error}"));
        }
    }
}

#[expect(clippy::print_stderr, reason = "a skipped test and a failed clean-up are reported")]
fn report(message: &str) {
    eprintln!("{message}");
}

#[expect(clippy::print_stdout, reason = "the timings are the test's evidence, in its output")]
fn note(message: &str) {
    println!("{message}");
}

/// A `node runner.mjs` process and the JSON lines it printed so far.
struct TypeScript {
    mode: String,
    child: Child,
    stdin: Option<ChildStdin>,
    events: Arc<Mutex<Vec<Value>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl TypeScript {
    /// The lines printed so far.
    fn events(&self) -> Vec<Value> {
        self.events.lock().unwrap().clone()
    }

    /// The lines of one kind (`"reply"`, `"handled"`, …).
    fn events_of(&self, kind: &str) -> Vec<Value> {
        self.events().into_iter().filter(|event| event["event"] == kind).collect()
    }

    /// Waits until `condition` holds for the printed lines; fails on an `error` line, when the
    /// process ends first, or after [`DEADLINE`].
    async fn wait_for(&mut self, what: &str, condition: impl Fn(&[Value]) -> bool) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let events = self.events();
            if condition(&events) {
                return;
            }
            let errors: Vec<&Value> = events.iter().filter(|e| e["event"] == "error").collect();
            assert!(errors.is_empty(), "TypeScript {}: {errors:?}", self.mode);
            if self.reader.is_finished() {
                let status = self.child.try_wait();
                panic!("TypeScript {} ended before {what} ({status:?}): {events:?}", self.mode);
            }
            assert!(Instant::now() < deadline, "{what} did not happen: {events:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The shards the TypeScript runner reported last.
    fn shards(&self) -> Option<BTreeSet<u32>> {
        last_shards(&self.events())
    }

    /// Closes the standard input (a runner then shuts down gracefully) and waits for the
    /// process to exit successfully.
    async fn finish(&mut self) {
        drop(self.stdin.take());
        let status = tokio::time::timeout(DEADLINE, self.child.wait()).await;
        let status = status.expect("the TypeScript process exits").unwrap();
        assert!(status.success(), "TypeScript {} exited with {status}", self.mode);
        let deadline = Instant::now() + DEADLINE;
        while !self.reader.is_finished() {
            assert!(Instant::now() < deadline, "the TypeScript output did not end");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The shards of the last `shards` line.
fn last_shards(events: &[Value]) -> Option<BTreeSet<u32>> {
    let last = events.iter().rev().find(|event| event["event"] == "shards")?;
    let shards = last["shards"].as_array()?;
    Some(shards.iter().filter_map(|shard| shard.as_u64()?.try_into().ok()).collect())
}

/// The shard numbers a Rust runner holds.
fn held(sharding: &Sharding) -> BTreeSet<u32> {
    sharding.acquired_shards().iter().map(cluster_core::ShardId::id).collect()
}

/// The shard of `id` as the Rust side computes it (`default:<n>`).
fn rust_shard(sharding: &Sharding, id: &str) -> String {
    sharding.config().shard_id(id, &ShardGroup::default_group()).to_string()
}

/// `count` ids named `<label>-<n>` whose shards are in `shards`.
fn ids_on(sharding: &Sharding, label: &str, shards: &BTreeSet<u32>, count: usize) -> Vec<String> {
    let group = ShardGroup::default_group();
    (0..100_000)
        .map(|n| format!("{label}-{n}"))
        .filter(|id| shards.contains(&sharding.config().shard_id(id, &group).id()))
        .take(count)
        .collect()
}

/// `n` as the requests' number.
fn int(n: usize) -> i64 {
    i64::try_from(n).unwrap()
}

/// An `INTEROP_REQUESTS` entry.
fn request(entity_id: &str, key: &str, text: &str, n: i64) -> Value {
    json!({ "entityId": entity_id, "key": key, "text": text, "n": n })
}

/// Runs a client-only TypeScript process that reports the shards of `ids` and sends
/// `requests`; checks its shards against `sharding`'s and returns the ended process, its
/// replies by key and how long it took, Node's start included.
async fn run_client(
    interop: &Interop,
    sharding: &Sharding,
    ids: &[String],
    requests: &[Value],
) -> (TypeScript, BTreeMap<String, Vec<Value>>, Duration) {
    let started = Instant::now();
    let mut client = interop.spawn("client", 0, ids, requests);
    client
        .wait_for("the TypeScript client's replies", |e| e.iter().any(|e| e["event"] == "done"))
        .await;
    let elapsed = started.elapsed();
    client.finish().await;
    check_shards(&client, sharding, ids);
    let replies = replies_by_key(&client);
    (client, replies, elapsed)
}

/// The TypeScript client's outcomes, by key.
fn replies_by_key(client: &TypeScript) -> BTreeMap<String, Vec<Value>> {
    let mut replies: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for reply in client.events_of("reply") {
        let key = reply["key"].as_str().unwrap().to_owned();
        replies.entry(key).or_default().push(reply);
    }
    replies
}

/// The expected reply to `request` from a handler on `side`, as JSON.
fn expected(request: &Value, side: &str, shard: &str) -> Value {
    json!({
        "key": request["key"], "text": request["text"], "n": request["n"],
        "handledBy": side, "entityId": request["entityId"], "shard": shard,
    })
}

/// Checks that both sides compute the same shard for every id the TypeScript side reported.
fn check_shards(typescript: &TypeScript, sharding: &Sharding, ids: &[String]) {
    let reported: BTreeMap<String, String> = typescript
        .events_of("shard")
        .iter()
        .map(|e| (e["entityId"].as_str().unwrap().to_owned(), e["shard"].as_str().unwrap().into()))
        .collect();
    assert_eq!(reported.len(), ids.len(), "one shard line per id");
    for id in ids {
        assert_eq!(reported[id], rust_shard(sharding, id), "the shard of {id}");
    }
}

// ------------------------------------------------------------------------------------------
// The tests
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typescript_client_gets_every_reply_from_a_rust_runner() {
    let Some(interop) = Interop::new("c") else { return };
    let rust = interop.start_rust(free_port().unwrap()).await;
    eventually("the Rust runner holds every shard", || held(&rust.sharding).len() == 30).await;

    // Fifty requests to fifty entities, the first one sent twice with its key, and one that
    // the handler refuses with the typed error.
    let ids: Vec<String> = (0..50).map(|n| format!("from-ts-{n}")).collect();
    let mut requests: Vec<Value> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| request(id, &format!("ts-{n}"), &format!("héllo 👋 «{n}»"), int(n)))
        .collect();
    requests.push(requests[0].clone());
    requests.push(request("from-ts-refused", "ts-refused", "no", -1));
    // The shard hash runs over UTF-16 code units: ids outside ASCII and the BMP too.
    let mut shard_ids = ids.clone();
    shard_ids
        .extend(["ü", "日本語", "👋🏽", "a/b/c", "group:7", "🦀 ferris", " "].map(str::to_owned));
    shard_ids.push("long".repeat(100));
    let (client, replies, elapsed) =
        run_client(&interop, &rust.sharding, &shard_ids, &requests).await;
    assert_eq!(replies.len(), 51, "one key per request: {replies:?}");
    for request in &requests[..50] {
        let key = request["key"].as_str().unwrap();
        let shard = rust_shard(&rust.sharding, request["entityId"].as_str().unwrap());
        let times = if key == "ts-0" { 2 } else { 1 };
        assert_eq!(replies[key].len(), times, "the replies of {key}");
        for reply in &replies[key] {
            assert_eq!(reply["ok"], true, "{reply}");
            assert_eq!(reply["value"], expected(request, "rust", &shard));
        }
        assert_eq!(handled_in_rust(key), 1, "{key} was handled once");
    }
    let refused = &replies["ts-refused"];
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0]["error"], json!({ "reason": "refused -1" }), "{}", refused[0]);
    assert_eq!(handled_in_rust("ts-refused"), 1);

    // The same request sent again from Rust (same entity, tag and key) gets the reply the
    // TypeScript client got, without running again: both sides derive the same message id.
    let again = Echo { key: "ts-1".to_owned(), text: "héllo 👋 «1»".to_owned(), n: 1 };
    let again = rust.sharding.client::<InteropEcho>("from-ts-1").send(again).await.unwrap();
    assert_eq!(serde_json::to_value(&again).unwrap(), replies["ts-1"][0]["value"]);
    assert_eq!(handled_in_rust("ts-1"), 1, "deduplicated across sides");
    let slowest = client.events_of("reply").iter().filter_map(|r| r["millis"].as_u64()).max();
    note(&format!(
        "TypeScript client -> Rust runner: {} replies in {elapsed:?} (node start included), \
         slowest request {slowest:?} ms",
        client.events_of("reply").len(),
    ));
    rust.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(clippy::too_many_lines, reason = "one scenario, step by step")]
async fn a_rust_runner_and_a_typescript_runner_share_the_shards() {
    let Some(interop) = Interop::new("r") else { return };
    let ts_port = free_port().unwrap();
    let rust_port = free_port().unwrap();
    let all: BTreeSet<u32> = (1..=SHARDS).collect();

    // The TypeScript runner starts first: it creates the tables (migrations 1 to 3) and takes
    // every shard; the Rust runner then adds the claim's index, outside the reference's
    // migration history, and takes its share.
    let mut typescript = interop.spawn("runner", ts_port, &[], &[]);
    typescript
        .wait_for("the TypeScript runner holds every shard", |e| {
            last_shards(e).as_ref() == Some(&all)
        })
        .await;
    assert_eq!(interop.migrations().await, [1, 2, 3], "the reference's migrations");
    let started = Instant::now();
    let rust = interop.start_rust(rust_port).await;
    assert_eq!(interop.migrations().await, [1, 2, 3], "the history stays the reference's");
    let unprocessed_index = interop.prefix.table("messages_unprocessed_idx");
    assert!(
        interop.message_indexes().await.contains(&unprocessed_index),
        "the Rust runner adds the claim's index: {:?}",
        interop.message_indexes().await
    );

    // Both sides compute the assignment from the registry: the hash ring of both runners.
    let mut ring = HashRing::new();
    ring.add(RunnerAddress::new("127.0.0.1", ts_port), 1.0);
    ring.add(RunnerAddress::new("127.0.0.1", rust_port), 1.0);
    let owners = ring.get_shards(SHARDS).unwrap();
    let share = |port: u16| -> BTreeSet<u32> {
        (1..=SHARDS).filter(|shard| owners[*shard as usize - 1].port() == port).collect()
    };
    let (rust_share, ts_share) = (share(rust_port), share(ts_port));
    assert!(!rust_share.is_empty() && !ts_share.is_empty(), "{rust_share:?} {ts_share:?}");
    eventually("the runners split the shards as the ring says", || {
        held(&rust.sharding) == rust_share && typescript.shards().as_ref() == Some(&ts_share)
    })
    .await;
    note(&format!(
        "shards split {:?} after the Rust runner joined: Rust {rust_share:?}, TypeScript \
         {ts_share:?}",
        started.elapsed()
    ));

    // Rust -> TypeScript: persisted requests to entities on the TypeScript runner's shards,
    // one of them refused with the typed error.
    let to_ts = ids_on(&rust.sharding, "from-rust", &ts_share, 10);
    let started = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    for (n, id) in to_ts.iter().enumerate() {
        let client = rust.sharding.client::<InteropEcho>(id.as_str());
        let n = int(n);
        let echo = Echo { key: format!("rust-{n}"), text: format!("ünïcødé ✓ {n}"), n };
        calls.spawn(async move { (n, client.send(echo).await) });
    }
    let client = rust.sharding.client::<InteropEcho>(to_ts[1].as_str());
    calls.spawn(async move {
        let echo = Echo { key: "rust-refused".to_owned(), text: "no".to_owned(), n: -2 };
        (-2, client.send(echo).await)
    });
    let answers = tokio::time::timeout(DEADLINE, calls.join_all()).await.expect("every reply");
    let elapsed = started.elapsed();
    let mut from_ts = BTreeMap::new();
    for (n, answer) in answers {
        if n < 0 {
            assert!(
                matches!(&answer, Err(CallError::Failed(EchoRefused { reason })) if reason == "refused -2"),
                "the typed error crosses: {answer:?}"
            );
            continue;
        }
        let id = &to_ts[usize::try_from(n).unwrap()];
        let echoed = answer.unwrap();
        let shard = rust_shard(&rust.sharding, id);
        assert_eq!(
            echoed,
            Echoed {
                key: format!("rust-{n}"),
                text: format!("ünïcødé ✓ {n}"),
                n,
                handled_by: "typescript".to_owned(),
                entity_id: id.clone(),
                shard,
            }
        );
        from_ts.insert(echoed.key.clone(), echoed);
    }
    note(&format!("Rust runner -> TypeScript runner: 11 persisted replies in {elapsed:?}"));

    // TypeScript -> Rust, from a client-only TypeScript process: persisted requests to
    // entities on the Rust runner's shards, plus a request of the Rust runner's again (same
    // entity, same key), which must get the stored reply instead of running again.
    let to_rust = ids_on(&rust.sharding, "from-ts", &rust_share, 10);
    let mut requests: Vec<Value> = to_rust
        .iter()
        .enumerate()
        .map(|(n, id)| request(id, &format!("to-rust-{n}"), &format!("ß∂ƒ {n}"), int(n)))
        .collect();
    requests.push(request(&to_ts[0], "rust-0", "ünïcødé ✓ 0", 0));
    let mut ids = to_rust.clone();
    ids.extend(to_ts.iter().cloned());
    let (_client, replies, elapsed) = run_client(&interop, &rust.sharding, &ids, &requests).await;
    assert_eq!(replies.len(), 11, "{replies:?}");
    for request in &requests[..10] {
        let key = request["key"].as_str().unwrap();
        let shard = rust_shard(&rust.sharding, request["entityId"].as_str().unwrap());
        assert_eq!(replies[key].len(), 1, "{key}");
        assert_eq!(replies[key][0]["value"], expected(request, "rust", &shard), "{key}");
        assert_eq!(handled_in_rust(key), 1, "{key} was handled once");
    }
    let again = &replies["rust-0"];
    assert_eq!(again.len(), 1);
    assert_eq!(again[0]["value"], serde_json::to_value(&from_ts["rust-0"]).unwrap());
    note(&format!("TypeScript client -> Rust runner (mixed cluster): 11 replies in {elapsed:?}"));

    // Every request the Rust runner sent was handled once by the TypeScript runner, the
    // repeated one included.
    let mut handled_in_ts: BTreeMap<String, u32> = BTreeMap::new();
    for event in typescript.events_of("handled") {
        *handled_in_ts.entry(event["key"].as_str().unwrap().to_owned()).or_default() += 1;
    }
    let expected_keys: BTreeMap<String, u32> = (0..10)
        .map(|n| format!("rust-{n}"))
        .chain(["rust-refused".to_owned()])
        .map(|key| (key, 1))
        .collect();
    assert_eq!(handled_in_ts, expected_keys, "handled by the TypeScript runner");

    // A volatile request cannot cross: the Rust transport cannot reach the TypeScript
    // runner, and the request fails once the lock expiration has passed.
    let started = Instant::now();
    let pinger = rust.sharding.client::<InteropEcho>(to_ts[0].as_str());
    let ping = tokio::time::timeout(DEADLINE, pinger.send(Ping { n: 7 })).await;
    let ping = ping.expect("the volatile call ends");
    assert!(
        matches!(ping, Err(CallError::Cluster(ClusterError::RunnerUnavailable { .. }))),
        "a volatile request cannot cross protocols: {ping:?}"
    );
    note(&format!("volatile Rust -> TypeScript: RunnerUnavailable after {:?}", started.elapsed()));

    // The TypeScript runner leaves gracefully: the Rust runner takes every shard and serves
    // the entities the TypeScript runner had.
    let started = Instant::now();
    typescript.finish().await;
    assert!(typescript.events().iter().any(|e| e["event"] == "stopped"));
    eventually("the Rust runner takes every shard", || held(&rust.sharding) == all).await;
    note(&format!("TypeScript runner left; Rust holds every shard after {:?}", started.elapsed()));
    let echo = Echo { key: "after-handoff".to_owned(), text: "mine now".to_owned(), n: 99 };
    let client = rust.sharding.client::<InteropEcho>(to_ts[2].as_str());
    let echoed = tokio::time::timeout(DEADLINE, client.send(echo)).await.expect("a reply");
    assert_eq!(echoed.unwrap().handled_by, "rust");
    rust.shutdown().await;
}

// ------------------------------------------------------------------------------------------
// The runner-health check in a mixed cluster
// ------------------------------------------------------------------------------------------

/// The name of the runner-health singleton (the reference's, in
/// `effect/src/cluster/Sharding.ts`); its entity id gives its shard.
const RUNNER_HEALTH: &str = "effect/cluster/Sharding/RunnerHealth";

/// Counts the health-check rounds of this process that judged two runners, from the runtime's
/// `runner health check finished` debug event.
#[derive(Default)]
struct HealthRounds {
    rounds: std::sync::atomic::AtomicU32,
}

/// The fields of one event that the count needs.
#[derive(Default)]
struct RoundFields {
    finished: bool,
    checked: u64,
}

impl tracing::field::Visit for RoundFields {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "checked" {
            self.checked = value;
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.finished = format!("{value:?}") == "runner health check finished";
        }
    }
}

impl tracing::Subscriber for HealthRounds {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.target().starts_with("cluster_sharding")
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = RoundFields::default();
        event.record(&mut fields);
        if fields.finished && fields.checked == 2 {
            self.rounds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// The rounds counted so far, the counting subscriber installed on first use.
fn health_rounds() -> u32 {
    static ROUNDS: std::sync::OnceLock<Arc<HealthRounds>> = std::sync::OnceLock::new();
    let rounds = ROUNDS.get_or_init(|| {
        let rounds = Arc::new(HealthRounds::default());
        tracing::subscriber::set_global_default(Arc::clone(&rounds)).expect("the only subscriber");
        rounds
    });
    rounds.rounds.load(std::sync::atomic::Ordering::SeqCst)
}

/// A Rust runner that holds the runner-health singleton and checks every half second must not
/// take a TypeScript runner's shards because its transport cannot reach it: the TypeScript
/// runner never answered a handshake, so it is judged by its registry heartbeat, which is live.
/// With the reference's check its first round marks the TypeScript runner unhealthy: set
/// `INTEROP_RUNNER_HEALTH_CHECK=ping` to see this test fail so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typescript_runner_keeps_its_shards_while_a_rust_runner_checks_health() {
    health_rounds();
    let Some(interop) = Interop::new("h") else { return };
    let ts_port = free_port().unwrap();
    // The Rust runner's port is chosen so that the ring gives it the singleton's shard.
    let group = ShardGroup::default_group();
    let singleton_shard = cluster_core::hash::shard_id(RUNNER_HEALTH, &group, SHARDS).id();
    let owners_with = |rust_port: u16| {
        let mut ring = HashRing::new();
        ring.add(RunnerAddress::new("127.0.0.1", ts_port), 1.0);
        ring.add(RunnerAddress::new("127.0.0.1", rust_port), 1.0);
        let owners: Vec<u16> =
            ring.get_shards(SHARDS).unwrap().iter().map(|owner| owner.port()).collect();
        owners
    };
    // Every port is tried in turn: for some of the TypeScript runner's ports, only one port
    // in thirty gives the Rust runner the singleton's shard, and a hundred free ports drawn at
    // random (port 0) missed all of them in one CI run.
    let rust_port = (20_000..=u16::MAX)
        .filter(|port| {
            *port != ts_port && owners_with(*port)[singleton_shard as usize - 1] == *port
        })
        .find(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .expect("a free port whose runner owns the health singleton's shard");
    let owners = owners_with(rust_port);
    let share = |port: u16| -> BTreeSet<u32> {
        (1..=SHARDS).filter(|shard| owners[*shard as usize - 1] == port).collect()
    };
    let (rust_share, ts_share) = (share(rust_port), share(ts_port));
    assert!(rust_share.contains(&singleton_shard));

    let all: BTreeSet<u32> = (1..=SHARDS).collect();
    let mut typescript = interop.spawn("runner", ts_port, &[], &[]);
    typescript
        .wait_for("the TypeScript runner holds every shard", |e| {
            last_shards(e).as_ref() == Some(&all)
        })
        .await;
    let mode = std::env::var("INTEROP_RUNNER_HEALTH_CHECK").unwrap_or_default();
    let rust = interop
        .start_rust_with(
            rust_port,
            &[("RUNNER_HEALTH_CHECK_INTERVAL", "500 millis"), ("RUNNER_HEALTH_CHECK", &mode)],
        )
        .await;
    eventually("the runners split the shards as the ring says", || {
        held(&rust.sharding) == rust_share && typescript.shards().as_ref() == Some(&ts_share)
    })
    .await;

    // Three rounds that judged both runners, the last one begun after the split (or, with
    // the reference's check, until the TypeScript runner's shards move).
    let started = Instant::now();
    let enough = health_rounds() + 3;
    eventually("three health-check rounds", || {
        health_rounds() >= enough || typescript.shards().as_ref() != Some(&ts_share)
    })
    .await;
    note(&format!("watched the health check for {:?}", started.elapsed()));
    assert_eq!(interop.registry_health(ts_port).await, Some(true), "the TypeScript runner");
    assert_eq!(interop.registry_health(rust_port).await, Some(true), "the Rust runner");
    assert_eq!(typescript.shards(), Some(ts_share), "the TypeScript runner keeps its shards");
    assert_eq!(held(&rust.sharding), rust_share);

    typescript.finish().await;
    eventually("the Rust runner takes every shard", || held(&rust.sharding) == all).await;
    rust.shutdown().await;
}
