//! The admin on the operations server (feature `console`): JSON endpoints under `/admin/api`
//! and a web console under `/admin`, both off unless a token is configured.
//!
//! # Access
//!
//! | variable | scope |
//! | --- | --- |
//! | `CLUSTER_ADMIN_TOKEN` (or `CLUSTER_ADMIN_TOKEN_FILE`, one token per line) | read and act |
//! | `CLUSTER_ADMIN_READ_TOKEN` (or `CLUSTER_ADMIN_READ_TOKEN_FILE`) | read only |
//!
//! A token has at least 32 visible ASCII characters (`openssl rand -hex 16`). A request carries
//! it as `Authorization: Bearer <token>`, or as the cookie the console's login page sets
//! (`HttpOnly`, `SameSite=Strict`, path `/admin`). Without a token, or with a wrong one, every
//! page and endpoint answers 401 and changes nothing; a read token answers 403 to an action.
//!
//! Every action (a `POST`) also passes a same-origin check: a request whose `Origin` names
//! another origin is refused with 403, and a request authenticated by the cookie must show
//! that it comes from the console itself (`Origin`, or `Sec-Fetch-Site: same-origin`).
//!
//! # Endpoints
//!
//! | method and path | answers |
//! | --- | --- |
//! | `GET /admin/api/runners` | the registered runners |
//! | `GET /admin/api/shards` | the shard map: owner by assignment and by lock |
//! | `GET /admin/api/backlog?stale_after_ms=&limit=` | unprocessed messages per entity type and shard |
//! | `GET /admin/api/messages?type=&type_prefix=&entity=&tag=&unprocessed=&before=&limit=` | requests, newest first |
//! | `GET /admin/api/messages/{id}` | one request |
//! | `GET /admin/api/workflows?name=&status=&cursor=&limit=` | executions, newest first |
//! | `GET /admin/api/workflows/{name}/{id}` | one execution and its timeline |
//! | `GET /admin/api/stuck?threshold_ms=` | the stuck work |
//! | `POST /admin/api/workflows/{name}/{id}/{interrupt,resume,purge}` | the action |
//! | `POST /admin/api/workflows/{name}/{id}/deferreds/{deferred}` with `{"value": …}` or `{"error": …}` | completes the deferred |
//! | `POST /admin/api/messages/{id}/{retry,cancel,release}` | the action |
//!
//! The console's pages (`/admin`, `/admin/workflows`, `/admin/workflows/{name}/{id}`) are
//! rendered on the server; its actions are forms that post to the same paths as the API's,
//! without `/api`, and come back to the page.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use cluster_core::ConfigError;
use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson};
use cluster_core::inspect::{LIMIT_MAX, LockHolder, RequestQuery};
use cluster_core::{Snowflake, Timestamp};
use cluster_sharding::{Plumbing, Sharding};
use cluster_workflow::inspect::{ExecutionQuery, ExecutionStatus, StepKind, StepOutcome};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::{Value, json};

use super::text::{
    BACKLOG_COLUMNS, RUNNER_COLUMNS, age, backlog_cells, exit_summary, relative, runner_cells,
    status_text,
};
use super::{Action, Admin, AdminError, json as views};
use crate::token::{Tokens, bearer_credentials};

/// The variable of the tokens that may read and act.
pub const ADMIN_TOKEN_VARIABLE: &str = "CLUSTER_ADMIN_TOKEN";

/// The variable of the tokens that may only read.
pub const READ_TOKEN_VARIABLE: &str = "CLUSTER_ADMIN_READ_TOKEN";

/// The console's cookie.
const COOKIE: &str = "cluster_admin";

/// The most bytes of an action's or the login's body.
const BODY_BYTES_MAX: usize = 64 * 1024;

/// How often the stuck-work gauges are computed.
const STUCK_INTERVAL: Duration = Duration::from_secs(30);

/// The longest a page's, an endpoint's or an action's storage calls may take.
const CALL_DEADLINE: Duration = Duration::from_secs(20);

/// Who may use the admin: the tokens of each scope. Its `Debug` output shows how many tokens
/// each scope has, never one.
#[derive(Clone, Debug)]
pub struct AdminAccess {
    admin: Option<Tokens>,
    read: Option<Tokens>,
}

impl AdminAccess {
    /// The access `lookup` configures (`CLUSTER_ADMIN_TOKEN`, `CLUSTER_ADMIN_READ_TOKEN` and
    /// their `_FILE` forms); `None` when no token is set: the admin is off.
    ///
    /// # Errors
    ///
    /// A token is refused, or a variable is set together with its `_FILE` form; the error
    /// names the variable and never shows a token.
    pub fn from_lookup(
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> Result<Option<AdminAccess>, ConfigError> {
        let admin = Tokens::from_lookup(lookup, ADMIN_TOKEN_VARIABLE)?;
        let read = Tokens::from_lookup(lookup, READ_TOKEN_VARIABLE)?;
        Ok((admin.is_some() || read.is_some()).then_some(AdminAccess { admin, read }))
    }

    /// The scope of `token`, if it is one of ours.
    fn scope(&self, token: &[u8]) -> Option<Scope> {
        if self.admin.as_ref().is_some_and(|tokens| tokens.accepts(token)) {
            Some(Scope::Admin)
        } else if self.read.as_ref().is_some_and(|tokens| tokens.accepts(token)) {
            Some(Scope::Read)
        } else {
            None
        }
    }

    /// The scope of a session cookie, if it is one of ours.
    fn cookie_scope(&self, value: &[u8]) -> Option<Scope> {
        if self.admin.as_ref().is_some_and(|tokens| tokens.accepts_cookie(value)) {
            Some(Scope::Admin)
        } else if self.read.as_ref().is_some_and(|tokens| tokens.accepts_cookie(value)) {
            Some(Scope::Read)
        } else {
            None
        }
    }

    /// The session cookie's value for `token`, if it is one of ours.
    fn cookie_value(&self, token: &[u8]) -> Option<String> {
        [&self.admin, &self.read]
            .into_iter()
            .flatten()
            .find_map(|tokens| tokens.cookie_value(token))
    }
}

/// What a token allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    Read,
    Admin,
}

