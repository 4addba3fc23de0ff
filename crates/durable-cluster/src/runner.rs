//! [`Runner`]: one process of a cluster, configured from the environment.
//!
//! | variable | meaning |
//! | --- | --- |
//! | `CLUSTER_STORAGE_URL` | `postgres://…`, `mysql://…` or `sqlite:<path>` (required) |
//! | `CLUSTER_TABLE_PREFIX` | the tables' prefix (default `cluster`) |
//! | `CLUSTER_STORAGE_VALUE_BYTES_MAX` | the most bytes of a stored payload, reply or queue element (default 16777216, 16 MiB; at least 1024, at most 1 GiB) |
//! | `HOST`, `PORT`, `LISTEN_HOST`, `LISTEN_PORT`, … | the runtime's settings (`ShardingConfig::from_env`) |
//! | `CLUSTER_RPC_SECRET`, `CLUSTER_RPC_*` | the transport's settings (`RpcConfig::from_env`) |
//! | `CLUSTER_OPS_LISTEN` | the address of the operations server (`/healthz`, `/readyz`, `/metrics`; feature `ops`), off when unset |
//! | `CLUSTER_OPS_CONNECTIONS_MAX`, `CLUSTER_OPS_HEADER_READ_TIMEOUT` | the operations server's connection limit (default 64) and header-read and idle timeout (default `5 seconds`) |
//! | `CLUSTER_ADMIN_TOKEN`, `CLUSTER_ADMIN_READ_TOKEN` (or `_FILE`) | the console's tokens on the operations server (feature `console`): read and act, or read only; off when unset |
//! | `CLUSTER_RUNNER_HEALTH` | how the runners judge each other: `transport` (the default: pings, as `RUNNER_HEALTH_CHECK` says) or `kubernetes` (pod readiness; feature `kubernetes`) |
//! | `CLUSTER_KUBERNETES_NAMESPACE` | with `kubernetes`: the namespace of the runners' pods (default: the pod's own) |
//! | `CLUSTER_KUBERNETES_LABEL_SELECTOR` | with `kubernetes`: the label selector of the runners' pods (default: every running pod of the namespace) |
//!
//! A runner binds its transport's listener (the listen address, or else its advertised one),
//! joins the cluster, and serves peers.
//! On SIGTERM or SIGINT it shuts down gracefully: it hands its shards to the other runners, then
//! stops the listener.
//!
//! A runner binary (docs/deployment.md, "A runner binary"):
//!
//! ```no_run
//! use durable_cluster::{EntityOptions, Runner};
//! # use durable_cluster::{Entity, EntityContext, Protocol};
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
//!     // Binds the listener, opens the storages (running the migrations), joins, registers,
//!     // serves.
//!     let runner = Runner::from_env(|sharding| {
//!         sharding.entity::<Account>().register()?;
//!         Ok(())
//!     })
//!     .await?;
//!     durable_cluster::terminated().await?; // SIGTERM or SIGINT
//!     runner.shutdown().await; // hands the shards to the other runners, stops the listener
//!     Ok(())
//! }
//! ```

use cluster_sharding::Plumbing;
use std::net::SocketAddr;
use std::sync::Arc;

use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{ConfigError, RunnerAddress, ShardingConfig, StorageError};
use cluster_rpc::{RpcConfig, RpcError, RpcServer, ServerHandle, TcpTransport};
use cluster_sharding::{RunnerHealth, Sharding, StartError};
use cluster_storage_sql::{SqlStorageOptions, TablePrefix, ValueBytesMax};

