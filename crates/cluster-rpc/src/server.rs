//! The server side: [`RpcServer`] accepts connections and calls a [`RunnerHandler`].
//!
//! Task ownership: [`ServerHandle`] owns the accept loop, the accept loop owns one task per
//! connection, and each connection owns a reader, a writer and one task per call in flight.
//! Dropping an owner aborts what it owns, so nothing is detached: dropping the handle closes the
//! listener and every connection; aborting a call's task drops the handler's
//! [`ReplyStream`](cluster_core::transport::ReplyStream), which interrupts a volatile request.
//!
//! Connections are admitted in two stages, each with its own bound, so that peers that never
//! prove themselves cannot take the room of those that do:
//!
//! - **Shaking hands**: at most `max_handshakes` accepted connections run the handshake (TLS
//!   included) at once, each within `handshake_timeout`; a connection accepted beyond that bound,
//!   or while `max_connections` connections are established, is closed at once, unread.
//! - **Established**: a connection whose peer has proved itself takes one of `max_connections`
//!   slots (if the last one went meanwhile, the peer is told it is busy and the connection is
//!   closed), then frames are read and dispatched.
//!
//! Refusals at accept are logged as one warning per second at most, with their count.
//!
//! Per established connection: a `Cancel` frame, or the connection closing, aborts the call.
//! At most `max_in_flight` calls run at once, and beside them at most `max_pushed_in_flight` pushed
//! persisted requests (a `Request` frame marked persisted), which last as long as their
//! handlers run; a call beyond its lane's bound is answered `Overloaded` (the client reports
//! `RunnerUnavailable`), so reading never stalls and cancels are always seen.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cluster_core::envelope::{Envelope, Reply, Request};
use cluster_core::error::{ClusterError, DecodeError};
use cluster_core::transport::RunnerHandler;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use crate::codec;
use crate::config::RpcConfig;
use crate::conn;
use crate::error::RpcError;
use crate::frame::{Frame, WireError};
use crate::handshake;
use crate::tls::ServerTls;

/// The longest defect message sent back; longer ones are cut (on a character boundary).
const DEFECT_MESSAGE_MAX: usize = 4096;

/// A bound listener, not yet serving.
///
/// Binding comes first because the runtime needs the advertised address before it can build
/// the handler; [`RpcServer::serve`] then starts accepting.
#[derive(Debug)]
pub struct RpcServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    config: RpcConfig,
    tls: ServerTls,
}

/// A serving [`RpcServer`]. Dropping it stops the server abruptly; [`ServerHandle::shutdown`]
/// stops it and waits for its tasks.
#[derive(Debug)]
pub struct ServerHandle {
    local_addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    shutdown: CancellationToken,
    accept: JoinSet<()>,
}

impl RpcServer {
    /// Binds `listen` (port 0 picks a free port) after validating `config` (with TLS,
    /// `config.tls` needs a certificate and key).
    ///
    /// # Errors
    ///
    /// - `config` is invalid.
    /// - `listen` is not a loopback address and `config` neither authenticates peers nor sets
    ///   `insecure` ([`RpcConfig::check_exposure`]); with `insecure`, a warning is logged.
    /// - The socket cannot be bound.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future before it returns releases the socket.
    pub async fn bind(listen: SocketAddr, config: RpcConfig) -> Result<RpcServer, RpcError> {
        config.validate()?;
        config.check_exposure(listen)?;
        if config.accepts_anyone_on(listen) {
            warn!(%listen, "CLUSTER_RPC_INSECURE=true: the transport accepts any peer that reaches this address");
        }
        let tls = ServerTls::new(&config)?;
        let listener = TcpListener::bind(listen).await.map_err(RpcError::Bind)?;
        let local_addr = listener.local_addr().map_err(RpcError::Bind)?;
        Ok(RpcServer { listener, local_addr, config, tls })
    }

    /// The bound address (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Starts accepting connections, whose calls go to `handler`. Must be called within a
    /// tokio runtime.
    pub fn serve(self, handler: Arc<dyn RunnerHandler>) -> ServerHandle {
        let shutdown = CancellationToken::new();
        let mut accept = JoinSet::new();
        let local_addr = self.local_addr;
        let span = info_span!("rpc_server", %local_addr);
        let connections = Arc::new(AtomicUsize::new(0));
        let handshakes = usize::try_from(self.config.max_handshakes)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        let server = Server {
            config: Arc::new(self.config),
            handler,
            connections: Arc::clone(&connections),
            handshakes: Arc::new(Semaphore::new(handshakes)),
            tls: self.tls,
        };
        accept.spawn(accept_loop(self.listener, server, shutdown.clone()).instrument(span));
        ServerHandle { local_addr, connections, shutdown, accept }
    }
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// How many connections have passed the handshake and are open.
    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    /// Stops accepting, closes every connection (calls still running are cancelled, so their
    /// reply streams are dropped) and waits until all of the server's tasks have ended.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the handle, which aborts what is left.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        while self.accept.join_next().await.is_some() {}
    }
}

