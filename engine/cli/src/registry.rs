//! `tl registry`: a worker registry alone, until SIGTERM. First line:
//! `{"event":"listening","registry":...}`.

use std::process::ExitCode;

use tl_engine::telemetry::LogFormat;

use tl_engine::gateway::registry::RegistryNode;

use tl_engine::net::is_loopback_listen;
use tl_engine::net::tls::Tls;

use crate::run::{TlsArgs, serve_until_terminated};

/// Arguments of `tl registry`.
#[derive(clap::Args, Debug)]
pub(crate) struct RegistryArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// `GET /metrics` listen address (plaintext).
    #[arg(long, default_value = "127.0.0.1:0")]
    metrics_listen: String,
    #[command(flatten)]
    tls: TlsArgs,
}

/// Runs `tl registry`.
#[must_use]
pub(crate) fn registry(args: &RegistryArgs, log_format: LogFormat) -> ExitCode {
    tl_engine::telemetry::init_logs(log_format);
    let (mut section, mut allow) = (None, false);
    args.tls.apply(&mut section, &mut allow);
    if section.is_none() && !allow && !is_loopback_listen(&args.listen) {
        eprintln!(
            "error: --listen {:?} is not a loopback address: give --tls-ca/--tls-cert/--tls-key, or --allow-insecure",
            args.listen
        );
        return ExitCode::from(2);
    }
    let tls = match section.as_ref().map(Tls::load).transpose() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    serve_until_terminated(
        RegistryNode::start(&args.listen, tls.as_ref(), &args.metrics_listen),
        |node| {
            serde_json::json!({
                "event": "listening",
                "registry": node.addr().to_string(),
                "metrics": node.metrics_addr().to_string(),
            })
            .to_string()
        },
        async |node| node.stop().await,
    )
}
