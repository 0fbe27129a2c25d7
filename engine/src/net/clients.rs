//! Clients of the other processes: EngineControl and the WorkerRegistry over gRPC, and JSON over
//! HTTP/1.1 (whole responses or server-sent events). Used by the gateway, the heartbeat, the
//! demo, the benches and the tests.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvwire_grpc::glue::{self, MessageLimits};
use kvwire_grpc::pb::control::{
    HeartbeatAck, ListWorkersRequest, ListWorkersResponse, SetDrainRequest, SetDrainResponse,
    WorkerStatus, path as reg_path,
};
use kvwire_grpc::pb::engine::{
    BlockEvents, CancelRequest, CancelResponse, DrainRequest, DrainResponse, GenerateEvents,
    GenerateRequest, InfoRequest, InfoResponse, KvHandle, PrefillRequest, SetRoleRequest,
    SetRoleResponse, WatchBlocksRequest, path,
};
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::api::sse::{DecodeError, Decoder, StreamEvent};

/// A client of one engine's EngineControl service.
#[derive(Clone, Debug)]
pub struct ControlClient {
    channel: Channel,
}

impl ControlClient {
    /// Connects lazily to `addr` (`host:port`).
    ///
    /// # Errors
    /// When `addr` is malformed.
    pub fn new(addr: &str) -> Result<Self, Status> {
        Self::with_tls(addr, None)
    }

    /// Connects lazily to `addr` over mutual TLS when `tls` is given.
    ///
    /// # Errors
    /// When `addr` is malformed.
    pub fn with_tls(
        addr: &str,
        tls: Option<&tonic::transport::ClientTlsConfig>,
    ) -> Result<Self, Status> {
        let channel = glue::endpoint(addr, Duration::from_secs(2), tls)?.connect_lazy();
        Ok(Self { channel })
    }

    /// A client over a channel of the caller's (the gateway's one channel cache).
    #[must_use]
    pub fn from_channel(channel: Channel) -> Self {
        Self { channel }
    }

    /// Prefill.
    ///
    /// # Errors
    /// The engine's status.
    pub async fn prefill(&self, req: PrefillRequest) -> Result<KvHandle, Status> {
        glue::unary(
            self.channel.clone(),
            path::PREFILL,
            MessageLimits::default(),
            Request::new(req),
        )
        .await
    }

    /// Info.
    ///
    /// # Errors
    /// The engine's status.
    pub async fn info(&self) -> Result<InfoResponse, Status> {
        glue::unary(
            self.channel.clone(),
            path::INFO,
            MessageLimits::default(),
            Request::new(InfoRequest {}),
        )
        .await
    }

    /// Cancel.
    ///
    /// # Errors
    /// The engine's status.
    pub async fn cancel(&self, request_id: &str) -> Result<bool, Status> {
        let r: CancelResponse = glue::unary(
            self.channel.clone(),
            path::CANCEL,
            MessageLimits::default(),
            Request::new(CancelRequest {
                request_id: request_id.into(),
            }),
        )
        .await?;
        Ok(r.cancelled)
    }

    /// Drain.
    ///
    /// # Errors
    /// The engine's status.
    pub async fn drain(&self, deadline_ms: i64) -> Result<i32, Status> {
        let r: DrainResponse = glue::unary(
            self.channel.clone(),
            path::DRAIN,
            MessageLimits::default(),
            Request::new(DrainRequest { deadline_ms }),
        )
        .await?;
        Ok(r.remaining)
    }

    /// SetRole: the engine takes new work in `role` from now on; waits up to `deadline_ms` for
    /// the work of the role it left to end.
    ///
    /// # Errors
    /// The engine's status (FAILED_PRECONDITION for a role it is not configured for).
    pub async fn set_role(
        &self,
        role: crate::net::role::Role,
        deadline_ms: i64,
    ) -> Result<SetRoleResponse, Status> {
        glue::unary(
            self.channel.clone(),
            path::SET_ROLE,
            MessageLimits::default(),
            Request::new(SetRoleRequest {
                role: role.name().to_owned(),
                deadline_ms,
            }),
        )
        .await
    }

    /// Generate: a request's tokens as the engine makes them.
    ///
    /// # Errors
    /// The engine's refusal.
    pub async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<tonic::Streaming<GenerateEvents>, Status> {
        glue::server_streaming(
            self.channel.clone(),
            path::GENERATE,
            MessageLimits::default(),
            Request::new(req),
        )
        .await
    }

