//! `tl bench control`: how long the control plane waits behind compute. Info and HasBlocks
//! latency on a decode engine at the realistic shape, idle, while it decodes a long sequence, and
//! while it imports 256-block pushes; `busy_over_idle_p99` is the worst busy p99 over the idle
//! p99 across both calls and both loads. Idle and importing windows alternate over several
//! rounds and each condition's p99 is over all its rounds' calls.

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
pub struct ControlArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// Calls of each kind per condition (split over the rounds).
    #[arg(long, default_value_t = 300)]
    calls: usize,
    /// Rounds of idle then importing, interleaved so that both conditions see the same spells
    /// of machine noise (a shared host's steal time moves a p99 more than the load does).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Threads of the decode engine's import lane (`engine.import_threads`; 0: imports run
    /// in place on the async workers, as before the lane).
    #[arg(long)]
    import_threads: Option<usize>,
    /// Threads of the decode engine's control runtime (`engine.control_threads`; 0: the
    /// control plane shares the process's runtime, as before it had its own).
    #[arg(long)]
    control_threads: Option<usize>,
    /// Make the calls from the bench's own runtime, which also runs the engine, instead of a
    /// thread and runtime of their own (a caller in another process, as a gateway or a prefill
    /// engine is): then a call's client side also waits for the engine's workers.
    #[arg(long)]
    probe_on_engine_runtime: bool,
    /// Ask HasBlocks on the KV port, where its connection shares the data plane's threads with
    /// the imports, instead of on the control port, where prefill engines ask it when the
    /// gateway names it (`decode_lookup`).
    #[arg(long)]
    has_blocks_on_kv_port: bool,
    /// Probe a prefill engine instead: Info while it prefills 256-block prompts and pushes them
    /// to a decode engine (Prefill RPCs from a thread and runtime of their own, as a gateway's
    /// would be), against Info while it is idle. No HasBlocks (a prefill engine serves none)
    /// and no decoding window.
    #[arg(long)]
    prefill_side: bool,
    /// Prompt tokens of the sequence decoded under load.
    #[arg(long, default_value_t = 4096)]
    decode_tokens: usize,
    /// Run the measured engine's control threads under SCHED_FIFO at this priority
    /// (`engine.control_realtime`), and the prober's thread too: a caller on cores of its own,
    /// as a gateway on another host is, rather than one that waits for these busy cores. Needs
    /// CAP_SYS_NICE; the output says what the kernel granted.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=99))]
    realtime: Option<u8>,
}

