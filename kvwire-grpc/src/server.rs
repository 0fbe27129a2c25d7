//! The `tl.kv.v1.KvTransfer` service over a [`KvReceiver`], and [`serve_kv`] to run it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use tonic::body::Body;
use tonic::transport::Server;

use crate::frames::{self, RequestStream};
use crate::glue::{self, Dispatch, Handler, MessageLimits, ResponseFuture, Routes};
use crate::lane::ImportLane;
use crate::pb::kv::{
    HasBlocksRequest, HasBlocksResponse, KvAck, KvChunk, ReleaseRequest, ReleaseResponse, path,
};
use crate::receiver::{KvReceiver, PushState};

/// Deadlines and message limits of the `KvTransfer` service (spec/limits.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceLimits {
    /// A push stream with no chunk for this long is undone (DEADLINE_EXCEEDED).
    pub push_idle: Duration,
    /// One whole push may take this long; then it is undone (DEADLINE_EXCEEDED).
    pub push_deadline: Duration,
    /// A block whose store has no room ([`KvStore::room`](crate::KvStore::room)) waits up to
    /// this long for it before the push is refused (RESOURCE_EXHAUSTED); zero refuses at once.
    pub import_wait: Duration,
    /// Largest HasBlocks and Release message (OUT_OF_RANGE beyond, before it is read).
    pub small_message: usize,
}

impl Default for ServiceLimits {
    fn default() -> Self {
        Self {
            push_idle: Duration::from_secs(10),
            push_deadline: Duration::from_secs(60),
            import_wait: Duration::from_secs(1),
            small_message: 1 << 20,
        }
    }
}

/// Told of every push's outcome on the receiving side (for metrics): an accepted push with its
/// ack and how long it took from the call to the ack, or a refusal with its code.
pub trait PushObserver: Send + Sync + std::fmt::Debug {
    /// The push was accepted and is held under its handle.
    fn accepted(&self, ack: &KvAck, took: Duration);
    /// The push was refused or broken, and undone.
    fn refused(&self, code: tonic::Code);
    /// Any call (HasBlocks, PushKv, Release) begins; called inside its span, if it has one.
    fn serving(&self) {}
}

/// The `KvTransfer` service: moves messages into the receiver and its errors out as statuses.
#[derive(Clone, Debug)]
pub struct KvTransferService {
    rx: Arc<KvReceiver>,
    push: MessageLimits,
    small: MessageLimits,
    timeouts: ServiceLimits,
    observer: Option<Arc<dyn PushObserver>>,
    lane: Option<ImportLane>,
}

impl KvTransferService {
    /// Serves `rx` with the default [`ServiceLimits`]: a push message holds one envelope of the
    /// receiver's block shape (plus the chunk's fields).
    #[must_use]
    pub fn new(rx: Arc<KvReceiver>) -> Self {
        Self::with_limits(rx, ServiceLimits::default())
    }

    /// Serves `rx` with these limits.
    #[must_use]
    pub fn with_limits(rx: Arc<KvReceiver>, limits: ServiceLimits) -> Self {
        let envelope = rx
            .store()
            .shape()
            .envelope_len(1)
            .unwrap_or(usize::MAX - 4096);
        Self {
            push: MessageLimits {
                max_decode: envelope.saturating_add(4096),
                max_encode: 4096,
            },
            small: MessageLimits {
                max_decode: limits.small_message,
                max_encode: limits.small_message,
            },
            timeouts: limits,
            rx,
            observer: None,
            lane: None,
        }
    }

    fn serving(&self) {
        if let Some(o) = &self.observer {
            o.serving();
        }
    }

