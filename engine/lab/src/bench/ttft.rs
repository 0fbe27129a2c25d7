//! `tl bench ttft`: time to first token, disaggregated (prefill, HasBlocks, push, resume) against colocated.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use super::{BenchError, ms, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench ttft`.
#[derive(clap::Args, Debug)]
pub struct TtftArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// Prompt sizes, in blocks of 16 tokens at the realistic shape.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 256])]
    blocks: Vec<usize>,
    /// Keep one core busy with a spinning thread for the whole run (the loaded-machine case).
    #[arg(long)]
    busy_core: bool,
    /// Rounds, each timing colocated, serial and pipelined RPC once (in a rotating order); the
    /// medians are kept, and the ratios' medians over the rounds.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Warm one-block pushes timed after the first (one-block row only).
    #[arg(long, default_value_t = 9)]
    single_pushes: usize,
    /// A checkpoint directory to run instead of the fake model at the 2 MiB-block shape
    /// (`tl model init --shape smollm2-135m` writes one); its own shape then.
    #[arg(long)]
    model: Option<String>,
    /// Threads of the decode engine's import lane (`engine.import_threads`; 0: imports run in
    /// place on the async workers, as before the lane).
    #[arg(long)]
    import_threads: Option<usize>,
    /// The nice value of those threads (`engine.import_nice`, 0..=19; the engine's default is 10).
    #[arg(long)]
    import_nice: Option<i32>,
}

/// Rounds at most: each round shifts the prompt's tokens (mod 256) three new ways.
const MAX_ROUNDS: usize = 85;

/// Runs `tl bench ttft`.
#[must_use]
pub fn ttft(args: &TtftArgs) -> ExitCode {
    block_on(async { print_json(ttft_bench(args).await) })
}

