//! The connection pool of the PostgreSQL storages: the configuration of a URL ([`PgConfig`],
//! TLS included), building the pool with bounded waits, running one statement or the
//! migrations on a pooled connection, and closing a connection that is lost.

use std::fmt;
use std::time::Duration;

use cluster_core::error::{StorageError, StorageErrorKind};
use deadpool_postgres::{
    ClientWrapper, Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime,
};
use postgres_types::ToSql;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls, Row};

use super::classify::{driver_error, pool_error};
use super::queries::{self, MigrationTarget};
#[cfg(feature = "tls")]
use super::tls::MakeRustls;
use crate::tls::{TlsMode, TlsOptions};

/// How long a caller waits for a pooled connection before the operation fails with
/// [`StorageErrorKind::Timeout`].
pub const POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long opening a new connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The default number of pooled connections of
/// [`PgMessageStorage::connect`](super::PgMessageStorage::connect) and
/// [`PgRunnerStorage::connect`](super::PgRunnerStorage::connect).
pub const POOL_SIZE_DEFAULT: usize = 16;

/// Where and how the PostgreSQL storages connect: the driver's configuration, and the TLS that
/// the URL asks for, which the driver's configuration cannot hold (`verify-ca`,
/// `verify-full`, `sslrootcert`).
///
/// Made by [`parse_config`] from a URL, or by [`PgConfig::new`] from a driver configuration
/// built in code. Its `Debug` shows no password.
#[derive(Clone)]
pub struct PgConfig {
    driver: tokio_postgres::Config,
    tls: TlsOptions,
    connector: Connector,
}

/// What wraps a new connection.
#[derive(Clone)]
enum Connector {
    /// Plain TCP: `disable`, or `prefer` in a build without TLS.
    Plain,
    #[cfg(feature = "tls")]
    Rustls(MakeRustls),
}

impl PgConfig {
    /// `driver` with `tls`. Reads the CA file of `tls`, if any; the driver's `ssl_mode` is set
    /// from `tls.mode`.
    ///
    /// # Errors
    ///
    /// [`StorageErrorKind::InvalidInput`] when the CA file cannot be read or holds no usable
    /// certificate, or when the mode needs TLS and the crate was built without its feature
    /// `tls`.
    pub fn new(
        mut driver: tokio_postgres::Config,
        tls: TlsOptions,
    ) -> Result<PgConfig, StorageError> {
        crate::tls::check_compiled_in(tls.mode, &format!("TLS mode {:?}", tls.mode), "postgres")?;
        driver.ssl_mode(driver_ssl_mode(tls.mode));
        let connector = match tls.mode {
            TlsMode::Disable => Connector::Plain,
            #[cfg(feature = "tls")]
            _ => Connector::Rustls(MakeRustls::new(&tls)?),
            #[cfg(not(feature = "tls"))]
            _ => Connector::Plain,
        };
        Ok(PgConfig { driver, tls, connector })
    }

    /// The driver's configuration: host, port, user, database, timeouts.
    pub fn driver(&self) -> &tokio_postgres::Config {
        &self.driver
    }

    /// The driver's configuration, to change: session options, timeouts, the application
    /// name. Its `ssl_mode` is set from the TLS mode whenever a connection is made.
    pub fn driver_mut(&mut self) -> &mut tokio_postgres::Config {
        &mut self.driver
    }

    /// The TLS of the connections.
    pub fn tls(&self) -> &TlsOptions {
        &self.tls
    }

    /// The driver's configuration, with the `ssl_mode` of the TLS mode.
    fn into_driver(mut self) -> tokio_postgres::Config {
        self.driver.ssl_mode(driver_ssl_mode(self.tls.mode));
        self.driver
    }
}

/// The driver's own mode: it knows whether to ask for TLS, not what to check.
fn driver_ssl_mode(mode: TlsMode) -> tokio_postgres::config::SslMode {
    use tokio_postgres::config::SslMode;
    match mode {
        TlsMode::Disable => SslMode::Disable,
        TlsMode::Prefer => SslMode::Prefer,
        _ => SslMode::Require,
    }
}

impl fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The driver's `Debug` shows the password as `Redaction`.
        f.debug_struct("PgConfig")
            .field("driver", &self.driver)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// Parses a `postgres://` URL (or a `key=value` connection string), with its TLS parameters:
/// `sslmode` (`disable`, `allow`, `prefer`, the default, `require`, `verify-ca`,
/// `verify-full`) and `sslrootcert` (a PEM file of the trusted CAs, or `system`), as libpq
/// reads them. The CA file is read now.
///
/// # Errors
///
/// [`StorageErrorKind::InvalidInput`], with a message that never shows the URL (it may hold the
/// password).
pub fn parse_config(url: &str) -> Result<PgConfig, StorageError> {
    let (driver, tls) = super::tls::parse(url)?;
    PgConfig::new(driver, tls)
}

