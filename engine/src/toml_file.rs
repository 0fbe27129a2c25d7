//! Reading a TOML configuration file, shared by the node's and the gateway's configurations:
//! the error names the file, and serde's `deny_unknown_fields` on the target type makes a typo
//! an error rather than a silently ignored setting.

use std::path::Path;

/// A configuration file that could not be read or parsed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why.
        source: Box<toml::de::Error>,
    },
}

/// A configuration that cannot be used, the node's or the gateway's: each names the key at
/// fault (`gateway.id`, `limits.h2_max_streams`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read or parsed.
    #[error(transparent)]
    File(#[from] FileError),
    /// A value is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// A key's value is out of its range.
    #[error("invalid configuration: {0}")]
    Setting(#[from] crate::net::limits::InvalidSetting),
}

/// Reads and parses `path`.
///
/// # Errors
/// I/O or parse errors, naming the file.
pub fn read<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, FileError> {
    let shown = || path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| FileError::Io {
        path: shown(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| FileError::Parse {
        path: shown(),
        source: Box::new(e),
    })
}
