//! The shared-secret handshake, the length of the secret and the MACs of frames.

use cluster_core::error::ClusterError;
use cluster_core::transport::Transport;
use cluster_rpc::{RpcConfig, RpcError, RpcServer, TcpTransport};
use tokio::io::AsyncWriteExt;

use crate::support::{
    DEADLINE, FakeHandler, HELLO, Warnings, closed_by_server, config, hmac, raw_client,
    raw_session, request, runner_address, sealed_frame, serve, within,
};
use cluster_testkit::wait::eventually_within;

/// A secret long enough to be accepted (the checks below look for "s3cret" in what is shown).
const SECRET: &str = "s3cret-0123456789abcdef0123456789abcdef";
/// Another one, held by the wrong peers.
const OTHER_SECRET: &str = "guess-0123456789abcdef0123456789abcdef";

fn with_secret(secret: &str) -> RpcConfig {
    RpcConfig { secret: Some(secret.as_bytes().into()), ..config() }
}

#[tokio::test]
async fn the_right_secret_is_accepted() {
    let handler = FakeHandler::new();
    let server = serve(with_secret(SECRET), handler.clone()).await;
    let runners = TcpTransport::new(with_secret(SECRET)).expect("config");
    let reply = within(runners.send(&runner_address(&server), request(1, "Echo"), false)).await;
    assert!(reply.expect("reply").is_final());
}

/// A client without the server's secret is refused before any call, and both sides say why: the
/// caller gets `HandshakeFailed` at once (a configuration error, which routing does not retry),
/// also while the peer is in backoff, and the server logs a warning naming the secret mismatch.
/// Neither shows the secret.
#[tokio::test]
async fn a_wrong_or_missing_secret_is_refused_before_any_call_and_named_on_both_sides() {
    let handler = FakeHandler::new();
    let warnings = Warnings::default();
    let _guard = tracing::dispatcher::set_default(&tracing::Dispatch::new(warnings.clone()));
    let server = serve(with_secret(SECRET), handler.clone()).await;
    let address = runner_address(&server);
    for client in [with_secret(OTHER_SECRET), config()] {
        let runners = TcpTransport::new(client).expect("config");
        let error = within(runners.send(&address, request(1, "Echo"), false)).await;
        assert_handshake_failed(&error.map(|_| ()));
        // The second call finds the peer in backoff: the same error, not `RunnerUnavailable`.
        let error = within(runners.notify(
            &address,
            cluster_core::Envelope::Request(request(2, "Echo")),
            false,
        ))
        .await;
        assert_handshake_failed(&error);
        assert!(!runners.is_connected(&address));
    }
    let named = |line: &String| line.contains("failed the handshake") && line.contains("secret");
    let named_twice = || warnings.logged().iter().filter(|line| named(line)).count() >= 2;
    eventually_within("the server names the cause of each refusal", DEADLINE, named_twice).await;
    for line in warnings.logged() {
        assert!(!line.contains("s3cret") && !line.contains("guess"), "{line}");
    }
    assert_eq!(handler.calls(), 0);
    assert_eq!(server.connection_count(), 0);
}

/// `error` is a `HandshakeFailed` that names the secret's variable, and not the secrets.
fn assert_handshake_failed(error: &Result<(), ClusterError>) {
    let Err(ClusterError::HandshakeFailed { reason, .. }) = error else {
        panic!("not a handshake failure: {error:?}");
    };
    assert!(reason.contains("CLUSTER_RPC_SECRET"), "{reason}");
    let shown = format!("{error:?} {}", error.as_ref().unwrap_err());
    assert!(!shown.contains("s3cret") && !shown.contains("guess"), "{shown}");
}

#[tokio::test]
async fn a_client_with_a_secret_refuses_a_server_without_one() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(with_secret(SECRET)).expect("config");
    let error = within(runners.send(&runner_address(&server), request(1, "Echo"), false)).await;
    assert_handshake_failed(&error.map(|_| ()));
    assert_eq!(handler.calls(), 0);
}

