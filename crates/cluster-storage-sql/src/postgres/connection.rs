//! The connection pool of the PostgreSQL storages: building it with bounded waits, running one
//! statement or the migrations on a pooled connection, and closing a connection that is lost.

use std::time::Duration;

use cluster_core::error::{StorageError, StorageErrorKind};
use deadpool_postgres::{
    ClientWrapper, Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime,
};
use postgres_types::ToSql;
use tokio_postgres::{NoTls, Row};

use super::classify::{driver_error, pool_error};
use super::queries::{self, MigrationTarget};

/// How long a caller waits for a pooled connection before the operation fails with
/// [`StorageErrorKind::Timeout`].
pub const POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long opening a new connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The default number of pooled connections of
/// [`PgMessageStorage::connect`](super::PgMessageStorage::connect) and
/// [`PgRunnerStorage::connect`](super::PgRunnerStorage::connect).
pub const POOL_SIZE_DEFAULT: usize = 16;

/// Parses a `postgres://` URL (or a `key=value` connection string).
pub fn parse_config(url: &str) -> Result<tokio_postgres::Config, StorageError> {
    url.parse::<tokio_postgres::Config>().map_err(|error| {
        StorageError::with_source(StorageErrorKind::InvalidInput, "invalid PostgreSQL URL", error)
    })
}

/// `error`, from opening a storage on `config` (its first connection and its migrations), with
/// the server it tried and what to check: the driver's error alone names neither.
///
/// The cause itself (the OS error, or the server's message) stays the source, which
/// `StorageError`'s text shows.
pub(crate) fn opening_error(config: &tokio_postgres::Config, error: StorageError) -> StorageError {
    let target = target(config);
    let message = match cause(&error) {
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
    /// The server answered with this SQLSTATE.
    Server(String),
    /// The connection could not be made or was lost.
    Network,
    /// Anything else.
    Other,
}

fn cause(error: &StorageError) -> Cause {
    let mut source = std::error::Error::source(error);
    let mut network = false;
    while let Some(cause) = source {
        if let Some(db_error) = cause.downcast_ref::<tokio_postgres::error::DbError>() {
            return Cause::Server(db_error.code().code().to_owned());
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
pub fn pool(config: tokio_postgres::Config, size_max: usize) -> Result<Pool, StorageError> {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig { recycling_method: RecyclingMethod::Fast },
    );
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
async fn query(
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
