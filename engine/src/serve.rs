//! The long-running commands: `tl engine` and `tl registry`. Each prints one JSON line with the
//! addresses it bound (the only thing on stdout), logs to stderr, and on SIGTERM or SIGINT drains
//! then exits 0.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::config::{Config, Role};
use crate::node::{EngineNode, RegistryNode};

/// Arguments of `tl engine`; flags override the file's keys.
#[derive(clap::Args, Debug)]
pub struct EngineArgs {
    /// Engine configuration (TOML); the defaults when omitted.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// prefill, decode or both.
    #[arg(long, value_enum)]
    pub role: Option<Role>,
    /// Worker id.
    #[arg(long)]
    pub id: Option<String>,
    /// EngineControl listen address.
    #[arg(long)]
    pub grpc_listen: Option<String>,
    /// KvTransfer listen address.
    #[arg(long)]
    pub kv_listen: Option<String>,
    /// HTTP listen address.
    #[arg(long)]
    pub http_listen: Option<String>,
    /// The gateway's WorkerRegistry (host:port).
    #[arg(long)]
    pub gateway_registry: Option<String>,
    /// Seconds to wait for in-flight work on SIGTERM.
    #[arg(long, default_value_t = 5.0)]
    pub drain_seconds: f64,
}

impl EngineArgs {
    /// The configuration: file (or defaults), then flags.
    ///
    /// # Errors
    /// The file's or the result's problems.
    pub fn config(&self) -> Result<Config, crate::config::ConfigError> {
        let mut c = Config::load_or_default(self.config.as_deref())?;
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
        set(&mut c.engine.gateway_registry, &self.gateway_registry);
        c.validate()?;
        Ok(c)
    }
}

/// Arguments of `tl registry`.
#[derive(clap::Args, Debug)]
pub struct RegistryArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
}

/// Arguments of `tl gateway`; flags override the file's keys.
#[derive(clap::Args, Debug)]
pub struct GatewayArgs {
    /// Gateway configuration (TOML, section `[gateway]`); the defaults when omitted.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// HTTP listen address.
    #[arg(long)]
    pub http_listen: Option<String>,
    /// WorkerRegistry listen address.
    #[arg(long)]
    pub registry_listen: Option<String>,
}

/// Runs `tl gateway`.
#[must_use]
pub fn gateway(args: &GatewayArgs) -> ExitCode {
    let mut cfg = match crate::gateway::GatewayConfig::load_or_default(args.config.as_deref()) {
        Ok(c) => c.gateway,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(h) = &args.http_listen {
        cfg.http_listen.clone_from(h);
    }
    if let Some(r) = &args.registry_listen {
        cfg.registry_listen.clone_from(r);
    }
    block_on(async {
        let node = match crate::gateway::GatewayNode::start(&cfg).await {
            Ok(n) => n,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        announce(&node.listening_line());
        eprintln!("gateway serving; SIGTERM stops it");
        terminated().await;
        node.stop().await;
        ExitCode::SUCCESS
    })
}

/// A multi-threaded runtime for the servers (the engine steps on its own thread).
///
/// # Errors
/// When the OS refuses threads.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// Runs `fut` to completion on a fresh runtime; a runtime that cannot start is exit status 1.
pub fn block_on(fut: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    match runtime() {
        Ok(rt) => rt.block_on(fut),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints a bench's JSON line, or its error to stderr (exit status 1).
#[must_use]
pub fn print_json(result: Result<serde_json::Value, String>) -> ExitCode {
    match result {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Waits for SIGTERM or SIGINT.
pub async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut t), Ok(mut i)) => {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = i.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Prints the listening line and flushes it, so a parent reading our stdout sees it at once.
pub fn announce(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Runs `tl engine`.
#[must_use]
pub fn engine(args: &EngineArgs) -> ExitCode {
    let cfg = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    block_on(async {
        let node = match EngineNode::start(&cfg).await {
            Ok(n) => n,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        announce(&node.listening_line());
        eprintln!(
            "engine {} ({:?}) serving; SIGTERM drains and exits",
            cfg.engine.id, cfg.engine.role
        );
        terminated().await;
        eprintln!("engine {}: draining", cfg.engine.id);
        let left = node
            .shutdown(Duration::from_secs_f64(args.drain_seconds.max(0.0)))
            .await;
        eprintln!("engine {}: stopped ({left} unfinished)", cfg.engine.id);
        ExitCode::SUCCESS
    })
}

/// Runs `tl registry`.
#[must_use]
pub fn registry(args: &RegistryArgs) -> ExitCode {
    block_on(async {
        let node = match RegistryNode::start(&args.listen).await {
            Ok(n) => n,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        announce(
            &serde_json::json!({ "event": "listening", "registry": node.addr().to_string() })
                .to_string(),
        );
        terminated().await;
        node.stop().await;
        ExitCode::SUCCESS
    })
}
