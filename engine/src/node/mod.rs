//! One engine process: the engine thread and the services a role builds around it.
//!
//! | part | built for | file |
//! |---|---|---|
//! | shared state: id, role, engine thread handle, drain | every role | [`state`] |
//! | the step thread | every role | [`runner`] |
//! | EngineControl (Prefill, Generate, Info, Cancel, Drain, WatchBlocks, SetRole) | every role | [`control`] |
//! | the prefill service | prefill, both | [`prefill`] |
//! | the KV receiver (KvTransfer) over the pool | decode, both | [`store`], `kvwire_grpc` |
//! | Generate: a request's tokens, resuming a pushed handle or colocated | decode, both | [`generate`] |
//! | the decode front (`/v1/completions`), a client of the same generator | decode, both | [`front`] |
//! | the heartbeat | when a registry is configured | [`heartbeat`] |
//! | the registration on etcd | when the registry is on etcd | [`registrar`] |
//! | WatchBlocks: the blocks this engine holds, as a stream | decode, both | [`blocks`] |
//! | the configuration | every role | [`config`] |

pub mod blocks;
pub mod config;
pub mod control;
pub mod front;
pub mod generate;
pub mod heartbeat;
pub mod prefill;
pub mod registrar;
pub mod runner;
pub mod state;
pub mod store;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use kvwire_grpc::glue::Dispatch;
use kvwire_grpc::{
    GrpcTransport, KvLookups, KvReceiver, KvStore, KvTransferService, ReceiverLimits,
    TransportConfig,
};
use tl_engine_core::engine::Engine;
use tokio_util::sync::DropGuard;

use self::config::Config;
use self::control::EngineControl;
use self::front::DecodeFront;
use self::heartbeat::{Addresses, Heartbeat, worker_status};
use self::prefill::PrefillService;
use self::runner::{EngineThread, Runner};
use self::state::NodeState;
use self::store::PoolStore;
use crate::net::advertised;
use crate::net::authz::{HttpPolicy, RolePolicy, Table, require_roles};
use crate::net::clients::RegistryClient;
use crate::net::server::{Lifecycle, bind, serve_grpc, serve_http, serve_router};
use crate::net::tls::{PeerRole, Tls};
use crate::telemetry::metrics::{self, KvObserver, Metrics, SharedMetrics};

/// Who may call KvTransfer (spec/identities.md).
pub const KV_POLICY: Table = &[
    (
        kvwire_grpc::pb::kv::path::HAS_BLOCKS,
        &[PeerRole::Gateway, PeerRole::Prefill, PeerRole::Both],
    ),
    (
        kvwire_grpc::pb::kv::path::PUSH_KV,
        &[PeerRole::Prefill, PeerRole::Both],
    ),
    (
        kvwire_grpc::pb::kv::path::RELEASE,
        &[PeerRole::Gateway, PeerRole::Prefill, PeerRole::Both],
    ),
];

/// Who may call HasBlocks and Release on a decode engine's control port: as on its KV port.
pub const LOOKUP_POLICY: Table = &[
    (
        kvwire_grpc::pb::kv::path::HAS_BLOCKS,
        &[PeerRole::Gateway, PeerRole::Prefill, PeerRole::Both],
    ),
    (
        kvwire_grpc::pb::kv::path::RELEASE,
        &[PeerRole::Gateway, PeerRole::Prefill, PeerRole::Both],
    ),
];

fn invalid(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
}

/// A running engine.
#[derive(Debug)]
pub struct EngineNode {
    state: Arc<NodeState>,
    addrs: Addresses,
    metrics_addr: String,
    metrics: SharedMetrics,
    receiver: Option<Arc<KvReceiver>>,
    life: Lifecycle,
    _stop_on_drop: DropGuard,
    thread: EngineThread,
    /// On etcd: the registrar whose lease a graceful shutdown revokes, so that gateways drop
    /// this engine at once rather than when the lease runs out.
    etcd: Option<Arc<registrar::EtcdRegistrar>>,
    /// The control plane's runtime (`engine.control_threads`); last, so it ends after the
    /// tasks above that run on it.
    _control: Option<ControlRuntime>,
}

