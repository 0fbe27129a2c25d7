//! Mutual TLS between the processes of a deployment, and who each peer is.
//!
//! Every internal port serves TLS 1.3 only and requires a client certificate that chains to the
//! deployment's CA; every outgoing connection presents the process's own certificate and
//! verifies the server against the same CA. A peer's identity is the SPIFFE URI SAN of its
//! certificate, `spiffe://tl/ROLE/ID` ([`PeerId`]); what it may call is decided by its role.
//!
//! [`issue`] is `tl certs`: a development CA made on first use, and role certificates signed by
//! it. Production deployments bring their own (cert-manager, SPIRE); only the URI SAN matters.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::Deserialize;

/// What a peer is, as its certificate says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerRole {
    /// The gateway.
    Gateway,
    /// A prefill engine.
    Prefill,
    /// A decode engine.
    Decode,
    /// An engine with both roles.
    Both,
    /// An operator's tool.
    Admin,
    /// An etcd member (the registry's store): a server certificate, allowed no call here.
    Etcd,
}

impl PeerRole {
    /// Every role.
    pub const ALL: [PeerRole; 6] = [
        PeerRole::Gateway,
        PeerRole::Prefill,
        PeerRole::Decode,
        PeerRole::Both,
        PeerRole::Admin,
        PeerRole::Etcd,
    ];

    /// The role's name in a SPIFFE id.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            PeerRole::Gateway => "gateway",
            PeerRole::Prefill => "prefill",
            PeerRole::Decode => "decode",
            PeerRole::Both => "both",
            PeerRole::Admin => "admin",
            PeerRole::Etcd => "etcd",
        }
    }
}

impl std::str::FromStr for PeerRole {
    type Err = TlsError;

    fn from_str(s: &str) -> Result<Self, TlsError> {
        PeerRole::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| TlsError::Role(s.to_owned()))
    }
}

/// A peer's identity: `spiffe://tl/ROLE/ID`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerId {
    /// Its role.
    pub role: PeerRole,
    /// Its id (a worker id, or a gateway's or operator's name).
    pub id: String,
}

const SPIFFE_PREFIX: &str = "spiffe://tl/";

impl PeerId {
    /// The SPIFFE URI.
    #[must_use]
    pub fn uri(&self) -> String {
        format!("{SPIFFE_PREFIX}{}/{}", self.role.as_str(), self.id)
    }

    /// Parses `spiffe://tl/ROLE/ID`.
    #[must_use]
    pub fn parse(uri: &str) -> Option<Self> {
        let (role, id) = uri.strip_prefix(SPIFFE_PREFIX)?.split_once('/')?;
        if id.is_empty() || id.contains('/') {
            return None;
        }
        Some(Self {
            role: role.parse().ok()?,
            id: id.to_owned(),
        })
    }

    /// The identity in a DER certificate: its one `spiffe://tl/` URI SAN.
    #[must_use]
    pub fn from_cert(der: &[u8]) -> Option<Self> {
        use x509_parser::extensions::GeneralName;
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let mut ids = san.value.general_names.iter().filter_map(|n| match n {
            GeneralName::URI(u) => PeerId::parse(u),
            _ => None,
        });
        let id = ids.next()?;
        // Two identities in one certificate is one too many.
        ids.next().is_none().then_some(id)
    }
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A PEM file holds no usable certificate or key.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: String,
        /// What is wrong.
        what: String,
    },
    /// Our own certificate carries no `spiffe://tl/ROLE/ID` URI SAN.
    #[error("{0}: the certificate has no spiffe://tl/ROLE/ID identity")]
    NoIdentity(String),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client verifier could not be built.
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// Making a certificate failed.
    #[error("certificate: {0}")]
    Cert(#[from] rcgen::Error),
    /// `peer_name` is not a name a certificate can carry.
    #[error("peer_name {0:?} is not a DNS name a certificate can carry")]
    PeerName(String),
    /// Not one of gateway, prefill, decode, both, admin.
    #[error("role {0:?}: expected gateway, prefill, decode, both or admin")]
    Role(String),
}

