//! Starting and stopping servers and long-lived tasks, one way for every process: a
//! [`Lifecycle`] is a cancellation token that every task watches and a tracker that knows when
//! they have all finished (tokio-util's `CancellationToken` and `TaskTracker`).

use std::future::Future;
use std::net::SocketAddr;

use kvwire_grpc::glue::{Dispatch, Routes};
use kvwire_grpc::server::tuned_server;
use tokio::net::TcpListener;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;
use tonic::transport::server::TcpIncoming;

/// The tasks of one process (or one node inside a test process) and their stop signal.
#[derive(Clone, Debug, Default)]
pub struct Lifecycle {
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl Lifecycle {
    /// A lifecycle with no task yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The stop signal every task watches.
    #[must_use]
    pub fn token(&self) -> &CancellationToken {
        &self.stop
    }

    /// A guard that fires the stop signal when dropped (a node dropped without a shutdown still
    /// stops its servers).
    #[must_use]
    pub fn guard(&self) -> DropGuard {
        self.stop.clone().drop_guard()
    }

    /// Runs `task` until it ends; it must end soon after [`token`](Self::token) fires.
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Fires the stop signal and waits until every task has ended.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Binds `addr`, naming it in the error.
///
/// # Errors
/// When the address cannot be bound.
pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("bind {addr}: {e}")))
}

/// Serves one hand-written gRPC service on `listener` until `life` stops; calls in flight finish.
///
/// # Errors
/// When the listener has no local address.
pub fn serve_grpc<S: Routes>(
    life: &Lifecycle,
    listener: TcpListener,
    svc: Dispatch<S>,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = tuned_server()
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, life.token().clone().cancelled_owned());
    life.spawn(async move {
        if let Err(e) = server.await {
            eprintln!("grpc server on {addr}: {e}");
        }
    });
    Ok(addr)
}

/// Serves an axum app on `listener` until `life` stops; responses in flight finish.
///
/// # Errors
/// When the listener has no local address.
pub fn serve_http(
    life: &Lifecycle,
    listener: TcpListener,
    app: axum::Router,
) -> std::io::Result<SocketAddr> {
    use axum::serve::ListenerExt;
    let addr = listener.local_addr()?;
    // Server-sent events are many small writes: without TCP_NODELAY, Nagle's algorithm and the
    // peer's delayed ACK hold each one back for ~40 ms.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let stop = life.token().clone().cancelled_owned();
    life.spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .await
        {
            eprintln!("http server on {addr}: {e}");
        }
    });
    Ok(addr)
}
