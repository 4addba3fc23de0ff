//! The soak run: W3's persisted echo for minutes with message retention on, sampling the
//! throughput and the tables' rows and size on disk, to see that they stay flat.
//!
//! ```text
//! cluster-bench soak [--seconds N] [--retention-seconds R] [--sample-seconds S]
//!                    [--in-flight N] [--entities N] [--no-vacuum]
//! ```
//!
//! One runner (`Sharding::single_runner`) on fresh PostgreSQL tables holds every shard, with
//! `message_retention` of `R` seconds (default 60) and otherwise W3's configuration. After a
//! short warm-up, `in_flight` callers (default 64) send W3's request to `entities` entities
//! (default 1,000), each with a primary key of its own, for `N` seconds (default 600). Every
//! `S` seconds (default 10) it prints one JSON line `{"kind":"sample",…}`: the window's
//! throughput and p99, the row counts of `<prefix>_messages` and `<prefix>_replies`, their
//! size on disk with indexes (`pg_total_relation_size`), their dead rows and this process's
//! resident set. A last line `{"kind":"summary","workload":"soak",…}` compares the first half
//! with the second and gives the rows and sizes at the start, at their maximum and at the end.
//! The tables are dropped afterwards. `cargo xtask bench soak` runs it and plots the samples.
//!
//! Deleted rows leave dead tuples that only a vacuum makes reusable. A server with
//! `autovacuum` off (the local test server, for speed) would grow the files whatever retention
//! deletes, so on such a server the soak runs `VACUUM` on the two tables after every sample in
//! autovacuum's stead (its time is in the sample, `vacuum_ms`); `--no-vacuum` leaves them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::ShardingConfig;
use cluster_core::sync::lock;
use cluster_sharding::Sharding;
use serde_json::Value;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::database::BenchDatabase;
use crate::drive::{Measured, OPERATION_DEADLINE, drive};
use crate::workloads::{Echo, check, entity_id, stored_ping};
use crate::{Plan, Workload, usize_f64};

/// Requests sent before the measurement (the tables' statistics are refreshed after them).
const WARM_UP: usize = 2_000;

/// The usage line of `cluster-bench soak`.
pub(crate) const SOAK_USAGE: &str = "usage: cluster-bench soak [--seconds N (600)] [--retention-seconds R (60)] [--sample-seconds S (10)] [--in-flight N (64)] [--entities N (1000)] [--no-vacuum]";

/// One soak run: how long, with which retention, sampled how often, under how much load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SoakPlan {
    /// How long the load runs after the warm-up.
    pub(crate) seconds: u64,
    /// The runner's `message_retention`.
    pub(crate) retention_seconds: u64,
    /// The length of one sample's window.
    pub(crate) sample_seconds: u64,
    /// Requests in flight at once (the number of callers).
    pub(crate) in_flight: usize,
    /// Distinct entities the requests go to.
    pub(crate) entities: usize,
    /// Whether the soak vacuums the tables after every sample when the server's autovacuum
    /// is off.
    pub(crate) vacuum: bool,
}

impl Default for SoakPlan {
    fn default() -> SoakPlan {
        SoakPlan {
            seconds: 600,
            retention_seconds: 60,
            sample_seconds: 10,
            in_flight: 64,
            entities: 1_000,
            vacuum: true,
        }
    }
}

impl SoakPlan {
    /// The W3 plan whose request, entities and load the soak sends.
    fn as_w3(&self) -> Plan {
        Plan {
            workload: Workload::W3,
            ops: WARM_UP,
            in_flight: self.in_flight,
            entities: self.entities,
        }
    }
}

