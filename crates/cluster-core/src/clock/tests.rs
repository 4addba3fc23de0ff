//! Tests of the clock types.

use super::*;

#[test]
fn system_clock_is_after_2025() {
    // 2025-01-01T00:00:00Z, the snowflake epoch: any machine running this is later.
    assert!(SystemClock.now() > Timestamp::from_unix_millis(1_735_689_600_000));
}

#[test]
fn saturating_arithmetic() {
    let t = Timestamp::from_unix_millis(1_000);
    assert_eq!(t.saturating_add(Duration::from_millis(500)).unix_millis(), 1_500);
    assert_eq!(t.saturating_sub(Duration::from_secs(2)).unix_millis(), -1_000);
    assert_eq!(t.saturating_add(Duration::MAX).unix_millis(), i64::MAX);
    assert_eq!(
        t.saturating_duration_since(Timestamp::from_unix_millis(400)),
        Duration::from_millis(600)
    );
    assert_eq!(t.saturating_duration_since(Timestamp::from_unix_millis(4_000)), Duration::ZERO);
}