/// The control plane's own tokio runtime: EngineControl's listener, connections and handlers,
/// the heartbeat and the registry client run on its threads, so a control call never waits in
/// a queue behind a KV connection's task (which reads megabytes per wakeup) on the data plane's
/// workers. It waits only for the kernel to give its thread a core, and a thread that wakes
/// from sleep is scheduled ahead of busy ones.
#[derive(Debug)]
struct ControlRuntime(Option<tokio::runtime::Runtime>, Arc<RealtimeOutcome>);

/// What became of `engine.control_realtime` on the control runtime's threads.
#[derive(Debug, Default)]
struct RealtimeOutcome {
    asked: bool,
    granted: std::sync::atomic::AtomicUsize,
    refused: std::sync::atomic::AtomicUsize,
}

impl ControlRuntime {
    /// `threads` workers (none: `Ok(None)`); with `realtime` 1..=99 each of the runtime's
    /// threads (its workers and its few blocking threads) asks for `SCHED_FIFO` at that
    /// priority as it starts.
    fn start(threads: usize, realtime: u8) -> std::io::Result<Option<Self>> {
        if threads == 0 {
            return Ok(None);
        }
        let outcome = Arc::new(RealtimeOutcome {
            asked: realtime > 0,
            ..RealtimeOutcome::default()
        });
        let seen = Arc::clone(&outcome);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("engine-control")
            .on_thread_start(move || {
                use std::sync::atomic::Ordering::Relaxed;
                if realtime == 0 {
                    return;
                }
                match crate::sched::set_fifo(realtime) {
                    Ok(()) => {
                        seen.granted.fetch_add(1, Relaxed);
                    }
                    Err(e) => {
                        if seen.refused.fetch_add(1, Relaxed) == 0 {
                            tracing::warn!(
                                priority = realtime,
                                error = %e,
                                "engine.control_realtime: SCHED_FIFO refused; the control \
                                 threads run at normal priority"
                            );
                        }
                    }
                }
            })
            .enable_all()
            .build()?;
        Ok(Some(Self(Some(rt), outcome)))
    }

    /// `Some(true)` when real-time scheduling was asked and every thread started so far got
    /// it, `Some(false)` when one was refused, `None` when it was not asked.
    fn realtime(&self) -> Option<bool> {
        use std::sync::atomic::Ordering::Relaxed;
        let o = &self.1;
        o.asked
            .then(|| o.refused.load(Relaxed) == 0 && o.granted.load(Relaxed) > 0)
    }
}

