//! Starting and stopping servers and long-lived tasks, one way for every process: a
//! [`Lifecycle`] is a cancellation token that every task watches and a tracker that knows when
//! they have all finished (tokio-util's `CancellationToken` and `TaskTracker`).
//!
//! Both server kinds take an optional TLS configuration (mutual TLS on internal ports, see
//! [`super::tls`]); TLS handshakes run in tasks of their own under a deadline, so a peer that
//! connects and says nothing holds no accept slot. The HTTP server also bounds how long request
//! headers may take, and on stop gives open connections a short grace before closing them, so
//! a stalled client cannot keep a process alive.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use kvwire_grpc::H2Limits;
use kvwire_grpc::glue::{Dispatch, Routes};
use kvwire_grpc::server::tuned_server;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use super::unproven::{Entry, Unproven};
use kvwire_grpc::socket::{Capped, READ_CAP, TLS_READ_AHEAD};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

use super::tls::PeerId;

/// The tasks of one process (or one node inside a test process) and their stop signal.
#[derive(Clone, Debug, Default)]
pub struct Lifecycle {
    stop: CancellationToken,
    /// Fired before `stop` for an abrupt end: no grace for what is in flight.
    abort: CancellationToken,
    tasks: TaskTracker,
}

impl Lifecycle {
    /// A lifecycle with no task yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The stop signal every task watches.
    #[must_use]
    pub fn token(&self) -> &CancellationToken {
        &self.stop
    }

    /// A guard that fires the stop signal when dropped (a node dropped without a shutdown still
    /// stops its servers).
    #[must_use]
    pub fn guard(&self) -> DropGuard {
        self.stop.clone().drop_guard()
    }

    /// Runs `task` until it ends; it must end soon after [`token`](Self::token) fires.
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// The signal of [`abort`](Self::abort): what a long stream watches to end at once, as a
    /// killed process's would.
    #[must_use]
    pub fn aborted(&self) -> CancellationToken {
        self.abort.clone()
    }

    /// Stops as a killed process would, as far as peers can tell: connections in flight are
    /// cut at once instead of given [`STOP_GRACE`]. For failover tests in one process.
    pub async fn abort(&self) {
        self.abort.cancel();
        self.shutdown().await;
    }

    /// Fires the stop signal and waits until every task has ended.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Binds `addr`, naming it in the error.
///
/// # Errors
/// When the address cannot be bound.
pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("bind {addr}: {e}")))
}

/// A loopback port that is free now, for a server another process will bind later (an etcd
/// member, a registry started after its engines). It lies below the kernel's ephemeral range.
/// A port bound at `:0` and freed comes from that range, so any connection opened in between
/// may take it as its source port, and the later bind then fails with `EADDRINUSE`. Below the
/// range only an explicit bind can take it.
///
/// # Errors
/// When no port between 10000 and the range's start can be bound.
pub fn free_loopback_port() -> std::io::Result<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = low.saturating_sub(10_000).max(1);
    // Calls in one process start 7919 ports apart (modulo the span), processes apart by their
    // ids; then each walks the span once.
    let start = std::process::id().wrapping_add(next_probe()) % u32::from(span);
    for i in 0..u32::from(span) {
        let port = 10_000 + ((start + i) % u32::from(span)) as u16;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return Ok(l.local_addr()?.port());
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free loopback port in 10000..{low}"),
    ))
}

/// A different starting point for each call in this process (several members in a row).
fn next_probe() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    NEXT.fetch_add(7919, std::sync::atomic::Ordering::Relaxed)
}

/// How long a TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS handshakes in progress per listener: a peer that opens connections and says nothing
/// holds one slot each for at most [`HANDSHAKE_TIMEOUT`]; beyond this, the oldest handshake in
/// progress is closed to admit the new connection.
pub const MAX_HANDSHAKES: usize = 256;

/// TLS handshakes in progress one source address may hold; beyond this, its own oldest is
/// closed: a flood from one address displaces only itself.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 64;

/// Open connections per HTTP listener; beyond this, the oldest connection that has not yet
/// delivered a whole request is closed to admit a new one (and the new one is refused only
/// when every open connection has).
pub const MAX_HTTP_CONNECTIONS: usize = 4096;

/// How long open connections get to finish after the stop signal before they are closed.
pub const STOP_GRACE: Duration = Duration::from_millis(500);

