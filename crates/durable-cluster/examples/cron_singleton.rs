//! A cron job and a singleton on one runner with a SQLite file.
//!
//! ```text
//! cargo run -p durable-cluster --example cron_singleton
//! ```
//!
//! - The singleton `heartbeat` runs on the one runner that holds its shard (here the only
//!   runner): it beats every 100 ms until its cancellation fires, which happens when the
//!   runner lets the shard go (here at shutdown), and only then is the shard's lock released.
//! - The cron job `report` runs every second (six fields, seconds first, UTC), once per instant
//!   across the whole cluster: each run is a persisted request delivered at its instant.
//!
//! The example waits (with a deadline) for three cron runs, shuts the runner down, and checks
//! that every run was for a distinct instant, one second apart, and that the singleton beat
//! and then saw its cancellation.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durable_cluster::ShardingConfig;
use durable_cluster::cluster_core::sync::lock;
use durable_cluster::{CronOptions, SingleRunner, SingletonOptions};

/// What the singleton and the job did.
#[derive(Default)]
struct Seen {
    beats: AtomicUsize,
    cancelled: AtomicBool,
    runs: Mutex<Vec<i64>>,
}

impl Seen {
    fn runs(&self) -> Vec<i64> {
        lock(&self.runs).clone()
    }
}

async fn run(path: &std::path::Path) -> Result<(), String> {
    // Cron runs are persisted requests delivered at their instant: the storage read loop looks
    // for due messages every `entity_message_poll_interval`, so a job every second needs a poll
    // at least that often (the default is 10 s).
    let config = ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(100),
        ..ShardingConfig::default()
    };
    let sharding = SingleRunner::sqlite(path, config).await.map_err(|error| error.to_string())?;
    let seen = Arc::new(Seen::default());

    let beat = Arc::clone(&seen);
    sharding
        .register_singleton("heartbeat", SingletonOptions::default(), move |context| {
            let seen = Arc::clone(&beat);
            async move {
                loop {
                    tokio::select! {
                        () = context.cancellation().cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(100)) => {
                            seen.beats.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                seen.cancelled.store(true, Ordering::SeqCst);
            }
        })
        .map_err(|error| error.to_string())?;

    let job = Arc::clone(&seen);
    sharding
        .register_cron("report", "* * * * * *", CronOptions::default(), move |context| {
            let seen = Arc::clone(&job);
            async move {
                let instant = context.scheduled().unix_millis();
                say(&format!("cron run for {instant} (unix ms)"));
                lock(&seen.runs).push(instant);
                Ok::<(), String>(())
            }
        })
        .map_err(|error| error.to_string())?;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while seen.runs().len() < 3 {
        if tokio::time::Instant::now() > deadline {
            sharding.shutdown().await;
            return Err(format!("only {} cron runs in 20 s", seen.runs().len()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sharding.shutdown().await;

    let runs = seen.runs();
    let beats = seen.beats.load(Ordering::SeqCst);
    say(&format!("{} cron runs, {beats} heartbeats", runs.len()));
    let distinct_seconds = runs.windows(2).all(|pair| pair[1] - pair[0] == 1_000);
    if !distinct_seconds || runs.iter().any(|instant| instant % 1_000 != 0) {
        return Err(format!("cron runs not one per second: {runs:?}"));
    }
    if beats == 0 || !seen.cancelled.load(Ordering::SeqCst) {
        return Err(format!(
            "the singleton beat {beats} times, cancelled: {}",
            seen.cancelled.load(Ordering::SeqCst)
        ));
    }
    Ok(())
}

#[expect(clippy::print_stdout, reason = "the example narrates what happens")]
fn say(line: &str) {
    println!("{line}");
}

#[tokio::main]
async fn main() -> ExitCode {
    let path = std::env::temp_dir().join(format!("cron-example-{}.db", std::process::id()));
    let result = run(&path).await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    match result {
        Ok(()) => {
            say("cron_singleton: one run per second, and the singleton stopped with the runner");
            ExitCode::SUCCESS
        }
        Err(error) => {
            #[expect(clippy::print_stderr, reason = "the example reports its failure")]
            {
                eprintln!("cron_singleton: {error}");
            }
            ExitCode::FAILURE
        }
    }
}