/// What an application's registration step may fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a process could not start or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// A variable is missing or wrong.
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    /// The storage could not be opened.
    #[error("storage: {0}")]
    Storage(#[from] StorageError),
    /// The transport could not start.
    #[error("transport: {0}")]
    Transport(#[from] RpcError),
    /// The listen address could not be resolved.
    #[error("cannot resolve {address}")]
    Resolve {
        /// The address.
        address: RunnerAddress,
        /// Why, or `None` when it resolved to nothing.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The runtime could not start.
    #[error("start: {0}")]
    Start(#[from] StartError),
    /// The application's registration step failed; the runner left the cluster.
    #[error("registration: {0}")]
    Register(#[source] BoxError),
    /// The signal handlers could not be installed.
    #[error("signals: {0}")]
    Signals(#[source] std::io::Error),
    /// The operations server could not listen on `CLUSTER_OPS_LISTEN`.
    #[error("cannot listen on {address} (CLUSTER_OPS_LISTEN): {source}")]
    Ops {
        /// The address.
        address: SocketAddr,
        /// Why, for instance that the port is in use.
        #[source]
        source: std::io::Error,
    },
}

impl RunnerError {
    /// The exit code of a runner process that stops with this error: 2 for a configuration
    /// error (a wrong variable, an unknown storage scheme), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunnerError::Config(_) => 2,
            _ => 1,
        }
    }
}

/// Whether a process hosts entities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A runner: it hosts entities and has an address.
    Runner,
    /// A client: it hosts no entity; its runner address is dropped.
    Client,
}

/// A process's settings.
///
/// Its `Debug` output shows the storage URL with its password masked ([`masked_url`]) and no
/// transport secret.
#[derive(Clone)]
pub struct RunnerEnv {
    /// Where messages and locks live. It may hold a password: show it with [`masked_url`].
    pub storage_url: String,
    /// The tables' prefix.
    pub table_prefix: TablePrefix,
    /// The most bytes of a stored value (`CLUSTER_STORAGE_VALUE_BYTES_MAX`, 16 MiB by default;
    /// see `SqlStorageOptions::value_bytes_max`).
    pub value_bytes_max: ValueBytesMax,
    /// The runtime's settings; `runner_address: None` for a client.
    pub sharding: ShardingConfig,
    /// The transport's settings.
    pub rpc: RpcConfig,
    /// Where the operations server listens (`CLUSTER_OPS_LISTEN`, feature `ops`); `None`: off.
    pub ops_listen: Option<SocketAddr>,
    /// The operations server's limits (`CLUSTER_OPS_CONNECTIONS_MAX`,
    /// `CLUSTER_OPS_HEADER_READ_TIMEOUT`; by default
    /// [`ServerLimits::ops`](crate::ServerLimits::ops)).
    #[cfg(feature = "ops")]
    pub ops_limits: crate::ServerLimits,
    /// How a runner judges the other runners' health (`CLUSTER_RUNNER_HEALTH`); a client
    /// judges none, and does not read it.
    pub runner_health: RunnerHealthSource,
    /// Who may use the admin on the operations server (`CLUSTER_ADMIN_TOKEN`,
    /// `CLUSTER_ADMIN_READ_TOKEN`, feature `console`); `None`: off.
    #[cfg(feature = "console")]
    pub admin_access: Option<crate::admin::web::AdminAccess>,
}

impl std::fmt::Debug for RunnerEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut debug = f.debug_struct("RunnerEnv");
        debug
            .field("storage_url", &masked_url(&self.storage_url))
            .field("table_prefix", &self.table_prefix)
            .field("value_bytes_max", &self.value_bytes_max)
            .field("sharding", &self.sharding)
            .field("rpc", &self.rpc)
            .field("ops_listen", &self.ops_listen);
        #[cfg(feature = "ops")]
        debug.field("ops_limits", &self.ops_limits);
        #[cfg(feature = "console")]
        debug.field("admin_access", &self.admin_access);
        debug.field("runner_health", &self.runner_health).finish()
    }
}

/// What replaces a password in a URL that is shown.
const MASK: &str = "***";

/// `url` as it may be shown in an error, a log line or a `Debug` output: the password of its
/// user information (`postgres://app:***@db:5432/app`) and the value of every query parameter
/// whose name contains `password` (`?password=***`) masked.
///
/// It never fails: a value that is not a URL is masked from its first `:` (after `://` when
/// there is one) to its last `@`, so that a malformed URL shows no more than a well-formed one.
/// It masks too much rather than too little: a `@` in a query string masks what precedes it.
pub fn masked_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => match url.split_once(':') {
            Some((scheme, rest)) => (format!("{scheme}:"), rest),
            None => (String::new(), url),
        },
    };
    let (user_info, rest) = match rest.rsplit_once('@') {
        Some((user_info, host)) => {
            let user = match user_info.split_once(':') {
                Some((user, _password)) => format!("{user}:{MASK}@"),
                None => format!("{user_info}@"),
            };
            (user, host)
        }
        None => (String::new(), rest),
    };
    let masked_rest = match rest.split_once('?') {
        Some((path, query)) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if name.to_ascii_lowercase().contains("password") => {
                        format!("{name}={MASK}")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", pairs.join("&"))
        }
        None => rest.to_owned(),
    };
    format!("{scheme}{user_info}{masked_rest}")
}

/// How a runner's runner-health singleton judges the other runners (`CLUSTER_RUNNER_HEALTH`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunnerHealthSource {
    /// Pings through the transport, as `RUNNER_HEALTH_CHECK` says (`CLUSTER_RUNNER_HEALTH`
    /// unset, or `transport`).
    #[default]
    Transport,
    /// The readiness of the runners' pods, read from the Kubernetes API
    /// (`CLUSTER_RUNNER_HEALTH=kubernetes`, feature `kubernetes`; see `KubernetesRunnerHealth`).
    /// A runner is alive while the pod whose IP is its host is ready or still starting.
    Kubernetes {
        /// The API server's URL, from `KUBERNETES_SERVICE_HOST` and `KUBERNETES_SERVICE_PORT`.
        api_url: String,
        /// Where the pod's service account (token, CA and namespace) is mounted:
        /// `/var/run/secrets/kubernetes.io/serviceaccount` from the environment.
        service_account_dir: std::path::PathBuf,
        /// The namespace of the runners' pods (`CLUSTER_KUBERNETES_NAMESPACE`); `None`: the
        /// pod's own, from the service account.
        namespace: Option<String>,
        /// The label selector of the runners' pods (`CLUSTER_KUBERNETES_LABEL_SELECTOR`);
        /// `None`: every running pod of the namespace.
        label_selector: Option<String>,
    },
}

/// The variable of [`RunnerEnv::value_bytes_max`].
const VALUE_BYTES_MAX: &str = "CLUSTER_STORAGE_VALUE_BYTES_MAX";