/// Opens one connection on `config`, outside any pool, and runs its connection task, which
/// ends when the returned handle is aborted or the connection closes.
pub(crate) async fn connect(
    config: &PgConfig,
) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
    fn run<T>(connection: T) -> JoinHandle<()>
    where
        T: std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static,
    {
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection ended");
            }
        })
    }
    let connector = config.connector.clone();
    let driver = config.clone().into_driver();
    match connector {
        Connector::Plain => {
            let (client, connection) = driver.connect(NoTls).await?;
            Ok((client, run(connection)))
        }
        #[cfg(feature = "tls")]
        Connector::Rustls(tls) => {
            let (client, connection) = driver.connect(tls).await?;
            Ok((client, run(connection)))
        }
    }
}

/// `error`, from opening a storage on `config` (its first connection and its migrations), with
/// the server it tried and what to check: the driver's error alone names neither.
///
/// The cause itself (the OS error, or the server's message) stays the source, which
/// `StorageError`'s text shows.
pub(crate) fn opening_error(config: &PgConfig, error: StorageError) -> StorageError {
    let target = target(&config.driver);
    let message = match cause(&error, config.tls.mode) {
        Cause::Tls(explanation) => format!("TLS to PostgreSQL at {target} failed: {explanation}"),
        Cause::Server(code) if code == "3D000" => format!(
            "PostgreSQL at {target} has no such database: create the database, or fix its name \
             in the URL"
        ),
        Cause::Server(code) if code.starts_with("28") => format!(
            "PostgreSQL at {target} refused the user: check the user and password in the URL, \
             and the server's pg_hba.conf"
        ),
        Cause::Server(_) => format!("PostgreSQL at {target} refused: see the server's message"),
        Cause::Network => format!(
            "cannot reach PostgreSQL at {target}: check that PostgreSQL runs there and accepts \
             connections from this host, and the host and port in the URL"
        ),
        Cause::Other if error.kind() == StorageErrorKind::Timeout => format!(
            "PostgreSQL at {target} did not answer in time: check the host, the port and the \
             network"
        ),
        Cause::Other => format!("cannot open the PostgreSQL storage at {target}"),
    };
    StorageError::with_source(error.kind(), message, error)
}

/// What a failure to open a storage comes from.
enum Cause {
    /// TLS failed, for the reason and with the fix given.
    Tls(String),
    /// The server answered with this SQLSTATE.
    Server(String),
    /// The connection could not be made or was lost.
    Network,
    /// Anything else.
    Other,
}

/// The tokio-postgres message of a server that answered "no" to TLS; the driver's error has no
/// kind to match instead.
const NO_TLS_ON_SERVER: &str = "server does not support TLS";

fn cause(error: &StorageError, mode: TlsMode) -> Cause {
    #[cfg(feature = "tls")]
    {
        let parameters = crate::tls::TlsParameters {
            ca: "sslrootcert",
            encrypt_only: "sslmode=require without sslrootcert",
            name_advice: "connect with a host name that the certificate holds (with `hostaddr` \
                          for the address, if the name does not resolve to it), or use \
                          sslmode=verify-ca to check the CA only",
        };
        if let Some(explanation) = crate::tls::explain(error, &parameters) {
            return Cause::Tls(explanation);
        }
    }
    let mut source = std::error::Error::source(error);
    let mut network = false;
    while let Some(cause) = source {
        if let Some(db_error) = cause.downcast_ref::<tokio_postgres::error::DbError>() {
            return Cause::Server(db_error.code().code().to_owned());
        }
        if mode.requires_tls() && cause.to_string().contains(NO_TLS_ON_SERVER) {
            return Cause::Tls(
                "the server does not offer TLS, and the URL's sslmode requires it: turn `ssl` on \
                 in the server's postgresql.conf, or use sslmode=prefer to fall back to \
                 plaintext"
                    .to_owned(),
            );
        }
        network |= cause.is::<std::io::Error>();
        source = cause.source();
    }
    if network { Cause::Network } else { Cause::Other }
}

/// Where `config` connects, without its password: `host:port, database "…", user "…"`.
fn target(config: &tokio_postgres::Config) -> String {
    use tokio_postgres::config::Host;
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(idx, host)| {
            // One port for every host, or one per host; 5432 when the URL gives none.
            let port = ports.get(idx).or(ports.first()).copied().unwrap_or(5432);
            match host {
                Host::Tcp(name) => format!("{name}:{port}"),
                Host::Unix(path) => format!("{}/.s.PGSQL.{port}", path.display()),
            }
        })
        .collect();
    let hosts = if hosts.is_empty() { "localhost:5432".to_owned() } else { hosts.join(", ") };
    let user = config.get_user().unwrap_or("(none)");
    let database = config.get_dbname().unwrap_or(user);
    format!("{hosts} (database \"{database}\", user \"{user}\")")
}

