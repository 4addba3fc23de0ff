//! The adversarial suite of the HTTP gateway and the operations server: what one client, or a
//! careless operator, must not be able to do to a runner. Each test runs on loopback with ports
//! chosen by the system, bounded in connections and time (the whole file takes a few seconds).
//!
//! - Slow headers, slow bodies and idle connections are closed within their timeouts while a
//!   legitimate client is served.
//! - A flood of connections to the gateway or to the operations server opens a bounded number
//!   of server sockets, and leaves the runner ready and the gateway answering.
//! - A request without the JSON content type is refused (415); a request without the bearer
//!   token is refused (401) on every route.
//! - An id with a control character is refused (400) and no log line ever carries one.
//! - A storage URL's password shows in no error, `Debug` output or log line.
//! - A handler's panic is answered 500 at once.
#![cfg(all(
    feature = "http",
    feature = "ops",
    feature = "sqlite",
    feature = "workflow",
    feature = "rpc"
))]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use durable_cluster::http::{HttpConfig, HttpGateway, serve};
use durable_cluster::workflow::{ExecutionId, Token, Workflow, WorkflowEngine};
use durable_cluster::{Never, RequestContext, Runner, entity};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

mod support;

use support::{Approval, approve};

/// Everything the process logged, as text lines without colours.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        use tracing_subscriber::layer::SubscriberExt as _;
        let logs = Arc::new(Mutex::new(Vec::new()));
        let writer = Logs(Arc::clone(&logs));
        let filter = tracing_subscriber::EnvFilter::new(
            "info,durable_cluster=debug,cluster_sharding=debug,cluster_workflow=debug",
        );
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .with_filter(filter);
        use tracing_subscriber::Layer as _;
        // Each test runs in a process of its own (nextest); under `cargo test` the first
        // test's subscriber serves them all.
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer));
        logs
    })
}

/// Held by each test: under `cargo test` the tests of this file share one process, whose
/// descriptors the flood test counts (nextest runs each in a process of its own).
async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

#[derive(Clone)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logged() -> String {
    String::from_utf8_lossy(&logs().lock().unwrap()).into_owned()
}

/// The test entity: `whoami` answers its id and logs inside its request's span, `get` answers
/// 0, `boom` panics.
struct Probe;

#[derive(Serialize, Deserialize)]
struct Whoami;

#[derive(Serialize, Deserialize)]
struct Get;

#[derive(Serialize, Deserialize)]
struct Boom;

#[entity]
impl Probe {
    async fn create() -> Self {
        Probe
    }

    #[rpc]
    async fn whoami(&mut self, context: &RequestContext, _: Whoami) -> Result<String, Never> {
        tracing::info!("whoami handled");
        Ok(context.address().entity_id.as_str().to_owned())
    }

    #[rpc]
    async fn get(&mut self, _: Get) -> Result<i64, Never> {
        Ok(0)
    }

    #[rpc]
    async fn boom(&mut self, _: Boom) -> Result<(), Never> {
        panic!("boom")
    }
}

/// A runner with its operations server, and a gateway in the same process, both on loopback.
struct Served {
    runner: Runner,
    ops: SocketAddr,
    gateway: SocketAddr,
    stop: tokio_util::sync::CancellationToken,
    server: tokio::task::JoinHandle<()>,
    name: &'static str,
}

/// The gateway's and the operations server's variables of these tests: small limits, so that a
/// flood is a few dozen connections, and short timeouts, so that they are seen to run.
const GATEWAY_CONNECTIONS_MAX: usize = 16;
const OPS_CONNECTIONS_MAX: usize = 8;

/// Starts the runner (`ops` variables from `ops_vars`) and its gateway (configured from
/// `http_vars`).
async fn start(
    name: &'static str,
    ops_vars: &[(&str, &str)],
    http_vars: &[(&str, &str)],
) -> Served {
    let _ = logs();
    let mut vars = vec![("CLUSTER_OPS_LISTEN", "127.0.0.1:0")];
    vars.extend_from_slice(ops_vars);
    let env = support::env(name, &vars).unwrap();
    let runner = Runner::start(&env, |sharding| {
        sharding.entity::<Probe>().register()?;
        Ok(())
    })
    .await
    .unwrap();
    let engine = WorkflowEngine::cluster(&runner.sharding).unwrap();
    Approval::register(&engine, approve).unwrap();
    let http_vars: Vec<(String, String)> =
        http_vars.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect();
    let config = HttpConfig::from_lookup(|name| {
        http_vars.iter().find(|(var, _)| var == name).map(|(_, value)| value.clone())
    })
    .unwrap();
    let router = HttpGateway::new(runner.sharding.clone())
        .entity::<Probe>()
        .workflow::<Approval>(&engine)
        .configured(&config)
        .router();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone().cancelled_owned();
    let server = tokio::spawn(serve(listener, router, config.limits.clone(), stopped));
    let ops = runner.ops_address().unwrap();
    Served { runner, ops, gateway, stop, server, name }
}

