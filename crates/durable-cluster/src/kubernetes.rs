//! [`KubernetesRunnerHealth`] (feature `kubernetes`): a runner is alive while the Kubernetes pod
//! whose IP is the runner's host is ready or still starting, as the reference's
//! `RunnerHealth.layerK8s` judges (`effect/src/cluster/RunnerHealth.ts`, with the pod list and
//! `Pod.isReadyOrInitializing` of `effect/src/cluster/K8sHttpClient.ts`).
//!
//! - The pods are listed from the Kubernetes API (`GET /api/v1/namespaces/{namespace}/pods`,
//!   running pods only, with the label selector when there is one), over HTTPS with the
//!   service account's token and CA in a pod ([`KubernetesOptions::in_cluster`]).
//! - One list serves every runner of a health round: the list is kept for
//!   [`cache_ttl`](KubernetesOptions::cache_ttl) (10 s), and concurrent questions wait for the
//!   one list in flight.
//! - Every list is bounded in time ([`request_timeout`](KubernetesOptions::request_timeout))
//!   and size ([`max_body_bytes`](KubernetesOptions::max_body_bytes)).
//! - A failure (no answer, an error status, a body that is not a pod list) counts every runner
//!   as alive, as the reference does: the check fails open and logs a warning, and the runners
//!   are left to their registry heartbeat.
//!
//! Where this differs from the reference:
//!
//! - In a pod the list is scoped to the pod's own namespace (the reference lists every
//!   namespace without one), so a `Role` that allows `list` on pods is enough.
//! - A runner whose host is not an IP address counts as alive, with a warning: no pod can be
//!   found by it (the reference finds none, and judges the runner dead).
//! - A pod without an IP, or a condition without a transition time, does not fail the whole
//!   list; a pod's secondary IPs (`podIPs`, dual stack) find it too.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cluster_core::future::BoxFuture;
use cluster_core::{ConfigError, RunnerAddress};
use cluster_sharding::RunnerHealth;
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper::body::Bytes;
use hyper::header::{ACCEPT, AUTHORIZATION, HOST, USER_AGENT};
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto, version};

/// Where to reach the Kubernetes API and which pods to read, for [`KubernetesRunnerHealth`].
///
/// Start from [`KubernetesOptions::in_cluster`] in a pod, or from [`KubernetesOptions::new`]
/// with an explicit API URL, then change the fields.
#[derive(Clone)]
#[non_exhaustive]
pub struct KubernetesOptions {
    /// The API server's base URL: `https://host:port`, or `http://host:port` (a test server, or
    /// a local proxy such as `kubectl proxy`). A path after the authority is kept as a prefix of
    /// the API paths.
    pub api_url: String,
    /// The bearer token sent with every list.
    pub token: KubernetesToken,
    /// The PEM certificates of the CAs that sign the API server's certificate; required with
    /// `https`. They are the only roots trusted.
    pub ca_pem: Option<Vec<u8>>,
    /// The namespace whose pods are listed; `None` lists the pods of every namespace (which
    /// needs a `ClusterRole`).
    pub namespace: Option<String>,
    /// The label selector of the runners' pods (`app=cluster-runner`); `None` lists every
    /// running pod of the namespace.
    pub label_selector: Option<String>,
    /// How long one list may take, connection and TLS included. Default
    /// [`KubernetesOptions::DEFAULT_REQUEST_TIMEOUT`].
    pub request_timeout: Duration,
    /// How long a list (or a failure to list) is reused. Default
    /// [`KubernetesOptions::DEFAULT_CACHE_TTL`].
    pub cache_ttl: Duration,
    /// The largest pod list read, in bytes; a larger one is a failure (every runner alive).
    /// Default [`KubernetesOptions::DEFAULT_MAX_BODY_BYTES`].
    pub max_body_bytes: usize,
}

/// The bearer token of [`KubernetesOptions::token`].
#[derive(Clone)]
#[non_exhaustive]
pub enum KubernetesToken {
    /// No `Authorization` header (a local proxy that authenticates, a test server).
    None,
    /// This token.
    Static(String),
    /// The token in this file, read again before every list: the kubelet rotates a pod's
    /// projected service-account token.
    File(PathBuf),
}