impl Drop for ControlRuntime {
    fn drop(&mut self) {
        // Dropped from async code (a node dropped in a test): do not block on its threads.
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Runs `f` (which creates and spawns what the control plane runs) in the control runtime's
/// context when there is one: tasks it spawns, listeners and channels it makes are that
/// runtime's. No `.await` may happen inside.
fn on_control<T>(rt: Option<&ControlRuntime>, f: impl FnOnce() -> T) -> T {
    match rt.and_then(|r| r.0.as_ref()) {
        Some(rt) => {
            let _ctx = rt.enter();
            f()
        }
        None => f(),
    }
}

/// `listener` moved to the current runtime's reactor.
fn rebind(listener: tokio::net::TcpListener) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::from_std(listener.into_std()?)
}

/// A decode engine's KV receiver over `pool`, within `cfg`'s limits.
fn receiver_for(
    cfg: &Config,
    pool: &tl_engine_core::pool::SharedKv,
    model: &Arc<dyn tl_engine_core::model::Model>,
) -> Arc<KvReceiver> {
    let limits = &cfg.limits;
    let shape = model.shape();
    let reserve = limits.reserve(cfg.pool.n_blocks);
    let store: Arc<dyn KvStore> = Arc::new(PoolStore(pool.clone(), reserve));
    let max_blocks = cfg.model.max_context.div_ceil(shape.block_tokens());
    let rl = ReceiverLimits {
        max_pushes: limits.max_pushes.max(1),
        max_blocks,
        max_pending_handles: limits.max_pending_handles.max(1),
        // One prefill identity takes at most half of each, unless configured.
        max_pushes_per_peer: match limits.max_pushes_per_peer {
            0 => (limits.max_pushes / 2).max(1),
            n => n,
        },
        max_pending_per_peer: match limits.max_pending_per_peer {
            0 => (limits.max_pending_handles / 2).max(1),
            n => n,
        },
    };
    Arc::new(
        KvReceiver::new(store, model.name().to_owned())
            .with_limits(rl)
            .with_lease(Duration::from_millis(limits.handle_lease_ms.max(1))),
    )
}

/// The engine's metrics, with the pool's and the receiver's figures read at each scrape.
fn node_metrics(
    pool: &tl_engine_core::pool::SharedKv,
    state: &NodeState,
    receiver: Option<&Arc<KvReceiver>>,
) -> SharedMetrics {
    let metrics: SharedMetrics = Arc::new(Metrics::new());
    {
        let pool = pool.clone();
        let load = state.runner().load().clone();
        metrics.on_scrape(move |m| {
            let c = pool.counts();
            m.set_pool(c.free, c.used, c.cached);
            Metrics::catch_up(&m.preemptions, load.preemptions());
        });
    }
    if let Some(rx) = receiver.cloned() {
        metrics.on_scrape(move |m| {
            let s = rx.stats();
            m.kv_handles_pending.set(s.pending as i64);
            Metrics::catch_up(&m.kv_handle_leases_expired, s.leases_expired);
        });
    }
    metrics
}

/// A prefill engine's service, pushing to servers that prove they decode.
fn prefill_service(
    cfg: &Config,
    tls: Option<&Tls>,
    state: &Arc<NodeState>,
    metrics: &SharedMetrics,
) -> std::io::Result<Arc<PrefillService>> {
    let limits = &cfg.limits;
    let shape = state.runner().model().shape();
    let push_connect = tls
        .map(|t| {
            t.connect(
                crate::net::dial::DECODE_TARGET,
                TransportConfig::for_envelope(0).connect_timeout,
            )
        })
        .transpose()
        .map_err(|e| invalid(&e))?;
    let mut tc = TransportConfig::for_envelope(shape.envelope_len(1).unwrap_or(usize::MAX / 2));
    tc.max_channels = limits.max_peer_channels.max(1);
    tc.keepalive = Some((
        Duration::from_millis(limits.keepalive_ms.max(1)),
        Duration::from_millis(limits.keepalive_timeout_ms.max(1)),
    ));
    let transport = GrpcTransport::new(tc).with_connector(push_connect);
    Ok(Arc::new(PrefillService::new(
        Arc::clone(state),
        transport,
        cfg.engine.push_while_prefilling,
        Arc::clone(metrics),
    )))
}

/// Refuses an etcd whose auth is off when it answers now; one that does not answer yet is
/// checked again before the first registration.
async fn etcd_auth_is_on(cfg: &Config, tls: Option<&Tls>) -> std::io::Result<()> {
    let etcd = crate::etcd::Etcd::new(&cfg.registry.etcd_endpoints, tls, Duration::from_secs(2))
        .map_err(|e| invalid(&e))?;
    let keys = crate::etcd::Keys::new(&cfg.registry.prefix);
    match crate::etcd::auth::is_on(&etcd, &keys).await {
        Ok(true) => {}
        Ok(false) => {
            let s = crate::etcd::auth::off_refused(&etcd.endpoints());
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                s.message().to_owned(),
            ));
        }
        Err(e) => {
            tracing::warn!(code = ?e.code(), error = e.message(), "etcd did not answer at start; its auth is checked again before registering");
        }
    }
    Ok(())
}

/// A decode engine's KvTransfer over `rx`, its imports on a lane of their own when configured.
fn kv_service(
    cfg: &Config,
    rx: &Arc<KvReceiver>,
    metrics: &SharedMetrics,
) -> std::io::Result<KvTransferService> {
    let kv = KvTransferService::with_limits(Arc::clone(rx), cfg.limits.service()).observed(
        Arc::new(KvObserver(Arc::clone(metrics), cfg.engine.id.clone())),
    );
    Ok(if cfg.engine.import_threads > 0 {
        kv.with_import_lane(import_lane(
            cfg.engine.import_threads,
            cfg.engine.import_nice,
        )?)
    } else {
        kv
    })
}

/// What a decode engine serves besides EngineControl: KvTransfer on `kv_listen`, and the HTTP
/// front on `http_listen`.
struct Decode<'a> {
    state: &'a Arc<NodeState>,
    receiver: Arc<KvReceiver>,
    kv: KvTransferService,
    generator: Arc<generate::Generator>,
    metrics: &'a SharedMetrics,
}

