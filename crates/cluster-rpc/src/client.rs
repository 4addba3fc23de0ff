//! The client side: [`TcpTransport`], the `Transport` contract over TCP.
//!
//! One multiplexed connection per peer, opened on first use and cached. Each call gets a fresh
//! call id and a bounded channel; the connection's reader routes server frames to it. A call
//! whose future or reply stream is dropped before its final answer queues a `Cancel` frame
//! (written ahead of other frames), so the server drops the request's reply stream.
//!
//! A connection's calls take slots in one of two lanes ([`Lane`]):
//!
//! - pings, notices, envelopes and volatile requests: `max_in_flight` slots; a call waits for
//!   a free one;
//! - pushed persisted requests: `max_pushed_in_flight` slots of their own. Such a call lasts
//!   until its request's final reply is stored, however long its handler runs, so held pushes
//!   never take the slots of the other calls. A push that finds its lane full fails at once
//!   (`RunnerUnavailable`): its caller waits on storage, where the request is already.
//!
//! Reconnection is lazy: a call that finds its peer's connection closed opens a new one. After
//! a failed attempt the peer is in backoff, `min(backoff_cap, backoff_base × 2^(n−1))` with
//! equal jitter (half fixed, half random) after the n-th consecutive failure; calls during
//! backoff fail at once with `RunnerUnavailable` (routing retries them). A connection with no
//! call in flight for `idle_expiry` closes itself; [`Transport::on_runner_unavailable`] and a
//! failed ping drop the cached connection (its calls in flight fail with `RunnerUnavailable`).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{self, AtomicBool};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::backoff::{Backoff, jittered};
use cluster_core::envelope::{Envelope, Exit, Reply, Request, WithExit};
use cluster_core::error::{ClusterError, DecodeError};
use cluster_core::future::BoxFuture;
use cluster_core::ids::RunnerAddress;
use cluster_core::snowflake::Snowflake;
use cluster_core::sync::lock;
use cluster_core::transport::{Probe, ReplyStream, Transport};
use tokio::io::WriteHalf;
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::codec::{self, ServerError};
use crate::config::RpcConfig;
use crate::conn;
use crate::frame::Frame;
use crate::handshake;
use crate::tls::{BoxStream, ClientTls};

/// The `Transport` contract over TCP: a cached, multiplexed connection per peer, reopened lazily
/// with a capped, jittered backoff (see the [crate docs](crate)).
pub struct TcpTransport {
    config: Arc<RpcConfig>,
    tls: ClientTls,
    peers: Mutex<BTreeMap<RunnerAddress, PeerSlot>>,
}

/// A peer as the calls find it: its open connection, taken under the map's lock without
/// waiting, and the state of connection attempts, which one caller at a time holds.
#[derive(Default)]
struct PeerSlot {
    open: Option<Arc<Connection>>,
    attempts: Arc<tokio::sync::Mutex<Peer>>,
}

/// The connection attempts to one peer.
#[derive(Default)]
struct Peer {
    failures: u32,
    retry_at: Option<Instant>,
    /// Why the last attempt's handshake failed, if that is how it failed: calls during the
    /// backoff fail with it too, not with `RunnerUnavailable`, which routing would retry.
    refused: Option<Arc<str>>,
}

fn unavailable(address: &RunnerAddress) -> ClusterError {
    ClusterError::RunnerUnavailable { address: address.clone() }
}

fn refused(address: &RunnerAddress, reason: &Arc<str>) -> ClusterError {
    ClusterError::HandshakeFailed { address: address.clone(), reason: Arc::clone(reason) }
}

/// Why a connection attempt failed.
enum ConnectError {
    /// The handshake failed: the peer and this process do not accept each other.
    Refused(Arc<str>),
    /// Anything else: the connection was refused or lost, or the attempt timed out.
    Failed(String),
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Refused(reason) => write!(f, "handshake failed: {reason}"),
            ConnectError::Failed(reason) => f.write_str(reason),
        }
    }
}

