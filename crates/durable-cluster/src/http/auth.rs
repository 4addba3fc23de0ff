//! Who may call the gateway: the [`Authenticator`] hook, which runs before every route, and
//! [`BearerToken`], a ready one.

use std::path::Path;

use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cluster_core::ConfigError;
use cluster_core::future::BoxFuture;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Decides whether a request may reach the gateway's routes; set with
/// [`HttpGateway::authenticator`](super::HttpGateway::authenticator).
///
/// It runs on every request the gateway receives, before routing: entity, workflow and
/// deferred routes, the OpenAPI document and unknown paths alike. It sees the request's head
/// (method, path, headers), not its body.
pub trait Authenticator: Send + Sync + 'static {
    /// `Ok(())` lets the request through; `Err(answer)` answers it instead (401, 403, ...).
    ///
    /// # Errors
    ///
    /// The answer that refuses the request.
    fn authenticate<'a>(&'a self, request: &'a Parts) -> BoxFuture<'a, Result<(), Response>>;
}

/// The fewest characters of a bearer token: 32, the hexadecimal form of 128 random bits
/// (`openssl rand -hex 16`).
pub const BEARER_TOKEN_CHARS_MIN: usize = 32;

/// The most characters of a bearer token, and of the tokens one file may hold.
const BEARER_TOKEN_CHARS_MAX: usize = 4096;
const BEARER_TOKENS_MAX: usize = 16;

/// An [`Authenticator`] that lets through the requests whose `Authorization` header is
/// `Bearer <token>` with one of its tokens (several during a rotation); the others are answered
/// 401 with `WWW-Authenticate: Bearer`.
///
/// A token has at least [`BEARER_TOKEN_CHARS_MIN`] characters, all visible ASCII (no space).
/// Only the tokens' SHA-256 digests are kept, and a request's token is compared with each of
/// them in constant time, so the time an answer takes says nothing about how much of a token
/// was right. Its `Debug` output shows how many tokens it holds, never one of them.
#[derive(Clone)]
pub struct BearerToken {
    digests: Vec<[u8; 32]>,
}

impl BearerToken {
    /// A bearer token.
    ///
    /// # Errors
    ///
    /// The token is shorter than [`BEARER_TOKEN_CHARS_MIN`] characters, or holds a character
    /// other than visible ASCII; the error names `CLUSTER_HTTP_BEARER_TOKEN` and never shows
    /// the token.
    pub fn new(token: &str) -> Result<BearerToken, ConfigError> {
        BearerToken::any_of([token], TOKEN_VARIABLE)
    }

    /// The tokens of a file (`CLUSTER_HTTP_BEARER_TOKEN_FILE`): one per line; blank lines and
    /// lines that start with `#` are skipped. Several tokens let a rotation add the new one
    /// before the callers switch, then remove the old one.
    ///
    /// # Errors
    ///
    /// The file cannot be read, holds no token or more than 16, or a token is refused as by
    /// [`BearerToken::new`].
    pub fn from_file(path: &Path) -> Result<BearerToken, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| {
            ConfigError::new(TOKEN_FILE_VARIABLE, &shown, format!("cannot be read: {error}"))
        })?;
        let tokens =
            text.lines().map(str::trim).filter(|line| !line.is_empty() && !line.starts_with('#'));
        BearerToken::any_of(tokens, TOKEN_FILE_VARIABLE)
            .map_err(|error| ConfigError::new(TOKEN_FILE_VARIABLE, &shown, error.reason()))
    }

    fn any_of<'a>(
        tokens: impl IntoIterator<Item = &'a str>,
        variable: &str,
    ) -> Result<BearerToken, ConfigError> {
        let refused = |reason: &str| ConfigError::new(variable, "<redacted>", reason);
        let mut digests = Vec::new();
        for token in tokens {
            let chars = token.chars().count();
            if chars < BEARER_TOKEN_CHARS_MIN {
                return Err(refused(
                    "a bearer token needs at least 32 characters, such as the output of `openssl rand -hex 16`",
                ));
            }
            if chars > BEARER_TOKEN_CHARS_MAX {
                return Err(refused("a bearer token has at most 4096 characters"));
            }
            if !token.bytes().all(|byte| byte.is_ascii_graphic()) {
                return Err(refused(
                    "a bearer token is visible ASCII only (no space, no control character)",
                ));
            }
            digests.push(Sha256::digest(token.as_bytes()).into());
        }
        if digests.is_empty() {
            return Err(refused("holds no bearer token"));
        }
        if digests.len() > BEARER_TOKENS_MAX {
            return Err(refused("holds more than 16 bearer tokens"));
        }
        Ok(BearerToken { digests })
    }

    /// Whether `given` is one of the tokens, in time that depends on neither.
    fn accepts(&self, given: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(given).into();
        let accepted = self
            .digests
            .iter()
            .fold(subtle::Choice::from(0), |found, expected| found | expected.ct_eq(&digest));
        accepted.into()
    }
}

/// The variables a bearer token comes from.
pub(super) const TOKEN_VARIABLE: &str = "CLUSTER_HTTP_BEARER_TOKEN";
pub(super) const TOKEN_FILE_VARIABLE: &str = "CLUSTER_HTTP_BEARER_TOKEN_FILE";

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BearerToken").field("tokens", &self.digests.len()).finish()
    }
}

impl Authenticator for BearerToken {
    fn authenticate<'a>(&'a self, request: &'a Parts) -> BoxFuture<'a, Result<(), Response>> {
        let given = request
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| bearer_credentials(value.as_bytes()));
        let accepted = given.is_some_and(|given| self.accepts(given));
        Box::pin(async move { if accepted { Ok(()) } else { Err(unauthorized()) } })
    }
}

/// The token of an `Authorization: Bearer <token>` value (the scheme in any case).
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let scheme = value.get(..7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| value[7..].trim_ascii())
}

/// 401 with `WWW-Authenticate: Bearer` and an empty body.
fn unauthorized() -> Response {
    let mut response = StatusCode::UNAUTHORIZED.into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn a_bearer_token_is_checked_and_never_shown() {
        let tokens = BearerToken::new(TOKEN).unwrap();
        assert!(tokens.accepts(TOKEN.as_bytes()));
        assert!(!tokens.accepts(b"0123456789abcdef0123456789abcdeX"));
        assert!(!tokens.accepts(b""));
        assert!(!format!("{tokens:?}").contains("0123"), "{tokens:?}");
        assert_eq!(bearer_credentials(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"Basic abc"), None);
        for short in ["", "short", &TOKEN[1..]] {
            let error = BearerToken::new(short).unwrap_err();
            assert_eq!(error.key(), "CLUSTER_HTTP_BEARER_TOKEN");
            assert!(!error.to_string().contains("short"), "{error}");
        }
        let spaced = format!("{TOKEN} x");
        assert!(BearerToken::new(&spaced).is_err());
    }
}
