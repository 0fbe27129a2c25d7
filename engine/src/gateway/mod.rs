//! The gateway: one OpenAI-compatible endpoint over prefill and decode engines, with the worker
//! registry the engines beat to.
//!
//! | job | file |
//! |---|---|
//! | configuration | [`config`] |
//! | the WorkerRegistry server (and `tl registry`) | [`registry`] |
//! | choosing prefill and decode engines: a pure function | [`plan`] |
//! | requests in flight per engine | [`inflight`] |
//! | clients of the engines (one channel cache) | [`upstream`] |
//! | one request's life, as a task | [`request`] |
//! | the OpenAI HTTP handlers | [`openai`] |

pub mod config;
pub mod inflight;
pub mod openai;
pub mod plan;
pub mod registry;
pub mod request;
pub mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvwire_grpc::glue::Dispatch;
use kvwire_grpc::pb::control::WorkerStatus;
use tokio::sync::Semaphore;
use tokio_util::sync::DropGuard;

use self::config::GatewaySection;
use self::inflight::InFlight;
use self::plan::Policy;
use self::registry::{RegistryService, RegistryState};
use self::upstream::Upstream;
use crate::net::server::{Lifecycle, bind, serve_grpc, serve_http};

/// The gateway's shared state.
#[derive(Debug)]
pub struct Gateway {
    registry: Arc<RegistryState>,
    cfg: GatewaySection,
    upstream: Arc<Upstream>,
    permits: Arc<Semaphore>,
    inflight: Arc<InFlight>,
    next: AtomicU64,
}

impl Gateway {
    /// A gateway over `registry`.
    #[must_use]
    pub fn new(registry: Arc<RegistryState>, cfg: GatewaySection) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(cfg.max_inflight.max(1))),
            upstream: Arc::new(Upstream::new(Duration::from_millis(
                cfg.has_blocks_timeout_ms,
            ))),
            registry,
            cfg,
            inflight: Arc::new(InFlight::default()),
            next: AtomicU64::new(1),
        }
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

    fn policy(&self) -> Policy {
        Policy {
            load_penalty_tokens: self.cfg.load_penalty_tokens,
        }
    }

    fn request_id(&self) -> String {
        format!("gw-{}", self.next.fetch_add(1, Ordering::Relaxed))
    }
}

/// A running gateway: registry and HTTP front.
#[derive(Debug)]
pub struct GatewayNode {
    gateway: Arc<Gateway>,
    registry_addr: SocketAddr,
    http_addr: SocketAddr,
    life: Lifecycle,
    _stop_on_drop: DropGuard,
}

impl GatewayNode {
    /// Starts a gateway.
    ///
    /// # Errors
    /// When an address cannot be bound.
    pub async fn start(cfg: &GatewaySection) -> std::io::Result<Self> {
        let life = Lifecycle::new();
        let state = Arc::new(RegistryState::default());
        let svc = Dispatch::new(Arc::new(RegistryService::new(Arc::clone(&state))));
        let registry_addr = serve_grpc(&life, bind(&cfg.registry_listen).await?, svc)?;
        let gateway = Arc::new(Gateway::new(state, cfg.clone()));
        let http_addr = serve_http(
            &life,
            bind(&cfg.http_listen).await?,
            openai::router(Arc::clone(&gateway)),
        )?;
        Ok(Self {
            gateway,
            registry_addr,
            http_addr,
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

    /// The listening line.
    #[must_use]
    pub fn listening_line(&self) -> String {
        serde_json::json!({ "event": "listening", "http": self.http_addr.to_string(), "registry": self.registry_addr.to_string() }).to_string()
    }

    /// Stops both servers.
    pub async fn stop(self) {
        self.life.shutdown().await;
    }
}