impl fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<RunnerAddress> = lock(&self.peers).keys().cloned().collect();
        f.debug_struct("TcpTransport").field("config", &self.config).field("peers", &peers).finish()
    }
}

impl TcpTransport {
    /// A client with `config` (validated first; with TLS, `config.tls` needs a CA).
    pub fn new(config: RpcConfig) -> Result<Arc<TcpTransport>, crate::RpcError> {
        config.validate()?;
        let tls = ClientTls::new(&config)?;
        Ok(Arc::new(TcpTransport {
            config: Arc::new(config),
            tls,
            peers: Mutex::new(BTreeMap::new()),
        }))
    }

    /// Whether a connection to `address` is cached and open (also true while a connection
    /// attempt to it is under way).
    pub fn is_connected(&self, address: &RunnerAddress) -> bool {
        let peers = lock(&self.peers);
        let Some(slot) = peers.get(address) else { return false };
        slot.open.as_ref().is_some_and(|connection| !connection.shared.is_closed())
            || slot.attempts.try_lock().is_err()
    }

    /// Drops the cached connection to `address`: calls in flight on it fail with
    /// `RunnerUnavailable`, the next call connects afresh (with no backoff).
    fn forget(&self, address: &RunnerAddress) {
        let Some(slot) = lock(&self.peers).remove(address) else { return };
        info!(%address, "rpc connection dropped");
        // A connection attempt under way is left to it: its connection serves the call that
        // made it and is not cached, as its peer no longer is.
        if let Some(connection) = slot.open {
            connection.shared.close();
        }
    }

    /// The open connection to `address`, opened if needed.
    async fn connection(&self, address: &RunnerAddress) -> Result<Arc<Connection>, ClusterError> {
        let attempts = match self.open_connection(address) {
            Ok(connection) => return Ok(connection),
            Err(attempts) => attempts,
        };
        let mut peer = attempts.lock().await;
        // Another caller may have connected while this one waited for the attempt's lock.
        let attempts = match self.open_connection(address) {
            Ok(connection) => return Ok(connection),
            Err(current) => current,
        };
        let now = Instant::now();
        if peer.retry_at.is_some_and(|retry_at| now < retry_at) {
            return Err(match &peer.refused {
                Some(reason) => refused(address, reason),
                None => unavailable(address),
            });
        }
        match connect(address, &self.config, &self.tls).await {
            Ok(connection) => {
                info!(%address, "rpc connection established");
                peer.failures = 0;
                peer.retry_at = None;
                peer.refused = None;
                let connection = Arc::new(connection);
                // Cached unless the peer was forgotten meanwhile (its slot is then a new one).
                if let Some(slot) = lock(&self.peers).get_mut(address)
                    && Arc::ptr_eq(&slot.attempts, &attempts)
                {
                    slot.open = Some(Arc::clone(&connection));
                }
                Ok(connection)
            }
            Err(error) => {
                peer.failures = peer.failures.saturating_add(1);
                let delay = backoff(&self.config, peer.failures);
                let now = Instant::now();
                // A configured backoff may be past what an instant holds: capped, it is never.
                peer.retry_at = Some(
                    now.checked_add(delay).unwrap_or_else(|| now + cluster_core::clock::FAR_FUTURE),
                );
                warn!(%address, %error, failures = peer.failures, ?delay, "rpc connect failed");
                match error {
                    // A configuration error: the caller is told at once, not after retries.
                    ConnectError::Refused(reason) => {
                        let error = refused(address, &reason);
                        peer.refused = Some(reason);
                        Err(error)
                    }
                    ConnectError::Failed(_) => {
                        peer.refused = None;
                        Err(unavailable(address))
                    }
                }
            }
        }
    }

    /// The cached open connection to `address`, or the lock of its connection attempts.
    fn open_connection(
        &self,
        address: &RunnerAddress,
    ) -> Result<Arc<Connection>, Arc<tokio::sync::Mutex<Peer>>> {
        let mut peers = lock(&self.peers);
        if let Some(slot) = peers.get_mut(address) {
            match &slot.open {
                Some(connection) if !connection.shared.is_closed() => {
                    return Ok(Arc::clone(connection));
                }
                Some(_) => slot.open = None,
                None => {}
            }
            return Err(Arc::clone(&slot.attempts));
        }
        Err(Arc::clone(&peers.entry(address.clone()).or_default().attempts))
    }

