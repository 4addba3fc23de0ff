//! W6 to W9: three runner processes and this process as a client-only member, on PostgreSQL.
//!
//! - W9 adds a gateway process between this one and the runners: a client-only member serving
//!   the echo entity over HTTP (`durable_cluster::http`); this process sends HTTP requests.
//! - Each runner is this binary in `runner` mode, configured from the environment as any
//!   runner process is (`durable_cluster::Runner`): the echo entity, the workflow engine and the
//!   three-step workflow, on a free port of 127.0.0.1.
//! - This process joins as a client (no shard of its own) with the TCP transport, so every
//!   request crosses a process boundary.
//! - The peak resident set of every process is read from `/proc` before the runners stop.

use std::process::Stdio;
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_sharding::Sharding;
use cluster_workflow::{Workflow, WorkflowEngine};
use durable_cluster::{Role, Runner, RunnerEnv};
use tokio::process::{Child, Command};

use crate::database::BenchDatabase;
use crate::drive::Measured;
use crate::workloads::{self, Echo, Tally, ThreeSteps};
use crate::{Plan, Workload};

/// How many runner processes serve the shards.
const RUNNERS: usize = 3;

/// The variable tokio reads for its number of worker threads.
const WORKERS_VARIABLE: &str = "TOKIO_WORKER_THREADS";

/// The tokio worker threads each process of `workload` runs, across processes: the machine's
/// cores shared among them, at least one each, as a container's CPU limit would share them
/// (tokio sizes its pool from the cores a process may use). Every process of W6 to W8 on a
/// 2-core machine would otherwise run 2 workers, 8 threads on 2 cores, which pay for waking
/// each other more than for their work (docs/performance.md). `TOKIO_WORKER_THREADS` set by
/// the caller wins.
pub(crate) fn workers_per_process(workload: Workload) -> usize {
    if let Some(workers) =
        std::env::var(WORKERS_VARIABLE).ok().and_then(|value| value.trim().parse::<usize>().ok())
    {
        return workers.max(1);
    }
    let processes = RUNNERS + 1 + usize::from(workload == Workload::W9);
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    share_of(cores, processes)
}

/// Each of `processes` processes' share of `cores`, at least one.
fn share_of(cores: usize, processes: usize) -> usize {
    cores.checked_div(processes).unwrap_or(cores).max(1)
}

/// How long the runners may take to register.
const REGISTER_DEADLINE: Duration = Duration::from_secs(60);

/// How long a runner may take to hand its shards over and exit once told to stop.
const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// A measured run across processes, with every process's peak resident set in MiB (this one
/// first).
pub(crate) struct AcrossProcesses {
    pub(crate) measured: Measured,
    pub(crate) peak_rss_mb: Vec<f64>,
}

/// `cluster-bench runner`: one runner process, until SIGTERM.
///
/// # Errors
///
/// The environment is wrong, or the runner could not start.
pub(crate) async fn runner() -> Result<(), String> {
    let env = RunnerEnv::from_env(Role::Runner).map_err(|error| error.to_string())?;
    let runner = Runner::start(&env, |sharding| {
        sharding.entity::<Echo>().register()?;
        sharding.entity::<Tally>().register()?;
        // The engine's entities keep it: it lives as long as the runtime.
        let engine = WorkflowEngine::cluster(sharding)?;
        ThreeSteps::register(&engine, workloads::three_steps)?;
        Ok(())
    })
    .await
    .map_err(|error| error.to_string())?;
    durable_cluster::terminated().await.map_err(|error| error.to_string())?;
    runner.shutdown().await;
    Ok(())
}

/// `cluster-bench gateway`: W9's gateway process, a client-only member serving the echo entity
/// over HTTP on `127.0.0.1:$GATEWAY_PORT`, until SIGTERM.
///
/// # Errors
///
/// The environment is wrong, or the member or the listener could not start.
pub(crate) async fn gateway() -> Result<(), String> {
    let env = RunnerEnv::from_env(Role::Client).map_err(|error| error.to_string())?;
    let port: u16 = std::env::var("GATEWAY_PORT")
        .ok()
        .and_then(|port| port.parse().ok())
        .ok_or("GATEWAY_PORT must be a port")?;
    let client = env.join().await.map_err(|error| error.to_string())?;
    let router = durable_cluster::http::HttpGateway::new(client.clone()).entity::<Echo>().router();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|error| format!("127.0.0.1:{port}: {error}"))?;
    let stopped = async {
        let _ = durable_cluster::terminated().await;
    };
    axum::serve(listener, router)
        .with_graceful_shutdown(stopped)
        .await
        .map_err(|error| error.to_string())?;
    client.shutdown().await;
    Ok(())
}

/// Runs `plan` (W6 to W9) against three runner processes.
///
/// # Errors
///
/// A process or the database could not start, or an operation failed.
pub(crate) async fn run(plan: &Plan) -> Result<AcrossProcesses, String> {
    let database = BenchDatabase::postgres()?;
    let result = run_on(plan, &database).await;
    database.remove().await?;
    result
}

