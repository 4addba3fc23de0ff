//! Trace context across the transport and the message table (feature `otel`): a client-only
//! process calls a runner over real TCP, on SQLite, and the handler's `request` span on the
//! runner continues the caller's trace. Spans are collected by an in-memory exporter.
//!
//! The subscriber and the propagator are global to the process: this file is a test binary of
//! its own, with one test.
#![cfg(all(feature = "otel", feature = "sqlite"))]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use durable_cluster::{
    Entity, EntityContext, Never, Protocol, RequestContext, Role, Rpc, Runner, RunnerEnv, Sharding,
};
use opentelemetry::trace::{SpanId, TracerProvider as _};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use serde::{Deserialize, Serialize};
use tracing::Instrument;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

mod support;

/// An exporter that keeps the finished spans in memory.
#[derive(Clone, Debug, Default)]
struct Collected(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collected {
    async fn export(&self, batch: Vec<SpanData>) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.lock().unwrap().extend(batch);
        Ok(())
    }
}

/// Answers `Ping` (volatile) and `Note` (persisted).
struct Echo;

#[derive(Serialize, Deserialize)]
struct Ping;

#[derive(Serialize, Deserialize)]
struct Note(String);

impl Rpc for Ping {
    const TAG: &'static str = "Ping";
    type Success = String;
    type Error = Never;
}

impl Rpc for Note {
    const TAG: &'static str = "Note";
    const PERSISTED: bool = true;
    type Success = String;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.0.clone())
    }
}

impl Entity for Echo {
    const TYPE: &'static str = "Echo";

    async fn create(_: &EntityContext) -> Echo {
        Echo
    }

    fn protocol(protocol: &mut Protocol<Echo>) {
        protocol.handle::<Ping>().handle::<Note>();
    }
}

impl durable_cluster::Handler<Ping> for Echo {
    async fn handle(&mut self, _: &RequestContext, _: Ping) -> Result<String, Never> {
        Ok("pong".to_owned())
    }
}

impl durable_cluster::Handler<Note> for Echo {
    async fn handle(&mut self, _: &RequestContext, Note(note): Note) -> Result<String, Never> {
        Ok(note)
    }
}

/// One line per span: name, trace, id and parent.
fn summary(spans: &[SpanData]) -> String {
    spans
        .iter()
        .map(|span| {
            format!(
                "{} trace {} id {} parent {}{}\n",
                span.name,
                span.span_context.trace_id(),
                span.span_context.span_id(),
                span.parent_span_id,
                if span.parent_span_is_remote { " (remote)" } else { "" },
            )
        })
        .collect()
}

/// The one span named `name` whose attribute `key` is `value`.
fn span<'a>(spans: &'a [SpanData], name: &str, key: &str, value: &str) -> &'a SpanData {
    let found: Vec<_> = spans
        .iter()
        .filter(|span| span.name == name)
        .filter(|span| {
            span.attributes.iter().any(|kv| kv.key.as_str() == key && kv.value.as_str() == value)
        })
        .collect();
    assert_eq!(found.len(), 1, "one span {name} with {key}={value} in\n{}", summary(spans));
    found[0]
}

/// The one span named `name`.
fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    let found: Vec<_> = spans.iter().filter(|span| span.name == name).collect();
    assert_eq!(found.len(), 1, "one span {name} in\n{}", summary(spans));
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_on_another_runner_continues_the_callers_trace() {
    let exporter = Collected::default();
    let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("test"))
        .with_filter(tracing_subscriber::EnvFilter::new("info,cluster_sharding=debug"));
    tracing_subscriber::registry().with(layer).try_init().unwrap();
    assert!(durable_cluster::otel::install_propagator());

    let name = "otel-propagation";
    let settings =
        support::env(name, &[("CLUSTER_RPC_SECRET", "otel-test-0123456789abcdef0123456789abcdef")])
            .unwrap();
    let runner = Runner::start(&settings, |sharding| {
        sharding.entity::<Echo>().register()?;
        Ok(())
    })
    .await
    .unwrap();
    // A client-only process's settings: the same storage and secret, no address.
    let storage = format!("sqlite:{}", support::database(name).display());
    let vars: BTreeMap<&str, String> = [
        ("CLUSTER_STORAGE_URL", storage),
        ("CLUSTER_RPC_SECRET", "otel-test-0123456789abcdef0123456789abcdef".to_owned()),
    ]
    .into_iter()
    .collect();
    let client_env =
        RunnerEnv::from_lookup(Role::Client, move |name| vars.get(name).cloned()).unwrap();
    let client: Sharding = client_env.join().await.unwrap();

    let echo = client.client::<Echo>("e-1");
    let pong = echo.send(Ping).instrument(tracing::info_span!("volatile caller")).await;
    assert_eq!(pong.unwrap(), "pong");
    let noted =
        echo.send(Note("n-1".to_owned())).instrument(tracing::info_span!("persisted caller")).await;
    assert_eq!(noted.unwrap(), "n-1");
    client.shutdown().await;
    runner.shutdown().await;
    provider.force_flush().unwrap();
    let spans = exporter.0.lock().unwrap().clone();

    for (caller, tag) in [("volatile caller", "Ping"), ("persisted caller", "Note")] {
        let caller = named(&spans, caller);
        // The client's span (named `<type>.client.<tag>` by its `otel.name`) is the caller's
        // child, in the client's process.
        let client_span = named(&spans, &format!("Echo.client.{tag}"));
        assert_eq!(client_span.span_context.trace_id(), caller.span_context.trace_id());
        assert_eq!(client_span.parent_span_id, caller.span_context.span_id());
        // The handler's span on the runner continues the trace from the request's context:
        // its parent is the client's span, remote (it came over the transport or the table).
        let handler = span(&spans, "request", "tag", tag);
        assert_eq!(
            handler.span_context.trace_id(),
            caller.span_context.trace_id(),
            "{tag}: one trace from the caller to the handler"
        );
        assert_eq!(handler.parent_span_id, client_span.span_context.span_id(), "{tag}");
        assert!(handler.parent_span_is_remote, "{tag}: the parent is remote");
        assert_ne!(handler.parent_span_id, SpanId::INVALID);
    }
    support::remove_database(name);
}
