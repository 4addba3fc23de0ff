//! The fault test across processes (`cargo xtask chaos`, issue "runner-to-runner transport").
//!
//! Three runner processes on 127.0.0.1 share PostgreSQL tables of the run's own prefix and
//! reach each other over the TCP transport (with a shared secret); a client-only process
//! sends persisted deposits (with primary keys, in bursts per ledger, see [`crate::workload`])
//! and volatile echoes. While it does, the schedule has two phases:
//!
//! 1. crashes: `runner-1` is killed with SIGKILL, `runner-2` is frozen with SIGSTOP past the
//!    lock expiration and then continued;
//! 2. graceful changes only, once the frozen runner had a lock expiration to notice what it
//!    lost: `runner-4` joins, `runner-3` leaves with SIGTERM, `runner-1` comes back (its second
//!    process) and joins, and `runner-2` leaves with SIGTERM.
//!
//! The runners run with message retention at 30 s ([`RETENTION`], `MESSAGE_RETENTION`), so
//! a sweep deletes answered deposits while the faults go on. The client sends each deposit for
//! at most [`ANSWER_WITHIN`] (15 s) from its first attempt to store it, so it never sends one
//! again after retention could have deleted it. Once the client is done the last runners stay
//! up [`RETENTION_LINGER`] (10 s), so that the deposits of the run's first seconds, those sent
//! around the SIGKILL and the SIGSTOP, grow older than the retention before the last sweep.
//!
//! Each fault is logged with marks of the runs' sequence taken before and after it
//! ([`crate::runs::Fault`]). At the end, once every runner left, it checks that
//!
//! - every deposit was answered to its caller and has exactly one audit row, and the audit
//!   shows no shard served by two runners at once (see [`crate::ledger`]);
//! - every deposit audited within the retention of the check's start (less a 2 s margin for
//!   the clocks, [`crate::retention::CLOCK_MARGIN`]) has its stored request and exactly one
//!   final reply, a success; an older one has that too or is gone whole (no request, no reply,
//!   no other envelope), and no reply or envelope is left without its request
//!   ([`crate::retention::check_deposit`]);
//! - retention deleted at least one deposit: otherwise the run proves nothing about it;
//! - each ledger's durable balance equals its audit rows (retention deletes neither);
//! - every run of a deposit's handler other than its committed one (the one its audit row
//!   names) was cut off by a SIGKILL or SIGSTOP of its own process
//!   ([`crate::runs::check_reruns`]): a re-run after a graceful stop, a join or a rebalance is a
//!   violation;
//! - on every ledger, the stored deposits' first runs come in their storage order, and a run of
//!   a request that is not stored belongs to a deposit retention deleted
//!   ([`crate::runs::check_order`]).
//!
//! A summary is printed (runs, re-runs, the re-runs each fault explains, the deposits retention
//! deleted and kept); any violation fails the run.

use std::collections::{BTreeMap, BTreeSet};
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
use crate::retention::{self, Found, Stored, Window};
use crate::runs::{self, Fault, FaultKind, Order, ProcessId, Reruns, Run, StoredRequest};
use crate::workload::{self, Summary};
use durable_cluster::{Role, RunnerEnv};

/// The ledgers the client spreads its deposits over (passed to it as `CHAOS_ENTITIES`).
const ENTITIES: u64 = 200;

/// Consecutive deposits to one ledger (`CHAOS_BURST`), so that several wait on one ledger.
const BURST: u64 = 4;

/// How long each deposit works inside its transaction (`CHAOS_DEPOSIT_WORK_MS`), so that the
/// faults find runs in flight.
const DEPOSIT_WORK: Duration = Duration::from_millis(50);

/// The lock expiration of the run's runners.
const EXPIRATION: Duration = Duration::from_secs(4);

/// How long the frozen runner stays stopped: past its locks' expiration.
const FREEZE: Duration = Duration::from_secs(7);

/// How long after SIGCONT a run of the frozen runner still counts as the freeze's: a resumed
/// runner may start a handler of a shard it lost until its next lock refresh tells it so.
const FREEZE_AFTERMATH: Duration = EXPIRATION;

/// How long a runner has to leave after SIGTERM, or to register after it started.
const PROCESS_DEADLINE: Duration = Duration::from_secs(30);

/// The runners' message retention (`MESSAGE_RETENTION`): answered deposits older than this are
/// deleted, with their replies, by a sweep every tenth of it.
pub const RETENTION: Duration = Duration::from_secs(30);