impl std::fmt::Debug for KubernetesToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KubernetesToken::None => f.write_str("None"),
            KubernetesToken::Static(_) => f.write_str("Static(<redacted>)"),
            KubernetesToken::File(path) => f.debug_tuple("File").field(path).finish(),
        }
    }
}

impl std::fmt::Debug for KubernetesOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesOptions")
            .field("api_url", &self.api_url)
            .field("token", &self.token)
            .field("ca_pem", &self.ca_pem.as_ref().map(|pem| format!("{} bytes", pem.len())))
            .field("namespace", &self.namespace)
            .field("label_selector", &self.label_selector)
            .field("request_timeout", &self.request_timeout)
            .field("cache_ttl", &self.cache_ttl)
            .field("max_body_bytes", &self.max_body_bytes)
            .finish()
    }
}

impl KubernetesOptions {
    /// Where a pod's service account is mounted: `token`, `ca.crt` and `namespace`.
    pub const SERVICE_ACCOUNT_DIR: &'static str = "/var/run/secrets/kubernetes.io/serviceaccount";
    /// The default [`request_timeout`](KubernetesOptions::request_timeout): 5 seconds.
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
    /// The default [`cache_ttl`](KubernetesOptions::cache_ttl): 10 seconds, the reference's.
    pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(10);
    /// The default [`max_body_bytes`](KubernetesOptions::max_body_bytes): 16 MiB, some thousand
    /// pods.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

    /// Options for the API at `api_url`: no token, no CA, every namespace, no label selector,
    /// the default limits.
    pub fn new(api_url: impl Into<String>) -> KubernetesOptions {
        KubernetesOptions {
            api_url: api_url.into(),
            token: KubernetesToken::None,
            ca_pem: None,
            namespace: None,
            label_selector: None,
            request_timeout: KubernetesOptions::DEFAULT_REQUEST_TIMEOUT,
            cache_ttl: KubernetesOptions::DEFAULT_CACHE_TTL,
            max_body_bytes: KubernetesOptions::DEFAULT_MAX_BODY_BYTES,
        }
    }

    /// Options for a process in a pod, as Kubernetes clients configure themselves there: the API
    /// at `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, the service account's
    /// token (read again before every list) and CA, and the pod's own namespace, all from
    /// [`SERVICE_ACCOUNT_DIR`](KubernetesOptions::SERVICE_ACCOUNT_DIR). No label selector.
    ///
    /// # Errors
    ///
    /// A variable is missing or wrong, or a file of the service account cannot be read (the
    /// error names it): the process is not in a pod, or its pod mounts no service account.
    pub fn in_cluster() -> Result<KubernetesOptions, ConfigError> {
        let api_url = in_cluster_api_url(|name| std::env::var(name).ok())?;
        KubernetesOptions::from_service_account(
            api_url,
            Path::new(KubernetesOptions::SERVICE_ACCOUNT_DIR),
            None,
        )
    }

    /// Options for the API at `api_url` with the service account mounted at `dir`: its token
    /// file, its `ca.crt` when `api_url` is `https`, and `namespace`, or else the namespace in
    /// its `namespace` file.
    pub(crate) fn from_service_account(
        api_url: String,
        dir: &Path,
        namespace: Option<String>,
    ) -> Result<KubernetesOptions, ConfigError> {
        let unreadable = |path: &Path, error: std::io::Error| {
            ConfigError::new(
                path.display().to_string(),
                "",
                format!("cannot be read ({error}): does the pod mount its service account?"),
            )
        };
        let token = dir.join("token");
        std::fs::metadata(&token).map_err(|error| unreadable(&token, error))?;
        let ca_pem = if api_url.starts_with("https:") {
            let ca = dir.join("ca.crt");
            Some(std::fs::read(&ca).map_err(|error| unreadable(&ca, error))?)
        } else {
            None
        };
        let namespace = match namespace {
            Some(namespace) => namespace,
            None => {
                let file = dir.join("namespace");
                let read =
                    std::fs::read_to_string(&file).map_err(|error| unreadable(&file, error))?;
                read.trim().to_owned()
            }
        };
        Ok(KubernetesOptions {
            token: KubernetesToken::File(token),
            ca_pem,
            namespace: Some(namespace),
            ..KubernetesOptions::new(api_url)
        })
    }
}

