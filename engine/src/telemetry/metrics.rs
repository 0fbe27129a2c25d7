//! Prometheus metrics of one process, with the names of spec/telemetry.md, served as text on
//! `GET /metrics` of a listener of their own.
//!
//! The hot path pays a few atomic adds per push or request: counters and histograms are
//! `prometheus-client`'s atomics. Figures that already exist elsewhere (pool counts, pending
//! handles, live workers) are read at scrape time by the process's refresh hooks, not kept
//! up to date on every change.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Buckets in seconds for the figures this project measures: a one-block push or a decode step
/// (a fraction of a millisecond) up to a 512 MiB push or a long prefill (seconds).
pub const SECONDS_BUCKETS: [f64; 16] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

fn seconds_histogram() -> Histogram {
    Histogram::new(SECONDS_BUCKETS)
}

/// `{direction}` of payload bytes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Direction {
    /// `sent` (prefill side) or `received` (decode side).
    pub direction: &'static str,
}

/// `{code}` of a refused push: the gRPC code's name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// For instance `RESOURCE_EXHAUSTED`.
    pub code: String,
}

/// `{state}` of pool blocks.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct State {
    /// `free`, `used` or `cached`.
    pub state: &'static str,
}

/// `{endpoint, status}` of an HTTP request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The path, for instance `/v1/completions`.
    pub endpoint: String,
    /// The HTTP status code.
    pub status: u16,
}

/// A closed set of label values: each value renders as its label.
macro_rules! label_values {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $label:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Every value, in order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The label this value renders as.
            #[must_use]
            pub fn label(self) -> &'static str {
                match self {
                    $($name::$variant => $label),+
                }
            }
        }

        impl EncodeLabelValue for $name {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                EncodeLabelValue::encode(&self.label(), encoder)
            }
        }
    };
}

label_values! {
    /// Why a decode engine counts as lost: `tl_failovers_total{cause}`.
    LossCause {
        /// Its stream broke, ended early, or the resume was refused or could not connect.
        Reset => "reset",
        /// It sent nothing within the stall timeout.
        Stall => "stall",
    }
}

label_values! {
    /// How a failover ended: `tl_failovers_total{outcome}`.
    FailoverOutcome {
        /// The request continued on another decode engine.
        Resumed => "resumed",
        /// It could not: the client got an error event.
        GaveUp => "gave_up",
    }
}

label_values! {
    /// Why the gateway routed a request where it did: `tl_route_decisions_total{reason}`.
    RouteReason {
        /// A decode engine holds a prefix of the prompt.
        PrefixHit => "prefix_hit",
        /// No engine holds a prefix: the least loaded.
        ByLoad => "by_load",
        /// No prefill and decode pair: a `both` engine serves it alone.
        Colocated => "colocated",
        /// No engine can serve it.
        None => "none",
    }
}

label_values! {
    /// Whether an engine took a role change: `tl_role_changes_total{outcome}`.
    ChangeOutcome {
        /// It took it.
        Ok => "ok",
        /// It refused, or could not be reached.
        Failed => "failed",
    }
}

/// `{cause, outcome}` of a failover.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailoverLabels {
    /// Why the decode stream was lost.
    pub cause: LossCause,
    /// Whether the request continued elsewhere.
    pub outcome: FailoverOutcome,
}

/// `{role}` of live workers.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Role {
    /// `prefill`, `decode` or `both`.
    pub role: String,
}

/// `{from, to, outcome}` of a role change the planner made: the roles (`prefill`, `decode`,
/// `both`) and whether the engine took it (`ok`) or not (`failed`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleChange {
    /// The role it served in (a role's name, or `unspecified`).
    pub from: &'static str,
    /// The role asked for (a role's name).
    pub to: &'static str,
    /// Whether the engine took it.
    pub outcome: ChangeOutcome,
}

/// `{reason}` of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// Why the request went where it did.
    pub reason: RouteReason,
}

type Refresh = Box<dyn Fn(&Metrics) + Send + Sync>;

