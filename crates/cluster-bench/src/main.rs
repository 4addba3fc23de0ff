//! The benchmark workloads of docs/performance.md, one per process (so the peak resident set is the
//! workload's own), each printing one JSON line.
//!
//! ```text
//! cargo run --release -p cluster-bench -- W1 [--ops N] [--in-flight N] [--entities N]
//! ```
//!
//! - `W0`: W1's baseline, the same echo through bare tokio mailboxes and oneshots (no
//!   runtime), to compare W1 with on the same machine and day.
//! - `W1`: volatile echo requests to local entities (no storage).
//! - `W2`, `W3`: the same request persisted with a primary key, on SQLite and on PostgreSQL.
//! - `W3C`: W3 while an operator's console polls the read model every second from storages
//!   of its own (`durable_cluster::admin`: the overview's runners, shards, backlog and stuck
//!   work, and a page of workflow executions).
//! - `W2S`, `W3S`, `W6S`: W2, W3 and W6 where every request also changes its entity's durable
//!   state (a count), committed with its reply.
//! - `W4`, `W5`: a workflow of three small activities on the cluster workflow engine, on
//!   SQLite and on PostgreSQL.
//! - `W6`, `W7`, `W8`: three runner processes on PostgreSQL and this process as a client-only
//!   member: W3's persisted request, a volatile echo, and W5's workflow (see `processes`).
//!   The line adds the sum and the maximum of every process's peak resident set.
//! - `runner`: one runner process of W6 to W8 (started by them).
//! - `soak`: W3 for ten minutes with message retention at one minute, a JSON line every ten
//!   seconds with the throughput and the tables' rows and size, then a summary (see `soak`).
//!
//! `cargo xtask bench` runs them in release mode with the local services (see
//! docs/performance.md). PostgreSQL comes from `CLUSTER_BENCH_POSTGRES_URL`, else
//! `CLUSTER_TEST_POSTGRES_URL`, else the local server; the benchmark's tables have a prefix of
//! their own and are dropped afterwards.

mod database;
mod drive;
mod http;
mod processes;
mod soak;
mod workloads;

use std::process::ExitCode;

use crate::drive::Measured;

/// One workload run: which, where and how much.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// `W0` … `W5`.
    pub(crate) workload: Workload,
    /// Measured operations (requests or workflow executions).
    pub(crate) ops: usize,
    /// Operations in flight at once (the number of callers).
    pub(crate) in_flight: usize,
    /// Distinct entities the requests go to (W1–W3).
    pub(crate) entities: usize,
}

/// The workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Workload {
    /// The baseline of W1 without the runtime: the same echo through a bare tokio mailbox and
    /// a oneshot per request, with the same JSON encoding, on the same driver (the issue's
    /// "bare echo" that W1 is measured against).
    W0,
    /// Volatile echo.
    W1,
    /// Persisted echo on SQLite.
    W2,
    /// Persisted echo on PostgreSQL.
    W3,
    /// W2 with a durable state change per request.
    W2S,
    /// W3 with a durable state change per request.
    W3S,
    /// W3 while an operator's console polls the read model every second.
    W3C,
    /// Three-activity workflow on SQLite.
    W4,
    /// Three-activity workflow on PostgreSQL.
    W5,
    /// Persisted echo from a client to three runner processes, on PostgreSQL.
    W6,
    /// W6 with a durable state change per request.
    W6S,
    /// Volatile echo from a client to three runner processes.
    W7,
    /// Three-activity workflow started from a client, run by three runner processes.
    W8,
    /// W6's persisted echo over HTTP, through a gateway process (a client-only member serving
    /// `durable_cluster::http`) to three runner processes, on PostgreSQL.
    W9,
}

impl Workload {
    fn parse(name: &str) -> Option<Workload> {
        match name.to_ascii_uppercase().as_str() {
            "W0" => Some(Workload::W0),
            "W1" => Some(Workload::W1),
            "W2" => Some(Workload::W2),
            "W3" => Some(Workload::W3),
            "W2S" => Some(Workload::W2S),
            "W3S" => Some(Workload::W3S),
            "W3C" => Some(Workload::W3C),
            "W6S" => Some(Workload::W6S),
            "W4" => Some(Workload::W4),
            "W5" => Some(Workload::W5),
            "W6" => Some(Workload::W6),
            "W7" => Some(Workload::W7),
            "W8" => Some(Workload::W8),
            "W9" => Some(Workload::W9),
            _ => None,
        }
    }

