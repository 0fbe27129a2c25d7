//! `tl generate`: one colocated generation, one JSON line `{"tokens":[...],"text":"...","seed":S}`.

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
    #[arg(long, value_delimiter = ',', num_args = 1.., required_unless_present = "prompt", conflicts_with = "prompt")]
    prompt_tokens: Vec<u32>,
    /// Prompt text, tokenized by the checkpoint's tokenizer as `transformers` does
    /// (`add_special_tokens=True`); the fake model's bytes otherwise.
    #[arg(long)]
    prompt: Option<String>,
    /// Send `--prompt` as one user message through the checkpoint's chat template, with the
    /// generation prompt.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// Go on past the checkpoint's end-of-sequence tokens (else generation stops at one).
    #[arg(long)]
    ignore_eos: bool,
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
    /// A checkpoint (`[model] path`): a GGUF file, a Hugging Face directory, or `fake`.
    #[arg(long)]
    model: Option<String>,
}

/// Runs `tl generate`: one colocated generation, one JSON line `{"tokens":[...],"seed":S}`.
#[must_use]
pub(crate) fn generate(args: &GenerateArgs) -> ExitCode {
    let cfg = match Config::load_or_default(args.config.as_deref()).map(|mut c| {
        if let Some(m) = &args.model {
            c.set_model(m);
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
    // The checkpoint's tokenizer, when the model is one; the byte ids of the fake model.
    let text = if cfg.model.path.is_empty() {
        None
    } else {
        match tl_llama::Text::load(std::path::Path::new(&cfg.model.path)) {
            Ok(t) => Some(t),
            Err(e) if args.prompt.is_some() => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
            Err(_) => None,
        }
    };
    let prompt: Vec<u32> = match (&args.prompt, &text) {
        (None, _) => args.prompt_tokens.clone(),
        (Some(p), Some(t)) => {
            let rendered = if args.chat {
                let m = [tl_llama::Message {
                    role: "user".into(),
                    content: p.clone(),
                }];
                // The template writes its own special tokens: none are added again.
                t.render_chat(&m, true).and_then(|r| t.encode(&r, false))
            } else {
                t.encode(p, true)
            };
            match rendered {
                Ok(ids) => ids,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        (Some(_), None) if args.chat => {
            eprintln!("error: --chat needs a checkpoint with a chat template (--model DIR)");
            return ExitCode::from(2);
        }
        (Some(p), None) => tl_engine_core::model::encode_text(p),
    };
    let stop = tl_engine_core::stop::Stop {
        sequences: Vec::new(),
        token_ids: match &text {
            Some(t) if !args.ignore_eos => t.eos_ids().to_vec(),
            _ => Vec::new(),
        },
        min_tokens: 0,
        vocab: model.tokens(),
    };
    let params = Params {
        prompt: &prompt,
        max_tokens: args.max_tokens,
        sampling: SamplingRequest {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            ..SamplingRequest::default()
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
        prompt,
        sampling,
        seed,
        max_tokens: args.max_tokens,
        mode: Mode::Generate,
        draws_offset: 0,
        stop,
        choices: tl_engine_core::engine::Choices::ONE,
        scope: 0,
        earlier_output: 0,
        constraint: None,
    };
    match engine.generate(req) {
        Ok(tokens) => {
            // Keys in the documented order: tokens, text, then seed. The text leaves out
            // special tokens (an EOS that ended the generation among them).
            let words = match &text {
                Some(t) => t.decode(&tokens),
                None => tl_engine_core::model::decode_text(&tokens),
            };
            let words = serde_json::to_string(&words).unwrap_or_default();
            let tokens = serde_json::to_string(&tokens).unwrap_or_default();
            println!("{{\"tokens\":{tokens},\"text\":{words},\"seed\":{seed}}}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
