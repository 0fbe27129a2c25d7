//! Benchmarks and failover drills of the kvwire engine: what `tl bench` and `tl drill` run.
//! Each prints one JSON line. Figures are ratios against baselines measured in the same run.

pub mod bench;
pub mod drill;
mod netns;

pub mod run {
    //! What a bench, a drill and the `tl` commands share: a runtime, and one JSON result.

    use std::process::ExitCode;

    /// A multi-threaded runtime for the servers (the engine steps on its own thread).
    ///
    /// # Errors
    /// When the OS refuses threads.
    pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    }

    /// Runs `fut` to completion on a fresh runtime; a runtime that cannot start is exit status 1.
    pub fn block_on(fut: impl std::future::Future<Output = ExitCode>) -> ExitCode {
        match runtime() {
            Ok(rt) => rt.block_on(fut),
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    }

    /// Prints a bench's JSON line, or its error to stderr (exit status 1).
    #[must_use]
    pub fn print_json<T: serde::Serialize, E: std::fmt::Display>(result: Result<T, E>) -> ExitCode {
        match result.map(|v| serde_json::to_string(&v)) {
            Ok(Ok(line)) => {
                println!("{line}");
                ExitCode::SUCCESS
            }
            Ok(Err(e)) => {
                eprintln!("error: the report does not serialize: {e}");
                ExitCode::from(1)
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    }
}
