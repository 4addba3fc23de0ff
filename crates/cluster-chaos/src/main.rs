//! `chaos runner` runs one runner from the environment (see `durable_cluster::Runner`) with the
//! test's ledger entity; `chaos client` runs the client-only workload; `chaos run` (the
//! default) runs the whole fault test across processes and exits non-zero on any violation;
//! `chaos failover` measures failovers after SIGKILL with the default settings.

use std::process::ExitCode;
use std::time::Duration;

use cluster_chaos::chaos::{self, ChaosOptions, say};
use cluster_chaos::ledger::{self, Ledger, LedgerDependencies};
use cluster_chaos::runs::{self, RunRecorder};
use cluster_chaos::workload::{self, WorkloadOptions};
use durable_cluster::{Role, Runner, RunnerEnv};

#[tokio::main]
async fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "run".to_owned());
    let result = match mode.as_str() {
        // A runner's failures are reported as every runner reports them (`Runner::main_with`).
        "runner" => return runner().await,
        "client" => client().await,
        "run" => run().await,
        "failover" => failover().await,
        other => Err(format!("unknown mode {other:?}: expected runner, client, run or failover")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            report_error(&format!("chaos {mode}: {error}"));
            ExitCode::FAILURE
        }
    }
}

#[expect(clippy::print_stderr, reason = "a failed process says why on standard error")]
fn report_error(message: &str) {
    eprintln!("{message}");
}

async fn runner() -> ExitCode {
    let env = RunnerEnv::from_env(Role::Runner);
    let dependencies = match &env {
        Ok(env) => match ledger_dependencies(env) {
            Ok(dependencies) => dependencies,
            Err(error) => {
                report_error(&format!("chaos runner: {error}"));
                return ExitCode::FAILURE;
            }
        },
        Err(_) => LedgerDependencies::default(),
    };
    Runner::main_with(env, |sharding| {
        sharding.entity().factory(Ledger::factory(dependencies)).register()?;
        Ok(())
    })
    .await
}

/// The ledger's audit and run recording, from the `CHAOS_*` variables.
fn ledger_dependencies(env: &RunnerEnv) -> Result<LedgerDependencies, String> {
    let mut dependencies = LedgerDependencies::default();
    if std::env::var("CHAOS_AUDIT").is_ok() {
        dependencies.audit_table = Some(ledger::audit_table(&env.table_prefix));
        let name = std::env::var("CHAOS_RUNNER_NAME").unwrap_or_else(|_| "runner".to_owned());
        let process = match std::env::var("CHAOS_RUNNER_PROCESS") {
            Ok(value) => value
                .parse()
                .map_err(|_| format!("CHAOS_RUNNER_PROCESS={value:?} is not a number"))?,
            Err(_) => 1,
        };
        let table = runs::runs_table(&env.table_prefix);
        let recorder = RunRecorder::new(&env.storage_url, &table, name, process)
            .map_err(|error| error.to_string())?;
        dependencies.recorder = Some(recorder);
        if let Ok(value) = std::env::var("CHAOS_DEPOSIT_WORK_MS") {
            let millis: u64 = value
                .parse()
                .map_err(|_| format!("CHAOS_DEPOSIT_WORK_MS={value:?} is not a number"))?;
            dependencies.deposit_work = Duration::from_millis(millis);
        }
    }
    Ok(dependencies)
}

async fn client() -> Result<(), String> {
    let env = RunnerEnv::from_env(Role::Client).map_err(|error| error.to_string())?;
    let options = WorkloadOptions::from_env()?;
    let sharding = env.join().await.map_err(|error| error.to_string())?;
    let summary = workload::run(&sharding, &options).await;
    sharding.shutdown().await;
    let line = serde_json::to_string(&summary).map_err(|error| error.to_string())?;
    say(&line);
    Ok(())
}

/// `chaos failover`: SIGKILLs with the default settings (`CHAOS_FAILOVER_KILLS` per lock mode,
/// 3 unless set), and the distribution of the failover times.
async fn failover() -> Result<(), String> {
    let postgres_url = std::env::var("CLUSTER_CHAOS_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let kills = match std::env::var("CHAOS_FAILOVER_KILLS") {
        Ok(value) => {
            value.parse().map_err(|_| format!("CHAOS_FAILOVER_KILLS={value:?} is not a number"))?
        }
        Err(_) => 3,
    };
    let reports = cluster_chaos::failover::run(&cluster_chaos::failover::FailoverOptions {
        postgres_url,
        kills,
    })
    .await?;
    let mut violations = Vec::new();
    for report in &reports {
        say(&format!("chaos {}", report.summary()));
        violations.extend(report.violations());
    }
    if violations.is_empty() {
        say("chaos failover: passed");
        return Ok(());
    }
    for violation in &violations {
        say(&format!("chaos violation: {violation}"));
    }
    Err(format!("{} violations", violations.len()))
}

async fn run() -> Result<(), String> {
    let postgres_url = std::env::var("CLUSTER_CHAOS_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let keep_tables = std::env::var_os("CHAOS_KEEP_TABLES").is_some();
    let options = ChaosOptions { postgres_url, send_for: Duration::from_secs(30), keep_tables };
    let report = chaos::run(&options).await?;
    let client = &report.client;
    say(&format!(
        "chaos summary: deposits sent {}, answered {}, failed {}, unanswered {}; \
         echoes ok {}, wrong {}; deposit latency p50 {} ms, p99 {} ms, max {} ms; audit rows {}; \
         ledgers with a durable balance {}; errors by kind {:?}",
        client.sent,
        client.answered,
        client.failed,
        client.unanswered,
        client.echoes_ok,
        client.echoes_wrong,
        client.p50_deposit_latency_ms,
        client.p99_deposit_latency_ms,
        client.max_deposit_latency_ms,
        report.audit_rows,
        report.ledgers,
        client.errors
    ));
    let reruns = &report.reruns;
    say(&format!(
        "chaos runs: {} runs of {} deposits, {} re-runs: {} explained by a fault {:?}, {} not \
         explained",
        reruns.runs,
        reruns.deposits,
        reruns.reruns,
        reruns.excused.values().sum::<usize>(),
        reruns.excused,
        reruns.unexcused
    ));
    say(&format!(
        "chaos order: {} ledgers, {} deposits compared with the one stored before them, {} \
         stored while an earlier one to their ledger was unanswered, {} deleted by retention, \
         {} out of order",
        report.order.entities,
        report.order.pairs,
        client.queued_behind,
        report.order.purged,
        report.order.violation_count
    ));
    let retained = &report.retention;
    let seconds = |ms: Option<i64>| {
        ms.map_or_else(|| "none".to_owned(), |ms| format!("{:.1} s", ms as f64 / 1000.0))
    };
    say(&format!(
        "chaos retention {:?}: {} deposits deleted whole (the youngest audited {} before the \
         check), {} stored with their reply (the oldest audited {} before the check); every \
         deposit audited within {} of the check must be stored",
        chaos::RETENTION,
        retained.purged,
        seconds(retained.youngest_purged_ms),
        retained.present,
        seconds(retained.oldest_present_ms),
        seconds(Some(retained.window_ms)),
    ));
    if report.violations.is_empty() {
        say("chaos: passed");
        Ok(())
    } else {
        for violation in &report.violations {
            say(&format!("chaos violation: {violation}"));
        }
        Err(format!("{} violations", report.violations.len()))
    }
}
