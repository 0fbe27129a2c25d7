//! `tl bench model`: the real transformer on this CPU, on a published shape with seeded random
//! weights (nothing downloaded). Decode tokens/s at several batch sizes against the roofline of
//! streaming every weight byte once per step at the memcpy bandwidth measured in the same run;
//! prefill tokens/s against the matmul crate's own best square-matmul FLOP/s, also measured
//! here. Each figure for both kernel sets: `gemm` (the crate, the default) and `portable`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use tl_engine_core::engine::{Choices, Engine, Mode, Request};
use tl_engine_core::model::Model;
use tl_engine_core::pool::{KvPool, SharedKv};
use tl_engine_core::sampler::Sampling;
use tl_llama::Llama;
use tl_llama::LlamaConfig;
use tl_llama::init::write_checkpoint;
use tl_llama::kernels::{DType, Kernels, MatRef, matmul};
use tl_llama::workers::Workers;

use super::{BenchError, round3};
use crate::run::print_json;

/// Arguments of `tl bench model`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// A checkpoint directory to measure instead of a SmolLM2-135M-shaped one made here.
    #[arg(long)]
    model: Option<String>,
    /// Batch sizes to decode at.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 8)]
    steps: u32,
    /// Prompt tokens of the prefill figure.
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    /// Kernel threads (0: every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Kernel sets to measure: gemm, portable, or both.
    #[arg(long, value_delimiter = ',', default_value = "simd,gemm")]
    kernels: Vec<String>,
}

/// Runs `tl bench model`.
#[must_use]
pub fn model(args: &ModelArgs) -> ExitCode {
    print_json(bench(args))
}

