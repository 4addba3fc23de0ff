//! HTTP ingress (feature `http`): entities called over HTTP, wire-compatible with the reference's
//! `EntityProxy.toHttpApiGroup` + `EntityProxyServer.layerHttpApi`
//! (`effect/src/cluster/EntityProxy.ts`, `effect/src/cluster/EntityProxyServer.ts`), so that a
//! client made with effect's `HttpApiClient` from the reference's definition works unchanged.
//!
//! [`HttpGateway`] builds an [`axum::Router`] from registered entity types. It runs on a runner
//! or on a client-only process (a stateless gateway in front of the cluster). The answers follow
//! the reference's (its golden answers are in `crates/durable-cluster/tests/fixtures/http/`):
//!
//! - `POST /{tag in lowercase}/{entityId}` sends the request and answers 200 with the success
//!   as JSON (a void success: 200 with an empty body).
//! - `POST /{tag in lowercase}/{entityId}/discard` sends it without waiting: 204.
//! - The body is the request's payload as JSON; an empty body is `null` (a request without
//!   fields); an array is refused (the reference's payloads are structs). A body that does not decode as the request type answers 400 with the decoding
//!   error (the reference's body is empty; its client reads the status only).
//! - The request type's own error answers 500 with the error's JSON, unless
//!   [`HttpGateway::error_status`] gives its `_tag` another status (the reference's
//!   `httpApiStatus` annotation).
//! - `MailboxFull`, `AlreadyProcessingMessage`, `PersistenceError` and
//!   `EntityNotAssignedToRunner` answer 500 with their tagged JSON (the last one not on a discard
//!   route, as in the reference). A defect answers 500 with an empty body: it is logged, never
//!   shown.
//! - Paths match without regard to case; duplicate and trailing slashes are ignored; the entity
//!   id is percent-decoded and at most 100 characters. Anything else (another method, another
//!   path, the discard route of a streaming request type) answers 404 with an empty body.
//! - A streaming request type answers 200 and its items as NDJSON or Server-Sent Events, with
//!   backpressure (a format of this gateway's own: the reference's proxy has none; see
//!   `http/stream.rs`).
//! - A request without the JSON content type (`application/json`, parameters allowed) answers
//!   415, also without a content type at all (the reference reads that as JSON): a browser's
//!   `no-cors` request from another site cannot send JSON, so it cannot change state here.
//! - An entity id, an execution id or a deferred's name with a control character answers 400.
//! - A body over the limit answers 413; a body not read within `body_read_timeout` 408; a call
//!   past the request timeout 504.
//! - `GET /openapi.json` answers the OpenAPI document of the routes ([`HttpGateway::openapi`]).
//!
//! Authentication: an [`Authenticator`] ([`HttpGateway::authenticator`], such as
//! [`BearerToken`]) runs before every route. [`serve`] serves a router within
//! [`ServerLimits`](crate::ServerLimits) (connections, header and idle timeouts), and
//! [`HttpConfig::from_env`] reads all of it from `CLUSTER_HTTP_*`. A prefix is axum's
//! `Router::nest`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson};
use cluster_core::{ClusterError, EntityAddress, EntityId};
use cluster_sharding::{Entity, ErasedError, ErasedRpc, Sharding};

mod auth;
mod openapi;
#[cfg(feature = "schemars")]
mod schemas;
mod stream;

pub use auth::{Authenticator, BEARER_TOKEN_CHARS_MIN, BearerToken};
#[cfg(feature = "workflow")]
pub use workflows::{WorkflowAccess, WorkflowAction};

/// The longest entity id a path may carry, in characters after decoding (the reference's
/// router's `maxParamLength`); also the longest execution id a workflow route accepts.
pub const MAX_ENTITY_ID_CHARS: usize = 100;

/// Limits of an [`HttpGateway`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct HttpOptions {
    /// The largest request body, in bytes; a larger one answers 413. Default 4 MiB.
    pub max_body_bytes: usize,
    /// How long a call may take before the gateway answers 504. A persisted request goes on
    /// and is answered in storage (the same call, with the same primary key, reads it); a
    /// volatile one is interrupted. Default 30 s.
    pub request_timeout: Duration,
    /// How long reading a request's whole body may take before the gateway answers 408 and
    /// closes the connection. Default 30 s.
    pub body_read_timeout: Duration,
}

impl Default for HttpOptions {
    fn default() -> HttpOptions {
        HttpOptions {
            max_body_bytes: 4 * 1024 * 1024,
            request_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
        }
    }
}

/// The gateway's settings from the environment ([`HttpConfig::from_env`]): its server's limits,
/// its options and its bearer token. Unset or empty variables keep the defaults.
///
/// | variable | meaning |
/// | --- | --- |
/// | `CLUSTER_HTTP_CONNECTIONS_MAX` | the most connections open at once (default 1024) |
/// | `CLUSTER_HTTP_HEADER_READ_TIMEOUT` | the time to send a request head, and the idle time of a kept-alive connection (default `30 seconds`) |
/// | `CLUSTER_HTTP_BODY_READ_TIMEOUT` | the time to send a whole body (default `30 seconds`) |
/// | `CLUSTER_HTTP_BODY_BYTES_MAX` | the largest body, in bytes (default 4194304) |
/// | `CLUSTER_HTTP_REQUEST_TIMEOUT` | the time a call may take (default `30 seconds`) |
/// | `CLUSTER_HTTP_BEARER_TOKEN` | the token every request must carry (`Authorization: Bearer ...`), at least 32 characters |
/// | `CLUSTER_HTTP_BEARER_TOKEN_FILE` | a file of such tokens, one per line (instead of the variable; for a rotation) |
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct HttpConfig {
    /// The server's limits (for [`serve`]).
    pub limits: crate::ServerLimits,
    /// The gateway's options ([`HttpGateway::options`]).
    pub options: HttpOptions,
    /// The bearer token(s) every request must carry, when set ([`HttpGateway::authenticator`]).
    pub bearer_token: Option<BearerToken>,
}

