//! The fault test across processes (`cargo xtask chaos`, issue "runner-to-runner transport").
//!
//! Three runner processes on 127.0.0.1 share PostgreSQL tables of the run's own prefix and
//! reach each other over the TCP transport (with a shared secret); a client-only process
//! sends persisted deposits (with primary keys, in bursts per ledger, see [`crate::workload`])
//! and volatile echoes. While it does, one runner
//! is killed with SIGKILL, one is frozen with SIGSTOP past the lock expiration and then
//! continued, a fourth runner joins, and one shuts down gracefully (SIGTERM).
//!
//! At the end it checks that every deposit was answered to its caller and has exactly one
//! stored final reply and one audit row, and that the audit shows no shard served by two
//! runners at once (see [`crate::ledger`]). A summary is printed; any violation fails the run.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use cluster_core::envelope::{Reply, primary_key};
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{EntityAddress, EntityId, EntityType, ShardGroup};
use cluster_sharding::{Entity, Rpc};
use cluster_storage_sql::TablePrefix;
use cluster_storage_sql::postgres::{PgMessageStorage, PgRunnerStorage};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::ledger::{self, Deposit, Ledger};
use crate::node::NodeEnv;
use crate::workload::{self, Summary};

/// The ledgers the client spreads its deposits over (passed to it as `CHAOS_ENTITIES`).
const ENTITIES: u64 = 200;

/// Consecutive deposits to one ledger (`CHAOS_BURST`), so that several wait on one ledger.
const BURST: u64 = 4;

/// The lock expiration of the run's runners.
const EXPIRATION: Duration = Duration::from_secs(4);

/// Reports a step of the run on standard output.
#[expect(clippy::print_stdout, reason = "the fault test reports its steps to the terminal")]
pub fn say(message: &str) {
    println!("{message}");
}

/// The run's settings.
#[derive(Clone, Debug)]
pub struct ChaosOptions {
    /// The PostgreSQL database.
    pub postgres_url: String,
    /// How long the client starts new deposits.
    pub send_for: Duration,
}

/// What the run found.
#[derive(Debug, Default)]
pub struct Report {
    /// The client's view.
    pub client: Summary,
    /// Violations: lost, duplicated or unanswered requests, overlapping ownership.
    pub violations: Vec<String>,
    /// Audit rows read.
    pub audit_rows: usize,
}

/// The runtime settings every process of the run shares, as environment variables.
fn shared_env(options: &ChaosOptions, prefix: &TablePrefix, secret: &str) -> Vec<(String, String)> {
    [
        ("CLUSTER_STORAGE_URL", options.postgres_url.as_str()),
        ("CLUSTER_TABLE_PREFIX", prefix.as_str()),
        ("CLUSTER_RPC_SECRET", secret),
        ("SHARDS_PER_GROUP", "60"),
        ("SHARD_LOCK_EXPIRATION", "4 seconds"),
        ("SHARD_LOCK_REFRESH_INTERVAL", "1 second"),
        ("REFRESH_ASSIGNMENTS_INTERVAL", "500 millis"),
        ("ENTITY_MESSAGE_POLL_INTERVAL", "200 millis"),
        ("ENTITY_REPLY_POLL_INTERVAL", "100 millis"),
        ("ENTITY_TERMINATION_TIMEOUT", "2 seconds"),
        ("RUNNER_HEALTH_CHECK_INTERVAL", "2 seconds"),
        ("SEND_RETRY_INTERVAL", "100 millis"),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect()
}

/// One process of the run.
struct Process {
    name: String,
    child: Child,
}

impl Process {
    fn pid(&self) -> Result<u32, String> {
        self.child.id().ok_or_else(|| format!("{} has exited", self.name))
    }

    async fn signal(&self, signal: &str) -> Result<(), String> {
        let pid = self.pid()?.to_string();
        let status = Command::new("kill").args([signal, &pid]).status().await;
        match status {
            Ok(status) if status.success() => Ok(()),
            other => Err(format!("kill {signal} {}: {other:?}", self.name)),
        }
    }
}

fn spawn(
    name: &str,
    mode: &str,
    env: &[(String, String)],
    extra: &[(&str, String)],
    stdout: Stdio,
) -> Result<Process, String> {
    let exe = std::env::current_exe().map_err(|error| format!("current exe: {error}"))?;
    let mut command = Command::new(exe);
    command.arg(mode).stdout(stdout).stderr(Stdio::inherit()).kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    for (name, value) in extra {
        command.env(name, value);
    }
    let child = command.spawn().map_err(|error| format!("spawn {name}: {error}"))?;
    Ok(Process { name: name.to_owned(), child })
}

fn spawn_runner(name: &str, port: u16, env: &[(String, String)]) -> Result<Process, String> {
    let extra = [
        ("HOST", "127.0.0.1".to_owned()),
        ("PORT", port.to_string()),
        ("CHAOS_AUDIT", "1".to_owned()),
    ];
    spawn(name, "runner", env, &extra, Stdio::null())
}

/// A free TCP port on 127.0.0.1 (bound, then released for the runner to take).
pub fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|error| error.to_string())?;
    listener.local_addr().map(|address| address.port()).map_err(|error| error.to_string())
}

