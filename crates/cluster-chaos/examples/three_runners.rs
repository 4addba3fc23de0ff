//! A cluster of three runner processes on PostgreSQL, and a client process.
//!
//! ```text
//! cargo run -p cluster-chaos --example three_runners [-- postgres://user@host/db]
//! ```
//!
//! The URL defaults to `CLUSTER_EXAMPLE_POSTGRES_URL`, else the local server of the README
//! (`postgres://postgres@127.0.0.1:5432/test`). The example creates tables under a prefix of
//! its own and drops them at the end.
//!
//! 1. Three runner processes start from the environment (`durable_cluster::Runner`: storage URL,
//!    table prefix, `HOST`/`PORT`, the cluster's shared secret, any `ShardingConfig`
//!    variable), register the `Greeter` entity, join the cluster and split its 300 shards.
//! 2. This process joins as a client (no runner address): it computes the same shard
//!    assignment and sends each volatile request straight to its entity's runner over TCP,
//!    and each persisted request through the database.
//! 3. The runner hosting the most entities gets SIGTERM: it hands its shards to the other two
//!    and exits. The same entities are asked again and answer from the remaining runners (the
//!    example checks that every entity of the stopped runner moved). An entity's in-memory
//!    state starts afresh on its new runner (keep what must survive in your own storage, or
//!    in the persisted requests' replies).
//!
//! Run a runner of your own the same way: `cargo run -p cluster-chaos --example three_runners
//! -- runner` with the variables this example sets (see `docs/transport.md`).

use std::process::{ExitCode, Stdio};
use std::time::Duration;

use cluster_chaos::chaos::{free_port, wait_for_runners};
use cluster_sharding::{
    Entity, EntityContext, Handler, Never, Protocol, RequestContext, Rpc, Sharding,
};
use cluster_storage_sql::PgRunnerStorage;
use durable_cluster::{Role, Runner, RunnerEnv};
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

/// How many entities the client talks to.
const ENTITIES: u64 = 12;

/// A greeter: knows the runner it lives on and counts its visits.
struct Greeter {
    runner: String,
    visits: u64,
}

/// Which runner hosts you? (volatile)
#[derive(Serialize, Deserialize)]
struct Where;

/// Count a visit, once per key (persisted).
#[derive(Serialize, Deserialize)]
struct Visit {
    key: String,
}

impl Rpc for Where {
    const TAG: &'static str = "Where";
    type Success = String;
    type Error = Never;
}

impl Rpc for Visit {
    const TAG: &'static str = "Visit";
    const PERSISTED: bool = true;
    type Success = String;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl Entity for Greeter {
    const TYPE: &'static str = "Greeter";

    async fn create(context: &EntityContext) -> Greeter {
        let runner = context
            .sharding()
            .config()
            .runner_address
            .as_ref()
            .map_or_else(|| "?".to_owned(), ToString::to_string);
        Greeter { runner, visits: 0 }
    }

    fn protocol(protocol: &mut Protocol<Greeter>) {
        protocol.handle::<Where>();
        protocol.handle::<Visit>();
    }
}

impl Handler<Where> for Greeter {
    async fn handle(&mut self, _: &RequestContext, _: Where) -> Result<String, Never> {
        Ok(self.runner.clone())
    }
}

impl Handler<Visit> for Greeter {
    async fn handle(&mut self, _: &RequestContext, _: Visit) -> Result<String, Never> {
        self.visits += 1;
        Ok(format!("visit {} on {}", self.visits, self.runner))
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("runner") => runner().await,
        url => orchestrate(url).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            #[expect(clippy::print_stderr, reason = "the example reports its failure")]
            {
                eprintln!("three_runners: {error}");
            }
            ExitCode::FAILURE
        }
    }
}

#[expect(clippy::print_stdout, reason = "the example narrates what happens")]
fn say(line: &str) {
    println!("{line}");
}

/// One runner process: configured from the environment, until SIGTERM or SIGINT.
async fn runner() -> Result<(), String> {
    let env = RunnerEnv::from_env(Role::Runner).map_err(|error| error.to_string())?;
    let node = Runner::start(&env, |sharding| {
        sharding.entity::<Greeter>().register()?;
        Ok(())
    })
    .await
    .map_err(|error| error.to_string())?;
    durable_cluster::terminated().await.map_err(|error| error.to_string())?;
    // Graceful: the shards go to the other runners first.
    node.shutdown().await;
    Ok(())
}

/// The settings every process of this cluster shares.
fn cluster_env(url: &str, prefix: &str) -> Vec<(&'static str, String)> {
    vec![
        ("CLUSTER_STORAGE_URL", url.to_owned()),
        ("CLUSTER_TABLE_PREFIX", prefix.to_owned()),
        // Every runner and client of a cluster needs the same secret, of at least 32 bytes: a
        // real cluster makes one with `openssl rand -hex 32` and keeps it in a secret store.
        ("CLUSTER_RPC_SECRET", format!("example-secret-0123456789abcdef-{prefix}")),
        // Faster than the defaults, so that the example takes seconds.
        ("REFRESH_ASSIGNMENTS_INTERVAL", "500 millis".to_owned()),
        ("ENTITY_MESSAGE_POLL_INTERVAL", "500 millis".to_owned()),
        ("ENTITY_REPLY_POLL_INTERVAL", "50 millis".to_owned()),
    ]
}

