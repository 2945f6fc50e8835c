//! Logs and traces. Logs: one `tracing` subscriber writing text, or one JSON object per line with
//! `--json-logs`. Traces (`--otlp-endpoint URL`): spans with the target [`TARGET`] go to OpenTelemetry and
//! out over OTLP/HTTP (protobuf) to `URL/v1/traces`, as service `rill-router`; they never reach the logs.
//! Without `--otlp-endpoint` no layer enables those spans, so creating one costs a filter check.
//!
//! The spans (names are what a trace viewer shows):
//! - `request`, one per HTTP request (middleware): `request_id`, `http.route`, `http.request.method`,
//!   `http.response.status_code`; a child of the client's `traceparent` header when it sent one. It ends
//!   when the response is sent and the engine has dropped the request, so it covers a whole stream.
//! - `queue`, a child of `request`: from the request's arrival in the engine to its first admission.
//! - `step`, one per engine iteration (forward pass): `tokens`, `sequences`, `kind` (prefill or decode).
//!   A step serves many requests, so it is the root of a trace of its own with a link to the `request`
//!   span of every sequence it computes (link attribute `scheduled_tokens`), rather than a span per
//!   request and step. Its context goes to the shards as W3C `traceparent` gRPC metadata; each shard
//!   records its `forward` span as the step's child.

use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::{
    propagation::{Extractor, Injector, TextMapPropagator},
    trace::{Status, TraceContextExt, TracerProvider as _},
    Context, KeyValue,
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::{propagation::TraceContextPropagator, trace::SdkTracerProvider, Resource};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    filter::{EnvFilter, Targets},
    layer::SubscriberExt,
    util::SubscriberInitExt,
    Layer,
};

/// The `tracing` target of the spans exported to OpenTelemetry (and only of those).
pub const TARGET: &str = "rill_trace";

/// The service name the router's spans carry.
const SERVICE_NAME: &str = "rill-router";

/// Owns the span exporter; dropping it sends the spans still buffered (blocking for up to a few seconds).
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// Installs the global subscriber: logs (text or JSON) filtered by `RUST_LOG` (default `info`), and the
/// OpenTelemetry layer when `otlp_endpoint` is given.
pub fn init(json_logs: bool, otlp_endpoint: Option<&str>) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info"))
        .add_directive(format!("{TARGET}=off").parse().expect("a valid directive"));
    let logs = if json_logs {
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer().with_filter(filter).boxed()
    };
    let provider = otlp_endpoint.map(tracer_provider).transpose()?;
    let traces = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(SERVICE_NAME))
            .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE))
    });
    tracing_subscriber::registry().with(logs).with(traces).init();
    if let Some(endpoint) = otlp_endpoint {
        tracing::info!(endpoint, "exporting traces over OTLP/HTTP");
    }
    Ok(Telemetry { provider })
}

fn tracer_provider(endpoint: &str) -> anyhow::Result<SdkTracerProvider> {
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(Duration::from_secs(10))
        .build()
        .context("cannot build the OTLP span exporter")?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(SERVICE_NAME).build())
        .build())
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.shutdown() {
                tracing::warn!(error = %e, "flushing the last spans failed");
            }
        }
    }
}

/// The trace context a client sent in a `traceparent` header, if any.
pub fn remote_parent(headers: &axum::http::HeaderMap) -> Option<Context> {
    struct Headers<'a>(&'a axum::http::HeaderMap);
    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }
    headers.get("traceparent")?;
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    cx.span().span_context().is_valid().then_some(cx)
}

/// gRPC metadata carrying the current span's context as `traceparent` (empty when not tracing).
pub fn grpc_metadata() -> tonic::metadata::MetadataMap {
    struct Metadata(tonic::metadata::MetadataMap);
    impl Injector for Metadata {
        fn set(&mut self, key: &str, value: String) {
            let key = tonic::metadata::MetadataKey::from_bytes(key.as_bytes());
            if let (Ok(key), Ok(value)) = (key, value.parse()) {
                self.0.insert(key, value);
            }
        }
    }
    let mut metadata = Metadata(tonic::metadata::MetadataMap::new());
    let span = Span::current();
    if !span.is_disabled() {
        TraceContextPropagator::new().inject_context(&span.context(), &mut metadata);
    }
    metadata.0
}