/// What every connection of a server shares.
#[derive(Clone)]
struct Server {
    config: Arc<RpcConfig>,
    handler: Arc<dyn RunnerHandler>,
    connections: Arc<AtomicUsize>,
    /// The slots of connections still shaking hands (`max_handshakes`).
    handshakes: Arc<Semaphore>,
    tls: ServerTls,
}

/// Counts an open connection while alive.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Takes an established connection's slot, if one of `max` is free.
fn admit(connections: &Arc<AtomicUsize>, max: usize) -> Option<Counted> {
    connections
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| (open < max).then_some(open + 1))
        .ok()
        .map(|_| Counted(Arc::clone(connections)))
}

/// Refusals at accept, logged as one warning per second at most, with their count: a flood of
/// connections must not become a flood of log lines.
struct Refusals {
    what: &'static str,
    since_logged: u64,
    logged_at: Option<Instant>,
}

impl Refusals {
    fn new(what: &'static str) -> Refusals {
        Refusals { what, since_logged: 0, logged_at: None }
    }

    fn note(&mut self, peer: SocketAddr) {
        self.since_logged += 1;
        let now = Instant::now();
        if self.logged_at.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1)) {
            warn!(%peer, refused = self.since_logged, "connection refused: {}", self.what);
            self.since_logged = 0;
            self.logged_at = Some(now);
        }
    }
}

