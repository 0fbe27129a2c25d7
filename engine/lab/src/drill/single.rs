//! `tl drill`: the ops.01 failover drill. It starts a gateway, one prefill and two decode engines
//! as processes, drives concurrent streaming clients (greedy and seeded mixed), and at T/3 takes
//! one decode engine away (`kill -9`, or `SIGSTOP` for a hung engine); at 2T/3 it brings it back
//! (a fresh process under the same id, or `SIGCONT`). Every request's tokens are compared with a
//! colocated run of the same request. It prints one JSON line; exit status 0 only when nothing
//! was lost or failed, both pools went back to baseline and the engine rejoined.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::{Value, json};
use tl_engine::api::sse::StreamEvent;
use tl_engine::net::clients::{EventStream, HttpClient};

use super::args::{DrillArgs, Fault};
use super::error::DrillError;
use super::parts::*;
use super::report::{Ends, SingleReport, in_beats};

/// One request as the client saw it.
#[derive(Debug)]
struct Outcome {
    started: Duration,
    ended: Duration,
    verdict: Verdict,
    ttft: Option<Duration>,
    tpot: Option<Duration>,
    max_gap: Duration,
    decode: String,
    /// Decode engines the first Prefill tried before one took the push.
    retries: u64,
}

#[derive(Debug, PartialEq)]
enum Verdict {
    Equal,
    Failed(String),
    Lost(String),
}

