#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod crc;
mod format;
mod hash;
mod header;
mod payload;
mod read;
mod write;

pub use crc::{CRC32C_RESIDUE, Crc32c, CrcImpl, UnknownCrcImpl, crc32c, crc32c_impl, set_crc_impl};
pub use format::{Dims, Formats, Shape, WireFormat};
pub use hash::{
    BlockId, BlockKey, FNV_OFFSET_BASIS, FNV_PRIME, block_hash, fnv1a64, prompt_hashes,
};
pub use header::{HEADER_LEN, Header, MAGIC, RECORD_HEAD_LEN, RecordHead, TRAILER_LEN};
pub use payload::{Kv, PlaneError, Pos};
pub use read::{Envelope, ErrorKind, ReadError, Reader, Record, Records};
pub use write::{
    RecordIn, SPLIT_HEAD_LEN, SplitEnvelope, WriteError, full_block_head, split_full,
    write_envelope, write_to_vec,
};

/// Re-exported so callers name the element type of f16 payloads without a direct dependency.
pub use half::f16;
