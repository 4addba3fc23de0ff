//! Trace context across processes: a request carries the trace context of the span it was sent
//! from (`trace_id`, `span_id`, `sampled`, as the reference's envelopes do), over the transport
//! and in the message table, and its handler's `request` span continues that trace on the runner
//! that runs it.
//!
//! The runtime knows `tracing` spans, not trace ids: a [`TracePropagator`] (installed once per
//! process with [`set_propagator`]) reads the current span's context and sets a span's parent.
//! durable-cluster's `otel` feature installs one built on OpenTelemetry. Without one, requests
//! carry no trace context, as before.

use std::sync::OnceLock;

use cluster_core::envelope::TraceContext;

/// Reads and continues trace contexts.
pub trait TracePropagator: Send + Sync + 'static {
    /// The trace context of `span`, stamped on a request this process sends from it; the
    /// default context (all fields `None`) when there is no trace.
    fn context(&self, span: &tracing::Span) -> TraceContext;

    /// Makes `span` (a handler's `request` span) a child of the span `trace` names. A context
    /// without a trace id, or with ids that do not parse, leaves `span` as it is.
    fn set_parent(&self, span: &tracing::Span, trace: &TraceContext);
}

static PROPAGATOR: OnceLock<Box<dyn TracePropagator>> = OnceLock::new();

/// Installs the process's propagator; the first one installed stays.
///
/// # Errors
///
/// Gives `propagator` back when one is installed already.
pub fn set_propagator(
    propagator: Box<dyn TracePropagator>,
) -> Result<(), Box<dyn TracePropagator>> {
    PROPAGATOR.set(propagator)
}

/// The trace context to stamp on a new request: the current span's.
pub(crate) fn current() -> TraceContext {
    PROPAGATOR
        .get()
        .map(|propagator| propagator.context(&tracing::Span::current()))
        .unwrap_or_default()
}

/// Stamps `span`'s trace context on a request, if a propagator is installed and `span` is
/// traced (a client call's own span, made after its request).
pub(crate) fn stamp(span: &tracing::Span, trace: &mut TraceContext) {
    if let Some(propagator) = PROPAGATOR.get() {
        let context = propagator.context(span);
        if context.trace_id.is_some() {
            *trace = context;
        }
    }
}

/// Continues the trace of `trace` in `span`, if a propagator is installed and the request
/// carries a trace.
pub(crate) fn set_parent(span: &tracing::Span, trace: &TraceContext) {
    if trace.trace_id.is_none() {
        return;
    }
    if let Some(propagator) = PROPAGATOR.get() {
        propagator.set_parent(span, trace);
    }
}