    /// Starts a request call: its frame is queued when this returns.
    async fn start_request(
        &self,
        address: &RunnerAddress,
        request: &Request,
        persisted: bool,
    ) -> Result<TcpReplyStream, ClusterError> {
        let connection = self.connection(address).await?;
        // A pushed persisted request waits as long as its handler runs: its own lane.
        let lane = if persisted { Lane::Pushed } else { Lane::Calls };
        let call = connection.begin_call(self.config.stream_buffer(), address, lane).await?;
        let frame =
            |id| Frame::Request { call: id, request: codec::request_out(request), persisted };
        call.send(&connection, frame, address).await.map(|call| TcpReplyStream {
            call,
            address: address.clone(),
            request_id: request.request_id,
            persisted,
            done: false,
        })
    }

    /// A void call: queues the frame and waits for `Done` or `Failed`.
    async fn void_call<'f>(
        &self,
        address: &RunnerAddress,
        frame: impl FnOnce(u64) -> Frame<'f>,
    ) -> Result<(), ClusterError> {
        let connection = self.connection(address).await?;
        let call = connection.begin_call(1, address, Lane::Calls).await?;
        let mut call = call.send(&connection, frame, address).await?;
        match call.receive().await {
            Some(Incoming::Done) => Ok(()),
            Some(Incoming::Failed(ServerError::Typed(error))) => Err(error),
            Some(Incoming::Failed(ServerError::Defect(message))) => {
                warn!(%address, %message, "a void call failed with a defect");
                Err(unavailable(address))
            }
            Some(Incoming::Malformed(error)) => Err(ClusterError::MalformedMessage(error)),
            Some(Incoming::Failed(ServerError::Overloaded) | Incoming::Reply(_)) | None => {
                Err(unavailable(address))
            }
        }
    }
}

/// The delay after the `failures`-th consecutive failed connection attempt.
fn backoff(config: &RpcConfig, failures: u32) -> Duration {
    let delay =
        Backoff::doubling(config.backoff_base, config.backoff_cap).after_failures(failures.max(1));
    let mut random = [0_u8; 8];
    let random = match getrandom::fill(&mut random) {
        Ok(()) => u64::from_le_bytes(random),
        Err(_) => 0,
    };
    jittered(delay, random)
}

/// Opens a connection: TCP, then TLS when configured, then the handshake, all within the
/// connect timeout.
async fn connect(
    address: &RunnerAddress,
    config: &Arc<RpcConfig>,
    tls: &ClientTls,
) -> Result<Connection, ConnectError> {
    let failed = |error: &dyn fmt::Display| ConnectError::Failed(error.to_string());
    let attempt = async {
        let tcp = TcpStream::connect((address.host(), address.port()))
            .await
            .map_err(|error| failed(&error))?;
        let _ = tcp.set_nodelay(true);
        let mut stream = tls.connect(address, tcp).await.map_err(|error| failed(&error))?;
        let keys =
            handshake::client(&mut stream, config.secret_bytes()).await.map_err(|error| {
                if error.is_refusal() {
                    ConnectError::Refused(Arc::from(error.to_string()))
                } else {
                    failed(&error)
                }
            })?;
        Ok::<_, ConnectError>((stream, keys))
    };
    let (stream, keys) = tokio::time::timeout(config.connect_timeout, attempt)
        .await
        .map_err(|_| ConnectError::Failed("timed out".to_owned()))??;
    // A root span: the connection outlives the call that happened to open it, and must not keep
    // that call's span (and its trace) open.
    let span = info_span!(parent: None, "rpc_client_connection", %address);
    Ok(Connection::start(stream, keys, Arc::clone(config), span))
}

