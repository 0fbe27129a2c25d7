//! API keys on the public endpoint: when any are configured (`[gateway] api_keys_file`, one key
//! a line, and/or the env `TL_API_KEYS`, comma separated), every `/v1/*` request needs
//! `Authorization: Bearer <a key>`, else 401 with an OpenAI-style error body. `/health` stays
//! open.

use std::sync::Arc;

use axum::extract::{Request, State};

use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::ApiError;

/// The keys in force (none: the endpoint is open).
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<Vec<Vec<u8>>>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// Keys from `file` (if non-empty) and `TL_API_KEYS`.
    ///
    /// # Errors
    /// An unreadable file.
    pub fn load(file: &str) -> std::io::Result<Self> {
        let mut keys: Vec<String> = std::env::var("TL_API_KEYS")
            .unwrap_or_default()
            .split(',')
            .map(str::to_owned)
            .collect();
        if !file.is_empty() {
            let text = std::fs::read_to_string(file)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{file}: {e}")))?;
            keys.extend(text.lines().map(str::to_owned));
        }
        Ok(Self::new(keys))
    }

    /// These keys (blank ones ignored).
    #[must_use]
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        Self(Arc::new(
            keys.into_iter()
                .map(|k| k.trim().as_bytes().to_vec())
                .filter(|k| !k.is_empty())
                .collect(),
        ))
    }

    /// True when no key is configured.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `presented` is one of the keys, compared in time independent of where they differ.
    #[must_use]
    pub fn accepts(&self, presented: &[u8]) -> bool {
        self.0.iter().fold(false, |found, k| {
            let same = k.len() == presented.len()
                && k.iter().zip(presented).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
            found | same
        })
    }
}

/// Axum middleware: 401 for a `/v1/*` request without a configured key.
pub async fn require_key(State(keys): State<ApiKeys>, req: Request, next: Next) -> Response {
    if keys.is_open() || !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(k) if keys.accepts(k.as_bytes()) => next.run(req).await,
        Some(_) => unauthorized("Incorrect API key provided."),
        None => unauthorized(
            "You didn't provide an API key. Provide it as Authorization: Bearer <key>.",
        ),
    }
}

fn unauthorized(message: &str) -> Response {
    ApiError::unauthorized(message).into_response()
}
