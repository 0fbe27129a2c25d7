//! `tl-engine`: the engine behind the `tl` binary.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod bench;
pub mod cli;
pub mod config;
pub mod engine;
pub mod model;
pub mod pool;
pub mod rng;
pub mod sampler;
