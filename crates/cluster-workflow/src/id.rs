//! Identity: execution ids, activity idempotency keys and deferred tokens, computed exactly
//! as the reference does (`effect/src/workflow/Workflow.ts`, `effect/src/workflow/Activity.ts`,
//! `effect/src/workflow/DurableDeferred.ts`), so that an execution started by one implementation is
//! found by the other.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The id of one workflow execution: 32 lowercase hex characters.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExecutionId(Arc<str>);

impl Serialize for ExecutionId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ExecutionId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(ExecutionId::from_raw)
    }
}

impl ExecutionId {
    /// The execution id of the workflow `name` for the idempotency key `key`:
    /// `hex(SHA-256(len16(name) ":" name ":" key))[..32]`, where `len16` is the name's length
    /// in UTF-16 code units (a JavaScript string length).
    pub fn derive(name: &str, key: &str) -> ExecutionId {
        let input = format!("{}:{name}:{key}", name.encode_utf16().count());
        ExecutionId(hash_digest(&input).into())
    }

    /// An execution id read from elsewhere (a token, a stored payload), taken as it is.
    pub fn from_raw(id: impl Into<Arc<str>>) -> ExecutionId {
        ExecutionId(id.into())
    }

    /// The id's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ExecutionId({})", self.0)
    }
}

/// The reference's `makeHashDigest`: lowercase hex of the first 16 bytes of SHA-256 of the
/// UTF-8 text.
pub fn hash_digest(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let mut out = String::with_capacity(32);
    for byte in &digest[..16] {
        out.push(hex_digit(byte >> 4));
        out.push(hex_digit(byte & 0x0f));
    }
    out
}

fn hex_digit(nibble: u8) -> char {
    char::from(if nibble < 10 { b'0' + nibble } else { b'a' + nibble - 10 })
}

/// An idempotency key for an external side effect made by an activity (the reference's
/// `Activity.idempotencyKey`): stable across replays and owners, distinct per execution and
/// activity name, and per attempt when `attempt` is given.
pub fn activity_idempotency_key(
    execution_id: &ExecutionId,
    name: &str,
    attempt: Option<u32>,
) -> String {
    match attempt {
        Some(attempt) => hash_digest(&format!("{execution_id}-{attempt}-{name}")),
        None => hash_digest(&format!("{execution_id}-{name}")),
    }
}

/// Where a deferred lives: the workflow's name, the execution and the deferred's name. Anyone
/// holding a token can complete the deferred, from any process that runs an engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    /// The workflow's name.
    pub workflow: String,
    /// The execution.
    pub execution_id: ExecutionId,
    /// The deferred's name.
    pub deferred: String,
}

/// A token that cannot be read, or (signed) whose signature does not match.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid token: {0}")]
pub struct TokenError(String);

impl TokenError {
    pub(crate) fn new(why: impl Into<String>) -> TokenError {
        TokenError(why.into())
    }
}

impl Token {
    /// The token's text: unpadded base64url of the JSON array
    /// `[workflow, execution id, deferred]`.
    pub fn encode(&self) -> String {
        let json =
            serde_json::to_string(&(&self.workflow, self.execution_id.as_str(), &self.deferred))
                .unwrap_or_default();
        base64url_encode(json.as_bytes())
    }

    /// Reads a token's text.
    ///
    /// # Errors
    ///
    /// [`TokenError`] when it is not unpadded base64url of a three-string JSON array.
    pub fn parse(text: &str) -> Result<Token, TokenError> {
        let bytes = base64url_decode(text).ok_or_else(|| TokenError("not base64url".into()))?;
        let (workflow, execution_id, deferred): (String, String, String) =
            serde_json::from_slice(&bytes).map_err(|error| TokenError(error.to_string()))?;
        Ok(Token { workflow, execution_id: ExecutionId::from_raw(execution_id), deferred })
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

pub(crate) fn base64url_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let sextets = [n >> 18, n >> 12, n >> 6, n];
        for sextet in &sextets[..=chunk.len()] {
            out.push(char::from(ALPHABET[(sextet & 63) as usize]));
        }
    }
    out
}

pub(crate) fn base64url_decode(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| ALPHABET.iter().position(|&a| a == c).and_then(|p| u32::try_from(p).ok());
    let bytes = text.as_bytes();
    if bytes.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3 + 2);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c)? << (18 - 6 * i);
        }
        let produced = chunk.len() - 1;
        for i in 0..produced {
            out.push(u8::try_from((n >> (16 - 8 * i)) & 0xff).ok()?);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_ids_match_the_reference_vectors() {
        assert_eq!(
            ExecutionId::derive("EmailWorkflow", "test-email-1").as_str(),
            "8f86cb6dac9f9bc041a2165d105c1362"
        );
        // The name's length counts UTF-16 code units: "Wörkflow🚀" is 10.
        assert_eq!(
            ExecutionId::derive("Wörkflow🚀", "x").as_str(),
            "41da6b54c7b86fda51e64423e310a2fe"
        );
    }

    #[test]
    fn activity_keys_match_the_reference_vectors() {
        let id = ExecutionId::from_raw("8f86cb6dac9f9bc041a2165d105c1362");
        assert_eq!(
            activity_idempotency_key(&id, "charge", None),
            "62b322c1e82738b13b9e3806f3f2e8a2"
        );
        assert_eq!(
            activity_idempotency_key(&id, "charge", Some(3)),
            "ebac8778257a656649510fb51886b636"
        );
        // DurableQueue item ids are activity keys of `DurableQueue/<queue>/<key>`.
        assert_eq!(
            activity_idempotency_key(&id, "DurableQueue/ApiQueue/api-call-1", None),
            "37a278f07b3ae8f2ef9488fec8df2c11"
        );
    }

    #[test]
    fn tokens_match_the_reference_and_round_trip() {
        let token = Token {
            workflow: "EmailWorkflow".into(),
            execution_id: ExecutionId::from_raw("8f86cb6dac9f9bc041a2165d105c1362"),
            deferred: "EmailTrigger".into(),
        };
        let text = token.encode();
        assert_eq!(
            text,
            "WyJFbWFpbFdvcmtmbG93IiwiOGY4NmNiNmRhYzlmOWJjMDQxYTIxNjVkMTA1YzEzNjIiLCJFbWFpbFRyaWdnZXIiXQ"
        );
        assert_eq!(Token::parse(&text), Ok(token));
        for bad in ["", "a", "!!!!", "WyJhIl0", "e30"] {
            assert!(Token::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn base64url_round_trips_every_length() {
        for len in 0..40u8 {
            let bytes: Vec<u8> = (0..len).map(|i| i.wrapping_mul(37).wrapping_add(250)).collect();
            let text = base64url_encode(&bytes);
            assert!(!text.contains('='));
            assert_eq!(base64url_decode(&text), Some(bytes));
        }
    }
}
