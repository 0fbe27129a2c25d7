//! The tonic plumbing that generated code would otherwise contain, written once.
//!
//! - A server is a [`Routes`] implementation: its service name and one table of
//!   (method path, handler). [`Dispatch`] turns it into the tower service tonic serves; each
//!   handler answers with [`serve_unary`], [`crate::frames::serve_client_streaming`] or
//!   [`serve_server_streaming`] and a closure.
//! - A client builds its channel from [`endpoint`] and calls [`unary`], [`client_streaming`] or
//!   [`server_streaming`] with the method path, bounded by [`bounded`].

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::PathAndQuery;
use tokio_stream::Stream;
use tonic::body::Body;
use tonic::server::{Grpc, NamedService, ServerStreamingService, UnaryService};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

/// The future a hand-written service returns for one HTTP request.
pub type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

/// Message size limits of one method, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageLimits {
    /// Largest message decoded.
    pub max_decode: usize,
    /// Largest message encoded.
    pub max_encode: usize,
}

impl Default for MessageLimits {
    /// tonic's own defaults: 4 MiB decoded, unbounded encoded.
    fn default() -> Self {
        Self {
            max_decode: 4 << 20,
            max_encode: usize::MAX,
        }
    }
}

/// One method's handler: the service state and the HTTP request in, the response out.
pub type Handler<S> = fn(&Arc<S>, http::Request<Body>) -> ResponseFuture;

/// A gRPC service written by hand: its name and its routing table, read in one place.
pub trait Routes: Send + Sync + 'static {
    /// The fully qualified service name (`package.Service`).
    const NAME: &'static str;
    /// Every method: its path (`/package.Service/Method`) and its handler.
    const ROUTES: &'static [(&'static str, Handler<Self>)];
}

/// Who may call what: consulted by [`Dispatch`] before any handler runs, so a server's
/// authorization is decided in one place. It may attach what it learned (the caller's identity)
/// to the request's extensions for the handler.
pub trait Authorize: Send + Sync + 'static {
    /// `Ok` to let the call through.
    ///
    /// # Errors
    /// The status to answer instead (PERMISSION_DENIED, UNAUTHENTICATED).
    fn authorize(&self, path: &str, req: &mut http::Request<Body>) -> Result<(), Status>;
}

/// The tower service tonic serves for a [`Routes`] implementation: asks the [`Authorize`] policy
/// (when one is set), looks the request's path up in the table, and answers UNIMPLEMENTED for any
/// other.
pub struct Dispatch<S> {
    state: Arc<S>,
    auth: Option<Arc<dyn Authorize>>,
}

/// Trace context across calls, set once per process by whoever owns tracing (this crate does
/// not name a tracing backend): `inject` writes the current span's context into an outgoing
/// call's headers; `server_span` makes the span an incoming call of `path` runs in, a child of
/// the context its headers carry.
#[derive(Clone, Copy, Debug)]
pub struct Propagation {
    /// Adds the current trace context (W3C `traceparent`) to outgoing headers.
    pub inject: fn(&mut http::HeaderMap),
    /// The span for an incoming call, or `None` for none.
    pub server_span: fn(&str, &http::HeaderMap) -> Option<tracing::Span>,
}

static PROPAGATION: std::sync::OnceLock<Propagation> = std::sync::OnceLock::new();

/// Sets the process's [`Propagation`]; `false` when one was set already (the first stays).
pub fn set_propagation(p: Propagation) -> bool {
    PROPAGATION.set(p).is_ok()
}

/// Writes the current trace context into `headers` when a [`Propagation`] is set.
pub fn inject_context(headers: &mut http::HeaderMap) {
    if let Some(p) = PROPAGATION.get() {
        (p.inject)(headers);
    }
}

impl<S> std::fmt::Debug for Dispatch<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatch")
            .field("authorized", &self.auth.is_some())
            .finish_non_exhaustive()
    }
}

impl<S> Dispatch<S> {
    /// Serves `state`, letting every caller through.
    #[must_use]
    pub fn new(state: Arc<S>) -> Self {
        Self { state, auth: None }
    }

    /// Checks every call with `auth` first.
    #[must_use]
    pub fn with_auth(mut self, auth: Option<Arc<dyn Authorize>>) -> Self {
        self.auth = auth;
        self
    }

    /// The state behind the service.
    #[must_use]
    pub fn state(&self) -> &Arc<S> {
        &self.state
    }
}

impl<S> Clone for Dispatch<S> {
    fn clone(&self) -> Self {
        Self {
            state: Arc::clone(&self.state),
            auth: self.auth.clone(),
        }
    }
}

impl<S: Routes> NamedService for Dispatch<S> {
    const NAME: &'static str = S::NAME;
}

