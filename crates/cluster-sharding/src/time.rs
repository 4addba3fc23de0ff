//! Instants a configured duration from now, without overflow.
//!
//! `Instant + Duration` panics past what an `Instant` holds, and configured durations can be
//! very long (an idle time of a year, a user's `Duration::MAX`). A deadline that far out is
//! never reached, so it is capped instead.

use std::time::Duration;

use cluster_core::clock::FAR_FUTURE;
use tokio::time::Instant;

/// `start + duration`, capped at [`FAR_FUTURE`] from `start`.
pub(crate) fn after(start: Instant, duration: Duration) -> Instant {
    start
        .checked_add(duration.min(FAR_FUTURE))
        .or_else(|| start.checked_add(FAR_FUTURE))
        .unwrap_or(start)
}

/// [`after`] from now.
pub(crate) fn deadline(duration: Duration) -> Instant {
    after(Instant::now(), duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_past_any_instant_is_capped_instead_of_panicking() {
        let start = Instant::now();
        assert_eq!(after(start, Duration::MAX), after(start, FAR_FUTURE));
        assert!(after(start, Duration::MAX) > start + Duration::from_secs(365 * 24 * 60 * 60));
        assert_eq!(after(start, Duration::from_secs(5)), start + Duration::from_secs(5));
    }
}