impl HttpConfig {
    /// The settings from the process environment.
    ///
    /// # Errors
    ///
    /// A variable is wrong (the error names it, and never shows a token), or both
    /// `CLUSTER_HTTP_BEARER_TOKEN` and `CLUSTER_HTTP_BEARER_TOKEN_FILE` are set.
    pub fn from_env() -> Result<HttpConfig, cluster_core::ConfigError> {
        HttpConfig::from_lookup(|name| std::env::var(name).ok())
    }

    /// The settings from `lookup` (a variable's value, or `None` when it is unset).
    ///
    /// # Errors
    ///
    /// As [`HttpConfig::from_env`].
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<HttpConfig, cluster_core::ConfigError> {
        use crate::server::{bounded_duration, set};
        let limits = crate::ServerLimits::gateway().with_lookup("CLUSTER_HTTP_", &lookup)?;
        let mut options = HttpOptions::default();
        if let Some(value) = set(&lookup, "CLUSTER_HTTP_BODY_READ_TIMEOUT") {
            options.body_read_timeout = bounded_duration("CLUSTER_HTTP_BODY_READ_TIMEOUT", &value)?;
        }
        if let Some(value) = set(&lookup, "CLUSTER_HTTP_REQUEST_TIMEOUT") {
            options.request_timeout = bounded_duration("CLUSTER_HTTP_REQUEST_TIMEOUT", &value)?;
        }
        if let Some(value) = set(&lookup, "CLUSTER_HTTP_BODY_BYTES_MAX") {
            options.max_body_bytes = value
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|bytes| (1..=1 << 30).contains(bytes))
                .ok_or_else(|| {
                    cluster_core::ConfigError::new(
                        "CLUSTER_HTTP_BODY_BYTES_MAX",
                        &value,
                        "is not a number of bytes from 1 to 1073741824, such as 4194304",
                    )
                })?;
        }
        let bearer_token = crate::token::Tokens::from_lookup(&lookup, auth::TOKEN_VARIABLE)?
            .map(BearerToken::from_tokens);
        Ok(HttpConfig { limits, options, bearer_token })
    }
}

/// Serves `app` (a gateway's router, or a router it is nested in) on `listener` within
/// `limits` until `shutdown` completes, then stops gracefully: no new connection, the requests
/// in progress answered within `limits.shutdown_timeout`, every connection closed.
///
/// Use it rather than `axum::serve`, which has no header-read or idle timeout and no connection
/// limit: a few hundred stalled clients would hold it. HTTP/1 only: a connection carries one
/// request at a time (pipelined requests wait their turn). See [`ServerLimits`](crate::ServerLimits)
/// for what happens at the connection limit.
///
/// # Cancel safety
///
/// Dropping the future closes every connection at once.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: crate::ServerLimits,
    shutdown: impl Future<Output = ()> + Send,
) {
    crate::server::serve(listener, app, limits, shutdown).await;
}

/// The request types of one registered entity type, by their path segment.
#[derive(Debug)]
struct EntityRoutes {
    entity_type: &'static str,
    /// Path segments before the tag, in lowercase (empty at the root).
    prefix: Vec<String>,
    /// The callable request types, by tag in lowercase.
    rpcs: BTreeMap<String, ErasedRpc>,
}

/// An HTTP gateway to entities: build it, then serve its [`router`](HttpGateway::router).
pub struct HttpGateway {
    sharding: Sharding,
    entities: Vec<EntityRoutes>,
    #[cfg(feature = "workflow")]
    workflows: Vec<workflows::WorkflowRoutes>,
    /// Who may complete deferreds and resume, poll or interrupt executions.
    #[cfg(feature = "workflow")]
    access: workflows::Access,
    error_statuses: BTreeMap<String, StatusCode>,
    options: HttpOptions,
    /// Runs before every route, when set.
    authenticator: Option<Arc<dyn Authenticator>>,
    /// The schemas the application documented (feature `schemars`).
    documented: openapi::Documented,
    #[cfg(feature = "schemars")]
    generator: schemas::Generator,
    /// The OpenAPI document, made when the router is.
    openapi_json: String,
}

impl HttpGateway {
    /// A gateway that calls entities through `sharding` (a runner, or a client-only process).
    pub fn new(sharding: Sharding) -> HttpGateway {
        HttpGateway {
            sharding,
            entities: Vec::new(),
            #[cfg(feature = "workflow")]
            workflows: Vec::new(),
            #[cfg(feature = "workflow")]
            access: workflows::Access::default(),
            error_statuses: BTreeMap::new(),
            options: HttpOptions::default(),
            authenticator: None,
            documented: openapi::Documented::default(),
            #[cfg(feature = "schemars")]
            generator: schemas::Generator::default(),
            openapi_json: String::new(),
        }
    }

    /// Serves the request types of `E` at the root: `/{tag}/{entityId}` and
    /// `/{tag}/{entityId}/discard` (the reference's group without a prefix).
    #[must_use]
    pub fn entity<E: Entity>(self) -> HttpGateway {
        self.entity_under::<E>("")
    }

    /// Serves the request types of `E` under `prefix` (such as `/counter`), so that entity types
    /// with the same tags do not share paths (the reference's `HttpApiGroup.prefix`).
    #[must_use]
    pub fn entity_under<E: Entity>(mut self, prefix: &str) -> HttpGateway {
        let rpcs = cluster_sharding::rpcs_of::<E>()
            .into_iter()
            .map(|rpc| (rpc.tag().to_lowercase(), rpc))
            .collect();
        let prefix = segments(prefix).map(str::to_lowercase).collect();
        self.entities.push(EntityRoutes { entity_type: E::TYPE, prefix, rpcs });
        self
    }

    /// Answers the request types' errors whose `_tag` is `tag` with `status` instead of 500 (the
    /// reference's `httpApiStatus` annotation on an error class).
    ///
    /// # Errors
    ///
    /// `status` is not an HTTP error status (400 to 599).
    pub fn error_status(mut self, tag: &str, status: u16) -> Result<HttpGateway, InvalidStatus> {
        let status = StatusCode::from_u16(status).map_err(|_| InvalidStatus(status))?;
        if !(status.is_client_error() || status.is_server_error()) {
            return Err(InvalidStatus(status.as_u16()));
        }
        self.error_statuses.insert(tag.to_owned(), status);
        Ok(self)
    }

