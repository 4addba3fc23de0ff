//! The connection options of a URL (TLS included) and the connection pool of the MySQL
//! storages, and [`ClosingConn`]: a connection closed rather than reused after a failure,
//! without waiting for an unresponsive server.

use std::future::Future;
use std::task::{Context, Waker};
use std::time::Duration;

use cluster_core::error::{StorageError, StorageErrorKind};
use mysql_async::{Conn, DriverError, Opts, Pool};

use super::classify::storage_error;
use super::tls::Parsed;

/// The default number of pooled connections of [`pool`].
pub const POOL_SIZE_DEFAULT: usize = 16;

/// How long the connection that finds out whether the server offers TLS (`ssl-mode=PREFERRED`)
/// may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The connection options of the `mysql://` URL `url`, with its TLS parameters applied:
/// `ssl-mode` (`DISABLED`, `PREFERRED`, the default, `REQUIRED`, `VERIFY_CA`,
/// `VERIFY_IDENTITY`) and `ssl-ca` (a PEM file of the trusted CAs), as the `mysql` client
/// reads them.
///
/// With `PREFERRED` and a build with TLS (feature `tls`), one connection, closed at once,
/// finds out whether the server offers TLS; the options use it if it does.
///
/// # Errors
///
/// [`StorageErrorKind::InvalidInput`] for a URL that cannot be read, an unreadable CA file, or
/// a mode that needs TLS in a build without it; with `PREFERRED`, the failure of that
/// connection (an unreachable server, a refused user). Messages never show the URL.
///
/// # Cancel safety
///
/// Cancel safe: the connection of `PREFERRED` is closed when dropped.
pub async fn opts(url: &str) -> Result<Opts, StorageError> {
    match super::tls::parse(url)? {
        Parsed::Ready(opts) => Ok(opts),
        Parsed::Preferred { tls, plain } => preferred(*tls, *plain).await,
    }
}

/// `tls` if the server takes a TLS connection, `plain` if it offers no TLS or its handshake
/// fails (as the `mysql` client's `PREFERRED` falls back).
async fn preferred(tls: Opts, plain: Opts) -> Result<Opts, StorageError> {
    let attempt = tokio::time::timeout(CONNECT_TIMEOUT, Conn::new(tls.clone())).await;
    match attempt {
        Ok(Ok(conn)) => {
            close_now(conn);
            Ok(tls)
        }
        Ok(Err(mysql_async::Error::Driver(DriverError::NoClientSslFlagFromServer))) => {
            tracing::debug!("the MySQL server offers no TLS; connecting in plaintext");
            Ok(plain)
        }
        #[cfg(feature = "tls")]
        Ok(Err(error)) if is_tls_failure(&error) => {
            tracing::warn!(
                %error,
                "TLS with the MySQL server failed; connecting in plaintext, as ssl-mode=PREFERRED \
                 allows (ssl-mode=REQUIRED refuses instead)"
            );
            Ok(plain)
        }
        Ok(Err(error)) => Err(storage_error("connect", error)),
        Err(_elapsed) => Err(StorageError::new(
            StorageErrorKind::Timeout,
            format!("connect: no answer within {CONNECT_TIMEOUT:?}"),
        )),
    }
}

#[cfg(feature = "tls")]
fn is_tls_failure(error: &mysql_async::Error) -> bool {
    let parameters = tls_parameters();
    crate::tls::explain(error, &parameters).is_some()
}

#[cfg(feature = "tls")]
fn tls_parameters() -> crate::tls::TlsParameters {
    crate::tls::TlsParameters {
        ca: "ssl-ca",
        encrypt_only: "ssl-mode=REQUIRED",
        name_advice: "connect with a host name that the certificate holds (mysql_async checks \
                      the name under VERIFY_CA too), or use ssl-mode=REQUIRED to encrypt \
                      without checking the certificate",
    }
}