/// The slots a call takes on its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    /// Pings, notices, envelopes and volatile requests (`max_in_flight`): a call waits for a
    /// slot.
    Calls,
    /// Pushed persisted requests (`max_pushed_in_flight`): a push that finds no slot fails at
    /// once.
    Pushed,
}

/// What the reader delivers to a call.
enum Incoming {
    Done,
    Reply(Reply),
    Failed(ServerError),
    Malformed(DecodeError),
}

/// The state a connection shares between its tasks and its calls.
struct Shared {
    state: Mutex<SharedState>,
    /// Wakes the writer when a cancel is queued.
    cancel_queued: Notify,
    /// Whether the connection is closed, read by every call without a lock (`closed` is what
    /// the tasks wait on).
    is_closed: AtomicBool,
    closed: CancellationToken,
    /// The slots of [`Lane::Calls`].
    permits: Arc<Semaphore>,
    /// The slots of [`Lane::Pushed`].
    pushed_permits: Arc<Semaphore>,
    out: mpsc::Sender<Vec<u8>>,
    max_frame_bytes: u32,
}

struct SharedState {
    next_call: u64,
    pending: BTreeMap<u64, mpsc::Sender<Incoming>>,
    cancels: Vec<u64>,
    /// Since when no call has been in flight (the clock is read only when the last call of a
    /// busy connection ends, not for every call).
    idle_since: Instant,
}

impl SharedState {
    /// Forgets `call`; `true` when it was in flight.
    fn end_call(&mut self, call: u64) -> bool {
        let ended = self.pending.remove(&call).is_some();
        if ended && self.pending.is_empty() {
            self.idle_since = Instant::now();
        }
        ended
    }
}

impl Shared {
    fn is_closed(&self) -> bool {
        self.is_closed.load(atomic::Ordering::Acquire)
    }

    /// Closes the connection: its tasks stop and every call in flight sees its channel close.
    fn close(&self) {
        self.is_closed.store(true, atomic::Ordering::Release);
        self.closed.cancel();
        let pending = std::mem::take(&mut lock(&self.state).pending);
        drop(pending);
    }

    /// Forgets `call` and, if it was still in flight, queues its cancellation.
    fn abandon(&self, call: u64) {
        let mut state = lock(&self.state);
        if state.end_call(call) && !self.is_closed() {
            state.cancels.push(call);
            drop(state);
            self.cancel_queued.notify_one();
        }
    }

    /// Routes one server frame to its call; `Err` is a protocol violation.
    fn route(&self, names: &mut codec::Names, frame: Frame<'_>) -> Result<(), &'static str> {
        let (call, incoming, is_final) = match frame {
            Frame::Done { call } => (call, Incoming::Done, true),
            Frame::Failed { call, error } => match codec::error_in(names, error) {
                Ok(error) => (call, Incoming::Failed(error), true),
                Err(error) => (call, Incoming::Malformed(error), true),
            },
            Frame::Reply { call, reply } => match codec::reply_in(reply) {
                Ok(reply) => {
                    let is_final = reply.is_final();
                    (call, Incoming::Reply(reply), is_final)
                }
                Err(error) => (call, Incoming::Malformed(error), true),
            },
            Frame::Ping { .. }
            | Frame::Notify { .. }
            | Frame::Request { .. }
            | Frame::Envelope { .. }
            | Frame::Cancel { .. } => return Err("a client frame from the server"),
        };
        let mut state = lock(&self.state);
        let sender = if is_final {
            let sender = state.pending.remove(&call);
            if sender.is_some() && state.pending.is_empty() {
                state.idle_since = Instant::now();
            }
            sender
        } else {
            state.pending.get(&call).cloned()
        };
        // A frame for a call that was abandoned meanwhile is dropped.
        let Some(sender) = sender else { return Ok(()) };
        if sender.try_send(incoming).is_err() && !is_final {
            // The caller let more replies pile up than the stream buffer holds: its stream is
            // cut (it will see `RunnerUnavailable`) and the request cancelled.
            warn!(call, "stream buffer overflow; cancelling the call");
            state.end_call(call);
            state.cancels.push(call);
            drop(state);
            self.cancel_queued.notify_one();
        }
        Ok(())
    }
}

/// One client connection. Dropping it closes the connection and aborts its tasks.
struct Connection {
    shared: Arc<Shared>,
    _tasks: JoinSet<()>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.shared.close();
    }
}

