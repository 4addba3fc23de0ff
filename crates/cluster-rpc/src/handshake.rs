//! The connection handshake: a mutual HMAC-SHA256 challenge–response over a shared secret, in
//! which the caller proves first.
//!
//! It runs on the raw socket (inside TLS when configured) before any frame is read, with
//! fixed-size messages, so a peer without the secret is refused before a single message frame
//! is decoded:
//!
//! 1. client → server: `MAGIC`, [`PROTOCOL_VERSION`], a 32-byte random client nonce `cn`;
//! 2. server → client: `MAGIC`, its version and a 32-byte random server nonce `sn`, and nothing
//!    else: nothing it sends before the client has proved itself depends on the secret;
//! 3. client → server: `HMAC(secret, "client" ‖ cn ‖ sn)`;
//! 4. the server checks it in constant time; when it is wrong the server closes the connection
//!    without another byte. Otherwise it answers [`ACCEPTED`] and its own proof,
//!    `HMAC(secret, "server" ‖ cn ‖ sn)`, or [`BUSY`] alone when it serves as many connections
//!    as it may (the caller then reports the runner unavailable, not a secret mismatch);
//! 5. the client checks the server's proof (so it never talks to an impostor) before it sends a
//!    frame.
//!
//! No offline oracle: a peer that does not hold the secret gets a random nonce and then a
//! closed connection, nothing it could test guesses of the secret against. (The server's proof
//! at step 4 goes only to a client that has just proved it holds the secret.) A passive
//! observer of a plaintext connection does see both proofs: the secret must be random and at
//! least 128 bits long (`RpcConfig`'s "The shared secret"), or the transport must run inside
//! TLS.
//!
//! A server that meets a client of another version still sends its hello (step 2), so that the
//! client can name the cause; a client of version 1 (whose server proved first) then reads the
//! close as a failed connection.
//!
//! Session keys: with a secret, each direction of the connection gets a key of its own,
//! `HMAC(secret, "session c2s" ‖ cn ‖ sn)` (client to server) and
//! `HMAC(secret, "session s2c" ‖ cn ‖ sn)`, with which every write after the handshake (a
//! record of frames) carries a MAC over its sequence number and bytes (see
//! [`crate::conn::FrameMac`]). Without a secret
//! there are no keys and no MACs: the empty key would protect nothing.
//!
//! Fresh nonces on both sides make every proof single-use (no replay), the role labels stop a
//! proof from being reflected back, and the comparisons are constant-time (`hmac`'s `verify`).
//! With no secret configured both sides use the empty key: the handshake then only checks the
//! protocol version, and a side with a secret refuses a side without one.

use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::conn::FrameMac;

/// The protocol version; bumped on every change to [`crate::frame`] or to this handshake.
pub(crate) const PROTOCOL_VERSION: u8 = 2;

const MAGIC: [u8; 4] = *b"CRPC";
const NONCE_LEN: usize = 32;
const PROOF_LEN: usize = 32;
/// A hello, either way: `MAGIC`, version, nonce.
const HELLO_LEN: usize = MAGIC.len() + 1 + NONCE_LEN;
/// The server's answer to a good proof, ahead of its own proof.
const ACCEPTED: u8 = 1;
/// The server's answer to a good proof when it has no room for another connection.
const BUSY: u8 = 2;

type HmacSha256 = Hmac<Sha256>;

/// Why a handshake failed. No variant holds the secret or a value derived from it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    /// The socket failed or closed.
    #[error("i/o error during the handshake: {0}")]
    Io(#[from] io::Error),
    /// The peer does not speak this protocol or version.
    #[error("the peer does not speak this protocol (version {PROTOCOL_VERSION})")]
    Protocol,
    /// The peer's proof does not match: it does not hold the shared secret.
    #[error(
        "the peer does not hold this side's shared secret (CLUSTER_RPC_SECRET must be the same on \
         every runner and client)"
    )]
    BadProof,
    /// The server closed the connection right after this side's proof, as it does when it
    /// refuses it.
    #[error(
        "the peer refused this side's proof: the two do not hold the same shared secret \
         (CLUSTER_RPC_SECRET must be the same on every runner and client)"
    )]
    ProofRefused,
    /// The server accepted the proof but serves as many connections as it may.
    #[error("the server serves as many connections as it may (CLUSTER_RPC_MAX_CONNECTIONS)")]
    Busy,
    /// No randomness for the nonce.
    #[error("no randomness for the handshake nonce: {0}")]
    Random(String),
    /// The peer closed the connection before it sent a byte: a runner's probe (or a port
    /// scan), not a peer that failed.
    #[error("the peer closed the connection before its handshake")]
    ClosedEarly,
}

