//! `tl etcd`: an admin's tool for the registry on etcd. `init` sets up etcd's auth (run once,
//! with the admin's certificate, before auth is on); `grant` lets one identity in with the
//! role its certificate names; `wait` waits until auth is on (an engine's init
//! container); `drain` asks a worker to drain. Each prints one JSON line.

use std::process::ExitCode;
use std::time::Duration;

use tl_engine::etcd::{Etcd, Keys, auth, drain};
use tl_engine::net::tls::{PeerId, Tls};

use crate::run::TlsArgs;

/// Arguments shared by every `tl etcd` command.
#[derive(clap::Args, Debug)]
pub(crate) struct EtcdTarget {
    /// etcd's client URLs, comma separated.
    #[arg(long, value_name = "URL[,URL...]")]
    etcd_endpoints: String,
    /// The key prefix of the deployment (`[registry] prefix`).
    #[arg(long, default_value = tl_engine::etcd::DEFAULT_PREFIX)]
    prefix: String,
    #[command(flatten)]
    tls: TlsArgs,
    /// How long to keep trying while etcd cannot be reached (a cluster still starting), in
    /// milliseconds.
    #[arg(long, default_value_t = 30_000)]
    wait_ms: u64,
}

/// Runs `call` again every 500 ms while etcd is unreachable (UNAVAILABLE, DEADLINE_EXCEEDED),
/// for at most `wait_ms`: an admin's Job may start before the members have formed a cluster.
async fn patiently<T, F, Fut>(wait_ms: u64, mut call: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let end = std::time::Instant::now() + Duration::from_millis(wait_ms);
    loop {
        match call().await {
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                ) && std::time::Instant::now() < end =>
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            r => return r.map_err(|s| format!("{:?}: {}", s.code(), s.message())),
        }
    }
}

/// `tl etcd` commands.
#[derive(clap::Subcommand, Debug)]
pub(crate) enum EtcdCmd {
    /// Turn etcd's auth on: the root user, the caller (an admin certificate) as a superuser,
    /// and the gateway role.
    Init(EtcdTarget),
    /// Let an identity in: `--id ID --role ROLE` as in `tl certs`.
    Grant {
        #[command(flatten)]
        target: EtcdTarget,
        /// The identity's id.
        #[arg(long)]
        id: String,
        /// Its role: gateway, prefill, decode, both or admin.
        #[arg(long)]
        role: String,
    },
    /// Wait, for at most `--wait-ms`, until etcd's auth is on as the caller's certificate sees
    /// it: an engine's init container, so that no engine starts before `tl etcd init`.
    Wait(EtcdTarget),
    /// Ask a worker to drain (`--undo`: withdraw the request).
    Drain {
        #[command(flatten)]
        target: EtcdTarget,
        /// The worker's id.
        #[arg(long)]
        id: String,
        /// Withdraw the request.
        #[arg(long)]
        undo: bool,
    },
}

fn client(t: &EtcdTarget) -> Result<(Etcd, Keys, Option<Tls>), String> {
    let tls = t.tls.load()?;
    let mut r = tl_engine::etcd::RegistrySection::default();
    r.set_endpoints(&t.etcd_endpoints);
    let etcd = Etcd::new(&r.etcd_endpoints, tls.as_ref(), Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    Ok((etcd, Keys::new(&t.prefix), tls))
}

/// Runs `tl etcd`.
#[must_use]
pub(crate) fn etcd(cmd: &EtcdCmd) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let r: Result<serde_json::Value, String> = rt.block_on(async {
        match cmd {
            EtcdCmd::Init(t) => {
                let (etcd, keys, tls) = client(t)?;
                let me = tls
                    .as_ref()
                    .map(|t| t.identity().clone())
                    .ok_or("tl etcd init needs the admin's certificate (--tls-*)")?;
                patiently(t.wait_ms, || auth::init(&etcd, &keys, &me)).await?;
                Ok(serde_json::json!({"auth": "enabled", "superuser": auth::user(&me)}))
            }
            EtcdCmd::Grant { target, id, role } => {
                let (etcd, keys, _) = client(target)?;
                let peer = PeerId {
                    role: role
                        .parse()
                        .map_err(|e: tl_engine::net::tls::UnknownPeerRole| e.to_string())?,
                    id: id.clone(),
                };
                let granted =
                    patiently(target.wait_ms, || auth::grant(&etcd, &keys, &peer)).await?;
                Ok(serde_json::json!({"user": auth::user(&peer), "role": granted}))
            }
            EtcdCmd::Wait(t) => {
                let (etcd, keys, _) = client(t)?;
                let end = std::time::Instant::now() + Duration::from_millis(t.wait_ms);
                loop {
                    // One deadline for the whole wait, unreachable members included.
                    let left = end.saturating_duration_since(std::time::Instant::now());
                    let left_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
                    let on = patiently(left_ms, || auth::is_on(&etcd, &keys)).await?;
                    if on {
                        break Ok(serde_json::json!({"auth": "enabled"}));
                    }
                    if std::time::Instant::now() >= end {
                        break Err(format!(
                            "etcd's auth was still off after {} ms: an admin runs `tl etcd init`",
                            t.wait_ms
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            EtcdCmd::Drain { target, id, undo } => {
                let (etcd, keys, _) = client(target)?;
                patiently(target.wait_ms, || drain::set_drain(&etcd, &keys, id, !undo)).await?;
                Ok(serde_json::json!({"worker": id, "drain": !undo}))
            }
        }
    });
    crate::run::print_json(r)
}