/// How a request proved its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Credential {
    Bearer,
    Cookie,
}

/// A request's verified access, set by the access layer.
#[derive(Clone, Copy, Debug)]
struct Caller {
    scope: Scope,
    credential: Credential,
}

/// What the handlers share.
struct WebState {
    admin: Admin,
    access: AdminAccess,
    sharding: Sharding,
}

/// The `/admin` router of the operations server, and the task that keeps the stuck-work
/// gauges (`effect_cluster_stuck_backlogs`, `effect_cluster_stuck_executions`) current; the
/// task ends when `stop` is cancelled.
pub(crate) fn router(
    admin: Admin,
    access: AdminAccess,
    sharding: Sharding,
    stop: tokio_util::sync::CancellationToken,
) -> Router {
    let state = Arc::new(WebState { admin, access, sharding });
    tokio::spawn(stuck_gauges(Arc::clone(&state), stop));
    let api = Router::new()
        .route("/runners", get(api_runners))
        .route("/shards", get(api_shards))
        .route("/backlog", get(api_backlog))
        .route("/messages", get(api_messages))
        .route("/messages/{id}", get(api_message))
        .route("/messages/{id}/{action}", post(api_message_action))
        .route("/workflows", get(api_workflows))
        .route("/workflows/{name}/{id}", get(api_workflow))
        .route("/workflows/{name}/{id}/{action}", post(api_workflow_action))
        .route("/workflows/{name}/{id}/deferreds/{deferred}", post(api_complete))
        .route("/stuck", get(api_stuck));
    let console = Router::new()
        .route("/", get(page_overview))
        .route("/workflows", get(page_workflows))
        .route("/workflows/{name}/{id}", get(page_workflow))
        .route("/workflows/{name}/{id}/{action}", post(form_workflow_action))
        .route("/console.css", get(|| async { asset("text/css", CSS) }))
        .route("/console.js", get(|| async { asset("text/javascript", SCRIPT) }));
    let protected = Router::new()
        .nest("/api", api)
        .merge(console)
        .route_layer(middleware::from_fn_with_state(Arc::clone(&state), access_layer));
    Router::new()
        .route("/login", get(page_login).post(login))
        .route("/logout", post(logout))
        .merge(protected)
        .layer(axum::extract::DefaultBodyLimit::max(BODY_BYTES_MAX))
        .layer(middleware::from_fn(security_headers))
        .with_state(state)
}

// --- Access ----------------------------------------------------------------------------------

/// Checks the token, the scope and, for an action, the origin; sets the [`Caller`].
async fn access_layer(
    State(state): State<Arc<WebState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| bearer_credentials(value.as_bytes()))
        .map(|token| (state.access.scope(token), Credential::Bearer));
    let cookie = || {
        cookie_token(headers).map(|value| (state.access.cookie_scope(&value), Credential::Cookie))
    };
    let Some((Some(scope), credential)) = bearer.or_else(cookie) else {
        return unauthorized(request.uri().path());
    };
    if request.method() == Method::POST {
        if scope != Scope::Admin {
            return refusal(
                StatusCode::FORBIDDEN,
                "this token may only read: act with an admin token (CLUSTER_ADMIN_TOKEN)",
            );
        }
        if let Err(reason) = same_origin(request.headers(), credential) {
            return refusal(StatusCode::FORBIDDEN, reason);
        }
    }
    request.extensions_mut().insert(Caller { scope, credential });
    next.run(request).await
}

/// The token of the console's cookie.
fn cookie_token(headers: &HeaderMap) -> Option<Vec<u8>> {
    headers.get_all(header::COOKIE).iter().find_map(|value| {
        value.as_bytes().split(|byte| *byte == b';').find_map(|pair| {
            let pair = pair.trim_ascii();
            let value = pair.strip_prefix(COOKIE.as_bytes())?.strip_prefix(b"=")?;
            Some(value.to_vec())
        })
    })
}

/// Whether an action comes from the console's own origin, or from a client that is no
/// browser page of another site.
///
/// Behind a proxy that rewrites `Host`, the proxy's `X-Forwarded-Host` names the console's
/// origin: a page of another site cannot set that header on a form's request.
fn same_origin(headers: &HeaderMap, credential: Credential) -> Result<(), &'static str> {
    let hosts = [header::HOST.as_str(), "x-forwarded-host"]
        .map(|name| headers.get(name).and_then(|host| host.to_str().ok()));
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let authority = origin.split_once("://").map(|(_, authority)| authority);
        let ours = authority.is_some_and(|authority| {
            hosts.iter().flatten().any(|host| authority.eq_ignore_ascii_case(host.trim()))
        });
        return if ours {
            Ok(())
        } else {
            Err("the request comes from another origin: act from the console or the API")
        };
    }
    let fetch_site = headers.get("sec-fetch-site").and_then(|site| site.to_str().ok());
    match (credential, fetch_site) {
        (_, Some("same-origin")) | (Credential::Bearer, None) => Ok(()),
        _ => {
            Err("the request does not show its origin: act from the console or with a bearer token")
        }
    }
}

