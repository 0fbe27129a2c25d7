//! Command-line front ends that are plain functions, so tests can call them without a process.

use std::path::PathBuf;
use std::process::ExitCode;

use kvwire::{ErrorKind, Reader, Shape};

/// Arguments of `tl inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The envelope file.
    pub file: PathBuf,
    /// Refuse envelopes whose shape is not B,L,H,D (as a receiving pool would).
    #[arg(long, value_parser = parse_shape, value_name = "B,L,H,D")]
    pub shape: Option<Shape>,
}

/// Parses `B,L,H,D` into a v1 shape.
///
/// # Errors
/// When there are not four positive integers.
pub fn parse_shape(s: &str) -> Result<Shape, String> {
    let parts: Vec<u32> = s
        .split(',')
        .map(|p| p.trim().parse::<u32>().map_err(|e| format!("{p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    match parts[..] {
        [b, l, h, d] if b > 0 && l > 0 && h > 0 && d > 0 => Ok(Shape::v1(b, l, h, d)),
        _ => Err(format!(
            "expected four positive integers B,L,H,D, got {s:?}"
        )),
    }
}

/// The exit status `tl inspect` uses for a refusal of this kind.
#[must_use]
pub fn refusal_exit_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::Format => 3,
        ErrorKind::Version => 4,
        ErrorKind::Shape => 5,
        // A kind added later is still a refusal; treat it as corruption.
        _ => 3,
    }
}

/// Runs `tl inspect`: prints the header and one line per record, or one `refused:` line to stderr.
#[must_use]
pub fn inspect(args: &InspectArgs) -> ExitCode {
    let bytes = match std::fs::read(&args.file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {}: {e}", args.file.display());
            return ExitCode::from(2);
        }
    };
    let mut reader = Reader::new();
    if let Some(shape) = args.shape {
        reader = reader.expect_shape(shape);
    }
    match reader.read(&bytes) {
        Ok(env) => {
            let h = env.header();
            let s = env.shape();
            println!(
                "envelope {} bytes: version {} dtype {} ({}) n_blocks {} {} payload {} bytes crc32c {:#010x}",
                bytes.len(),
                h.version.get(),
                h.dtype.get(),
                s.format.name,
                env.n_blocks(),
                s.dims,
                env.payload_bytes(),
                env.crc()
            );
            for (i, r) in env.records().enumerate() {
                println!(
                    "record {i} hash {:016x} fill {} payload {} bytes",
                    r.hash,
                    r.n_tokens,
                    r.payload.len()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("refused: {}: {e}", e.kind());
            ExitCode::from(refusal_exit_code(e.kind()))
        }
    }
}

/// Arguments of `tl generate`.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Engine configuration (TOML); the defaults when omitted.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    pub prompt_tokens: Vec<u32>,
    /// Tokens to generate.
    #[arg(long)]
    pub max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Generator seed; the engine picks one (and prints it) when omitted.
    #[arg(long)]
    pub seed: Option<u64>,
}

/// A seed from the process's randomness, for requests that do not give one.
#[must_use]
pub fn pick_seed() -> u64 {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one(nanos)
}

/// Runs `tl generate`: one colocated generation, one JSON line `{"tokens":[...],"seed":S}`.
#[must_use]
pub fn generate(args: &GenerateArgs) -> ExitCode {
    use crate::config::Config;
    use crate::engine::{Engine, Mode, Request};
    use crate::sampler::{Sampling, SamplingRequest};

    let cfg = match Config::load_or_default(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let model = cfg.build_model();
    let req = SamplingRequest {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
    };
    let sampling = match Sampling::new(req, cfg.model.vocab) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let seed = args.seed.unwrap_or_else(pick_seed);
    let mut engine = Engine::new(model, cfg.build_pool());
    let req = Request {
        prompt: args.prompt_tokens.clone(),
        sampling,
        seed,
        max_tokens: args.max_tokens,
        mode: Mode::Generate,
    };
    match engine.generate(req) {
        Ok(tokens) => {
            // Keys in the documented order: tokens, then seed.
            let tokens = serde_json::to_string(&tokens).unwrap_or_default();
            println!("{{\"tokens\":{tokens},\"seed\":{seed}}}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
