//! Unreachable and restarting servers; garbage, truncated, oversize and stalled frames.

use std::time::Duration;

use cluster_core::error::ClusterError;
use cluster_core::ids::RunnerAddress;
use cluster_core::transport::{Probe, Transport};
use cluster_rpc::{RpcConfig, RpcServer, TcpTransport};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::support::{
    DEADLINE, FakeHandler, closed_by_server, config, raw_client, request, runner_address, serve,
    within,
};
use cluster_testkit::wait::{eventually_async, eventually_within};

#[tokio::test]
async fn a_server_that_is_not_listening_is_unavailable_quickly() {
    // A port that was just free: nothing listens there.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let address = RunnerAddress::new("127.0.0.1", port);
    let runners = TcpTransport::new(config()).expect("config");
    let started = Instant::now();
    let error = within(runners.send(&address, request(1, "Echo"), false)).await;
    assert!(
        matches!(&error, Err(ClusterError::RunnerUnavailable { address: at }) if *at == address)
    );
    assert!(within(runners.ping(&address)).await.is_err());
    assert!(started.elapsed() < Duration::from_secs(1), "took {:?}", started.elapsed());
}

#[tokio::test]
async fn a_probe_tells_a_gone_runner_from_a_listening_one() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let address = runner_address(&server);
    let runners = TcpTransport::new(config()).expect("config");
    // No connection open yet: the probe connects and closes, and the server serves on.
    assert_eq!(within(runners.probe(&address)).await, Probe::Listening);
    within(runners.ping(&address)).await.expect("ping after a probe");
    // A connection is open: it answers for the peer.
    assert_eq!(within(runners.probe(&address)).await, Probe::Listening);
    eventually_within("server.connection_count() == 1", DEADLINE, || {
        server.connection_count() == 1
    })
    .await;

    // The process is gone: its connection closes and its port refuses.
    within(server.shutdown()).await;
    eventually_async("the probe says refused", || {
        let runners = std::sync::Arc::clone(&runners);
        let address = address.clone();
        async move { runners.probe(&address).await == Probe::Refused }
    })
    .await;

    // A probe that cannot tell (here, a name that never resolves) is not "gone".
    let nowhere = RunnerAddress::new("runner.invalid", 9);
    assert_eq!(within(runners.probe(&nowhere)).await, Probe::Unknown);
}

#[tokio::test]
async fn the_client_reconnects_after_a_server_restart() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let address = runner_address(&server);
    let listen = server.local_addr();
    let runners = TcpTransport::new(config()).expect("config");
    within(runners.send(&address, request(1, "Echo"), false)).await.expect("before");
    within(server.shutdown()).await;
    let error = within(runners.send(&address, request(2, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");

    let restarted = RpcServer::bind(listen, config()).await.expect("rebind").serve(handler.clone());
    // Calls may meet the backoff window first; the first one after it reconnects.
    let mut reply = Err(ClusterError::RunnerUnavailable { address: address.clone() });
    let deadline = Instant::now() + crate::support::DEADLINE;
    while reply.is_err() && Instant::now() < deadline {
        reply = runners.send(&address, request(3, "Echo"), false).await;
        if reply.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(reply.expect("after the restart").is_final());
    assert_eq!(restarted.connection_count(), 1);
}

/// Sends `bytes` on a handshaken raw connection and checks that the server closes it, that the
/// handler saw nothing, and that a good client is still served.
async fn closes_only_that_connection(bytes: &[u8], close_after: bool) {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    within(runners.ping(&address)).await.expect("good client");

    let mut raw = raw_client(server.local_addr(), b"").await;
    raw.write_all(bytes).await.expect("write");
    if close_after {
        raw.shutdown().await.expect("half-close");
    }
    assert!(closed_by_server(&mut raw).await, "the server kept a broken connection");
    eventually_within("server.connection_count() == 1", DEADLINE, || {
        server.connection_count() == 1
    })
    .await;
    assert_eq!(handler.calls(), 0);
    let reply = within(runners.send(&address, request(5, "Echo"), false)).await;
    assert!(reply.expect("the good client still works").is_final());
    assert!(runners.is_connected(&address));
}

#[tokio::test]
async fn random_bytes_close_only_that_connection() {
    // A fixed-seed xorshift: replayable "random" bytes.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()[0]
        })
        .collect();
    closes_only_that_connection(&bytes, false).await;
}

#[tokio::test]
async fn a_well_framed_garbage_body_closes_only_that_connection() {
    let mut bytes = 16_u32.to_be_bytes().to_vec();
    bytes.extend_from_slice(&[0xff; 16]);
    closes_only_that_connection(&bytes, false).await;
}

#[tokio::test]
async fn a_truncated_frame_closes_only_that_connection() {
    let mut bytes = 1000_u32.to_be_bytes().to_vec();
    bytes.extend_from_slice(&[0; 10]);
    closes_only_that_connection(&bytes, true).await;
}

#[tokio::test]
async fn an_oversize_frame_closes_only_that_connection() {
    // The header alone announces more than the limit: nothing more needs to be sent.
    let bytes = (config().max_frame_bytes + 1).to_be_bytes();
    closes_only_that_connection(&bytes, false).await;
}

#[tokio::test]
async fn garbage_before_the_handshake_is_refused() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let mut raw = TcpStream::connect(server.local_addr()).await.expect("connect");
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n-----------------").await.expect("write");
    assert!(closed_by_server(&mut raw).await);
    assert_eq!(server.connection_count(), 0);
    assert_eq!(handler.calls(), 0);
}

/// A peer that has passed the handshake, announces a near-maximal frame and sends one byte of
/// it has its connection closed after the frame timeout (and is logged); the server carries on.
#[tokio::test]
async fn a_frame_that_stalls_closes_its_connection_after_the_frame_timeout() {
    let handler = FakeHandler::new();
    let server_config = RpcConfig { frame_timeout: Duration::from_millis(300), ..config() };
    let max = server_config.max_frame_bytes;
    let server = serve(server_config, handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    within(runners.ping(&address)).await.expect("good client");

    let mut raw = raw_client(server.local_addr(), b"").await;
    eventually_within("server.connection_count() == 2", DEADLINE, || {
        server.connection_count() == 2
    })
    .await;
    let started = Instant::now();
    raw.write_all(&(max - 1).to_be_bytes()).await.expect("length");
    raw.write_all(&[0]).await.expect("one byte");
    assert!(closed_by_server(&mut raw).await, "the server kept a stalled frame");
    assert!(started.elapsed() < Duration::from_secs(5), "closed after {:?}", started.elapsed());
    eventually_within("server.connection_count() == 1", DEADLINE, || {
        server.connection_count() == 1
    })
    .await;
    assert_eq!(handler.calls(), 0);
    let reply = within(runners.send(&address, request(5, "Echo"), false)).await;
    assert!(reply.expect("the good client still works").is_final());
}