    /// The gateway with `options`.
    #[must_use]
    pub fn options(mut self, options: HttpOptions) -> HttpGateway {
        self.options = options;
        self
    }

    /// Runs `authenticator` before every route: a request it refuses is answered with its
    /// answer, and reaches no entity or workflow.
    #[must_use]
    pub fn authenticator(mut self, authenticator: impl Authenticator) -> HttpGateway {
        self.authenticator = Some(Arc::new(authenticator));
        self
    }

    /// The gateway with the options and the bearer token (when one is set) of `config`.
    #[must_use]
    pub fn configured(mut self, config: &HttpConfig) -> HttpGateway {
        self.options = config.options.clone();
        if let Some(token) = &config.bearer_token {
            self = self.authenticator(token.clone());
        }
        self
    }

    /// The axum router of the gateway; it also serves the OpenAPI document at
    /// `GET /openapi.json`.
    pub fn router(mut self) -> axum::Router {
        self.openapi_json = self.openapi().to_string();
        axum::Router::new().fallback(route_request).with_state(Arc::new(self))
    }

    /// The OpenAPI 3.1 document of the routes, as JSON, in the reference's shape (see
    /// `http/openapi.rs`): paths relative to the router, one tag per entity type or workflow;
    /// the schemas of the request types and workflows documented with `schemars` (feature
    /// `schemars`), open ones (`{}`) for the others.
    pub fn openapi(&self) -> serde_json::Value {
        let entities: Vec<openapi::EntityOperation<'_>> = self
            .entities
            .iter()
            .flat_map(|entity| {
                entity.rpcs.values().map(|rpc| openapi::EntityOperation {
                    group: entity.entity_type,
                    prefix: &entity.prefix,
                    tag: rpc.tag(),
                    void_success: rpc.is_void(),
                    stream: rpc.is_stream(),
                })
            })
            .collect();
        #[cfg(feature = "workflow")]
        let workflows = workflows::operations(&self.workflows);
        #[cfg(not(feature = "workflow"))]
        let workflows = Vec::new();
        let errors: Vec<(String, u16)> = self
            .error_statuses
            .iter()
            .map(|(tag, status)| (tag.clone(), status.as_u16()))
            .collect();
        openapi::document(
            "durable-cluster gateway",
            &entities,
            &workflows,
            &errors,
            &self.documented,
        )
    }

    /// The request type and entity id a path names, and whether it is a discard route.
    fn route(&self, parts: &[&str]) -> Option<(&EntityRoutes, &ErasedRpc, EntityId, bool)> {
        self.entities.iter().find_map(|entity| {
            let rest = strip_prefix(parts, &entity.prefix)?;
            let (tag, entity_id, discard) = match rest {
                [tag, entity_id] => (tag, entity_id, false),
                [tag, entity_id, discard] if discard.eq_ignore_ascii_case("discard") => {
                    (tag, entity_id, true)
                }
                _ => return None,
            };
            let rpc = entity.rpcs.get(&tag.to_lowercase())?;
            let entity_id = decode_segment(entity_id)?;
            if entity_id.chars().count() > MAX_ENTITY_ID_CHARS {
                return None;
            }
            Some((entity, rpc, EntityId::from(entity_id), discard))
        })
    }
}

impl std::fmt::Debug for HttpGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpGateway")
            .field("entities", &self.entities)
            .field("error_statuses", &self.error_statuses)
            .field("options", &self.options)
            .field("authenticated", &self.authenticator.is_some())
            .finish_non_exhaustive()
    }
}

/// A status that is not an HTTP error status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0} is not an HTTP error status (400 to 599)")]
pub struct InvalidStatus(pub u16);

/// The segments a route is matched on: the path up to `;` (where the reference's router ends
/// it), without empty segments (duplicate and trailing slashes).
fn path_parts(path: &str) -> Vec<&str> {
    segments(path.split(';').next().unwrap_or_default()).collect()
}

/// The non-empty segments of a path.
fn segments(path: &str) -> impl Iterator<Item = &str> {
    path.split('/').filter(|segment| !segment.is_empty())
}