impl Decode<'_> {
    /// Serves both; returns their advertised addresses (KvTransfer, HTTP).
    async fn serve(
        self,
        life: &Lifecycle,
        cfg: &Config,
        tls: Option<&Tls>,
    ) -> std::io::Result<(String, String)> {
        let (limits, mtls) = (&cfg.limits, tls.is_some());
        let advertise = &cfg.engine.advertise_address;
        let server_tls = |alpn: &[u8]| {
            tls.map(|t| t.server_config(&[alpn]))
                .transpose()
                .map_err(invalid)
        };
        let kv = self
            .kv
            .into_service()
            .with_auth(RolePolicy::for_service::<KvTransferService>(KV_POLICY).when(mtls));
        let kv = serve_grpc(
            life,
            bind(&cfg.engine.kv_listen).await?,
            kv,
            server_tls(b"h2")?,
            limits.h2(),
        )?;
        life.spawn(kvwire_grpc::server::sweep_leases(
            self.receiver,
            life.token().clone(),
        ));
        let front = Arc::new(DecodeFront::new(Arc::clone(self.state), self.generator));
        let policy = HttpPolicy {
            roles: front::POLICY,
            mtls,
        };
        let app = front
            .router()
            .layer(axum::extract::DefaultBodyLimit::max(limits.max_body_bytes))
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(self.metrics),
                metrics::count_requests,
            ))
            .layer(axum::middleware::from_fn_with_state(policy, require_roles));
        let http = serve_http(
            life,
            bind(&cfg.engine.http_listen).await?,
            app,
            server_tls(b"http/1.1")?,
            limits.http(),
        )?;
        Ok((advertised(kv, advertise)?, advertised(http, advertise)?))
    }
}

