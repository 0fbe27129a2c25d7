//! `tl-engine`: the processes around the sans-IO core (`tl-engine-core`), in layers:
//!
//! - [`node`]: one engine process (step thread, EngineControl, KV receiver, decode front,
//!   heartbeat, drain);
//! - [`gateway`]: the registry server, route planning, in-flight accounting, upstream clients,
//!   the request state machine and the OpenAI handlers;
//! - [`api`]: the typed OpenAI HTTP API and its one SSE codec, shared by both;
//! - [`net`]: servers and their one shutdown mechanism, and the clients of other processes;
//! - [`toml_file`]: reading a configuration file, for both.
//!
//! The `tl` binary (`src/bin/tl/`) is built on these; it is not library API.
// One module, `sched`, holds unsafe code (two libc calls rustix does not offer), each with its
// reason.
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod api;
pub mod etcd;
pub mod gateway;
pub mod net;
pub mod node;
pub mod sched;
pub mod telemetry;
pub mod toml_file;
