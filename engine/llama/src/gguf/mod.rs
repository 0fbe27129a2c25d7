//! GGUF checkpoints, as llama.cpp, Ollama and LM Studio publish small models for CPUs, one job a
//! file:
//!
//! | job | file |
//! |---|---|
//! | the header, the metadata and the tensor infos, every length, count, offset and size checked against the file before anything is read or allocated | [`file`] |
//! | the hyper-parameters of the `llama` and `qwen2` architectures, read from their keys into the same [`LlamaConfig`] a `config.json` gives | [`config`] |
//! | the tensors, copied at load into memory the file cannot take away: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 as they are (the kernels read them in place), Q4_K, Q5_K and Q6_K dequantized to f32 following ggml's block layouts | [`tensors`] |
//! | the tokenizer, rebuilt from `tokenizer.ggml.*` as a `tokenizers` tokenizer | [`tokenizer`] |
//!
//! This file holds what they share: the parsed file ([`Gguf`]) and its metadata ([`Meta`]).
//!
//! **RoPE order.** llama.cpp rotates the `llama` architecture's Q and K in adjacent pairs, so
//! its converter reorders each head's rows of `attn_q` and `attn_k` from Hugging Face's
//! half-split order (row `s * d/2 + j` of a head of width `d` becomes row `2j + s`). This loader
//! puts them back at load ([`tensors::unpermute_rows`]), so the forward pass is the one a
//! safetensors checkpoint runs. `qwen2` files are written in Hugging Face's order and are not
//! reordered.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;

use crate::config::{Architecture, CheckpointError, LlamaConfig};
use crate::kernels::DType;
use crate::weights::Weights;

mod config;
mod file;
mod tensors;
mod tokenizer;

use self::file::parse;
#[cfg(test)]
use self::tensors::unpermute_rows;
pub use self::tensors::{GgmlType, dequantize};
pub use self::tokenizer::{TextParts, Tokenizer, text_parts};

/// `GGUF` read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// Deepest nesting of metadata arrays taken.
const MAX_ARRAY_DEPTH: usize = 2;
/// Most dimensions a tensor may have (ggml's own bound).
const MAX_DIMS: usize = 4;
/// Longest metadata key or tensor name taken.
const MAX_NAME: usize = 1 << 16;
/// Most metadata keys taken (a real file has a few dozen).
const MAX_KEYS: usize = 1 << 16;
/// Most entries of an array read (tokens, their types and scores, merges): eight times the
/// largest vocabulary served today.
const MAX_TOKENIZER_ENTRIES: usize = 1 << 21;
/// The arrays this loader reads, with the value types each may hold; every other array is
/// walked and checked but not kept ([`Meta::Unread`]), so a file's metadata costs memory in
/// proportion to what is read, not to how many elements it declares.
const READ_ARRAYS: [(&str, &[u32]); 5] = [
    ("tokenizer.ggml.tokens", &[8]),
    ("tokenizer.ggml.merges", &[8]),
    ("tokenizer.ggml.token_type", &[0, 1, 2, 3, 4, 5, 10, 11]),
    // SentencePiece's scores: f32 or f64.
    ("tokenizer.ggml.scores", &[6, 12]),
    // Which of Gemma 3's layers are local: bools.
    ("gemma3.attention.sliding_window_pattern", &[7]),
];

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    /// Any unsigned integer type.
    U(u64),
    /// Any signed integer type.
    I(i64),
    /// f32 or f64.
    F(f64),
    /// A bool.
    Bool(bool),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Meta>),
    /// An array this loader does not read: walked and checked, not kept (`len` elements of
    /// value type `kind`).
    Unread {
        /// The value type of its elements.
        kind: u32,
        /// How many.
        len: usize,
    },
}

impl Meta {
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Meta::U(v) => Some(v),
            Meta::I(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match *self {
            Meta::F(v) => Some(v),
            Meta::U(v) => Some(v as f64),
            Meta::I(v) => Some(v as f64),
            _ => None,
        }
    }