impl EngineNode {
    /// Starts an engine as `cfg` says: the engine thread, then what its role builds.
    ///
    /// # Errors
    /// When an address cannot be bound, the registry address is malformed, or the engine
    /// thread cannot start.
    pub async fn start(cfg: &Config) -> std::io::Result<Self> {
        // Whoever built the configuration (a file, flags, a test), nothing out of range starts.
        cfg.validate().map_err(invalid)?;
        let tls = cfg
            .tls
            .as_ref()
            .map(Tls::load)
            .transpose()
            .map_err(invalid)?;
        let mtls = tls.is_some();
        let server_tls = |alpn: &[u8]| {
            tls.as_ref()
                .map(|t| t.server_config(&[alpn]))
                .transpose()
                .map_err(invalid)
        };
        let model = cfg.build_model().map_err(invalid)?;
        let pool = cfg.build_pool();
        let mut engine = Engine::new(model.clone(), pool.clone());
        engine.set_cost(cfg.cost());
        engine.set_scheduler(tl_engine_core::scheduler::Scheduler {
            max_prefill_tokens: (cfg.engine.max_prefill_tokens > 0)
                .then_some(cfg.engine.max_prefill_tokens),
            max_step_tokens: (cfg.engine.max_step_tokens > 0).then_some(cfg.engine.max_step_tokens),
        });
        let (runner, thread) = Runner::start(engine)?;
        let role = cfg.engine.role;
        let limits = &cfg.limits;
        let receiver = role.decodes().then(|| receiver_for(cfg, &pool, &model));
        let state = Arc::new(NodeState::new(
            cfg.engine.id.clone(),
            role,
            runner,
            receiver.clone(),
        ));
        if let Some(r) = cfg.engine.serving {
            state.set_serving(r).map_err(invalid)?;
        }
        let life = Lifecycle::new();
        let stop_on_drop = life.guard();
        let control_rt =
            ControlRuntime::start(cfg.engine.control_threads, cfg.engine.control_realtime)?;
        let ctl = control_rt.as_ref();
        let metrics = node_metrics(&pool, &state, receiver.as_ref());

        let prefill = if role.prefills() {
            Some(prefill_service(cfg, tls.as_ref(), &state, &metrics)?)
        } else {
            None
        };

        // Gateways route from each decode engine's index as it streams it (WatchBlocks).
        let feed = role.decodes().then(|| {
            Arc::new(blocks::BlockFeed::attach(
                &pool,
                &cfg.engine.id,
                limits.max_block_watchers,
                Duration::from_millis(limits.push_idle_ms.max(1)),
            ))
        });
        // Requests decoded here, over Generate and the HTTP front alike.
        let generator = receiver.clone().map(|rx| {
            Arc::new(generate::Generator::new(
                Arc::clone(&state),
                rx,
                limits.http_max_inflight.max(1),
                life.aborted(),
            ))
        });
        let control = EngineControl::new(Arc::clone(&state), prefill, receiver.clone())
            .with_feed(feed)
            .with_generator(generator.clone());
        let svc = Dispatch::new(Arc::new(control))
            .with_auth(RolePolicy::for_service::<EngineControl>(control::POLICY).when(mtls));
        let advertise = &cfg.engine.advertise_address;
        let h2 = limits.h2();
        let grpc_listener = bind(&cfg.engine.grpc_listen).await?;
        let grpc_tls = server_tls(b"h2")?;
        // A decode engine's KvTransfer, and its HasBlocks and Release also on the control
        // port, answered on the control threads: a lookup never waits for a core an import
        // holds (the gateway hands this address to prefill engines as decode_lookup).
        let kv_svc = receiver
            .as_ref()
            .map(|rx| kv_service(cfg, rx, &metrics))
            .transpose()?;
        let lookups = kv_svc.as_ref().map(|kv| {
            kv.lookups()
                .into_service()
                .with_auth(RolePolicy::for_service::<KvLookups>(LOOKUP_POLICY).when(mtls))
        });
        let grpc = on_control(ctl, || {
            let router = kvwire_grpc::server::tuned_server(h2)
                .add_service(svc)
                .add_optional_service(lookups);
            serve_router(&life, rebind(grpc_listener)?, router, grpc_tls)
        })?;
        let mut addrs = Addresses {
            grpc: advertised(grpc, advertise)?,
            ..Addresses::default()
        };
        if let (Some(rx), Some(kv), Some(generator)) = (receiver.clone(), kv_svc, &generator) {
            let decode = Decode {
                state: &state,
                receiver: rx,
                kv,
                generator: Arc::clone(generator),
                metrics: &metrics,
            };
            (addrs.kv, addrs.http) = decode.serve(&life, cfg, tls.as_ref()).await?;
        }
        // An etcd whose auth is off is refused at start when it answers now; one that does not
        // answer yet is checked again before the first registration.
        if cfg.registry.on_etcd() && !cfg.registry.allow_no_auth {
            etcd_auth_is_on(cfg, tls.as_ref()).await?;
        }
        // The heartbeat and the registry's client (its channel's task too) on the control
        // runtime: a beat is never late because the data plane's workers are busy.
        let on_etcd = on_control(ctl, || {
            register(&life, &state, &metrics, &addrs, cfg, tls.as_ref())
        })?;
        let metrics_listener = serve_http(
            &life,
            bind(&cfg.engine.metrics_listen).await?,
            metrics::router(Arc::clone(&metrics)).merge(crate::net::probes::router(
                Arc::clone(&state) as Arc<dyn crate::net::probes::Probe>,
                cfg.engine.drain_probe,
            )),
            None,
            limits.http(),
        )?;
        let metrics_addr = advertised(metrics_listener, advertise)?;
        Ok(Self {
            state,
            addrs,
            metrics_addr,
            metrics,
            receiver,
            life,
            _stop_on_drop: stop_on_drop,
            thread,
            etcd: on_etcd,
            _control: control_rt,
        })
    }

    /// The state every part shares.
    #[must_use]
    pub fn state(&self) -> &Arc<NodeState> {
        &self.state
    }

    /// The engine thread's handle.
    #[must_use]
    pub fn runner(&self) -> &Runner {
        self.state.runner()
    }

    /// The KV receiver (decode roles).
    #[must_use]
    pub fn receiver(&self) -> Option<&Arc<KvReceiver>> {
        self.receiver.as_ref()
    }

    /// Whether the control runtime's threads run under `SCHED_FIFO` (`engine.control_realtime`):
    /// `None` when it was not asked (or there is no control runtime), `Some(false)` when the
    /// kernel refused it for a thread.
    #[must_use]
    pub fn control_realtime(&self) -> Option<bool> {
        self._control.as_ref().and_then(ControlRuntime::realtime)
    }

    /// The addresses served.
    #[must_use]
    pub fn addresses(&self) -> Addresses {
        self.addrs.clone()
    }

    /// The `GET /metrics` address.
    #[must_use]
    pub fn metrics_address(&self) -> &str {
        &self.metrics_addr
    }

    /// This engine's metrics.
    #[must_use]
    pub fn metrics(&self) -> &SharedMetrics {
        &self.metrics
    }

