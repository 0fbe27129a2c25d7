//! GGUF checkpoints, as llama.cpp, Ollama and LM Studio publish small models for CPUs: the
//! header, the metadata and the tensor infos parsed with every length, count, offset and size
//! checked against the file before anything is read or allocated; the hyper-parameters of the
//! `llama` and `qwen2` architectures read from their keys into the same [`LlamaConfig`] a
//! `config.json` gives; the tensors copied at load into memory the file cannot take away, F32,
//! F16, BF16, Q8_0, Q4_0 and Q4_1 as they are (the kernels read them in place), Q4_K, Q5_K and
//! Q6_K dequantized to f32 following ggml's block layouts;
//! and the tokenizer rebuilt from `tokenizer.ggml.*` as a `tokenizers` tokenizer.
//!
//! **RoPE order.** llama.cpp rotates the `llama` architecture's Q and K in adjacent pairs, so
//! its converter reorders each head's rows of `attn_q` and `attn_k` from Hugging Face's
//! half-split order (row `s * d/2 + j` of a head of width `d` becomes row `2j + s`). This loader
//! puts them back at load ([`unpermute_rows`]), so the forward pass is the one a safetensors
//! checkpoint runs. `qwen2` files are written in Hugging Face's order and are not reordered.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use serde_json::json;

use crate::config::{CheckpointError, LlamaConfig};
use crate::kernels::DType;
use crate::weights::Weights;

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
/// Most entries of a tokenizer array taken (tokens, their types, merges): eight times the
/// largest vocabulary served today.
const MAX_TOKENIZER_ENTRIES: usize = 1 << 21;
/// The arrays this loader reads, with the value types each may hold; every other array is
/// walked and checked but not kept ([`Meta::Unread`]), so a file's metadata costs memory in
/// proportion to what is read, not to how many elements it declares.
const READ_ARRAYS: [(&str, &[u32]); 3] = [
    ("tokenizer.ggml.tokens", &[8]),
    ("tokenizer.ggml.merges", &[8]),
    ("tokenizer.ggml.token_type", &[0, 1, 2, 3, 4, 5, 10, 11]),
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

/// A tensor's ggml type, among those this loader reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 values: an f16 scale and 32 signed bytes.
    Q8_0,
    /// 32 values: an f16 scale and 32 nibbles, offset by 8.
    Q4_0,
    /// 32 values: an f16 scale, an f16 minimum and 32 nibbles.
    Q4_1,
    /// 256 values: f16 super-scale and super-minimum, 8 six-bit scales and minimums, nibbles.
    Q4K,
    /// As Q4_K with a fifth bit a value.
    Q5K,
    /// 256 values: 6 bits a value, 16 signed 8-bit scales, an f16 super-scale.
    Q6K,
}

/// A ggml type this loader does not read: its name and id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Unread {
    name: &'static str,
    id: u32,
}

impl std::fmt::Display for Unread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (ggml type {})", self.name, self.id)
    }
}

impl GgmlType {
    /// The type of ggml's id `id`, or the one this loader does not read.
    fn of(id: u32) -> Result<Self, Unread> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            30 => Self::Bf16,
            8 => Self::Q8_0,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            other => {
                let name = match other {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16..=23 | 29 => "an IQ type",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    39 => "MXFP4",
                    _ => "unknown",
                };
                return Err(Unread { name, id: other });
            }
        })
    }

    /// The weight type the kernels read this type's bytes as, in place; `None` for the
    /// K-quants, which are dequantized to f32 at load.
    #[must_use]
    pub fn stored(self) -> Option<DType> {
        match self {
            Self::F32 => Some(DType::F32),
            Self::F16 => Some(DType::F16),
            Self::Bf16 => Some(DType::Bf16),
            Self::Q8_0 => Some(DType::Q8_0),
            Self::Q4_0 => Some(DType::Q4_0),
            Self::Q4_1 => Some(DType::Q4_1),
            Self::Q4K | Self::Q5K | Self::Q6K => None,
        }
    }

    /// Values a block holds, and its bytes: the kernels' own figures for the types they read
    /// in place ([`DType`]), the K-quants' here.
    #[must_use]
    pub fn block(self) -> (usize, usize) {
        match (self.stored(), self) {
            (Some(d), _) => (d.block_values(), d.size()),
            (None, Self::Q5K) => (256, 176),
            (None, Self::Q6K) => (256, 210),
            // Q4_K.
            (None, _) => (256, 144),
        }
    }

    /// Its name as ggml writes it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
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