#[tokio::test]
async fn frames_sent_after_a_failed_proof_are_never_decoded() {
    let handler = FakeHandler::new();
    let server = serve(with_secret(SECRET), handler.clone()).await;
    // The raw client proves the empty key: the server must refuse it, whatever follows.
    let mut raw = tokio::net::TcpStream::connect(server.local_addr()).await.expect("connect");
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&[1; 32]);
    raw.write_all(&hello).await.expect("hello");
    raw.write_all(&[0; 32]).await.expect("bad proof");
    let _ = raw.write_all(&[0, 0, 0, 2, 0, 0]).await;
    assert!(closed_by_server(&mut raw).await);
    assert_eq!(handler.calls(), 0);
    assert_eq!(server.connection_count(), 0);
    // A raw client with the secret gets through (the test's handshake matches the crate's).
    let _accepted = raw_client(server.local_addr(), SECRET.as_bytes()).await;
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
    let error = RpcConfig::from_env_with(|var| {
        Ok((var == "CLUSTER_RPC_MAX_PUSHED_IN_FLIGHT").then(|| "0".to_owned()))
    })
    .expect_err("out of range");
    assert_eq!(error.key(), "CLUSTER_RPC_MAX_PUSHED_IN_FLIGHT");
    let config = RpcConfig::from_env_with(|var| {
        Ok(match var {
            "CLUSTER_RPC_SECRET" => Some(SECRET.to_owned()),
            "CLUSTER_RPC_IDLE_EXPIRY" => Some("2 seconds".to_owned()),
            "CLUSTER_RPC_MAX_PUSHED_IN_FLIGHT" => Some("100".to_owned()),
            "CLUSTER_RPC_MAX_HANDSHAKES" => Some("8".to_owned()),
            "CLUSTER_RPC_HANDSHAKE_TIMEOUT" => Some("500 millis".to_owned()),
            _ => None,
        })
    })
    .expect("valid");
    assert_eq!(config.secret.as_deref(), Some(SECRET.as_bytes()));
    assert_eq!(config.idle_expiry, std::time::Duration::from_secs(2));
    assert_eq!(config.max_pushed_in_flight, 100);
    assert_eq!(config.max_handshakes, 8);
    assert_eq!(config.handshake_timeout, std::time::Duration::from_millis(500));
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

/// A server that listens beyond loopback must authenticate its peers, or be told explicitly
/// that it need not: then it says so in a warning.
#[tokio::test]
async fn a_server_beyond_loopback_refuses_to_start_without_a_secret() {
    let everywhere: std::net::SocketAddr = "0.0.0.0:0".parse().unwrap();
    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let error = match RpcServer::bind(everywhere, config()).await {
        Err(RpcError::Config(error)) => error,
        Err(error) => panic!("not a configuration error: {error}"),
        Ok(_) => panic!("a server without a secret started on 0.0.0.0"),
    };
    assert_eq!((error.key(), error.value()), ("CLUSTER_RPC_SECRET", ""));
    assert!(error.reason().contains("CLUSTER_RPC_INSECURE=true"), "{error}");
    let empty = RpcConfig { secret: Some(b"".as_slice().into()), ..config() };
    assert!(RpcServer::bind(everywhere, empty).await.is_err(), "an empty secret is no secret");
    assert!(RpcServer::bind(everywhere, with_secret(SECRET)).await.is_ok());
    assert!(RpcServer::bind(loopback, config()).await.is_ok(), "loopback needs no secret");
    let warnings = Warnings::default();
    let guard = tracing::dispatcher::set_default(&tracing::Dispatch::new(warnings.clone()));
    let insecure = RpcConfig { insecure: true, ..config() };
    assert!(RpcServer::bind(everywhere, insecure).await.is_ok());
    assert!(RpcServer::bind(everywhere, with_secret(SECRET)).await.is_ok());
    drop(guard);
    let logged = warnings.logged();
    assert_eq!(logged.len(), 1, "one warning, for the insecure server only: {logged:?}");
    assert!(logged[0].contains("CLUSTER_RPC_INSECURE=true"), "{logged:?}");
}