/// 401: JSON for the API, the login page for the console.
fn unauthorized(path: &str) -> Response {
    if path.starts_with("/api") || path.starts_with("/admin/api") {
        let mut response = refusal(
            StatusCode::UNAUTHORIZED,
            "a token is needed: Authorization: Bearer <CLUSTER_ADMIN_TOKEN or CLUSTER_ADMIN_READ_TOKEN>",
        );
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        response
    } else {
        (StatusCode::UNAUTHORIZED, html_page("Sign in", &login_form(None))).into_response()
    }
}

/// An error answer in JSON.
fn refusal(status: StatusCode, message: &str) -> Response {
    json_response(status, &json!({ "error": message }))
}

/// A JSON answer.
fn json_response(status: StatusCode, value: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], value.to_string()).into_response()
}

/// Headers on every answer: no caching, no framing, no sniffing, no referrer to other sites,
/// and a content security policy that allows the console's own script and style only. The
/// referrer policy is `same-origin`, not `no-referrer`: under `no-referrer` a browser sends
/// `Origin: null`, which the same-origin check refuses.
async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        ("cache-control", "no-store"),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "same-origin"),
        ("x-frame-options", "DENY"),
        (
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

async fn page_login() -> Response {
    html_page("Sign in", &login_form(None)).into_response()
}

/// `POST /admin/login` with `token=…`: sets the cookie and goes to the console.
async fn login(State(state): State<Arc<WebState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(reason) = same_origin(&headers, Credential::Cookie) {
        return refusal(StatusCode::FORBIDDEN, reason);
    }
    let token = form_field(&body, "token").unwrap_or_default();
    let Some(value) = state.access.cookie_value(token.as_bytes()) else {
        let form = login_form(Some("That token is not one of this cluster's admin tokens."));
        return (StatusCode::UNAUTHORIZED, html_page("Sign in", &form)).into_response();
    };
    // The cookie holds the token's digest, never the token.
    let cookie = format!("{COOKIE}={value}; Path=/admin; HttpOnly; SameSite=Strict");
    let mut response = Redirect::to("/admin").into_response();
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

/// `POST /admin/logout`: clears the cookie.
async fn logout() -> Response {
    let mut response = Redirect::to("/admin/login").into_response();
    let cleared = format!("{COOKIE}=; Path=/admin; HttpOnly; SameSite=Strict; Max-Age=0");
    if let Ok(cleared) = HeaderValue::from_str(&cleared) {
        response.headers_mut().insert(header::SET_COOKIE, cleared);
    }
    response
}

fn login_form(error: Option<&str>) -> String {
    let error =
        error.map_or(String::new(), |error| format!("<p class=\"error\">{}</p>", escape(error)));
    format!(
        "<h1>Cluster console</h1>{error}<form method=\"post\" action=\"/admin/login\">\
         <label>Admin token <input type=\"password\" name=\"token\" autocomplete=\"off\" \
         required minlength=\"32\"></label> <button type=\"submit\">Sign in</button></form>\
         <p>The token is <code>CLUSTER_ADMIN_TOKEN</code> or <code>CLUSTER_ADMIN_READ_TOKEN</code> \
         of the runners.</p>"
    )
}

// --- The stuck-work gauges -------------------------------------------------------------------

async fn stuck_gauges(state: Arc<WebState>, stop: tokio_util::sync::CancellationToken) {
    let mut interval = tokio::time::interval(STUCK_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = interval.tick() => {}
        }
        let threshold = state.admin.stuck_threshold();
        match tokio::time::timeout(CALL_DEADLINE, state.admin.stuck(threshold)).await {
            Ok(Ok(stuck)) => record_stuck(&stuck),
            Ok(Err(error)) => tracing::debug!(%error, "the stuck-work check failed"),
            Err(_) => tracing::debug!("the stuck-work check timed out"),
        }
    }
}

/// Sets the stuck-work gauges from `stuck` (computed with the default threshold), and warns
/// when something is stuck.
fn record_stuck(stuck: &super::StuckWork) {
    let backlogs = u32::try_from(stuck.backlogs.len()).unwrap_or(u32::MAX);
    let executions = u32::try_from(stuck.executions.len()).unwrap_or(u32::MAX);
    metrics::gauge!("effect_cluster_stuck_backlogs").set(f64::from(backlogs));
    metrics::gauge!("effect_cluster_stuck_executions").set(f64::from(executions));
    if !stuck.is_empty() {
        tracing::warn!(
            backlogs,
            executions,
            "stuck work: see /admin or `durable-cluster admin stuck`"
        );
    }
}

// --- The API ---------------------------------------------------------------------------------

/// An admin result as JSON, or its error with a status that says what went wrong.
fn answer(result: Result<Value, AdminError>) -> Response {
    match result {
        Ok(value) => json_response(StatusCode::OK, &value),
        Err(error) => {
            let status = match &error {
                AdminError::NotFound(_) => StatusCode::NOT_FOUND,
                AdminError::Refused(_) => StatusCode::CONFLICT,
                AdminError::Storage(_) => StatusCode::SERVICE_UNAVAILABLE,
            };
            refusal(status, &error.to_string())
        }
    }
}

/// Runs storage calls under [`CALL_DEADLINE`]. Past it, an action's outcome is unknown;
/// actions are idempotent, so it may be repeated.
async fn bounded<T>(
    calls: impl std::future::Future<Output = Result<T, AdminError>>,
) -> Result<T, AdminError> {
    tokio::time::timeout(CALL_DEADLINE, calls).await.unwrap_or_else(|_| {
        Err(AdminError::Storage(cluster_core::StorageError::new(
            cluster_core::error::StorageErrorKind::Timeout,
            format!(
                "the storage did not answer within {CALL_DEADLINE:?}; an action may or may not \
                 have been applied, and repeating it is safe"
            ),
        )))
    })
}

type Params = Query<BTreeMap<String, String>>;

fn param<'a>(params: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    params.get(name).map(String::as_str).filter(|value| !value.is_empty())
}

