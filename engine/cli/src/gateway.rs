//! `tl gateway`: the OpenAI-compatible front and the worker registry, until SIGTERM. First line:
//! `{"event":"listening","http":...,"registry":...}`.

use std::path::PathBuf;
use std::process::ExitCode;

use tl_engine::telemetry::{self, LogFormat};

use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;

use crate::run::{AndFlush, TlsArgs, serve_until_terminated};

/// Arguments of `tl gateway`; flags override the file's keys.
#[derive(clap::Args, Debug)]
pub(crate) struct GatewayArgs {
    /// Gateway configuration (TOML, section `[gateway]`); the defaults when omitted.
    #[arg(long)]
    config: Option<PathBuf>,
    /// HTTP listen address.
    #[arg(long)]
    http_listen: Option<String>,
    /// WorkerRegistry listen address.
    #[arg(long)]
    registry_listen: Option<String>,
    /// Route over the workers registered on etcd: its client URLs, comma separated
    /// (`[registry] etcd_endpoints`).
    #[arg(long, value_name = "URL[,URL...]")]
    etcd_endpoints: Option<String>,
    /// `GET /metrics` listen address (plaintext).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Serve `/v1/*` to callers without a key (`[gateway] public_unauthenticated`) while no
    /// tenant key is configured; admin keys (for `/workers`) do not close it, tenant keys do.
    /// With no key at all and without this, the gateway refuses to start.
    #[arg(long)]
    public_unauthenticated: bool,
    #[command(flatten)]
    tls: TlsArgs,
}

/// Runs `tl gateway`.
#[must_use]
pub(crate) fn gateway(args: &GatewayArgs, log_format: LogFormat) -> ExitCode {
    let mut cfg = match GatewayConfig::read_or_default(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(h) = &args.http_listen {
        cfg.gateway.http_listen.clone_from(h);
    }
    if let Some(r) = &args.registry_listen {
        cfg.gateway.registry_listen.clone_from(r);
    }
    if let Some(e) = &args.etcd_endpoints {
        cfg.registry.set_endpoints(e);
    }
    if let Some(m) = &args.metrics_listen {
        cfg.gateway.metrics_listen.clone_from(m);
    }
    if args.public_unauthenticated {
        cfg.gateway.public_unauthenticated = true;
    }
    // Chat templates render in processes of this same binary, bounded in memory and time.
    cfg.gateway.render_worker = tl_engine::gateway::sandbox::own_executable();
    args.tls.apply(&mut cfg.tls, &mut cfg.allow_insecure);
    if let Err(e) = cfg.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let drain = cfg.limits.drain();
    let traces = telemetry::start(
        log_format,
        cfg.telemetry.endpoint().as_deref(),
        "tl-gateway",
        &cfg.gateway.id,
    );
    serve_until_terminated(
        GatewayNode::start(&cfg),
        |node| {
            tracing::info!("gateway serving; SIGTERM stops it");
            node.listening_line()
        },
        async |node| {
            // SIGTERM drains: running streams get drain_ms to finish, then end with an error
            // event naming the drain.
            tracing::info!("draining");
            let ended = node.shutdown(drain).await;
            tracing::info!(ended, "stopped");
        },
    )
    .and_flush(traces)
}

#[cfg(test)]
mod tests {
    use tl_engine::gateway::config::GatewayConfig;

    /// The deployment files of the gateway parse, and need `[tls]` (from flags) to listen on
    /// every interface.
    #[test]
    fn deployment_files_parse_and_need_tls() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        for file in [
            "deploy/compose/gateway.toml",
            "deploy/k8s/config/gateway.toml",
        ] {
            let path = std::path::PathBuf::from(format!("{root}/{file}"));
            let c = GatewayConfig::read_or_default(Some(&path)).unwrap();
            assert!(
                c.validate().is_err(),
                "{file}: plaintext on 0.0.0.0 accepted"
            );
            assert!(c.gateway.stall_timeout_ms > 0 && c.gateway.max_failovers > 0);
            // Kubernetes runs two gateways over the registry on etcd's three members.
            let members = if file.contains("k8s") { 3 } else { 0 };
            assert_eq!(c.registry.etcd_endpoints.len(), members, "{file}");
        }
    }
}
