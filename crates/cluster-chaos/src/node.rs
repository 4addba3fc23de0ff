//! One process of a cluster, configured from the environment.
//!
//! | variable | meaning |
//! | --- | --- |
//! | `CLUSTER_STORAGE_URL` | `postgres://…`, `mysql://…` or `sqlite:<path>` (required) |
//! | `CLUSTER_TABLE_PREFIX` | the tables' prefix (default `cluster`) |
//! | `HOST`, `PORT`, `LISTEN_HOST`, `LISTEN_PORT`, … | the runtime's settings (`ShardingConfig::from_env`) |
//! | `CLUSTER_RPC_SECRET`, `CLUSTER_RPC_*` | the transport's settings (`RpcConfig::from_env`) |
//!
//! A runner binds its transport's listener (the listen address, or else its advertised one),
//! joins the cluster, serves peers, and on SIGTERM or SIGINT shuts down gracefully: it hands
//! its shards to the other runners, then stops the listener.
//!
//! A runner binary (docs/deployment.md, "A runner binary"):
//!
//! ```no_run
//! use cluster_chaos::node::{self, Node, NodeEnv};
//! use cluster_sharding::EntityOptions;
//! # use cluster_sharding::{Entity, EntityContext, Protocol};
//! # struct Account;
//! # impl Entity for Account {
//! #     const TYPE: &'static str = "Account";
//! #     async fn create(_context: &EntityContext) -> Account { Account }
//! #     fn protocol(_protocol: &mut Protocol<Account>) {}
//! # }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // CLUSTER_STORAGE_URL, CLUSTER_TABLE_PREFIX, every ShardingConfig variable, CLUSTER_RPC_*.
//!     let env = NodeEnv::from_env(true)?;
//!     // Binds the listener, opens the storages (running the migrations), joins, registers,
//!     // serves.
//!     let node = Node::serve(&env, |sharding| {
//!         sharding.register::<Account>(EntityOptions::default()).map_err(|error| error.to_string())
//!     })
//!     .await?;
//!     node::terminated().await?; // SIGTERM or SIGINT
//!     node.shutdown().await; // hands the shards to the other runners, then stops the listener
//!     Ok(())
//! }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{ConfigError, RunnerAddress, ShardingConfig, SystemClock};
use cluster_rpc::{RpcConfig, RpcServer, TcpRunners};
use cluster_sharding::Sharding;
use cluster_storage_sql::mysql::{MySqlMessageStorage, MySqlRunnerStorage};
use cluster_storage_sql::postgres::{PgMessageStorage, PgRunnerStorage};
use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage};
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};

/// Why a process could not start or run.
#[derive(Debug)]
pub enum NodeError {
    /// A variable is missing or wrong.
    Config(ConfigError),
    /// Storage could not be opened.
    Storage(String),
    /// The transport could not start.
    Transport(String),
    /// The runtime could not start.
    Start(String),
}

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeError::Config(error) => write!(f, "configuration: {error}"),
            NodeError::Storage(error) => write!(f, "storage: {error}"),
            NodeError::Transport(error) => write!(f, "transport: {error}"),
            NodeError::Start(error) => write!(f, "start: {error}"),
        }
    }
}

impl std::error::Error for NodeError {}

/// A process's settings.
#[derive(Clone, Debug)]
pub struct NodeEnv {
    /// Where messages and locks live.
    pub storage_url: String,
    /// The tables' prefix.
    pub table_prefix: TablePrefix,
    /// The runtime's settings; `runner_address: None` for a client-only process.
    pub sharding: ShardingConfig,
    /// The transport's settings.
    pub rpc: RpcConfig,
}

impl NodeEnv {
    /// The settings from the process environment; `runner` false makes a client-only process.
    pub fn from_env(runner: bool) -> Result<NodeEnv, NodeError> {
        NodeEnv::from_lookup(runner, |name| std::env::var(name).ok())
    }

    /// The settings from `lookup` (a variable's value, or `None` when it is unset).
    pub fn from_lookup(
        runner: bool,
        lookup: impl Fn(&str) -> Option<String> + Clone,
    ) -> Result<NodeEnv, NodeError> {
        let storage_url = lookup("CLUSTER_STORAGE_URL").ok_or_else(|| {
            NodeError::Config(ConfigError::new(
                "CLUSTER_STORAGE_URL",
                "",
                "is required (postgres://…, mysql://… or sqlite:<path>)",
            ))
        })?;
        let table_prefix = match lookup("CLUSTER_TABLE_PREFIX") {
            // Named by its variable, as every other setting's error is.
            Some(prefix) => TablePrefix::new(&prefix).map_err(|error| {
                NodeError::Config(ConfigError::new(
                    "CLUSTER_TABLE_PREFIX",
                    &prefix,
                    error.reason().to_owned(),
                ))
            })?,
            None => TablePrefix::default(),
        };
        let mut sharding =
            ShardingConfig::from_env_with(lookup.clone()).map_err(NodeError::Config)?;
        if !runner {
            sharding.runner_address = None;
            sharding.runner_listen_address = None;
        }
        let rpc = RpcConfig::from_env_with(|name| Ok(lookup(name))).map_err(NodeError::Config)?;
        Ok(NodeEnv { storage_url, table_prefix, sharding, rpc })
    }

