//! Durable workflows on top of `cluster-sharding`.
//!
//! This crate will hold the workflow API (activities, deferreds and tokens, durable clocks,
//! compensation, interrupt signals, child workflows), an in-memory engine, and the cluster
//! engine whose entity types, RPCs and stored encodings are the reference's.
//!
//! Status: not written yet (the workflow issue).
