//! The model interface and the deterministic fake model of `spec/fake-model.md`.

use std::fmt;

use kvwire::{Crc32c, Shape, f16, fnv1a64};

use crate::pool::{BlockId, PoolError, SharedKv};
use crate::rng::Pcg32;

pub use crate::vocab::{BOS, BYTE_VOCAB, EOS, PAD, UNK};

/// A text the model's tokenizer refused, with the tokenizer's reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TokenizeError(pub String);

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
    /// What each token id stands for as text: stop strings are matched on it. The fake
    /// model's byte vocabulary unless the model says otherwise.
    fn tokens(&self) -> std::sync::Arc<crate::vocab::Vocab> {
        crate::vocab::Vocab::bytes()
    }
    /// What decides the model's numbers besides its vocabulary (architecture, sizes,
    /// constants), for its [`fingerprint`]; `None`: nothing (the fake model).
    fn identity(&self) -> Option<String> {
        None
    }
    /// A text prompt's token ids, special tokens added as the model's tokenizer adds them:
    /// the fake model's bytes unless the model says otherwise.
    ///
    /// # Errors
    /// The tokenizer's refusal.
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(encode_text(text))
    }
    /// Writes the KV of `tokens` at positions `first_pos..first_pos + tokens.len()` into
    /// `blocks`, the sequence's block table, and raises the blocks' fills. An engine calls it
    /// block by block. A model computes outside every lock and writes each block through
    /// [`SharedKv::write`] (that block's lock only), then sets fills under the pool's lock, which
    /// it holds for bookkeeping only.
    ///
    /// # Errors
    /// A [`ModelError`] when the table or the pool cannot hold the positions.
    fn write(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError>;
    /// Blocks of a prompt written in one [`write`](Self::write) call while it is prefilled
    /// (each is named, and can stream, as soon as its call returns). One for a model whose
    /// cost is per token; more for one whose matrix products want many rows at once.
    fn prefill_chunk_blocks(&self) -> usize {
        1
    }
    /// The logits for the token after `tokens`, the sequence's first `n = tokens.len()`
    /// positions, whose KV is already in `blocks`: read through [`SharedKv::read`], one block's
    /// lock at a time and never the pool's, so a control call or an import never waits for a
    /// sequence's pass. The blocks of a running sequence change only on the engine thread
    /// (shared prefix blocks are full and immutable, the tail is this sequence's alone), so
    /// block-by-block reads see one consistent state. (A transformer runs the last position
    /// again over the cached KV; the fake model reads only the KV.)
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn logits(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError>;
    /// Writes the KV of `tokens[start..]` at positions `start..` (the KV of positions before
    /// `start` is already there, from cached prefix blocks) and returns the logits for the token
    /// after the last.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn prefill(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        start: usize,
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        self.write(pool, tokens.get(start..).unwrap_or_default(), start, blocks)?;
        self.logits(pool, tokens, blocks)
    }
    /// Writes the KV of the last of `tokens` at its position (`tokens.len() - 1`; the others'
    /// KV is in `blocks`) and returns the logits for the next position, in one pass where the
    /// model can.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn decode(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        let Some((&last, _)) = tokens.split_last() else {
            return Err(ModelError::NoBlock {
                pos: 0,
                blocks: blocks.len(),
            });
        };
        self.write(pool, &[last], tokens.len() - 1, blocks)?;
        self.logits(pool, tokens, blocks)
    }
    /// [`decode`](Self::decode) for every sequence of a step: each entry is a sequence's
    /// tokens and its block table. A model that batches runs them through each weight once;
    /// each sequence's logits are the same bits as it would get alone. The default decodes
    /// them one by one.
    ///
    /// # Errors
    /// As [`write`](Self::write); the step's sequences all fail with it.
    fn decode_batch(
        &self,
        pool: &SharedKv,
        seqs: &[(&[u32], &[BlockId])],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        seqs.iter()
            .map(|(tokens, blocks)| self.decode(pool, tokens, blocks))
            .collect()
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

    /// Copies the rows of positions `first_pos..` (`rows`, one position's rows after another)
    /// into their slots of the block table, one block's lock at a time, then raises the fills
    /// under the pool's lock.
    fn place(
        &self,
        pool: &SharedKv,
        rows: &[u8],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError> {
        let b = self.shape.block_tokens() as usize;
        let d = self.shape.dims;
        let row = d.n_kv_heads as usize * d.head_dim as usize * 2;
        let plane = row * b;
        let per = self.rows_len().max(1);
        let n = rows.len() / per;
        let table = |pos: usize| {
            blocks.get(pos / b).copied().ok_or(ModelError::NoBlock {
                pos,
                blocks: blocks.len(),
            })
        };
        // Check the whole range first: nothing is written when the table is short.
        if n > 0 {
            table(first_pos + n - 1)?;
        }
        let mut fills: Vec<(BlockId, u32)> = Vec::new();
        let mut at = 0;
        while at < n {
            let pos = first_pos + at;
            let id = table(pos)?;
            // The positions from `pos` that fall into its block.
            let k = (b - pos % b).min(n - at);
            let mut payload = pool.write(id)?;
            for j in 0..k {
                let slot = (pos + j) % b;
                let src = &rows[(at + j) * per..(at + j + 1) * per];
                for (p, r) in src.chunks_exact(row).enumerate() {
                    let to = p * plane + slot * row;
                    payload[to..to + row].copy_from_slice(r);
                }
            }
            drop(payload);
            fills.push((id, (pos % b + k) as u32));
            at += k;
        }
        let mut p = pool.lock();
        for (id, fill) in fills {
            let (_, old, _) = p.info(id)?;
            p.set_fill(id, old.max(fill))?;
        }
        Ok(())
    }

    /// The logits after `n` positions: a PCG stream seeded by CRC-32C over every cached KV byte
    /// of positions `0..n` (block by block, plane by plane, the filled rows of each plane) and by
    /// `n`, one value per vocabulary entry, `u32 * 8 / 2^32`, in [0, 8). `read` gives a block's
    /// payload to a closure.
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
        pool: &SharedKv,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError> {
        // The values are computed outside every lock, into a buffer the calling thread keeps
        // (a block's worth, allocated and faulted in once); then copied block by block.
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        SCRATCH.with_borrow_mut(|rows| {
            rows.clear();
            for (i, &t) in tokens.iter().enumerate() {
                self.rows(t, first_pos + i, rows)?;
            }
            self.place(pool, rows, first_pos, blocks)
        })
    }

    fn logits(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        // One block's lock at a time (about 60 us of CRC for 2 MiB), never the pool's.
        let read = |id, f: &mut dyn FnMut(&[u8])| {
            f(&pool.read(id)?);
            Ok(())
        };
        self.logits_at(read, tokens.len(), blocks)
    }
}

/// The byte-level tokenizer: one token per UTF-8 byte.
#[must_use]
pub fn encode_text(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Token ids back to text as they stream: the concatenation of everything [`push`](Self::push)
/// and [`finish`](Self::finish) return equals [`decode_text`] of all the tokens at once. Bytes
/// that do not yet form a complete UTF-8 character are held back and go out with the token that
/// completes them (a character split over two byte tokens is one character, not two
/// replacement characters); an invalid sequence becomes U+FFFD exactly where the whole-text
/// decoding puts one.
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    /// The text `tokens` complete, after what was held back.
    pub fn push(&mut self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens
            .iter()
            .filter(|&&t| t < 256)
            .map(|&t| t as u8)
            .collect();
        self.push_bytes(&bytes)
    }

    /// The text `bytes` complete, after what was held back: the same stream over any
    /// vocabulary's token bytes.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 (from_utf8 said so).
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            // An incomplete character at the end: wait for its next bytes.
                            self.pending.drain(..valid);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// What was held back, at the end of the stream (an incomplete character is U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
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

#[cfg(test)]
mod text_tests {
    use super::*;
    use crate::rng::stream;

    /// Streamed text equals whole text for every split: random byte streams (mostly high bytes,
    /// so multi-byte characters, invalid sequences and truncated ones all occur), valid UTF-8
    /// split inside characters, and specials in between.
    #[test]
    fn streamed_text_equals_whole_text() {
        let mut rng = stream(5, "text");
        let mut cases: Vec<Vec<u32>> = (0..2000)
            .map(|_| {
                let n = rng.next_u32() % 24;
                (0..n)
                    .map(|_| match rng.next_u32() % 8 {
                        0 => 256 + rng.next_u32() % 4, // a special: dropped
                        1..=3 => rng.next_u32() % 128,
                        _ => 0x80 + rng.next_u32() % 0x80,
                    })
                    .collect()
            })
            .collect();
        cases.push(encode_text("héllo wörld, Բարեւ, 日本語, 🦀!"));
        for tokens in &cases {
            let whole = decode_text(tokens);
            // One token at a time, and in pieces of every size.
            for piece in 1..=tokens.len().max(1) {
                let mut t = TextStream::default();
                let mut streamed: String = tokens.chunks(piece).map(|c| t.push(c)).collect();
                streamed.push_str(&t.finish());
                assert_eq!(streamed, whole, "{tokens:?} in pieces of {piece}");
            }
        }
        // A character split over two tokens goes out whole with the second.
        let mut t = TextStream::default();
        assert_eq!(t.push(&[0xD4]), "");
        assert_eq!(t.push(&[0xB2]), "Բ");
        // A lone continuation byte is one replacement character at once.
        assert_eq!(t.push(&[0x80]), "\u{FFFD}");
        // An incomplete character at the end is one replacement character.
        assert_eq!(t.push(&[0xE6, 0x97]), "");
        assert_eq!(t.finish(), "\u{FFFD}");
    }
}

/// A model's fingerprint as engines report it and the gateway checks it: `v` and 16 hex digits
/// of its vocabulary (every piece and whether it is special), or `vbytes` for a byte-level one
/// (ids 0 to 255 are the bytes 0 to 255, as the gateway's byte tokenizer writes them, whatever
/// specials follow), then `-c` and 16 hex digits of its [`Model::identity`], or `-c-` without
/// one. Two engines, or an engine and the gateway's text
/// side, serve the same model when their fingerprints agree (FNV-1a, 64 bits: it tells apart
/// configurations, it is no proof against a peer that lies).
#[must_use]
pub fn fingerprint(vocab: &crate::vocab::Vocab, identity: Option<&str>) -> String {
    fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }
    const SEED: u64 = 0xcbf2_9ce4_8422_2325;
    let byte_level = vocab.len() >= 256
        && (0..256u32).all(|i| vocab.piece(i) == [i as u8] && !vocab.is_special(i));
    let v = if byte_level {
        "vbytes".to_owned()
    } else {
        let mut v = fnv(SEED, &(vocab.len() as u64).to_le_bytes());
        for id in 0..vocab.len() as u32 {
            let piece = vocab.piece(id);
            v = fnv(v, &(piece.len() as u64).to_le_bytes());
            v = fnv(v, piece);
            v = fnv(v, &[u8::from(vocab.is_special(id))]);
        }
        format!("v{v:016x}")
    };
    match identity {
        Some(c) => format!("{v}-c{:016x}", fnv(SEED, c.as_bytes())),
        None => format!("{v}-c-"),
    }
}

/// Whether an engine of fingerprint `engine` serves what a gateway of fingerprint `gateway`
/// expects: the same vocabulary, and the same identity where both have one. An engine that
/// reports none (an older build) is not refused.
#[must_use]
pub fn same_model(gateway: &str, engine: &str) -> bool {
    if engine.is_empty() || gateway.is_empty() {
        return true;
    }
    let split = |f: &str| -> (String, String) {
        match f.split_once("-c") {
            Some((v, c)) => (v.to_owned(), c.to_owned()),
            None => (f.to_owned(), "-".to_owned()),
        }
    };
    let ((gv, gc), (ev, ec)) = (split(gateway), split(engine));
    gv == ev && (gc == "-" || ec == "-" || gc == ec)
}

#[cfg(test)]
mod fingerprint_tests {
    use super::*;
    use crate::vocab::Vocab;

    /// The vocabulary and the identity both count; an engine of the right vocabulary but
    /// another configuration is another model where the gateway knows its configuration; an
    /// engine that reports nothing is let through.
    #[test]
    fn fingerprints_tell_models_apart() {
        let bytes = Vocab::bytes();
        let other = Vocab::new((0..256u32).map(|b| (vec![b as u8, b as u8], false)));
        let g_bytes = fingerprint(&bytes, None);
        assert_eq!(g_bytes, fingerprint(&Vocab::bytes(), None), "stable");
        assert_ne!(g_bytes, fingerprint(&other, None));
        let a = fingerprint(&other, Some("llama hidden=576"));
        let b = fingerprint(&other, Some("llama hidden=960"));
        assert_ne!(a, b);
        assert!(same_model(&a, &a));
        assert!(!same_model(&a, &b), "two configurations of one tokenizer");
        assert!(
            !same_model(&g_bytes, &a),
            "the byte tokenizer before a trained model"
        );
        assert!(
            same_model(&fingerprint(&other, None), &a),
            "a gateway without a configuration"
        );
        assert!(same_model(&a, ""), "an engine that reports none");
        // A byte-level tokenizer with specials of its own is what the byte tokenizer writes.
        let byte_level = Vocab::new(
            (0..256u32)
                .map(|b| (vec![b as u8], false))
                .chain([(b"<eos>".to_vec(), true), (b"<bos>".to_vec(), true)]),
        );
        assert!(same_model(
            &g_bytes,
            &fingerprint(&byte_level, Some("tiny"))
        ));
        assert!(g_bytes.starts_with("vbytes"), "{g_bytes}");
    }
}