/// A cursor over the file that checks every read against what is left.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a str,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], CheckpointError> {
        if n > self.left() {
            return Err(bad(
                self.path,
                format!(
                    "{} needs {n} bytes at offset {} but the file has {} left (truncated?)",
                    what(),
                    self.at,
                    self.left()
                ),
            ));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, CheckpointError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, CheckpointError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of items of at least `min` bytes each, checked against what is left.
    fn count(&mut self, min: usize, what: &dyn Fn() -> String) -> Result<usize, CheckpointError> {
        let n = self.u64(what)?;
        match usize::try_from(n) {
            Ok(n) if n.checked_mul(min).is_some_and(|b| b <= self.left()) => Ok(n),
            _ => Err(bad(
                self.path,
                format!(
                    "{} says {n} items, more than the {} bytes left can hold",
                    what(),
                    self.left()
                ),
            )),
        }
    }

    fn string(&mut self, max: usize, what: &dyn Fn() -> String) -> Result<String, CheckpointError> {
        let n = self.count(1, what)?;
        if n > max {
            return Err(bad(
                self.path,
                format!("{} is {n} bytes long; at most {max}", what()),
            ));
        }
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| bad(self.path, format!("{} is not UTF-8", what())))
    }

    /// A top-level array under `key`: kept when it is one of [`READ_ARRAYS`] (of a value
    /// type it may hold, and at most [`MAX_TOKENIZER_ENTRIES`] long), else walked and checked
    /// without being kept.
    fn top_array(&mut self, key: &str, what: &dyn Fn() -> String) -> Result<Meta, CheckpointError> {
        let Some((_, kinds)) = READ_ARRAYS.iter().find(|(k, _)| *k == key) else {
            let at = self.at;
            let inner = self.u32(what)?;
            self.at = at;
            let before = self.at;
            self.skip(9, 0, what)?;
            debug_assert!(self.at > before);
            // The element count, read again from the bytes just checked.
            let len = u64::from_le_bytes(self.b[at + 4..at + 12].try_into().expect("8 bytes"));
            return Ok(Meta::Unread {
                kind: inner,
                len: usize::try_from(len).unwrap_or(usize::MAX),
            });
        };
        let at = self.at;
        let inner = self.u32(what)?;
        if !kinds.contains(&inner) {
            return Err(bad(
                self.path,
                format!(
                    "{} is an array of value type {inner}, not the type it holds",
                    what()
                ),
            ));
        }
        let n = self.u64(what)?;
        if n > MAX_TOKENIZER_ENTRIES as u64 {
            return Err(bad(
                self.path,
                format!(
                    "{} has {n} entries; at most {MAX_TOKENIZER_ENTRIES} are taken",
                    what()
                ),
            ));
        }
        self.at = at;
        self.value(9, 0, what)
    }

    /// An array's head at nesting `depth`: its value type and element count, the count checked
    /// against the bytes left at the least each element of that type takes.
    fn array_head(
        &mut self,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<(u32, usize), CheckpointError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(bad(
                self.path,
                format!("{} nests arrays deeper than {MAX_ARRAY_DEPTH}", what()),
            ));
        }
        let inner = self.u32(what)?;
        let min = match inner {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            other => {
                return Err(bad(
                    self.path,
                    format!("{} is an array of unknown type {other}", what()),
                ));
            }
        };
        Ok((inner, self.count(min, what)?))
    }

    /// Walks a value of type `kind` without keeping it: every length checked against the
    /// bytes left, as [`Self::value`] checks it, and nothing allocated.
    fn skip(
        &mut self,
        kind: u32,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<(), CheckpointError> {
        let fixed = match kind {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        if let Some(n) = fixed {
            if kind == 7 {
                let b = self.take(1, what)?[0];
                if b > 1 {
                    return Err(bad(self.path, format!("{} is a bool of {b}", what())));
                }
            } else {
                self.take(n, what)?;
            }
            return Ok(());
        }
        match kind {
            8 => {
                let n = self.count(1, what)?;
                self.take(n, what)?;
                Ok(())
            }
            9 => {
                let (inner, n) = self.array_head(depth, what)?;
                if inner != 7
                    && let Some(size) = match inner {
                        0 | 1 => Some(1),
                        2 | 3 => Some(2),
                        4..=6 => Some(4),
                        10..=12 => Some(8),
                        _ => None,
                    }
                {
                    // Elements of one fixed size: one bounds check for all.
                    self.take(n * size, what)?;
                    return Ok(());
                }
                for _ in 0..n {
                    self.skip(inner, depth + 1, what)?;
                }
                Ok(())
            }
            other => Err(bad(
                self.path,
                format!("{} has unknown value type {other}", what()),
            )),
        }
    }

    fn value(
        &mut self,
        kind: u32,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Meta, CheckpointError> {
        Ok(match kind {
            0 => Meta::U(u64::from(self.take(1, what)?[0])),
            1 => Meta::I(i64::from(self.take(1, what)?[0] as i8)),
            2 => {
                let b = self.take(2, what)?;
                Meta::U(u64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            3 => {
                let b = self.take(2, what)?;
                Meta::I(i64::from(i16::from_le_bytes([b[0], b[1]])))
            }
            4 => Meta::U(u64::from(self.u32(what)?)),
            5 => Meta::I(i64::from(self.u32(what)? as i32)),
            6 => Meta::F(f64::from(f32::from_bits(self.u32(what)?))),
            7 => match self.take(1, what)?[0] {
                0 => Meta::Bool(false),
                1 => Meta::Bool(true),
                b => return Err(bad(self.path, format!("{} is a bool of {b}", what()))),
            },
            8 => Meta::Str(self.string(usize::MAX, what)?),
            9 => {
                let (inner, n) = self.array_head(depth, what)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1, what)?);
                }
                Meta::Array(v)
            }
            10 => Meta::U(self.u64(what)?),
            11 => Meta::I(self.u64(what)? as i64),
            12 => Meta::F(f64::from_bits(self.u64(what)?)),
            other => {
                return Err(bad(
                    self.path,
                    format!("{} has unknown value type {other}", what()),
                ));
            }
        })
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

    /// The model's configuration from its metadata, as a `config.json` would give it, then
    /// validated by [`LlamaConfig::parse`].
    ///
    /// # Errors
    /// An architecture other than `llama` and `qwen2`, a missing or unserved key, named.
    pub fn config(&self) -> Result<LlamaConfig, CheckpointError> {
        let arch = self.architecture()?;
        let hf = match arch {
            "llama" => "LlamaForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            other => {
                return Err(bad(
                    &self.path,
                    format!("general.architecture = {other:?}: served: llama, qwen2"),
                ));
            }
        };
        let k = |s: &str| format!("{arch}.{s}");
        if let Some(v) = self.get(&k("attention.head_count_kv"))
            && matches!(v, Meta::Array(_) | Meta::Unread { .. })
        {
            return Err(bad(
                &self.path,
                format!(
                    "{}: per-layer head counts are not served",
                    k("attention.head_count_kv")
                ),
            ));
        }
        let heads = self.need_u(&k("attention.head_count"))?;
        let hidden = self.need_u(&k("embedding_length"))?;
        let kv_heads = match self.get(&k("attention.head_count_kv")) {
            Some(_) => self.need_u(&k("attention.head_count_kv"))?,
            None => heads,
        };
        let vocab = match self.get(&k("vocab_size")) {
            Some(_) => self.need_u(&k("vocab_size"))?,
            None => match self.get("tokenizer.ggml.tokens") {
                Some(Meta::Array(a)) => a.len(),
                _ => self
                    .tensor("token_embd.weight")
                    .and_then(|t| t.dims.get(1).copied())
                    .ok_or_else(|| bad(&self.path, "no vocabulary size"))?,
            },
        };
        for key in [
            "rope.scaling.type",
            "rope.scaling.factor",
            "attention.sliding_window",
            "expert_count",
        ] {
            if let Some(v) = self.get(&k(key)) {
                let none = matches!(v, Meta::Str(s) if s == "none")
                    || matches!(v, Meta::U(0) | Meta::I(0))
                    || matches!(v, Meta::F(f) if *f == 0.0 || *f == 1.0);
                if !none {
                    return Err(bad(&self.path, format!("{} = {v:?}: not served", k(key))));
                }
            }
        }
        if self.tensor("rope_freqs.weight").is_some() {
            return Err(bad(
                &self.path,
                "tensor rope_freqs.weight: per-frequency RoPE factors are not served",
            ));
        }
        let mut cfg = json!({
            "architectures": [hf],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": self.need_u(&k("feed_forward_length"))?,
            "num_hidden_layers": self.need_u(&k("block_count"))?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "vocab_size": vocab,
            "max_position_embeddings": self.need_u(&k("context_length"))?,
            "tie_word_embeddings": self.tensor("output.weight").is_none(),
            "attention_bias": self.tensor("blk.0.attn_q.bias").is_some(),
        });
        if let Some(d) = self.get(&k("attention.key_length")) {
            cfg["head_dim"] = json!(d.as_u64());
        }
        if let Some(e) = self
            .get(&k("attention.layer_norm_rms_epsilon"))
            .and_then(Meta::as_f64)
        {
            cfg["rms_norm_eps"] = json!(e);
        }
        if let Some(t) = self.get(&k("rope.freq_base")).and_then(Meta::as_f64) {
            cfg["rope_theta"] = json!(t);
        }
        if let Some(e) = self
            .get("tokenizer.ggml.eos_token_id")
            .and_then(Meta::as_u64)
        {
            cfg["eos_token_id"] = json!(e);
        }
        if let Some(b) = self
            .get("tokenizer.ggml.bos_token_id")
            .and_then(Meta::as_u64)
        {
            cfg["bos_token_id"] = json!(b);
        }
        let c = LlamaConfig::parse(&format!("{} (metadata)", self.path), &cfg.to_string())?;
        if let Some(Meta::U(rot)) = self.get(&k("rope.dimension_count"))
            && *rot as usize != c.head_dim
        {
            return Err(bad(
                &self.path,
                format!(
                    "{} = {rot}: partial rotary embeddings are not served (head width {})",
                    k("rope.dimension_count"),
                    c.head_dim
                ),
            ));
        }
        Ok(c)
    }

    /// Every tensor the model needs, under its Hugging Face name, copied out of the file (F32,
    /// F16, BF16, Q8_0, Q4_0 and Q4_1 as they are, the K-quants dequantized to f32), with the Q and
    /// K rows of a `llama` file put back in Hugging Face's order.
    ///
    /// # Errors
    /// A tensor of a type this loader does not read (named with it), or a shape that is not
    /// the configuration's.
    pub fn weights(&self, cfg: &LlamaConfig) -> Result<Weights, CheckpointError> {
        let llama = self.architecture()? == "llama";
        let mut out = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let Some(name) = hf_name(&t.name) else {
                continue;
            };
            let (rows, cols) = match t.dims[..] {
                [n] => (1, n),
                [c, r] => (r, c),
                _ => {
                    return Err(bad(
                        &self.path,
                        format!("tensor {}: {} dimensions", t.name, t.dims.len()),
                    ));
                }
            };
            let bytes = &self.map[t.start..t.start + t.len];
            // The types the kernels read in place stay as they are; the K-quants are widened.
            let (dtype, mut data) = match t.kind.stored() {
                Some(d) => (d, bytes.to_vec()),
                None => {
                    let mut v = vec![0f32; rows * cols];
                    dequantize(t.kind, bytes, &mut v);
                    (DType::F32, bytemuck::cast_slice(&v).to_vec())
                }
            };
            let heads = if t.name.ends_with("attn_q.weight") {
                Some(cfg.heads)
            } else if t.name.ends_with("attn_k.weight") {
                Some(cfg.kv_heads)
            } else {
                None
            };
            if llama && let Some(h) = heads {
                if rows != h * cfg.head_dim {
                    return Err(CheckpointError::Shape {
                        name: t.name.clone(),
                        got: vec![rows, cols],
                        want: vec![h * cfg.head_dim, cols],
                    });
                }
                data = unpermute_rows(&data, cfg.head_dim, dtype.row_bytes(cols));
            }
            let shape = if t.dims.len() == 1 {
                vec![cols]
            } else {
                vec![rows, cols]
            };
            out.push((name, dtype, shape, data));
        }
        Ok(Weights::owned(out))
    }
}

