//! What message retention may have deleted by the end of the fault test, and the check of each
//! deposit's stored request and replies against it.
//!
//! The runners run with `MESSAGE_RETENTION` (see [`crate::chaos`]): a sweep deletes a
//! processed request whose final reply is older than the retention, together with its replies
//! and its other envelopes (acknowledgements, interrupts), in one statement. It never deletes
//! the ledgers' audit rows, runs or balances.
//!
//! Every sweep deletes only what was answered before its own start minus the retention, and
//! every sweep is over once the last runner left, before the checks start. A deposit's final
//! reply is made after its audit row is written, by a runner on the same clock. So a deposit
//! audited at `at` can have been deleted only if `at` is before the check's start minus the
//! retention ([`Window::purgeable_before`], with a margin for the clocks of the database and
//! the runners). For each deposit [`check_deposit`] accepts:
//!
//! - its request with exactly one final reply, a success, whatever its age;
//! - nothing at all (no request, no reply, no other envelope of it), if it was audited before
//!   [`Window::purgeable_before`]: retention deleted it whole.
//!
//! and refuses a request without its final reply (retention never deletes those), replies or
//! envelopes left without their request (a partial deletion), and a deposit audited inside
//! the window, or never audited, whose request is gone.

use std::time::Duration;

#[cfg(test)]
mod tests;

/// How far the clocks of the database (the audit's `at`) and of the runners (the final reply's
/// id, which retention compares with its cutoff) may be apart.
pub const CLOCK_MARGIN: Duration = Duration::from_secs(2);

/// The deposits retention may have deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// The check's start, in microseconds of the database's clock.
    pub check_start: i64,
    /// Deposits audited before this (microseconds of the database's clock) may be gone:
    /// `check_start - retention + CLOCK_MARGIN`.
    pub purgeable_before: i64,
}

impl Window {
    /// The window of a check that starts at `check_start` (microseconds), all sweeps being
    /// over, with `retention`.
    pub fn new(check_start: i64, retention: Duration) -> Window {
        let span = retention.saturating_sub(CLOCK_MARGIN);
        let span = i64::try_from(span.as_micros()).unwrap_or(i64::MAX);
        Window { check_start, purgeable_before: check_start.saturating_sub(span) }
    }

    /// How long before the check `at` was, in milliseconds.
    pub fn age_ms(&self, at: i64) -> i64 {
        (self.check_start - at) / 1000
    }
}

/// What storage still holds of one deposit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stored {
    /// Its request row is there.
    pub request: bool,
    /// Its final replies (with its request).
    pub final_replies: usize,
    /// Those that are a success.
    pub successes: usize,
    /// Rows left of it without their request: replies and envelopes that point to one of the
    /// request ids its runs saw and whose request row is gone.
    pub orphans: usize,
}

/// How a deposit was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// Its request and its one final reply are stored.
    Present,
    /// Retention deleted it whole.
    Purged,
}

/// Checks one deposit (see the module doc); `audited_at` is its audit row's time in
/// microseconds of the database's clock (its earliest, if it has several: the audit check
/// flags those).
pub fn check_deposit(
    audited_at: Option<i64>,
    stored: &Stored,
    window: &Window,
) -> Result<Found, String> {
    if stored.orphans > 0 {
        return Err(format!(
            "{} of its replies or envelopes are left without their request: a partial deletion",
            stored.orphans
        ));
    }
    if stored.request {
        if stored.final_replies == 1 && stored.successes == 1 {
            return Ok(Found::Present);
        }
        return Err(format!(
            "{} final replies, {} successes",
            stored.final_replies, stored.successes
        ));
    }
    match audited_at {
        None => Err("no stored request and no audit row".to_owned()),
        Some(at) if at >= window.purgeable_before => Err(format!(
            "no stored request, audited {} ms before the check: inside the retention window",
            window.age_ms(at)
        )),
        Some(_) => Ok(Found::Purged),
    }
}
