//! `tl certs`: a development CA made on first use, and role certificates it signs, written
//! without ever following a planted symlink or overwriting a file. Production deployments bring
//! their own (cert-manager, SPIRE); only the URI SAN matters.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::identity::{PeerId, PeerRole};
use super::tls::{TlsError, TlsSection, read};

/// The files `tl certs` wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issued {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The new certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

impl Issued {
    /// As a `[tls]` section.
    #[must_use]
    pub fn section(&self) -> TlsSection {
        TlsSection {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
            peer_name: None,
            crypto: None,
        }
    }
}

/// Creates `path` holding `text` with `mode`, never following a symlink planted there and
/// never writing over an existing file (`O_EXCL | O_NOFOLLOW`): a private key is 0600 from its
/// first byte, not chmod'ed after.
fn create(path: &Path, text: &str, mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    let io = |source| TlsError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(mode).custom_flags(libc_nofollow());
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = opts.open(path).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

/// `O_NOFOLLOW`, where this build knows it. `create_new` is `O_CREAT | O_EXCL`, which already
/// fails on any existing path, a symlink (even a dangling one) included; this says so twice.
#[cfg(unix)]
fn libc_nofollow() -> i32 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        libc::O_NOFOLLOW
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

fn write(path: &Path, text: &str) -> Result<(), TlsError> {
    create(path, text, 0o644)
}

/// Writes a private key readable by its owner only.
fn write_key(path: &Path, text: &str) -> Result<(), TlsError> {
    create(path, text, 0o600)
}

/// Ids `tl certs` will not issue: their files would be the CA's.
pub const RESERVED_IDS: &[&str] = &["ca"];

/// `tl certs`: makes `dir/ca.pem` and `dir/ca.key` on first use (a self-signed CA), then
/// `dir/ID.pem` and `dir/ID.key`, a leaf signed by it with URI SAN `spiffe://tl/ROLE/ID`, DNS SAN
/// `localhost`, IP SAN `127.0.0.1`, and each of `hosts` (a DNS name or an IP).
///
/// # Errors
/// I/O errors, or an id that cannot be part of a SPIFFE id.
pub fn issue(dir: &Path, id: &str, role: PeerRole, hosts: &[String]) -> Result<Issued, TlsError> {
    issue_with(dir, id, role, hosts, false)
}

/// [`issue`], re-issuing over an existing certificate of `id` when `force` (its old files are
/// removed first, a symlink as a link, never followed); without it, an existing `ID.pem` or
/// `ID.key` is an error. A reserved id ([`RESERVED_IDS`]) is always refused.
///
/// # Errors
/// As [`issue`], and an existing certificate without `force`.
pub fn issue_with(
    dir: &Path,
    id: &str,
    role: PeerRole,
    hosts: &[String],
    force: bool,
) -> Result<Issued, TlsError> {
    let me = PeerId {
        role,
        id: id.to_owned(),
    };
    if PeerId::parse(&me.uri()).as_ref() != Some(&me) {
        return Err(TlsError::NoIdentity(format!("id {id:?}")));
    }
    if RESERVED_IDS.contains(&id) {
        return Err(TlsError::NoIdentity(format!(
            "id {id:?} is reserved: its files would replace the CA's"
        )));
    }
    let (cert_path, key_path) = (dir.join(format!("{id}.pem")), dir.join(format!("{id}.key")));
    for p in [&cert_path, &key_path] {
        if std::fs::symlink_metadata(p).is_ok() {
            if !force {
                return Err(TlsError::Io {
                    path: p.display().to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::AlreadyExists,
                        "already exists; pass --force to issue it again",
                    ),
                });
            }
            std::fs::remove_file(p).map_err(|source| TlsError::Io {
                path: p.display().to_string(),
                source,
            })?;
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    if !ca_pem.exists() {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name
            .push(DnType::CommonName, "tl development CA");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = p.self_signed(&key)?;
        write_key(&ca_key, &key.serialize_pem())?;
        write(&ca_pem, &cert.pem())?;
    }
    let key_text = String::from_utf8_lossy(&read(&ca_key)?).into_owned();
    let ca_signing = KeyPair::from_pem(&key_text)?;
    let ca_text = String::from_utf8_lossy(&read(&ca_pem)?).into_owned();
    let issuer = Issuer::from_ca_cert_pem(&ca_text, ca_signing)?;

    let mut p = CertificateParams::new(vec!["localhost".to_owned()])?;
    p.distinguished_name.push(DnType::CommonName, me.uri());
    p.subject_alt_names
        .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    for h in hosts {
        p.subject_alt_names.push(match h.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(h.as_str().try_into()?),
        });
    }
    p.subject_alt_names
        .push(SanType::URI(me.uri().as_str().try_into()?));
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer)?;
    write_key(&key_path, &key.serialize_pem())?;
    write(&cert_path, &cert.pem())?;
    Ok(Issued {
        ca: ca_pem,
        cert: cert_path,
        key: key_path,
    })
}
