//! The writer: one copy of each payload into the caller's buffer, CRC-32C computed alongside.
//!
//! Everything is validated before the first byte is written, so a refused write leaves the
//! caller's buffer as it was.

use bytes::BufMut;
use zerocopy::IntoBytes;
use zerocopy::little_endian::{U16, U32, U64};

use crate::crc::Crc32c;
use crate::format::Shape;
use crate::header::{HEADER_LEN, Header, MAGIC, RECORD_HEAD_LEN, RecordHead, TRAILER_LEN};
use crate::payload::PlaneError;

/// One block to write.
#[derive(Clone, Copy, Debug)]
pub struct RecordIn<'p> {
    /// The block's chained hash; 0 for a partial block or one never registered.
    pub hash: u64,
    /// Tokens present, in `1..=B`.
    pub fill: u32,
    /// Either the full P bytes (token slots past `fill` may hold anything: they are written as
    /// zeros) or the short form holding only the first `fill` token rows of each plane
    /// (`2 * L * fill * H * D * elem` bytes), which the writer pads with zeros.
    pub payload: &'p [u8],
}

impl<'p> RecordIn<'p> {
    /// A record whose payload is `planes`, the `2 * L` planes of an f16 shape in order (layer 0
    /// K, layer 0 V, layer 1 K, ...), each `[token][head][dim]`: the bytes are the slice's own,
    /// no cast by hand and no copy.
    ///
    /// ```
    /// use half::f16;
    /// use kvwire::{PlaneError, RecordIn, Shape};
    /// let shape = Shape::v1(4, 2, 1, 4);
    /// let planes = vec![f16::ZERO; shape.payload_bytes().unwrap() / 2];
    /// let rec = RecordIn::from_f16(&shape, 0, 3, &planes).unwrap();
    /// assert_eq!(rec.payload.len(), shape.payload_bytes().unwrap());
    /// assert!(matches!(
    ///     RecordIn::from_f16(&shape, 0, 3, &planes[1..]),
    ///     Err(PlaneError::Length { .. })
    /// ));
    /// ```
    ///
    /// # Errors
    /// [`PlaneError::NotF16`] for a shape whose elements are not 2 bytes,
    /// [`PlaneError::Length`] when `planes` is not the shape's whole payload, and
    /// [`PlaneError::BigEndian`] on a big-endian target (the wire is little-endian: there,
    /// encode with [`Shape::put_f16`]).
    pub fn from_f16(
        shape: &Shape,
        hash: u64,
        fill: u32,
        planes: &'p [half::f16],
    ) -> Result<Self, PlaneError> {
        shape.f16_in_place()?;
        let payload: &[u8] = bytemuck::cast_slice(planes);
        let want = shape.payload_bytes().unwrap_or(usize::MAX);
        if payload.len() != want {
            return Err(PlaneError::Length {
                got: payload.len(),
                want,
            });
        }
        Ok(Self {
            hash,
            fill,
            payload,
        })
    }
}

/// Why a write was refused. Nothing was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// An envelope has at least one record.
    #[error("an envelope needs at least one record")]
    NoRecords,
    /// Every dimension of the shape is at least 1.
    #[error("every dimension of the shape must be >= 1")]
    ZeroDimension,
    /// The envelope's size does not fit in memory arithmetic.
    #[error("the envelope's size overflows")]
    Overflow,
    /// Too many records for the header's u32 count.
    #[error("{0} records do not fit the header's u32 n_blocks")]
    TooManyRecords(usize),
    /// A fill is in `1..=B`.
    #[error("record {record}: fill {fill} outside 1..={block_tokens}")]
    BadFill {
        /// Record index.
        record: usize,
        /// Its fill.
        fill: u32,
        /// B.
        block_tokens: u32,
    },
    /// Only full blocks carry a hash.
    #[error("record {record}: hash {hash:#018x} on a partial block (fill {fill})")]
    HashedPartial {
        /// Record index.
        record: usize,
        /// Its hash.
        hash: u64,
        /// Its fill.
        fill: u32,
    },
    /// Only a full block's envelope is split ([`split_full`]): a partial one is padded with
    /// zeros on the way out, which takes a copy.
    #[error("record {record}: fill {fill} of {block_tokens} cannot be split (only full blocks)")]
    NotFull {
        /// Record index.
        record: usize,
        /// Its fill.
        fill: u32,
        /// B.
        block_tokens: u32,
    },
    /// The payload is neither P bytes nor the short form for its fill.
    #[error("record {record}: payload of {len} bytes is neither {full} nor the short {short}")]
    PayloadLength {
        /// Record index.
        record: usize,
        /// Given length.
        len: usize,
        /// P.
        full: usize,
        /// The short form's length for this fill.
        short: usize,
    },
}

/// Zeros to copy and checksum for the unfilled token rows.
static ZEROS: [u8; 4096] = [0; 4096];

/// Copies and checksums in pieces small enough to stay in cache between the two.
// cargo-mutants: `64 * 1024` -> `64 + 1024` is equivalent (any piece size writes the same bytes
// and the same checksum; only the speed changes).
const PIECE: usize = 64 * 1024;

