//! The reader: eight rules, in the contract's order, before anything is allocated.
//!
//! Every check reads the input in place through `zerocopy` views. On success the caller gets an
//! [`Envelope`] that borrows the input; on refusal a [`ReadError`] that is `Copy` and owns no heap
//! memory. Neither path allocates, so the size of a refused input costs nothing but the CRC pass.

use std::fmt;

use half::f16;
use zerocopy::FromBytes;

use crate::crc::{CRC32C_RESIDUE, crc32c};
use crate::format::{Dims, Formats, Shape};
use crate::header::{HEADER_LEN, Header, MAGIC, RECORD_HEAD_LEN, RecordHead, TRAILER_LEN};
use crate::payload::{Kv, PlaneError};

/// The three kinds of refusal, which decide how a server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The bytes are corrupt or malformed (gRPC `DATA_LOSS`).
    Format,
    /// A well-formed envelope of a format this reader does not read (gRPC `FAILED_PRECONDITION`).
    Version,
    /// A well-formed envelope whose block shape differs from the receiver's (`FAILED_PRECONDITION`).
    Shape,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::Format => "format",
            ErrorKind::Version => "version",
            ErrorKind::Shape => "shape",
        })
    }
}

/// Why the reader refused an envelope. Each variant names the rule (1 to 8) that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// Rule 1: an envelope has at least a header and a trailer.
    #[error("rule 1: {len} bytes is shorter than the 32-byte minimum")]
    TooShort {
        /// Input length.
        len: usize,
    },
    /// Rule 2: the first four bytes are `TLKV`.
    #[error("rule 2: magic is {found:02x?}, not \"TLKV\"")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// Rule 3: the trailer is the CRC-32C of every byte before it.
    #[error("rule 3: CRC-32C does not match the trailer {stored:#010x}")]
    Checksum {
        /// The trailer as stored.
        stored: u32,
    },
    /// Rule 4: `(version, dtype)` is one this reader was told to read.
    #[error("rule 4: version {version} dtype {dtype} is not a format this reader reads")]
    UnsupportedFormat {
        /// Header version.
        version: u16,
        /// Header dtype.
        dtype: u16,
    },
    /// Rule 5: n_blocks and every dimension are at least 1.
    #[error("rule 5: n_blocks {n_blocks} with {dims}: every count must be >= 1")]
    ZeroCount {
        /// Header n_blocks.
        n_blocks: u32,
        /// Header dimensions.
        dims: Dims,
    },
    /// Rule 5: the length is exactly `28 + n * (12 + P) + 4`.
    #[error("rule 5: length {len} but the header implies {}", fmt_len(*.expected))]
    BadLength {
        /// Input length.
        len: usize,
        /// What the header implies; `None` when that overflows.
        expected: Option<usize>,
    },
    /// Rule 6: the dimensions and format are the receiving pool's.
    #[error(
        "rule 6: block shape {found} ({found_format}) is not the pool's {expected} ({expected_format})"
    )]
    ShapeMismatch {
        /// The pool's dimensions.
        expected: Dims,
        /// The pool's format name.
        expected_format: &'static str,
        /// The envelope's dimensions.
        found: Dims,
        /// The envelope's format name.
        found_format: &'static str,
    },
    /// Rule 7: every fill is in `1..=B`.
    #[error("rule 7: record {record} has fill {fill}, outside 1..={block_tokens}")]
    BadFill {
        /// Record index.
        record: u32,
        /// Its fill.
        fill: u32,
        /// B.
        block_tokens: u32,
    },
    /// Rule 8: a record with a non-zero hash is full.
    #[error("rule 8: record {record} has hash {hash:#018x} but fill {fill} < {block_tokens}")]
    HashedPartial {
        /// Record index.
        record: u32,
        /// Its hash.
        hash: u64,
        /// Its fill.
        fill: u32,
        /// B.
        block_tokens: u32,
    },
}

fn fmt_len(expected: Option<usize>) -> String {
    match expected {
        Some(n) => n.to_string(),
        None => "an overflowing size".to_owned(),
    }
}

impl ReadError {
    /// The rule that failed, 1 to 8.
    #[must_use]
    pub fn rule(&self) -> u8 {
        match self {
            ReadError::TooShort { .. } => 1,
            ReadError::BadMagic { .. } => 2,
            ReadError::Checksum { .. } => 3,
            ReadError::UnsupportedFormat { .. } => 4,
            ReadError::ZeroCount { .. } | ReadError::BadLength { .. } => 5,
            ReadError::ShapeMismatch { .. } => 6,
            ReadError::BadFill { .. } => 7,
            ReadError::HashedPartial { .. } => 8,
        }
    }

    /// Corruption, an unread format, or a shape mismatch.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            ReadError::UnsupportedFormat { .. } => ErrorKind::Version,
            ReadError::ShapeMismatch { .. } => ErrorKind::Shape,
            _ => ErrorKind::Format,
        }
    }
}