fn limit_param(params: &BTreeMap<String, String>) -> Result<u32, AdminError> {
    match param(params, "limit") {
        None => Ok(50),
        Some(text) => text
            .parse::<u32>()
            .ok()
            .filter(|limit| (1..=LIMIT_MAX).contains(limit))
            .ok_or_else(|| AdminError::Refused(format!("limit {text:?}: use 1 to {LIMIT_MAX}"))),
    }
}

fn id_param(text: &str, what: &str) -> Result<Snowflake, AdminError> {
    text.parse::<u64>()
        .map(Snowflake::new)
        .map_err(|_| AdminError::Refused(format!("{what} {text:?} is not a decimal id")))
}

fn millis_param(
    params: &BTreeMap<String, String>,
    name: &str,
) -> Result<Option<Duration>, AdminError> {
    param(params, name)
        .map(|text| {
            text.parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| AdminError::Refused(format!("{name} {text:?} is not milliseconds")))
        })
        .transpose()
}

async fn api_runners(State(state): State<Arc<WebState>>) -> Response {
    let runners = bounded(state.admin.runners()).await;
    answer(runners.map(|runners| Value::Array(runners.iter().map(views::runner).collect())))
}

async fn api_shards(State(state): State<Arc<WebState>>) -> Response {
    let shards = bounded(state.admin.shards()).await;
    answer(shards.map(|shards| Value::Array(shards.iter().map(views::shard).collect())))
}

async fn api_backlog(State(state): State<Arc<WebState>>, Query(params): Params) -> Response {
    let read = async {
        let stale_after =
            millis_param(&params, "stale_after_ms")?.unwrap_or(Duration::from_secs(60));
        let backlogs = state.admin.backlog(stale_after, limit_param(&params)?).await?;
        let now = state.admin.now();
        Ok(Value::Array(backlogs.iter().map(|backlog| views::backlog(backlog, now)).collect()))
    };
    answer(bounded(read).await)
}

fn request_query(params: &BTreeMap<String, String>) -> Result<RequestQuery, AdminError> {
    Ok(RequestQuery {
        entity_type: param(params, "type").map(str::to_owned),
        entity_type_prefix: param(params, "type_prefix").unwrap_or("").to_owned(),
        entity_id: param(params, "entity").map(str::to_owned),
        tag: param(params, "tag").map(str::to_owned),
        processed: (param(params, "unprocessed") == Some("true")).then_some(false),
        before: param(params, "before").map(|text| id_param(text, "before")).transpose()?,
        newest_first: true,
        limit: limit_param(params)?,
        ..RequestQuery::default()
    })
}

async fn api_messages(State(state): State<Arc<WebState>>, Query(params): Params) -> Response {
    let read = async {
        let records = state.admin.requests(&request_query(&params)?).await?;
        Ok(Value::Array(records.iter().map(views::request).collect()))
    };
    answer(bounded(read).await)
}

async fn api_message(State(state): State<Arc<WebState>>, Path(id): Path<String>) -> Response {
    let read = async { Ok(views::request(&state.admin.request(id_param(&id, "id")?).await?)) };
    answer(bounded(read).await)
}

fn execution_query(params: &BTreeMap<String, String>) -> Result<ExecutionQuery, AdminError> {
    let status = param(params, "status")
        .map(str::parse::<ExecutionStatus>)
        .transpose()
        .map_err(|error| AdminError::Refused(error.to_string()))?;
    Ok(ExecutionQuery {
        workflow: param(params, "name").map(str::to_owned),
        execution_id: param(params, "execution").map(str::to_owned),
        status,
        cursor: param(params, "cursor").map(|text| id_param(text, "cursor")).transpose()?,
        ..ExecutionQuery::newest(limit_param(params)?)
    })
}

async fn api_workflows(State(state): State<Arc<WebState>>, Query(params): Params) -> Response {
    let read =
        async { Ok(views::executions(&state.admin.workflows(&execution_query(&params)?).await?)) };
    answer(bounded(read).await)
}

async fn api_workflow(
    State(state): State<Arc<WebState>>,
    Path((name, id)): Path<(String, String)>,
) -> Response {
    let read = async { Ok(views::detail(&state.admin.workflow(&name, &id).await?)) };
    answer(bounded(read).await)
}

async fn api_stuck(State(state): State<Arc<WebState>>, Query(params): Params) -> Response {
    let read = async {
        let asked = millis_param(&params, "threshold_ms")?;
        let threshold = asked.unwrap_or_else(|| state.admin.stuck_threshold());
        let stuck = state.admin.stuck(threshold).await?;
        if asked.is_none() {
            record_stuck(&stuck);
        }
        Ok(views::stuck(&stuck))
    };
    answer(bounded(read).await)
}

