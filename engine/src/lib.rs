//! `tl-engine`: the engine behind the `tl` binary.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod bench;
pub mod cli;
pub mod client;
pub mod config;
pub mod control;
pub mod demo;
pub mod engine;
pub mod gateway;
pub mod http;
pub mod model;
pub mod node;
pub mod pool;
pub mod registry;
pub mod rng;
pub mod runner;
pub mod sampler;
pub mod serve;