    /// Tells `observer` of every push's outcome.
    #[must_use]
    pub fn observed(mut self, observer: Arc<dyn PushObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Checks and copies large chunks into the store on `lane`'s threads instead of on the
    /// async workers (see [`ImportLane`]); without a lane they run in place, with the worker's
    /// other tasks handed to another thread first (`block_in_place`).
    #[must_use]
    pub fn with_import_lane(mut self, lane: ImportLane) -> Self {
        self.lane = Some(lane);
        self
    }

    /// The message limits of PushKv, and of HasBlocks and Release.
    #[must_use]
    pub fn limits(&self) -> (MessageLimits, MessageLimits) {
        (self.push, self.small)
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
        self.serving();
        let rx = Arc::clone(&self.rx);
        glue::serve_unary(req, self.small, move |m: HasBlocksRequest| async move {
            let present = rx.has_blocks(&m)?;
            Ok(HasBlocksResponse { present })
        })
    }

    fn push_kv(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        self.serving();
        let rx = Arc::clone(&self.rx);
        let t = self.timeouts;
        let observer = self.observer.clone();
        let lane = self.lane.clone();
        let owner = push_owner(&req);
        frames::serve_client_streaming(
            req,
            self.push,
            move |s: RequestStream<KvChunk>| async move {
                let started = Instant::now();
                let r = Self::receive(rx, t, s, owner, lane).await;
                if let Some(o) = &observer {
                    match &r {
                        Ok(ack) => o.accepted(ack, started.elapsed()),
                        Err(status) => o.refused(status.code()),
                    }
                }
                r
            },
        )
    }

    /// One push, from its first chunk to its ack.
    async fn receive(
        rx: Arc<KvReceiver>,
        t: ServiceLimits,
        mut s: RequestStream<KvChunk>,
        owner: Vec<u8>,
        lane: Option<ImportLane>,
    ) -> Result<KvAck, Status> {
        // Counted (and refused when too many) before a byte of it is read. Dropping
        // `push` on any early return (refusal, broken stream, cancelled call, a
        // deadline) undoes what it imported.
        let mut push = rx.begin_push_from(owner)?;
        let whole = async move {
            loop {
                let next = tokio::time::timeout(t.push_idle, s.message())
                    .await
                    .map_err(|_| {
                        Status::deadline_exceeded(format!(
                            "no chunk for {:?}: the push is undone",
                            t.push_idle
                        ))
                    })?;
                match next? {
                    Some(chunk) => {
                        if !chunk.payload.is_empty() {
                            wait_for_room(&rx, chunk.cache_scope, t.import_wait).await;
                        }
                        push = import(lane.as_ref(), push, chunk).await?;
                    }
                    None => return Ok::<_, Status>(push),
                }
            }
        };
        let push = tokio::time::timeout(t.push_deadline, whole)
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "the push took longer than {:?}: it is undone",
                    t.push_deadline
                ))
            })??;
        Ok(push.finish()?)
    }

    fn release(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        self.serving();
        let rx = Arc::clone(&self.rx);
        glue::serve_unary(req, self.small, move |m: ReleaseRequest| async move {
            Ok::<_, Status>(ReleaseResponse {
                released: rx.release(&m.handle_id),
            })
        })
    }

    /// The tower service to hand to a tonic server (beside your own services, with your own
    /// TLS and authorization: [`Dispatch::with_auth`](crate::glue::Dispatch::with_auth)).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvwire::Shape;
    /// use kvwire_grpc::memory::MemStore;
    /// use kvwire_grpc::server::tuned_server;
    /// use kvwire_grpc::{H2Limits, KvReceiver, KvTransferService, ServiceLimits};
    ///
    /// let rx = Arc::new(KvReceiver::new(Arc::new(MemStore::new(Shape::v1(4, 2, 1, 4), 8)), "fake"));
    /// let svc = KvTransferService::with_limits(rx, ServiceLimits::default()).into_service();
    /// let _router = tuned_server(H2Limits::default()).add_service(svc);
    /// // ... .serve_with_incoming_shutdown(incoming, stop) in your runtime.
    /// ```
    #[must_use]
    pub fn into_service(self) -> Dispatch<Self> {
        Dispatch::new(Arc::new(self))
    }
}

/// The small calls of a [`KvTransferService`], HasBlocks and Release, without PushKv: for a
/// port other than the KV port, served on other threads, so that a lookup never waits for a core
/// an import holds. The service name and messages are KvTransfer's; PushKv there answers
/// UNIMPLEMENTED. A decode engine serves it beside EngineControl, on its control threads.
///
/// ```
/// use std::sync::Arc;
/// use kvwire::Shape;
/// use kvwire_grpc::memory::MemStore;
/// use kvwire_grpc::server::tuned_server;
/// use kvwire_grpc::{H2Limits, KvReceiver, KvTransferService};
///
/// let rx = Arc::new(KvReceiver::new(Arc::new(MemStore::new(Shape::v1(4, 2, 1, 4), 8)), "fake"));
/// let lookups = KvTransferService::new(rx).lookups().into_service();
/// let _router = tuned_server(H2Limits::default()).add_service(lookups);
/// ```
#[derive(Clone, Debug)]
pub struct KvLookups(Arc<KvTransferService>);

impl KvTransferService {
    /// HasBlocks and Release of this service (same receiver, limits and observer), for
    /// another port.
    #[must_use]
    pub fn lookups(&self) -> KvLookups {
        KvLookups(Arc::new(self.clone()))
    }
}

impl Routes for KvLookups {
    const NAME: &'static str = path::SERVICE;
    const ROUTES: &'static [(&'static str, Handler<Self>)] = &[
        (path::HAS_BLOCKS, |s, req| s.0.has_blocks(req)),
        (path::RELEASE, |s, req| s.0.release(req)),
    ];
}

impl KvLookups {
    /// The tower service to hand to a tonic server.
    #[must_use]
    pub fn into_service(self) -> Dispatch<Self> {
        Dispatch::new(Arc::new(self))
    }
}