/// `CLUSTER_STORAGE_VALUE_BYTES_MAX` (read with `lookup`): a number of bytes, or the default
/// when unset or empty.
fn value_bytes_max(lookup: &impl Fn(&str) -> Option<String>) -> Result<ValueBytesMax, ConfigError> {
    let Some(value) = lookup(VALUE_BYTES_MAX).filter(|value| !value.trim().is_empty()) else {
        return Ok(ValueBytesMax::default());
    };
    let bytes = value.trim().parse::<usize>().map_err(|_| {
        ConfigError::new(VALUE_BYTES_MAX, &value, "is not a number of bytes, such as 16777216")
    })?;
    ValueBytesMax::new(bytes)
        .map_err(|error| ConfigError::new(VALUE_BYTES_MAX, &value, error.reason().to_owned()))
}

/// `CLUSTER_RUNNER_HEALTH` and the variables of its `kubernetes` mode.
const RUNNER_HEALTH: &str = "CLUSTER_RUNNER_HEALTH";
const KUBERNETES_NAMESPACE: &str = "CLUSTER_KUBERNETES_NAMESPACE";
const KUBERNETES_LABEL_SELECTOR: &str = "CLUSTER_KUBERNETES_LABEL_SELECTOR";

impl RunnerHealthSource {
    /// The source that `CLUSTER_RUNNER_HEALTH` and its variables (read with `lookup`) name.
    fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let set = |name: &str| lookup(name).filter(|value| !value.is_empty());
        let namespace = set(KUBERNETES_NAMESPACE);
        let label_selector = set(KUBERNETES_LABEL_SELECTOR);
        match set(RUNNER_HEALTH).as_deref() {
            None | Some("transport") => {
                let unused = [
                    (KUBERNETES_NAMESPACE, namespace),
                    (KUBERNETES_LABEL_SELECTOR, label_selector),
                ];
                if let Some((name, value)) =
                    unused.into_iter().find_map(|(name, value)| Some((name, value?)))
                {
                    return Err(ConfigError::new(
                        name,
                        value,
                        "is only read with CLUSTER_RUNNER_HEALTH=kubernetes",
                    ));
                }
                Ok(RunnerHealthSource::Transport)
            }
            Some("kubernetes") => kubernetes_source(lookup, namespace, label_selector),
            Some(other) => Err(ConfigError::new(
                RUNNER_HEALTH,
                other,
                "expected `transport` (the default) or `kubernetes`",
            )),
        }
    }

    /// The runner-health check of this source: `None` for the transport's pings.
    fn check(&self) -> Result<Option<Arc<dyn RunnerHealth>>, ConfigError> {
        match self {
            RunnerHealthSource::Transport => Ok(None),
            #[cfg(feature = "kubernetes")]
            RunnerHealthSource::Kubernetes {
                api_url,
                service_account_dir,
                namespace,
                label_selector,
            } => {
                use crate::kubernetes::{KubernetesOptions, KubernetesRunnerHealth};
                let mut options = KubernetesOptions::from_service_account(
                    api_url.clone(),
                    service_account_dir,
                    namespace.clone(),
                )?;
                options.label_selector.clone_from(label_selector);
                Ok(Some(Arc::new(KubernetesRunnerHealth::new(options)?)))
            }
            #[cfg(not(feature = "kubernetes"))]
            RunnerHealthSource::Kubernetes { .. } => Err(kubernetes_missing()),
        }
    }
}

/// The `kubernetes` source, its variables checked.
#[cfg(feature = "kubernetes")]
fn kubernetes_source(
    lookup: &impl Fn(&str) -> Option<String>,
    namespace: Option<String>,
    label_selector: Option<String>,
) -> Result<RunnerHealthSource, ConfigError> {
    if let Some(namespace) = &namespace {
        crate::kubernetes::check_namespace(namespace)
            .map_err(|reason| ConfigError::new(KUBERNETES_NAMESPACE, namespace, reason))?;
    }
    if let Some(selector) = &label_selector {
        crate::kubernetes::check_label_selector(selector)
            .map_err(|reason| ConfigError::new(KUBERNETES_LABEL_SELECTOR, selector, reason))?;
    }
    Ok(RunnerHealthSource::Kubernetes {
        api_url: crate::kubernetes::in_cluster_api_url(lookup)?,
        service_account_dir: crate::kubernetes::KubernetesOptions::SERVICE_ACCOUNT_DIR.into(),
        namespace,
        label_selector,
    })
}

/// Without the feature `kubernetes`, asking for it is a configuration error.
#[cfg(not(feature = "kubernetes"))]
fn kubernetes_source(
    _lookup: &impl Fn(&str) -> Option<String>,
    _namespace: Option<String>,
    _label_selector: Option<String>,
) -> Result<RunnerHealthSource, ConfigError> {
    Err(kubernetes_missing())
}

#[cfg(not(feature = "kubernetes"))]
fn kubernetes_missing() -> ConfigError {
    ConfigError::new(
        RUNNER_HEALTH,
        "kubernetes",
        "needs durable-cluster's feature `kubernetes`, which this build lacks",
    )
}

impl RunnerEnv {
    /// The settings of a process with `role`, from the process environment.
    ///
    /// # Errors
    ///
    /// A variable is missing or wrong; the error names it.
    pub fn from_env(role: Role) -> Result<RunnerEnv, RunnerError> {
        RunnerEnv::from_lookup(role, |name| std::env::var(name).ok())
    }

