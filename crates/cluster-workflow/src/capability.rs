//! Capabilities: deferred tokens and execution handles that carry a MAC under a key the
//! application's processes share ([`TokenKey`]), so that holding one is what grants the right
//! to complete a deferred, or to resume, poll or interrupt an execution.
//!
//! What is public and what is secret:
//!
//! - An execution id is not a secret: it is a hash of the workflow's name and the payload's
//!   idempotency key (the reference's `Workflow.executionId`), which anyone who knows the
//!   business key can compute.
//! - A plain [`Token`] is not a secret either: it is base64url of `[workflow, execution id,
//!   deferred]` (the reference's `DurableDeferred.token`), which workflows store and TypeScript
//!   runners read. It names a deferred; it grants nothing.
//! - A signed token ([`TokenKey::sign`]) and a signed execution handle
//!   ([`TokenKey::sign_execution`]) are capabilities: hand them only to whoever may act, over a
//!   channel you trust, as you would a password reset link.
//! - The [`TokenKey`] is a secret: whoever has it can make every capability.
//!
//! A signed text is the plain text, a `.`, and a 128-bit HMAC-SHA256 tag (unpadded base64url)
//! over the text and the kind of capability, so a deferred token never passes for an execution
//! handle nor the other way round. The base64url alphabet has no `.`, so the split is exact.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::id::{ExecutionId, Token, TokenError, base64url_decode, base64url_encode};

/// The fewest bytes of key material a [`TokenKey`] takes: 128 bits.
pub const TOKEN_KEY_BYTES_MIN: usize = 16;

/// The bytes of a signature kept in a capability: 128 bits.
const TAG_BYTES: usize = 16;

/// The key that signs and checks capabilities. Every process that makes or checks them needs
/// the same one; keep it as you keep a database password (an environment variable or a secret
/// store), and make it with `openssl rand -hex 32`.
///
/// Its `Debug` shows nothing of the key.
#[derive(Clone)]
pub struct TokenKey {
    key: Vec<u8>,
}

impl fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

/// Why key material cannot make a [`TokenKey`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenKeyError {
    /// Fewer bytes than [`TOKEN_KEY_BYTES_MIN`].
    #[error(
        "a token key needs at least {TOKEN_KEY_BYTES_MIN} bytes (128 bits) of key material, got \
         {0}: make one with `openssl rand -hex 32`"
    )]
    TooShort(usize),
    /// Text that is not hexadecimal.
    #[error("a token key's text must be hexadecimal (as `openssl rand -hex 32` prints)")]
    NotHex,
}

impl TokenKey {
    /// A key from raw key material, at least [`TOKEN_KEY_BYTES_MIN`] bytes.
    ///
    /// # Errors
    ///
    /// [`TokenKeyError::TooShort`] for less material.
    pub fn new(material: &[u8]) -> Result<TokenKey, TokenKeyError> {
        if material.len() < TOKEN_KEY_BYTES_MIN {
            return Err(TokenKeyError::TooShort(material.len()));
        }
        Ok(TokenKey { key: material.to_vec() })
    }

    /// A key from hexadecimal text (surrounding whitespace ignored), such as
    /// `openssl rand -hex 32` prints: at least 32 hex digits.
    ///
    /// # Errors
    ///
    /// [`TokenKeyError::NotHex`] or [`TokenKeyError::TooShort`].
    pub fn from_hex(text: &str) -> Result<TokenKey, TokenKeyError> {
        let text = text.trim();
        if !text.len().is_multiple_of(2) {
            return Err(TokenKeyError::NotHex);
        }
        let digit = |c: u8| char::from(c).to_digit(16).and_then(|d| u8::try_from(d).ok());
        let material = text
            .as_bytes()
            .chunks(2)
            .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
            .collect::<Option<Vec<u8>>>()
            .ok_or(TokenKeyError::NotHex)?;
        TokenKey::new(&material)
    }

    /// The capability to complete the deferred `token` names: `<token>.<tag>`.
    pub fn sign(&self, token: &Token) -> String {
        let text = token.encode();
        let tag = self.tag(Kind::Deferred, &text);
        format!("{text}.{tag}")
    }

    /// The deferred a signed token names, if its tag is this key's.
    ///
    /// # Errors
    ///
    /// [`TokenError`] when the text is not a signed token, or its tag does not match (a plain
    /// or forged token, another key's, or an execution handle).
    pub fn verify(&self, signed: &str) -> Result<Token, TokenError> {
        let text = self.checked(Kind::Deferred, signed)?;
        Token::parse(text)
    }

    /// The capability to resume, poll or interrupt the execution `execution_id` of
    /// `workflow`: `<base64url of [workflow, execution id]>.<tag>`.
    pub fn sign_execution(&self, workflow: &str, execution_id: &ExecutionId) -> String {
        let json = serde_json::to_string(&(workflow, execution_id.as_str())).unwrap_or_default();
        let text = base64url_encode(json.as_bytes());
        let tag = self.tag(Kind::Execution, &text);
        format!("{text}.{tag}")
    }

    /// The workflow and execution a signed execution handle names, if its tag is this key's.
    ///
    /// # Errors
    ///
    /// [`TokenError`] when the text is not a signed handle or its tag does not match.
    pub fn verify_execution(&self, signed: &str) -> Result<(String, ExecutionId), TokenError> {
        let text = self.checked(Kind::Execution, signed)?;
        let bytes = base64url_decode(text).ok_or_else(|| TokenError::new("not base64url"))?;
        let (workflow, execution_id): (String, String) =
            serde_json::from_slice(&bytes).map_err(|error| TokenError::new(error.to_string()))?;
        Ok((workflow, ExecutionId::from_raw(execution_id)))
    }

    fn mac(&self, kind: Kind, text: &str) -> Hmac<Sha256> {
        // The key has at least 16 bytes; HMAC takes a key of any length.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        mac.update(kind.domain().as_bytes());
        mac.update(&[0]);
        mac.update(text.as_bytes());
        mac
    }

    fn tag(&self, kind: Kind, text: &str) -> String {
        let tag = self.mac(kind, text).finalize().into_bytes();
        base64url_encode(&tag[..TAG_BYTES])
    }

    /// The text of `signed` once its tag is checked (in constant time).
    fn checked<'a>(&self, kind: Kind, signed: &'a str) -> Result<&'a str, TokenError> {
        let (text, tag) =
            signed.rsplit_once('.').ok_or_else(|| TokenError::new("not signed (no tag)"))?;
        let tag = base64url_decode(tag)
            .filter(|tag| tag.len() == TAG_BYTES)
            .ok_or_else(|| TokenError::new("a malformed tag"))?;
        self.mac(kind, text)
            .verify_truncated_left(&tag)
            .map_err(|_| TokenError::new("its signature does not match this key"))?;
        Ok(text)
    }
}

/// What a capability grants; part of what its tag signs.
#[derive(Clone, Copy)]
enum Kind {
    Deferred,
    Execution,
}

impl Kind {
    fn domain(self) -> &'static str {
        match self {
            Kind::Deferred => "durable-cluster/deferred-token/v1",
            Kind::Execution => "durable-cluster/execution-handle/v1",
        }
    }
}

#[cfg(test)]
mod tests;
