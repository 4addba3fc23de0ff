//! Runner-to-runner transport over TCP.
//!
//! This crate will implement the `cluster_core::runners::Runners` contract: length-delimited
//! frames with a size limit, a compact codec, one multiplexed connection per peer with bounded
//! queues, reconnect with capped backoff, optional TLS and a shared-secret handshake.
//! Persisted traffic never depends on it: storage is the source of truth.
//!
//! Status: not written yet (the transport issue).