/// Accepts connections on `listener` and completes their TLS handshakes in tasks of their own
/// (each under [`HANDSHAKE_TIMEOUT`]), yielding the finished streams until `stop` fires.
fn tls_incoming(
    life: &Lifecycle,
    listener: TcpListener,
    tls: Arc<ServerConfig>,
) -> mpsc::Receiver<(TlsStream<Capped>, SocketAddr)> {
    let (tx, rx) = mpsc::channel(64);
    let acceptor = TlsAcceptor::from(tls);
    let stop = life.token().clone();
    life.spawn(async move {
        let mut handshakes = JoinSet::new();
        // Every handshake in progress is unproven: at the cap the oldest goes, and one source
        // holds at most its share.
        let pending = Arc::new(Unproven::default());
        let mut entries = std::collections::HashMap::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((tcp, peer)) = accepted else { continue };
                    let full = pending.len() >= MAX_HANDSHAKES;
                    if !pending.make_room(peer.ip(), MAX_HANDSHAKES_PER_SOURCE, full) {
                        continue; // dropping `tcp` closes it
                    }
                    let _ = tcp.set_nodelay(true);
                    let (acceptor, tx) = (acceptor.clone(), tx.clone());
                    let handle = handshakes.spawn(async move {
                        if let Ok(Ok(mut tls)) = tokio::time::timeout(
                            HANDSHAKE_TIMEOUT,
                            acceptor.accept(Capped::new(tcp, READ_CAP, usize::MAX)),
                        )
                        .await
                        {
                            // Only a peer that proved its certificate gets the buffer.
                            tls.get_mut().0.read_ahead(TLS_READ_AHEAD);
                            let _ = tx.send((tls, peer)).await;
                        }
                    });
                    entries.insert(handle.id(), pending.enter(peer.ip(), handle));
                }
                Some(done) = handshakes.join_next_with_id() => {
                    let id = match done {
                        Ok((id, ())) => id,
                        Err(e) => e.id(),
                    };
                    entries.remove(&id);
                }
                () = stop.cancelled() => return,
            }
        }
    });
    rx
}

/// Serves one hand-written gRPC service on `listener` until `life` stops, over mutual TLS when
/// `tls` is given, within the HTTP/2 bounds `h2`; calls in flight get [`STOP_GRACE`] to finish.
///
/// # Errors
/// When the listener has no local address.
pub fn serve_grpc<S: Routes>(
    life: &Lifecycle,
    listener: TcpListener,
    svc: Dispatch<S>,
    tls: Option<Arc<ServerConfig>>,
    h2: H2Limits,
) -> std::io::Result<SocketAddr> {
    serve_router(life, listener, tuned_server(h2).add_service(svc), tls)
}

/// Serves the services of `router` (several hand-written services on one port) as
/// [`serve_grpc`] serves one.
///
/// # Errors
/// When the listener has no local address.
pub fn serve_router(
    life: &Lifecycle,
    listener: TcpListener,
    router: tonic::transport::server::Router,
    tls: Option<Arc<ServerConfig>>,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let stop = life.token().clone();
    let graceful = graceful_stop(stop.clone());
    match tls {
        None => {
            let incoming = kvwire_grpc::socket::capped_incoming(listener);
            let server = router.serve_with_incoming_shutdown(incoming, graceful);
            life.spawn(bounded_stop(stop, addr, server));
        }
        Some(tls) => {
            let incoming = ReceiverStream::new(tls_incoming(life, listener, tls));
            let incoming =
                tokio_stream::StreamExt::map(incoming, |(s, _)| Ok::<_, std::io::Error>(s));
            let server = router.serve_with_incoming_shutdown(incoming, graceful);
            life.spawn(bounded_stop(stop, addr, server));
        }
    }
    Ok(addr)
}

/// Resolves when `stop` fires: the signal for a server's graceful shutdown.
async fn graceful_stop(stop: CancellationToken) {
    stop.cancelled().await;
}

/// Runs a server until it ends, or until [`STOP_GRACE`] after `stop`, whichever comes first.
async fn bounded_stop<E: std::fmt::Display>(
    stop: CancellationToken,
    addr: SocketAddr,
    server: impl Future<Output = Result<(), E>>,
) {
    tokio::pin!(server);
    let res = tokio::select! {
        r = &mut server => r,
        () = async { stop.cancelled().await; tokio::time::sleep(STOP_GRACE).await } => Ok(()),
    };
    if let Err(e) = res {
        tracing::error!(%addr, error = %e, "grpc server stopped");
    }
}

