//! What the runner tests share: a runner's settings on an SQLite file of the test's own.
#![allow(dead_code, reason = "each test binary uses a part of it")]

use std::collections::BTreeMap;
use std::net::SocketAddr;

use durable_cluster::workflow::{DurableDeferred, Workflow, WorkflowContext};
use durable_cluster::{Role, RunnerEnv, RunnerError};
use serde::{Deserialize, Serialize};

/// A single runner on `database`, with the default configuration.
pub(crate) async fn single_runner(
    database: &cluster_testkit::databases::TestDatabase,
) -> durable_cluster::Sharding {
    let config = durable_cluster::ShardingConfig::default();
    let (messages, runners) = database.open(&config).await.unwrap();
    durable_cluster::Sharding::single_runner(config, messages, runners).start().await.unwrap()
}

/// The SQLite file of the test `name`.
pub(crate) fn database(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("durable-cluster-{name}-{}.db", std::process::id()))
}

/// Removes the SQLite file of the test `name` and its journal files.
pub(crate) fn remove_database(name: &str) {
    let path = database(name);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// A runner's variables on a fresh SQLite file, advertised on loopback at a free port, with
/// `extra` (which may replace them).
pub(crate) fn env(name: &str, extra: &[(&str, &str)]) -> Result<RunnerEnv, RunnerError> {
    remove_database(name);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut vars: BTreeMap<String, String> = [
        ("CLUSTER_STORAGE_URL", format!("sqlite:{}", database(name).display())),
        ("HOST", "127.0.0.1".to_owned()),
        ("PORT", port.to_string()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    for (name, value) in extra {
        vars.insert((*name).to_owned(), (*value).to_owned());
    }
    RunnerEnv::from_lookup(Role::Runner, move |name| vars.get(name).cloned())
}

/// One exchange: the status, the content type and the body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) content_type: Option<String>,
    pub(crate) body: String,
    /// The status line and the headers, as received.
    pub(crate) head: String,
}

/// Sends `method path` with `headers` and `body` over HTTP/1.1, one connection per request.
pub(crate) async fn exchange(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> Answer {
    try_exchange(address, method, path, headers, body).await.unwrap()
}

/// [`exchange`], failing when the connection or the answer does.
pub(crate) async fn try_exchange(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> std::io::Result<Answer> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let response = String::from_utf8(response).map_err(|_| invalid("not UTF-8"))?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or_else(|| invalid("no head"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .ok_or_else(|| invalid("no status"))?;
    let content_type = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("content-type").then(|| value.trim().to_owned())
    });
    let chunked = head.lines().any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.eq_ignore_ascii_case("transfer-encoding") && value.trim() == "chunked"
        })
    });
    let body =
        if chunked { dechunk(body).ok_or_else(|| invalid("bad chunks"))? } else { body.to_owned() };
    Ok(Answer { status, content_type, body, head: head.to_owned() })
}

/// The body of a chunked transfer encoding; `None` when it is cut or malformed.
fn dechunk(mut rest: &str) -> Option<String> {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(body);
        }
        body.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// `GET path` over HTTP/1.1 on a connection of its own: the status and the body.
pub(crate) async fn get(address: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let answer = try_exchange(address, "GET", path, &[], b"").await?;
    Ok((answer.status, answer.body))
}

/// A workflow that waits for an approval: the deferred `approval`, completed over HTTP from its
/// token. Its payload's field is one the HTTP property test's JSON never has (it would wait).
pub(crate) struct Approval;

#[derive(Serialize, Deserialize)]
pub(crate) struct ApprovalPayload {
    pub(crate) approval_id: String,
}

impl Workflow for Approval {
    const NAME: &'static str = "Approval";
    type Payload = ApprovalPayload;
    type Success = String;
    type Error = String;

    fn idempotency_key(payload: &ApprovalPayload) -> String {
        payload.approval_id.clone()
    }
}

/// The deferred an `Approval` waits for.
pub(crate) fn approval() -> DurableDeferred<String, String> {
    DurableDeferred::new("approval").unwrap()
}

pub(crate) async fn approve(ctx: WorkflowContext, _: ApprovalPayload) -> Result<String, String> {
    let by = ctx.await_deferred(&approval()).await?;
    Ok(format!("approved by {by}"))
}