    /// The settings from `lookup` (a variable's value, or `None` when it is unset).
    ///
    /// # Errors
    ///
    /// A variable is missing or wrong; the error names it.
    pub fn from_lookup(
        role: Role,
        lookup: impl Fn(&str) -> Option<String> + Clone,
    ) -> Result<RunnerEnv, RunnerError> {
        let storage_url = lookup("CLUSTER_STORAGE_URL").ok_or_else(|| {
            ConfigError::new(
                "CLUSTER_STORAGE_URL",
                "",
                "is required (postgres://…, mysql://… or sqlite:<path>)",
            )
        })?;
        let table_prefix = match lookup("CLUSTER_TABLE_PREFIX") {
            // Named by its variable, as every other setting's error is.
            Some(prefix) => TablePrefix::new(&prefix).map_err(|error| {
                ConfigError::new("CLUSTER_TABLE_PREFIX", &prefix, error.reason().to_owned())
            })?,
            None => TablePrefix::default(),
        };
        let value_bytes_max = value_bytes_max(&lookup)?;
        let mut sharding = ShardingConfig::from_env_with(lookup.clone())?;
        if role == Role::Client {
            sharding.runner_address = None;
            sharding.runner_listen_address = None;
        }
        let rpc = RpcConfig::from_env_with(|name| Ok(lookup(name)))?;
        let ops_listen = match lookup("CLUSTER_OPS_LISTEN").filter(|value| !value.is_empty()) {
            None => None,
            Some(value) if cfg!(feature = "ops") => {
                Some(value.trim().parse::<SocketAddr>().map_err(|_| {
                    ConfigError::new(
                        "CLUSTER_OPS_LISTEN",
                        &value,
                        "is not an IP address and port, such as 0.0.0.0:9090",
                    )
                })?)
            }
            Some(value) => {
                return Err(ConfigError::new(
                    "CLUSTER_OPS_LISTEN",
                    &value,
                    "needs durable-cluster's feature `ops`, which this build lacks",
                )
                .into());
            }
        };
        #[cfg(feature = "ops")]
        let ops_limits = crate::ServerLimits::ops().with_lookup("CLUSTER_OPS_", &lookup)?;
        // A client judges no runner: it does not read the runner-health variables.
        let runner_health = match role {
            Role::Runner => RunnerHealthSource::from_lookup(&lookup)?,
            Role::Client => RunnerHealthSource::Transport,
        };
        let admin_configured = ["CLUSTER_ADMIN_TOKEN", "CLUSTER_ADMIN_READ_TOKEN"]
            .into_iter()
            .flat_map(|name| [name.to_owned(), format!("{name}_FILE")])
            .find(|name| lookup(name).is_some_and(|value| !value.is_empty()));
        if let Some(name) = &admin_configured {
            if !cfg!(feature = "console") {
                return Err(ConfigError::new(
                    name,
                    "<redacted>",
                    "needs durable-cluster's feature `console`, which this build lacks",
                )
                .into());
            }
            if ops_listen.is_none() {
                return Err(ConfigError::new(
                    name,
                    "<redacted>",
                    "the admin is served by the operations server: set CLUSTER_OPS_LISTEN too",
                )
                .into());
            }
        }
        #[cfg(feature = "console")]
        let admin_access = crate::admin::web::AdminAccess::from_lookup(&lookup)?;
        Ok(RunnerEnv {
            storage_url,
            table_prefix,
            value_bytes_max,
            sharding,
            rpc,
            ops_listen,
            #[cfg(feature = "ops")]
            ops_limits,
            runner_health,
            #[cfg(feature = "console")]
            admin_access,
        })
    }

    /// The storage options of these settings.
    pub fn storage_options(&self) -> SqlStorageOptions {
        SqlStorageOptions {
            value_bytes_max: self.value_bytes_max,
            ..SqlStorageOptions::from_config(&self.sharding, self.table_prefix.clone())
        }
    }

