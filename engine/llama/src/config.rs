//! `config.json` of a Hugging Face checkpoint, as `LlamaForCausalLM` and the architectures that
//! share its layout publish it (Mistral, Qwen2 with attention biases, SmolLM), validated into
//! the figures the forward pass needs. Anything this engine does not compute is refused here,
//! naming the field, before a weight is read or a pool allocated.

use serde::Deserialize;

/// Why a checkpoint cannot be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A JSON file is malformed or lacks a field.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: String,
        /// serde's message (it names the field).
        message: String,
    },
    /// A field holds a value this engine does not compute.
    #[error("config.json: {field} = {value}: {why}")]
    Unsupported {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is supported.
        why: String,
    },
    /// A tensor the architecture needs is missing.
    #[error("missing tensor {0}")]
    MissingTensor(String),
    /// A tensor's shape is not the one the config implies.
    #[error("tensor {name} has shape {got:?}, but config.json implies {want:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// Its shape.
        got: Vec<usize>,
        /// The shape the config implies.
        want: Vec<usize>,
    },
    /// A tensor's dtype is not bf16, f16 or f32 (or differs within one matrix).
    #[error(
        "tensor {name} has dtype {dtype}: not served (safetensors: BF16, F16, F32; GGUF: those and Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)"
    )]
    Dtype {
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// A GGUF file is malformed, or holds what is not served (the key or tensor named).
    #[error("{path}: {message}")]
    Gguf {
        /// The file.
        path: String,
        /// What is wrong, naming the key or tensor.
        message: String,
    },
    /// A safetensors file is malformed.
    #[error("{path}: {message}")]
    Safetensors {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
}

/// RoPE's frequency scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rope {
    /// `inv_freq[i] = theta^(-2i / head_dim)`.
    Default,
    /// Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend
    /// between.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was trained at.
        original_max_position_embeddings: f64,
    },
}

/// The validated figures of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// The architecture named in `architectures`.
    pub architecture: Architecture,
    /// Model width.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA: `heads` is a multiple of it).
    pub kv_heads: usize,
    /// Per-head width (`head_dim`, else `hidden / heads`).
    pub head_dim: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RMSNorm's epsilon.
    pub rms_eps: f32,
    /// RoPE's base.
    pub rope_theta: f64,
    /// RoPE's scaling.
    pub rope: Rope,
    /// Longest sequence.
    pub max_positions: usize,
    /// The output projection is the embedding matrix.
    pub tied: bool,
    /// Q, K and V projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Token ids that end a sequence.
    pub eos: Vec<u32>,
    /// The token a text prompt starts with, if any.
    pub bos: Option<u32>,
    /// Gemma 3's layer, where the architecture is Gemma 3.
    pub gemma: Option<Gemma>,
}

/// What Gemma 3's layer is, beside Llama's: RMSNorm on each head of Q and K, a norm after the
/// attention and after the MLP as well as before them, GeGLU (GELU's tanh form) for SwiGLU, the
/// embedding scaled by the square root of the width, and local layers that attend to a window
/// of the latest positions, with RoPE of their own base, between global ones. Served from GGUF
/// files, whose converter folds the norms' `+1` into their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemma {
    /// The positions a local layer attends to, its own included.
    pub window: usize,
    /// Layer `l` is global when `(l + 1)` is a multiple of it (6: the 6th, 12th, ...), local
    /// otherwise.
    pub global_every: usize,
    /// RoPE's base on the local layers (`rope_theta` is the global layers').
    pub local_theta: f64,
    /// Attention scores are scaled by its inverse square root (`query_pre_attn_scalar`).
    pub query_scalar: f64,
}

