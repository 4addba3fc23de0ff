//! The HTTP server under the gateway (`http::serve`) and the operations server: hyper's
//! HTTP/1 connections, with its timer, behind a connection limit.
//!
//! What one client cannot do to it:
//!
//! - keep a connection without sending a whole request head: hyper's header-read timeout
//!   ([`ServerLimits::header_read_timeout`]) closes it. The timer also runs while a kept-alive
//!   connection waits for its next request, so it is the idle timeout too.
//! - open connections until the process runs out of descriptors: at most
//!   [`ServerLimits::connections_max`] are open. At the limit, the connection that has waited
//!   longest without a request in progress is closed to make room for the new one (nginx reuses
//!   its waiting connections the same way when it runs out), and when every connection has a
//!   request in progress the new one is closed at once. A flood of idle connections therefore
//!   never keeps out a client that sends its request as soon as it connects (a probe, a
//!   scrape).
//! - send several requests at once on one connection: the server speaks HTTP/1 only, where a
//!   connection carries one request at a time (pipelined requests wait their turn), so at most
//!   `connections_max` requests run at once.
//! - send a request head larger than [`HEADER_BYTES_MAX`].
//!
//! Reading a request's body is the route's business: the gateway bounds its size and the time
//! it takes (`HttpOptions::max_body_bytes`, `HttpOptions::body_read_timeout`); the operations
//! server's routes read no body, and hyper closes a connection whose body was left unread.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The largest request head (request line and headers), in bytes; a larger one is refused
/// (431) and its connection closed. hyper's own default is about 400 KiB, which a thousand slow
/// connections would turn into 400 MiB.
pub const HEADER_BYTES_MAX: usize = 64 * 1024;

/// How long the accept loop waits after an error other than a connection's own (such as the
/// process being out of descriptors) before it accepts again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The limits of an HTTP server: the gateway's (`CLUSTER_HTTP_*`, [`ServerLimits::gateway`])
/// or the operations server's (`CLUSTER_OPS_*`, [`ServerLimits::ops`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerLimits {
    /// The most connections open at once; at the limit, the connection idle the longest is
    /// closed to make room, or the new one when none is idle. At least 1.
    pub connections_max: usize,
    /// How long a connection may take to send a whole request head, counted from when it opens
    /// or from the end of its previous answer: the header-read timeout and the keep-alive idle
    /// timeout in one (hyper runs one timer for both). At least 1 ms.
    pub header_read_timeout: Duration,
    /// How long a shutdown waits for the requests in progress before it closes their
    /// connections.
    pub shutdown_timeout: Duration,
}

impl ServerLimits {
    /// The gateway's defaults: 1,024 connections, 30 s to send a request head (hyper's
    /// default), 5 s for a shutdown.
    pub fn gateway() -> ServerLimits {
        ServerLimits {
            connections_max: 1024,
            header_read_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(5),
        }
    }

    /// The operations server's defaults: 64 connections (probes and scrapes need a few), 5 s
    /// to send a request head, 5 s for a shutdown.
    pub fn ops() -> ServerLimits {
        ServerLimits {
            connections_max: 64,
            header_read_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        }
    }

    /// The limits with the variables `<prefix>CONNECTIONS_MAX` and
    /// `<prefix>HEADER_READ_TIMEOUT` (read with `lookup`) in place of the defaults; unset or
    /// empty variables keep them.
    ///
    /// # Errors
    ///
    /// A variable is not a number of connections from 1 to 1,000,000, or not a duration from 1
    /// millisecond to 1 hour (`10 seconds`); the error names it.
    pub(crate) fn with_lookup(
        mut self,
        prefix: &str,
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> Result<ServerLimits, cluster_core::ConfigError> {
        let connections = format!("{prefix}CONNECTIONS_MAX");
        if let Some(value) = set(lookup, &connections) {
            self.connections_max = value
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|count| (1..=1_000_000).contains(count))
                .ok_or_else(|| {
                    cluster_core::ConfigError::new(
                        &connections,
                        &value,
                        "is not a number of connections from 1 to 1000000",
                    )
                })?;
        }
        let header = format!("{prefix}HEADER_READ_TIMEOUT");
        if let Some(value) = set(lookup, &header) {
            self.header_read_timeout = bounded_duration(&header, &value)?;
        }
        Ok(self)
    }
}

