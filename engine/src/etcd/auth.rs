//! Users and roles on etcd, so that each certificate reaches only its own keys.
//!
//! etcd, run with `--client-cert-auth` and auth on, takes a client certificate's common name
//! as the user. `tl certs` puts the SPIFFE id there (`spiffe://tl/ROLE/ID`), so a user name
//! carries its role and no certificate `tl certs` issues is named `root` (etcd's superuser).
//!
//! | identity | etcd role | may |
//! |---|---|---|
//! | an engine `ROLE/ID` | `tl-ROLE-ID` | write `<prefix>/workers/ROLE/ID`; read `<prefix>/drain/ID` |
//! | a gateway | `tl-gateway` | read `<prefix>/workers/*`; write `<prefix>/drain/*` |
//! | an admin | `root` | everything |

use bytes::Bytes;
use kvwire_grpc::etcd::{self as pb, path};
use tonic::{Code, Status};

use super::{Etcd, Keys};
use crate::net::role::Role;
use crate::net::tls::{PeerId, PeerRole};

/// The etcd role of every gateway.
pub const GATEWAY_ROLE: &str = "tl-gateway";

/// The etcd user of a certificate's identity: its common name.
#[must_use]
pub fn user(id: &PeerId) -> String {
    id.uri()
}

/// Whether etcd's auth is on, as a caller that is not a superuser sees it: a key outside every
/// grant is refused with auth on and read with auth off. (etcd 3.4, Debian's, has no
/// `AuthStatus` call.) A superuser reads it either way, so this answers `false` for one.
///
/// # Errors
/// etcd's status when it could not be asked (unreachable, timed out).
pub async fn is_on(etcd: &Etcd, keys: &Keys) -> Result<bool, Status> {
    match etcd.get(&keys.auth_probe()).await {
        Ok(_) => Ok(false),
        Err(s) if s.code() == Code::PermissionDenied => Ok(true),
        Err(s) => Err(s),
    }
}

/// The refusal of an engine that finds etcd's auth off and may not run so.
#[must_use]
pub fn off_refused(endpoints: &str) -> Status {
    Status::failed_precondition(format!(
        "etcd at {endpoints} has its auth off, so any identity could write any worker's key: \
         an admin runs `tl etcd init` first (or set [registry] allow_no_auth = true, \
         --etcd-allow-no-auth, for a test)"
    ))
}

/// An answer that says the thing exists already: setting up twice is not an error.
fn tolerate_existing(r: Result<(), Status>) -> Result<(), Status> {
    match r {
        Err(s) if s.code() == Code::FailedPrecondition && s.message().contains("already") => Ok(()),
        r => r,
    }
}

async fn add_user(etcd: &Etcd, name: &str) -> Result<(), Status> {
    tolerate_existing(
        etcd.auth::<_, pb::AuthUserAddResponse>(
            path::USER_ADD,
            pb::AuthUserAddRequest {
                name: name.to_owned(),
                password: String::new(),
                // Certificates only: no password can log in as this user.
                options: Some(pb::UserAddOptions { no_password: true }),
            },
        )
        .await
        .map(drop),
    )
}

async fn add_role(etcd: &Etcd, name: &str) -> Result<(), Status> {
    tolerate_existing(
        etcd.auth::<_, pb::AuthRoleAddResponse>(
            path::ROLE_ADD,
            pb::AuthRoleAddRequest {
                name: name.to_owned(),
            },
        )
        .await
        .map(drop),
    )
}

/// Grants `perm_type` on `key` alone, or on every key starting with it when `prefix`.
async fn permit(
    etcd: &Etcd,
    role: &str,
    perm_type: i32,
    key: &str,
    prefix: bool,
) -> Result<(), Status> {
    let range_end = if prefix {
        pb::prefix_end(key.as_bytes())
    } else {
        Bytes::new()
    };
    etcd.auth::<_, pb::AuthRoleGrantPermissionResponse>(
        path::ROLE_GRANT_PERMISSION,
        pb::AuthRoleGrantPermissionRequest {
            name: role.to_owned(),
            perm: Some(pb::Permission {
                perm_type,
                key: Bytes::copy_from_slice(key.as_bytes()),
                range_end,
            }),
        },
    )
    .await
    .map(drop)
}

async fn grant_role(etcd: &Etcd, user: &str, role: &str) -> Result<(), Status> {
    tolerate_existing(
        etcd.auth::<_, pb::AuthUserGrantRoleResponse>(
            path::USER_GRANT_ROLE,
            pb::AuthUserGrantRoleRequest {
                user: user.to_owned(),
                role: role.to_owned(),
            },
        )
        .await
        .map(drop),
    )
}

/// Sets up auth on a fresh cluster and turns it on: etcd's `root` user (no password, and no
/// certificate of ours is named so), `admin` as a second superuser, the gateway role.
/// Run once, by the admin whose identity is `admin`, before auth is on.
///
/// # Errors
/// PERMISSION_DENIED, before anything is written, when `admin` is not an `admin` identity (an
/// engine's certificate must never become the cluster's superuser); etcd's status otherwise
/// (PERMISSION_DENIED when auth is on already and `admin` is not a superuser).
pub async fn init(etcd: &Etcd, keys: &Keys, admin: &PeerId) -> Result<(), Status> {
    if admin.role != crate::net::tls::PeerRole::Admin {
        return Err(Status::permission_denied(format!(
            "etcd init is the admin's: {} is a {} identity, and would become the superuser",
            user(admin),
            admin.role.as_str()
        )));
    }
    add_user(etcd, "root").await?;
    grant_role(etcd, "root", "root").await?;
    add_user(etcd, &user(admin)).await?;
    grant_role(etcd, &user(admin), "root").await?;
    add_role(etcd, GATEWAY_ROLE).await?;
    permit(etcd, GATEWAY_ROLE, pb::PERM_READ, &keys.workers(), true).await?;
    permit(etcd, GATEWAY_ROLE, pb::PERM_READWRITE, &keys.drains(), true).await?;
    etcd.auth::<_, pb::AuthEnableResponse>(path::AUTH_ENABLE, pb::AuthEnableRequest {})
        .await
        .map(drop)
}

/// Lets identity `id` in: an engine gets a role of its own over its two keys, a gateway the
/// gateway role, an admin the superuser role. Returns the etcd role granted.
///
/// # Errors
/// etcd's status (PERMISSION_DENIED unless the caller is a superuser).
pub async fn grant(etcd: &Etcd, keys: &Keys, id: &PeerId) -> Result<String, Status> {
    let name = user(id);
    add_user(etcd, &name).await?;
    let role = match id.role {
        PeerRole::Gateway => GATEWAY_ROLE.to_owned(),
        PeerRole::Admin => "root".to_owned(),
        PeerRole::Etcd => {
            return Err(Status::invalid_argument(
                "an etcd member's certificate is not a client of the registry",
            ));
        }
        PeerRole::Prefill | PeerRole::Decode | PeerRole::Both => {
            // The key names the certificate's role: a decode identity cannot list itself as
            // prefill, because etcd refuses it the prefill key.
            let worker = Role::try_from(id.role).map_err(|_| {
                Status::internal("a worker certificate role without a registry role")
            })?;
            let role = format!("tl-{}-{}", worker.name(), id.id);
            add_role(etcd, &role).await?;
            permit(
                etcd,
                &role,
                pb::PERM_READWRITE,
                &keys.worker(worker, &id.id),
                false,
            )
            .await?;
            permit(etcd, &role, pb::PERM_READ, &keys.drain(&id.id), false).await?;
            role
        }
    };
    grant_role(etcd, &name, &role).await?;
    Ok(role)
}