/// What follows `prefix` in `parts`, compared without regard to case.
fn strip_prefix<'a>(parts: &'a [&'a str], prefix: &[String]) -> Option<&'a [&'a str]> {
    if parts.len() < prefix.len() {
        return None;
    }
    let (head, rest) = parts.split_at(prefix.len());
    head.iter()
        .zip(prefix)
        .all(|(part, expected)| part.eq_ignore_ascii_case(expected))
        .then_some(rest)
}

/// A percent-decoded path segment; `None` when an escape is not valid or the bytes are not
/// UTF-8.
fn decode_segment(segment: &str) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        if bytes[index] == b'%' {
            let hex = bytes.get(index + 1..index + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            decoded.push(u8::from_str_radix(hex, 16).ok()?);
            index += 3;
        } else {
            decoded.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8(decoded).ok()
}

/// An empty answer with `status`.
fn empty(status: StatusCode) -> Response {
    status.into_response()
}

/// A JSON answer.
fn json(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The one handler: authenticates, routes, checks the body, calls, answers.
async fn route_request(State(gateway): State<Arc<HttpGateway>>, request: Request) -> Response {
    let request = match authenticate(&gateway, request).await {
        Ok(request) => request,
        Err(refused) => return refused,
    };
    let path = request.uri().path().to_owned();
    let parts = path_parts(&path);
    if request.method() == Method::GET && parts == ["openapi.json"] {
        return json(StatusCode::OK, gateway.openapi_json.clone());
    }
    if request.method() != Method::POST {
        return empty(StatusCode::NOT_FOUND);
    }
    #[cfg(feature = "workflow")]
    if let Some(deferred) = workflows::deferred_route(&gateway.workflows, &gateway.access, &parts) {
        if let Some(refused) = workflows::refuse_token_ids(&deferred) {
            return refused;
        }
        return workflows::complete(&gateway, deferred, request).await;
    }
    #[cfg(feature = "workflow")]
    if let Some((routes, action)) = workflows::route(&gateway.workflows, &parts) {
        return workflows::serve(&gateway, routes, action, request).await;
    }
    let Some((entity, rpc, entity_id, discard)) = gateway.route(&parts) else {
        return empty(StatusCode::NOT_FOUND);
    };
    if let Some(refused) = refuse_id("entity id", entity_id.as_str()) {
        return refused;
    }
    // A stream has no discard route.
    if discard && rpc.is_stream() {
        return empty(StatusCode::NOT_FOUND);
    }
    // Read before the body takes the request.
    let format = rpc.is_stream().then(|| stream::Format::of(request.headers()));
    let span = tracing::info_span!(
        "http_request",
        entity_type = entity.entity_type,
        tag = rpc.tag(),
        entity_id = %entity_id,
        discard,
    );
    // Instrumented, not entered: an entered span must not be held across an await.
    let reading =
        tracing::Instrument::instrument(read_payload(&gateway.options, request), span.clone());
    let payload = match reading.await {
        Ok(payload) => payload,
        Err(refused) => return refused,
    };
    if let Some(format) = format {
        // The timeout bounds the start; the items come as long as the connection reads them.
        let started = rpc.stream(&gateway.sharding, entity_id, payload);
        return match within_timeout(&gateway.options, &span, started).await {
            None => empty(StatusCode::GATEWAY_TIMEOUT),
            Some(Ok(started)) => stream::respond(started, format, span),
            Some(Err(error)) => {
                let _entered = span.enter();
                error_response(&error, false)
            }
        };
    }
    let call = async {
        if discard {
            rpc.discard(&gateway.sharding, entity_id, payload).await.map(|()| None)
        } else {
            rpc.send(&gateway.sharding, entity_id, payload).await.map(Some)
        }
    };
    let called = within_timeout(&gateway.options, &span, call).await;
    let _entered = span.enter();
    match called {
        None => empty(StatusCode::GATEWAY_TIMEOUT),
        Some(Ok(None)) => empty(StatusCode::NO_CONTENT),
        Some(Ok(Some(exit))) => gateway.exit_response(rpc, exit),
        Some(Err(error)) => error_response(&error, discard),
    }
}

/// The request, when the gateway has no authenticator or its authenticator lets it through;
/// otherwise the authenticator's answer.
async fn authenticate(gateway: &HttpGateway, request: Request) -> Result<Request, Response> {
    let Some(authenticator) = &gateway.authenticator else { return Ok(request) };
    let (parts, body) = request.into_parts();
    if let Err(refused) = authenticator.authenticate(&parts).await {
        tracing::debug!(status = %refused.status(), "HTTP request refused by the authenticator");
        return Err(refused);
    }
    Ok(Request::from_parts(parts, body))
}

/// Runs `call` in `span` within the request timeout; `None` when it timed out (logged).
async fn within_timeout<T>(
    options: &HttpOptions,
    span: &tracing::Span,
    call: impl Future<Output = T>,
) -> Option<T> {
    let timed = tokio::time::timeout(options.request_timeout, call);
    let called = tracing::Instrument::instrument(timed, span.clone()).await;
    if called.is_err() {
        let _entered = span.enter();
        tracing::warn!("HTTP call timed out");
    }
    called.ok()
}

/// The request's JSON payload, or the answer that refuses it (415, 413, 408, 400).
async fn read_payload(options: &HttpOptions, request: Request) -> Result<RawJson, Response> {
    if let Some(unsupported) = unsupported_content_type(request.headers()) {
        let mut response = (StatusCode::UNSUPPORTED_MEDIA_TYPE, unsupported).into_response();
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        return Err(response);
    }
    let reading = axum::body::to_bytes(request.into_body(), options.max_body_bytes);
    let Ok(read) = tokio::time::timeout(options.body_read_timeout, reading).await else {
        tracing::debug!("HTTP request body not read within its timeout");
        // The rest of the body is never read: the connection closes after the answer.
        let mut response = empty(StatusCode::REQUEST_TIMEOUT);
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Err(response);
    };
    let Ok(body) = read else {
        return Err(empty(StatusCode::PAYLOAD_TOO_LARGE));
    };
    payload_of(&body).map_err(|message| decode_failed(&message))
}

/// Why a content type is refused (`Unsupported content-type: ...`), if it is: the value is
/// compared in lowercase without its parameters, and a request without one is refused too
/// (the reference reads it as JSON), so that no request a browser sends without a CORS
/// preflight (`text/plain`, a form, no body type at all) reaches a route that changes state.
fn unsupported_content_type(headers: &axum::http::HeaderMap) -> Option<String> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Some("Missing content-type: send application/json".to_owned());
    };
    let value = String::from_utf8_lossy(value.as_bytes()).to_lowercase();
    let media = value.split(';').next().unwrap_or_default().trim().to_owned();
    (media != "application/json").then(|| format!("Unsupported content-type: {media}"))
}

/// The payload of a body: JSON, or `null` when the body is empty.
fn payload_of(body: &[u8]) -> Result<RawJson, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(RawJson::null());
    }
    let text = std::str::from_utf8(body).map_err(|error| error.to_string())?;
    // The reference's payloads are structs or empty, never arrays; serde would read an array
    // into a struct's fields in order.
    if text.trim_start().starts_with('[') {
        return Err("a payload is a JSON object or null, not an array".to_owned());
    }
    RawJson::from_json(text.to_owned()).map_err(|error| error.to_string())
}

/// 400 when `id` (an entity id, an execution id, a deferred's name: `what`) is longer than
/// [`MAX_ENTITY_ID_CHARS`] or holds a control character, which could forge a log line or drive
/// a terminal wherever the id is shown. The answer names the character, never the id.
fn refuse_id(what: &str, id: &str) -> Option<Response> {
    let problem = if id.chars().count() > MAX_ENTITY_ID_CHARS {
        format!("the {what} is longer than {MAX_ENTITY_ID_CHARS} characters")
    } else {
        let control = id.chars().find(|character| character.is_control())?;
        format!("the {what} holds the control character U+{:04X}", u32::from(control))
    };
    Some(decode_failed(&problem))
}

/// 400, with the decoding error.
fn decode_failed(message: &str) -> Response {
    tracing::debug!(%message, "HTTP payload does not decode");
    let body = serde_json::json!({ "_tag": "HttpApiSchemaError", "message": message });
    json(StatusCode::BAD_REQUEST, body.to_string())
}

