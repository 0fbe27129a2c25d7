//! `tl bench serve`: load over loopback HTTP, the gateway over 1 prefill + 2 decode against one engine alone.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tl_engine::api::sse::StreamEvent;
use tl_engine::api::{CompletionRequest, GenerationParams, LogprobsField, Prompt};
use tl_engine::net::clients::{EventStream, HttpClient};

use tl_engine::node::config::{Config, Role};

use super::{BenchError, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// After the runs above, switch span export on (to an in-process OTLP receiver) and run the
    /// disaggregated load again: `traced_over_off`.
    #[arg(long)]
    trace: bool,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Fraction of requests with a long prompt.
    #[arg(long, default_value_t = 0.1)]
    long_fraction: f64,
    /// Tokens of a long prompt.
    #[arg(long, default_value_t = 1024)]
    long_tokens: usize,
    /// Tokens of a short prompt.
    #[arg(long, default_value_t = 64)]
    short_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// A checkpoint directory for every engine instead of the fake model (its own costs; the
    /// simulated ones are not used). B = 16, 1024 blocks per engine.
    #[arg(long)]
    model: Option<String>,
    /// Simulated prefill cost per prompt token, microseconds.
    #[arg(long, default_value_t = 50)]
    prefill_us_per_token: u64,
    /// Simulated decode cost per running sequence per step, microseconds.
    #[arg(long, default_value_t = 300)]
    decode_us_per_seq: u64,
    /// Choices per request (`n`, 1 to 8): one prefill and one push serve them all.
    #[arg(long, default_value_t = 1)]
    n: u32,
    /// Ask for this many alternatives' log-probabilities per token (completions' `logprobs`).
    #[arg(long)]
    logprobs: Option<u32>,
    /// Send the load to this running gateway (or engine front), `HOST:PORT`, instead of
    /// starting engines: prints that one load's figures (`target`), to set beside another
    /// client's (aiperf, guidellm) against the same server.
    #[arg(long)]
    target: Option<String>,
    /// Instead of the runs above: `tl serve` (1P+2D and colocated) beside llama.cpp's server
    /// (PyPI's `xllamacpp`, sha256-checked, under `target/peer`), each alone under `vllm bench
    /// serve`'s load on the trained model as one BF16 GGUF, with the ratios against the better
    /// peer.
    #[arg(long)]
    pub peers: bool,
    /// `--peers`: the levels of concurrency.
    #[arg(long, default_value = "1,4,16")]
    pub concurrency: String,
    /// `--peers`: the servers, among tl, tl-colocated, llama-server and vllm.
    #[arg(
        long,
        default_value = "tl,tl-colocated,llama-server",
        value_delimiter = ','
    )]
    pub servers: Vec<String>,
    /// `--peers`: threads of every server.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// `--peers`: a virtualenv holding vLLM's CPU build (not installed here: several GB).
    #[arg(long)]
    pub vllm_venv: Option<std::path::PathBuf>,
    /// `--peers`: the same weights as a safetensors directory, for vLLM.
    #[arg(long)]
    pub vllm_model: Option<std::path::PathBuf>,
    /// `--peers`: the trained model's GGUF file (set from `smollm2` by the caller).
    #[arg(skip)]
    pub peer_source: Option<Result<String, String>>,
}

/// One request's timings.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    /// Seconds to the first token.
    pub(crate) ttft: f64,
    /// Seconds per token after the first.
    pub(crate) tpot: Option<f64>,
    /// Tokens received, every choice.
    pub(crate) tokens: usize,
}

async fn one_streamed(http: &HttpClient, addr: &str, body: Vec<u8>) -> Result<Timing, BenchError> {
    streamed_with(http, addr, &[], body).await
}

