//! `tl.control.v1.WorkerRegistry`: the registry (gateway side) and the heartbeat (engine side).
//!
//! Engines beat every `heartbeat_ms` with their live load; the registry keeps the last status of
//! each worker in memory, forgets a worker after three missed beats, and tells a worker to drain
//! when an operator asked (SetDrain). A worker that has seen `drain = true` stays draining.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_grpc::glue::{self, Limits, ResponseFuture};
use kvwire_grpc::pb::control::{
    HeartbeatAck, ListWorkersRequest, ListWorkersResponse, Role as PbRole, SetDrainRequest,
    SetDrainResponse, WorkerStatus, path,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use crate::config::Role;
use crate::control::Worker;

/// The heartbeat interval a worker that does not say is assumed to use.
pub const DEFAULT_HEARTBEAT_MS: u32 = 2000;

/// Missed beats after which a worker is forgotten.
pub const MISSED_BEATS: u32 = 3;

#[derive(Debug)]
struct Entry {
    status: WorkerStatus,
    last: Instant,
    drain: bool,
}

/// The registry's state: live workers and drain requests.
#[derive(Debug, Default)]
pub struct RegistryState {
    workers: Mutex<HashMap<String, Entry>>,
}

impl RegistryState {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.workers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a beat received at `now`; the ack carries the drain request.
    pub fn heartbeat(&self, status: WorkerStatus, now: Instant) -> HeartbeatAck {
        let mut w = self.lock();
        let drain = w.get(&status.worker_id).is_some_and(|e| e.drain);
        w.insert(
            status.worker_id.clone(),
            Entry {
                status,
                last: now,
                drain,
            },
        );
        HeartbeatAck { drain }
    }

    /// Forgets workers silent for more than three of their intervals; returns how many.
    pub fn evict_stale(&self, now: Instant) -> usize {
        let mut w = self.lock();
        let before = w.len();
        w.retain(|_, e| {
            let ms = if e.status.heartbeat_ms == 0 {
                DEFAULT_HEARTBEAT_MS
            } else {
                e.status.heartbeat_ms
            };
            now.saturating_duration_since(e.last)
                <= Duration::from_millis(u64::from(ms) * u64::from(MISSED_BEATS))
        });
        before - w.len()
    }

    /// Live workers as of `now`, sorted by id.
    #[must_use]
    pub fn list(&self, now: Instant) -> Vec<WorkerStatus> {
        self.evict_stale(now);
        let mut v: Vec<WorkerStatus> = self.lock().values().map(|e| e.status.clone()).collect();
        v.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        v
    }

    /// Sets or clears the drain request of a known worker.
    pub fn set_drain(&self, worker_id: &str, drain: bool) -> bool {
        match self.lock().get_mut(worker_id) {
            Some(e) => {
                e.drain = drain;
                true
            }
            None => false,
        }
    }
}

/// The WorkerRegistry service.
#[derive(Clone, Debug, Default)]
pub struct RegistryService {
    state: Arc<RegistryState>,
}

impl RegistryService {
    /// Serves `state`.
    #[must_use]
    pub fn new(state: Arc<RegistryState>) -> Self {
        Self { state }
    }
}

impl NamedService for RegistryService {
    const NAME: &'static str = path::SERVICE;
}

impl tower_service::Service<http::Request<Body>> for RegistryService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> ResponseFuture {
        let s = Arc::clone(&self.state);
        let limits = Limits::default();
        match req.uri().path() {
            path::HEARTBEAT => glue::serve_unary(req, limits, move |m: WorkerStatus| async move {
                if m.worker_id.is_empty() {
                    return Err(Status::invalid_argument("empty worker_id"));
                }
                Ok(s.heartbeat(m, Instant::now()))
            }),
            path::LIST_WORKERS => {
                glue::serve_unary(req, limits, move |_: ListWorkersRequest| async move {
                    Ok::<_, Status>(ListWorkersResponse {
                        workers: s.list(Instant::now()),
                    })
                })
            }
            path::SET_DRAIN => {
                glue::serve_unary(req, limits, move |m: SetDrainRequest| async move {
                    Ok::<_, Status>(SetDrainResponse {
                        found: s.set_drain(&m.worker_id, m.drain),
                    })
                })
            }
            other => glue::unimplemented(other),
        }
    }
}

/// What the heartbeat needs of a registry.
pub trait Registry: Send + Sync + 'static {
    /// Sends one beat.
    fn heartbeat(
        &self,
        status: WorkerStatus,
    ) -> impl Future<Output = Result<HeartbeatAck, Status>> + Send;
}

impl<R: Registry> Registry for Arc<R> {
    fn heartbeat(
        &self,
        status: WorkerStatus,
    ) -> impl Future<Output = Result<HeartbeatAck, Status>> + Send {
        R::heartbeat(self, status)
    }
}

/// A registry reached over gRPC, each call bounded by a timeout.
#[derive(Clone, Debug)]
pub struct GrpcRegistry {
    channel: Channel,
    timeout: Duration,
}