/// `[tls]` of every process's TOML: the CA that signs every peer, and this process's certificate
/// and key (PEM files).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// The deployment's CA certificate.
    pub ca: PathBuf,
    /// This process's certificate.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The name every engine's certificate carries, verified when this process dials an engine
    /// at the address it advertised, instead of that address's host. For deployments where
    /// engines advertise an address no certificate can name in advance (a pod IP). Omitted: the
    /// dialed host is verified. Connections to the registry always verify the dialed host.
    #[serde(default)]
    pub peer_name: Option<String>,
    /// The library under rustls for the whole process: `"aws-lc"` (the default) or `"ring"`.
    /// Omitted: the default, or whatever the process chose before loading this section.
    #[serde(default)]
    pub crypto: Option<TlsCrypto>,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Io {
        path: path.display().to_string(),
        source,
    })
}

fn pem_error(path: &Path, what: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        what: what.to_string(),
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(pem_error(path, "no certificate"));
    }
    Ok(certs)
}

/// The cryptography library under rustls, for every TLS connection the process serves or
/// makes: [`set_crypto`] chooses it once at start, before any configuration is built.
///
/// aws-lc's AES-GCM has a VAES/AVX-512 path that ring 0.17 lacks: on an Intel Xeon of family 6
/// model 207 (Emerald Rapids) it sealed 16 KiB records at 19.5 GB/s against ring's 12.6 and
/// opened them at 17.5 against 12.4 (README). So it is the default; ring stays selectable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsCrypto {
    /// aws-lc-rs (the default).
    #[default]
    AwsLc,
    /// ring.
    Ring,
}

impl TlsCrypto {
    /// Its name as [`FromStr`](std::str::FromStr) takes it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::AwsLc => "aws-lc",
            Self::Ring => "ring",
        }
    }
}

impl std::fmt::Display for TlsCrypto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not one of [`TlsCrypto`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected aws-lc or ring")]
pub struct UnknownTlsCrypto(pub String);

impl std::str::FromStr for TlsCrypto {
    type Err = UnknownTlsCrypto;

    fn from_str(s: &str) -> Result<Self, UnknownTlsCrypto> {
        match s {
            "aws-lc" => Ok(Self::AwsLc),
            "ring" => Ok(Self::Ring),
            other => Err(UnknownTlsCrypto(other.to_owned())),
        }
    }
}

/// 0 aws-lc, 1 ring.
static CRYPTO: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Chooses the library under every TLS configuration built from now on.
pub fn set_crypto(c: TlsCrypto) {
    let v = match c {
        TlsCrypto::AwsLc => 0,
        TlsCrypto::Ring => 1,
    };
    CRYPTO.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The library [`set_crypto`] chose.
#[must_use]
pub fn crypto() -> TlsCrypto {
    match CRYPTO.load(std::sync::atomic::Ordering::Relaxed) {
        0 => TlsCrypto::AwsLc,
        _ => TlsCrypto::Ring,
    }
}

/// Library `c`'s own provider: its suites, key exchanges and signature checks, as it orders them.
fn library(c: TlsCrypto) -> rustls::crypto::CryptoProvider {
    match c {
        TlsCrypto::AwsLc => rustls::crypto::aws_lc_rs::default_provider(),
        TlsCrypto::Ring => rustls::crypto::ring::default_provider(),
    }
}

/// [`provider`] with the library's TLS 1.2 suites after its own, for the public endpoint, whose
/// clients may still speak only TLS 1.2. The internal ports stay TLS 1.3 only.
fn public_provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = Arc::unwrap_or_clone(provider());
    p.cipher_suites.extend(
        library(crypto())
            .cipher_suites
            .into_iter()
            .filter(|s| s.version().version == rustls::ProtocolVersion::TLSv1_2),
    );
    Arc::new(p)
}

/// Makes the chosen library's provider the process default, which rustls falls back on for a
/// configuration built without one (tonic's client TLS, used by the registry's etcd client). With
/// both libraries compiled in, rustls cannot pick a default by itself. False when a default was
/// already installed.
pub fn install_process_default() -> bool {
    rustls::crypto::CryptoProvider::install_default(Arc::unwrap_or_clone(provider())).is_ok()
}

/// The chosen library's provider, TLS 1.3 suites only, AES-128-GCM first: a KV push is bulk
/// data, and 128-bit AES is about a third cheaper per byte than 256-bit (10 rounds, not 14) at
/// the same GCM cost.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    provider_for(crypto())
}

/// [`provider`] with library `c`.
fn provider_for(c: TlsCrypto) -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
    let mut p = library(c);
    p.cipher_suites
        .retain(|s| s.version().version == rustls::ProtocolVersion::TLSv1_3);
    // Stable: anything after the two AES suites (ChaCha20-Poly1305) keeps the library's order.
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        TLS13_AES_128_GCM_SHA256 => 0,
        TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
    Arc::new(p)
}

