//! Llama-family transformers for the engine, on the CPU.
//!
//! - [`config`]: `config.json`, validated; what is not computed is refused naming the field.
//! - [`weights`]: the safetensors of a checkpoint (one file or shards), read into memory.
//! - [`gguf`]: GGUF checkpoints: parsed and checked, dequantized at load, their tokenizer
//!   rebuilt from the metadata.
//! - [`kernels`]: batch-invariant f32 arithmetic over bf16, f16 or f32 weights.
//! - [`model`]: [`Llama`], a [`tl_engine_core::model::Model`] whose KV cache is the pool's
//!   blocks in kv.wire.v1's layout.
//! - [`init`]: checkpoints with seeded random weights, for tests and the demo.

pub mod config;
pub mod gguf;
pub mod init;
pub mod kernels;
pub mod model;
pub mod text;
pub mod weights;

pub use config::{CheckpointError, LlamaConfig};
pub use model::Llama;

use std::path::Path;

/// The configuration of the checkpoint at `path`: a directory's `config.json`, or a GGUF
/// file's metadata.
///
/// # Errors
/// As [`LlamaConfig::parse`] and [`gguf::Gguf::config`].
pub fn config_of(path: &Path) -> Result<LlamaConfig, CheckpointError> {
    if gguf::is_gguf(path) {
        return gguf::Gguf::open(path)?.config();
    }
    let cpath = path.join("config.json");
    let text = std::fs::read_to_string(&cpath).map_err(|source| CheckpointError::Io {
        path: cpath.display().to_string(),
        source,
    })?;
    LlamaConfig::parse(&cpath.display().to_string(), &text)
}

/// The name a checkpoint is served under by default: a directory's name, or a GGUF file's
/// without `.gguf`.
#[must_use]
pub fn default_name(path: &Path) -> String {
    let base = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    base.strip_suffix(".gguf")
        .map(str::to_owned)
        .unwrap_or(base)
}
pub use text::{Message, Text, TextError};
