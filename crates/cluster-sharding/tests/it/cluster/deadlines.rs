//! Storage deadlines against a database that stops answering: a TCP proxy in front of
//! PostgreSQL stops forwarding (its connections stay open, as in a network stall), the runner
//! fails its calls within their deadlines, gives its shards up as a lost lock requires, and
//! takes them again once forwarding resumes.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::error::{ClusterError, StorageErrorKind};
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{RunnerAddress, ShardingConfig};
use cluster_sharding::{CallError, Sharding};
use cluster_storage_sql::postgres::{PgMessageStorage, PgRunnerStorage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::{Backend, Net, config, eventually_within, split, sql_options};
use crate::entities::{Counter, Deposit};

/// A proxy on 127.0.0.1 that forwards every connection to `upstream` while not paused; paused,
/// it holds the bytes and keeps the connections open. A side that closes closes the other.
struct StallingProxy {
    address: std::net::SocketAddr,
    paused: watch::Sender<bool>,
    _tasks: JoinSet<()>,
}

impl StallingProxy {
    async fn start(upstream: String) -> StallingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (paused, watch) = watch::channel(false);
        let mut tasks = JoinSet::new();
        tasks.spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                // Pipes of closed connections are reaped, so the set holds the open ones only.
                while connections.try_join_next().is_some() {}
                let Ok(server) = TcpStream::connect(&upstream).await else { continue };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                connections.spawn(pipe(client_read, server_write, watch.clone()));
                connections.spawn(pipe(server_read, client_write, watch.clone()));
            }
        });
        StallingProxy { address, paused, _tasks: tasks }
    }

    fn pause(&self, paused: bool) {
        self.paused.send_replace(paused);
    }
}

/// Copies `from` to `to`, holding each chunk while the proxy is paused.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: watch::Receiver<bool>,
) {
    let mut buffer = vec![0_u8; 16 * 1024];
    loop {
        if paused.wait_for(|paused| !*paused).await.is_err() {
            return;
        }
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if paused.wait_for(|paused| !*paused).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// `url` with its host and port replaced by `address`.
fn through(url: &str, address: std::net::SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let user = authority.rsplit_once('@').map(|(user, _)| format!("{user}@")).unwrap_or_default();
    format!("{scheme}://{user}{address}/{path}")
}

/// The host and port of `url`.
fn upstream(url: &str) -> String {
    let rest = url.split_once("://").unwrap().1;
    let authority = rest.split_once('/').map_or(rest, |(authority, _)| authority);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    if host_port.contains(':') { host_port.to_owned() } else { format!("{host_port}:5432") }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_database_fails_calls_within_their_deadlines_and_the_runner_recovers() {
    let Some(mut net) = Net::postgres().await else { return };
    let expiration = Duration::from_secs(3);
    net.expiration = expiration;
    let Backend::Postgres { url, prefix } = &net.backend else { unreachable!() };
    let proxy = StallingProxy::start(upstream(url)).await;
    let proxied = through(url, proxy.address);
    let options = sql_options(prefix.clone(), expiration, &net.groups);
    let messages: Arc<dyn MessageStorage> =
        Arc::new(PgMessageStorage::connect(&proxied, &options).await.unwrap());
    let locks: Arc<dyn RunnerStorage> =
        Arc::new(PgRunnerStorage::connect(&proxied, &options).await.unwrap());
    let deadline = Duration::from_secs(1);
    let config = ShardingConfig {
        storage_read_timeout: deadline,
        storage_write_timeout: deadline,
        shard_lock_expiration: expiration,
        shard_lock_refresh_interval: Duration::from_millis(300),
        ..config(Some(RunnerAddress::new("127.0.0.1", 16_001)))
    };
    let runner = Sharding::member(config, messages, locks).start().await.unwrap();
    runner.entity::<Counter>().register().unwrap();
    eventually_within("the runner holds every shard", Duration::from_secs(20), || {
        split(&[&runner])
    })
    .await;
    let counter = runner.client::<Counter>(net.id("stalled").as_str());
    assert_eq!(counter.send(Deposit { key: "before".to_owned(), amount: 1 }).await.unwrap(), 1);

    proxy.pause(true);
    // A call fails within its deadline, with a timeout, rather than hanging.
    let began = tokio::time::Instant::now();
    let stalled = tokio::time::timeout(
        Duration::from_secs(10),
        counter.send(Deposit { key: "stalled".to_owned(), amount: 2 }),
    )
    .await
    .expect("the call fails instead of hanging");
    let took = began.elapsed();
    match stalled {
        Err(CallError::Cluster(ClusterError::Persistence(error))) => {
            assert_eq!(error.kind(), StorageErrorKind::Timeout, "{error}");
        }
        other => panic!("expected a storage timeout, got {other:?}"),
    }
    assert!(took < deadline + Duration::from_secs(2), "failed after {took:?}");
    // The lock refresh fails too: the runner lets every shard go.
    eventually_within("the runner gives its shards up", Duration::from_secs(10), || {
        runner.acquired_shards().is_empty() && !runner.readiness().lock_storage_healthy
    })
    .await;

    proxy.pause(false);
    eventually_within("the runner takes its shards again", Duration::from_secs(30), || {
        split(&[&runner])
    })
    .await;
    let after = tokio::time::timeout(
        Duration::from_secs(20),
        counter.send(Deposit { key: "after".to_owned(), amount: 5 }),
    )
    .await
    .expect("answered after the stall");
    assert!(after.is_ok(), "{after:?}");
    runner.shutdown().await;
}

#[test]
fn urls_go_through_the_proxy() {
    let address: std::net::SocketAddr = "127.0.0.1:4000".parse().unwrap();
    assert_eq!(
        through("postgres://postgres@127.0.0.1:5432/test", address),
        "postgres://postgres@127.0.0.1:4000/test"
    );
    assert_eq!(upstream("postgres://postgres@127.0.0.1:5432/test"), "127.0.0.1:5432");
    assert_eq!(upstream("postgres://db.local/test"), "db.local:5432");
}
