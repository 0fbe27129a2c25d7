//! Drain requests on etcd: what an admin or a gateway writes under `<prefix>/drain/<id>`, and
//! the engine's watch on its own key.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvwire_grpc::etcd::EVENT_PUT;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::{Etcd, Keys};

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