/// Who acted, for the log: the scope and how it signed in (tokens have no names).
fn actor(caller: Caller) -> String {
    let credential = match caller.credential {
        Credential::Bearer => "api",
        Credential::Cookie => "console",
    };
    let scope = match caller.scope {
        Scope::Admin => "admin",
        Scope::Read => "read",
    };
    format!("{credential} ({scope} token)")
}

/// Runs a workflow action, and wakes this runner's storage read loop so that it picks the
/// write up now (the other runners pick it up at their next poll).
async fn workflow_action(
    state: &WebState,
    caller: Caller,
    name: &str,
    id: &str,
    action: &str,
) -> Result<Action, AdminError> {
    let actor = actor(caller);
    let done = bounded(async {
        match action {
            "interrupt" => state.admin.interrupt(&actor, name, id).await,
            "resume" => state.admin.resume(&actor, name, id).await,
            "purge" => state.admin.purge(&actor, name, id).await,
            other => Err(AdminError::NotFound(format!(
                "no action {other:?}: use interrupt, resume or purge"
            ))),
        }
    })
    .await?;
    state.sharding.poll_storage();
    Ok(done)
}

async fn api_workflow_action(
    State(state): State<Arc<WebState>>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((name, id, action)): Path<(String, String, String)>,
) -> Response {
    let done = workflow_action(&state, caller, &name, &id, &action).await;
    answer(done.map(|done| views::action(&done)))
}

async fn api_complete(
    State(state): State<Arc<WebState>>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((name, id, deferred)): Path<(String, String, String)>,
    body: Bytes,
) -> Response {
    let act = async {
        let body: serde_json::Map<String, Value> = serde_json::from_slice(&body).map_err(|_| {
            AdminError::Refused(
                "the body is a JSON object: {\"value\": …} or {\"error\": …}".into(),
            )
        })?;
        let encode = |value: &Value| {
            RawJson::from_json(value.to_string())
                .map_err(|error| AdminError::Refused(error.to_string()))
        };
        let exit = match (body.get("value"), body.get("error")) {
            (Some(_), Some(_)) => {
                return Err(AdminError::Refused("give a value or an error, not both".into()));
            }
            (None, Some(error)) => Exit::Failure(Cause(vec![CauseReason::Fail(encode(error)?)])),
            (Some(value), None) => Exit::Success(encode(value)?),
            (None, None) => Exit::void(),
        };
        let done =
            state.admin.complete_deferred(&actor(caller), &name, &id, &deferred, &exit).await?;
        state.sharding.poll_storage();
        Ok(views::action(&done))
    };
    answer(bounded(act).await)
}

async fn api_message_action(
    State(state): State<Arc<WebState>>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((id, action)): Path<(String, String)>,
) -> Response {
    let act = async {
        let id = id_param(&id, "id")?;
        let actor = actor(caller);
        let done = match action.as_str() {
            "retry" => state.admin.retry(&actor, id).await?,
            "cancel" => state.admin.cancel(&actor, id).await?,
            "release" => state.admin.release_claim(&actor, id).await?,
            other => {
                return Err(AdminError::NotFound(format!(
                    "no action {other:?}: use retry, cancel or release"
                )));
            }
        };
        state.sharding.poll_storage();
        Ok(views::action(&done))
    };
    answer(bounded(act).await)
}

// --- The console -----------------------------------------------------------------------------

async fn form_workflow_action(
    State(state): State<Arc<WebState>>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((name, id, action)): Path<(String, String, String)>,
) -> Response {
    let message = match workflow_action(&state, caller, &name, &id, &action).await {
        Ok(done) => done.to_string(),
        Err(error) => error.to_string(),
    };
    let target = format!(
        "/admin/workflows/{}/{}?message={}",
        encode_path(&name),
        encode_path(&id),
        encode_path(&message)
    );
    Redirect::to(&target).into_response()
}

async fn page_overview(State(state): State<Arc<WebState>>) -> Response {
    let admin = &state.admin;
    let read = async {
        let stuck = admin.stuck(admin.stuck_threshold()).await?;
        record_stuck(&stuck);
        let runners = admin.runners().await?;
        let shards = admin.shards().await?;
        let backlogs = admin.backlog(admin.stuck_threshold(), 100).await?;
        Ok::<_, AdminError>((stuck, runners, shards, backlogs))
    };
    let (stuck, runners, shards, backlogs) = match bounded(read).await {
        Ok(read) => read,
        Err(error) => return error_page(&error),
    };
    let now = admin.now();
    let mut body = String::from("<h1>Cluster</h1>");
    body.push_str(&stuck_banner(&stuck, now));
    let _ = write!(body, "<h2>Runners ({})</h2>", runners.len());
    body.push_str(&html_table(
        &RUNNER_COLUMNS,
        runners.iter().map(|record| escaped(runner_cells(record))),
        "runners",
    ));
    let disagreeing = shards.iter().filter(|shard| !shard.agrees()).count();
    let _ = write!(
        body,
        "<h2>Shards ({}, {} not held by their assigned runner)</h2><div class=\"grid\" id=\"shards\">",
        shards.len(),
        disagreeing
    );
    let mut colors: BTreeMap<String, usize> = BTreeMap::new();
    for shard in &shards {
        let holder = shard.lock.as_ref().map(|lock| lock.holder.to_string());
        let next = colors.len();
        let color = holder.as_ref().map(|holder| *colors.entry(holder.clone()).or_insert(next) % 8);
        let class = match (shard.agrees(), color) {
            (false, _) => "cell bad".to_owned(),
            (true, Some(color)) => format!("cell c{color}"),
            (true, None) => "cell free".to_owned(),
        };
        let title = format!(
            "{}: assigned {}, held by {}",
            shard.shard_id,
            shard.assigned.as_ref().map_or("nobody".to_owned(), ToString::to_string),
            holder.unwrap_or_else(|| "nobody".to_owned())
        );
        let _ = write!(body, "<span class=\"{class}\" title=\"{}\"></span>", escape(&title));
    }
    body.push_str("</div><p class=\"legend\">");
    for (holder, color) in &colors {
        let _ = write!(body, "<span class=\"cell c{}\"></span> {} ", color % 8, escape(holder));
    }
    body.push_str("<span class=\"cell bad\"></span> not held by its assigned runner</p>");
    let _ = write!(body, "<h2>Backlog</h2>");
    body.push_str(&html_table(
        &BACKLOG_COLUMNS,
        backlogs.iter().map(|backlog| escaped(backlog_cells(backlog, now))),
        "backlog",
    ));
    html_page("Cluster", &body).into_response()
}

