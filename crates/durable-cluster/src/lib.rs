//! Durable, sharded entities and workflows on a SQL database: the one crate an application
//! depends on.
//!
//! It re-exports the runtime (`cluster-sharding`), the types it is configured with
//! (`cluster-core`), the SQL storages (`cluster-storage-sql`), and behind features the transport
//! between runners (`cluster-rpc`) and durable workflows (`cluster-workflow`).
//!
//! | feature | what it adds |
//! | --- | --- |
// Each row links its items only when its feature is on: `cargo doc` without it would report the
// links as broken (a CI step builds the docs with the default features, warnings denied).
#![cfg_attr(
    feature = "sqlite",
    doc = "| `sqlite` (default) | [`storage::sqlite`] and [`SingleRunner::sqlite`] |"
)]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "| `sqlite` (default) | `storage::sqlite` and `SingleRunner::sqlite` |"
)]
#![cfg_attr(feature = "postgres", doc = "| `postgres` | [`storage::postgres`] |")]
#![cfg_attr(not(feature = "postgres"), doc = "| `postgres` | `storage::postgres` |")]
#![cfg_attr(feature = "mysql", doc = "| `mysql` | [`storage::mysql`] (MySQL or MariaDB) |")]
#![cfg_attr(not(feature = "mysql"), doc = "| `mysql` | `storage::mysql` (MySQL or MariaDB) |")]
#![cfg_attr(
    feature = "rpc",
    doc = "| `rpc` | the TCP transport ([`rpc`]) and the runner process ([`Runner`]) |"
)]
#![cfg_attr(
    not(feature = "rpc"),
    doc = "| `rpc` | the TCP transport (`rpc`) and the runner process (`Runner`) |"
)]
#![cfg_attr(
    feature = "ops",
    doc = "| `ops` (with `rpc`) | [`Runner::main`]: the operations server (`/healthz`, `/readyz`, \
           `/metrics` from `CLUSTER_OPS_LISTEN`) and the logger (`RUST_LOG`, \
           `CLUSTER_LOG_FORMAT`) |"
)]
#![cfg_attr(
    not(feature = "ops"),
    doc = "| `ops` (with `rpc`) | `Runner::main`: the operations server (`/healthz`, `/readyz`, \
           `/metrics` from `CLUSTER_OPS_LISTEN`) and the logger (`RUST_LOG`, \
           `CLUSTER_LOG_FORMAT`) |"
)]
#![cfg_attr(
    feature = "otel",
    doc = "| `otel` (with `ops`) | [`otel`]: spans exported over OTLP, and the trace context \
           carried by requests across processes |"
)]
#![cfg_attr(
    not(feature = "otel"),
    doc = "| `otel` (with `ops`) | `otel`: spans exported over OTLP, and the trace context \
           carried by requests across processes |"
)]
//! | `tls` | TLS on the transport |
#![cfg_attr(
    feature = "kubernetes",
    doc = "| `kubernetes` | [`KubernetesRunnerHealth`]: runners judged by their pods' readiness \
           (`CLUSTER_RUNNER_HEALTH=kubernetes` for `Runner`) |"
)]
#![cfg_attr(
    not(feature = "kubernetes"),
    doc = "| `kubernetes` | `KubernetesRunnerHealth`: runners judged by their pods' readiness \
           (`CLUSTER_RUNNER_HEALTH=kubernetes` for `Runner`) |"
)]
#![cfg_attr(
    feature = "http",
    doc = "| `http` | the HTTP gateway ([`http::HttpGateway`]): entities, streams and workflows \
           over HTTP |"
)]
#![cfg_attr(
    not(feature = "http"),
    doc = "| `http` | the HTTP gateway (`http::HttpGateway`): entities, streams and workflows over \
           HTTP |"
)]
//! | `schemars` | payload, success and error schemas in the gateway's OpenAPI document |
#![cfg_attr(feature = "workflow", doc = "| `workflow` | durable workflows ([`workflow`]) |")]
#![cfg_attr(not(feature = "workflow"), doc = "| `workflow` | durable workflows (`workflow`) |")]
//!
//! An entity, a runner on a SQLite file, and a persisted request answered exactly once:
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//!
//! use durable_cluster::{EntityContext, EntityOptions, Never, ShardingConfig, SingleRunner, entity};
//! use serde::{Deserialize, Serialize};
//!
//! /// Adds `amount`; `key` makes it one deposit however often it is sent.
//! #[derive(Serialize, Deserialize)]
//! struct Deposit {
//!     key: String,
//!     amount: u64,
//! }
//!
//! /// Reads the balance (volatile: in memory only).
//! #[derive(Serialize, Deserialize)]
//! struct Balance;
//!
//! struct Account {
//!     balance: u64,
//!     /// A dependency, handed in by the factory: counts the handler's runs.
//!     runs: Arc<AtomicU64>,
//! }
//!
//! #[entity]
//! impl Account {
//!     #[rpc(persisted, primary_key = key)]
//!     async fn deposit(&mut self, deposit: Deposit) -> Result<u64, Never> {
//!         self.runs.fetch_add(1, Ordering::SeqCst);
//!         self.balance += deposit.amount;
//!         Ok(self.balance)
//!     }
//!
//!     #[rpc]
//!     async fn balance(&mut self, _: Balance) -> Result<u64, Never> {
//!         Ok(self.balance)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let path = std::env::temp_dir().join(format!("doc-facade-{}.db", std::process::id()));
//! let sharding = SingleRunner::sqlite(&path, ShardingConfig::default()).await?;
//! let runs = Arc::new(AtomicU64::new(0));
//! let counted = Arc::clone(&runs);
//! sharding.entity().factory(move |_: &EntityContext| Account {
//!     balance: 0,
//!     runs: Arc::clone(&counted),
//! }).register()?;
//!
//! let accounts = Account::client(&sharding);
//! let deposit = || Deposit { key: "deposit-1".into(), amount: 10 };
//! assert_eq!(accounts.deposit("alice", deposit()).await?, 10);
//! // The same key again: the stored reply; the handler does not run again.
//! assert_eq!(accounts.deposit("alice", deposit()).await?, 10);
//! assert_eq!(runs.load(Ordering::SeqCst), 1);
//! assert_eq!(accounts.balance("alice", Balance).await?, 10);
//!
//! sharding.shutdown().await;
//! # for suffix in ["", "-wal", "-shm"] {
//! #     let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
//! # }
//! # Ok(())
//! # }
//! ```
//!
//! The `entity` macro writes the request types' `Rpc` implementations, the handlers, the
//! protocol and the typed client (`Account::client`); docs/sharding.md lists its arguments.
//! The same entity can be written by hand with the [`Entity`], [`Rpc`] and [`Handler`]
//! traits.
//!
//! Several runners on one database: `Runner` (feature `rpc`) reads its storage, address and
//! transport settings from the environment; docs/deployment.md shows a complete runner.