/// Writes an envelope of `records` into `out` and returns its length.
///
/// `out` grows as it is written; for a `Vec<u8>` prefer [`write_to_vec`], which reserves once.
///
/// ```
/// use kvwire::{RecordIn, Shape, write_envelope};
/// let shape = Shape::v1(4, 2, 1, 4);
/// let payload = vec![1u8; shape.payload_bytes().unwrap()];
/// // Any `bytes::BufMut`: a `BytesMut`, a gRPC encode buffer...
/// let mut out = bytes::BytesMut::new();
/// let n = write_envelope(&shape, &[RecordIn { hash: 0, fill: 2, payload: &payload }], &mut out)
///     .unwrap();
/// assert_eq!(n, out.len());
/// assert_eq!(n, shape.envelope_len(1).unwrap());
/// ```
///
/// # Errors
/// A [`WriteError`] when the shape or a record is invalid; then nothing is written.
pub fn write_envelope<B: BufMut>(
    shape: &Shape,
    records: &[RecordIn<'_>],
    out: &mut B,
) -> Result<usize, WriteError> {
    let len = check(shape, records)?;
    let dims = &shape.dims;
    let header = header(shape, records.len() as u32);
    let mut crc = Crc32c::new();
    put(out, &mut crc, header.as_bytes());

    // check() proved these sizes fit.
    let row = shape.row_bytes().unwrap_or(0);
    let b = dims.block_tokens as usize;
    for r in records {
        let head = RecordHead {
            hash: U64::new(r.hash),
            n_tokens: U32::new(r.fill),
        };
        put(out, &mut crc, head.as_bytes());
        let fill = r.fill as usize;
        // Source stride: a full payload keeps B rows per plane, the short form `fill` rows.
        let stride = if r.payload.len() == row * b * shape.planes() {
            b
        } else {
            fill
        };
        if fill == b {
            put(out, &mut crc, r.payload);
            continue;
        }
        for plane in r.payload.chunks_exact(row * stride) {
            put(out, &mut crc, &plane[..row * fill]);
            put_zeros(out, &mut crc, row * (b - fill));
        }
    }
    out.put_slice(&crc.finish().to_le_bytes());
    Ok(len)
}

/// The bytes before a one-record envelope's payload: the header and the record's head.
pub const SPLIT_HEAD_LEN: usize = HEADER_LEN + RECORD_HEAD_LEN;

/// A one-record envelope of a full block, without its payload: what goes before it and the
/// CRC-32C that goes after. `head`, the payload and `crc.to_le_bytes()` in that order are
/// byte for byte what [`write_envelope`] writes, so a sender can hand the payload to the socket
/// where it lies (a vectored write, a `Bytes` of the pool's memory) instead of copying it into a
/// message buffer. Computing `crc` reads the payload once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitEnvelope {
    /// The header and the record head.
    pub head: [u8; SPLIT_HEAD_LEN],
    /// The envelope's CRC-32C, over `head` and the payload.
    pub crc: u32,
}

impl SplitEnvelope {
    /// The split envelope of the block `head` names (from [`full_block_head`]) and `payload`:
    /// its CRC-32C read over the head and the payload once.
    #[must_use]
    pub fn of(head: [u8; SPLIT_HEAD_LEN], payload: &[u8]) -> Self {
        let mut crc = Crc32c::new();
        crc.update(&head);
        for piece in payload.chunks(PIECE) {
            crc.update(piece);
        }
        Self {
            head,
            crc: crc.finish(),
        }
    }

    /// The envelope's length: head, payload and trailer.
    #[must_use]
    pub fn len(&self, payload: usize) -> usize {
        SPLIT_HEAD_LEN + payload + TRAILER_LEN
    }

    /// Seals the envelope in place: `buf` holds the payload between [`SPLIT_HEAD_LEN`] bytes of
    /// room before it and [`TRAILER_LEN`] after it; the head goes before and the CRC after, so
    /// `buf` becomes the whole envelope, byte for byte what [`write_envelope`] writes.
    ///
    /// # Panics
    /// When `buf` is shorter than the head and the trailer together.
    pub fn place(&self, buf: &mut [u8]) {
        let n = buf.len();
        buf[..SPLIT_HEAD_LEN].copy_from_slice(&self.head);
        buf[n - TRAILER_LEN..].copy_from_slice(&self.crc.to_le_bytes());
    }
}

