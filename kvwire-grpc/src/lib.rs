//! `kvwire-grpc`: the deduplicating `tl.kv.v1` transfer between a prefill and a decode engine.
//!
//! - [`pb`]: hand-written prost messages of all three packages (no codegen).
//! - [`glue`]: the few lines of tonic plumbing a service or client needs, shared by every service.
//! - [`store`]: the pool interface the transfer needs ([`KvStore`]); the engine's pool implements it.
//! - [`memory`]: an in-memory [`KvStore`] for tests and examples, so the transfer's logic runs
//!   without an engine and without a socket.
//! - [`receiver`]: the decode side's per-chunk rules, as plain logic ([`KvReceiver`]).
//! - [`sender`]: the prefill side: [`KvTransport`], its gRPC implementation, and [`transfer`].
//! - [`server`]: the `KvTransfer` service and [`serve_kv`].
//! - [`socket`]: KV sockets whose reads and writes are capped ([`socket::READ_CAP`],
//!   [`socket::WRITE_CAP`]), and the dialler of capped writes `GrpcTransport` uses.
//! - [`frames`]: a client-streaming call read frame by frame, without tonic's copy.
//! - [`lane`]: the receiver's threads for checking and copying pushed blocks, off the async
//!   workers.
//! - [`etcd`]: hand-written prost messages for the part of etcd's v3 API the registry uses.
//!
#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod etcd;
pub mod frames;
pub mod glue;
pub mod lane;
pub mod memory;
pub mod pb;
pub mod receiver;
pub mod sender;
pub mod server;
pub mod socket;
pub mod store;

pub use lane::ImportLane;
pub use receiver::{Claimed, HandleView, KvReceiver, PushState, ReceiverLimits, RecvError};
pub use sender::{
    BlockFeed, GrpcTransport, Holds, KvTransport, OutChunk, Push, TransferError, TransferStats,
    TransportConfig, has_blocks_at, transfer, transfer_formats, transfer_streaming,
};
pub use server::{
    H2Limits, KvLookups, KvServerHandle, KvTransferService, PushObserver, ServiceLimits, serve_kv,
};
pub use store::{BlockId, BlockKey, KvStore, StoreError};

/// The `kv_format` of `kv.wire.v1`.
pub const KV_FORMAT_V1: u32 = 1;
