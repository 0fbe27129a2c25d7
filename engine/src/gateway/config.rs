//! The gateway's TOML configuration: `[gateway]`, every key optional, unknown keys refused.
//!
//! ```toml
//! [gateway]
//! http_listen = "127.0.0.1:0"      # the OpenAI-compatible front
//! registry_listen = "127.0.0.1:0"  # WorkerRegistry (tl.control.v1) for the engines' heartbeats
//! max_inflight = 256               # requests in flight; beyond it 429
//! request_timeout_ms = 60000       # whole request; beyond it 504
//! has_blocks_timeout_ms = 250      # per decode engine when routing; a slower one is skipped
//! load_penalty_tokens = 64         # routing: cached prefix tokens one in-flight sequence is worth
//! ```

use std::path::Path;

use serde::Deserialize;

use crate::toml_file::{self, FileError};

/// `[gateway]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySection {
    /// HTTP listen address.
    pub http_listen: String,
    /// Registry listen address.
    pub registry_listen: String,
    /// Requests in flight before 429.
    pub max_inflight: usize,
    /// Request timeout in milliseconds (504).
    pub request_timeout_ms: u64,
    /// HasBlocks timeout per decode engine in milliseconds.
    pub has_blocks_timeout_ms: u64,
    /// Routing weight of load against cached prefix (see [`super::plan::score`]).
    pub load_penalty_tokens: f64,
}

impl Default for GatewaySection {
    fn default() -> Self {
        Self {
            http_listen: "127.0.0.1:0".into(),
            registry_listen: "127.0.0.1:0".into(),
            max_inflight: 256,
            request_timeout_ms: 60_000,
            has_blocks_timeout_ms: 250,
            load_penalty_tokens: 64.0,
        }
    }
}

/// The gateway's configuration file.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// `[gateway]`.
    pub gateway: GatewaySection,
}

/// A gateway configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayConfigError {
    /// The file could not be read or parsed.
    #[error(transparent)]
    File(#[from] FileError),
    /// A value is out of range.
    #[error("gateway.max_inflight and gateway.request_timeout_ms must be >= 1")]
    Invalid,
}

impl GatewayConfig {
    /// Reads `path` if given, else the defaults.
    ///
    /// # Errors
    /// I/O, parse or range errors.
    pub fn load_or_default(path: Option<&Path>) -> Result<Self, GatewayConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let c: Self = toml_file::read(path)?;
        if c.gateway.max_inflight == 0 || c.gateway.request_timeout_ms == 0 {
            return Err(GatewayConfigError::Invalid);
        }
        Ok(c)
    }
}
