//! `tl-engine`: the processes around the sans-IO core (`tl-engine-core`), in layers:
//!
//! - [`node`]: one engine process (step thread, EngineControl, KV receiver, decode front,
//!   heartbeat, drain);
//! - [`gateway`]: the registry server, route planning, in-flight accounting, upstream clients,
//!   the request state machine and the OpenAI handlers;
//! - [`fleet`]: a gateway and its engines in one process, started in one order;
//! - [`api`]: the typed OpenAI HTTP API and its one SSE codec, shared by both;
//! - [`net`]: servers and their one shutdown mechanism, and the clients of other processes;
//! - [`etcd`]: the registry on etcd: client, keys, drain requests, users and roles;
//! - [`telemetry`]: metrics, traces and logs;
//! - [`toml_file`]: reading a configuration file, for both;
//! - [`copies`] and [`sched`]: process-wide settings (glibc's copy threshold, thread priority).
//!
//! The `tl` binary (`engine/cli`) and the benchmarks and drills (`engine/lab`) are built on these.
// One module, `sched`, holds unsafe code (two libc calls rustix does not offer), each with its
// reason.
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod api;
pub mod copies;
pub mod etcd;
pub mod fleet;
pub mod gateway;
pub mod net;
pub mod node;
pub mod sched;
pub mod structured;
pub mod telemetry;
pub mod toml_file;