/// Rows of `data` (`row_bytes` each), in heads of `head_dim` rows, from llama.cpp's adjacent-
/// pair RoPE order back to Hugging Face's half-split one: row `2j + s` of a head goes to row
/// `s * head_dim / 2 + j`.
#[must_use]
pub fn unpermute_rows(data: &[u8], head_dim: usize, row_bytes: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len()];
    let half = head_dim / 2;
    let head_bytes = head_dim * row_bytes;
    for (h, (src, dst)) in data
        .chunks_exact(head_bytes)
        .zip(out.chunks_exact_mut(head_bytes))
        .enumerate()
    {
        let _ = h;
        for j in 0..half {
            for s in 0..2 {
                let from = (2 * j + s) * row_bytes;
                let to = (s * half + j) * row_bytes;
                dst[to..to + row_bytes].copy_from_slice(&src[from..from + row_bytes]);
            }
        }
    }
    out
}

/// The Hugging Face name of a GGUF tensor the model reads; `None` for one it does not.
fn hf_name(gguf: &str) -> Option<String> {
    Some(match gguf {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = gguf.strip_prefix("blk.")?;
            let (layer, part) = rest.split_once('.')?;
            let layer: usize = layer.parse().ok()?;
            let hf = match part {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "attn_q.bias" => "self_attn.q_proj.bias",
                "attn_k.bias" => "self_attn.k_proj.bias",
                "attn_v.bias" => "self_attn.v_proj.bias",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                _ => return None,
            };
            format!("model.layers.{layer}.{hf}")
        }
    })
}

