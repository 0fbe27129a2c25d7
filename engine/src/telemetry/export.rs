//! OTLP/gRPC export of spans, off every request's path: spans go to the SDK's batch processor
//! (a bounded queue drained by a thread of its own, full queue: spans dropped), which hands
//! batches to an exporter that runs on a current-thread Tokio runtime of its own (tonic needs a
//! reactor; the batch thread has none). A span that finds the queue full, and a batch whose
//! export fails or takes longer than its timeout, are dropped and counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter, Tracer,
};

/// Spans dropped since the start: in batches whose export failed or timed out, or refused
/// because the queue was full.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Spans handed to the batch processor and not yet exported (or dropped by it).
static QUEUED: AtomicU64 = AtomicU64::new(0);

/// Spans dropped by the exporter since the start (`tl_trace_spans_dropped_total`).
#[must_use]
pub fn spans_dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// How long one export may take before its batch is dropped.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Spans the queue holds before new ones are dropped.
pub const MAX_QUEUE: usize = 4096;

/// The OTLP exporter on a runtime of its own.
#[derive(Debug)]
struct OnRuntime {
    inner: opentelemetry_otlp::SpanExporter,
    rt: tokio::runtime::Runtime,
}

impl SpanExporter for OnRuntime {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        let n = batch.len() as u64;
        // Whatever the outcome, these spans have left the queue.
        let _ = QUEUED.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
            Some(q.saturating_sub(n))
        });
        let r = self.rt.block_on(async {
            match tokio::time::timeout(EXPORT_TIMEOUT, self.inner.export(batch)).await {
                Ok(r) => r,
                Err(_) => Err(opentelemetry_sdk::error::OTelSdkError::Timeout(
                    EXPORT_TIMEOUT,
                )),
            }
        });
        if r.is_err() {
            DROPPED.fetch_add(n, Ordering::Relaxed);
        }
        std::future::ready(r)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _in_runtime = self.rt.enter();
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The batch processor behind a queue bound of our own: a span that would make the queue longer
/// than [`MAX_QUEUE`] is dropped here and counted (the SDK's own bound, set above ours, then
/// never drops one uncounted).
#[derive(Debug)]
struct Bounded(BatchSpanProcessor);

impl opentelemetry_sdk::trace::SpanProcessor for Bounded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.0.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        let admitted = QUEUED
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                (q < MAX_QUEUE as u64).then_some(q + 1)
            })
            .is_ok();
        if admitted {
            self.0.on_end(span);
        } else {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("OTLP exporter to {endpoint}: {message}")]
pub struct ExportError {
    endpoint: String,
    message: String,
}

/// A tracer exporting to the OTLP/gRPC collector at `endpoint` (`host:port`, or a URL), with
/// `service.name` = `service` and `service.instance.id` = `instance`; and its provider, to shut
/// down (flushing what is queued) at exit.
///
/// # Errors
/// When the runtime or the exporter cannot be built (a malformed endpoint).
pub fn otlp(
    endpoint: &str,
    service: &str,
    instance: &str,
) -> Result<(Tracer, SdkTracerProvider), ExportError> {
    let err = |message: String| ExportError {
        endpoint: endpoint.to_owned(),
        message,
    };
    let url = if endpoint.contains("://") {
        endpoint.to_owned()
    } else {
        format!("http://{endpoint}")
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| err(e.to_string()))?;
    let inner = {
        // The channel is made (lazily connecting) on the exporter's own runtime.
        let _in_runtime = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(url)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| err(e.to_string()))?
    };
    let processor = BatchSpanProcessor::builder(OnRuntime { inner, rt })
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(2 * MAX_QUEUE)
                .with_max_export_batch_size(512)
                .with_scheduled_delay(Duration::from_millis(200))
                .build(),
        )
        .build();
    let resource = Resource::builder()
        .with_service_name(service.to_owned())
        .with_attribute(KeyValue::new("service.instance.id", instance.to_owned()))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Bounded(processor))
        .with_resource(resource)
        .build();
    Ok((provider.tracer("tl"), provider))
}
