//! Llama-family transformers for the engine, on the CPU.
//!
//! - [`config`]: `config.json`, validated; what is not computed is refused naming the field.
//! - [`weights`]: the safetensors of a checkpoint (one file or shards), read into memory.
//! - [`gguf`]: GGUF checkpoints: parsed and checked, dequantized at load, their tokenizer
//!   rebuilt from the metadata.
//! - [`kernels`]: batch-invariant f32 arithmetic over the weights as the checkpoint holds them
//!   ([`dtype`], [`quant`]): the written orders, the vector paths held to them, one thread pool.
//! - [`model`]: [`Llama`], a [`tl_engine_core::model::Model`] whose KV cache is the pool's
//!   blocks in kv.wire.v1's layout.
//! - [`init`]: checkpoints with seeded random weights, for tests and the demo.

pub mod config;
pub mod dtype;
pub mod gguf;
pub mod init;
pub mod kernels;
pub mod model;
pub mod quant;
pub mod spm;
pub mod text;
mod turns;
pub mod weights;
pub mod workers;

pub use config::{Architecture, CheckpointError, LlamaConfig};
pub use model::Llama;

use std::path::Path;

/// The configuration of the checkpoint at `path`: a directory's `config.json`, or a GGUF
/// file's metadata.
///
/// # Errors
/// As [`LlamaConfig::parse`] and [`gguf::Gguf::config`].
pub fn config_of(path: &Path) -> Result<LlamaConfig, CheckpointError> {
    if gguf::is_gguf(path) {
        return gguf_config(path);
    }
    let cpath = path.join("config.json");
    let text = std::fs::read_to_string(&cpath).map_err(|source| CheckpointError::Io {
        path: cpath.display().to_string(),
        source,
    })?;
    LlamaConfig::parse(&cpath.display().to_string(), &text)
}

/// A GGUF file's configuration, read once per file as it is on disk (its path, length and
/// modification time): the file is read whole to parse it, and callers ask for the
/// configuration often (every KV block shape is derived from it).
fn gguf_config(path: &Path) -> Result<LlamaConfig, CheckpointError> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock, PoisonError};
    type Key = (std::path::PathBuf, u64, Option<std::time::SystemTime>);
    static SEEN: OnceLock<Mutex<HashMap<Key, LlamaConfig>>> = OnceLock::new();
    let meta = std::fs::metadata(path).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let key = (path.to_path_buf(), meta.len(), meta.modified().ok());
    let seen = SEEN.get_or_init(Mutex::default);
    if let Some(c) = seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key)
    {
        return Ok(c.clone());
    }
    let c = gguf::Gguf::open(path)?.config()?;
    seen.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key, c.clone());
    Ok(c)
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
