//! `tl-engine`: the engine behind the `tl` binary.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod bench;
pub mod cli;
