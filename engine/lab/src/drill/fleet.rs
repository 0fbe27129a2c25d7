//! `tl drill --gateways 2`: the drill of what can fail once several gateways share the registry
//! on etcd. Two gateways, one prefill and two decode engines, and etcd (one member, or three for
//! `--fault etcd-kill`) run as processes on loopback. Clients behave as the official `openai`
//! client does: a request that gets no response (connection refused or reset before the
//! answer) or a 502/503/504 is retried, twice, after 0.5 s then 1 s, each retry at the next
//! gateway (as a load balancer that dropped a dead gateway sends it); a stream that breaks
//! after it started is not retried and is counted as cut, on the gateway that carried it. A
//! third of the requests are not streamed.
//!
//! Faults at T/3, undone at 2T/3: `gateway-kill` (SIGKILL of gateway 0, started again on its
//! addresses), `etcd-kill` (SIGKILL of one of three members), `etcd-down` (every member).
//! Every request's tokens are compared with a colocated run; at the end every engine's pool
//! must be back to baseline, and both gateways must list every engine again.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::{Value, json};
use tl_engine::api::sse::StreamEvent;
use tl_engine::etcd::member::{Member, start_cluster};
use tl_engine::net::clients::{EventStream, HttpClient};

use super::args::{DrillArgs, Fault};
use super::error::DrillError;
use super::parts::{
    Compose, Proc, Timeline, colocated, engine_toml, in_use, nth_request, p99_ms, scrape,
    start_clients,
};
use super::report::{Ends, FleetReport};

/// How one request ended, as its client saw it.
#[derive(Debug, Clone, PartialEq)]
enum End {
    /// Its tokens equal a colocated run's.
    Equal,
    /// No answer even after the retries (or an error answer): a failed request.
    Failed(String),
    /// A stream that broke after it started, on gateway `0` or `1`.
    Cut(usize),
    /// Wrong or missing tokens.
    Lost(String),
}

#[derive(Debug)]
struct Outcome {
    started: Duration,
    ended: Duration,
    streamed: bool,
    end: End,
    /// Retries the client made.
    retries: u32,
}

/// A try at one gateway: whether the client would retry it (no response), and the verdict.
enum Try {
    Done(Vec<u32>),
    Retry(String),
    Final(End),
}

fn retryable(status: u16) -> bool {
    matches!(status, 502..=504)
}

async fn whole(http: &HttpClient, gw: &str, body: &str) -> Try {
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        http.post(gw, "/v1/completions", &[], body.to_owned()),
    )
    .await;
    match r {
        Err(_) => Try::Final(End::Lost("no answer in 30 s".into())),
        // Connection refused, reset, or closed before the whole answer: openai retries.
        Ok(Err(e)) => Try::Retry(e.to_string()),
        Ok(Ok(r)) if retryable(r.status) => Try::Retry(format!("http_{}", r.status)),
        Ok(Ok(r)) if r.status != 200 => Try::Final(End::Failed(format!("http_{}", r.status))),
        Ok(Ok(r)) => {
            let v = r.json();
            Try::Done(
                v["choices"][0]["tokens"]
                    .as_array()
                    .map(|t| {
                        t.iter()
                            .filter_map(|x| x.as_u64())
                            .map(|x| x as u32)
                            .collect()
                    })
                    .unwrap_or_default(),
            )
        }
    }
}

