//! The gateway: one OpenAI-compatible endpoint over prefill and decode engines, with the worker
//! registry the engines beat to.
//!
//! | job | file |
//! |---|---|
//! | configuration | [`config`] |
//! | the WorkerRegistry server (and `tl registry`) | [`registry`] |
//! | a worker as last heard from, and when it is stale | [`worker`] |
//! | choosing prefill and decode engines: a pure function | [`plan`] |
//! | the load this gateway routed to each engine, until each stream ends | [`routed`] |
//! | which decode engine holds which block, from their WatchBlocks streams | [`index`] |
//! | clients of the engines (one channel cache) | [`upstream`] |
//! | one request's life: its decisions, with no I/O | [`session`] |
//! | one request's life: the task that performs them | [`request`] |
//! | the OpenAI HTTP handlers | [`openai`] |
//! | API keys on the public endpoint | [`api_keys`] |
//! | the tenant of a request, its cache scope and its quotas | [`tenant`] |
//! | the served checkpoint's text side: tokenizer, template | [`text`] |
//! | the role planner: engines of role both moved between prefill and decode | [`roles`] |
//! | the registry on etcd, mirrored | [`mirror`] |
//! | chat templates rendered in processes bounded in memory and time | [`sandbox`] |

pub mod api_keys;
pub mod browser;
pub mod config;
pub mod fair;
pub mod index;
pub mod mirror;
pub mod openai;
pub mod plan;
pub mod queue;
pub mod registry;
pub mod request;
pub mod roles;
pub mod routed;
pub mod sandbox;
pub mod session;
pub mod tenant;
pub mod text;
pub mod upstream;
pub mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_grpc::pb::control::WorkerStatus;
use tokio::sync::Semaphore;
use tokio_util::sync::DropGuard;

use self::config::{GatewayConfig, GatewaySection};
use self::plan::Policy;
use self::registry::RegistryState;
use self::routed::RoutedLoad;
use self::upstream::Upstream;
use crate::net::limits::LimitsSection;
use crate::net::server::{Lifecycle, bind, serve_http};
use crate::net::tls::{PublicTls, Tls, TlsError};
use crate::telemetry::metrics::{Metrics, SharedMetrics};

/// The gateway's shared state.
#[derive(Debug)]
pub struct Gateway {
    registry: Arc<RegistryState>,
    cfg: GatewaySection,
    upstream: Arc<Upstream>,
    permits: Arc<Semaphore>,
    /// Templates and tokenizing in progress on the blocking pool (`prep_threads`).
    prep: Arc<fair::FairPlaces>,
    routed: Arc<RoutedLoad>,
    /// Where requests wait for a place on the prefill engines.
    queue: Arc<queue::WaitQueue>,
    /// The decode engines' blocks, from their streams (`route_from_index`).
    index: Arc<index::BlockIndex>,
    /// The last snapshot arranged for routing from the index, and the index generation at
    /// which all its decode candidates were seen synced.
    fleet: std::sync::Mutex<Option<(Arc<plan::Fleet>, Option<u64>)>>,
    /// Counts plans: spreads colocated requests over equal `both` engines.
    spread: std::sync::atomic::AtomicU64,
    api_keys: api_keys::ApiKeys,
    scopes: tenant::Scopes,
    quotas: Arc<tenant::Quotas>,
    metrics: SharedMetrics,
    /// The drain on SIGTERM.
    drain: Drain,
    /// When this gateway started: for a while after, a request that finds no engine waits for
    /// the engines to register (they beat to a fresh registry within one interval).
    started: Instant,
    /// The same, in seconds since the epoch: `created` of `/v1/models`.
    started_secs: u64,
    /// The served checkpoint's text side (`[gateway] model_path`); none: the byte tokenizer.
    text: Option<Arc<text::GatewayText>>,
    /// The model this gateway tokenizes for (its text side's fingerprint, or the byte
    /// vocabulary's): requests go only to engines that report the same model.
    fingerprint: String,
}