/// A process's TLS material, loaded once: its identity and the rustls configurations of its
/// servers and clients.
#[derive(Clone)]
pub struct Tls {
    identity: PeerId,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    peer_name: Option<String>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// Loads `[tls]`.
    ///
    /// # Errors
    /// Unreadable or malformed files, or a certificate without an identity.
    pub fn load(s: &TlsSection) -> Result<Self, TlsError> {
        if let Some(c) = s.crypto {
            set_crypto(c);
        }
        // The first section loaded decides what configurations built without a provider use
        // (tonic's client TLS); later calls change nothing there.
        install_process_default();
        let mut roots = RootCertStore::empty();
        for c in certs(&s.ca)? {
            roots.add(c)?;
        }
        let chain = certs(&s.cert)?;
        let key_pem = read(&s.key)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| pem_error(&s.key, e))?;
        if let Some(n) = s.peer_name.as_deref().filter(|n| !n.is_empty())
            && rustls_pki_types::ServerName::try_from(n).is_err()
        {
            return Err(TlsError::PeerName(n.to_owned()));
        }
        let identity = PeerId::from_cert(&chain[0])
            .ok_or_else(|| TlsError::NoIdentity(s.cert.display().to_string()))?;
        Ok(Self {
            identity,
            roots: Arc::new(roots),
            chain,
            key: Arc::new(key),
            ca_pem: read(&s.ca)?,
            cert_pem: read(&s.cert)?,
            key_pem,
            peer_name: s.peer_name.clone().filter(|n| !n.is_empty()),
        })
    }

    /// Who this process is.
    #[must_use]
    pub fn identity(&self) -> &PeerId {
        &self.identity
    }

    /// A server configuration: TLS 1.3 only, a client certificate chaining to the CA required,
    /// offering `alpn`.
    ///
    /// # Errors
    /// When rustls refuses the key or the CA.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Result<Arc<ServerConfig>, TlsError> {
        self.server_config_on(alpn, provider())
    }

    fn server_config_on(
        &self,
        alpn: &[&[u8]],
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(
            Arc::clone(&self.roots),
            Arc::clone(&provider),
        )
        .build()?;
        let mut c = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())?;
        // Our order (AES-128-GCM first), whatever a client's library prefers.
        c.ignore_client_order = true;
        c.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        Ok(Arc::new(c))
    }

    /// A client configuration: TLS 1.3, this process's certificate, servers verified against
    /// the CA, offering `alpn`.
    ///
    /// # Errors
    /// When rustls refuses the key.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Result<Arc<ClientConfig>, TlsError> {
        self.client_config_on(alpn, provider())
    }

    fn client_config_on(
        &self,
        alpn: &[&[u8]],
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Arc<ClientConfig>, TlsError> {
        let mut c = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(Arc::clone(&self.roots))
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        c.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        Ok(Arc::new(c))
    }

    /// tonic's client TLS settings for a gRPC channel.
    #[must_use]
    pub fn tonic_client(&self) -> tonic::transport::ClientTlsConfig {
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .identity(tonic::transport::Identity::from_pem(
                &self.cert_pem,
                &self.key_pem,
            ))
    }

    pub(crate) fn roots(&self) -> Arc<RootCertStore> {
        Arc::clone(&self.roots)
    }

    pub(crate) fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    pub(crate) fn key(&self) -> &PrivateKeyDer<'static> {
        &self.key
    }

    /// The name engines' certificates are verified against, when configured.
    #[must_use]
    pub fn peer_name(&self) -> Option<&str> {
        self.peer_name.as_deref()
    }
}

/// `[gateway.public_tls]`: the certificate and key of the public HTTPS endpoint (from a public
/// CA; no client certificate is asked for).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublicTls {
    /// The certificate chain.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

impl PublicTls {
    /// A TLS 1.2/1.3 server configuration without client authentication, for HTTP/1.1.
    ///
    /// # Errors
    /// Unreadable or malformed files.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let chain = certs(&self.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&read(&self.key)?)
            .map_err(|e| pem_error(&self.key, e))?;
        let mut c = ServerConfig::builder_with_provider(public_provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(c))
    }
}

