//! The sharding runtime.
//!
//! This crate will hold `Sharding`: entity registration and typed clients, routing, entity
//! managers, the storage read loop, shard lock acquisition, refresh and release, membership
//! sync, singletons, cron, shutdown and handoff, and metrics.
//! It drives the pure state machines of `cluster-core` (`membership`, `ownership`) with tokio.
//!
//! Status: not written yet (the one-runner and many-runner sharding issues).
