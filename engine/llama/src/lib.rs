//! Llama-family transformers for the engine, on the CPU.
//!
//! - [`config`]: `config.json`, validated; what is not computed is refused naming the field.
//! - [`weights`]: the safetensors of a checkpoint (one file or shards), memory-mapped.
//! - [`kernels`]: batch-invariant f32 arithmetic over bf16, f16 or f32 weights.
//! - [`model`]: [`Llama`], a [`tl_engine_core::model::Model`] whose KV cache is the pool's
//!   blocks in kv.wire.v1's layout.
//! - [`init`]: checkpoints with seeded random weights, for tests and the demo.

pub mod config;
pub mod init;
pub mod kernels;
pub mod model;
pub mod text;
pub mod weights;

pub use config::{CheckpointError, LlamaConfig};
pub use model::Llama;
pub use text::{Message, Text, TextError};