/// The head of a one-record envelope of a full block: the header and the record head, the
/// first [`SPLIT_HEAD_LEN`] bytes [`write_envelope`] writes for it. A pool that keeps this room
/// before each block's payload and 4 bytes after it can hold the whole envelope in place.
///
/// # Errors
/// [`WriteError::ZeroDimension`] for an invalid shape, [`WriteError::NotFull`] when `fill` is
/// not B.
pub fn full_block_head(
    shape: &Shape,
    hash: u64,
    fill: u32,
) -> Result<[u8; SPLIT_HEAD_LEN], WriteError> {
    if !shape.is_valid() {
        return Err(WriteError::ZeroDimension);
    }
    let b = shape.dims.block_tokens;
    if fill != b {
        return Err(WriteError::NotFull {
            record: 0,
            fill,
            block_tokens: b,
        });
    }
    let mut head = [0u8; SPLIT_HEAD_LEN];
    head[..HEADER_LEN].copy_from_slice(header(shape, 1).as_bytes());
    let rh = RecordHead {
        hash: U64::new(hash),
        n_tokens: U32::new(fill),
    };
    head[HEADER_LEN..].copy_from_slice(rh.as_bytes());
    Ok(head)
}

/// [`SplitEnvelope`] of one full record (`fill` = B, all P payload bytes).
///
/// ```
/// use kvwire::{RecordIn, Shape, split_full, write_to_vec};
/// let shape = Shape::v1(4, 2, 1, 4);
/// let payload = vec![7u8; shape.payload_bytes().unwrap()];
/// let rec = RecordIn { hash: 9, fill: 4, payload: &payload };
/// let split = split_full(&shape, rec).unwrap();
/// let mut whole = Vec::new();
/// write_to_vec(&shape, &[rec], &mut whole).unwrap();
/// let joined = [&split.head[..], &payload, &split.crc.to_le_bytes()].concat();
/// assert_eq!(joined, whole);
/// ```
///
/// # Errors
/// As [`write_envelope`], and [`WriteError::NotFull`] for a partial record or one in the short
/// form.
pub fn split_full(shape: &Shape, record: RecordIn<'_>) -> Result<SplitEnvelope, WriteError> {
    check(shape, &[record])?;
    if Some(record.payload.len()) != shape.payload_bytes() {
        return Err(WriteError::NotFull {
            record: 0,
            fill: record.fill,
            block_tokens: shape.dims.block_tokens,
        });
    }
    let head = full_block_head(shape, record.hash, record.fill)?;
    Ok(SplitEnvelope::of(head, record.payload))
}

fn header(shape: &Shape, n_blocks: u32) -> Header {
    let dims = &shape.dims;
    Header {
        magic: MAGIC,
        version: U16::new(shape.format.version),
        dtype: U16::new(shape.format.dtype),
        n_blocks: U32::new(n_blocks),
        block_tokens: U32::new(dims.block_tokens),
        n_layers: U32::new(dims.n_layers),
        n_kv_heads: U32::new(dims.n_kv_heads),
        head_dim: U32::new(dims.head_dim),
    }
}

/// [`write_envelope`] appending to a `Vec`, reserving the envelope's size first so the payload
/// is copied once and never moved by a reallocation.
///
/// # Errors
/// As [`write_envelope`]; then `out` is unchanged.
pub fn write_to_vec(
    shape: &Shape,
    records: &[RecordIn<'_>],
    out: &mut Vec<u8>,
) -> Result<usize, WriteError> {
    let len = check(shape, records)?;
    out.reserve(len);
    write_envelope(shape, records, out)
}

fn put<B: BufMut>(out: &mut B, crc: &mut Crc32c, bytes: &[u8]) {
    for piece in bytes.chunks(PIECE) {
        out.put_slice(piece);
        crc.update(piece);
    }
}

fn put_zeros<B: BufMut>(out: &mut B, crc: &mut Crc32c, mut n: usize) {
    while n > 0 {
        let k = n.min(ZEROS.len());
        out.put_slice(&ZEROS[..k]);
        crc.update(&ZEROS[..k]);
        n -= k;
    }
}

/// Validates the shape and every record; returns the envelope length.
fn check(shape: &Shape, records: &[RecordIn<'_>]) -> Result<usize, WriteError> {
    if !shape.is_valid() {
        return Err(WriteError::ZeroDimension);
    }
    if records.is_empty() {
        return Err(WriteError::NoRecords);
    }
    if u32::try_from(records.len()).is_err() {
        return Err(WriteError::TooManyRecords(records.len()));
    }
    let len = shape
        .envelope_len(records.len())
        .ok_or(WriteError::Overflow)?;
    let full = shape.payload_bytes().ok_or(WriteError::Overflow)?;
    let row = shape.row_bytes().ok_or(WriteError::Overflow)?;
    let b = shape.dims.block_tokens;
    for (i, r) in records.iter().enumerate() {
        if r.fill == 0 || r.fill > b {
            return Err(WriteError::BadFill {
                record: i,
                fill: r.fill,
                block_tokens: b,
            });
        }
        if r.hash != 0 && r.fill != b {
            return Err(WriteError::HashedPartial {
                record: i,
                hash: r.hash,
                fill: r.fill,
            });
        }
        // Cannot overflow: at most `full`.
        let short = row * r.fill as usize * shape.planes();
        if r.payload.len() != full && r.payload.len() != short {
            return Err(WriteError::PayloadLength {
                record: i,
                len: r.payload.len(),
                full,
                short,
            });
        }
    }
    Ok(len)
}
