//! The operations server of a [`Runner`](crate::Runner) (feature `ops`): probes and metrics
//! over HTTP, on the address in `CLUSTER_OPS_LISTEN` (off when it is unset).
//!
//! | path | answers |
//! | --- | --- |
//! | `GET /healthz` | `200 ok` while the process runs |
//! | `GET /readyz` | `200` when the runner serves what the cluster assigns it, else `503`; a JSON body says why |
//! | `GET /metrics` | every series of the `metrics` facade, in the Prometheus text format |
//!
//! A runner is ready when all of these hold:
//!
//! - it is not shutting down;
//! - it is in the runner registry;
//! - its shard lock storage answers;
//! - it holds every shard the assignment gives it, or has been taking them for less than
//!   twice `SHARD_LOCK_EXPIRATION` (a previous owner's lock may have to expire first).
//!
//! `/metrics` needs the process's global `metrics` recorder.
//! The first operations server installs a Prometheus recorder when it binds, before the runtime
//! starts; if the application installed another recorder first, `/metrics` answers `503` and
//! says so.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use cluster_sharding::Sharding;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::runner::RunnerError;
use crate::server::ServerLimits;

mod series;

/// The admin the operations server serves under `/admin`: the admin and who may use it.
#[cfg(feature = "console")]
pub(crate) type AdminParts = (crate::admin::Admin, crate::admin::web::AdminAccess);

/// Without the feature `console` there is no admin to serve.
#[cfg(not(feature = "console"))]
pub(crate) type AdminParts = std::convert::Infallible;

/// How long a shutdown waits for the operations server's requests in progress.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the Prometheus recorder folds its histograms (its upkeep).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// A bound operations listener, not serving yet ([`OpsListener::serve`]).
#[derive(Debug)]
pub(crate) struct OpsListener {
    listener: tokio::net::TcpListener,
    local_addr: SocketAddr,
    limits: ServerLimits,
}

/// A running operations server; [`OpsServer::shutdown`] stops it.
#[derive(Debug)]
pub(crate) struct OpsServer {
    local_addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl OpsListener {
    /// Binds `listen`.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Ops`] names `CLUSTER_OPS_LISTEN` and the address, for instance when the
    /// port is in use.
    pub(crate) async fn bind(
        listen: SocketAddr,
        limits: ServerLimits,
    ) -> Result<OpsListener, RunnerError> {
        // Before the runtime starts: a series set once while it starts (such as
        // `effect_cluster_runners`) would be lost to a recorder installed later.
        let _ = prometheus();
        let bound = async {
            let listener = tokio::net::TcpListener::bind(listen).await?;
            let local_addr = listener.local_addr()?;
            Ok::<_, std::io::Error>(OpsListener { listener, local_addr, limits })
        };
        bound.await.map_err(|source| RunnerError::Ops { address: listen, source })
    }

    /// Serves the probes of `sharding` and the metrics until [`OpsServer::shutdown`], and the
    /// admin under `/admin` when given (feature `console`).
    pub(crate) fn serve(self, sharding: Sharding, admin: Option<AdminParts>) -> OpsServer {
        let expiration = sharding.config().shard_lock_expiration;
        #[cfg(feature = "console")]
        let sharding_for_admin = sharding.clone();
        let readiness = Arc::new(ReadinessCheck {
            sharding,
            acquire_bound: expiration.saturating_mul(2),
            not_acquired_since: Mutex::new(None),
        });
        let stop = CancellationToken::new();
        let router = Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(move || ready(Arc::clone(&readiness))))
            .route("/metrics", get(render_metrics));
        #[cfg(feature = "console")]
        let router = match admin {
            Some((admin, access)) => {
                let web =
                    crate::admin::web::router(admin, access, sharding_for_admin, stop.clone());
                router.nest("/admin", web)
            }
            None => router,
        };
        #[cfg(not(feature = "console"))]
        let () = admin.map_or((), |never| match never {});
        let stopped = stop.clone();
        let local_addr = self.local_addr;
        let task = tokio::spawn(async move {
            let upkeep = async {
                let mut interval = tokio::time::interval(UPKEEP_INTERVAL);
                loop {
                    interval.tick().await;
                    if let Some(exported) = prometheus() {
                        exported.prometheus.run_upkeep();
                    }
                }
            };
            let served =
                crate::server::serve(self.listener, router, self.limits, stopped.cancelled_owned());
            tokio::select! {
                () = served => {}
                () = upkeep => {}
            }
        });
        tracing::info!(%local_addr, "operations server listening");
        OpsServer { local_addr, stop, task }
    }
}