#[allow(clippy::type_complexity)]
fn parse(
    b: &[u8],
    path: &str,
) -> Result<(BTreeMap<String, Meta>, Vec<TensorInfo>), CheckpointError> {
    let mut r = Reader { b, at: 0, path };
    let magic = r.u32(&|| "the magic".into())?;
    if magic != MAGIC {
        return Err(bad(path, "not a GGUF file (no GGUF magic)"));
    }
    let version = r.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(bad(path, format!("GGUF version {version}: served: 2, 3")));
    }
    // A tensor info takes at least 8 (name) + 4 + 8 + 4 + 8 bytes; a key-value 8 + 4 + 1.
    let n_tensors = r.count(32, &|| "the tensor count".into())?;
    let n_kv = r.count(13, &|| "the metadata count".into())?;
    if n_kv > MAX_KEYS {
        return Err(bad(
            path,
            format!("the metadata count is {n_kv}; at most {MAX_KEYS} keys are taken"),
        ));
    }
    let mut meta = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(MAX_NAME, &|| format!("metadata key {i}"))?;
        let what = || format!("metadata {key}");
        let kind = r.u32(&what)?;
        let v = if kind == 9 {
            r.top_array(&key, &what)?
        } else {
            r.value(kind, 0, &what)?
        };
        if meta.insert(key.clone(), v).is_some() {
            return Err(bad(path, format!("metadata {key} appears twice")));
        }
    }
    let align = match meta.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 16 => a as usize,
            _ => {
                return Err(bad(
                    path,
                    format!("general.alignment = {v:?}: must be a power of two up to 65536"),
                ));
            }
        },
    };
    let mut infos = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.string(MAX_NAME, &|| format!("tensor name {i}"))?;
        let what = || format!("tensor {name}");
        let nd = r.u32(&what)? as usize;
        if nd == 0 || nd > MAX_DIMS {
            return Err(bad(path, format!("tensor {name}: {nd} dimensions")));
        }
        let mut dims = Vec::with_capacity(nd);
        for _ in 0..nd {
            let d = r.u64(&what)?;
            dims.push(
                usize::try_from(d)
                    .map_err(|_| bad(path, format!("tensor {name}: dimension {d}")))?,
            );
        }
        let kind = GgmlType::of(r.u32(&what)?).map_err(|t| CheckpointError::Dtype {
            name: name.clone(),
            dtype: t.to_string(),
        })?;
        let offset = r.u64(&what)?;
        let count = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&c| c > 0)
            .ok_or_else(|| {
                bad(
                    path,
                    format!("tensor {name}: dimensions {dims:?} overflow or are zero"),
                )
            })?;
        let (per, bytes) = kind.block();
        if !dims[0].is_multiple_of(per) {
            return Err(bad(
                path,
                format!(
                    "tensor {name}: {} rows of {} values are not whole {} blocks of {per}",
                    count / dims[0],
                    dims[0],
                    kind.name()
                ),
            ));
        }
        let len = (count / per)
            .checked_mul(bytes)
            .ok_or_else(|| bad(path, format!("tensor {name}: size overflows")))?;
        let offset = usize::try_from(offset)
            .ok()
            .filter(|o| o.is_multiple_of(align))
            .ok_or_else(|| {
                bad(
                    path,
                    format!("tensor {name}: offset {offset} is not aligned to {align}"),
                )
            })?;
        infos.push((name, dims, kind, offset, len));
    }
    let data = r.at.div_ceil(align) * align;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(infos.len());
    for (name, dims, kind, offset, len) in infos {
        let start = data.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(len));
        let (Some(start), Some(end)) = (start, end) else {
            return Err(bad(path, format!("tensor {name}: offset overflows")));
        };
        if end > b.len() {
            return Err(bad(
                path,
                format!(
                    "tensor {name} lies at bytes {start}..{end}, past the file's {} (truncated?)",
                    b.len()
                ),
            ));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            kind,
            start,
            len,
        });
    }
    let mut spans: Vec<(usize, usize, &str)> = tensors
        .iter()
        .map(|t| (t.start, t.start + t.len, t.name.as_str()))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(bad(
                path,
                format!("tensors {} and {} overlap", w[0].2, w[1].2),
            ));
        }
    }
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(bad(path, format!("tensor {} appears twice", w[0])));
    }
    Ok((meta, tensors))
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Q4_K's and Q5_K's six-bit scale and minimum `j` (0..8) from their 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// `bytes` of quantized type `kind` as f32 values into `out`, block by block, as ggml's
/// reference dequantization computes them (each value's arithmetic in f32, in ggml's order).
///
/// # Panics
/// When `bytes` and `out` do not hold the same number of whole blocks.
pub fn dequantize(kind: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let (per, size) = kind.block();
    assert_eq!(bytes.len() / size * per, out.len(), "whole blocks");
    assert!(bytes.len().is_multiple_of(size), "whole blocks");
    for (b, y) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(per)) {
        match kind {
            GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            GgmlType::F16 => y[0] = h(b, 0),
            GgmlType::Bf16 => y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 => {
                if let Some(d) = kind.stored() {
                    crate::kernels::dequantize_block(d, b, y);
                }
            }
            GgmlType::Q4K => {
                let (d, dmin) = (h(b, 0), h(b, 2));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for c in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * c, scales);
                    let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
                    let (d1, m1) = (d * sc1, dmin * m1);
                    let (d2, m2) = (d * sc2, dmin * m2);
                    let q = &qs[32 * c..32 * c + 32];
                    let y = &mut y[64 * c..64 * c + 64];
                    for l in 0..32 {
                        y[l] = d1 * f32::from(q[l] & 0xF) - m1;
                        y[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
                    }
                }
            }
            GgmlType::Q5K => {
                let (d, dmin) = (h(b, 0), h(b, 2));
                let scales = &b[4..16];
                let qh = &b[16..48];
                let qs = &b[48..176];
                for c in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * c, scales);
                    let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
                    let (d1, m1) = (d * sc1, dmin * m1);
                    let (d2, m2) = (d * sc2, dmin * m2);
                    let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
                    let q = &qs[32 * c..32 * c + 32];
                    let y = &mut y[64 * c..64 * c + 64];
                    for l in 0..32 {
                        let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                        let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                        y[l] = d1 * f32::from((q[l] & 0xF) + hi1) - m1;
                        y[l + 32] = d2 * f32::from((q[l] >> 4) + hi2) - m2;
                    }
                }
            }
            GgmlType::Q6K => {
                let ql = &b[0..128];
                let qh = &b[128..192];
                let sc = &b[192..208];
                let d = h(b, 208);
                for n in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                    let y = &mut y[128 * n..128 * n + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = i32::from((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                        let q2 = i32::from((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        let s = |i: usize| f32::from(sc[i] as i8);
                        y[l] = d * s(is) * q1 as f32;
                        y[l + 32] = d * s(is + 2) * q2 as f32;
                        y[l + 64] = d * s(is + 4) * q3 as f32;
                        y[l + 96] = d * s(is + 6) * q4 as f32;
                    }
                }
            }
        }
    }
}