impl<S: Routes> tower_service::Service<http::Request<Body>> for Dispatch<S> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: http::Request<Body>) -> ResponseFuture {
        let path = req.uri().path().to_owned();
        let Some((_, handler)) = S::ROUTES.iter().find(|(p, _)| *p == path) else {
            return unimplemented(&path);
        };
        if let Some(auth) = &self.auth
            && let Err(status) = auth.authorize(&path, &mut req)
        {
            let resp = status.into_http();
            return Box::pin(async move { Ok(resp) });
        }
        let span = PROPAGATION
            .get()
            .and_then(|p| (p.server_span)(&path, req.headers()));
        match span {
            Some(span) => {
                use tracing::Instrument;
                let _entered = span.enter();
                let fut = handler(&self.state, req);
                drop(_entered);
                Box::pin(fut.instrument(span))
            }
            None => handler(&self.state, req),
        }
    }
}

/// The endpoint of a gRPC peer at `addr` (`host:port`), connecting lazily with TCP_NODELAY
/// (small control messages must not wait for Nagle) and `connect_timeout`; over TLS with `tls`
/// (then the peer's certificate must be valid for the address's host).
///
/// # Errors
/// INVALID_ARGUMENT when `addr` is not a `host:port`.
pub fn endpoint(
    addr: &str,
    connect_timeout: Duration,
    tls: Option<&ClientTlsConfig>,
) -> Result<Endpoint, Status> {
    let bad =
        |e: &dyn std::fmt::Display| Status::invalid_argument(format!("address {addr:?}: {e}"));
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| bad(&e))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true);
    if let Some(tls) = tls {
        ep = ep.tls_config(tls.clone()).map_err(|e| bad(&e))?;
    }
    Ok(ep)
}

struct UnaryFn<F>(F);

impl<Req, Resp, F, Fut> UnaryService<Req> for UnaryFn<F>
where
    F: FnMut(Request<Req>) -> Fut,
    Fut: Future<Output = Result<Response<Resp>, Status>>,
{
    type Response = Resp;
    type Future = Fut;

    fn call(&mut self, request: Request<Req>) -> Fut {
        (self.0)(request)
    }
}

struct ServerStreamingFn<F>(F);

impl<Req, Resp, S, F, Fut> ServerStreamingService<Req> for ServerStreamingFn<F>
where
    F: FnMut(Request<Req>) -> Fut,
    Fut: Future<Output = Result<Response<S>, Status>>,
    S: Stream<Item = Result<Resp, Status>> + Send + 'static,
{
    type Response = Resp;
    type ResponseStream = S;
    type Future = Fut;

    fn call(&mut self, request: Request<Req>) -> Fut {
        (self.0)(request)
    }
}

/// A handler's answer, boxed so one adapter serves every method kind.
type Answer<Resp> = Pin<Box<dyn Future<Output = Result<Response<Resp>, Status>> + Send>>;

/// Adapts a one-shot `handler` of the request body to the `FnMut` tonic's service traits want
/// (tonic calls it once per HTTP request).
fn once<In, Resp, F, Fut>(handler: F) -> impl FnMut(Request<In>) -> Answer<Resp>
where
    In: Send + 'static,
    F: FnOnce(In) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
{
    let mut handler = Some(handler);
    move |r: Request<In>| {
        let h = handler.take();
        Box::pin(async move {
            match h {
                Some(h) => h(r.into_inner()).await.map(Response::new),
                None => Err(Status::internal("handler called twice")),
            }
        })
    }
}

/// The server side of one call, with `limits` on both directions.
fn server<Req, Resp>(limits: MessageLimits) -> Grpc<ProstCodec<Resp, Req>>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
{
    Grpc::new(ProstCodec::<Resp, Req>::default())
        .max_decoding_message_size(limits.max_decode)
        .max_encoding_message_size(limits.max_encode)
}

/// Answers one unary call with `handler`.
pub fn serve_unary<Req, Resp, F, Fut>(
    req: http::Request<Body>,
    limits: MessageLimits,
    handler: F,
) -> ResponseFuture
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: FnOnce(Req) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
{
    Box::pin(async move {
        let svc = UnaryFn(once(handler));
        Ok(server::<Req, Resp>(limits).unary(svc, req).await)
    })
}

/// Answers one server-streaming call with `handler`, whose stream is the response.
pub fn serve_server_streaming<Req, Resp, S, F, Fut>(
    req: http::Request<Body>,
    limits: MessageLimits,
    handler: F,
) -> ResponseFuture
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    S: Stream<Item = Result<Resp, Status>> + Send + 'static,
    F: FnOnce(Req) -> Fut + Send + 'static,
    Fut: Future<Output = Result<S, Status>> + Send + 'static,
{
    Box::pin(async move {
        let svc = ServerStreamingFn(once(handler));
        Ok(server::<Req, Resp>(limits).server_streaming(svc, req).await)
    })
}

/// The answer to a path no method matches.
pub fn unimplemented(path: &str) -> ResponseFuture {
    let resp = Status::unimplemented(format!("no method {path}")).into_http();
    Box::pin(async move { Ok(resp) })
}

