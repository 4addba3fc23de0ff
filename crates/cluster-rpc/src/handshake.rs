//! The connection handshake: a mutual HMAC-SHA256 challenge–response over a shared secret.
//!
//! It runs on the raw socket before any frame is read, with fixed-size messages, so a peer
//! without the secret is refused before a single message frame is decoded:
//!
//! 1. client → server: `MAGIC`, [`PROTOCOL_VERSION`], a 32-byte random client nonce;
//! 2. server → client: `MAGIC`, version, a 32-byte random server nonce and
//!    `HMAC(secret, "server" ‖ client nonce ‖ server nonce)`;
//! 3. the client checks the server's proof (so it never talks to an impostor), then sends
//!    `HMAC(secret, "client" ‖ client nonce ‖ server nonce)`; when the server's proof is wrong
//!    it sends [`REFUSED`] instead, and closes;
//! 4. the server checks it and answers one byte, [`ACCEPTED`]; otherwise it closes.
//!
//! [`REFUSED`] (32 zero bytes, which no proof equals in practice) lets the server say why in its
//! log: without it, the server of a client with another secret only saw the connection end.
//! It carries nothing derived from the secret. A server of an earlier build reads it as a wrong
//! proof, and a client of an earlier build closes without it, which the server reports as a
//! likely secret mismatch; so the protocol version stays 1.
//!
//! Fresh nonces on both sides make every proof single-use (no replay), the role labels stop a
//! proof from being reflected back, and the comparison is constant-time (`hmac`'s `verify`).
//! With no secret configured both sides use the empty key: the handshake then only checks the
//! protocol version, and a side with a secret refuses a side without one.

use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The protocol version; bumped on every change to [`crate::frame`].
pub(crate) const PROTOCOL_VERSION: u8 = 1;

const MAGIC: [u8; 4] = *b"CRPC";
const NONCE_LEN: usize = 32;
const PROOF_LEN: usize = 32;
const ACCEPTED: u8 = 1;
/// What a client sends in place of its proof after refusing the server's.
const REFUSED: [u8; PROOF_LEN] = [0; PROOF_LEN];

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
    /// The peer refused this side's proof: it does not hold the same shared secret.
    #[error(
        "the peer refused this side's proof: the two do not hold the same shared secret \
         (CLUSTER_RPC_SECRET must be the same on every runner and client)"
    )]
    ProofRefused,
    /// The peer closed the connection right after this side's proof, as a client of an earlier
    /// build does when it refuses it.
    #[error(
        "the peer closed the connection after this side's proof: it likely does not hold the \
         same shared secret (CLUSTER_RPC_SECRET must be the same on every runner and client)"
    )]
    ClosedAfterProof,
    /// No randomness for the nonce.
    #[error("no randomness for the handshake nonce: {0}")]
    Random(String),
}

impl HandshakeError {
    /// Whether the peer and this side do not accept each other (another secret, another
    /// protocol): a configuration error, which trying again does not fix.
    pub(crate) fn is_refusal(&self) -> bool {
        match self {
            HandshakeError::Protocol
            | HandshakeError::BadProof
            | HandshakeError::ProofRefused
            | HandshakeError::ClosedAfterProof => true,
            HandshakeError::Io(_) | HandshakeError::Random(_) => false,
        }
    }
}

fn nonce() -> Result<[u8; NONCE_LEN], HandshakeError> {
    let mut nonce = [0_u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|error| HandshakeError::Random(error.to_string()))?;
    Ok(nonce)
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

/// The client side. Not cancel safe; the caller bounds it with the connect timeout.
pub(crate) async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
) -> Result<(), HandshakeError> {
    let client_nonce = nonce()?;
    let mut hello = Vec::with_capacity(MAGIC.len() + 1 + NONCE_LEN);
    hello.extend_from_slice(&MAGIC);
    hello.push(PROTOCOL_VERSION);
    hello.extend_from_slice(&client_nonce);
    stream.write_all(&hello).await?;

    let mut answer = [0_u8; 4 + 1 + NONCE_LEN + PROOF_LEN];
    stream.read_exact(&mut answer).await?;
    if answer[..4] != MAGIC || answer[4] != PROTOCOL_VERSION {
        return Err(HandshakeError::Protocol);
    }
    let server_nonce = &answer[5..5 + NONCE_LEN];
    let verified =
        mac(secret, b"server", &client_nonce, server_nonce).verify_slice(&answer[5 + NONCE_LEN..]);
    if verified.is_err() {
        // Tells the server why, so that its log names the cause; best effort.
        let _ = stream.write_all(&REFUSED).await;
        let _ = stream.flush().await;
        return Err(HandshakeError::BadProof);
    }
    let proof = mac(secret, b"client", &client_nonce, server_nonce).finalize().into_bytes();
    stream.write_all(&proof).await?;
    let mut accepted = [0_u8; 1];
    stream.read_exact(&mut accepted).await?;
    if accepted[0] != ACCEPTED {
        return Err(HandshakeError::Protocol);
    }
    Ok(())
}

/// The server side. Not cancel safe; the caller bounds it with the connect timeout.
pub(crate) async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
) -> Result<(), HandshakeError> {
    let mut hello = [0_u8; 4 + 1 + NONCE_LEN];
    stream.read_exact(&mut hello).await?;
    if hello[..4] != MAGIC || hello[4] != PROTOCOL_VERSION {
        return Err(HandshakeError::Protocol);
    }
    let client_nonce = &hello[5..];
    let server_nonce = nonce()?;
    let proof = mac(secret, b"server", client_nonce, &server_nonce).finalize().into_bytes();
    let mut answer = Vec::with_capacity(4 + 1 + NONCE_LEN + PROOF_LEN);
    answer.extend_from_slice(&MAGIC);
    answer.push(PROTOCOL_VERSION);
    answer.extend_from_slice(&server_nonce);
    answer.extend_from_slice(&proof);
    stream.write_all(&answer).await?;

    let mut client_proof = [0_u8; PROOF_LEN];
    match stream.read_exact(&mut client_proof).await {
        Ok(_) => {}
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(HandshakeError::ClosedAfterProof);
        }
        Err(error) => return Err(HandshakeError::Io(error)),
    }
    if client_proof == REFUSED {
        return Err(HandshakeError::ProofRefused);
    }
    mac(secret, b"client", client_nonce, &server_nonce)
        .verify_slice(&client_proof)
        .map_err(|_| HandshakeError::BadProof)?;
    stream.write_all(&[ACCEPTED]).await?;
    Ok(())
}