async fn run_on(plan: &Plan, database: &BenchDatabase) -> Result<AcrossProcesses, String> {
    let BenchDatabase::Postgres { url, prefix } = database else {
        return Err("the workloads across processes run on PostgreSQL".to_owned());
    };
    // The tables exist before any process starts (one migration, no race).
    let (_, registry) = database.open(&ShardingConfig::default()).await?;
    let secret = random_secret();
    let shared = vec![
        ("CLUSTER_STORAGE_URL".to_owned(), url.clone()),
        ("CLUSTER_TABLE_PREFIX".to_owned(), prefix.as_str().to_owned()),
        ("CLUSTER_RPC_SECRET".to_owned(), secret),
        (WORKERS_VARIABLE.to_owned(), workers_per_process(plan.workload).to_string()),
    ];
    let mut runners = Vec::with_capacity(RUNNERS);
    for _ in 0..RUNNERS {
        runners.push(spawn_runner(&shared)?);
    }
    let gateway_port = free_port()?;
    let mut gateway = if plan.workload == Workload::W9 {
        Some(spawn_mode("gateway", &shared, &[("GATEWAY_PORT", gateway_port.to_string())])?)
    } else {
        None
    };
    let measured = async {
        wait_for_runners(&*registry).await?;
        if plan.workload == Workload::W9 {
            let http = crate::http::HttpClient::new(gateway_port);
            http.wait_until_up().await?;
            return crate::http::persisted_echo_over_http(plan, Some(database), http).await;
        }
        let env = RunnerEnv::from_lookup(Role::Client, |name| {
            shared.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone())
        })
        .map_err(|error| error.to_string())?;
        let client = env.join().await.map_err(|error| error.to_string())?;
        let measured = measure(plan, database, &client).await;
        client.shutdown().await;
        measured
    }
    .await;
    let mut peak_rss_mb = vec![crate::peak_rss_mb()];
    peak_rss_mb.extend(gateway.iter().map(|child| child.id().map_or(0.0, peak_rss_of)));
    peak_rss_mb.extend(runners.iter().map(|child| child.id().map_or(0.0, peak_rss_of)));
    if let Some(gateway) = &mut gateway {
        stop(gateway).await;
    }
    for child in &mut runners {
        stop(child).await;
    }
    Ok(AcrossProcesses { measured: measured?, peak_rss_mb })
}

/// The workload of `plan` from the client `client`.
///
/// As for W3 and W5, `database`'s statistics are refreshed after the warm-up. The tables start
/// empty, and a plan that PostgreSQL caches while they are empty can stay in use as they grow
/// (the owner's read-back of a pushed request: 1.9 ms a call instead of 0.04 ms).
async fn measure(
    plan: &Plan,
    database: &BenchDatabase,
    client: &Sharding,
) -> Result<Measured, String> {
    match plan.workload {
        Workload::W6 => workloads::persisted_echo_on(plan, Some(database), client).await,
        Workload::W6S => workloads::stateful_on(plan, Some(database), client).await,
        Workload::W7 => workloads::volatile_echo_from(plan, client).await,
        Workload::W8 => workloads::workflows_on(plan, Some(database), client).await,
        other => Err(format!("{other:?} does not run across processes")),
    }
}

/// Starts one runner process on a free port of 127.0.0.1.
fn spawn_runner(shared: &[(String, String)]) -> Result<Child, String> {
    let port = free_port()?.to_string();
    spawn_mode("runner", shared, &[("HOST", "127.0.0.1".to_owned()), ("PORT", port)])
}

/// Starts this binary in `mode` with the `shared` and `own` variables.
fn spawn_mode(
    mode: &str,
    shared: &[(String, String)],
    own: &[(&str, String)],
) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|error| format!("current exe: {error}"))?;
    let mut command = Command::new(exe);
    command.arg(mode).stdout(Stdio::null()).stderr(Stdio::inherit()).kill_on_drop(true);
    command.envs(shared.iter().map(|(name, value)| (name, value)));
    command.envs(own.iter().map(|(name, value)| (name, value)));
    command.spawn().map_err(|error| format!("cannot start a {mode}: {error}"))
}

/// Waits until every runner is in the registry.
async fn wait_for_runners(
    registry: &dyn cluster_core::storage::RunnerStorage,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + REGISTER_DEADLINE;
    loop {
        let registered = registry.get_runners().await.map_err(|error| error.to_string())?;
        let healthy = registered.iter().filter(|(_, healthy)| *healthy).count();
        if healthy >= RUNNERS {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("{healthy} of {RUNNERS} runners registered healthy in time"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Stops a runner gracefully (SIGTERM: it hands its shards over), or kills it past the
/// deadline.
async fn stop(child: &mut Child) {
    if let Some(pid) = child.id() {
        let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status().await;
    }
    if tokio::time::timeout(STOP_DEADLINE, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

/// The peak resident set (`VmHWM`) of process `pid` in MiB, or 0 where `/proc` has none.
fn peak_rss_of(pid: u32) -> f64 {
    crate::vm_hwm_mb(&std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default())
}

/// A free TCP port on 127.0.0.1 (bound, then released for the runner to take).
fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|error| error.to_string())?;
    listener.local_addr().map(|address| address.port()).map_err(|error| error.to_string())
}

/// A fresh random shared secret for one run: 64 hexadecimal digits from four randomly keyed
/// hashers (the transport refuses secrets shorter than 32 bytes).
fn random_secret() -> String {
    use std::hash::{BuildHasher, Hasher};
    (0..4)
        .map(|_| format!("{:016x}", std::hash::RandomState::new().build_hasher().finish()))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_process_gets_its_share_of_the_cores_and_at_least_one() {
        assert_eq!(super::share_of(2, 4), 1, "four processes on two cores");
        assert_eq!(super::share_of(16, 4), 4);
        assert_eq!(super::share_of(17, 5), 3);
        assert_eq!(super::share_of(1, 0), 1);
    }
}