async fn accept_loop(listener: TcpListener, server: Server, shutdown: CancellationToken) {
    let max_connections = usize::try_from(server.config.max_connections).unwrap_or(usize::MAX);
    let mut connections = JoinSet::new();
    let mut too_many = Refusals::new("too many connections (CLUSTER_RPC_MAX_CONNECTIONS)");
    let mut too_many_handshakes =
        Refusals::new("too many connections shaking hands (CLUSTER_RPC_MAX_HANDSHAKES)");
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Both refusals close the socket at once, unread: it takes no slot.
                    if server.connections.load(Ordering::Acquire) >= max_connections {
                        too_many.note(peer);
                        continue;
                    }
                    let Ok(handshake) = Arc::clone(&server.handshakes).try_acquire_owned() else {
                        too_many_handshakes.note(peer);
                        continue;
                    };
                    let task = serve_connection(
                        stream,
                        server.clone(),
                        handshake,
                        shutdown.child_token(),
                    );
                    connections.spawn(task.instrument(info_span!("rpc_connection", %peer)));
                }
                Err(error) => {
                    // Per-connection accept errors (the peer reset before accept, no file
                    // descriptors left): log, breathe and go on.
                    warn!(%error, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Serves one accepted connection: the handshake, holding `handshake` (a slot of
/// `max_handshakes`) until it ends, then the frames.
async fn serve_connection(
    tcp: TcpStream,
    server: Server,
    handshake: OwnedSemaphorePermit,
    shutdown: CancellationToken,
) {
    let Server { config, handler, connections, tls, .. } = server;
    let _ = tcp.set_nodelay(true);
    let max_connections = usize::try_from(config.max_connections).unwrap_or(usize::MAX);
    // TLS (when configured) first, then the handshake inside it, both within the timeout.
    let shake = async {
        // A connection that closes before its first byte is a runner's probe
        // (`Transport::probe`): logged at debug level, not as a failed handshake.
        let mut first = [0_u8; 1];
        if tcp.peek(&mut first).await.map_err(handshake::HandshakeError::Io)? == 0 {
            return Err(handshake::HandshakeError::ClosedEarly);
        }
        let mut stream = tls.accept(tcp).await.map_err(handshake::HandshakeError::Io)?;
        let admit = || admit(&connections, max_connections);
        handshake::server(&mut stream, config.secret_bytes(), admit)
            .await
            .map(|(counted, keys)| (stream, counted, keys))
    };
    let shaken = tokio::time::timeout(config.handshake_timeout, shake).await;
    drop(handshake);
    let (stream, _counted, keys) = match shaken {
        Ok(Ok(established)) => {
            debug!("connection accepted");
            established
        }
        Ok(Err(handshake::HandshakeError::ClosedEarly)) => {
            debug!("a connection closed before its handshake (a probe); nothing to serve");
            return;
        }
        Ok(Err(handshake::HandshakeError::Busy)) => {
            warn!("connection refused after its handshake: too many connections");
            return;
        }
        Ok(Err(error)) => {
            // The cause, never the secret: a peer with another secret is named as such.
            warn!(%error, "a peer failed the handshake; connection refused");
            return;
        }
        Err(_) => {
            warn!("handshake timed out; connection refused");
            return;
        }
    };
    let (read_half, write_half) = tokio::io::split(stream);
    let (frames_tx, frames_rx) = mpsc::channel(config.queue_capacity());
    let (out_tx, out_rx) = mpsc::channel(config.queue_capacity());
    let (read_mac, write_mac) = match keys {
        Some(keys) => (Some(keys.client_to_server), Some(keys.server_to_client)),
        None => (None, None),
    };
    let reader =
        conn::FrameReader::new(read_half, config.max_frame_bytes, config.frame_timeout, read_mac);
    let mut io_tasks = JoinSet::new();
    io_tasks.spawn(read_loop(reader, frames_tx).in_current_span());
    io_tasks.spawn(write_loop(write_half, out_rx, write_mac).in_current_span());
    let connection = Connection {
        config,
        handler,
        out: out_tx,
        calls: JoinSet::new(),
        ids: BTreeMap::new(),
        pushed: 0,
        by_call: BTreeMap::new(),
    };
    connection.dispatch(frames_rx, shutdown).await;
    debug!("connection closed");
}

/// A client's frame, decoded by the connection's reader into what the dispatcher acts on.
#[expect(
    clippy::large_enum_variant,
    reason = "calls are nearly every frame; boxing them would add an allocation to each"
)]
pub(crate) enum Inbound {
    /// `Ping`.
    Ping {
        /// The call id.
        call: u64,
    },
    /// `Cancel`.
    Cancel {
        /// The call id.
        call: u64,
    },
    /// A call to run (`Notify`, `Request` or `Envelope`).
    Call {
        /// The call id.
        call: u64,
        /// What to run.
        body: CallBody,
    },
    /// A server frame sent by a client: a protocol violation.
    FromServer,
}

/// What a call runs. A frame that decodes but not into domain values (a payload that is not
/// JSON, shard 0) fails its own call only, so the error is kept for the call to answer.
pub(crate) enum CallBody {
    /// `Notify`: the envelope, and whether it is stored.
    Notify(Result<Envelope, DecodeError>, bool),
    /// `Request`: the request, and whether it is stored.
    Request(Result<Request, DecodeError>, bool),
    /// `Envelope`: the envelope, and whether it is stored.
    Envelope(Result<Envelope, DecodeError>, bool),
}

/// `frame`, decoded into domain values with the connection's `names`.
fn inbound(names: &mut codec::Names, frame: Frame<'_>) -> Inbound {
    match frame {
        Frame::Ping { call } => Inbound::Ping { call },
        Frame::Cancel { call } => Inbound::Cancel { call },
        Frame::Notify { call, envelope, persisted } => Inbound::Call {
            call,
            body: CallBody::Notify(codec::envelope_in(names, envelope), persisted),
        },
        Frame::Request { call, request, persisted } => Inbound::Call {
            call,
            body: CallBody::Request(codec::request_in(names, request), persisted),
        },
        Frame::Envelope { call, envelope, persisted } => Inbound::Call {
            call,
            body: CallBody::Envelope(codec::envelope_in(names, envelope), persisted),
        },
        Frame::Done { .. } | Frame::Reply { .. } | Frame::Failed { .. } => Inbound::FromServer,
    }
}

/// Reads and decodes frames until the peer closes or sends something wrong.
///
/// The socket is read through a [`conn::FrameReader`]: one system call takes in every frame
/// that has arrived, and a frame's strings are copied once, into its domain values.
pub(crate) async fn read_loop<R: tokio::io::AsyncRead + Unpin>(
    mut reader: conn::FrameReader<R>,
    frames: mpsc::Sender<Inbound>,
) {
    let mut names = codec::Names::default();
    while let Some(frame) = reader.next_decoded().await {
        if frames.send(inbound(&mut names, frame)).await.is_err() {
            return;
        }
    }
}

/// Writes queued frames, sealed with `mac` when the connection has one, until the queue closes
/// or the socket fails.
pub(crate) async fn write_loop<W: tokio::io::AsyncWrite + Unpin>(
    mut writer: W,
    mut out: mpsc::Receiver<Vec<u8>>,
    mut mac: Option<conn::FrameMac>,
) {
    let mut buffer = Vec::new();
    while let Some(body) = out.recv().await {
        let written = conn::write_queued(&mut writer, body, &mut out, &mut buffer, &mut mac).await;
        if let Err(error) = written {
            debug!(%error, "write failed; closing the connection");
            return;
        }
    }
    let _ = tokio::io::AsyncWriteExt::shutdown(&mut writer).await;
}

/// One served connection's dispatcher state.
struct Connection {
    config: Arc<RpcConfig>,
    handler: Arc<dyn RunnerHandler>,
    out: mpsc::Sender<Vec<u8>>,
    calls: JoinSet<()>,
    /// The call of each running task, to answer a call whose task panicked, and whether it is a
    /// pushed persisted request.
    ids: BTreeMap<tokio::task::Id, (u64, bool)>,
    /// How many of the running calls are pushed persisted requests.
    pushed: usize,
    /// The task of each running call, to cancel it.
    by_call: BTreeMap<u64, AbortHandle>,
}

impl Connection {
    async fn dispatch(mut self, mut frames: mpsc::Receiver<Inbound>, shutdown: CancellationToken) {
        // One wait for the whole loop, not one registered and dropped per frame.
        let shutdown = shutdown.cancelled();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                Some(joined) = self.calls.join_next_with_id() => self.reap(joined).await,
                frame = frames.recv() => match frame {
                    Some(frame) => {
                        if let Err(error) = self.on_frame(frame).await {
                            warn!(%error, "protocol violation; closing the connection");
                            return;
                        }
                    }
                    None => return,
                },
            }
        }
    }

    async fn reap(&mut self, joined: Result<(tokio::task::Id, ()), tokio::task::JoinError>) {
        let id = match &joined {
            Ok((id, ())) => *id,
            Err(error) => error.id(),
        };
        let Some((call, pushed)) = self.ids.remove(&id) else { return };
        self.by_call.remove(&call);
        if pushed {
            self.pushed -= 1;
        }
        if let Err(error) = joined
            && error.is_panic()
        {
            warn!(call, "the handler panicked");
            let frame =
                Frame::Failed { call, error: WireError::Defect("the handler panicked".into()) };
            send(&self.out, &frame, self.config.max_frame_bytes).await;
        }
    }

    async fn on_frame(&mut self, frame: Inbound) -> Result<(), io::Error> {
        let max = self.config.max_frame_bytes;
        let (call, body) = match frame {
            Inbound::Ping { call } => {
                send(&self.out, &Frame::Done { call }, max).await;
                return Ok(());
            }
            Inbound::Cancel { call } => {
                if let Some(task) = self.by_call.remove(&call) {
                    debug!(call, "call cancelled by the client");
                    task.abort();
                }
                return Ok(());
            }
            Inbound::FromServer => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a server frame from a client",
                ));
            }
            Inbound::Call { call, body } => (call, body),
        };
        if self.by_call.contains_key(&call) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a call id reused while in flight",
            ));
        }
        // A pushed persisted request waits as long as its handler runs: it has a lane of its
        // own, so that held pushes never take the slots of the other calls.
        let pushed = matches!(body, CallBody::Request(_, true));
        let full = match pushed {
            true => self.pushed >= self.config.max_pushed_in_flight(),
            false => self.calls.len() - self.pushed >= self.config.max_in_flight(),
        };
        if full {
            debug!(call, pushed, "a call beyond its lane's bound: overloaded");
            send(&self.out, &Frame::Failed { call, error: WireError::Overloaded }, max).await;
            return Ok(());
        }
        let task = run_call(call, body, Arc::clone(&self.handler), self.out.clone(), max);
        let abort = self.calls.spawn(task.in_current_span());
        self.ids.insert(abort.id(), (call, pushed));
        if pushed {
            self.pushed += 1;
        }
        self.by_call.insert(call, abort);
        Ok(())
    }
}

