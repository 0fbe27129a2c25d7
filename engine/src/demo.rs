//! `tl demo`: a registry, one prefill engine and two decode engines on loopback, in one process.
//! Requests sharing a system prompt go through Prefill and a decode engine's resume; each is
//! checked against a colocated run of the same request.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvwire::prompt_hashes;
use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use kvwire_grpc::pb::kv::HasBlocksRequest;
use kvwire_grpc::{GrpcTransport, KvTransport, TransportConfig};
use serde_json::json;

use crate::client::{ControlClient, HttpClient};
use crate::config::{Config, Role};
use crate::engine::{Engine, Mode, Request};
use crate::model::encode_text;
use crate::node::{EngineNode, RegistryNode};
use crate::sampler::{Sampling, SamplingRequest};

/// Arguments of `tl demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Tokens generated per request.
    #[arg(long, default_value_t = 12)]
    pub max_tokens: u32,
}

const SYSTEM: &str = "You are the kvwire demo assistant. Answer in one short sentence, plainly.\n";
const QUESTIONS: [&str; 6] = [
    "What is a KV cache?",
    "Why split prefill from decode?",
    "What does deduplication save?",
    "Which engine holds my prefix?",
    "How is a block checked?",
    "What if the stream is cut?",
];

fn config(id: &str, role: Role, registry: &str) -> Config {
    let mut c = Config::default();
    c.engine.id = id.into();
    c.engine.role = role;
    c.engine.gateway_registry = registry.into();
    c.engine.heartbeat_ms = 200;
    c.pool.n_blocks = 512;
    c
}

