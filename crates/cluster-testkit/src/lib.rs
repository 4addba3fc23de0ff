//! Test support for the cluster crates; only ever a dev-dependency.
//!
//! This crate will hold the in-memory `MessageStorage` and `RunnerStorage` with the reference's
//! semantics, the simulated transport and clock with fault injection, the simulated cluster
//! (`SimCluster`), the storage conformance suite and the invariant checkers.
//!
//! Status: not written yet (the storage and simulation issues).