impl OpsServer {
    /// The bound address (with the actual port when bound to port 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting requests and waits for those in progress, at most
    /// [`SHUTDOWN_TIMEOUT`]: a client that keeps a request open does not hold the runner's
    /// exit.
    pub(crate) async fn shutdown(mut self) {
        self.stop.cancel();
        match tokio::time::timeout(SHUTDOWN_TIMEOUT, &mut self.task).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::debug!(%error, "the operations server's task ended abnormally")
            }
            // Dropped here, the server's task is aborted.
            Err(_) => tracing::debug!("the operations server's requests outlived the shutdown"),
        }
    }
}

/// A runner dropped without its shutdown stops its operations server too.
impl Drop for OpsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The readiness rule of the module documentation, with the time the runner has been taking
/// its shards.
struct ReadinessCheck {
    sharding: Sharding,
    acquire_bound: Duration,
    not_acquired_since: Mutex<Option<cluster_core::Timestamp>>,
}

impl ReadinessCheck {
    /// Why the runner is not ready, if it is not.
    fn not_ready(&self) -> (Option<String>, cluster_sharding::Readiness) {
        let readiness = self.sharding.readiness();
        let reason = if self.sharding.is_shutdown() {
            Some("shutting down".to_owned())
        } else if !readiness.registered {
            Some("not registered in the runner registry".to_owned())
        } else if !readiness.lock_storage_healthy {
            Some("the shard lock storage does not answer".to_owned())
        } else {
            self.taking_too_long(&readiness)
        };
        (reason, readiness)
    }

    /// Whether the runner has been taking its assigned shards for longer than the bound.
    fn taking_too_long(&self, readiness: &cluster_sharding::Readiness) -> Option<String> {
        let mut since = cluster_core::sync::lock(&self.not_acquired_since);
        if readiness.not_acquired == 0 {
            *since = None;
            return None;
        }
        let now = self.sharding.clock().now();
        let waited = now.saturating_duration_since(*since.get_or_insert(now));
        (waited > self.acquire_bound).then(|| {
            format!(
                "{} of {} assigned shards not acquired for {} s",
                readiness.not_acquired,
                readiness.assigned,
                waited.as_secs()
            )
        })
    }
}

/// `GET /readyz`.
async fn ready(check: Arc<ReadinessCheck>) -> impl IntoResponse {
    let (reason, readiness) = check.not_ready();
    let status = if reason.is_some() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    let body = serde_json::json!({
        "ready": reason.is_none(),
        "reason": reason,
        "registered": readiness.registered,
        "lock_storage_healthy": readiness.lock_storage_healthy,
        "assigned_shards": readiness.assigned,
        "not_acquired_shards": readiness.not_acquired,
        "unserved_shards": readiness.unserved,
    });
    (status, [("content-type", "application/json")], format!("{body}\n"))
}

/// `GET /metrics`.
async fn render_metrics() -> impl IntoResponse {
    match prometheus() {
        Some(exported) => {
            let mut body = exported.prometheus.render();
            exported.entities.render(&mut body);
            (StatusCode::OK, [("content-type", "text/plain; version=0.0.4")], body)
        }
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            [("content-type", "text/plain")],
            "another metrics recorder is installed in this process\n".to_owned(),
        ),
    }
}

/// Bucket bounds of the histograms in seconds: from half a millisecond (a cached lock
/// confirmation, a fast handler) to half a minute (a stuck statement).
const SECONDS_BUCKETS: [f64; 14] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0];
/// Bucket bounds of the reference's shard release histogram, in milliseconds.
const MILLISECONDS_BUCKETS: [f64; 9] =
    [10.0, 50.0, 100.0, 500.0, 1_000.0, 5_000.0, 15_000.0, 30_000.0, 60_000.0];

