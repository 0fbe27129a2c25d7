//! The gateway's text side when `[gateway] model_path` names the checkpoint the engines serve:
//! its tokenizer for text prompts, its chat template, its EOS ids as stop tokens (unless the
//! request sets `ignore_eos`), and its vocabulary and context for validation and `/v1/models`.

use std::path::Path;

use tl_engine_core::request::Limits;

/// A checkpoint's text side, loaded once at start.
#[derive(Debug)]
pub struct GatewayText {
    /// The tokenizer, template and EOS ids.
    pub text: tl_llama::Text,
    /// What the gateway validates against: the checkpoint's vocabulary and context.
    pub limits: Limits,
    /// The checkpoint's context length (`max_position_embeddings`), for `/v1/models`.
    pub max_model_len: u32,
    /// Its special tokens' names (ids 256 and up), for `skip_special_tokens: false`.
    pub render: crate::api::TextRender,
}

impl GatewayText {
    /// Loads `dir`'s `config.json` and text files.
    ///
    /// # Errors
    /// A checkpoint the loader refuses, or one whose tokenizer is not byte-level: the
    /// gateway's streamed text, stop strings and log-probability strings are decoded from byte
    /// ids, so another vocabulary would be rendered wrong; it is refused rather than served.
    pub fn load(dir: &str) -> Result<Self, String> {
        let path = Path::new(dir);
        let cfg_path = path.join("config.json");
        let raw = std::fs::read_to_string(&cfg_path)
            .map_err(|e| format!("gateway.model_path {dir}: {}: {e}", cfg_path.display()))?;
        let cfg = tl_llama::LlamaConfig::parse(&cfg_path.display().to_string(), &raw)
            .map_err(|e| format!("gateway.model_path {dir}: {e}"))?;
        let text =
            tl_llama::Text::load(path).map_err(|e| format!("gateway.model_path {dir}: {e}"))?;
        if !text.is_byte_level() {
            return Err(format!(
                "gateway.model_path {dir}: its tokenizer is not byte-level (ids 0..=255 the \
                 bytes); the gateway renders text from byte ids, so serving this vocabulary \
                 through it is not built yet"
            ));
        }
        let max_model_len = u32::try_from(cfg.max_positions).unwrap_or(u32::MAX);
        let vocab = u32::try_from(cfg.vocab).unwrap_or(u32::MAX);
        let render = crate::api::TextRender {
            specials: crate::api::Specials::Skipped,
            names: (256..vocab).map(|id| text.token_text(id)).collect(),
        };
        Ok(Self {
            render,
            text,
            limits: Limits {
                vocab: u32::try_from(cfg.vocab).unwrap_or(u32::MAX),
                max_context: None,
            },
            max_model_len,
        })
    }
}