impl Connection {
    /// Starts the reader and writer of a connection whose handshake gave `keys` (none without
    /// a secret).
    fn start(
        stream: BoxStream,
        keys: Option<handshake::SessionKeys>,
        config: Arc<RpcConfig>,
        span: tracing::Span,
    ) -> Connection {
        let (write_mac, read_mac) = match keys {
            Some(keys) => (Some(keys.client_to_server), Some(keys.server_to_client)),
            None => (None, None),
        };
        let (read_half, write_half) = tokio::io::split(stream);
        let (out_tx, out_rx) = mpsc::channel(config.queue_capacity());
        let shared = Arc::new(Shared {
            state: Mutex::new(SharedState {
                next_call: 0,
                pending: BTreeMap::new(),
                cancels: Vec::new(),
                idle_since: Instant::now(),
            }),
            cancel_queued: Notify::new(),
            is_closed: AtomicBool::new(false),
            closed: CancellationToken::new(),
            permits: Arc::new(Semaphore::new(config.max_in_flight().min(Semaphore::MAX_PERMITS))),
            pushed_permits: Arc::new(Semaphore::new(
                config.max_pushed_in_flight().min(Semaphore::MAX_PERMITS),
            )),
            out: out_tx,
            max_frame_bytes: config.max_frame_bytes,
        });
        let mut tasks = JoinSet::new();
        let reader = {
            let shared = Arc::clone(&shared);
            let max = config.max_frame_bytes;
            let frame_timeout = config.frame_timeout;
            async move {
                // Each frame is routed to its call as soon as it is decoded, from the buffer.
                let route = async {
                    let mut frames =
                        conn::FrameReader::new(read_half, max, frame_timeout, read_mac);
                    let mut names = codec::Names::default();
                    while let Some(frame) = frames.next_decoded().await {
                        if let Err(violation) = shared.route(&mut names, frame) {
                            warn!(violation, "protocol violation; closing the connection");
                            return;
                        }
                    }
                };
                tokio::select! {
                    () = shared.closed.cancelled() => {}
                    () = route => {}
                }
                shared.close();
                debug!("connection closed");
            }
        };
        tasks.spawn(reader.instrument(span.clone()));
        let writer =
            write_loop(write_half, out_rx, Arc::clone(&shared), config.idle_expiry, write_mac);
        tasks.spawn(writer.instrument(span));
        Connection { shared, _tasks: tasks }
    }

    /// Registers a new call in `lane` whose channel holds `buffer` answers.
    async fn begin_call(
        &self,
        buffer: usize,
        address: &RunnerAddress,
        lane: Lane,
    ) -> Result<PendingCall, ClusterError> {
        let permits = match lane {
            Lane::Calls => &self.shared.permits,
            Lane::Pushed => &self.shared.pushed_permits,
        };
        let permit = match Arc::clone(permits).try_acquire_owned() {
            Ok(permit) => permit,
            Err(TryAcquireError::NoPermits) if lane == Lane::Pushed => {
                debug!(%address, "the lane of pushed requests is full; the caller waits on storage");
                return Err(unavailable(address));
            }
            Err(TryAcquireError::NoPermits) => {
                Arc::clone(permits).acquire_owned().await.map_err(|_| unavailable(address))?
            }
            Err(TryAcquireError::Closed) => return Err(unavailable(address)),
        };
        let (sender, receiver) = mpsc::channel(buffer);
        let mut state = lock(&self.shared.state);
        if self.shared.is_closed() {
            return Err(unavailable(address));
        }
        let call = state.next_call;
        state.next_call = state.next_call.wrapping_add(1);
        state.pending.insert(call, sender);
        Ok(PendingCall {
            call,
            receiver,
            shared: Arc::clone(&self.shared),
            answered: false,
            _permit: permit,
        })
    }
}

