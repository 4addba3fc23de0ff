//! Streaming request types through the HTTP gateway, over real HTTP, on SQLite and on
//! PostgreSQL: items as NDJSON and as Server-Sent Events with the end line, a failure after
//! some items, a persisted stream deduplicated by its primary key, backpressure (a slow reader
//! holds the handler back) and a closed connection interrupting the handler.
#![cfg(all(feature = "http", feature = "schemars", feature = "sqlite", feature = "rpc"))]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use cluster_testkit::databases::TestDatabase;
use durable_cluster::http::HttpGateway;
use durable_cluster::{
    Chunks, Entity, EntityContext, Protocol, RequestContext, Sharding, StreamHandler, StreamRpc,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

mod support;

/// An entity whose streams count.
struct Feed;

/// Counts from 0 below `to`, failing with `Stopped` at `fail_at`.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
struct Count {
    to: u32,
    fail_at: Option<u32>,
}

/// As `Count`, persisted: its items go through storage; `id` is its primary key.
#[derive(Serialize, Deserialize)]
struct CountStored {
    id: String,
    to: u32,
}

/// `chunks` items of 256 KiB each, counted in `PRODUCED` as the handler sends them.
#[derive(Serialize, Deserialize)]
struct Flood {
    chunks: u32,
}

/// Items until interrupted; `STOPPED` is set when the handler is dropped.
#[derive(Serialize, Deserialize)]
struct Forever;

#[derive(Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "_tag", rename = "Stopped")]
struct Stopped {
    at: u32,
}

impl StreamRpc for Count {
    const TAG: &'static str = "Count";
    type Item = u32;
    type Error = Stopped;
}

impl StreamRpc for CountStored {
    const TAG: &'static str = "CountStored";
    const PERSISTED: bool = true;
    type Item = u32;
    type Error = durable_cluster::Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.id.clone())
    }
}

impl StreamRpc for Flood {
    const TAG: &'static str = "Flood";
    type Item = String;
    type Error = durable_cluster::Never;
}

impl StreamRpc for Forever {
    const TAG: &'static str = "Forever";
    type Item = u32;
    type Error = durable_cluster::Never;
}

/// Items the `Flood` handler has sent (one test uses it).
static PRODUCED: AtomicU32 = AtomicU32::new(0);
/// Runs of `CountStored` (its handler runs once per primary key).
static STORED_RUNS: AtomicU32 = AtomicU32::new(0);
/// Set when a `Forever` handler is dropped.
static STOPPED: AtomicBool = AtomicBool::new(false);

impl Entity for Feed {
    const TYPE: &'static str = "Feed";

    async fn create(_: &EntityContext) -> Feed {
        Feed
    }

    fn protocol(protocol: &mut Protocol<Feed>) {
        protocol.stream::<Count>().stream::<CountStored>().stream::<Flood>().stream::<Forever>();
    }
}

impl StreamHandler<Count> for Feed {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Count,
        chunks: &mut Chunks<'_, u32>,
    ) -> Result<(), Stopped> {
        for n in 0..request.to {
            if request.fail_at == Some(n) {
                let _ = chunks.flush().await;
                return Err(Stopped { at: n });
            }
            if chunks.send(n).await.is_err() {
                return Ok(());
            }
        }
        Ok(())
    }
}

impl StreamHandler<CountStored> for Feed {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: CountStored,
        chunks: &mut Chunks<'_, u32>,
    ) -> Result<(), durable_cluster::Never> {
        STORED_RUNS.fetch_add(1, Ordering::SeqCst);
        let _ = chunks.send_batch(0..request.to).await;
        Ok(())
    }
}

impl StreamHandler<Flood> for Feed {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Flood,
        chunks: &mut Chunks<'_, String>,
    ) -> Result<(), durable_cluster::Never> {
        let item = "x".repeat(256 * 1024);
        for _ in 0..request.chunks {
            if chunks.send(item.clone()).await.is_err() {
                return Ok(());
            }
            PRODUCED.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// Sets `STOPPED` when dropped.
struct SetOnDrop;

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        STOPPED.store(true, Ordering::SeqCst);
    }
}

impl StreamHandler<Forever> for Feed {
    async fn handle(
        &mut self,
        _: &RequestContext,
        _: Forever,
        chunks: &mut Chunks<'_, u32>,
    ) -> Result<(), durable_cluster::Never> {
        let _stopped = SetOnDrop;
        let mut n = 0;
        while chunks.send(n).await.is_ok() {
            n = n.wrapping_add(1);
        }
        Ok(())
    }
}

