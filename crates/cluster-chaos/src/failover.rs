//! Failover after SIGKILL, with the default settings (`cargo xtask chaos --failover`).
//!
//! Three runner processes on 127.0.0.1 share PostgreSQL tables of the run's own prefix, with
//! every timing setting at its default (a 35 s lock expiration, a 1 minute health check).
//! Once every shard is held, the run kills one runner with SIGKILL and measures how long its
//! shards stay unserved: from the kill until another runner holds every shard it held, as
//! the database's lock listing shows ([`RunnerStorage::shard_locks`]).
//! Then it starts that runner again (a new process on a new port), waits until the cluster
//! holds every shard again, and kills the next one.
//!
//! It runs once with advisory locks (PostgreSQL's default) and once with lease rows
//! (`SHARD_LOCK_DISABLE_ADVISORY=true`), and fails when one failover takes longer than
//! [`FAILOVER_BOUND`].
//! Without the probe for gone runners, a failover waits for the killed runner's heartbeat
//! to expire (35 s), and in lease mode for its leases too.

use std::collections::BTreeSet;
use std::time::Duration;

use cluster_core::inspect::LockHolder;
use cluster_core::storage::RunnerStorage;
use cluster_core::{RunnerAddress, ShardGroup, ShardId};
use cluster_storage_sql::TablePrefix;
use cluster_storage_sql::postgres::PgRunnerStorage;
use tokio::time::Instant;

use crate::chaos::{Process, drop_tables, random_secret, say, spawn_runner_with, wait_for_runners};
use durable_cluster::{Role, RunnerEnv};

/// The longest failover the run accepts: the probe finds a killed runner within about
/// 1.2 s (`RUNNER_PROBE_INTERVAL` and a second probe), and the others see it unhealthy at
/// their next registry sync (3 s): about 4.5 s at worst, with room for a loaded machine.
pub const FAILOVER_BOUND: Duration = Duration::from_secs(10);

/// How long the run waits for the cluster to hold every shard, or for a failover, before it
/// gives up.
const SETTLE_DEADLINE: Duration = Duration::from_secs(90);

/// The shards of the default group at the default `SHARDS_PER_GROUP`.
const SHARDS: u32 = 300;

/// The runners of the run.
const RUNNERS: usize = 3;

/// What [`run`] is asked to do.
#[derive(Clone, Debug)]
pub struct FailoverOptions {
    /// PostgreSQL.
    pub postgres_url: String,
    /// SIGKILLs per lock mode.
    pub kills: usize,
}

/// One lock mode's failovers.
#[derive(Clone, Debug, Default)]
pub struct FailoverReport {
    /// `advisory` or `lease`.
    pub mode: &'static str,
    /// Each failover's time, from the SIGKILL until others held every shard the killed runner
    /// held, in kill order.
    pub samples: Vec<Duration>,
}

impl FailoverReport {
    /// The samples, sorted.
    fn sorted(&self) -> Vec<Duration> {
        let mut sorted = self.samples.clone();
        sorted.sort();
        sorted
    }

    /// A line for the terminal: the distribution of the samples.
    pub fn summary(&self) -> String {
        let sorted = self.sorted();
        let at = |percent: usize| -> String {
            match sorted.get(sorted.len().saturating_sub(1) * percent / 100) {
                Some(took) => format!("{:.2} s", took.as_secs_f64()),
                None => "none".to_owned(),
            }
        };
        format!(
            "failover with {} locks: {} SIGKILLs, shards served again after min {}, median {}, \
             max {} (bound {:?})",
            self.mode,
            sorted.len(),
            at(0),
            at(50),
            at(100),
            FAILOVER_BOUND
        )
    }

    /// The failovers past [`FAILOVER_BOUND`].
    pub fn violations(&self) -> Vec<String> {
        self.samples
            .iter()
            .enumerate()
            .filter(|(_, took)| **took > FAILOVER_BOUND)
            .map(|(kill, took)| {
                format!(
                    "{} locks: failover {} took {:.2} s, past {FAILOVER_BOUND:?}",
                    self.mode,
                    kill + 1,
                    took.as_secs_f64()
                )
            })
            .collect()
    }
}

/// Runs the failovers in both lock modes, each on tables of its own, dropped at the end.
///
/// # Cancel safety
///
/// Not cancel safe: dropped, child processes are killed and the tables stay.
pub async fn run(options: &FailoverOptions) -> Result<Vec<FailoverReport>, String> {
    let (client, connection) =
        tokio_postgres::connect(&options.postgres_url, tokio_postgres::NoTls)
            .await
            .map_err(|error| format!("PostgreSQL at {}: {error}", options.postgres_url))?;
    let connection = tokio::spawn(connection);
    let mut reports = Vec::new();
    for (mode, lease) in [("advisory", false), ("lease", true)] {
        let millis =
            std::time::SystemTime::UNIX_EPOCH.elapsed().map_or(0, |e| e.as_millis() % 1_000_000);
        let prefix = TablePrefix::new(&format!("failover{}_{mode}_{millis}", std::process::id()))
            .map_err(|error| error.to_string())?;
        let result = run_mode(options, &prefix, mode, lease).await;
        drop_tables(&client, &prefix).await;
        reports.push(result?);
    }
    connection.abort();
    Ok(reports)
}