/// One client: requests back to back until `end`.
async fn client(
    i: usize,
    http: String,
    t0: Instant,
    end: Instant,
    max_tokens: u32,
    out: Arc<Mutex<Vec<Outcome>>>,
    flowing: Flowing,
) {
    let client = HttpClient::default();
    let mut n = 0;
    while Instant::now() < end {
        let (p, t, seed) = nth_request(i, n);
        n += 1;
        let body = json!({ "prompt": p, "max_tokens": max_tokens, "temperature": t, "seed": seed, "stream": true });
        let started = Instant::now();
        let (got, verdict) = one_request(&client, &http, body.to_string(), &flowing).await;
        let want = colocated(&p, t, seed, max_tokens);
        let verdict = match verdict {
            None if got.tokens == want => Verdict::Equal,
            None => Verdict::Lost(format!(
                "tokens differ from colocated ({} vs {})",
                got.tokens.len(),
                want.len()
            )),
            Some(v) => v,
        };
        let times = &got.times;
        let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
        let o = Outcome {
            started: started - t0,
            ended: t0.elapsed(),
            verdict,
            ttft: times.first().map(|t| *t - started),
            tpot: (times.len() > 1)
                .then(|| (times[times.len() - 1] - times[0]) / (times.len() as u32 - 1)),
            max_gap: gaps.iter().max().copied().unwrap_or_default(),
            decode: got.decode,
            retries: got.retries,
        };
        // After an error the next request waits a moment, as a client library's retry would.
        let refused = o.verdict != Verdict::Equal;
        if let Ok(mut v) = out.lock() {
            v.push(o);
        }
        if refused {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What one streamed request received: its tokens, when each arrived, and the route's decode
/// engine and Prefill retries.
#[derive(Debug, Default)]
struct Got {
    tokens: Vec<u32>,
    times: Vec<Instant>,
    decode: String,
    retries: u64,
}

/// Sends one streamed request; returns what it received, and the verdict when already decided
/// (failed, lost; `None` when it completed and remains to be compared).
async fn one_request(
    client: &HttpClient,
    http: &str,
    body: String,
    flowing: &Flowing,
) -> (Got, Option<Verdict>) {
    let mut got = Got::default();
    let verdict = receive(client, http, body, &mut got, flowing).await.err();
    flowing.leave(&got.decode);
    (got, verdict)
}

/// Streams whose tokens are flowing, by decode engine, as the drill's clients see them: a
/// stream counts from its first token from an engine to its end. The gateway's own count
/// (`routed_in_flight`) starts at routing, before the prefill: with one prefill engine the
/// clients fall into step, and a victim picked by that count could have every stream still
/// queued for its prefill (then nothing fails over: seen once in CI on a 2-core Zen 4).
#[derive(Clone, Default)]
pub(super) struct Flowing(Arc<Mutex<BTreeMap<String, usize>>>);

impl Flowing {
    fn enter(&self, decode: &str) {
        if let Ok(mut m) = self.0.lock() {
            *m.entry(decode.to_owned()).or_default() += 1;
        }
    }

    fn leave(&self, decode: &str) {
        if let Ok(mut m) = self.0.lock()
            && let Some(n) = m.get_mut(decode)
        {
            *n = n.saturating_sub(1);
        }
    }

    fn on(&self, decode: &str) -> usize {
        self.0
            .lock()
            .ok()
            .and_then(|m| m.get(decode).copied())
            .unwrap_or(0)
    }
}

/// The exchange of [`one_request`]: `Ok` when it completed, else the verdict.
async fn receive(
    client: &HttpClient,
    http: &str,
    body: String,
    got: &mut Got,
    flowing: &Flowing,
) -> Result<(), Verdict> {
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(30),
        client.post_streaming(http, "/v1/completions", &[], body),
    )
    .await
    .map_err(|_| Verdict::Lost("no answer in 30 s".into()))?
    .map_err(|e| Verdict::Lost(format!("no answer: {e}")))?;
    if status != 200 {
        // The error body's message names the cause.
        let text = tokio::time::timeout(Duration::from_secs(5), body.collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let message = serde_json::from_slice::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_default();
        return Err(Verdict::Failed(format!("http_{status}: {message}")));
    }
    let mut events = EventStream::new(body);
    let mut finished = false;
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .map_err(|_| Verdict::Lost("stream silent for 30 s".into()))?
            .ok_or_else(|| Verdict::Lost("stream truncated without an error".into()))?
            .map_err(|e| Verdict::Lost(format!("stream broke: {e}")))?;
        match event {
            StreamEvent::Chunk(c) => {
                if let Some(r) = &c.tl_route {
                    if r.decode != got.decode {
                        // The first token, or a failover to another engine.
                        flowing.leave(&got.decode);
                        flowing.enter(&r.decode);
                        got.decode.clone_from(&r.decode);
                    }
                    got.retries = u64::from(r.retries);
                }
                let now = Instant::now();
                for ch in &c.choices {
                    got.tokens.extend(&ch.tokens);
                    got.times.extend(ch.tokens.iter().map(|_| now));
                    finished |= ch.finish_reason.is_some();
                }
            }
            StreamEvent::Error(e) => {
                return Err(Verdict::Failed(format!("error_event: {}", e.message)));
            }
            StreamEvent::Done if finished => return Ok(()),
            StreamEvent::Done => {
                return Err(Verdict::Lost("[DONE] without a finish reason".into()));
            }
        }
    }
}

/// The sum of `tl_failovers_total` series with `outcome`.
async fn failovers(metrics: &str, outcome: &str) -> u64 {
    let needle = format!("outcome=\"{outcome}\"");
    scrape(metrics).await.map_or(0, |m| {
        m.iter()
            .filter(|(k, _)| k.starts_with("tl_failovers_total{") && k.contains(&needle))
            .map(|(_, v)| *v)
            .sum::<f64>() as u64
    })
}

/// The deployment under the drill: processes of this binary, or the compose file's containers.
#[allow(clippy::large_enum_variant)] // one value per run
enum Cluster {
    Procs {
        d: [Proc; 2],
        p: Proc,
        gw: Proc,
        /// How the gateway was started (to start it again on the same addresses).
        gw_args: Vec<String>,
        /// The registry's port.
        registry_port: String,
        /// Namespaces, with `--netns` (dropped after the processes in them).
        net: Option<crate::netns::Netns>,
        dir: PathBuf,
    },
    Compose(Compose),
}

impl Cluster {
    async fn start(a: &DrillArgs) -> Result<Self, DrillError> {
        if a.fault == Fault::Partition && !a.compose && !a.netns {
            return Err(DrillError::Unsupported(
                "--fault partition needs --compose or --netns",
            ));
        }
        if a.compose {
            return Ok(Self::Compose(Compose::up(&a.image, &a.etcd_image)?));
        }
        let dir = std::env::temp_dir().join(format!(
            "tl-drill-{}-{}",
            std::process::id(),
            tl_engine::net::tls::random_hex::<4>()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let gw_toml = dir.join("gateway.toml");
        std::fs::write(
            &gw_toml,
            format!(
                "[gateway]\nstall_timeout_ms = {}\nmax_failovers = 2\npublic_unauthenticated = true\nunauthenticated_admin = true\n",
                a.stall_ms
            ),
        )
        .map_err(|e| e.to_string())?;
        let net = if a.netns {
            Some(crate::netns::Netns::create().map_err(|e| format!("network namespaces: {e}"))?)
        } else {
            None
        };
        let mut gw_args = vec![
            "gateway".to_owned(),
            "--config".into(),
            gw_toml.to_string_lossy().into_owned(),
        ];
        if let Some(n) = &net {
            // Across namespaces every internal port speaks mutual TLS, with certificates made
            // here; the registry listens on the root side of every link.
            let hosts: Vec<String> = (0..crate::netns::ENGINES).map(|k| n.root_ip(k)).collect();
            gw_args.extend(certs(&dir, "gw", "gateway", &hosts)?);
            gw_args.extend(["--registry-listen".into(), "0.0.0.0:0".into()]);
        }
        let gw = Proc::start(
            &gw_args.iter().map(String::as_str).collect::<Vec<_>>(),
            &dir.join("gateway.log"),
        )?;
        // A restart binds what this one bound.
        let (registry_bind, http, metrics) =
            (gw.addr("registry"), gw.addr("http"), gw.addr("metrics"));
        let registry_bind = match &net {
            Some(_) => format!(
                "0.0.0.0:{}",
                registry_bind.rsplit_once(':').map_or("0", |(_, p)| p)
            ),
            None => registry_bind,
        };
        if let Some(i) = gw_args.iter().position(|a| a == "--registry-listen") {
            gw_args.drain(i..i + 2);
        }
        gw_args.extend([
            "--registry-listen".into(),
            registry_bind,
            "--http-listen".into(),
            http,
            "--metrics-listen".into(),
            metrics,
        ]);
        let registry_port = gw
            .addr("registry")
            .rsplit_once(':')
            .map(|(_, p)| p.to_owned())
            .unwrap_or_default();
        let engine = |k| Self::engine(&dir, k, &registry_port, net.as_ref(), a);
        Ok(Self::Procs {
            p: engine(0)?,
            d: [engine(1)?, engine(2)?],
            gw,
            gw_args,
            registry_port,
            net,
            dir,
        })
    }

    /// Engine `k` (0 the prefill engine, 1 and 2 the decode engines), in its namespace with
    /// `--netns`.
    fn engine(
        dir: &Path,
        k: usize,
        registry_port: &str,
        net: Option<&crate::netns::Netns>,
        a: &DrillArgs,
    ) -> Result<Proc, DrillError> {
        let (id, role) = [("P", "prefill"), ("D1", "decode"), ("D2", "decode")][k];
        let (listen, registry, prefix) = match net {
            Some(n) => (n.engine_ip(k), n.root_ip(k), n.exec(k)),
            None => ("127.0.0.1".to_owned(), "127.0.0.1".to_owned(), Vec::new()),
        };
        let cfg = engine_toml(
            dir,
            id,
            role,
            &format!("{registry}:{registry_port}"),
            &listen,
            a,
        )?;
        let mut args = vec![
            "engine".to_owned(),
            "--config".into(),
            cfg.to_string_lossy().into_owned(),
        ];
        if net.is_some() {
            args.extend(certs(dir, id, role, &[listen])?);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Proc::start_in(&prefix, &args, &dir.join(format!("{id}.log")))
    }

    fn http(&self) -> String {
        match self {
            Self::Procs { gw, .. } => gw.addr("http"),
            Self::Compose(c) => c.http.clone(),
        }
    }

    /// Worker ids of the two decode engines.
    fn decode_ids(&self) -> [&'static str; 2] {
        match self {
            Self::Procs { .. } => ["D1", "D2"],
            Self::Compose(_) => ["d1", "d2"],
        }
    }

    /// The metrics address of the gateway, the prefill engine, or decode engine `i`.
    fn metrics(&self, who: Who) -> Option<String> {
        match (self, who) {
            (Self::Procs { gw, .. }, Who::Gateway) => Some(gw.addr("metrics")),
            (Self::Procs { p, .. }, Who::Prefill) => Some(p.addr("metrics")),
            (Self::Procs { d, .. }, Who::Decode(i)) => Some(d[i].addr("metrics")),
            (Self::Compose(c), Who::Gateway) => c.port("gateway", 9100),
            (Self::Compose(c), Who::Prefill) => c.port("prefill", 9100),
            (Self::Compose(c), Who::Decode(i)) => c.port(["decode-1", "decode-2"][i], 9100),
        }
    }

    fn fault(&mut self, i: usize, f: Fault) -> Result<(), DrillError> {
        match self {
            Self::Procs {
                d,
                net,
                gw,
                gw_args,
                dir,
                ..
            } => {
                match (f, net) {
                    (Fault::RegistryRestart, _) => {
                        gw.signal("KILL");
                        let _ = gw.child.wait();
                        let args: Vec<&str> = gw_args.iter().map(String::as_str).collect();
                        *gw = Proc::start(&args, &dir.join("gateway-restarted.log"))?;
                    }
                    (Fault::Kill, _) => d[i].signal("KILL"),
                    (Fault::Sigstop, _) => d[i].signal("STOP"),
                    (Fault::Partition, Some(n)) => n.cut(i)?,
                    (Fault::Partition, None) => {
                        return Err(DrillError::Unsupported(
                            "--fault partition needs --compose or --netns",
                        ));
                    }
                    (Fault::GatewayKill | Fault::EtcdKill | Fault::EtcdDown, _) => {
                        return Err(DrillError::Unsupported("this fault needs --gateways 2"));
                    }
                }
                Ok(())
            }
            Self::Compose(c) => {
                let service = ["decode-1", "decode-2"][i];
                match f {
                    Fault::GatewayKill | Fault::EtcdKill | Fault::EtcdDown => {
                        Err(DrillError::Unsupported("this fault needs --gateways 2"))
                    }
                    Fault::RegistryRestart => c
                        .docker(&["kill", "-s", "KILL"], "gateway")
                        .and_then(|_| c.docker(&["start"], "gateway")),
                    Fault::Kill => c.docker(&["kill", "-s", "KILL"], service),
                    Fault::Sigstop => c.docker(&["pause"], service),
                    Fault::Partition => {
                        c.docker(&["network", "disconnect", "-f", &c.network()], service)
                    }
                }
                .map(drop)
            }
        }
    }

    fn restore(&mut self, i: usize, f: Fault, a: &DrillArgs) -> Result<(), DrillError> {
        match self {
            Self::Procs {
                d,
                dir,
                registry_port,
                net,
                ..
            } => {
                match (f, &*net) {
                    (Fault::RegistryRestart, _) => {}
                    (Fault::Kill, _) => {
                        d[i] = Self::engine(dir, i + 1, registry_port, net.as_ref(), a)?;
                    }
                    (Fault::Sigstop, _) => d[i].signal("CONT"),
                    (Fault::Partition, Some(n)) => n.mend(i)?,
                    (Fault::Partition, None) => {
                        return Err(DrillError::Unsupported(
                            "--fault partition needs --compose or --netns",
                        ));
                    }
                    (Fault::GatewayKill | Fault::EtcdKill | Fault::EtcdDown, _) => {
                        return Err(DrillError::Unsupported("this fault needs --gateways 2"));
                    }
                }
                Ok(())
            }
            Self::Compose(c) => {
                let service = ["decode-1", "decode-2"][i];
                match f {
                    Fault::GatewayKill | Fault::EtcdKill | Fault::EtcdDown => {
                        Err(DrillError::Unsupported("this fault needs --gateways 2"))
                    }
                    Fault::RegistryRestart => Ok(String::new()),
                    Fault::Kill => c.docker(&["start"], service),
                    Fault::Sigstop => c.docker(&["unpause"], service),
                    Fault::Partition => c.docker(
                        &["network", "connect", "--alias", service, &c.network()],
                        service,
                    ),
                }
                .map(drop)
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Self::Procs { dir, .. } = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Who {
    Gateway,
    Prefill,
    Decode(usize),
}

/// The live workers' ids, from the gateway's `GET /workers`.
async fn live_workers(http: &str) -> Option<Vec<String>> {
    let r = HttpClient::default().get(http, "/workers").await.ok()?;
    let v: Value = serde_json::from_slice(&r.body).ok()?;
    Some(
        v["workers"]
            .as_array()?
            .iter()
            .filter_map(|w| w["worker_id"].as_str().map(str::to_owned))
            .collect(),
    )
}

/// Polls `who`'s metrics until nothing is in use (within 15 s).
async fn back_to_baseline(c: &Cluster, who: Who) -> bool {
    let end = Instant::now() + Duration::from_secs(15);
    while Instant::now() < end {
        if let Some(addr) = c.metrics(who)
            && let Some(m) = scrape(&addr).await
            && in_use(&m) == 0.0
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// The index of a decode engine holding blocks for running sequences (polled up to 2 s; the
/// first otherwise).
async fn busy_decoder(c: &Cluster, flowing: &Flowing) -> usize {
    // The engine with the most streams whose tokens are flowing, once one has two (a stream
    // about to end may finish from what is already in its socket, and then nothing fails
    // over), or the busiest seen in 2 s.
    let ids = c.decode_ids();
    let end = Instant::now() + Duration::from_secs(2);
    let mut best = (0, 0);
    while Instant::now() < end {
        for (i, id) in ids.iter().enumerate() {
            let n = flowing.on(id);
            if n > best.1 {
                best = (i, n);
            }
        }
        if best.1 >= 2 {
            return best.0;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    best.0
}

/// Each request's verdict, counted: equal to colocated, failed (by cause) and lost (by cause).
/// A client connected to the gateway when it was restarted (`faulted`: from the fault's start
/// to its landing) sees its connection cut: an error it can retry on, not a loss.
fn tally(
    outcomes: &[Outcome],
    fault: Fault,
    faulted: std::ops::Range<Duration>,
) -> (usize, BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let mut failed: BTreeMap<String, u64> = BTreeMap::new();
    let mut lost: BTreeMap<String, u64> = BTreeMap::new();
    let mut equal = 0;
    for o in outcomes {
        // A client connected to the gateway when it was killed sees its connection cut: an
        // error it can retry on, not a loss (the gateway is the client's only endpoint).
        if fault == Fault::RegistryRestart
            && matches!(o.verdict, Verdict::Lost(_))
            && o.started <= faulted.end
            && o.ended >= faulted.start
        {
            *failed.entry("gateway_restarted".into()).or_default() += 1;
            continue;
        }
        match &o.verdict {
            Verdict::Equal => equal += 1,
            Verdict::Failed(c) => *failed.entry(c.clone()).or_default() += 1,
            Verdict::Lost(c) => *lost.entry(c.clone()).or_default() += 1,
        }
    }
    (equal, failed, lost)
}

/// The p99 TTFT and TPOT, and the first routes, of the requests started before the fault,
/// during it and after it was restored.
fn by_phase(
    outcomes: &[Outcome],
    fault_time: Duration,
    restore_time: Duration,
) -> (
    serde_json::Map<String, Value>,
    serde_json::Map<String, Value>,
    serde_json::Map<String, Value>,
) {
    let phase = |o: &&Outcome| {
        if o.started < fault_time {
            "before"
        } else if o.started < restore_time {
            "during"
        } else {
            "after"
        }
    };
    let mut ttft = serde_json::Map::new();
    let mut tpot = serde_json::Map::new();
    let mut routes = serde_json::Map::new();
    for ph in ["before", "during", "after"] {
        let mut by: BTreeMap<&str, u64> = BTreeMap::new();
        for o in outcomes.iter().filter(|o| phase(o) == ph) {
            *by.entry(o.decode.as_str()).or_default() += 1;
        }
        routes.insert(ph.into(), json!(by));
        let of = |f: &dyn Fn(&Outcome) -> Option<Duration>| {
            outcomes
                .iter()
                .filter(|o| phase(o) == ph)
                .filter_map(f)
                .collect::<Vec<_>>()
        };
        ttft.insert(ph.into(), p99_ms(of(&|o| o.ttft)));
        tpot.insert(ph.into(), p99_ms(of(&|o| o.tpot)));
    }
    (ttft, tpot, routes)
}

/// What the registry did after the fault, in ms from it, until the restore: after a gateway
/// restart, when the engines had registered again with the new registry; otherwise, when the
/// registry forgot the lost engine (after 3 missed beats).
async fn registry_after_fault(
    http: &str,
    fault: Fault,
    victim_id: &str,
    t0: Instant,
    fault_time: Duration,
    restore_at: Duration,
) -> (Option<f64>, Option<f64>) {
    let since_fault = || Some((t0.elapsed() - fault_time).as_secs_f64() * 1e3);
    while t0.elapsed() < restore_at {
        let live = live_workers(http).await;
        if fault == Fault::RegistryRestart {
            if live.is_some_and(|w| w.len() == 3) {
                return (since_fault(), None);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        } else {
            if live.is_some_and(|w| !w.iter().any(|id| id == victim_id)) {
                return (None, since_fault());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    (None, None)
}

pub(super) async fn run(a: &DrillArgs) -> Result<SingleReport, DrillError> {
    let mut cluster = Cluster::start(a).await?;
    let http = cluster.http();
    let heartbeat_ms = if a.compose { 500 } else { a.heartbeat_ms };
    let end = Instant::now() + Duration::from_secs(60);
    while live_workers(&http).await.map_or(0, |w| w.len()) < 3 {
        if Instant::now() > end {
            return Err("the engines never registered".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let gw_metrics = cluster
        .metrics(Who::Gateway)
        .ok_or("the gateway's metrics are not reachable")?;

    let line = Timeline::start(a.seconds, 1.0);
    let (t0, _total, fault_at, restore_at) = (line.t0, line.total, line.fault_at, line.restore_at);
    let flowing = Flowing::default();
    let (outcomes, mut clients) = start_clients(a.clients.max(1), |i, out| {
        client(
            i,
            http.clone(),
            t0,
            line.end(),
            a.max_tokens,
            out,
            flowing.clone(),
        )
    });

    tokio::time::sleep_until((t0 + fault_at).into()).await;
    // The victim: a decode engine with streams in flight (so that the fault hits requests).
    let v = busy_decoder(&cluster, &flowing).await;
    let victim_metrics = cluster.metrics(Who::Decode(v));
    let used_before = match &victim_metrics {
        Some(m) => scrape(m).await.map(|m| in_use(&m)),
        None => None,
    };
    let ids = cluster.decode_ids();
    let (victim_id, survivor_id) = (ids[v], ids[1 - v]);
    let fault_start = t0.elapsed();
    cluster.fault(v, a.fault)?;
    // Once the fault has landed (a `docker` command takes a moment).
    let fault_time = t0.elapsed();
    let (reregistered_ms, evicted_ms) =
        registry_after_fault(&http, a.fault, victim_id, t0, fault_time, restore_at).await;
    tokio::time::sleep_until((t0 + restore_at).into()).await;
    let restore_time = t0.elapsed();
    cluster.restore(v, a.fault, a)?;
    while clients.join_next().await.is_some() {}

    let prefill_back = back_to_baseline(&cluster, Who::Prefill).await;
    let survivor_back = back_to_baseline(&cluster, Who::Decode(1 - v)).await;
    let restored_back = back_to_baseline(&cluster, Who::Decode(v)).await;
    let resumed = failovers(&gw_metrics, "resumed").await;
    let gave_up = failovers(&gw_metrics, "gave_up").await;

    let outcomes = std::mem::take(&mut *outcomes.lock().map_err(|e| e.to_string())?);
    let (equal, failed, lost) = tally(&outcomes, a.fault, fault_start..fault_time);
    let (ttft, tpot, routes) = by_phase(&outcomes, fault_time, restore_time);
    // Requests in flight when the fault landed: their longest wait between two tokens (the
    // failover's cost, for those that failed over) against that of undisturbed requests.
    let hit: Vec<Duration> = outcomes
        .iter()
        .filter(|o| o.started < fault_time && o.ended > fault_time && o.decode == victim_id)
        .map(|o| o.max_gap)
        .collect();
    let undisturbed: Vec<Duration> = outcomes
        .iter()
        .filter(|o| o.ended < fault_time)
        .map(|o| o.max_gap)
        .collect();
    let rejoined = outcomes
        .iter()
        .any(|o| o.started > restore_time && o.decode == victim_id && o.verdict == Verdict::Equal);
    let retried = outcomes.iter().filter(|o| o.retries > 0).count();
    let ends = Ends::new(outcomes.len(), equal as u64, failed, lost);
    let passed = match a.fault {
        Fault::RegistryRestart => {
            ends.failed_by_cause
                .keys()
                .all(|k| k == "gateway_restarted")
                && ends.lost == 0
                && prefill_back
                && survivor_back
                && restored_back
                && reregistered_ms.is_some()
        }
        _ => ends.failed == 0 && ends.lost == 0 && prefill_back && survivor_back && rejoined,
    };
    // What a failover costs the client: the extra wait for the next token.
    let failover_extra_ms = match (
        p50_ms(hit.clone()).as_f64(),
        p50_ms(undisturbed.clone()).as_f64(),
    ) {
        (Some(h), Some(u)) => Some(((h - u) * 100.0).round() / 100.0),
        _ => None,
    };
    let report = SingleReport {
        drill: "ops.01",
        fault: format!("{:?}", a.fault).to_lowercase(),
        mode: if a.compose {
            "containers"
        } else if a.netns {
            "netns"
        } else {
            "processes"
        },
        clients: a.clients,
        seconds: a.seconds,
        ends,
        failovers: resumed,
        failovers_gave_up: gave_up,
        prefill_retried_on_another_decode: retried,
        p99_ttft_ms: ttft,
        p99_tpot_ms: tpot,
        first_routes: routes,
        in_flight_at_fault_on_victim: hit.len(),
        failover_extra_ms,
        p50_max_gap_ms_in_flight_at_fault: p50_ms(hit),
        p50_max_gap_ms_undisturbed: p50_ms(undisturbed),
        prefill_pool_back_to_baseline: prefill_back,
        survivor_pool_back_to_baseline: survivor_back,
        restored_pool_back_to_baseline: restored_back,
        victim: victim_id,
        victim_blocks_in_use_before_fault: used_before,
        survivor: survivor_id,
        heartbeat_ms,
        evicted_after_ms: evicted_ms,
        evicted_within_beats: in_beats(evicted_ms, heartbeat_ms),
        rejoined,
        reregistered_after_ms: reregistered_ms,
        reregistered_within_beats: in_beats(reregistered_ms, heartbeat_ms),
        passed,
    };
    drop(cluster);
    Ok(report)
}
