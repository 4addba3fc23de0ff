//! The limits and the reconnection policy: calls beyond `max_in_flight`, pushed persisted
//! requests in a lane of their own (`max_pushed_in_flight`), connections beyond
//! `max_connections`, connections still shaking hands (`max_handshakes`, `handshake_timeout`),
//! the reconnection backoff and the stream-buffer overflow.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cluster_core::error::ClusterError;
use cluster_core::ids::RunnerAddress;
use cluster_core::transport::Transport;
use cluster_rpc::{RpcConfig, TcpTransport};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::support::{
    DEADLINE, FakeHandler, Warnings, closed_by_server, config, request, runner_address, serve,
    within,
};
use cluster_testkit::wait::eventually_within;

#[tokio::test]
async fn a_call_beyond_max_in_flight_is_overloaded_and_others_carry_on() {
    let handler = FakeHandler::new();
    let server = serve(RpcConfig { max_in_flight: 1, ..config() }, handler.clone()).await;
    // The client's own limit is higher: the server is the one that refuses.
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    let hang = {
        let (runners, address) = (runners.clone(), address.clone());
        tokio::spawn(async move { runners.send(&address, request(1, "Hang"), false).await })
    };
    eventually_within("the first request never arrived", DEADLINE, || handler.requests() == 1)
        .await;

    let overloaded = within(runners.send(&address, request(2, "Echo"), false)).await;
    assert!(
        matches!(&overloaded, Err(ClusterError::RunnerUnavailable { address: at }) if *at == address),
        "{overloaded:?}"
    );
    assert_eq!(handler.requests(), 1, "the overloaded call reached the handler");
    // Pings are answered by the transport, not counted as calls in flight.
    within(runners.ping(&address)).await.expect("ping while overloaded");
    assert!(runners.is_connected(&address));
    assert_eq!(server.connection_count(), 1);

    // Once the running call is gone, the next one is served on the same connection.
    hang.abort();
    eventually_within("handler.dropped.load(Ordering::Acquire) == 1", DEADLINE, || {
        handler.dropped.load(Ordering::Acquire) == 1
    })
    .await;
    let mut echo = Err(ClusterError::RunnerUnavailable { address: address.clone() });
    let deadline = Instant::now() + DEADLINE;
    // The server frees the slot when it reaps the aborted task: wait for that, with a deadline.
    while echo.is_err() && Instant::now() < deadline {
        echo = within(runners.send(&address, request(3, "Echo"), false)).await;
        if echo.is_err() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert!(echo.expect("served after the slot is freed").is_final());
    assert_eq!(server.connection_count(), 1);
}

#[tokio::test]
async fn a_connection_beyond_max_connections_is_refused() {
    let handler = FakeHandler::new();
    let server = serve(RpcConfig { max_connections: 1, ..config() }, handler.clone()).await;
    let address = runner_address(&server);
    let first = TcpTransport::new(config()).expect("config");
    within(first.ping(&address)).await.expect("first connection");
    assert_eq!(server.connection_count(), 1);

    let second = TcpTransport::new(config()).expect("config");
    let refused = within(second.send(&address, request(1, "Echo"), false)).await;
    assert!(matches!(refused, Err(ClusterError::RunnerUnavailable { .. })), "{refused:?}");
    assert!(!second.is_connected(&address));
    assert_eq!(handler.calls(), 0);
    // The first connection is untouched.
    within(first.send(&address, request(2, "Echo"), false)).await.expect("first still served");
    assert_eq!(server.connection_count(), 1);

    // When the first connection closes, its slot is free again (past the second's backoff).
    first.on_runner_unavailable(&address);
    eventually_within("server.connection_count() == 0", DEADLINE, || {
        server.connection_count() == 0
    })
    .await;
    let mut reply = Err(ClusterError::RunnerUnavailable { address: address.clone() });
    let deadline = Instant::now() + DEADLINE;
    while reply.is_err() && Instant::now() < deadline {
        reply = within(second.send(&address, request(3, "Echo"), false)).await;
        if reply.is_err() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert!(reply.expect("the freed slot serves the second client").is_final());
}

/// A listener that accepts connections and drops them at once (every handshake fails),
/// counting them; the count is raised before the drop, so a client that saw its attempt fail
/// has been counted.
async fn refusing_listener() -> (RunnerAddress, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let task = {
        let accepted = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::AcqRel);
                drop(stream);
            }
        })
    };
    (RunnerAddress::new("127.0.0.1", port), accepted, task)
}

