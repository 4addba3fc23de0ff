//! One frame body: decoded, converted to the domain types, and encoded again.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cluster_rpc::fuzzing::decode_frame(data));