    /// WatchBlocks: the engine's prefix index, a snapshot then its changes. Each message is
    /// bounded by `max_message` bytes.
    ///
    /// # Errors
    /// The engine's status.
    pub async fn watch_blocks(
        &self,
        max_message: usize,
    ) -> Result<tonic::Streaming<BlockEvents>, Status> {
        glue::server_streaming(
            self.channel.clone(),
            path::WATCH_BLOCKS,
            MessageLimits {
                max_decode: max_message,
                max_encode: 1 << 10,
            },
            Request::new(WatchBlocksRequest {}),
        )
        .await
    }
}

/// A client of a WorkerRegistry, each call bounded by a timeout.
#[derive(Clone, Debug)]
pub struct RegistryClient {
    channel: Channel,
    timeout: Duration,
}

impl RegistryClient {
    /// A client of the registry at `addr` (`host:port`); connects on first use.
    ///
    /// # Errors
    /// When `addr` is not a `host:port`.
    pub fn new(addr: &str, timeout: Duration) -> Result<Self, Status> {
        Self::with_tls(addr, timeout, None)
    }

    /// As [`new`](Self::new), over mutual TLS when `tls` is given.
    ///
    /// # Errors
    /// When `addr` is not a `host:port`.
    pub fn with_tls(
        addr: &str,
        timeout: Duration,
        tls: Option<&tonic::transport::ClientTlsConfig>,
    ) -> Result<Self, Status> {
        let channel = glue::endpoint(addr, timeout, tls)?
            .timeout(timeout)
            .connect_lazy();
        Ok(Self { channel, timeout })
    }

    /// As [`new`](Self::new), with channels made by `connect` (mutual TLS that checks the
    /// registry's role, [`crate::net::dial`]).
    ///
    /// # Errors
    /// When `addr` is not a `host:port`.
    pub fn with_connector(
        addr: &str,
        timeout: Duration,
        connect: &kvwire_grpc::sender::Connect,
    ) -> Result<Self, Status> {
        let channel = connect(glue::endpoint(addr, timeout, None)?.timeout(timeout));
        Ok(Self { channel, timeout })
    }

    async fn call<Req, Resp>(&self, path: &'static str, req: Req) -> Result<Resp, Status>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let call = glue::unary::<Req, Resp>(
            self.channel.clone(),
            path,
            MessageLimits::default(),
            Request::new(req),
        );
        glue::bounded(self.timeout, path, call).await
    }

    /// Sends one heartbeat.
    ///
    /// # Errors
    /// The registry's status, or a timeout.
    pub async fn heartbeat(&self, status: WorkerStatus) -> Result<HeartbeatAck, Status> {
        self.call(reg_path::HEARTBEAT, status).await
    }

    /// The live workers.
    ///
    /// # Errors
    /// The registry's status, or a timeout.
    pub async fn list_workers(&self) -> Result<Vec<WorkerStatus>, Status> {
        Ok(self
            .call::<_, ListWorkersResponse>(reg_path::LIST_WORKERS, ListWorkersRequest {})
            .await?
            .workers)
    }

    /// Asks a worker to drain (or withdraws the request).
    ///
    /// # Errors
    /// The registry's status, or a timeout.
    pub async fn set_drain(&self, worker_id: &str, drain: bool) -> Result<bool, Status> {
        let req = SetDrainRequest {
            worker_id: worker_id.to_owned(),
            drain,
        };
        Ok(self
            .call::<_, SetDrainResponse>(reg_path::SET_DRAIN, req)
            .await?
            .found)
    }
}

/// Why an HTTP exchange failed (below the level of a status code).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The request could not be built (a bad address or header).
    #[error("building the request: {0}")]
    Request(#[from] http::Error),
    /// Connecting or sending failed.
    #[error("{0}")]
    Send(#[from] hyper_util::client::legacy::Error),
    /// Reading the body failed.
    #[error("reading the body: {0}")]
    Body(#[from] hyper::Error),
}

/// An HTTP/1.1 client for JSON requests, over plain TCP or (mutual) TLS.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Inner,
}

#[derive(Clone, Debug)]
enum Inner {
    Plain(Client<HttpConnector, Full<Bytes>>),
    Tls(Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>),
}

fn tcp() -> HttpConnector {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn
}

impl Default for HttpClient {
    fn default() -> Self {
        Self {
            inner: Inner::Plain(Client::builder(TokioExecutor::new()).build(tcp())),
        }
    }
}

impl HttpClient {
    /// A client that speaks HTTPS only, with this TLS configuration (mutual TLS when it carries
    /// a client certificate). The configuration must offer no ALPN: the connector sets it.
    #[must_use]
    pub fn tls(config: std::sync::Arc<rustls::ClientConfig>) -> Self {
        Self::tls_verifying(config, None)
    }

    /// As [`tls`](Self::tls), verifying every server against `server_name` (when given) instead
    /// of the dialed host.
    #[must_use]
    pub fn tls_verifying(
        config: std::sync::Arc<rustls::ClientConfig>,
        server_name: Option<rustls_pki_types::ServerName<'static>>,
    ) -> Self {
        let mut conn = tcp();
        conn.enforce_http(false);
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*config).clone())
            .https_only();
        let builder = match server_name {
            Some(n) => {
                builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(n))
            }
            None => builder,
        };
        let https = builder.enable_http1().wrap_connector(conn);
        Self {
            inner: Inner::Tls(Client::builder(TokioExecutor::new()).build(https)),
        }
    }
}

