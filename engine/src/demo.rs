//! `tl demo`: a gateway (with its worker registry), one prefill engine and two decode engines on
//! loopback, in one process. Requests go to the gateway's OpenAI-compatible endpoint; the table
//! shows where each was decoded and why, what the transfer moved, the time to the first streamed
//! token, and whether the tokens equal a colocated run of the same request.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::client::HttpClient;
use crate::config::{Config, Role};
use crate::engine::{Engine, Mode, Request};
use crate::gateway::{GatewayNode, GatewaySection};
use crate::model::encode_text;
use crate::node::EngineNode;
use crate::sampler::{Sampling, SamplingRequest};

/// Arguments of `tl demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Tokens generated per request.
    #[arg(long, default_value_t = 12)]
    pub max_tokens: u32,
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

fn config(id: &str, role: Role, registry: &str) -> Config {
    let mut c = Config::for_worker(id, role, registry);
    c.engine.heartbeat_ms = 50;
    c.pool.n_blocks = 512;
    c
}

/// Runs `tl demo`.
#[must_use]
pub fn demo(args: &DemoArgs) -> ExitCode {
    crate::serve::block_on(async {
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
    route: Value,
    ttft_ms: f64,
    equal: bool,
}

/// Sends one streaming request; returns the tokens, the route, and the time to the first chunk.
async fn stream_once(
    http: &HttpClient,
    addr: &str,
    body: String,
) -> Result<(Vec<u32>, Value, Duration), String> {
    let start = Instant::now();
    let (status, mut body) = http
        .post_streaming(addr, "/v1/completions", &[], body)
        .await?;
    if status != 200 {
        return Err(format!("gateway answered {status}"));
    }
    let (mut tokens, mut route, mut ttft, mut buf) = (Vec::new(), Value::Null, None, String::new());
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        ttft.get_or_insert_with(|| start.elapsed());
        buf.push_str(&String::from_utf8_lossy(&data));
    }
    for d in buf
        .lines()
        .filter_map(|l| l.strip_prefix("data:").map(str::trim))
    {
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(d).map_err(|e| e.to_string())?;
        if let Some(e) = v.get("error") {
            return Err(e.to_string());
        }
        route = v["tl_route"].clone();
        tokens.extend(
            v["choices"][0]["tokens"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64)
                .map(|t| t as u32),
        );
    }
    Ok((tokens, route, ttft.unwrap_or_default()))
}

async fn run(args: &DemoArgs) -> Result<bool, String> {
    let gw = GatewayNode::start(&GatewaySection::default())
        .await
        .map_err(|e| e.to_string())?;
    let reg = gw.registry_addr().to_string();
    let nodes = [
        EngineNode::start(&config("prefill-0", Role::Prefill, &reg))
            .await
            .map_err(|e| e.to_string())?,
        EngineNode::start(&config("decode-1", Role::Decode, &reg))
            .await
            .map_err(|e| e.to_string())?,
        EngineNode::start(&config("decode-2", Role::Decode, &reg))
            .await
            .map_err(|e| e.to_string())?,
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
        return Err(format!("only {} of 3 engines registered", workers.len()));
    }
    let addr = gw.http_addr().to_string();
    println!(
        "gateway http {addr}, registry {reg}: {} workers registered",
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
        let body = json!({ "prompt": prompt, "max_tokens": args.max_tokens, "temperature": t, "seed": seed, "stream": true });
        let (got, route, ttft) = stream_once(&http, &addr, body.to_string()).await?;
        let sampling = Sampling::new(
            SamplingRequest {
                temperature: t,
                top_p: 1.0,
                top_k: 0,
            },
            cfg.model.vocab,
        )
        .map_err(|e| e.to_string())?;
        let want = Engine::new(cfg.build_model(), cfg.build_pool())
            .generate(Request {
                prompt: prompt.clone(),
                sampling,
                seed,
                max_tokens: args.max_tokens,
                mode: Mode::Generate,
            })
            .map_err(|e| e.to_string())?;
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
    let num = |r: &Row, k: &str| r.route[k].as_u64().unwrap_or(0);
    for (n, r) in rows.iter().enumerate() {
        println!(
            "{:>2}  {:>6}  {:<9}  {:<28}  {:>4} / {:<7}  {:>7}  {:>8.2}  {}",
            n,
            r.prompt_tokens,
            r.route["decode"].as_str().unwrap_or("?"),
            r.route["reason"].as_str().unwrap_or("?"),
            num(r, "blocks_sent"),
            num(r, "blocks_deduped"),
            num(r, "payload_bytes"),
            r.ttft_ms,
            if r.equal { "yes" } else { "NO" }
        );
    }
    let sent: u64 = rows.iter().map(|r| num(r, "blocks_sent")).sum();
    let deduped: u64 = rows.iter().map(|r| num(r, "blocks_deduped")).sum();
    let bytes: u64 = rows.iter().map(|r| num(r, "payload_bytes")).sum();
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
