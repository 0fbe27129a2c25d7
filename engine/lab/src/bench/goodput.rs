//! `tl bench goodput`: DistServe's comparison on the same number of engines. Goodput is the
//! highest request rate at which 90% of requests meet both a TTFT and a TPOT SLO. Each
//! topology serves the same seeded open-loop Poisson trace, topologies alternated at every
//! rate, rates swept upwards until each falls below 90%, for each long-prompt fraction.
//!
//! The engines run the fake model with the GPU-like cost model (`CostModel::llama3_8b_h100`,
//! every cost multiplied by `--time-scale`, so that the 2-core host that runs the gateway, the
//! engines and the client is not what saturates first; the CPU each run used is printed).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tl_engine::api::sse::StreamEvent;
use tl_engine::api::{CompletionRequest, GenerationParams, Prompt};
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::roles::PlannerSection;
use tl_engine::net::clients::{EventStream, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};

use super::{BenchError, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench goodput`.
#[derive(clap::Args, Debug, Clone)]
pub struct GoodputArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// Topologies, `NAME=SPEC` (comma-separated): SPEC is `gw:` (the gateway routes), `gwp:`
    /// (the gateway routes and its planner moves engines between roles: its prefill and decode
    /// engines are engines of role both that start serving as such) or `rr:` (the client
    /// spreads requests round-robin over the engines' fronts; `both` engines only), then
    /// engine counts such as `1p2d`, `3b`, `1p1d1b`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "A=gw:1p2d,Ap=gwp:1p2d,B=gw:3b,Bd=rr:3b"
    )]
    topology: Vec<String>,
    /// Fractions of requests with a long prompt, each a sweep of its own.
    #[arg(long, value_delimiter = ',', default_value = "0,0.1,0.3,0.5")]
    long_fraction: Vec<f64>,
    /// Request rates (requests/s) to run; empty: swept from `--rate-start` by `--rate-step`
    /// until every topology falls below 90% attainment or `--max-points` rates ran.
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// First rate of the sweep; 0: a quarter of the prefill capacity the costs give.
    #[arg(long, default_value_t = 0.0)]
    rate_start: f64,
    /// Factor between successive rates of the sweep.
    #[arg(long, default_value_t = 1.3)]
    rate_step: f64,
    /// Rates at most per sweep.
    #[arg(long, default_value_t = 10)]
    max_points: usize,
    /// Requests per point (at least this many; see `--seconds`).
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Make each point's trace `rate x seconds` requests long instead (a smoke run).
    #[arg(long)]
    seconds: Option<f64>,
    /// Tokens generated per request (every request generates exactly this many).
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Short prompts: uniform in this range of tokens.
    #[arg(long, default_value_t = 64)]
    short_min: usize,
    #[arg(long, default_value_t = 256)]
    short_max: usize,
    /// Long prompts: uniform in this range of tokens.
    #[arg(long, default_value_t = 2048)]
    long_min: usize,
    #[arg(long, default_value_t = 3800)]
    long_max: usize,
    /// Every simulated cost is Llama-3-8B on one H100 times this.
    #[arg(long, default_value_t = 4.0)]
    time_scale: f64,
    /// Per-step token budget of every engine (chunked prefill); 0: off.
    #[arg(long, default_value_t = 512)]
    max_step_tokens: usize,
    /// TTFT SLO, ms; default: 4 x the simulated prefill of the longest prompt.
    #[arg(long)]
    ttft_slo_ms: Option<f64>,
    /// TPOT SLOs, ms, each a column of its own; default: 1.5 and 3 x a decode step of one
    /// sequence.
    #[arg(long, value_delimiter = ',')]
    tpot_slo_ms: Vec<f64>,
    /// Seed of the traces.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write attainment against rate for every topology here, as SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// Where requests go and which engines serve them.
#[derive(Clone, Debug, PartialEq)]
struct Topology {
    name: String,
    /// The gateway routes (else the client round-robins over the fronts).
    gateway: bool,
    /// The gateway's planner moves engines between roles.
    planner: bool,
    prefill: usize,
    decode: usize,
    both: usize,
}

impl Topology {
    fn engines(&self) -> usize {
        self.prefill + self.decode + self.both
    }
}

/// Parses `NAME=gw:1p2d` and the like.
fn parse_topology(s: &str) -> Result<Topology, BenchError> {
    let bad = || -> BenchError {
        format!(
            "topology {s:?}: expected NAME=gw:COUNTS, NAME=gwp:COUNTS or NAME=rr:COUNTS (e.g. A=gw:1p2d)"
        )
        .into()
    };
    let (name, spec) = s.split_once('=').ok_or_else(bad)?;
    let (how, counts) = spec.split_once(':').ok_or_else(bad)?;
    let (gateway, planner) = match how {
        "gw" => (true, false),
        "gwp" => (true, true),
        "rr" => (false, false),
        _ => return Err(bad()),
    };
    let mut t = Topology {
        name: name.trim().to_owned(),
        gateway,
        planner,
        prefill: 0,
        decode: 0,
        both: 0,
    };
    let mut digits = String::new();
    for c in counts.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let n: usize = digits.parse().map_err(|_| bad())?;
        digits.clear();
        match c {
            'p' => t.prefill += n,
            'd' => t.decode += n,
            'b' => t.both += n,
            _ => return Err(bad()),
        }
    }
    if !digits.is_empty() || t.name.is_empty() || t.engines() == 0 {
        return Err(bad());
    }
    if !gateway && (t.prefill > 0 || t.decode > 0) {
        return Err(format!(
            "topology {s:?}: round-robin over fronts serves with `both` engines only"
        )
        .into());
    }
    if gateway && t.both == 0 && (t.prefill == 0 || t.decode == 0) {
        return Err(format!(
            "topology {s:?}: needs a prefill and a decode engine, or a both engine"
        )
        .into());
    }
    Ok(t)
}

/// The simulated costs, microseconds.
#[derive(Clone, Copy, Debug)]
struct Costs {
    prefill_us_per_token: u64,
    decode_us_per_seq: u64,
    decode_us_per_step: u64,
}

impl Costs {
    fn scaled(k: f64) -> Self {
        let base = tl_engine_core::cost::CostModel::llama3_8b_h100();
        let us = |d: Duration| ((d.as_secs_f64() * 1e6 * k).round() as u64).max(1);
        Self {
            prefill_us_per_token: us(base.prefill_per_token),
            decode_us_per_seq: us(base.decode_per_seq),
            decode_us_per_step: us(base.decode_per_step),
        }
    }

    /// A decode step of `batch` sequences, ms.
    fn step_ms(&self, batch: u64) -> f64 {
        (self.decode_us_per_step + self.decode_us_per_seq * batch) as f64 / 1e3
    }

    /// The prefill of `tokens`, ms.
    fn prefill_ms(&self, tokens: usize) -> f64 {
        (self.prefill_us_per_token * tokens as u64) as f64 / 1e3
    }
}

/// A small seeded generator (splitmix64): the trace is the same for every topology and run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi.saturating_sub(lo) as u64 + 1)) as usize
    }
}

/// One request of a trace.
#[derive(Clone, Debug)]
struct Arrival {
    /// Seconds after the start.
    at: f64,
    prompt: Arc<Vec<u32>>,
    long: bool,
    seed: u64,
}

/// `n` Poisson arrivals at `rate`, a `long_fraction` of them with long prompts.
fn trace(a: &GoodputArgs, n: usize, rate: f64, long_fraction: f64, seed: u64) -> Vec<Arrival> {
    let mut rng = Rng(seed ^ 0x5EED_0000);
    let mut at = 0.0;
    (0..n)
        .map(|i| {
            at += -(1.0 - rng.unit()).ln() / rate;
            let long = rng.unit() < long_fraction;
            let len = if long {
                rng.range(a.long_min, a.long_max)
            } else {
                rng.range(a.short_min, a.short_max)
            };
            // Distinct prompts: no request shares a prefix with another.
            let prompt = (0..len).map(|_| (rng.next() % 256) as u32).collect();
            Arrival {
                at,
                prompt: Arc::new(prompt),
                long,
                seed: seed.wrapping_mul(1_000_003).wrapping_add(i as u64),
            }
        })
        .collect()
}

/// What one request saw.
#[derive(Clone, Debug, Default)]
struct Outcome {
    error: Option<String>,
    ttft: f64,
    /// Mean time per output token after the first.
    tpot: f64,
    /// Gaps between successive token arrivals.
    itl: Vec<f64>,
    e2e: f64,
    long: bool,
}

async fn one(http: HttpClient, addr: String, body: Vec<u8>, long: bool) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome {
        long,
        ..Outcome::default()
    };
    let res = http
        .post_streaming(&addr, "/v1/completions", &[], body)
        .await;
    let body = match res {
        Ok((200, body)) => body,
        Ok((status, _)) => {
            out.error = Some(format!("answered {status}"));
            return out;
        }
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    let mut events = EventStream::new(body);
    let mut times = Vec::new();
    while let Some(event) = events.next().await {
        match event {
            Ok(StreamEvent::Chunk(c)) => {
                let n: usize = c.choices.iter().map(|c| c.tokens.len()).sum();
                if n > 0 {
                    let now = start.elapsed().as_secs_f64();
                    times.extend(std::iter::repeat_n(now, n));
                }
            }
            Ok(StreamEvent::Error(e)) => {
                out.error = Some(e.message);
                return out;
            }
            Ok(StreamEvent::Done) => break,
            Err(e) => {
                out.error = Some(e.to_string());
                return out;
            }
        }
    }
    let Some(&first) = times.first() else {
        out.error = Some("no token".into());
        return out;
    };
    let last = times[times.len() - 1];
    out.ttft = first;
    out.e2e = start.elapsed().as_secs_f64();
    out.tpot = if times.len() > 1 {
        (last - first) / (times.len() - 1) as f64
    } else {
        0.0
    };
    out.itl = times.windows(2).map(|w| w[1] - w[0]).collect();
    out
}

/// The engines (and gateway) of one topology, started for one run.
struct Running {
    gateway: Option<GatewayNode>,
    engines: Vec<(String, EngineNode)>,
}

impl Running {
    async fn start(
        t: &Topology,
        c: Costs,
        a: &GoodputArgs,
        marks: &PlannerSection,
    ) -> Result<Self, BenchError> {
        use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
        let gateway = if t.gateway {
            let mut cfg = GatewayConfig {
                gateway: GatewaySection {
                    max_inflight: 4096,
                    ..GatewaySection::local()
                },
                ..GatewayConfig::local()
            };
            if t.planner {
                cfg.planner = marks.clone();
            }
            cfg.limits.http_max_conns_per_ip = 4096;
            cfg.limits.http_max_inflight = 4096;
            Some(GatewayNode::start(&cfg).await?)
        } else {
            None
        };
        let reg = gateway
            .as_ref()
            .map(|g| g.registry_addr().to_string())
            .unwrap_or_default();
        let mut engines = Vec::new();
        let roles = std::iter::repeat_n((Role::Prefill, "P"), t.prefill)
            .chain(std::iter::repeat_n((Role::Decode, "D"), t.decode))
            .chain(std::iter::repeat_n((Role::Both, "B"), t.both));
        for (i, (role, tag)) in roles.enumerate() {
            let id = format!("{tag}{i}");
            // Under the planner, every engine can take either role.
            let mut cfg = if t.planner {
                let mut c = Config::for_worker(&id, Role::Both, &reg);
                c.engine.serving = Some(role);
                c
            } else {
                Config::for_worker(&id, role, &reg)
            };
            cfg.engine.heartbeat_ms = 100;
            cfg.engine.max_step_tokens = a.max_step_tokens;
            cfg.model.prefill_us_per_token = c.prefill_us_per_token;
            cfg.model.decode_us_per_seq = c.decode_us_per_seq;
            cfg.model.decode_us_per_step = c.decode_us_per_step;
            cfg.pool.n_blocks = 65_536;
            cfg.limits.http_max_conns_per_ip = 4096;
            cfg.limits.http_max_inflight = 4096;
            cfg.limits.max_pending_handles = 4096;
            cfg.limits.max_pushes = 1024;
            engines.push((id, EngineNode::start(&cfg).await?));
        }
        if let Some(g) = &gateway {
            let end = Instant::now() + Duration::from_secs(10);
            while g.registry().list(Instant::now()).len() < engines.len() {
                if Instant::now() > end {
                    return Err("the engines did not register within 10 s".into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(Self { gateway, engines })
    }

    /// Where the client sends requests: the gateway, or every engine's front in turn.
    fn targets(&self) -> Vec<String> {
        match &self.gateway {
            Some(g) => vec![g.http_addr().to_string()],
            None => self
                .engines
                .iter()
                .map(|(_, e)| e.addresses().http)
                .collect(),
        }
    }

    /// Requests each engine took: prefills or whole requests submitted, decodes resumed.
    fn split(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (id, e) in &self.engines {
            let load = e.runner().load();
            m.insert(
                id.clone(),
                serde_json::json!({
                    "submitted": load.submitted(),
                    "resumed": load.resumed(),
                    "serving_at_end": e.state().serving().name(),
                }),
            );
        }
        m.into()
    }

    async fn stop(self) {
        for (_, e) in self.engines {
            e.shutdown(Duration::from_secs(1)).await;
        }
        if let Some(g) = self.gateway {
            g.stop().await;
        }
    }
}

/// CPU seconds this process has used (user + system), from `/proc/self/stat`.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command (which may hold spaces) start at the state, field 3.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 (indices 11 and 12 here), in clock ticks of 100 Hz.
    (tick(11) + tick(12)) / 100.0
}

/// Rates below the sweep's first tried for a topology that missed an SLO there.
const DOWN_STEPS: usize = 3;

/// One rate of a sweep: one seeded trace of `rate` with `lf` long prompts, run by every
/// topology `run_here` selects, each on freshly started engines. The point's JSON, and each
/// topology's attainment per TPOT SLO (`None`: not run).
#[allow(clippy::too_many_arguments)]
async fn point(
    topologies: &[Topology],
    run_here: &[bool],
    c: Costs,
    a: &GoodputArgs,
    marks: &PlannerSection,
    slos: &Slos,
    rate: f64,
    lf: f64,
    seed: u64,
) -> Result<(serde_json::Value, Vec<Option<Vec<f64>>>), BenchError> {
    let n = match a.seconds {
        Some(s) => ((rate * s).ceil() as usize).max(1),
        None => a.requests.max(1),
    };
    let arrivals = trace(a, n, rate, lf, seed);
    let mut row = serde_json::Map::new();
    let mut atts = vec![None; topologies.len()];
    for (ti, t) in topologies.iter().enumerate() {
        if !run_here[ti] {
            continue;
        }
        let run = run_trace(t, c, a, marks, &arrivals).await?;
        atts[ti] = Some(
            slos.tpot_ms
                .iter()
                .map(|&tp| attainment(&run.outcomes, slos.ttft_ms, tp))
                .collect(),
        );
        row.insert(t.name.clone(), summary(&run, slos, rate));
    }
    let p = serde_json::json!({ "request_rate": round3(rate), "requests": n, "topologies": row });
    Ok((p, atts))
}

/// The longest one request of a run may take.
const REQUEST_DEADLINE: Duration = Duration::from_secs(120);

/// One topology serving one trace.
struct Run {
    outcomes: Vec<Outcome>,
    wall: f64,
    cpu: f64,
    split: serde_json::Value,
    /// Role changes the planner made (0 without one).
    role_changes: u64,
}

async fn run_trace(
    t: &Topology,
    c: Costs,
    a: &GoodputArgs,
    marks: &PlannerSection,
    arrivals: &[Arrival],
) -> Result<Run, BenchError> {
    let fleet = Running::start(t, c, a, marks).await?;
    let targets = fleet.targets();
    let http = HttpClient::default();
    let cpu0 = cpu_seconds();
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(arrivals.len());
    for (i, r) in arrivals.iter().enumerate() {
        let req = CompletionRequest {
            prompt: Prompt::Tokens(r.prompt.to_vec()),
            params: GenerationParams {
                max_tokens: Some(a.max_tokens),
                min_tokens: Some(a.max_tokens),
                stream: Some(true),
                seed: Some(r.seed),
                temperature: Some(1.0),
                ..GenerationParams::default()
            },
        };
        let body = serde_json::to_vec(&req)?;
        let addr = targets[i % targets.len()].clone();
        tokio::time::sleep_until(start + Duration::from_secs_f64(r.at)).await;
        let (http, long) = (http.clone(), r.long);
        // Every wait has a deadline: a request that never ends counts as failed, not as a
        // bench that never ends.
        tasks.push(tokio::spawn(async move {
            tokio::time::timeout(REQUEST_DEADLINE, one(http, addr, body, long))
                .await
                .unwrap_or_else(|_| Outcome {
                    error: Some(format!("no end within {} s", REQUEST_DEADLINE.as_secs())),
                    long,
                    ..Outcome::default()
                })
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await?);
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let split = fleet.split();
    let role_changes = fleet.gateway.as_ref().map_or(0, |g| {
        g.gateway()
            .metrics()
            .encode()
            .lines()
            .filter(|l| l.starts_with("tl_role_changes_total{") && l.contains("outcome=\"ok\""))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>() as u64
    });
    fleet.stop().await;
    Ok(Run {
        outcomes,
        wall,
        cpu,
        split,
        role_changes,
    })
}

fn pct(v: &[f64], p: f64) -> f64 {
    super::serve::pct(&mut v.to_vec(), p)
}

/// The planner's marks for topologies with one: its defaults, but a decode engine counts as
/// loaded at 80% of the batch whose simulated step takes the tightest TPOT SLO, so it moves
/// engines to decode before the SLO is missed.
fn planner_marks(c: Costs, slos: &Slos) -> PlannerSection {
    let tight = slos.tpot_ms.iter().copied().fold(f64::MAX, f64::min);
    let per_seq = (c.decode_us_per_seq as f64 / 1e3).max(1e-3);
    let batch = ((tight - c.step_ms(0)) / per_seq).max(5.0);
    PlannerSection {
        enabled: true,
        cooldown_ms: 2_000,
        decode_running_high: 0.8 * batch,
        ..PlannerSection::default()
    }
}

/// The SLOs every request is held to.
#[derive(Clone, Debug)]
struct Slos {
    ttft_ms: f64,
    tpot_ms: Vec<f64>,
}

/// Fraction of requests meeting the TTFT SLO and `tpot_ms` (a failed request meets none).
fn attainment(o: &[Outcome], ttft_ms: f64, tpot_ms: f64) -> f64 {
    if o.is_empty() {
        return 0.0;
    }
    let met = o
        .iter()
        .filter(|r| r.error.is_none() && r.ttft * 1e3 <= ttft_ms && r.tpot * 1e3 <= tpot_ms)
        .count();
    met as f64 / o.len() as f64
}

/// A run's figures, with `vllm bench serve`'s names.
fn summary(run: &Run, slos: &Slos, rate: f64) -> serde_json::Value {
    let ok: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.error.is_none()).collect();
    let ms = |f: &dyn Fn(&Outcome) -> f64| -> Vec<f64> { ok.iter().map(|o| f(o) * 1e3).collect() };
    let ttft = ms(&|o| o.ttft);
    let tpot = ms(&|o| o.tpot);
    let itl: Vec<f64> = ok
        .iter()
        .flat_map(|o| o.itl.iter().map(|x| x * 1e3))
        .collect();
    let e2e = ms(&|o| o.e2e);
    let long_ttft: Vec<f64> = ok.iter().filter(|o| o.long).map(|o| o.ttft * 1e3).collect();
    let pcts = |v: &[f64]| {
        serde_json::json!({
            "mean": round3(if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 }),
            "p50": round3(pct(v, 50.0)), "p90": round3(pct(v, 90.0)), "p99": round3(pct(v, 99.0)),
        })
    };
    let mut att = serde_json::Map::new();
    let mut goodput = serde_json::Map::new();
    for &tp in &slos.tpot_ms {
        let a = attainment(&run.outcomes, slos.ttft_ms, tp);
        att.insert(format!("{tp}"), round3(a).into());
        goodput.insert(
            format!("{tp}"),
            round3(a * run.outcomes.len() as f64 / run.wall).into(),
        );
    }
    let errors: Vec<&str> = run
        .outcomes
        .iter()
        .filter_map(|o| o.error.as_deref())
        .collect();
    serde_json::json!({
        "request_rate": round3(rate),
        "completed": ok.len(),
        "failed": errors.len(),
        "first_error": errors.first(),
        "request_throughput": round3(ok.len() as f64 / run.wall),
        "request_goodput": goodput,
        "attainment": att,
        "ttft_ms": pcts(&ttft),
        "ttft_ms_long_prompts": pcts(&long_ttft),
        "tpot_ms": pcts(&tpot),
        "itl_ms": pcts(&itl),
        "e2el_ms": pcts(&e2e),
        "duration_s": round3(run.wall),
        "cpu_cores_used": round3(run.cpu / run.wall),
        "engine_split": run.split,
        "role_changes": run.role_changes,
    })
}

/// Runs `tl bench goodput`.
#[must_use]
pub fn goodput(args: &GoodputArgs) -> ExitCode {
    block_on(async { print_json(bench(args).await) })
}

/// One topology's points of one sweep: (rate, attainment per TPOT SLO).
type Curve = Vec<(f64, Vec<f64>)>;

/// Calibration: requests one at a time, measured against what the costs say a request alone
/// takes (its prefill; a decode step of one sequence per token).
async fn calibrate(
    topologies: &[Topology],
    c: Costs,
    a: &GoodputArgs,
    marks: &PlannerSection,
) -> Result<serde_json::Map<String, serde_json::Value>, BenchError> {
    let mut calibration = serde_json::Map::new();
    for t in topologies {
        let mut one_by_one = trace(a, 4, 1.0, 0.5, a.seed ^ 0xCA11);
        for (i, r) in one_by_one.iter_mut().enumerate() {
            r.at = i as f64
                * (c.prefill_ms(a.long_max) / 1e3
                    + 0.1
                    + f64::from(a.max_tokens) * c.step_ms(1) / 1e3);
        }
        let run = run_trace(t, c, a, marks, &one_by_one).await?;
        let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
        for (o, r) in run.outcomes.iter().zip(&one_by_one) {
            if o.error.is_none() {
                ttft.push(o.ttft * 1e3 / c.prefill_ms(r.prompt.len()));
                tpot.push(o.tpot * 1e3 / c.step_ms(1));
            }
        }
        calibration.insert(
            t.name.clone(),
            serde_json::json!({
                "requests": run.outcomes.len(),
                "ttft_measured_over_simulated": round3(super::median(&mut ttft)),
                "tpot_measured_over_simulated": round3(super::median(&mut tpot)),
            }),
        );
    }
    Ok(calibration)
}

/// Each topology's highest rate at each TPOT SLO, and each pair's ratio of them.
fn rates_at_slo(
    topologies: &[Topology],
    slos: &Slos,
    curve: &[Curve],
) -> (
    serde_json::Map<String, serde_json::Value>,
    serde_json::Map<String, serde_json::Value>,
) {
    let mut max_rate = serde_json::Map::new();
    for (ti, t) in topologies.iter().enumerate() {
        let mut per = serde_json::Map::new();
        for (si, &tp) in slos.tpot_ms.iter().enumerate() {
            per.insert(format!("{tp}"), max_rate_at(&curve[ti], si).into());
        }
        max_rate.insert(t.name.clone(), per.into());
    }
    let mut over = serde_json::Map::new();
    for x in topologies {
        for y in topologies {
            if x.name == y.name {
                continue;
            }
            let mut per = serde_json::Map::new();
            for (si, &tp) in slos.tpot_ms.iter().enumerate() {
                let (rx, ry) = (
                    max_rate_at(&curve[idx(topologies, x)], si),
                    max_rate_at(&curve[idx(topologies, y)], si),
                );
                let r = match (rx, ry) {
                    (Some(rx), Some(ry)) if ry > 0.0 => Some(round3(rx / ry)),
                    _ => None,
                };
                per.insert(format!("{tp}"), r.into());
            }
            over.insert(format!("{}/{}", x.name, y.name), per.into());
        }
    }
    (max_rate, over)
}

/// The rates a sweep tries: those given, else from `--rate-start` (or a quarter of the prefill
/// capacity) up by `--rate-step`.
fn sweep_rates(a: &GoodputArgs, capacity: f64) -> Vec<f64> {
    if !a.rates.is_empty() {
        return a.rates.clone();
    }
    let r0 = if a.rate_start > 0.0 {
        a.rate_start
    } else {
        capacity / 4.0
    };
    (0..a.max_points)
        .map(|i| r0 * a.rate_step.powi(i as i32))
        .collect()
}

async fn bench(a: &GoodputArgs) -> Result<serde_json::Value, BenchError> {
    let topologies: Vec<Topology> = a
        .topology
        .iter()
        .map(|s| parse_topology(s))
        .collect::<Result<_, _>>()?;
    if topologies.is_empty() {
        return Err("no topology".into());
    }
    if a.short_min > a.short_max || a.long_min > a.long_max || a.short_min == 0 {
        return Err("prompt ranges: min must be at least 1 and at most max".into());
    }
    let c = Costs::scaled(a.time_scale);
    let slos = Slos {
        ttft_ms: a.ttft_slo_ms.unwrap_or(4.0 * c.prefill_ms(a.long_max)),
        tpot_ms: if a.tpot_slo_ms.is_empty() {
            vec![round3(1.5 * c.step_ms(1)), round3(3.0 * c.step_ms(1))]
        } else {
            a.tpot_slo_ms.clone()
        },
    };
    // The loosest TPOT SLO's column: a sweep goes on while a topology meets it.
    let loosest = (0..slos.tpot_ms.len())
        .max_by(|&x, &y| slos.tpot_ms[x].total_cmp(&slos.tpot_ms[y]))
        .unwrap_or(0);
    let marks = planner_marks(c, &slos);
    let engines = topologies.iter().map(Topology::engines).max().unwrap_or(1);

    let calibration = calibrate(&topologies, c, a, &marks).await?;

    let mut sweeps = Vec::new();
    let mut curves: BTreeMap<String, Vec<(String, Curve)>> = BTreeMap::new();
    for &lf in &a.long_fraction {
        let avg_prompt = (1.0 - lf) * (a.short_min + a.short_max) as f64 / 2.0
            + lf * (a.long_min + a.long_max) as f64 / 2.0;
        let capacity = engines as f64 / (avg_prompt * c.prefill_us_per_token as f64 / 1e6);
        let rates = sweep_rates(a, capacity);
        let mut points = Vec::new();
        let mut live: Vec<bool> = vec![true; topologies.len()];
        let mut curve: Vec<Curve> = vec![Vec::new(); topologies.len()];
        for (k, &rate) in rates.iter().enumerate() {
            if a.rates.is_empty() && !live.iter().any(|&l| l) {
                break;
            }
            let seed = a.seed.wrapping_add(k as u64);
            let (p, atts) = point(&topologies, &live, c, a, &marks, &slos, rate, lf, seed).await?;
            for (ti, att) in atts.into_iter().enumerate() {
                if let Some(att) = att {
                    live[ti] = att[loosest] >= 0.9;
                    curve[ti].push((rate, att));
                }
            }
            points.push(p);
        }
        // A topology that missed an SLO at the sweep's first rate: lower rates (by the same
        // step, at most DOWN_STEPS), each its own trace shared by the topologies run at it,
        // until it meets every SLO, so its goodput is a figure rather than "below the first".
        if a.rates.is_empty() {
            let r0 = rates.first().copied().unwrap_or(1.0);
            let meets_all = |att: &[f64]| att.iter().all(|&x| x >= 0.9);
            let mut low: Vec<bool> = curve
                .iter()
                .map(|c| !c.first().is_some_and(|(_, att)| meets_all(att)))
                .collect();
            for j in 1..=DOWN_STEPS {
                if !low.iter().any(|&l| l) {
                    break;
                }
                let rate = r0 / a.rate_step.powi(j as i32);
                let seed = a.seed.wrapping_add(1_000 + j as u64);
                let (p, atts) =
                    point(&topologies, &low, c, a, &marks, &slos, rate, lf, seed).await?;
                for (ti, att) in atts.into_iter().enumerate() {
                    if let Some(att) = att {
                        low[ti] = !meets_all(&att);
                        curve[ti].push((rate, att));
                    }
                }
                points.insert(0, p);
            }
            for c in &mut curve {
                c.sort_by(|x, y| x.0.total_cmp(&y.0));
            }
        }
        let (max_rate, over) = rates_at_slo(&topologies, &slos, &curve);
        curves.insert(
            format!("{lf}"),
            topologies
                .iter()
                .zip(curve)
                .map(|(t, c)| (t.name.clone(), c))
                .collect(),
        );
        sweeps.push(serde_json::json!({
            "long_fraction": lf,
            "prefill_capacity_estimate_rps": round3(capacity),
            "max_rate_at_slo": max_rate,
            "goodput_over": over,
            "points": points,
        }));
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, svg(&curves, &slos))?;
    }
    Ok(serde_json::json!({
        "bench": "goodput",
        "cpu": super::cpu_json(),
        "settings": {
            "topologies": topologies.iter().map(|t| serde_json::json!({
                "name": t.name, "routing": if t.gateway { "gateway" } else { "client round-robin over fronts" },
                "planner": t.planner,
                "prefill": t.prefill, "decode": t.decode, "both": t.both,
            })).collect::<Vec<_>>(),
            "cost_model": format!("llama-3-8b-h100 x {}", a.time_scale),
            "prefill_us_per_token": c.prefill_us_per_token,
            "decode_us_per_seq": c.decode_us_per_seq,
            "decode_us_per_step": c.decode_us_per_step,
            "max_step_tokens": a.max_step_tokens,
            "max_tokens": a.max_tokens,
            "short_prompt_tokens": [a.short_min, a.short_max],
            "long_prompt_tokens": [a.long_min, a.long_max],
            "arrivals": "open-loop Poisson, seeded, the same trace for every topology at a rate",
            "requests_per_point": a.seconds.map_or(a.requests.to_string(), |s| format!("rate x {s} s")),
            "seed": a.seed,
            "slo": {
                "ttft_ms": round3(slos.ttft_ms),
                "ttft_derivation": if a.ttft_slo_ms.is_some() { "given" } else { "4 x the simulated prefill of the longest prompt" },
                "tpot_ms": slos.tpot_ms,
                "tpot_derivation": if a.tpot_slo_ms.is_empty() { "1.5 and 3 x a simulated decode step of one sequence" } else { "given" },
                "attainment_goal": 0.9,
            },
            "plot": a.plot.as_ref().map(|p| p.display().to_string()),
            "planner": {
                "interval_ms": marks.interval_ms,
                "cooldown_ms": marks.cooldown_ms,
                "prefill_queue_high": marks.prefill_queue_high,
                "prefill_queue_low": marks.prefill_queue_low,
                "decode_running_high": round3(marks.decode_running_high),
                "decode_running_high_derivation": "0.8 x the batch whose simulated decode step takes the tightest TPOT SLO",
                "smoothing": marks.smoothing,
            },
        },
        "calibration": calibration,
        "sweeps": sweeps,
    }))
}

fn idx(ts: &[Topology], t: &Topology) -> usize {
    ts.iter().position(|x| x.name == t.name).unwrap_or(0)
}

/// The highest rate of `curve` whose attainment for SLO `si` reached 90%, if any did.
fn max_rate_at(curve: &Curve, si: usize) -> Option<f64> {
    curve
        .iter()
        .filter(|(_, att)| att.get(si).is_some_and(|&x| x >= 0.9))
        .map(|(r, _)| round3(*r))
        .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))))
}

/// Attainment against rate: a panel per long-prompt fraction (rows) and TPOT SLO (columns),
/// a line per topology, the 90% goal dashed.
fn svg(curves: &BTreeMap<String, Vec<(String, Curve)>>, slos: &Slos) -> String {
    const W: f64 = 300.0;
    const H: f64 = 200.0;
    const PAD: f64 = 45.0;
    const COLOURS: [&str; 6] = [
        "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let cols = slos.tpot_ms.len().max(1);
    let rows = curves.len().max(1);
    let (width, height) = (
        cols as f64 * (W + PAD) + PAD,
        rows as f64 * (H + PAD) + PAD + 20.0,
    );
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (ri, (lf, lines)) in curves.iter().enumerate() {
        let max_rate = lines
            .iter()
            .flat_map(|(_, c)| c.iter().map(|(r, _)| *r))
            .fold(1e-9, f64::max);
        for (ci, tp) in slos.tpot_ms.iter().enumerate() {
            let (x0, y0) = (PAD + ci as f64 * (W + PAD), PAD + ri as f64 * (H + PAD));
            let x = |r: f64| x0 + r / max_rate * W;
            let y = |a: f64| y0 + (1.0 - a) * H;
            let _ = writeln!(
                s,
                r##"<rect x="{x0}" y="{y0}" width="{W}" height="{H}" fill="none" stroke="#999"/>"##
            );
            let _ = writeln!(
                s,
                r##"<line x1="{x0}" y1="{}" x2="{}" y2="{}" stroke="#999" stroke-dasharray="4 3"/>"##,
                y(0.9),
                x0 + W,
                y(0.9)
            );
            let _ = writeln!(
                s,
                r#"<text x="{x0}" y="{}">long prompts {lf}, TPOT SLO {tp} ms, TTFT SLO {} ms</text>"#,
                y0 - 6.0,
                round3(slos.ttft_ms)
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text><text x="{}" y="{}">0</text>"#,
                x0 + W,
                y0 + H + 14.0,
                round3(max_rate),
                x0,
                y0 + H + 14.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">1</text><text x="{}" y="{}" text-anchor="end">0</text>"#,
                x0 - 4.0,
                y0 + 4.0,
                x0 - 4.0,
                y0 + H
            );
            for (li, (name, curve)) in lines.iter().enumerate() {
                let colour = COLOURS[li % COLOURS.len()];
                let pts: Vec<String> = curve
                    .iter()
                    .filter_map(|(r, att)| {
                        att.get(ci).map(|&a| format!("{:.1},{:.1}", x(*r), y(a)))
                    })
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
                    pts.join(" ")
                );
                for p in &pts {
                    let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{px}" cy="{py}" r="2.5" fill="{colour}"/>"#
                    );
                }
                if ri == 0 && ci == 0 {
                    let _ = writeln!(
                        s,
                        r#"<text x="{}" y="{}" fill="{colour}">{name}</text>"#,
                        PAD + li as f64 * 80.0,
                        height - 8.0
                    );
                }
            }
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">x: requests/s; y: fraction meeting both SLOs</text>"#,
        width - PAD,
        height - 8.0
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topologies_parse_and_bad_ones_are_refused() {
        let t = parse_topology("A=gw:1p2d").unwrap();
        assert_eq!((t.prefill, t.decode, t.both, t.gateway), (1, 2, 0, true));
        let t = parse_topology("M=gw:1p1d1b").unwrap();
        assert_eq!((t.prefill, t.decode, t.both), (1, 1, 1));
        let t = parse_topology("Bd=rr:3b").unwrap();
        assert!(!t.gateway && !t.planner);
        let t = parse_topology("Ap=gwp:1p2d").unwrap();
        assert_eq!(
            (t.prefill, t.decode, t.gateway, t.planner),
            (1, 2, true, true)
        );
        assert!(!parse_topology("A=gw:1p2d").unwrap().planner);
        for bad in [
            "A",
            "A=gw",
            "A=xx:1p",
            "A=gw:1q",
            "A=gw:p",
            "A=gw:1p",
            "A=gwp:1p",
            "A=rr:1p1d",
            "=gw:3b",
            "A=gw:3",
        ] {
            assert!(parse_topology(bad).is_err(), "{bad}");
        }
    }

    /// The planner's decode mark is 80% of the batch whose simulated step takes the tightest
    /// TPOT SLO: (28.98 - 19.16) / 0.16 = 61.4 sequences at 4 x Llama-3-8B/H100, so 49.1.
    #[test]
    fn the_planner_decode_mark_follows_the_tightest_tpot_slo() {
        let c = Costs::scaled(4.0);
        let slos = Slos {
            ttft_ms: 1_000.0,
            tpot_ms: vec![57.96, 28.98],
        };
        let m = planner_marks(c, &slos);
        assert!(m.enabled);
        assert!((m.decode_running_high - 49.1).abs() < 0.1, "{m:?}");
        assert!(m.validate().is_ok());
    }

    #[test]
    fn the_highest_rate_at_ninety_percent_is_the_maximum() {
        let curve: Curve = vec![(1.0, vec![1.0]), (2.0, vec![0.95]), (3.0, vec![0.5])];
        assert_eq!(max_rate_at(&curve, 0), Some(2.0));
        assert_eq!(max_rate_at(&vec![(1.0, vec![0.2])], 0), None);
    }
}
