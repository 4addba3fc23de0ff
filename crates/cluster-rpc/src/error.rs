//! [`RpcError`]: what setting up the transport can fail with.
//!
//! Calls between runners never return it: they report [`cluster_core::ClusterError`] as the
//! `Transport` contract requires (see the crate docs for the mapping).

use std::io;

use cluster_core::error::ConfigError;

/// A failure to set up the transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listening socket could not be bound.
    #[error("cannot bind the rpc listener: {0}")]
    Bind(#[source] io::Error),
}
