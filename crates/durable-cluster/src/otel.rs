//! OpenTelemetry traces (feature `otel`): spans exported over OTLP, and the trace context that
//! requests carry across processes.
//!
//! - [`OtelPropagator`] reads the current span's OpenTelemetry context into a request's
//!   `trace_id`, `span_id` and `sampled` (the reference's envelope fields, stored in the message
//!   table and carried by the transport), and makes a handler's `request` span a child of it on
//!   the runner that runs the request. [`install_propagator`] installs it for the process.
//! - [`Runner::main`](crate::Runner::main) exports spans when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, over OTLP/HTTP with protobuf; the
//!   exporter's standard `OTEL_*` variables apply, and `OTEL_SERVICE_NAME` names the service
//!   (default `durable-cluster`).
//!
//! An application with a subscriber of its own adds `tracing_opentelemetry::layer()` to it and
//! calls [`install_propagator`].

use std::sync::{Arc, Mutex, OnceLock};

use cluster_core::envelope::TraceContext;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The propagator of trace contexts between the `tracing` spans of this process (bridged to
/// OpenTelemetry by `tracing_opentelemetry`'s layer) and the requests it sends and runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct OtelPropagator;

impl cluster_sharding::trace::TracePropagator for OtelPropagator {
    fn context(&self, span: &tracing::Span) -> TraceContext {
        let context = span.context();
        let span = context.span();
        let span = span.span_context();
        if !span.is_valid() {
            return TraceContext::default();
        }
        TraceContext {
            trace_id: Some(span.trace_id().to_string()),
            span_id: Some(span.span_id().to_string()),
            sampled: Some(span.is_sampled()),
        }
    }

    fn set_parent(&self, span: &tracing::Span, trace: &TraceContext) {
        let Some(parent) = remote_parent(trace) else { return };
        let context = opentelemetry::Context::new().with_remote_span_context(parent);
        // Fails only when the span is disabled or has no OpenTelemetry layer: nothing to link.
        let _ = span.set_parent(context);
    }
}

/// The span a request was sent from, as a remote parent; `None` when the ids are missing or
/// are not the W3C forms (32 and 16 lowercase hex digits, not all zero).
fn remote_parent(trace: &TraceContext) -> Option<SpanContext> {
    let hex = |id: &str, digits: usize| {
        (id.len() == digits && id.bytes().all(|byte| byte.is_ascii_hexdigit())).then_some(())
    };
    let trace_id = trace.trace_id.as_deref()?;
    let span_id = trace.span_id.as_deref()?;
    hex(trace_id, 32)?;
    hex(span_id, 16)?;
    let trace_id = TraceId::from_hex(trace_id).ok()?;
    let span_id = SpanId::from_hex(span_id).ok()?;
    let flags =
        if trace.sampled.unwrap_or(true) { TraceFlags::SAMPLED } else { TraceFlags::default() };
    let parent = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
    parent.is_valid().then_some(parent)
}

/// Installs [`OtelPropagator`] as the process's trace propagator; `false` when another one was
/// installed first (it stays).
pub fn install_propagator() -> bool {
    cluster_sharding::trace::set_propagator(Box::new(OtelPropagator)).is_ok()
}

/// The tracer provider `Runner::main` installed, flushed at its end.
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// The OpenTelemetry layer of `Runner::main`'s subscriber when an OTLP endpoint is configured:
/// spans exported in batches over OTLP/HTTP, selected by `CLUSTER_OTEL_FILTER` (default: `info`
/// everywhere, and the runtime's and the storages' `debug` spans, among them each handler's
/// `request` span and each storage operation). It also installs the propagator.
///
/// # Errors
///
/// A filter that does not parse, or an exporter that cannot be built, names its variable.
pub(crate) fn layer_from_env<S>(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<Box<dyn tracing_subscriber::Layer<S> + Send + Sync>>, cluster_core::ConfigError>
where
    S: tracing::Subscriber
        + for<'span> tracing_subscriber::registry::LookupSpan<'span>
        + Send
        + Sync
        + 'static,
{
    use tracing_subscriber::Layer as _;
    let endpoint =
        ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"].into_iter().find_map(
            |name| lookup(name).filter(|value| !value.trim().is_empty()).map(|value| (name, value)),
        );
    let Some((variable, endpoint)) = endpoint else { return Ok(None) };
    let filter = match lookup("CLUSTER_OTEL_FILTER") {
        Some(value) if !value.trim().is_empty() => tracing_subscriber::EnvFilter::try_new(&value)
            .map_err(|error| {
            cluster_core::ConfigError::new("CLUSTER_OTEL_FILTER", &value, error.to_string())
        })?,
        _ => tracing_subscriber::EnvFilter::new(DEFAULT_FILTER),
    };
    // The per-signal variable is the traces endpoint itself; the general one is a base that
    // `/v1/traces` is appended to (the OTLP exporter specification).
    let traces = if variable == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" {
        endpoint.trim().to_owned()
    } else {
        format!("{}/v1/traces", endpoint.trim().trim_end_matches('/'))
    };
    let provider = exporting_provider(traces, lookup("OTEL_SERVICE_NAME"))
        .map_err(|error| cluster_core::ConfigError::new(variable, &endpoint, error))?;
    let tracer = provider.tracer("durable-cluster");
    let _ = PROVIDER.set(provider);
    install_propagator();
    let layer = tracing_opentelemetry::layer().with_tracer(tracer).with_filter(filter);
    Ok(Some(Box::new(layer)))
}