/// A variable's value, `None` when it is unset or empty.
pub(crate) fn set(lookup: &impl Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    lookup(name).filter(|value| !value.trim().is_empty())
}

/// A duration from 1 ms to 1 hour, in the reference's syntax (`10 seconds`).
pub(crate) fn bounded_duration(
    name: &str,
    value: &str,
) -> Result<Duration, cluster_core::ConfigError> {
    let duration = cluster_core::config::parse_duration(value.trim())
        .map_err(|error| cluster_core::ConfigError::new(name, value, error.to_string()))?;
    if duration < Duration::from_millis(1) || duration > Duration::from_secs(3600) {
        return Err(cluster_core::ConfigError::new(
            name,
            value,
            "must be from 1 millis to 1 hour, such as `10 seconds`",
        ));
    }
    Ok(duration)
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes; then it stops
/// accepting, lets the requests in progress finish within `limits.shutdown_timeout`, and closes
/// every connection. Every connection's task is owned here and ended before it returns.
///
/// It never fails: an accept error (such as the process being out of descriptors) is logged,
/// and accepting goes on after a short pause.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()> + Send,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(HEADER_BYTES_MAX)
        .keep_alive(true);
    let tracker = Arc::new(Tracker::new(limits.connections_max));
    let stopping = CancellationToken::new();
    let mut connections = JoinSet::new();
    let mut backoff = std::pin::pin!(tokio::time::sleep(Duration::ZERO));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next() => continue,
            accepted = async {
                backoff.as_mut().await;
                listener.accept().await
            } => accepted,
        };
        let accepted = match accepted {
            Ok((stream, _peer)) => stream,
            Err(error) => {
                if !is_connection_error(&error) {
                    tracing::warn!(%error, "an HTTP server cannot accept a connection; retrying");
                    backoff.as_mut().reset(tokio::time::Instant::now() + ACCEPT_BACKOFF);
                }
                continue;
            }
        };
        let Some(connection) = tracker.admit() else {
            // Every connection has a request in progress: this one is closed at once.
            drop(accepted);
            continue;
        };
        let _ = accepted.set_nodelay(true);
        let served = serve_connection(
            accepted,
            router.clone(),
            builder.clone(),
            connection,
            stopping.clone(),
        );
        connections.spawn(served);
    }
    drop(listener);
    stopping.cancel();
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.shutdown_timeout, drained).await.is_err() {
        tracing::debug!("HTTP requests outlived the shutdown; their connections are closed");
    }
    connections.shutdown().await;
}

/// Whether an accept error is the connection's own (it went away before it was accepted), as
/// opposed to the listener's or the process's (out of descriptors).
fn is_connection_error(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection until it ends, is evicted (closed at once: it had no request in
/// progress), or the server stops (hyper's graceful shutdown: the request in progress is
/// answered, then the connection closes).
async fn serve_connection(
    stream: TcpStream,
    router: Router,
    builder: hyper::server::conn::http1::Builder,
    admitted: Admitted,
    stopping: CancellationToken,
) {
    let connection = Arc::clone(&admitted.0);
    let evicted = connection.evict.clone();
    let service = Tracked { router: TowerToHyperService::new(router), connection };
    let served = builder.serve_connection(TokioIo::new(stream), service);
    let mut served = std::pin::pin!(served);
    tokio::select! {
        result = served.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%error, "HTTP connection ended");
            }
        }
        () = evicted.cancelled() => {}
        () = stopping.cancelled() => {
            // A connection without a request in progress (idle, or still sending its head) is
            // closed at once; the others answer their request first.
            if admitted.0.idle_since().is_none() {
                served.as_mut().graceful_shutdown();
                let _ = served.await;
            }
        }
    }
    drop(admitted);
}