/// Limits of an HTTP server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Request headers must arrive within this.
    pub header_read: Duration,
    /// The whole request, body included, must arrive within this (408 and the connection
    /// closed beyond): a trickled body holds nothing for long.
    pub request_read: Duration,
    /// The largest body read (413 beyond).
    pub max_body: usize,
    /// Connections one source address may hold at once; more are closed on accept.
    pub per_ip: usize,
    /// Connections open at once ([`MAX_HTTP_CONNECTIONS`] by default).
    pub max_conns: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(10),
            request_read: Duration::from_secs(30),
            max_body: 2 << 20,
            per_ip: 64,
            max_conns: MAX_HTTP_CONNECTIONS,
        }
    }
}

/// Connections open per source address.
#[derive(Debug, Default)]
struct PerIp(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One connection's place in [`PerIp`], given back on drop.
struct IpSlot(Arc<PerIp>, std::net::IpAddr);

impl PerIp {
    fn take(self: &Arc<Self>, ip: std::net::IpAddr, cap: usize) -> Option<IpSlot> {
        let mut m = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = m.entry(ip).or_default();
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(IpSlot(Arc::clone(self), ip))
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut m = self
            .0
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// Who is calling an HTTP server: its address, and its identity when it presented a client
/// certificate. Every request carries it as an extension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The peer's address.
    pub addr: SocketAddr,
    /// The peer's certificate identity (mutual TLS only).
    pub peer: Option<PeerId>,
}

/// Serves an axum app on `listener` (HTTP/1.1) until `life` stops, over TLS when `tls` is given
/// (requiring client certificates if that configuration does). Each request carries a
/// [`Caller`] extension. On stop, responses in flight get [`STOP_GRACE`], then connections are
/// closed.
///
/// # Errors
/// When the listener has no local address.
pub fn serve_http(
    life: &Lifecycle,
    listener: TcpListener,
    app: axum::Router,
    tls: Option<Arc<ServerConfig>>,
    limits: HttpLimits,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let stop = life.token().clone();
    let abort = life.abort.clone();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let acceptor = tls.map(TlsAcceptor::from);
    let per_ip = Arc::new(PerIp::default());
    // Connections over a source's share being answered 429 at once.
    let refusing = Arc::new(tokio::sync::Semaphore::new(REFUSALS_AT_ONCE));
    // Connections that have not yet delivered a whole request, oldest first.
    let unproven = Arc::new(Unproven::default());
    life.spawn(async move {
        let graceful = GracefulShutdown::new();
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((tcp, peer)) = accepted else { continue };
                    // One source cannot take every connection: beyond its share, a plain
                    // HTTP connection is told 429 with Retry-After (read a little, answered,
                    // closed, within a second, a bounded number at once), so a client under
                    // load is asked to come back rather than dropped; beyond that bound, or
                    // over TLS, closed.
                    let Some(slot) = per_ip.take(peer.ip(), limits.per_ip) else {
                        if acceptor.is_none()
                            && let Ok(turn) = Arc::clone(&refusing).try_acquire_owned()
                        {
                            conns.spawn(async move {
                                let _turn = turn;
                                let _ = tokio::time::timeout(
                                    REFUSAL_TIME,
                                    refuse_busy(tcp),
                                )
                                .await;
                            });
                        }
                        continue; // dropping `tcp` closes it
                    };
                    // Each connection is bounded in time (header reads, TLS handshakes); this
                    // bounds how many there are. At the cap, the oldest connection that has
                    // not yet delivered a request makes way; only when every one has is the
                    // newcomer closed.
                    let full = conns.len() >= limits.max_conns;
                    if !unproven.make_room(peer.ip(), usize::MAX, full) {
                        continue;
                    }
                    let proof: Proof = Arc::default();
                    // Server-sent events are many small writes: without TCP_NODELAY, Nagle's
                    // algorithm and the peer's delayed ACK hold each one back for ~40 ms.
                    let _ = tcp.set_nodelay(true);
                    let (app, http, watcher, acceptor) =
                        (app.clone(), http.clone(), graceful.watcher(), acceptor.clone());
                    let mine = Arc::clone(&proof);
                    let handle = conns.spawn(async move {
                        let _slot = slot;
                        let conn = Conn { app, http, watcher, limits, proof: mine };
                        match acceptor {
                            None => conn.serve(tcp, Caller { addr: peer, peer: None }).await,
                            Some(acceptor) => {
                                let Ok(Ok(tls)) =
                                    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                                else {
                                    return;
                                };
                                let id = tls
                                    .get_ref()
                                    .1
                                    .peer_certificates()
                                    .and_then(|c| c.first())
                                    .and_then(|c| PeerId::from_cert(c));
                                conn.serve(tls, Caller { addr: peer, peer: id }).await;
                            }
                        }
                    });
                    *lock(&proof) = Some(unproven.enter(peer.ip(), handle));
                }
                Some(_) = conns.join_next() => {}
                () = stop.cancelled() => break,
            }
        }
        // Stop accepting; let responses in flight end, then close what is left (dropping the
        // set aborts its tasks). An abort closes them at once.
        if !abort.is_cancelled() {
            let _ = tokio::time::timeout(STOP_GRACE, graceful.shutdown()).await;
        }
        drop(conns);
    });
    Ok(addr)
}