/// Every metric a process may publish; each process fills the ones that apply to it.
pub struct Metrics {
    registry: Registry,
    refresh: Mutex<Vec<Refresh>>,
    /// Blocks a prefill engine sent with a payload.
    pub kv_blocks_sent: Counter,
    /// Blocks a prefill engine sent as empty chunks (the decode side held them).
    pub kv_blocks_deduped: Counter,
    /// Envelope bytes, by direction.
    pub kv_payload_bytes: Family<Direction, Counter>,
    /// Pushes refused by the decode side, by gRPC code.
    pub kv_push_refused: Family<CodeLabel, Counter>,
    /// Push duration: the whole transfer on the prefill side, first chunk to ack on the decode
    /// side.
    pub kv_push_seconds: Histogram,
    /// Handles held by the decode side's receiver.
    pub kv_handles_pending: Gauge,
    /// Handles released because their lease ran out.
    pub kv_handle_leases_expired: Counter,
    /// Pool blocks by state.
    pub pool_blocks: Family<State, Gauge>,
    /// HTTP requests by endpoint and status.
    pub requests: Family<RequestLabels, Counter>,
    /// Time to first token, as the client sees it.
    pub ttft_seconds: Histogram,
    /// Time per output token after the first, per request.
    pub tpot_seconds: Histogram,
    /// Time a request waited in the gateway's queue for a place, per wait.
    pub queue_wait_seconds: Histogram,
    /// Heartbeats that failed.
    pub heartbeat_failures: Counter,
    /// Live workers in the registry, by role.
    pub workers: Family<Role, Gauge>,
    /// Routing decisions, by reason.
    pub route_decisions: Family<Reason, Counter>,
    /// Role changes the planner made, by roles and outcome.
    pub role_changes: Family<RoleChange, Counter>,
    /// Spans the OTLP exporter dropped (failed or timed-out exports).
    pub trace_spans_dropped: Counter,
    /// Decode streams lost mid-request, by cause and outcome.
    pub failovers: Family<FailoverLabels, Counter>,
    /// Requests an engine preempted (paused, blocks given back) when its pool ran dry.
    pub preemptions: Counter,
    /// Beats the registry refused because another address held the worker id's lease.
    pub registry_identity_conflicts: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All of section 9's metrics, registered and at zero.
    #[must_use]
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            refresh: Mutex::new(Vec::new()),
            kv_blocks_sent: Counter::default(),
            kv_blocks_deduped: Counter::default(),
            kv_payload_bytes: Family::default(),
            kv_push_refused: Family::default(),
            kv_push_seconds: seconds_histogram(),
            kv_handles_pending: Gauge::default(),
            kv_handle_leases_expired: Counter::default(),
            pool_blocks: Family::default(),
            requests: Family::default(),
            ttft_seconds: seconds_histogram(),
            tpot_seconds: seconds_histogram(),
            queue_wait_seconds: seconds_histogram(),
            heartbeat_failures: Counter::default(),
            workers: Family::default(),
            route_decisions: Family::default(),
            role_changes: Family::default(),
            trace_spans_dropped: Counter::default(),
            failovers: Family::default(),
            preemptions: Counter::default(),
            registry_identity_conflicts: Counter::default(),
        };
        let r = &mut m.registry;
        r.register(
            "tl_kv_blocks_sent",
            "KV blocks sent with a payload",
            m.kv_blocks_sent.clone(),
        );
        r.register(
            "tl_kv_blocks_deduped",
            "KV blocks the decode side already held, sent as empty chunks",
            m.kv_blocks_deduped.clone(),
        );
        r.register(
            "tl_kv_payload_bytes",
            "KV envelope bytes by direction",
            m.kv_payload_bytes.clone(),
        );
        r.register(
            "tl_kv_push_refused",
            "KV pushes refused, by gRPC code",
            m.kv_push_refused.clone(),
        );
        r.register(
            "tl_kv_push_seconds",
            "KV push duration",
            m.kv_push_seconds.clone(),
        );
        r.register(
            "tl_kv_handles_pending",
            "KV handles held, waiting for their claim",
            m.kv_handles_pending.clone(),
        );
        r.register(
            "tl_kv_handle_leases_expired",
            "KV handles released because their lease ran out",
            m.kv_handle_leases_expired.clone(),
        );
        r.register(
            "tl_pool_blocks",
            "KV pool blocks by state",
            m.pool_blocks.clone(),
        );
        r.register(
            "tl_requests",
            "HTTP requests by endpoint and status",
            m.requests.clone(),
        );
        r.register(
            "tl_time_to_first_token_seconds",
            "Time to first token",
            m.ttft_seconds.clone(),
        );
        r.register(
            "tl_time_per_output_token_seconds",
            "Time per output token after the first",
            m.tpot_seconds.clone(),
        );
        r.register(
            "tl_gateway_queue_wait_seconds",
            "Time a request waited in the gateway's queue for a place",
            m.queue_wait_seconds.clone(),
        );
        r.register(
            "tl_heartbeat_failures",
            "Heartbeats that failed",
            m.heartbeat_failures.clone(),
        );
        r.register("tl_workers", "Live workers by role", m.workers.clone());
        r.register(
            "tl_route_decisions",
            "Routing decisions by reason",
            m.route_decisions.clone(),
        );
        r.register(
            "tl_role_changes",
            "Role changes the planner made, by roles and outcome",
            m.role_changes.clone(),
        );
        r.register(
            "tl_trace_spans_dropped",
            "Spans the OTLP exporter dropped: export failed or timed out",
            m.trace_spans_dropped.clone(),
        );
        r.register(
            "tl_failovers",
            "Decode streams lost mid-request, by cause, and whether the request resumed elsewhere",
            m.failovers.clone(),
        );
        r.register(
            "tl_preemptions",
            "Requests paused with their KV blocks given back because the pool ran dry; each \
             resumes by recomputation with the tokens it would have produced",
            m.preemptions.clone(),
        );
        r.register(
            "tl_registry_identity_conflicts",
            "Heartbeats refused because another address held the worker id's lease",
            m.registry_identity_conflicts.clone(),
        );
        // Series with a closed set of label values exist from the start, at 0, so a rate over
        // them is defined before the first event.
        for direction in ["sent", "received"] {
            m.kv_payload_bytes
                .get_or_create(&Direction { direction })
                .inc_by(0);
        }
        for &cause in LossCause::ALL {
            for &outcome in FailoverOutcome::ALL {
                m.failovers
                    .get_or_create(&FailoverLabels { cause, outcome })
                    .inc_by(0);
            }
        }
        for &reason in RouteReason::ALL {
            m.route_decisions
                .get_or_create(&Reason { reason })
                .inc_by(0);
        }
        m
    }

    /// Runs `f` before every scrape, to copy figures kept elsewhere into gauges.
    pub fn on_scrape(&self, f: impl Fn(&Metrics) + Send + Sync + 'static) {
        self.refresh
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Box::new(f));
    }

    /// The Prometheus text exposition of every metric, after the refresh hooks ran.
    #[must_use]
    pub fn encode(&self) -> String {
        for f in self
            .refresh
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            f(self);
        }
        Self::catch_up(&self.trace_spans_dropped, super::export::spans_dropped());
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Counts one push the prefill side completed.
    pub fn push_sent(&self, sent: u32, deduped: u32, bytes: u64, took: Duration) {
        self.kv_blocks_sent.inc_by(u64::from(sent));
        self.kv_blocks_deduped.inc_by(u64::from(deduped));
        self.kv_payload_bytes
            .get_or_create(&Direction { direction: "sent" })
            .inc_by(bytes);
        self.kv_push_seconds.observe(took.as_secs_f64());
    }

    /// Sets the pool gauges.
    pub fn set_pool(&self, free: usize, used: usize, cached: usize) {
        for (state, n) in [("free", free), ("used", used), ("cached", cached)] {
            self.pool_blocks
                .get_or_create(&State { state })
                .set(n as i64);
        }
    }

    /// Brings a cumulative figure kept elsewhere into a counter (it only grows).
    pub fn catch_up(counter: &Counter, total: u64) {
        let now = counter.get();
        if total > now {
            counter.inc_by(total - now);
        }
    }
}

