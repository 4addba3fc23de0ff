//! Wall-clock time, injected.
//!
//! Nothing in the cluster reads the wall clock directly: components take a [`Clock`] and pure
//! functions take a [`Timestamp`] argument. [`SystemClock`] is the single place that reads
//! `SystemTime::now` (the rest of the workspace is forbidden to by `clippy.toml`), so a
//! simulation can substitute its own clock and replay a run.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// About 30 years: the deadline of a wait whose configured duration is past what an `Instant`
/// holds (`Instant + Duration` panics there). Such a deadline is never reached, so waits cap
/// their duration at `now + FAR_FUTURE` instead (`checked_add`, then this).
pub const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);

/// A point in wall-clock time, in whole milliseconds since the Unix epoch.
///
/// Milliseconds are the resolution of the reference (`Date.now()`), of snowflakes and of the
/// `deliver_at` column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The Unix epoch.
    pub const UNIX_EPOCH: Timestamp = Timestamp(0);

    /// A timestamp `millis` milliseconds after the Unix epoch (negative: before it).
    pub const fn from_unix_millis(millis: i64) -> Timestamp {
        Timestamp(millis)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn unix_millis(self) -> i64 {
        self.0
    }

    /// This timestamp moved forward by `duration`, saturating at the end of time.
    pub fn saturating_add(self, duration: Duration) -> Timestamp {
        let millis = i64::try_from(duration.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(millis))
    }

    /// This timestamp moved back by `duration`, saturating at the beginning of time.
    pub fn saturating_sub(self, duration: Duration) -> Timestamp {
        let millis = i64::try_from(duration.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_sub(millis))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        let millis = self.0.saturating_sub(earlier.0).max(0);
        Duration::from_millis(millis.unsigned_abs())
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// A source of wall-clock time.
///
/// Implemented by [`SystemClock`] and, for simulation, by the testkit's clock. Readings may go
/// backwards (NTP steps, clock skew between runners); consumers such as the
/// [`SnowflakeGenerator`](crate::SnowflakeGenerator) tolerate that.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current wall-clock time.
    fn now(&self) -> Timestamp;
}

/// The operating system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[expect(
        clippy::disallowed_methods,
        reason = "SystemClock is the one allow-listed reader of the wall clock"
    )]
    fn now(&self) -> Timestamp {
        let since_epoch = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(duration) => i64::try_from(duration.as_millis()).unwrap_or(i64::MAX),
            Err(before) => -i64::try_from(before.duration().as_millis()).unwrap_or(i64::MAX),
        };
        Timestamp(since_epoch)
    }
}

#[cfg(test)]
mod tests;
