//! `kvwire-grpc`: the tl.kv.v1 transfer between a prefill and a decode engine.
//!
//! Not built yet: this crate is a placeholder so the workspace has its final layout.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

/// The only KV format this transfer speaks today (`kv.wire.v1`).
pub const KV_FORMAT_V1: u32 = kvwire::WireFormat::V1_F16.version as u32;
