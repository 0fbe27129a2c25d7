//! Writes a checkpoint directory with seeded random weights in the formats a published one uses
//! (`config.json`, `model.safetensors` or shards with `model.safetensors.index.json`), so the
//! engine, its tests and `tl demo` run a real transformer with nothing downloaded.

use std::path::Path;

use tl_engine_core::rng::Pcg32;

use crate::config::{Architecture, CheckpointError, LlamaConfig, Rope};
use crate::kernels::DType;

/// The shapes of checkpoints this module makes, as the validated configuration they load as.
impl LlamaConfig {
    /// A model small enough for every test: 2 layers, width 64, 4 query and 2 KV heads.
    #[must_use]
    pub fn tiny(vocab: usize) -> Self {
        Self {
            architecture: Architecture::Llama,
            hidden: 64,
            intermediate: 160,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab,
            tied: false,
            qkv_bias: false,
            rope_theta: 10_000.0,
            max_positions: 2048,
            rope: Rope::Default,
            rms_eps: 1e-5,
            eos: Vec::new(),
            bos: None,
            gemma: None,
        }
    }

    /// SmolLM2-135M's published shape (30 layers, width 576, 9 query and 3 KV heads, tied).
    #[must_use]
    pub fn smollm2_135m() -> Self {
        Self {
            architecture: Architecture::Llama,
            hidden: 576,
            intermediate: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49_152,
            tied: true,
            qkv_bias: false,
            rope_theta: 100_000.0,
            max_positions: 8192,
            rope: Rope::Default,
            rms_eps: 1e-5,
            eos: Vec::new(),
            bos: None,
            gemma: None,
        }
    }

    /// `config.json`'s text for this shape.
    #[must_use]
    pub fn config_json(&self, eos: u32, bos: u32) -> String {
        let arch = if self.qkv_bias {
            Architecture::Qwen2
        } else {
            Architecture::Llama
        }
        .hf_name();
        let mut v = serde_json::json!({
            "architectures": [arch],
            "model_type": if self.qkv_bias { "qwen2" } else { "llama" },
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tied,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        });
        if let Rope::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = self.rope
        {
            v["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            });
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// Every tensor's name and shape, in the order a checkpoint lists them.
    #[must_use]
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (self.hidden, self.intermediate);
        let (qd, kvd) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let mut t = vec![("model.embed_tokens.weight".to_owned(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            t.push((p("input_layernorm.weight"), vec![h]));
            t.push((p("self_attn.q_proj.weight"), vec![qd, h]));
            t.push((p("self_attn.k_proj.weight"), vec![kvd, h]));
            t.push((p("self_attn.v_proj.weight"), vec![kvd, h]));
            if self.qkv_bias {
                t.push((p("self_attn.q_proj.bias"), vec![qd]));
                t.push((p("self_attn.k_proj.bias"), vec![kvd]));
                t.push((p("self_attn.v_proj.bias"), vec![kvd]));
            }
            t.push((p("self_attn.o_proj.weight"), vec![h, qd]));
            t.push((p("post_attention_layernorm.weight"), vec![h]));
            t.push((p("mlp.gate_proj.weight"), vec![i, h]));
            t.push((p("mlp.up_proj.weight"), vec![i, h]));
            t.push((p("mlp.down_proj.weight"), vec![h, i]));
        }
        t.push(("model.norm.weight".to_owned(), vec![h]));
        if !self.tied {
            t.push(("lm_head.weight".to_owned(), vec![self.vocab, h]));
        }
        t
    }
}

/// Seeded values for tensor `name`: norms near 1, everything else uniform with standard
/// deviation about 0.02 (biases 0.02 too), each tensor its own stream.
fn values(name: &str, n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Pcg32::new(seed, kvwire::fnv1a64(name.as_bytes()));
    let unit = |rng: &mut Pcg32| f64::from(rng.next_u32()) / f64::from(u32::MAX) * 2.0 - 1.0;
    if name.ends_with("layernorm.weight") || name == "model.norm.weight" {
        (0..n)
            .map(|_| (1.0 + 0.1 * unit(&mut rng)) as f32)
            .collect()
    } else {
        // Uniform on [-a, a] has standard deviation a / sqrt(3).
        let a = 0.02 * 3f64.sqrt();
        (0..n).map(|_| (a * unit(&mut rng)) as f32).collect()
    }
}

fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        DType::Bf16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        // Refused by `write_checkpoint` before anything is encoded.
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => Vec::new(),
    }
}

/// The byte-level vocabulary's special tokens, from id 256: BOS, EOS (end of turn), PAD, UNK,
/// named as SmolLM2 names its first two.
pub const BYTE_SPECIALS: [&str; 4] = ["<|im_start|>", "<|im_end|>", "<|pad|>", "<|unk|>"];

/// Writes a checkpoint of `shape` into `dir` (created): weights seeded by `seed` in `dtype`,
/// in `shards` files (1: `model.safetensors`; more: `model-0000i-of-0000n.safetensors` with an
/// index), `config.json` naming `eos` and `bos`, and the byte-level tokenizer files of
/// [`crate::text::byte_level_files`] (`tokenizer.json`, `tokenizer_config.json` with a chat
/// template, `generation_config.json`).
///
/// # Errors
/// When a file cannot be written.
pub fn write_checkpoint(
    dir: &Path,
    shape: &LlamaConfig,
    dtype: DType,
    seed: u64,
    shards: usize,
    eos: u32,
    bos: u32,
) -> Result<(), CheckpointError> {
    let io = |path: &Path, source: std::io::Error| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let cpath = dir.join("config.json");
    std::fs::write(&cpath, shape.config_json(eos, bos)).map_err(|e| io(&cpath, e))?;
    let (tokenizer, tokenizer_config, generation) =
        crate::text::byte_level_files(&BYTE_SPECIALS, bos, eos);
    for (name, body) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, body).map_err(|e| io(&path, e))?;
    }
    let st_dtype = match dtype {
        DType::Bf16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::F32 => safetensors::Dtype::F32,
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
            return Err(CheckpointError::Unsupported {
                field: "dtype",
                value: format!("{dtype:?}"),
                why: "safetensors holds element types only".into(),
            });
        }
    };
    let tensors = shape.tensors();
    let shards = shards.clamp(1, tensors.len());
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (s, chunk) in tensors.chunks(per).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_owned()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, shards)
        };
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|(name, dims)| {
                let n = dims.iter().product();
                (
                    name.clone(),
                    dims.clone(),
                    encode(&values(name, n, seed), dtype),
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(name, dims, bytes)| {
                let view = safetensors::tensor::TensorView::new(st_dtype, dims.clone(), bytes)
                    .map_err(|e| CheckpointError::Safetensors {
                        path: file.clone(),
                        message: format!("{e:?}"),
                    })?;
                Ok((name.clone(), view))
            })
            .collect::<Result<_, CheckpointError>>()?;
        let path = dir.join(&file);
        let bytes =
            safetensors::serialize(views, None).map_err(|e| CheckpointError::Safetensors {
                path: path.display().to_string(),
                message: format!("{e:?}"),
            })?;
        std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
        for (name, _, _) in &data {
            weight_map.insert(name.clone(), serde_json::Value::String(file.clone()));
        }
    }
    if shards > 1 {
        let ipath = dir.join("model.safetensors.index.json");
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        std::fs::write(&ipath, index.to_string()).map_err(|e| io(&ipath, e))?;
    }
    Ok(())
}