impl LlamaConfig {
    /// What decides this model's numbers besides its vocabulary: the architecture and every
    /// size and constant of the forward pass, as one line (not the context length an engine
    /// may cut, nor the EOS ids). Engines and the gateway hash it into the model's fingerprint.
    #[must_use]
    pub fn identity(&self) -> String {
        let gemma = self.gemma.map_or(String::new(), |g| {
            format!(
                " window={} global_every={} local_theta={:#x} query_scalar={:#x}",
                g.window,
                g.global_every,
                g.local_theta.to_bits(),
                g.query_scalar.to_bits()
            )
        });
        format!(
            "{} hidden={} intermediate={} layers={} heads={} kv_heads={} head_dim={} vocab={} \
             rms_eps={:#x} rope_theta={:#x} rope={:?} tied={} qkv_bias={}{gemma}",
            self.architecture.hf_name(),
            self.hidden,
            self.intermediate,
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.vocab,
            self.rms_eps.to_bits(),
            self.rope_theta.to_bits(),
            self.rope,
            self.tied,
            self.qkv_bias
        )
    }
}

#[derive(Deserialize)]
struct Raw {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<serde_json::Value>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    hidden_activation: Option<String>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f64>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
}

/// The widest attention head taken (published models use 64 to 256).
pub const MAX_HEAD_DIM: usize = 1024;
/// The most weights one matrix may hold (2^34: 64 GiB of f32).
const MAX_MATRIX: usize = 1 << 34;

/// The architectures served: Llama's layout, and those that publish the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM`: Llama's layout.
    Mistral,
    /// `Qwen2ForCausalLM`: Llama's layout with Q, K and V biases.
    Qwen2,
    /// `Gemma3ForCausalLM`: Gemma 3's layer ([`Gemma`]).
    Gemma3,
}

impl Architecture {
    /// Every one served.
    pub const ALL: [Architecture; 4] = [Self::Llama, Self::Mistral, Self::Qwen2, Self::Gemma3];

    /// Its name in `config.json`'s `architectures`.
    #[must_use]
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// The architecture `config.json` names so, if it is served.
    #[must_use]
    pub fn from_hf(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.hf_name() == name)
    }
}

fn unsupported(field: &'static str, value: impl std::fmt::Display, why: &str) -> CheckpointError {
    CheckpointError::Unsupported {
        field,
        value: value.to_string(),
        why: why.to_owned(),
    }
}

fn ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|n| n as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// Gemma 3's figures: a window of 1 to 2^20 positions, a global layer every 1 to 64, RoPE's
/// local base (10,000 when not given) and `query_pre_attn_scalar` (`head_dim` when not given).
fn gemma_of(raw: &Raw) -> Result<Gemma, CheckpointError> {
    let window = raw
        .sliding_window
        .as_ref()
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| unsupported("sliding_window", "none", "Gemma 3 needs its window"))?;
    if window == 0 || window > 1 << 20 {
        return Err(unsupported("sliding_window", window, "must be 1 to 2^20"));
    }
    let every = raw.sliding_window_pattern.unwrap_or(6);
    if every == 0 || every > 64 {
        return Err(unsupported(
            "sliding_window_pattern",
            every,
            "must be 1 to 64",
        ));
    }
    let local_theta = raw.rope_local_base_freq.unwrap_or(10_000.0);
    if !(local_theta > 1.0 && local_theta.is_finite()) {
        return Err(unsupported(
            "rope_local_base_freq",
            local_theta,
            "must be above 1",
        ));
    }
    let head_dim = raw
        .head_dim
        .unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1));
    let query_scalar = raw.query_pre_attn_scalar.unwrap_or(head_dim as f64);
    if !(query_scalar > 0.0 && query_scalar.is_finite()) {
        return Err(unsupported(
            "query_pre_attn_scalar",
            query_scalar,
            "must be positive",
        ));
    }
    Ok(Gemma {
        window: window as usize,
        global_every: every,
        local_theta,
        query_scalar,
    })
}

