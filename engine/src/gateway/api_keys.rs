//! API keys on the public endpoint: when any are configured (`[gateway] api_keys_file` and
//! `admin_keys_file`, one key a line, `#` comment lines and blank lines skipped, and/or the env
//! `TL_API_KEYS` and `TL_ADMIN_KEYS`, comma separated), every `/v1/*` request and `/workers`
//! need `Authorization: Bearer <a key>`, else 401 with an OpenAI-style error body. `/health`
//! stays open. An admin key is also a tenant key, and sees routing internals.
//!
//! Every request leaves the middleware with a [`EndUser`] extension: its tenant (the key, or a
//! trusted front's `tenant_header`) and whether it is an admin.

use std::sync::Arc;

use axum::extract::{Request, State};

use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::tenant::EndUser;
use crate::api::ApiError;

#[derive(Default)]
struct Inner {
    keys: Vec<Vec<u8>>,
    admin: Vec<Vec<u8>>,
    /// `[gateway] tenant_header`, lower-case (empty: the key is the tenant).
    tenant_header: String,
    /// Without keys: whether every caller is an admin (a local, single-user gateway).
    open_admin: bool,
    /// `public_unauthenticated` on a gateway without tenant keys: `/v1/*` serves a caller
    /// without a key even when admin keys exist (a key, when presented, must be right). Tenant
    /// keys close the public endpoint: then every `/v1/*` call needs one.
    public: bool,
}

/// The keys in force (none: the endpoint is open).
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<Inner>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ApiKeys({} keys, {} admin)",
            self.0.keys.len(),
            self.0.admin.len()
        )
    }
}

/// Keys from the env variable `var` (comma separated) and `file` (one a line).
fn read_keys(var: &str, file: &str) -> std::io::Result<Vec<String>> {
    let mut keys: Vec<String> = std::env::var(var)
        .unwrap_or_default()
        .split(',')
        .map(str::to_owned)
        .collect();
    if !file.is_empty() {
        let text = std::fs::read_to_string(file)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{file}: {e}")))?;
        keys.extend(text.lines().map(str::to_owned));
    }
    Ok(keys)
}

/// Trimmed keys, blank lines and `#` comment lines left out.
fn clean(keys: impl IntoIterator<Item = String>) -> Vec<Vec<u8>> {
    keys.into_iter()
        .map(|k| k.trim().as_bytes().to_vec())
        .filter(|k| !k.is_empty() && !k.starts_with(b"#"))
        .collect()
}

/// Whether `presented` is one of `keys`, compared in time independent of where they differ.
fn holds(keys: &[Vec<u8>], presented: &[u8]) -> bool {
    keys.iter().fold(false, |found, k| {
        let same = k.len() == presented.len()
            && k.iter().zip(presented).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
        found | same
    })
}

impl ApiKeys {
    /// Tenant keys from `file` (if non-empty) and `TL_API_KEYS`, admin keys from `admin_file`
    /// and `TL_ADMIN_KEYS`.
    ///
    /// # Errors
    /// An unreadable file.
    pub fn load(file: &str, admin_file: &str) -> std::io::Result<Self> {
        Ok(Self::with_admin(
            read_keys("TL_API_KEYS", file)?,
            read_keys("TL_ADMIN_KEYS", admin_file)?,
        ))
    }

    /// These tenant keys (blank and comment lines ignored), no admin key.
    #[must_use]
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        Self::with_admin(keys, [])
    }

    /// These tenant and admin keys.
    #[must_use]
    pub fn with_admin(
        keys: impl IntoIterator<Item = String>,
        admin: impl IntoIterator<Item = String>,
    ) -> Self {
        Self(Arc::new(Inner {
            keys: clean(keys),
            admin: clean(admin),
            ..Inner::default()
        }))
    }

    /// Takes the tenant from `header` (a trusted front's; empty: from the key); without keys,
    /// treats every caller as an admin when `open_admin`; with `public` and no tenant key,
    /// serves `/v1/*` to callers without a key beside the admin keys.
    #[must_use]
    pub fn tenants(self, header: &str, open_admin: bool, public: bool) -> Self {
        let inner = Inner {
            keys: self.0.keys.clone(),
            admin: self.0.admin.clone(),
            tenant_header: header.to_ascii_lowercase(),
            open_admin,
            public: public && self.0.keys.is_empty(),
        };
        Self(Arc::new(inner))
    }

    /// True when no key is configured.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.0.keys.is_empty() && self.0.admin.is_empty()
    }

    /// Whether `presented` is one of the keys (tenant or admin).
    #[must_use]
    pub fn accepts(&self, presented: &[u8]) -> bool {
        holds(&self.0.keys, presented) | holds(&self.0.admin, presented)
    }

    /// The caller presenting `key` (already accepted) with these request headers.
    fn caller(&self, key: &[u8], headers: &axum::http::HeaderMap) -> EndUser {
        let tenant = match self.0.tenant_header.as_str() {
            "" => key.to_vec(),
            h => headers
                .get(h)
                .map(|v| v.as_bytes().to_vec())
                .unwrap_or_default(),
        };
        EndUser {
            tenant,
            admin: if self.is_open() {
                self.0.open_admin
            } else {
                holds(&self.0.admin, key)
            },
        }
    }
}

/// Whether a path needs a key: the API, and the operators' `/workers`.
fn guarded(path: &str) -> bool {
    path.starts_with("/v1/") || path == "/workers"
}

/// Axum middleware: 401 for a guarded request without a configured key; otherwise the request
/// goes on with its [`EndUser`].
pub async fn require_key(State(keys): State<ApiKeys>, mut req: Request, next: Next) -> Response {
    // Behind a trusted front that names the tenant, a request without the name belongs to no
    // one: it is refused rather than served as the empty tenant (no quota, a shared scope).
    let header = keys.0.tenant_header.as_str();
    if !header.is_empty()
        && req.uri().path().starts_with("/v1/")
        && req
            .headers()
            .get(header)
            .is_none_or(|v| v.as_bytes().is_empty())
    {
        return ApiError::bad_request(format!(
            "the {header} header is required: this gateway serves tenants named by it"
        ))
        .into_response();
    }
    if keys.is_open() {
        let caller = keys.caller(b"", req.headers());
        req.extensions_mut().insert(caller);
        return next.run(req).await;
    }
    if !guarded(req.uri().path()) {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(k) if keys.accepts(k.as_bytes()) => {
            let caller = keys.caller(k.as_bytes(), req.headers());
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Some(_) => unauthorized("Incorrect API key provided."),
        // `public_unauthenticated`: the API serves anyone, as documented, even when admin keys
        // exist for `/workers`.
        None if keys.0.public && req.uri().path().starts_with("/v1/") => {
            let caller = keys.caller(b"", req.headers());
            req.extensions_mut().insert(EndUser {
                admin: false,
                ..caller
            });
            next.run(req).await
        }
        None => unauthorized(
            "You didn't provide an API key. Provide it as Authorization: Bearer <key>.",
        ),
    }
}

fn unauthorized(message: &str) -> Response {
    ApiError::unauthorized(message).into_response()
}
