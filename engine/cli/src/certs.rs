//! `tl certs`: a development CA (made on first use) and a role certificate signed by it, with the
//! SPIFFE identity `spiffe://tl/ROLE/ID`. Prints `{"ca":...,"cert":...,"key":...}`.

use std::path::PathBuf;
use std::process::ExitCode;

use tl_engine::net::tls::{PeerRole, issue_with};

/// Arguments of `tl certs`.
#[derive(clap::Args, Debug)]
pub(crate) struct CertsArgs {
    /// Directory of the CA and the certificates.
    #[arg(long)]
    dir: PathBuf,
    /// The identity's id (a worker id, or a gateway's or operator's name).
    #[arg(long)]
    id: String,
    /// gateway, prefill, decode, both or admin.
    #[arg(long)]
    role: PeerRole,
    /// Another DNS name or IP the certificate is valid for (repeatable).
    #[arg(long = "host")]
    hosts: Vec<String>,
    /// Issue again over an existing certificate of this id.
    #[arg(long)]
    force: bool,
}

/// Runs `tl certs`.
#[must_use]
pub(crate) fn certs(args: &CertsArgs) -> ExitCode {
    match issue_with(&args.dir, &args.id, args.role, &args.hosts, args.force) {
        Ok(i) => {
            let line = serde_json::json!({
                "ca": i.ca.display().to_string(),
                "cert": i.cert.display().to_string(),
                "key": i.key.display().to_string(),
            });
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
