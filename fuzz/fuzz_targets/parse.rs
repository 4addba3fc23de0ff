//! Shard ids, runner addresses, durations and health-check modes from arbitrary text: what
//! parses prints as text that parses to the same value.
#![no_main]

use durable_cluster::cluster_core::config::{RunnerHealthCheck, parse_duration};
use durable_cluster::cluster_core::{RunnerAddress, ShardId};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(shard) = text.parse::<ShardId>() {
        assert_eq!(shard.to_string().parse::<ShardId>().ok(), Some(shard));
    }
    if let Ok(address) = text.parse::<RunnerAddress>() {
        assert_eq!(address.to_string().parse::<RunnerAddress>().ok(), Some(address));
    }
    let _ = parse_duration(text);
    let _ = RunnerHealthCheck::parse(text);
});