/// The open connections, for the limit and the choice of the one to close.
struct Tracker {
    connections_max: usize,
    open: std::sync::Mutex<BTreeMap<u64, Arc<Connection>>>,
    /// The next connection's number.
    next_id: AtomicU64,
    /// Orders the moments connections became idle: the smallest is idle the longest.
    idle_clock: Arc<AtomicU64>,
    /// When the limit was last reported, so that a flood logs one warning, not one per
    /// connection.
    warned: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// How often reaching the connection limit is logged at most.
const LIMIT_WARNING_INTERVAL: Duration = Duration::from_secs(60);

impl Tracker {
    fn new(connections_max: usize) -> Tracker {
        Tracker {
            connections_max: connections_max.max(1),
            open: std::sync::Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(0),
            idle_clock: Arc::new(AtomicU64::new(0)),
            warned: std::sync::Mutex::new(None),
        }
    }

    /// Admits a new connection, closing the one idle the longest when the limit is reached;
    /// `None` when the limit is reached and every connection has a request in progress.
    fn admit(self: &Arc<Tracker>) -> Option<Admitted> {
        let mut open = lock(&self.open);
        if open.len() >= self.connections_max {
            self.warn_limit(open.len());
            let oldest_idle = open
                .iter()
                .filter_map(|(id, connection)| connection.idle_since().map(|since| (since, *id)))
                .min()
                .map(|(_, id)| id);
            let evicted = open.remove(&oldest_idle?)?;
            evicted.evict.cancel();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let connection = Arc::new(Connection {
            id,
            state: std::sync::Mutex::new(ConnectionState {
                in_progress: 0,
                idle_since: self.idle_clock.fetch_add(1, Ordering::Relaxed),
            }),
            idle_clock: Arc::clone(&self.idle_clock),
            evict: CancellationToken::new(),
        });
        open.insert(id, Arc::clone(&connection));
        Some(Admitted(connection, Arc::clone(self)))
    }

    fn warn_limit(&self, open: usize) {
        let now = tokio::time::Instant::now();
        let mut warned = lock(&self.warned);
        if warned.is_none_or(|last| now.duration_since(last) >= LIMIT_WARNING_INTERVAL) {
            *warned = Some(now);
            tracing::warn!(
                open,
                "an HTTP server reached its connection limit: idle connections are closed to make room, new ones refused while none is idle"
            );
        }
    }
}

/// An admitted connection; it leaves the tracker when dropped (its task ended).
struct Admitted(Arc<Connection>, Arc<Tracker>);

impl Drop for Admitted {
    fn drop(&mut self) {
        lock(&self.1.open).remove(&self.0.id);
    }
}

/// One open connection.
struct Connection {
    id: u64,
    state: std::sync::Mutex<ConnectionState>,
    idle_clock: Arc<AtomicU64>,
    /// Cancelled when the connection is closed to make room.
    evict: CancellationToken,
}

struct ConnectionState {
    /// Requests whose answer is not fully written yet (at most 1 on HTTP/1).
    in_progress: usize,
    /// When it last became idle, on the tracker's idle clock.
    idle_since: u64,
}

impl Connection {
    /// When the connection became idle, or `None` while a request is in progress.
    fn idle_since(&self) -> Option<u64> {
        let state = lock(&self.state);
        (state.in_progress == 0).then_some(state.idle_since)
    }

    /// Marks a request in progress until the returned guard is dropped.
    fn busy(self: &Arc<Connection>) -> Busy {
        lock(&self.state).in_progress += 1;
        Busy(Arc::clone(self))
    }
}

/// A request in progress on a connection: from its head to the end of its answer's body.
struct Busy(Arc<Connection>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = lock(&self.0.state);
        state.in_progress = state.in_progress.saturating_sub(1);
        if state.in_progress == 0 {
            state.idle_since = self.0.idle_clock.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The router, with each request marked in progress until its answer's body is written.
struct Tracked {
    router: TowerToHyperService<Router>,
    connection: Arc<Connection>,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Tracked {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        let busy = self.connection.busy();
        let answer = self.router.call(request);
        Box::pin(async move {
            let response = answer.await?;
            // The guard goes with the body: a streamed answer keeps its connection busy until
            // its last chunk is written (or the connection drops it).
            Ok(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _in_progress = &busy;
                    frame
                }))
            }))
        })
    }
}

#[cfg(test)]
mod tests;
