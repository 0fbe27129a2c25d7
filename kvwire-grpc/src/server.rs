//! The `tl.kv.v1.KvTransfer` service over a [`KvReceiver`], and [`serve_kv`] to run it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::body::Body;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Status, Streaming};

use crate::glue::{self, Dispatch, Handler, Limits, ResponseFuture, Routes};
use crate::pb::kv::{
    HasBlocksRequest, HasBlocksResponse, KvChunk, ReleaseRequest, ReleaseResponse, path,
};
use crate::receiver::KvReceiver;

/// The `KvTransfer` service: moves messages into the receiver and its errors out as statuses.
#[derive(Clone, Debug)]
pub struct KvTransferService {
    rx: Arc<KvReceiver>,
    limits: Limits,
}

impl KvTransferService {
    /// Serves `rx`; messages up to one envelope of the receiver's block shape (at least 4 MiB)
    /// are accepted.
    #[must_use]
    pub fn new(rx: Arc<KvReceiver>) -> Self {
        let envelope = rx
            .store()
            .shape()
            .envelope_len(1)
            .unwrap_or(usize::MAX - 4096);
        Self {
            limits: Limits {
                // One envelope plus the chunk's fields; HasBlocks for a long prompt can be
                // larger than a small block, so never below tonic's 4 MiB default.
                max_decode: (envelope + 4096).max(4 << 20),
                max_encode: 4 << 20,
            },
            rx,
        }
    }

    /// The message limits in force.
    #[must_use]
    pub fn limits(&self) -> Limits {
        self.limits
    }
}

impl Routes for KvTransferService {
    const NAME: &'static str = path::SERVICE;
    const ROUTES: &'static [(&'static str, Handler<Self>)] = &[
        (path::HAS_BLOCKS, Self::has_blocks),
        (path::PUSH_KV, Self::push_kv),
        (path::RELEASE, Self::release),
    ];
}

impl KvTransferService {
    fn has_blocks(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let rx = Arc::clone(&self.rx);
        glue::serve_unary(req, self.limits, move |m: HasBlocksRequest| async move {
            let present = rx.has_blocks(&m.hashes, m.kv_format, &m.model)?;
            Ok(HasBlocksResponse { present })
        })
    }

    fn push_kv(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let rx = Arc::clone(&self.rx);
        glue::serve_client_streaming(
            req,
            self.limits,
            move |mut s: Streaming<KvChunk>| async move {
                // Dropping `push` on any early return (refusal, broken stream, cancelled call)
                // undoes what it imported.
                let mut push = rx.begin_push();
                while let Some(chunk) = s.message().await? {
                    push.accept(chunk)?;
                }
                Ok(push.finish()?)
            },
        )
    }

    fn release(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let rx = Arc::clone(&self.rx);
        glue::serve_unary(req, self.limits, move |m: ReleaseRequest| async move {
            Ok::<_, Status>(ReleaseResponse {
                released: rx.release(&m.handle_id),
            })
        })
    }

    /// The tower service to hand to a tonic server.
    #[must_use]
    pub fn into_service(self) -> Dispatch<Self> {
        Dispatch::new(Arc::new(self))
    }
}

/// HTTP/2 settings for servers that receive multi-MiB messages.
#[must_use]
pub fn tuned_server() -> Server {
    Server::builder()
        .initial_stream_window_size(32 << 20)
        .initial_connection_window_size(64 << 20)
        .max_frame_size(Some((1 << 24) - 1))
        .http2_adaptive_window(Some(false))
}

/// Releases expired leases of `rx` every quarter lease (10 ms to 1 s) until `stop` fires.
pub async fn sweep_leases(rx: Arc<KvReceiver>, stop: CancellationToken) {
    let tick = (rx.lease() / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut every = tokio::time::interval(tick);
    loop {
        tokio::select! {
            _ = every.tick() => {
                rx.expire_leases(Instant::now());
            }
            () = stop.cancelled() => return,
        }
    }
}

/// A running `KvTransfer` server: the server and its lease sweeper, stopped together.
#[derive(Debug)]
pub struct KvServerHandle {
    addr: SocketAddr,
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl KvServerHandle {
    /// The address actually bound.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets calls in flight finish, and waits for the server and the sweeper.
    pub async fn shutdown(self) {
        self.stop.cancel();
        self.tasks.wait().await;
    }
}

impl Drop for KvServerHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Serves `rx` on `listener` (bind `127.0.0.1:0` for tests), releasing expired leases in the
/// background, until the handle is shut down or dropped.
///
/// # Errors
/// When the listener has no local address.
pub fn serve_kv(listener: TcpListener, rx: Arc<KvReceiver>) -> std::io::Result<KvServerHandle> {
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let svc = KvTransferService::new(Arc::clone(&rx)).into_service();
    let server = tuned_server()
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned());
    tasks.spawn(async move {
        // The only error is the listener failing; the caller sees the port go dead.
        let _ = server.await;
    });
    tasks.spawn(sweep_leases(rx, stop.clone()));
    tasks.close();
    Ok(KvServerHandle { addr, stop, tasks })
}