/// The writer: cancels first, then queued frames; closes the connection when it has been idle
/// for `idle_expiry` with no call in flight.
async fn write_loop(
    mut writer: WriteHalf<BoxStream>,
    mut out: mpsc::Receiver<Vec<u8>>,
    shared: Arc<Shared>,
    idle_expiry: Duration,
    mut mac: Option<conn::FrameMac>,
) {
    let mut buffer = Vec::new();
    // One wait for the whole loop, not one registered and dropped per batch.
    let closed = shared.closed.cancelled();
    tokio::pin!(closed);
    loop {
        let idle_at = {
            let state = lock(&shared.state);
            // A connection with calls in flight is not idle: it looks again one period later.
            if state.pending.is_empty() {
                state.idle_since + idle_expiry
            } else {
                Instant::now() + idle_expiry
            }
        };
        let body = tokio::select! {
            biased;
            () = &mut closed => break,
            () = shared.cancel_queued.notified() => {
                let cancels = std::mem::take(&mut lock(&shared.state).cancels);
                let mut failed = false;
                for call in cancels {
                    if let Ok(body) = codec::encode(&Frame::Cancel { call }, shared.max_frame_bytes) {
                        failed |= conn::write_frame(&mut writer, &body, mac.as_mut()).await.is_err();
                    }
                }
                if failed { break }
                continue;
            }
            body = out.recv() => match body {
                Some(body) => body,
                None => break,
            },
            () = tokio::time::sleep_until(idle_at) => {
                let state = lock(&shared.state);
                if state.pending.is_empty() && Instant::now() >= state.idle_since + idle_expiry {
                    drop(state);
                    info!("idle rpc connection expired");
                    break;
                }
                continue;
            }
        };
        let written = conn::write_queued(&mut writer, body, &mut out, &mut buffer, &mut mac).await;
        if let Err(error) = written {
            debug!(%error, "write failed");
            break;
        }
    }
    shared.close();
    let _ = tokio::io::AsyncWriteExt::shutdown(&mut writer).await;
}

/// A registered call. Dropping it before its final answer cancels it on the server.
struct PendingCall {
    call: u64,
    receiver: mpsc::Receiver<Incoming>,
    shared: Arc<Shared>,
    /// Whether the call's final answer was received (the reader has forgotten the call).
    answered: bool,
    _permit: OwnedSemaphorePermit,
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        if !self.answered {
            self.shared.abandon(self.call);
        }
    }
}

impl PendingCall {
    /// The call's next answer, or `None` once the reader has dropped the call.
    async fn receive(&mut self) -> Option<Incoming> {
        let incoming = self.receiver.recv().await;
        // A final answer was routed after the reader forgot the call: nothing to cancel.
        self.answered = match &incoming {
            Some(Incoming::Reply(reply)) => reply.is_final(),
            Some(Incoming::Done | Incoming::Failed(_) | Incoming::Malformed(_)) | None => true,
        };
        incoming
    }

    /// Encodes and queues the call's frame. A frame that cannot be encoded or is too large
    /// fails this call only, as `MalformedMessage`.
    async fn send<'a>(
        self,
        connection: &Connection,
        frame: impl FnOnce(u64) -> Frame<'a>,
        address: &RunnerAddress,
    ) -> Result<PendingCall, ClusterError> {
        let bytes = codec::encode(&frame(self.call), connection.shared.max_frame_bytes)?;
        connection.shared.out.send(bytes).await.map_err(|_| unavailable(address))?;
        Ok(self)
    }
}

/// The replies of a request over TCP.
struct TcpReplyStream {
    call: PendingCall,
    address: RunnerAddress,
    request_id: Snowflake,
    persisted: bool,
    done: bool,
}

