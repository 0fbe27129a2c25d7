//! The model interface and the deterministic fake model of `spec/fake-model.md`.

use std::fmt;

use kvwire::{Crc32c, Shape, f16, fnv1a64};

use crate::pool::{BlockId, KvPool, PoolError, SharedKv};
use crate::rng::Pcg32;

/// Byte tokens 0..=255, then these specials.
pub const BOS: u32 = 256;
/// End of sequence (the fake model never samples it on purpose; it is just a vocabulary entry).
pub const EOS: u32 = 257;
/// Padding.
pub const PAD: u32 = 258;
/// Unknown.
pub const UNK: u32 = 259;
/// The byte-level vocabulary: 256 bytes and 4 specials.
pub const BYTE_VOCAB: u32 = 260;

/// Errors a model step can hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The block table does not cover the positions to write or read.
    #[error("position {pos} is past the {blocks} blocks of the table")]
    NoBlock {
        /// Position.
        pos: usize,
        /// Blocks in the table.
        blocks: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token {0} is outside the vocabulary")]
    BadToken(u32),
    /// The pool refused an access.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// What an engine needs of a model. The KV cache lives in the pool, in the blocks of the
/// sequence's table; a model reads and writes it there, never in a side copy.
pub trait Model: Send + Sync + fmt::Debug {
    /// The model's name (`model` in requests and RPCs).
    fn name(&self) -> &str;
    /// The KV block shape it writes.
    fn shape(&self) -> Shape;
    /// Vocabulary size.
    fn vocab(&self) -> u32;
    /// Longest sequence, prompt and completion together.
    fn max_context(&self) -> u32;
    /// Writes the KV of `tokens` at positions `first_pos..first_pos + tokens.len()` into
    /// `blocks`, the sequence's block table. An engine may call it block by block, releasing the
    /// pool between calls, so a long prefill does not hold the pool the whole time.
    ///
    /// # Errors
    /// A [`ModelError`] when the table or the pool cannot hold the positions.
    fn write(
        &self,
        pool: &mut KvPool,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError>;
    /// [`write`](Self::write) on the shared pool. The default locks it for the whole call; a model
    /// should compute outside the lock and take it only to copy into the blocks.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn write_shared(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError> {
        self.write(&mut pool.lock(), tokens, first_pos, blocks)
    }
    /// The logits for the token after the first `n` positions, read from the KV in `blocks`.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn logits(&self, pool: &KvPool, n: usize, blocks: &[BlockId]) -> Result<Vec<f32>, ModelError>;
    /// The same logits, from the shared pool. The default locks it once for the whole pass; a
    /// model that reads its blocks one at a time should take the lock per block, so a control
    /// call (HasBlocks, an import) waits for one block's read, not a whole sequence's. That is
    /// safe because the blocks of a running sequence change only on the engine thread: shared
    /// prefix blocks are full and immutable, the tail is this sequence's alone.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn logits_shared(
        &self,
        pool: &SharedKv,
        n: usize,
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        self.logits(&pool.lock(), n, blocks)
    }
    /// Writes the KV of `tokens[start..]` at positions `start..` (the KV of positions before
    /// `start` is already there, from cached prefix blocks) and returns the logits for the token
    /// after the last.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn prefill(
        &self,
        pool: &mut KvPool,
        tokens: &[u32],
        start: usize,
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        self.write(pool, tokens.get(start..).unwrap_or_default(), start, blocks)?;
        self.logits(pool, tokens.len(), blocks)
    }
    /// Writes the KV of `token` at `pos` and returns the logits for position `pos + 1`.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn decode(
        &self,
        pool: &mut KvPool,
        token: u32,
        pos: usize,
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        self.write(pool, &[token], pos, blocks)?;
        self.logits(pool, pos + 1, blocks)
    }
}

/// The fake model: cheap, deterministic, and sensitive to every cached KV byte.
#[derive(Clone, Debug)]
pub struct FakeModel {
    name: String,
    shape: Shape,
    vocab: u32,
    max_context: u32,
}

impl FakeModel {
    /// A fake model named `name`.
    #[must_use]
    pub fn new(name: impl Into<String>, shape: Shape, vocab: u32, max_context: u32) -> Self {
        Self {
            name: name.into(),
            shape,
            vocab,
            max_context,
        }
    }

    /// The f16 the model stores for input `token` at `pos`, in (layer, kv, head, dim):
    /// `((7x + 13p + 5l + 3kv + 11h + d) mod 64 - 32) / 16`, exact in binary16.
    #[must_use]
    pub fn kv_value(token: u32, pos: usize, layer: u32, kv: u32, head: u32, dim: u32) -> f16 {
        let n = (u64::from(token) * 7
            + pos as u64 * 13
            + u64::from(layer) * 5
            + u64::from(kv) * 3
            + u64::from(head) * 11
            + u64::from(dim))
            % 64;
        f16::from_f32((n as f32 - 32.0) / 16.0)
    }

    /// Appends the KV rows of input `token` at `pos` to `out`: one row of `H x D` f16 per
    /// (layer, K or V), in plane order, computed without touching the pool.
    fn rows(&self, token: u32, pos: usize, out: &mut Vec<u8>) -> Result<(), ModelError> {
        if token >= self.vocab {
            return Err(ModelError::BadToken(token));
        }
        let d = self.shape.dims;
        let row = d.n_kv_heads as usize * d.head_dim as usize * 2;
        let start = out.len();
        out.resize(start + self.rows_len(), 0);
        for (p, dst) in out[start..].chunks_exact_mut(row).enumerate() {
            let (layer, kv) = ((p / 2) as u32, (p % 2) as u32);
            let mut i = 0;
            for head in 0..d.n_kv_heads {
                for dim in 0..d.head_dim {
                    let v = Self::kv_value(token, pos, layer, kv, head, dim).to_le_bytes();
                    dst[i..i + 2].copy_from_slice(&v);
                    i += 2;
                }
            }
        }
        Ok(())
    }