impl GrpcRegistry {
    /// A client of the registry at `addr` (`host:port`); connects on first use.
    ///
    /// # Errors
    /// When `addr` is not a `host:port`.
    pub fn new(addr: &str, timeout: Duration) -> Result<Self, Status> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::invalid_argument(format!("registry address {addr:?}: {e}")))?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect_lazy();
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
            Limits::default(),
            Request::new(req),
        );
        glue::bounded(self.timeout, path, call).await
    }

    /// The live workers.
    ///
    /// # Errors
    /// The registry's status, or a timeout.
    pub async fn list_workers(&self) -> Result<Vec<WorkerStatus>, Status> {
        Ok(self
            .call::<_, ListWorkersResponse>(path::LIST_WORKERS, ListWorkersRequest {})
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
            .call::<_, SetDrainResponse>(path::SET_DRAIN, req)
            .await?
            .found)
    }
}

impl Registry for GrpcRegistry {
    async fn heartbeat(&self, status: WorkerStatus) -> Result<HeartbeatAck, Status> {
        self.call(path::HEARTBEAT, status).await
    }
}

/// The addresses a worker serves, as registered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Addresses {
    /// HTTP front (decode roles).
    pub http: String,
    /// EngineControl.
    pub grpc: String,
    /// KvTransfer (decode roles).
    pub kv: String,
}

/// A worker's status for one beat, with its live load.
#[must_use]
pub fn worker_status(worker: &Worker, addrs: &Addresses, heartbeat_ms: u32) -> WorkerStatus {
    let role = worker.role();
    let model = worker.runner().model();
    let counts = worker.runner().pool().lock().counts();
    WorkerStatus {
        worker_id: worker.id().to_owned(),
        http_address: if role.decodes() {
            addrs.http.clone()
        } else {
            String::new()
        },
        grpc_address: addrs.grpc.clone(),
        // Only an engine that receives KV advertises where to push it.
        kv_address: if role.decodes() {
            addrs.kv.clone()
        } else {
            String::new()
        },
        role: match role {
            Role::Prefill => PbRole::Prefill,
            Role::Decode => PbRole::Decode,
            Role::Both => PbRole::Both,
        } as i32,
        model: model.name().to_owned(),
        kv_format: kvwire_grpc::KV_FORMAT_V1,
        queue_depth: worker.runner().queue_depth() + worker.inflight_prefills() as u32,
        running: worker.runner().running(),
        // Blocks on the free list; cached blocks are evictable but still hold someone's prefix.
        free_blocks: counts.free as u32,
        total_blocks: counts.total as u32,
        draining: worker.is_draining(),
        block_tokens: model.shape().block_tokens(),
        heartbeat_ms,
    }
}

/// The heartbeat's memory: consecutive failures, beats sent, and the sticky drain flag.
#[derive(Debug)]
pub struct Heartbeat<R> {
    registry: R,
    timeout: Duration,
    failures: AtomicU32,
    beats: AtomicU64,
    drain: AtomicBool,
}

impl<R: Registry> Heartbeat<R> {
    /// A heartbeat to `registry`, each beat bounded by `timeout`.
    pub fn new(registry: R, timeout: Duration) -> Self {
        Self {
            registry,
            timeout,
            failures: AtomicU32::new(0),
            beats: AtomicU64::new(0),
            drain: AtomicBool::new(false),
        }
    }

    /// Consecutive failed beats (0 after a success).
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::SeqCst)
    }

    /// Beats attempted.
    pub fn beats(&self) -> u64 {
        self.beats.load(Ordering::SeqCst)
    }

    /// True once any ack said drain.
    pub fn drain_requested(&self) -> bool {
        self.drain.load(Ordering::SeqCst)
    }

    /// Sends one beat, bounded by the timeout. Returns whether the worker must drain (sticky:
    /// once true, true for good).
    ///
    /// # Errors
    /// The registry's status or DEADLINE_EXCEEDED; the failure is counted.
    pub async fn beat_once(&self, status: WorkerStatus) -> Result<bool, Status> {
        self.beats.fetch_add(1, Ordering::SeqCst);
        let res = match tokio::time::timeout(self.timeout, self.registry.heartbeat(status)).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "heartbeat took longer than {:?}",
                self.timeout
            ))),
        };
        match res {
            Ok(ack) => {
                self.failures.store(0, Ordering::SeqCst);
                if ack.drain {
                    self.drain.store(true, Ordering::SeqCst);
                }
                Ok(self.drain_requested())
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::SeqCst);
                Err(e)
            }
        }
    }
}

/// A running heartbeat task.
#[derive(Debug)]
pub struct HeartbeatTask {
    stop: watch::Sender<bool>,
    join: JoinHandle<()>,
}

impl HeartbeatTask {
    /// Stops the task and waits for it (promptly: a beat in progress is abandoned).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.join.await;
    }
}

/// Beats at once, then every `interval`, with a fresh status each time. Never stops on failure;
/// `on_drain` runs (once) when an ack first says drain.
pub fn spawn_heartbeat<R, S, D>(
    hb: Arc<Heartbeat<R>>,
    interval: Duration,
    status: S,
    on_drain: D,
) -> HeartbeatTask
where
    R: Registry,
    S: Fn() -> WorkerStatus + Send + 'static,
    D: Fn() + Send + 'static,
{
    let (stop, mut stopped) = watch::channel(false);
    let join = tokio::spawn(async move {
        let mut drained = false;
        loop {
            tokio::select! {
                r = hb.beat_once(status()) => {
                    if matches!(r, Ok(true)) && !drained {
                        drained = true;
                        on_drain();
                    }
                }
                _ = stopped.changed() => return,
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                _ = stopped.changed() => return,
            }
        }
    });
    HeartbeatTask { stop, join }
}
