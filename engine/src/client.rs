//! Small clients used by the demo, the benches and the tests: EngineControl over gRPC, and
//! `POST` of JSON over HTTP/1.1 (whole responses or server-sent events).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvwire_grpc::glue::{self, Limits};
use kvwire_grpc::pb::engine::{
    CancelRequest, CancelResponse, DrainRequest, DrainResponse, InfoRequest, InfoResponse,
    KvHandle, PrefillRequest, path,
};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

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
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::invalid_argument(format!("{addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(Self { channel })
    }

    /// Prefill.
    ///
    /// # Errors
    /// The engine's status.
    pub async fn prefill(&self, req: PrefillRequest) -> Result<KvHandle, Status> {
        glue::unary(
            self.channel.clone(),
            path::PREFILL,
            Limits::default(),
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
            Limits::default(),
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
            Limits::default(),
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
            Limits::default(),
            Request::new(DrainRequest { deadline_ms }),
        )
        .await?;
        Ok(r.remaining)
    }
}

/// An HTTP/1.1 client for JSON requests.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        Self {
            inner: Client::builder(TokioExecutor::new()).build(conn),
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
}

impl HttpResponse {
    /// The body as JSON (`Null` when it is not JSON).
    #[must_use]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The `data:` payloads of a server-sent event body, in order.
    #[must_use]
    pub fn sse_data(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.body)
            .lines()
            .filter_map(|l| l.strip_prefix("data:").map(|d| d.trim_start().to_owned()))
            .collect()
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
    ) -> Result<http::Response<hyper::body::Incoming>, String> {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"));
        if !body.is_empty() {
            req = req.header("content-type", "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        self.inner.request(req).await.map_err(|e| e.to_string())
    }

    async fn whole(resp: http::Response<hyper::body::Incoming>) -> Result<HttpResponse, String> {
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(HttpResponse { status, body })
    }

    /// POSTs `body` to `http://{addr}{path}` with extra headers and reads the whole response.
    ///
    /// # Errors
    /// Connection or protocol errors, as text.
    pub async fn post(
        &self,
        addr: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<HttpResponse, String> {
        Self::whole(
            self.send(http::Method::POST, addr, path, headers, body.into())
                .await?,
        )
        .await
    }

    /// GETs `http://{addr}{path}`.
    ///
    /// # Errors
    /// Connection or protocol errors, as text.
    pub async fn get(&self, addr: &str, path: &str) -> Result<HttpResponse, String> {
        Self::whole(
            self.send(http::Method::GET, addr, path, &[], Bytes::new())
                .await?,
        )
        .await
    }

    /// POSTs and returns the status and the body as a stream of frames, for callers that read
    /// server-sent events as they come (and may drop the stream to disconnect).
    ///
    /// # Errors
    /// Connection or protocol errors, as text.
    pub async fn post_streaming(
        &self,
        addr: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<(u16, hyper::body::Incoming), String> {
        let resp = self
            .send(http::Method::POST, addr, path, headers, body.into())
            .await?;
        Ok((resp.status().as_u16(), resp.into_body()))
    }
}
