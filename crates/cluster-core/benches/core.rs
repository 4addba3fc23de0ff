//! Microbenchmarks of the pure core's hot paths: the entity-to-shard hash, the hash ring's
//! shard assignment, snowflake generation and the envelope's JSON form.
//!
//! ```text
//! cargo bench -p cluster-core
//! ```
//!
//! The results of a run are in docs/performance.md.

use std::hint::black_box;

use cluster_core::encoded::JsonForm;
use cluster_core::envelope::{Envelope, RawJson, Request, TraceContext};
use cluster_core::{
    EntityAddress, EntityId, EntityType, HashRing, MachineId, RunnerAddress, ShardGroup, Snowflake,
    SnowflakeGenerator, Timestamp,
};

fn main() {
    divan::main();
}

/// `hash_string` and the shard of an entity id (the per-request routing hash).
#[divan::bench(args = ["user-42", "a-much-longer-entity-identifier-of-64-characters-0123456789abcd"])]
fn shard_of_entity(entity_id: &str) -> u32 {
    cluster_core::hash::shard_number(black_box(entity_id), 300)
}

/// The assignment every runner computes on a membership change: 300 shards over `runners`.
#[divan::bench(args = [1, 3, 10, 100])]
fn ring_assign_300_shards(bencher: divan::Bencher<'_, '_>, runners: u16) {
    let mut ring = HashRing::new();
    for n in 0..runners {
        ring.add(RunnerAddress::new(format!("10.0.{}.{}", n / 256, n % 256), 34_431), 1.0);
    }
    bencher.bench_local(|| black_box(&ring).get_shards(300).map(|owners| owners.len()));
}

/// Building the ring of `runners` runners (each with its virtual points).
#[divan::bench(args = [3, 100])]
fn ring_build(runners: u16) -> usize {
    let mut ring = HashRing::new();
    for n in 0..runners {
        ring.add(RunnerAddress::new(format!("10.0.{}.{}", n / 256, n % 256), 34_431), 1.0);
    }
    ring.len()
}

/// One snowflake id (every request and reply takes one).
#[divan::bench]
fn snowflake_next(bencher: divan::Bencher<'_, '_>) {
    let now = Timestamp::from_unix_millis(1_764_000_000_000);
    let mut generator = SnowflakeGenerator::new(MachineId::new(7), now);
    bencher.bench_local(|| generator.next(black_box(now)));
}

fn request() -> Envelope {
    Envelope::Request(Request {
        request_id: Snowflake::from_i64(7_371_000_000_123_456_789).expect("a positive id"),
        address: EntityAddress {
            shard_id: cluster_core::hash::shard_id("user-42", &ShardGroup::default_group(), 300),
            entity_type: EntityType::from("Account"),
            entity_id: EntityId::from("user-42"),
        },
        tag: "Deposit".into(),
        payload: RawJson::encode(&("deposit-1234", 2_500_u64)).expect("encodable"),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    })
}

/// A request envelope to the reference's JSON form (what storage and the transport write).
#[divan::bench]
fn envelope_encode(bencher: divan::Bencher<'_, '_>) {
    let envelope = request();
    bencher.bench_local(|| black_box(&envelope).to_json());
}

/// A request envelope back from its JSON form.
#[divan::bench]
fn envelope_decode(bencher: divan::Bencher<'_, '_>) {
    let json = request().to_json();
    bencher.bench_local(|| Envelope::from_json(black_box(&json)).map(|envelope| envelope.id()));
}
