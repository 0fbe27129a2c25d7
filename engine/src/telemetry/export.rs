//! OTLP/gRPC export of spans, off every request's path: spans go to the SDK's batch processor
//! (a bounded queue drained by a thread of its own, full queue: spans dropped), which hands
//! batches to an exporter that runs on a one-thread Tokio runtime of its own (tonic needs a
//! reactor; the batch thread has none). An export that fails or takes longer than its timeout
//! drops its batch, and the spans are counted.

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

/// Spans in batches whose export failed or timed out, since the start.
static DROPPED: AtomicU64 = AtomicU64::new(0);

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
                .with_max_queue_size(MAX_QUEUE)
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
        .with_span_processor(processor)
        .with_resource(resource)
        .build();
    Ok((provider.tracer("tl"), provider))
}