    /// The storage it runs on.
    pub(crate) fn storage(self) -> &'static str {
        match self {
            Workload::W0 | Workload::W1 => "memory",
            Workload::W2 | Workload::W2S | Workload::W4 => "sqlite",
            Workload::W3
            | Workload::W3S
            | Workload::W3C
            | Workload::W6S
            | Workload::W5
            | Workload::W6
            | Workload::W7
            | Workload::W8
            | Workload::W9 => "postgres",
        }
    }

    /// The reference workload's size: `(ops, in_flight, entities)`.
    fn defaults(self) -> (usize, usize, usize) {
        match self {
            // A million: 100,000 take about 0.15 s, too short to read on a noisy machine.
            Workload::W0 | Workload::W1 | Workload::W7 => (1_000_000, 256, 1_000),
            Workload::W2
            | Workload::W3
            | Workload::W6
            | Workload::W9
            | Workload::W2S
            | Workload::W3S
            | Workload::W3C
            | Workload::W6S => (20_000, 64, 1_000),
            Workload::W4 | Workload::W5 | Workload::W8 => (2_000, 64, 0),
        }
    }
}

const USAGE: &str = "usage: cluster-bench <W0|W1|W2|W3|W4|W5|W6|W7|W8|W9|W2S|W3S|W3C|W6S> [--ops N] [--in-flight N] [--entities N] | soak [--seconds N] [--retention-seconds R] [--sample-seconds S] [--in-flight N] [--entities N] [--no-vacuum] | runner | gateway";

/// Reads the command line.
pub(crate) fn parse_args(args: &[String]) -> Result<Plan, String> {
    let (name, options) = args.split_first().ok_or_else(|| USAGE.to_owned())?;
    let workload =
        Workload::parse(name).ok_or_else(|| format!("unknown workload `{name}`; {USAGE}"))?;
    let (mut ops, mut in_flight, mut entities) = workload.defaults();
    let mut options = options.iter();
    while let Some(option) = options.next() {
        let target = match option.as_str() {
            "--ops" => &mut ops,
            "--in-flight" => &mut in_flight,
            "--entities" => &mut entities,
            other => return Err(format!("unknown option `{other}`; {USAGE}")),
        };
        let value = options.next().ok_or_else(|| format!("`{option}` needs a number"))?;
        *target = value
            .replace('_', "")
            .parse()
            .map_err(|_| format!("`{option}` needs a number, not `{value}`"))?;
        if *target == 0 {
            return Err(format!("`{option}` must be at least 1"));
        }
    }
    Ok(Plan { workload, ops, in_flight, entities })
}

/// The JSON line of a finished run; `processes` holds the peak resident set of every process
/// of a run across processes (this one first), for their sum and maximum.
pub(crate) fn report(
    plan: &Plan,
    measured: &Measured,
    peak_rss_mb: f64,
    processes: Option<&[f64]>,
) -> String {
    let seconds = measured.elapsed.as_secs_f64();
    let ops_per_s = if seconds > 0.0 { usize_f64(plan.ops) / seconds } else { 0.0 };
    let round = |value: f64, digits: i32| {
        let scale = 10f64.powi(digits);
        (value * scale).round() / scale
    };
    let line = serde_json::json!({
        "workload": format!("{:?}", plan.workload),
        "storage": plan.workload.storage(),
        "ops": plan.ops,
        "in_flight": plan.in_flight,
        "entities": plan.entities,
        "seconds": round(seconds, 3),
        "ops_per_s": round(ops_per_s, 0),
        "p50_ms": round(measured.percentile_ms(500), 3),
        "p99_ms": round(measured.percentile_ms(990), 3),
        "peak_rss_mb": round(peak_rss_mb, 1),
    });
    let mut line = line;
    if let (Some(processes), Some(fields)) = (processes, line.as_object_mut()) {
        let sum: f64 = processes.iter().sum();
        let max = processes.iter().copied().fold(0.0, f64::max);
        fields.insert("processes".to_owned(), processes.len().into());
        fields.insert(
            "workers_per_process".to_owned(),
            processes::workers_per_process(plan.workload).into(),
        );
        fields.insert("rss_sum_mb".to_owned(), round(sum, 1).into());
        fields.insert("rss_max_mb".to_owned(), round(max, 1).into());
    }
    line.to_string()
}

/// `value` as a float (exact below 2^53, which every count here is).
#[expect(clippy::cast_precision_loss, reason = "counts far below 2^53")]
pub(crate) fn usize_f64(value: usize) -> f64 {
    value as f64
}

/// The process's peak resident set (`VmHWM`) in MiB, or 0 where `/proc` has none.
pub(crate) fn peak_rss_mb() -> f64 {
    vm_hwm_mb(&std::fs::read_to_string("/proc/self/status").unwrap_or_default())
}