    /// Opens this process's message and lock storage, running the migrations.
    ///
    /// # Errors
    ///
    /// The URL names a backend this build lacks, or the storage cannot be opened.
    pub async fn open_storages(
        &self,
    ) -> Result<(Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>), RunnerError> {
        let options = self.storage_options();
        let url = self.storage_url.as_str();
        let missing = |feature: &str| {
            ConfigError::new(
                "CLUSTER_STORAGE_URL",
                masked_url(url),
                format!("needs durable-cluster's feature `{feature}`, which this build lacks"),
            )
        };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            #[cfg(feature = "postgres")]
            {
                use cluster_storage_sql::postgres::{PgMessageStorage, PgRunnerStorage};
                let messages = PgMessageStorage::connect(url, &options).await?;
                let locks = PgRunnerStorage::connect(url, &options).await?;
                return Ok((Arc::new(messages), Arc::new(locks)));
            }
            #[cfg(not(feature = "postgres"))]
            return Err(missing("postgres").into());
        }
        if url.starts_with("mysql://") {
            #[cfg(feature = "mysql")]
            {
                use cluster_storage_sql::mysql::{MySqlMessageStorage, MySqlRunnerStorage};
                let messages = MySqlMessageStorage::connect(url, &options).await?;
                let locks = MySqlRunnerStorage::connect(url, options).await?;
                return Ok((Arc::new(messages), Arc::new(locks)));
            }
            #[cfg(not(feature = "mysql"))]
            return Err(missing("mysql").into());
        }
        if let Some(path) = url.strip_prefix("sqlite:") {
            #[cfg(feature = "sqlite")]
            {
                use cluster_storage_sql::sqlite::{
                    SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage,
                };
                let messages =
                    SqliteMessageStorage::open(path, SqliteOptions::new(options.clone())).await?;
                let locks = SqliteRunnerStorage::open(path, SqliteOptions::new(options)).await?;
                return Ok((Arc::new(messages), Arc::new(locks)));
            }
            #[cfg(not(feature = "sqlite"))]
            {
                let _ = path;
                return Err(missing("sqlite").into());
            }
        }
        let _ = (options, missing);
        Err(ConfigError::new(
            "CLUSTER_STORAGE_URL",
            masked_url(url),
            "is not postgres://…, mysql://… or sqlite:<path>",
        )
        .into())
    }

    /// Joins the cluster with the TCP transport: a client, or a runner that does not serve
    /// (a runner also needs [`Runner::start`]).
    ///
    /// # Errors
    ///
    /// The transport, the storage or the runtime could not start.
    pub async fn join(&self) -> Result<Sharding, RunnerError> {
        let (messages, locks) = self.open_storages().await?;
        self.join_with(messages, locks).await
    }

    /// Joins the cluster as [`RunnerEnv::join`] does, on storages the caller opened.
    ///
    /// # Errors
    ///
    /// The transport or the runtime could not start.
    pub async fn join_with(
        &self,
        messages: Arc<dyn MessageStorage>,
        locks: Arc<dyn RunnerStorage>,
    ) -> Result<Sharding, RunnerError> {
        // A client judges nobody: only a runner gets the runner-health check.
        let health = match self.sharding.runner_address {
            Some(_) => self.runner_health.check()?,
            None => None,
        };
        let transport = TcpTransport::new(self.rpc.clone())?;
        let mut builder = Sharding::member(self.sharding.clone(), messages, locks);
        if let Some(health) = health {
            builder = builder.runner_health(health);
        }
        let sharding = builder.transport(transport).start().await?;
        Ok(sharding)
    }
}

/// A running runner: the runtime and its transport's server.
pub struct Runner {
    /// The runtime.
    pub sharding: Sharding,
    server: ServerHandle,
    #[cfg(feature = "ops")]
    ops: Option<crate::ops::OpsServer>,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("sharding", &self.sharding).finish_non_exhaustive()
    }
}

impl Runner {
    /// A runner from the process environment (see the module docs), started with
    /// [`Runner::start`].
    ///
    /// # Errors
    ///
    /// As [`RunnerEnv::from_env`] and [`Runner::start`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`Runner::start`].
    pub async fn from_env(
        register: impl FnOnce(&Sharding) -> Result<(), BoxError>,
    ) -> Result<Runner, RunnerError> {
        Runner::start(&RunnerEnv::from_env(Role::Runner)?, register).await
    }

    /// Binds the listener, joins the cluster, registers the application's entities with
    /// `register`, and starts serving peers.
    ///
    /// # Errors
    ///
    /// - [`RunnerError::Config`]: the settings have no runner address.
    /// - [`RunnerError::Transport`], [`RunnerError::Resolve`]: the listener did not start.
    /// - [`RunnerError::Storage`], [`RunnerError::Start`]: the runtime did not start.
    /// - [`RunnerError::Register`]: `register` failed; the runner left the cluster cleanly.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a runner dropped half-way may have registered itself (its registration
    /// expires).
    pub async fn start(
        env: &RunnerEnv,
        register: impl FnOnce(&Sharding) -> Result<(), BoxError>,
    ) -> Result<Runner, RunnerError> {
        Runner::start_with(env, None, register).await
    }

    /// Starts as [`Runner::start`] does, on `storages` (the message storage and the runner
    /// storage) instead of those of `env.storage_url`, when given: wrapped storages, or a
    /// backend of the application's own.
    ///
    /// # Errors
    ///
    /// As [`Runner::start`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`Runner::start`].
    pub async fn start_with(
        env: &RunnerEnv,
        storages: Option<(Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>)>,
        register: impl FnOnce(&Sharding) -> Result<(), BoxError>,
    ) -> Result<Runner, RunnerError> {
        let address = env
            .sharding
            .runner_address
            .clone()
            .ok_or_else(|| ConfigError::new("HOST", "", "a runner needs an address"))?;
        let listen = env.sharding.runner_listen_address.clone().unwrap_or(address);
        let listen = resolve(&listen).await?;
        let server = RpcServer::bind(listen, env.rpc.clone()).await?;
        // Bound before joining: a port in use stops the start before the runner holds shards.
        #[cfg(feature = "ops")]
        let ops = match env.ops_listen {
            Some(address) => {
                Some(crate::ops::OpsListener::bind(address, env.ops_limits.clone()).await?)
            }
            None => None,
        };
        let (messages, locks) = match storages {
            Some(storages) => storages,
            None => env.open_storages().await?,
        };
        #[cfg(feature = "console")]
        let admin_storages = (Arc::clone(&messages), Arc::clone(&locks));
        let sharding = env.join_with(messages, locks).await?;
        if let Err(error) = register(&sharding) {
            // Leave the cluster cleanly instead of holding shards it cannot serve.
            sharding.shutdown().await;
            return Err(RunnerError::Register(error));
        }
        let server = server.serve(sharding.runner_handler());
        #[cfg(feature = "ops")]
        let ops = ops.map(|ops| {
            #[cfg(feature = "console")]
            let admin = env.admin_access.clone().map(|access| {
                let (messages, locks) = admin_storages;
                let admin = crate::admin::Admin::new(messages, locks, env.sharding.clone());
                (admin, access)
            });
            #[cfg(not(feature = "console"))]
            let admin = None;
            ops.serve(sharding.clone(), admin)
        });
        Ok(Runner {
            sharding,
            server,
            #[cfg(feature = "ops")]
            ops,
        })
    }