/// How long after its first attempt to store it the client may still send a deposit
/// (`CHAOS_ANSWER_WITHIN_MS`). Retention deletes a request only once its final reply is older
/// than [`RETENTION`], and a resend after that would run the deposit again under the same key;
/// this stays far below it.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(15);

const _: () = assert!(ANSWER_WITHIN.as_secs() * 2 <= RETENTION.as_secs());

/// How long the last runners stay up after the client is done, before they leave and the
/// checks start: the client sends for 30 s, so without it only the deposits of the run's first
/// second or two would be older than [`RETENTION`] while a sweep can still run.
pub const RETENTION_LINGER: Duration = Duration::from_secs(10);

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
    /// How long the client starts new deposits (the schedule's faults need 28 s).
    pub send_for: Duration,
    /// Leaves the tables in place for inspection instead of dropping them.
    pub keep_tables: bool,
}

/// What the run found.
#[derive(Debug, Default)]
pub struct Report {
    /// The client's view.
    pub client: Summary,
    /// Violations: lost, duplicated or unanswered requests, overlapping ownership, runs not
    /// explained by a fault, deliveries out of storage order.
    pub violations: Vec<String>,
    /// Audit rows read.
    pub audit_rows: usize,
    /// Ledgers with a stored balance (durable entity state).
    pub ledgers: usize,
    /// The faults injected, in order.
    pub faults: Vec<Fault>,
    /// The runs and their attribution.
    pub reruns: Reruns,
    /// The order check.
    pub order: Order,
    /// What retention deleted.
    pub retention: Retained,
}

/// The deposits retention deleted, and those it left.
#[derive(Debug, Default)]
pub struct Retained {
    /// Deposits whose request and replies are all stored.
    pub present: usize,
    /// Deposits retention deleted whole (see [`crate::retention`]).
    pub purged: usize,
    /// How long before the check a deposit had to be audited to be allowed to be gone, in
    /// milliseconds.
    pub window_ms: i64,
    /// The youngest purged deposit's audit, in milliseconds before the check.
    pub youngest_purged_ms: Option<i64>,
    /// The oldest deposit found present, in milliseconds before the check.
    pub oldest_present_ms: Option<i64>,
}

/// The runtime settings every process of the run shares, as environment variables.
fn shared_env(options: &ChaosOptions, prefix: &TablePrefix, secret: &str) -> Vec<(String, String)> {
    let retention = format!("{} seconds", RETENTION.as_secs());
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
        ("MESSAGE_RETENTION", retention.as_str()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect()
}

/// One process of the run.
pub(crate) struct Process {
    pub(crate) id: ProcessId,
    pub(crate) port: u16,
    pub(crate) child: Child,
    /// Waited for: it was killed, or it left.
    pub(crate) exited: bool,
}

impl Process {
    pub(crate) fn name(&self) -> &str {
        &self.id.runner
    }

    pub(crate) async fn signal(&self, signal: &str) -> Result<(), String> {
        let pid = self.id.pid.to_string();
        let status = Command::new("kill").args([signal, &pid]).status().await;
        match status {
            Ok(status) if status.success() => Ok(()),
            other => Err(format!("kill {signal} {}: {other:?}", self.id)),
        }
    }
}

/// Starts this program in `mode` (`runner` or `client`) with `env` and `extra`.
fn spawn(
    name: &str,
    mode: &str,
    env: &[(String, String)],
    extra: &[(&str, String)],
    stdout: Stdio,
) -> Result<(Child, u32), String> {
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
    let pid = child.id().ok_or_else(|| format!("{name} exited at once"))?;
    Ok((child, pid))
}

/// Starts process `process` (1 for the first) of runner `name` on a free port.
fn spawn_runner(name: &str, process: u32, env: &[(String, String)]) -> Result<Process, String> {
    let audit = [
        ("CHAOS_AUDIT", "1".to_owned()),
        ("CHAOS_RUNNER_NAME", name.to_owned()),
        ("CHAOS_RUNNER_PROCESS", process.to_string()),
        ("CHAOS_DEPOSIT_WORK_MS", DEPOSIT_WORK.as_millis().to_string()),
    ];
    spawn_runner_with(name, process, env, &audit)
}

/// Starts process `process` of runner `name` on a free port of 127.0.0.1, with `env` and
/// `extra`.
pub(crate) fn spawn_runner_with(
    name: &str,
    process: u32,
    env: &[(String, String)],
    extra: &[(&str, String)],
) -> Result<Process, String> {
    let port = free_port()?;
    let mut all = vec![("HOST", "127.0.0.1".to_owned()), ("PORT", port.to_string())];
    all.extend(extra.iter().cloned());
    let (child, pid) = spawn(name, "runner", env, &all, Stdio::null())?;
    Ok(Process {
        id: ProcessId { runner: name.to_owned(), process, pid },
        port,
        child,
        exited: false,
    })
}

/// A free TCP port on 127.0.0.1 (bound, then released for the runner to take).
pub fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|error| error.to_string())?;
    listener.local_addr().map(|address| address.port()).map_err(|error| error.to_string())
}

