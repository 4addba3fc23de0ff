//! The transport's frame reader and decoder on an arbitrary byte stream, with and without MACs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cluster_rpc::fuzzing::read_frames(data));
