//! Probes for orchestrators, served beside `GET /metrics` on the plaintext metrics listener (a
//! kubelet or a compose health check cannot present a client certificate):
//!
//! - `GET /livez`: 200 while the process answers.
//! - `GET /readyz`: 200 when it takes new work, 503 with the reason otherwise (a draining
//!   engine is not ready, so a load balancer stops sending it work).
//! - `POST /drain?deadline_ms=N`: starts a drain and answers when the work in flight has ended
//!   or `N` ms (at most 10 minutes) have passed, with `{"remaining": n}`. It is what a pod's
//!   `preStop` hook runs, inside the pod, so it is **off unless the operator turns it on**
//!   (`[engine] drain_probe = true`): a drain cannot be undone, and on a shared host every
//!   local user, and every web page through the browser, reaches loopback. When on, only a
//!   caller on loopback may ask, and never a browser (a request with `Origin` or
//!   `Sec-Fetch-Site`); 403 otherwise.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::server::Caller;

/// The longest drain a probe may ask for.
pub const MAX_DRAIN: Duration = Duration::from_secs(600);

/// Why a process does not take new work (`GET /readyz` answers 503 with it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotReady {
    /// The worker is draining.
    #[error("worker {worker} is draining")]
    Draining {
        /// Its id.
        worker: String,
    },
    /// The worker's registry has not acknowledged a beat yet.
    #[error("worker {worker} is not registered yet: no beat to {registry} acknowledged")]
    Unregistered {
        /// Its id.
        worker: String,
        /// The registry it beats to.
        registry: String,
    },
}

/// What the probes ask a process.
pub trait Probe: Send + Sync + 'static {
    /// `Ok` when it takes new work; else why not.
    ///
    /// # Errors
    /// The reason it is not ready.
    fn ready(&self) -> Result<(), NotReady>;

    /// Starts draining and resolves with the work left once it has ended or `deadline` passed;
    /// `None` when this process has nothing to drain.
    fn drain(
        self: Arc<Self>,
        deadline: Duration,
    ) -> Pin<Box<dyn Future<Output = Option<usize>> + Send>>;
}

/// A process that is ready while it runs and has no drain of its own (the gateway, the
/// registry).
#[derive(Clone, Copy, Debug, Default)]
pub struct AlwaysReady;

impl Probe for AlwaysReady {
    fn ready(&self) -> Result<(), NotReady> {
        Ok(())
    }

    fn drain(self: Arc<Self>, _: Duration) -> Pin<Box<dyn Future<Output = Option<usize>> + Send>> {
        Box::pin(async { None })
    }
}

/// The probe routes over `probe`; `POST /drain` answers only when `drain` is on.
pub fn router(probe: Arc<dyn Probe>, drain: bool) -> axum::Router {
    axum::Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/drain", post(drain_route))
        .with_state(Probes { probe, drain })
}

/// The probe routes' state.
#[derive(Clone)]
struct Probes {
    probe: Arc<dyn Probe>,
    drain: bool,
}

async fn readyz(State(Probes { probe: p, .. }): State<Probes>) -> Response {
    match p.ready() {
        Ok(()) => "ready\n".into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}

/// `deadline_ms` of a query string (`deadline_ms=N`), if present and a number.
fn deadline_ms(query: Option<&str>) -> Option<u64> {
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix("deadline_ms="))?
        .parse()
        .ok()
}