/// The API URL of a process in a pod, from `KUBERNETES_SERVICE_HOST` and
/// `KUBERNETES_SERVICE_PORT` (read with `lookup`).
pub(crate) fn in_cluster_api_url(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<String, ConfigError> {
    const HOST: &str = "KUBERNETES_SERVICE_HOST";
    const PORT: &str = "KUBERNETES_SERVICE_PORT";
    let outside = "is not set: the Kubernetes runner health reads the API of the pod's cluster";
    let host = lookup(HOST).filter(|host| !host.is_empty());
    let host = host.ok_or_else(|| ConfigError::new(HOST, "", outside))?;
    let port = lookup(PORT).filter(|port| !port.is_empty());
    let port = port.ok_or_else(|| ConfigError::new(PORT, "", outside))?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|port| *port != 0)
        .ok_or_else(|| ConfigError::new(PORT, &port, "is not a port number"))?;
    let name = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
    if host.parse::<IpAddr>().is_err() && !host.chars().all(name) {
        return Err(ConfigError::new(HOST, &host, "is not an IP address or a host name"));
    }
    let authority = if host.parse::<Ipv6Addr>().is_ok() {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let url = format!("https://{authority}");
    Endpoint::parse(&url)
        .map_err(|_| ConfigError::new(HOST, &host, "is not an IP address or a host name"))?;
    Ok(url)
}

/// Whether `namespace` is a Kubernetes namespace name (an RFC 1123 label): at most 63
/// lower-case letters, digits and `-`, starting and ending with a letter or a digit.
pub(crate) fn check_namespace(namespace: &str) -> Result<(), &'static str> {
    let bytes = namespace.as_bytes();
    let edge =
        |byte: Option<&u8>| byte.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let valid = (1..=63).contains(&bytes.len())
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && edge(bytes.first())
        && edge(bytes.last());
    if valid {
        Ok(())
    } else {
        Err("is not a namespace name: 1 to 63 lower-case letters, digits or `-`, starting and \
             ending with a letter or a digit")
    }
}

/// Whether `selector` can be a label selector: not empty, at most 4096 characters, and only
/// the characters of label keys, values and selector operators (letters, digits,
/// `-_./=!,()` and spaces). The API server checks the rest of its syntax.
pub(crate) fn check_label_selector(selector: &str) -> Result<(), &'static str> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_./=!,() ".contains(c);
    if !selector.trim().is_empty() && selector.len() <= 4096 && selector.chars().all(allowed) {
        Ok(())
    } else {
        Err("is not a label selector such as `app=cluster-runner`: letters, digits, `-_./=!,()` \
             and spaces")
    }
}

/// A runner is alive while the pod whose IP is its host is ready or still starting, read from
/// the Kubernetes API (see the module docs).
///
/// ```no_run
/// use std::sync::Arc;
///
/// use durable_cluster::{KubernetesOptions, KubernetesRunnerHealth, Sharding, ShardingConfig};
/// # async fn start(
/// #     messages: Arc<dyn durable_cluster::storage::MessageStorage>,
/// #     runners: Arc<dyn durable_cluster::storage::RunnerStorage>,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// let mut options = KubernetesOptions::in_cluster()?;
/// options.label_selector = Some("app=cluster-runner".to_owned());
/// let health = KubernetesRunnerHealth::new(options)?;
/// let sharding = Sharding::member(ShardingConfig::from_env()?, messages, runners)
///     .runner_health(Arc::new(health))
///     .start()
///     .await?;
/// # sharding.shutdown().await;
/// # Ok(())
/// # }
/// ```
pub struct KubernetesRunnerHealth {
    endpoint: Endpoint,
    token: KubernetesToken,
    request_timeout: Duration,
    cache_ttl: Duration,
    max_body_bytes: usize,
    /// The last list, or failure to list, and when it ended; held while a list is in flight,
    /// so that concurrent questions share it.
    cache: tokio::sync::Mutex<Option<(Instant, Option<Arc<Pods>>)>>,
}