/// Runs the whole test; tables are dropped at the end whatever happened.
///
/// # Cancel safety
///
/// Not cancel safe: dropped, child processes are killed and the tables stay.
pub async fn run(options: &ChaosOptions) -> Result<Report, String> {
    let millis =
        std::time::SystemTime::UNIX_EPOCH.elapsed().map_or(0, |e| e.as_millis() % 1_000_000);
    let prefix = TablePrefix::new(&format!("chaos{}_{millis}", std::process::id()))
        .map_err(|error| error.to_string())?;
    let (client, connection) =
        tokio_postgres::connect(&options.postgres_url, tokio_postgres::NoTls)
            .await
            .map_err(|error| format!("PostgreSQL at {}: {error}", options.postgres_url))?;
    let connection = tokio::spawn(connection);
    let result = run_on(options, &prefix, &client).await;
    drop_tables(&client, &prefix).await;
    connection.abort();
    result
}

async fn drop_tables(client: &tokio_postgres::Client, prefix: &TablePrefix) {
    let mut tables: Vec<String> =
        ["messages", "replies", "migrations", "runners", "locks", "runner_migrations"]
            .iter()
            .map(|table| format!("\"{}\"", prefix.table(table)))
            .collect();
    tables.push(format!("\"{}\"", ledger::audit_table(prefix)));
    let _ = client.batch_execute(&format!("DROP TABLE IF EXISTS {}", tables.join(", "))).await;
}

async fn run_on(
    options: &ChaosOptions,
    prefix: &TablePrefix,
    db: &tokio_postgres::Client,
) -> Result<Report, String> {
    let secret = format!("chaos-{}-{}", std::process::id(), free_port()?);
    let env = shared_env(options, prefix, &secret);
    // The tables exist before any process starts (one migration, no race).
    let node = NodeEnv::from_lookup(false, |name| {
        env.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone())
    })
    .map_err(|error| error.to_string())?;
    let storage_options = node.storage_options();
    let messages = PgMessageStorage::connect(&options.postgres_url, &storage_options)
        .await
        .map_err(|error| error.to_string())?;
    let registry = PgRunnerStorage::connect(&options.postgres_url, &storage_options)
        .await
        .map_err(|error| error.to_string())?;
    db.batch_execute(&ledger::create_audit_table_sql(&ledger::audit_table(prefix)))
        .await
        .map_err(|error| format!("audit table: {error}"))?;

    let mut runners = Vec::new();
    for n in 1..=3 {
        runners.push(spawn_runner(&format!("runner-{n}"), free_port()?, &env)?);
    }
    wait_for_runners(&registry, 3).await?;
    say("chaos: 3 runners registered; starting the client");
    let workload = [
        ("CHAOS_KEY_PREFIX", "deposit".to_owned()),
        ("CHAOS_SEND_FOR_MS", options.send_for.as_millis().to_string()),
        ("CHAOS_ENTITIES", ENTITIES.to_string()),
        ("CHAOS_BURST", BURST.to_string()),
    ];
    let client = spawn("client", "client", &env, &workload, Stdio::piped())?;
    let output = tokio::spawn(client.child.wait_with_output());

    let started = Instant::now();
    let at = |seconds: u64| tokio::time::sleep_until(started + Duration::from_secs(seconds));
    at(3).await;
    say(&format!("chaos: SIGKILL {}", runners[0].name));
    runners[0].signal("-KILL").await?;
    at(6).await;
    say(&format!(
        "chaos: SIGSTOP {} for {:?}",
        runners[1].name,
        EXPIRATION + Duration::from_secs(3)
    ));
    runners[1].signal("-STOP").await?;
    tokio::time::sleep(EXPIRATION + Duration::from_secs(3)).await;
    say(&format!("chaos: SIGCONT {}", runners[1].name));
    runners[1].signal("-CONT").await?;
    at(15).await;
    say("chaos: runner-4 joins");
    runners.push(spawn_runner("runner-4", free_port()?, &env)?);
    at(18).await;
    say(&format!("chaos: SIGTERM {} (graceful)", runners[2].name));
    runners[2].signal("-TERM").await?;
    let graceful = tokio::time::timeout(Duration::from_secs(30), runners[2].child.wait()).await;
    match graceful {
        Ok(Ok(status)) if status.success() => {
            say(&format!("chaos: {} left cleanly", runners[2].name))
        }
        other => return Err(format!("{} did not shut down cleanly: {other:?}", runners[2].name)),
    }

    let output = tokio::time::timeout(options.send_for + Duration::from_secs(120), output)
        .await
        .map_err(|_| "the client did not finish".to_owned())?
        .map_err(|error| error.to_string())?
        .map_err(|error| error.to_string())?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().rev().find(|line| line.starts_with('{')).unwrap_or_default();
    let summary: Summary = serde_json::from_str(line)
        .map_err(|error| format!("client summary {line:?}: {error}; status {}", output.status))?;

    for runner in [&runners[1], &runners[3]] {
        runner.signal("-TERM").await?;
    }
    for runner in &mut runners {
        let _ = tokio::time::timeout(Duration::from_secs(30), runner.child.wait()).await;
    }
    let mut report = Report { client: summary, ..Report::default() };
    check_client(&mut report);
    check_replies(&mut report, &messages, &node).await?;
    check_audit(&mut report, db, prefix).await?;
    Ok(report)
}