/// `error`, from opening a storage on the `mysql://` URL `url` (its first connection and its
/// migrations), with the server it tried and what to check: the driver's error alone names
/// neither.
///
/// The cause itself (the OS error, or the server's message) stays the source, which
/// `StorageError`'s text shows.
pub(crate) fn opening_error(url: &str, error: StorageError) -> StorageError {
    let driver_url = super::tls::driver_url(url);
    let Ok(opts) = driver_url.as_deref().map(mysql_async::Opts::from_url) else { return error };
    let Ok(opts) = opts else { return error };
    let target = format!(
        "{}:{} (database \"{}\", user \"{}\")",
        opts.ip_or_hostname(),
        opts.tcp_port(),
        opts.db_name().unwrap_or("(none)"),
        opts.user().unwrap_or("(none)"),
    );
    #[cfg(feature = "tls")]
    if let Some(explanation) = crate::tls::explain(&error, &tls_parameters()) {
        let message = format!("TLS to MySQL at {target} failed: {explanation}");
        return StorageError::with_source(error.kind(), message, error);
    }
    if no_tls_on_server(&error) {
        let message = format!(
            "MySQL at {target} does not offer TLS, and the URL's ssl-mode requires it: give the \
             server a certificate (ssl_cert, ssl_key), or use ssl-mode=PREFERRED to fall back \
             to plaintext"
        );
        return StorageError::with_source(error.kind(), message, error);
    }
    let message = match server_code(&error) {
        // ER_BAD_DB_ERROR
        Some(1049) => format!(
            "MySQL at {target} has no such database: create the database, or fix its name in \
             the URL"
        ),
        // ER_ACCESS_DENIED_ERROR, ER_DBACCESS_DENIED_ERROR
        Some(1044 | 1045) => format!(
            "MySQL at {target} refused the user: check the user and password in the URL, and \
             the user's grants"
        ),
        Some(_) => format!("MySQL at {target} refused: see the server's message"),
        None if error.kind() == StorageErrorKind::Unavailable => format!(
            "cannot reach MySQL at {target}: check that MySQL runs there and accepts \
             connections from this host, and the host and port in the URL"
        ),
        None if error.kind() == StorageErrorKind::Timeout => format!(
            "MySQL at {target} did not answer in time: check the host, the port and the network"
        ),
        None => format!("cannot open the MySQL storage at {target}"),
    };
    StorageError::with_source(error.kind(), message, error)
}

/// Whether the server answered a TLS connection without offering TLS.
fn no_tls_on_server(error: &StorageError) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(mysql_async::Error::Driver(DriverError::NoClientSslFlagFromServer)) =
            cause.downcast_ref::<mysql_async::Error>()
        {
            return true;
        }
        source = cause.source();
    }
    false
}

/// The server's error code, when the server refused.
fn server_code(error: &StorageError) -> Option<u16> {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(mysql_async::Error::Server(server)) = cause.downcast_ref::<mysql_async::Error>()
        {
            return Some(server.code);
        }
        source = cause.source();
    }
    None
}

/// A pool of at most `size_max` connections to the `mysql://` URL `url`, with its TLS (see
/// [`opts`]), set up as the storages want it: idle connections are kept for a minute (a
/// `mysql_async` pool with no inactive TTL closes every connection it gets back) and are not
/// reset on checkout (a reset drops their prepared statements).
///
/// # Errors
///
/// As [`opts`].
///
/// # Cancel safety
///
/// As [`opts`].
pub async fn pool(url: &str, size_max: usize) -> Result<Pool, StorageError> {
    pool_on(opts(url).await?, size_max)
}

/// A pool of at most `size_max` connections with `opts`, set up as [`pool`] says.
pub(crate) fn pool_on(opts: Opts, size_max: usize) -> Result<Pool, StorageError> {
    let constraints = mysql_async::PoolConstraints::new(0, size_max.max(1)).ok_or_else(|| {
        StorageError::new(StorageErrorKind::InvalidInput, "invalid MySQL pool size")
    })?;
    let pool_opts = mysql_async::PoolOpts::default()
        .with_constraints(constraints)
        .with_inactive_connection_ttl(Duration::from_secs(60))
        .with_reset_connection(false);
    Ok(Pool::new(mysql_async::OptsBuilder::from_opts(opts).pool_opts(pool_opts)))
}

/// A connection that is closed, not returned to its pool, if it is dropped before
/// [`into_inner`](ClosingConn::into_inner): after a failure or a cancellation its session
/// state (named locks, a half-read result) must not be reused.
pub(crate) struct ClosingConn(Option<Conn>);

impl ClosingConn {
    pub(crate) fn new(conn: Conn) -> ClosingConn {
        ClosingConn(Some(conn))
    }

    pub(crate) fn get(&mut self) -> &mut Conn {
        // Present from `new` until `into_inner` consumes self or `drop` runs.
        self.0.as_mut().expect("a ClosingConn holds its connection until it is consumed")
    }

    /// The connection, now dropped normally (a pooled one returns to its pool).
    pub(crate) fn into_inner(mut self) -> Conn {
        self.0.take().expect("a ClosingConn holds its connection until it is consumed")
    }
}

impl Drop for ClosingConn {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            close_now(conn);
        }
    }
}

/// Closes `conn` without waiting for the server.
///
/// Dropping a `Conn` makes `mysql_async` spawn a task that first drains any pending result and
/// then says goodbye; with an unresponsive server that task can wait for minutes and keep the
/// session (and its named locks) alive. Instead, start `disconnect` and poll it once: it marks
/// the connection disconnected before its first await, so dropping it afterwards closes the
/// socket at once (a pooled connection is discarded by its pool, not reused).
fn close_now(conn: Conn) {
    if tokio::runtime::Handle::try_current().is_err() {
        // Outside a runtime the socket cannot be polled; the driver's drop closes it.
        drop(conn);
        return;
    }
    let mut disconnect = std::pin::pin!(conn.disconnect());
    let mut context = Context::from_waker(Waker::noop());
    // Ready or not, the outcome does not matter: the socket closes when the future drops.
    let _poll = disconnect.as_mut().poll(&mut context);
}
