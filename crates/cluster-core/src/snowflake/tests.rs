//! Golden vectors of `effect/src/cluster/Snowflake.ts` and the generator's monotonicity.

use proptest::prelude::*;

use super::*;

fn at(offset_millis: i64) -> Timestamp {
    Timestamp::from_unix_millis(EPOCH.unix_millis() + offset_millis)
}

#[test]
fn epoch_is_2025_01_01() {
    assert_eq!(EPOCH.unix_millis(), 1_735_689_600_000);
}

#[test]
fn make_matches_the_reference() {
    let id = Snowflake::from_parts(SnowflakeParts {
        timestamp: at(1000),
        machine_id: MachineId::new(5),
        sequence: 7,
    });
    assert_eq!(id.get(), 4_194_324_487);
    assert_eq!(id.to_string(), "4194324487");
}

#[test]
fn to_parts_matches_the_reference() {
    let parts = Snowflake::new(4_194_304_005_127).to_parts();
    assert_eq!(parts.timestamp.unix_millis(), 1_735_690_600_000);
    assert_eq!(parts.machine_id, MachineId::new(1));
    assert_eq!(parts.sequence, 1031);
}

#[test]
fn machine_id_and_sequence_wrap() {
    let id = Snowflake::from_parts(SnowflakeParts {
        timestamp: at(1),
        machine_id: MachineId::new(1024 + 3),
        sequence: 4096 + 2,
    });
    assert_eq!(id.machine_id(), MachineId::new(3));
    assert_eq!(id.sequence(), 2);
}

#[test]
fn timestamps_outside_the_range_are_clamped() {
    let before = Snowflake::from_parts(SnowflakeParts {
        timestamp: Timestamp::from_unix_millis(0),
        machine_id: MachineId::new(0),
        sequence: 0,
    });
    assert_eq!(before.get(), 0);
    let after = Snowflake::from_parts(SnowflakeParts {
        timestamp: Timestamp::from_unix_millis(i64::MAX),
        machine_id: MachineId::new(0),
        sequence: 0,
    });
    assert_eq!(after.timestamp(), at((1 << 42) - 1));
}

#[test]
fn string_form_is_strict() {
    assert_eq!("123".parse::<Snowflake>(), Ok(Snowflake::new(123)));
    assert_eq!("18446744073709551615".parse::<Snowflake>(), Ok(Snowflake::new(u64::MAX)));
    for input in ["", "-1", "+1", "1e3", " 1", "18446744073709551616", "0x10"] {
        assert!(input.parse::<Snowflake>().is_err(), "{input:?}");
    }
}

#[test]
fn sql_conversions_are_checked() {
    assert_eq!(Snowflake::from_i64(-1), None);
    assert_eq!(Snowflake::from_i64(42).and_then(Snowflake::to_i64), Some(42));
    assert_eq!(Snowflake::new(u64::MAX).to_i64(), None);
}

#[test]
fn generator_resets_the_sequence_each_millisecond() {
    let mut generator = SnowflakeGenerator::new(MachineId::new(9), at(10));
    let first = generator.next(at(10));
    let second = generator.next(at(10));
    let third = generator.next(at(11));
    assert_eq!((first.timestamp(), first.sequence()), (at(10), 0));
    assert_eq!((second.timestamp(), second.sequence()), (at(10), 1));
    assert_eq!((third.timestamp(), third.sequence()), (at(11), 0));
    assert_eq!(third.machine_id(), MachineId::new(9));
}

#[test]
fn generator_borrows_the_next_millisecond_when_the_sequence_is_used_up() {
    let mut generator = SnowflakeGenerator::new(MachineId::new(1), at(10));
    let ids: Vec<Snowflake> = (0..4097).map(|_| generator.next(at(10))).collect();
    assert_eq!(ids[4095].to_parts().sequence, 4095);
    assert_eq!((ids[4096].timestamp(), ids[4096].sequence()), (at(11), 0));
    // The clock catches up with the borrowed millisecond: the sequence continues there.
    let next = generator.next(at(11));
    assert_eq!((next.timestamp(), next.sequence()), (at(11), 1));
}

#[test]
fn generator_never_goes_backwards_when_the_clock_does() {
    let mut generator = SnowflakeGenerator::new(MachineId::new(1), at(100));
    let late = generator.next(at(100));
    // The 4.0.6 bug: a clock that is behind skipped the exhaustion check and wrapped the
    // sequence, repeating ids. Exhaust the sequence with the clock behind.
    let mut previous = late;
    for _ in 0..10_000 {
        let id = generator.next(at(50));
        assert!(id > previous);
        previous = id;
    }
    assert!(previous.timestamp() > at(100));
}

#[test]
fn set_machine_id_applies_to_new_ids() {
    let mut generator = SnowflakeGenerator::new(MachineId::new(1), at(0));
    generator.set_machine_id(MachineId::new(700));
    assert_eq!(generator.machine_id(), MachineId::new(700));
    assert_eq!(generator.next(at(0)).machine_id(), MachineId::new(700));
}

/// A clock reading: advance, stand still (possibly for many ids) or jump back.
#[derive(Clone, Debug)]
enum Tick {
    Forward(u16),
    StandStill(u16),
    Back(u32),
}

fn tick() -> impl Strategy<Value = Tick> {
    prop_oneof![
        (1u16..2000).prop_map(Tick::Forward),
        (1u16..9000).prop_map(Tick::StandStill),
        (1u32..100_000).prop_map(Tick::Back),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn ids_strictly_increase_for_any_clock(
        start in 0i64..1_000_000_000,
        ticks in proptest::collection::vec(tick(), 1..40),
        machine in 0i32..5000,
    ) {
        let mut clock = start;
        let mut generator = SnowflakeGenerator::new(MachineId::new(machine), at(clock));
        let shared = SharedSnowflakeGenerator::new(MachineId::new(machine), at(clock));
        let mut previous: Option<Snowflake> = None;
        for tick in ticks {
            let n_ids = match tick {
                Tick::Forward(millis) => { clock += i64::from(millis); 1 }
                Tick::StandStill(n_ids) => n_ids,
                Tick::Back(millis) => { clock -= i64::from(millis); 3 }
            };
            for _ in 0..n_ids {
                let id = generator.next(at(clock));
                // The lock-free generator makes the same id from the same calls.
                prop_assert_eq!(shared.next(at(clock)), id);
                if let Some(previous) = previous {
                    prop_assert!(id > previous, "{id:?} after {previous:?}");
                }
                prop_assert_eq!(id.machine_id(), MachineId::new(machine.rem_euclid(1024)));
                previous = Some(id);
            }
        }
    }
}

#[test]
fn a_shared_generator_gives_threads_distinct_increasing_ids() {
    let generator = std::sync::Arc::new(SharedSnowflakeGenerator::new(MachineId::new(3), at(0)));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let generator = std::sync::Arc::clone(&generator);
            std::thread::spawn(move || {
                // A clock that stands still: the sequence is used up and borrowed ahead.
                (0..10_000).map(|_| generator.next(at(5))).collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all = std::collections::BTreeSet::new();
    for thread in threads {
        let ids = thread.join().unwrap();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "each thread sees increasing ids");
        all.extend(ids);
    }
    assert_eq!(all.len(), 40_000, "no id was made twice");
    generator.set_machine_id(MachineId::new(7));
    assert_eq!(generator.next(at(5)).machine_id(), MachineId::new(7));
}