    fn as_str(&self) -> Option<&str> {
        match self {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's info.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// Its dimensions, fastest first (ggml's `ne`): a matrix is `[cols, rows]`.
    pub dims: Vec<usize>,
    /// Its type.
    pub kind: GgmlType,
    /// Where its bytes start, from the start of the file.
    pub start: usize,
    /// How many bytes it takes.
    pub len: usize,
}

/// A parsed GGUF file, read into memory.
pub struct Gguf {
    map: Vec<u8>,
    path: String,
    /// Its metadata.
    pub meta: BTreeMap<String, Meta>,
    /// Its tensors, in file order.
    pub tensors: Vec<TensorInfo>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("keys", &self.meta.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn bad(path: &str, message: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Gguf {
        path: path.to_owned(),
        message: message.to_string(),
    }
}

/// Whether `path` is a GGUF file (by its first four bytes).
#[must_use]
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && u32::from_le_bytes(magic) == MAGIC
}

impl Gguf {
    /// Reads and parses `path`: header, metadata and tensor infos, each checked against the
    /// file. No tensor is converted.
    ///
    /// # Errors
    /// [`CheckpointError::Gguf`] naming the key or tensor, or the file's I/O error.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let p = path.display().to_string();
        // Read whole, not mapped: a file truncated while it is parsed or dequantized is an
        // I/O error or a bounds refusal, never a SIGBUS.
        let map = std::fs::read(path).map_err(|source| CheckpointError::Io {
            path: p.clone(),
            source,
        })?;
        let (meta, tensors) = parse(&map, &p)?;
        Ok(Self {
            map,
            path: p,
            meta,
            tensors,
        })
    }

    /// A tensor's bytes, as the file holds them.
    #[must_use]
    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.start + t.len]
    }

    fn get(&self, key: &str) -> Option<&Meta> {
        self.meta.get(key)
    }

    fn need_u(&self, key: &str) -> Result<usize, CheckpointError> {
        self.get(key)
            .and_then(Meta::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| {
                bad(
                    &self.path,
                    format!("{key}: missing, or not an unsigned integer"),
                )
            })
    }

    fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The architecture (`general.architecture`).
    ///
    /// # Errors
    /// A missing key.
    pub fn architecture(&self) -> Result<&str, CheckpointError> {
        self.get("general.architecture")
            .and_then(Meta::as_str)
            .ok_or_else(|| bad(&self.path, "general.architecture: missing"))
    }
}

#[cfg(test)]
mod tests {
    /// Every type's block as ggml's `ggml_type_traits` gives it (values, bytes).
    #[test]
    fn block_sizes_are_ggmls() {
        for (t, want) in [
            (GgmlType::F32, (1, 4)),
            (GgmlType::F16, (1, 2)),
            (GgmlType::Bf16, (1, 2)),
            (GgmlType::Q8_0, (32, 34)),
            (GgmlType::Q4_0, (32, 18)),
            (GgmlType::Q4_1, (32, 20)),
            (GgmlType::Q5_0, (32, 22)),
            (GgmlType::Q5_1, (32, 24)),
            (GgmlType::Q4K, (256, 144)),
            (GgmlType::Q5K, (256, 176)),
            (GgmlType::Q6K, (256, 210)),
        ] {
            assert_eq!(t.block(), want, "{}", t.name());
        }
    }

    use super::*;
    use half::f16;