/// An HTTP response: status and body.
#[derive(Clone, Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Body bytes.
    pub body: Bytes,
    /// Its headers.
    pub headers: http::HeaderMap,
}

impl HttpResponse {
    /// The body as JSON (`Null` when it is not JSON).
    #[must_use]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The events of a server-sent event body, in order.
    ///
    /// # Errors
    /// An event that is not part of a completion stream.
    pub fn events(&self) -> Result<Vec<StreamEvent>, DecodeError> {
        let mut d = Decoder::new();
        let mut events = d.push(&self.body)?;
        // A body that does not end with a blank line still ends its last event.
        events.extend(d.push(b"\n\n")?);
        Ok(events)
    }
}

impl HttpClient {
    async fn send(
        &self,
        method: http::Method,
        addr: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<http::Response<hyper::body::Incoming>, HttpError> {
        let scheme = match self.inner {
            Inner::Plain(_) => "http",
            Inner::Tls(_) => "https",
        };
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("{scheme}://{addr}{path}"));
        if !body.is_empty() {
            req = req.header("content-type", "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body))?;
        Ok(match &self.inner {
            Inner::Plain(c) => c.request(req).await?,
            Inner::Tls(c) => c.request(req).await?,
        })
    }

    async fn whole(resp: http::Response<hyper::body::Incoming>) -> Result<HttpResponse, HttpError> {
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(HttpResponse {
            status,
            body,
            headers,
        })
    }

    /// POSTs `body` to `http://{addr}{path}` with extra headers and reads the whole response.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn post(
        &self,
        addr: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<HttpResponse, HttpError> {
        Self::whole(
            self.send(http::Method::POST, addr, path, headers, body.into())
                .await?,
        )
        .await
    }

    /// GETs `http://{addr}{path}`.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn get(&self, addr: &str, path: &str) -> Result<HttpResponse, HttpError> {
        Self::whole(
            self.send(http::Method::GET, addr, path, &[], Bytes::new())
                .await?,
        )
        .await
    }

    /// A GET with these headers, read whole.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn get_with(
        &self,
        addr: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<HttpResponse, HttpError> {
        Self::whole(
            self.send(http::Method::GET, addr, path, headers, Bytes::new())
                .await?,
        )
        .await
    }

    /// POSTs and returns the status and the body as a stream of frames, for callers that read
    /// server-sent events as they come (and may drop the stream to disconnect).
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn post_streaming(
        &self,
        addr: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<(u16, hyper::body::Incoming), HttpError> {
        let resp = self
            .send(http::Method::POST, addr, path, headers, body.into())
            .await?;
        Ok((resp.status().as_u16(), resp.into_body()))
    }
}

/// Why reading an event stream failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The connection failed mid-stream.
    #[error("reading the stream: {0}")]
    Body(#[from] hyper::Error),
    /// An event was not part of a completion stream.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// A server-sent event body read event by event as it arrives. Dropping it closes the request.
#[derive(Debug)]
pub struct EventStream {
    body: hyper::body::Incoming,
    decoder: Decoder,
    ready: std::collections::VecDeque<StreamEvent>,
}

impl EventStream {
    /// Reads the events of `body`.
    #[must_use]
    pub fn new(body: hyper::body::Incoming) -> Self {
        Self {
            body,
            decoder: Decoder::new(),
            ready: std::collections::VecDeque::new(),
        }
    }

    /// The next event; `None` when the body ended (after the last complete event).
    ///
    /// # Errors
    /// A broken connection or a malformed event.
    pub async fn next(&mut self) -> Option<Result<StreamEvent, StreamError>> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Some(Ok(e));
            }
            let frame = match self.body.frame().await? {
                Ok(f) => f,
                Err(e) => return Some(Err(e.into())),
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            match self.decoder.push(&data) {
                Ok(events) => self.ready.extend(events),
                Err(e) => return Some(Err(e.into())),
            }
        }
    }
}
