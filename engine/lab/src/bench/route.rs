//! `tl bench route`: what routing costs a gateway per request as the fleet grows, asking every
//! decode engine HasBlocks (fan-out) against the prefix index kept from their WatchBlocks
//! streams; and whether two gateways route as well as one.
//!
//! - **Routing time.** 4, 16 and 64 in-process decode engines (and one prefill engine) behind
//!   one gateway. Their caches are filled by real requests through the gateway; then the
//!   gateway routes the same prompts, without serving them, alternately by fan-out and from its
//!   index, and each call is timed. The figure is the gateway's routing time per request, and
//!   its ratio at 64 engines over 4.
//! - **Hit rate, 1 gateway against 2.** The same load (documents with shared prefixes, unique
//!   tails, several clients) through one gateway, then spread over two gateways that each keep
//!   their own index over the same engines. The prefix-hit rate is the share of the prompts'
//!   full blocks that the chosen decode engine already held when the push arrived (the
//!   transfer's own dedup count, not the router's guess).
//!
//! The second gateway's registry is fed with the first's workers every 100 ms (the engines
//! beat to one in-process registry); sharing it through etcd is what `tl gateway
//! --etcd-endpoints` does and is tested apart.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::HttpClient;
use tl_engine::node::EngineNode;
use tl_engine::node::config::Role;

