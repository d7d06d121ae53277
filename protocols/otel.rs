//! `TracePropagation` over OpenTelemetry, through `tracing-opentelemetry`:
//! the trace context of a `tracing` span is its OpenTelemetry span
//! context. Shared by `examples/tracing_otel.rs` and `tests/tracing.rs`
//! (included with `#[path]`).

use datum_cluster_sharding::telemetry::{TraceContext, TracePropagation};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Reads and sets OpenTelemetry span contexts on `tracing` spans (needs
/// the `tracing_opentelemetry` layer in the subscriber).
pub struct OtelPropagation;

impl TracePropagation for OtelPropagation {
    fn context_of(&self, span: &tracing::Span) -> Option<TraceContext> {
        let context = span.context();
        let span_context = context.span().span_context().clone();
        span_context.is_valid().then(|| TraceContext {
            trace_id: span_context.trace_id().to_bytes(),
            span_id: span_context.span_id().to_bytes(),
            flags: span_context.trace_flags().to_u8(),
        })
    }

    fn set_parent(&self, span: &tracing::Span, parent: TraceContext) {
        let remote = SpanContext::new(
            TraceId::from_bytes(parent.trace_id),
            SpanId::from_bytes(parent.span_id),
            TraceFlags::new(parent.flags),
            true,
            TraceState::default(),
        );
        let context = opentelemetry::Context::new().with_remote_span_context(remote);
        // Without the layer there is nothing to parent: the span stays a root.
        let _ = span.set_parent(context);
    }
}
