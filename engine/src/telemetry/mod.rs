//! What an operator sees of a process: logs (`tracing`, on stderr, filtered by `RUST_LOG`, text
//! or JSON) and Prometheus metrics ([`metrics`]). The names are spec/telemetry.md's.

pub mod export;
pub mod metrics;
pub mod receiver;
pub mod trace;

use serde::Deserialize;
use tracing_subscriber::EnvFilter;

/// `[telemetry]` of an engine's or gateway's configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySection {
    /// OTLP/gRPC collector (`host:port`); empty: `OTEL_EXPORTER_OTLP_ENDPOINT`, else no export.
    pub otlp_endpoint: String,
}

impl TelemetrySection {
    /// Where spans go, if anywhere.
    #[must_use]
    pub fn endpoint(&self) -> Option<String> {
        if !self.otlp_endpoint.is_empty() {
            return Some(self.otlp_endpoint.clone());
        }
        std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
    }
}

/// Starts logs and, when an endpoint is configured, span export for a long-running process
/// named `service` (`tl-engine`, `tl-gateway`, `tl-registry`) with id `instance`. Keep the
/// returned provider and shut it down at exit, which flushes what is queued.
pub fn start(
    format: LogFormat,
    endpoint: Option<&str>,
    service: &str,
    instance: &str,
) -> Option<opentelemetry_sdk::trace::SdkTracerProvider> {
    match endpoint.map(|e| export::otlp(e, service, instance)) {
        Some(Ok((tracer, provider))) => {
            init(format, Some(tracer));
            Some(provider)
        }
        Some(Err(e)) => {
            init(format, None);
            tracing::error!(error = %e, "span export is off");
            None
        }
        None => {
            init(format, None);
            None
        }
    }
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per event (fields flattened), for log collectors.
    Json,
}

/// Sends `tracing` events to stderr in `format`, filtered by `RUST_LOG` (default `info`).
/// stdout stays free for the listening line and command output. A second call does nothing (the
/// first subscriber stays), so tests and commands can both call it.
pub fn init_logs(format: LogFormat) {
    if let Some(switch) = init_switchable(format) {
        let _ = SWITCH.set(switch);
    }
}

static SWITCH: std::sync::OnceLock<TraceSwitch> = std::sync::OnceLock::new();

/// Starts exporting spans to `tracer` in a process whose logs began with [`init_logs`];
/// `false` when they did not.
pub fn enable_spans(tracer: opentelemetry_sdk::trace::Tracer) -> bool {
    SWITCH.get().map(|s| s.enable(tracer)).is_some()
}

/// Stops exporting spans (after [`enable_spans`]).
pub fn disable_spans() {
    if let Some(s) = SWITCH.get() {
        s.disable();
    }
}

/// Turns span export on in a process started without it (benchmarks compare both in one run).
pub struct TraceSwitch(
    tracing_subscriber::reload::Handle<
        Option<
            tracing_opentelemetry::OpenTelemetryLayer<
                tracing_subscriber::Registry,
                opentelemetry_sdk::trace::Tracer,
            >,
        >,
        tracing_subscriber::Registry,
    >,
);

impl std::fmt::Debug for TraceSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TraceSwitch")
    }
}

impl TraceSwitch {
    /// From now on, spans go to `tracer`.
    pub fn enable(&self, tracer: opentelemetry_sdk::trace::Tracer) {
        let _ = self
            .0
            .reload(Some(tracing_opentelemetry::layer().with_tracer(tracer)));
    }

    /// From now on, spans go nowhere.
    pub fn disable(&self) {
        let _ = self.0.reload(None);
    }
}

/// [`init_logs`], with a span exporter that can be switched on later; `None` when a subscriber
/// was installed already.
#[must_use]
pub fn init_switchable(format: LogFormat) -> Option<TraceSwitch> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let (otel, handle) = tracing_subscriber::reload::Layer::new(None);
    let installed = tracing_subscriber::registry()
        .with(otel)
        .with(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with(fmt_layer(format))
        .try_init()
        .is_ok();
    if !installed {
        return None;
    }
    kvwire_grpc::glue::set_propagation(trace::propagation());
    Some(TraceSwitch(handle))
}

fn fmt_layer<S>(format: LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer;
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(true);
    match format {
        LogFormat::Text => fmt.with_ansi(false).boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .boxed(),
    }
}

/// [`init_logs`], and with `tracer`, spans exported through OpenTelemetry too; trace context
/// then crosses every gRPC call of `kvwire_grpc` (see [`trace`]).
pub fn init(format: LogFormat, tracer: Option<opentelemetry_sdk::trace::Tracer>) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let otel = tracer.map(|t| tracing_opentelemetry::layer().with_tracer(t));
    let installed = tracing_subscriber::registry()
        .with(otel)
        .with(filter)
        .with(fmt_layer(format))
        .try_init()
        .is_ok();
    if installed {
        kvwire_grpc::glue::set_propagation(trace::propagation());
    }
}
