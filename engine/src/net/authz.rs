//! Authorization by role, decided in one place per server: a table of (method or route, roles
//! allowed) checked against the caller's certificate identity before any handler runs
//! (spec/identities.md). gRPC servers consult a [`RolePolicy`] through `kvwire_grpc`'s
//! [`Dispatch`](kvwire_grpc::glue::Dispatch); HTTP servers through [`require_roles`]. A refused
//! call gets PERMISSION_DENIED or 403 and touches nothing. Without mutual TLS there is no
//! identity and no check: such a process only listens on loopback (secure by default).

use std::sync::Arc;

use axum::extract::Request;

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

/// (method path, roles allowed); a path not in the table is refused to everyone (fail closed).
pub type Table = &'static [(&'static str, &'static [PeerRole])];

/// A gRPC server's authorization table.
#[derive(Debug)]
pub struct RolePolicy(pub Table);

/// The methods of service `S` that `table` does not list (refused to every caller), and the
/// paths `table` lists that `S` does not serve. Both empty for a policy written for `S`.
#[must_use]
pub fn unlisted<S: kvwire_grpc::glue::Routes>(
    table: Table,
) -> (Vec<&'static str>, Vec<&'static str>) {
    let routes: Vec<&'static str> = S::ROUTES.iter().map(|(p, _)| *p).collect();
    let missing = routes
        .iter()
        .copied()
        .filter(|r| !table.iter().any(|(p, _)| p == r))
        .collect();
    let extra = table
        .iter()
        .map(|(p, _)| *p)
        .filter(|p| !routes.contains(p))
        .collect();
    (missing, extra)
}

impl RolePolicy {
    /// The policy of service `S`: `table` must list exactly `S`'s methods. A method it leaves out
    /// would be refused to everyone (fail closed); the mismatch is a programming error that the
    /// tests of every service catch (`every_service_lists_exactly_its_methods`).
    #[must_use]
    pub fn for_service<S: kvwire_grpc::glue::Routes>(table: Table) -> Self {
        debug_assert_eq!(
            unlisted::<S>(table),
            (Vec::new(), Vec::new()),
            "the policy of {} does not list exactly its methods",
            S::NAME
        );
        Self(table)
    }

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
        .is_some_and(|(_, roles)| roles.contains(&role))
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
                return ApiError::permission_denied(format!(
                    "{} may not call {}",
                    p.uri(),
                    req.uri().path()
                ))
                .into_response();
            }
            None => {
                return ApiError::permission_denied(
                    "the client certificate carries no spiffe://tl/ROLE/ID identity",
                )
                .into_response();
            }
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: Table = &[
        ("/a.S/Open", ANY),
        ("/a.S/Gated", &[PeerRole::Gateway, PeerRole::Admin]),
    ];

    #[test]
    fn unlisted_methods_are_refused() {
        for role in PeerRole::ALL {
            assert!(allowed(TABLE, "/a.S/Open", role), "{role:?}");
            assert!(
                !allowed(TABLE, "/a.S/Unlisted", role),
                "{role:?}: unlisted passed"
            );
            assert!(!allowed(TABLE, "", role), "{role:?}: empty path passed");
            // Only the exact path counts: no prefix, case or suffix match.
            for near in ["/a.S/open", "/a.S/Open/", "/a.S/Ope", "/a.S/OpenX"] {
                assert!(!allowed(TABLE, near, role), "{role:?}: {near} passed");
            }
        }
        assert!(allowed(TABLE, "/a.S/Gated", PeerRole::Gateway));
        assert!(!allowed(TABLE, "/a.S/Gated", PeerRole::Prefill));
        assert!(
            !allowed(&[], "/a.S/Open", PeerRole::Admin),
            "an empty table refuses all"
        );
    }

    #[test]
    fn every_service_lists_exactly_its_methods() {
        use crate::gateway::registry::{POLICY as REGISTRY, RegistryService};
        use crate::node::KV_POLICY;
        use crate::node::control::{EngineControl, POLICY as CONTROL};
        let none = (Vec::new(), Vec::new());
        assert_eq!(unlisted::<EngineControl>(CONTROL), none, "EngineControl");
        assert_eq!(
            unlisted::<RegistryService>(REGISTRY),
            none,
            "WorkerRegistry"
        );
        assert_eq!(
            unlisted::<kvwire_grpc::KvTransferService>(KV_POLICY),
            none,
            "KvTransfer"
        );
        assert_eq!(
            unlisted::<kvwire_grpc::KvLookups>(crate::node::LOOKUP_POLICY),
            none,
            "KvTransfer's lookups on the control port"
        );
        // The lookups are let through the control port exactly as through the KV port.
        for entry in crate::node::LOOKUP_POLICY {
            assert!(KV_POLICY.contains(entry), "{}", entry.0);
        }
        // And the check itself sees a missing and an extra method.
        let short: Table = &[(kvwire_grpc::pb::kv::path::PUSH_KV, ANY), ("/x.Y/Z", ANY)];
        let (missing, extra) = unlisted::<kvwire_grpc::KvTransferService>(short);
        assert_eq!(missing.len(), 2, "{missing:?}");
        assert_eq!(extra, vec!["/x.Y/Z"]);
    }
}