fn stuck_banner(stuck: &super::StuckWork, now: Timestamp) -> String {
    if stuck.is_empty() {
        return String::new();
    }
    let mut banner = format!(
        "<div class=\"banner\" id=\"stuck\"><strong>Stuck work</strong> (waiting longer than {}):<ul>",
        age(stuck.threshold)
    );
    for late in &stuck.backlogs {
        let holder = late.holder.as_ref().map_or("nobody".to_owned(), |holder| match holder {
            LockHolder::Runner(address) => address.to_string(),
            LockHolder::Session(session) => format!("session {session}"),
        });
        let _ = write!(
            banner,
            "<li>{} on {}: {} due, oldest {}, {} stale claims; held by {}</li>",
            escape(&late.backlog.entity_type),
            escape(&late.backlog.shard_id.to_string()),
            late.backlog.due,
            age(late.backlog.oldest_age(now)),
            late.backlog.stale_claims,
            escape(&holder)
        );
    }
    for summary in &stuck.executions {
        let _ = write!(
            banner,
            "<li>{} <a href=\"/admin/workflows/{}/{}\">{}</a>: suspended, a completion did not wake it</li>",
            escape(&summary.workflow),
            encode_path(&summary.workflow),
            encode_path(&summary.execution_id),
            escape(&summary.execution_id)
        );
    }
    banner.push_str("</ul></div>");
    banner
}

async fn page_workflows(State(state): State<Arc<WebState>>, Query(params): Params) -> Response {
    let page =
        match bounded(async { state.admin.workflows(&execution_query(&params)?).await }).await {
            Ok(page) => page,
            Err(error) => return error_page(&error),
        };
    let now = state.admin.now();
    let selected = param(&params, "status").unwrap_or("");
    let mut body = String::from("<h1>Workflows</h1><form method=\"get\" class=\"filters\">");
    let _ = write!(
        body,
        "<label>Workflow <input name=\"name\" value=\"{}\"></label> \
         <label>Execution <input name=\"execution\" value=\"{}\"></label> \
         <label>Status <select name=\"status\"><option value=\"\">any</option>",
        escape(param(&params, "name").unwrap_or("")),
        escape(param(&params, "execution").unwrap_or(""))
    );
    for status in ExecutionStatus::ALL {
        let chosen = if status.as_str() == selected { " selected" } else { "" };
        let _ = write!(body, "<option{chosen}>{status}</option>");
    }
    body.push_str("</select></label> <button type=\"submit\">Filter</button></form>");
    body.push_str(&html_table(
        &["Workflow", "Execution", "Status", "Started", "Updated"],
        page.executions.iter().map(|summary| {
            let status = status_text(summary);
            vec![
                escape(&summary.workflow),
                format!(
                    "<a href=\"/admin/workflows/{}/{}\">{}</a>",
                    encode_path(&summary.workflow),
                    encode_path(&summary.execution_id),
                    escape(&summary.execution_id)
                ),
                format!("<span class=\"status {}\">{status}</span>", summary.status),
                relative(now, summary.started),
                summary.updated.map_or("-".into(), |at| relative(now, at)),
            ]
        }),
        "workflows",
    ));
    if let Some(next) = page.next {
        let mut query: Vec<String> = params
            .iter()
            .filter(|(name, _)| name.as_str() != "cursor")
            .map(|(name, value)| format!("{}={}", encode_path(name), encode_path(value)))
            .collect();
        query.push(format!("cursor={next}"));
        let _ =
            write!(body, "<p><a href=\"/admin/workflows?{}\">Older</a></p>", query.join("&amp;"));
    }
    html_page("Workflows", &body).into_response()
}

