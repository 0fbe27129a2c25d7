//! The tensors: the ggml types, each tensor copied out under its Hugging Face name (the types
//! the kernels read in place as they are, the K-quants dequantized to f32), and the Q and K rows
//! of a `llama` file put back in Hugging Face's order.

use super::*;
use crate::quant::{
    self, Block, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0,
};

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
    /// 32 values: an f16 scale, 32 fifth bits and 32 nibbles, offset by 16.
    Q5_0,
    /// 32 values: an f16 scale, an f16 minimum, 32 fifth bits and 32 nibbles.
    Q5_1,
    /// 256 values: f16 super-scale and super-minimum, 8 six-bit scales and minimums, nibbles.
    Q4K,
    /// As Q4_K with a fifth bit a value.
    Q5K,
    /// 256 values: 6 bits a value, 16 signed 8-bit scales, an f16 super-scale.
    Q6K,
}

/// A ggml type this loader does not read: its name and id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Unread {
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
    pub(super) fn of(id: u32) -> Result<Self, Unread> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            30 => Self::Bf16,
            8 => Self::Q8_0,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            other => {
                let name = match other {
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
            Self::Q5_0 => Some(DType::Q5_0),
            Self::Q5_1 => Some(DType::Q5_1),
            Self::Q4K | Self::Q5K | Self::Q6K => None,
        }
    }

    /// Values a block holds, and its bytes: an element type's, or its block type's
    /// ([`crate::quant`]).
    #[must_use]
    pub fn block(self) -> (usize, usize) {
        fn of<B: Block>() -> (usize, usize) {
            (B::VALUES, B::BYTES)
        }
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q8_0 => of::<BlockQ8_0>(),
            Self::Q4_0 => of::<BlockQ4_0>(),
            Self::Q4_1 => of::<BlockQ4_1>(),
            Self::Q5_0 => of::<BlockQ5_0>(),
            Self::Q5_1 => of::<BlockQ5_1>(),
            Self::Q4K => of::<BlockQ4K>(),
            Self::Q5K => of::<BlockQ5K>(),
            Self::Q6K => of::<BlockQ6K>(),
        }
    }

    /// Its name as ggml writes it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
            Self::Q8_0 => BlockQ8_0::NAME,
            Self::Q4_0 => BlockQ4_0::NAME,
            Self::Q4_1 => BlockQ4_1::NAME,
            Self::Q5_0 => BlockQ5_0::NAME,
            Self::Q5_1 => BlockQ5_1::NAME,
            Self::Q4K => BlockQ4K::NAME,
            Self::Q5K => BlockQ5K::NAME,
            Self::Q6K => BlockQ6K::NAME,
        }
    }
}

impl Gguf {
    /// Every tensor the model needs, under its Hugging Face name, copied out of the file (F32,
    /// F16, BF16, Q8_0, Q4_0 and Q4_1 as they are, the K-quants dequantized to f32), with the Q and
    /// K rows of a `llama` file put back in Hugging Face's order.
    ///
    /// # Errors
    /// A tensor of a type this loader does not read (named with it), or a shape that is not
    /// the configuration's.
    pub fn weights(&self, cfg: &LlamaConfig) -> Result<Weights, CheckpointError> {
        let arch = self.architecture()?;
        let llama = arch == "llama";
        let gemma = arch == "gemma3";
        let mut out = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let Some(name) = hf_name(&t.name, gemma) else {
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

/// The Hugging Face name of a GGUF tensor the model reads (`gemma`: of a Gemma 3 file, whose
/// four norms a layer have names of their own); `None` for one it does not.
pub(super) fn hf_name(gguf: &str, gemma: bool) -> Option<String> {
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
                "ffn_norm.weight" if gemma => "pre_feedforward_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "post_attention_norm.weight" if gemma => "post_attention_layernorm.weight",
                "post_ffw_norm.weight" if gemma => "post_feedforward_layernorm.weight",
                "attn_q_norm.weight" if gemma => "self_attn.q_norm.weight",
                "attn_k_norm.weight" if gemma => "self_attn.k_norm.weight",
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

/// `bytes` of type `kind` as f32 values into `out`: an element type widened, a block type
/// dequantized by its [`Block`].
///
/// # Panics
/// When `bytes` and `out` do not hold the same number of whole blocks.
pub fn dequantize(kind: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match kind {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            let (per, size) = kind.block();
            assert!(bytes.len().is_multiple_of(size), "whole blocks");
            assert_eq!(bytes.len() / size * per, out.len(), "whole blocks");
            if let Some(d) = kind.stored() {
                crate::dtype::widen(bytes, d, out);
            }
        }
        GgmlType::Q8_0 => quant::dequantize::<BlockQ8_0>(bytes, out),
        GgmlType::Q4_0 => quant::dequantize::<BlockQ4_0>(bytes, out),
        GgmlType::Q4_1 => quant::dequantize::<BlockQ4_1>(bytes, out),
        GgmlType::Q5_0 => quant::dequantize::<BlockQ5_0>(bytes, out),
        GgmlType::Q5_1 => quant::dequantize::<BlockQ5_1>(bytes, out),
        GgmlType::Q4K => quant::dequantize::<BlockQ4K>(bytes, out),
        GgmlType::Q5K => quant::dequantize::<BlockQ5K>(bytes, out),
        GgmlType::Q6K => quant::dequantize::<BlockQ6K>(bytes, out),
    }
}
