//! Processes: an engine node (EngineControl, KvTransfer, HTTP, heartbeat) and a registry node,
//! started on the addresses of a configuration (port 0 picks a free port) and stopped cleanly.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvwire_grpc::server::tuned_server;
use kvwire_grpc::{GrpcTransport, KvReceiver, KvServerHandle, KvStore, TransportConfig, serve_kv};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;

use crate::config::Config;
use crate::control::{EngineControlService, Worker};
use crate::engine::Engine;
use crate::model::Model;
use crate::registry::{
    Addresses, GrpcRegistry, Heartbeat, HeartbeatTask, RegistryService, RegistryState,
    spawn_heartbeat, worker_status,
};
use crate::runner::Runner;

/// A server task with a shutdown switch.
#[derive(Debug)]
pub struct Served {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    join: JoinHandle<()>,
}

impl Served {
    /// The bound address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and waits for calls in flight.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.join).await;
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("bind {addr}: {e}")))
}

/// Serves one gRPC service on `listener`.
pub fn serve_grpc<S>(listener: TcpListener, svc: S) -> std::io::Result<Served>
where
    S: tower_service::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = tuned_server()
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        });
    let join = tokio::spawn(async move {
        if let Err(e) = server.await {
            eprintln!("grpc server on {addr}: {e}");
        }
    });
    Ok(Served {
        addr,
        stop: Some(stop),
        join,
    })
}

/// Serves an axum app on `listener`.
pub fn serve_http(listener: TcpListener, app: axum::Router) -> std::io::Result<Served> {
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    // Server-sent events are many small writes: without TCP_NODELAY, Nagle's algorithm and the
    // peer's delayed ACK hold each one back for ~40 ms.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let join = tokio::spawn(async move {
        let res = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = res {
            eprintln!("http server on {addr}: {e}");
        }
    });
    Ok(Served {
        addr,
        stop: Some(stop),
        join,
    })
}

/// A running engine.
#[derive(Debug)]
pub struct EngineNode {
    worker: Arc<Worker>,
    grpc: Served,
    kv: Option<KvServerHandle>,
    http: Option<Served>,
    heartbeat: Option<HeartbeatTask>,
    heartbeat_ms: u32,
}

impl EngineNode {
    /// Starts an engine as `cfg` says.
    ///
    /// # Errors
    /// When an address cannot be bound or the registry address is malformed.
    pub async fn start(cfg: &Config) -> std::io::Result<Self> {
        let model = cfg.build_model();
        let pool = cfg.build_pool();
        let mut engine = Engine::new(model.clone(), pool.clone());
        engine.set_cost(cfg.cost());
        let (runner, _thread) = Runner::start(engine);
        let shape = model.shape();
        let role = cfg.engine.role;
        let receiver = role.decodes().then(|| {
            let store: Arc<dyn KvStore> = Arc::new(pool.clone());
            Arc::new(KvReceiver::new(store, model_name(cfg)))
        });
        let transport = GrpcTransport::new(TransportConfig::for_envelope(
            shape.envelope_len(1).unwrap_or(usize::MAX / 2),
        ));
        let worker = Arc::new(Worker::new(
            cfg.engine.id.clone(),
            role,
            runner,
            transport,
            receiver.clone(),
        ));

        let grpc = serve_grpc(
            bind(&cfg.engine.grpc_listen).await?,
            EngineControlService::new(Arc::clone(&worker)),
        )?;
        let (kv, http) = match &receiver {
            Some(rx) => {
                let kv = serve_kv(bind(&cfg.engine.kv_listen).await?, Arc::clone(rx))?;
                let http = serve_http(
                    bind(&cfg.engine.http_listen).await?,
                    crate::http::router(Arc::clone(&worker)),
                )?;
                (Some(kv), Some(http))
            }
            None => (None, None),
        };
        let mut node = EngineNode {
            worker,
            grpc,
            kv,
            http,
            heartbeat: None,
            heartbeat_ms: cfg.engine.heartbeat_ms,
        };
        if !cfg.engine.gateway_registry.is_empty() {
            let timeout = Duration::from_millis(u64::from(cfg.engine.heartbeat_ms))
                .clamp(Duration::from_millis(100), Duration::from_secs(2));
            let reg = GrpcRegistry::new(&cfg.engine.gateway_registry, timeout).map_err(|s| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, s.message().to_owned())
            })?;
            node.heartbeat = Some(node.spawn_heartbeat(reg, timeout));
        }
        Ok(node)
    }

    fn spawn_heartbeat(&self, reg: GrpcRegistry, timeout: Duration) -> HeartbeatTask {
        let hb = Arc::new(Heartbeat::new(reg, timeout));
        let (w1, w2) = (Arc::clone(&self.worker), Arc::clone(&self.worker));
        let addrs = self.addresses();
        let ms = self.heartbeat_ms;
        spawn_heartbeat(
            hb,
            Duration::from_millis(u64::from(ms)),
            move || worker_status(&w1, &addrs, ms),
            move || w2.start_drain(),
        )
    }

    /// The worker behind the services.
    #[must_use]
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// The addresses served.
    #[must_use]
    pub fn addresses(&self) -> Addresses {
        Addresses {
            http: self
                .http
                .as_ref()
                .map(|s| s.addr().to_string())
                .unwrap_or_default(),
            grpc: self.grpc.addr().to_string(),
            kv: self
                .kv
                .as_ref()
                .map(|s| s.local_addr().to_string())
                .unwrap_or_default(),
        }
    }

    /// The first line a process prints: the addresses it bound.
    #[must_use]
    pub fn listening_line(&self) -> String {
        let mut m = serde_json::Map::new();
        m.insert("event".into(), "listening".into());
        m.insert("id".into(), self.worker.id().into());
        m.insert("grpc".into(), self.grpc.addr().to_string().into());
        if let Some(kv) = &self.kv {
            m.insert("kv".into(), kv.local_addr().to_string().into());
        }
        if let Some(h) = &self.http {
            m.insert("http".into(), h.addr().to_string().into());
        }
        serde_json::Value::Object(m).to_string()
    }

    /// Drains (refusing new work, waiting up to `deadline` for work in flight), then stops every
    /// server and the engine thread. Returns the work that remained.
    pub async fn shutdown(self, deadline: Duration) -> usize {
        use crate::control::PrefillBackend;
        let remaining = self.worker.drain(deadline).await;
        if let Some(hb) = self.heartbeat {
            hb.stop().await;
        }
        if let Some(h) = self.http {
            h.stop().await;
        }
        if let Some(kv) = self.kv {
            let _ = kv.shutdown().await;
        }
        self.grpc.stop().await;
        self.worker.runner().stop();
        remaining.max(0) as usize
    }
}

fn model_name(cfg: &Config) -> String {
    cfg.model.kind.clone()
}

/// A running registry.
#[derive(Debug)]
pub struct RegistryNode {
    state: Arc<RegistryState>,
    served: Served,
}

impl RegistryNode {
    /// Serves a registry on `listen`.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn start(listen: &str) -> std::io::Result<Self> {
        let state = Arc::new(RegistryState::default());
        let served = serve_grpc(
            bind(listen).await?,
            RegistryService::new(Arc::clone(&state)),
        )?;
        Ok(Self { state, served })
    }

    /// The state (live workers).
    #[must_use]
    pub fn state(&self) -> &Arc<RegistryState> {
        &self.state
    }

    /// The bound address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.served.addr()
    }

    /// Stops the server.
    pub async fn stop(self) {
        self.served.stop().await;
    }
}