/// Encodes and queues `frame`; a frame that cannot be encoded is logged and dropped (callers
/// send only frames that fit, or have a fallback).
async fn send(out: &mpsc::Sender<Vec<u8>>, frame: &Frame<'_>, max_frame_bytes: u32) -> bool {
    match codec::encode(frame, max_frame_bytes) {
        Ok(bytes) => out.send(bytes).await.is_ok(),
        Err(error) => {
            warn!(%error, "cannot encode a frame");
            false
        }
    }
}

fn defect(message: &str) -> WireError<'static> {
    let mut end = message.len().min(DEFECT_MESSAGE_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    WireError::Defect(message[..end].to_owned().into())
}

fn failed(call: u64, error: &ClusterError) -> Frame<'_> {
    // Typed errors are small; a defect's message is cut to a bound.
    let error = match codec::error_out(error) {
        WireError::Defect(message) => defect(&message),
        typed => typed,
    };
    Frame::Failed { call, error }
}

/// Answers a void call (`Notify`, `Envelope`) with its outcome.
async fn answer_void(
    call: u64,
    outcome: Result<Result<(), ClusterError>, DecodeError>,
    out: &mpsc::Sender<Vec<u8>>,
    max: u32,
) {
    match outcome {
        Ok(Ok(())) => send(out, &Frame::Done { call }, max).await,
        Ok(Err(error)) => send(out, &failed(call, &error), max).await,
        Err(error) => {
            send(out, &Frame::Failed { call, error: defect(&error.to_string()) }, max).await
        }
    };
}