/// One streamed completion with `headers`: its timings, or why it failed (`answered 429`, or
/// the stream's error event).
pub(crate) async fn streamed_with(
    http: &HttpClient,
    addr: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Timing, BenchError> {
    let start = Instant::now();
    let (status, body) = http
        .post_streaming(addr, "/v1/completions", headers, body)
        .await?;
    if status != 200 {
        return Err(format!("answered {status}").into());
    }
    let mut events = EventStream::new(body);
    let (mut first, mut last, mut tokens) = (None, None, 0usize);
    while let Some(event) = events.next().await {
        match event? {
            StreamEvent::Chunk(c) => {
                let n: usize = c.choices.iter().map(|c| c.tokens.len()).sum();
                if n > 0 {
                    let now = start.elapsed().as_secs_f64();
                    first.get_or_insert(now);
                    last = Some(now);
                    tokens += n;
                }
            }
            StreamEvent::Error(e) => return Err(e.message.into()),
            StreamEvent::Done => break,
        }
    }
    let ttft = first.ok_or("no token")?;
    let tpot = match (last, tokens) {
        (Some(l), n) if n > 1 => Some((l - ttft) / (n - 1) as f64),
        _ => None,
    };
    Ok(Timing { ttft, tpot, tokens })
}

pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Runs the load against `addr` and summarises it.
async fn load(addr: &str, a: &ServeArgs) -> Result<serde_json::Value, BenchError> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..a.clients.max(1) {
        let (next, addr, a) = (Arc::clone(&next), addr.to_owned(), a.clone());
        tasks.push(tokio::spawn(async move {
            let http = HttpClient::default();
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= a.requests {
                    break;
                }
                // Every 1/fraction-th request is long, spread evenly over the run.
                let every = (1.0 / a.long_fraction.max(1e-9)).round().max(1.0) as usize;
                let long = a.long_fraction > 0.0 && i % every == every / 2;
                let n = if long { a.long_tokens } else { a.short_tokens };
                let prompt: Vec<u32> = (0..n).map(|t| ((t * 31 + i * 7) % 256) as u32).collect();
                let req = CompletionRequest {
                    prompt: Prompt::Tokens(prompt),
                    params: GenerationParams {
                        max_tokens: Some(a.max_tokens),
                        stream: Some(true),
                        seed: Some(i as u64),
                        n: Some(a.n),
                        logprobs: a.logprobs.map(LogprobsField::Count),
                        ..GenerationParams::default()
                    },
                };
                let body = serde_json::to_vec(&req).unwrap_or_default();
                let res = one_streamed(&http, &addr, body)
                    .await
                    .map_err(|e| e.to_string());
                out.push((long, res));
            }
            out
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await?);
    }
    let wall = start.elapsed().as_secs_f64();
    let mut ttft = Vec::new();
    let mut tpot = Vec::new();
    let (mut tokens, mut errors) = (0usize, 0usize);
    let mut first_error = None;
    for (_, r) in &results {
        match r {
            Ok(t) => {
                ttft.push(t.ttft * 1e3);
                if let Some(p) = t.tpot {
                    tpot.push(p * 1e3);
                }
                tokens += t.tokens;
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| e.clone());
            }
        }
    }
    Ok(serde_json::json!({
        "requests": results.len(),
        "errors": errors,
        "first_error": first_error,
        "ttft_ms_p50": round3(pct(&mut ttft, 50.0)),
        "ttft_ms_p99": round3(pct(&mut ttft, 99.0)),
        "tpot_ms_p50": round3(pct(&mut tpot, 50.0)),
        "tpot_ms_p99": round3(pct(&mut tpot, 99.0)),
        "tokens_per_s": round3(tokens as f64 / wall),
        "wall_s": round3(wall),
    }))
}

/// Runs `tl bench serve`.
#[must_use]
pub fn serve(args: &ServeArgs) -> ExitCode {
    if args.peers {
        return print_json((|| {
            let source = match &args.peer_source {
                Some(Ok(p)) => std::path::PathBuf::from(p),
                Some(Err(e)) => return Err(e.clone().into()),
                None => return Err("--peers: no trained model to serve".into()),
            };
            super::peers::compare(&super::peers::PeersArgs {
                source,
                concurrency: args.concurrency.clone(),
                servers: args.servers.clone(),
                threads: args.threads,
                vllm: args.vllm_venv.clone().zip(args.vllm_model.clone()),
            })
        })());
    }
    block_on(async { print_json(serve_bench(args).await) })
}

/// The gateway over one prefill and two decode engines, plaintext or with mutual TLS on every
/// internal connection (certificates made in a temporary directory), under the load.
async fn gateway_load(a: &ServeArgs, mtls: bool) -> Result<serde_json::Value, BenchError> {
    use tl_engine::fleet::LocalFleet;
    use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
    use tl_engine::net::tls::{PeerRole, issue};

    let certs = std::env::temp_dir().join(format!(
        "tl-bench-serve-{}-{}",
        std::process::id(),
        tl_engine::net::tls::random_hex::<4>()
    ));
    let tls = |id: &str, role| -> Result<_, BenchError> {
        Ok(if mtls {
            Some(issue(&certs, id, role, &[])?.section())
        } else {
            None
        })
    };
    let mut fleet = LocalFleet::builder(GatewayConfig {
        gateway: GatewaySection {
            max_inflight: 4096,
            ..GatewaySection::local()
        },
        tls: tls("gw", PeerRole::Gateway)?,
        ..GatewayConfig::local()
    });
    for (id, role, peer) in [
        ("P", Role::Prefill, PeerRole::Prefill),
        ("D1", Role::Decode, PeerRole::Decode),
        ("D2", Role::Decode, PeerRole::Decode),
    ] {
        let mut c = engine_cfg(a, id, role, "");
        c.tls = tls(id, peer)?;
        fleet = fleet.engine(c);
    }
    let fleet = fleet.start().await;
    let _ = std::fs::remove_dir_all(&certs);
    let fleet = fleet?;
    let figures = load(&fleet.gateway.http_addr().to_string(), a).await?;
    fleet.stop(Duration::from_secs(1)).await;
    Ok(figures)
}

