//! `tl-engine-core`: the engine without I/O. Plain structs and functions, driven by whoever owns
//! them (the node's step thread, a test, a bench); no async runtime, no sockets, no JSON.
//!
//! - [`copy`]: the import's copy into the pool, with stores that skip reading the destination.
//! - [`pool`]: the paged KV block pool, its prefix index and LRU, and the [`pool::Blocks`] guard.
//! - [`engine`]: sequences, prefill with prefix reuse, the continuous-batching step, resume.
//! - [`cost`]: the simulated compute cost of a step (a GPU's shape, slept on CPUs).
//! - [`scheduler`]: the admission policy (which waiting requests a step prefills).
//! - [`model`]: the [`model::Model`] trait and the deterministic fake model.
//! - [`sampler`] and [`rng`]: sampling exactly as `spec/pcg32.md` says, and PCG32 with its
//!   O(log n) advance for the hand-off between engines.
//! - [`request`]: the one request validation every door calls.
//! - [`logprobs`]: the log-softmax OpenAI reports, computed once.
//! - [`stop`] and [`vocab`]: stop rules, matched on the bytes each token id stands for.
// One module, `copy`, holds unsafe code (non-temporal stores), each block with its reason.
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod constraint;
pub mod copy;
pub mod cost;
pub mod engine;
pub mod logprobs;
pub mod model;
pub mod pool;
pub mod request;
pub mod rng;
pub mod sampler;
pub mod scheduler;
pub mod stop;
pub mod vocab;
