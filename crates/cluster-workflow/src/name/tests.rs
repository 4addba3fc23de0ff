//! Which names are refused.

use super::{check_activity, check_deferred};

#[test]
fn the_engines_prefixes_are_refused_for_deferreds() {
    for name in ["raceAll/x", "DurableClock/nap", "DurableQueue/Q/i1", "Workflow/InterruptSignal"] {
        let refused = check_deferred(name).unwrap_err();
        assert_eq!(refused.name, name);
        assert!(refused.to_string().contains("choose a name"), "{refused}");
    }
    for name in ["approval", "raceAll", "race/raceAll/x", "durableclock/nap", "Workflow"] {
        assert_eq!(check_deferred(name), Ok(()), "{name}");
    }
}

#[test]
fn only_the_sleep_prefix_is_refused_for_activities() {
    assert_eq!(check_activity("DurableClock/nap").unwrap_err().prefix, "DurableClock/");
    for name in ["charge", "raceAll/x", "DurableQueue/Q", "Workflow/x"] {
        assert_eq!(check_activity(name), Ok(()), "{name}");
    }
}