fn engine_cfg(a: &ServeArgs, id: &str, role: Role, reg: &str) -> Config {
    let mut c = simulated(
        id,
        role,
        reg,
        a.prefill_us_per_token,
        a.decode_us_per_seq,
        8192,
    );
    if let Some(dir) = &a.model {
        c.set_model(dir);
        c.pool.block_tokens = 16;
        c.pool.n_blocks = 1024;
    }
    c
}

/// An engine beating every 100 ms to `reg`, with simulated costs and `n_blocks` pool blocks.
pub fn simulated(
    id: &str,
    role: Role,
    reg: &str,
    prefill_us: u64,
    decode_us: u64,
    n_blocks: u32,
) -> Config {
    let mut c = Config::for_worker(id, role, reg);
    c.engine.heartbeat_ms = 100;
    c.model.prefill_us_per_token = prefill_us;
    c.model.decode_us_per_seq = decode_us;
    c.pool.n_blocks = n_blocks;
    c
}

async fn serve_bench(a: &ServeArgs) -> Result<serde_json::Value, BenchError> {
    use tl_engine::node::EngineNode;

    if let Some(t) = &a.target {
        return Ok(serde_json::json!({ "target": load(t, a).await? }));
    }
    // (a) The gateway over one prefill and two decode engines, plaintext and over mutual TLS.
    let disagg = gateway_load(a, false).await?;
    let disagg_mtls = gateway_load(a, true).await?;
    // (b) One engine with role both, alone.
    let single = EngineNode::start(&engine_cfg(a, "B", Role::Both, "")).await?;
    let colocated = load(&single.addresses().http, a).await?;
    single.shutdown(Duration::from_secs(1)).await;
    let ratio = |k: &str| {
        round3(disagg[k].as_f64().unwrap_or(f64::NAN) / colocated[k].as_f64().unwrap_or(f64::NAN))
    };
    // (c) With span export on: the same disaggregated load, traced.
    // Pairs, off then on, so that a later run's drift is not read as tracing's cost.
    let traced = if a.trace {
        let tracing = super::Tracing::start().await?;
        let mut pairs = Vec::new();
        for _ in 0..3 {
            let off = gateway_load(a, false).await?;
            let on = tracing.traced(gateway_load(a, false)).await?;
            pairs.push((off, on));
        }
        let over = |k: &str| {
            let mut r: Vec<f64> = pairs
                .iter()
                .map(|(off, on)| {
                    on[k].as_f64().unwrap_or(f64::NAN) / off[k].as_f64().unwrap_or(f64::NAN)
                })
                .collect();
            serde_json::json!({
                "median": round3(super::median(&mut r.clone())),
                "all": r.iter_mut().map(|x| round3(*x)).collect::<Vec<_>>(),
            })
        };
        Some(serde_json::json!({
            "pairs": 3,
            "traced_over_off": {
                "tpot_ms_p99": over("tpot_ms_p99"),
                "ttft_ms_p99": over("ttft_ms_p99"),
                "tokens_per_s": over("tokens_per_s"),
            },
            "export": tracing.finish().await,
        }))
    } else {
        None
    };
    Ok(serde_json::json!({
        "tracing": traced,
        "bench": "serve",
        "settings": {
            "clients": a.clients, "requests": a.requests, "long_fraction": a.long_fraction, "long_tokens": a.long_tokens,
            "short_tokens": a.short_tokens, "max_tokens": a.max_tokens,
            "prefill_us_per_token": a.prefill_us_per_token, "decode_us_per_seq": a.decode_us_per_seq,
            "n": a.n, "logprobs": a.logprobs,
            "shape": match &a.model {
                Some(dir) => format!("{dir}: the checkpoint on every engine, B=16, every engine's kernels on every core"),
                None => "test shape B=4 L=2 H=1 D=4, fake model, cost model by sleeping in the step loop".to_owned(),
            },
        },
        "disaggregated_gateway_1p_2d": disagg,
        "disaggregated_gateway_1p_2d_mtls": disagg_mtls,
        "single_engine_both": colocated,
        "disagg_over_single": {
            "tpot_ms_p99": ratio("tpot_ms_p99"),
            "tpot_ms_p50": ratio("tpot_ms_p50"),
            "ttft_ms_p99": ratio("ttft_ms_p99"),
            "tokens_per_s": ratio("tokens_per_s"),
        },
    }))
}