/// Reads `soak`'s options (the words after `soak`).
pub(crate) fn parse_soak_args(options: &[String]) -> Result<SoakPlan, String> {
    let mut plan = SoakPlan::default();
    let mut options = options.iter();
    while let Some(option) = options.next() {
        let value = |options: &mut std::slice::Iter<'_, String>| -> Result<u64, String> {
            let value = options.next().ok_or_else(|| format!("`{option}` needs a number"))?;
            let number: u64 = value
                .replace('_', "")
                .parse()
                .map_err(|_| format!("`{option}` needs a number, not `{value}`"))?;
            if number == 0 {
                return Err(format!("`{option}` must be at least 1"));
            }
            Ok(number)
        };
        let count = |number: u64| {
            usize::try_from(number).map_err(|_| format!("`{option}` is too large: {number}"))
        };
        match option.as_str() {
            "--no-vacuum" => plan.vacuum = false,
            "--seconds" => plan.seconds = value(&mut options)?,
            "--retention-seconds" => plan.retention_seconds = value(&mut options)?,
            "--sample-seconds" => plan.sample_seconds = value(&mut options)?,
            "--in-flight" => plan.in_flight = count(value(&mut options)?)?,
            "--entities" => plan.entities = count(value(&mut options)?)?,
            other => return Err(format!("unknown option `{other}`; {SOAK_USAGE}")),
        }
    }
    Ok(plan)
}

/// The message tables at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Tables {
    /// Rows of `<prefix>_messages`.
    pub(crate) messages: i64,
    /// Rows of `<prefix>_replies`.
    pub(crate) replies: i64,
    /// Both tables' size on disk with their indexes and TOAST, in bytes.
    pub(crate) bytes: i64,
    /// Both tables' dead rows as the statistics collector last counted them.
    pub(crate) dead_rows: i64,
}

/// One window of the run.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Sample {
    /// Seconds from the start of the measurement to the window's end.
    pub(crate) t_s: f64,
    /// The window's length in seconds.
    pub(crate) window_s: f64,
    /// Requests answered in the window.
    pub(crate) ops: usize,
    /// The window's 99th latency percentile in milliseconds.
    pub(crate) p99_ms: f64,
    /// The tables at the window's end.
    pub(crate) tables: Tables,
    /// This process's resident set at the window's end, in MiB.
    pub(crate) rss_mb: f64,
    /// How long the soak's `VACUUM` after the sample took, in milliseconds, if it ran one.
    pub(crate) vacuum_ms: Option<f64>,
}

impl Sample {
    /// Requests answered per second in the window.
    fn ops_per_s(&self) -> f64 {
        if self.window_s > 0.0 { usize_f64(self.ops) / self.window_s } else { 0.0 }
    }

    /// The sample's JSON line.
    pub(crate) fn line(&self) -> String {
        let mut line = serde_json::json!({
            "kind": "sample",
            "t_s": round(self.t_s, 1),
            "ops": self.ops,
            "ops_per_s": round(self.ops_per_s(), 0),
            "p99_ms": round(self.p99_ms, 3),
            "messages": self.tables.messages,
            "replies": self.tables.replies,
            "table_bytes": self.tables.bytes,
            "dead_rows": self.tables.dead_rows,
            "rss_mb": round(self.rss_mb, 1),
        });
        if let (Some(vacuum_ms), Some(fields)) = (self.vacuum_ms, line.as_object_mut()) {
            fields.insert("vacuum_ms".to_owned(), round(vacuum_ms, 0).into());
        }
        line.to_string()
    }
}

