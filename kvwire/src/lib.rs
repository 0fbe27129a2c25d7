//! `kvwire`: the `kv.wire.v1` envelope that carries paged KV-cache blocks between engines.
//!
//! The crate owns four things, all synchronous and free of I/O:
//!
//! 1. **Names.** [`block_hash`] chains FNV-1a 64 over a parent hash and a block's token ids, so a
//!    block's name says which prefix it completes ([`prompt_hashes`] names every full block of a
//!    prompt).
//! 2. **Bytes.** [`Header`] and [`RecordHead`] are `zerocopy` views of little-endian integers; a
//!    [`Shape`] (B, L, H, D and a [`WireFormat`]) gives every size with overflow-checked arithmetic.
//! 3. **Reading.** [`Reader::read`] applies the eight reader rules in the contract's order and
//!    returns an [`Envelope`], a borrowed view whose records are slices of the input. It allocates
//!    nothing, on success or on refusal, so bytes from the network are judged before anything is
//!    spent on them.
//! 4. **Writing.** [`write_envelope`] copies each payload once into any [`bytes::BufMut`] while
//!    computing the CRC-32C trailer over the same bytes.
//!
//! Which `(version, dtype)` pairs a reader accepts is a value ([`Formats`]), so another crate can
//! add a format (say fp8, v2) without changing this one: element sizes come from the format.
//!
//! The life of a block through this crate: an engine exports a block's payload and fill, calls
//! [`write_envelope`] with its hash, sends the bytes; the receiver calls [`Reader::read`] with its
//! pool's [`Shape`], and copies each [`Record::payload`] into its own slab.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod crc;
mod format;
mod hash;
mod header;
mod payload;
mod read;
mod write;

pub use crc::{CRC32C_RESIDUE, Crc32c, CrcImpl, crc32c, crc32c_impl, set_crc_impl};
pub use format::{Dims, Formats, Shape, WireFormat};
pub use hash::{FNV_OFFSET_BASIS, FNV_PRIME, block_hash, fnv1a64, prompt_hashes};
pub use header::{HEADER_LEN, Header, MAGIC, RECORD_HEAD_LEN, RecordHead, TRAILER_LEN};
pub use payload::{Kv, PlaneError, Pos};
pub use read::{Envelope, ErrorKind, ReadError, Reader, Record, Records};
pub use write::{RecordIn, WriteError, write_envelope, write_to_vec};

/// Re-exported so callers name the element type of f16 payloads without a direct dependency.
pub use half::f16;
