//! Who a peer is: the one `spiffe://tl/ROLE/ID` URI SAN of its certificate ([`PeerId`]), and
//! the roles a deployment knows ([`PeerRole`]). What a peer may call is decided by its role.

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

/// A role name that is not gateway, prefill, decode, both, admin or etcd.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("role {0:?}: expected gateway, prefill, decode, both or admin")]
pub struct UnknownPeerRole(pub String);

impl std::str::FromStr for PeerRole {
    type Err = UnknownPeerRole;

    fn from_str(s: &str) -> Result<Self, UnknownPeerRole> {
        PeerRole::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownPeerRole(s.to_owned()))
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