/// Shared metrics of a process.
pub type SharedMetrics = Arc<Metrics>;

/// The gRPC code's name as the contract writes it (`RESOURCE_EXHAUSTED`).
#[must_use]
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The decode side's push outcomes into the metrics (bytes received and push time for an
/// accepted push, the code for a refused one) and into the push's span, with the worker's id.
#[derive(Debug)]
pub struct KvObserver(pub SharedMetrics, pub String);

impl kvwire_grpc::PushObserver for KvObserver {
    fn accepted(&self, ack: &kvwire_grpc::pb::kv::KvAck, took: Duration) {
        // The push runs in its `kv.transfer` SERVER span (when traced): its figures go there.
        let span = tracing::Span::current();
        span.record("tl.worker", self.1.as_str());
        span.record("kv.handle_id", ack.handle_id.as_str());
        span.record("kv.blocks_sent", ack.blocks_received);
        span.record("kv.blocks_deduped", ack.blocks_deduped);
        span.record("kv.payload_bytes", ack.payload_bytes);
        span.record("rpc.grpc.status_code", 0);
        self.0
            .kv_payload_bytes
            .get_or_create(&Direction {
                direction: "received",
            })
            .inc_by(ack.payload_bytes);
        self.0.kv_push_seconds.observe(took.as_secs_f64());
    }

    fn serving(&self) {
        tracing::Span::current().record("tl.worker", self.1.as_str());
    }

    fn refused(&self, code: tonic::Code) {
        tracing::Span::current().record("rpc.grpc.status_code", code as i32);
        self.0
            .kv_push_refused
            .get_or_create(&CodeLabel {
                code: code_name(code).to_owned(),
            })
            .inc();
    }
}

/// Counts every request by endpoint and status (`tl_requests_total`): an axum middleware for
/// the gateway's and the engines' HTTP fronts. A path nobody serves counts under `other`, so a
/// scanner cannot grow the label set.
pub async fn count_requests(
    axum::extract::State(m): axum::extract::State<SharedMetrics>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let endpoint = match req.uri().path() {
        p
        @ ("/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health" | "/workers") => {
            p.to_owned()
        }
        _ => "other".to_owned(),
    };
    let r = next.run(req).await;
    m.requests
        .get_or_create(&RequestLabels {
            endpoint,
            status: r.status().as_u16(),
        })
        .inc();
    r
}

/// `GET /metrics`: the text exposition.
pub fn router(metrics: SharedMetrics) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = Arc::clone(&metrics);
            async move {
                (
                    [(
                        http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    m.encode(),
                )
            }
        }),
    )
}