async fn streamed(http: &HttpClient, gw: &str, body: &str, which: usize) -> Try {
    let opened = tokio::time::timeout(
        Duration::from_secs(30),
        http.post_streaming(gw, "/v1/completions", &[], body.to_owned()),
    )
    .await;
    let body = match opened {
        Err(_) => return Try::Final(End::Lost("no answer in 30 s".into())),
        Ok(Err(e)) => return Try::Retry(e.to_string()),
        Ok(Ok((status, _))) if retryable(status) => return Try::Retry(format!("http_{status}")),
        Ok(Ok((status, b))) if status != 200 => {
            let _ = b.collect().await;
            return Try::Final(End::Failed(format!("http_{status}")));
        }
        Ok(Ok((_, b))) => b,
    };
    let mut events = EventStream::new(body);
    let (mut tokens, mut finished) = (Vec::new(), false);
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.next()).await {
            Err(_) => return Try::Final(End::Lost("stream silent for 30 s".into())),
            Ok(None | Some(Err(_))) => return Try::Final(End::Cut(which)),
            Ok(Some(Ok(StreamEvent::Chunk(c)))) => {
                for ch in &c.choices {
                    tokens.extend(&ch.tokens);
                    finished |= ch.finish_reason.is_some();
                }
            }
            Ok(Some(Ok(StreamEvent::Error(e)))) => {
                return Try::Final(End::Failed(format!("error_event: {}", e.message)));
            }
            Ok(Some(Ok(StreamEvent::Done))) if finished => return Try::Done(tokens),
            Ok(Some(Ok(StreamEvent::Done))) => return Try::Final(End::Cut(which)),
        }
    }
}

/// One client: requests back to back until `end`, starting at gateway `home`.
async fn client(
    i: usize,
    gateways: Vec<String>,
    t0: Instant,
    end: Instant,
    max_tokens: u32,
    out: Arc<Mutex<Vec<Outcome>>>,
) {
    let http = HttpClient::default();
    let mut n = 0;
    while Instant::now() < end {
        let (p, t, seed) = nth_request(i, n);
        let stream = n % 3 != 2;
        n += 1;
        let body = json!({ "prompt": p, "max_tokens": max_tokens, "temperature": t, "seed": seed, "stream": stream })
            .to_string();
        let started = t0.elapsed();
        let mut retries = 0;
        let mut at = i % gateways.len();
        let end_ = loop {
            let tried = if stream {
                streamed(&http, &gateways[at], &body, at).await
            } else {
                whole(&http, &gateways[at], &body).await
            };
            match tried {
                Try::Done(tokens) if tokens == colocated(&p, t, seed, max_tokens) => {
                    break End::Equal;
                }
                Try::Done(tokens) => {
                    break End::Lost(format!("tokens differ from colocated ({})", tokens.len()));
                }
                Try::Final(e) => break e,
                Try::Retry(why) if retries >= 2 => break End::Failed(why),
                Try::Retry(_) => {
                    tokio::time::sleep(Duration::from_millis(500 << retries)).await;
                    retries += 1;
                    at = (at + 1) % gateways.len();
                }
            }
        };
        if let Ok(mut v) = out.lock() {
            v.push(Outcome {
                started,
                ended: t0.elapsed(),
                streamed: stream,
                end: end_,
                retries,
            });
        }
    }
}