/// What the OpenTelemetry layer exports without `CLUSTER_OTEL_FILTER`.
const DEFAULT_FILTER: &str = "info,cluster_sharding=debug,cluster_storage_sql=debug";

/// A tracer provider exporting in batches over OTLP/HTTP (protobuf) to `endpoint`, its other
/// options from the standard `OTEL_EXPORTER_OTLP_*` variables.
fn exporting_provider(
    endpoint: String,
    service: Option<String>,
) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| "the OTLP exporter needs a Tokio runtime".to_owned())?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .with_http_client(OnRuntime::new(runtime))
        .build()
        .map_err(|error| error.to_string())?;
    let service = service.filter(|name| !name.trim().is_empty());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.unwrap_or_else(|| "durable-cluster".to_owned()))
        .build();
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
}

/// Flushes and stops the exporter `Runner::main` installed, if any; spans still buffered are
/// sent (bounded by the exporter's timeout). The flush blocks a thread of the blocking pool, not
/// the runtime, whose tasks carry the export.
pub(crate) async fn shutdown() {
    let Some(provider) = PROVIDER.get() else { return };
    let flushed = tokio::task::spawn_blocking(|| provider.shutdown()).await;
    match flushed {
        Ok(Ok(())) => {}
        // Spans were lost at exit; there is no one left to tell but the log.
        Ok(Err(error)) => tracing::warn!(%error, "could not flush the OpenTelemetry exporter"),
        Err(error) => tracing::warn!(%error, "could not flush the OpenTelemetry exporter"),
    }
}

/// The OTLP exporter's HTTP client: the batch processor exports from a thread of its own,
/// outside the Tokio runtime that hyper needs, so each request runs as a task on the runtime
/// the exporter was built on.
#[derive(Clone, Debug)]
struct OnRuntime {
    client: opentelemetry_http::hyper::HyperClient,
    runtime: tokio::runtime::Handle,
    /// The last export failure reported, so that a collector that is down logs once per
    /// failure kind, not once per batch.
    reported: Arc<Mutex<Option<String>>>,
}

/// How long one export may take.
const EXPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl OnRuntime {
    fn new(runtime: tokio::runtime::Handle) -> OnRuntime {
        let client =
            opentelemetry_http::hyper::HyperClient::with_default_connector(EXPORT_TIMEOUT, None);
        OnRuntime { client, runtime, reported: Arc::default() }
    }
}