impl HttpGateway {
    /// A request type's (or a workflow's) own error: 500, or the status given to its `_tag`.
    fn typed_error(&self, error: String) -> Response {
        if self.error_statuses.is_empty() {
            return json(StatusCode::INTERNAL_SERVER_ERROR, error);
        }
        let status = serde_json::from_str::<serde_json::Value>(&error)
            .ok()
            .and_then(|value| value.get("_tag").and_then(|tag| tag.as_str()).map(str::to_owned))
            .and_then(|tag| self.error_statuses.get(&tag).copied())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json(status, error)
    }

    /// The answer of an exit.
    fn exit_response(&self, rpc: &ErasedRpc, exit: Exit) -> Response {
        match exit {
            Exit::Success(_) if rpc.is_void() => empty(StatusCode::OK),
            Exit::Success(value) => json(StatusCode::OK, value.json_or_null().to_owned()),
            Exit::Failure(cause) => self.failure_response(&cause),
        }
    }

    /// The request type's own error with its status, or 500 with an empty body for a defect or
    /// an interruption (logged, never shown).
    fn failure_response(&self, cause: &Cause) -> Response {
        let failure = cause.0.iter().find_map(|reason| match reason {
            CauseReason::Fail(error) => Some(error),
            _ => None,
        });
        if let Some(error) = failure {
            return self.typed_error(error.json_or_null().to_owned());
        }
        tracing::error!(?cause, "HTTP call ended with a defect or an interruption");
        empty(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// The answer of a call that failed before its exit.
fn error_response(error: &ErasedError, discard: bool) -> Response {
    match error {
        ErasedError::Decode(error) => decode_failed(&error.to_string()),
        ErasedError::Cluster(error) => match cluster_error_json(error, discard) {
            Some(body) => json(StatusCode::INTERNAL_SERVER_ERROR, body.to_string()),
            None => {
                tracing::error!(%error, "HTTP call failed in the cluster");
                empty(StatusCode::INTERNAL_SERVER_ERROR)
            }
        },
        ErasedError::Stream(_) | ErasedError::NotStream(_) => empty(StatusCode::NOT_FOUND),
        other => {
            tracing::error!(error = %other, "HTTP call failed");
            empty(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// The reference's JSON of the cluster errors its proxy declares; `None` for the others (and
/// for `EntityNotAssignedToRunner` on a discard route, which does not declare it).
fn cluster_error_json(error: &ClusterError, discard: bool) -> Option<serde_json::Value> {
    match error {
        ClusterError::MailboxFull { address } => {
            Some(serde_json::json!({ "_tag": "MailboxFull", "address": address_json(address) }))
        }
        ClusterError::AlreadyProcessingMessage { envelope_id, address } => {
            Some(serde_json::json!({
                "_tag": "AlreadyProcessingMessage",
                "envelopeId": envelope_id.to_string(),
                "address": address_json(address),
            }))
        }
        ClusterError::EntityNotAssignedToRunner { address } if !discard => {
            Some(serde_json::json!({
                "_tag": "EntityNotAssignedToRunner",
                "address": address_json(address),
            }))
        }
        ClusterError::Persistence(storage) => {
            // The kind only: a driver's message may show the database's internals.
            tracing::warn!(error = %storage, "HTTP call failed in storage");
            let message = format!("storage failed ({})", storage.kind());
            Some(serde_json::json!({
                "_tag": "PersistenceError",
                "cause": { "name": "Error", "message": message },
            }))
        }
        _ => None,
    }
}

/// The reference's JSON of an entity address.
fn address_json(address: &EntityAddress) -> serde_json::Value {
    serde_json::json!({
        "shardId": { "group": address.shard_id.group().as_str(), "id": address.shard_id.id() },
        "entityType": address.entity_type.as_str(),
        "entityId": address.entity_id.as_str(),
    })
}

/// Workflow routes (with the feature `workflow`), wire-compatible with the reference's
/// `WorkflowProxy.toHttpApiGroup` + `WorkflowProxyServer.layerHttpApi`
/// (`effect/src/workflow/WorkflowProxy.ts`, `effect/src/workflow/WorkflowProxyServer.ts`).
#[cfg(feature = "workflow")]
mod workflows {
    use super::{
        HttpGateway, Request, Response, StatusCode, decode_failed, empty, json, read_payload,
        refuse_id, segments, strip_prefix, within_timeout,
    };
    use std::sync::Arc;

    use axum::http::HeaderMap;
    use cluster_core::envelope::{Exit, RawJson};
    use cluster_core::future::BoxFuture;
    use cluster_workflow::{
        ExecuteError, ExecutionId, Token, TokenKey, Workflow, WorkflowEngine, WorkflowError,
    };

    /// Who may complete deferreds and resume, poll or interrupt executions over HTTP: the
    /// holders of capabilities signed with the key, and whoever the authorizer lets through.
    /// With neither, those routes answer 403.
    #[derive(Clone, Default)]
    pub(super) struct Access {
        key: Option<TokenKey>,
        authorizer: Option<Authorizer>,
    }

    /// The application's rule for the workflow routes that act on an existing execution.
    type Authorizer = Arc<dyn Fn(&WorkflowAccess<'_>) -> bool + Send + Sync>;

    /// What a request asks of an execution, for [`HttpGateway::workflow_authorizer`].
    #[derive(Debug)]
    #[non_exhaustive]
    pub struct WorkflowAccess<'a> {
        /// The workflow's name.
        pub workflow: &'a str,
        /// The execution.
        pub execution_id: &'a ExecutionId,
        /// What is asked.
        pub action: WorkflowAction<'a>,
        /// The request's headers (for example the identity an authentication layer put there).
        pub headers: &'a HeaderMap,
    }

    /// What a request asks of an execution.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[non_exhaustive]
    pub enum WorkflowAction<'a> {
        /// Complete the deferred of this name (`/deferred/{token}`).
        Complete(&'a str),
        /// Resume the execution (`/{name}/resume`).
        Resume,
        /// Read its result (`/{name}/poll`).
        Poll,
        /// Interrupt it (`/{name}/interrupt`).
        Interrupt,
    }

    impl Access {
        /// Whether `access` is allowed: by a capability (a signed token or execution handle,
        /// checked before), or by the authorizer.
        fn allows(&self, access: &WorkflowAccess<'_>, signed: bool) -> bool {
            signed || self.authorizer.as_ref().is_some_and(|authorizer| authorizer(access))
        }

        fn configured(&self) -> bool {
            self.key.is_some() || self.authorizer.is_some()
        }
    }

    /// Why a workflow route refused a caller: logged, the caller gets the status only.
    fn forbidden(access: &Access, what: &str) -> Response {
        if access.configured() {
            tracing::debug!(what, "workflow route refused: no valid capability");
        } else {
            tracing::warn!(
                what,
                "workflow route refused: the gateway has no token key and no authorizer \
                 (HttpGateway::workflow_tokens, HttpGateway::workflow_authorizer)"
            );
        }
        empty(StatusCode::FORBIDDEN)
    }

    /// What a workflow route does.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Action {
        /// `POST /{name}`: run and wait for the result.
        Execute,
        /// `POST /{name}/discard`: start, answer the execution id.
        Discard,
        /// `POST /{name}/resume` with `{"executionId": ...}`: resume a suspended execution.
        Resume,
        /// `POST /{name}/poll` with `{"executionId": ...}`: the stored result, or `null`.
        Poll,
        /// `POST /{name}/interrupt` with `{"executionId": ...}`: interrupt the execution.
        Interrupt,
    }

    /// What an erased workflow call answers.
    pub(super) enum Outcome {
        /// The success's JSON, or `None` for a void success.
        Success(Option<String>),
        /// The workflow's own error, as JSON.
        Failed(String),
        /// The execution id of a discarded execution.
        Started(ExecutionId),
        /// Done, nothing to answer (resumed, interrupted).
        Done,
        /// The stored result (its JSON), or `None` while there is none.
        Polled(Option<String>),
        /// The payload is not the workflow's.
        Decode(String),
        /// A defect, an interruption or an engine failure: logged, never shown.
        Broken(String),
    }

    type Call = fn(WorkflowEngine, Action, RawJson) -> BoxFuture<'static, Outcome>;

    /// The routes of one workflow.
    pub(super) struct WorkflowRoutes {
        name: &'static str,
        prefix: Vec<String>,
        engine: WorkflowEngine,
        call: Call,
    }

    impl std::fmt::Debug for WorkflowRoutes {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("WorkflowRoutes").field("name", &self.name).finish_non_exhaustive()
        }
    }

    impl HttpGateway {
        /// Serves the workflow `W` of `engine` at the root: `POST /{name}` (execute and wait),
        /// `/{name}/discard` (start; answers the execution id) and `/{name}/resume` (the
        /// reference's workflow proxy group without a prefix); beyond the reference,
        /// `/{name}/poll` and `/{name}/interrupt`, and `/deferred/{token}` (and `.../fail`) to
        /// complete a deferred of `W` from its token.
        #[must_use]
        pub fn workflow<W: Workflow>(self, engine: &WorkflowEngine) -> HttpGateway {
            self.workflow_under::<W>(engine, "")
        }

        /// Accepts capabilities signed with `key` on the routes that act on an existing
        /// execution: `/deferred/{token}` takes a token signed with [`TokenKey::sign`], and
        /// `/{name}/resume`, `/{name}/poll` and `/{name}/interrupt` take an execution handle
        /// signed with [`TokenKey::sign_execution`] in the body's `token` field, beside
        /// `executionId`. Without a key or an authorizer those routes answer 403: an execution
        /// id and a plain token are computed from public inputs and grant nothing.
        #[must_use]
        pub fn workflow_tokens(mut self, key: TokenKey) -> HttpGateway {
            self.access.key = Some(key);
            self
        }

        /// Lets `authorize` decide the routes that act on an existing execution (completing
        /// a deferred from a plain token, resume, poll, interrupt), for example from the
        /// identity an authentication layer put in the headers. A valid capability
        /// ([`HttpGateway::workflow_tokens`]) is allowed without asking it.
        #[must_use]
        pub fn workflow_authorizer(
            mut self,
            authorize: impl Fn(&WorkflowAccess<'_>) -> bool + Send + Sync + 'static,
        ) -> HttpGateway {
            self.access.authorizer = Some(Arc::new(authorize));
            self
        }

        /// Serves the workflow `W` under `prefix`.
        #[must_use]
        pub fn workflow_under<W: Workflow>(
            mut self,
            engine: &WorkflowEngine,
            prefix: &str,
        ) -> HttpGateway {
            let prefix = segments(prefix).map(str::to_lowercase).collect();
            let routes =
                WorkflowRoutes { name: W::NAME, prefix, engine: engine.clone(), call: call::<W> };
            self.workflows.push(routes);
            self
        }
    }

    /// What the OpenAPI document needs of each workflow.
    pub(super) fn operations(
        workflows: &[WorkflowRoutes],
    ) -> Vec<super::openapi::WorkflowOperation<'_>> {
        workflows
            .iter()
            .map(|routes| super::openapi::WorkflowOperation {
                prefix: &routes.prefix,
                name: routes.name,
            })
            .collect()
    }

    /// The workflow and action a path names.
    pub(super) fn route<'a>(
        workflows: &'a [WorkflowRoutes],
        parts: &[&str],
    ) -> Option<(&'a WorkflowRoutes, Action)> {
        workflows.iter().find_map(|routes| {
            let rest = strip_prefix(parts, &routes.prefix)?;
            let (name, action) = match rest {
                [name] => (name, Action::Execute),
                [name, action] if action.eq_ignore_ascii_case("discard") => (name, Action::Discard),
                [name, action] if action.eq_ignore_ascii_case("resume") => (name, Action::Resume),
                [name, action] if action.eq_ignore_ascii_case("poll") => (name, Action::Poll),
                [name, action] if action.eq_ignore_ascii_case("interrupt") => {
                    (name, Action::Interrupt)
                }
                _ => return None,
            };
            name.eq_ignore_ascii_case(routes.name).then_some((routes, action))
        })
    }

    /// A deferred to complete: `POST /deferred/{token}` (a success, the body its value) or
    /// `POST /deferred/{token}/fail` (a failure, the body its error), for a workflow the gateway
    /// serves.
    pub(super) enum Deferred<'a> {
        /// The token names a workflow served here; `signed` when its signature was checked.
        Served { routes: &'a WorkflowRoutes, token: Token, signed: bool, fail: bool },
        /// The token does not read, is not allowed, or names a workflow not served here.
        Refused { status: StatusCode, why: String },
    }

    /// The deferred route a path names, if it is one (`/deferred/...`, only with workflows).
    pub(super) fn deferred_route<'a>(
        workflows: &'a [WorkflowRoutes],
        access: &Access,
        parts: &[&str],
    ) -> Option<Deferred<'a>> {
        let (token, fail) = match parts {
            [head, token] if head.eq_ignore_ascii_case("deferred") => (token, false),
            [head, token, fail]
                if head.eq_ignore_ascii_case("deferred") && fail.eq_ignore_ascii_case("fail") =>
            {
                (token, true)
            }
            _ => return None,
        };
        if workflows.is_empty() {
            return None;
        }
        // A signed token is checked; a plain one reads, and only an authorizer may allow it.
        let signed = access.key.as_ref().and_then(|key| key.verify(token).ok());
        let (token, signed) = match signed {
            Some(token) => (token, true),
            None => match Token::parse(token.split('.').next().unwrap_or_default()) {
                Ok(token) => (token, false),
                Err(error) => {
                    return Some(Deferred::Refused {
                        status: StatusCode::BAD_REQUEST,
                        why: error.to_string(),
                    });
                }
            },
        };
        match workflows.iter().find(|routes| routes.name == token.workflow) {
            Some(routes) => Some(Deferred::Served { routes, token, signed, fail }),
            None => Some(Deferred::Refused {
                status: StatusCode::NOT_FOUND,
                why: format!("no workflow {:?} is served here", token.workflow),
            }),
        }
    }

    /// 400 when the token's execution id or deferred name is too long or holds a control
    /// character (see `refuse_id`): it would reach the storage and the logs as it is.
    pub(super) fn refuse_token_ids(deferred: &Deferred<'_>) -> Option<Response> {
        let Deferred::Served { token, .. } = deferred else { return None };
        refuse_id("execution id", token.execution_id.as_str())
            .or_else(|| refuse_id("deferred name", &token.deferred))
    }

    /// 400 when the execution id that a resume, poll or interrupt names is too long or holds a
    /// control character (see `refuse_id`); a body that does not decode is left to the route.
    fn refuse_execution_id(action: Action, payload: &RawJson) -> Option<Response> {
        if !matches!(action, Action::Resume | Action::Poll | Action::Interrupt) {
            return None;
        }
        let named: Resume = payload.decode().ok()?;
        refuse_id("execution id", &named.execution_id)
    }

    /// Completes a deferred from its token: 204 once done.
    pub(super) async fn complete(
        gateway: &HttpGateway,
        deferred: Deferred<'_>,
        request: Request,
    ) -> Response {
        let (routes, token, signed, fail) = match deferred {
            Deferred::Served { routes, token, signed, fail } => (routes, token, signed, fail),
            Deferred::Refused { status, why } => {
                tracing::debug!(%why, "deferred completion refused");
                return empty(status);
            }
        };
        let asked = WorkflowAccess {
            workflow: routes.name,
            execution_id: &token.execution_id,
            action: WorkflowAction::Complete(&token.deferred),
            headers: request.headers(),
        };
        if !gateway.access.allows(&asked, signed) {
            return forbidden(&gateway.access, "complete a deferred");
        }
        let span = tracing::info_span!(
            "http_request",
            workflow = routes.name,
            deferred = %token.deferred,
            execution_id = %token.execution_id,
        );
        let payload = match read_payload(&gateway.options, request).await {
            Ok(payload) => payload,
            Err(refused) => return refused,
        };
        let exit = if fail { Exit::fail(payload) } else { Exit::Success(payload) };
        let completing = routes.engine.complete_exit(&token, exit);
        let completed = within_timeout(&gateway.options, &span, completing).await;
        let _entered = span.enter();
        match completed {
            Some(Ok(())) => empty(StatusCode::NO_CONTENT),
            // A name the engine keeps for itself is not a deferred a caller may complete.
            Some(Err(WorkflowError::ReservedName(refused))) => {
                tracing::debug!(%refused, "deferred completion refused");
                empty(StatusCode::FORBIDDEN)
            }
            Some(Err(error @ WorkflowError::NoSuchExecution { .. })) => {
                tracing::debug!(%error, "deferred completion refused");
                empty(StatusCode::NOT_FOUND)
            }
            Some(Err(error)) => {
                tracing::error!(%error, "HTTP deferred completion failed");
                empty(StatusCode::INTERNAL_SERVER_ERROR)
            }
            None => empty(StatusCode::GATEWAY_TIMEOUT),
        }
    }

    /// Runs one workflow route.
    pub(super) async fn serve(
        gateway: &HttpGateway,
        routes: &WorkflowRoutes,
        action: Action,
        request: Request,
    ) -> Response {
        let span = tracing::info_span!("http_request", workflow = routes.name, ?action);
        let headers = request.headers().clone();
        let payload = match read_payload(&gateway.options, request).await {
            Ok(payload) => payload,
            Err(refused) => return refused,
        };
        if let Some(refused) = refuse_execution_id(action, &payload) {
            return refused;
        }
        if let Some(asked) = action.on_execution() {
            let named: Named = match payload.decode() {
                Ok(named) => named,
                Err(error) => return decode_failed(&error.to_string()),
            };
            let execution_id = ExecutionId::from_raw(named.execution_id);
            let signed = gateway.access.key.as_ref().is_some_and(|key| {
                named.token.as_deref().and_then(|token| key.verify_execution(token).ok())
                    == Some((routes.name.to_owned(), execution_id.clone()))
            });
            let access = WorkflowAccess {
                workflow: routes.name,
                execution_id: &execution_id,
                action: asked,
                headers: &headers,
            };
            if !gateway.access.allows(&access, signed) {
                return forbidden(&gateway.access, "act on an execution");
            }
        }
        let call = (routes.call)(routes.engine.clone(), action, payload);
        let called = within_timeout(&gateway.options, &span, call).await;
        let _entered = span.enter();
        match called {
            None => empty(StatusCode::GATEWAY_TIMEOUT),
            Some(Outcome::Success(None)) => empty(StatusCode::OK),
            Some(Outcome::Success(Some(value))) => json(StatusCode::OK, value),
            Some(Outcome::Failed(error)) => gateway.typed_error(error),
            Some(Outcome::Started(execution_id)) => {
                // An id is a string: it always encodes.
                let id = serde_json::to_string(execution_id.as_str()).unwrap_or_default();
                json(StatusCode::OK, id)
            }
            Some(Outcome::Done) => empty(StatusCode::NO_CONTENT),
            Some(Outcome::Polled(result)) => {
                json(StatusCode::OK, result.unwrap_or_else(|| "null".to_owned()))
            }
            Some(Outcome::Decode(message)) => decode_failed(&message),
            Some(Outcome::Broken(why)) => {
                tracing::error!(%why, "HTTP workflow call failed");
                empty(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    impl Action {
        /// What the route asks of an existing execution, if it acts on one.
        fn on_execution(self) -> Option<WorkflowAction<'static>> {
            match self {
                Action::Resume => Some(WorkflowAction::Resume),
                Action::Poll => Some(WorkflowAction::Poll),
                Action::Interrupt => Some(WorkflowAction::Interrupt),
                Action::Execute | Action::Discard => None,
            }
        }
    }

    /// The body of the resume, poll and interrupt routes.
    #[derive(serde::Deserialize)]
    struct Resume {
        #[serde(rename = "executionId")]
        execution_id: String,
    }

    /// The same body, with the execution handle that allows the call.
    #[derive(serde::Deserialize)]
    struct Named {
        #[serde(rename = "executionId")]
        execution_id: String,
        #[serde(default)]
        token: Option<String>,
    }

    /// One workflow route of `W`.
    fn call<W: Workflow>(
        engine: WorkflowEngine,
        action: Action,
        payload: RawJson,
    ) -> BoxFuture<'static, Outcome> {
        Box::pin(async move {
            if matches!(action, Action::Resume | Action::Poll | Action::Interrupt) {
                let named: Resume = match payload.decode() {
                    Ok(named) => named,
                    Err(error) => return Outcome::Decode(error.to_string()),
                };
                let execution_id = ExecutionId::from_raw(named.execution_id);
                let done = match action {
                    Action::Poll => {
                        return match engine.poll::<W>(&execution_id).await {
                            Ok(result) => Outcome::Polled(result.map(|result| result.to_json())),
                            Err(error) => Outcome::Broken(error.to_string()),
                        };
                    }
                    Action::Interrupt => engine.interrupt::<W>(&execution_id).await,
                    _ => engine.resume::<W>(&execution_id).await,
                };
                return match done {
                    Ok(()) => Outcome::Done,
                    Err(error) => Outcome::Broken(error.to_string()),
                };
            }
            let payload: W::Payload = match payload.decode() {
                Ok(payload) => payload,
                Err(error) => return Outcome::Decode(error.to_string()),
            };
            if action == Action::Discard {
                return match engine.execute_discard::<W>(payload).await {
                    Ok(execution_id) => Outcome::Started(execution_id),
                    Err(error) => Outcome::Broken(error.to_string()),
                };
            }
            let void = std::any::TypeId::of::<W::Success>() == std::any::TypeId::of::<()>();
            match engine.execute::<W>(payload).await {
                Ok(_) if void => Outcome::Success(None),
                Ok(success) => match serde_json::to_string(&success) {
                    Ok(value) => Outcome::Success(Some(value)),
                    Err(error) => Outcome::Broken(error.to_string()),
                },
                Err(ExecuteError::Failed(error)) => match serde_json::to_string(&error) {
                    Ok(error) => Outcome::Failed(error),
                    Err(error) => Outcome::Broken(error.to_string()),
                },
                Err(error) => Outcome::Broken(error.to_string()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_percent_decoded_and_bad_escapes_refused() {
        assert_eq!(decode_segment("a%2Fb").as_deref(), Some("a/b"));
        assert_eq!(decode_segment("100%25").as_deref(), Some("100%"));
        assert_eq!(decode_segment("caf%C3%A9").as_deref(), Some("café"));
        assert_eq!(decode_segment("a+b").as_deref(), Some("a+b"));
        assert_eq!(decode_segment("%zz"), None);
        assert_eq!(decode_segment("%4"), None);
        assert_eq!(decode_segment("%FF"), None, "not UTF-8");
    }

    #[test]
    fn content_types_are_compared_in_lowercase_without_parameters() {
        let with = |value: &str| {
            let mut headers = axum::http::HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_str(value).unwrap());
            unsupported_content_type(&headers)
        };
        assert_eq!(
            unsupported_content_type(&axum::http::HeaderMap::new()).as_deref(),
            Some("Missing content-type: send application/json"),
            "no content type is not JSON: a browser sends none without a preflight"
        );
        assert_eq!(with("application/json"), None);
        assert_eq!(with("Application/JSON; charset=utf-8"), None);
        assert_eq!(with("text/plain").as_deref(), Some("Unsupported content-type: text/plain"));
        assert_eq!(
            with("application/vnd.api+json").as_deref(),
            Some("Unsupported content-type: application/vnd.api+json")
        );
    }

    #[test]
    fn an_empty_body_is_null_and_bad_json_is_refused() {
        assert_eq!(payload_of(b"").unwrap(), RawJson::null());
        assert_eq!(payload_of(b"  \n").unwrap(), RawJson::null());
        assert_eq!(payload_of(b"{\"amount\":1}").unwrap().json(), Some("{\"amount\":1}"));
        assert!(payload_of(b"{\"amount\":").is_err());
        assert!(payload_of(&[0xff, 0xfe]).is_err());
        assert!(payload_of(b" [1]").is_err(), "an array is never a payload");
    }
}
