//! `tl registry`: a worker registry alone, until SIGTERM. First line:
//! `{"event":"listening","registry":...}`.

use std::process::ExitCode;

use tl_engine::gateway::registry::RegistryNode;

use crate::run::serve_until_terminated;

/// Arguments of `tl registry`.
#[derive(clap::Args, Debug)]
pub(crate) struct RegistryArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
}

/// Runs `tl registry`.
#[must_use]
pub(crate) fn registry(args: &RegistryArgs) -> ExitCode {
    serve_until_terminated(
        RegistryNode::start(&args.listen),
        |node| {
            serde_json::json!({ "event": "listening", "registry": node.addr().to_string() })
                .to_string()
        },
        async |node| node.stop().await,
    )
}