/// `CLUSTER_RPC_INSECURE` takes `true` or `false`; anything else is an error naming it.
#[test]
fn the_insecure_opt_out_is_read_strictly() {
    let load = |value: &str| {
        let value = value.to_owned();
        RpcConfig::from_env_with(move |var| {
            Ok((var == "CLUSTER_RPC_INSECURE").then(|| value.clone()))
        })
    };
    assert!(load("true").unwrap().insecure);
    assert!(!load("false").unwrap().insecure);
    let error = load("yes").expect_err("not a boolean");
    assert_eq!((error.key(), error.value()), ("CLUSTER_RPC_INSECURE", "yes"));
}

/// The secret appears in no `Debug` output and in no error.
#[test]
fn the_secret_is_never_shown() {
    let config = with_secret("hunter2-value-0123456789abcdef0123456789");
    let shown = format!("{config:?} {config:#?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
    let error = RpcConfig { max_in_flight: 0, ..config }.validate().expect_err("out of range");
    assert!(!format!("{error} {error:?}").contains("hunter2"));
}

/// A secret shorter than 32 bytes is refused wherever a configuration is checked (from the
/// environment, `TcpTransport::new`, `RpcServer::bind`), with an error that names the variable
/// and how to make a good one, and never shows the secret.
#[tokio::test]
async fn a_short_secret_is_refused_without_being_shown() {
    let short = "hunter2-short-secret-31-bytes-x";
    assert_eq!(short.len(), cluster_rpc::MIN_SECRET_BYTES - 1);
    let error =
        RpcConfig::from_env_with(|var| Ok((var == "CLUSTER_RPC_SECRET").then(|| short.to_owned())))
            .expect_err("a short secret");
    assert_eq!(error.key(), "CLUSTER_RPC_SECRET");
    assert!(error.reason().contains("openssl rand -hex 32"), "{error}");
    assert!(error.reason().contains("at least 32 bytes"), "{error}");
    let shown = format!("{error} {error:?}");
    assert!(!shown.contains("hunter2"), "{shown}");

    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let errors = [
        TcpTransport::new(with_secret(short)).map(|_| ()).expect_err("client"),
        RpcServer::bind(loopback, with_secret(short)).await.map(|_| ()).expect_err("server"),
    ];
    for error in errors {
        let shown = format!("{error} {error:?}");
        assert!(matches!(error, RpcError::Config(_)), "{shown}");
        assert!(shown.contains("too short") && !shown.contains("hunter2"), "{shown}");
    }
    // 32 bytes are enough; an empty secret is no secret (allowed on loopback).
    let enough = "hunter2-long-enough-32-bytes-xyz";
    assert_eq!(enough.len(), cluster_rpc::MIN_SECRET_BYTES);
    assert!(with_secret(enough).validate().is_ok());
    assert!(with_secret("").validate().is_ok());
}

/// Everything a server sends to a peer that has not proved it holds the secret: its hello
/// (`MAGIC`, version, a fresh random nonce), then, after a wrong proof, nothing but the close.
/// So an unauthenticated connection carries nothing to test guesses of the secret against:
/// servers with different secrets answer alike, and the same server answers each connection
/// with a fresh nonce.
#[tokio::test]
async fn a_peer_that_has_not_proved_itself_gets_nothing_derived_from_the_secret() {
    let handler = FakeHandler::new();
    let mut answers = Vec::new();
    for secret in [SECRET, OTHER_SECRET, SECRET] {
        let server = serve(with_secret(secret), handler.clone()).await;
        let mut raw = tokio::net::TcpStream::connect(server.local_addr()).await.expect("connect");
        let mut hello = HELLO.to_vec();
        hello.extend_from_slice(&[9; 32]);
        raw.write_all(&hello).await.expect("hello");
        raw.write_all(&hmac(b"a guess", &[b"client"])).await.expect("wrong proof");
        // Everything the server sends until it closes the connection.
        let mut sent = Vec::new();
        let _ = tokio::time::timeout(
            crate::support::DEADLINE,
            tokio::io::AsyncReadExt::read_to_end(&mut raw, &mut sent),
        )
        .await
        .expect("the server closes the connection after a wrong proof");
        assert_eq!(sent.len(), 37, "hello only, then the close: {sent:?}");
        assert_eq!(&sent[..5], HELLO);
        answers.push(sent[5..].to_vec());
        assert_eq!(server.connection_count(), 0);
    }
    assert_ne!(answers[0], answers[1]);
    assert_ne!(answers[0], answers[2], "a fresh nonce for every connection");
    assert_eq!(handler.calls(), 0);
}

/// A server that does not hold the secret cannot pass for one that does: the client checks the
/// server's proof after its own and refuses the impostor, naming the cause, before it sends
/// anything else.
#[tokio::test]
async fn a_client_refuses_a_server_whose_proof_is_wrong() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let impostor = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut hello = [0_u8; 37];
        tokio::io::AsyncReadExt::read_exact(&mut stream, &mut hello).await.expect("hello");
        let mut answer = HELLO.to_vec();
        answer.extend_from_slice(&[3; 32]);
        stream.write_all(&answer).await.expect("server hello");
        let mut proof = [0_u8; 32];
        tokio::io::AsyncReadExt::read_exact(&mut stream, &mut proof).await.expect("proof");
        // Accepts any proof, and proves with a key of its own.
        let mut accepted = vec![1];
        accepted.extend_from_slice(&hmac(b"not the secret", &[b"server", &hello[5..], &[3; 32]]));
        stream.write_all(&accepted).await.expect("accepted");
        let mut after = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut after).await;
        after
    });
    let runners = TcpTransport::new(with_secret(SECRET)).expect("config");
    let address = cluster_core::RunnerAddress::new("127.0.0.1", port);
    let error = within(runners.send(&address, request(1, "Echo"), false)).await;
    let Err(ClusterError::HandshakeFailed { reason, .. }) = &error else {
        panic!("not a handshake failure: {error:?}");
    };
    assert!(reason.contains("does not hold this side's shared secret"), "{reason}");
    let after = within(impostor).await.expect("impostor");
    assert!(after.is_empty(), "the client sent {} bytes to an impostor", after.len());
}