/// A pool of at most `size_max` connections to `config`, with bounded waits: a caller waits at
/// most [`POOL_WAIT_TIMEOUT`] for a connection and a new connection is opened within
/// [`CONNECT_TIMEOUT`]. A connection whose socket closed is discarded when it is next checked
/// out.
///
/// Connections use the TLS of `config` (see [`parse_config`]).
pub fn pool(config: PgConfig, size_max: usize) -> Result<Pool, StorageError> {
    let manager_config = ManagerConfig { recycling_method: RecyclingMethod::Fast };
    let connector = config.connector.clone();
    let driver = config.into_driver();
    let manager = match connector {
        Connector::Plain => Manager::from_config(driver, NoTls, manager_config),
        #[cfg(feature = "tls")]
        Connector::Rustls(tls) => Manager::from_config(driver, tls, manager_config),
    };
    Pool::builder(manager)
        .max_size(size_max.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(POOL_WAIT_TIMEOUT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .recycle_timeout(Some(CONNECT_TIMEOUT))
        .build()
        .map_err(|error| {
            StorageError::with_source(StorageErrorKind::Other, "cannot build the pool", error)
        })
}

/// Runs `sql` on a connection from `pool` and returns its rows.
pub(crate) async fn pooled_query(
    pool: &Pool,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, StorageError> {
    let client = pool.get().await.map_err(|error| pool_error(what, error))?;
    let result = query(&client, what, sql, params).await;
    settle(client, result.as_ref().err());
    result
}

/// A connection of its own for statements that PostgreSQL should plan once, not at every call.
///
/// For a statement whose custom plans cost more to make than to run (an `= ANY($1)` over a
/// batch's ids, with a subquery for each row): PostgreSQL keeps planning it anew, because each
/// custom plan looks cheaper than the generic one. This connection is taken out of the pool
/// (it never goes back to it) and set to `plan_cache_mode = force_generic_plan` once, so the
/// pool's other statements keep their usual plans.
///
/// One batch writer uses it, one statement at a time. A connection that fails is closed, and
/// the next statement takes a new one from the pool.
pub(crate) struct GenericPlans {
    pool: Pool,
    client: tokio::sync::Mutex<Option<ClientWrapper>>,
}

impl GenericPlans {
    /// Statements on a connection that will be taken from `pool` when first needed.
    pub(crate) fn new(pool: Pool) -> GenericPlans {
        GenericPlans { pool, client: tokio::sync::Mutex::new(None) }
    }

    /// Runs `sql` and returns its rows.
    pub(crate) async fn query(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StorageError> {
        let mut slot = self.client.lock().await;
        let client = match slot.take() {
            Some(client) => client,
            None => {
                let pooled = self.pool.get().await.map_err(|error| pool_error(what, error))?;
                let client = Object::take(pooled);
                client
                    .batch_execute("SET plan_cache_mode = force_generic_plan")
                    .await
                    .map_err(|error| driver_error(what, error))?;
                client
            }
        };
        let result = query(&client, what, sql, params).await;
        let lost =
            result.as_ref().is_err_and(|error| error.kind() == StorageErrorKind::Unavailable);
        if !lost {
            *slot = Some(client);
        }
        result
    }
}

/// Runs `sql` on a connection from `pool` and returns the number of rows it changed.
pub(crate) async fn pooled_execute(
    pool: &Pool,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, StorageError> {
    let client = pool.get().await.map_err(|error| pool_error(what, error))?;
    let result = execute(&client, what, sql, params).await;
    settle(client, result.as_ref().err());
    result
}

/// Runs the migrations of `target` on a pooled connection; a lost race with another migrator
/// creating the history table is retried once.
pub(crate) async fn migrate_on_pool(
    pool: &Pool,
    target: &MigrationTarget<'_>,
) -> Result<Vec<i32>, StorageError> {
    let mut attempt = 0;
    loop {
        let mut client = pool.get().await.map_err(|error| pool_error("migrate", error))?;
        let result = queries::migrate(&mut client, target).await;
        settle(client, result.as_ref().err());
        match result {
            Err(error) if error.kind() == StorageErrorKind::Conflict && attempt == 0 => {
                attempt += 1;
                tracing::debug!(%error, "migration raced another migrator; retrying");
            }
            result => return result,
        }
    }
}

/// Gives a connection back to the pool, unless `error` says it is lost: then it is closed and
/// the pool opens a new one when needed.
pub(crate) fn settle(client: Object, error: Option<&StorageError>) {
    if error.is_some_and(|error| error.kind() == StorageErrorKind::Unavailable) {
        drop(Object::take(client));
    }
}

/// Runs the statement `sql` on `client` (prepared once per connection) and returns its rows.
pub(super) async fn query(
    client: &ClientWrapper,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, StorageError> {
    let statement = client.prepare_cached(sql).await.map_err(|error| driver_error(what, error))?;
    client.query(&statement, params).await.map_err(|error| driver_error(what, error))
}

pub(super) async fn execute(
    client: &ClientWrapper,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, StorageError> {
    let statement = client.prepare_cached(sql).await.map_err(|error| driver_error(what, error))?;
    client.execute(&statement, params).await.map_err(|error| driver_error(what, error))
}
