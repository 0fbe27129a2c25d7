//! What an operator sees of a process: logs (`tracing`, on stderr, filtered by `RUST_LOG`, text
//! or JSON) and Prometheus metrics ([`metrics`]). The names are CONTRACTS section 9.

pub mod metrics;
pub mod trace;

use tracing_subscriber::EnvFilter;

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
    init(format, None);
}

/// [`init_logs`], and with `tracer`, spans exported through OpenTelemetry too; trace context
/// then crosses every gRPC call of `kvwire_grpc` (see [`trace`]).
pub fn init(format: LogFormat, tracer: Option<opentelemetry_sdk::trace::Tracer>) {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(true);
    let fmt: Box<dyn Layer<_> + Send + Sync> = match format {
        LogFormat::Text => fmt.with_ansi(false).boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .boxed(),
    };
    let otel = tracer.map(|t| tracing_opentelemetry::layer().with_tracer(t));
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()
        .is_ok();
    if installed {
        kvwire_grpc::glue::set_propagation(trace::propagation());
    }
}
