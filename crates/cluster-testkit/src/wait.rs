//! Waiting on a condition with a deadline: the one helper that tests use instead of sleeping
//! and hoping.
//!
//! - [`eventually`] polls a condition every 10 ms until it holds, and panics with `what` after
//!   [`DEADLINE`].
//! - [`eventually_within`] takes the deadline.
//! - [`eventually_async`] polls a condition that is itself a future (a storage read, say).
//!
//! The deadline is counted in tokio's time: under a paused clock (`start_paused`) the waits are
//! instant, and a deadline of minutes costs nothing until the condition fails.

use std::future::Future;
use std::time::Duration;

/// How long [`eventually`] and [`eventually_async`] wait before they fail.
pub const DEADLINE: Duration = Duration::from_secs(300);

/// The pause between two checks.
pub const POLL: Duration = Duration::from_millis(10);

/// Waits until `condition` holds, checking every [`POLL`].
///
/// # Panics
///
/// When it does not hold within [`DEADLINE`]; the message names `what`.
pub async fn eventually(what: &str, condition: impl FnMut() -> bool) {
    eventually_within(what, DEADLINE, condition).await;
}

/// Waits until `condition` holds, checking every [`POLL`].
///
/// # Panics
///
/// When it does not hold within `deadline`; the message names `what`.
pub async fn eventually_within(
    what: &str,
    deadline: Duration,
    mut condition: impl FnMut() -> bool,
) {
    let until = tokio::time::Instant::now() + deadline;
    while !condition() {
        assert!(tokio::time::Instant::now() < until, "{what} did not happen within {deadline:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until the future that `condition` makes resolves to `true`, checking every [`POLL`].
///
/// # Panics
///
/// When it does not within [`DEADLINE`]; the message names `what`.
pub async fn eventually_async<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + DEADLINE;
    while !condition().await {
        assert!(tokio::time::Instant::now() < until, "{what} did not happen within {DEADLINE:?}");
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn waits_until_the_condition_holds() {
        let checks = AtomicU32::new(0);
        eventually("the third check", || checks.fetch_add(1, Ordering::SeqCst) == 2).await;
        assert_eq!(checks.load(Ordering::SeqCst), 3);
        let checks = AtomicU32::new(0);
        eventually_async("the second check", || async {
            checks.fetch_add(1, Ordering::SeqCst) == 1
        })
        .await;
        assert_eq!(checks.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn fails_at_the_deadline_naming_what_it_waited_for() {
        let started = tokio::time::Instant::now();
        let waited = tokio::spawn(eventually_within("never", Duration::from_secs(3), || false));
        let error = waited.await.unwrap_err();
        let message = error.into_panic();
        let message = message.downcast_ref::<String>().unwrap();
        assert!(message.starts_with("never did not happen within 3s"), "{message}");
        assert!(started.elapsed() >= Duration::from_secs(3));
    }
}