/// Runs the whole test; tables are dropped at the end whatever happened, unless
/// `options.keep_tables`.
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
    if options.keep_tables {
        say(&format!("chaos: tables kept under the prefix {}", prefix.as_str()));
    } else {
        drop_tables(&client, &prefix).await;
    }
    connection.abort();
    result
}

pub(crate) async fn drop_tables(client: &tokio_postgres::Client, prefix: &TablePrefix) {
    let mut tables: Vec<String> = [
        "messages",
        "replies",
        "migrations",
        "runners",
        "locks",
        "runner_migrations",
        "entity_state",
    ]
    .iter()
    .map(|table| format!("\"{}\"", prefix.table(table)))
    .collect();
    tables.push(format!("\"{}\"", ledger::audit_table(prefix)));
    tables.push(format!("\"{}\"", runs::runs_table(prefix)));
    let _ = client.batch_execute(&format!("DROP TABLE IF EXISTS {}", tables.join(", "))).await;
}

/// The faults injected so far, each between two marks of the runs' sequence.
struct Faults<'a> {
    db: &'a tokio_postgres::Client,
    registry: &'a PgRunnerStorage,
    env: &'a [(String, String)],
    mark_sql: String,
    log: Vec<Fault>,
}

impl Faults<'_> {
    /// A mark of the runs' sequence: runs recorded before it have a smaller `seq`, runs
    /// recorded after it a larger one.
    async fn mark(&self) -> Result<i64, String> {
        let row = self.db.query_one(&self.mark_sql, &[]).await;
        row.and_then(|row| row.try_get(0)).map_err(|error| format!("mark: {error}"))
    }

    fn log(&mut self, kind: FaultKind, process: &Process, began: i64, ended: i64) {
        self.log.push(Fault { kind, process: process.id.clone(), began, ended });
    }

    async fn kill(&mut self, runner: &mut Process) -> Result<(), String> {
        say(&format!("chaos: SIGKILL {}", runner.id));
        let began = self.mark().await?;
        runner.signal("-KILL").await?;
        match tokio::time::timeout(PROCESS_DEADLINE, runner.child.wait()).await {
            Ok(Ok(_)) => runner.exited = true,
            other => return Err(format!("{} did not die after SIGKILL: {other:?}", runner.id)),
        }
        let ended = self.mark().await?;
        self.log(FaultKind::Kill, runner, began, ended);
        Ok(())
    }

    /// SIGSTOP for [`FREEZE`], SIGCONT, then [`FREEZE_AFTERMATH`] before the next fault.
    async fn freeze(&mut self, runner: &Process) -> Result<(), String> {
        say(&format!("chaos: SIGSTOP {} for {FREEZE:?}", runner.id));
        let began = self.mark().await?;
        runner.signal("-STOP").await?;
        tokio::time::sleep(FREEZE).await;
        say(&format!("chaos: SIGCONT {}", runner.id));
        runner.signal("-CONT").await?;
        let ended = self.mark().await?;
        tokio::time::sleep(FREEZE_AFTERMATH).await;
        let runs_until = self.mark().await?;
        self.log(FaultKind::Freeze { runs_until }, runner, began, ended);
        Ok(())
    }

    /// Starts process `process` of runner `name` and waits until it is registered.
    async fn join(&mut self, name: &str, process: u32) -> Result<Process, String> {
        let began = self.mark().await?;
        let runner = spawn_runner(name, process, self.env)?;
        say(&format!("chaos: {} joins", runner.id));
        wait_for_runner(self.registry, runner.port).await?;
        let ended = self.mark().await?;
        self.log(FaultKind::Join, &runner, began, ended);
        Ok(runner)
    }

    /// SIGTERM, and waits until the runner has left cleanly.
    async fn terminate(&mut self, runner: &mut Process) -> Result<(), String> {
        say(&format!("chaos: SIGTERM {} (graceful)", runner.id));
        let began = self.mark().await?;
        runner.signal("-TERM").await?;
        match tokio::time::timeout(PROCESS_DEADLINE, runner.child.wait()).await {
            Ok(Ok(status)) if status.success() => {
                runner.exited = true;
                say(&format!("chaos: {} left cleanly", runner.id));
            }
            other => return Err(format!("{} did not shut down cleanly: {other:?}", runner.id)),
        }
        let ended = self.mark().await?;
        self.log(FaultKind::Terminate, runner, began, ended);
        Ok(())
    }
}