/// RoPE's scaling from `rope_scaling`: none, `default`, or `llama3` with its four figures.
fn rope_of(scaling: Option<&serde_json::Value>) -> Result<Rope, CheckpointError> {
    Ok(match scaling {
        None | Some(serde_json::Value::Null) => Rope::Default,
        Some(v) => {
            let kind = v
                .get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(serde_json::Value::as_str)
                .unwrap_or("");
            let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
            match kind {
                "default" => Rope::Default,
                "llama3" => {
                    let (Some(factor), Some(low), Some(high), Some(orig)) = (
                        num("factor"),
                        num("low_freq_factor"),
                        num("high_freq_factor"),
                        num("original_max_position_embeddings"),
                    ) else {
                        return Err(unsupported(
                            "rope_scaling",
                            v,
                            "llama3 needs factor, low_freq_factor, high_freq_factor and \
                             original_max_position_embeddings",
                        ));
                    };
                    if factor <= 0.0 || low <= 0.0 || high <= low || orig <= 0.0 {
                        return Err(unsupported(
                            "rope_scaling",
                            v,
                            "llama3 needs positive figures with high_freq_factor > \
                             low_freq_factor",
                        ));
                    }
                    Rope::Llama3 {
                        factor,
                        low_freq_factor: low,
                        high_freq_factor: high,
                        original_max_position_embeddings: orig,
                    }
                }
                other => {
                    return Err(unsupported(
                        "rope_scaling.rope_type",
                        format!("{other:?}"),
                        "served: default, llama3",
                    ));
                }
            }
        }
    })
}

/// The attention's widths (heads, KV heads, head size), each bounded, with every matrix the
/// forward pass allocates.
fn dims_of(raw: &Raw) -> Result<(usize, usize, usize), CheckpointError> {
    let heads = raw.num_attention_heads;
    let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
    for (field, v) in [
        ("hidden_size", raw.hidden_size),
        ("intermediate_size", raw.intermediate_size),
        ("num_hidden_layers", raw.num_hidden_layers),
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("vocab_size", raw.vocab_size),
    ] {
        if v == 0 || v > 1 << 24 {
            return Err(unsupported(field, v, "must be 1 to 2^24"));
        }
    }
    if !heads.is_multiple_of(kv_heads) {
        return Err(unsupported(
            "num_key_value_heads",
            kv_heads,
            &format!("must divide num_attention_heads ({heads})"),
        ));
    }
    let head_dim = match raw.head_dim {
        Some(d) => d,
        None if raw.hidden_size.is_multiple_of(heads) => raw.hidden_size / heads,
        None => {
            return Err(unsupported(
                "num_attention_heads",
                heads,
                &format!(
                    "must divide hidden_size ({}) when head_dim is not given",
                    raw.hidden_size
                ),
            ));
        }
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
        return Err(unsupported(
            "head_dim",
            head_dim,
            &format!("must be even, 2 to {MAX_HEAD_DIM}"),
        ));
    }
    // Every width the forward pass allocates, bounded: Q's and K/V's rows, and the largest
    // matrices.
    for (field, v, what) in [
        (
            "num_attention_heads",
            heads.checked_mul(head_dim),
            "heads x head_dim",
        ),
        (
            "num_key_value_heads",
            kv_heads.checked_mul(head_dim),
            "kv heads x head_dim",
        ),
    ] {
        if v.is_none_or(|v| v > 1 << 20) {
            return Err(unsupported(
                field,
                format!("{heads} x {head_dim}"),
                &format!("{what} must be at most 2^20"),
            ));
        }
    }
    for (field, a, b) in [
        ("vocab_size", raw.vocab_size, raw.hidden_size),
        ("intermediate_size", raw.intermediate_size, raw.hidden_size),
    ] {
        if a.checked_mul(b).is_none_or(|v| v > MAX_MATRIX) {
            return Err(unsupported(
                field,
                a,
                &format!("{field} x hidden_size must be at most 2^34 weights"),
            ));
        }
    }
    Ok((heads, kv_heads, head_dim))
}

impl LlamaConfig {
    /// Parses and validates `config.json`'s text (`path` names it in errors).
    ///
    /// # Errors
    /// [`CheckpointError::Json`] for malformed JSON or a missing required field, and
    /// [`CheckpointError::Unsupported`] naming the first field this engine does not compute.
    pub fn parse(path: &str, text: &str) -> Result<Self, CheckpointError> {
        Self::parse_from(path, text, false)
    }

