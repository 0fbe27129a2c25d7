//! `tl generate`: one colocated generation, one JSON line `{"tokens":[...],"seed":S}`.

use std::path::PathBuf;
use std::process::ExitCode;

use tl_engine::node::config::Config;
use tl_engine_core::engine::{Engine, Mode, Request};
use tl_engine_core::request::{Limits, Params, RequestError};
use tl_engine_core::rng::entropy_seed;
use tl_engine_core::sampler::SamplingRequest;

/// Arguments of `tl generate`.
#[derive(clap::Args, Debug)]
pub(crate) struct GenerateArgs {
    /// Engine configuration (TOML); the defaults when omitted.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    prompt_tokens: Vec<u32>,
    /// Tokens to generate.
    #[arg(long)]
    max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus mass in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Generator seed; the engine picks one (and prints it) when omitted.
    #[arg(long)]
    seed: Option<u64>,
    /// A checkpoint directory (`[model] path`), or `fake`.
    #[arg(long)]
    model: Option<String>,
}

/// Runs `tl generate`: one colocated generation, one JSON line `{"tokens":[...],"seed":S}`.
#[must_use]
pub(crate) fn generate(args: &GenerateArgs) -> ExitCode {
    let cfg = match Config::load_or_default(args.config.as_deref()).map(|mut c| {
        if let Some(m) = &args.model {
            crate::run::set_model(&mut c, m);
        }
        c
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let model = match cfg.build_model() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let params = Params {
        prompt: &args.prompt_tokens,
        max_tokens: args.max_tokens,
        sampling: SamplingRequest {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
        },
    };
    let sampling = match params.validate(Limits::of(model.as_ref())) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            // A bad flag is a usage error (2); a prompt the model refuses is a failed run (1).
            return ExitCode::from(match e {
                RequestError::Sampling(_) => 2,
                _ => 1,
            });
        }
    };
    let seed = args.seed.unwrap_or_else(entropy_seed);
    let mut engine = Engine::new(model, cfg.build_pool());
    let req = Request {
        prompt: args.prompt_tokens.clone(),
        sampling,
        seed,
        max_tokens: args.max_tokens,
        mode: Mode::Generate,
        draws_offset: 0,
        stop: tl_engine_core::stop::Stop::default(),
        choices: tl_engine_core::engine::Choices::ONE,
        scope: 0,
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
