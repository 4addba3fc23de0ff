//! Runner-to-runner transport over TCP: the `cluster_core::transport` contract
//! ([`Transport`](cluster_core::transport::Transport) on the client side,
//! [`RunnerHandler`](cluster_core::transport::RunnerHandler) on the server side) implemented with
//! tokio (`effect/src/cluster/Runners.ts`).
//!
//! - [`RpcServer::bind`] binds a listener (so the runtime learns its advertised address), then
//!   [`RpcServer::serve`] starts calling a handler and returns a [`ServerHandle`] whose
//!   [`shutdown`](ServerHandle::shutdown) stops it gracefully.
//! - [`TcpTransport`] is the client: one multiplexed connection per peer, cached, closed after
//!   `idle_expiry` without calls, dropped by `on_runner_unavailable`, reopened lazily with a
//!   capped, jittered backoff after failed attempts.
//! - [`RpcConfig`] holds the limits (frame size, calls in flight, queues, stream buffer,
//!   connections), timeouts and the shared secret, loadable from `CLUSTER_RPC_*` variables.
//!
//! Protocol: after a mutual HMAC-SHA256 handshake over the shared secret (see `handshake`),
//! each side sends length-delimited frames (4-byte big-endian length, at most
//! `max_frame_bytes`, then the body; with a secret, each write ends with a 16-byte MAC) of
//! postcard-encoded wire
//! forms (`frame`; the codec was chosen by measurement, see `codec`). Calls are `Ping`,
//! `Notify`, `Request` (the `Effect` and `Stream` RPCs), `Envelope` and `Cancel`; answers are
//! `Done`, `Reply` and `Failed`. A garbage, truncated, oversize, late or unauthentic frame
//! closes its connection only, and is logged.
//!
//! Security (protocol version 2):
//!
//! - **The caller proves first.** The server sends only a random nonce until the client has
//!   proved it holds the secret; a wrong proof gets the connection closed with nothing more. So
//!   an unauthenticated connection gets nothing to test guesses of the secret against (no
//!   offline oracle). The server then proves itself to the client.
//! - **Secrets of at least 32 bytes** ([`MIN_SECRET_BYTES`]); a shorter one is a configuration
//!   error that names `CLUSTER_RPC_SECRET` and never shows it. Make one with
//!   `openssl rand -hex 32`.
//! - **MACs on every frame.** With a secret, every frame after the handshake is covered by a
//!   16-byte HMAC-SHA256 tag under a per-connection, per-direction key derived from the
//!   handshake: one tag per write (a *record*: a lone frame or a writer's batch), over the
//!   record's sequence number and bytes, checked before any of its frames is handed out. A frame
//!   altered, replayed, reordered or dropped in transit closes the connection, and is logged.
//!   Without a secret (loopback only) there are no tags.
//! - **Bounds on peers that do not prove themselves or stall.** At most `max_handshakes`
//!   connections shake hands at once, each within `handshake_timeout`, counted apart from the
//!   `max_connections` established ones; a frame's announced length is never allocated up front
//!   (the buffer grows as bytes arrive), and a started frame must arrive within `frame_timeout`.
//! - **Confidentiality needs TLS**: without it, payloads travel in clear.
//!
//! Error mapping (`effect/src/cluster/Runners.ts`, effect's `Runners.test.ts`), on the client:
//!
//! - a transport failure (connect refused or timed out, connection lost before the final
//!   answer, server overloaded, backoff in force) is `ClusterError::RunnerUnavailable`;
//! - a failed handshake (the peer does not hold the same shared secret, or does not speak this
//!   protocol) is `ClusterError::HandshakeFailed`, which names the cause, also during the
//!   backoff that follows; routing does not retry it (the reference has no handshake);
//! - the server's typed errors (`EntityNotAssignedToRunner`, `MailboxFull`,
//!   `AlreadyProcessingMessage`, `Abandoned`, `RunnerUnavailable`, `RunnerNotRegistered`) come
//!   back as they are;
//! - any other server error (storage, decoding) or a handler panic travels as a *defect*: for a
//!   persisted request it is `RunnerUnavailable` (the caller recovers the reply from storage),
//!   for a volatile request it is the request's final reply, a `Die` with the message; for the
//!   void calls (`Notify`, `Envelope`) it is `RunnerUnavailable`;
//! - a reply the server cannot encode or that exceeds the frame limit fails only its own
//!   request, with a `Die(MalformedMessage)` final reply; a request the client cannot encode
//!   fails only itself with `MalformedMessage`.
//!
//! A failed `notify` of a persisted envelope is reported like any other failure; the contract
//! leaves ignoring it to the caller (storage is read anyway).
//!
//! Cancellation: dropping the future of `send` (or the stream of `stream`) before the final
//! reply sends `Cancel`; the server then drops the handler's reply stream, which interrupts a
//! volatile request. Closing a connection does the same to all of its calls.
//!
//! TLS (cargo feature `tls`, off by default): rustls with the `ring` provider, TLS 1.3 only.
//! When `RpcConfig::tls` is set (programmatically with `TlsConfig`, or from the
//! `CLUSTER_RPC_TLS_CERT`, `CLUSTER_RPC_TLS_KEY`, `CLUSTER_RPC_TLS_CA`,
//! `CLUSTER_RPC_TLS_SERVER_NAME` and `CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT` variables, see
//! [`RpcConfig`]), TLS wraps every TCP connection and the HMAC handshake runs inside it. A
//! server presents its certificate chain; a client verifies it against the configured CA and
//! the expected name (`CLUSTER_RPC_TLS_SERVER_NAME`, by default the runner's host, so
//! certificates must name the advertised host or IP address); with client certificates
//! required, the server verifies the client's chain against the same CA. A failed TLS
//! handshake is a refused connection (`RunnerUnavailable`, backoff); a failed HMAC handshake
//! inside it is `HandshakeFailed`. Both ends must agree: a plaintext peer and a TLS peer
//! refuse each other. Without the feature traffic is not encrypted (the handshake still
//! authenticates peers), and setting any `CLUSTER_RPC_TLS_*` variable is a configuration error
//! ("built without the tls feature").
//!
//! Persisted traffic never depends on this crate: storage is the source of truth.

mod client;
mod codec;
mod config;
mod conn;
mod error;
mod frame;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod handshake;
mod server;
mod tls;

pub use client::TcpTransport;
pub use config::{MAX_FRAME_BYTES_MAX, MIN_SECRET_BYTES, RpcConfig};
pub use error::RpcError;
pub use server::{RpcServer, ServerHandle};
#[cfg(feature = "tls")]
pub use tls::TlsConfig;
