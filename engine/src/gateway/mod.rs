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
//! | the gateway's shared state, which the files above read | [`state`] |

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
pub mod state;
pub mod tenant;
pub mod text;
pub mod upstream;
pub mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::DropGuard;

use self::config::GatewayConfig;
use self::registry::RegistryState;
pub use self::state::Gateway;
pub use self::worker::workers_by_role;
use crate::net::server::{Lifecycle, bind, serve_http};
use crate::net::tls::{PublicTls, Tls};

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