/// Ids of the workers gateway `http` lists.
async fn listed(http: &str) -> Vec<String> {
    let Ok(r) = HttpClient::default().get(http, "/workers").await else {
        return Vec::new();
    };
    serde_json::from_slice::<Value>(&r.body)
        .ok()
        .and_then(|v| {
            v["workers"].as_array().map(|ws| {
                ws.iter()
                    .filter_map(|w| w["worker_id"].as_str().map(str::to_owned))
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// Waits until every gateway lists the three engines; the time it took, or `None` after
/// `limit`.
async fn all_listed(gateways: &[String], limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        let mut all = true;
        for g in gateways {
            all &= listed(g).await.len() == 3;
        }
        if all {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Waits until etcd holds the three engines' keys; the time it took, or `None` after `limit`.
async fn etcd_lists_every_engine(members: &[Member], limit: Duration) -> Option<Duration> {
    let urls: Vec<String> = members.iter().map(|m| m.client_url.clone()).collect();
    let etcd = tl_engine::etcd::Etcd::new(&urls, None, Duration::from_secs(1)).ok()?;
    let prefix = tl_engine::etcd::Keys::new(tl_engine::etcd::DEFAULT_PREFIX).workers();
    let t = Instant::now();
    while t.elapsed() < limit {
        if etcd
            .get_prefix(&prefix)
            .await
            .is_ok_and(|(kvs, _)| kvs.len() == 3)
        {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

async fn back_to_baseline(metrics: &str) -> bool {
    let end = Instant::now() + Duration::from_secs(15);
    while Instant::now() < end {
        if scrape(metrics).await.is_some_and(|m| in_use(&m) == 0.0) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

struct Fleet {
    etcd: Vec<Member>,
    gateways: Vec<Proc>,
    gateway_args: Vec<Vec<String>>,
    engines: Vec<Proc>,
    dir: std::path::PathBuf,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.engines.clear();
        self.gateways.clear();
        self.etcd.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(a: &DrillArgs, dir: &Path) -> Result<Fleet, DrillError> {
    let members = if a.fault == Fault::EtcdKill { 3 } else { 1 };
    let etcd = start_cluster(&dir.join("etcd"), members, None)
        .map_err(|e| format!("etcd: {e} (Debian's etcd-server: apt-get install etcd-server)"))?;
    let endpoints = etcd
        .iter()
        .map(|m| m.client_url.clone())
        .collect::<Vec<_>>()
        .join(",");
    let gw_toml = dir.join("gateway.toml");
    std::fs::write(
        &gw_toml,
        format!(
            "[gateway]\nstall_timeout_ms = {}\nmax_failovers = 2\npublic_unauthenticated = true\nunauthenticated_admin = true\n",
            a.stall_ms
        ),
    )
    .map_err(|e| e.to_string())?;
    let mut gateways = Vec::new();
    let mut gateway_args = Vec::new();
    for g in 0..a.gateways.max(2) {
        let mut args: Vec<String> = vec![
            "gateway".into(),
            "--config".into(),
            gw_toml.to_string_lossy().into_owned(),
            "--etcd-endpoints".into(),
            endpoints.clone(),
        ];
        let p = Proc::start(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &dir.join(format!("gateway-{g}.log")),
        )?;
        // A restart binds what this one bound.
        for (flag, key) in [
            ("--http-listen", "http"),
            ("--registry-listen", "registry"),
            ("--metrics-listen", "metrics"),
        ] {
            args.extend([flag.to_owned(), p.addr(key)]);
        }
        gateways.push(p);
        gateway_args.push(args);
    }
    let mut engines = Vec::new();
    for (id, role) in [("P", "prefill"), ("D1", "decode"), ("D2", "decode")] {
        let cfg = engine_toml(dir, id, role, "", "127.0.0.1", a)?;
        let args = [
            "engine",
            "--config",
            &cfg.to_string_lossy(),
            "--etcd-endpoints",
            &endpoints,
            // The drill's etcd is a private single-host one, without auth.
            "--etcd-allow-no-auth",
        ]
        .map(str::to_owned);
        engines.push(Proc::start(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &dir.join(format!("{id}.log")),
        )?);
    }
    Ok(Fleet {
        etcd,
        gateways,
        gateway_args,
        engines,
        dir: dir.to_owned(),
    })
}

/// What the drill runs on: processes, or the compose file's containers.
enum Backend {
    Procs(Fleet),
    Compose(Compose),
}

/// The compose services of the prefill and decode engines, and of the etcd members.
const ENGINES: [&str; 3] = ["prefill", "decode-1", "decode-2"];
const MEMBERS: [&str; 3] = ["etcd-0", "etcd-1", "etcd-2"];

impl Backend {
    fn gateways(&self) -> Result<Vec<String>, DrillError> {
        match self {
            Self::Procs(f) => Ok(f.gateways.iter().map(|g| g.addr("http")).collect()),
            Self::Compose(c) => Ok(vec![
                c.http.clone(),
                c.port("gateway-2", 8000)
                    .ok_or("gateway-2's endpoint is not published")?,
            ]),
        }
    }

    fn engine_metrics(&self, k: usize) -> Option<String> {
        match self {
            Self::Procs(f) => Some(f.engines[k].addr("metrics")),
            Self::Compose(c) => c.port(ENGINES[k], 9100),
        }
    }

    fn members(&self) -> usize {
        match self {
            Self::Procs(f) => f.etcd.len(),
            Self::Compose(_) => MEMBERS.len(),
        }
    }

    /// The services (or members) a fault takes away: gateway 0, etcd member 0, or every member.
    fn victims(fault: Fault) -> &'static [&'static str] {
        match fault {
            Fault::GatewayKill => &["gateway"],
            Fault::EtcdKill => &MEMBERS[..1],
            _ => &MEMBERS,
        }
    }

    fn fault(&mut self, fault: Fault) -> Result<(), DrillError> {
        match self {
            Self::Procs(f) => match fault {
                Fault::GatewayKill => {
                    f.gateways[0].signal("KILL");
                    let _ = f.gateways[0].child.wait();
                }
                Fault::EtcdKill => f.etcd[0].kill(),
                _ => f.etcd.iter_mut().for_each(Member::kill),
            },
            Self::Compose(c) => {
                c.docker_all(&["kill", "-s", "KILL"], Self::victims(fault))?;
            }
        }
        Ok(())
    }

    fn restore(&mut self, fault: Fault) -> Result<(), DrillError> {
        match self {
            Self::Procs(f) => match fault {
                Fault::GatewayKill => {
                    let args: Vec<&str> = f.gateway_args[0].iter().map(String::as_str).collect();
                    f.gateways[0] = Proc::start(&args, &f.dir.join("gateway-0-restarted.log"))?;
                }
                Fault::EtcdKill => f.etcd[0].restart().map_err(|e| e.to_string())?,
                _ => {
                    for m in &mut f.etcd {
                        m.restart().map_err(|e| e.to_string())?;
                    }
                }
            },
            Self::Compose(c) => {
                c.docker_all(&["start"], Self::victims(fault))?;
            }
        }
        Ok(())
    }
}

pub(crate) async fn run(a: &DrillArgs) -> Result<FleetReport, DrillError> {
    if !matches!(
        a.fault,
        Fault::GatewayKill | Fault::EtcdKill | Fault::EtcdDown
    ) {
        return Err("--gateways 2 takes --fault gateway-kill, etcd-kill or etcd-down".into());
    }
    let mut f = if a.compose {
        Backend::Compose(Compose::up(&a.image, &a.etcd_image)?)
    } else {
        let dir = std::env::temp_dir().join(format!(
            "tl-drill-fleet-{}-{}",
            std::process::id(),
            tl_engine::net::tls::random_hex::<4>()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        Backend::Procs(start(a, &dir)?)
    };
    let http = f.gateways()?;
    all_listed(&http, Duration::from_secs(30))
        .await
        .ok_or("the engines never appeared on both gateways")?;

    let line = Timeline::start(a.seconds, 3.0);
    let (t0, total, fault_at, restore_at) = (line.t0, line.total, line.fault_at, line.restore_at);
    let (outcomes, mut clients) = start_clients(a.clients.max(2), |i, out| {
        client(i, http.clone(), t0, line.end(), a.max_tokens, out)
    });
    tokio::time::sleep_until((t0 + fault_at).into()).await;
    let fault_start = t0.elapsed();
    f.fault(a.fault)?;
    // Once the fault has landed (a `docker` command takes a moment).
    let fault_time = t0.elapsed();
    // While the fault lasts, the surviving gateways keep listing every engine (from etcd, or
    // from their snapshot while etcd is down).
    let survivors: Vec<String> = match a.fault {
        Fault::GatewayKill => http[1..].to_vec(),
        _ => http.clone(),
    };
    let mut listed_throughout = true;
    while t0.elapsed() < restore_at {
        for g in &survivors {
            listed_throughout &= listed(g).await.len() == 3;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep_until((t0 + restore_at).into()).await;
    let restore_time = t0.elapsed();
    f.restore(a.fault)?;
    let resynced = all_listed(&http, Duration::from_secs(30)).await;
    // etcd itself lists every engine again (their leases renewed or granted anew); checked on
    // processes, whose etcd the drill can reach (the containers' etcd is on their network).
    let in_etcd = match &f {
        Backend::Procs(p) => etcd_lists_every_engine(&p.etcd, Duration::from_secs(20))
            .await
            .ok_or(()),
        Backend::Compose(_) => Err(()),
    };
    while clients.join_next().await.is_some() {}
    let mut pools = BTreeMap::new();
    for (k, id) in ["P", "D1", "D2"].into_iter().enumerate() {
        let back = match f.engine_metrics(k) {
            Some(m) => back_to_baseline(&m).await,
            None => false,
        };
        pools.insert(id, back);
    }

    let outcomes = std::mem::take(&mut *outcomes.lock().map_err(|e| e.to_string())?);
    let mut failed: BTreeMap<String, u64> = BTreeMap::new();
    let mut lost: BTreeMap<String, u64> = BTreeMap::new();
    let mut cut = [0u64; 2];
    let (mut equal, mut retried, mut nonstreamed) = (0u64, 0u64, 0u64);
    let mut cut_outside_fault = 0u64;
    for o in &outcomes {
        retried += u64::from(o.retries > 0);
        nonstreamed += u64::from(!o.streamed);
        match &o.end {
            End::Equal => equal += 1,
            End::Failed(c) => *failed.entry(c.clone()).or_default() += 1,
            End::Lost(c) => *lost.entry(c.clone()).or_default() += 1,
            End::Cut(g) => {
                cut[*g.min(&1)] += 1;
                // A cut stream must have been in flight when the gateway died.
                if !(o.started <= fault_time && o.ended >= fault_start) {
                    cut_outside_fault += 1;
                }
            }
        }
    }
    let ends = Ends::new(outcomes.len(), equal, failed, lost);
    let pools_back = pools.values().all(|&b| b);
    let passed = ends.failed == 0
        && ends.lost == 0
        && pools_back
        && resynced.is_some()
        && (a.compose || in_etcd.is_ok())
        && match a.fault {
            Fault::GatewayKill => cut[1] == 0 && cut_outside_fault == 0,
            _ => cut == [0, 0] && listed_throughout,
        };
    let mut ttft_free = Vec::new();
    for o in &outcomes {
        if o.end == End::Equal {
            ttft_free.push(o.ended - o.started);
        }
    }
    let ms = |d: Duration| (d.as_secs_f64() * 1e5).round() / 100.0;
    let report = FleetReport {
        drill: "gateways",
        fault: clap::ValueEnum::to_possible_value(&a.fault).map(|v| v.get_name().to_owned()),
        mode: if a.compose { "containers" } else { "processes" },
        gateways: http.len(),
        etcd_members: f.members(),
        clients: a.clients.max(2),
        seconds: total.as_secs_f64(),
        ends,
        non_streamed: nonstreamed,
        streams_cut_on_killed_gateway: cut[0],
        streams_cut_on_other_gateways: cut[1],
        streams_cut_not_in_flight_at_fault: cut_outside_fault,
        requests_retried: retried,
        survivors_listed_every_engine_throughout: listed_throughout,
        gateways_list_every_engine_after_restore_ms: resynced.map(ms),
        etcd_lists_every_engine_after_restore_ms: in_etcd.ok().map(ms),
        fault_at_s: fault_time.as_secs_f64(),
        restored_at_s: restore_time.as_secs_f64(),
        p99_request_ms: p99_ms(ttft_free),
        pools_back_to_baseline: pools,
        passed,
    };
    drop(f);
    Ok(report)
}
