//! Traces: `tracing` spans exported through OpenTelemetry, with the W3C `traceparent` carried in
//! gRPC metadata and HTTP headers (spec/telemetry.md). Span kinds and names are set with the
//! `otel.kind` and `otel.name` fields `tracing-opentelemetry` reads.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Writes the current span's context into `headers` as `traceparent` (nothing when the current
/// span is not traced).
pub fn inject(headers: &mut http::HeaderMap) {
    let cx = tracing::Span::current().context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
    }
}

/// Makes `span` a child of the context `headers` carry, when they carry a valid one (a client's
/// own `traceparent` is honoured).
pub fn adopt(span: &tracing::Span, headers: &http::HeaderMap) {
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// The SERVER span an incoming gRPC call runs in: `kv.transfer` for PushKv (its attributes are
/// filled in when the push ends), `Service/Method` for the rest.
#[must_use]
pub fn server_span(path: &str, headers: &http::HeaderMap) -> Option<tracing::Span> {
    use kvwire_grpc::pb::kv::path as kv;
    let span = if path == kv::PUSH_KV {
        tracing::info_span!(
            "kv.transfer",
            otel.kind = "server",
            tl.worker = Empty,
            kv.handle_id = Empty,
            kv.blocks_sent = Empty,
            kv.blocks_deduped = Empty,
            kv.payload_bytes = Empty,
            rpc.grpc.status_code = Empty,
        )
    } else {
        // "/tl.engine.v1.EngineControl/Prefill" -> "EngineControl/Prefill".
        let name = path
            .trim_start_matches('/')
            .rsplit_once('.')
            .map_or(path, |(_, m)| m)
            .to_owned();
        tracing::info_span!(
            "rpc",
            otel.name = name,
            otel.kind = "server",
            tl.worker = Empty
        )
    };
    adopt(&span, headers);
    Some(span)
}

/// The process's propagation for `kvwire_grpc`'s clients and servers.
#[must_use]
pub fn propagation() -> kvwire_grpc::glue::Propagation {
    kvwire_grpc::glue::Propagation {
        inject,
        server_span,
    }
}