    /// The storage options of these settings.
    pub fn storage_options(&self) -> SqlStorageOptions {
        SqlStorageOptions::from_config(&self.sharding, self.table_prefix.clone())
    }

    /// Opens this process's message and lock storage.
    pub async fn open_storages(
        &self,
    ) -> Result<(Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>), NodeError> {
        let storage =
            |error: cluster_core::error::StorageError| NodeError::Storage(error.to_string());
        let options = self.storage_options();
        let url = self.storage_url.as_str();
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let messages = PgMessageStorage::connect(url, &options).await.map_err(storage)?;
            let locks = PgRunnerStorage::connect(url, &options).await.map_err(storage)?;
            Ok((Arc::new(messages), Arc::new(locks)))
        } else if url.starts_with("mysql://") {
            let messages = MySqlMessageStorage::connect(url, &options).await.map_err(storage)?;
            let locks = MySqlRunnerStorage::connect(url, options).await.map_err(storage)?;
            Ok((Arc::new(messages), Arc::new(locks)))
        } else if let Some(path) = url.strip_prefix("sqlite:") {
            let messages = SqliteMessageStorage::open(path, SqliteOptions::new(options.clone()));
            let messages = messages.await.map_err(storage)?;
            let locks = SqliteRunnerStorage::open(path, SqliteOptions::new(options));
            let locks = locks.await.map_err(storage)?;
            Ok((Arc::new(messages), Arc::new(locks)))
        } else {
            Err(NodeError::Config(ConfigError::new(
                "CLUSTER_STORAGE_URL",
                url,
                "is not postgres://…, mysql://… or sqlite:<path>",
            )))
        }
    }

    /// Joins the cluster with the TCP transport (a runner also needs [`Node::serve`]).
    pub async fn join(&self) -> Result<Sharding, NodeError> {
        let transport = TcpRunners::new(self.rpc.clone())
            .map_err(|error| NodeError::Transport(error.to_string()))?;
        let (messages, locks) = self.open_storages().await?;
        Sharding::join_with_transport(
            self.sharding.clone(),
            Arc::new(SystemClock),
            messages,
            locks,
            Some(transport),
        )
        .await
        .map_err(|error| NodeError::Start(error.to_string()))
    }
}

/// A running runner: the runtime and its transport's server.
pub struct Node {
    /// The runtime.
    pub sharding: Sharding,
    server: cluster_rpc::ServerHandle,
}

impl Node {
    /// Binds the listener, joins the cluster, registers the entities with `register` and starts
    /// serving peers.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a runner dropped half-way may have registered itself (its registration
    /// expires).
    pub async fn serve(
        env: &NodeEnv,
        register: impl FnOnce(&Sharding) -> Result<(), String>,
    ) -> Result<Node, NodeError> {
        let address = env.sharding.runner_address.clone().ok_or_else(|| {
            NodeError::Config(ConfigError::new("HOST", "", "a runner needs an address"))
        })?;
        let listen = env.sharding.runner_listen_address.clone().unwrap_or(address);
        let listen = resolve(&listen).await?;
        let server = RpcServer::bind(listen, env.rpc.clone())
            .await
            .map_err(|error| NodeError::Transport(error.to_string()))?;
        let sharding = env.join().await?;
        if let Err(error) = register(&sharding) {
            // Leave the cluster cleanly instead of holding shards it cannot serve.
            sharding.shutdown().await;
            return Err(NodeError::Start(error));
        }
        let server = server.serve(sharding.runner_handler());
        Ok(Node { sharding, server })
    }

    /// Shuts down gracefully: the shards go to the other runners, then the listener stops.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a shutdown dropped half-way leaves shards to expire.
    pub async fn shutdown(self) {
        self.sharding.shutdown().await;
        self.server.shutdown().await;
    }
}

async fn resolve(address: &RunnerAddress) -> Result<SocketAddr, NodeError> {
    let target = (address.host(), address.port());
    let mut found = tokio::net::lookup_host(target)
        .await
        .map_err(|error| NodeError::Transport(format!("cannot resolve {address}: {error}")))?;
    found.next().ok_or_else(|| NodeError::Transport(format!("{address} resolves to nothing")))
}

/// Waits for SIGTERM or SIGINT (Ctrl-C).
///
/// # Cancel safety
///
/// Cancel safe.
pub async fn terminated() -> Result<(), NodeError> {
    use tokio::signal::unix::{SignalKind, signal};
    let signal_error = |error: std::io::Error| NodeError::Start(format!("signals: {error}"));
    let mut term = signal(SignalKind::terminate()).map_err(signal_error)?;
    let mut int = signal(SignalKind::interrupt()).map_err(signal_error)?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{NodeEnv, NodeError};

    #[test]
    fn a_bad_table_prefix_is_reported_by_its_variable() {
        let env = NodeEnv::from_lookup(true, |name| match name {
            "CLUSTER_STORAGE_URL" => Some("sqlite:/tmp/unused.db".to_owned()),
            "CLUSTER_TABLE_PREFIX" => Some("bad-prefix".to_owned()),
            _ => None,
        });
        let Err(NodeError::Config(error)) = env else {
            panic!("a prefix with a dash is a configuration error");
        };
        assert_eq!((error.key(), error.value()), ("CLUSTER_TABLE_PREFIX", "bad-prefix"));
        assert!(error.to_string().contains("CLUSTER_TABLE_PREFIX"), "{error}");
    }
}
