//! 64-bit unique ids (`effect/src/cluster/Snowflake.ts`).
//!
//! Layout, from the most significant bit: 42 bits of milliseconds since [`EPOCH`]
//! (2025-01-01T00:00:00Z), 10 bits of machine id (the registry's [`MachineId`] modulo 1024) and
//! 12 bits of sequence. Ids are decimal strings in JSON and `BIGINT` in SQL.
//!
//! [`SnowflakeGenerator`] follows the reference's 4.1.0 rule: the timestamp never goes
//! backwards, and when the clock stands still or goes back and the 4096 sequence numbers of the
//! current millisecond are used up, it borrows the next millisecond. So ids from one generator
//! strictly increase whatever the clock does. The generator takes `now` as an argument and
//! never reads a clock, busy-waits or fails.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use crate::clock::Timestamp;
use crate::error::ParseError;
use crate::ids::MachineId;

/// The snowflake epoch, 2025-01-01T00:00:00Z.
pub const EPOCH: Timestamp = Timestamp::from_unix_millis(1_735_689_600_000);

const TIMESTAMP_SHIFT: u32 = 22;
const MACHINE_SHIFT: u32 = 12;
const SEQUENCE_COUNT: u32 = 4096;
const MACHINE_COUNT: u64 = 1024;
/// The largest millisecond offset from the epoch that fits 42 bits (year 2164).
const MAX_OFFSET_MILLIS: i64 = (1 << 42) - 1;

/// A 64-bit id: timestamp, machine id and sequence.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Snowflake(u64);

/// The fields of a [`Snowflake`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnowflakeParts {
    /// When the id was made, at or after [`EPOCH`].
    pub timestamp: Timestamp,
    /// The machine that made it; only the low 10 bits (`mod 1024`) are kept.
    pub machine_id: MachineId,
    /// The sequence within the millisecond; only the low 12 bits (`mod 4096`) are kept.
    pub sequence: u16,
}

impl Snowflake {
    /// The id with the raw value `value`.
    pub const fn new(value: u64) -> Snowflake {
        Snowflake(value)
    }

    /// The raw 64-bit value.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The id made of `parts`. A timestamp before [`EPOCH`] counts as the epoch, and one past
    /// the 42-bit range as its end.
    pub fn from_parts(parts: SnowflakeParts) -> Snowflake {
        let offset = parts.timestamp.unix_millis().saturating_sub(EPOCH.unix_millis());
        let offset = offset.clamp(0, MAX_OFFSET_MILLIS).unsigned_abs();
        let machine = u64::from(parts.machine_id.snowflake_bits());
        let sequence = u64::from(parts.sequence) % u64::from(SEQUENCE_COUNT);
        Snowflake((offset << TIMESTAMP_SHIFT) | (machine << MACHINE_SHIFT) | sequence)
    }

    /// The fields of this id.
    pub fn to_parts(self) -> SnowflakeParts {
        SnowflakeParts {
            timestamp: self.timestamp(),
            machine_id: self.machine_id(),
            sequence: self.sequence(),
        }
    }

    /// When this id was made.
    pub fn timestamp(self) -> Timestamp {
        // A u64 shifted right by 22 has at most 42 bits: it fits an i64.
        let offset = i64::try_from(self.0 >> TIMESTAMP_SHIFT).unwrap_or(i64::MAX);
        Timestamp::from_unix_millis(EPOCH.unix_millis().saturating_add(offset))
    }

    /// The machine id bits (`0..1024`).
    pub fn machine_id(self) -> MachineId {
        let bits = (self.0 >> MACHINE_SHIFT) % MACHINE_COUNT;
        MachineId::new(i32::try_from(bits).unwrap_or(0))
    }

    /// The sequence number within the millisecond (`0..4096`).
    pub fn sequence(self) -> u16 {
        u16::try_from(self.0 % u64::from(SEQUENCE_COUNT)).unwrap_or(0)
    }

    /// The id as a SQL `BIGINT`, or `None` past `i64::MAX` (after the year 2094).
    pub fn to_i64(self) -> Option<i64> {
        i64::try_from(self.0).ok()
    }

    /// The id stored as a SQL `BIGINT`, or `None` if it is negative (not a snowflake).
    pub fn from_i64(value: i64) -> Option<Snowflake> {
        u64::try_from(value).ok().map(Snowflake)
    }
}

impl fmt::Display for Snowflake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for Snowflake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Snowflake({})", self.0)
    }
}

impl FromStr for Snowflake {
    type Err = ParseError;

    /// Parses the decimal string form used in JSON.
    fn from_str(input: &str) -> Result<Snowflake, ParseError> {
        if input.is_empty() || !input.bytes().all(|byte| byte.is_ascii_digit()) {
            return Err(ParseError::new("snowflake", input, "expected a decimal number"));
        }
        input
            .parse()
            .map(Snowflake)
            .map_err(|_| ParseError::new("snowflake", input, "the number does not fit 64 bits"))
    }
}

/// Makes snowflakes for one machine; ids strictly increase whatever the clock does.
#[derive(Clone, Debug)]
pub struct SnowflakeGenerator {
    machine_id: MachineId,
    /// The next sequence number of `sequence_at`; `SEQUENCE_COUNT` when used up.
    sequence: u32,
    /// The millisecond (since the Unix epoch) ids are currently made for.
    sequence_at: i64,
}