/// Runs `tl demo`.
#[must_use]
pub fn demo(args: &DemoArgs) -> ExitCode {
    let rt = match crate::serve::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

struct Row {
    n: usize,
    prompt_tokens: usize,
    engine: String,
    why: String,
    sent: u32,
    deduped: u32,
    bytes: u64,
    ttft_ms: f64,
    equal: bool,
}

async fn run(args: &DemoArgs) -> Result<bool, String> {
    let reg = RegistryNode::start("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let reg_addr = reg.addr().to_string();
    let p = EngineNode::start(&config("prefill-0", Role::Prefill, &reg_addr))
        .await
        .map_err(|e| e.to_string())?;
    let d1 = EngineNode::start(&config("decode-1", Role::Decode, &reg_addr))
        .await
        .map_err(|e| e.to_string())?;
    let d2 = EngineNode::start(&config("decode-2", Role::Decode, &reg_addr))
        .await
        .map_err(|e| e.to_string())?;

    let end = Instant::now() + Duration::from_secs(10);
    let workers = loop {
        let w = reg.state().list(Instant::now());
        if w.len() == 3 || Instant::now() > end {
            break w;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if workers.len() != 3 {
        return Err(format!("only {} of 3 engines registered", workers.len()));
    }
    println!("registry {reg_addr}: {} workers registered", workers.len());
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

    let decoders = [&d1, &d2];
    let ctl = ControlClient::new(&p.addresses().grpc).map_err(|e| e.to_string())?;
    let http = HttpClient::default();
    let probe = GrpcTransport::new(TransportConfig::for_envelope(172));
    let cfg = Config::default();
    let b = cfg.pool.block_tokens as usize;
    let p_bytes = (cfg.shape().envelope_len(1).unwrap_or(0)) as u64;
    let mut rows = Vec::new();
    for (n, q) in QUESTIONS.iter().enumerate() {
        let prompt = encode_text(&format!("{SYSTEM}Q: {q}\nA:"));
        let (t, seed) = if n % 2 == 0 {
            (0.0f32, None)
        } else {
            (0.8f32, Some(1000 + n as u64))
        };
        // Route: the decode engine holding the longest cached prefix; on a tie, the less loaded,
        // then the next in turn.
        let hashes = prompt_hashes(&prompt, b);
        let mut best = (0usize, 0usize, u32::MAX);
        for (i, d) in decoders.iter().enumerate() {
            let req = HasBlocksRequest {
                hashes: hashes.clone(),
                kv_format: 1,
                model: "fake".into(),
            };
            let present = probe
                .has_blocks(&d.addresses().kv, req)
                .await
                .unwrap_or_default();
            let prefix = present.iter().take_while(|&&x| x).count();
            let load = d.worker().runner().running() + d.worker().runner().queue_depth();
            let turn = (i + n) % 2 == 0;
            if prefix > best.1 || (prefix == best.1 && (load < best.2 || (load == best.2 && turn)))
            {
                best = (i, prefix, load);
            }
        }
        let d = decoders[best.0];
        let why = if best.1 > 0 {
            format!("prefix hit: {} blocks cached", best.1)
        } else {
            "no cached prefix: by load".to_owned()
        };
        let start = Instant::now();
        let h = ctl
            .prefill(PrefillRequest {
                request_id: format!("demo-{n}"),
                prompt_tokens: prompt.clone(),
                sampling: Some(SamplingParams {
                    temperature: t,
                    top_p: 1.0,
                    top_k: 0,
                    seed,
                    max_tokens: args.max_tokens,
                }),
                decode_target: d.addresses().kv,
            })
            .await
            .map_err(|e| format!("prefill: {e}"))?;
        let ttft = start.elapsed();
        let body = json!({
            "prompt": prompt, "max_tokens": args.max_tokens, "temperature": t, "seed": h.seed,
            "tl_resume": { "first_token": h.first_token, "rng_draws_consumed": h.rng_draws_consumed },
        });
        let r = http
            .post(
                &d.addresses().http,
                "/v1/completions",
                &[("x-tl-kv-handle", &h.handle_id)],
                body.to_string(),
            )
            .await
            .map_err(|e| format!("resume: {e}"))?;
        let got: Vec<u32> = r.json()["choices"][0]["tokens"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(serde_json::Value::as_u64)
                    .map(|x| x as u32)
                    .collect()
            })
            .unwrap_or_default();
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
                seed: h.seed,
                max_tokens: args.max_tokens,
                mode: Mode::Generate,
            })
            .map_err(|e| e.to_string())?;
        rows.push(Row {
            n,
            prompt_tokens: prompt.len(),
            engine: d.worker().id().to_owned(),
            why,
            sent: h.blocks_sent,
            deduped: h.blocks_deduped,
            bytes: h.payload_bytes,
            ttft_ms: ttft.as_secs_f64() * 1e3,
            equal: r.status == 200 && got == want,
        });
    }

    println!(
        "{:>2}  {:>6}  {:<9}  {:<28}  {:>4} / {:<7}  {:>7}  {:>8}  equal to colocated",
        "#", "prompt", "decode", "why", "sent", "deduped", "bytes", "TTFT ms"
    );
    for r in &rows {
        println!(
            "{:>2}  {:>6}  {:<9}  {:<28}  {:>4} / {:<7}  {:>7}  {:>8.2}  {}",
            r.n,
            r.prompt_tokens,
            r.engine,
            r.why,
            r.sent,
            r.deduped,
            r.bytes,
            r.ttft_ms,
            if r.equal { "yes" } else { "NO" }
        );
    }
    let sent: u64 = rows.iter().map(|r| u64::from(r.sent)).sum();
    let deduped: u64 = rows.iter().map(|r| u64::from(r.deduped)).sum();
    let bytes: u64 = rows.iter().map(|r| r.bytes).sum();
    let matched = rows.iter().filter(|r| r.equal).count();
    println!();
    println!(
        "totals: {} requests, {matched} equal to colocated; blocks sent {sent}, deduped {deduped}; {bytes} bytes moved of {} without dedup ({:.0}% saved); mean TTFT {:.2} ms",
        rows.len(),
        (sent + deduped) * p_bytes,
        100.0 * (1.0 - bytes as f64 / ((sent + deduped) * p_bytes).max(1) as f64),
        rows.iter().map(|r| r.ttft_ms).sum::<f64>() / rows.len().max(1) as f64,
    );
    for node in [p, d1, d2] {
        node.shutdown(Duration::from_secs(1)).await;
    }
    reg.stop().await;
    Ok(matched == rows.len())
}
