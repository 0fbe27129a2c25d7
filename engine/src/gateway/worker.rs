//! A worker as the gateway knows it: its last status and that status's age, and when that age
//! makes it stale. Both the registry (which forgets stale workers) and the planner (which routes
//! over live ones) use it, so it sits below both.

use std::time::Duration;

use kvwire_grpc::pb::control::WorkerStatus;

use crate::net::role::Role;

/// A worker's id as the registry lists it (`WorkerStatus.worker_id`): the key of every map the
/// gateway keeps per engine. Made from a status ([`WorkerId::of`]) or, explicitly, from text
/// ([`WorkerId::new`]); looked up by `&str`.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(String);

impl WorkerId {
    /// The id `status` names: how the gateway learns every id it keys a map by.
    #[must_use]
    pub fn of(status: &WorkerStatus) -> Self {
        Self(status.worker_id.clone())
    }

    /// An id the caller holds as text (an index entry's, a test's).
    #[must_use]
    pub fn new(id: String) -> Self {
        Self(id)
    }

    /// The id as text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for WorkerId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

// A WorkerId hashes and compares as the String it holds, so maps keyed by it are looked up by
// a status's `worker_id` as it is.
impl std::borrow::Borrow<String> for WorkerId {
    fn borrow(&self) -> &String {
        &self.0
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The heartbeat interval a worker that does not say is assumed to use.
pub const DEFAULT_HEARTBEAT_MS: u32 = 2000;

/// Missed beats after which a worker is forgotten.
pub const MISSED_BEATS: u32 = 3;

/// True when a worker's last beat is older than [`MISSED_BEATS`] of its intervals.
#[must_use]
pub fn is_stale(status: &WorkerStatus, age: Duration) -> bool {
    let ms = if status.heartbeat_ms == 0 {
        DEFAULT_HEARTBEAT_MS
    } else {
        status.heartbeat_ms
    };
    age > Duration::from_millis(u64::from(ms) * u64::from(MISSED_BEATS))
}

/// The role `status` takes new work in: its `serving` role when it names one, else its role.
#[must_use]
pub fn serving_role(status: &WorkerStatus) -> Option<Role> {
    if status.serving == 0 {
        Role::from_wire(status.role)
    } else {
        Role::from_wire(status.serving)
    }
}

/// A worker as the registry last heard from it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerView {
    /// Its last status.
    pub status: WorkerStatus,
    /// Time since that beat.
    pub age: Duration,
}

impl WorkerView {
    /// The role it takes new work in now (its `serving` role, else its role); `None` for a
    /// role this gateway does not know (never routed to).
    #[must_use]
    pub fn role(&self) -> Option<Role> {
        serving_role(&self.status)
    }

    pub(super) fn is(&self, role: Role) -> bool {
        self.role() == Some(role)
    }

    /// Where it receives KV (a decode role that advertised its KvTransfer address).
    #[must_use]
    pub fn kv_target(&self) -> Option<&str> {
        let a = &self.status.kv_address;
        (self.role().is_some_and(Role::decodes) && !a.is_empty()).then_some(a.as_str())
    }

    /// Its OpenAI front (a decode role that advertised its HTTP address).
    #[must_use]
    pub fn front(&self) -> Option<&str> {
        let a = &self.status.http_address;
        (self.role().is_some_and(Role::decodes) && !a.is_empty()).then_some(a.as_str())
    }

    /// Can take new work: not draining, not stale.
    pub(super) fn usable(&self) -> bool {
        !self.status.draining && !is_stale(&self.status, self.age)
    }

    pub(super) fn load(&self) -> u32 {
        self.status.queue_depth + self.status.running
    }
}

/// Sets `tl_workers{role}` from the live workers by the role each serves in now, every role
/// reported (0 when none is live).
pub fn workers_by_role(m: &crate::telemetry::metrics::Metrics, live: &[WorkerStatus]) {
    use crate::net::role::Role;
    for role in Role::ALL {
        let n = live
            .iter()
            .filter(|w| serving_role(w) == Some(role))
            .count();
        m.workers
            .get_or_create(&crate::telemetry::metrics::Role {
                role: role.name().to_owned(),
            })
            .set(n as i64);
    }
}
