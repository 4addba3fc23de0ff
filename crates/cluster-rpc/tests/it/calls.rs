//! The five RPCs, cancellation, error mapping and the connection cache.

use std::sync::atomic::Ordering;
use std::time::Duration;

use cluster_core::envelope::{AckChunk, CauseReason, Envelope, Exit, Interrupt, Reply};
use cluster_core::error::ClusterError;
use cluster_core::snowflake::Snowflake;
use cluster_core::transport::Transport;
use cluster_rpc::{RpcConfig, TcpTransport};

use crate::support::{
    DEADLINE, FakeHandler, config, entity, lock, request, runner_address, serve, within,
};
use cluster_testkit::wait::eventually_within;

fn final_exit(reply: &Reply) -> &Exit {
    match reply {
        Reply::WithExit(with_exit) => &with_exit.exit,
        Reply::Chunk(chunk) => panic!("expected a final reply, got {chunk:?}"),
    }
}

fn die_message(reply: &Reply) -> String {
    match final_exit(reply) {
        Exit::Failure(cause) => match cause.0.as_slice() {
            [CauseReason::Die(defect)] => defect.json_or_null().to_owned(),
            other => panic!("expected one Die reason, got {other:?}"),
        },
        Exit::Success(value) => panic!("expected a failure, got success {value:?}"),
    }
}

#[tokio::test]
async fn ping_answers_without_reaching_the_handler() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    within(runners.ping(&runner_address(&server))).await.expect("ping");
    assert_eq!(handler.calls(), 0);
}

#[tokio::test]
async fn send_round_trips_the_request_and_its_reply() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let sent = request(41, "Echo");
    let reply = within(runners.send(&runner_address(&server), sent.clone(), true)).await;
    let reply = reply.expect("reply");
    assert_eq!(reply.request_id(), Snowflake::new(41));
    assert_eq!(final_exit(&reply), &Exit::Success(sent.payload.clone()));
    // The request arrived intact, with its persistence flag.
    assert_eq!(lock(&handler.state).requests, vec![(sent, true)]);
}

#[tokio::test]
async fn stream_yields_chunks_after_acks_then_the_final_reply() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    let mut replies = within(runners.stream(&address, request(50, "Stream"), false)).await;
    let replies = replies.as_mut().expect("stream");
    for sequence in 0..2 {
        let reply = within(replies.next_reply()).await.expect("a reply").expect("ok");
        let Reply::Chunk(chunk) = &reply else { panic!("expected a chunk, got {reply:?}") };
        assert_eq!(chunk.sequence(), sequence);
        let ack = Envelope::AckChunk(AckChunk {
            id: Snowflake::new(900 + u64::from(sequence)),
            address: entity(),
            request_id: Snowflake::new(50),
            reply_id: chunk.id(),
        });
        within(runners.send_envelope(&address, ack.clone(), false)).await.expect("ack");
        assert_eq!(lock(&handler.state).envelopes.last(), Some(&(ack, false)));
    }
    let last = within(replies.next_reply()).await.expect("final").expect("ok");
    assert_eq!(final_exit(&last), &Exit::void());
    assert!(within(replies.next_reply()).await.is_none());
    assert_eq!(handler.dropped.load(Ordering::Acquire), 0);
}

#[tokio::test]
async fn notify_delivers_volatile_and_persisted_envelopes() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    let volatile = Envelope::Request(request(60, "Echo"));
    let persisted = Envelope::Interrupt(Interrupt {
        id: Snowflake::new(61),
        address: entity(),
        request_id: Snowflake::new(60),
    });
    within(runners.notify(&address, volatile.clone(), false)).await.expect("volatile");
    within(runners.notify(&address, persisted.clone(), true)).await.expect("persisted");
    assert_eq!(lock(&handler.state).notifies, vec![(volatile, false), (persisted, true)]);
}

#[tokio::test]
async fn dropping_the_send_future_cancels_the_server_request() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    let call = {
        let (runners, address) = (runners.clone(), address.clone());
        tokio::spawn(async move { runners.send(&address, request(70, "Hang"), false).await })
    };
    eventually_within("the request never arrived", DEADLINE, || handler.requests() == 1).await;
    assert_eq!(handler.dropped.load(Ordering::Acquire), 0);
    call.abort();
    eventually_within("the server kept the reply stream of an abandoned call", DEADLINE, || {
        handler.dropped.load(Ordering::Acquire) == 1
    })
    .await;
    // Only the call was cancelled: the connection still serves.
    within(runners.send(&address, request(71, "Echo"), false)).await.expect("sibling");
    assert_eq!(server.connection_count(), 1);
}

#[tokio::test]
async fn dropping_a_reply_stream_cancels_the_server_request() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    let mut replies =
        within(runners.stream(&address, request(80, "Stream"), false)).await.expect("stream");
    let first = within(replies.next_reply()).await.expect("chunk").expect("ok");
    assert!(!first.is_final());
    drop(replies);
    eventually_within("the server kept the reply stream of a dropped stream", DEADLINE, || {
        handler.dropped.load(Ordering::Acquire) == 1
    })
    .await;
}

