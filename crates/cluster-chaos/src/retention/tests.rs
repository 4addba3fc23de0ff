//! The check of a deposit's stored rows against the retention window, on made-up deposits.

use std::time::Duration;

use super::{CLOCK_MARGIN, Found, Stored, Window, check_deposit};

const SECOND: i64 = 1_000_000;

/// A check at 100 s with a retention of 30 s: deposits audited before 72 s may be gone.
fn window() -> Window {
    Window::new(100 * SECOND, Duration::from_secs(30))
}

fn present() -> Stored {
    Stored { request: true, final_replies: 1, successes: 1, orphans: 0 }
}

fn gone() -> Stored {
    Stored::default()
}

#[test]
fn the_window_ends_a_retention_before_the_check_plus_the_clock_margin() {
    let window = window();
    let margin = i64::try_from(CLOCK_MARGIN.as_micros()).unwrap_or(i64::MAX);
    assert_eq!(window.purgeable_before, 70 * SECOND + margin);
    assert_eq!(window.age_ms(window.purgeable_before), 28_000);
}

#[test]
fn a_purged_old_deposit_passes_and_so_does_a_kept_one() {
    let window = window();
    assert_eq!(check_deposit(Some(40 * SECOND), &gone(), &window), Ok(Found::Purged));
    assert_eq!(
        check_deposit(Some(window.purgeable_before - 1), &gone(), &window),
        Ok(Found::Purged)
    );
    // Retention may not have come to it yet.
    assert_eq!(check_deposit(Some(40 * SECOND), &present(), &window), Ok(Found::Present));
    assert_eq!(check_deposit(Some(99 * SECOND), &present(), &window), Ok(Found::Present));
}

#[test]
fn a_partially_purged_old_deposit_fails() {
    let window = window();
    let old = Some(40 * SECOND);
    let reply_without_request = Stored { orphans: 1, ..gone() };
    let error = check_deposit(old, &reply_without_request, &window).unwrap_err();
    assert!(error.contains("partial deletion"), "{error}");
    let request_without_reply = Stored { final_replies: 0, successes: 0, ..present() };
    assert!(check_deposit(old, &request_without_reply, &window).is_err());
    // A request stored again under the key, next to what is left of a deleted one.
    let left_next_to_a_new_request = Stored { orphans: 1, ..present() };
    assert!(check_deposit(old, &left_next_to_a_new_request, &window).is_err());
}

#[test]
fn a_missing_deposit_inside_the_window_fails() {
    let window = window();
    assert!(check_deposit(Some(99 * SECOND), &gone(), &window).is_err());
    let error = check_deposit(Some(window.purgeable_before), &gone(), &window).unwrap_err();
    assert!(error.contains("inside the retention window"), "{error}");
    // Never audited: never answered, so retention cannot have deleted it.
    assert!(check_deposit(None, &gone(), &window).is_err());
}

#[test]
fn a_new_deposit_must_have_exactly_one_final_reply_a_success() {
    let window = window();
    let new = Some(99 * SECOND);
    let two = Stored { final_replies: 2, successes: 2, ..present() };
    assert!(check_deposit(new, &two, &window).is_err());
    let failed = Stored { successes: 0, ..present() };
    assert!(check_deposit(new, &failed, &window).is_err());
}
