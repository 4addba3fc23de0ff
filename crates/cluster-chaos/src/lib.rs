//! The fault test across processes (`cargo xtask chaos`): runner processes built on
//! `durable_cluster::Runner`, a client-only workload, faults, and the checks at the end.
//!
//! - [`ledger`]: the entity the fault test drives; every deposit it handles writes an audit
//!   row (runner, lock epoch, run, time) in the same transaction as its reply.
//! - [`runs`]: every run of a deposit's handler, recorded outside the request's transaction
//!   before the handler does anything else, and the checks on them: a run that was not
//!   committed must be explained by a kill or freeze of its own process, and each ledger's
//!   first runs follow its storage order.
//! - [`retention`]: what message retention may have deleted by the end of the run (the runners
//!   run with it at 30 s), and the check of each deposit's stored request and replies against
//!   it.
//! - [`workload`]: the client-only process: persisted deposits (with primary keys), stored
//!   one after the other per ledger and answered concurrently, each sent for at most a set
//!   time, and volatile echoes, retried until answered, with a summary.
//! - [`chaos`]: the orchestration: runner processes on 127.0.0.1, faults (SIGKILL, SIGSTOP past
//!   the lock expiration, then joins and graceful leaves only) and the checks at the end.
//! - [`failover`]: SIGKILLs with the default settings, and how long the killed runner's shards
//!   stay unserved, with advisory locks and with lease rows.

pub mod chaos;
pub mod failover;
pub mod ledger;
pub mod retention;
pub mod runs;
pub mod workload;
