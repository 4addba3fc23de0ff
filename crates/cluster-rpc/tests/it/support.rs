//! Test support: a fake `RunnerHandler` whose behaviour is chosen by the request tag, request
//! and address builders, a deadline for calls, and a raw handshake for tests that
//! speak to the server byte by byte.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::envelope::{Chunk, Envelope, Exit, RawJson, Reply, Request, WithExit};
use cluster_core::error::{ClusterError, StorageError, StorageErrorKind};
use cluster_core::future::BoxFuture;
use cluster_core::ids::{EntityAddress, EntityId, EntityType, RunnerAddress, ShardGroup, ShardId};
use cluster_core::snowflake::Snowflake;
pub(crate) use cluster_core::sync::lock;
use cluster_core::transport::{ReplyStream, RunnerHandler};
use cluster_rpc::{RpcConfig, RpcServer, ServerHandle};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long any condition may take before a test fails.
pub(crate) const DEADLINE: Duration = Duration::from_secs(10);

/// The fake handler. Tags: `Echo` (final reply with the payload), `Stream` (two chunks, each
/// sent after the previous one is acked, then the final reply), `Hang` (never answers),
/// `NotAssigned`, `MailboxFull`, `AlreadyProcessing` (typed errors), `Defect` (a storage
/// error, which is not a protocol error), `Big` (a final reply of `big_reply_bytes`),
/// `Flood` (chunks without end, as fast as the transport takes them), `Panic` (the handler
/// panics).
#[derive(Debug, Default)]
pub(crate) struct FakeHandler {
    pub(crate) state: Arc<Mutex<Log>>,
    /// Reply streams dropped (by the transport) before they yielded their final reply.
    pub(crate) dropped: Arc<AtomicU32>,
    pub(crate) big_reply_bytes: usize,
}

/// What the handler saw.
#[derive(Debug, Default)]
pub(crate) struct Log {
    pub(crate) notifies: Vec<(Envelope, bool)>,
    pub(crate) envelopes: Vec<(Envelope, bool)>,
    pub(crate) requests: Vec<(Request, bool)>,
    pub(crate) acked: BTreeSet<Snowflake>,
}

impl FakeHandler {
    pub(crate) fn new() -> Arc<FakeHandler> {
        Arc::new(FakeHandler::default())
    }

    pub(crate) fn with_big_reply(bytes: usize) -> Arc<FakeHandler> {
        Arc::new(FakeHandler { big_reply_bytes: bytes, ..FakeHandler::default() })
    }

    /// How many calls of any kind reached the handler.
    pub(crate) fn calls(&self) -> usize {
        let log = lock(&self.state);
        log.notifies.len() + log.envelopes.len() + log.requests.len()
    }

    pub(crate) fn requests(&self) -> usize {
        lock(&self.state).requests.len()
    }
}

fn final_reply(request: &Request, exit: Exit) -> Reply {
    Reply::WithExit(WithExit {
        request_id: request.request_id,
        id: Snowflake::new(request.request_id.get() + 1000),
        exit,
    })
}

/// Replies given in order, each possibly waiting for the ack of an earlier chunk.
struct FakeStream {
    replies: Vec<(Reply, Option<Snowflake>)>,
    state: Arc<Mutex<Log>>,
    dropped: Arc<AtomicU32>,
    finished: bool,
}