#[tokio::test]
async fn after_a_failed_connect_calls_fail_at_once_until_the_backoff_passes() {
    let (address, accepted, task) = refusing_listener().await;
    // A backoff that cannot pass during the test: at least half an hour.
    let long = RpcConfig {
        backoff_base: Duration::from_secs(3600),
        backoff_cap: Duration::from_secs(3600),
        ..config()
    };
    let runners = TcpTransport::new(long).expect("config");
    let error = within(runners.send(&address, request(1, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
    assert_eq!(accepted.load(Ordering::Acquire), 1);
    // In backoff: every call fails without a connection attempt.
    for id in 2..5 {
        let error = within(runners.send(&address, request(id, "Echo"), false)).await;
        assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
        let error = within(runners.notify(
            &address,
            cluster_core::Envelope::Request(request(id, "Echo")),
            false,
        ))
        .await;
        assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
    }
    assert_eq!(accepted.load(Ordering::Acquire), 1, "a call during the backoff connected");
    // Dropping the peer forgets its backoff: the next call tries again.
    runners.on_runner_unavailable(&address);
    let error = within(runners.ping(&address)).await;
    assert!(error.is_err());
    assert_eq!(accepted.load(Ordering::Acquire), 2);

    // A short backoff passes, and then calls try again (and fail again, here).
    let short = RpcConfig {
        backoff_base: Duration::from_millis(20),
        backoff_cap: Duration::from_millis(20),
        ..config()
    };
    let runners = TcpTransport::new(short).expect("config");
    let _ = within(runners.send(&address, request(10, "Echo"), false)).await;
    assert_eq!(accepted.load(Ordering::Acquire), 3);
    let retried = || accepted.load(Ordering::Acquire) >= 4;
    let retried = eventually_within("a connection attempt after the backoff", DEADLINE, retried);
    let calls = async {
        loop {
            let _ = runners.send(&address, request(11, "Echo"), false).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        () = retried => {}
        () = calls => {}
    }
    task.abort();
}

#[tokio::test]
async fn a_stream_that_overflows_its_buffer_is_cut_and_cancelled() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(RpcConfig { stream_buffer: 1, ..config() }).expect("config");
    let address = runner_address(&server);
    // The server floods chunks; the client reads none until the overflow has cancelled the
    // request on the server (which drops the handler's reply stream).
    let mut replies =
        within(runners.stream(&address, request(1, "Flood"), false)).await.expect("stream");
    eventually_within("the overflowing request was not cancelled", DEADLINE, || {
        handler.dropped.load(Ordering::Acquire) == 1
    })
    .await;
    let mut chunks = 0;
    let end = loop {
        match within(replies.next_reply()).await {
            Some(Ok(reply)) => {
                assert!(!reply.is_final());
                chunks += 1;
            }
            other => break other,
        }
    };
    assert!(chunks <= 1, "more chunks than the buffer holds: {chunks}");
    assert!(
        matches!(&end, Some(Err(ClusterError::RunnerUnavailable { address: at })) if *at == address),
        "{end:?}"
    );
    assert!(within(replies.next_reply()).await.is_none());
    // Only that request was cut: the connection still serves.
    let echo = within(runners.send(&address, request(2, "Echo"), false)).await;
    assert!(echo.expect("the connection still serves").is_final());
    assert_eq!(server.connection_count(), 1);
}

/// Sends `request` (pushed, as persisted) again and again until it is answered, failing after
/// [`DEADLINE`]: the server frees a slot only once it reaps the call that held it.
async fn pushed_until_answered(runners: &TcpTransport, address: &RunnerAddress, id: u64) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match within(runners.send(address, request(id, "Echo"), true)).await {
            Ok(reply) => return assert!(reply.is_final()),
            Err(error) => assert!(Instant::now() < deadline, "never answered: {error:?}"),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A pushed persisted request lasts as long as its handler runs, so pushes have a lane of their
/// own on a connection: held pushes leave the `max_in_flight` slots to the other calls, and a
/// push that finds its lane full fails at once, without reaching the server (its caller waits
/// on storage, where the request is).
#[tokio::test]
async fn pushed_requests_take_slots_of_their_own_and_fail_at_once_when_those_are_taken() {
    let handler = FakeHandler::new();
    let limits = RpcConfig { max_in_flight: 1, max_pushed_in_flight: 2, ..config() };
    let server = serve(limits.clone(), handler.clone()).await;
    let runners = TcpTransport::new(limits).expect("config");
    let address = runner_address(&server);
    let held: Vec<_> = (1..=2)
        .map(|id| {
            let (runners, address) = (runners.clone(), address.clone());
            tokio::spawn(async move { runners.send(&address, request(id, "Hang"), true).await })
        })
        .collect();
    eventually_within("the pushes never arrived", DEADLINE, || handler.requests() == 2).await;
    let full = within(runners.send(&address, request(3, "Echo"), true)).await;
    assert!(
        matches!(&full, Err(ClusterError::RunnerUnavailable { address: at }) if *at == address),
        "{full:?}"
    );
    assert_eq!(handler.requests(), 2, "the push beyond the lane reached the server");
    // The other calls keep their slot, one after the other.
    for id in [4, 5] {
        let echo = within(runners.send(&address, request(id, "Echo"), false)).await;
        assert!(echo.expect("a volatile call while pushes are held").is_final());
    }
    within(runners.ping(&address)).await.expect("a ping while pushes are held");
    // A held push that ends gives its slot back.
    held[0].abort();
    eventually_within("handler.dropped.load(Ordering::Acquire) == 1", DEADLINE, || {
        handler.dropped.load(Ordering::Acquire) == 1
    })
    .await;
    pushed_until_answered(&runners, &address, 6).await;
    assert_eq!(server.connection_count(), 1);
}

/// The server bounds the pushes of a connection on its own too: a client that allows more gets
/// `Overloaded` (`RunnerUnavailable`) for a push beyond the server's lane, while its other calls
/// are served.
#[tokio::test]
async fn the_server_answers_a_push_beyond_its_lane_overloaded() {
    let handler = FakeHandler::new();
    let limits = RpcConfig { max_in_flight: 1, max_pushed_in_flight: 1, ..config() };
    let server = serve(limits, handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    let held = {
        let (runners, address) = (runners.clone(), address.clone());
        tokio::spawn(async move { runners.send(&address, request(1, "Hang"), true).await })
    };
    eventually_within("the push never arrived", DEADLINE, || handler.requests() == 1).await;
    let overloaded = within(runners.send(&address, request(2, "Echo"), true)).await;
    assert!(matches!(overloaded, Err(ClusterError::RunnerUnavailable { .. })), "{overloaded:?}");
    assert_eq!(handler.requests(), 1, "the push beyond the server's lane reached the handler");
    let echo = within(runners.send(&address, request(3, "Echo"), false)).await;
    assert!(echo.expect("a volatile call while a push is held").is_final());
    held.abort();
    eventually_within("handler.dropped.load(Ordering::Acquire) == 1", DEADLINE, || {
        handler.dropped.load(Ordering::Acquire) == 1
    })
    .await;
    pushed_until_answered(&runners, &address, 4).await;
}

/// Connections that never prove themselves hold at most `max_handshakes` sockets, and never the
/// slot of an established connection: a flood of more idle connections than `max_connections`
/// leaves room for a peer that proves itself, those beyond `max_handshakes` are closed at once,
/// and the established connections carry on.
#[tokio::test]
async fn a_flood_of_unauthenticated_connections_leaves_room_for_peers() {
    let handler = FakeHandler::new();
    let limits = RpcConfig {
        max_connections: 3,
        max_handshakes: 5,
        // Longer than the test: only the limits can close the flood's connections.
        handshake_timeout: Duration::from_secs(60),
        ..config()
    };
    let warnings = Warnings::default();
    let _guard = tracing::dispatcher::set_default(&tracing::Dispatch::new(warnings.clone()));
    let server = serve(limits, handler.clone()).await;
    let address = runner_address(&server);
    let first = TcpTransport::new(config()).expect("config");
    within(first.ping(&address)).await.expect("first connection");

    // More idle, unauthenticated connections than `max_connections`, within `max_handshakes`.
    let mut flood = Vec::new();
    for _ in 0..4 {
        flood.push(TcpStream::connect(server.local_addr()).await.expect("connect"));
    }
    let second = TcpTransport::new(config()).expect("config");
    let reply = within(second.send(&address, request(1, "Echo"), false)).await;
    assert!(reply.expect("a peer that proves itself gets in").is_final());
    assert_eq!(server.connection_count(), 2);

    // Beyond `max_handshakes` (with an established slot still free): the first takes the last
    // free handshake slot, the others are closed at once (well before the handshake timeout),
    // unread.
    let mut beyond = Vec::new();
    for _ in 0..10 {
        beyond.push(TcpStream::connect(server.local_addr()).await.expect("connect"));
    }
    for (n, raw) in beyond.iter_mut().enumerate().skip(1) {
        assert!(closed_by_server(raw).await, "connection {n} beyond max_handshakes was kept");
    }
    within(first.send(&address, request(2, "Echo"), false)).await.expect("first still served");
    within(second.send(&address, request(3, "Echo"), false)).await.expect("second still served");
    assert_eq!(server.connection_count(), 2);
    assert_eq!(handler.requests(), 3);
    // Nine refusals, one warning line: a flood of sockets is not a flood of log lines.
    let refusals: Vec<String> = warnings
        .logged()
        .into_iter()
        .filter(|line| line.contains("CLUSTER_RPC_MAX_HANDSHAKES"))
        .collect();
    assert_eq!(refusals.len(), 1, "{:?}", warnings.logged());
    drop(flood);
}

/// A connection that does not complete its handshake within `handshake_timeout` is closed, and
/// its slot serves the next peer; while it holds the only slot, a peer is turned away at once.
#[tokio::test]
async fn a_connection_that_does_not_shake_hands_in_time_is_closed() {
    let handler = FakeHandler::new();
    let limits = RpcConfig {
        max_handshakes: 1,
        handshake_timeout: Duration::from_millis(300),
        // The client's bound, which the server used to apply to handshakes: far longer.
        connect_timeout: Duration::from_secs(60),
        ..config()
    };
    let server = serve(limits, handler.clone()).await;
    let address = runner_address(&server);
    let started = Instant::now();
    let mut idle = TcpStream::connect(server.local_addr()).await.expect("connect");
    let runners = TcpTransport::new(config()).expect("config");
    let refused = within(runners.ping(&address)).await;
    assert!(matches!(refused, Err(ClusterError::RunnerUnavailable { .. })), "{refused:?}");

    assert!(closed_by_server(&mut idle).await, "the idle connection was kept");
    assert!(started.elapsed() < Duration::from_secs(5), "closed after {:?}", started.elapsed());
    let deadline = Instant::now() + DEADLINE;
    let mut pinged = within(runners.ping(&address)).await;
    while pinged.is_err() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
        pinged = within(runners.ping(&address)).await;
    }
    pinged.expect("the freed slot serves the peer");
    assert_eq!(server.connection_count(), 1);
}