impl TcpReplyStream {
    async fn next(&mut self) -> Option<Result<Reply, ClusterError>> {
        if self.done {
            return None;
        }
        let incoming = self.call.receive().await;
        let item = match incoming {
            Some(Incoming::Reply(reply)) => {
                self.done = reply.is_final();
                return Some(Ok(reply));
            }
            Some(Incoming::Failed(ServerError::Typed(error))) => Err(error),
            Some(Incoming::Failed(ServerError::Defect(message))) => self.defect(&message),
            Some(Incoming::Malformed(error)) => Err(ClusterError::MalformedMessage(error)),
            Some(Incoming::Failed(ServerError::Overloaded) | Incoming::Done) | None => {
                Err(unavailable(&self.address))
            }
        };
        self.done = true;
        Some(item)
    }

    /// A defect delivered by the server: for a persisted request the caller recovers the reply
    /// from storage, so it is `RunnerUnavailable`; for a volatile one it is the request's
    /// final `Die` reply.
    fn defect(&self, message: &str) -> Result<Reply, ClusterError> {
        if self.persisted {
            warn!(address = %self.address, %message, "defect for a persisted request");
            return Err(unavailable(&self.address));
        }
        Ok(Reply::WithExit(WithExit {
            request_id: self.request_id,
            id: Snowflake::new(0),
            exit: Exit::die_with_message("Error", message),
        }))
    }
}

impl ReplyStream for TcpReplyStream {
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>> {
        Box::pin(self.next())
    }
}

impl Transport for TcpTransport {
    fn ping<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let result = self.void_call(address, |call| Frame::Ping { call }).await;
            if result.is_err() {
                self.forget(address);
            }
            result
        })
    }

    fn notify<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let envelope = codec::envelope_out(&envelope);
            self.void_call(address, |call| Frame::Notify { call, envelope, persisted }).await
        })
    }

    fn send<'a>(
        &'a self,
        address: &'a RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'a, Result<Reply, ClusterError>> {
        Box::pin(async move {
            let mut replies = self.start_request(address, &request, persisted).await?;
            loop {
                match replies.next().await {
                    Some(Ok(reply)) if reply.is_final() => return Ok(reply),
                    Some(Ok(_chunk)) => {}
                    Some(Err(error)) => return Err(error),
                    None => return Err(unavailable(address)),
                }
            }
        })
    }

    fn stream<'a>(
        &'a self,
        address: &'a RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'a, Result<Box<dyn ReplyStream>, ClusterError>> {
        Box::pin(async move {
            let replies = self.start_request(address, &request, persisted).await?;
            Ok(Box::new(replies) as Box<dyn ReplyStream>)
        })
    }

    fn send_envelope<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let envelope = codec::envelope_out(&envelope);
            self.void_call(address, |call| Frame::Envelope { call, envelope, persisted }).await
        })
    }

    fn on_runner_unavailable(&self, address: &RunnerAddress) {
        self.forget(address);
    }

    fn probe<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, Probe> {
        Box::pin(async move {
            // An open connection says the peer's socket lives: no need to open another.
            let open = lock(&self.peers)
                .get(address)
                .and_then(|slot| slot.open.as_ref())
                .is_some_and(|connection| !connection.shared.is_closed());
            if open {
                return Probe::Listening;
            }
            probe(address, PROBE_TIMEOUT.min(self.config.connect_timeout)).await
        })
    }
}

/// How long a probe's connection attempt may take; past it, the probe cannot tell.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// A bare TCP connection to `address`, closed at once, without a handshake (the server logs a
/// connection that closes before sending anything at debug level only).
///
/// Only a refused connection is [`Probe::Refused`]: a timeout or an unreachable host is what a
/// partition looks like, and a partitioned runner may still hold its shards.
async fn probe(address: &RunnerAddress, timeout: Duration) -> Probe {
    match tokio::time::timeout(timeout, TcpStream::connect((address.host(), address.port()))).await
    {
        Ok(Ok(_connected)) => Probe::Listening,
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionRefused => Probe::Refused,
        Ok(Err(error)) => {
            debug!(%address, %error, "probe failed; cannot tell whether the runner is gone");
            Probe::Unknown
        }
        Err(_) => Probe::Unknown,
    }
}
