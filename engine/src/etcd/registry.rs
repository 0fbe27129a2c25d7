//! The registry on etcd: an engine's side ([`EtcdRegistrar`], which the heartbeat loop drives
//! as it drives a beat to the gateway) and a gateway's side ([`mirror`], which keeps the
//! gateway's [`RegistryState`] equal to what etcd holds).
//!
//! An engine holds a lease of three beats, keeps its `WorkerStatus` (protobuf bytes) under
//! `<prefix>/workers/<role>/<id>` attached to it, and writes it again only when it changed, at most
//! once a beat. A key written by an admin or a gateway under `<prefix>/drain/<id>` asks it to
//! drain. A dead engine's key goes with its lease; a gateway learns it from its watch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvwire_grpc::etcd::{EVENT_DELETE, EVENT_PUT, KeyValue};
use kvwire_grpc::pb::control::{HeartbeatAck, WorkerStatus};
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::{Etcd, Keys};
use crate::gateway::registry::RegistryState;
use crate::net::role::Role;
use crate::node::heartbeat::Registry;

/// The lease TTL for a beat interval: three beats, in whole seconds, at least one.
#[must_use]
pub fn lease_ttl_s(heartbeat_ms: u32) -> i64 {
    (u64::from(heartbeat_ms) * 3).div_ceil(1000).max(1) as i64
}

#[derive(Debug, Default)]
struct Lease {
    id: i64,
    /// Left the registry: no beat registers again.
    left: bool,
    /// The status bytes last written under this lease.
    written: Option<Vec<u8>>,
}

/// An engine's registration on etcd.
#[derive(Debug)]
pub struct EtcdRegistrar {
    etcd: Arc<Etcd>,
    keys: Keys,
    ttl_s: i64,
    lease: tokio::sync::Mutex<Lease>,
    require_auth: bool,
}

impl EtcdRegistrar {
    /// Registers through `etcd` under `keys`, with a lease of three `heartbeat_ms`.
    #[must_use]
    pub fn new(etcd: Arc<Etcd>, keys: Keys, heartbeat_ms: u32) -> Self {
        Self {
            etcd,
            keys,
            ttl_s: lease_ttl_s(heartbeat_ms),
            lease: tokio::sync::Mutex::new(Lease::default()),
            require_auth: true,
        }
    }

    /// Registers on an etcd whose auth is off too (`[registry] allow_no_auth`); by default
    /// every new registration first checks that auth is on, and fails with
    /// FAILED_PRECONDITION when it is not.
    #[must_use]
    pub fn allow_no_auth(mut self, allow: bool) -> Self {
        self.require_auth = !allow;
        self
    }

    /// Renews the lease, takes a new one when it is gone, writes the status when it changed,
    /// and reads the drain key.
    async fn beat(&self, status: WorkerStatus) -> Result<HeartbeatAck, Status> {
        let mut l = self.lease.lock().await;
        if l.left {
            return Err(Status::unavailable("this engine has left the registry"));
        }
        if l.id != 0 && self.etcd.keep_alive_once(l.id).await? <= 0 {
            tracing::warn!(lease = l.id, "the registry lease expired; registering anew");
            *l = Lease::default();
        }
        let role = Role::from_wire(status.role).ok_or_else(|| {
            Status::invalid_argument(format!(
                "worker role {} is not a registry role",
                status.role
            ))
        })?;
        let key = self.keys.worker(role, &status.worker_id);
        if l.id == 0 {
            if self.require_auth && !super::auth::is_on(&self.etcd, &self.keys).await? {
                return Err(super::auth::off_refused(&self.etcd.endpoints()));
            }
            // One id, one live process: a key another address holds under a live lease is
            // left alone until that lease ends (three missed beats of the other process).
            if let Some(kv) = self.etcd.get(&key).await?
                && let Ok(other) = WorkerStatus::decode(kv.value.as_ref())
                && kv.lease != 0
                && (&other.grpc_address, &other.http_address, &other.kv_address)
                    != (
                        &status.grpc_address,
                        &status.http_address,
                        &status.kv_address,
                    )
            {
                return Err(Status::already_exists(format!(
                    "worker {:?} is live at {}; another address may register it only after its \
                     lease ends",
                    status.worker_id, other.grpc_address
                )));
            }
            l.id = self.etcd.lease_grant(self.ttl_s).await?;
        }
        let bytes = status.encode_to_vec();
        if l.written.as_deref() != Some(bytes.as_slice()) {
            l.written = None;
            self.etcd
                .put(&key, Bytes::from(bytes.clone()), l.id)
                .await?;
            l.written = Some(bytes);
        }
        drop(l);
        let drain = self
            .etcd
            .get(&self.keys.drain(&status.worker_id))
            .await?
            .is_some_and(|kv| !kv.value.is_empty());
        Ok(HeartbeatAck { drain })
    }

    /// Ends the registration at once (the key goes with the lease).
    ///
    /// # Errors
    /// etcd's status.
    pub async fn leave(&self) -> Result<(), Status> {
        let mut l = self.lease.lock().await;
        l.left = true;
        if l.id != 0 {
            self.etcd.lease_revoke(l.id).await?;
            l.id = 0;
            l.written = None;
        }
        Ok(())
    }
}

impl Registry for EtcdRegistrar {
    fn heartbeat(
        &self,
        status: WorkerStatus,
    ) -> impl std::future::Future<Output = Result<HeartbeatAck, Status>> + Send {
        self.beat(status)
    }
}