impl Served {
    async fn stop(self) {
        self.stop.cancel();
        self.server.await.unwrap();
        self.runner.shutdown().await;
        support::remove_database(self.name);
    }
}

fn json() -> Vec<(String, String)> {
    vec![("content-type".to_owned(), "application/json".to_owned())]
}

/// A legitimate call: `POST /get/{id}` with the JSON content type answers 200 and `0`.
async fn legitimate_call(gateway: SocketAddr) {
    let answer = support::exchange(gateway, "POST", "/get/legit", &json(), b"").await;
    assert_eq!((answer.status, answer.body.as_str()), (200, "0"), "{answer:?}");
}

/// Reads `stream` until the server closes it; the time that took and what it sent, or `None`
/// when it is still open at `deadline`.
async fn closed_by_server(stream: &mut TcpStream, deadline: Instant) -> Option<(Duration, String)> {
    let started = Instant::now();
    let mut received = Vec::new();
    let mut buffer = [0_u8; 1024];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => {
                return Some((started.elapsed(), String::from_utf8_lossy(&received).into_owned()));
            }
            Ok(Ok(read)) => received.extend_from_slice(&buffer[..read]),
        }
    }
}

/// The number of descriptors this process has open.
fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map(Iterator::count).unwrap_or_default()
}

/// Slow headers, slow bodies and idle connections are closed within their timeouts (1 s each
/// here), and a legitimate client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_slow_bodies_and_idle_connections_are_closed_within_their_timeouts() {
    let _serial = one_at_a_time().await;
    let served = start(
        "security-slow",
        &[],
        &[
            ("CLUSTER_HTTP_HEADER_READ_TIMEOUT", "1 second"),
            ("CLUSTER_HTTP_BODY_READ_TIMEOUT", "1 second"),
        ],
    )
    .await;
    let gateway = served.gateway;
    let mut idle = Vec::new();
    let mut slow_headers = Vec::new();
    let mut slow_bodies = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(gateway).await.unwrap());
        let mut stream = TcpStream::connect(gateway).await.unwrap();
        stream.write_all(b"POST /get/slow HTTP/1.1\r\nHost: a\r\n").await.unwrap();
        slow_headers.push(stream);
        let mut stream = TcpStream::connect(gateway).await.unwrap();
        let head = "POST /get/slow HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n\
                    Content-Length: 100000\r\n\r\n{\"pad\":\"";
        stream.write_all(head.as_bytes()).await.unwrap();
        slow_bodies.push(stream);
    }
    // Served while they stall.
    legitimate_call(gateway).await;
    // Each is closed within its timeout and a margin; a slow body gets 408 first.
    let deadline = Instant::now() + Duration::from_secs(5);
    for mut stream in idle.into_iter().chain(slow_headers) {
        let closed = closed_by_server(&mut stream, deadline).await;
        let (after, _) = closed.expect("an idle or slow-header connection is closed");
        assert!(after < Duration::from_secs(4), "closed after {after:?}");
    }
    for mut stream in slow_bodies {
        let closed = closed_by_server(&mut stream, deadline).await;
        let (_, answer) = closed.expect("a slow-body connection is closed");
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    }
    legitimate_call(gateway).await;
    // A kept-alive connection that went idle after its answer is closed too.
    let mut kept = TcpStream::connect(gateway).await.unwrap();
    let request = "POST /get/kept HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n\
                   Content-Length: 0\r\n\r\n";
    kept.write_all(request.as_bytes()).await.unwrap();
    let closed = closed_by_server(&mut kept, Instant::now() + Duration::from_secs(5)).await;
    let (_, answer) = closed.expect("an idle kept-alive connection is closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    served.stop().await;
}