/// Runs `tl bench control`.
#[must_use]
pub fn control(args: &ControlArgs) -> ExitCode {
    block_on(async { print_json(control_bench(args).await) })
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[(((p / 100.0) * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)]
}

/// Latencies of Info and of HasBlocks (256 hashes), in ms.
#[derive(Default)]
struct Samples {
    info: Vec<f64>,
    has_blocks: Vec<f64>,
}

impl Samples {
    fn extend(&mut self, other: Samples) {
        self.info.extend(other.info);
        self.has_blocks.extend(other.has_blocks);
    }

    fn summary(&mut self) -> serde_json::Value {
        serde_json::json!({
            "calls": self.info.len(),
            "info_ms_p50": round3(pct(&mut self.info, 50.0)),
            "info_ms_p99": round3(pct(&mut self.info, 99.0)),
            "has_blocks_ms_p50": round3(pct(&mut self.has_blocks, 50.0)),
            "has_blocks_ms_p99": round3(pct(&mut self.has_blocks, 99.0)),
        })
    }
}

/// `n` calls of Info and of HasBlocks, alternating, into `into`.
async fn probe(
    ctl: &ControlClient,
    t: &GrpcTransport,
    kv: Option<&str>,
    n: usize,
    into: &mut Samples,
) -> Result<(), BenchError> {
    let hashes: Vec<u64> = (1..=256).collect();
    for _ in 0..n {
        let s = Instant::now();
        ctl.info().await?;
        into.info.push(s.elapsed().as_secs_f64() * 1e3);
        let Some(kv) = kv else {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        };
        let s = Instant::now();
        let req = HasBlocksRequest {
            hashes: hashes.clone(),
            kv_format: 1,
            model: "fake".into(),
            ..HasBlocksRequest::default()
        };
        t.has_blocks(kv, req).await?;
        into.has_blocks.push(s.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

/// One batch of calls for the prober: how many, and where to send their latencies.
type ProbeJob = (
    usize,
    tokio::sync::oneshot::Sender<Result<Samples, BenchError>>,
);

/// Where the bench's calls come from: a thread with a runtime of its own (a caller in another
/// process: its calls wait for a core, never for the engine's tokio workers), or the bench's
/// own runtime.
enum Prober {
    Own(tokio::sync::mpsc::UnboundedSender<ProbeJob>),
    Shared(Box<(ControlClient, GrpcTransport)>),
}

impl Prober {
    /// The prober, and whether its thread got `realtime` (`None`: not asked, or no thread of
    /// its own).
    fn start(
        own: bool,
        grpc: &str,
        kv: Option<&str>,
        envelope: usize,
        realtime: Option<u8>,
    ) -> Result<(Self, Option<bool>), BenchError> {
        let transport = || GrpcTransport::new(TransportConfig::for_envelope(envelope));
        if !own {
            return Ok((
                Self::Shared(Box::new((ControlClient::new(grpc)?, transport()))),
                None,
            ));
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<ProbeJob>();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Made on the prober's runtime, so their connections are its own.
        let (ctl, t) = {
            let _ctx = rt.enter();
            (ControlClient::new(grpc)?, transport())
        };
        let kv = kv.map(str::to_owned);
        let (granted_tx, granted) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("bench-prober".into())
            .spawn(move || {
                let _ = granted_tx.send(realtime.map(|p| tl_engine::sched::set_fifo(p).is_ok()));
                rt.block_on(async move {
                    while let Some((n, reply)) = rx.recv().await {
                        let mut got = Samples::default();
                        let r = probe(&ctl, &t, kv.as_deref(), n, &mut got).await;
                        let _ = reply
                            .send(r.map(|()| got).map_err(|e| BenchError::from(e.to_string())));
                    }
                });
            })?;
        let granted = granted.recv().map_err(|_| "the prober did not start")?;
        Ok((Self::Own(tx), granted))
    }

    /// `n` calls of each kind, their latencies into `into`.
    async fn run(&self, kv: Option<&str>, n: usize, into: &mut Samples) -> Result<(), BenchError> {
        match self {
            Self::Shared(both) => probe(&both.0, &both.1, kv, n, into).await,
            Self::Own(tx) => {
                let (reply, got) = tokio::sync::oneshot::channel();
                tx.send((n, reply)).map_err(|_| "the prober stopped")?;
                into.extend(got.await.map_err(|_| "the prober stopped")??);
                Ok(())
            }
        }
    }
}

/// What `--realtime` asked and what the kernel granted: the engine's control threads and the
/// prober's thread.
fn realtime_json(
    asked: Option<u8>,
    control: Option<bool>,
    prober: Option<bool>,
) -> serde_json::Value {
    asked.map_or(serde_json::Value::Null, |p| {
        serde_json::json!({
            "priority": p,
            "policy": "SCHED_FIFO",
            "engine_control_granted": control,
            "prober_granted": prober,
        })
    })
}

/// Waits up to 10 s for `cond`.
async fn until(cond: impl Fn() -> bool) -> Result<(), BenchError> {
    let end = Instant::now() + Duration::from_secs(10);
    while !cond() {
        if Instant::now() > end {
            return Err("the load did not follow the bench within 10 s".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// The load's switches: whether it should run, whether it is running, and stop for good.
#[derive(Clone, Default)]
struct Switch {
    active: Arc<AtomicBool>,
    running: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

type LoadThread = std::thread::JoinHandle<Result<u64, BenchError>>;

/// Runs one unit of load after another (`one(n)` for n = 0, 1, ...) while `sw` is active, on a
/// thread and runtime of its own, as another process would: it shares the machine's cores with
/// the engine, not its tokio workers. `make` builds `one` inside that runtime. The thread's
/// result is how many units ran.
fn load_thread<M, F>(sw: &Switch, make: M) -> LoadThread
where
    M: FnOnce() -> Result<F, BenchError> + Send + 'static,
    F: AsyncFnMut(u64) -> Result<(), BenchError>,
{
    let sw = sw.clone();
    std::thread::spawn(move || -> Result<u64, BenchError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let mut one = {
            let _ctx = rt.enter();
            make()?
        };
        rt.block_on(async move {
            let mut n = 0u64;
            while !sw.stop.load(Ordering::Relaxed) {
                if !sw.active.load(Ordering::Relaxed) {
                    sw.running.store(false, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                sw.running.store(true, Ordering::Relaxed);
                one(n).await?;
                n += 1;
            }
            sw.running.store(false, Ordering::Relaxed);
            Ok(n)
        })
    })
}

/// Idle and busy windows alternated over `a.rounds`, so that both see the same spells of
/// machine noise: the calls' latencies while the load is off, and while it is on. Then the
/// load is stopped; its units are returned with the samples.
async fn alternate(
    a: &ControlArgs,
    prober: &Prober,
    lookup: Option<&str>,
    sw: &Switch,
    load: LoadThread,
) -> Result<(Samples, Samples, u64), BenchError> {
    let rounds = a.rounds.max(1);
    let per_round = a.calls.div_ceil(rounds);
    let (mut idle, mut busy) = (Samples::default(), Samples::default());
    let mut result = Ok(());
    for _ in 0..rounds {
        result = async {
            until(|| !sw.running.load(Ordering::Relaxed)).await?;
            // Past the last unit's release and the engine's work after it.
            tokio::time::sleep(Duration::from_millis(200)).await;
            prober.run(lookup, per_round, &mut idle).await?;
            sw.active.store(true, Ordering::Relaxed);
            until(|| sw.running.load(Ordering::Relaxed)).await?;
            // Into the unit, past its negotiation.
            tokio::time::sleep(Duration::from_millis(20)).await;
            prober.run(lookup, per_round, &mut busy).await?;
            sw.active.store(false, Ordering::Relaxed);
            Ok::<_, BenchError>(())
        }
        .await;
        if result.is_err() || load.is_finished() {
            break;
        }
    }
    sw.stop.store(true, Ordering::Relaxed);
    let units = load.join().map_err(|_| "the load thread panicked")??;
    result?;
    Ok((idle, busy, units))
}

async fn control_bench(a: &ControlArgs) -> Result<serde_json::Value, BenchError> {
    if a.prefill_side {
        return prefill_side(a).await;
    }
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
    if let Some(n) = a.import_threads {
        cfg.engine.import_threads = n;
    }
    if let Some(n) = a.control_threads {
        cfg.engine.control_threads = n;
    }
    cfg.engine.control_realtime = a.realtime.unwrap_or(0);
    cfg.validate()?;
    let shape = cfg.shape();
    let d = EngineNode::start(&cfg).await?;
    let (grpc, kv, http) = (d.addresses().grpc, d.addresses().kv, d.addresses().http);
    // Where HasBlocks is asked.
    let lookup = if a.has_blocks_on_kv_port { &kv } else { &grpc };
    let (prober, prober_realtime) = Prober::start(
        !a.probe_on_engine_runtime,
        &grpc,
        Some(lookup),
        shape.envelope_len(1).ok_or("overflow")?,
        a.realtime,
    )?;
    let realtime = realtime_json(a.realtime, d.control_realtime(), prober_realtime);
    // Warm the connections.
    prober.run(Some(lookup), 5, &mut Samples::default()).await?;

    // The importing load: 256-block pushes into the engine, one after another while `active`.
    let src = SharedKv::new(KvPool::new(shape, 256));
    let ids = src.lock().allocate(256)?;
    for &id in &ids {
        src.lock().set_fill(id, 16)?;
    }
    let store: Arc<dyn KvStore> = Arc::new(PoolStore::new(src.clone()));
    let sw = Switch::default();
    let pusher = {
        let (kv, rx) = (kv.clone(), Arc::clone(d.receiver().ok_or("no receiver")?));
        let envelope = shape.envelope_len(1).ok_or("overflow")?;
        load_thread(&sw, move || {
            let t = GrpcTransport::new(TransportConfig::for_envelope(envelope));
            Ok(async move |n: u64| {
                let h = format!("load-{n}");
                // Fresh hashes every push, so nothing is deduplicated: every block is imported.
                let hashes: Vec<u64> = (0..ids.len() as u64).map(|i| (n << 20) + i + 1).collect();
                kvwire_grpc::transfer(
                    &t,
                    Arc::clone(&store),
                    kvwire_grpc::Push {
                        target: &kv,
                        handle_id: &h,
                        model: "fake",
                        hashes: &hashes,
                        n_blocks: ids.len(),
                        known: None,
                        lookup: None,
                        tokens: &[],
                        scope: 0,
                    },
                    &ids,
                )
                .await
                .map_err(|e| e.to_string())?;
                rx.release(&h);
                Ok(())
            })
        })
    };
    let (mut idle, mut importing, pushes) =
        alternate(a, &prober, Some(lookup), &sw, pusher).await?;

    // The decoding load: one long sequence (its prefill first, then steps over its whole KV).
    let prompt: Vec<u32> = (0..a.decode_tokens).map(|i| (i * 7 % 251) as u32).collect();
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": 64, "seed": 1 });
    let decoding = tokio::spawn(async move {
        HttpClient::default()
            .post(&http, "/v1/completions", &[], body.to_string())
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut decode = Samples::default();
    prober
        .run(Some(lookup), a.calls.min(100), &mut decode)
        .await?;
    let r = decoding.await??;
    if r.status != 200 {
        return Err(format!("the long sequence answered {}", r.status).into());
    }
    d.shutdown(Duration::from_secs(2)).await;

    let (idle, while_importing, while_decoding) =
        (idle.summary(), importing.summary(), decode.summary());
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
        "cpu": super::cpu_json(),
        "kernel": super::kernel_json(),
        "shape": "B=16 L=32 H=8 D=128 (2 MiB blocks), fake model",
        "import_threads": cfg.engine.import_threads,
        "import_nice": cfg.engine.import_nice,
        "control_threads": cfg.engine.control_threads,
        "realtime": realtime,
        "has_blocks_on": if a.has_blocks_on_kv_port { "the KV port" } else { "the control port" },
        "probe": if a.probe_on_engine_runtime { "the engine's runtime" } else { "a thread and runtime of its own" },
        "rounds": a.rounds.max(1),
        "idle": idle,
        "while_decoding": while_decoding,
        "decode_prompt_tokens": a.decode_tokens,
        "while_importing": while_importing,
        "pushes_of_256_blocks": pushes,
        "busy_over_idle_p99": round3(worst),
    }))
}

/// `--prefill-side`: Info on a prefill engine, idle and while it prefills and pushes.
async fn prefill_side(a: &ControlArgs) -> Result<serde_json::Value, BenchError> {
    use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
    const BLOCKS: usize = 256;
    let shape_of = |cfg: &mut Config, blocks: usize| {
        cfg.model.n_layers = 32;
        cfg.model.n_kv_heads = 8;
        cfg.model.head_dim = 128;
        cfg.pool.block_tokens = 16;
        cfg.model.max_context = (BLOCKS as u32 + 8) * 16;
        cfg.pool.n_blocks = blocks as u32;
        cfg.limits.decode_reserve_blocks = 1;
    };
    let mut dc = Config::for_worker("D", Role::Decode, "");
    shape_of(&mut dc, 2 * BLOCKS + 16);
    let mut pc = Config::for_worker("P", Role::Prefill, "");
    shape_of(&mut pc, BLOCKS + 16);
    if let Some(n) = a.control_threads {
        pc.engine.control_threads = n;
    }
    pc.engine.control_realtime = a.realtime.unwrap_or(0);
    dc.validate()?;
    pc.validate()?;
    let envelope = pc.shape().envelope_len(1).ok_or("overflow")?;
    let d = EngineNode::start(&dc).await?;
    let p = EngineNode::start(&pc).await?;
    let (p_grpc, d_kv, d_grpc) = (p.addresses().grpc, d.addresses().kv, d.addresses().grpc);
    let (prober, prober_realtime) = Prober::start(
        !a.probe_on_engine_runtime,
        &p_grpc,
        None,
        envelope,
        a.realtime,
    )?;
    let realtime = realtime_json(a.realtime, p.control_realtime(), prober_realtime);
    prober.run(None, 5, &mut Samples::default()).await?;

    // The load: one 256-block Prefill after another, each handle released.
    let sw = Switch::default();
    let loader = {
        let (p_grpc, d_kv, d_grpc) = (p_grpc.clone(), d_kv.clone(), d_grpc.clone());
        load_thread(&sw, move || {
            let ctl = ControlClient::new(&p_grpc).map_err(|e| e.to_string())?;
            let release = GrpcTransport::new(TransportConfig::for_envelope(1 << 10));
            Ok(async move |n: u64| {
                // A prompt of its own each time: nothing is a prefix hit or deduplicated.
                let prompt: Vec<u32> = (0..BLOCKS * 16)
                    .map(|i| ((i as u64 * 7 + n * 13) % 251) as u32)
                    .collect();
                let h = ctl
                    .prefill(PrefillRequest {
                        request_id: format!("load-{n}"),
                        prompt_tokens: prompt,
                        sampling: Some(SamplingParams {
                            seed: Some(1),
                            max_tokens: 2,
                            ..SamplingParams::default()
                        }),
                        decode_target: d_kv.clone(),
                        decode_lookup: d_grpc.clone(),
                        ..PrefillRequest::default()
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                release
                    .release(&d_kv, &h.handle_id)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(())
            })
        })
    };
    let (mut idle, mut busy, prefills) = alternate(a, &prober, None, &sw, loader).await?;
    p.shutdown(Duration::from_secs(2)).await;
    d.shutdown(Duration::from_secs(2)).await;
    let (idle, busy) = (idle.summary(), busy.summary());
    let p99 = |v: &serde_json::Value| v["info_ms_p99"].as_f64().unwrap_or(f64::NAN);
    Ok(serde_json::json!({
        "bench": "control",
        "side": "prefill",
        "cpu": super::cpu_json(),
        "kernel": super::kernel_json(),
        "shape": "B=16 L=32 H=8 D=128 (2 MiB blocks), fake model",
        "control_threads": pc.engine.control_threads,
        "realtime": realtime,
        "probe": if a.probe_on_engine_runtime { "the engine's runtime" } else { "a thread and runtime of its own" },
        "rounds": a.rounds.max(1),
        "idle": idle,
        "while_prefilling_and_pushing": busy,
        "prefills_of_256_blocks": prefills,
        "busy_over_idle_p99": round3(p99(&busy) / p99(&idle)),
    }))
}