async fn page_workflow(
    State(state): State<Arc<WebState>>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((name, id)): Path<(String, String)>,
    Query(params): Params,
) -> Response {
    let detail = match bounded(state.admin.workflow(&name, &id)).await {
        Ok(detail) => detail,
        Err(error) => return error_page(&error),
    };
    let now = state.admin.now();
    let summary = &detail.summary;
    let mut body = format!(
        "<p><a href=\"/admin/workflows\">Workflows</a></p><h1>{} <code>{}</code></h1>",
        escape(&summary.workflow),
        escape(&summary.execution_id)
    );
    if let Some(message) = param(&params, "message") {
        let _ = write!(body, "<p class=\"message\" id=\"message\">{}</p>", escape(message));
    }
    let _ = write!(
        body,
        "<p>Status <span class=\"status {}\" id=\"status\">{}</span>, started {}",
        summary.status,
        status_text(summary),
        relative(now, summary.started),
    );
    if let Some(parent) = &summary.parent {
        let _ = write!(
            body,
            ", child of <a href=\"/admin/workflows/{}/{}\">{} {}</a>",
            encode_path(&parent.workflow),
            encode_path(&parent.execution_id),
            escape(&parent.workflow),
            escape(&parent.execution_id)
        );
    }
    body.push_str(".</p>");
    if let Some(result) = &summary.result {
        let _ = write!(
            body,
            "<pre class=\"result\">{}</pre>",
            escape(&views::result(result).to_string())
        );
    }
    if caller.scope == Scope::Admin {
        body.push_str("<div class=\"actions\">");
        let base = format!("/admin/workflows/{}/{}", encode_path(&name), encode_path(&id));
        let mut button = |action: &str, label: &str, enabled: bool, confirm: &str| {
            if enabled {
                let _ = write!(
                    body,
                    "<form method=\"post\" action=\"{base}/{action}\" data-confirm=\"{confirm}\">\
                     <button type=\"submit\" id=\"{action}\">{label}</button></form>"
                );
            }
        };
        let finished = summary.status.is_finished();
        button("interrupt", "Interrupt", !finished, "Interrupt this execution?");
        button(
            "resume",
            "Resume",
            summary.status == ExecutionStatus::Suspended,
            "Resume this execution?",
        );
        button("purge", "Purge", finished, "Delete this execution and its history?");
        body.push_str("</div>");
    }
    body.push_str("<h2>Timeline</h2>");
    body.push_str(&timeline(&detail, now));
    html_page(&format!("{} {}", summary.workflow, summary.execution_id), &body).into_response()
}

/// An execution's steps as a table.
fn timeline(detail: &cluster_workflow::inspect::ExecutionDetail, now: Timestamp) -> String {
    html_table(
        &["Sent", "Kind", "Name", "Outcome", "Answered"],
        detail.steps.iter().map(|step| {
            let (outcome, class) = match &step.outcome {
                StepOutcome::Pending => ("pending".to_owned(), "pending"),
                StepOutcome::Suspended => ("suspended".to_owned(), "suspended"),
                StepOutcome::Done(_) if step.kind == StepKind::Interrupt => {
                    ("signalled".to_owned(), "interrupted")
                }
                StepOutcome::Done(exit) => match exit {
                    Exit::Success(value) => match value.json().filter(|json| *json != "null") {
                        Some(json) => (format!("success {json}"), "completed"),
                        None => ("success".to_owned(), "completed"),
                    },
                    Exit::Failure(cause) if cause.has_interrupts_only() => {
                        ("interrupted".to_owned(), "interrupted")
                    }
                    Exit::Failure(_) => {
                        (format!("{} {}", exit_summary(exit), views::exit(exit)), "failed")
                    }
                },
            };
            let kind = match &step.kind {
                StepKind::Activity { attempt } => {
                    format!("activity (attempt {attempt})")
                }
                StepKind::Sleep { wake_at } => {
                    format!("sleep (wakes {})", relative(now, *wake_at))
                }
                other => other.as_str().to_owned(),
            };
            vec![
                relative(now, step.sent),
                escape(&kind),
                escape(&step.name),
                format!(
                    "<span class=\"status {class}\">{}</span>",
                    escape(&truncate(&outcome, 200))
                ),
                step.answered.map_or("-".into(), |at| relative(now, at)),
            ]
        }),
        "timeline",
    )
}

fn error_page(error: &AdminError) -> Response {
    let status = match error {
        AdminError::NotFound(_) => StatusCode::NOT_FOUND,
        AdminError::Refused(_) => StatusCode::BAD_REQUEST,
        AdminError::Storage(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    let body = format!("<h1>Error</h1><p class=\"error\">{}</p>", escape(&error.to_string()));
    (status, html_page("Error", &body)).into_response()
}

// --- HTML ------------------------------------------------------------------------------------

fn html_page(title: &str, body: &str) -> axum::response::Html<String> {
    axum::response::Html(format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · cluster console</title><link rel=\"stylesheet\" href=\"/admin/console.css\">\
         <script src=\"/admin/console.js\" defer></script></head><body>\
         <nav><a href=\"/admin\">Cluster</a> <a href=\"/admin/workflows\">Workflows</a>\
         <form method=\"post\" action=\"/admin/logout\" class=\"logout\"><button type=\"submit\">Sign out</button></form>\
         <label class=\"refresh\"><input type=\"checkbox\" id=\"refresh\"> refresh every 5 s</label></nav>\
         <main>{body}</main></body></html>",
        escape(title)
    ))
}

fn html_table(header: &[&str], rows: impl Iterator<Item = Vec<String>>, id: &str) -> String {
    let mut table = format!("<table id=\"{id}\"><thead><tr>");
    for title in header {
        let _ = write!(table, "<th>{}</th>", escape(title));
    }
    table.push_str("</tr></thead><tbody>");
    let mut empty = true;
    for row in rows {
        empty = false;
        table.push_str("<tr>");
        for cell in row {
            let _ = write!(table, "<td>{cell}</td>");
        }
        table.push_str("</tr>");
    }
    if empty {
        let _ = write!(table, "<tr><td colspan=\"{}\" class=\"none\">none</td></tr>", header.len());
    }
    table.push_str("</tbody></table>");
    table
}

/// Cells of text made safe for HTML.
fn escaped(cells: Vec<String>) -> Vec<String> {
    cells.iter().map(|cell| escape(cell)).collect()
}

/// Text made safe for HTML content and attribute values.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for character in text.chars() {
        match character {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            other => out.push(other),
        }
    }
    out
}

