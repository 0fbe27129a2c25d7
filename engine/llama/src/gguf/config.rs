//! The configuration: the hyper-parameters of the `llama`, `qwen2` and `gemma3` architectures
//! read from their keys into the same [`LlamaConfig`] a `config.json` gives.

use super::*;

impl Gguf {
    /// The model's configuration from its metadata, as a `config.json` would give it, then
    /// validated by [`LlamaConfig::parse`].
    ///
    /// # Errors
    /// An architecture other than `llama`, `qwen2` and `gemma3`, a missing or unserved key,
    /// named.
    pub fn config(&self) -> Result<LlamaConfig, CheckpointError> {
        let arch = self.architecture()?;
        let hf = match arch {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "gemma3" => Architecture::Gemma3,
            other => {
                let family = if other.starts_with("gemma") {
                    " (of the Gemma family, gemma3 is)"
                } else {
                    ""
                };
                return Err(bad(
                    &self.path,
                    format!(
                        "general.architecture = {other:?}: served: llama, qwen2, gemma3{family}"
                    ),
                ));
            }
        };
        let gemma = hf == Architecture::Gemma3;
        let hf = hf.hf_name();
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
        let unserved: &[&str] = if gemma {
            &["rope.scaling.type", "rope.scaling.factor", "expert_count"]
        } else {
            &[
                "rope.scaling.type",
                "rope.scaling.factor",
                "attention.sliding_window",
                "expert_count",
            ]
        };
        for key in unserved
            .iter()
            .chain(&["attn_logit_softcapping", "final_logit_softcapping"])
        {
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
            if let Some(v) = self.get(&k("attention.value_length"))
                && v.as_u64() != d.as_u64()
            {
                return Err(bad(
                    &self.path,
                    format!(
                        "{} = {v:?}: a value width other than the key width ({d:?}) is not served",
                        k("attention.value_length")
                    ),
                ));
            }
        }
        if gemma {
            self.gemma_keys(&mut cfg)?;
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
        let c = LlamaConfig::parse_folded(&format!("{} (metadata)", self.path), &cfg.to_string())?;
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

    /// Gemma 3's figures, as llama.cpp reads this architecture: the window from
    /// `gemma3.attention.sliding_window`, a global layer every 6th (a per-layer pattern in the
    /// file must say the same), RoPE's local base 10,000, scores scaled by the head width, and
    /// GELU's tanh form.
    fn gemma_keys(&self, cfg: &mut serde_json::Value) -> Result<(), CheckpointError> {
        let window = self.need_u("gemma3.attention.sliding_window")?;
        let layers = self.need_u("gemma3.block_count")?;
        const EVERY: usize = 6;
        if let Some(p) = self.get("gemma3.attention.sliding_window_pattern") {
            let same = match p {
                Meta::Array(a) => a.len() == layers
                    && a.iter().enumerate().all(
                        |(l, v)| matches!(v, Meta::Bool(b) if *b != (l + 1).is_multiple_of(EVERY)),
                    ),
                other => other.as_u64() == Some(EVERY as u64),
            };
            if !same {
                return Err(bad(
                    &self.path,
                    format!(
                        "gemma3.attention.sliding_window_pattern = {p:?}: served: a global \
                         layer every {EVERY}th"
                    ),
                ));
            }
        }
        cfg["sliding_window"] = json!(window);
        cfg["sliding_window_pattern"] = json!(EVERY);
        cfg["rope_local_base_freq"] = json!(10_000.0);
        cfg["hidden_activation"] = json!("gelu_pytorch_tanh");
        // Scores scale by the head width, except on the 27B model (62 layers), whose
        // `query_pre_attn_scalar` is the width over the heads.
        let scalar = if layers == 62 {
            json!(
                self.need_u("gemma3.embedding_length")?
                    / self.need_u("gemma3.attention.head_count")?.max(1)
            )
        } else {
            cfg.get("head_dim")
                .cloned()
                .unwrap_or(serde_json::Value::Null)
        };
        if !scalar.is_null() {
            cfg["query_pre_attn_scalar"] = scalar;
        }
        Ok(())
    }
}
