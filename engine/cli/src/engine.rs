//! `tl engine`: runs an engine (prefill, decode or both) until SIGTERM, which drains then exits 0.
//! The first stdout line is `{"event":"listening",...}` with the addresses bound.

use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Duration;
use tl_engine::telemetry::{self, LogFormat};

use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, ConfigError, Role};

use crate::run::{AndFlush, TlsArgs, serve_until_terminated};

/// Arguments of `tl engine`; flags override the file's keys.
#[derive(clap::Args, Debug)]
pub(crate) struct EngineArgs {
    /// Engine configuration (TOML); the defaults when omitted.
    #[arg(long)]
    config: Option<PathBuf>,
    /// prefill, decode or both.
    #[arg(long)]
    role: Option<Role>,
    /// Worker id.
    #[arg(long)]
    id: Option<String>,
    /// EngineControl listen address.
    #[arg(long)]
    grpc_listen: Option<String>,
    /// KvTransfer listen address.
    #[arg(long)]
    kv_listen: Option<String>,
    /// HTTP listen address.
    #[arg(long)]
    http_listen: Option<String>,
    /// `GET /metrics` listen address.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// The gateway's WorkerRegistry (host:port).
    #[arg(long)]
    gateway_registry: Option<String>,
    /// The worker registry on etcd instead: its client URLs, comma separated
    /// (`[registry] etcd_endpoints`).
    #[arg(long, value_name = "URL[,URL...]")]
    etcd_endpoints: Option<String>,
    /// Register on an etcd whose auth is off (`[registry] allow_no_auth`): tests and private
    /// single-host setups only. Without it such an etcd is refused.
    #[arg(long)]
    etcd_allow_no_auth: bool,
    /// The host peers reach this engine at (advertised with the bound ports); needed when
    /// listening on 0.0.0.0.
    #[arg(long)]
    advertise_address: Option<String>,
    /// Seconds to wait for in-flight work on SIGTERM (default: `[limits] drain_ms`, 5 s).
    #[arg(long)]
    drain_seconds: Option<f64>,
    /// A checkpoint to serve (`[model] path`): a GGUF file, a Hugging Face directory, or `fake`.
    #[arg(long)]
    model: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
}

impl EngineArgs {
    /// The configuration: file (or defaults), then flags.
    ///
    /// # Errors
    /// The file's or the result's problems.
    pub(crate) fn config(&self) -> Result<Config, ConfigError> {
        let mut c = Config::read_or_default(self.config.as_deref())?;
        if let Some(r) = self.role {
            c.engine.role = r;
        }
        let set = |dst: &mut String, v: &Option<String>| {
            if let Some(v) = v {
                dst.clone_from(v);
            }
        };
        set(&mut c.engine.id, &self.id);
        set(&mut c.engine.grpc_listen, &self.grpc_listen);
        set(&mut c.engine.kv_listen, &self.kv_listen);
        set(&mut c.engine.http_listen, &self.http_listen);
        set(&mut c.engine.metrics_listen, &self.metrics_listen);
        set(&mut c.engine.gateway_registry, &self.gateway_registry);
        if let Some(e) = &self.etcd_endpoints {
            c.registry.set_endpoints(e);
        }
        if self.etcd_allow_no_auth {
            c.registry.allow_no_auth = true;
        }
        set(&mut c.engine.advertise_address, &self.advertise_address);
        if let Some(m) = &self.model {
            c.set_model(m);
        }
        self.tls.apply(&mut c.tls, &mut c.allow_insecure);
        c.validate()?;
        Ok(c)
    }
}

/// Runs `tl engine`.
#[must_use]
pub(crate) fn engine(args: &EngineArgs, log_format: LogFormat) -> ExitCode {
    let cfg = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let id = &cfg.engine.id;
    let traces = telemetry::start(
        log_format,
        cfg.telemetry.endpoint().as_deref(),
        "tl-engine",
        id,
    );
    let drain = args
        .drain_seconds
        .map_or(cfg.limits.drain(), |s| Duration::from_secs_f64(s.max(0.0)));
    serve_until_terminated(
        EngineNode::start(&cfg),
        |node| {
            tracing::info!(
                worker_id = %id,
                role = ?cfg.engine.role,
                "engine serving; SIGTERM drains and exits"
            );
            node.listening_line()
        },
        async |node| {
            tracing::info!(worker_id = %id, "draining");
            let left = node.shutdown(drain).await;
            tracing::info!(worker_id = %id, unfinished = left, "stopped");
        },
    )
    .and_flush(traces)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn config(args: &[&str]) -> Result<Config, ConfigError> {
        let mut all = vec!["tl"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap().engine.config()
    }

    /// The deployment files listen on every interface and take their certificates from flags:
    /// the file is validated with the flags applied, not before.
    #[test]
    fn deployment_files_load_with_tls_from_flags() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let tls = [
            "--tls-ca=/certs/ca.pem",
            "--tls-cert=/certs/d1.pem",
            "--tls-key=/certs/d1.key",
        ];
        for file in [
            "deploy/compose/decode.toml",
            "deploy/compose/prefill.toml",
            "deploy/k8s/config/decode.toml",
            "deploy/k8s/config/prefill.toml",
        ] {
            let path = format!("{root}/{file}");
            let mut args = vec!["--config", &path, "--advertise-address", "10.0.0.7"];
            // Without certificates, listening on 0.0.0.0 is refused.
            let e = config(&args).unwrap_err();
            assert!(e.to_string().contains("loopback"), "{file}: {e}");
            args.extend_from_slice(&tls);
            args.push("--tls-peer-name=kvwire-engine");
            let c = config(&args).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(c.engine.grpc_listen, "0.0.0.0:7100", "{file}");
            let t = c.tls.unwrap();
            assert_eq!(t.cert, std::path::PathBuf::from("/certs/d1.pem"));
            assert_eq!(t.peer_name.as_deref(), Some("kvwire-engine"));
            let members = if file.contains("k8s") { 3 } else { 0 };
            assert_eq!(c.registry.etcd_endpoints.len(), members, "{file}");
            assert!(
                members == 0 || c.engine.gateway_registry.is_empty(),
                "{file}"
            );
        }
    }
}