/// Every byte but the unreserved ones (RFC 3986: letters, digits, `-`, `_`, `.`, `~`).
const RESERVED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');

/// Text made safe for a URL's path segment or query value: every byte but the unreserved ones
/// percent-encoded.
fn encode_path(text: &str) -> String {
    utf8_percent_encode(text, RESERVED).to_string()
}

/// A field of an `application/x-www-form-urlencoded` body (`+` a space, `%XX` a byte; a
/// malformed escape is kept as it is).
fn form_field(body: &[u8], name: &str) -> Option<String> {
    form_urlencoded::parse(body).find(|(key, _)| key == name).map(|(_, value)| value.into_owned())
}

fn truncate(text: &str, chars: usize) -> String {
    if text.chars().count() <= chars {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(chars).collect();
    cut.push('…');
    cut
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// The console's style.
const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2127;background:#f6f7f9}\
nav{display:flex;gap:1em;align-items:center;padding:.6em 1.2em;background:#1d2127}\
nav a{color:#fff;text-decoration:none;font-weight:600}nav .logout{margin-left:auto}\
nav .refresh{color:#ccd}main{padding:1em 1.5em}h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}\
table{border-collapse:collapse;background:#fff;min-width:40em}th,td{padding:.3em .7em;border-bottom:1px solid #e3e5e8;text-align:left}\
th{background:#eceef1}td.none{color:#889}.grid{display:flex;flex-wrap:wrap;gap:2px;max-width:64em}\
.cell{display:inline-block;width:12px;height:12px;border-radius:2px}.free{background:#d5d8dc}.bad{background:#d33}\
.c0{background:#2b7bb9}.c1{background:#3a9a5b}.c2{background:#b07d2b}.c3{background:#7a4fb0}\
.c4{background:#2ba5a5}.c5{background:#b04f7a}.c6{background:#6b8e23}.c7{background:#555}\
.legend{color:#445}.banner{background:#fde8e8;border:1px solid #d33;padding:.6em 1em;border-radius:4px}\
.message{background:#e8f3fd;border:1px solid #2b7bb9;padding:.5em 1em;border-radius:4px}.error{color:#b00}\
.status{font-weight:600}.running{color:#2b7bb9}.suspended{color:#b07d2b}.completed{color:#3a9a5b}\
.failed{color:#d33}.interrupted{color:#7a4fb0}.pending{color:#889}.actions{display:flex;gap:.6em;margin:1em 0}\
.filters{margin:1em 0}pre.result{background:#fff;padding:.6em;border:1px solid #e3e5e8;overflow:auto}";

/// The console's script: a confirmation before an action, and the optional refresh.
const SCRIPT: &str = "document.addEventListener('submit',function(e){var m=e.target.getAttribute('data-confirm');\
if(m&&!window.confirm(m)){e.preventDefault();}});\
document.addEventListener('DOMContentLoaded',function(){var box=document.getElementById('refresh');if(!box)return;\
box.checked=sessionStorage.getItem('refresh')==='1';box.addEventListener('change',function(){\
sessionStorage.setItem('refresh',box.checked?'1':'0');});\
setInterval(function(){if(box.checked){location.reload();}},5000);});";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_and_urls_are_escaped() {
        assert_eq!(
            escape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(encode_path("a b/c?d"), "a%20b%2Fc%3Fd");
        assert_eq!(form_field(b"x=1&token=ab%2Bc+d", "token").as_deref(), Some("ab+c d"));
        assert_eq!(form_field(b"token=%zz%4", "token").as_deref(), Some("%zz%4"));
    }

    #[test]
    fn the_same_origin_check_wants_the_consoles_origin() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, HeaderValue::from_static(value));
            }
            map
        };
        let host = ("host", "127.0.0.1:9090");
        let same = headers(&[host, ("origin", "http://127.0.0.1:9090")]);
        assert!(same_origin(&same, Credential::Cookie).is_ok());
        let other = headers(&[host, ("origin", "http://evil.example")]);
        assert!(same_origin(&other, Credential::Cookie).is_err());
        assert!(
            same_origin(&other, Credential::Bearer).is_err(),
            "a foreign origin, whatever the token"
        );
        let bare = headers(&[host]);
        assert!(same_origin(&bare, Credential::Bearer).is_ok(), "a client that is no browser");
        assert!(same_origin(&bare, Credential::Cookie).is_err(), "a cookie needs its origin shown");
        let fetched = headers(&[host, ("sec-fetch-site", "same-origin")]);
        assert!(same_origin(&fetched, Credential::Cookie).is_ok());
        let proxied = headers(&[
            ("host", "10.0.0.5:9090"),
            ("x-forwarded-host", "console.example.com"),
            ("origin", "https://console.example.com"),
        ]);
        assert!(same_origin(&proxied, Credential::Cookie).is_ok(), "behind a proxy");
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_static("a=1; cluster_admin=tok; b=2"));
        assert_eq!(cookie_token(&headers), Some(b"tok".to_vec()));
        headers.insert(header::COOKIE, HeaderValue::from_static("cluster_admin_x=1"));
        assert_eq!(cookie_token(&headers), None);
    }
}