#[tokio::test]
async fn typed_errors_come_back_as_they_are() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    for persisted in [false, true] {
        let error = within(runners.send(&address, request(90, "NotAssigned"), persisted)).await;
        assert!(
            matches!(&error, Err(ClusterError::EntityNotAssignedToRunner { address }) if *address == entity()),
            "{error:?}"
        );
        let error = within(runners.send(&address, request(91, "MailboxFull"), persisted)).await;
        assert!(
            matches!(&error, Err(ClusterError::MailboxFull { address }) if *address == entity())
        );
        let error =
            within(runners.send(&address, request(92, "AlreadyProcessing"), persisted)).await;
        assert!(matches!(
            &error,
            Err(ClusterError::AlreadyProcessingMessage { envelope_id, address })
                if *envelope_id == Snowflake::new(92) && *address == entity()
        ));
    }
}

#[tokio::test]
async fn a_defect_is_runner_unavailable_when_persisted_and_a_die_reply_when_volatile() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    let persisted = within(runners.send(&address, request(100, "Defect"), true)).await;
    assert!(
        matches!(&persisted, Err(ClusterError::RunnerUnavailable { address: at }) if *at == address),
        "{persisted:?}"
    );
    let volatile = within(runners.send(&address, request(101, "Defect"), false)).await;
    let volatile = volatile.expect("a volatile defect is the request's reply");
    assert_eq!(volatile.request_id(), Snowflake::new(101));
    assert!(die_message(&volatile).contains("boom"), "{volatile:?}");
}

#[tokio::test]
async fn an_oversize_reply_fails_only_its_own_request() {
    let limit = 64 * 1024;
    let config = RpcConfig { max_frame_bytes: limit, ..config() };
    let handler = FakeHandler::with_big_reply(100 * 1024);
    let server = serve(config.clone(), handler.clone()).await;
    let runners = TcpTransport::new(config).expect("config");
    let address = runner_address(&server);
    // A sibling in flight on the same connection while the big reply fails.
    let mut sibling =
        within(runners.stream(&address, request(110, "Stream"), false)).await.expect("stream");
    let big = within(runners.send(&address, request(111, "Big"), false)).await.expect("reply");
    assert_eq!(big.request_id(), Snowflake::new(111));
    assert!(die_message(&big).contains("MalformedMessage"), "{big:?}");
    let chunk = within(sibling.next_reply()).await.expect("chunk").expect("ok");
    assert!(!chunk.is_final());
    let echo = within(runners.send(&address, request(112, "Echo"), false)).await;
    assert!(echo.expect("echo").is_final());
    assert_eq!(server.connection_count(), 1);
}

#[tokio::test]
async fn on_runner_unavailable_drops_the_cached_connection() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    within(runners.ping(&address)).await.expect("ping");
    assert!(runners.is_connected(&address));
    assert_eq!(server.connection_count(), 1);
    runners.on_runner_unavailable(&address);
    assert!(!runners.is_connected(&address));
    eventually_within("the connection stayed open", DEADLINE, || server.connection_count() == 0)
        .await;
    within(runners.ping(&address)).await.expect("reconnects");
    assert_eq!(server.connection_count(), 1);
}

#[tokio::test]
async fn an_idle_connection_expires() {
    let config = RpcConfig { idle_expiry: Duration::from_millis(100), ..config() };
    let handler = FakeHandler::new();
    let server = serve(config.clone(), handler.clone()).await;
    let runners = TcpTransport::new(config).expect("config");
    let address = runner_address(&server);
    within(runners.ping(&address)).await.expect("ping");
    eventually_within("the idle connection stayed", DEADLINE, || server.connection_count() == 0)
        .await;
    assert!(!runners.is_connected(&address));
    within(runners.ping(&address)).await.expect("reconnects");
}

/// A connection with a call in flight is not idle, however long the call takes; it expires
/// once its last call ends.
#[tokio::test]
async fn a_connection_with_a_call_in_flight_does_not_expire() {
    let idle_expiry = Duration::from_millis(100);
    let config = RpcConfig { idle_expiry, ..config() };
    let handler = FakeHandler::new();
    let server = serve(config.clone(), handler.clone()).await;
    let runners = TcpTransport::new(config).expect("config");
    let address = runner_address(&server);
    let hanging =
        within(runners.stream(&address, request(120, "Hang"), false)).await.expect("stream");
    // What is checked is that nothing happens: the wait is the check, four idle periods.
    tokio::time::sleep(idle_expiry * 4).await;
    assert!(runners.is_connected(&address), "a busy connection expired");
    assert_eq!(server.connection_count(), 1);
    drop(hanging);
    eventually_within("the idle connection stayed", DEADLINE, || server.connection_count() == 0)
        .await;
}

#[tokio::test]
async fn a_handler_panic_is_a_defect_of_that_request_only() {
    let handler = FakeHandler::new();
    let server = serve(config(), handler.clone()).await;
    let runners = TcpTransport::new(config()).expect("config");
    let address = runner_address(&server);
    // The fake handler panics on a tag it does not know.
    let volatile = within(runners.send(&address, request(120, "Panic"), false)).await;
    let volatile = volatile.expect("a volatile defect is the request's reply");
    assert!(die_message(&volatile).contains("panicked"), "{volatile:?}");
    let persisted = within(runners.send(&address, request(121, "Panic"), true)).await;
    assert!(matches!(persisted, Err(ClusterError::RunnerUnavailable { .. })), "{persisted:?}");
    let echo = within(runners.send(&address, request(122, "Echo"), false)).await;
    assert!(echo.expect("the connection still serves").is_final());
    assert_eq!(server.connection_count(), 1);
}
