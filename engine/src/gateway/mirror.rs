//! A gateway's view of the registry on etcd: [`mirror`] keeps the gateway's [`RegistryState`]
//! equal to the workers etcd holds, from a read and then a watch. A status is listed only under
//! the role and id its key names, which etcd lets only that identity write.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_grpc::etcd::{EVENT_DELETE, EVENT_PUT, KeyValue};
use kvwire_grpc::pb::control::WorkerStatus;
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::registry::RegistryState;
use crate::etcd::{Etcd, Keys};
use crate::net::role::Role;

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
                            if let Some((role, id)) = keys.worker_of(&key) {
                                let role = kvwire_grpc::pb::control::Role::from(role) as i32;
                                state.mirror_remove_as(id, role);
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
