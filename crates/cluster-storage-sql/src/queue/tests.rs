//! Tests of `queue`.

use super::*;

#[test]
fn table_names_are_identifiers() {
    assert_eq!(QueueTable::default().as_str(), "effect_queue");
    assert_eq!(QueueTable::default().history(), "effect_queue_migrations");
    assert_eq!(QueueTable::default().index("take"), "idx_effect_queue_take");
    assert!(QueueTable::new(&"q".repeat(QUEUE_TABLE_LEN_MAX)).is_ok());
    for bad in ["", "1q", "q-q", "q;drop table x", &"q".repeat(QUEUE_TABLE_LEN_MAX + 1)] {
        let error = QueueTable::new(bad).unwrap_err();
        assert_eq!((error.key(), error.value()), ("queue_table", bad));
    }
}

#[test]
fn locks_are_version_4_uuids() {
    let (first, second) = (new_lock().unwrap(), new_lock().unwrap());
    assert_ne!(first, second);
    let groups: Vec<usize> = first.split('-').map(str::len).collect();
    assert_eq!(groups, [8, 4, 4, 4, 12]);
    assert_eq!(&first[14..15], "4");
    assert!(matches!(&first[19..20], "8" | "9" | "a" | "b"), "{first}");
}

#[test]
fn delays_round_up_to_whole_seconds() {
    assert_eq!(whole_seconds(Duration::ZERO), 0);
    assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
    assert_eq!(whole_seconds(Duration::from_secs(120)), 120);
    assert_eq!(whole_seconds(Duration::from_millis(1_500)), 2);
}
