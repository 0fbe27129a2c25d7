//! `tl model init`: a checkpoint directory with seeded random weights in a published layout.

use std::path::PathBuf;
use std::process::ExitCode;

use tl_engine_core::model::{BOS, BYTE_VOCAB, EOS};
use tl_llama::LlamaConfig;
use tl_llama::init::write_checkpoint;
use tl_llama::kernels::DType;

/// `tl model` commands.
#[derive(clap::Subcommand, Debug)]
pub(crate) enum ModelCmd {
    /// Write `config.json` and safetensors with seeded random weights; prints one JSON line.
    Init(InitArgs),
}

/// The shapes `tl model init` writes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShapeName {
    /// 2 layers, width 64, 4 query and 2 KV heads, the byte vocabulary (260).
    Tiny,
    /// SmolLM2-135M's shape: 30 layers, width 576, 9 query and 3 KV heads, 49,152 tokens.
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
}

/// Checkpoint dtypes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DtypeName {
    /// bfloat16, as most checkpoints are published.
    Bf16,
    /// binary16.
    F16,
    /// binary32.
    F32,
}

/// Arguments of `tl model init`.
#[derive(clap::Args, Debug)]
pub(crate) struct InitArgs {
    /// The directory to write (created).
    #[arg(long)]
    dir: PathBuf,
    /// The model's shape.
    #[arg(long, value_enum, default_value_t = ShapeName::Tiny)]
    shape: ShapeName,
    /// The weights' dtype.
    #[arg(long, value_enum, default_value_t = DtypeName::Bf16)]
    dtype: DtypeName,
    /// Safetensors files (more than 1: shards with model.safetensors.index.json).
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// The weights' seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// The tiny shape every demo and test uses.
#[must_use]
pub(crate) fn tiny() -> LlamaConfig {
    LlamaConfig::tiny(BYTE_VOCAB as usize)
}

/// Runs `tl model`.
#[must_use]
pub(crate) fn model(cmd: &ModelCmd) -> ExitCode {
    let ModelCmd::Init(a) = cmd;
    let shape = match a.shape {
        ShapeName::Tiny => tiny(),
        ShapeName::Smollm2_135m => LlamaConfig::smollm2_135m(),
    };
    let dtype = match a.dtype {
        DtypeName::Bf16 => DType::Bf16,
        DtypeName::F16 => DType::F16,
        DtypeName::F32 => DType::F32,
    };
    match write_checkpoint(&a.dir, &shape, dtype, a.seed, a.shards, EOS, BOS) {
        Ok(()) => {
            let params: usize = shape
                .tensors()
                .iter()
                .map(|(_, d)| d.iter().product::<usize>())
                .sum();
            println!(
                "{}",
                serde_json::json!({
                    "dir": a.dir.display().to_string(),
                    "shape": format!("{:?}", a.shape).to_lowercase(),
                    "dtype": format!("{:?}", a.dtype).to_lowercase(),
                    "parameters": params,
                    "shards": a.shards.max(1),
                })
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