/// The recorder's histograms: Prometheus histograms with buckets (which add up across
/// runners), not summaries.
fn histograms(builder: PrometheusBuilder) -> PrometheusBuilder {
    use metrics_exporter_prometheus::Matcher;
    let seconds = Matcher::Suffix("_seconds".to_owned());
    let milliseconds = Matcher::Full(cluster_sharding::metrics::SHARD_RELEASE.to_owned());
    // Neither list is empty, the only error `set_buckets_for_metric` reports.
    let configured = builder
        .set_buckets_for_metric(seconds, &SECONDS_BUCKETS)
        .and_then(|builder| builder.set_buckets_for_metric(milliseconds, &MILLISECONDS_BUCKETS));
    configured.unwrap_or_else(|_| PrometheusBuilder::new())
}

/// What `/metrics` renders: the Prometheus recorder's series, then the per-entity series that
/// leave with their entities (see `series`).
struct Exported {
    prometheus: PrometheusHandle,
    entities: Arc<series::EntitySeries>,
}

/// The process's recorder, installed by the first call; `None` when another recorder was
/// installed first.
fn prometheus() -> Option<&'static Exported> {
    static EXPORTED: OnceLock<Option<Exported>> = OnceLock::new();
    EXPORTED
        .get_or_init(|| {
            let prometheus = histograms(PrometheusBuilder::new()).build_recorder();
            let handle = prometheus.handle();
            let entities = Arc::new(series::EntitySeries::default());
            let recorder = series::SplitRecorder { prometheus, entities: Arc::clone(&entities) };
            metrics::set_global_recorder(recorder)
                .ok()
                .map(|()| Exported { prometheus: handle, entities })
        })
        .as_ref()
}

/// Installs the process's logger: `tracing` events to standard error, filtered by `RUST_LOG`
/// (default `info`), as text or, with `CLUSTER_LOG_FORMAT=json`, as JSON lines; with the
/// feature `otel` and an OTLP endpoint, spans are also exported (see [`crate::otel`]).
/// Text has colours only when standard error is a terminal and `NO_COLOR` is unset or empty,
/// so that logs written to a file or a pipe hold no escape codes.
/// A logger installed before stays.
///
/// # Errors
///
/// `RUST_LOG` or `CLUSTER_OTEL_FILTER` is not a filter, `CLUSTER_LOG_FORMAT` is neither `text`
/// nor `json`, or the OTLP exporter cannot be built; the error names the variable.
pub(crate) fn init_logging() -> Result<(), cluster_core::ConfigError> {
    use std::io::IsTerminal as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let lookup = |name: &str| std::env::var(name).ok();
    let settings = logging_settings(lookup, std::io::stderr().is_terminal())?;
    let logs = log_layer(settings, std::io::stderr);
    #[cfg(feature = "otel")]
    let layers: Vec<BoxedLayer> =
        std::iter::once(logs).chain(crate::otel::layer_from_env(lookup)?).collect();
    #[cfg(not(feature = "otel"))]
    let layers: Vec<BoxedLayer> = vec![logs];
    // Another logger may be installed already (tests, an application's own): it stays.
    let _ = tracing_subscriber::registry().with(layers).try_init();
    #[cfg(not(feature = "otel"))]
    if lookup("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
        tracing::warn!(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set, but this binary was built without the feature `otel`: no spans are exported"
        );
    }
    Ok(())
}

/// A layer of the process's subscriber.
type BoxedLayer = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// How the logs are written: which events, JSON or text, and whether text has colours.
struct LogSettings {
    filter: tracing_subscriber::EnvFilter,
    json: bool,
    ansi: bool,
}

/// The log layer of `settings`, writing to `writer`.
fn log_layer<W>(settings: LogSettings, writer: W) -> BoxedLayer
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::Layer as _;
    let LogSettings { filter, json, ansi } = settings;
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer);
    if json {
        Box::new(fmt.json().with_filter(filter))
    } else {
        Box::new(fmt.with_ansi(ansi).with_filter(filter))
    }
}

