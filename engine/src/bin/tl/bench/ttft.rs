//! `tl bench ttft`: time to first token, disaggregated (prefill, HasBlocks, push, resume) against colocated.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use super::{BenchError, ms, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench ttft`.
#[derive(clap::Args, Debug)]
pub(crate) struct TtftArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// Prompt sizes, in blocks of 16 tokens at the realistic shape.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 256])]
    blocks: Vec<usize>,
}

/// Runs `tl bench ttft`.
#[must_use]
pub(crate) fn ttft(args: &TtftArgs) -> ExitCode {
    block_on(async { print_json(ttft_bench(args).await) })
}

async fn ttft_bench(args: &TtftArgs) -> Result<serde_json::Value, BenchError> {
    use std::sync::Arc;

    use kvwire_grpc::pb::kv::HasBlocksRequest;
    use kvwire_grpc::{GrpcTransport, KvStore, KvTransport, TransportConfig};

    use tl_engine::net::clients::HttpClient;
    use tl_engine::node::EngineNode;
    use tl_engine::node::config::{Config, Role};
    use tl_engine::node::store::PoolStore;
    use tl_engine_core::engine::{Engine, Event, Mode, Request};
    use tl_engine_core::sampler::Sampling;

    let mut rows = Vec::new();
    for &n in &args.blocks {
        let mut cfg = Config::default();
        cfg.model.n_layers = 32;
        cfg.model.n_kv_heads = 8;
        cfg.model.head_dim = 128;
        cfg.model.max_context = 16 * (n as u32 + 8);
        cfg.pool.block_tokens = 16;
        cfg.pool.n_blocks = n as u32 + 8;
        // The push fills nearly the whole pool: keep only one block back for the decode step.
        cfg.limits.decode_reserve_blocks = 1;
        cfg.engine.role = Role::Decode;
        cfg.validate()?;
        let shape = cfg.shape();
        let prompt: Vec<u32> = (0..n * 16).map(|i| (i * 7 % 251) as u32).collect();
        let req = |mode| Request {
            prompt: prompt.clone(),
            sampling: Sampling::GREEDY,
            seed: 1,
            max_tokens: 1,
            mode,
        };

        // Colocated: prefill and first token on one engine.
        let mut solo = Engine::new(cfg.build_model(), cfg.build_pool());
        let t = Instant::now();
        let colocated_first = solo.generate(req(Mode::Generate))?;
        let colocated = t.elapsed();
        drop(solo);

        // Disaggregated, step by step: prefill here, transfer to a decode engine, resume there.
        let d = EngineNode::start(&cfg).await?;
        let kv = d.addresses().kv;
        let mut p = Engine::new(cfg.build_model(), cfg.build_pool());
        let t = Instant::now();
        p.submit(req(Mode::PrefillOnly))?;
        let out = p
            .step()
            .0
            .into_iter()
            .find_map(|e| match e {
                Event::Prefilled { output, .. } => Some(output),
                _ => None,
            })
            .ok_or("prefill produced no output")?;
        let prefill = t.elapsed();
        let transport = GrpcTransport::new(TransportConfig::for_envelope(
            shape.envelope_len(1).unwrap_or(0),
        ));
        // Connect once outside the measurement, as a long-running prefill engine would have.
        let warm = HasBlocksRequest {
            hashes: vec![1],
            kv_format: 1,
            model: "fake".into(),
        };
        transport.has_blocks(&kv, warm).await?;
        let t = Instant::now();
        let hb = HasBlocksRequest {
            hashes: out.hashes.clone(),
            kv_format: 1,
            model: "fake".into(),
        };
        transport.has_blocks(&kv, hb).await?;
        let has_blocks = t.elapsed();
        let store: Arc<dyn KvStore> = Arc::new(PoolStore::new(p.pool().clone()));
        let t = Instant::now();
        let st = kvwire_grpc::transfer(
            &transport,
            &kv,
            store,
            "ttft",
            "fake",
            out.blocks.ids(),
            &out.hashes,
        )
        .await?;
        let transfer = t.elapsed();
        let first = out.first_token;
        drop(out);
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": 2, "seed": 1, "tl_resume": { "first_token": first, "rng_draws_consumed": 0 },
        });
        let t = Instant::now();
        let r = HttpClient::default()
            .post(
                &d.addresses().http,
                "/v1/completions",
                &[("x-tl-kv-handle", "ttft")],
                body.to_string(),
            )
            .await?;
        let resume = t.elapsed();
        if r.status != 200 {
            return Err(format!("resume answered {}", r.status).into());
        }
        d.shutdown(Duration::from_secs(1)).await;
        let disagg = prefill + transfer;
        rows.push(serde_json::json!({
            "blocks": n,
            "prompt_tokens": n * 16,
            "payload_mib": round3(st.payload_bytes as f64 / (1 << 20) as f64),
            "colocated_ttft_ms": ms(colocated),
            "prefill_ms": ms(prefill),
            "has_blocks_ms": ms(has_blocks),
            "push_ms": ms(transfer.saturating_sub(has_blocks)),
            "disaggregated_ttft_ms": ms(disagg),
            "ttft_ratio": round3(disagg.as_secs_f64() / colocated.as_secs_f64()),
            "resume_first_decode_ms": ms(resume),
            "first_token_equal": colocated_first.first() == Some(&first),
        }));
    }
    Ok(serde_json::json!({
        "bench": "ttft",
        "shape": "B=16 L=32 H=8 D=128 (2 MiB blocks), fake model, greedy",
        "note": "disaggregated TTFT = prefill + HasBlocks + push (the first token returns with the KvHandle); resume = claim + one decode step + HTTP",
        "single_block_push_over_streamed": single_over_streamed(&rows),
        "rows": rows,
    }))
}

/// The one-block push's time over the time per block inside the largest push of the run (null
/// when the run has no one-block row or no larger one).
fn single_over_streamed(rows: &[serde_json::Value]) -> Option<f64> {
    let per_block = |r: &serde_json::Value| Some(r["push_ms"].as_f64()? / r["blocks"].as_f64()?);
    let single = rows.iter().find(|r| r["blocks"] == 1).and_then(per_block)?;
    let largest = rows
        .iter()
        .filter(|r| r["blocks"].as_u64().unwrap_or(0) > 1)
        .max_by_key(|r| r["blocks"].as_u64().unwrap_or(0))
        .and_then(per_block)?;
    Some(round3(single / largest))
}