impl SnowflakeGenerator {
    /// A generator for `machine_id` whose clock currently reads `now`.
    ///
    /// Until the runner registers, the reference uses a random machine id in `0..1024`; callers
    /// pass one drawn from their seeded RNG.
    pub fn new(machine_id: MachineId, now: Timestamp) -> SnowflakeGenerator {
        SnowflakeGenerator { machine_id, sequence: 0, sequence_at: clamp_to_epoch(now) }
    }

    /// The machine id stamped into new ids.
    pub fn machine_id(&self) -> MachineId {
        self.machine_id
    }

    /// Stamps new ids with `machine_id` (after the runner registered).
    pub fn set_machine_id(&mut self, machine_id: MachineId) {
        self.machine_id = machine_id;
    }

    /// The next id, given that the clock reads `now`.
    pub fn next(&mut self, now: Timestamp) -> Snowflake {
        let (sequence_at, sequence) = advance(self.sequence_at, self.sequence, now);
        self.sequence_at = sequence_at;
        self.sequence = sequence + 1;
        make(sequence_at, self.machine_id, sequence)
    }
}

/// The millisecond and sequence number of the next id, for a generator at `sequence_at` whose
/// next number is `sequence`, when the clock reads `now`: a new millisecond starts the sequence
/// afresh; a used-up sequence borrows the next millisecond; a clock that went back changes
/// nothing (ids never go backwards).
fn advance(sequence_at: i64, sequence: u32, now: Timestamp) -> (i64, u32) {
    let now = clamp_to_epoch(now);
    if now > sequence_at {
        (now, 0)
    } else if sequence >= SEQUENCE_COUNT {
        (sequence_at + 1, 0)
    } else {
        (sequence_at, sequence)
    }
}

/// The id of `sequence` in millisecond `sequence_at` for `machine_id`.
fn make(sequence_at: i64, machine_id: MachineId, sequence: u32) -> Snowflake {
    Snowflake::from_parts(SnowflakeParts {
        timestamp: Timestamp::from_unix_millis(sequence_at),
        machine_id,
        sequence: u16::try_from(sequence).unwrap_or(0),
    })
}

/// A [`SnowflakeGenerator`] that threads share without a lock: the millisecond and the next
/// sequence number are one atomic word, advanced by compare-and-swap, and the machine id is
/// another. It makes the same ids a `SnowflakeGenerator` would, in the order the calls take
/// effect.
///
/// Every request of a runtime takes an id; behind a mutex the generator was the one lock all
/// worker threads took on every call.
#[derive(Debug)]
pub struct SharedSnowflakeGenerator {
    /// `sequence_at << SEQUENCE_BITS | sequence`, with `sequence` in `0..=SEQUENCE_COUNT`.
    state: AtomicU64,
    machine_id: AtomicI32,
}

/// The bits of [`SharedSnowflakeGenerator::state`] that hold the sequence (up to
/// `SEQUENCE_COUNT` itself, the used-up mark).
const SEQUENCE_BITS: u32 = 13;

impl SharedSnowflakeGenerator {
    /// A generator for `machine_id` whose clock currently reads `now`.
    pub fn new(machine_id: MachineId, now: Timestamp) -> SharedSnowflakeGenerator {
        SharedSnowflakeGenerator {
            state: AtomicU64::new(pack(clamp_to_epoch(now), 0)),
            machine_id: AtomicI32::new(machine_id.get()),
        }
    }

    /// The machine id stamped into new ids.
    pub fn machine_id(&self) -> MachineId {
        MachineId::new(self.machine_id.load(Ordering::Acquire))
    }

    /// Stamps new ids with `machine_id` (after the runner registered).
    pub fn set_machine_id(&self, machine_id: MachineId) {
        self.machine_id.store(machine_id.get(), Ordering::Release);
    }

    /// The next id, given that the clock reads `now`: the rules of
    /// [`SnowflakeGenerator::next`].
    pub fn next(&self, now: Timestamp) -> Snowflake {
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            let (sequence_at, sequence) = unpack(current);
            let (sequence_at, sequence) = advance(sequence_at, sequence, now);
            let next = pack(sequence_at, sequence + 1);
            match self.state.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return make(sequence_at, self.machine_id(), sequence),
                Err(actual) => current = actual,
            }
        }
    }
}

/// The state word of a millisecond (at or after the epoch, so never negative) and a sequence.
fn pack(sequence_at: i64, sequence: u32) -> u64 {
    (sequence_at.unsigned_abs() << SEQUENCE_BITS) | u64::from(sequence)
}

fn unpack(state: u64) -> (i64, u32) {
    let sequence_at = i64::try_from(state >> SEQUENCE_BITS).unwrap_or(i64::MAX);
    let sequence = u32::try_from(state & ((1 << SEQUENCE_BITS) - 1)).unwrap_or(SEQUENCE_COUNT);
    (sequence_at, sequence)
}

fn clamp_to_epoch(now: Timestamp) -> i64 {
    now.unix_millis().clamp(EPOCH.unix_millis(), EPOCH.unix_millis() + MAX_OFFSET_MILLIS)
}

#[cfg(test)]
mod tests;