/// Runs one call to its end and queues its answer frames.
async fn run_call(
    call: u64,
    body: CallBody,
    handler: Arc<dyn RunnerHandler>,
    out: mpsc::Sender<Vec<u8>>,
    max: u32,
) {
    match body {
        CallBody::Notify(envelope, persisted) => {
            let outcome = match envelope {
                Ok(envelope) => Ok(handler.notify(envelope, persisted).await),
                Err(error) => Err(error),
            };
            answer_void(call, outcome, &out, max).await;
        }
        CallBody::Envelope(envelope, persisted) => {
            let outcome = match envelope {
                Ok(envelope) => Ok(handler.envelope(envelope, persisted).await),
                Err(error) => Err(error),
            };
            answer_void(call, outcome, &out, max).await;
        }
        CallBody::Request(request, persisted) => {
            run_request(call, request, persisted, &*handler, &out, max).await;
        }
    }
}

async fn run_request(
    call: u64,
    request: Result<Request, DecodeError>,
    persisted: bool,
    handler: &dyn RunnerHandler,
    out: &mpsc::Sender<Vec<u8>>,
    max: u32,
) {
    let request = match request {
        Ok(request) => request,
        Err(error) => {
            send(out, &Frame::Failed { call, error: defect(&error.to_string()) }, max).await;
            return;
        }
    };
    let request_id = request.request_id;
    let mut replies = match handler.request(request, persisted).await {
        Ok(replies) => replies,
        Err(error) => {
            send(out, &failed(call, &error), max).await;
            return;
        }
    };
    loop {
        let reply = match replies.next_reply().await {
            Some(Ok(reply)) => reply,
            Some(Err(error)) => {
                send(out, &failed(call, &error), max).await;
                return;
            }
            None => {
                let error = defect("the reply stream ended without a final reply");
                send(out, &Frame::Failed { call, error }, max).await;
                return;
            }
        };
        let is_final = reply.is_final();
        let frame = Frame::Reply { call, reply: codec::reply_out(&reply) };
        let bytes = match codec::encode(&frame, max) {
            Ok(bytes) => bytes,
            Err(error) => {
                // Only this request fails: its final reply is a `MalformedMessage` defect.
                warn!(call, %error, "a reply cannot be sent; failing its request");
                let malformed = Reply::malformed(request_id, reply.id(), &error);
                send(out, &Frame::Reply { call, reply: codec::reply_out(&malformed) }, max).await;
                return;
            }
        };
        if out.send(bytes).await.is_err() || is_final {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::codec;
    use crate::frame::Frame;

    /// Frames that have arrived together are taken in with one read, not three reads each.
    #[tokio::test]
    async fn arrived_frames_are_read_together() {
        let mut bytes = Vec::new();
        for call in 0..100 {
            let body = codec::encode(&Frame::Ping { call }, 1 << 20).unwrap();
            bytes.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
            bytes.extend_from_slice(&body);
        }
        let mut socket = crate::conn::tests::Chunked::new(bytes, usize::MAX);
        let (frames, mut read) = tokio::sync::mpsc::channel(128);
        let reader = crate::conn::FrameReader::new(
            &mut socket,
            1 << 20,
            std::time::Duration::from_secs(30),
            None,
        );
        super::read_loop(reader, frames).await;
        let mut calls = Vec::new();
        while let Ok(frame) = read.try_recv() {
            if let super::Inbound::Ping { call } = frame {
                calls.push(call);
            }
        }
        assert_eq!(calls, (0..100).collect::<Vec<u64>>(), "every frame, in order");
        assert_eq!(socket.reads, 1, "one read for every frame that had arrived");
    }
}