    /// The first line a process prints: the addresses it bound (keys for what it serves).
    #[must_use]
    pub fn listening_line(&self) -> String {
        let mut m = serde_json::Map::new();
        m.insert("event".into(), "listening".into());
        m.insert("id".into(), self.state.id().into());
        m.insert("grpc".into(), self.addrs.grpc.clone().into());
        if !self.addrs.kv.is_empty() {
            m.insert("kv".into(), self.addrs.kv.clone().into());
        }
        if !self.addrs.http.is_empty() {
            m.insert("http".into(), self.addrs.http.clone().into());
        }
        m.insert("metrics".into(), self.metrics_addr.clone().into());
        serde_json::Value::Object(m).to_string()
    }

    /// Stops at once, as `kill -9` would look to peers: no drain, HTTP streams in flight cut,
    /// no more beats. The engine thread is joined.
    pub async fn kill(self) {
        self.life.abort().await;
        self.thread.join().await;
    }

    /// Drains (refusing new work, waiting up to `deadline` for work in flight), then stops every
    /// server and task and joins the engine thread. Returns the work that remained.
    pub async fn shutdown(self, deadline: Duration) -> usize {
        let remaining = self.state.drain(deadline).await;
        // Leave the registry now: the heartbeat stops with the tasks below, and a lease left
        // to run out would keep this engine listed for up to three beats.
        if let Some(r) = &self.etcd {
            self.life.token().cancel();
            match tokio::time::timeout(Duration::from_secs(1), r.leave()).await {
                Ok(Ok(())) => tracing::info!("left the registry on etcd (lease revoked)"),
                Ok(Err(s)) => {
                    tracing::warn!(code = ?s.code(), error = %s.message(), "cannot revoke the etcd lease; it runs out in three beats");
                }
                Err(_) => tracing::warn!(
                    "revoking the etcd lease took over 1 s; it runs out in three beats"
                ),
            }
        }
        self.life.shutdown().await;
        self.thread.join().await;
        remaining
    }
}

/// The import lane of a decode engine: `threads` threads at nice value `nice`, so that the
/// bulk copy of pushed blocks yields its core to the async workers (control calls, HasBlocks,
/// the HTTP front) whenever they have work. A thread that cannot lower its priority (a
/// platform without per-thread nice values) imports at the normal one and says so.
fn import_lane(threads: usize, nice: i32) -> std::io::Result<kvwire_grpc::ImportLane> {
    kvwire_grpc::ImportLane::with_thread_start("kv-import", threads, move || {
        if nice == 0 {
            return;
        }
        // On Linux a nice value is a thread's own: this lowers only the lane thread.
        if let Err(e) = rustix::process::setpriority_process(None, nice) {
            tracing::warn!(nice, error = %e, "the import lane keeps the normal priority");
        }
    })
}

/// Registers the engine where `cfg` says, beating on the current runtime: on etcd (the
/// registrar is returned, to leave at shutdown), or to a gateway's registry, or nowhere.
fn register(
    life: &Lifecycle,
    state: &Arc<NodeState>,
    metrics: &SharedMetrics,
    addrs: &Addresses,
    cfg: &Config,
    tls: Option<&Tls>,
) -> std::io::Result<Option<Arc<registrar::EtcdRegistrar>>> {
    let mut on_etcd = None;
    if cfg.registry.on_etcd() {
        let ms = cfg.engine.heartbeat_ms;
        let interval = Duration::from_millis(u64::from(ms));
        let timeout = interval.clamp(Duration::from_millis(500), Duration::from_secs(2));
        let etcd = Arc::new(
            crate::etcd::Etcd::new(&cfg.registry.etcd_endpoints, tls, timeout)
                .map_err(|e| invalid(&e))?,
        );
        let keys = crate::etcd::Keys::new(&cfg.registry.prefix);
        {
            let s = Arc::clone(state);
            life.spawn(crate::etcd::drain::watch_drain(
                Arc::clone(&etcd),
                keys.clone(),
                cfg.engine.id.clone(),
                move || s.start_drain(),
                life.token().clone(),
            ));
        }
        let registry = Arc::new(
            registrar::EtcdRegistrar::new(etcd, keys, ms).allow_no_auth(cfg.registry.allow_no_auth),
        );
        on_etcd = Some(Arc::clone(&registry));
        let target = cfg.registry.etcd_endpoints.join(",");
        let hb = Arc::new(Heartbeat::new(registry, timeout).named(&target));
        state.awaits_registration(&target);
        self::start_heartbeat(life, state, metrics, addrs, hb, cfg);
    } else if !cfg.engine.gateway_registry.is_empty() {
        let ms = cfg.engine.heartbeat_ms;
        let interval = Duration::from_millis(u64::from(ms));
        let timeout = interval.clamp(Duration::from_millis(100), Duration::from_secs(2));
        // The registry must prove it is a gateway: a worker's certificate cannot drain us.
        let registry = match tls {
            Some(t) => RegistryClient::with_connector(
                &cfg.engine.gateway_registry,
                timeout,
                &t.connect(crate::net::dial::REGISTRY, timeout)
                    .map_err(|e| invalid(&e))?,
            ),
            None => RegistryClient::new(&cfg.engine.gateway_registry, timeout),
        }
        .map_err(|s| invalid(s.message()))?;
        let hb = Arc::new(Heartbeat::new(registry, timeout).named(&cfg.engine.gateway_registry));
        state.awaits_registration(&cfg.engine.gateway_registry);
        self::start_heartbeat(life, state, metrics, addrs, hb, cfg);
    }
    Ok(on_etcd)
}