/// `value` rounded to `digits` decimals.
fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// The summary line of a run: totals, the halves' mean throughput, the tables at the start,
/// at their maximum and at the end, and what reclaimed the dead rows (`vacuum`).
pub(crate) fn summary(
    plan: &SoakPlan,
    start: Tables,
    samples: &[Sample],
    peak_rss_mb: f64,
    vacuum: &str,
) -> String {
    let seconds: f64 = samples.iter().map(|sample| sample.window_s).sum();
    let ops: usize = samples.iter().map(|sample| sample.ops).sum();
    let rate = |part: &[&Sample]| {
        let seconds: f64 = part.iter().map(|sample| sample.window_s).sum();
        let ops: usize = part.iter().map(|sample| sample.ops).sum();
        if seconds > 0.0 { usize_f64(ops) / seconds } else { 0.0 }
    };
    let (first, second): (Vec<&Sample>, Vec<&Sample>) =
        samples.iter().partition(|sample| sample.t_s <= seconds / 2.0 + 1e-9);
    let (first, second) = (rate(&first), rate(&second));
    let ratio = if first > 0.0 { second / first } else { 0.0 };
    let last = samples.last().map_or(start, |sample| sample.tables);
    let max = |field: fn(&Tables) -> i64| {
        samples.iter().map(|sample| field(&sample.tables)).fold(field(&start), i64::max)
    };
    let mut fields = serde_json::Map::new();
    fields.insert("kind".to_owned(), "summary".into());
    fields.insert("workload".to_owned(), "soak".into());
    fields.insert("storage".to_owned(), "postgres".into());
    fields.insert("seconds".to_owned(), round(seconds, 1).into());
    fields.insert("retention_s".to_owned(), plan.retention_seconds.into());
    fields.insert("sample_s".to_owned(), plan.sample_seconds.into());
    fields.insert("in_flight".to_owned(), plan.in_flight.into());
    fields.insert("entities".to_owned(), plan.entities.into());
    fields.insert("ops".to_owned(), ops.into());
    let overall = if seconds > 0.0 { usize_f64(ops) / seconds } else { 0.0 };
    fields.insert("ops_per_s".to_owned(), round(overall, 0).into());
    fields.insert("first_half_ops_per_s".to_owned(), round(first, 0).into());
    fields.insert("second_half_ops_per_s".to_owned(), round(second, 0).into());
    fields.insert("second_to_first".to_owned(), round(ratio, 3).into());
    let worst_p99 = samples.iter().map(|sample| sample.p99_ms).fold(0.0, f64::max);
    fields.insert("max_window_p99_ms".to_owned(), round(worst_p99, 3).into());
    for (name, field) in [
        ("messages", (|t: &Tables| t.messages) as fn(&Tables) -> i64),
        ("replies", |t: &Tables| t.replies),
        ("table_bytes", |t: &Tables| t.bytes),
        ("dead_rows", |t: &Tables| t.dead_rows),
    ] {
        let key = |when: &str| format!("{when}_{name}");
        fields.insert(key("start"), field(&start).into());
        fields.insert(key("max"), max(field).into());
        fields.insert(key("last"), field(&last).into());
    }
    fields.insert("peak_rss_mb".to_owned(), round(peak_rss_mb, 1).into());
    fields.insert("vacuum".to_owned(), vacuum.into());
    Value::Object(fields).to_string()
}

/// Runs the soak on fresh PostgreSQL tables, printing each line as it comes, then drops the
/// tables.
///
/// # Errors
///
/// The runtime or its storage could not start, a request failed, or the tables could not be
/// read or dropped.
pub(crate) async fn run(plan: &SoakPlan) -> Result<(), String> {
    let database = BenchDatabase::postgres()?;
    let result = on_database(plan, &database).await;
    let removed = database.remove().await;
    result.and(removed)
}

/// The soak on `database`: runner, warm-up, load and samples, summary.
async fn on_database(plan: &SoakPlan, database: &BenchDatabase) -> Result<(), String> {
    let config = ShardingConfig {
        message_retention: Some(Duration::from_secs(plan.retention_seconds)),
        ..ShardingConfig::default()
    };
    let (messages, runners) = database.open(&config).await?;
    let sharding = Sharding::single_runner(config, messages, runners)
        .start()
        .await
        .map_err(|error| format!("cannot start the runner: {error}"))?;
    let result = load(plan, database, &sharding).await;
    sharding.shutdown().await;
    let (start, samples, vacuum) = result?;
    say(&summary(plan, start, &samples, crate::peak_rss_mb(), vacuum));
    Ok(())
}

