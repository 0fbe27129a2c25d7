//! `tl.control.v1.WorkerRegistry`, served by the gateway (or alone by `tl registry`).
//!
//! Engines beat every `heartbeat_ms` with their live load (the node's `heartbeat` module); the
//! registry keeps the last status of each worker in memory, forgets a worker after three missed
//! beats, and tells a worker to drain when an operator asked (SetDrain). A worker that has seen
//! `drain = true` stays draining. Time is always passed in (`now`), so tests drive it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvwire_grpc::glue::{self, Dispatch, Handler, Limits, ResponseFuture, Routes};
use kvwire_grpc::pb::control::{
    HeartbeatAck, ListWorkersRequest, ListWorkersResponse, SetDrainRequest, SetDrainResponse,
    WorkerStatus, path,
};
use tokio_util::sync::DropGuard;
use tonic::Status;
use tonic::body::Body;

use super::plan::WorkerView;
use crate::net::server::{Lifecycle, bind, serve_grpc};

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
        w.retain(|_, e| !is_stale(&e.status, now.saturating_duration_since(e.last)));
        before - w.len()
    }

    /// Live workers as of `now`, sorted by id.
    #[must_use]
    pub fn list(&self, now: Instant) -> Vec<WorkerStatus> {
        self.snapshot(now).into_iter().map(|v| v.status).collect()
    }

    /// Live workers as of `now`, sorted by id, each with the age of its last beat: what the
    /// route planner works over.
    #[must_use]
    pub fn snapshot(&self, now: Instant) -> Vec<WorkerView> {
        self.evict_stale(now);
        let mut v: Vec<WorkerView> = self
            .lock()
            .values()
            .map(|e| WorkerView {
                status: e.status.clone(),
                age: now.saturating_duration_since(e.last),
            })
            .collect();
        v.sort_by(|a, b| a.status.worker_id.cmp(&b.status.worker_id));
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

/// True when a worker's last beat is older than [`MISSED_BEATS`] of its intervals.
#[must_use]
pub fn is_stale(status: &WorkerStatus, age: Duration) -> bool {
    let ms = if status.heartbeat_ms == 0 {
        DEFAULT_HEARTBEAT_MS
    } else {
        status.heartbeat_ms
    };
    age > Duration::from_millis(u64::from(ms) * u64::from(MISSED_BEATS))
}

/// The WorkerRegistry service.
#[derive(Debug, Default)]
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

impl Routes for RegistryService {
    const NAME: &'static str = path::SERVICE;
    const ROUTES: &'static [(&'static str, Handler<Self>)] = &[
        (path::HEARTBEAT, Self::heartbeat),
        (path::LIST_WORKERS, Self::list_workers),
        (path::SET_DRAIN, Self::set_drain),
    ];
}

impl RegistryService {
    fn heartbeat(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let s = Arc::clone(&self.state);
        glue::serve_unary(req, Limits::default(), move |m: WorkerStatus| async move {
            if m.worker_id.is_empty() {
                return Err(Status::invalid_argument("empty worker_id"));
            }
            Ok(s.heartbeat(m, Instant::now()))
        })
    }

    fn list_workers(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let s = Arc::clone(&self.state);
        glue::serve_unary(
            req,
            Limits::default(),
            move |_: ListWorkersRequest| async move {
                Ok::<_, Status>(ListWorkersResponse {
                    workers: s.list(Instant::now()),
                })
            },
        )
    }

    fn set_drain(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let s = Arc::clone(&self.state);
        glue::serve_unary(
            req,
            Limits::default(),
            move |m: SetDrainRequest| async move {
                Ok::<_, Status>(SetDrainResponse {
                    found: s.set_drain(&m.worker_id, m.drain),
                })
            },
        )
    }
}

/// A registry served alone (`tl registry`).
#[derive(Debug)]
pub struct RegistryNode {
    state: Arc<RegistryState>,
    addr: SocketAddr,
    life: Lifecycle,
    _stop_on_drop: DropGuard,
}

impl RegistryNode {
    /// Serves a registry on `listen`.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn start(listen: &str) -> std::io::Result<Self> {
        let state = Arc::new(RegistryState::default());
        let life = Lifecycle::new();
        let svc = Dispatch::new(Arc::new(RegistryService::new(Arc::clone(&state))));
        let addr = serve_grpc(&life, bind(listen).await?, svc)?;
        Ok(Self {
            state,
            addr,
            _stop_on_drop: life.guard(),
            life,
        })
    }

    /// The state (live workers).
    #[must_use]
    pub fn state(&self) -> &Arc<RegistryState> {
        &self.state
    }

    /// The bound address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the server.
    pub async fn stop(self) {
        self.life.shutdown().await;
    }
}