async fn ttft_bench(args: &TtftArgs) -> Result<serde_json::Value, BenchError> {
    use std::sync::Arc;

    use kvwire_grpc::{GrpcTransport, KvStore, TransportConfig};

    use tl_engine::node::EngineNode;
    use tl_engine::node::store::PoolStore;
    use tl_engine_core::engine::{Engine, Mode, Request};
    use tl_engine_core::sampler::Sampling;

    if args.repeat > MAX_ROUNDS {
        return Err(format!(
            "--repeat: at most {MAX_ROUNDS} rounds (each needs prompts of its own)"
        )
        .into());
    }
    let spin = args.busy_core.then(Spinner::start);
    let mut rows = Vec::new();
    for &n in &args.blocks {
        let cfg = config_for(args, n)?;
        let shape = cfg.shape();
        let model_name = cfg.build_model()?.name().to_owned();
        let model_name = model_name.as_str();
        let prompt: Vec<u32> = (0..n * 16).map(|i| (i * 7 % 251) as u32).collect();
        let req = |mode| Request {
            prompt: prompt.clone(),
            sampling: Sampling::greedy(),
            seed: 1,
            max_tokens: 1,
            mode,
            draws_offset: 0,
            stop: tl_engine_core::stop::Stop::default(),
            choices: tl_engine_core::engine::Choices::ONE,
            scope: 0,
            earlier_output: 0,
            constraint: None,
        };

        // Colocated: prefill and first token on one long-running engine, as the prefill engine
        // of the RPC rows below is: its pool's pages touched by a first run, then each timed run
        // with the tokens shifted, so nothing is a prefix hit. (A fresh pool per run also timed
        // the kernel faulting in and zeroing its pages, a cost no engine pays twice.) Its timed
        // runs are interleaved with the RPC rows' below, so that each ratio compares runs a few
        // seconds apart, not the machine of one minute against the next.
        let mut solo = Engine::new(cfg.build_model()?, cfg.build_pool());
        let colocated_first = solo.generate(req(Mode::Generate))?;

        // Disaggregated, step by step: prefill here, transfer to a decode engine, resume there.
        let d = EngineNode::start(&cfg).await?;
        let kv = d.addresses().kv;
        let mut p = Engine::new(cfg.build_model()?, cfg.build_pool());
        let t = Instant::now();
        let out = prefill_only(&mut p, req(Mode::PrefillOnly))?;
        let prefill = t.elapsed();
        let transport = GrpcTransport::new(TransportConfig::for_envelope(
            shape.envelope_len(1).unwrap_or(0),
        ));
        let has_blocks = has_blocks_once(&transport, &kv, model_name, &out.hashes, &prompt).await?;
        let store: Arc<dyn KvStore> = Arc::new(PoolStore::new(p.pool().clone()));
        let t = Instant::now();
        let st = kvwire_grpc::transfer(
            &transport,
            store,
            kvwire_grpc::Push {
                target: &kv,
                handle_id: "ttft",
                model: model_name,
                hashes: &out.hashes,
                n_blocks: out.blocks.ids().len(),
                known: None,
                lookup: None,
                tokens: &prompt,
                scope: 0,
            },
            out.blocks.ids(),
        )
        .await?;
        let transfer = t.elapsed();
        // Warm one-block pushes: the tail of a 15-token prompt (no full block, so no HasBlocks
        // and nothing to dedup), five times on the now-warm connection, each handle released.
        let mut warm_single = Vec::new();
        if n == 1 {
            let tail = Request {
                prompt: (0..15).collect(),
                ..req(Mode::PrefillOnly)
            };
            let to = (&transport, kv.as_str(), model_name);
            warm_single = warm_single_pushes(&cfg, tail, to, args.single_pushes).await?;
        }
        let first = out.first_token;
        drop(out);
        let resume = resume_once(&d, &prompt, first).await?;
        // The same prompt through a prefill engine's Prefill RPC, the push after the prefill
        // (serial) and overlapping it (pipelined). Each uses a prompt the decode side does not
        // hold (the tokens shifted), so every block moves. Each round times colocated, serial
        // and pipelined once, in an order that rotates, and the ratios are taken per round.
        let serial = RpcPrefill::start(&cfg, &d, false).await?;
        let pipelined = RpcPrefill::start(&cfg, &d, true).await?;
        let Timed {
            colocated: mut colocated_runs,
            serial: mut serial_runs,
            pipelined: mut pipelined_runs,
            ratio: ratio_runs,
            ratio_serial: mut ratio_serial_runs,
        } = timed_rounds(
            args.repeat.max(1) as u32,
            &prompt,
            &mut |p| {
                let t = Instant::now();
                solo.generate(Request {
                    prompt: p,
                    ..req(Mode::Generate)
                })?;
                Ok(t.elapsed())
            },
            (&serial, &pipelined),
        )
        .await?;
        serial.shutdown().await;
        pipelined.shutdown().await;
        drop(solo);
        let colocated = median(&mut colocated_runs);
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
            "warm_single_push_ms": warm_single.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
            "warm_single_push_p50_ms": (!warm_single.is_empty()).then(|| ms(median(&mut warm_single.clone()))),
            "stepwise_ttft_ms": ms(disagg),
            "prefill_rpc_serial_ms": ms(median(&mut serial_runs)),
            "prefill_rpc_pipelined_ms": ms(median(&mut pipelined_runs)),
            "ttft_ratio_serial": round3(super::median(&mut ratio_serial_runs)),
            "ttft_ratio": round3(super::median(&mut ratio_runs.clone())),
            "ttft_ratio_rounds": ratio_runs.iter().map(|r| round3(*r)).collect::<Vec<_>>(),
            "resume_first_decode_ms": ms(resume),
            "first_token_equal": colocated_first.first() == Some(&first),
        }));
    }
    drop(spin);
    Ok(report(args, rows))
}