/// The warm-up, then the load with a sample every window; returns the tables after the
/// warm-up, the samples, and what reclaimed the dead rows.
async fn load(
    plan: &SoakPlan,
    database: &BenchDatabase,
    sharding: &Sharding,
) -> Result<(Tables, Vec<Sample>, &'static str), String> {
    sharding.entity::<Echo>().register().map_err(|error| error.to_string())?;
    let monitor = Monitor::connect(database, plan.vacuum).await?;
    let w3 = plan.as_w3();
    let send = {
        let (sharding, w3) = (sharding.clone(), w3.clone());
        move |n: usize| {
            let client = sharding.client::<Echo>(entity_id(&w3, n));
            async move {
                let echoed = client.send(stored_ping(n)).await.map_err(|e| e.to_string())?;
                check(echoed, n)
            }
        }
    };
    drive(0, WARM_UP, plan.in_flight, send.clone())
        .await
        .map_err(|error| format!("warm-up: {error}"))?;
    database.analyze().await?;
    let start = monitor.read().await?;

    let next = Arc::new(AtomicUsize::new(WARM_UP));
    let stop = Arc::new(AtomicBool::new(false));
    let window: Arc<Mutex<Vec<u64>>> = Arc::default();
    let mut callers = JoinSet::new();
    for _ in 0..plan.in_flight {
        let (send, next, stop, window) =
            (send.clone(), Arc::clone(&next), Arc::clone(&stop), Arc::clone(&window));
        callers.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let sent = Instant::now();
                send(n).await.map_err(|error| format!("request {n}: {error}"))?;
                let nanos = u64::try_from(sent.elapsed().as_nanos()).unwrap_or(u64::MAX);
                lock(&window).push(nanos);
            }
            Ok::<(), String>(())
        });
    }
    let sampled = sample(plan, &monitor, &window, &mut callers).await;
    stop.store(true, Ordering::Relaxed);
    let finished = finish(&mut callers).await;
    let samples = sampled?;
    finished?;
    Ok((start, samples, monitor.vacuum_kind()))
}

/// Takes a sample at the end of every window until the run's time is up; a failed caller
/// ends it with the caller's error.
async fn sample(
    plan: &SoakPlan,
    monitor: &Monitor,
    window: &Mutex<Vec<u64>>,
    callers: &mut JoinSet<Result<(), String>>,
) -> Result<Vec<Sample>, String> {
    let started = Instant::now();
    let end = started + Duration::from_secs(plan.seconds);
    let every = Duration::from_secs(plan.sample_seconds);
    let mut samples = Vec::new();
    let mut window_start = started;
    let mut last_progress = started;
    loop {
        let window_end = (window_start + every).min(end);
        tokio::select! {
            () = tokio::time::sleep_until(window_end) => {}
            joined = callers.join_next() => return Err(match joined {
                Some(Ok(Err(error))) => error,
                Some(Err(error)) => format!("a caller panicked: {error}"),
                Some(Ok(Ok(()))) | None => "a caller stopped early".to_owned(),
            }),
        }
        let now = Instant::now();
        let mut latencies_ns = std::mem::take(&mut *lock(window));
        latencies_ns.sort_unstable();
        let measured = Measured { elapsed: now - window_start, latencies_ns };
        if !measured.latencies_ns.is_empty() {
            last_progress = now;
        } else if now - last_progress >= OPERATION_DEADLINE {
            return Err(format!("no request finished for {OPERATION_DEADLINE:?}"));
        }
        let tables = monitor.read().await?;
        let vacuum_ms = monitor.vacuum().await?;
        let sample = Sample {
            t_s: (now - started).as_secs_f64(),
            window_s: measured.elapsed.as_secs_f64(),
            ops: measured.latencies_ns.len(),
            p99_ms: measured.percentile_ms(990),
            tables,
            rss_mb: rss_mb(),
            vacuum_ms,
        };
        say(&sample.line());
        samples.push(sample);
        window_start = now;
        if now >= end {
            return Ok(samples);
        }
    }
}

