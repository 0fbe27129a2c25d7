//! A worker's role, and the one conversion between its three spellings: the configuration's
//! [`Role`], the registry's `tl.control.v1.Role` (an `i32` on the wire), and the certificate's
//! [`PeerRole`] (whose gateway and admin roles are not workers).

use kvwire_grpc::pb::control::Role as PbRole;
use serde::Deserialize;

use super::tls::PeerRole;

/// What an engine does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs prompts and ships their KV.
    Prefill,
    /// Receives KV and generates.
    Decode,
    /// Both, in one process (also serves colocated requests).
    #[default]
    Both,
}

impl Role {
    /// True for prefill and both.
    #[must_use]
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// True for decode and both.
    #[must_use]
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    /// The contract's role strings: `prefill`, `decode`, or both of them.
    #[must_use]
    pub fn names(self) -> Vec<String> {
        let mut v = Vec::new();
        if self.prefills() {
            v.push("prefill".to_owned());
        }
        if self.decodes() {
            v.push("decode".to_owned());
        }
        v
    }
}

/// A role name that is not `prefill`, `decode` or `both`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("role {0:?}: expected prefill, decode or both")]
pub struct UnknownRole(pub String);

impl std::str::FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, UnknownRole> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => Err(UnknownRole(other.to_owned())),
        }
    }
}

impl Role {
    /// Every worker role.
    pub const ALL: [Role; 3] = [Role::Prefill, Role::Decode, Role::Both];

    /// `prefill`, `decode` or `both`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// The role a registry entry's `role` field names, if it names one.
    #[must_use]
    pub fn from_wire(role: i32) -> Option<Role> {
        Role::ALL
            .into_iter()
            .find(|r| PbRole::from(*r) as i32 == role)
    }
}

impl From<Role> for PbRole {
    fn from(r: Role) -> Self {
        match r {
            Role::Prefill => PbRole::Prefill,
            Role::Decode => PbRole::Decode,
            Role::Both => PbRole::Both,
        }
    }
}

impl From<Role> for PeerRole {
    fn from(r: Role) -> Self {
        match r {
            Role::Prefill => PeerRole::Prefill,
            Role::Decode => PeerRole::Decode,
            Role::Both => PeerRole::Both,
        }
    }
}

impl TryFrom<PeerRole> for Role {
    type Error = PeerRole;

    /// The worker role a certificate's role registers as; gateway and admin are none.
    fn try_from(p: PeerRole) -> Result<Self, PeerRole> {
        Role::ALL
            .into_iter()
            .find(|r| PeerRole::from(*r) == p)
            .ok_or(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_spellings_agree() {
        for r in Role::ALL {
            assert_eq!(r.name().parse::<Role>(), Ok(r));
            assert_eq!(Role::from_wire(PbRole::from(r) as i32), Some(r));
            assert_eq!(Role::try_from(PeerRole::from(r)), Ok(r));
            assert_eq!(PeerRole::from(r).as_str(), r.name());
        }
        assert_eq!(Role::from_wire(PbRole::Unspecified as i32), None);
        assert_eq!(Role::from_wire(99), None);
        assert_eq!(Role::try_from(PeerRole::Gateway), Err(PeerRole::Gateway));
        assert_eq!(Role::try_from(PeerRole::Admin), Err(PeerRole::Admin));
    }
}