async fn orchestrate(url: Option<&str>) -> Result<(), String> {
    let url = url
        .map(str::to_owned)
        .or_else(|| std::env::var("CLUSTER_EXAMPLE_POSTGRES_URL").ok())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let prefix = format!("example{}", std::process::id());
    let env = cluster_env(&url, &prefix);
    let lookup = |name: &str| env.iter().find(|(key, _)| *key == name).map(|(_, v)| v.clone());
    let client_env =
        RunnerEnv::from_lookup(Role::Client, lookup).map_err(|error| error.to_string())?;
    // The client opens the storages first, which creates the tables before any runner starts.
    let client = client_env.join().await.map_err(|error| error.to_string())?;
    let registry = PgRunnerStorage::connect(&url, &client_env.storage_options())
        .await
        .map_err(|error| error.to_string())?;

    let mut runners = Vec::new();
    let outcome = async {
        for _ in 0..3 {
            let port = free_port()?;
            runners.push((format!("127.0.0.1:{port}"), spawn_runner(&env, port)?));
        }
        wait_for_runners(&registry, 3).await?;
        say("three runners registered");
        run_scenario(&client, &mut runners).await
    }
    .await;

    for (_, child) in &mut runners {
        terminate(child).await;
    }
    client.shutdown().await;
    drop_tables(&url, &prefix).await;
    outcome
}

/// Asks every entity where it lives and counts a visit; stops the runner hosting the most
/// entities; asks again.
async fn run_scenario(client: &Sharding, runners: &mut [(String, Child)]) -> Result<(), String> {
    let before = locate(client).await?;
    let hosts: std::collections::BTreeSet<&String> = before.iter().collect();
    say(&format!("{ENTITIES} entities live on {} runners: {before:?}", hosts.len()));
    if hosts.len() < 2 {
        return Err("the entities did not spread over the runners".to_owned());
    }
    for n in 0..ENTITIES {
        let reply = visit(client, n, "first").await?;
        say(&format!("greeter-{n}: {reply}"));
    }

    // The runner hosting the most entities, so that the hand-over visibly moves some.
    let busiest = runners
        .iter()
        .enumerate()
        .max_by_key(|(_, (address, _))| before.iter().filter(|host| *host == address).count())
        .map_or(0, |(index, _)| index);
    let (stopped, child) = &mut runners[busiest];
    let hosted = before.iter().filter(|host| *host == stopped).count();
    say(&format!(
        "SIGTERM to the runner at {stopped} ({hosted} entities): it hands its shards over and exits"
    ));
    terminate(child).await;
    let after = locate(client).await?;
    say(&format!("after the hand-over: {after:?}"));
    if after.iter().any(|host| host == stopped) {
        return Err(format!("an entity still answered from the stopped runner {stopped}"));
    }
    let moved = before.iter().zip(&after).filter(|(was, now)| was != now).count();
    say(&format!("{moved} entities moved to another runner"));
    if moved < hosted {
        return Err(format!("{hosted} entities lived on {stopped} but only {moved} moved"));
    }
    for n in 0..ENTITIES {
        let reply = visit(client, n, "second").await?;
        say(&format!("greeter-{n}: {reply}"));
        if !reply.starts_with("visit ") {
            return Err(format!("unexpected reply {reply:?}"));
        }
    }
    say("three_runners: every entity answered before and after the hand-over");
    Ok(())
}

/// Where each entity lives (its runner's address), asked over the transport.
async fn locate(client: &Sharding) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for n in 0..ENTITIES {
        let host = client
            .client::<Greeter>(format!("greeter-{n}"))
            .send(Where)
            .await
            .map_err(|error| format!("greeter-{n}: {error}"))?;
        hosts.push(host);
    }
    Ok(hosts)
}

/// A persisted visit with its own key: stored, then answered by the owner from the database.
async fn visit(client: &Sharding, n: u64, round: &str) -> Result<String, String> {
    // A persisted caller waits for its reply as long as it takes; the example does not.
    let greeter = client.client::<Greeter>(format!("greeter-{n}"));
    let sent = greeter.send(Visit { key: format!("{round}-{n}") });
    match tokio::time::timeout(Duration::from_secs(60), sent).await {
        Ok(reply) => reply.map_err(|error| format!("greeter-{n}: {error}")),
        Err(_) => Err(format!("greeter-{n}: no reply to the visit within 60 s")),
    }
}

fn spawn_runner(env: &[(&'static str, String)], port: u16) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|error| format!("current exe: {error}"))?;
    let mut command = Command::new(exe);
    command.arg("runner").stdout(Stdio::null()).stderr(Stdio::inherit()).kill_on_drop(true);
    command.envs(env.iter().map(|(name, value)| (*name, value)));
    command.env("HOST", "127.0.0.1").env("PORT", port.to_string());
    command.spawn().map_err(|error| format!("cannot start a runner: {error}"))
}

/// SIGTERM, then wait for the process to exit (killed after 30 s).
async fn terminate(child: &mut Child) {
    if let Ok(None) = child.try_wait()
        && let Some(pid) = child.id()
    {
        let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status().await;
        if tokio::time::timeout(Duration::from_secs(30), child.wait()).await.is_err() {
            let _ = child.kill().await;
        }
    }
}

async fn drop_tables(url: &str, prefix: &str) {
    let Ok((db, connection)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await else {
        return;
    };
    let connection = tokio::spawn(connection);
    let tables: Vec<String> = [
        "messages",
        "replies",
        "migrations",
        "runners",
        "locks",
        "runner_migrations",
        "entity_state",
    ]
    .iter()
    .map(|table| format!("\"{prefix}_{table}\""))
    .collect();
    let _ = db.batch_execute(&format!("DROP TABLE IF EXISTS {}", tables.join(", "))).await;
    connection.abort();
}