/// Waits for the callers to finish their last request (each within the operation deadline).
async fn finish(callers: &mut JoinSet<Result<(), String>>) -> Result<(), String> {
    let joined = tokio::time::timeout(OPERATION_DEADLINE, async {
        let mut first_error = Ok(());
        while let Some(joined) = callers.join_next().await {
            let outcome = joined.map_err(|error| format!("a caller panicked: {error}"));
            if let Err(error) = outcome.and_then(|outcome| outcome) {
                first_error = first_error.and(Err(error));
            }
        }
        first_error
    })
    .await;
    joined.unwrap_or_else(|_| {
        Err(format!("the callers did not finish their last request within {OPERATION_DEADLINE:?}"))
    })
}

/// A connection of its own that reads the message tables' rows and size.
struct Monitor {
    /// The connection's client.
    client: tokio_postgres::Client,
    /// The task driving the connection, aborted on drop.
    connection: JoinHandle<Result<(), tokio_postgres::Error>>,
    /// The statement: two counts, the size, the dead rows.
    sql: String,
    /// Whether the server runs autovacuum.
    autovacuum: bool,
    /// The soak's `VACUUM` of the two tables, when it runs one after every sample.
    vacuum: Option<String>,
}

impl Monitor {
    /// Connects to `database` (PostgreSQL only); it vacuums after every sample if `vacuum` is
    /// set and the server's autovacuum is off.
    async fn connect(database: &BenchDatabase, vacuum: bool) -> Result<Monitor, String> {
        let BenchDatabase::Postgres { url, prefix } = database else {
            return Err("the soak runs on PostgreSQL".to_owned());
        };
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|error| format!("cannot connect to read the tables of {prefix}: {error}"))?;
        let connection = tokio::spawn(connection);
        let (messages, replies) = (prefix.table("messages"), prefix.table("replies"));
        let sql = format!(
            "SELECT (SELECT count(*) FROM \"{messages}\"), (SELECT count(*) FROM \"{replies}\"), \
             pg_total_relation_size('\"{messages}\"'::regclass) \
             + pg_total_relation_size('\"{replies}\"'::regclass), \
             (SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables \
              WHERE relname IN ('{messages}', '{replies}'))"
        );
        let autovacuum: String = client
            .query_one("SHOW autovacuum", &[])
            .await
            .and_then(|row| row.try_get(0))
            .map_err(|error| format!("cannot read the server's autovacuum setting: {error}"))?;
        let autovacuum = autovacuum == "on";
        let vacuum =
            (vacuum && !autovacuum).then(|| format!("VACUUM \"{messages}\", \"{replies}\""));
        Ok(Monitor { client, connection, sql, autovacuum, vacuum })
    }

    /// What reclaims the tables' dead rows during the run.
    fn vacuum_kind(&self) -> &'static str {
        match (self.autovacuum, self.vacuum.is_some()) {
            (true, _) => "autovacuum",
            (false, true) => "VACUUM after every sample",
            (false, false) => "none",
        }
    }

    /// Runs the soak's `VACUUM`, if it runs one, and returns how long it took in milliseconds.
    async fn vacuum(&self) -> Result<Option<f64>, String> {
        let Some(sql) = &self.vacuum else { return Ok(None) };
        let started = Instant::now();
        self.client
            .batch_execute(sql)
            .await
            .map_err(|error| format!("cannot vacuum the tables: {error}"))?;
        Ok(Some(started.elapsed().as_secs_f64() * 1_000.0))
    }

    /// The tables now.
    async fn read(&self) -> Result<Tables, String> {
        let failed = |error: tokio_postgres::Error| format!("cannot read the tables: {error}");
        let row = self.client.query_one(&self.sql, &[]).await.map_err(failed)?;
        Ok(Tables {
            messages: row.try_get(0).map_err(failed)?,
            replies: row.try_get(1).map_err(failed)?,
            bytes: row.try_get(2).map_err(failed)?,
            dead_rows: row.try_get(3).map_err(failed)?,
        })
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// The process's resident set (`VmRSS`) in MiB, or 0 where `/proc` has none.
fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u32>().ok())
        .map_or(0.0, |kib| f64::from(kib) / 1024.0)
}

