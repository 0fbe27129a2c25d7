//! The worker registry on etcd v3: a small client of etcd's gRPC API (the messages are
//! hand-written in [`kvwire_grpc::etcd`], no codegen), the keys of a deployment, drain requests,
//! and the users and roles that keep each identity to its own keys. The engine's registration
//! is `node::registrar`, the gateway's mirror `gateway::mirror`: both use this module, and it
//! uses neither.
//!
//! | job | file |
//! |---|---|
//! | `[registry]`: endpoints, prefix, `stale_ms` | [`RegistrySection`] |
//! | the client: endpoints tried in turn, every call bounded | [`client`] |
//! | drain requests, and an engine's watch on its own | [`drain`] |
//! | users and roles (`tl etcd init`, `tl etcd grant`) | [`auth`] |
//! | etcd members started by tests and drills | [`member`] |

pub mod auth;
pub mod client;
pub mod drain;
pub mod member;

use serde::Deserialize;

use crate::net::role::Role;

pub use self::client::{Etcd, EtcdError};

/// `[registry]`: where the worker registry lives. No endpoints: the gateway's own in-process
/// registry, which engines beat to (`[engine] gateway_registry`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistrySection {
    /// etcd's client URLs (`https://host:port`, or `http://` without `[tls]`); empty: none.
    pub etcd_endpoints: Vec<String>,
    /// The key prefix every key of this deployment lives under.
    pub prefix: String,
    /// How long a gateway routes on its last snapshot when it cannot reach etcd; after that it
    /// knows no engine until etcd answers again.
    pub stale_ms: u64,
    /// Lets an engine register on an etcd whose auth is off. Off (the default), the engine
    /// refuses: with auth off any identity may write any worker's key, and the first to run
    /// `auth enable` becomes etcd's superuser. For tests and private single-host setups.
    pub allow_no_auth: bool,
}

impl Default for RegistrySection {
    fn default() -> Self {
        Self {
            etcd_endpoints: Vec::new(),
            prefix: DEFAULT_PREFIX.to_owned(),
            stale_ms: DEFAULT_STALE_MS,
            allow_no_auth: false,
        }
    }
}

impl RegistrySection {
    /// True when the registry is on etcd.
    #[must_use]
    pub fn on_etcd(&self) -> bool {
        !self.etcd_endpoints.is_empty()
    }

    /// Parses `--etcd-endpoints URL[,URL...]`.
    pub fn set_endpoints(&mut self, list: &str) {
        self.etcd_endpoints = list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
    }
}

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "/tl";
/// The default `stale_ms`.
pub const DEFAULT_STALE_MS: u64 = 15_000;

/// The keys of one deployment.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (a trailing `/` is dropped).
    #[must_use]
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.trim_end_matches('/').to_owned(),
        }
    }

    /// Every worker's key starts with this.
    #[must_use]
    pub fn workers(&self) -> String {
        format!("{}/workers/", self.prefix)
    }

    /// The key of worker `id`'s status, under the role it registers as. The role is part of
    /// the key so that etcd's permissions bind it: an engine's certificate may write only the
    /// key of its own role and id, and a gateway lists a key only with the role it names.
    #[must_use]
    pub fn worker(&self, role: Role, id: &str) -> String {
        format!("{}/workers/{}/{id}", self.prefix, role.name())
    }

    /// The role and id a worker key names, or `None` for a key that is not one.
    #[must_use]
    pub fn worker_of<'k>(&self, key: &'k str) -> Option<(Role, &'k str)> {
        let rest = key.strip_prefix(&self.workers())?;
        let (role, id) = rest.split_once('/')?;
        Some((role.parse().ok()?, id))
    }

    /// A key no identity but a superuser may read once auth is on: reading it tells whether
    /// auth is on ([`auth::is_on`]).
    #[must_use]
    pub fn auth_probe(&self) -> String {
        format!("{}/auth-probe", self.prefix)
    }

    /// Every drain key starts with this.
    #[must_use]
    pub fn drains(&self) -> String {
        format!("{}/drain/", self.prefix)
    }

    /// The key that asks worker `id` to drain.
    #[must_use]
    pub fn drain(&self, id: &str) -> String {
        format!("{}/drain/{id}", self.prefix)
    }
}
