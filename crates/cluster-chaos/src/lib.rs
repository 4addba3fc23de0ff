//! A runner process configured from the environment, and the fault test that runs several of
//! them (`cargo xtask chaos`).
//!
//! - [`node`]: one process of a cluster from `CLUSTER_*` and the runtime's variables: storage
//!   from a URL, the TCP transport of `cluster-rpc`, graceful shutdown on SIGTERM and SIGINT.
//! - [`ledger`]: the entity the fault test drives; every deposit it handles writes an audit
//!   row (runner, lock epoch, time) in the same transaction as its reply.
//! - [`workload`]: the client-only process: persisted deposits (with primary keys) and
//!   volatile echoes, retried until answered, with a summary.
//! - [`chaos`]: the orchestration: runner processes on 127.0.0.1, faults (SIGKILL, SIGSTOP past
//!   the lock expiration, a join, a graceful leave) and the checks at the end.

pub mod chaos;
pub mod ledger;
pub mod node;
pub mod workload;