/// Asks worker `id` to drain (or withdraws the request): what an admin or a gateway writes.
///
/// # Errors
/// etcd's status (PERMISSION_DENIED for an engine's certificate).
pub async fn set_drain(etcd: &Etcd, keys: &Keys, id: &str, drain: bool) -> Result<(), Status> {
    if drain {
        etcd.put(&keys.drain(id), Bytes::from_static(b"1"), 0)
            .await?;
    } else {
        etcd.delete(&keys.drain(id)).await?;
    }
    Ok(())
}

/// Watches worker `id`'s drain key until it is written, then calls `on_drain` (once) and
/// returns; a lost watch is opened again. The heartbeat also reads the key at every beat: this
/// makes a drain request take effect at once instead of at the next beat.
pub async fn watch_drain(
    etcd: Arc<Etcd>,
    keys: Keys,
    id: String,
    on_drain: impl Fn() + Send,
    stop: CancellationToken,
) {
    let key = keys.drain(&id);
    let asked = async || -> Result<(), Status> {
        // The watch first, then the read: a write between the two is seen by one of them.
        let mut w = etcd.watch_key(&key).await?;
        if etcd.get(&key).await?.is_some_and(|kv| !kv.value.is_empty()) {
            return Ok(());
        }
        loop {
            let r = w
                .next()
                .await?
                .ok_or_else(|| Status::unavailable("etcd ended the watch"))?;
            if r.canceled {
                return Err(Status::aborted(r.cancel_reason));
            }
            let written = r.events.iter().any(|e| {
                e.r#type == EVENT_PUT && e.kv.as_ref().is_some_and(|kv| !kv.value.is_empty())
            });
            if written {
                return Ok(());
            }
        }
    };
    loop {
        tokio::select! {
            r = asked() => match r {
                Ok(()) => {
                    on_drain();
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "drain watch lost; opening it again"),
            },
            () = stop.cancelled() => return,
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// A worker's status as read from its key: `None` (and a warning) for one that does not
/// decode, that names another worker or another role than its key, or that breaks the
/// registry's bounds. The key's role is the one etcd let the writer's certificate write, so a
/// status that claims another role is not listed.
fn status_of(keys: &Keys, kv: &KeyValue) -> Option<WorkerStatus> {
    let key = String::from_utf8_lossy(&kv.key);
    let listed = keys.worker_of(&key);
    let s = WorkerStatus::decode(kv.value.as_ref()).ok();
    match (listed, s) {
        (Some((role, id)), Some(s))
            if s.worker_id == id
                && Role::from_wire(s.role) == Some(role)
                && RegistryState::within_bounds(&s).is_ok() =>
        {
            Some(s)
        }
        _ => {
            tracing::warn!(key = %key, "ignoring a worker key whose value is not its own status");
            None
        }
    }
}

/// Keeps `state` equal to the workers etcd holds under `keys`, until `stop`: reads them all,
/// then follows a watch from that revision. A quiet watch is asked for progress every second
/// and counts as lost when no answer comes within the client's timeout; a lost watch or a
/// compaction reads everything again. While etcd cannot be reached the state keeps its last
/// snapshot, for `stale_ms` (the state's own bound).
pub async fn mirror(
    etcd: Arc<Etcd>,
    keys: Keys,
    state: Arc<RegistryState>,
    stop: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        let r = tokio::select! {
            r = follow(&etcd, &keys, &state, &mut failures) => r,
            () = stop.cancelled() => return,
        };
        failures += 1;
        if let Err(e) = r {
            tracing::warn!(code = ?e.code(), error = e.message(), failures, "lost the etcd watch; reading the workers again");
        }
        let wait = Duration::from_millis(100 * u64::from(failures.min(10)));
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return,
        }
    }
}

async fn follow(
    etcd: &Etcd,
    keys: &Keys,
    state: &RegistryState,
    failures: &mut u32,
) -> Result<(), Status> {
    let (kvs, rev) = etcd.get_prefix(&keys.workers()).await?;
    let now = Instant::now();
    state.mirror_replace(
        kvs.iter().filter_map(|kv| status_of(keys, kv)).collect(),
        now,
    );
    let mut watch = etcd.watch(&keys.workers(), rev + 1).await?;
    *failures = 0;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut asked: Option<Instant> = None;
    loop {
        tokio::select! {
            m = watch.next() => {
                let r = m?.ok_or_else(|| Status::unavailable("etcd ended the watch"))?;
                if r.canceled || r.compact_revision != 0 {
                    return Err(Status::aborted(format!("watch cancelled: {}", r.cancel_reason)));
                }
                let now = Instant::now();
                for ev in &r.events {
                    let Some(kv) = &ev.kv else { continue };
                    match ev.r#type {
                        EVENT_PUT => {
                            if let Some(s) = status_of(keys, kv) {
                                state.mirror_put(s, now);
                            }
                        }
                        EVENT_DELETE => {
                            let key = String::from_utf8_lossy(&kv.key);
                            if let Some((_, id)) = keys.worker_of(&key) {
                                state.mirror_remove(id);
                            }
                        }
                        _ => {}
                    }
                }
                state.mirror_synced(now);
                asked = None;
            }
            _ = tick.tick() => match asked {
                Some(t) if t.elapsed() > etcd.timeout() => {
                    return Err(Status::deadline_exceeded("etcd did not answer a progress request"));
                }
                Some(_) => {}
                None => {
                    watch.request_progress().await?;
                    asked = Some(Instant::now());
                }
            },
        }
    }
}