/// Connections over a source's share answered 429 at once, at most (beyond: closed).
const REFUSALS_AT_ONCE: usize = 64;
/// The longest one such answer takes, reading included.
const REFUSAL_TIME: Duration = Duration::from_secs(1);

/// Answers a plain HTTP connection over its source's share: reads what the client has sent
/// (at most 64 KiB, so that closing does not reset the answer away), then 429 with
/// `Retry-After` in OpenAI's error shape, and closes.
async fn refuse_busy(mut tcp: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.set_nodelay(true);
    let mut buf = vec![0u8; 64 << 10];
    let mut got = 0;
    // Until the headers' end, a pause, or the buffer's end.
    while got < buf.len() {
        match tokio::time::timeout(Duration::from_millis(200), tcp.read(&mut buf[got..])).await {
            Ok(Ok(n)) if n > 0 => {
                got += n;
                if buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                    // The body, if any, follows at once: one more short read.
                    let _ =
                        tokio::time::timeout(Duration::from_millis(50), tcp.read(&mut buf[got..]))
                            .await;
                    break;
                }
            }
            _ => break,
        }
    }
    let body = serde_json::json!({"error": {
        "message": "too many connections from this address at once; retry",
        "type": "rate_limit", "code": 429,
    }})
    .to_string();
    let head = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = tcp.write_all(head.as_bytes()).await;
    let _ = tcp.write_all(body.as_bytes()).await;
    let _ = tcp.shutdown().await;
}

/// A refusal before the app saw the request, in OpenAI's error shape; the connection closes.
fn refusal(status: http::StatusCode, message: &str) -> axum::response::Response {
    use axum::response::IntoResponse;
    let body = serde_json::json!({
        "error": { "message": message, "type": "invalid_request_error", "code": status.as_u16() }
    });
    let mut r = (status, axum::Json(body)).into_response();
    r.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    r
}

/// A connection's place among the unproven ones, until its first whole request.
type Proof = Arc<std::sync::Mutex<Option<Entry>>>;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One accepted HTTP connection's server side.
struct Conn {
    app: axum::Router,
    http: hyper::server::conn::http1::Builder,
    watcher: hyper_util::server::graceful::Watcher,
    limits: HttpLimits,
    proof: Proof,
}

impl Conn {
    /// Serves requests on `io` until the peer closes it (or the stop grace ends), each carrying
    /// `caller`.
    async fn serve<I>(self, io: I, caller: Caller)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (app, limits, proof) = (self.app, self.limits, self.proof);
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let mut app = app.clone();
            let caller = caller.clone();
            let proof = Arc::clone(&proof);
            async move {
                // The body, whole, within the request's deadline and its size bound: a client
                // that trickles it holds the connection no longer than that.
                use http_body_util::BodyExt;
                let (mut parts, body) = req.into_parts();
                // A body that says it is over the bound is refused before a byte of it is read.
                let declared = parts
                    .headers
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok());
                if declared.is_some_and(|n| n > limits.max_body as u64) {
                    return Ok(refusal(
                        http::StatusCode::PAYLOAD_TOO_LARGE,
                        "request body too large",
                    ));
                }
                let limited = http_body_util::Limited::new(body, limits.max_body);
                let body = match tokio::time::timeout(limits.request_read, limited.collect()).await
                {
                    Ok(Ok(b)) => b.to_bytes(),
                    Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                        return Ok(refusal(
                            http::StatusCode::PAYLOAD_TOO_LARGE,
                            "request body too large",
                        ));
                    }
                    Ok(Err(_)) => {
                        return Ok(refusal(
                            http::StatusCode::BAD_REQUEST,
                            "the request body broke off",
                        ));
                    }
                    Err(_) => {
                        return Ok(refusal(
                            http::StatusCode::REQUEST_TIMEOUT,
                            "the request did not arrive in time",
                        ));
                    }
                };
                // A whole request arrived: no longer among the first to be closed at the cap.
                lock(&proof).take();
                parts.extensions.insert(caller);
                let req = http::Request::from_parts(parts, axum::body::Body::from(body));
                tower_service::Service::call(&mut app, req).await
            }
        });
        let _ = self
            .watcher
            .watch(self.http.serve_connection(TokioIo::new(io), svc))
            .await;
    }
}