    /// As [`parse`](Self::parse), for a configuration a GGUF file's metadata gave, whose norms'
    /// weights hold Gemma's `+1` already.
    pub(crate) fn parse_folded(path: &str, text: &str) -> Result<Self, CheckpointError> {
        Self::parse_from(path, text, true)
    }

    fn parse_from(path: &str, text: &str, folded: bool) -> Result<Self, CheckpointError> {
        let raw: Raw = serde_json::from_str(text).map_err(|e| CheckpointError::Json {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let named = raw.architectures.as_ref().and_then(|a| a.first());
        let Some(arch) = named.and_then(|a| Architecture::from_hf(a)) else {
            let served: Vec<&str> = Architecture::ALL.iter().map(|a| a.hf_name()).collect();
            return Err(unsupported(
                "architectures",
                format!("{:?}", raw.architectures.unwrap_or_default()),
                &format!("served: {}", served.join(", ")),
            ));
        };
        let qwen2 = arch == Architecture::Qwen2 || raw.model_type.as_deref() == Some("qwen2");
        let gemma = if arch == Architecture::Gemma3 {
            if !folded {
                return Err(unsupported(
                    "architectures",
                    arch.hf_name(),
                    "Gemma 3 is served from GGUF files (whose converter folds the norms' +1 \
                     into their weights); its safetensors checkpoints are not yet",
                ));
            }
            Some(gemma_of(&raw)?)
        } else {
            None
        };
        for (field, v) in [
            ("attn_logit_softcapping", raw.attn_logit_softcapping),
            ("final_logit_softcapping", raw.final_logit_softcapping),
        ] {
            if let Some(v) = v.filter(|v| *v != 0.0) {
                return Err(unsupported(field, v, "logit softcapping is not served"));
            }
        }
        let (act_field, act, want) = if gemma.is_some() {
            (
                "hidden_activation",
                raw.hidden_activation.as_deref(),
                "gelu_pytorch_tanh",
            )
        } else {
            ("hidden_act", raw.hidden_act.as_deref(), "silu")
        };
        if let Some(act) = act
            && act != want
        {
            return Err(unsupported(
                act_field,
                act,
                &format!("only {want} is served for {}", arch.hf_name()),
            ));
        }
        if raw.mlp_bias == Some(true) {
            return Err(unsupported("mlp_bias", true, "MLP biases are not served"));
        }
        if raw.use_sliding_window == Some(true) {
            return Err(unsupported(
                "use_sliding_window",
                true,
                "sliding-window attention is not served",
            ));
        }
        let (heads, kv_heads, head_dim) = dims_of(&raw)?;
        let max_positions = raw.max_position_embeddings.unwrap_or(2048);
        // Mistral's sliding window only matters past it: the context is capped there.
        let window = raw
            .sliding_window
            .as_ref()
            .and_then(serde_json::Value::as_u64)
            .map(|w| w as usize);
        let max_positions = match window {
            Some(w) if w > 0 && w < max_positions && gemma.is_none() => w,
            _ => max_positions,
        };
        let rope = rope_of(raw.rope_scaling.as_ref())?;
        Ok(Self {
            architecture: arch,
            hidden: raw.hidden_size,
            intermediate: raw.intermediate_size,
            layers: raw.num_hidden_layers,
            heads,
            kv_heads,
            head_dim,
            vocab: raw.vocab_size,
            rms_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope,
            max_positions,
            tied: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: raw.attention_bias.unwrap_or(qwen2),
            eos: ids(raw.eos_token_id.as_ref()),
            bos: ids(raw.bos_token_id.as_ref()).first().copied(),
            gemma,
        })
    }

    /// The positions layer `l` attends to, its own included, when it is a local layer.
    #[must_use]
    pub fn window(&self, l: usize) -> Option<usize> {
        self.gemma
            .filter(|g| !(l + 1).is_multiple_of(g.global_every))
            .map(|g| g.window)
    }

    /// The scale of attention scores: `head_dim`'s inverse square root, or Gemma's
    /// `query_pre_attn_scalar`'s.
    #[must_use]
    pub fn attn_scale(&self) -> f32 {
        match self.gemma {
            Some(g) => 1.0 / (g.query_scalar as f32).sqrt(),
            None => 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    /// RoPE's inverse frequencies on the local layers, where the model has any.
    #[must_use]
    pub fn local_inv_freq(&self) -> Option<Vec<f64>> {
        let g = self.gemma?;
        let d = self.head_dim as f64;
        Some(
            (0..self.head_dim / 2)
                .map(|i| g.local_theta.powf(-(2.0 * i as f64) / d))
                .collect(),
        )
    }

    /// RoPE's inverse frequencies, one per pair of dimensions, with the scaling applied.
    #[must_use]
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let f = self.rope_theta.powf(-(2.0 * i as f64) / d);
                match self.rope {
                    Rope::Default => f,
                    Rope::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: orig,
                    } => {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < orig / high_freq_factor {
                            f
                        } else if wavelen > orig / low_freq_factor {
                            f / factor
                        } else {
                            let smooth = (orig / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "eos_token_id": [2, 3]
        })
    }

    fn parse(v: &serde_json::Value) -> Result<LlamaConfig, CheckpointError> {
        LlamaConfig::parse("config.json", &v.to_string())
    }

    #[test]
    fn a_llama_config_reads_with_its_defaults() {
        let c = parse(&base()).unwrap();
        assert_eq!((c.heads, c.kv_heads, c.head_dim), (4, 2, 16));
        assert_eq!(c.rope, Rope::Default);
        assert!(!c.tied && !c.qkv_bias);
        assert_eq!(c.eos, [2, 3]);
        let mut q = base();
        q["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        q["head_dim"] = serde_json::json!(32);
        let c = parse(&q).unwrap();
        assert!(c.qkv_bias, "Qwen2 has attention biases");
        assert_eq!(c.head_dim, 32);
    }

    #[test]
    fn what_is_not_served_is_refused_naming_the_field() {
        let cases: [(&str, serde_json::Value, &str); 11] = [
            // Sizes past every bound: refused by field, never a wrapped product or an abort.
            ("head_dim", serde_json::json!(1u64 << 40), "head_dim"),
            (
                "num_attention_heads",
                serde_json::json!(1 << 23),
                "num_attention_heads",
            ),
            ("hidden_size", serde_json::json!(1 << 24), "head_dim"),
            (
                "architectures",
                serde_json::json!(["GPT2LMHeadModel"]),
                "architectures",
            ),
            ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
            (
                "num_key_value_heads",
                serde_json::json!(3),
                "num_key_value_heads",
            ),
            ("mlp_bias", serde_json::json!(true), "mlp_bias"),
            (
                "use_sliding_window",
                serde_json::json!(true),
                "use_sliding_window",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
                "rope_scaling.rope_type",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "llama3"}),
                "rope_scaling",
            ),
            ("head_dim", serde_json::json!(7), "head_dim"),
        ];
        for (key, value, field) in cases {
            let mut v = base();
            v[key] = value;
            let e = parse(&v).unwrap_err();
            assert!(
                e.to_string()
                    .starts_with(&format!("config.json: {field} = ")),
                "{key}: {e}"
            );
        }
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("hidden_size"), "{e}");
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut v = base();
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64});
        v["rope_theta"] = serde_json::json!(500000.0);
        let scaled = parse(&v).unwrap().inv_freq();
        v["rope_scaling"] = serde_json::Value::Null;
        let plain = parse(&v).unwrap().inv_freq();
        assert_eq!(scaled[0], plain[0], "the highest frequency is kept");
        let last = plain.len() - 1;
        assert!(
            (scaled[last] - plain[last] / 8.0).abs() < 1e-15,
            "the lowest is divided"
        );
    }
}