fn client(channel: Channel, limits: MessageLimits) -> tonic::client::Grpc<Channel> {
    tonic::client::Grpc::new(channel)
        .max_decoding_message_size(limits.max_decode)
        .max_encoding_message_size(limits.max_encode)
}

/// A client of `channel` once it is ready for a call, and `req` carrying the trace context.
async fn ready<Req>(
    channel: Channel,
    limits: MessageLimits,
    mut req: Request<Req>,
) -> Result<(tonic::client::Grpc<Channel>, Request<Req>), Status> {
    inject_context(req.metadata_mut().as_mut());
    let mut grpc = client(channel, limits);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    Ok((grpc, req))
}

/// Calls a unary method.
///
/// # Errors
/// The server's status, or UNAVAILABLE when the channel cannot be used.
pub async fn unary<Req, Resp>(
    channel: Channel,
    path: &'static str,
    limits: MessageLimits,
    req: Request<Req>,
) -> Result<Resp, Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let (mut grpc, req) = ready(channel, limits, req).await?;
    let codec = ProstCodec::<Req, Resp>::default();
    grpc.unary(req, PathAndQuery::from_static(path), codec)
        .await
        .map(Response::into_inner)
}

/// Calls a server-streaming method; the answer is the server's stream.
///
/// # Errors
/// As [`unary`].
pub async fn server_streaming<Req, Resp>(
    channel: Channel,
    path: &'static str,
    limits: MessageLimits,
    req: Request<Req>,
) -> Result<Streaming<Resp>, Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let (mut grpc, req) = ready(channel, limits, req).await?;
    let codec = ProstCodec::<Req, Resp>::default();
    grpc.server_streaming(req, PathAndQuery::from_static(path), codec)
        .await
        .map(Response::into_inner)
}

/// Calls a client-streaming method with the messages of `stream`.
///
/// # Errors
/// As [`unary`].
pub async fn client_streaming<S, Req, Resp>(
    channel: Channel,
    path: &'static str,
    limits: MessageLimits,
    req: Request<S>,
) -> Result<Resp, Status>
where
    S: Stream<Item = Req> + Send + 'static,
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    client_streaming_with(
        channel,
        path,
        limits,
        req,
        ProstCodec::<Req, Resp>::default(),
    )
    .await
}

/// Calls a client-streaming method with a codec of the caller's (one that encodes a message
/// without first building it, say).
///
/// # Errors
/// As [`unary`].
pub async fn client_streaming_with<S, C>(
    channel: Channel,
    path: &'static str,
    limits: MessageLimits,
    req: Request<S>,
    codec: C,
) -> Result<C::Decode, Status>
where
    S: Stream<Item = C::Encode> + Send + 'static,
    C: tonic::codec::Codec,
    C::Encode: Send + Sync + 'static,
    C::Decode: Send + Sync + 'static,
{
    let mut req = req;
    inject_context(req.metadata_mut().as_mut());
    let mut grpc = client(channel, limits);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    grpc.client_streaming(req, PathAndQuery::from_static(path), codec)
        .await
        .map(Response::into_inner)
}

/// Runs a call within `limit`, answering DEADLINE_EXCEEDED after it. A connection that failed
/// (refused, reset, closed under the call) surfaces from tonic as UNKNOWN or CANCELLED with a
/// transport error as its source; it is reported as UNAVAILABLE, the code that tells a caller
/// to try again or elsewhere. A CANCELLED that a server sent stays CANCELLED.
///
/// # Errors
/// The call's status, so mapped, or DEADLINE_EXCEEDED.
pub async fn bounded<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Err(s)) if is_transport_failure(&s) => {
            let detail = std::error::Error::source(&s)
                .map(ToString::to_string)
                .unwrap_or_default();
            Err(Status::unavailable(format!(
                "{what}: connection failed: {detail}"
            )))
        }
        Ok(r) => r,
        Err(_) => Err(Status::deadline_exceeded(format!(
            "{what} took longer than {limit:?}"
        ))),
    }
}

fn is_transport_failure(s: &Status) -> bool {
    matches!(s.code(), tonic::Code::Unknown | tonic::Code::Cancelled)
        && std::error::Error::source(s)
            .is_some_and(|e| e.downcast_ref::<tonic::transport::Error>().is_some())
}

/// Opens a bidirectional-streaming call fed by `stream`; the answer is the server's stream.
///
/// # Errors
/// As [`unary`].
pub async fn streaming<S, Req, Resp>(
    channel: Channel,
    path: &'static str,
    limits: MessageLimits,
    req: Request<S>,
) -> Result<Streaming<Resp>, Status>
where
    S: Stream<Item = Req> + Send + 'static,
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let mut grpc = client(channel, limits);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    grpc.streaming(
        req,
        PathAndQuery::from_static(path),
        ProstCodec::<Req, Resp>::default(),
    )
    .await
    .map(Response::into_inner)
}