/// A flood of idle connections to the gateway and to the operations server, three times their
/// limits, and long header timeouts so that only the limit acts: the server sockets stay within
/// the limits, the runner stays ready and the gateway answers, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_on_each_port_leaves_the_runner_ready() {
    let _serial = one_at_a_time().await;
    let ops_max = OPS_CONNECTIONS_MAX.to_string();
    let gateway_max = GATEWAY_CONNECTIONS_MAX.to_string();
    let served = start(
        "security-flood",
        &[
            ("CLUSTER_OPS_CONNECTIONS_MAX", &ops_max),
            ("CLUSTER_OPS_HEADER_READ_TIMEOUT", "1 minute"),
        ],
        &[
            ("CLUSTER_HTTP_CONNECTIONS_MAX", &gateway_max),
            ("CLUSTER_HTTP_HEADER_READ_TIMEOUT", "1 minute"),
        ],
    )
    .await;
    let (status, body) = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let (status, body) = support::get(served.ops, "/readyz").await.unwrap();
            if status == 200 {
                return (status, body);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the runner gets ready");
    assert_eq!(status, 200, "{body}");

    for (port, limit) in
        [(served.gateway, GATEWAY_CONNECTIONS_MAX), (served.ops, OPS_CONNECTIONS_MAX)]
    {
        let before = open_descriptors();
        let flood_size = 3 * limit;
        let mut flood = Vec::new();
        for _ in 0..flood_size {
            flood.push(TcpStream::connect(port).await.unwrap());
        }
        // Every connection is accepted and either served or closed: let the server catch up.
        let settled = Instant::now() + Duration::from_secs(5);
        loop {
            // The flood's own sockets, plus the server's: at most its limit and one being
            // admitted (and a few of the runtime's own).
            let server_side = open_descriptors().saturating_sub(before + flood_size);
            if server_side <= limit + 4 {
                break;
            }
            assert!(
                Instant::now() < settled,
                "{port}: {server_side} server sockets for a limit of {limit}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Ready and answering at once, although the flood's connections stay open.
        let answered = tokio::time::timeout(Duration::from_secs(2), async {
            let (status, body) = support::get(served.ops, "/readyz").await.unwrap();
            assert_eq!(status, 200, "{body}");
            legitimate_call(served.gateway).await;
        });
        answered.await.expect("answered within 2 s during the flood");
        drop(flood);
    }
    served.stop().await;
}

/// A state-changing request needs the JSON content type: without one, or with a type a
/// browser may send without a preflight, it is refused and reaches no entity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_the_json_content_type_is_refused() {
    let _serial = one_at_a_time().await;
    let served = start("security-content-type", &[], &[]).await;
    let gateway = served.gateway;
    let text = vec![("content-type".to_owned(), "text/plain".to_owned())];
    let form = vec![("content-type".to_owned(), "application/x-www-form-urlencoded".to_owned())];
    for (headers, body) in [(vec![], &b""[..]), (text, b"{}"), (form, b"a=1")] {
        for path in ["/get/c1", "/get/c1/discard", "/approval", "/approval/interrupt"] {
            let answer = support::exchange(gateway, "POST", path, &headers, body).await;
            assert_eq!(answer.status, 415, "{path} {headers:?}: {answer:?}");
        }
    }
    // Reading is not changing: the document needs no content type.
    let document = support::exchange(gateway, "GET", "/openapi.json", &[], b"").await;
    assert_eq!(document.status, 200);
    legitimate_call(gateway).await;
    served.stop().await;
}

/// With a bearer token configured, every route refuses a request without it (401), and a
/// wrong token is refused as a missing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_needs_the_bearer_token() {
    let _serial = one_at_a_time().await;
    let token = "d2f1c9a0e4b7386512fedcba98765432";
    let served = start("security-bearer", &[], &[("CLUSTER_HTTP_BEARER_TOKEN", token)]).await;
    let gateway = served.gateway;
    let with = |value: &str| {
        let mut headers = json();
        headers.push(("authorization".to_owned(), value.to_owned()));
        headers
    };
    let wrong = with("Bearer d2f1c9a0e4b7386512fedcba98765433");
    for headers in [json(), wrong, with("Basic dXNlcjpwYXNz"), with(token)] {
        for (method, path) in [
            ("POST", "/get/c1"),
            ("POST", "/approval/discard"),
            ("POST", "/deferred/abc"),
            ("GET", "/openapi.json"),
            ("POST", "/nowhere"),
        ] {
            let answer = support::exchange(gateway, method, path, &headers, b"").await;
            assert_eq!(answer.status, 401, "{method} {path} {headers:?}: {answer:?}");
        }
    }
    let right = with(&format!("Bearer {token}"));
    let answer = support::exchange(gateway, "POST", "/get/c1", &right, b"").await;
    assert_eq!((answer.status, answer.body.as_str()), (200, "0"), "{answer:?}");
    assert!(!logged().contains(token), "the token was logged");
    served.stop().await;
}