impl HandshakeError {
    /// Whether the peer and this side do not accept each other (another secret, another
    /// protocol): a configuration error, which trying again does not fix.
    pub(crate) fn is_refusal(&self) -> bool {
        match self {
            HandshakeError::Protocol | HandshakeError::BadProof | HandshakeError::ProofRefused => {
                true
            }
            HandshakeError::Io(_)
            | HandshakeError::Busy
            | HandshakeError::Random(_)
            | HandshakeError::ClosedEarly => false,
        }
    }
}

fn nonce() -> Result<[u8; NONCE_LEN], HandshakeError> {
    let mut nonce = [0_u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|error| HandshakeError::Random(error.to_string()))?;
    Ok(nonce)
}

fn hello(nonce: &[u8; NONCE_LEN]) -> [u8; HELLO_LEN] {
    let mut hello = [0_u8; HELLO_LEN];
    hello[..MAGIC.len()].copy_from_slice(&MAGIC);
    hello[MAGIC.len()] = PROTOCOL_VERSION;
    hello[MAGIC.len() + 1..].copy_from_slice(nonce);
    hello
}

/// The frame MACs of a connection's two directions, derived from the handshake.
pub(crate) struct SessionKeys {
    /// Client to server: the client's writer seals with it, the server's reader checks.
    pub(crate) client_to_server: FrameMac,
    /// Server to client.
    pub(crate) server_to_client: FrameMac,
}

/// The session keys of a handshake with `secret`, or `None` without a secret.
fn session(secret: &[u8], client: &[u8], server: &[u8]) -> Option<SessionKeys> {
    if secret.is_empty() {
        return None;
    }
    let key = |role: &[u8]| mac(secret, role, client, server).finalize().into_bytes();
    Some(SessionKeys {
        client_to_server: FrameMac::new(&key(b"session c2s")),
        server_to_client: FrameMac::new(&key(b"session s2c")),
    })
}

fn mac(secret: &[u8], role: &[u8], client: &[u8], server: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length, the empty key included.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| <HmacSha256 as Mac>::new(&Default::default()));
    mac.update(role);
    mac.update(client);
    mac.update(server);
    mac
}

/// The client side; returns the session keys (none without a secret). Not cancel safe; the
/// caller bounds it with the connect timeout.
pub(crate) async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
) -> Result<Option<SessionKeys>, HandshakeError> {
    let client_nonce = nonce()?;
    stream.write_all(&hello(&client_nonce)).await?;

    let mut answer = [0_u8; HELLO_LEN];
    stream.read_exact(&mut answer).await?;
    if answer[..MAGIC.len()] != MAGIC || answer[MAGIC.len()] != PROTOCOL_VERSION {
        return Err(HandshakeError::Protocol);
    }
    let server_nonce = &answer[MAGIC.len() + 1..];
    let proof = mac(secret, b"client", &client_nonce, server_nonce).finalize().into_bytes();
    stream.write_all(&proof).await?;

    let mut status = [0_u8; 1];
    match stream.read_exact(&mut status).await {
        Ok(_) => {}
        // The server closes without a word when it refuses the proof.
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(HandshakeError::ProofRefused);
        }
        Err(error) => return Err(HandshakeError::Io(error)),
    }
    match status[0] {
        ACCEPTED => {}
        BUSY => return Err(HandshakeError::Busy),
        _ => return Err(HandshakeError::Protocol),
    }
    let mut server_proof = [0_u8; PROOF_LEN];
    stream.read_exact(&mut server_proof).await?;
    mac(secret, b"server", &client_nonce, server_nonce)
        .verify_slice(&server_proof)
        .map_err(|_| HandshakeError::BadProof)?;
    Ok(session(secret, &client_nonce, server_nonce))
}

