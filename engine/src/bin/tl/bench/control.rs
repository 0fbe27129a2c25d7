//! `tl bench control`: how long the control plane waits behind compute. Info and HasBlocks
//! latency on a decode engine at the realistic shape, idle, while it decodes a long sequence, and
//! while it imports a 256-block push; `busy_over_idle_p99` is the worst busy p99 over the idle
//! p99 across both calls and both loads.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvwire_grpc::pb::kv::HasBlocksRequest;
use kvwire_grpc::{GrpcTransport, KvStore, KvTransport, TransportConfig};
use tl_engine::net::clients::{ControlClient, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine::node::store::PoolStore;
use tl_engine_core::pool::{KvPool, SharedKv};

use super::{BenchError, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench control`.
#[derive(clap::Args, Debug)]
pub(crate) struct ControlArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// Calls of each kind per condition.
    #[arg(long, default_value_t = 100)]
    calls: usize,
    /// Prompt tokens of the sequence decoded under load.
    #[arg(long, default_value_t = 4096)]
    decode_tokens: usize,
}

/// Runs `tl bench control`.
#[must_use]
pub(crate) fn control(args: &ControlArgs) -> ExitCode {
    block_on(async { print_json(control_bench(args).await) })
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[(((p / 100.0) * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)]
}

/// p50 and p99 of Info and of HasBlocks (256 hashes), in ms, over `n` calls each, alternating.
async fn probe(
    ctl: &ControlClient,
    t: &GrpcTransport,
    kv: &str,
    n: usize,
) -> Result<serde_json::Value, BenchError> {
    let (mut info, mut hb) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let hashes: Vec<u64> = (1..=256).collect();
    for _ in 0..n {
        let s = Instant::now();
        ctl.info().await?;
        info.push(s.elapsed().as_secs_f64() * 1e3);
        let s = Instant::now();
        let req = HasBlocksRequest {
            hashes: hashes.clone(),
            kv_format: 1,
            model: "fake".into(),
            ..HasBlocksRequest::default()
        };
        t.has_blocks(kv, req).await?;
        hb.push(s.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(serde_json::json!({
        "info_ms_p50": round3(pct(&mut info, 50.0)),
        "info_ms_p99": round3(pct(&mut info, 99.0)),
        "has_blocks_ms_p50": round3(pct(&mut hb, 50.0)),
        "has_blocks_ms_p99": round3(pct(&mut hb, 99.0)),
    }))
}

async fn control_bench(a: &ControlArgs) -> Result<serde_json::Value, BenchError> {
    // The realistic shape: 2 MiB blocks.
    let blocks = a.decode_tokens.div_ceil(16) + 16;
    let mut cfg = Config::for_worker("D", Role::Decode, "");
    cfg.model.n_layers = 32;
    cfg.model.n_kv_heads = 8;
    cfg.model.head_dim = 128;
    cfg.pool.block_tokens = 16;
    cfg.model.max_context = (blocks as u32) * 16;
    cfg.pool.n_blocks = (blocks + 256 + 16) as u32;
    cfg.limits.decode_reserve_blocks = 1;
    cfg.validate()?;
    let shape = cfg.shape();
    let d = EngineNode::start(&cfg).await?;
    let (grpc, kv, http) = (d.addresses().grpc, d.addresses().kv, d.addresses().http);
    let ctl = ControlClient::new(&grpc)?;
    let t = GrpcTransport::new(TransportConfig::for_envelope(
        shape.envelope_len(1).ok_or("overflow")?,
    ));
    // Warm the connections.
    probe(&ctl, &t, &kv, 5).await?;
    let idle = probe(&ctl, &t, &kv, a.calls).await?;

    // Load 1: one long sequence decoding (its prefill first, then steps over its whole KV).
    let prompt: Vec<u32> = (0..a.decode_tokens).map(|i| (i * 7 % 251) as u32).collect();
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": 64, "seed": 1 });
    let decoding = tokio::spawn(async move {
        HttpClient::default()
            .post(&http, "/v1/completions", &[], body.to_string())
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let while_decoding = probe(&ctl, &t, &kv, a.calls).await?;
    let r = decoding.await??;
    if r.status != 200 {
        return Err(format!("the long sequence answered {}", r.status).into());
    }

    // Load 2: 256-block pushes into the same engine, one after another.
    let src = SharedKv::new(KvPool::new(shape, 256));
    let ids = src.lock().allocate(256)?;
    for &id in &ids {
        src.lock().set_fill(id, 16)?;
    }
    let store: Arc<dyn KvStore> = Arc::new(PoolStore::new(src.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let pusher = {
        let (stop, kv, rx) = (
            Arc::clone(&stop),
            kv.clone(),
            Arc::clone(d.receiver().ok_or("no receiver")?),
        );
        let t = GrpcTransport::new(TransportConfig::for_envelope(
            shape.envelope_len(1).ok_or("overflow")?,
        ));
        // The pusher runs on a thread and runtime of its own, as a prefill engine in another
        // process would: it shares the machine's cores with the engine, not its tokio workers.
        std::thread::spawn(move || -> u64 {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return 0;
            };
            rt.block_on(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let h = format!("load-{n}");
                    // Fresh hashes every push, so nothing is deduplicated: every block is
                    // imported.
                    let hashes: Vec<u64> =
                        (0..ids.len() as u64).map(|i| (n << 20) + i + 1).collect();
                    let r = kvwire_grpc::transfer(
                        &t,
                        Arc::clone(&store),
                        kvwire_grpc::Push {
                            target: &kv,
                            handle_id: &h,
                            model: "fake",
                            hashes: &hashes,
                            n_blocks: ids.len(),
                            known: None,
                            tokens: &[],
                            scope: 0,
                        },
                        &ids,
                    )
                    .await;
                    if r.is_err() {
                        break;
                    }
                    rx.release(&h);
                    n += 1;
                }
                n
            })
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let while_importing = probe(&ctl, &t, &kv, a.calls).await?;
    stop.store(true, Ordering::Relaxed);
    let pushes = pusher.join().map_err(|_| "the pusher panicked")?;
    d.shutdown(Duration::from_secs(2)).await;

    let idle_p99 = |k: &str| idle[k].as_f64().unwrap_or(f64::NAN);
    let worst = ["info_ms_p99", "has_blocks_ms_p99"]
        .iter()
        .flat_map(|k| {
            [&while_decoding, &while_importing]
                .map(|load| load[*k].as_f64().unwrap_or(f64::NAN) / idle_p99(k))
        })
        .fold(0.0f64, f64::max);
    Ok(serde_json::json!({
        "bench": "control",
        "shape": "B=16 L=32 H=8 D=128 (2 MiB blocks), fake model",
        "calls_per_condition": a.calls,
        "idle": idle,
        "while_decoding": while_decoding,
        "decode_prompt_tokens": a.decode_tokens,
        "while_importing": while_importing,
        "pushes_of_256_blocks_during_probe": pushes,
        "busy_over_idle_p99": round3(worst),
    }))
}