async fn run_on(
    options: &ChaosOptions,
    prefix: &TablePrefix,
    db: &tokio_postgres::Client,
) -> Result<Report, String> {
    let secret = random_secret();
    let env = shared_env(options, prefix, &secret);
    // The tables exist before any process starts (one migration, no race).
    let node = RunnerEnv::from_lookup(Role::Client, |name| {
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
    let runs_table = runs::runs_table(prefix);
    db.batch_execute(&runs::create_runs_table_sql(&runs_table))
        .await
        .map_err(|error| format!("runs table: {error}"))?;

    let mut runners = Vec::new();
    for n in 1..=3 {
        runners.push(spawn_runner(&format!("runner-{n}"), 1, &env)?);
    }
    wait_for_runners(&registry, 3).await?;
    say("chaos: 3 runners registered; starting the client");
    let workload = [
        ("CHAOS_KEY_PREFIX", "deposit".to_owned()),
        ("CHAOS_SEND_FOR_MS", options.send_for.as_millis().to_string()),
        ("CHAOS_ENTITIES", ENTITIES.to_string()),
        ("CHAOS_BURST", BURST.to_string()),
        ("CHAOS_ANSWER_WITHIN_MS", ANSWER_WITHIN.as_millis().to_string()),
    ];
    let (client, _) = spawn("client", "client", &env, &workload, Stdio::piped())?;
    let output = tokio::spawn(client.wait_with_output());

    let mut faults = Faults {
        db,
        registry: &registry,
        env: &env,
        mark_sql: runs::mark_sql(&runs_table),
        log: Vec::new(),
    };
    let schedule = inject_faults(&mut faults, &mut runners).await;
    if let Err(error) = schedule {
        return Err(format!("the fault schedule failed: {error}"));
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

    say(&format!("chaos: the client is done; the runners stay up {RETENTION_LINGER:?} more"));
    tokio::time::sleep(RETENTION_LINGER).await;
    // The runners still up leave gracefully; no run and no sweep may happen after the checks'
    // reads start.
    for runner in runners.iter_mut().filter(|runner| !runner.exited) {
        faults.terminate(runner).await?;
    }
    let mut report = Report { client: summary, faults: faults.log, ..Report::default() };
    let tables = Tables { db, prefix, messages: &messages, node: &node };
    check_all(&mut report, &tables).await?;
    Ok(report)
}

/// What the checks read.
struct Tables<'a> {
    db: &'a tokio_postgres::Client,
    prefix: &'a TablePrefix,
    messages: &'a PgMessageStorage,
    node: &'a RunnerEnv,
}

/// The checks at the end, once every runner left (so every sweep of retention is over).
async fn check_all(report: &mut Report, tables: &Tables<'_>) -> Result<(), String> {
    let (db, prefix) = (tables.db, tables.prefix);
    let row = db
        .query_one("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::BIGINT", &[])
        .await
        .map_err(|error| format!("clock: {error}"))?;
    let window = Window::new(row.try_get(0).map_err(|error| format!("clock: {error}"))?, RETENTION);
    check_client(report);
    let audited = check_audit(report, db, prefix).await?;
    let all = read_runs(db, prefix).await?;
    let purged = check_replies(report, tables, &audited, &all, &window).await?;
    check_balances(report, db, prefix).await?;
    check_runs(report, db, prefix, &audited.committed, &all, &purged).await?;
    Ok(())
}

/// The schedule: crashes first, then (once the frozen runner had [`FREEZE_AFTERMATH`] to
/// notice what it lost) graceful changes only, each at a fixed time after the client started.
async fn inject_faults(faults: &mut Faults<'_>, runners: &mut Vec<Process>) -> Result<(), String> {
    let started = Instant::now();
    let at = |seconds: u64| tokio::time::sleep_until(started + Duration::from_secs(seconds));
    let runner = |name: &str| -> Result<usize, String> {
        runners
            .iter()
            .position(|runner| runner.name() == name && !runner.exited)
            .ok_or_else(|| format!("{name} is not running"))
    };
    let (one, two, three) = (runner("runner-1")?, runner("runner-2")?, runner("runner-3")?);
    at(3).await;
    faults.kill(&mut runners[one]).await?;
    at(6).await;
    // Back at 13 s, its aftermath over at 17 s.
    faults.freeze(&runners[two]).await?;
    at(18).await;
    runners.push(faults.join("runner-4", 1).await?);
    at(21).await;
    faults.terminate(&mut runners[three]).await?;
    at(24).await;
    runners.push(faults.join("runner-1", 2).await?);
    at(27).await;
    faults.terminate(&mut runners[two]).await?;
    Ok(())
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

/// Waits (at most [`PROCESS_DEADLINE`]) until the runner on 127.0.0.1:`port` is registered
/// and healthy.
async fn wait_for_runner(registry: &PgRunnerStorage, port: u16) -> Result<(), String> {
    let deadline = Instant::now() + PROCESS_DEADLINE;
    loop {
        let runners = registry.get_runners().await.map_err(|error| error.to_string())?;
        let registered = runners.iter().any(|(runner, healthy)| {
            *healthy && runner.address.port() == port && runner.address.host() == "127.0.0.1"
        });
        if registered {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the runner on port {port} did not register in time"));
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

/// Every deposit has one stored request and exactly one final reply, a success, or, if it was
/// audited before the retention window, may be gone whole: no request, no reply and no other
/// envelope left ([`retention::check_deposit`]). Replies and envelopes left without their
/// request are violations whichever deposit they belong to. Returns the keys of the deposits
/// retention deleted, and fails the run if there are none: retention did not run.
async fn check_replies(
    report: &mut Report,
    tables: &Tables<'_>,
    audited: &Audited,
    runs: &[Run],
    window: &Window,
) -> Result<BTreeSet<String>, String> {
    let mut request_ids: BTreeMap<&str, BTreeSet<i64>> = BTreeMap::new();
    for run in runs {
        request_ids.entry(run.key.as_str()).or_default().insert(run.request_id);
    }
    let mut orphans = orphans(tables.db, tables.prefix).await?;
    let (messages, node) = (tables.messages, tables.node);
    let mut problems = Vec::new();
    let mut purged = BTreeSet::new();
    let found = &mut report.retention;
    found.window_ms = window.age_ms(window.purgeable_before);
    for n in 0..report.client.sent {
        let key = format!("deposit-{n}");
        let entity_id = workload::ledger_of(n, ENTITIES, BURST);
        let address = EntityAddress {
            shard_id: node.sharding.shard_id(&entity_id, &ShardGroup::default_group()),
            entity_type: EntityType::from(Ledger::TYPE),
            entity_id: EntityId::from(entity_id),
        };
        let primary = primary_key(&address, Deposit::TAG, &key);
        let id = messages.request_id_for_primary_key(&primary).await.map_err(|e| e.to_string())?;
        let mut stored = Stored::default();
        if let Some(id) = id {
            let replies =
                messages.replies_for_unfiltered(&[id]).await.map_err(|e| e.to_string())?;
            let finals: Vec<&Reply> =
                replies.iter().filter(|reply| matches!(reply, Reply::WithExit(_))).collect();
            stored.request = true;
            stored.final_replies = finals.len();
            stored.successes = finals
                .iter()
                .filter(|reply| {
                    matches!(reply, Reply::WithExit(with_exit) if with_exit.exit.is_success())
                })
                .count();
        }
        for id in request_ids.get(key.as_str()).into_iter().flatten() {
            stored.orphans += orphans.remove(id).unwrap_or(0);
        }
        let at = audited.at.get(&key).copied();
        match retention::check_deposit(at, &stored, window) {
            Ok(Found::Present) => {
                found.present += 1;
                if let Some(age) = at.map(|at| window.age_ms(at)) {
                    found.oldest_present_ms = found.oldest_present_ms.max(Some(age));
                }
            }
            Ok(Found::Purged) => {
                found.purged += 1;
                if let Some(age) = at.map(|at| window.age_ms(at)) {
                    found.youngest_purged_ms =
                        Some(found.youngest_purged_ms.map_or(age, |young| young.min(age)));
                }
                purged.insert(key);
            }
            Err(problem) => problems.push(format!("{key}: {problem}")),
        }
    }
    for (id, rows) in orphans {
        problems.push(format!("request {id} of no deposit: {rows} rows left without it"));
    }
    report_problems(report, "stored requests and replies", problems);
    if report.retention.purged == 0 {
        let old = audited.at.values().filter(|at| **at < window.purgeable_before).count();
        report.violations.push(format!(
            "retention deleted no deposit: all {} deposits are stored, {} of them audited \
             more than {} ms before the check",
            report.client.sent, old, report.retention.window_ms
        ));
    }
    Ok(purged)
}

/// Replies and envelopes (acknowledgements, interrupts) whose request row is not stored, per
/// request id: what a partial deletion would leave.
async fn orphans(
    db: &tokio_postgres::Client,
    prefix: &TablePrefix,
) -> Result<BTreeMap<i64, usize>, String> {
    let (messages, replies) = (prefix.table("messages"), prefix.table("replies"));
    let sql = format!(
        "SELECT request_id, COUNT(*) FROM ( \
           SELECT r.request_id FROM \"{replies}\" r WHERE NOT EXISTS \
             (SELECT 1 FROM \"{messages}\" m WHERE m.id = r.request_id AND m.kind = 0) \
           UNION ALL \
           SELECT e.request_id FROM \"{messages}\" e WHERE e.kind <> 0 AND NOT EXISTS \
             (SELECT 1 FROM \"{messages}\" m WHERE m.id = e.request_id AND m.kind = 0) \
         ) AS left_over GROUP BY request_id"
    );
    let rows = db.query(&sql, &[]).await.map_err(|error| format!("orphans: {error}"))?;
    let mut orphans = BTreeMap::new();
    for row in &rows {
        let count: i64 = row.get(1);
        orphans.insert(row.get::<_, i64>(0), usize::try_from(count).unwrap_or(usize::MAX));
    }
    Ok(orphans)
}

fn report_problems(report: &mut Report, what: &str, problems: Vec<String>) {
    if !problems.is_empty() {
        let shown: Vec<&String> = problems.iter().take(10).collect();
        report.violations.push(format!("{what}: {} problems, first: {shown:?}", problems.len()));
    }
}

/// What the audit says of each deposit, by key.
#[derive(Debug, Default)]
struct Audited {
    /// The committed runs (their `seq`).
    committed: BTreeMap<String, BTreeSet<i64>>,
    /// The earliest audit row's time, in microseconds of the database's clock.
    at: BTreeMap<String, i64>,
}

/// One audit row per deposit, naming a run; on each shard, the epochs of different runners
/// never overlap. Retention deletes no audit row, so this holds for purged deposits too.
async fn check_audit(
    report: &mut Report,
    db: &tokio_postgres::Client,
    prefix: &TablePrefix,
) -> Result<Audited, String> {
    let sql = format!(
        "SELECT key, shard, runner, epoch, run, \
         (EXTRACT(EPOCH FROM at) * 1000000)::BIGINT FROM \"{}\"",
        ledger::audit_table(prefix)
    );
    let rows = db.query(&sql, &[]).await.map_err(|error| format!("audit: {error}"))?;
    report.audit_rows = rows.len();
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    let mut audited = Audited::default();
    let mut problems = Vec::new();
    let mut spans = Spans::new();
    for row in &rows {
        let key: String = row.get(0);
        let shard: String = row.get(1);
        let runner: String = row.get(2);
        let epoch: String = row.get(3);
        let run: Option<i64> = row.get(4);
        let at: i64 = row.get(5);
        match run {
            Some(run) => {
                audited.committed.entry(key.clone()).or_default().insert(run);
            }
            None => problems.push(format!("{key}: an audit row without its run")),
        }
        let first = audited.at.entry(key.clone()).or_insert(at);
        *first = (*first).min(at);
        *per_key.entry(key).or_default() += 1;
        let span = spans.entry(shard).or_default().entry((runner, epoch)).or_insert((at, at));
        span.0 = span.0.min(at);
        span.1 = span.1.max(at);
    }
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
    Ok(audited)
}

/// Each ledger's durable count of deposits equals its audit rows: every deposit changed the
/// state once, with its reply, across every crash, freeze and move.
async fn check_balances(
    report: &mut Report,
    db: &tokio_postgres::Client,
    prefix: &TablePrefix,
) -> Result<(), String> {
    let audited =
        format!("SELECT entity, COUNT(*) FROM \"{}\" GROUP BY entity", ledger::audit_table(prefix));
    let rows = db.query(&audited, &[]).await.map_err(|error| format!("audit: {error}"))?;
    let mut counts: BTreeMap<String, i64> =
        rows.iter().map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1))).collect();
    let stored = format!(
        "SELECT entity_id, value FROM \"{}\" WHERE entity_type = 'ChaosLedger'",
        prefix.table("entity_state")
    );
    let rows = db.query(&stored, &[]).await.map_err(|error| format!("entity state: {error}"))?;
    let mut problems = Vec::new();
    for row in &rows {
        let entity: String = row.get(0);
        let value: String = row.get(1);
        let audited = counts.remove(&entity).unwrap_or(0);
        match value.parse::<i64>() {
            Ok(balance) if balance == audited => {}
            Ok(balance) => {
                problems.push(format!("{entity}: balance {balance}, {audited} audit rows"));
            }
            Err(_) => problems.push(format!("{entity}: balance {value:?} is not a number")),
        }
    }
    for (entity, audited) in counts {
        problems.push(format!("{entity}: no stored balance, {audited} audit rows"));
    }
    report.ledgers = rows.len();
    report_problems(report, "durable balances against the audit", problems);
    Ok(())
}

/// Every recorded run of a deposit's handler (retention deletes none).
async fn read_runs(db: &tokio_postgres::Client, prefix: &TablePrefix) -> Result<Vec<Run>, String> {
    let sql = format!(
        "SELECT seq, key, entity, request_id, runner, process, pid FROM \"{}\"",
        runs::runs_table(prefix)
    );
    let rows = db.query(&sql, &[]).await.map_err(|error| format!("runs: {error}"))?;
    let mut all = Vec::with_capacity(rows.len());
    for row in &rows {
        let process: i32 = row.get(5);
        let pid: i64 = row.get(6);
        all.push(Run {
            seq: row.get(0),
            key: row.get(1),
            entity: row.get(2),
            request_id: row.get(3),
            runner: row.get(4),
            process: u32::try_from(process).map_err(|_| format!("run process {process}"))?,
            pid: u32::try_from(pid).map_err(|_| format!("run pid {pid}"))?,
        });
    }
    Ok(all)
}

/// Every run not committed is explained by a kill or freeze of its process, and each ledger's
/// first runs follow its storage order (see [`crate::runs`]); the runs of the `purged`
/// deposits, whose requests retention deleted, are left out of the order.
async fn check_runs(
    report: &mut Report,
    db: &tokio_postgres::Client,
    prefix: &TablePrefix,
    committed: &BTreeMap<String, BTreeSet<i64>>,
    all: &[Run],
    purged: &BTreeSet<String>,
) -> Result<(), String> {
    report.reruns = runs::check_reruns(all, committed, &report.faults);
    if report.reruns.unexcused > 0 {
        report.violations.push(format!(
            "runs that were not committed and no kill or freeze explains: {}, first: {:?}",
            report.reruns.unexcused, report.reruns.violations
        ));
    }
    let sql = format!(
        "SELECT rowid, id, entity_id FROM \"{}\" WHERE entity_type = $1 AND tag = $2 AND kind = 0",
        prefix.table("messages")
    );
    let rows = db
        .query(&sql, &[&Ledger::TYPE, &Deposit::TAG])
        .await
        .map_err(|error| format!("stored requests: {error}"))?;
    let requests: Vec<StoredRequest> = rows
        .iter()
        .map(|row| StoredRequest { rowid: row.get(0), id: row.get(1), entity: row.get(2) })
        .collect();
    report.order = runs::check_order(&requests, all, purged);
    if report.order.violation_count > 0 {
        report.violations.push(format!(
            "first runs out of storage order: {}, first: {:?}",
            report.order.violation_count, report.order.violations
        ));
    }
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

/// A fresh random shared secret for one run: 64 hexadecimal digits from four randomly keyed
/// hashers (the transport refuses secrets shorter than 32 bytes).
pub(crate) fn random_secret() -> String {
    use std::hash::{BuildHasher, Hasher};
    (0..4)
        .map(|_| format!("{:016x}", std::hash::RandomState::new().build_hasher().finish()))
        .collect()
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
