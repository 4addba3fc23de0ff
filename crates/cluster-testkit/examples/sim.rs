//! Runs the simulated cluster (`cluster_testkit::sim`) over seeds.
//!
//! ```text
//! cargo run -p cluster-testkit --example sim -- --seeds 200 [--from 0]
//! cargo run -p cluster-testkit --example sim -- --seed 17      # replay one seed, with its trace
//! cargo run -p cluster-testkit --example sim -- --seed 17 --trace   # and the runtime's events
//! cargo run -p cluster-testkit --example sim -- --seed 153 --classic  # an older scenario
//! ```
//!
//! `--classic` runs the scenario as it was before transport faults, latency spikes and
//! workflows came (`SimConfig::classic`), in which the oldest regression seeds were found;
//! `--extended` the one before the checks of handler runs came (`SimConfig::extended`);
//! `--graceful` the scenario with graceful faults only (`SimConfig::graceful`), in which every
//! handler must run exactly once and in storage order.
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
    quiet_deliberate_panics();
    let deterministic = cfg!(tokio_unstable);
    let flag = |name: &str| args.iter().any(|arg| arg == name);
    let config: fn(u64) -> SimConfig = if flag("--classic") {
        SimConfig::classic
    } else if flag("--extended") {
        SimConfig::extended
    } else if flag("--graceful") {
        SimConfig::graceful
    } else {
        SimConfig::seed
    };
    if let Some(seed) = value("--seed") {
        if args.iter().any(|arg| arg == "--trace") {
            let _ = tracing::subscriber::set_global_default(Trace::default());
        }
        let report = run(&config(seed));
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
        let first = run(&config(seed));
        let mut problems = first.violations.clone();
        if deterministic {
            let second = run(&config(seed));
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

/// The workflow engine ends a run that has no result (a storage failure broke it off) with a
/// panic, which the runtime turns into an entity restart and a redelivery; those are part of
/// the scenario, not failures, and would bury the report under their messages. Every other
/// panic is reported as usual.
fn quiet_deliberate_panics() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if !message.starts_with("workflow run ended without a result") {
            report(info);
        }
    }));
}

/// The runtime's debug events (targets `cluster_*`) on standard error, each with the
/// simulation's time since the first event: `--trace`.
#[derive(Default)]
struct Trace {
    start: std::sync::OnceLock<tokio::time::Instant>,
}

/// Writes an event's fields as `message name=value …`.
struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl tracing::Subscriber for Trace {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::DEBUG && metadata.target().starts_with("cluster")
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    #[expect(clippy::print_stderr, reason = "the trace goes to standard error")]
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        let now = tokio::time::Instant::now();
        let at = now.duration_since(*self.start.get_or_init(|| now)).as_millis();
        let metadata = event.metadata();
        eprintln!("{at:>7} ms  {} {}: {}", metadata.level(), metadata.target(), fields.0);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}
