//! The load driver: a fixed number of callers pull operation numbers from a shared counter
//! until every operation ran, each timing its own calls.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The longest the run may go without an operation finishing: a stuck runtime fails the run
/// instead of hanging it. Checked by one watchdog, not a timer per operation (which would add
/// a timer-wheel insert and removal to every measured call).
pub(crate) const OPERATION_DEADLINE: Duration = Duration::from_secs(60);

/// What a measured run took.
#[derive(Clone, Debug)]
pub(crate) struct Measured {
    /// From the first call to the last reply.
    pub(crate) elapsed: Duration,
    /// Every call's latency at the caller, in nanoseconds, sorted.
    pub(crate) latencies_ns: Vec<u64>,
}

impl Measured {
    /// The quantile of `per_mille` thousandths (1..=1000, nearest rank) in milliseconds; 0
    /// without calls.
    pub(crate) fn percentile_ms(&self, per_mille: usize) -> f64 {
        let n = self.latencies_ns.len();
        let rank = (per_mille.min(1_000) * n).div_ceil(1_000).clamp(1, n.max(1));
        self.latencies_ns.get(rank - 1).map_or(0.0, |nanos| nanos_f64(*nanos) / 1e6)
    }
}

#[expect(clippy::cast_precision_loss, reason = "latencies far below 2^53 ns")]
fn nanos_f64(nanos: u64) -> f64 {
    nanos as f64
}

/// Runs `op(first)`, …, `op(first + ops - 1)` with `in_flight` callers and times them.
///
/// # Errors
///
/// The first failed operation's error (the run stops there: a benchmark with failures
/// measures nothing useful).
pub(crate) async fn drive<F, Fut>(
    first: usize,
    ops: usize,
    in_flight: usize,
    op: F,
) -> Result<Measured, String>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..in_flight.min(ops) {
        let (op, next, done) = (Arc::clone(&op), Arc::clone(&next), Arc::clone(&done));
        callers.spawn(async move {
            let mut latencies = Vec::with_capacity(ops / in_flight + 1);
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= ops {
                    return Ok(latencies);
                }
                let sent = Instant::now();
                op(first + n).await.map_err(|error| format!("operation {}: {error}", first + n))?;
                let nanos = u64::try_from(sent.elapsed().as_nanos()).unwrap_or(u64::MAX);
                latencies.push(nanos);
                done.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    let mut latencies_ns = Vec::with_capacity(ops);
    let mut watchdog = tokio::time::interval(OPERATION_DEADLINE);
    watchdog.tick().await;
    let mut done_at_last_tick = 0;
    loop {
        tokio::select! {
            joined = callers.join_next() => match joined {
                None => break,
                Some(Ok(Ok(latencies))) => latencies_ns.extend(latencies),
                Some(Ok(Err(error))) => return Err(error),
                Some(Err(error)) => return Err(format!("a caller panicked: {error}")),
            },
            _ = watchdog.tick() => {
                let done_now = done.load(Ordering::Relaxed);
                if done_now == done_at_last_tick {
                    return Err(format!(
                        "no operation finished for {OPERATION_DEADLINE:?} ({done_now} of {ops} done)"
                    ));
                }
                done_at_last_tick = done_now;
            }
        }
    }
    let elapsed = started.elapsed();
    latencies_ns.sort_unstable();
    Ok(Measured { elapsed, latencies_ns })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_operation_runs_once_and_is_timed() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let measured = drive(10, 100, 7, move |n| {
            let record = Arc::clone(&record);
            async move {
                record.lock().unwrap().push(n);
                Ok(())
            }
        })
        .await
        .unwrap();
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_unstable();
        assert_eq!(seen, (10..110).collect::<Vec<_>>());
        assert_eq!(measured.latencies_ns.len(), 100);
        assert!(measured.latencies_ns.is_sorted());
    }

    #[tokio::test]
    async fn a_failed_operation_ends_the_run_with_its_error() {
        let result =
            drive(0, 50, 4, |n| async move { if n == 13 { Err("no".to_owned()) } else { Ok(()) } })
                .await;
        assert_eq!(result.unwrap_err(), "operation 13: no");
    }

    #[tokio::test(start_paused = true)]
    async fn an_operation_past_its_deadline_ends_the_run() {
        let result = drive(0, 3, 1, |n| async move {
            if n == 1 {
                std::future::pending::<()>().await;
            }
            Ok(())
        })
        .await;
        assert_eq!(result.unwrap_err(), "no operation finished for 60s (1 of 3 done)");
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let measured = Measured {
            elapsed: Duration::ZERO,
            latencies_ns: (1..=100).map(|ms| ms * 1_000_000).collect(),
        };
        assert!((measured.percentile_ms(500) - 50.0).abs() < 1e-9);
        assert!((measured.percentile_ms(990) - 99.0).abs() < 1e-9);
        assert!((measured.percentile_ms(1_000) - 100.0).abs() < 1e-9);
        let empty = Measured { elapsed: Duration::ZERO, latencies_ns: Vec::new() };
        assert!(empty.percentile_ms(500).abs() < 1e-9);
    }
}