    /// Runs a runner process to its end, from the process environment, and returns its exit
    /// code: the whole `main` of a runner binary (`examples/runner.rs`).
    ///
    /// - Logs go to standard error, filtered by `RUST_LOG` (default `info`), as text or, with
    ///   `CLUSTER_LOG_FORMAT=json`, as JSON lines.
    /// - With the feature `otel` and `OTEL_EXPORTER_OTLP_ENDPOINT` set, spans are exported over
    ///   OTLP and requests carry their trace context to other runners (the `otel` module).
    /// - It starts as [`Runner::from_env`] does, then runs until SIGTERM or SIGINT, and shuts
    ///   down gracefully.
    /// - A failure is one line on standard error and exit code 2 for a configuration error, 1
    ///   otherwise ([`RunnerError::exit_code`]).
    #[cfg(feature = "ops")]
    pub async fn main(
        register: impl FnOnce(&Sharding) -> Result<(), BoxError>,
    ) -> std::process::ExitCode {
        let env = crate::ops::init_logging()
            .map_err(RunnerError::from)
            .and_then(|()| RunnerEnv::from_env(Role::Runner));
        Runner::main_with(env, register).await
    }

    /// Runs a runner process to its end on settings already read, as `Runner::main` does, and
    /// returns its exit code; it installs no logger.
    pub async fn main_with(
        env: Result<RunnerEnv, RunnerError>,
        register: impl FnOnce(&Sharding) -> Result<(), BoxError>,
    ) -> std::process::ExitCode {
        let run = async {
            let runner = Runner::start(&env?, register).await?;
            log_started(runner.sharding.config().runner_address.as_ref(), runner.listen_address());
            let stopped = terminated().await;
            runner.shutdown().await;
            stopped
        };
        let ran = run.await;
        #[cfg(feature = "otel")]
        crate::otel::shutdown().await;
        match ran {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(error) => {
                report_failure(&error);
                std::process::ExitCode::from(error.exit_code())
            }
        }
    }

    /// The address the transport's listener is bound to: the listen address (`LISTEN_HOST`,
    /// `LISTEN_PORT`), or else the advertised one, with the port the system chose for port 0.
    pub fn listen_address(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// Where the operations server listens, when `CLUSTER_OPS_LISTEN` is set (feature `ops`).
    #[cfg(feature = "ops")]
    pub fn ops_address(&self) -> Option<SocketAddr> {
        self.ops.as_ref().map(crate::ops::OpsServer::local_addr)
    }

    /// Shuts down gracefully: the shards go to the other runners, then the listener stops.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a shutdown dropped half-way leaves shards to expire.
    pub async fn shutdown(self) {
        // `/readyz` answers 503 ("shutting down") during the handoff.
        self.sharding.shutdown().await;
        self.server.shutdown().await;
        #[cfg(feature = "ops")]
        if let Some(ops) = self.ops {
            ops.shutdown().await;
        }
    }
}

/// Logs that a runner started, advertised at `address` and listening on `listen`, both as text
/// (`127.0.0.1:5000`): JSON logs show a field's text, and a `Debug` form would be
/// `Some(RunnerAddress(127.0.0.1:5000))`.
pub(crate) fn log_started(address: Option<&RunnerAddress>, listen: SocketAddr) {
    match address {
        Some(address) => tracing::info!(%address, %listen, "runner started"),
        None => tracing::info!(%listen, "runner started"),
    }
}

/// Says why a runner process stops, in one line on standard error (a logger may not be
/// installed).
#[expect(clippy::print_stderr, reason = "a failed process says why on standard error")]
fn report_failure(error: &RunnerError) {
    let line = error.to_string().replace('\n', " ");
    eprintln!("error: {line}");
}

async fn resolve(address: &RunnerAddress) -> Result<SocketAddr, RunnerError> {
    let target = (address.host(), address.port());
    let unresolved = |source| RunnerError::Resolve { address: address.clone(), source };
    let mut found =
        tokio::net::lookup_host(target).await.map_err(|error| unresolved(Some(error)))?;
    found.next().ok_or_else(|| unresolved(None))
}

/// Waits for SIGTERM or SIGINT (Ctrl-C).
///
/// It installs its signal handlers when it is first polled.
///
/// # Errors
///
/// The signal handlers could not be installed.
///
/// # Cancel safety
///
/// Cancel safe.
pub async fn terminated() -> Result<(), RunnerError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(RunnerError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(RunnerError::Signals)?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Role, RunnerEnv, RunnerError};