    /// Bytes of one position's rows.
    fn rows_len(&self) -> usize {
        let d = self.shape.dims;
        d.n_kv_heads as usize * d.head_dim as usize * 2 * 2 * d.n_layers as usize
    }

    /// Copies the `rows` of position `pos` into its slot of the block table, and raises the
    /// block's fill.
    fn place(
        &self,
        pool: &mut KvPool,
        rows: &[u8],
        pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError> {
        let b = self.shape.block_tokens() as usize;
        let id = *blocks.get(pos / b).ok_or(ModelError::NoBlock {
            pos,
            blocks: blocks.len(),
        })?;
        let slot = pos % b;
        let d = self.shape.dims;
        let row = d.n_kv_heads as usize * d.head_dim as usize * 2;
        let plane = row * b;
        let payload = pool.payload_mut(id)?;
        for (p, src) in rows.chunks_exact(row).enumerate() {
            let at = p * plane + slot * row;
            payload[at..at + row].copy_from_slice(src);
        }
        let (_, fill, _) = pool.info(id)?;
        pool.set_fill(id, fill.max(slot as u32 + 1))?;
        Ok(())
    }

    /// The logits after `n` positions: a PCG stream seeded by CRC-32C over every cached KV byte
    /// of positions `0..n` (block by block, plane by plane, the filled rows of each plane) and by
    /// `n`, one value per vocabulary entry, `u32 * 8 / 2^32`, in [0, 8). `read` gives a block's
    /// payload to a closure (under whatever lock the caller takes).
    fn logits_at(
        &self,
        read: impl Fn(BlockId, &mut dyn FnMut(&[u8])) -> Result<(), ModelError>,
        n: usize,
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        let b = self.shape.block_tokens() as usize;
        let row = self.shape.row_bytes().unwrap_or(0);
        let plane = row * b;
        if n.div_ceil(b) > blocks.len() {
            return Err(ModelError::NoBlock {
                pos: n - 1,
                blocks: blocks.len(),
            });
        }
        let mut crc = Crc32c::new();
        for (i, &id) in blocks.iter().enumerate().take(n.div_ceil(b)) {
            let rows = (n - i * b).min(b);
            read(id, &mut |payload: &[u8]| {
                for p in payload.chunks_exact(plane) {
                    crc.update(&p[..rows * row]);
                }
            })?;
        }
        let seed = u64::from(crc.finish()) << 32 | (n as u64 & 0xffff_ffff);
        let mut rng = Pcg32::new(seed, fnv1a64(b"fake-logits"));
        let scale = 8.0 / (1u64 << 32) as f64;
        Ok((0..self.vocab)
            .map(|_| (f64::from(rng.next_u32()) * scale) as f32)
            .collect())
    }
}

impl Model for FakeModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn shape(&self) -> Shape {
        self.shape
    }

    fn vocab(&self) -> u32 {
        self.vocab
    }

    fn max_context(&self) -> u32 {
        self.max_context
    }

    fn write(
        &self,
        pool: &mut KvPool,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError> {
        let mut rows = Vec::with_capacity(self.rows_len());
        for (i, &t) in tokens.iter().enumerate() {
            rows.clear();
            self.rows(t, first_pos + i, &mut rows)?;
            self.place(pool, &rows, first_pos + i, blocks)?;
        }
        Ok(())
    }

    fn write_shared(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError> {
        // The values are computed outside the lock, into a buffer the calling thread keeps (a
        // block's worth, allocated and faulted in once); under the lock, only the copy into
        // the slab.
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        SCRATCH.with_borrow_mut(|rows| {
            rows.clear();
            let per = self.rows_len();
            for (i, &t) in tokens.iter().enumerate() {
                self.rows(t, first_pos + i, rows)?;
            }
            let mut p = pool.lock();
            for (i, r) in rows.chunks_exact(per.max(1)).enumerate() {
                self.place(&mut p, r, first_pos + i, blocks)?;
            }
            Ok(())
        })
    }

    fn logits(&self, pool: &KvPool, n: usize, blocks: &[BlockId]) -> Result<Vec<f32>, ModelError> {
        let read = |id, f: &mut dyn FnMut(&[u8])| {
            f(pool.export(id)?.0);
            Ok(())
        };
        self.logits_at(read, n, blocks)
    }

    fn logits_shared(
        &self,
        pool: &SharedKv,
        n: usize,
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        // The lock for one block's CRC at a time (about 60 us for 2 MiB), not the whole pass.
        let read = |id, f: &mut dyn FnMut(&[u8])| {
            let p = pool.lock();
            f(p.export(id)?.0);
            Ok(())
        };
        self.logits_at(read, n, blocks)
    }
}

/// The byte-level tokenizer: one token per UTF-8 byte.
#[must_use]
pub fn encode_text(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Token ids back to text: bytes as UTF-8 (lossy); specials are dropped.
#[must_use]
pub fn decode_text(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .filter(|&&t| t < 256)
        .map(|&t| t as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