impl Gateway {
    /// A gateway over `registry`, reaching the engines over mutual TLS when `tls` is given.
    ///
    /// # Errors
    /// When the TLS client configuration cannot be built.
    pub fn new(
        registry: Arc<RegistryState>,
        cfg: GatewaySection,
        tls: Option<&Tls>,
        api_keys: api_keys::ApiKeys,
        limits: &LimitsSection,
    ) -> Result<Self, TlsError> {
        let scopes = tenant::Scopes::new(
            &scope_secret(&cfg.cache_scope_secret_file)?,
            cfg.shared_cache,
        );
        let api_keys = api_keys.tenants(
            &cfg.tenant_header,
            cfg.unauthenticated_admin,
            cfg.public_unauthenticated,
        );
        let quotas = Arc::new(tenant::Quotas::new(
            match cfg.max_inflight_per_key {
                0 => cfg.max_inflight / 4,
                n => n,
            },
            cfg.max_tokens_in_flight_per_key,
        ));
        let queue = Arc::new(queue::WaitQueue::new(queue::QueueLimits {
            max_queued: cfg.max_queued,
            prefill_tokens: cfg.queue_prefill_tokens.max(1),
            timeout: Duration::from_millis(cfg.queue_timeout_ms),
        }));
        Ok(Self {
            permits: Arc::new(Semaphore::new(cfg.max_inflight.max(1))),
            prep: Arc::new(fair::FairPlaces::new(match cfg.prep_threads {
                0 => std::thread::available_parallelism().map_or(2, |n| n.get().max(2)),
                n => n,
            })),
            upstream: Arc::new(Upstream::new(
                Duration::from_millis(cfg.has_blocks_timeout_ms),
                tls,
                limits.max_peer_channels.max(1),
            )?),
            registry,
            cfg,
            routed: Arc::new(RoutedLoad::default()),
            queue,
            index: Arc::default(),
            fleet: std::sync::Mutex::default(),
            spread: std::sync::atomic::AtomicU64::new(0),
            api_keys,
            scopes,
            quotas,
            metrics: Arc::new(Metrics::new()),
            drain: Drain::default(),
            started: Instant::now(),
            started_secs: crate::api::now_secs(),
            text: None,
            fingerprint: tl_engine_core::model::fingerprint(
                &tl_engine_core::vocab::Vocab::bytes(),
                None,
            ),
        })
    }

    /// The same gateway tokenizing with `text` (the checkpoint the engines serve).
    #[must_use]
    pub fn with_text(mut self, text: Option<Arc<text::GatewayText>>) -> Self {
        if let Some(t) = &text {
            self.fingerprint.clone_from(&t.fingerprint);
        }
        self.text = text;
        self
    }

    /// The model this gateway tokenizes for, as engines report theirs.
    #[must_use]
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The prefix index kept from the decode engines' streams.
    #[must_use]
    pub fn block_index(&self) -> &Arc<index::BlockIndex> {
        &self.index
    }

    /// The gateway's metrics.
    #[must_use]
    pub fn metrics(&self) -> &SharedMetrics {
        &self.metrics
    }

    /// The live workers.
    #[must_use]
    pub fn workers(&self) -> Vec<WorkerStatus> {
        self.registry.list(Instant::now())
    }

    /// The registry.
    #[must_use]
    pub fn registry(&self) -> &Arc<RegistryState> {
        &self.registry
    }

    /// Requests this gateway has on `worker` now: from each one's Prefill until its stream
    /// there ends.
    #[must_use]
    pub fn routed_on(&self, worker: &str) -> u32 {
        self.routed.on(worker)
    }

    fn policy(&self) -> Policy {
        Policy {
            load_penalty_tokens: self.cfg.load_penalty_tokens,
            // What a Prefill tries, and one more (the failover's pick comes from a new plan).
            ranked: self.cfg.prefill_decode_attempts as usize + 1,
            spread: self
                .spread
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// `<gateway id>-<128 random bits in hex>`: never reused, not guessable, so nobody can
    /// cancel another client's request by naming it.
    fn request_id(&self) -> String {
        format!("{}-{}", self.cfg.id, crate::net::tls::random_hex::<16>())
    }
}

/// A gateway's drain: `started` refuses new requests (503, and `/health` says so); `cut` ends
/// the requests still running with an error event naming the drain.
#[derive(Debug, Default)]
struct Drain {
    started: tokio_util::sync::CancellationToken,
    cut: tokio_util::sync::CancellationToken,
}

impl Gateway {
    /// Whether a drain has begun.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.drain.started.is_cancelled()
    }

    /// Requests waiting for a place on the prep pool (templates and tokenizing).
    #[must_use]
    pub fn prep_waiting(&self) -> usize {
        self.prep.waiting()
    }

    /// Requests running now.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.cfg.max_inflight.max(1) - self.permits.available_permits()
    }