/// Reads envelopes: which formats it accepts and, optionally, the shape they must have.
///
/// ```
/// use kvwire::{Reader, Shape};
/// let reader = Reader::new().expect_shape(Shape::v1(4, 2, 1, 4));
/// assert_eq!(reader.read(b"too short").unwrap_err().rule(), 1);
/// ```
#[derive(Clone, Debug, Default)]
pub struct Reader {
    formats: Formats,
    expect: Option<Shape>,
}

impl Reader {
    /// A reader of v1 envelopes of any shape.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Accept exactly these formats (rule 4).
    #[must_use]
    pub fn formats(mut self, formats: Formats) -> Self {
        self.formats = formats;
        self
    }

    /// Refuse envelopes whose dimensions or format differ from `shape` (rule 6).
    #[must_use]
    pub fn expect_shape(mut self, shape: Shape) -> Self {
        self.expect = Some(shape);
        self
    }

    /// The shape this reader insists on, if any.
    #[must_use]
    pub fn expected_shape(&self) -> Option<&Shape> {
        self.expect.as_ref()
    }

    /// Validates `buf` and returns a view of it.
    ///
    /// # Errors
    /// The first rule, in the contract's order, that `buf` breaks.
    pub fn read<'a>(&self, buf: &'a [u8]) -> Result<Envelope<'a>, ReadError> {
        self.read_inner(buf, None)
    }

    /// As [`read`](Self::read), for a caller that already ran one CRC-32C pass over all of `buf`,
    /// trailer included (for a chunk checksum): rule 3 then holds when that pass equals
    /// [`CRC32C_RESIDUE`], and the bytes are not read a second time.
    ///
    /// ```
    /// use kvwire::{CRC32C_RESIDUE, Crc32c, Reader, RecordIn, Shape, write_to_vec};
    /// let shape = Shape::v1(4, 2, 1, 4);
    /// let payload = vec![0u8; shape.payload_bytes().unwrap()];
    /// let mut buf = Vec::new();
    /// write_to_vec(&shape, &[RecordIn { hash: 0, fill: 1, payload: &payload }], &mut buf).unwrap();
    /// // The CRC computed while the bytes arrived, over all of them.
    /// let mut crc = Crc32c::new();
    /// for piece in buf.chunks(100) {
    ///     crc.update(piece);
    /// }
    /// assert_eq!(crc.finish(), CRC32C_RESIDUE);
    /// let env = Reader::new().read_with_crc(&buf, crc.finish()).unwrap();
    /// assert_eq!(env.n_blocks(), 1);
    /// ```
    ///
    /// # Errors
    /// As [`read`](Self::read).
    pub fn read_with_crc<'a>(
        &self,
        buf: &'a [u8],
        crc_of_all: u32,
    ) -> Result<Envelope<'a>, ReadError> {
        self.read_inner(buf, Some(crc_of_all))
    }

    fn read_inner<'a>(
        &self,
        buf: &'a [u8],
        crc_of_all: Option<u32>,
    ) -> Result<Envelope<'a>, ReadError> {
        // Rule 1: length >= 32 (a header and a trailer).
        if buf.len() < HEADER_LEN + TRAILER_LEN {
            return Err(ReadError::TooShort { len: buf.len() });
        }
        let (header, rest) =
            Header::ref_from_prefix(buf).map_err(|_| ReadError::TooShort { len: buf.len() })?;
        let (body, trailer) = rest.split_at(rest.len() - TRAILER_LEN);
        let stored = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);

        // Rule 2: magic is `TLKV`.
        if header.magic != MAGIC {
            return Err(ReadError::BadMagic {
                found: header.magic,
            });
        }

        // Rule 3: CRC-32C of bytes [0, len-4) equals the trailer. Checked before the version so a
        // flipped version bit reads as corruption, not as "a format I do not read".
        let crc_ok = match crc_of_all {
            Some(all) => all == CRC32C_RESIDUE,
            None => crc32c(&buf[..buf.len() - TRAILER_LEN]) == stored,
        };
        if !crc_ok {
            return Err(ReadError::Checksum { stored });
        }

        // Rule 4: (version, dtype) is one this reader reads.
        let (version, dtype) = (header.version.get(), header.dtype.get());
        let format = self
            .formats
            .get(version, dtype)
            .ok_or(ReadError::UnsupportedFormat { version, dtype })?;

        // Rule 5: n_blocks and every dimension >= 1; len == E, overflow-checked.
        let dims = Dims {
            block_tokens: header.block_tokens.get(),
            n_layers: header.n_layers.get(),
            n_kv_heads: header.n_kv_heads.get(),
            head_dim: header.head_dim.get(),
        };
        let n_blocks = header.n_blocks.get();
        let shape = Shape { dims, format };
        if n_blocks == 0 || !shape.is_valid() {
            return Err(ReadError::ZeroCount { n_blocks, dims });
        }
        let expected = shape.envelope_len(n_blocks as usize);
        if expected != Some(buf.len()) {
            return Err(ReadError::BadLength {
                len: buf.len(),
                expected,
            });
        }
        // Some whenever envelope_len was.
        let payload = shape.payload_bytes().ok_or(ReadError::BadLength {
            len: buf.len(),
            expected,
        })?;

        // Rule 6: dimensions equal the receiving pool's.
        if let Some(want) = &self.expect
            && (want.dims != dims || want.format != format)
        {
            return Err(ReadError::ShapeMismatch {
                expected: want.dims,
                expected_format: want.format.name,
                found: dims,
                found_format: format.name,
            });
        }

        let env = Envelope {
            header,
            shape,
            body,
            payload,
            stored_crc: stored,
        };

        // Rule 7: every fill in 1..=B. All records are checked before rule 8 is applied to any.
        let b = dims.block_tokens;
        for (i, head) in env.heads().enumerate() {
            let fill = head.n_tokens.get();
            if fill == 0 || fill > b {
                return Err(ReadError::BadFill {
                    record: i as u32,
                    fill,
                    block_tokens: b,
                });
            }
        }
        // Rule 8: a record with hash != 0 has fill == B.
        for (i, head) in env.heads().enumerate() {
            let (hash, fill) = (head.hash.get(), head.n_tokens.get());
            if hash != 0 && fill != b {
                return Err(ReadError::HashedPartial {
                    record: i as u32,
                    hash,
                    fill,
                    block_tokens: b,
                });
            }
        }
        Ok(env)
    }
}

