//! `tl.control.v1.WorkerRegistry`, served by the gateway (or alone by `tl registry`).
//!
//! Engines beat every `heartbeat_ms` with their live load (the node's `heartbeat` module); the
//! registry keeps the last status of each worker in memory, forgets a worker after three missed
//! beats, and tells a worker to drain when an operator asked (SetDrain). A worker that has seen
//! `drain = true` stays draining. Time is always passed in (`now`), so tests drive it.

use super::worker::WorkerId;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvwire_grpc::glue::{self, Dispatch, Handler, MessageLimits, ResponseFuture, Routes};
use kvwire_grpc::pb::control::{
    HeartbeatAck, ListWorkersRequest, ListWorkersResponse, Role as PbRole, SetDrainRequest,
    SetDrainResponse, WorkerStatus, path,
};
use tokio_util::sync::DropGuard;
use tonic::Status;
use tonic::body::Body;

use super::worker::WorkerView;
pub use super::worker::{DEFAULT_HEARTBEAT_MS, MISSED_BEATS, is_stale};
use crate::net::authz::{RolePolicy, Table};
use crate::net::limits::LimitsSection;
use crate::net::server::{Lifecycle, bind, serve_grpc};
use crate::net::tls::{PeerId, PeerRole, Tls};

#[derive(Debug)]
struct Entry {
    status: WorkerStatus,
    last: Instant,
    drain: bool,
    /// Mirrored from etcd: alive while its lease is (etcd deletes the key), not by beats.
    leased: bool,
}

/// The mirror's freshness, when the registry mirrors etcd.
struct Mirror {
    /// When etcd last answered the mirror.
    synced: Instant,
    /// How long the last snapshot is routed on without an answer.
    stale: std::time::Duration,
    /// Writes drain requests to etcd.
    drain: Arc<dyn Fn(String, bool) + Send + Sync>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror")
            .field("synced", &self.synced)
            .field("stale", &self.stale)
            .finish_non_exhaustive()
    }
}

/// The registry's state: live workers and drain requests.
#[derive(Debug, Default)]
pub struct RegistryState {
    workers: Mutex<HashMap<WorkerId, Entry>>,
    /// Woken by every beat recorded: a request waiting for engines to register
    /// (`startup_grace_ms`) looks again then, instead of polling.
    beats: tokio::sync::Notify,
    /// Beats refused because another address holds the worker id's lease.
    conflicts: std::sync::atomic::AtomicU64,
    /// Set when the workers come from etcd ([`super::mirror::mirror`]).
    mirror: Mutex<Option<Mirror>>,
    /// The last snapshot routing took, and when: shared by the requests that route within
    /// [`SHARED_SNAPSHOT_FOR`] of it, dropped by any change to the workers.
    shared: Mutex<Option<(Instant, Arc<[WorkerView]>)>>,
}

/// How long requests route on one shared snapshot (its workers' ages are that much younger
/// than they are; a worker is forgotten only after three of its beats, 300 ms at least).
pub const SHARED_SNAPSHOT_FOR: std::time::Duration = std::time::Duration::from_millis(50);

impl RegistryState {
    /// The workers, for a change: the shared snapshot is dropped.
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerId, Entry>> {
        *self.shared_lock() = None;
        self.lock_read()
    }