/// Waits (at most 60 s) until the registry lists `count` healthy runners.
///
/// # Cancel safety
///
/// Cancel safe.
pub async fn wait_for_runners(registry: &PgRunnerStorage, count: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let runners = registry.get_runners().await.map_err(|error| error.to_string())?;
        if runners.iter().filter(|(_, healthy)| *healthy).count() >= count {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("only {} runners registered after 60 s", runners.len()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn check_client(report: &mut Report) {
    let client = &report.client;
    if client.sent == 0 {
        report.violations.push("the client sent nothing".to_owned());
    }
    if client.answered != client.sent {
        report.violations.push(format!(
            "{} of {} deposits were not answered with success ({} failed, {} unanswered)",
            client.sent - client.answered.min(client.sent),
            client.sent,
            client.failed,
            client.unanswered
        ));
    }
    if client.echoes_wrong > 0 {
        report.violations.push(format!("{} echoes had a wrong answer", client.echoes_wrong));
    }
}

/// Every deposit has one stored request and exactly one final reply, a success.
async fn check_replies(
    report: &mut Report,
    messages: &PgMessageStorage,
    node: &NodeEnv,
) -> Result<(), String> {
    let mut problems = Vec::new();
    for n in 0..report.client.sent {
        let entity_id = workload::ledger_of(n, ENTITIES, BURST);
        let address = EntityAddress {
            shard_id: node.sharding.shard_id(&entity_id, &ShardGroup::default_group()),
            entity_type: EntityType::from(Ledger::TYPE),
            entity_id: EntityId::from(entity_id),
        };
        let key = primary_key(&address, Deposit::TAG, &format!("deposit-{n}"));
        let id = messages.request_id_for_primary_key(&key).await.map_err(|e| e.to_string())?;
        let Some(id) = id else {
            problems.push(format!("deposit-{n}: no stored request"));
            continue;
        };
        let replies = messages.replies_for_unfiltered(&[id]).await.map_err(|e| e.to_string())?;
        let finals: Vec<&Reply> =
            replies.iter().filter(|reply| matches!(reply, Reply::WithExit(_))).collect();
        let successes = finals
            .iter()
            .filter(
                |reply| matches!(reply, Reply::WithExit(with_exit) if with_exit.exit.is_success()),
            )
            .count();
        if finals.len() != 1 || successes != 1 {
            problems.push(format!(
                "deposit-{n}: {} final replies, {successes} successes",
                finals.len()
            ));
        }
    }
    report_problems(report, "stored replies", problems);
    Ok(())
}

fn report_problems(report: &mut Report, what: &str, problems: Vec<String>) {
    if !problems.is_empty() {
        let shown: Vec<&String> = problems.iter().take(10).collect();
        report.violations.push(format!("{what}: {} problems, first: {shown:?}", problems.len()));
    }
}

/// One audit row per deposit; on each shard, the epochs of different runners never overlap.
async fn check_audit(
    report: &mut Report,
    db: &tokio_postgres::Client,
    prefix: &TablePrefix,
) -> Result<(), String> {
    let sql = format!(
        "SELECT key, shard, runner, epoch, \
         (EXTRACT(EPOCH FROM at) * 1000000)::BIGINT FROM \"{}\"",
        ledger::audit_table(prefix)
    );
    let rows = db.query(&sql, &[]).await.map_err(|error| format!("audit: {error}"))?;
    report.audit_rows = rows.len();
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    let mut spans = Spans::new();
    for row in &rows {
        let key: String = row.get(0);
        let shard: String = row.get(1);
        let runner: String = row.get(2);
        let epoch: String = row.get(3);
        let at: i64 = row.get(4);
        *per_key.entry(key).or_default() += 1;
        let span = spans.entry(shard).or_default().entry((runner, epoch)).or_insert((at, at));
        span.0 = span.0.min(at);
        span.1 = span.1.max(at);
    }
    let mut problems = Vec::new();
    for n in 0..report.client.sent {
        let key = format!("deposit-{n}");
        let count = per_key.get(&key).copied().unwrap_or(0);
        if count != 1 {
            problems.push(format!("{key}: {count} audit rows"));
        }
    }
    report_problems(report, "audit rows per deposit", problems);
    let overlaps = overlapping_epochs(&spans);
    report_problems(report, "shards served by two runners at once", overlaps);
    Ok(())
}

/// Per shard, the first and last audit time (microseconds) of each (runner, epoch).
pub type Spans = BTreeMap<String, BTreeMap<(String, String), (i64, i64)>>;

/// The pairs of epochs of *different* runners whose spans overlap on one shard: that shard
/// was served by two runners at once. Epochs of one runner may overlap (several entities of a
/// shard live at once on its owner).
pub fn overlapping_epochs(spans: &Spans) -> Vec<String> {
    let mut overlaps = Vec::new();
    for (shard, epochs) in spans {
        let epochs: Vec<_> = epochs.iter().collect();
        for (i, ((runner_a, epoch_a), (start_a, end_a))) in epochs.iter().enumerate() {
            for ((runner_b, epoch_b), (start_b, end_b)) in epochs.iter().skip(i + 1) {
                if runner_a != runner_b && start_a <= end_b && start_b <= end_a {
                    overlaps.push(format!("{shard}: {epoch_a} and {epoch_b}"));
                }
            }
        }
    }
    overlaps
}

#[cfg(test)]
mod tests {
    use super::{Spans, overlapping_epochs};

    fn spans(entries: &[(&str, &str, &str, i64, i64)]) -> Spans {
        let mut spans = Spans::new();
        for (shard, runner, epoch, first, last) in entries {
            spans
                .entry((*shard).to_owned())
                .or_default()
                .insert(((*runner).to_owned(), (*epoch).to_owned()), (*first, *last));
        }
        spans
    }

    #[test]
    fn ownership_that_moves_and_comes_back_is_not_an_overlap() {
        let moved = spans(&[
            ("default:1", "a", "a/1", 0, 10),
            ("default:1", "b", "b/1", 11, 20),
            ("default:1", "a", "a/2", 21, 30),
            ("default:2", "a", "a/3", 5, 25),
            ("default:2", "a", "a/4", 6, 7),
        ]);
        assert!(overlapping_epochs(&moved).is_empty());
    }

    #[test]
    fn two_runners_serving_one_shard_at_once_is_an_overlap() {
        let split_brain = spans(&[
            ("default:1", "a", "a/1", 0, 10),
            ("default:1", "b", "b/1", 10, 20),
            ("default:2", "a", "a/2", 0, 10),
            ("default:2", "b", "b/2", 3, 4),
        ]);
        assert_eq!(overlapping_epochs(&split_brain).len(), 2);
    }
}
