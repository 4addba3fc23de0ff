//! Both sides of the transport's handshake against a peer that sends arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cluster_rpc::fuzzing::handshakes(data));
