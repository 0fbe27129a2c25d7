//! The `tl.kv.v1.KvTransfer` service over a [`KvReceiver`], and [`serve_kv`] to run it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Status, Streaming};

use crate::glue::{self, Limits, ResponseFuture};
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

impl NamedService for KvTransferService {
    const NAME: &'static str = path::SERVICE;
}

impl tower_service::Service<http::Request<Body>> for KvTransferService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> ResponseFuture {
        let rx = Arc::clone(&self.rx);
        match req.uri().path() {
            path::HAS_BLOCKS => {
                glue::serve_unary(req, self.limits, move |m: HasBlocksRequest| async move {
                    let present = rx.has_blocks(&m.hashes, m.kv_format, &m.model)?;
                    Ok(HasBlocksResponse { present })
                })
            }
            path::PUSH_KV => glue::serve_client_streaming(
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
            ),
            path::RELEASE => {
                glue::serve_unary(req, self.limits, move |m: ReleaseRequest| async move {
                    Ok::<_, Status>(ReleaseResponse {
                        released: rx.release(&m.handle_id),
                    })
                })
            }
            other => glue::unimplemented(other),
        }
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

/// A running `KvTransfer` server.
#[derive(Debug)]
pub struct KvServerHandle {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    join: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    sweeper: JoinHandle<()>,
}

impl KvServerHandle {
    /// The address actually bound.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets calls in flight finish, and waits for the server to end.
    ///
    /// # Errors
    /// The server's own transport error, if it had one.
    pub async fn shutdown(mut self) -> Result<(), tonic::transport::Error> {
        self.sweeper.abort();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.join.take() {
            Some(j) => j.await.unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}

impl Drop for KvServerHandle {
    fn drop(&mut self) {
        self.sweeper.abort();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Serves `rx` on `listener` (bind `127.0.0.1:0` for tests), releasing expired leases in the
/// background.
///
/// # Errors
/// When the listener has no local address.
pub fn serve_kv(listener: TcpListener, rx: Arc<KvReceiver>) -> std::io::Result<KvServerHandle> {
    let addr = listener.local_addr()?;
    let (tx, stop) = oneshot::channel::<()>();
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let svc = KvTransferService::new(Arc::clone(&rx));
    let server = tuned_server()
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop.await;
        });
    let join = tokio::spawn(server);
    let tick = (rx.lease() / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let sweeper = tokio::spawn(async move {
        let mut every = tokio::time::interval(tick);
        loop {
            every.tick().await;
            rx.expire_leases(Instant::now());
        }
    });
    Ok(KvServerHandle {
        addr,
        shutdown: Some(tx),
        join: Some(join),
        sweeper,
    })
}