/// The engines' configuration for a prompt of `n` blocks.
fn config_for(args: &TtftArgs, n: usize) -> Result<tl_engine::node::config::Config, BenchError> {
    use tl_engine::node::config::{Config, Role};
    let mut cfg = Config::default();
    match &args.model {
        Some(dir) => cfg.set_model(dir),
        None => {
            cfg.model.n_layers = 32;
            cfg.model.n_kv_heads = 8;
            cfg.model.head_dim = 128;
        }
    }
    cfg.model.max_context = 16 * (n as u32 + 8);
    cfg.pool.block_tokens = 16;
    cfg.pool.n_blocks = n as u32 + 8;
    // The push fills nearly the whole pool: keep only one block back for the decode step.
    cfg.limits.decode_reserve_blocks = 1;
    cfg.engine.role = Role::Decode;
    if let Some(t) = args.import_threads {
        cfg.engine.import_threads = t;
    }
    if let Some(n) = args.import_nice {
        cfg.engine.import_nice = n;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Warm one-block pushes: the tail of a 15-token prompt (`tail`: no full block, so no
/// HasBlocks and nothing to dedup), `count` times on the now-warm connection of `transport` to
/// `kv`, each handle released.
async fn warm_single_pushes(
    cfg: &tl_engine::node::config::Config,
    tail: tl_engine_core::engine::Request,
    (transport, kv, model): (&kvwire_grpc::GrpcTransport, &str, &str),
    count: usize,
) -> Result<Vec<Duration>, BenchError> {
    use kvwire_grpc::{KvStore, KvTransport};
    use std::sync::Arc;
    let mut q = tl_engine_core::engine::Engine::new(cfg.build_model()?, cfg.build_pool());
    let small = prefill_only(&mut q, tail)?;
    let store: Arc<dyn KvStore> =
        Arc::new(tl_engine::node::store::PoolStore::new(q.pool().clone()));
    let mut took = Vec::new();
    for i in 0..count {
        let handle = format!("warm-{i}");
        let t = Instant::now();
        kvwire_grpc::transfer(
            transport,
            Arc::clone(&store),
            kvwire_grpc::Push {
                target: kv,
                handle_id: &handle,
                model,
                hashes: &[],
                n_blocks: small.blocks.ids().len(),
                known: None,
                lookup: None,
                tokens: &[],
                scope: 0,
            },
            small.blocks.ids(),
        )
        .await?;
        took.push(t.elapsed());
        transport.release(kv, &handle).await?;
    }
    Ok(took)
}

/// One HasBlocks of `hashes` (the prompt's full blocks) on a connection opened beforehand, as
/// a long-running prefill engine's is: its time.
async fn has_blocks_once(
    transport: &kvwire_grpc::GrpcTransport,
    kv: &str,
    model: &str,
    hashes: &[u64],
    prompt: &[u32],
) -> Result<Duration, BenchError> {
    use kvwire_grpc::KvTransport;
    use kvwire_grpc::pb::kv::HasBlocksRequest;
    let warm = HasBlocksRequest {
        hashes: vec![1],
        kv_format: 1,
        model: model.into(),
        ..HasBlocksRequest::default()
    };
    transport.has_blocks(kv, warm).await?;
    let t = Instant::now();
    let hb = HasBlocksRequest {
        hashes: hashes.to_vec(),
        kv_format: 1,
        model: model.into(),
        tokens: prompt[..hashes.len() * 16].to_vec(),
        cache_scope: 0,
    };
    transport.has_blocks(kv, hb).await?;
    Ok(t.elapsed())
}

/// The decode engine `d` resumes the handle `ttft` over Generate, as a gateway does: the time
/// to its answer (a claim and one decode step).
async fn resume_once(
    d: &tl_engine::node::EngineNode,
    prompt: &[u32],
    first: u32,
) -> Result<Duration, BenchError> {
    use kvwire_grpc::pb::engine::{GenerateRequest, Resume, SamplingParams};
    let t = Instant::now();
    let ctl = tl_engine::net::clients::ControlClient::new(&d.addresses().grpc)?;
    let request = GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        sampling: Some(SamplingParams {
            seed: Some(1),
            max_tokens: 2,
            ..SamplingParams::default()
        }),
        resume: Some(Resume {
            handle_id: "ttft".into(),
            first_token: first,
            rng_draws_consumed: 0,
        }),
        ..GenerateRequest::default()
    };
    tl_engine::node::generate::collect(ctl.generate(request).await?).await?;
    Ok(t.elapsed())
}

/// Each kind's times over the rounds, and each round's ratios over colocated.
struct Timed {
    colocated: Vec<Duration>,
    serial: Vec<Duration>,
    pipelined: Vec<Duration>,
    ratio: Vec<f64>,
    ratio_serial: Vec<f64>,
}

/// `rounds` rounds, each timing colocated (`solo`), serial and pipelined once, in an order that
/// rotates. Token shifts 1..=rounds for colocated, then the next `rounds` for serial and the
/// next for pipelined: no prompt repeats across kinds or rounds (checked below 256 shifts).
async fn timed_rounds(
    rounds: u32,
    prompt: &[u32],
    solo: &mut dyn FnMut(Vec<u32>) -> Result<Duration, BenchError>,
    (serial, pipelined): (&RpcPrefill, &RpcPrefill),
) -> Result<Timed, BenchError> {
    let mut out = Timed {
        colocated: Vec::new(),
        serial: Vec::new(),
        pipelined: Vec::new(),
        ratio: Vec::new(),
        ratio_serial: Vec::new(),
    };
    for round in 0..rounds as usize {
        let k = 1 + round as u32;
        let shifted = |kind: u32| -> Vec<u32> {
            prompt
                .iter()
                .map(|&t| (t + k + kind * rounds) % 256)
                .collect()
        };
        let mut took = [Duration::ZERO; 3];
        for i in 0..3 {
            let which = (round + i) % 3;
            took[which] = match which {
                0 => solo(shifted(0))?,
                1 => serial.run(round, shifted(1)).await?,
                _ => pipelined.run(round, shifted(2)).await?,
            };
        }
        let [c, s, p] = took;
        out.ratio.push(p.as_secs_f64() / c.as_secs_f64());
        out.ratio_serial.push(s.as_secs_f64() / c.as_secs_f64());
        out.colocated.push(c);
        out.serial.push(s);
        out.pipelined.push(p);
    }
    Ok(out)
}

/// The bench's JSON line.
fn report(args: &TtftArgs, rows: Vec<serde_json::Value>) -> serde_json::Value {
    serde_json::json!({
        "bench": "ttft",
        "shape": match &args.model {
            Some(dir) => format!("{dir}: the checkpoint's own L, H, D with B=16, greedy"),
            None => "B=16 L=32 H=8 D=128 (2 MiB blocks), fake model, greedy".to_owned(),
        },
        "busy_core": args.busy_core,
        "cpu": super::cpu_json(),
        "kernel": super::kernel_json(),
        "import_threads": args.import_threads.unwrap_or(tl_engine::node::config::EngineSection::default().import_threads),
        "import_nice": args.import_nice.unwrap_or(tl_engine::node::config::EngineSection::default().import_nice),
        "note": "stepwise: prefill, HasBlocks and push timed apart on an in-process engine (push after prefill); prefill_rpc_*: a prefill engine's whole Prefill RPC (the first token returns with the KvHandle), pushing after the prefill (serial) or each block as it is written (pipelined); ttft_ratio = median over --repeat rounds of pipelined RPC / colocated, each round timing colocated, serial and pipelined once in a rotating order (ttft_ratio_rounds: each round's); single_block_push_over_streamed = median warm one-block push / per-block time of the largest stepwise push, first_push_over_streamed the same for the first push on the connection; resume = claim + one decode step, over Generate",
        "single_block_push_over_streamed": single_over_streamed(&rows, "warm_single_push_p50_ms"),
        "first_push_over_streamed": single_over_streamed(&rows, "push_ms"),
        "rows": rows,
    })
}

/// Submits a prefill-only request to `e` and runs the step that prefills it.
fn prefill_only(
    e: &mut tl_engine_core::engine::Engine,
    req: tl_engine_core::engine::Request,
) -> Result<tl_engine_core::engine::PrefillOutput, BenchError> {
    use tl_engine_core::engine::StepEvent;
    e.submit(req)?;
    Ok(e.step()
        .0
        .into_iter()
        .find_map(|ev| match ev {
            StepEvent::Prefilled { output, .. } => Some(output),
            _ => None,
        })
        .ok_or("prefill produced no output")?)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// A prefill engine, pushing after the prefill or while it runs, that answers Prefill RPCs to
/// the decode engine `d` on a warm connection (a one-token prefill to `d` first).
struct RpcPrefill {
    node: tl_engine::node::EngineNode,
    ctl: tl_engine::net::clients::ControlClient,
    release: kvwire_grpc::GrpcTransport,
    kv: String,
    /// The decode engine's control address, where it answers HasBlocks (as a gateway says).
    lookup: String,
}

impl RpcPrefill {
    async fn start(
        cfg: &tl_engine::node::config::Config,
        d: &tl_engine::node::EngineNode,
        pipelined: bool,
    ) -> Result<Self, BenchError> {
        use kvwire_grpc::{GrpcTransport, KvTransport, TransportConfig};
        use tl_engine::net::clients::ControlClient;
        use tl_engine::node::EngineNode;
        use tl_engine::node::config::Role;

        let mut pc = cfg.clone();
        pc.engine.role = Role::Prefill;
        pc.engine.id = if pipelined { "P-pipelined" } else { "P-serial" }.into();
        pc.engine.push_while_prefilling = pipelined;
        let node = EngineNode::start(&pc).await?;
        let ctl = ControlClient::new(&node.addresses().grpc)?;
        let me = Self {
            node,
            ctl,
            release: GrpcTransport::new(TransportConfig::for_envelope(1 << 10)),
            kv: d.addresses().kv,
            lookup: d.addresses().grpc,
        };
        let warm = me.ctl.prefill(me.request("warm", vec![7])).await?;
        me.release.release(&me.kv, &warm.handle_id).await?;
        Ok(me)
    }

    fn request(&self, id: &str, prompt: Vec<u32>) -> kvwire_grpc::pb::engine::PrefillRequest {
        use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
        PrefillRequest {
            request_id: id.into(),
            prompt_tokens: prompt,
            sampling: Some(SamplingParams {
                seed: Some(1),
                max_tokens: 2,
                ..SamplingParams::default()
            }),
            decode_target: self.kv.clone(),
            rng_draws_offset: 0,
            decode_holds: None,
            cache_scope: 0,
            decode_lookup: self.lookup.clone(),
        }
    }

    /// One Prefill RPC of `prompt` (which the decode side must not hold), timed from call to
    /// KvHandle; the handle is released after the timing.
    async fn run(&self, round: usize, prompt: Vec<u32>) -> Result<Duration, BenchError> {
        use kvwire_grpc::KvTransport;
        let t = Instant::now();
        let h = self
            .ctl
            .prefill(self.request(&format!("timed-{round}"), prompt))
            .await?;
        let took = t.elapsed();
        self.release.release(&self.kv, &h.handle_id).await?;
        Ok(took)
    }

    async fn shutdown(self) {
        self.node.shutdown(Duration::from_secs(1)).await;
    }
}

/// A thread spinning on one core until dropped.
struct Spinner {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut x = 0u64;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A one-block push's time (the one-block row's `key`: the warm median, or the first push on
/// the connection) over the time per block inside the largest push of the run (null when the
/// run has no one-block row or no larger one).
fn single_over_streamed(rows: &[serde_json::Value], key: &str) -> Option<f64> {
    let per_block = |r: &serde_json::Value| Some(r["push_ms"].as_f64()? / r["blocks"].as_f64()?);
    let single = rows
        .iter()
        .find(|r| r["blocks"] == 1)
        .and_then(|r| r[key].as_f64())?;
    let largest = rows
        .iter()
        .filter(|r| r["blocks"].as_u64().unwrap_or(0) > 1)
        .max_by_key(|r| r["blocks"].as_u64().unwrap_or(0))
        .and_then(per_block)?;
    Some(round3(single / largest))
}
