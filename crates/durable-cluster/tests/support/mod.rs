//! What the runner tests share: a runner's settings on an SQLite file of the test's own.
#![allow(dead_code, reason = "each test binary uses a part of it")]

use std::collections::BTreeMap;

use durable_cluster::{Role, RunnerEnv, RunnerError};

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

/// `GET path` over HTTP/1.1 on a connection of its own: the status and the body.
pub(crate) async fn get(
    address: std::net::SocketAddr,
    path: &str,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default();
    Ok((status, body))
}