    /// A GGUF file's bytes: `kv` metadata (already encoded), then `tensors` of (name, dims,
    /// type id, bytes).
    pub(crate) fn file(
        kv: &[(&str, Vec<u8>)],
        tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
    ) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        for (k, v) in kv {
            b.extend_from_slice(&(k.len() as u64).to_le_bytes());
            b.extend_from_slice(k.as_bytes());
            b.extend_from_slice(v);
        }
        let mut offset = 0u64;
        for (name, dims, ty, data) in tensors {
            b.extend_from_slice(&(name.len() as u64).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for (_, _, _, data) in tensors {
            b.extend_from_slice(data);
            while b.len() % 32 != 0 {
                b.push(0);
            }
        }
        b
    }

    fn u32v(v: u32) -> Vec<u8> {
        let mut b = 4u32.to_le_bytes().to_vec();
        b.extend_from_slice(&v.to_le_bytes());
        b
    }

    fn parse_bytes(b: &[u8]) -> Result<(BTreeMap<String, Meta>, Vec<TensorInfo>), String> {
        parse(b, "t.gguf").map_err(|e| e.to_string())
    }

    #[test]
    fn a_small_file_parses_and_hostile_ones_are_refused_by_name() {
        let data = vec![0u8; 4 * 64];
        let good = file(
            &[("llama.block_count", u32v(2))],
            &[("blk.0.attn_norm.weight", vec![64], 0, data.clone())],
        );
        let (meta, t) = parse_bytes(&good).unwrap();
        assert_eq!(meta["llama.block_count"], Meta::U(2));
        assert_eq!(t[0].dims, [64]);
        assert_eq!(t[0].len, 256);
        // Truncated anywhere: an error, never a panic.
        for cut in [0, 3, 10, 30, good.len() / 2, good.len() - 1] {
            let e = parse_bytes(&good[..cut]).unwrap_err();
            assert!(e.contains("t.gguf"), "{cut}: {e}");
        }
        let t = |b: Vec<u8>| parse_bytes(&b).unwrap_err();
        // A lying tensor count.
        let mut lie = good.clone();
        lie[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(t(lie).contains("tensor count"));
        // A lying string length in a key.
        let mut lie = good.clone();
        lie[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(t(lie).contains("metadata key 0"));
        // A huge array.
        let mut arr = 9u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&4u32.to_le_bytes());
        arr.extend_from_slice(&(1u64 << 50).to_le_bytes());
        let e = t(file(&[("tokenizer.ggml.tokens", arr)], &[]));
        assert!(e.contains("tokenizer.ggml.tokens"), "{e}");
        // A foreign type, named with the tensor.
        let e = t(file(&[], &[("w", vec![32], 10, vec![0; 84])]));
        assert!(e.contains("w") && e.contains("Q2_K"), "{e}");
        // Dimensions whose product overflows.
        let e = t(file(&[], &[("w", vec![1 << 40, 1 << 40], 0, vec![])]));
        assert!(e.contains("tensor w") && e.contains("overflow"), "{e}");
        // Data past the end.
        let e = t(file(&[], &[("w", vec![1 << 20], 0, vec![0; 64])]));
        assert!(e.contains("tensor w") && e.contains("past the file"), "{e}");
        // A row that is not whole blocks.
        let e = t(file(&[], &[("q", vec![33], 8, vec![0; 34])]));
        assert!(e.contains("tensor q") && e.contains("blocks"), "{e}");
        // Two tensors in the same bytes.
        let mut two = file(
            &[],
            &[
                ("a", vec![8], 0, vec![0; 32]),
                ("b", vec![8], 0, vec![0; 32]),
            ],
        );
        // b's offset (the last 8 bytes of its info) set to a's.
        let at = two.windows(1).len();
        let _ = at;
        let info_end = 24 + (8 + 1 + 4 + 8 + 4 + 8) * 2;
        two[info_end - 8..info_end].copy_from_slice(&0u64.to_le_bytes());
        let e = t(two);
        assert!(e.contains("overlap"), "{e}");
        // Not GGUF at all.
        assert!(t(b"PK\x03\x04 not a gguf file at all".to_vec()).contains("magic"));
    }

    #[test]
    fn rope_rows_go_back_to_half_split_order() {
        // One head of width 4, rows of one byte: llama.cpp's order is (0, 2, 1, 3) of HF's.
        let hf = [10u8, 11, 12, 13];
        let gguf = [10u8, 12, 11, 13];
        assert_eq!(unpermute_rows(&gguf, 4, 1), hf);
        // Two heads, rows of two bytes.
        let gguf2: Vec<u8> = [0u8, 0, 2, 2, 1, 1, 3, 3, 4, 4, 6, 6, 5, 5, 7, 7].to_vec();
        let want: Vec<u8> = (0..8u8).flat_map(|r| [r, r]).collect();
        assert_eq!(unpermute_rows(&gguf2, 4, 2), want);
    }

    #[test]
    fn q4_1_and_q8_0_follow_ggml() {
        // Q4_1: d = 0.5, m = -1; nibbles 0..16 low, 15..0 high.
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-1.0).to_bits().to_le_bytes());
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q4_1, &b, &mut y);
        assert_eq!(y[0], -1.0);
        assert_eq!(y[15], 6.5);
        assert_eq!(y[16], 6.5);
        assert_eq!(y[31], -1.0);
        let mut q = f16::from_f32(0.25).to_bits().to_le_bytes().to_vec();
        q.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q8_0, &q, &mut y);
        assert_eq!(y[0], -4.0);
        assert_eq!(y[31], 3.75);
    }
}