impl std::fmt::Debug for KubernetesRunnerHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesRunnerHealth")
            .field("authority", &self.endpoint.authority)
            .field("path", &self.endpoint.path)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl KubernetesRunnerHealth {
    /// The check that `options` describe.
    ///
    /// # Errors
    ///
    /// An option is wrong, and the error names it: the URL is not `http` or `https`, an
    /// `https` URL has no CA or a CA that is not PEM, the namespace or the label selector is
    /// not one, the token is not a header value, or a limit is zero.
    pub fn new(options: KubernetesOptions) -> Result<KubernetesRunnerHealth, ConfigError> {
        let KubernetesOptions {
            api_url,
            token,
            ca_pem,
            namespace,
            label_selector,
            request_timeout,
            cache_ttl,
            max_body_bytes,
        } = options;
        let mut endpoint = Endpoint::parse(&api_url)
            .map_err(|reason| ConfigError::new("api_url", &api_url, reason))?;
        if endpoint.https {
            let Some(pem) = ca_pem else {
                return Err(ConfigError::new(
                    "ca_pem",
                    "",
                    "an https API URL needs the CA certificate of the API server",
                ));
            };
            endpoint.tls = Some(tls_connector(&pem)?);
        }
        if let Some(namespace) = &namespace {
            check_namespace(namespace)
                .map_err(|reason| ConfigError::new("namespace", namespace, reason))?;
        }
        if let Some(selector) = &label_selector {
            check_label_selector(selector)
                .map_err(|reason| ConfigError::new("label_selector", selector, reason))?;
        }
        if let KubernetesToken::Static(token) = &token
            && !is_header_token(token)
        {
            return Err(ConfigError::new("token", "<redacted>", "is not a bearer token"));
        }
        if request_timeout.is_zero() {
            return Err(ConfigError::new("request_timeout", "0", "must be greater than 0"));
        }
        if max_body_bytes == 0 {
            return Err(ConfigError::new("max_body_bytes", "0", "must be greater than 0"));
        }
        endpoint.path = pods_path(&endpoint.path, namespace.as_deref(), label_selector.as_deref());
        Ok(KubernetesRunnerHealth {
            endpoint,
            token,
            request_timeout,
            cache_ttl,
            max_body_bytes,
            cache: tokio::sync::Mutex::new(None),
        })
    }

    /// The pods by IP, listed or reused; `None` when they could not be listed.
    async fn pods(&self) -> Option<Arc<Pods>> {
        let mut cache = self.cache.lock().await;
        if let Some((at, pods)) = &*cache
            && at.elapsed() < self.cache_ttl
        {
            return pods.clone();
        }
        let listed = match tokio::time::timeout(self.request_timeout, self.list()).await {
            Ok(Ok(pods)) => {
                tracing::debug!(pods = pods.len(), "listed the pods from the Kubernetes API");
                Some(Arc::new(pods))
            }
            Ok(Err(error)) => {
                tracing::warn!(
                    %error,
                    "could not list the pods from the Kubernetes API; every runner counts as alive"
                );
                None
            }
            Err(_) => {
                tracing::warn!(
                    timeout = ?self.request_timeout,
                    "the Kubernetes API did not list the pods in time; every runner counts as alive"
                );
                None
            }
        };
        *cache = Some((Instant::now(), listed.clone()));
        listed
    }

    /// One list of the running pods.
    async fn list(&self) -> Result<Pods, ListError> {
        let token = match &self.token {
            KubernetesToken::None => None,
            KubernetesToken::Static(token) => Some(token.clone()),
            KubernetesToken::File(path) => {
                let read = tokio::fs::read_to_string(path).await;
                let token = read.map_err(|error| ListError::Token(path.clone(), error))?;
                Some(token.trim().to_owned())
            }
        };
        let body = self.endpoint.get(token.as_deref(), self.max_body_bytes).await?;
        parse_pods(&body)
    }
}

impl RunnerHealth for KubernetesRunnerHealth {
    fn is_alive<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let host = address.host();
            let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
            let Ok(ip) = host.parse::<IpAddr>() else {
                tracing::warn!(
                    runner = %address,
                    "the runner's host is not an IP address, so no pod is found by it; it counts \
                     as alive (advertise the pod IP: HOST from status.podIP)"
                );
                return true;
            };
            match self.pods().await {
                Some(pods) => pods.get(&ip).copied().unwrap_or(false),
                None => true,
            }
        })
    }
}

/// Whether each pod IP's pod is ready or still starting.
type Pods = BTreeMap<IpAddr, bool>;

