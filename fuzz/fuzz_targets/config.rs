//! The configuration loaders on an arbitrary environment (`NAME=value` lines): the runtime's,
//! a runner's (storage URL, transport, operations server) and the HTTP gateway's. Bad input is
//! an error naming the variable, never a panic.
#![no_main]

use std::collections::BTreeMap;

use durable_cluster::http::HttpConfig;
use durable_cluster::{Role, RunnerEnv, ShardingConfig};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let env: BTreeMap<String, String> = text
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect();
    let lookup = |name: &str| env.get(name).cloned();
    if let Ok(config) = ShardingConfig::from_env_with(lookup) {
        let _ = config.validate();
    }
    let _ = RunnerEnv::from_lookup(Role::Runner, lookup);
    let _ = RunnerEnv::from_lookup(Role::Client, lookup);
    let _ = HttpConfig::from_lookup(lookup);
});
