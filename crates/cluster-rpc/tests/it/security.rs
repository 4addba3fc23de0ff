//! The shared-secret handshake.

use cluster_core::error::ClusterError;
use cluster_core::transport::Transport;
use cluster_rpc::{RpcConfig, TcpTransport};
use tokio::io::AsyncWriteExt;

use crate::support::{
    FakeHandler, closed_by_server, config, raw_client, request, runner_address, serve, within,
};

fn with_secret(secret: &str) -> RpcConfig {
    RpcConfig { secret: Some(secret.as_bytes().into()), ..config() }
}

#[tokio::test]
async fn the_right_secret_is_accepted() {
    let handler = FakeHandler::new();
    let server = serve(with_secret("s3cret"), handler.clone()).await;
    let runners = TcpTransport::new(with_secret("s3cret")).expect("config");
    let reply = within(runners.send(&runner_address(&server), request(1, "Echo"), false)).await;
    assert!(reply.expect("reply").is_final());
}

#[tokio::test]
async fn a_wrong_or_missing_secret_is_refused_before_any_call() {
    let handler = FakeHandler::new();
    let server = serve(with_secret("s3cret"), handler.clone()).await;
    let address = runner_address(&server);
    for client in [with_secret("guess"), config()] {
        let runners = TcpTransport::new(client).expect("config");
        let error = within(runners.send(&address, request(1, "Echo"), false)).await;
        assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
        let error = within(runners.notify(
            &address,
            cluster_core::Envelope::Request(request(2, "Echo")),
            false,
        ))
        .await;
        assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
        assert!(!runners.is_connected(&address));
    }
    assert_eq!(handler.calls(), 0);
    assert_eq!(server.connection_count(), 0);
}

#[tokio::test]
async fn a_client_with_a_secret_refuses_a_server_without_one() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(with_secret("s3cret")).expect("config");
    let error = within(runners.send(&runner_address(&server), request(1, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
    assert_eq!(handler.calls(), 0);
}

#[tokio::test]
async fn frames_sent_after_a_failed_proof_are_never_decoded() {
    let handler = FakeHandler::new();
    let server = serve(with_secret("s3cret"), handler.clone()).await;
    // The raw client proves the empty key: the server must refuse it, whatever follows.
    let mut raw = tokio::net::TcpStream::connect(server.local_addr()).await.expect("connect");
    let mut hello = b"CRPC\x01".to_vec();
    hello.extend_from_slice(&[1; 32]);
    raw.write_all(&hello).await.expect("hello");
    raw.write_all(&[0; 32]).await.expect("bad proof");
    let _ = raw.write_all(&[0, 0, 0, 2, 0, 0]).await;
    assert!(closed_by_server(&mut raw).await);
    assert_eq!(handler.calls(), 0);
    assert_eq!(server.connection_count(), 0);
    // A raw client with the secret gets through (the test's handshake matches the crate's).
    let _accepted = raw_client(server.local_addr(), b"s3cret").await;
}

#[tokio::test]
async fn config_from_env_names_the_bad_variable() {
    let error = RpcConfig::from_env_with(|var| {
        Ok((var == "CLUSTER_RPC_MAX_FRAME_BYTES").then(|| "lots".to_owned()))
    })
    .expect_err("a bad value");
    assert_eq!((error.key(), error.value()), ("CLUSTER_RPC_MAX_FRAME_BYTES", "lots"));
    let error = RpcConfig::from_env_with(|var| {
        Ok((var == "CLUSTER_RPC_STREAM_BUFFER").then(|| "0".to_owned()))
    })
    .expect_err("out of range");
    assert_eq!(error.key(), "CLUSTER_RPC_STREAM_BUFFER");
    let config = RpcConfig::from_env_with(|var| {
        Ok(match var {
            "CLUSTER_RPC_SECRET" => Some("k".to_owned()),
            "CLUSTER_RPC_IDLE_EXPIRY" => Some("2 seconds".to_owned()),
            _ => None,
        })
    })
    .expect("valid");
    assert_eq!(config.secret.as_deref(), Some(&b"k"[..]));
    assert_eq!(config.idle_expiry, std::time::Duration::from_secs(2));
}

#[cfg(not(feature = "tls"))]
#[test]
fn tls_variables_without_the_tls_feature_are_an_error() {
    for var in [
        "CLUSTER_RPC_TLS_CERT",
        "CLUSTER_RPC_TLS_KEY",
        "CLUSTER_RPC_TLS_CA",
        "CLUSTER_RPC_TLS_SERVER_NAME",
        "CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT",
    ] {
        let error = RpcConfig::from_env_with(|name| Ok((name == var).then(|| "x".to_owned())))
            .expect_err("TLS requested without TLS support");
        assert_eq!(error.key(), var);
        assert!(error.reason().contains("built without the tls feature"), "{error}");
    }
}