/// A gateway serving `Feed` in front of a single runner on `database`.
struct Gateway {
    address: SocketAddr,
    sharding: Sharding,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Gateway {
    async fn start(database: &TestDatabase) -> Gateway {
        let sharding = support::single_runner(database).await;
        sharding.entity::<Feed>().register().unwrap();
        let router = HttpGateway::new(sharding.clone())
            .entity::<Feed>()
            .stream_schemas::<Feed, Count>()
            .router();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, router).await });
        Gateway { address, sharding, server }
    }

    async fn stop(self) {
        self.server.abort();
        self.sharding.shutdown().await;
    }
}

fn json_headers(accept: Option<&str>) -> Vec<(String, String)> {
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    if let Some(accept) = accept {
        headers.push(("accept".to_owned(), accept.to_owned()));
    }
    headers
}

/// The JSON lines of an NDJSON body.
fn lines(body: &str) -> Vec<Value> {
    body.lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

/// The `(event, data)` pairs of an SSE body (keep-alive comments left out).
fn events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|event| !event.trim().is_empty() && !event.starts_with(':'))
        .map(|event| {
            let mut name = String::new();
            let mut data = String::new();
            for line in event.lines() {
                if let Some(value) = line.strip_prefix("event:") {
                    name = value.trim().to_owned();
                } else if let Some(value) = line.strip_prefix("data:") {
                    data.push_str(value.trim_start());
                }
            }
            (name, serde_json::from_str(&data).unwrap())
        })
        .collect()
}

fn items(values: std::ops::Range<u32>) -> Vec<Value> {
    values.map(|n| serde_json::json!({ "item": n })).collect()
}

