//! What an operator sees of a process: logs (`tracing`, on stderr, filtered by `RUST_LOG`, text
//! or JSON) and Prometheus metrics ([`metrics`]). The names are CONTRACTS section 9.

pub mod metrics;

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
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(false).try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
}