/// Prints one line of the run's output.
#[expect(clippy::print_stdout, reason = "the soak's sample and summary lines")]
fn say(line: &str) {
    println!("{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_soak_takes_its_defaults_unless_told_otherwise() {
        assert_eq!(parse_soak_args(&[]), Ok(SoakPlan::default()));
        assert_eq!(
            parse_soak_args(&args("--seconds 30 --retention-seconds 10 --sample-seconds 2")),
            Ok(SoakPlan {
                seconds: 30,
                retention_seconds: 10,
                sample_seconds: 2,
                ..SoakPlan::default()
            })
        );
        assert!(parse_soak_args(&args("--seconds 0")).unwrap_err().contains("at least 1"));
        assert!(parse_soak_args(&args("--seconds")).unwrap_err().contains("needs a number"));
        assert!(parse_soak_args(&args("--ops 5")).unwrap_err().contains("unknown option"));
        assert_eq!(
            parse_soak_args(&args("--no-vacuum --in-flight 8")),
            Ok(SoakPlan { vacuum: false, in_flight: 8, ..SoakPlan::default() })
        );
    }

    fn sample(t_s: f64, ops: usize, messages: i64) -> Sample {
        Sample {
            t_s,
            window_s: 10.0,
            ops,
            p99_ms: 12.5,
            tables: Tables { messages, replies: messages, bytes: messages * 100, dead_rows: 7 },
            rss_mb: 30.0,
            vacuum_ms: None,
        }
    }

    #[test]
    fn samples_and_the_summary_are_json_lines() {
        let line: Value = serde_json::from_str(&sample(10.0, 50_000, 40_000).line()).unwrap();
        assert_eq!(line["kind"], "sample");
        assert_eq!(line["ops_per_s"], 5_000.0);
        assert_eq!(line["messages"], 40_000);
        assert_eq!(line["table_bytes"], 4_000_000);
        let plan = SoakPlan { seconds: 40, ..SoakPlan::default() };
        let samples = [
            sample(10.0, 100_000, 50_000),
            sample(20.0, 100_000, 90_000),
            sample(30.0, 80_000, 60_000),
            sample(40.0, 80_000, 70_000),
        ];
        let start = Tables { messages: 2_000, replies: 2_000, bytes: 1_000, dead_rows: 0 };
        let summary = summary(&plan, start, &samples, 42.0, "none");
        let summary: Value = serde_json::from_str(&summary).unwrap();
        assert_eq!(summary["kind"], "summary");
        assert_eq!(summary["workload"], "soak");
        assert_eq!(summary["ops"], 360_000);
        assert_eq!(summary["ops_per_s"], 9_000.0);
        assert_eq!(summary["first_half_ops_per_s"], 10_000.0);
        assert_eq!(summary["second_half_ops_per_s"], 8_000.0);
        assert_eq!(summary["second_to_first"], 0.8);
        assert_eq!(summary["start_messages"], 2_000);
        assert_eq!(summary["max_messages"], 90_000);
        assert_eq!(summary["last_messages"], 70_000);
        assert_eq!(summary["max_table_bytes"], 9_000_000);
        assert_eq!(summary["peak_rss_mb"], 42.0);
        assert_eq!(summary["vacuum"], "none");
        let vacuumed = Sample { vacuum_ms: Some(1_234.4), ..sample(10.0, 1, 1) };
        let line: Value = serde_json::from_str(&vacuumed.line()).unwrap();
        assert_eq!(line["vacuum_ms"], 1_234.0);
    }
}
