//! Who may call the gateway: the [`Authenticator`] hook, which runs before every route, and
//! [`BearerToken`], a ready one.

use std::path::Path;

use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cluster_core::ConfigError;
use cluster_core::future::BoxFuture;

use crate::token::{Tokens, bearer_credentials};

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
pub const BEARER_TOKEN_CHARS_MIN: usize = crate::token::TOKEN_CHARS_MIN;

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
    tokens: Tokens,
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
        Ok(BearerToken { tokens: Tokens::any_of([token], TOKEN_VARIABLE)? })
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
        Ok(BearerToken { tokens: Tokens::from_file(path, TOKEN_FILE_VARIABLE)? })
    }

    /// The bearer token of `tokens`.
    pub(crate) fn from_tokens(tokens: Tokens) -> BearerToken {
        BearerToken { tokens }
    }
}

/// The variables a bearer token comes from.
pub(super) const TOKEN_VARIABLE: &str = "CLUSTER_HTTP_BEARER_TOKEN";
pub(super) const TOKEN_FILE_VARIABLE: &str = "CLUSTER_HTTP_BEARER_TOKEN_FILE";

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BearerToken").field("tokens", &self.tokens).finish()
    }
}

impl Authenticator for BearerToken {
    fn authenticate<'a>(&'a self, request: &'a Parts) -> BoxFuture<'a, Result<(), Response>> {
        let given = request
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| bearer_credentials(value.as_bytes()));
        let accepted = given.is_some_and(|given| self.tokens.accepts(given));
        Box::pin(async move { if accepted { Ok(()) } else { Err(unauthorized()) } })
    }
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

    #[test]
    fn a_bearer_token_is_checked_and_never_shown() {
        let token = "0123456789abcdef0123456789abcdef";
        let tokens = BearerToken::new(token).unwrap();
        assert!(tokens.tokens.accepts(token.as_bytes()));
        assert!(!format!("{tokens:?}").contains("0123"), "{tokens:?}");
        let error = BearerToken::new("short").unwrap_err();
        assert_eq!(error.key(), "CLUSTER_HTTP_BEARER_TOKEN");
        assert!(!error.to_string().contains("short"), "{error}");
    }
}