/// Waits, up to `wait`, until the store has room for a block in `scope`, asking again every
/// 2 ms (each ask tells the store a block is waiting, so its owner can make room); the import
/// that follows finds the room, or is refused as before.
async fn wait_for_room(rx: &KvReceiver, scope: u64, wait: Duration) {
    let until = Instant::now() + wait;
    while !rx.store().room(scope) && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Chunks at least this large are checked and imported off the async scheduler.
const OFFLOAD_BYTES: usize = 64 << 10;

/// Accepts one chunk, giving the push back when it was accepted (dropping it on a refusal
/// undoes the push). A large chunk's checksum and copy into the store (a few hundred
/// microseconds for 2 MiB) run on the import lane when there is one; otherwise in place on
/// this thread, with the worker's other tasks handed to another thread first
/// (`block_in_place`), so HasBlocks and control calls never queue behind an import in tokio's
/// run queue. On a current-thread runtime without a lane (tests) it simply runs.
async fn import(
    lane: Option<&ImportLane>,
    mut push: PushState,
    chunk: KvChunk,
) -> Result<PushState, Status> {
    if chunk.payload.len() >= OFFLOAD_BYTES {
        if let Some(lane) = lane {
            let (push, r) = lane
                .run(move || {
                    let r = push.accept(chunk);
                    (push, r)
                })
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            r?;
            return Ok(push);
        }
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi {
            tokio::task::block_in_place(|| push.accept(chunk))?;
            return Ok(push);
        }
    }
    push.accept(chunk)?;
    Ok(push)
}

/// HTTP/2 bounds of a server (spec/limits.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2Limits {
    /// Streams one connection may have open at once.
    pub max_streams: u32,
    /// Ping an idle connection this often...
    pub keepalive: Duration,
    /// ...and close it when a ping is not answered within this.
    pub keepalive_timeout: Duration,
}

impl Default for H2Limits {
    fn default() -> Self {
        Self {
            max_streams: 128,
            keepalive: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(20),
        }
    }
}

/// Who pushes, for the per-peer bounds: the client certificate over mutual TLS (one prefill
/// identity however many connections it opens), else the remote address.
fn push_owner(req: &http::Request<Body>) -> Vec<u8> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = req.extensions();
    if let Some(tls) = ext.get::<TlsConnectInfo<TcpConnectInfo>>()
        && let Some(cert) = tls.peer_certs().and_then(|c| c.first().cloned())
    {
        return cert.as_ref().to_vec();
    }
    let addr = ext
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|t| t.get_ref().remote_addr())
        .or_else(|| {
            ext.get::<TcpConnectInfo>()
                .and_then(TcpConnectInfo::remote_addr)
        });
    addr.map(|a| a.ip().to_string().into_bytes())
        .unwrap_or_default()
}

/// HTTP/2 settings for servers that receive multi-MiB messages, with these bounds: a peer that
/// vanishes is found by keepalive and its connection (and pushes) closed.
#[must_use]
pub fn tuned_server(h2: H2Limits) -> Server {
    Server::builder()
        .initial_stream_window_size(32 << 20)
        .initial_connection_window_size(64 << 20)
        .max_frame_size(Some((1 << 24) - 1))
        .http2_adaptive_window(Some(false))
        .max_concurrent_streams(Some(h2.max_streams))
        .http2_keepalive_interval(Some(h2.keepalive))
        .http2_keepalive_timeout(Some(h2.keepalive_timeout))
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
/// A decode side on loopback and a real gRPC transfer to it:
///
/// ```
/// use std::sync::Arc;
/// use kvwire::Shape;
/// use kvwire_grpc::memory::MemStore;
/// use kvwire_grpc::{BlockKey, GrpcTransport, KvReceiver, KvStore, Push, TransportConfig, serve_kv, transfer};
///
/// # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
/// let shape = Shape::v1(4, 2, 1, 4);
/// let decode = Arc::new(MemStore::new(shape, 8));
/// let rx = Arc::new(KvReceiver::new(Arc::clone(&decode) as Arc<dyn KvStore>, "fake"));
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
/// let server = serve_kv(listener, Arc::clone(&rx)).unwrap();
///
/// let prefill = Arc::new(MemStore::new(shape, 8));
/// let id = prefill.put(BlockKey::ANON, 3, &vec![1u8; shape.payload_bytes().unwrap()]).unwrap();
/// let transport = GrpcTransport::new(TransportConfig::for_envelope(shape.envelope_len(1).unwrap()));
/// let target = server.local_addr().to_string();
/// let store = Arc::clone(&prefill) as Arc<dyn KvStore>;
/// let push = Push {
///     target: &target, handle_id: "h", model: "fake", hashes: &[], n_blocks: 1, known: None, lookup: None,
///     tokens: &[1, 2, 3], scope: 0,
/// };
/// let stats = transfer(&transport, store, push, &[id]).await.unwrap();
/// assert_eq!(stats.sent, 1);
/// assert!(rx.claim("h").is_some());
/// server.shutdown().await;
/// # });
/// ```
///
/// # Errors
/// When the listener has no local address.
pub fn serve_kv(listener: TcpListener, rx: Arc<KvReceiver>) -> std::io::Result<KvServerHandle> {
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    let incoming = crate::socket::capped_incoming(listener);
    let svc = KvTransferService::new(Arc::clone(&rx)).into_service();
    let server = tuned_server(H2Limits::default())
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
