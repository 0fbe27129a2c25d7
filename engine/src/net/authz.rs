//! Authorization by role, decided in one place per server: a table of (method or route, roles
//! allowed) checked against the caller's certificate identity before any handler runs
//! (CONTRACTS section 7). gRPC servers consult a [`RolePolicy`] through `kvwire_grpc`'s
//! [`Dispatch`](kvwire_grpc::glue::Dispatch); HTTP servers through [`require_roles`]. A refused
//! call gets PERMISSION_DENIED or 403 and touches nothing. Without mutual TLS there is no
//! identity and no check: such a process only listens on loopback (secure by default).

use std::sync::Arc;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kvwire_grpc::glue::Authorize;
use tonic::Status;
use tonic::body::Body;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use super::server::Caller;
use super::tls::{PeerId, PeerRole};
use crate::api::ApiError;

/// Every role.
pub const ANY: &[PeerRole] = &PeerRole::ALL;

/// (method path, roles allowed); a path not in the table is open to every authenticated peer.
pub type Table = &'static [(&'static str, &'static [PeerRole])];

/// A gRPC server's authorization table.
#[derive(Debug)]
pub struct RolePolicy(pub Table);

impl RolePolicy {
    /// The policy as `Dispatch` takes it, when mutual TLS is on.
    #[must_use]
    pub fn when(self, mtls: bool) -> Option<Arc<dyn Authorize>> {
        mtls.then(|| Arc::new(self) as Arc<dyn Authorize>)
    }
}

/// The identity in a gRPC request's client certificate.
#[must_use]
pub fn grpc_peer(req: &http::Request<Body>) -> Option<PeerId> {
    let info = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>()?;
    let certs = info.peer_certs()?;
    PeerId::from_cert(certs.first()?)
}

fn allowed(table: Table, path: &str, role: PeerRole) -> bool {
    table
        .iter()
        .find(|(p, _)| *p == path)
        .is_none_or(|(_, roles)| roles.contains(&role))
}

impl Authorize for RolePolicy {
    fn authorize(&self, path: &str, req: &mut http::Request<Body>) -> Result<(), Status> {
        let Some(peer) = grpc_peer(req) else {
            return Err(Status::unauthenticated(
                "the client certificate carries no spiffe://tl/ROLE/ID identity",
            ));
        };
        if !allowed(self.0, path, peer.role) {
            return Err(Status::permission_denied(format!(
                "{} may not call {path}",
                peer.uri()
            )));
        }
        // Handlers that check more (a heartbeat speaks only for its own id) read it here.
        req.extensions_mut().insert(peer);
        Ok(())
    }
}

/// An HTTP server's policy: the roles allowed on every route of the app it guards.
#[derive(Clone, Copy, Debug)]
pub struct HttpPolicy {
    /// Roles allowed.
    pub roles: &'static [PeerRole],
    /// Mutual TLS is on: a caller without an identity is refused.
    pub mtls: bool,
}

/// Axum middleware enforcing an [`HttpPolicy`] (`axum::middleware::from_fn_with_state`).
pub async fn require_roles(
    axum::extract::State(policy): axum::extract::State<HttpPolicy>,
    req: Request,
    next: Next,
) -> Response {
    if policy.mtls {
        let peer = req
            .extensions()
            .get::<Caller>()
            .and_then(|c| c.peer.clone());
        match peer {
            Some(p) if policy.roles.contains(&p.role) => {}
            Some(p) => {
                return ApiError::new(
                    StatusCode::FORBIDDEN,
                    "permission_denied",
                    format!("{} may not call {}", p.uri(), req.uri().path()),
                )
                .into_response();
            }
            None => {
                return ApiError::new(
                    StatusCode::FORBIDDEN,
                    "permission_denied",
                    "the client certificate carries no spiffe://tl/ROLE/ID identity",
                )
                .into_response();
            }
        }
    }
    next.run(req).await
}