#[cfg(feature = "admin")]
pub mod admin;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "kubernetes")]
mod kubernetes;
#[cfg(feature = "ops")]
mod ops;
#[cfg(feature = "otel")]
pub mod otel;
#[cfg(feature = "rpc")]
mod runner;
#[cfg(feature = "server")]
mod server;
#[cfg(feature = "sqlite")]
mod single_runner;
#[cfg(any(feature = "http", feature = "console"))]
mod token;

pub use cluster_core::{
    Clock, ClusterError, ConfigError, EntityAddress, EntityId, EntityType, Never, RunnerAddress,
    ShardGroup, ShardId, ShardingConfig, Snowflake, StorageError, SystemClock, Timestamp,
};
/// Writes an entity from one impl block: its requests' `Rpc` implementations, its handlers, its
/// protocol and a typed client (the `cluster-macros` crate's `entity`, with this crate as the
/// runtime's path).
pub use cluster_macros::durable_entity as entity;
pub use cluster_sharding::*;
#[cfg(feature = "kubernetes")]
pub use kubernetes::{KubernetesOptions, KubernetesRunnerHealth, KubernetesToken};
#[cfg(feature = "rpc")]
pub use runner::{
    BoxError, Role, Runner, RunnerEnv, RunnerError, RunnerHealthSource, masked_url, terminated,
};
#[cfg(feature = "server")]
pub use server::{HEADER_BYTES_MAX, ServerLimits};
#[cfg(feature = "sqlite")]
pub use single_runner::SingleRunner;

/// The crates underneath, for what the top level does not re-export.
pub use {cluster_core, cluster_sharding, cluster_storage_sql};

/// Storage: the contracts ([`MessageStorage`](storage::MessageStorage),
/// [`RunnerStorage`](storage::RunnerStorage)) and the SQL backends compiled in by the features.
pub mod storage {
    pub use cluster_core::storage::*;
    pub use cluster_storage_sql::*;
}

/// The TCP transport between runners (feature `rpc`).
#[cfg(feature = "rpc")]
pub use cluster_rpc as rpc;

/// Durable workflows (feature `workflow`).
#[cfg(feature = "workflow")]
pub use cluster_workflow as workflow;