/// The server side. Once the client has proved itself, `admit` takes a slot for the connection
/// (`None`: none is left, and the client is told so); the slot is returned, with the session
/// keys (none without a secret).
///
/// Not cancel safe; the caller bounds it with the handshake timeout.
pub(crate) async fn server<S: AsyncRead + AsyncWrite + Unpin, T>(
    stream: &mut S,
    secret: &[u8],
    admit: impl FnOnce() -> Option<T>,
) -> Result<(T, Option<SessionKeys>), HandshakeError> {
    let mut hello_in = [0_u8; HELLO_LEN];
    stream.read_exact(&mut hello_in).await?;
    if hello_in[..MAGIC.len()] != MAGIC {
        return Err(HandshakeError::Protocol);
    }
    let server_nonce = nonce()?;
    // Sent before the version is checked, so that a client of another version can name the
    // cause. Nothing in it depends on the secret.
    stream.write_all(&hello(&server_nonce)).await?;
    if hello_in[MAGIC.len()] != PROTOCOL_VERSION {
        return Err(HandshakeError::Protocol);
    }
    let client_nonce = &hello_in[MAGIC.len() + 1..];

    let mut client_proof = [0_u8; PROOF_LEN];
    stream.read_exact(&mut client_proof).await?;
    // A wrong proof closes the connection with nothing more sent.
    mac(secret, b"client", client_nonce, &server_nonce)
        .verify_slice(&client_proof)
        .map_err(|_| HandshakeError::BadProof)?;
    let Some(slot) = admit() else {
        // Best effort: the connection is closed either way.
        let _ = stream.write_all(&[BUSY]).await;
        return Err(HandshakeError::Busy);
    };
    let mut answer = [0_u8; 1 + PROOF_LEN];
    answer[0] = ACCEPTED;
    answer[1..].copy_from_slice(
        &mac(secret, b"server", client_nonce, &server_nonce).finalize().into_bytes(),
    );
    stream.write_all(&answer).await?;
    Ok((slot, session(secret, client_nonce, &server_nonce)))
}

#[cfg(test)]
mod tests {
    use super::{HandshakeError, client, server};

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    /// Both sides of a handshake over an in-memory pipe, the server admitting with `admit`.
    async fn shake(
        client_secret: &[u8],
        admit: Option<u32>,
    ) -> (Result<(), HandshakeError>, Result<u32, HandshakeError>) {
        let (mut near, mut far) = tokio::io::duplex(1024);
        let server = async move {
            let result = server(&mut far, SECRET, || admit).await;
            drop(far);
            result
        };
        let (client, server) = tokio::join!(client(&mut near, client_secret), server);
        (client.map(|_| ()), server.map(|(slot, _)| slot))
    }

    #[tokio::test]
    async fn a_proved_client_gets_the_slot_the_server_admits_it_with() {
        let (client, server) = shake(SECRET, Some(7)).await;
        assert!(client.is_ok(), "{client:?}");
        assert_eq!(server.unwrap(), 7);
    }

    /// With no slot left, a proved client hears that the server is busy: not a refusal, so the
    /// caller reports the runner unavailable rather than a secret mismatch.
    #[tokio::test]
    async fn a_server_with_no_slot_left_says_it_is_busy() {
        let (client, server) = shake(SECRET, None).await;
        assert!(matches!(client, Err(HandshakeError::Busy)), "{client:?}");
        assert!(!client.unwrap_err().is_refusal());
        assert!(matches!(server, Err(HandshakeError::Busy)), "{server:?}");
    }

    /// A wrong proof is never admitted, and the client hears a refusal.
    #[tokio::test]
    async fn a_wrong_proof_takes_no_slot() {
        let (client, server) = shake(b"another-secret-0123456789abcdef0", Some(7)).await;
        assert!(matches!(client, Err(HandshakeError::ProofRefused)), "{client:?}");
        assert!(matches!(server, Err(HandshakeError::BadProof)), "{server:?}");
    }
}