    fn lock_read(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerId, Entry>> {
        self.workers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn shared_lock(&self) -> std::sync::MutexGuard<'_, Option<(Instant, Arc<[WorkerView]>)>> {
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`snapshot`](Self::snapshot), shared: requests routing within
    /// [`SHARED_SNAPSHOT_FOR`] of each other, with no change to the workers between, take the
    /// same one, so routing does not copy every worker's status for every request.
    #[must_use]
    pub fn snapshot_shared(&self, now: Instant) -> Arc<[WorkerView]> {
        if let Some((at, v)) = &*self.shared_lock()
            && now.saturating_duration_since(*at) < SHARED_SNAPSHOT_FOR
        {
            return Arc::clone(v);
        }
        let v: Arc<[WorkerView]> = self.snapshot(now).into();
        *self.shared_lock() = Some((now, Arc::clone(&v)));
        v
    }

    /// Records a beat received at `now`; the ack carries the drain request.
    pub fn heartbeat(&self, status: WorkerStatus, now: Instant) -> HeartbeatAck {
        // Callers that must not overflow use `record`; this one is for trusted, in-process use.
        let mut w = self.lock();
        let drain = w.get(&status.worker_id).is_some_and(|e| e.drain);
        w.insert(
            WorkerId::of(&status),
            Entry {
                status,
                last: now,
                drain,
                leased: false,
            },
        );
        drop(w);
        self.beats.notify_waiters();
        HeartbeatAck { drain }
    }

    /// Resolves at the next beat recorded after this future was first polled (or `enable`d).
    pub fn next_beat(&self) -> tokio::sync::futures::Notified<'_> {
        self.beats.notified()
    }

    /// Records a beat from a peer, within the registry's bounds: a worker id of at most
    /// [`MAX_WORKER_ID`] bytes, addresses of at most [`MAX_ADDRESS`], `heartbeat_ms` clamped to
    /// [`HEARTBEAT_MS_RANGE`], and at most `max_workers` workers (a known worker may always beat).
    ///
    /// # Errors
    /// INVALID_ARGUMENT for a field out of bounds, RESOURCE_EXHAUSTED for a new worker when the
    /// registry is full; nothing is recorded then.
    pub fn record(
        &self,
        mut status: WorkerStatus,
        now: Instant,
        max_workers: usize,
    ) -> Result<HeartbeatAck, Status> {
        Self::within_bounds(&status)?;
        status.heartbeat_ms = status
            .heartbeat_ms
            .clamp(*HEARTBEAT_MS_RANGE.start(), *HEARTBEAT_MS_RANGE.end());
        self.admit(status, now, max_workers)
    }

    /// The registry's bounds on one status: a worker id of 1 to [`MAX_WORKER_ID`] bytes and
    /// addresses (and model) of at most [`MAX_ADDRESS`].
    ///
    /// # Errors
    /// INVALID_ARGUMENT naming the field.
    pub fn within_bounds(status: &WorkerStatus) -> Result<(), Status> {
        if status.worker_id.is_empty() || status.worker_id.len() > MAX_WORKER_ID {
            return Err(Status::invalid_argument(format!(
                "worker_id must be 1 to {MAX_WORKER_ID} bytes"
            )));
        }
        for (name, a) in [
            ("http_address", &status.http_address),
            ("grpc_address", &status.grpc_address),
            ("kv_address", &status.kv_address),
            ("model", &status.model),
        ] {
            if a.len() > MAX_ADDRESS {
                return Err(Status::invalid_argument(format!(
                    "{name} is longer than {MAX_ADDRESS} bytes"
                )));
            }
        }
        // The role it serves in now is its own, or any for an engine of role both.
        let within = status.serving == PbRole::Unspecified as i32
            || status.serving == status.role
            || (status.role == PbRole::Both as i32
                && (PbRole::Prefill as i32..=PbRole::Both as i32).contains(&status.serving));
        if !within {
            return Err(Status::invalid_argument(format!(
                "serving role {} is not within role {}",
                status.serving, status.role
            )));
        }
        Ok(())
    }