/// Links `step` to the `request` span of a sequence it computes `num_scheduled_tokens` of.
pub fn link_request(step: &Span, request: &Span, num_scheduled_tokens: usize) {
    let cx = request.context();
    let attributes = vec![KeyValue::new("scheduled_tokens", num_scheduled_tokens as i64)];
    step.add_link_with_attributes(cx.span().span_context().clone(), attributes);
}

/// Marks a span failed.
pub fn set_error(span: &Span, message: String) {
    span.set_status(Status::error(message));
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanId, TraceId};
    use opentelemetry_sdk::trace::InMemorySpanExporter;
    use tracing::Instrument;

    use super::*;

    /// Runs `f` under a subscriber that exports the spans of [`TARGET`] to memory; returns them.
    fn with_tracing(f: impl FnOnce()) -> Vec<opentelemetry_sdk::trace::SpanData> {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry().with(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("test"))
                .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE)),
        );
        tracing::subscriber::with_default(subscriber, f);
        provider.force_flush().expect("in-memory export cannot fail");
        exporter.get_finished_spans().expect("in-memory export cannot fail")
    }

    #[test]
    fn a_step_links_its_requests_and_its_context_goes_to_the_shards() {
        let mut traceparent = String::new();
        let spans = with_tracing(|| {
            let request = tracing::info_span!(target: TARGET, "request");
            let step = tracing::info_span!(target: TARGET, parent: None, "step");
            link_request(&step, &request, 7);
            let metadata = futures::executor::block_on(async { grpc_metadata() }.instrument(step.clone()));
            traceparent = metadata.get("traceparent").expect("set").to_str().unwrap().to_owned();
        });
        let request = spans.iter().find(|s| s.name == "request").unwrap();
        let step = spans.iter().find(|s| s.name == "step").unwrap();
        assert_ne!(
            step.span_context.trace_id(),
            request.span_context.trace_id(),
            "a step is a trace root"
        );
        let link = &step.links.links[0];
        assert_eq!(link.span_context, request.span_context);
        assert_eq!(link.attributes, vec![KeyValue::new("scheduled_tokens", 7i64)]);
        let expected = format!("00-{}-{}-01", step.span_context.trace_id(), step.span_context.span_id());
        assert_eq!(traceparent, expected);
    }

    #[test]
    fn nothing_is_sent_or_linked_without_tracing() {
        // The logs' layer alone, filtered as `init` filters it: the spans of TARGET are off.
        let logs = tracing_subscriber::fmt::layer()
            .with_test_writer()
            .with_filter(EnvFilter::new("trace").add_directive(format!("{TARGET}=off").parse().unwrap()));
        tracing::subscriber::with_default(tracing_subscriber::registry().with(logs), || {
            // (Not `is_disabled()`: tests running at the same time under other subscribers share callsites.)
            let step = tracing::info_span!(target: TARGET, "step");
            link_request(&step, &tracing::info_span!(target: TARGET, "request"), 1);
            let metadata = futures::executor::block_on(async { grpc_metadata() }.instrument(step));
            assert!(metadata.is_empty());
        });
    }

    #[test]
    fn a_client_traceparent_becomes_the_parent() {
        let mut headers = axum::http::HeaderMap::new();
        assert!(remote_parent(&headers).is_none());
        headers.insert("traceparent", "garbage".parse().unwrap());
        assert!(remote_parent(&headers).is_none());
        headers.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let cx = remote_parent(&headers).expect("a valid traceparent");
        let span = cx.span();
        let parent = span.span_context();
        assert_eq!(
            parent.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(parent.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(parent.is_remote());
    }
}