    /// Drains: new requests are refused from now; running ones get until `grace` to finish;
    /// then each one left ends with an error event naming the drain (never a silent cut), and
    /// gets up to half a second to release what it holds on the engines. Returns how many were
    /// ended.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.drain.started.cancel();
        let idle = async {
            while self.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        if tokio::time::timeout(grace, idle).await.is_ok() {
            return 0;
        }
        let ended = self.in_flight();
        tracing::warn!(ended, "drain time is up: ending the requests still running");
        self.drain.cut.cancel();
        // The process must be gone within drain_ms plus a second (spec/limits.md): what a
        // request cannot release by then ends with its lease on the engine.
        let wait = self
            .retry_policy()
            .release_wait
            .min(Duration::from_millis(500));
        let _ = tokio::time::timeout(wait, async {
            while self.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        ended
    }
}

/// The cache scopes' HMAC key: the file's bytes, or 32 random bytes.
fn scope_secret(file: &str) -> Result<Vec<u8>, TlsError> {
    if file.is_empty() {
        return Ok(crate::net::tls::random_hex::<32>().into_bytes());
    }
    match std::fs::read(file) {
        Ok(bytes) if bytes.len() >= 16 => Ok(bytes),
        Ok(_) => Err(TlsError::Io {
            path: file.to_owned(),
            source: std::io::Error::other("a cache scope secret needs at least 16 bytes"),
        }),
        Err(source) => Err(TlsError::Io {
            path: file.to_owned(),
            source,
        }),
    }
}

/// Sets `tl_workers{role}` from the live workers by the role each serves in now, every role
/// reported (0 when none is live).
pub fn workers_by_role(m: &Metrics, live: &[WorkerStatus]) {
    use crate::net::role::Role;
    for role in Role::ALL {
        let n = live
            .iter()
            .filter(|w| worker::serving_role(w) == Some(role))
            .count();
        m.workers
            .get_or_create(&crate::telemetry::metrics::Role {
                role: role.name().to_owned(),
            })
            .set(n as i64);
    }
}

/// Makes `state` a mirror of the workers on etcd (`[registry]`), followed for the life of the
/// gateway; drain requests are written to etcd.
fn mirror_etcd(
    life: &Lifecycle,
    state: &Arc<RegistryState>,
    cfg: &GatewayConfig,
    tls: Option<&Tls>,
) -> Result<(), crate::etcd::EtcdError> {
    use crate::etcd::{Etcd, Keys, drain};
    let etcd = Arc::new(Etcd::new(
        &cfg.registry.etcd_endpoints,
        tls,
        Duration::from_secs(2),
    )?);
    let keys = Keys::new(&cfg.registry.prefix);
    let (e, k) = (Arc::clone(&etcd), keys.clone());
    let rt = tokio::runtime::Handle::current();
    state.mirror_etcd(
        Duration::from_millis(cfg.registry.stale_ms),
        Arc::new(move |id: String, drain: bool| {
            let (e, k) = (Arc::clone(&e), k.clone());
            rt.spawn(async move {
                if let Err(s) = drain::set_drain(&e, &k, &id, drain).await {
                    tracing::warn!(worker = %id, error = %s, "cannot write the drain key to etcd");
                }
            });
        }),
        Instant::now(),
    );
    life.spawn(mirror::mirror(
        etcd,
        keys,
        Arc::clone(state),
        life.token().clone(),
    ));
    Ok(())
}

/// A running gateway: registry and HTTP front.
#[derive(Debug)]
pub struct GatewayNode {
    gateway: Arc<Gateway>,
    registry_addr: SocketAddr,
    http_addr: SocketAddr,
    metrics_addr: SocketAddr,
    life: Lifecycle,
    _stop_on_drop: DropGuard,
}

impl GatewayNode {
    /// Starts a gateway.
    ///
    /// # Errors
    /// When an address cannot be bound.
    pub async fn start(cfg: &GatewayConfig) -> std::io::Result<Self> {
        let invalid = |e: &dyn std::fmt::Display| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
        };
        let tls = cfg
            .tls
            .as_ref()
            .map(Tls::load)
            .transpose()
            .map_err(|e| invalid(&e))?;
        cfg.validate().map_err(|e| invalid(&e))?;
        let g = &cfg.gateway;
        let api_keys = api_keys::ApiKeys::load(&g.api_keys_file, &g.admin_keys_file)
            .map_err(|e| invalid(&e))?;
        if api_keys.is_open() && !g.public_unauthenticated {
            return Err(invalid(&format!(
                "no API key configured ({} and TL_API_KEYS hold none): set keys, or \
                 [gateway] public_unauthenticated = true to serve /v1/* to anyone",
                if g.api_keys_file.is_empty() {
                    "api_keys_file is unset".to_owned()
                } else {
                    format!("api_keys_file {}", g.api_keys_file)
                }
            )));
        }
        let life = Lifecycle::new();
        let state = Arc::new(RegistryState::default());
        if cfg.registry.on_etcd() {
            mirror_etcd(&life, &state, cfg, tls.as_ref()).map_err(|e| invalid(&e))?;
        }
        let registry_addr = registry::serve_registry(
            &life,
            &g.registry_listen,
            Arc::clone(&state),
            tls.as_ref(),
            &cfg.limits,
        )
        .await?;
        let text = if g.model_path.is_empty() {
            None
        } else {
            Some(Arc::new(
                text::GatewayText::load(
                    &g.model_path,
                    tl_llama::text::RenderBounds {
                        fuel: g.template_fuel,
                        max_bytes: g.template_max_bytes,
                    },
                    g.render_worker.clone().map(|exe| sandbox::SandboxLimits {
                        exe,
                        memory_mib: g.template_memory_mib,
                        timeout: Duration::from_millis(g.template_timeout_ms),
                    }),
                )
                .map_err(|e| invalid(&e))?,
            ))
        };
        let gateway = Arc::new(
            Gateway::new(state, g.clone(), tls.as_ref(), api_keys, &cfg.limits)
                .map_err(|e| invalid(&e))?
                .with_text(text),
        );
        if g.route_from_index {
            let registry = Arc::clone(&gateway.registry);
            life.spawn(index::follow(
                Arc::clone(&gateway.index),
                Arc::clone(&gateway.upstream),
                move || registry.list(Instant::now()),
                Duration::from_millis(250),
                life.token().clone(),
            ));
        }
        if cfg.planner.enabled {
            life.spawn(roles::run(
                Arc::clone(&gateway),
                cfg.planner.clone(),
                life.token().clone(),
            ));
        }
        let public_tls = g
            .public_tls
            .as_ref()
            .map(PublicTls::server_config)
            .transpose()
            .map_err(|e| invalid(&e))?;
        let http_addr = serve_http(
            &life,
            bind(&g.http_listen).await?,
            openai::router(Arc::clone(&gateway)),
            public_tls,
            cfg.limits.http(),
        )?;
        let metrics_addr = registry::serve_metrics(
            &life,
            &g.metrics_listen,
            Arc::clone(&gateway.registry),
            Arc::clone(&gateway.metrics),
            &cfg.limits,
        )
        .await?;
        Ok(Self {
            gateway,
            registry_addr,
            http_addr,
            metrics_addr,
            _stop_on_drop: life.guard(),
            life,
        })
    }

    /// The gateway.
    #[must_use]
    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// The registry's state.
    #[must_use]
    pub fn registry(&self) -> &Arc<RegistryState> {
        &self.gateway.registry
    }

    /// HTTP address.
    #[must_use]
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// Registry address.
    #[must_use]
    pub fn registry_addr(&self) -> SocketAddr {
        self.registry_addr
    }

    /// `GET /metrics` address.
    #[must_use]
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// The listening line.
    #[must_use]
    pub fn listening_line(&self) -> String {
        serde_json::json!({
            "event": "listening",
            "http": self.http_addr.to_string(),
            "registry": self.registry_addr.to_string(),
            "metrics": self.metrics_addr.to_string(),
        })
        .to_string()
    }

    /// Stops both servers.
    pub async fn stop(self) {
        self.life.shutdown().await;
    }

    /// SIGTERM: [`Gateway::drain`] for up to `grace`, then stops. Returns how many requests the
    /// drain had to end.
    pub async fn shutdown(self, grace: Duration) -> usize {
        let ended = self.gateway.drain(grace).await;
        // The responses in flight (the error events just sent among them) get the servers'
        // stop grace to be written.
        self.life.shutdown().await;
        ended
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn request_ids_are_random_and_prefixed() {
        let g = Gateway::new(
            Arc::new(RegistryState::default()),
            GatewaySection {
                id: "gw-a".into(),
                ..GatewaySection::default()
            },
            None,
            api_keys::ApiKeys::default(),
            &LimitsSection::default(),
        )
        .unwrap();
        let ids: HashSet<String> = (0..1000).map(|_| g.request_id()).collect();
        assert_eq!(ids.len(), 1000, "an id repeated");
        for id in ids.iter().take(10) {
            let hex = id.strip_prefix("gw-a-").unwrap();
            assert_eq!(hex.len(), 32, "{id}: 128 bits");
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
    }
}