    fn admit(
        &self,
        status: WorkerStatus,
        now: Instant,
        max_workers: usize,
    ) -> Result<HeartbeatAck, Status> {
        {
            let w = self.lock();
            // One id, one live process: a second address for an id whose lease is held (a
            // copied certificate, a second process started by mistake) is refused until the
            // first falls silent for three beats, instead of taking its traffic by turns.
            if let Some(e) = w.get(&status.worker_id)
                && !is_stale(&e.status, now.saturating_duration_since(e.last))
                && addresses(&e.status) != addresses(&status)
            {
                let held = e.status.grpc_address.clone();
                drop(w);
                self.conflicts
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(
                    worker = %status.worker_id,
                    live = %held,
                    refused = %status.grpc_address,
                    "identity conflict: a second address beat for a live worker id"
                );
                return Err(Status::already_exists(format!(
                    "worker {:?} is live at {held}; another address may register it only after \
                     three missed beats",
                    status.worker_id
                )));
            }
            if !w.contains_key(&status.worker_id) && w.len() >= max_workers {
                drop(w);
                // Make room from the dead before refusing the living.
                self.evict_stale(now);
                let w = self.lock();
                if !w.contains_key(&status.worker_id) && w.len() >= max_workers {
                    return Err(Status::resource_exhausted(format!(
                        "the registry holds {max_workers} workers"
                    )));
                }
            }
        }
        Ok(self.heartbeat(status, now))
    }

    /// Beats refused so far because another address held the worker id's lease.
    #[must_use]
    pub fn identity_conflicts(&self) -> u64 {
        self.conflicts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Forgets workers silent for more than three of their intervals; returns how many.
    pub fn evict_stale(&self, now: Instant) -> usize {
        let fresh = self.mirror_fresh(now);
        let mut w = self.lock_read();
        let before = w.len();
        w.retain(|_, e| {
            if e.leased {
                fresh
            } else {
                !is_stale(&e.status, now.saturating_duration_since(e.last))
            }
        });
        let evicted = before - w.len();
        drop(w);
        if evicted > 0 {
            *self.shared_lock() = None;
        }
        evicted
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
            .lock_read()
            .values()
            .map(|e| WorkerView {
                status: e.status.clone(),
                // A leased worker is alive while etcd says so: its key is the beat.
                age: if e.leased {
                    std::time::Duration::ZERO
                } else {
                    now.saturating_duration_since(e.last)
                },
            })
            .collect();
        v.sort_by(|a, b| a.status.worker_id.cmp(&b.status.worker_id));
        v
    }

    /// Sets or clears the drain request of a known worker (on etcd: writes its drain key).
    pub fn set_drain(&self, worker_id: &str, drain: bool) -> bool {
        if let Some(m) = self.mirror_lock().as_ref() {
            let found = self.lock().contains_key(worker_id);
            if found {
                (m.drain)(worker_id.to_owned(), drain);
            }
            return found;
        }
        match self.lock().get_mut(worker_id) {
            Some(e) => {
                e.drain = drain;
                true
            }
            None => false,
        }
    }
}

impl RegistryState {
    fn mirror_lock(&self) -> std::sync::MutexGuard<'_, Option<Mirror>> {
        self.mirror
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Makes this registry a mirror of etcd's workers: they come and go by
    /// [`mirror_put`](Self::mirror_put) and [`mirror_remove`](Self::mirror_remove), the last
    /// snapshot stays routable for `stale` after etcd last answered, and drain requests go to
    /// `drain`.
    pub fn mirror_etcd(
        &self,
        stale: std::time::Duration,
        drain: Arc<dyn Fn(String, bool) + Send + Sync>,
        now: Instant,
    ) {
        *self.mirror_lock() = Some(Mirror {
            synced: now,
            stale,
            drain,
        });
    }

    /// True unless this is a mirror that has not heard from etcd for longer than its bound.
    fn mirror_fresh(&self, now: Instant) -> bool {
        self.mirror_lock()
            .as_ref()
            .is_none_or(|m| now.saturating_duration_since(m.synced) <= m.stale)
    }

    /// etcd answered at `now`.
    pub fn mirror_synced(&self, now: Instant) {
        if let Some(m) = self.mirror_lock().as_mut() {
            m.synced = m.synced.max(now);
        }
    }