/// A validated envelope: a view over the bytes it was read from.
#[derive(Clone, Copy, Debug)]
pub struct Envelope<'a> {
    header: &'a Header,
    shape: Shape,
    /// The records: n * (12 + P) bytes.
    body: &'a [u8],
    payload: usize,
    stored_crc: u32,
}

impl<'a> Envelope<'a> {
    /// The header, in place.
    #[must_use]
    pub fn header(&self) -> &'a Header {
        self.header
    }

    /// The block shape and format the header declares.
    #[must_use]
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Number of records.
    #[must_use]
    pub fn n_blocks(&self) -> usize {
        self.header.n_blocks.get() as usize
    }

    /// P, payload bytes per record.
    #[must_use]
    pub fn payload_bytes(&self) -> usize {
        self.payload
    }

    /// The trailer.
    #[must_use]
    pub fn crc(&self) -> u32 {
        self.stored_crc
    }

    /// The records, in order.
    #[must_use]
    pub fn records(&self) -> Records<'a> {
        Records {
            chunks: self.body.chunks_exact(RECORD_HEAD_LEN + self.payload),
            shape: self.shape,
        }
    }

    fn heads(&self) -> impl Iterator<Item = &'a RecordHead> + use<'a> {
        self.body
            .chunks_exact(RECORD_HEAD_LEN + self.payload)
            .filter_map(|rec| RecordHead::ref_from_prefix(rec).ok().map(|(h, _)| h))
    }
}

/// One record of an [`Envelope`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record<'a> {
    /// The block's chained hash, or 0.
    pub hash: u64,
    /// The fill (tokens present), in `1..=B`.
    pub n_tokens: u32,
    /// P bytes laid out as the contract says; a slice of the input.
    pub payload: &'a [u8],
    shape: Shape,
}

impl<'a> Record<'a> {
    /// The envelope's shape, which lays out [`payload`](Self::payload).
    #[must_use]
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The `(layer, kv)` plane as `[f16]`, a view of the input (no copy): `B * H * D` values in
    /// `[token][head][dim]` order; slots past [`n_tokens`](Self::n_tokens) are zeros.
    ///
    /// ```
    /// use half::f16;
    /// use kvwire::{Kv, Reader, RecordIn, Shape, write_to_vec};
    /// let shape = Shape::v1(4, 1, 1, 2); // planes of 4 tokens x 1 head x 2 dims
    /// let planes: Vec<f16> = (0..16).map(|i| f16::from_f32(i as f32)).collect();
    /// let mut buf = Vec::new();
    /// let rec = RecordIn::from_f16(&shape, 0, 4, &planes).unwrap();
    /// write_to_vec(&shape, &[rec], &mut buf).unwrap();
    /// let env = Reader::new().read(&buf).unwrap();
    /// let v = env.records().next().unwrap().plane(0, Kv::V).unwrap();
    /// assert_eq!(v, &planes[8..]);
    /// ```
    ///
    /// # Errors
    /// See [`Shape::f16_plane`].
    pub fn plane(&self, layer: u32, kv: Kv) -> Result<&'a [f16], PlaneError> {
        self.shape.f16_plane(self.payload, layer, kv)
    }
}

/// Iterator over the records of an [`Envelope`].
#[derive(Clone, Debug)]
pub struct Records<'a> {
    chunks: std::slice::ChunksExact<'a, u8>,
    shape: Shape,
}

impl<'a> Iterator for Records<'a> {
    type Item = Record<'a>;

    fn next(&mut self) -> Option<Record<'a>> {
        let rec = self.chunks.next()?;
        let (head, payload) = RecordHead::ref_from_prefix(rec).ok()?;
        Some(Record {
            hash: head.hash.get(),
            n_tokens: head.n_tokens.get(),
            payload,
            shape: self.shape,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.chunks.size_hint()
    }
}

impl ExactSizeIterator for Records<'_> {}