/// Beats to `hb`'s registry for the life of the node, with the node's live status; the
/// heartbeat's failures are counted in the node's metrics.
fn start_heartbeat<R: heartbeat::Registry>(
    life: &Lifecycle,
    state: &Arc<NodeState>,
    metrics: &SharedMetrics,
    addrs: &Addresses,
    hb: Arc<Heartbeat<R>>,
    cfg: &Config,
) {
    let (limits, role) = (&cfg.limits, cfg.engine.role);
    let shape = &state.runner().model().shape();
    let ms = cfg.engine.heartbeat_ms;
    let interval = Duration::from_millis(u64::from(ms));
    {
        let hb = Arc::clone(&hb);
        metrics.on_scrape(move |m| {
            Metrics::catch_up(&m.heartbeat_failures, hb.failed_total());
        });
    }
    let (s1, s2, s3, a) = (
        Arc::clone(state),
        Arc::clone(state),
        Arc::clone(state),
        addrs.clone(),
    );
    // The longest sequence this engine can ever hold: its context, within the pool a
    // push may fill (less the reserve held back for running sequences).
    let b = shape.block_tokens();
    let room = if role.decodes() {
        cfg.pool.n_blocks - limits.reserve(cfg.pool.n_blocks) as u32
    } else {
        cfg.pool.n_blocks
    };
    let usable_context = cfg.model.max_context.min(room.saturating_mul(b));
    // What this engine serves, hashed once: the gateway routes only to engines of its model.
    let fingerprint = {
        let model = state.runner().model();
        tl_engine_core::model::fingerprint(&model.tokens(), model.identity().as_deref())
    };
    life.spawn(hb.run(
        interval,
        move || kvwire_grpc::pb::control::WorkerStatus {
            usable_context,
            fingerprint: fingerprint.clone(),
            ..worker_status(&s1, &a, ms)
        },
        move || s3.registered(),
        move || s2.start_drain(),
        state.drain_started(),
        life.token().clone(),
    ));
}

#[cfg(test)]
mod tests {
    use super::ControlRuntime;

    /// With `control_realtime` the control runtime's threads run SCHED_FIFO exactly when this
    /// process may set it (probed on a scratch thread), and say so; without it they do not.
    #[test]
    fn control_threads_take_the_realtime_policy_when_asked_and_allowed() {
        let allowed = std::thread::spawn(|| crate::sched::set_fifo(1).is_ok())
            .join()
            .unwrap();
        let on_control = |rt: &ControlRuntime| {
            let handle = rt.0.as_ref().unwrap().handle().clone();
            std::thread::spawn(move || {
                handle.block_on(handle.spawn(async { crate::sched::is_fifo() }))
            })
            .join()
            .unwrap()
            .unwrap()
        };
        let rt = ControlRuntime::start(1, 10).unwrap().unwrap();
        assert_eq!(on_control(&rt), allowed);
        assert_eq!(rt.realtime(), Some(allowed));
        let plain = ControlRuntime::start(1, 0).unwrap().unwrap();
        assert!(!on_control(&plain));
        assert_eq!(plain.realtime(), None);
        assert!(ControlRuntime::start(0, 10).unwrap().is_none());
    }
}