impl opentelemetry_http::HttpClient for OnRuntime {
    fn send_bytes<'life0, 'async_trait>(
        &'life0 self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> std::pin::Pin<
        Box<
            dyn Future<
                    Output = Result<
                        opentelemetry_http::Response<opentelemetry_http::Bytes>,
                        opentelemetry_http::HttpError,
                    >,
                > + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        let client = self.client.clone();
        let reported = Arc::clone(&self.reported);
        let task = self.runtime.spawn(async move { client.send_bytes(request).await });
        Box::pin(async move {
            let sent =
                task.await.map_err(|error| Box::new(error) as opentelemetry_http::HttpError)?;
            let mut last = cluster_core::sync::lock(&reported);
            match &sent {
                Ok(_) => *last = None,
                Err(error) => {
                    let message = error.to_string();
                    if last.as_deref() != Some(message.as_str()) {
                        tracing::warn!(target: "durable_cluster::otel", error = %message, "could not export spans");
                        *last = Some(message);
                    }
                }
            }
            sent
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_w3c_ids_become_a_parent() {
        let trace = |trace_id: &str, span_id: &str| TraceContext {
            trace_id: Some(trace_id.to_owned()),
            span_id: Some(span_id.to_owned()),
            sampled: Some(true),
        };
        let parent = remote_parent(&trace("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"));
        let parent = parent.expect("a valid parent");
        assert_eq!(parent.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parent.span_id().to_string(), "00f067aa0ba902b7");
        assert!(parent.is_remote() && parent.is_sampled());
        // All zero, too short, not hex, missing: no parent.
        assert!(
            remote_parent(&trace("00000000000000000000000000000000", "00f067aa0ba902b7")).is_none()
        );
        assert!(remote_parent(&trace("4bf92f", "00f067aa0ba902b7")).is_none());
        assert!(
            remote_parent(&trace("not hex at all, not hex at all!!", "00f067aa0ba902b7")).is_none()
        );
        assert!(remote_parent(&TraceContext::default()).is_none());
        let unsampled = TraceContext {
            sampled: Some(false),
            ..trace("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
        };
        assert!(!remote_parent(&unsampled).unwrap().is_sampled());
    }

    /// A span goes to a collector (an HTTP server of the test's own) as one OTLP/HTTP protobuf
    /// request to `/v1/traces`, with the service name, once the exporter is flushed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn spans_go_to_the_collector_over_otlp_http() {
        use tracing_subscriber::layer::SubscriberExt as _;
        type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;
        let received = Received::default();
        let kept = Arc::clone(&received);
        let collector = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let kind = headers
                    .get("content-type")
                    .and_then(|value| value.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                cluster_core::sync::lock(&kept).push((kind, body.to_vec()));
                async { axum::http::StatusCode::OK }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, collector).await });
        let endpoint = format!("http://{address}/");
        let layer = layer_from_env::<tracing_subscriber::Registry>(|name| match name {
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some(endpoint.clone()),
            "OTEL_SERVICE_NAME" => Some("otel-unit-test".to_owned()),
            _ => None,
        });
        let layer = layer.unwrap().expect("an endpoint gives a layer");
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
            let span = tracing::info_span!("exported-span");
            let _entered = span.enter();
        });
        shutdown().await;
        let received = cluster_core::sync::lock(&received).clone();
        assert_eq!(received.len(), 1, "one export");
        let (kind, body) = &received[0];
        assert_eq!(kind, "application/x-protobuf");
        let contains = |needle: &[u8]| body.windows(needle.len()).any(|window| window == needle);
        assert!(contains(b"exported-span"), "the span's name is in the export");
        assert!(contains(b"otel-unit-test"), "the service name is in the export");
        server.abort();
    }

    #[test]
    fn no_endpoint_no_layer_and_a_bad_filter_names_its_variable() {
        let none = layer_from_env::<tracing_subscriber::Registry>(|_| None).unwrap();
        assert!(none.is_none());
        let bad = layer_from_env::<tracing_subscriber::Registry>(|name| match name {
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some("http://127.0.0.1:4318".to_owned()),
            "CLUSTER_OTEL_FILTER" => Some("info,=[".to_owned()),
            _ => None,
        });
        let error = bad.err().expect("a bad filter is refused");
        assert!(error.to_string().contains("CLUSTER_OTEL_FILTER"), "{error}");
    }
}
