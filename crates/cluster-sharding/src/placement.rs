//! Where requests run: the runners of a cluster, the shards each serves, and routing.
//!
//! - `member`: this process as a cluster member: membership, shard locks and the handoff;
//! - `single_runner`: one runner holding every shard's lock;
//! - `shards`: the shards served now, and whether a final reply may be stored;
//! - `remote`: volatile requests routed to the owner of their shard.

pub(crate) mod member;
pub(crate) mod remote;
pub(crate) mod shards;
pub(crate) mod single_runner;
