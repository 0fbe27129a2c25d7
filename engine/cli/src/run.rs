//! What every long-running command and bench shares: the runtime, the listening line, the stop
//! signal, and printing one JSON result.

use std::io::Write;
use std::process::ExitCode;

pub(crate) use tl_lab::run::{block_on, print_json};

/// Waits for SIGTERM, SIGINT or SIGHUP (a closed terminal: the same drain and clean-up as
/// SIGTERM, not the default of dying on the spot with the run's files left behind).
pub async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(mut t), Ok(mut i), Ok(mut h)) => {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = i.recv() => {}
                    _ = h.recv() => {}
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
pub(crate) fn announce(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Runs a long-lived node: starts it (exit status 1 if it cannot), prints its listening line,
/// waits for SIGTERM or SIGINT, then stops it with `stop`; exit status 0.
pub(crate) fn serve_until_terminated<N>(
    start: impl std::future::Future<Output = std::io::Result<N>>,
    listening_line: impl FnOnce(&N) -> String,
    stop: impl AsyncFnOnce(N),
) -> ExitCode {
    block_on(async {
        let node = match start.await {
            Ok(n) => n,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        announce(&listening_line(&node));
        terminated().await;
        stop(node).await;
        ExitCode::SUCCESS
    })
}

/// The TLS flags every long-running command takes; they override the file's `[tls]` and
/// `allow_insecure`.
#[derive(clap::Args, Debug, Default)]
pub(crate) struct TlsArgs {
    /// The deployment's CA certificate (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<std::path::PathBuf>,
    /// This process's certificate (PEM), from `tl certs`.
    #[arg(long, requires_all = ["tls_ca", "tls_key"])]
    tls_cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires_all = ["tls_ca", "tls_cert"])]
    tls_key: Option<std::path::PathBuf>,
    /// The name engines' certificates carry, verified when dialing an engine at its advertised
    /// address (for engines that advertise a pod IP); `[tls] peer_name`.
    #[arg(long)]
    tls_peer_name: Option<String>,
    /// Without TLS, listen on non-loopback addresses anyway.
    #[arg(long)]
    allow_insecure: bool,
}

impl TlsArgs {
    /// The flags' certificates loaded, for a client command (no configuration file): `None`
    /// without `--tls-*`.
    ///
    /// # Errors
    /// A file that cannot be read or parsed, named.
    pub(crate) fn load(&self) -> Result<Option<tl_engine::net::tls::Tls>, String> {
        let (mut section, mut allow) = (None, false);
        self.apply(&mut section, &mut allow);
        section
            .as_ref()
            .map(tl_engine::net::tls::Tls::load)
            .transpose()
            .map_err(|e| e.to_string())
    }

    /// Applies the flags over a configuration's `[tls]` and `allow_insecure`.
    pub(crate) fn apply(
        &self,
        tls: &mut Option<tl_engine::net::tls::TlsSection>,
        allow_insecure: &mut bool,
    ) {
        if let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            let peer_name = tls.as_ref().and_then(|t| t.peer_name.clone());
            let crypto = tls.as_ref().and_then(|t| t.crypto);
            *tls = Some(tl_engine::net::tls::TlsSection {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
                peer_name,
                crypto,
            });
        }
        if let (Some(t), Some(n)) = (tls.as_mut(), &self.tls_peer_name) {
            t.peer_name = Some(n.clone());
        }
        *allow_insecure |= self.allow_insecure;
    }
}

/// Flushes and stops span export after a server's run.
pub(crate) trait AndFlush {
    /// Shuts `provider` down (flushing queued spans) and passes the exit code on.
    fn and_flush(self, provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>) -> Self;
}

impl AndFlush for ExitCode {
    fn and_flush(self, provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>) -> Self {
        if let Some(p) = provider {
            let _ = p.shutdown();
        }
        self
    }
}