use super::serve::{pct, simulated};
use super::{BenchError, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench route`.
#[derive(clap::Args, Debug, Clone)]
pub struct RouteArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// Fleet sizes: decode engines behind the gateway.
    #[arg(long, value_delimiter = ',', default_values_t = [4usize, 16, 64])]
    engines: Vec<usize>,
    /// Timed routing calls per mode and fleet size.
    #[arg(long, default_value_t = 400)]
    calls: usize,
    /// Documents: distinct shared prefixes.
    #[arg(long, default_value_t = 24)]
    documents: usize,
    /// Tokens of each document's shared prefix.
    #[arg(long, default_value_t = 256)]
    prefix_tokens: usize,
    /// Tokens of each request's own tail.
    #[arg(long, default_value_t = 32)]
    tail_tokens: usize,
    /// Requests of the hit-rate load (each run: 1 gateway, then 2).
    #[arg(long, default_value_t = 240)]
    requests: usize,
    /// Concurrent clients of the hit-rate load.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Decode engines of the hit-rate runs.
    #[arg(long, default_value_t = 4)]
    hit_engines: usize,
    /// Time the index only (for a profile of it; the fan-out figures are then absent).
    #[arg(long)]
    index_only: bool,
}

/// Runs `tl bench route`.
#[must_use]
pub fn route(args: &RouteArgs) -> ExitCode {
    block_on(async { print_json(bench(args).await) })
}

/// Request `i`'s prompt: document `i % documents`'s prefix, then a tail of its own. Tokens are
/// the fake model's bytes.
fn prompt(a: &RouteArgs, i: usize) -> Vec<u32> {
    let doc = i % a.documents.max(1);
    let mix = |x: usize| ((x.wrapping_mul(2_654_435_761) >> 7) % 256) as u32;
    (0..a.prefix_tokens)
        .map(|t| mix(doc * 100_003 + t))
        .chain((0..a.tail_tokens).map(|t| mix(((i + 1) << 24) + t)))
        .collect()
}

/// A gateway over a prefill engine and `n` decode engines, every decode engine's stream
/// followed by its index.
struct Fleet {
    gw: GatewayNode,
    _engines: Vec<EngineNode>,
}

impl Fleet {
    async fn start(n: usize) -> Result<Self, BenchError> {
        let gw = GatewayNode::start(&GatewayConfig::local()).await?;
        let reg = gw.registry_addr().to_string();
        // Beats a second apart: at 64 engines, beats every 100 ms would be 640 RPCs a second
        // on the gateway, load that grows with N and would be timed as routing.
        let quiet = |mut c: tl_engine::node::config::Config| {
            c.engine.heartbeat_ms = 1000;
            c
        };
        let mut engines =
            vec![EngineNode::start(&quiet(simulated("P", Role::Prefill, &reg, 0, 0, 8192))).await?];
        for i in 1..=n {
            let c = quiet(simulated(&format!("D{i}"), Role::Decode, &reg, 0, 0, 1024));
            engines.push(EngineNode::start(&c).await?);
        }
        let fleet = Self {
            gw,
            _engines: engines,
        };
        fleet.wait_synced(fleet.gw.gateway(), n).await?;
        Ok(fleet)
    }

    /// Waits until `g` lists `n` decode engines and follows each one's stream.
    async fn wait_synced(
        &self,
        g: &tl_engine::gateway::Gateway,
        n: usize,
    ) -> Result<(), BenchError> {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let ids: Vec<String> = (1..=n).map(|i| format!("D{i}")).collect();
            let listed = g.workers().len() == n + 1;
            if listed && ids.iter().all(|id| g.block_index().synced(id)) {
                return Ok(());
            }
            if Instant::now() > end {
                return Err(format!("{n} decode engines never registered and synced").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Sends requests `from..from + count` of the load, `clients` at a time, through `gateways` in
/// turn: the blocks the chosen engines already held, the prompts' full blocks, failures.
async fn load(a: &RouteArgs, gateways: &[String], from: usize, count: usize) -> (u64, u64, usize) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(from));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..a.clients.max(1) {
        let (next, gateways, a) = (Arc::clone(&next), gateways.to_vec(), a.clone());
        tasks.spawn(async move {
            let http = HttpClient::default();
            let (mut held, mut full, mut failed) = (0u64, 0u64, 0usize);
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= from + count {
                    break;
                }
                let p = prompt(&a, i);
                let body = serde_json::json!({ "prompt": p, "max_tokens": 2, "temperature": 0 });
                let gw = &gateways[i % gateways.len()];
                match http
                    .post(gw, "/v1/completions", &[], body.to_string())
                    .await
                {
                    Ok(r) if r.status == 200 => {
                        let v = r.json();
                        held += v["tl_route"]["blocks_deduped"].as_u64().unwrap_or(0);
                        full += (p.len() / 4) as u64;
                    }
                    _ => failed += 1,
                }
            }
            (held, full, failed)
        });
    }
    let (mut held, mut full, mut failed) = (0, 0, 0);
    while let Some(Ok((h, f, x))) = tasks.join_next().await {
        held += h;
        full += f;
        failed += x;
    }
    (held, full, failed)
}

async fn timing(a: &RouteArgs, n: usize) -> Result<serde_json::Value, BenchError> {
    let fleet = Fleet::start(n).await?;
    let addr = fleet.gw.http_addr().to_string();
    // Fill the caches: every document lands on some engine.
    let (_, _, failed) = load(a, std::slice::from_ref(&addr), 0, a.documents * 2).await;
    if failed > 0 {
        return Err(format!("{failed} warm-up requests failed at {n} engines").into());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let g = fleet.gw.gateway();
    let (mut fan, mut ix) = (Vec::new(), Vec::new());
    let (mut fan_hits, mut ix_hits, mut asked_by_index) = (0usize, 0usize, 0usize);
    for i in 0..a.calls {
        let p = prompt(a, i);
        // Interleaved, so drift on a shared machine falls on both alike.
        for from_index in [i % 2 == 0, i % 2 != 0] {
            if a.index_only && !from_index {
                continue;
            }
            let t = Instant::now();
            let (plan, asked) = g.route_only(&p, 0, from_index).await;
            let us = t.elapsed().as_secs_f64() * 1e6;
            let hit = plan.decode.first().map_or(0, |r| r.cached_blocks);
            if from_index {
                ix.push(us);
                ix_hits += hit;
                asked_by_index += asked;
            } else {
                fan.push(us);
                fan_hits += hit;
                // The fan-out leaves work behind (its connections' tasks, the engines'
                // answers still being read): let it settle, untimed, so that it is not timed
                // as the next index call's (seen: 64-engine index calls 3x slower without).
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }
    let summary = |v: &mut Vec<f64>| {
        serde_json::json!({
            "p50_us": round3(pct(v, 50.0)),
            "p99_us": round3(pct(v, 99.0)),
            "mean_us": round3(v.iter().sum::<f64>() / v.len().max(1) as f64),
        })
    };
    Ok(serde_json::json!({
        "decode_engines": n,
        "fan_out": summary(&mut fan),
        "index": summary(&mut ix),
        "index_rpcs_per_request": round3(asked_by_index as f64 / a.calls.max(1) as f64),
        "fan_out_rpcs_per_request": n,
        // The same choices both ways: the index routes to the prefixes fan-out finds.
        "cached_blocks_chosen_fan_out": fan_hits,
        "cached_blocks_chosen_index": ix_hits,
    }))
}

async fn hit_rates(a: &RouteArgs) -> Result<serde_json::Value, BenchError> {
    let mut out = serde_json::Map::new();
    for gateways in [1usize, 2] {
        let fleet = Fleet::start(a.hit_engines).await?;
        let mut addrs = vec![fleet.gw.http_addr().to_string()];
        let mut extra = Vec::new();
        let mut copier = None;
        if gateways == 2 {
            let gw2 = GatewayNode::start(&GatewayConfig::local()).await?;
            let (from, to) = (Arc::clone(fleet.gw.registry()), Arc::clone(gw2.registry()));
            copier = Some(tokio::spawn(async move {
                loop {
                    let now = Instant::now();
                    for w in from.list(now) {
                        to.heartbeat(w, now);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }));
            fleet.wait_synced(gw2.gateway(), a.hit_engines).await?;
            addrs.push(gw2.http_addr().to_string());
            extra.push(gw2);
        }
        let (held, full, failed) = load(a, &addrs, 0, a.requests).await;
        if let Some(c) = copier {
            c.abort();
        }
        out.insert(
            format!("gateways_{gateways}"),
            serde_json::json!({
                "prefix_hit_rate": round3(held as f64 / full.max(1) as f64),
                "blocks_held": held,
                "full_blocks": full,
                "failed": failed,
            }),
        );
    }
    let rate = |k: &str| out[k]["prefix_hit_rate"].as_f64().unwrap_or(0.0);
    let (one, two) = (rate("gateways_1"), rate("gateways_2"));
    out.insert(
        "two_over_one".into(),
        serde_json::json!(round3(two / one.max(f64::MIN_POSITIVE))),
    );
    Ok(serde_json::Value::Object(out))
}

async fn bench(a: &RouteArgs) -> Result<serde_json::Value, BenchError> {
    let mut sizes = Vec::new();
    for &n in &a.engines {
        sizes.push(timing(a, n).await?);
    }
    let p50 = |i: usize, mode: &str| sizes[i][mode]["p50_us"].as_f64().unwrap_or(f64::NAN);
    let last = sizes.len().saturating_sub(1);
    let ratios = serde_json::json!({
        "index_largest_over_smallest_p50": round3(p50(last, "index") / p50(0, "index")),
        "fan_out_largest_over_smallest_p50": round3(p50(last, "fan_out") / p50(0, "fan_out")),
        "fan_out_over_index_p50_at_largest": round3(p50(last, "fan_out") / p50(last, "index")),
    });
    Ok(serde_json::json!({
        "bench": "route",
        "cpu": super::cpu_json(),
        "documents": a.documents,
        "prompt_tokens": a.prefix_tokens + a.tail_tokens,
        "block_tokens": 4,
        "sizes": sizes,
        "ratios": ratios,
        "hit_rate": hit_rates(a).await?,
    }))
}
