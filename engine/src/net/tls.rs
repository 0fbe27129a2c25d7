//! Mutual TLS between the processes of a deployment: the `[tls]` section, and the rustls and
//! tonic configurations built from it.
//!
//! Every internal port serves TLS 1.3 only and requires a client certificate that chains to the
//! deployment's CA; every outgoing connection presents the process's own certificate and
//! verifies the server against the same CA. Who a peer is lives in [`super::identity`], the
//! library under rustls in [`super::crypto`], and `tl certs` in [`super::certs`]; their names
//! are re-exported here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::Deserialize;

pub use super::certs::{Issued, RESERVED_IDS, issue, issue_with};
pub(crate) use super::crypto::provider;
use super::crypto::public_provider;
pub use super::crypto::{
    TlsCrypto, UnknownTlsCrypto, crypto, install_process_default, random_hex, set_crypto,
};
pub use super::identity::{PeerId, PeerRole, UnknownPeerRole};

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
    #[error(transparent)]
    Role(#[from] super::identity::UnknownPeerRole),
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

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::crypto::provider_for;

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
