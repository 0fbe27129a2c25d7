//! The gateway's text side when `[gateway] model_path` names the checkpoint the engines serve
//! (a Hugging Face directory or a GGUF file): its tokenizer for text prompts, its chat
//! template, its EOS ids as stop tokens (unless the request sets `ignore_eos`), what each of
//! its token ids stands for as text (streamed text, stop strings, log-probability strings), and
//! its vocabulary and context for validation and `/v1/models`.
//!
//! Templates and tokenizing are CPU work a request's body decides, so they never run on the
//! async workers: [`Prep`] runs them on the blocking pool, at most `prep_threads` at a time,
//! after the key's admission, and each template render is bounded in instructions and bytes,
//! and (in a render process of its own, [`super::sandbox`]) in memory and time.

use std::path::Path;
use std::sync::Arc;

use tl_engine_core::request::Limits;
use tl_engine_core::vocab::Vocab;

/// A checkpoint's text side, loaded once at start.
#[derive(Debug)]
pub struct GatewayText {
    /// The tokenizer, template and EOS ids.
    pub text: Arc<tl_llama::Text>,
    /// What each token id stands for.
    pub vocab: Arc<Vocab>,
    /// What the gateway validates against: the checkpoint's vocabulary and context.
    pub limits: Limits,
    /// The checkpoint's context length (`max_position_embeddings`), for `/v1/models`.
    pub max_model_len: u32,
    /// Where its template renders: in processes of their own, or (`None`) in this one.
    pub sandbox: Option<super::sandbox::Sandbox>,
    /// The checkpoint's fingerprint (its vocabulary and configuration), as its engines report
    /// theirs.
    pub fingerprint: String,
}

/// Why a checkpoint's text side cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("gateway.model_path {path}: {why}")]
pub struct TextLoadError {
    path: String,
    why: String,
}

impl GatewayText {
    /// Loads the configuration and text side of the checkpoint at `path`, its templates run
    /// within `bounds`.
    ///
    /// # Errors
    /// A checkpoint the loader refuses, naming the file, key or field.
    pub fn load(
        path: &str,
        bounds: tl_llama::text::RenderBounds,
        sandbox: Option<super::sandbox::SandboxLimits>,
    ) -> Result<Self, TextLoadError> {
        let err = |why: String| TextLoadError {
            path: path.to_owned(),
            why,
        };
        let p = Path::new(path);
        let cfg = tl_llama::config_of(p).map_err(|e| err(e.to_string()))?;
        let text = tl_llama::Text::load(p)
            .map_err(|e| err(e.to_string()))?
            .with_bounds(bounds);
        let vocab = Arc::new(text.vocab());
        let max_model_len = u32::try_from(cfg.max_positions).unwrap_or(u32::MAX);
        let sandbox = match (text.chat_template(), sandbox) {
            (Some(t), Some(limits)) => Some(super::sandbox::Sandbox::new(t, limits)),
            _ => None,
        };
        let fingerprint = tl_engine_core::model::fingerprint(&vocab, Some(&cfg.identity()));
        Ok(Self {
            fingerprint,
            sandbox,
            vocab,
            text: Arc::new(text),
            limits: Limits {
                vocab: u32::try_from(cfg.vocab).unwrap_or(u32::MAX),
                max_context: None,
            },
            max_model_len,
        })
    }
}

impl GatewayText {
    /// `messages` through the checkpoint's chat template, with a generation prompt: in a
    /// render process when there is a sandbox, in this one otherwise. Blocking.
    ///
    /// # Errors
    /// No template, one that fails on these messages, or one past a bound.
    pub fn render_chat(
        &self,
        messages: &[tl_llama::Message],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, tl_llama::TextError> {
        match &self.sandbox {
            Some(s) => s.render(messages, tools, true),
            None => self.text.render_chat_tools(messages, tools, true),
        }
    }
}
