//! etcd members started by tests and drills on loopback: each its own process, data
//! directory and ports, over mutual TLS when certificates are given (clients and peers alike).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::net::server::free_loopback_port;

/// Certificates for a cluster: the CA and the members' own certificate and key (a `tl certs`
/// leaf with role `etcd`).
#[derive(Clone, Debug)]
pub struct MemberTls {
    /// The CA every client and peer must chain to.
    pub ca: PathBuf,
    /// The members' certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

/// One running member.
#[derive(Debug)]
pub struct Member {
    /// Its name in the cluster.
    pub name: String,
    /// Its client URL.
    pub client_url: String,
    args: Vec<String>,
    child: Option<Child>,
}

/// The etcd binary: `$TL_ETCD`, else `etcd` on the PATH (Debian's `etcd-server`).
#[must_use]
pub fn binary() -> PathBuf {
    std::env::var_os("TL_ETCD").map_or_else(|| PathBuf::from("etcd"), PathBuf::from)
}

impl Member {
    fn spawn(&mut self) -> std::io::Result<()> {
        let child = Command::new(binary())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "starting {} (Debian's etcd-server; or set TL_ETCD): {e}",
                        binary().display()
                    ),
                )
            })?;
        self.child = Some(child);
        Ok(())
    }

    /// Kills the member (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a killed member again, on its data directory and ports.
    ///
    /// # Errors
    /// When etcd cannot be started.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        let mut args = self.args.clone();
        if let Some(i) = args.iter().position(|a| a == "--initial-cluster-state") {
            args[i + 1] = "existing".into();
        }
        self.args = args;
        self.spawn()
    }

    /// The process id, while it runs.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts a cluster of `n` members with data under `dir`, and waits (up to 20 s) until every
/// member accepts connections.
///
/// # Errors
/// When etcd cannot be started or does not listen in time.
pub fn start_cluster(
    dir: &Path,
    n: usize,
    tls: Option<&MemberTls>,
) -> std::io::Result<Vec<Member>> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ports = Vec::with_capacity(n);
    for _ in 0..n {
        ports.push((free_loopback_port()?, free_loopback_port()?));
    }
    let initial: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, (_, peer))| format!("m{i}={scheme}://127.0.0.1:{peer}"))
        .collect();
    let mut members = Vec::with_capacity(n);
    for (i, (client, peer)) in ports.iter().enumerate() {
        let name = format!("m{i}");
        let client_url = format!("{scheme}://127.0.0.1:{client}");
        let peer_url = format!("{scheme}://127.0.0.1:{peer}");
        let mut args: Vec<String> = vec![
            "--name".into(),
            name.clone(),
            "--data-dir".into(),
            dir.join(&name).display().to_string(),
            "--listen-client-urls".into(),
            client_url.clone(),
            "--advertise-client-urls".into(),
            client_url.clone(),
            "--listen-peer-urls".into(),
            peer_url.clone(),
            "--initial-advertise-peer-urls".into(),
            peer_url,
            "--initial-cluster".into(),
            initial.join(","),
            "--initial-cluster-token".into(),
            "tl".into(),
            "--initial-cluster-state".into(),
            "new".into(),
            "--logger".into(),
            "zap".into(),
            "--log-level".into(),
            "error".into(),
        ];
        if let Some(t) = tls {
            for (flag, file) in [
                ("--cert-file", &t.cert),
                ("--key-file", &t.key),
                ("--trusted-ca-file", &t.ca),
                ("--peer-cert-file", &t.cert),
                ("--peer-key-file", &t.key),
                ("--peer-trusted-ca-file", &t.ca),
            ] {
                args.push(flag.into());
                args.push(file.display().to_string());
            }
            args.push("--client-cert-auth".into());
            args.push("--peer-client-cert-auth".into());
        }
        let mut m = Member {
            name,
            client_url,
            args,
            child: None,
        };
        m.spawn()?;
        members.push(m);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for (client, _) in &ports {
        while std::net::TcpStream::connect(("127.0.0.1", *client)).is_err() {
            if Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("etcd did not listen on 127.0.0.1:{client} within 20 s"),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(members)
}
