//! Runs the simulated cluster (`cluster_testkit::sim`) over seeds.
//!
//! ```text
//! cargo run -p cluster-testkit --example sim -- --seeds 200 [--from 0]
//! cargo run -p cluster-testkit --example sim -- --seed 17      # replay one seed, with its trace
//! ```
//!
//! Each seed runs twice and the two histories must be equal (built with
//! `--cfg tokio_unstable`, as `cargo xtask sim` does; otherwise only the invariants are
//! checked). A failure prints the seed and the violated invariant; the exit code is 1.

use std::process::ExitCode;

use cluster_testkit::sim::{SimConfig, run};

#[expect(clippy::print_stdout, reason = "the simulator reports on its output")]
fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|arg| arg == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let deterministic = cfg!(tokio_unstable);
    if let Some(seed) = value("--seed") {
        let report = run(&SimConfig::seed(seed));
        for (at, event) in &report.events {
            println!("{at:>7} ms  {event}");
        }
        println!("seed {seed}: history {:016x}, {} events", report.history, report.events.len());
        for violation in &report.violations {
            println!("seed {seed}: VIOLATION {violation}");
        }
        return if report.passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    }
    let seeds = value("--seeds").unwrap_or(20);
    let from = value("--from").unwrap_or(0);
    #[expect(
        clippy::disallowed_methods,
        reason = "the runner's own wall-clock duration, outside any simulation"
    )]
    let started = std::time::Instant::now();
    let mut failed = 0;
    for seed in from..from + seeds {
        let first = run(&SimConfig::seed(seed));
        let mut problems = first.violations.clone();
        if deterministic {
            let second = run(&SimConfig::seed(seed));
            if second.history != first.history {
                let diverged = first.events.iter().zip(&second.events).position(|(a, b)| a != b);
                problems.push(format!(
                    "not deterministic: histories {:016x} and {:016x} (first difference at event {diverged:?})",
                    first.history, second.history
                ));
            }
        }
        if problems.is_empty() {
            println!(
                "seed {seed}: ok ({} events, history {:016x})",
                first.events.len(),
                first.history
            );
        } else {
            failed += 1;
            for problem in problems {
                println!("seed {seed}: FAILED: {problem}  (replay: cargo xtask sim --seed {seed})");
            }
        }
    }
    println!(
        "sim: {seeds} seeds from {from}, {failed} failed, determinism {}checked, {:.1} s",
        if deterministic { "" } else { "not " },
        started.elapsed().as_secs_f64()
    );
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
