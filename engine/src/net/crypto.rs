//! The cryptography library under rustls for the whole process (aws-lc by default, or ring),
//! chosen once at start, and secure random bytes.

use std::sync::Arc;

use serde::Deserialize;

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
pub(crate) fn public_provider() -> Arc<rustls::crypto::CryptoProvider> {
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
pub(crate) fn provider_for(c: TlsCrypto) -> Arc<rustls::crypto::CryptoProvider> {
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
