//! Why a drill could not reach its verdict. A verdict itself (requests lost or failed, a pool
//! not back to baseline) is not an error: it is in the drill's JSON line and its exit status.

/// Why a drill stopped before its verdict.
#[derive(Debug, thiserror::Error)]
pub enum DrillError {
    /// A process the drill runs (`tl`, `docker`, `ip`, etcd) could not start, or failed.
    #[error("{what}: {why}")]
    Process {
        /// The command.
        what: String,
        /// What it said, or why it could not run.
        why: String,
    },
    /// A fault this mode cannot inject, or options that do not go together.
    #[error("{0}")]
    Unsupported(&'static str),
    /// The fleet did not come up, or did not answer as the drill needs.
    #[error("{0}")]
    Fleet(String),
}

impl From<String> for DrillError {
    fn from(why: String) -> Self {
        Self::Fleet(why)
    }
}

impl From<&str> for DrillError {
    fn from(why: &str) -> Self {
        Self::Fleet(why.to_owned())
    }
}