/// memcpy GB/s over a buffer far larger than the caches, best of a few copies.
fn memcpy_gbps() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best = 0f64;
    for _ in 0..4 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.max(n as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// A 512 x 1024 x 1024 f32 product's operands.
fn square() -> (Vec<f32>, Vec<u8>, usize, usize, usize) {
    let (m, k, n) = (512, 1024, 1024);
    let w: Vec<u8> = (0..n * k)
        .flat_map(|i| ((i % 97) as f32 / 97.0 - 0.5).to_le_bytes())
        .collect();
    let x: Vec<f32> = (0..m * k).map(|i| (i % 89) as f32 / 89.0 - 0.5).collect();
    (x, w, m, k, n)
}

/// The kernels' best FLOP/s on the square-ish f32 product, through the engine's own driver.
fn driver_peak(kernels: Kernels, threads: usize) -> f64 {
    let (x, w, m, k, n) = square();
    let mat = MatRef {
        bytes: &w,
        dtype: DType::F32,
        rows: n,
        cols: k,
    };
    let mut out = vec![0f32; m * n];
    let mut best = 0f64;
    let workers = Workers::new(threads);
    for _ in 0..3 {
        let t = Instant::now();
        matmul(kernels, &x, mat, None, &mut out, &workers);
        std::hint::black_box(&out);
        best = best.max(2.0 * (m * k * n) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// The gemm crate's own best FLOP/s on the same product, called as its documentation shows
/// (one call over the whole product, its own blocking), once per thread at the same time.
#[allow(unsafe_code)]
fn crate_peak(threads: usize) -> f64 {
    let (x, w, m, k, n) = square();
    let w: Vec<f32> = w
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let mut out = vec![0f32; m * n];
                    // SAFETY: out is m x n, x is m x k and w is n x k (read transposed), all
                    // row-major and exactly that long.
                    unsafe {
                        gemm::gemm(
                            m,
                            n,
                            k,
                            out.as_mut_ptr(),
                            1,
                            n as isize,
                            false,
                            x.as_ptr(),
                            1,
                            k as isize,
                            w.as_ptr(),
                            k as isize,
                            1,
                            0.0,
                            1.0,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                    std::hint::black_box(&out);
                });
            }
        });
        best = best.max(threads as f64 * 2.0 * (m * k * n) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

fn weight_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn request(prompt: Vec<u32>, max_tokens: u32) -> Request {
    Request {
        prompt,
        sampling: Sampling::GREEDY,
        seed: 0,
        max_tokens,
        mode: Mode::Generate,
        draws_offset: 0,
        stop: Default::default(),
        choices: Choices::ONE,
        scope: 0,
    }
}

fn bench(a: &ModelArgs) -> Result<serde_json::Value, BenchError> {
    let tmp = std::env::temp_dir().join(format!(
        "tl-bench-model-{}-{}",
        std::process::id(),
        tl_engine::net::tls::random_hex::<4>()
    ));
    let (dir, shape_name) = match &a.model {
        Some(d) => (std::path::PathBuf::from(d), d.clone()),
        None => {
            write_checkpoint(&tmp, &LlamaConfig::smollm2_135m(), DType::Bf16, 1, 1, 2, 1)?;
            (
                tmp.clone(),
                "smollm2-135m (random weights, bf16)".to_owned(),
            )
        }
    };
    let threads = match a.threads {
        0 => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        n => n,
    };
    let bytes = weight_bytes(&dir);
    let memcpy = memcpy_gbps();
    let roofline_steps = memcpy * 1e9 / bytes as f64;
    let crate_peak = crate_peak(threads);
    let mut sets = serde_json::Map::new();
    for name in &a.kernels {
        let kernels = Kernels::parse(name).ok_or_else(|| {
            BenchError::from(format!("--kernels {name:?}: expected gemm or portable"))
        })?;
        let model =
            Llama::load(&dir, "bench", a.block_tokens, threads, 8192)?.with_kernels(kernels);
        let r = measure(
            a,
            Arc::new(model),
            roofline_steps,
            kernels,
            threads,
            crate_peak,
        )?;
        sets.insert(name.clone(), r);
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(serde_json::json!({
        "bench": "model",
        "model": shape_name,
        "threads": threads,
        "block_tokens": a.block_tokens,
        "weight_bytes": bytes,
        "memcpy_gbps": round3(memcpy),
        "roofline_steps_per_s": round3(roofline_steps),
        "gemm_crate_peak_gflops": round3(crate_peak / 1e9),
        "kernels": sets,
    }))
}

/// One kernel set's decode and prefill figures.
fn measure(
    a: &ModelArgs,
    model: Arc<Llama>,
    roofline_steps: f64,
    kernels: Kernels,
    threads: usize,
    crate_peak: f64,
) -> Result<serde_json::Value, BenchError> {
    let driver = driver_peak(kernels, threads);
    // The gemm set is held to the crate's own best; the portable set to its own.
    let peak = match kernels {
        Kernels::Gemm => crate_peak,
        Kernels::Portable | Kernels::Simd => driver,
    };
    let b = a.block_tokens as usize;
    let vocab = model.vocab();

    // Decode: `batch` sequences of 16 prompt tokens, prefilled first, then `steps` timed steps.
    let mut decode = serde_json::Map::new();
    let mut batch1 = f64::NAN;
    for &batch in &a.batches {
        let per = (16 + a.steps as usize + 2).div_ceil(b);
        let pool = SharedKv::new(KvPool::new(model.shape(), per * batch + 1));
        let mut e = Engine::new(model.clone() as Arc<dyn Model>, pool);
        for s in 0..batch {
            let prompt: Vec<u32> = (0..16).map(|t| ((t * 31 + s * 7) as u32) % vocab).collect();
            e.submit(request(prompt, a.steps + 1))?;
        }
        // The first step prefills every sequence and samples its first token.
        e.step();
        let t = Instant::now();
        let mut tokens = 0usize;
        let mut steps = 0;
        while !e.is_idle() {
            tokens += e.step().1.decoded;
            steps += 1;
        }
        let secs = t.elapsed().as_secs_f64();
        let tps = tokens as f64 / secs;
        let steps_per_s = f64::from(steps) / secs;
        if batch == 1 {
            batch1 = tps;
        }
        decode.insert(
            format!("batch_{batch}"),
            serde_json::json!({
                "tokens_per_s": round3(tps),
                "steps_per_s": round3(steps_per_s),
                "decode_over_roofline": round3(steps_per_s / roofline_steps),
            }),
        );
    }
    let batch32_over_batch1 = decode
        .get("batch_32")
        .and_then(|v| v["tokens_per_s"].as_f64())
        .map(|t| round3(t / batch1));

    // Prefill: one prompt, written block by block as the engine does.
    let pool = SharedKv::new(KvPool::new(model.shape(), a.prefill_tokens.div_ceil(b) + 2));
    let mut e = Engine::new(model.clone() as Arc<dyn Model>, pool);
    let prompt: Vec<u32> = (0..a.prefill_tokens)
        .map(|t| ((t * 13 + 5) as u32) % vocab)
        .collect();
    let t = Instant::now();
    e.submit(request(prompt, 1))?;
    while !e.is_idle() {
        e.step();
    }
    let secs = t.elapsed().as_secs_f64();
    let c = model.config();
    let per_token_flops = 2.0
        * (c.layers
            * (c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim
                + c.heads * c.head_dim * c.hidden
                + 3 * c.hidden * c.intermediate)) as f64;
    let prefill_flops = per_token_flops * a.prefill_tokens as f64 / secs;
    Ok(serde_json::json!({
        "decode": decode,
        "batch_32_over_batch_1": batch32_over_batch1,
        "prefill": {
            "tokens": a.prefill_tokens,
            "tokens_per_s": round3(a.prefill_tokens as f64 / secs),
            "gflops": round3(prefill_flops / 1e9),
            "prefill_over_matmul_peak": round3(prefill_flops / peak),
        },
        "driver_square_gflops": round3(driver / 1e9),
        "peak_gflops": round3(peak / 1e9),
    }))
}
