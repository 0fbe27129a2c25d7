//! `tl demo`: a gateway (with its worker registry), one prefill engine and two decode engines on
//! loopback, in one process. Requests go to the gateway's OpenAI-compatible endpoint; the table
//! shows where each was decoded and why, what the transfer moved, the time to the first streamed
//! token, and whether the tokens equal a colocated run of the same request.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tl_engine::api::sse::StreamEvent;
use tl_engine::api::{CompletionRequest, GenerationParams, Prompt, RouteInfo};
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::{EventStream, HttpClient};
use tl_engine::net::tls::{PeerRole, issue};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine_core::engine::{Engine, GenerateError, Mode, Request};
use tl_engine_core::model::encode_text;
use tl_engine_core::sampler::{Sampling, SamplingError, SamplingRequest};

use crate::run::block_on;

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<Self> {
        let p = std::env::temp_dir().join(format!(
            "tl-demo-{}-{}",
            std::process::id(),
            tl_engine::net::tls::random_hex::<4>()
        ));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Arguments of `tl demo`.
#[derive(clap::Args, Debug)]
pub(crate) struct DemoArgs {
    /// Tokens generated per request.
    #[arg(long, default_value_t = 12)]
    max_tokens: u32,
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    #[error("starting a node: {0}")]
    Start(#[from] std::io::Error),
    #[error("certificates: {0}")]
    Certs(#[from] tl_engine::net::tls::TlsError),
    #[error("only {0} of 3 engines registered")]
    Registration(usize),
    #[error("request: {0}")]
    Http(#[from] tl_engine::net::clients::HttpError),
    #[error("stream: {0}")]
    Stream(#[from] tl_engine::net::clients::StreamError),
    #[error("the gateway answered {0}")]
    Status(u16),
    #[error("the stream failed: {0}")]
    Failed(String),
    #[error("colocated reference run: {0}")]
    Reference(#[from] GenerateError),
    #[error("sampling: {0}")]
    Sampling(#[from] SamplingError),
}

const TENANT_A: &str =
    "You are the kvwire demo assistant. Answer in one short sentence, plainly.\n";
const TENANT_B: &str = "Release-notes bot for a storage team. Reply in terse bullet points only.\n";
const REQUESTS: [(&str, &str); 7] = [
    (TENANT_A, "What is a KV cache?"),
    (TENANT_A, "Why split prefill from decode?"),
    (TENANT_B, "Summarise the 1.4 release."),
    (TENANT_A, "What does deduplication save?"),
    (TENANT_B, "What broke in 1.3?"),
    (TENANT_A, "How is a block checked?"),
    (TENANT_A, "What if the stream is cut?"),
];

fn config(id: &str, role: Role, registry: &str, certs: &Path) -> Result<Config, DemoError> {
    let peer = match role {
        Role::Prefill => PeerRole::Prefill,
        Role::Decode => PeerRole::Decode,
        Role::Both => PeerRole::Both,
    };
    let mut c = Config::for_worker(id, role, registry);
    c.tls = Some(issue(certs, id, peer, &[])?.section());
    c.engine.heartbeat_ms = 50;
    c.pool.n_blocks = 512;
    Ok(c)
}

/// Runs `tl demo`.
#[must_use]
pub(crate) fn demo(args: &DemoArgs) -> ExitCode {
    block_on(async {
        match run(args).await {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    })
}

struct Row {
    prompt_tokens: usize,
    route: RouteInfo,
    ttft_ms: f64,
    equal: bool,
}

/// Sends one streaming request; returns the tokens, the route, and the time to the first chunk.
async fn stream_once(
    http: &HttpClient,
    addr: &str,
    req: &CompletionRequest,
) -> Result<(Vec<u32>, RouteInfo, Duration), DemoError> {
    let start = Instant::now();
    let body = serde_json::to_vec(req).unwrap_or_default();
    let (status, body) = http
        .post_streaming(addr, "/v1/completions", &[], body)
        .await?;
    if status != 200 {
        return Err(DemoError::Status(status));
    }
    let mut events = EventStream::new(body);
    let (mut tokens, mut route, mut ttft) = (Vec::new(), RouteInfo::default(), None);
    while let Some(event) = events.next().await {
        match event? {
            StreamEvent::Chunk(c) => {
                ttft.get_or_insert_with(|| start.elapsed());
                if let Some(r) = c.tl_route {
                    route = r;
                }
                tokens.extend(c.choices.into_iter().flat_map(|c| c.tokens));
            }
            StreamEvent::Error(e) => return Err(DemoError::Failed(e.message)),
            StreamEvent::Done => break,
        }
    }
    Ok((tokens, route, ttft.unwrap_or_default()))
}

async fn run(args: &DemoArgs) -> Result<bool, DemoError> {
    // Every internal connection is mutual TLS, with certificates made here for this run.
    let certs = TempDir::new()?;
    let gw_cfg = GatewayConfig {
        tls: Some(issue(certs.path(), "gw", PeerRole::Gateway, &[])?.section()),
        ..GatewayConfig::default()
    };
    let gw = GatewayNode::start(&gw_cfg).await?;
    let reg = gw.registry_addr().to_string();
    let nodes = [
        EngineNode::start(&config("prefill-0", Role::Prefill, &reg, certs.path())?).await?,
        EngineNode::start(&config("decode-1", Role::Decode, &reg, certs.path())?).await?,
        EngineNode::start(&config("decode-2", Role::Decode, &reg, certs.path())?).await?,
    ];
    let end = Instant::now() + Duration::from_secs(10);
    let workers = loop {
        let w = gw.registry().list(Instant::now());
        if w.len() == 3 || Instant::now() > end {
            break w;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if workers.len() != 3 {
        return Err(DemoError::Registration(workers.len()));
    }
    let addr = gw.http_addr().to_string();
    println!(
        "gateway http {addr}, registry {reg}: {} workers registered; mTLS: on",
        workers.len()
    );
    for w in &workers {
        let kv = if w.kv_address.is_empty() {
            "-".to_owned()
        } else {
            w.kv_address.clone()
        };
        println!(
            "  {:<10} grpc {:<16} kv {:<16} free blocks {}",
            w.worker_id, w.grpc_address, kv, w.free_blocks
        );
    }
    println!();

    let http = HttpClient::default();
    let cfg = Config::default();
    let mut rows = Vec::new();
    for (n, (system, q)) in REQUESTS.iter().enumerate() {
        let prompt = encode_text(&format!("{system}Q: {q}\nA:"));
        let (t, seed) = if n % 2 == 0 {
            (0.0f32, 500 + n as u64)
        } else {
            (0.8f32, 1000 + n as u64)
        };
        let req = CompletionRequest {
            prompt: Prompt::Tokens(prompt.clone()),
            params: GenerationParams {
                max_tokens: Some(args.max_tokens),
                temperature: Some(t),
                seed: Some(seed),
                stream: Some(true),
                ..GenerationParams::default()
            },
            tl_resume: None,
        };
        let (got, route, ttft) = stream_once(&http, &addr, &req).await?;
        let sampling = Sampling::new(
            SamplingRequest {
                temperature: t,
                top_p: 1.0,
                top_k: 0,
            },
            cfg.model.vocab,
        )?;
        let want = Engine::new(cfg.build_model(), cfg.build_pool()).generate(Request {
            prompt: prompt.clone(),
            sampling,
            seed,
            max_tokens: args.max_tokens,
            mode: Mode::Generate,
        })?;
        rows.push(Row {
            prompt_tokens: prompt.len(),
            route,
            ttft_ms: ttft.as_secs_f64() * 1e3,
            equal: got == want,
        });
        // Let a heartbeat carry the engines' new pool figures to the gateway before the next one.
        tokio::time::sleep(Duration::from_millis(120)).await;
    }

    println!(
        "{:>2}  {:>6}  {:<9}  {:<28}  {:>4} / {:<7}  {:>7}  {:>8}  equal to colocated",
        "#", "prompt", "decode", "why", "sent", "deduped", "bytes", "TTFT ms"
    );

    for (n, r) in rows.iter().enumerate() {
        println!(
            "{:>2}  {:>6}  {:<9}  {:<28}  {:>4} / {:<7}  {:>7}  {:>8.2}  {}",
            n,
            r.prompt_tokens,
            r.route.decode,
            r.route.reason,
            r.route.blocks_sent.unwrap_or(0),
            r.route.blocks_deduped.unwrap_or(0),
            r.route.payload_bytes.unwrap_or(0),
            r.ttft_ms,
            if r.equal { "yes" } else { "NO" }
        );
    }
    let sent: u64 = rows
        .iter()
        .map(|r| u64::from(r.route.blocks_sent.unwrap_or(0)))
        .sum();
    let deduped: u64 = rows
        .iter()
        .map(|r| u64::from(r.route.blocks_deduped.unwrap_or(0)))
        .sum();
    let bytes: u64 = rows
        .iter()
        .map(|r| r.route.payload_bytes.unwrap_or(0))
        .sum();
    let per_block = cfg.shape().envelope_len(1).unwrap_or(0) as u64;
    let matched = rows.iter().filter(|r| r.equal).count();
    println!();
    println!(
        "totals: {} requests, {matched} equal to colocated; blocks sent {sent}, deduped {deduped}; {bytes} bytes moved of {} without dedup ({:.0}% saved); mean TTFT {:.2} ms",
        rows.len(),
        (sent + deduped) * per_block,
        100.0 * (1.0 - bytes as f64 / ((sent + deduped) * per_block).max(1) as f64),
        rows.iter().map(|r| r.ttft_ms).sum::<f64>() / rows.len().max(1) as f64,
    );
    for node in nodes {
        node.shutdown(Duration::from_secs(1)).await;
    }
    gw.stop().await;
    Ok(matched == rows.len())
}