    /// A worker's key was written. A new worker beyond [`DEFAULT_MAX_WORKERS`] is not
    /// listed: whoever can write keys under the prefix cannot grow the gateway without bound.
    pub fn mirror_put(&self, mut status: WorkerStatus, now: Instant) {
        status.heartbeat_ms = status
            .heartbeat_ms
            .clamp(*HEARTBEAT_MS_RANGE.start(), *HEARTBEAT_MS_RANGE.end());
        let mut w = self.lock();
        if !w.contains_key(&status.worker_id) && w.len() >= DEFAULT_MAX_WORKERS {
            drop(w);
            tracing::warn!(
                worker = %status.worker_id,
                "etcd lists more than {DEFAULT_MAX_WORKERS} workers; not listing this one"
            );
            return;
        }
        w.insert(
            WorkerId::of(&status),
            Entry {
                status,
                last: now,
                drain: false,
                leased: true,
            },
        );
        drop(w);
        self.beats.notify_waiters();
    }

    /// A worker's key went (its lease ended).
    pub fn mirror_remove(&self, worker_id: &str) {
        self.lock().remove(worker_id);
    }

    /// Forgets `worker_id` only while it is listed with `role` (a registry `Role` as on the
    /// wire): the key of another role under the same id going away leaves it listed.
    pub fn mirror_remove_as(&self, worker_id: &str, role: i32) {
        let mut w = self.lock();
        if w.get(worker_id).is_some_and(|e| e.status.role == role) {
            w.remove(worker_id);
        }
    }

    /// etcd's workers as read at once: they replace every mirrored one.
    pub fn mirror_replace(&self, statuses: Vec<WorkerStatus>, now: Instant) {
        self.lock().retain(|_, e| !e.leased);
        for s in statuses {
            self.mirror_put(s, now);
        }
        self.mirror_synced(now);
    }
}

/// Longest worker id a registry records.
pub const MAX_WORKER_ID: usize = 128;

/// The addresses a worker serves on: what tells two processes with one id apart.
fn addresses(s: &WorkerStatus) -> (&str, &str, &str) {
    (&s.grpc_address, &s.http_address, &s.kv_address)
}

/// Longest address (and model name) a registry records.
pub const MAX_ADDRESS: usize = 256;

/// The heartbeat intervals a registry believes; others are clamped into it.
pub const HEARTBEAT_MS_RANGE: std::ops::RangeInclusive<u32> = 100..=60_000;

/// Workers a registry holds by default (`[limits] registry_max_workers`).
pub const DEFAULT_MAX_WORKERS: usize = 1024;

/// Who may call the WorkerRegistry (spec/identities.md). A heartbeat must also speak for its
/// own certificate (checked in the handler, which alone sees the message).
pub const POLICY: Table = &[
    (
        path::HEARTBEAT,
        &[PeerRole::Prefill, PeerRole::Decode, PeerRole::Both],
    ),
    (path::LIST_WORKERS, &[PeerRole::Gateway, PeerRole::Admin]),
    (path::SET_DRAIN, &[PeerRole::Gateway, PeerRole::Admin]),
];

/// The registry role that a certificate role may register as (gateway and admin: none).
fn registers_as(role: PeerRole) -> Option<PbRole> {
    crate::net::role::Role::try_from(role)
        .ok()
        .map(PbRole::from)
}

/// Registry messages are small: a larger one is refused by tonic's decoder (OUT_OF_RANGE)
/// before anything is allocated for it.
const SMALL: MessageLimits = MessageLimits {
    max_decode: 1 << 20,
    max_encode: usize::MAX,
};

/// The WorkerRegistry service.
#[derive(Debug)]
pub struct RegistryService {
    state: Arc<RegistryState>,
    max_workers: usize,
}

impl RegistryService {
    /// Serves `state`, holding at most [`DEFAULT_MAX_WORKERS`] workers.
    #[must_use]
    pub fn new(state: Arc<RegistryState>) -> Self {
        Self {
            state,
            max_workers: DEFAULT_MAX_WORKERS,
        }
    }

