//! `tl bench tenants`: what one tenant can do to another through a gateway over 1 prefill and 2
//! decode engines with API keys. Two parts:
//!
//! - **Fairness.** A light key's sequential requests, alone and then while a heavy key runs
//!   `n = 8` requests with long `max_tokens` from several clients: the light key's p99 TTFT and
//!   TPOT against running alone, its failures, the heavy key's refusals, the engines'
//!   preemptions.
//! - **Privacy.** Pairs: tenant A sends a prefix; tenant B then sends a prompt starting with it,
//!   and a prompt starting with a prefix nobody sent, in alternating order. If B's TTFT told the
//!   two apart, B would learn what A sent; Welch's t-test over the pairs says whether it does.
//!   A's own repeat of its prefix (a hit in its own cache) shows the gap that scoping closes.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tl_engine::api::{CompletionRequest, GenerationParams, Prompt};
use tl_engine::fleet::LocalFleet;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::HttpClient;
use tl_engine::node::config::Role;

use super::serve::{Timing, pct, simulated, streamed_with};
use super::stats::welch;
use super::{BenchError, median, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench tenants`.
#[derive(clap::Args, Debug, Clone)]
pub struct TenantsArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// The light key's requests in each phase (one at a time).
    #[arg(long, default_value_t = 40)]
    light_requests: usize,
    /// Tokens the light key generates per request.
    #[arg(long, default_value_t = 16)]
    light_max_tokens: u32,
    /// Concurrent clients of the heavy key.
    #[arg(long, default_value_t = 4)]
    heavy_clients: usize,
    /// Choices per heavy request.
    #[arg(long, default_value_t = 8)]
    heavy_n: u32,
    /// Tokens per heavy choice.
    #[arg(long, default_value_t = 400)]
    heavy_max_tokens: u32,
    /// Prompt tokens of every fairness request.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Privacy pairs.
    #[arg(long, default_value_t = 50)]
    pairs: usize,
    /// Tokens of the prefix A sends and B probes.
    #[arg(long, default_value_t = 512)]
    prefix_tokens: usize,
    /// Simulated prefill cost per prompt token, microseconds.
    #[arg(long, default_value_t = 50)]
    prefill_us_per_token: u64,
    /// Simulated decode cost per running sequence per step, microseconds.
    #[arg(long, default_value_t = 300)]
    decode_us_per_seq: u64,
    /// Blocks of each decode engine's pool (B = 4): small enough that the heavy key runs it dry.
    #[arg(long, default_value_t = 1024)]
    decode_blocks: u32,
    /// The gateway's `max_tokens_in_flight_per_key` (0: no token bound, the default).
    #[arg(long, default_value_t = 0)]
    tokens_per_key: u64,
}

/// Runs `tl bench tenants`.
#[must_use]
pub fn tenants(args: &TenantsArgs) -> ExitCode {
    block_on(async { print_json(bench(args).await) })
}

fn body(prompt: Vec<u32>, max_tokens: u32, n: u32, seed: u64) -> Vec<u8> {
    let req = CompletionRequest {
        prompt: Prompt::Tokens(prompt),
        params: GenerationParams {
            max_tokens: Some(max_tokens),
            stream: Some(true),
            seed: Some(seed),
            n: Some(n),
            ..GenerationParams::default()
        },
    };
    serde_json::to_vec(&req).unwrap_or_default()
}

/// A prompt of `n` tokens unique to `salt`.
fn prompt(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|t| ((t * 31 + salt * 977 + (t * salt) % 13) % 256) as u32)
        .collect()
}

struct Keyed {
    http: HttpClient,
    auth: String,
}

impl Keyed {
    fn new(key: &str) -> Self {
        Self {
            http: HttpClient::default(),
            auth: format!("Bearer {key}"),
        }
    }

    async fn run(&self, addr: &str, body: Vec<u8>) -> Result<Timing, BenchError> {
        streamed_with(&self.http, addr, &[("authorization", &self.auth)], body).await
    }
}

/// Summary of one phase of the light key.
fn summary(results: &[Result<Timing, BenchError>]) -> serde_json::Value {
    let mut ttft: Vec<f64> = Vec::new();
    let mut tpot: Vec<f64> = Vec::new();
    let mut failed = 0;
    let mut first_error = None;
    for r in results {
        match r {
            Ok(t) => {
                ttft.push(t.ttft * 1e3);
                tpot.extend(t.tpot.map(|p| p * 1e3));
            }
            Err(e) => {
                failed += 1;
                first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    serde_json::json!({
        "completed": results.len() - failed,
        "failed": failed,
        "first_error": first_error,
        "ttft_ms_p50": round3(pct(&mut ttft, 50.0)),
        "ttft_ms_p99": round3(pct(&mut ttft, 99.0)),
        "tpot_ms_p50": round3(pct(&mut tpot, 50.0)),
        "tpot_ms_p99": round3(pct(&mut tpot, 99.0)),
    })
}

async fn light_phase(addr: &str, a: &TenantsArgs, salt: usize) -> Vec<Result<Timing, BenchError>> {
    let light = Keyed::new("light");
    let mut out = Vec::new();
    for i in 0..a.light_requests {
        let b = body(
            prompt(a.prompt_tokens, salt + i),
            a.light_max_tokens,
            1,
            i as u64,
        );
        out.push(
            light
                .run(addr, b)
                .await
                .map_err(|e| BenchError::from(e.to_string())),
        );
    }
    out
}

/// B's times to first token (ms) with and without A's prefix, and A's own repeat, per pair.
struct Probes {
    with_a: Vec<f64>,
    without: Vec<f64>,
    a_again: Vec<f64>,
    errors: usize,
}

/// Privacy: B's TTFT with and without A's prefix, pair by pair, order alternating.
async fn privacy(addr: &str, a: &TenantsArgs) -> Probes {
    let (ka, kb) = (Keyed::new("tenant-a"), Keyed::new("tenant-b"));
    let (mut with_a, mut without, mut a_again) = (Vec::new(), Vec::new(), Vec::new());
    let mut errors = 0usize;
    for i in 0..a.pairs {
        let sent = prompt(a.prefix_tokens, 100_000 + 2 * i);
        let fresh = prompt(a.prefix_tokens, 100_001 + 2 * i);
        let probe = |mut p: Vec<u32>, tail: u32| {
            p.extend([tail, tail + 1, tail + 2]);
            body(p, 1, 1, 0)
        };
        if ka.run(addr, probe(sent.clone(), 7)).await.is_err() {
            errors += 1;
            continue;
        }
        let b_with = probe(sent.clone(), 40);
        let b_without = probe(fresh, 40);
        let (first, second) = if i % 2 == 0 {
            (b_with, b_without)
        } else {
            (b_without, b_with)
        };
        let r1 = kb.run(addr, first).await;
        let r2 = kb.run(addr, second).await;
        let again = ka.run(addr, probe(sent, 90)).await;
        match (r1, r2, again) {
            (Ok(x), Ok(y), Ok(z)) => {
                let (w, wo) = if i % 2 == 0 { (x, y) } else { (y, x) };
                with_a.push(w.ttft * 1e3);
                without.push(wo.ttft * 1e3);
                a_again.push(z.ttft * 1e3);
            }
            _ => errors += 1,
        }
    }
    Probes {
        with_a,
        without,
        a_again,
        errors,
    }
}

async fn bench(a: &TenantsArgs) -> Result<serde_json::Value, BenchError> {
    let dir = std::env::temp_dir().join(format!(
        "tl-bench-tenants-{}-{}",
        std::process::id(),
        tl_engine::net::tls::random_hex::<4>()
    ));
    std::fs::create_dir_all(&dir)?;
    let keys = dir.join("keys");
    std::fs::write(&keys, "light\nheavy\ntenant-a\ntenant-b\n")?;
    let mut cfg = GatewayConfig::default();
    cfg.gateway.api_keys_file = keys.display().to_string();
    cfg.gateway.max_tokens_in_flight_per_key = a.tokens_per_key;
    let (p_us, d_us) = (a.prefill_us_per_token, a.decode_us_per_seq);
    let fleet = LocalFleet::builder(cfg)
        .engine(simulated("P", Role::Prefill, "", p_us, d_us, 8192))
        .engines(
            ["D1", "D2"].map(|id| simulated(id, Role::Decode, "", p_us, d_us, a.decode_blocks)),
        )
        .start()
        .await;
    let _ = std::fs::remove_dir_all(&dir);
    let fleet = fleet?;
    let addr = fleet.gateway.http_addr().to_string();

    // Fairness: the light key alone, then beside the heavy key.
    let alone = light_phase(&addr, a, 1_000).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (done, refused, failed) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let mut heavy = Vec::new();
    for c in 0..a.heavy_clients.max(1) {
        let (stop, done, refused, failed) = (
            Arc::clone(&stop),
            Arc::clone(&done),
            Arc::clone(&refused),
            Arc::clone(&failed),
        );
        let (addr, a) = (addr.clone(), a.clone());
        heavy.push(tokio::spawn(async move {
            let k = Keyed::new("heavy");
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let b = body(
                    prompt(a.prompt_tokens, 50_000 + c * 10_000 + i),
                    a.heavy_max_tokens,
                    a.heavy_n,
                    i as u64,
                );
                match k.run(&addr, b).await {
                    Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                    Err(e) if e.to_string().contains("429") => {
                        // Refused at admission: back off a little, as a client would.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        refused.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    // Let the heavy key fill the engines first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let beside = light_phase(&addr, a, 2_000).await;
    stop.store(true, Ordering::Relaxed);
    for h in heavy {
        h.await?;
    }
    let (alone_s, beside_s) = (summary(&alone), summary(&beside));
    let over = |k: &str| {
        round3(beside_s[k].as_f64().unwrap_or(f64::NAN) / alone_s[k].as_f64().unwrap_or(f64::NAN))
    };

    let Probes {
        with_a,
        without,
        a_again,
        errors,
    } = privacy(&addr, a).await;
    let (t, df, p_value) = welch(&with_a, &without);
    let preemptions: u64 = fleet.engines[1..]
        .iter()
        .map(|n| n.runner().preemptions())
        .sum();
    fleet.stop(Duration::from_secs(1)).await;
    Ok(serde_json::json!({
        "bench": "tenants",
        "settings": {
            "light_requests": a.light_requests, "light_max_tokens": a.light_max_tokens,
            "heavy_clients": a.heavy_clients, "heavy_n": a.heavy_n,
            "heavy_max_tokens": a.heavy_max_tokens, "prompt_tokens": a.prompt_tokens,
            "pairs": a.pairs, "prefix_tokens": a.prefix_tokens,
            "prefill_us_per_token": a.prefill_us_per_token,
            "decode_us_per_seq": a.decode_us_per_seq, "decode_blocks": a.decode_blocks,
            "max_tokens_in_flight_per_key": a.tokens_per_key,
            "topology": "gateway with API keys + 1 prefill + 2 decode, plaintext, in process",
            "shape": "test shape B=4 L=2 H=1 D=4, fake model, cost model by sleeping in the step loop",
        },
        "light_alone": alone_s,
        "light_beside_heavy": beside_s,
        "p99_ttft_over_alone": over("ttft_ms_p99"),
        "p99_tpot_over_alone": over("tpot_ms_p99"),
        "light_failed": beside_s["failed"],
        "heavy": {
            "completed": done.load(Ordering::Relaxed),
            "refused_429": refused.load(Ordering::Relaxed),
            "failed": failed.load(Ordering::Relaxed),
        },
        "preemptions": preemptions,
        "cross_tenant_ttft": {
            "pairs": with_a.len(),
            "errors": errors,
            "b_after_a_sent_it_ms_median": round3(median(&mut with_a.clone())),
            "b_fresh_prefix_ms_median": round3(median(&mut without.clone())),
            "b_after_a_sent_it_ms_p10_p90": [round3(pct(&mut with_a.clone(), 10.0)), round3(pct(&mut with_a.clone(), 90.0))],
            "b_fresh_prefix_ms_p10_p90": [round3(pct(&mut without.clone(), 10.0)), round3(pct(&mut without.clone(), 90.0))],
            "a_own_repeat_ms_median": round3(median(&mut a_again.clone())),
            "welch_t": round3(t),
            "welch_df": round3(df),
            "welch_p": round3(p_value),
            "separable_at_0_05": p_value < 0.05,
        },
    }))
}