/// `N` bytes from the operating system's secure random source, in lowercase hex.
#[must_use]
pub fn random_hex<const N: usize>() -> String {
    let mut b = [0u8; N];
    if rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut b)
        .is_err()
    {
        // No OS randomness at all: fall back to the process's keyed hash, still not a counter.
        for chunk in b.chunks_mut(8) {
            let r = tl_engine_core::rng::entropy_seed().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// `tl certs` never writes over the CA, never follows a planted symlink, creates keys
    /// 0600 from the start, and re-issues only when forced.
    #[cfg(unix)]
    #[test]
    fn issuing_refuses_to_overwrite_or_follow() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("tl-certs-safe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = issue(&dir, "p-1", PeerRole::Prefill, &[]).unwrap();
        let ca_before = std::fs::read(&first.ca).unwrap();
        // The CA's own name is reserved.
        let e = issue(&dir, "ca", PeerRole::Gateway, &[]).unwrap_err();
        assert!(e.to_string().contains("reserved"), "{e}");
        assert_eq!(std::fs::read(&first.ca).unwrap(), ca_before);
        // Private keys are owner-only.
        for k in [&first.key, &dir.join("ca.key")] {
            let mode = std::fs::metadata(k).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", k.display());
        }
        // An existing identity is not re-issued without force.
        let e = issue(&dir, "p-1", PeerRole::Prefill, &[]).unwrap_err();
        assert!(e.to_string().contains("--force"), "{e}");
        let old = std::fs::read(&first.key).unwrap();
        issue_with(&dir, "p-1", PeerRole::Prefill, &[], true).unwrap();
        assert_ne!(std::fs::read(&first.key).unwrap(), old, "forced: a new key");
        // A symlink planted where a key will go is neither followed nor overwritten.
        let target = dir.join("elsewhere");
        std::fs::write(&target, "precious").unwrap();
        std::os::unix::fs::symlink(&target, dir.join("d-9.key")).unwrap();
        assert!(issue(&dir, "d-9", PeerRole::Decode, &[]).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn issued_certificates_carry_their_identity() {
        let dir = std::env::temp_dir().join(format!("tl-tls-{}", std::process::id()));
        let a = issue(&dir, "decode-1", PeerRole::Decode, &["10.0.0.7".into()]).unwrap();
        let b = issue(&dir, "gw", PeerRole::Gateway, &[]).unwrap();
        assert_eq!(a.ca, b.ca, "one CA, made once");
        let tls = Tls::load(&a.section()).unwrap();
        assert_eq!(
            tls.identity(),
            &PeerId {
                role: PeerRole::Decode,
                id: "decode-1".into()
            }
        );
        assert_eq!(
            Tls::load(&b.section()).unwrap().identity().uri(),
            "spiffe://tl/gateway/gw"
        );
        tls.server_config(&[b"h2"]).unwrap();
        tls.client_config(&[b"h2"]).unwrap();
        assert!(issue(&dir, "a/b", PeerRole::Admin, &[]).is_err());
        for bad in [
            "spiffe://tl/king/x",
            "spiffe://other/gateway/x",
            "spiffe://tl/gateway/",
            "spiffe://tl/gateway/a/b",
        ] {
            assert_eq!(PeerId::parse(bad), None, "{bad}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Moves every TLS byte each side has to send to the other until neither has any; the
    /// plaintext the server received meanwhile.
    fn pump(c: &mut rustls::ClientConnection, s: &mut rustls::ServerConnection) -> Vec<u8> {
        use std::io::Read;
        let mut got = Vec::new();
        loop {
            let mut moved = false;
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                moved = true;
                s.read_tls(&mut rd).unwrap();
                s.process_new_packets().unwrap();
                let mut piece = [0u8; 4096];
                while let Ok(n @ 1..) = s.reader().read(&mut piece) {
                    got.extend_from_slice(&piece[..n]);
                }
            }
            buf.clear();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                moved = true;
                c.read_tls(&mut rd).unwrap();
                c.process_new_packets().unwrap();
            }
            if !moved {
                return got;
            }
        }
    }

    /// aws-lc (the default) and ring each serve the other's clients, with mutual certificates,
    /// AES-128-GCM chosen and bytes delivered intact: a fleet can change library engine by
    /// engine.
    #[test]
    fn each_crypto_library_talks_to_the_other() {
        use std::io::Write;
        assert_eq!(crypto(), TlsCrypto::AwsLc, "the default");
        for name in ["aws-lc", "ring"] {
            let c: TlsCrypto = name.parse().unwrap();
            assert_eq!(c.to_string(), name);
        }
        assert!("openssl".parse::<TlsCrypto>().is_err());
        for c in [TlsCrypto::AwsLc, TlsCrypto::Ring] {
            let suites: Vec<_> = provider_for(c)
                .cipher_suites
                .iter()
                .map(|s| s.suite())
                .collect();
            assert_eq!(
                suites[..2],
                [
                    rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
                    rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
                ],
                "{c}"
            );
            assert!(
                provider_for(c)
                    .cipher_suites
                    .iter()
                    .all(|s| s.version().version == rustls::ProtocolVersion::TLSv1_3),
                "{c}: the internal ports speak TLS 1.3 only"
            );
        }
        let dir = std::env::temp_dir().join(format!("tl-tls-libs-{}", std::process::id()));
        let srv = Tls::load(&issue(&dir, "d-1", PeerRole::Decode, &[]).unwrap().section()).unwrap();
        let cli = Tls::load(
            &issue(&dir, "p-1", PeerRole::Prefill, &[])
                .unwrap()
                .section(),
        )
        .unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        for (on_srv, on_cli) in [
            (TlsCrypto::AwsLc, TlsCrypto::Ring),
            (TlsCrypto::Ring, TlsCrypto::AwsLc),
            (TlsCrypto::AwsLc, TlsCrypto::AwsLc),
        ] {
            let sc = srv
                .server_config_on(&[b"h2"], provider_for(on_srv))
                .unwrap();
            let cc = cli
                .client_config_on(&[b"h2"], provider_for(on_cli))
                .unwrap();
            let mut s = rustls::ServerConnection::new(sc).unwrap();
            let mut c = rustls::ClientConnection::new(cc, name.clone()).unwrap();
            pump(&mut c, &mut s);
            assert!(
                !c.is_handshaking() && !s.is_handshaking(),
                "{on_srv} / {on_cli}"
            );
            assert_eq!(
                s.negotiated_cipher_suite().map(|x| x.suite()),
                Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
            );
            // Four records; under rustls's 64 KiB of buffered plaintext.
            let payload: Vec<u8> = (0..60_000u32).map(|i| (i * 7) as u8).collect();
            c.writer().write_all(&payload).unwrap();
            assert_eq!(pump(&mut c, &mut s), payload, "{on_srv} / {on_cli}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The public endpoint serves what its documentation promises: TLS 1.2 clients as well as
    /// 1.3 ones (a client library of the field may still be 1.2-only), each with an AEAD suite.
    #[test]
    fn the_public_endpoint_takes_tls_1_2_and_1_3() {
        let dir = std::env::temp_dir().join(format!("tl-tls-public-{}", std::process::id()));
        let issued = issue(&dir, "gw", PeerRole::Gateway, &[]).unwrap();
        let public = PublicTls {
            cert: issued.cert.clone(),
            key: issued.key.clone(),
        };
        let mut roots = RootCertStore::empty();
        for c in certs(&issued.ca).unwrap() {
            roots.add(c).unwrap();
        }
        let roots = Arc::new(roots);
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
            let cc = ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_protocol_versions(&[version])
            .unwrap()
            .with_root_certificates(Arc::clone(&roots))
            .with_no_client_auth();
            let mut s = rustls::ServerConnection::new(public.server_config().unwrap()).unwrap();
            let mut c = rustls::ClientConnection::new(Arc::new(cc), name.clone()).unwrap();
            pump(&mut c, &mut s);
            assert!(!c.is_handshaking(), "{version:?}");
            assert_eq!(c.protocol_version(), Some(version.version));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `[tls] crypto` names the library; omitted, the section leaves the choice alone; a name
    /// that is neither is refused when the configuration is read.
    #[test]
    fn the_tls_section_names_its_library() {
        let read = |extra: &str| {
            toml::from_str::<TlsSection>(&format!("ca = 'a'\ncert = 'b'\nkey = 'c'\n{extra}"))
        };
        assert_eq!(
            read("crypto = 'ring'").unwrap().crypto,
            Some(TlsCrypto::Ring)
        );
        assert_eq!(
            read("crypto = 'aws-lc'").unwrap().crypto,
            Some(TlsCrypto::AwsLc)
        );
        assert_eq!(read("").unwrap().crypto, None);
        assert!(read("crypto = 'openssl'").is_err());
    }
}