/// Why the pods could not be listed.
#[derive(Debug, thiserror::Error)]
enum ListError {
    #[error("cannot read the token file {path}: {source}", path = .0.display(), source = .1)]
    Token(PathBuf, #[source] std::io::Error),
    #[error("cannot connect to {0}: {1}")]
    Connect(String, #[source] std::io::Error),
    #[error("TLS with {0}: {1}")]
    Tls(String, #[source] std::io::Error),
    #[error("the request cannot be built (is the token a header value?): {0}")]
    Request(#[from] hyper::http::Error),
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("the pod list is larger than {0} bytes (max_body_bytes)")]
    TooLarge(usize),
    #[error("reading the answer: {0}")]
    Body(String),
    #[error("the API answered {status}: {message}")]
    Status { status: StatusCode, message: String },
    #[error("the answer is not a pod list: {0}")]
    Json(#[from] serde_json::Error),
}

/// The API server: where to connect, and the request to send.
struct Endpoint {
    https: bool,
    tls: Option<TlsConnector>,
    /// The host to connect to, without brackets.
    host: String,
    port: u16,
    /// The `Host` header.
    authority: String,
    /// The path prefix at parse time; the list's path and query once built.
    path: String,
}

impl Endpoint {
    /// The endpoint of `url` (`http` or `https`, with an optional path prefix).
    fn parse(url: &str) -> Result<Endpoint, &'static str> {
        let uri: Uri = url.parse().map_err(|_| "is not a URL")?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err("is not an http:// or https:// URL"),
        };
        let authority = uri.authority().ok_or("has no host")?;
        if authority.as_str().contains('@') {
            return Err("must not carry credentials: set the token instead");
        }
        if uri.query().is_some() {
            return Err("must not have a query");
        }
        let host = authority.host();
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() {
            return Err("has no host");
        }
        Ok(Endpoint {
            https,
            tls: None,
            host: host.to_owned(),
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            authority: authority.as_str().to_owned(),
            path: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// `GET` of the list: the body of a successful answer, at most `limit` bytes.
    async fn get(&self, token: Option<&str>, limit: usize) -> Result<Bytes, ListError> {
        let target = format!("{}:{}", self.host, self.port);
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|error| ListError::Connect(target.clone(), error))?;
        // Best effort: one small request.
        let _ = tcp.set_nodelay(true);
        if !self.https {
            return self.exchange(TokioIo::new(tcp), token, limit).await;
        }
        let Some(connector) = &self.tls else {
            return Err(ListError::Tls(target, std::io::Error::other("no TLS configuration")));
        };
        let name = ServerName::try_from(self.host.clone())
            .map_err(|error| ListError::Tls(target.clone(), std::io::Error::other(error)))?;
        let tls =
            connector.connect(name, tcp).await.map_err(|error| ListError::Tls(target, error))?;
        self.exchange(TokioIo::new(tls), token, limit).await
    }

    /// The request and its answer on one HTTP/1 connection over `io`, which ends with them.
    async fn exchange<I>(
        &self,
        io: I,
        token: Option<&str>,
        limit: usize,
    ) -> Result<Bytes, ListError>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await?;
        let mut request = Request::get(self.path.as_str())
            .header(HOST, self.authority.as_str())
            .header(ACCEPT, "application/json")
            .header(USER_AGENT, "durable-cluster");
        if let Some(token) = token {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Empty::<Bytes>::new())?;
        let exchange = async {
            let response = sender.send_request(request).await?;
            let status = response.status();
            let body =
                Limited::new(response.into_body(), limit).collect().await.map_err(|error| {
                    if error.is::<LengthLimitError>() {
                        ListError::TooLarge(limit)
                    } else {
                        ListError::Body(error.to_string())
                    }
                })?;
            Ok::<_, ListError>((status, body.to_bytes()))
        };
        tokio::pin!(exchange);
        tokio::pin!(connection);
        // The connection is driven here, not on a task of its own: it ends with the exchange,
        // or with the timeout that drops both.
        let (status, body) = tokio::select! {
            biased;
            answered = &mut exchange => answered?,
            closed = &mut connection => {
                closed?;
                exchange.await?
            }
        };
        if !status.is_success() {
            return Err(ListError::Status { status, message: status_message(&body) });
        }
        Ok(body)
    }
}

/// The TLS connector that trusts the CAs of `pem` only.
fn tls_connector(pem: &[u8]) -> Result<TlsConnector, ConfigError> {
    let invalid = |reason: String| ConfigError::new("ca_pem", "", reason);
    let mut roots = RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(pem) {
        let certificate =
            certificate.map_err(|error| invalid(format!("is not PEM certificates: {error}")))?;
        roots
            .add(certificate)
            .map_err(|error| invalid(format!("holds an unusable certificate: {error}")))?;
    }
    if roots.is_empty() {
        return Err(invalid("holds no certificate".to_owned()));
    }
    let provider = Arc::new(crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&version::TLS13, &version::TLS12])
        .map_err(|error| invalid(format!("TLS: {error}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

/// Whether `token` can follow `Bearer ` in a header: visible ASCII, not empty.
fn is_header_token(token: &str) -> bool {
    !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic())
}

/// The path and query of the list of running pods, under `prefix`.
fn pods_path(prefix: &str, namespace: Option<&str>, label_selector: Option<&str>) -> String {
    let mut path = match namespace {
        Some(namespace) => format!("{prefix}/api/v1/namespaces/{namespace}/pods"),
        None => format!("{prefix}/api/v1/pods"),
    };
    path.push_str("?fieldSelector=");
    path.push_str(&query_encode("status.phase=Running"));
    if let Some(selector) = label_selector {
        path.push_str("&labelSelector=");
        path.push_str(&query_encode(selector));
    }
    path
}

/// `value` percent-encoded for a query: every byte but the unreserved ones.
fn query_encode(value: &str) -> String {
    let mut encoded = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// The message of an error answer: the `message` of a Kubernetes `Status`, or the start of the
/// body.
fn status_message(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Status {
        message: String,
    }
    let message = match serde_json::from_slice::<Status>(body) {
        Ok(status) => status.message,
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    };
    let message: String = message.chars().take(300).collect();
    if message.is_empty() { "(no message)".to_owned() } else { message }
}

/// The pods of a pod list (`PodList`), by IP: whether each is ready or still starting.
fn parse_pods(body: &[u8]) -> Result<Pods, ListError> {
    let list: PodList = serde_json::from_slice(body)?;
    let mut pods = Pods::new();
    for status in list.items.into_iter().filter_map(|pod| pod.status) {
        let alive = ready_or_initializing(status.conditions.as_deref().unwrap_or_default());
        let ips = status
            .pod_ip
            .into_iter()
            .chain(status.pod_ips.into_iter().flatten().filter_map(|ip| ip.ip));
        for ip in ips.filter_map(|ip| ip.parse::<IpAddr>().ok()) {
            // Pods sharing an IP (host network): alive if any is.
            *pods.entry(ip).or_insert(false) |= alive;
        }
    }
    Ok(pods)
}

/// Whether a pod with `conditions` is ready, or still starting: the reference's
/// `Pod.isReadyOrInitializing`.
///
/// - Not initialized yet: starting.
/// - Ready: ready.
/// - Initialized and not ready: still starting if it became not ready when it became
///   initialized (the same transition time, both unknown included), and so was never ready
///   since; dead otherwise.
///   A pod with neither condition counts as starting.
fn ready_or_initializing(conditions: &[Condition]) -> bool {
    // `None`: the condition is absent; `Some(None)`: present, without a transition time.
    let mut initialized_at: Option<Option<&str>> = None;
    let mut ready_at: Option<Option<&str>> = None;
    for condition in conditions {
        match condition.kind.as_str() {
            "Initialized" => {
                if condition.status != "True" {
                    return true;
                }
                initialized_at = Some(condition.last_transition_time.as_deref());
            }
            "Ready" => {
                if condition.status == "True" {
                    return true;
                }
                ready_at = Some(condition.last_transition_time.as_deref());
            }
            _ => {}
        }
    }
    initialized_at == ready_at
}

/// The parts of a `PodList` read here; the rest is ignored.
#[derive(Deserialize)]
struct PodList {
    items: Vec<Pod>,
}

#[derive(Deserialize)]
struct Pod {
    #[serde(default)]
    status: Option<PodStatus>,
}

#[derive(Deserialize)]
struct PodStatus {
    #[serde(default, rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(default, rename = "podIPs")]
    pod_ips: Option<Vec<PodIp>>,
    #[serde(default)]
    conditions: Option<Vec<Condition>>,
}

#[derive(Deserialize)]
struct PodIp {
    #[serde(default)]
    ip: Option<String>,
}

#[derive(Deserialize)]
struct Condition {
    #[serde(rename = "type")]
    kind: String,
    status: String,
    #[serde(default, rename = "lastTransitionTime")]
    last_transition_time: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn condition(kind: &str, status: &str, at: Option<&str>) -> Condition {
        Condition {
            kind: kind.to_owned(),
            status: status.to_owned(),
            last_transition_time: at.map(str::to_owned),
        }
    }

    #[test]
    fn readiness_follows_the_references_pod_conditions() {
        let t1 = Some("2026-01-01T00:00:00Z");
        let t2 = Some("2026-01-01T00:05:00Z");
        let cases = [
            (
                "ready",
                vec![condition("Initialized", "True", t1), condition("Ready", "True", t2)],
                true,
            ),
            (
                "initializing",
                vec![condition("Initialized", "False", t1), condition("Ready", "False", t1)],
                true,
            ),
            (
                "booting",
                vec![condition("Initialized", "True", t1), condition("Ready", "False", t1)],
                true,
            ),
            (
                "was ready",
                vec![condition("Initialized", "True", t1), condition("Ready", "False", t2)],
                false,
            ),
            // The reference's K8sHttpClient test: both transition times null.
            (
                "null times",
                vec![condition("Initialized", "True", None), condition("Ready", "False", None)],
                true,
            ),
            ("no ready condition", vec![condition("Initialized", "True", t1)], false),
            ("no initialized condition", vec![condition("Ready", "False", t1)], false),
            ("no conditions", vec![], true),
            ("other conditions only", vec![condition("PodScheduled", "True", t1)], true),
        ];
        for (name, conditions, expected) in cases {
            assert_eq!(ready_or_initializing(&conditions), expected, "{name}");
        }
    }

    #[test]
    fn the_pods_are_found_by_every_ip_and_odd_pods_are_skipped() {
        let body = br#"{"items": [
            {"status": {"podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}],
                        "conditions": [
                            {"type": "Ready", "status": "True", "lastTransitionTime": null}
                        ]}},
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            {"metadata": {"name": "no-status"}},
            {"status": {"podIP": "not-an-ip", "conditions": null}}
        ]}"#;
        let pods = parse_pods(body).unwrap();
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        assert_eq!(pods.get(&ip("10.0.0.1")), Some(&true));
        assert_eq!(pods.get(&ip("fd00::1")), Some(&true));
        assert_eq!(pods.len(), 2);
        for malformed in [
            &b"not json"[..],
            br#"{"items": 3}"#,
            b"{}",
            br#"{"items": [{"status": {"conditions": [{"type": 1}]}}]}"#,
        ] {
            assert!(parse_pods(malformed).is_err(), "{}", String::from_utf8_lossy(malformed));
        }
    }

    #[test]
    fn the_list_path_scopes_and_encodes_the_selectors() {
        assert_eq!(
            pods_path("", Some("runners"), Some("app=cluster-runner,tier in (a,b)")),
            "/api/v1/namespaces/runners/pods?fieldSelector=status.phase%3DRunning\
             &labelSelector=app%3Dcluster-runner%2Ctier%20in%20%28a%2Cb%29"
        );
        assert_eq!(
            pods_path("/proxy", None, None),
            "/proxy/api/v1/pods?fieldSelector=status.phase%3DRunning"
        );
    }

    #[test]
    fn namespaces_and_selectors_are_checked() {
        for good in ["default", "a", "runners-2", &"a".repeat(63)] {
            assert!(check_namespace(good).is_ok(), "{good}");
        }
        for bad in ["", "Default", "-a", "a-", "a_b", "a.b", &"a".repeat(64)] {
            assert!(check_namespace(bad).is_err(), "{bad}");
        }
        for good in ["app=cluster-runner", "app in (a, b),!canary", "example.com/role!=db"] {
            assert!(check_label_selector(good).is_ok(), "{good}");
        }
        for bad in ["", " ", "app: runner", "app=\"x\"", "a=b&c=d"] {
            assert!(check_label_selector(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_in_cluster_url_comes_from_the_service_variables() {
        let lookup = |host: &'static str, port: &'static str| {
            move |name: &str| match name {
                "KUBERNETES_SERVICE_HOST" => Some(host.to_owned()),
                "KUBERNETES_SERVICE_PORT" => Some(port.to_owned()),
                _ => None,
            }
        };
        assert_eq!(
            in_cluster_api_url(lookup("10.96.0.1", "443")).unwrap(),
            "https://10.96.0.1:443"
        );
        assert_eq!(
            in_cluster_api_url(lookup("fd00::1", "6443")).unwrap(),
            "https://[fd00::1]:6443"
        );
        let error = in_cluster_api_url(lookup("10.96.0.1", "https")).unwrap_err();
        assert_eq!(error.key(), "KUBERNETES_SERVICE_PORT");
        let error = in_cluster_api_url(lookup("a/b", "443")).unwrap_err();
        assert_eq!(error.key(), "KUBERNETES_SERVICE_HOST");
        let error = in_cluster_api_url(|_: &str| None).unwrap_err();
        assert_eq!(error.key(), "KUBERNETES_SERVICE_HOST");
    }

    #[test]
    fn the_service_account_gives_the_token_file_the_ca_and_the_namespace() {
        let dir = std::env::temp_dir().join(format!("durable-cluster-sa-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("token"), "t0ken\n").unwrap();
        std::fs::write(dir.join("namespace"), "runners\n").unwrap();
        let options =
            KubernetesOptions::from_service_account("http://127.0.0.1:1".to_owned(), &dir, None)
                .unwrap();
        assert_eq!(options.namespace.as_deref(), Some("runners"));
        assert!(
            matches!(&options.token, KubernetesToken::File(path) if *path == dir.join("token"))
        );
        assert!(options.ca_pem.is_none(), "no CA for http");
        // An https API needs ca.crt.
        let error = KubernetesOptions::from_service_account(
            "https://10.96.0.1:443".to_owned(),
            &dir,
            Some("other".to_owned()),
        )
        .unwrap_err();
        assert!(error.key().ends_with("ca.crt"), "{error}");
        std::fs::write(dir.join("ca.crt"), "not a certificate").unwrap();
        let options = KubernetesOptions::from_service_account(
            "https://10.96.0.1:443".to_owned(),
            &dir,
            Some("other".to_owned()),
        )
        .unwrap();
        assert_eq!(options.namespace.as_deref(), Some("other"));
        let error = KubernetesRunnerHealth::new(options).unwrap_err();
        assert_eq!(error.key(), "ca_pem");
        std::fs::remove_dir_all(&dir).unwrap();
        let error =
            KubernetesOptions::from_service_account("http://127.0.0.1:1".to_owned(), &dir, None)
                .unwrap_err();
        assert!(error.key().ends_with("token"), "{error}");
    }

    #[test]
    fn wrong_options_are_refused_by_name() {
        let refused =
            |options: KubernetesOptions| KubernetesRunnerHealth::new(options).unwrap_err();
        assert_eq!(refused(KubernetesOptions::new("ftp://host")).key(), "api_url");
        assert_eq!(refused(KubernetesOptions::new("http://user:pw@host")).key(), "api_url");
        assert_eq!(refused(KubernetesOptions::new("https://10.96.0.1")).key(), "ca_pem");
        let mut options = KubernetesOptions::new("http://127.0.0.1:1");
        options.namespace = Some("Bad".to_owned());
        assert_eq!(refused(options).key(), "namespace");
        let mut options = KubernetesOptions::new("http://127.0.0.1:1");
        options.label_selector = Some("app: x".to_owned());
        assert_eq!(refused(options).key(), "label_selector");
        let mut options = KubernetesOptions::new("http://127.0.0.1:1");
        options.token = KubernetesToken::Static("two words".to_owned());
        let error = refused(options);
        assert_eq!(error.key(), "token");
        assert!(!error.to_string().contains("two words"), "{error}");
        let mut options = KubernetesOptions::new("http://127.0.0.1:1");
        options.request_timeout = Duration::ZERO;
        assert_eq!(refused(options).key(), "request_timeout");
        let mut options = KubernetesOptions::new("http://127.0.0.1:1");
        options.token = KubernetesToken::Static("secret-token".to_owned());
        let shown = format!("{options:?}");
        assert!(!shown.contains("secret-token"), "{shown}");
    }
}
