//! The fixed-size parts of an envelope as `zerocopy` views: read in place, never copied.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// The four bytes every envelope starts with.
pub const MAGIC: [u8; 4] = *b"TLKV";
/// Bytes in the header.
pub const HEADER_LEN: usize = 28;
/// Bytes in a record head (hash and fill) before each payload.
pub const RECORD_HEAD_LEN: usize = 12;
/// Bytes in the CRC-32C trailer.
pub const TRAILER_LEN: usize = 4;

/// The 28-byte envelope header, all integers little-endian.
#[derive(
    FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq,
)]
#[repr(C)]
pub struct Header {
    /// ASCII `TLKV`.
    pub magic: [u8; 4],
    /// Format version (1 for `kv.wire.v1`).
    pub version: U16,
    /// Element type (1 = f16 in v1).
    pub dtype: U16,
    /// Number of records, at least 1.
    pub n_blocks: U32,
    /// B: token slots per block.
    pub block_tokens: U32,
    /// L: layers.
    pub n_layers: U32,
    /// H: KV heads.
    pub n_kv_heads: U32,
    /// D: head dimension.
    pub head_dim: U32,
}

/// The 12 bytes before each payload.
#[derive(
    FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq,
)]
#[repr(C)]
pub struct RecordHead {
    /// The block's chained hash, or 0 for a partial or never-registered block.
    pub hash: U64,
    /// The fill: how many of the B token slots hold data.
    pub n_tokens: U32,
}

const _: () = assert!(size_of::<Header>() == HEADER_LEN);
const _: () = assert!(size_of::<RecordHead>() == RECORD_HEAD_LEN);