async fn run_mode(
    options: &FailoverOptions,
    prefix: &TablePrefix,
    mode: &'static str,
    lease: bool,
) -> Result<FailoverReport, String> {
    let secret = random_secret();
    // Only what the run needs: every timing setting keeps its default.
    let env: Vec<(String, String)> = [
        ("CLUSTER_STORAGE_URL", options.postgres_url.as_str()),
        ("CLUSTER_TABLE_PREFIX", prefix.as_str()),
        ("CLUSTER_RPC_SECRET", secret.as_str()),
        ("SHARD_LOCK_DISABLE_ADVISORY", if lease { "true" } else { "false" }),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect();
    let node = RunnerEnv::from_lookup(Role::Client, |name| {
        env.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone())
    })
    .map_err(|error| error.to_string())?;
    let registry = PgRunnerStorage::connect(&options.postgres_url, &node.storage_options())
        .await
        .map_err(|error| error.to_string())?;
    let all: Vec<ShardId> =
        (1..=SHARDS).map(|id| ShardId::new(ShardGroup::default_group(), id)).collect();

    let mut runners = Vec::new();
    for n in 1..=RUNNERS {
        runners.push(spawn_runner_with(&format!("runner-{n}"), 1, &env, &[])?);
    }
    wait_for_runners(&registry, RUNNERS).await?;
    let mut report = FailoverReport { mode, samples: Vec::new() };
    for kill in 0..options.kills {
        let addresses: Vec<RunnerAddress> = runners.iter().map(address).collect();
        settled(&registry, &all, &addresses).await?;
        let victim = kill % runners.len();
        let gone = address(&runners[victim]);
        let held = held_by(&registry, &all, &gone).await?;
        say(&format!(
            "failover ({mode}): SIGKILL {} holding {} shards",
            runners[victim].id,
            held.len()
        ));
        let killed = Instant::now();
        runners[victim].signal("-KILL").await?;
        tokio::time::timeout(SETTLE_DEADLINE, runners[victim].child.wait())
            .await
            .map_err(|_| format!("{} did not die after SIGKILL", runners[victim].id))?
            .map_err(|error| format!("waiting for {}: {error}", runners[victim].id))?;
        runners[victim].exited = true;
        let took = served_again(&registry, &held, &gone, killed).await?;
        say(&format!("failover ({mode}): served again after {:.2} s", took.as_secs_f64()));
        report.samples.push(took);
        let process = runners[victim].id.process + 1;
        let name = runners[victim].name().to_owned();
        runners[victim] = spawn_runner_with(&name, process, &env, &[])?;
    }
    for runner in runners.iter_mut().filter(|runner| !runner.exited) {
        let _ = runner.signal("-TERM").await;
        let _ = tokio::time::timeout(SETTLE_DEADLINE, runner.child.wait()).await;
        runner.exited = true;
    }
    Ok(report)
}

fn address(process: &Process) -> RunnerAddress {
    RunnerAddress::new("127.0.0.1", process.port)
}

/// The runner holding each shard of `all`, if a runner of the run does.
async fn holders(
    registry: &PgRunnerStorage,
    all: &[ShardId],
) -> Result<Vec<(ShardId, RunnerAddress)>, String> {
    let locks = registry.shard_locks(all).await.map_err(|error| error.to_string())?;
    Ok(locks
        .into_iter()
        .filter(|lock| !lock.expired)
        .filter_map(|lock| match lock.holder {
            LockHolder::Runner(address) => Some((lock.shard_id, address)),
            LockHolder::Session(_) => None,
        })
        .collect())
}

/// The shards `address` holds.
async fn held_by(
    registry: &PgRunnerStorage,
    all: &[ShardId],
    address: &RunnerAddress,
) -> Result<BTreeSet<ShardId>, String> {
    let holders = holders(registry, all).await?;
    Ok(holders
        .into_iter()
        .filter(|(_, holder)| holder == address)
        .map(|(shard, _)| shard)
        .collect())
}

/// Waits until every shard is held, each runner of `addresses` holding some.
async fn settled(
    registry: &PgRunnerStorage,
    all: &[ShardId],
    addresses: &[RunnerAddress],
) -> Result<(), String> {
    let deadline = Instant::now() + SETTLE_DEADLINE;
    loop {
        let holders = holders(registry, all).await?;
        let holding: BTreeSet<&RunnerAddress> = holders.iter().map(|(_, holder)| holder).collect();
        if holders.len() == all.len() && addresses.iter().all(|address| holding.contains(address)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the cluster did not settle within {SETTLE_DEADLINE:?}: {} of {} shards held, \
                 by {} runners",
                holders.len(),
                all.len(),
                holding.len()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until runners other than `gone` hold every shard of `held`; returns the time since
/// `killed`.
async fn served_again(
    registry: &PgRunnerStorage,
    held: &BTreeSet<ShardId>,
    gone: &RunnerAddress,
    killed: Instant,
) -> Result<Duration, String> {
    let shards: Vec<ShardId> = held.iter().cloned().collect();
    loop {
        let holders = holders(registry, &shards).await?;
        let served = holders.iter().filter(|(_, holder)| holder != gone).count();
        if served == shards.len() {
            return Ok(killed.elapsed());
        }
        if killed.elapsed() > SETTLE_DEADLINE {
            return Err(format!(
                "{} of the {} shards of the killed runner {gone} are still unserved after {:?}",
                shards.len() - served,
                shards.len(),
                SETTLE_DEADLINE
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