    /// Holds at most `n` workers.
    #[must_use]
    pub fn with_max_workers(mut self, n: usize) -> Self {
        self.max_workers = n;
        self
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
        let max_workers = self.max_workers;
        // Under mutual TLS the policy put the caller's identity here: a beat speaks only for it.
        let peer = req.extensions().get::<PeerId>().cloned();
        glue::serve_unary(req, SMALL, move |m: WorkerStatus| async move {
            if let Some(p) = peer {
                let role_ok = registers_as(p.role).is_some_and(|r| r as i32 == m.role);
                if p.id != m.worker_id || !role_ok {
                    return Err(Status::permission_denied(format!(
                        "{} may not beat for worker {:?} with role {}",
                        p.uri(),
                        m.worker_id,
                        m.role
                    )));
                }
            }
            s.record(m, Instant::now(), max_workers)
        })
    }

    fn list_workers(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let s = Arc::clone(&self.state);
        glue::serve_unary(req, SMALL, move |_: ListWorkersRequest| async move {
            Ok::<_, Status>(ListWorkersResponse {
                workers: s.list(Instant::now()),
            })
        })
    }

    fn set_drain(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let s = Arc::clone(&self.state);
        glue::serve_unary(req, SMALL, move |m: SetDrainRequest| async move {
            Ok::<_, Status>(SetDrainResponse {
                found: s.set_drain(&m.worker_id, m.drain),
            })
        })
    }
}

/// Serves the WorkerRegistry over `state` on `listen` (mutual TLS when `tls` is given, each
/// method checked against [`POLICY`]), holding at most `registry_max_workers`: the one way the
/// gateway and `tl registry` serve it.
///
/// # Errors
/// When the address cannot be bound or the TLS configuration cannot be built.
pub async fn serve_registry(
    life: &Lifecycle,
    listen: &str,
    state: Arc<RegistryState>,
    tls: Option<&Tls>,
    limits: &LimitsSection,
) -> std::io::Result<SocketAddr> {
    let svc = Dispatch::new(Arc::new(
        RegistryService::new(state).with_max_workers(limits.registry_max_workers.max(1)),
    ))
    .with_auth(RolePolicy::for_service::<RegistryService>(POLICY).when(tls.is_some()));
    let server_tls = tls
        .map(|t| t.server_config(&[b"h2"]))
        .transpose()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    serve_grpc(life, bind(listen).await?, svc, server_tls, limits.h2())
}

/// Serves `GET /metrics` (with `tl_workers{role}` from `state` at each scrape) and the probes on
/// `listen`, plaintext.
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve_metrics(
    life: &Lifecycle,
    listen: &str,
    state: Arc<RegistryState>,
    metrics: crate::telemetry::metrics::SharedMetrics,
    limits: &LimitsSection,
) -> std::io::Result<SocketAddr> {
    metrics.on_scrape(move |m| {
        super::worker::workers_by_role(m, &state.list(Instant::now()));
        crate::telemetry::metrics::Metrics::catch_up(
            &m.registry_identity_conflicts,
            state.identity_conflicts(),
        );
    });
    crate::net::server::serve_http(
        life,
        bind(listen).await?,
        crate::telemetry::metrics::router(metrics).merge(crate::net::probes::router(
            Arc::new(crate::net::probes::AlwaysReady),
            false,
        )),
        None,
        limits.http(),
    )
}

/// A registry served alone (`tl registry`).
#[derive(Debug)]
pub struct RegistryNode {
    state: Arc<RegistryState>,
    addr: SocketAddr,
    metrics_addr: SocketAddr,
    life: Lifecycle,
    _stop_on_drop: DropGuard,
}

impl RegistryNode {
    /// Serves a registry on `listen`, over mutual TLS when `tls` is given, and its metrics
    /// (`tl_workers{role}`) on `metrics_listen`.
    ///
    /// # Errors
    /// When an address cannot be bound.
    pub async fn start(
        listen: &str,
        tls: Option<&Tls>,
        metrics_listen: &str,
    ) -> std::io::Result<Self> {
        let state = Arc::new(RegistryState::default());
        let life = Lifecycle::new();
        let limits = LimitsSection::default();
        let addr = serve_registry(&life, listen, Arc::clone(&state), tls, &limits).await?;
        let metrics = Arc::new(crate::telemetry::metrics::Metrics::new());
        let metrics_addr =
            serve_metrics(&life, metrics_listen, Arc::clone(&state), metrics, &limits).await?;
        Ok(Self {
            state,
            addr,
            metrics_addr,
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

    /// `GET /metrics` address.
    #[must_use]
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// Stops the server.
    pub async fn stop(self) {
        self.life.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn worker(id: &str) -> WorkerStatus {
        WorkerStatus {
            worker_id: id.into(),
            grpc_address: "127.0.0.1:1".into(),
            heartbeat_ms: 100,
            ..Default::default()
        }
    }

    #[test]
    fn a_mirror_routes_on_its_snapshot_for_stale_ms_and_not_after() {
        let t0 = Instant::now();
        let s = RegistryState::default();
        s.mirror_etcd(Duration::from_secs(2), Arc::new(|_, _| {}), t0);
        s.mirror_replace(vec![worker("a"), worker("b")], t0);
        // Far beyond three beats of 100 ms: a leased worker does not age by beats.
        let later = t0 + Duration::from_millis(1_900);
        let v = s.snapshot(later);
        assert_eq!(v.len(), 2);
        assert!(
            v.iter().all(|w| w.age.is_zero()),
            "a leased worker's age is its lease's"
        );
        // etcd answered again: the bound counts from then.
        s.mirror_synced(t0 + Duration::from_secs(1));
        assert_eq!(s.snapshot(t0 + Duration::from_millis(2_900)).len(), 2);
        // Silent past stale_ms: no worker is routed to.
        assert!(s.snapshot(t0 + Duration::from_millis(3_100)).is_empty());
        // Back: a fresh read replaces the snapshot; a delete removes one worker.
        let back = t0 + Duration::from_secs(4);
        s.mirror_replace(vec![worker("a"), worker("b")], back);
        s.mirror_remove("b");
        let ids: Vec<String> = s.list(back).into_iter().map(|w| w.worker_id).collect();
        assert_eq!(ids, ["a"]);
    }

    #[test]
    fn a_mirrors_drain_request_goes_to_etcd_for_known_workers_only() {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let s = RegistryState::default();
        let a = Arc::clone(&asked);
        s.mirror_etcd(
            Duration::from_secs(5),
            Arc::new(move |id, drain| a.lock().unwrap().push((id, drain))),
            Instant::now(),
        );
        s.mirror_put(worker("a"), Instant::now());
        assert!(s.set_drain("a", true));
        assert!(!s.set_drain("zz", true));
        assert_eq!(*asked.lock().unwrap(), [("a".to_owned(), true)]);
    }

    #[test]
    fn a_mirror_lists_at_most_the_registrys_bound_of_workers() {
        let s = RegistryState::default();
        let now = Instant::now();
        s.mirror_etcd(Duration::from_secs(5), Arc::new(|_, _| {}), now);
        for i in 0..DEFAULT_MAX_WORKERS + 5 {
            s.mirror_put(worker(&format!("w{i:05}")), now);
        }
        assert_eq!(s.list(now).len(), DEFAULT_MAX_WORKERS);
        // A listed worker's update still lands.
        let mut w = worker("w00000");
        w.queue_depth = 9;
        s.mirror_put(w, now);
        assert_eq!(s.list(now)[0].queue_depth, 9);
    }
}