    fn env(variables: &[(&str, &str)]) -> Result<RunnerEnv, RunnerError> {
        let variables: Vec<(String, String)> = variables
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect();
        RunnerEnv::from_lookup(Role::Runner, move |name| {
            variables.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone())
        })
    }

    #[test]
    fn a_bad_table_prefix_is_reported_by_its_variable() {
        let found = env(&[
            ("CLUSTER_STORAGE_URL", "sqlite:/tmp/unused.db"),
            ("CLUSTER_TABLE_PREFIX", "bad-prefix"),
        ]);
        let Err(RunnerError::Config(error)) = found else {
            panic!("a prefix with a dash is a configuration error");
        };
        assert_eq!((error.key(), error.value()), ("CLUSTER_TABLE_PREFIX", "bad-prefix"));
        assert!(error.to_string().contains("CLUSTER_TABLE_PREFIX"), "{error}");
    }

    #[test]
    fn the_value_limit_comes_from_its_variable() {
        let unset = env(&[("CLUSTER_STORAGE_URL", "sqlite:/tmp/unused.db")]);
        let Ok(unset) = unset else { panic!("the settings load without the variable") };
        assert_eq!(unset.storage_options().value_bytes_max.get(), 16 * 1024 * 1024);
        let set = env(&[
            ("CLUSTER_STORAGE_URL", "sqlite:/tmp/unused.db"),
            ("CLUSTER_STORAGE_VALUE_BYTES_MAX", "1048576"),
        ]);
        let Ok(set) = set else { panic!("a number of bytes loads") };
        assert_eq!(set.storage_options().value_bytes_max.get(), 1_048_576);
        for bad in ["16MiB", "-1", "0", "1073741825"] {
            let error = refused(&[("CLUSTER_STORAGE_VALUE_BYTES_MAX", bad)]);
            assert_eq!((error.key(), error.value()), ("CLUSTER_STORAGE_VALUE_BYTES_MAX", bad));
            assert!(error.to_string().contains("CLUSTER_STORAGE_VALUE_BYTES_MAX"), "{error}");
        }
    }

    #[test]
    fn a_shown_url_has_its_password_masked() {
        use super::masked_url;
        let cases = [
            ("postgres://app:Hunter2@db:5432/app", "postgres://app:***@db:5432/app"),
            (
                "mysql://app:p%40ss@db/app?ssl-mode=required",
                "mysql://app:***@db/app?ssl-mode=required",
            ),
            ("mariadb://app:Hunter2@db:3306/app", "mariadb://app:***@db:3306/app"),
            // Unescaped `@` and `/` in the password: masked up to the last `@`.
            ("postgres://app:a@b/c@db/app", "postgres://app:***@db/app"),
            (
                "postgres://app@db/app?password=Hunter2&sslmode=require",
                "postgres://app@db/app?password=***&sslmode=require",
            ),
            ("postgres://db/app?PassWord=Hunter2", "postgres://db/app?PassWord=***"),
            ("mariadb:app:Hunter2@db", "mariadb:app:***@db"),
            ("sqlite:/tmp/cluster.db", "sqlite:/tmp/cluster.db"),
            ("redis://localhost", "redis://localhost"),
            ("", ""),
        ];
        for (url, shown) in cases {
            assert_eq!(masked_url(url), shown, "{url}");
        }
    }

    #[tokio::test]
    async fn a_storage_url_with_a_password_is_shown_masked() {
        let url = "mariadb://app:Hunter2Secret@db.example:3306/app";
        let Ok(found) = env(&[("CLUSTER_STORAGE_URL", url)]) else {
            panic!("the settings load; the scheme is checked when the storage opens");
        };
        let shown = format!("{found:?} {found:#?}");
        assert!(!shown.contains("Hunter2Secret"), "{shown}");
        assert!(shown.contains("mariadb://app:***@db.example:3306/app"), "{shown}");
        let Err(error) = found.open_storages().await else { panic!("an unknown scheme") };
        let shown = format!("{error} {error:?}");
        assert!(!shown.contains("Hunter2Secret"), "{shown}");
        assert!(shown.contains("CLUSTER_STORAGE_URL"), "{shown}");
    }

    #[test]
    fn a_missing_storage_url_is_reported_by_its_variable() {
        let Err(RunnerError::Config(error)) = env(&[]) else {
            panic!("the storage URL is required");
        };
        assert_eq!(error.key(), "CLUSTER_STORAGE_URL");
    }

    #[test]
    fn a_client_has_no_runner_address() {
        let found = RunnerEnv::from_lookup(Role::Client, |name| {
            (name == "CLUSTER_STORAGE_URL").then(|| "sqlite:/tmp/unused.db".to_owned())
        });
        let Ok(found) = found else { panic!("a client's settings load") };
        assert_eq!(found.sharding.runner_address, None);
        assert_eq!(found.sharding.runner_listen_address, None);
    }

    #[test]
    fn an_error_says_its_cause_in_one_line() {
        let error =
            RunnerError::Start(cluster_sharding::StartError::ShardsHeld { held: 2, total: 8 });
        assert_eq!(error.to_string(), "start: 2 of 8 shards are locked by another runner");
    }

    #[tokio::test]
    async fn an_unknown_storage_scheme_is_a_configuration_error() {
        let Ok(found) = env(&[("CLUSTER_STORAGE_URL", "redis://localhost")]) else {
            panic!("the settings load; the scheme is checked when the storage opens");
        };
        let Err(RunnerError::Config(error)) = found.open_storages().await else {
            panic!("an unknown scheme is a configuration error");
        };
        assert_eq!((error.key(), error.value()), ("CLUSTER_STORAGE_URL", "redis://localhost"));
    }

    /// The configuration error of the runner settings `variables` (on an unused SQLite file).
    fn refused(variables: &[(&str, &str)]) -> cluster_core::ConfigError {
        let mut all = vec![("CLUSTER_STORAGE_URL", "sqlite:/tmp/unused.db")];
        all.extend_from_slice(variables);
        match env(&all) {
            Err(RunnerError::Config(error)) => error,
            Err(error) => panic!("not a configuration error: {error}"),
            Ok(found) => panic!("accepted: {:?}", found.runner_health),
        }
    }

    /// The runner-health variables of a pod: the API server's service and `extra`.
    #[cfg(feature = "kubernetes")]
    fn in_pod<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let mut variables = vec![
            ("CLUSTER_STORAGE_URL", "sqlite:/tmp/unused.db"),
            ("CLUSTER_RUNNER_HEALTH", "kubernetes"),
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
        ];
        for (name, value) in extra {
            variables.retain(|(known, _)| known != name);
            variables.push((name, value));
        }
        variables
    }

    #[test]
    fn the_runner_health_is_the_transports_unless_a_variable_says_otherwise() {
        use super::RunnerHealthSource;
        for variables in [&[][..], &[("CLUSTER_RUNNER_HEALTH", "transport")][..]] {
            let mut all = vec![("CLUSTER_STORAGE_URL", "sqlite:/tmp/unused.db")];
            all.extend_from_slice(variables);
            let Ok(found) = env(&all) else { panic!("{variables:?} load") };
            assert_eq!(found.runner_health, RunnerHealthSource::Transport);
        }
        let error = refused(&[("CLUSTER_RUNNER_HEALTH", "k8s")]);
        assert_eq!((error.key(), error.value()), ("CLUSTER_RUNNER_HEALTH", "k8s"));
        // A namespace or selector without `kubernetes` would be silently unused.
        let error = refused(&[("CLUSTER_KUBERNETES_NAMESPACE", "runners")]);
        assert_eq!(error.key(), "CLUSTER_KUBERNETES_NAMESPACE");
        let error = refused(&[("CLUSTER_KUBERNETES_LABEL_SELECTOR", "app=runner")]);
        assert_eq!(error.key(), "CLUSTER_KUBERNETES_LABEL_SELECTOR");
        // A client judges no runner, and reads none of them.
        let client = RunnerEnv::from_lookup(Role::Client, |name| match name {
            "CLUSTER_STORAGE_URL" => Some("sqlite:/tmp/unused.db".to_owned()),
            "CLUSTER_RUNNER_HEALTH" => Some("kubernetes".to_owned()),
            _ => None,
        });
        let Ok(client) = client else { panic!("a client's settings load") };
        assert_eq!(client.runner_health, RunnerHealthSource::Transport);
    }

    #[cfg(not(feature = "kubernetes"))]
    #[test]
    fn kubernetes_runner_health_without_the_feature_is_a_configuration_error() {
        let error = refused(&[("CLUSTER_RUNNER_HEALTH", "kubernetes")]);
        assert_eq!(error.key(), "CLUSTER_RUNNER_HEALTH");
        assert!(error.reason().contains("feature `kubernetes`"), "{error}");
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn kubernetes_runner_health_reads_the_pods_service_and_its_variables() {
        use super::RunnerHealthSource;
        let selector = ("CLUSTER_KUBERNETES_LABEL_SELECTOR", "app=cluster-runner");
        let Ok(found) = env(&in_pod(&[("CLUSTER_KUBERNETES_NAMESPACE", "runners"), selector]))
        else {
            panic!("the settings of a pod load");
        };
        let expected = RunnerHealthSource::Kubernetes {
            api_url: "https://10.96.0.1:443".to_owned(),
            service_account_dir: "/var/run/secrets/kubernetes.io/serviceaccount".into(),
            namespace: Some("runners".to_owned()),
            label_selector: Some("app=cluster-runner".to_owned()),
        };
        assert_eq!(found.runner_health, expected);
        let Ok(found) = env(&in_pod(&[])) else { panic!("the defaults load") };
        let RunnerHealthSource::Kubernetes { namespace, label_selector, .. } = found.runner_health
        else {
            panic!("kubernetes");
        };
        assert_eq!((namespace, label_selector), (None, None));
        let refused_by = |variables: &[(&str, &str)]| match env(&in_pod(variables)) {
            Err(RunnerError::Config(error)) => error.key().to_owned(),
            Err(error) => panic!("not a configuration error: {error}"),
            Ok(found) => panic!("accepted: {:?}", found.runner_health),
        };
        let bad_namespace = ("CLUSTER_KUBERNETES_NAMESPACE", "Runners");
        assert_eq!(refused_by(&[bad_namespace]), "CLUSTER_KUBERNETES_NAMESPACE");
        let bad_selector = ("CLUSTER_KUBERNETES_LABEL_SELECTOR", "app: runner");
        assert_eq!(refused_by(&[bad_selector]), "CLUSTER_KUBERNETES_LABEL_SELECTOR");
        assert_eq!(refused_by(&[("KUBERNETES_SERVICE_PORT", "")]), "KUBERNETES_SERVICE_PORT");
        assert_eq!(refused_by(&[("KUBERNETES_SERVICE_HOST", "")]), "KUBERNETES_SERVICE_HOST");
    }
}