/// The `VmHWM` of a `/proc/<pid>/status` text in MiB, or 0 without one.
pub(crate) fn vm_hwm_mb(status: &str) -> f64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u32>().ok())
        .map_or(0.0, |kib| f64::from(kib) / 1024.0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("runner") {
        return run_process("runner", processes::runner());
    }
    if args.first().map(String::as_str) == Some("gateway") {
        return run_process("gateway", processes::gateway());
    }
    if args.first().map(String::as_str) == Some("soak") {
        return match soak::parse_soak_args(&args[1..]) {
            Ok(plan) => run_process("soak", async move { soak::run(&plan).await }),
            Err(error) => fail(&error),
        };
    }
    let plan = match parse_args(&args) {
        Ok(plan) => plan,
        Err(error) => return fail(&error),
    };
    let across = matches!(
        plan.workload,
        Workload::W6 | Workload::W6S | Workload::W7 | Workload::W8 | Workload::W9
    );
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if across {
        // This process is one of several sharing the cores (see `workers_per_process`).
        builder.worker_threads(processes::workers_per_process(plan.workload));
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => return fail(&format!("cannot start the runtime: {error}")),
    };
    let outcome = runtime.block_on(async {
        if across {
            let run = processes::run(&plan).await?;
            Ok((run.measured, Some(run.peak_rss_mb)))
        } else {
            workloads::run(&plan).await.map(|measured| (measured, None))
        }
    });
    match outcome {
        Ok((measured, processes)) => {
            let line = report(&plan, &measured, peak_rss_mb(), processes.as_deref());
            #[expect(clippy::print_stdout, reason = "the benchmark's result line")]
            {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(error) => fail(&format!("{:?}: {error}", plan.workload)),
    }
}

/// `cluster-bench runner` (a runner process of W6 to W8), `cluster-bench gateway` (the HTTP
/// gateway process of W9) or `cluster-bench soak`: runs `process` on a runtime of its own, of
/// as many workers as `TOKIO_WORKER_THREADS` says (the parent of a runner or gateway sets it,
/// see `processes::workers_per_process`; otherwise one per core).
fn run_process(
    name: &str,
    process: impl std::future::Future<Output = Result<(), String>>,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => return fail(&format!("cannot start the runtime: {error}")),
    };
    match runtime.block_on(process) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => fail(&format!("{name}: {error}")),
    }
}

/// A note on standard error, beside the JSON line on standard output.
#[expect(clippy::print_stderr, reason = "the benchmark notes what it did beside its result")]
pub(crate) fn note(message: &str) {
    eprintln!("cluster-bench: {message}");
}

#[expect(clippy::print_stderr, reason = "the benchmark reports why it could not run")]
fn fail(error: &str) -> ExitCode {
    eprintln!("cluster-bench: {error}");
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn a_workload_takes_the_reference_sizes_unless_told_otherwise() {
        assert_eq!(
            parse_args(&args("w1")),
            Ok(Plan { workload: Workload::W1, ops: 1_000_000, in_flight: 256, entities: 1_000 })
        );
        assert_eq!(
            parse_args(&args("W3 --in-flight 16 --ops 1_000")),
            Ok(Plan { workload: Workload::W3, ops: 1_000, in_flight: 16, entities: 1_000 })
        );
        assert_eq!(parse_args(&args("W5")).map(|plan| plan.ops), Ok(2_000));
        assert_eq!(
            parse_args(&args("w9")),
            Ok(Plan { workload: Workload::W9, ops: 20_000, in_flight: 64, entities: 1_000 })
        );
    }

    #[test]
    fn bad_arguments_are_refused_with_a_reason() {
        assert!(parse_args(&[]).unwrap_err().starts_with("usage"));
        assert!(parse_args(&args("W10")).unwrap_err().contains("unknown workload `W10`"));
        assert!(parse_args(&args("W1 --ops")).unwrap_err().contains("needs a number"));
        assert!(parse_args(&args("W1 --ops many")).unwrap_err().contains("not `many`"));
        assert!(parse_args(&args("W1 --ops 0")).unwrap_err().contains("at least 1"));
        assert!(parse_args(&args("W1 --fast")).unwrap_err().contains("unknown option"));
    }

    #[test]
    fn the_report_is_one_json_line_with_every_field() {
        let plan = parse_args(&args("W2 --ops 4")).unwrap();
        let measured = Measured {
            elapsed: std::time::Duration::from_secs(2),
            latencies_ns: vec![1_000_000, 2_000_000, 3_000_000, 40_000_000],
        };
        let line = report(&plan, &measured, 12.34, None);
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["workload"], "W2");
        assert_eq!(value["storage"], "sqlite");
        assert_eq!(value["ops"], 4);
        assert_eq!(value["ops_per_s"], 2.0);
        assert_eq!(value["p50_ms"], 2.0);
        assert_eq!(value["p99_ms"], 40.0);
        assert_eq!(value["peak_rss_mb"], 12.3);
        assert!(!line.contains('\n'));
        assert!(value.get("rss_sum_mb").is_none(), "one process: no sum");
        let across = parse_args(&args("W6 --ops 4")).unwrap();
        let line = report(&across, &measured, 10.0, Some(&[10.0, 20.55, 30.0]));
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["storage"], "postgres");
        assert_eq!(value["processes"], 3);
        assert_eq!(value["rss_sum_mb"], 60.6);
        assert_eq!(value["rss_max_mb"], 30.0);
    }
}
