//! [`Backoff`]: the one type for the delays between retries, growing by a fixed factor from a
//! first delay to a cap.
//!
//! It is pure: it reads no clock and draws no random number. A caller that spreads retries
//! ([`jittered`]) passes its own random value, so the simulation's runs stay replayable.

use std::time::Duration;

/// Delays that start at `first`, grow by `numerator / denominator` after each use, and stay at
/// `max` once they reach it.
///
/// ```
/// # use std::time::Duration;
/// # use cluster_core::backoff::Backoff;
/// let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(1), 3, 2);
/// assert_eq!(backoff.next_delay(), Duration::from_millis(500));
/// assert_eq!(backoff.next_delay(), Duration::from_millis(750));
/// assert_eq!(backoff.next_delay(), Duration::from_secs(1));
/// backoff.reset();
/// assert_eq!(backoff.next_delay(), Duration::from_millis(500));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    numerator: u32,
    denominator: u32,
    next: Duration,
}

impl Backoff {
    /// Delays from `first` to `max`, each `numerator / denominator` times the one before.
    ///
    /// A factor below 1 is taken as 1, and a `max` below `first` as `first`.
    pub fn new(first: Duration, max: Duration, numerator: u32, denominator: u32) -> Backoff {
        let denominator = denominator.max(1);
        let numerator = numerator.max(denominator);
        let max = max.max(first);
        Backoff { first, max, numerator, denominator, next: first }
    }

    /// Delays from `first` to `max`, doubling.
    pub fn doubling(first: Duration, max: Duration) -> Backoff {
        Backoff::new(first, max, 2, 1)
    }

    /// The delay to wait now; the one after it grows.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (delay.saturating_mul(self.numerator) / self.denominator).min(self.max);
        delay
    }

    /// The delay [`next_delay`](Backoff::next_delay) will give, without using it.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// Back to the first delay, after a success.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// The delay after `attempts` failures in a row (the first failure waits `first`), as
    /// [`next_delay`](Backoff::next_delay) would give it; 0 attempts wait nothing.
    pub fn after_failures(&self, attempts: u32) -> Duration {
        let mut backoff = Backoff { next: self.first, ..self.clone() };
        let mut delay = Duration::ZERO;
        for _ in 0..attempts {
            delay = backoff.next_delay();
            if delay == self.max {
                break;
            }
        }
        delay
    }
}

/// `delay` spread over its upper half: half of it, plus `random` modulo the other half (and
/// one nanosecond). Callers pass a fresh random value, so that retries do not fall in step.
pub fn jittered(delay: Duration, random: u64) -> Duration {
    let half = delay / 2;
    let half_nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
    half + Duration::from_nanos(random.checked_rem(half_nanos.saturating_add(1)).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    #[test]
    fn delays_grow_by_the_factor_to_the_cap_and_reset() {
        let cases: [(Backoff, &[u64]); 4] = [
            (Backoff::doubling(ms(100), ms(1_000)), &[100, 200, 400, 800, 1_000, 1_000]),
            (Backoff::new(ms(500), ms(5_000), 3, 2), &[500, 750, 1_125, 1_687, 2_531, 3_796]),
            // A factor below 1 does not shrink; a cap below the first delay is the first.
            (Backoff::new(ms(300), ms(1_000), 1, 2), &[300, 300, 300]),
            (Backoff::doubling(ms(300), ms(100)), &[300, 300]),
        ];
        for (mut backoff, expected) in cases {
            let delays: Vec<u128> =
                expected.iter().map(|_| backoff.next_delay().as_millis()).collect();
            let expected: Vec<u128> = expected.iter().map(|&millis| u128::from(millis)).collect();
            assert_eq!(delays, expected, "{backoff:?}");
            backoff.reset();
            assert_eq!(backoff.peek().as_millis(), expected[0]);
        }
    }

    #[test]
    fn the_delay_after_failures_is_the_one_next_delay_gives() {
        let backoff = Backoff::doubling(ms(100), ms(10_000));
        assert_eq!(backoff.after_failures(0), Duration::ZERO);
        assert_eq!(backoff.after_failures(1), ms(100));
        assert_eq!(backoff.after_failures(4), ms(800));
        assert_eq!(backoff.after_failures(u32::MAX), ms(10_000));
    }

    #[test]
    fn jitter_stays_in_the_upper_half() {
        let delay = ms(1_000);
        for random in [0, 1, 499_999_999, 500_000_000, 500_000_001, u64::MAX] {
            let jittered = jittered(delay, random);
            assert!(jittered >= ms(500) && jittered <= delay, "{random}: {jittered:?}");
        }
        assert_eq!(jittered(Duration::ZERO, u64::MAX), Duration::ZERO);
    }
}