/// NDJSON and SSE, a failure after items, a persisted stream and its dedup, and the routes a
/// stream does not have.
async fn streams_are_served(database: TestDatabase) {
    let gateway = Gateway::start(&database).await;
    let address = gateway.address;

    // 600 items: more than one chunk (256 items at most), in order, then the end.
    let answer = support::exchange(
        address,
        "POST",
        "/count/a",
        &json_headers(None),
        br#"{"to":600,"fail_at":null}"#,
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.content_type.as_deref(), Some("application/x-ndjson"));
    let mut expected = items(0..600);
    expected.push(serde_json::json!({ "end": "complete" }));
    assert_eq!(lines(&answer.body), expected);

    // The request type's own error ends the stream after the items before it.
    let body = br#"{"to":10,"fail_at":3}"#;
    let answer = support::exchange(address, "POST", "/count/b", &json_headers(None), body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let mut expected = items(0..3);
    expected.push(serde_json::json!({ "end": "failed", "error": { "_tag": "Stopped", "at": 3 } }));
    assert_eq!(lines(&answer.body), expected);

    // Server-Sent Events when asked for.
    let accept = Some("text/event-stream");
    let answer = support::exchange(address, "POST", "/count/c", &json_headers(accept), body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.content_type.as_deref(), Some("text/event-stream"));
    let mut expected: Vec<(String, Value)> =
        (0..3).map(|n| ("item".to_owned(), Value::from(n))).collect();
    let end = serde_json::json!({ "end": "failed", "error": { "_tag": "Stopped", "at": 3 } });
    expected.push(("end".to_owned(), end));
    assert_eq!(events(&answer.body), expected);

    // A persisted stream: its items come through storage. Sent again with the same primary
    // key it is not run again; its items were taken (acknowledged), so only its end is
    // answered, as a Rust caller gets it (the reference's duplicate: the last reply).
    let runs = STORED_RUNS.load(Ordering::SeqCst);
    let body = br#"{"id":"s1","to":5}"#;
    let answer =
        support::exchange(address, "POST", "/countstored/d", &json_headers(None), body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let mut expected = items(0..5);
    expected.push(serde_json::json!({ "end": "complete" }));
    assert_eq!(lines(&answer.body), expected, "{answer:?}");
    let again =
        support::exchange(address, "POST", "/countstored/d", &json_headers(None), body).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(lines(&again.body), [serde_json::json!({ "end": "complete" })], "{again:?}");
    assert_eq!(STORED_RUNS.load(Ordering::SeqCst) - runs, 1, "the handler ran again");

    // A stream has no discard route; a bad payload is refused before anything streams.
    let answer =
        support::exchange(address, "POST", "/count/a/discard", &json_headers(None), b"{}").await;
    assert_eq!(answer.status, 404, "{answer:?}");
    let answer =
        support::exchange(address, "POST", "/count/a", &json_headers(None), br#"{"to":"x"}"#).await;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(answer.body.contains("HttpApiSchemaError"), "{answer:?}");

    // The document lists the stream's route with both formats, and no discard route.
    let (status, document) = support::get(address, "/openapi.json").await.unwrap();
    assert_eq!(status, 200);
    let document: Value = serde_json::from_str(&document).unwrap();
    let content = &document["paths"]["/count/{entityId}"]["post"]["responses"]["200"]["content"];
    assert!(content.get("application/x-ndjson").is_some(), "{content}");
    assert!(content.get("text/event-stream").is_some(), "{content}");
    assert!(document["paths"].get("/count/{entityId}/discard").is_none());
    // `Count` is documented: a line is an item of its item's schema, or the end.
    let lines = &content["application/x-ndjson"]["schema"]["oneOf"];
    assert_eq!(lines[0]["properties"]["item"]["type"], "integer", "{lines}");
    assert_eq!(lines[1]["required"], serde_json::json!(["end"]), "{lines}");
    let payload = &document["paths"]["/count/{entityId}"]["post"]["requestBody"]["content"];
    let payload = &payload["application/json"]["schema"];
    assert_eq!(payload["$ref"], "#/components/schemas/Count", "{payload}");

    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_served_on_sqlite() {
    streams_are_served(TestDatabase::sqlite("http-stream")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_served_on_postgres() {
    if let Some(database) = TestDatabase::postgres() {
        streams_are_served(database).await;
    }
}

/// Opens a connection with a small receive buffer and sends `POST path` with `body`; returns
/// the reader positioned after the answer's head.
async fn open_stream(
    address: SocketAddr,
    path: &str,
    body: &str,
) -> tokio::io::BufReader<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 * 1024).unwrap();
    let mut stream = socket.connect(address).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut reader = tokio::io::BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await.unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    loop {
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        if line == "\r\n" {
            return reader;
        }
    }
}

/// The items the handler may have sent beyond those the reader took: what the connection's
/// buffers hold (the gateway's socket buffer, at most 4 MiB on Linux's defaults, plus the
/// reader's 64 KiB), and a chunk in flight and one being filled, in 256 KiB items.
const AHEAD_AT_MOST: u32 = 40;

/// How long the reader of `a_slow_reader_holds_the_handler_back` stops reading: a handler
/// without backpressure sends more than `AHEAD_AT_MOST` items in far less.
const READER_PAUSE: Duration = Duration::from_secs(3);

/// A reader that stops reading holds the handler back: after the first item, the handler
/// never gets more than what the buffers hold ahead of the reader, where a gateway that
/// buffered the stream would let it run on to its end (200 items, 50 MiB). The reader then takes
/// every item, and the handler is never that far ahead either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_holds_the_handler_back() {
    let database = TestDatabase::sqlite("http-stream-backpressure");
    let gateway = Gateway::start(&database).await;
    let total = 200;
    let body = format!("{{\"chunks\":{total}}}");
    let mut reader = open_stream(gateway.address, "/flood/a", &body).await;

    let mut taken = 0;
    let mut line = Vec::new();
    while taken < total {
        // A chunk-size line of the chunked encoding, or an item's line.
        line.clear();
        let read = reader.read_until(b'\n', &mut line).await.unwrap();
        assert!(read > 0, "the body ended after {taken} items");
        if !line.starts_with(b"{\"item\":") {
            continue;
        }
        taken += 1;
        let produced = PRODUCED.load(Ordering::SeqCst);
        assert!(
            produced <= taken + AHEAD_AT_MOST,
            "the handler sent {produced} items while the reader took {taken}"
        );
        if taken == 1 {
            // The reader stops: the handler must stop too, within the buffers' room.
            let deadline = tokio::time::Instant::now() + READER_PAUSE;
            while tokio::time::Instant::now() < deadline {
                let produced = PRODUCED.load(Ordering::SeqCst);
                assert!(
                    produced <= taken + AHEAD_AT_MOST,
                    "the handler sent {produced} items while the reader took {taken}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    assert_eq!(PRODUCED.load(Ordering::SeqCst), total);
    drop(reader);
    gateway.stop().await;
}

/// Closing the connection in the middle of a stream drops its handler (the request is
/// interrupted), and the entity serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_connection_interrupts_the_stream() {
    let database = TestDatabase::sqlite("http-stream-close");
    let gateway = Gateway::start(&database).await;
    let mut reader = open_stream(gateway.address, "/forever/a", "null").await;
    let mut line = String::new();
    while !line.starts_with("{\"item\":") {
        line.clear();
        reader.read_line(&mut line).await.unwrap();
    }
    assert!(!STOPPED.load(Ordering::SeqCst));
    drop(reader);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !STOPPED.load(Ordering::SeqCst) {
        assert!(tokio::time::Instant::now() < deadline, "the handler still runs");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let body = br#"{"to":2,"fail_at":null}"#;
    let answer =
        support::exchange(gateway.address, "POST", "/count/a", &json_headers(None), body).await;
    assert_eq!(lines(&answer.body).len(), 3, "{answer:?}");
    gateway.stop().await;
}