/// An entity id, an execution id or a token's ids with a control character are refused with
/// 400 at once (not after storage retries); an id the runtime is given otherwise (a Rust
/// caller) is logged escaped. No log line carries a raw control character, and none is forged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_with_a_control_character_is_refused_and_never_logged_raw() {
    let _serial = one_at_a_time().await;
    let served = start("security-ids", &[], &[]).await;
    let gateway = served.gateway;
    for id in ["x%0AINFO%20admin%20login%20ok", "a%1B%5B2J", "nul%00", "del%7F"] {
        for path in [format!("/whoami/{id}"), format!("/whoami/{id}/discard")] {
            let answer = support::exchange(gateway, "POST", &path, &json(), b"").await;
            assert_eq!(answer.status, 400, "{path}: {answer:?}");
            assert!(answer.body.contains("control character"), "{answer:?}");
        }
    }
    let started = Instant::now();
    for action in ["resume", "poll", "interrupt"] {
        let body = serde_json::json!({ "executionId": "a\u{0}b" }).to_string();
        let path = format!("/approval/{action}");
        let answer = support::exchange(gateway, "POST", &path, &json(), body.as_bytes()).await;
        assert_eq!(answer.status, 400, "{path}: {answer:?}");
        let long = serde_json::json!({ "executionId": "e".repeat(101) }).to_string();
        let answer = support::exchange(gateway, "POST", &path, &json(), long.as_bytes()).await;
        assert_eq!(answer.status, 400, "{path}: {answer:?}");
    }
    let forged = Token {
        workflow: "Approval".to_owned(),
        execution_id: ExecutionId::from_raw("e\n2024-01-01T00:00:00Z  INFO admin login ok"),
        deferred: "approval".to_owned(),
    };
    let path = format!("/deferred/{}", forged.encode());
    let answer = support::exchange(gateway, "POST", &path, &json(), b"\"x\"").await;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());

    // A Rust caller may still name such an entity: the runtime logs its id escaped.
    let id = "r\nINFO admin login ok\u{1b}[2J";
    let answered = served.runner.sharding.client::<Probe>(id).send(Whoami).await.unwrap();
    assert_eq!(answered, id, "the id itself is unchanged");
    let logs = logged();
    assert!(logs.contains("whoami handled"), "{logs}");
    assert!(logs.contains("r\\nINFO admin login ok\\u{1b}[2J"), "{logs}");
    for line in logs.lines() {
        assert!(!line.chars().any(char::is_control), "a raw control character: {line:?}");
        assert!(!line.starts_with("INFO admin"), "a forged line: {line:?}");
    }
    legitimate_call(gateway).await;
    served.stop().await;
}

/// A handler's panic is answered 500 at once (not 504 after the request timeout and a series of
/// restarts), and the recreated entity serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_defect_is_answered_500_at_once() {
    let _serial = one_at_a_time().await;
    let served = start("security-defect", &[], &[]).await;
    let started = Instant::now();
    let answer = support::exchange(served.gateway, "POST", "/boom/b1", &json(), b"").await;
    assert_eq!((answer.status, answer.body.as_str()), (500, ""), "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    let answer = support::exchange(served.gateway, "POST", "/get/b1", &json(), b"").await;
    assert_eq!((answer.status, answer.body.as_str()), (200, "0"), "{answer:?}");
    served.stop().await;
}

/// A storage URL's password shows in no error, `Debug` output, log line or `/readyz` answer of
/// a runner: one that cannot start (an unknown scheme, an unreachable database) and, with
/// PostgreSQL (which trusts any password here), one that runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storage_password_never_shows() {
    let _serial = one_at_a_time().await;
    let _ = logs();
    const PASSWORD: &str = "Hunter2Secret";
    let mut shown = String::new();
    for url in [
        format!("mariadb://app:{PASSWORD}@db.example:3306/app"),
        format!("postgres://app:{PASSWORD}@127.0.0.1:1/app"),
        format!("postgres://app@127.0.0.1:1/app?password={PASSWORD}"),
    ] {
        let env = support::env("security-secret", &[("CLUSTER_STORAGE_URL", &url)]).unwrap();
        shown.push_str(&format!("{env:?} {env:#?}\n"));
        match Runner::start(&env, |_| Ok(())).await {
            Err(error) => shown.push_str(&format!("{error} {error:?}\n")),
            Ok(runner) => {
                runner.shutdown().await;
                panic!("{url} started");
            }
        }
    }
    if let Ok(reachable) = std::env::var("CLUSTER_TEST_POSTGRES_URL") {
        let url = reachable.replacen(
            "postgres://postgres@",
            &format!("postgres://postgres:{PASSWORD}@"),
            1,
        );
        assert!(url.contains(PASSWORD), "{reachable} has no user to give a password");
        let env = support::env(
            "security-secret",
            &[("CLUSTER_STORAGE_URL", &url), ("CLUSTER_OPS_LISTEN", "127.0.0.1:0")],
        )
        .unwrap();
        let runner = Runner::start(&env, |_| Ok(())).await.unwrap();
        let (_, ready) = support::get(runner.ops_address().unwrap(), "/readyz").await.unwrap();
        shown.push_str(&format!("{env:?} {ready} {:?}\n", runner));
        runner.shutdown().await;
    }
    support::remove_database("security-secret");
    let logs = logged();
    assert!(!shown.contains(PASSWORD), "{shown}");
    assert!(!logs.contains(PASSWORD), "{logs}");
    assert!(shown.contains("app:***@"), "{shown}");
}
