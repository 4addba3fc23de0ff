//! Test support for the cluster crates; only ever a dev-dependency (tests that use it live in
//! `tests/`, never in `src/`).
//!
//! - [`mod@storage_suite`]: the storage conformance suite, run against every `MessageStorage` and
//!   `RunnerStorage` implementation (memory, SQLite, PostgreSQL, MySQL) with
//!   [`storage_suite!`](crate::storage_suite!).
//! - `databases` (feature `sql`): real SQLite, PostgreSQL and MySQL storages for tests, on
//!   a file or tables of the test's own, removed afterwards.
//! - [`logs`]: [`Warnings`](logs::Warnings), the warnings a test's code logged.
//! - [`faulty`]: a `MessageStorage` wrapper that fails on demand (transactions that cannot
//!   begin, commits whose outcome is unknown).
//! - [`measure`]: throughput measurements of storages, for benchmarks and notes.
//! - [`memory`]: in-memory storages with the reference's semantics, whose shard locks are
//!   exclusive and expire, for unit tests and simulation.
//! - [`mod@queue_suite`]: the conformance suite of `QueueStorage` implementations, with
//!   [`queue_suite!`](crate::queue_suite!).
//!
//! - [`test_client`]: [`TestClient`], an in-memory client of one entity type for application unit
//!   tests (the reference's `Entity.makeTestClient`).
//!
//! - [`transport`]: an in-memory runner-to-runner transport with faults (unreachable runners,
//!   failing calls), for several runtimes in one process.
//!
//! - [`sim`]: the simulated cluster: runners and a client of the real runtime on one paused
//!   single-threaded runtime, faults and workload from one seed, invariants checked as it goes
//!   (`cargo xtask sim`).
//!
//! - [`wait`]: [`eventually`](wait::eventually), the one way tests wait on a condition, with a
//!   deadline.

#[cfg(feature = "sql")]
pub mod databases;
pub mod faulty;
pub mod logs;
pub mod measure;
pub mod memory;
pub mod queue_suite;
pub mod sim;
pub mod storage_suite;
pub mod test_client;
pub mod transport;
pub mod wait;

pub use test_client::TestClient;
