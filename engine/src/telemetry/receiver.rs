//! A small in-process OTLP/gRPC trace receiver (the collector's `TraceService`, from
//! `opentelemetry-proto`): `tl demo --trace` and the tests gather spans with it, so the whole
//! path of a request can be seen without installing a collector.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tokio_util::sync::CancellationToken;

/// Spans kept at most; later ones are dropped.
pub const MAX_SPANS: usize = 100_000;

/// One received span, flattened.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedSpan {
    /// Trace id, 32 hex digits.
    pub trace_id: String,
    /// Span id, 16 hex digits.
    pub span_id: String,
    /// Parent span id, 16 hex digits, or empty for a root.
    pub parent_span_id: String,
    /// The span's name.
    pub name: String,
    /// OTLP span kind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer.
    pub kind: i32,
    /// Start, Unix nanoseconds.
    pub start_ns: u64,
    /// End, Unix nanoseconds.
    pub end_ns: u64,
    /// Attributes, as text.
    pub attributes: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service: String,
}

impl ReceivedSpan {
    /// An attribute's value, as text.
    #[must_use]
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[derive(Debug, Default)]
struct Store(Mutex<Vec<ReceivedSpan>>);

/// The service: a handle on the shared store.
#[derive(Debug)]
struct Service(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(ReceivedSpan {
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        name: s.name,
                        kind: s.kind,
                        start_ns: s.start_time_unix_nano,
                        end_ns: s.end_time_unix_nano,
                        attributes: s
                            .attributes
                            .into_iter()
                            .map(|kv| {
                                let v = text(kv.value.as_ref().and_then(|v| v.value.as_ref()));
                                (kv.key, v)
                            })
                            .collect(),
                        service: service.clone(),
                    });
                }
            }
        }
        let mut spans = self
            .0
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let room = MAX_SPANS.saturating_sub(spans.len());
        spans.extend(got.into_iter().take(room));
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A running receiver; it stops when dropped.
#[derive(Debug)]
pub struct Receiver {
    store: Arc<Store>,
    addr: SocketAddr,
    stop: CancellationToken,
}

impl Receiver {
    /// Starts a receiver on `127.0.0.1:0`.
    ///
    /// # Errors
    /// When it cannot bind.
    pub async fn start() -> std::io::Result<Self> {
        Self::start_on(&tokio::runtime::Handle::current())
    }

    /// Starts a receiver on `127.0.0.1:0`, served by the runtime of `handle` (a collector's
    /// work off the measured process's own workers, in a benchmark).
    ///
    /// # Errors
    /// When it cannot bind.
    pub fn start_on(handle: &tokio::runtime::Handle) -> std::io::Result<Self> {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let store = Arc::new(Store::default());
        let stop = CancellationToken::new();
        let (svc, token) = (Service(Arc::clone(&store)), stop.clone());
        handle.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else {
                return;
            };
            let _ = tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(svc))
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    token.cancelled_owned(),
                )
                .await;
        });
        Ok(Self { store, addr, stop })
    }

    /// Where exporters send.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The spans received so far.
    #[must_use]
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.store
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
