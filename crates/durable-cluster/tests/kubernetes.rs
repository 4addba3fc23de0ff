//! `KubernetesRunnerHealth` (feature `kubernetes`) against a fake Kubernetes API on loopback:
//! an axum server over HTTP, a one-route server over TLS with certificates made at test time by
//! the `openssl` command line, and two `Runner`s started with `CLUSTER_RUNNER_HEALTH=kubernetes`.
#![cfg(feature = "kubernetes")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use durable_cluster::{
    KubernetesOptions, KubernetesRunnerHealth, KubernetesToken, RunnerAddress, RunnerHealth,
};
use serde_json::{Value, json};

#[cfg(all(feature = "rpc", feature = "sqlite"))]
use cluster_testkit::wait::eventually;

#[cfg(all(feature = "rpc", feature = "sqlite"))]
mod support;

/// What the fake API answers to a list.
#[derive(Clone)]
enum Answer {
    /// A pod list with these pods.
    Pods(Vec<Value>),
    /// This status and body.
    Raw(u16, String),
    /// Nothing, ever.
    Hang,
}

/// One list the fake API was asked for.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    query: BTreeMap<String, String>,
    authorization: Option<String>,
}

#[derive(Clone)]
struct Fake {
    answer: Arc<Mutex<Answer>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// The fake API: `/api/v1/namespaces/{namespace}/pods` and `/api/v1/pods` on loopback; it
/// stops when dropped.
struct FakeApi {
    address: SocketAddr,
    fake: Fake,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn answer(State(fake): State<Fake>, uri: Uri, headers: HeaderMap) -> Response {
    let authorization =
        headers.get(header::AUTHORIZATION).and_then(|value| value.to_str().ok()).map(str::to_owned);
    fake.seen.lock().unwrap().push(Seen {
        path: uri.path().to_owned(),
        query: query(uri.query().unwrap_or_default()),
        authorization,
    });
    let answer = fake.answer.lock().unwrap().clone();
    let json = [(header::CONTENT_TYPE, "application/json")];
    match answer {
        Answer::Pods(items) => {
            let list = json!({"kind": "PodList", "apiVersion": "v1", "items": items});
            (StatusCode::OK, json, list.to_string()).into_response()
        }
        Answer::Raw(status, body) => {
            (StatusCode::from_u16(status).unwrap(), json, body).into_response()
        }
        Answer::Hang => std::future::pending().await,
    }
}

impl FakeApi {
    async fn start(first: Answer) -> FakeApi {
        let fake = Fake { answer: Arc::new(Mutex::new(first)), seen: Arc::default() };
        let app = axum::Router::new()
            .route("/api/v1/namespaces/{namespace}/pods", axum::routing::get(answer))
            .route("/api/v1/pods", axum::routing::get(answer))
            .with_state(fake.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        FakeApi { address, fake, server }
    }

    fn set(&self, answer: Answer) {
        *self.fake.answer.lock().unwrap() = answer;
    }

    fn seen(&self) -> Vec<Seen> {
        self.fake.seen.lock().unwrap().clone()
    }

    fn lists(&self) -> usize {
        self.fake.seen.lock().unwrap().len()
    }

    /// The options of a check on this API: a static token, namespace `runners`, a label
    /// selector, and no reuse of a list.
    fn options(&self) -> KubernetesOptions {
        let mut options = KubernetesOptions::new(format!("http://{}", self.address));
        options.token = KubernetesToken::Static("test-token".to_owned());
        options.namespace = Some("runners".to_owned());
        options.label_selector = Some("app=cluster-runner,tier in (a,b)".to_owned());
        options.cache_ttl = Duration::ZERO;
        options
    }

    fn health(&self) -> KubernetesRunnerHealth {
        KubernetesRunnerHealth::new(self.options()).unwrap()
    }
}

/// The parameters of a query string, percent-decoded.
fn query(query: &str) -> BTreeMap<String, String> {
    fn decode(text: &str) -> String {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            if bytes[at] == b'%' && at + 2 < bytes.len() {
                let hex = std::str::from_utf8(&bytes[at + 1..at + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                at += 3;
            } else {
                out.push(if bytes[at] == b'+' { b' ' } else { bytes[at] });
                at += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(name), decode(value))
        })
        .collect()
}

const T1: &str = "2026-01-01T00:00:00Z";
const T2: &str = "2026-01-01T00:05:00Z";

/// A running pod at `ip` with `conditions` (`type`, `status`, `lastTransitionTime`).
fn pod(ip: &str, conditions: &[(&str, &str, Option<&str>)]) -> Value {
    let conditions: Vec<Value> = conditions
        .iter()
        .map(|(kind, status, at)| json!({"type": kind, "status": status, "lastTransitionTime": at}))
        .collect();
    json!({
        "metadata": {"name": format!("runner-{ip}"), "namespace": "runners"},
        "status": {"phase": "Running", "podIP": ip, "hostIP": "192.0.2.1", "conditions": conditions}
    })
}

fn ready(ip: &str) -> Value {
    pod(ip, &[("Initialized", "True", Some(T1)), ("Ready", "True", Some(T2))])
}

/// A pod that was ready and no longer is.
fn not_ready(ip: &str) -> Value {
    pod(ip, &[("Initialized", "True", Some(T1)), ("Ready", "False", Some(T2))])
}

fn address(host: &str) -> RunnerAddress {
    RunnerAddress::new(host, 34431)
}

async fn alive(health: &KubernetesRunnerHealth, host: &str) -> bool {
    let address = address(host);
    let verdict = tokio::time::timeout(Duration::from_secs(20), health.is_alive(&address));
    verdict.await.expect("the check answers within its timeout")
}

/// A runner is alive while its pod is ready or still starting, and dead when its pod is not
/// ready any more or is not listed; the list carries the token, the namespace, the label
/// selector and the running phase.
#[tokio::test]
async fn verdicts_follow_the_pods_and_the_list_carries_the_token_and_the_selectors() {
    let pods = vec![
        ready("10.0.0.1"),
        not_ready("10.0.0.2"),
        pod("10.0.0.3", &[("Initialized", "False", Some(T1)), ("Ready", "False", Some(T1))]),
        pod("10.0.0.4", &[("Initialized", "True", Some(T1)), ("Ready", "False", Some(T1))]),
        // The reference's test: both transition times null.
        pod("10.0.0.5", &[("Initialized", "True", None), ("Ready", "False", None)]),
    ];
    let api = FakeApi::start(Answer::Pods(pods)).await;
    let health = api.health();
    let cases = [
        ("10.0.0.1", true, "ready"),
        ("10.0.0.2", false, "not ready any more"),
        ("10.0.0.3", true, "initializing"),
        ("10.0.0.4", true, "starting, never ready yet"),
        ("10.0.0.5", true, "transition times unknown"),
        ("10.0.0.9", false, "no pod"),
    ];
    for (host, expected, what) in cases {
        assert_eq!(alive(&health, host).await, expected, "{host}: {what}");
    }
    let seen = api.seen();
    assert_eq!(seen.len(), cases.len(), "no reuse with cache_ttl 0: {seen:?}");
    let first = &seen[0];
    assert_eq!(first.path, "/api/v1/namespaces/runners/pods");
    assert_eq!(first.authorization.as_deref(), Some("Bearer test-token"));
    assert_eq!(
        first.query.get("labelSelector").map(String::as_str),
        Some("app=cluster-runner,tier in (a,b)")
    );
    assert_eq!(first.query.get("fieldSelector").map(String::as_str), Some("status.phase=Running"));
}

/// Without a namespace every namespace is listed; without a token or selector none is sent.
#[tokio::test]
async fn without_a_namespace_the_pods_of_every_namespace_are_listed() {
    let api = FakeApi::start(Answer::Pods(vec![ready("10.0.0.1")])).await;
    let mut options = KubernetesOptions::new(format!("http://{}/", api.address));
    options.cache_ttl = Duration::ZERO;
    let health = KubernetesRunnerHealth::new(options).unwrap();
    assert!(alive(&health, "10.0.0.1").await);
    let seen = api.seen();
    assert_eq!(seen[0].path, "/api/v1/pods");
    assert_eq!(seen[0].authorization, None);
    assert_eq!(seen[0].query.get("labelSelector"), None);
}

/// One health round (questions about many runners at once) lists the pods once; a later
/// round within `cache_ttl` reuses the list, and one after it lists again.
#[tokio::test]
async fn one_round_lists_the_pods_once() {
    let pods = (1..=8).map(|n| ready(&format!("10.0.1.{n}"))).collect();
    let api = FakeApi::start(Answer::Pods(pods)).await;
    let ttl = Duration::from_millis(300);
    let mut options = api.options();
    options.cache_ttl = ttl;
    let health = Arc::new(KubernetesRunnerHealth::new(options).unwrap());
    let round = || {
        let questions: Vec<_> = (1..=8)
            .map(|n| {
                let health = Arc::clone(&health);
                tokio::spawn(async move { alive(&health, &format!("10.0.1.{n}")).await })
            })
            .collect();
        async move {
            for question in questions {
                assert!(question.await.unwrap());
            }
        }
    };
    round().await;
    assert_eq!(api.lists(), 1, "eight concurrent questions, one list");
    round().await;
    assert_eq!(api.lists(), 1, "reused within the TTL");
    tokio::time::sleep(ttl).await;
    round().await;
    assert_eq!(api.lists(), 2, "listed again once the TTL passed");
}

/// Whatever goes wrong with the list, every runner counts as alive (the reference's fail-open):
/// an error status, a body that is not a pod list, a list too large.
#[tokio::test]
async fn a_failed_list_counts_every_runner_as_alive() {
    let api = FakeApi::start(Answer::Pods(vec![])).await;
    let health = api.health();
    // The control: a good list without the runner's pod says it is dead.
    assert!(!alive(&health, "10.0.0.9").await);
    let forbidden = json!({
        "kind": "Status",
        "status": "Failure",
        "message": "pods is forbidden: User \"system:serviceaccount:runners:default\" cannot list resource \"pods\"",
        "reason": "Forbidden",
        "code": 403
    });
    let failures = [
        Answer::Raw(500, "internal error".to_owned()),
        Answer::Raw(403, forbidden.to_string()),
        Answer::Raw(200, "this is not JSON".to_owned()),
        Answer::Raw(200, r#"{"items": 3}"#.to_owned()),
        Answer::Raw(200, r#"{"kind": "PodList"}"#.to_owned()),
    ];
    for failure in failures {
        api.set(failure);
        assert!(alive(&health, "10.0.0.9").await);
    }
    assert_eq!(api.lists(), 6, "each question listed: the failures were answered");
    // And back to a good list: the verdict is the pod's again.
    api.set(Answer::Pods(vec![not_ready("10.0.0.9")]));
    assert!(!alive(&health, "10.0.0.9").await);
}

/// A pod list larger than `max_body_bytes` is a failure: every runner counts as alive.
#[tokio::test]
async fn a_pod_list_over_the_size_limit_counts_every_runner_as_alive() {
    let pods = (1..=100).map(|n| not_ready(&format!("10.0.2.{n}"))).collect();
    let api = FakeApi::start(Answer::Pods(pods)).await;
    let mut options = api.options();
    options.max_body_bytes = 4096;
    let small = KubernetesRunnerHealth::new(options).unwrap();
    assert!(alive(&small, "10.0.2.1").await, "too large: alive");
    // The control: the same list within the default limit says the runner is dead.
    assert!(!alive(&api.health(), "10.0.2.1").await);
}

/// An API that does not answer counts every runner as alive once `request_timeout` passed.
#[tokio::test]
async fn a_slow_api_counts_every_runner_as_alive_after_the_timeout() {
    let api = FakeApi::start(Answer::Hang).await;
    let mut options = api.options();
    options.request_timeout = Duration::from_millis(300);
    let health = KubernetesRunnerHealth::new(options).unwrap();
    let started = tokio::time::Instant::now();
    assert!(alive(&health, "10.0.0.9").await);
    assert!(started.elapsed() >= Duration::from_millis(300), "{:?}", started.elapsed());
    assert_eq!(api.lists(), 1, "the request reached the API");
}

/// An API that cannot be reached counts every runner as alive.
#[tokio::test]
async fn an_unreachable_api_counts_every_runner_as_alive() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut options = KubernetesOptions::new(format!("http://{closed}"));
    options.request_timeout = Duration::from_secs(2);
    let health = KubernetesRunnerHealth::new(options).unwrap();
    assert!(alive(&health, "10.0.0.9").await);
}

/// A runner whose host is not an IP address has no pod to find: it counts as alive, and the
/// API is not asked.
#[tokio::test]
async fn a_runner_whose_host_is_not_an_ip_address_counts_as_alive() {
    let api = FakeApi::start(Answer::Pods(vec![])).await;
    let health = api.health();
    assert!(alive(&health, "runner-0.runners.svc").await);
    assert_eq!(api.lists(), 0);
    // IPv6 hosts are found, bracketed or not.
    api.set(Answer::Pods(vec![ready("fd00::7")]));
    assert!(alive(&health, "fd00::7").await);
    assert!(alive(&health, "[fd00::7]").await);
    assert!(!alive(&health, "fd00::8").await);
}

/// A temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("durable-cluster-{what}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The token file is read before every list: a rotated token is sent at the next list (the
/// reference's K8sHttpClient test).
#[tokio::test]
async fn a_rotated_token_file_is_sent_at_the_next_list() {
    let api = FakeApi::start(Answer::Pods(vec![ready("10.0.0.1")])).await;
    let dir = TempDir::new("token");
    let token = dir.path().join("token");
    std::fs::write(&token, "token-1\n").unwrap();
    let mut options = api.options();
    options.token = KubernetesToken::File(token.clone());
    let health = KubernetesRunnerHealth::new(options).unwrap();
    assert!(alive(&health, "10.0.0.1").await);
    std::fs::write(&token, "token-2\n").unwrap();
    assert!(alive(&health, "10.0.0.1").await);
    let sent: Vec<Option<String>> = api.seen().into_iter().map(|seen| seen.authorization).collect();
    assert_eq!(sent, [Some("Bearer token-1".to_owned()), Some("Bearer token-2".to_owned())]);
    // A token file that went away: no list is sent, and every runner counts as alive.
    std::fs::remove_file(&token).unwrap();
    api.set(Answer::Pods(vec![]));
    assert!(alive(&health, "10.0.0.1").await);
    assert_eq!(api.lists(), 2);
}

/// A CA, a server certificate it signed for `127.0.0.1`, and an unrelated CA, as PEM files
/// made with the `openssl` command line.
struct Pki {
    dir: TempDir,
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command line");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

impl Pki {
    fn new() -> Pki {
        let pki = Pki { dir: TempDir::new("kubernetes-pki") };
        let dir = pki.dir.path();
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        for ca in ["ca", "other-ca"] {
            let (key, cert, subject) =
                (format!("{ca}.key"), format!("{ca}.pem"), format!("/CN={ca}"));
            let mut args = vec!["req", "-x509", "-days", "2"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &cert, "-subj", &subject]);
            args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
            args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
            openssl(dir, &args);
        }
        let mut args = vec!["req", "-new"];
        args.extend(ec);
        args.extend(["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=kubernetes"]);
        openssl(dir, &args);
        std::fs::write(
            dir.join("server.ext"),
            "basicConstraints=CA:FALSE\n\
             subjectAltName=DNS:kubernetes.default.svc,IP:127.0.0.1\n\
             extendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "server.ext",
                "-out",
                "server.pem",
            ],
        );
        pki
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.path().join(name)).unwrap()
    }
}

/// A fake API over TLS on loopback that answers every request with `pods` and counts the
/// requests it answered; it stops when the returned task is aborted.
async fn tls_api(
    pki: &Pki,
    pods: Vec<Value>,
) -> (SocketAddr, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls::{ServerConfig, crypto, version};

    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&pki.read("server.pem")).map(Result::unwrap).collect();
    let key = PrivateKeyDer::from_pem_slice(&pki.read("server.key")).unwrap();
    let config = ServerConfig::builder_with_provider(Arc::new(crypto::ring::default_provider()))
        .with_protocol_versions(&[&version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let answered = Arc::new(AtomicUsize::new(0));
    let body = json!({"kind": "PodList", "items": pods}).to_string();
    let counter = Arc::clone(&answered);
    let server = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let (acceptor, body, counter) = (acceptor.clone(), body.clone(), Arc::clone(&counter));
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper::service::service_fn(move |_request| {
                    counter.fetch_add(1, Ordering::SeqCst);
                    let body = body.clone();
                    async move { Ok::<_, std::convert::Infallible>(hyper::Response::new(body)) }
                });
                let io = hyper_util::rt::TokioIo::new(tls);
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    (address, answered, server)
}

/// Over HTTPS the API server's certificate is checked against the given CA (an IP address
/// SAN, as the in-cluster service address has): with the cluster's CA the pods are read; with
/// another CA nothing is sent, and every runner counts as alive.
#[tokio::test]
async fn over_https_only_the_clusters_ca_is_trusted() {
    let pki = Pki::new();
    let (address, answered, server) = tls_api(&pki, vec![not_ready("10.0.0.2")]).await;
    let with_ca = |ca: &str| {
        let mut options = KubernetesOptions::new(format!("https://{address}"));
        options.ca_pem = Some(pki.read(ca));
        options.token = KubernetesToken::Static("test-token".to_owned());
        options.cache_ttl = Duration::ZERO;
        KubernetesRunnerHealth::new(options).unwrap()
    };
    let trusted = with_ca("ca.pem");
    assert!(!alive(&trusted, "10.0.0.2").await, "read over TLS: not ready");
    assert_eq!(answered.load(Ordering::SeqCst), 1);
    let untrusted = with_ca("other-ca.pem");
    assert!(alive(&untrusted, "10.0.0.2").await, "the handshake fails: alive");
    assert_eq!(answered.load(Ordering::SeqCst), 1, "no request after a failed handshake");
    server.abort();
}

/// Two runners on one SQLite file, started with `CLUSTER_RUNNER_HEALTH=kubernetes` (the service
/// account in a directory of the test's, the API a fake one over HTTP): the runner whose pod is
/// not ready any more loses its shards, and gets them back once its pod is ready again.
#[cfg(all(feature = "rpc", feature = "sqlite"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runners_started_with_kubernetes_health_follow_their_pods() {
    use durable_cluster::{Runner, RunnerEnv, RunnerHealthSource};

    let api = FakeApi::start(Answer::Pods(vec![ready("127.0.0.1"), ready("127.0.0.2")])).await;
    let account = TempDir::new("service-account");
    std::fs::write(account.path().join("token"), "pod-token\n").unwrap();
    std::fs::write(account.path().join("namespace"), "runners\n").unwrap();
    let name = "kubernetes-health";
    let env = |host: &str| -> RunnerEnv {
        let vars = [
            ("HOST", host),
            ("SHARDS_PER_GROUP", "12"),
            ("REFRESH_ASSIGNMENTS_INTERVAL", "100 millis"),
            ("RUNNER_HEALTH_CHECK_INTERVAL", "200 millis"),
            ("CLUSTER_RUNNER_HEALTH", "kubernetes"),
            ("CLUSTER_KUBERNETES_LABEL_SELECTOR", "app=cluster-runner"),
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
        ];
        let mut env = support::env(name, &vars).unwrap();
        // The in-cluster API and service account, pointed at the test's.
        let RunnerHealthSource::Kubernetes { api_url, service_account_dir, .. } =
            &mut env.runner_health
        else {
            panic!("CLUSTER_RUNNER_HEALTH=kubernetes: {:?}", env.runner_health);
        };
        assert_eq!(api_url, "https://10.96.0.1:443");
        *api_url = format!("http://{}", api.address);
        *service_account_dir = account.path().to_path_buf();
        env
    };
    let (env_a, env_b) = (env("127.0.0.1"), env("127.0.0.2"));
    let a = Runner::start(&env_a, |_| Ok(())).await.unwrap();
    let b = Runner::start(&env_b, |_| Ok(())).await.unwrap();
    let holds = |runner: &Runner| runner.sharding.acquired_shards().len();
    eventually("both runners hold shards", || holds(&a) > 0 && holds(&b) > 0).await;
    api.set(Answer::Pods(vec![ready("127.0.0.1"), not_ready("127.0.0.2")]));
    eventually("the runner whose pod is not ready loses its shards", || {
        holds(&b) == 0 && holds(&a) == 12
    })
    .await;
    api.set(Answer::Pods(vec![ready("127.0.0.1"), ready("127.0.0.2")]));
    eventually("it gets shards back once its pod is ready", || holds(&a) > 0 && holds(&b) > 0)
        .await;
    let seen = api.seen();
    let first = seen.first().expect("the runners listed the pods");
    assert_eq!(first.path, "/api/v1/namespaces/runners/pods", "the pod's own namespace");
    assert_eq!(first.authorization.as_deref(), Some("Bearer pod-token"));
    assert_eq!(first.query.get("labelSelector").map(String::as_str), Some("app=cluster-runner"));
    a.shutdown().await;
    b.shutdown().await;
    support::remove_database(name);
}

/// A runner asked for `kubernetes` whose pod mounts no service account does not start, and
/// the error names the missing file.
#[cfg(all(feature = "rpc", feature = "sqlite"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_without_a_service_account_does_not_start() {
    use durable_cluster::{Runner, RunnerError, RunnerHealthSource};

    let name = "kubernetes-no-account";
    let vars = [
        ("CLUSTER_RUNNER_HEALTH", "kubernetes"),
        ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
        ("KUBERNETES_SERVICE_PORT", "443"),
    ];
    let mut env = support::env(name, &vars).unwrap();
    let missing = TempDir::new("no-account");
    if let RunnerHealthSource::Kubernetes { service_account_dir, .. } = &mut env.runner_health {
        *service_account_dir = missing.path().join("serviceaccount");
    }
    match Runner::start(&env, |_| Ok(())).await {
        Err(RunnerError::Config(error)) => {
            assert!(error.key().ends_with("serviceaccount/token"), "{error}");
            assert_eq!(RunnerError::Config(error).exit_code(), 2);
        }
        Err(error) => panic!("not a configuration error: {error}"),
        Ok(runner) => {
            runner.shutdown().await;
            panic!("started without a service account");
        }
    }
    support::remove_database(name);
}