/// The log settings from `RUST_LOG`, `CLUSTER_LOG_FORMAT` and `NO_COLOR` in `lookup`, for a
/// standard error that is a terminal or not.
fn logging_settings(
    lookup: impl Fn(&str) -> Option<String>,
    stderr_is_terminal: bool,
) -> Result<LogSettings, cluster_core::ConfigError> {
    use tracing_subscriber::EnvFilter;
    let filter = match lookup("RUST_LOG") {
        Some(value) if !value.trim().is_empty() => EnvFilter::try_new(&value).map_err(|error| {
            cluster_core::ConfigError::new("RUST_LOG", &value, error.to_string())
        })?,
        _ => EnvFilter::new("info"),
    };
    let json = match lookup("CLUSTER_LOG_FORMAT") {
        None => false,
        Some(value) => match value.trim() {
            "" | "text" => false,
            "json" => true,
            _ => {
                return Err(cluster_core::ConfigError::new(
                    "CLUSTER_LOG_FORMAT",
                    &value,
                    "must be text or json",
                ));
            }
        },
    };
    // https://no-color.org: a non-empty `NO_COLOR` turns colours off.
    let no_color = lookup("NO_COLOR").is_some_and(|value| !value.is_empty());
    Ok(LogSettings { filter, json, ansi: stderr_is_terminal && !no_color })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::{LogSettings, log_layer, logging_settings};

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> =
            vars.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect();
        move |name: &str| vars.iter().find(|(var, _)| var == name).map(|(_, value)| value.clone())
    }

    fn settings(vars: &[(&str, &str)]) -> Result<bool, (String, String)> {
        logging_settings(lookup(vars), false)
            .map(|settings| settings.json)
            .map_err(|error| (error.key().to_owned(), error.value().to_owned()))
    }

    #[test]
    fn the_log_settings_are_read_strictly() {
        assert_eq!(settings(&[]), Ok(false));
        assert_eq!(settings(&[("CLUSTER_LOG_FORMAT", "json"), ("RUST_LOG", "debug")]), Ok(true));
        assert_eq!(settings(&[("CLUSTER_LOG_FORMAT", "text")]), Ok(false));
        let wrong = ("CLUSTER_LOG_FORMAT".to_owned(), "xml".to_owned());
        assert_eq!(settings(&[("CLUSTER_LOG_FORMAT", "xml")]), Err(wrong));
        let filter = settings(&[("RUST_LOG", "cluster=loud")]);
        assert_eq!(filter.map_err(|(key, _)| key), Err("RUST_LOG".to_owned()));
    }

    /// What a log layer wrote, as a writer for it.
    #[derive(Clone, Default)]
    struct Written(Arc<Mutex<Vec<u8>>>);

    impl Written {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    impl std::io::Write for Written {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Written {
        type Writer = Written;

        fn make_writer(&'w self) -> Written {
            self.clone()
        }
    }

    /// What `log` writes through the layer of `settings`.
    fn logged(settings: LogSettings, log: impl FnOnce()) -> String {
        use tracing_subscriber::layer::SubscriberExt as _;
        let written = Written::default();
        let subscriber = tracing_subscriber::registry().with(log_layer(settings, written.clone()));
        tracing::subscriber::with_default(subscriber, log);
        written.text()
    }

    /// Text written where standard error is no terminal (a file, a pipe) has no colours, and
    /// `NO_COLOR` turns them off on a terminal too.
    #[test]
    fn text_logs_have_colours_only_on_a_terminal_without_no_color() {
        let to_file = logging_settings(lookup(&[]), false).unwrap();
        let text = logged(to_file, || tracing::info!(runner = "r1", "runner started"));
        assert!(text.contains("runner started"), "{text}");
        assert!(!text.contains('\u{1b}'), "escape codes in a file: {text:?}");
        let on_terminal = logging_settings(lookup(&[]), true).unwrap();
        assert!(on_terminal.ansi);
        let no_color = logging_settings(lookup(&[("NO_COLOR", "1")]), true).unwrap();
        assert!(!no_color.ansi);
        let empty = logging_settings(lookup(&[("NO_COLOR", "")]), true).unwrap();
        assert!(empty.ansi, "an empty NO_COLOR is unset");
    }

    /// The `runner started` event shows its addresses as text (`127.0.0.1:5000`), not as their
    /// `Debug` form.
    #[test]
    fn the_runner_started_event_shows_addresses_as_text() {
        let json = logging_settings(lookup(&[("CLUSTER_LOG_FORMAT", "json")]), false).unwrap();
        let address = cluster_core::RunnerAddress::new("127.0.0.1", 5000);
        let listen = std::net::SocketAddr::from(([0, 0, 0, 0], 5000));
        let line = logged(json, || crate::runner::log_started(Some(&address), listen));
        let event: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(event["fields"]["address"], "127.0.0.1:5000", "{line}");
        assert_eq!(event["fields"]["listen"], "0.0.0.0:5000", "{line}");
    }
}