/// The tokenizer, template and EOS ids a GGUF file carries, as the pieces of a
/// [`crate::Text`]: `tokenizer.json` rebuilt from `tokenizer.ggml.*`, the chat template, the
/// BOS and EOS token strings, and the EOS ids (the file's, plus the template's end-of-turn
/// token).
///
/// # Errors
/// A tokenizer model other than `gpt2` (byte-level BPE), an unknown pre-tokenizer, or missing
/// keys, named.
pub fn text_parts(g: &Gguf) -> Result<TextParts, CheckpointError> {
    let path = &g.path;
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Meta::as_str)
        .ok_or_else(|| bad(path, "tokenizer.ggml.model: missing"))?;
    if model != "gpt2" {
        return Err(bad(
            path,
            format!(
                "tokenizer.ggml.model = {model:?}: served: \"gpt2\" (byte-level BPE); \
                 SentencePiece (\"llama\") vocabularies are not built yet"
            ),
        ));
    }
    let Some(Meta::Array(tokens)) = g.get("tokenizer.ggml.tokens") else {
        return Err(bad(path, "tokenizer.ggml.tokens: missing"));
    };
    let tokens: Vec<&str> = tokens.iter().map(|t| t.as_str().unwrap_or("")).collect();
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        Some(Meta::Array(a)) => a.iter().map(|t| t.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let merges: Vec<&str> = match g.get("tokenizer.ggml.merges") {
        Some(Meta::Array(a)) => a.iter().filter_map(Meta::as_str).collect(),
        _ => return Err(bad(path, "tokenizer.ggml.merges: missing")),
    };
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Meta::as_str)
        .unwrap_or("default");
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let pre_tokenizer = match pre {
        "default" | "gpt-2" | "gpt2" => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level(false)]}),
        "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level(false)]}),
        other => {
            return Err(bad(
                path,
                format!(
                    "tokenizer.ggml.pre = {other:?}: served: default, gpt-2, smollm, qwen2, \
                     llama-bpe"
                ),
            ));
        }
    };
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&t, &ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert(t.to_owned(), json!(id));
        // 3: control (special), 4: user-defined (added, not special).
        if ty == 3 || ty == 4 {
            added.push(
                json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == 3}),
            );
        }
    }
    let id_of = |key: &str| g.get(key).and_then(Meta::as_u64).map(|v| v as u32);
    let name = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| (*s).to_owned())
    };
    let bos_id = id_of("tokenizer.ggml.bos_token_id");
    let add_bos = matches!(
        g.get("tokenizer.ggml.add_bos_token"),
        Some(Meta::Bool(true))
    );
    let post = match (add_bos, name(bos_id)) {
        (true, Some(bos)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos.clone(): {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }),
        _ => byte_level(false),
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let template = g
        .get("tokenizer.chat_template")
        .and_then(Meta::as_str)
        .map(str::to_owned);
    let eos_id = id_of("tokenizer.ggml.eos_token_id");
    let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
    // The template's end of turn ends a completion too.
    if let Some(t) = &template {
        let controls = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, ty))| **ty == 3)
            .map(|(id, (tok, _))| (id as u32, (*tok).to_owned()));
        for id in crate::turns::end_of_turn(t, controls) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
    }
    Ok(TextParts {
        tokenizer: tokenizer.to_string(),
        template,
        bos: name(bos_id),
        eos: name(eos_id),
        eos_ids,
    })
}

/// What [`text_parts`] gives.
#[derive(Debug)]
pub struct TextParts {
    /// A `tokenizer.json`.
    pub tokenizer: String,
    /// The chat template.
    pub template: Option<String>,
    /// The BOS token's text.
    pub bos: Option<String>,
    /// The EOS token's text.
    pub eos: Option<String>,
    /// Ids that end a sequence.
    pub eos_ids: Vec<u32>,
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
            (GgmlType::Q4K, (256, 144)),
            (GgmlType::Q5K, (256, 176)),
            (GgmlType::Q6K, (256, 210)),
        ] {
            assert_eq!(t.block(), want, "{}", t.name());
        }
    }

    use super::*;

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