/// With a secret, every write after the handshake (a record of frames) carries a MAC under its
/// direction's session key, over its sequence number: the server answers a sealed `Ping` with
/// a sealed `Done`, and closes the connection on a frame that was replayed or altered in
/// transit.
#[tokio::test]
async fn frames_are_sealed_and_a_replayed_or_altered_frame_closes_the_connection() {
    let handler = FakeHandler::new();
    let server = serve(with_secret(SECRET), handler.clone()).await;
    // `Ping { call: 5 }` and `Done { call: 5 }` in postcard.
    let (ping, done) = ([0_u8, 5], [5_u8, 5]);

    let mut raw = raw_session(server.local_addr(), SECRET.as_bytes()).await;
    let first = sealed_frame(&raw.client_to_server, 0, &ping);
    raw.stream.write_all(&first).await.expect("ping");
    let mut answer = [0_u8; 4 + 2 + 16];
    within(tokio::io::AsyncReadExt::read_exact(&mut raw.stream, &mut answer))
        .await
        .expect("a sealed answer");
    assert_eq!(answer.to_vec(), sealed_frame(&raw.server_to_client, 0, &done));
    // The same frame again: its sequence number is past.
    raw.stream.write_all(&first).await.expect("replay");
    assert!(closed_by_server(&mut raw.stream).await, "a replayed frame was accepted");

    let mut raw = raw_session(server.local_addr(), SECRET.as_bytes()).await;
    let mut altered = sealed_frame(&raw.client_to_server, 0, &ping);
    altered[5] ^= 0x01;
    raw.stream.write_all(&altered).await.expect("altered ping");
    assert!(closed_by_server(&mut raw.stream).await, "an altered frame was accepted");

    // A tag that is not the MAC.
    let mut raw = raw_session(server.local_addr(), SECRET.as_bytes()).await;
    raw.stream.write_all(&[0x80, 0, 0, 2, 0, 5]).await.expect("unsealed ping");
    raw.stream.write_all(&[0; 16]).await.expect("no tag");
    assert!(closed_by_server(&mut raw.stream).await, "an unsealed frame was accepted");
    eventually_within("server.connection_count() == 0", DEADLINE, || {
        server.connection_count() == 0
    })
    .await;
}