impl Drop for FakeStream {
    fn drop(&mut self) {
        if !self.finished {
            self.dropped.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl ReplyStream for FakeStream {
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>> {
        Box::pin(async move {
            if self.replies.is_empty() {
                return None;
            }
            if let Some(awaited) = self.replies[0].1 {
                // Waits for the ack of chunk `awaited`, as an entity does.
                let state = Arc::clone(&self.state);
                let acked = move || lock(&state).acked.contains(&awaited);
                let acked = cluster_testkit::wait::eventually("the chunk's ack", acked);
                if tokio::time::timeout(DEADLINE, acked).await.is_err() {
                    return Some(Err(ClusterError::MalformedMessage(
                        cluster_core::DecodeError::new("test", "no ack"),
                    )));
                }
            }
            let (reply, _) = self.replies.remove(0);
            self.finished = reply.is_final();
            Some(Ok(reply))
        })
    }
}

impl FakeHandler {
    fn replies(&self, request: &Request) -> Result<Vec<(Reply, Option<Snowflake>)>, ClusterError> {
        let address = request.address.clone();
        let payload = request.payload.clone();
        let chunk = |sequence: u32| {
            let id = Snowflake::new(request.request_id.get() + 1 + u64::from(sequence));
            let value = RawJson::from_json(sequence.to_string()).unwrap_or_default();
            Chunk::new(request.request_id, id, sequence, vec![value]).map(Reply::Chunk)
        };
        Ok(match &*request.tag {
            "Echo" => vec![(final_reply(request, Exit::Success(payload)), None)],
            "Stream" => {
                let (Some(first), Some(second)) = (chunk(0), chunk(1)) else { return Ok(vec![]) };
                let (first_id, second_id) = (first.id(), second.id());
                vec![
                    (first, None),
                    (second, Some(first_id)),
                    (final_reply(request, Exit::void()), Some(second_id)),
                ]
            }
            "Hang" | "Flood" => vec![],
            "NotAssigned" => return Err(ClusterError::EntityNotAssignedToRunner { address }),
            "MailboxFull" => return Err(ClusterError::MailboxFull { address }),
            "AlreadyProcessing" => {
                return Err(ClusterError::AlreadyProcessingMessage {
                    envelope_id: request.request_id,
                    address,
                });
            }
            "Defect" => {
                let error = StorageError::new(StorageErrorKind::Other, "boom");
                return Err(ClusterError::Persistence(error));
            }
            "Big" => {
                let value = RawJson::encode(&"x".repeat(self.big_reply_bytes)).unwrap_or_default();
                vec![(final_reply(request, Exit::Success(value)), None)]
            }
            other => panic!("the fake handler has no behaviour for tag {other}"),
        })
    }
}

impl RunnerHandler for FakeHandler {
    fn notify(
        &self,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>> {
        lock(&self.state).notifies.push((envelope, persisted));
        Box::pin(async { Ok(()) })
    }

    fn request(
        &self,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'_, Result<Box<dyn ReplyStream>, ClusterError>> {
        Box::pin(async move {
            lock(&self.state).requests.push((request.clone(), persisted));
            let replies = self.replies(&request)?;
            let stream = FakeStream {
                replies,
                state: Arc::clone(&self.state),
                dropped: Arc::clone(&self.dropped),
                finished: false,
            };
            if &*request.tag == "Flood" {
                return Ok(Box::new(FloodStream { stream, sequence: 0 }) as Box<dyn ReplyStream>);
            }
            if &*request.tag == "Hang" {
                // A stream that never yields: pending until dropped.
                return Ok(Box::new(HangStream(stream)) as Box<dyn ReplyStream>);
            }
            Ok(Box::new(stream) as Box<dyn ReplyStream>)
        })
    }

    fn envelope(
        &self,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>> {
        let mut log = lock(&self.state);
        if let Envelope::AckChunk(ack) = &envelope {
            log.acked.insert(ack.reply_id);
        }
        log.envelopes.push((envelope, persisted));
        Box::pin(async { Ok(()) })
    }
}

/// A reply stream that never yields; dropping it counts as an interruption.
struct HangStream(
    #[allow(dead_code, reason = "held for its drop, which counts the interruption")] FakeStream,
);

impl ReplyStream for HangStream {
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>> {
        Box::pin(std::future::pending())
    }
}

/// A reply stream of chunks without end; dropping it counts as an interruption.
struct FloodStream {
    stream: FakeStream,
    sequence: u32,
}

impl ReplyStream for FloodStream {
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>> {
        let request_id = Snowflake::new(1);
        let id = Snowflake::new(10_000 + u64::from(self.sequence));
        let value = RawJson::from_json(self.sequence.to_string()).unwrap_or_default();
        let chunk = Chunk::new(request_id, id, self.sequence, vec![value]).map(Reply::Chunk);
        self.sequence = self.sequence.wrapping_add(1);
        let _ = &self.stream;
        Box::pin(async move { chunk.map(Ok) })
    }
}

/// `future`, failing the test if it takes longer than [`DEADLINE`].
pub(crate) async fn within<T>(future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("timed out after {DEADLINE:?}"),
    }
}

pub(crate) fn entity() -> EntityAddress {
    EntityAddress {
        shard_id: ShardId::new(ShardGroup::from("default"), 7),
        entity_type: EntityType::from("Counter"),
        entity_id: EntityId::from("counter-1"),
    }
}

pub(crate) fn request(id: u64, tag: &str) -> Request {
    Request {
        request_id: Snowflake::new(id),
        address: entity(),
        tag: tag.into(),
        payload: RawJson::from_json(format!(r#"{{"n":{id}}}"#)).unwrap_or_default(),
        headers: RawJson::empty_object(),
        trace: cluster_core::envelope::TraceContext::default(),
    }
}

/// A config with short backoff for tests.
pub(crate) fn config() -> RpcConfig {
    RpcConfig {
        backoff_base: Duration::from_millis(5),
        backoff_cap: Duration::from_millis(50),
        connect_timeout: Duration::from_secs(2),
        ..RpcConfig::default()
    }
}

pub(crate) async fn serve(config: RpcConfig, handler: Arc<FakeHandler>) -> ServerHandle {
    let localhost = SocketAddr::from(([127, 0, 0, 1], 0));
    let server = RpcServer::bind(localhost, config).await.expect("bind");
    server.serve(handler)
}

pub(crate) fn runner_address(server: &ServerHandle) -> RunnerAddress {
    RunnerAddress::new("127.0.0.1", server.local_addr().port())
}

/// The hello of a client of this protocol version (its nonce follows).
pub(crate) const HELLO: &[u8; 5] = b"CRPC\x02";

/// `HMAC(key, parts…)`.
pub(crate) fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("key");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// Connects and completes the client half of the handshake with `secret`, as the crate does:
/// hello, the server's nonce, the client's proof, then the server's answer and proof.
pub(crate) async fn raw_client(address: SocketAddr, secret: &[u8]) -> TcpStream {
    raw_session(address, secret).await.stream
}

/// A raw connection past the handshake, with its session keys.
pub(crate) struct RawSession {
    pub(crate) stream: TcpStream,
    /// The key of the frames this side sends.
    pub(crate) client_to_server: [u8; 32],
    /// The key of the frames the server sends.
    pub(crate) server_to_client: [u8; 32],
}

/// Like [`raw_client`], keeping the session keys to seal and check frames with.
pub(crate) async fn raw_session(address: SocketAddr, secret: &[u8]) -> RawSession {
    let mut stream = TcpStream::connect(address).await.expect("connect");
    let client_nonce = [7_u8; 32];
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&client_nonce);
    stream.write_all(&hello).await.expect("hello");
    let mut answer = [0_u8; 37];
    stream.read_exact(&mut answer).await.expect("server hello");
    assert_eq!(&answer[..5], HELLO);
    let server_nonce = &answer[5..37];
    let proof = hmac(secret, &[b"client", &client_nonce, server_nonce]);
    stream.write_all(&proof).await.expect("proof");
    let mut accepted = [0_u8; 33];
    stream.read_exact(&mut accepted).await.expect("accepted");
    assert_eq!(accepted[0], 1);
    assert_eq!(accepted[1..], hmac(secret, &[b"server", &client_nonce, server_nonce]));
    RawSession {
        stream,
        client_to_server: hmac(secret, &[b"session c2s", &client_nonce, server_nonce]),
        server_to_client: hmac(secret, &[b"session s2c", &client_nonce, server_nonce]),
    }
}

/// A lone frame as a side with session key `key` sends it, as its `sequence`-th record:
/// length with the record flag (the top bit), body, and `HMAC(key, sequence ‖ length ‖ body)`
/// cut to 16 bytes.
pub(crate) fn sealed_frame(key: &[u8], sequence: u64, body: &[u8]) -> Vec<u8> {
    let len = u32::try_from(body.len()).expect("short") | 1 << 31;
    let mut frame = len.to_be_bytes().to_vec();
    frame.extend_from_slice(body);
    let tag = hmac(key, &[&sequence.to_be_bytes(), &frame]);
    frame.extend_from_slice(&tag[..16]);
    frame
}

/// Whether the server closed `stream` (EOF or reset) before [`DEADLINE`].
pub(crate) async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buffer = [0_u8; 256];
    let read = async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(DEADLINE, read).await.is_ok()
}

pub(crate) use cluster_testkit::logs::Warnings;
