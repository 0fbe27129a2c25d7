//! An engine's registration on etcd ([`EtcdRegistrar`], which the heartbeat loop drives as it
//! drives a beat to the gateway's own registry).
//!
//! An engine holds a lease of three beats, keeps its `WorkerStatus` (protobuf bytes) under
//! `<prefix>/workers/<role>/<id>` attached to it, and writes it again only when it changed, at
//! most once a beat. A dead engine's key goes with its lease. The key names the role, and etcd
//! grants an engine's certificate only its own role's key ([`crate::etcd::auth`]).

use std::sync::Arc;

use bytes::Bytes;
use kvwire_grpc::pb::control::{HeartbeatAck, WorkerStatus};
use prost::Message;
use tonic::Status;

use super::heartbeat::Registry;
use crate::etcd::{Etcd, Keys, auth};
use crate::net::role::Role;

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
            if self.require_auth && !auth::is_on(&self.etcd, &self.keys).await? {
                return Err(auth::off_refused(&self.etcd.endpoints()));
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