async fn drain_route(
    State(Probes { probe: p, drain }): State<Probes>,
    caller: Option<Extension<Caller>>,
    headers: axum::http::HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    if !drain {
        return (
            StatusCode::FORBIDDEN,
            "drain over the probe listener is off ([engine] drain_probe = true turns it on)\n",
        )
            .into_response();
    }
    // A browser names the page's site on every cross-site request; a preStop hook never does.
    if headers.contains_key(axum::http::header::ORIGIN) || headers.contains_key("sec-fetch-site") {
        return (StatusCode::FORBIDDEN, "drain is not asked from a browser\n").into_response();
    }
    if !caller.is_some_and(|Extension(c)| c.addr.ip().is_loopback()) {
        return (
            StatusCode::FORBIDDEN,
            "drain is asked from inside the host only\n",
        )
            .into_response();
    }
    let deadline = Duration::from_millis(deadline_ms(uri.query()).unwrap_or(5_000)).min(MAX_DRAIN);
    match p.drain(deadline).await {
        Some(remaining) => {
            axum::Json(serde_json::json!({ "remaining": remaining })).into_response()
        }
        None => (StatusCode::NOT_FOUND, "nothing to drain here\n").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::body::Body;
    use axum::http::Request;
    use tower_service::Service;

    use super::*;

    /// Ready until drained; counts drains.
    #[derive(Default)]
    struct Fake(AtomicUsize);

    impl Probe for Fake {
        fn ready(&self) -> Result<(), NotReady> {
            if self.0.load(Ordering::SeqCst) == 0 {
                Ok(())
            } else {
                Err(NotReady::Draining {
                    worker: "fake".into(),
                })
            }
        }

        fn drain(
            self: Arc<Self>,
            _: Duration,
        ) -> Pin<Box<dyn Future<Output = Option<usize>> + Send>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Some(0) })
        }
    }

    async fn call(app: &mut axum::Router, method: &str, uri: &str, from: &str) -> (u16, String) {
        call_with(app, method, uri, from, &[]).await
    }

    async fn call_with(
        app: &mut axum::Router,
        method: &str,
        uri: &str,
        from: &str,
        headers: &[(&str, &str)],
    ) -> (u16, String) {
        let mut req = Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let mut req = req.body(Body::empty()).unwrap();
        req.extensions_mut().insert(Caller {
            addr: from.parse().unwrap(),
            peer: None,
        });
        let resp = app.call(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn drain_only_from_loopback_then_not_ready() {
        let probe = Arc::new(Fake::default());
        let mut app = router(Arc::clone(&probe) as Arc<dyn Probe>, true);
        assert_eq!(call(&mut app, "GET", "/livez", "10.0.0.9:1").await.0, 200);
        assert_eq!(call(&mut app, "GET", "/readyz", "10.0.0.9:1").await.0, 200);
        // From another host: refused, and nothing drained.
        let (status, _) = call(&mut app, "POST", "/drain", "10.0.0.9:1").await;
        assert_eq!(status, 403);
        assert_eq!(probe.0.load(Ordering::SeqCst), 0);
        // From a web page on this host (the browser names its site): refused, nothing drained.
        for h in [
            ("origin", "http://evil.example"),
            ("sec-fetch-site", "cross-site"),
        ] {
            let (status, _) = call_with(&mut app, "POST", "/drain", "127.0.0.1:1", &[h]).await;
            assert_eq!(status, 403, "{h:?}");
        }
        assert_eq!(probe.0.load(Ordering::SeqCst), 0);
        assert_eq!(call(&mut app, "GET", "/readyz", "10.0.0.9:1").await.0, 200);
        // From inside the host: drained, and not ready any more.
        let (status, body) = call(&mut app, "POST", "/drain?deadline_ms=10", "127.0.0.1:1").await;
        assert_eq!((status, body.as_str()), (200, r#"{"remaining":0}"#));
        assert_eq!(probe.0.load(Ordering::SeqCst), 1);
        let (status, body) = call(&mut app, "GET", "/readyz", "127.0.0.1:1").await;
        assert_eq!((status, body.as_str()), (503, "worker fake is draining\n"));
        // A process with nothing to drain says so.
        let mut gw = router(Arc::new(AlwaysReady), true);
        assert_eq!(call(&mut gw, "POST", "/drain", "[::1]:1").await.0, 404);
    }

    /// Off by default: no caller, loopback included, drains an engine that did not turn the
    /// drain probe on; the probes that only read still answer.
    #[tokio::test]
    async fn drain_is_off_unless_turned_on() {
        let probe = Arc::new(Fake::default());
        let mut app = router(Arc::clone(&probe) as Arc<dyn Probe>, false);
        for from in ["127.0.0.1:1", "[::1]:1", "10.0.0.9:1"] {
            let (status, body) = call(&mut app, "POST", "/drain?deadline_ms=10", from).await;
            assert_eq!(status, 403, "{from}");
            assert!(body.contains("drain_probe"), "{body}");
        }
        assert_eq!(probe.0.load(Ordering::SeqCst), 0);
        assert_eq!(call(&mut app, "GET", "/readyz", "127.0.0.1:1").await.0, 200);
        assert_eq!(call(&mut app, "GET", "/livez", "127.0.0.1:1").await.0, 200);
    }

    #[test]
    fn deadline_from_the_query() {
        assert_eq!(deadline_ms(Some("deadline_ms=250")), Some(250));
        assert_eq!(deadline_ms(Some("a=1&deadline_ms=9")), Some(9));
        assert_eq!(deadline_ms(Some("deadline_ms=x")), None);
        assert_eq!(deadline_ms(None), None);
    }
}
