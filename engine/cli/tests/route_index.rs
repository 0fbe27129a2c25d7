//! Routing from events: a gateway's prefix index follows the decode engines' WatchBlocks
//! streams through stores, evictions, a restart and a cut stream, and routing asks no engine
//! HasBlocks while the streams are up.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{cluster_with, engine_cfg, eventually};
use serde_json::json;
use tl_engine::gateway::index::{self, BlockIndex};
use tl_engine::gateway::upstream::Upstream;
use tl_engine::net::clients::{ControlClient, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::Role;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The engine's own index, as `(scope, hash)` pairs.
fn real(d: &EngineNode) -> Vec<(u64, u64)> {
    d.runner().pool().lock().index_keys()
}

/// Waits until `ix` lists exactly what `d` holds (false after 5 s).
async fn follows(ix: &BlockIndex, id: &str, d: &EngineNode) -> bool {
    eventually(Duration::from_secs(5), || {
        ix.synced(id) && ix.keys_of(id) == real(d)
    })
    .await
}

/// Prompt number `k`: `len` tokens of the fake model's 256 byte tokens, different for each `k`.
fn prompt(k: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|j| (k.wrapping_mul(2_654_435_761) ^ j.wrapping_mul(40_503)).rotate_right(7) % 256)
        .collect()
}

/// Prompts `from..from + n`, `len` tokens each.
async fn serve(gw: &str, from: u32, n: u32, len: u32) {
    let http = HttpClient::default();
    for k in from..from + n {
        let prompt = prompt(k, len);
        let body = json!({ "prompt": prompt, "max_tokens": 4, "temperature": 0 });
        let r = http
            .post(gw, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
}

/// A TCP relay to `target` whose connections the test can cut.
struct Relay {
    addr: String,
    conns: Arc<std::sync::Mutex<JoinSet<()>>>,
    _accept: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: String) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let conns = Arc::new(std::sync::Mutex::new(JoinSet::new()));
        let c = Arc::clone(&conns);
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = l.accept().await {
                let target = target.clone();
                c.lock().unwrap().spawn(async move {
                    if let Ok(mut out) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
            }
        });
        Self {
            addr,
            conns,
            _accept: accept,
        }
    }

    /// Closes every relayed connection (the watch streams on them break).
    fn cut(&self) -> usize {
        let mut c = self.conns.lock().unwrap();
        let n = c.len();
        c.abort_all();
        n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_follows_the_engines() {
    // Small decode pools, so that a few prompts evict.
    let mut c = cluster_with(2, |cfg| cfg.pool.n_blocks = 24).await;
    let gw = c.gw.http_addr().to_string();
    let ix = Arc::clone(c.gw.gateway().block_index());
    for (i, d) in c.d.iter().enumerate() {
        assert!(follows(&ix, &format!("D{}", i + 1), d).await, "D{}", i + 1);
    }

    // Stores: 64-token prompts are 16 full blocks of 4 tokens.
    serve(&gw, 100, 4, 64).await;
    for (i, d) in c.d.iter().enumerate() {
        assert!(
            follows(&ix, &format!("D{}", i + 1), d).await,
            "after stores"
        );
    }
    let stored: usize = c.d.iter().map(|d| real(d).len()).sum();
    assert!(stored > 0, "the prompts stored no block");

    // Evictions: more distinct prompts than the pools hold.
    serve(&gw, 50_000, 8, 64).await;
    let evicted: u64 =
        c.d.iter()
            .map(|d| d.runner().pool().lock().evictions())
            .sum();
    assert!(evicted > 0, "nothing was evicted");
    for (i, d) in c.d.iter().enumerate() {
        assert!(
            follows(&ix, &format!("D{}", i + 1), d).await,
            "after evictions"
        );
    }

    // Routing with every stream up asks no decode engine HasBlocks, and ranks first the
    // engine the index says holds the most of the prompt (the last one served is cached).
    let prompt = prompt(50_000 + 7, 64);
    let (plan, asked) = c.gw.gateway().route_only(&prompt, 0, true).await;
    assert_eq!(asked, 0, "routing asked HasBlocks with every stream up");
    let hashes = kvwire::prompt_hashes(&prompt, 4);
    let (counts, unsynced) = ix.prefixes(0, &hashes, &["D1", "D2"]);
    assert!(unsynced.is_empty());
    let best = counts.values().copied().max().unwrap();
    assert!(
        best > 0,
        "the last prompt served is cached nowhere: {counts:?}"
    );
    assert_eq!(plan.decode[0].cached_blocks, best, "{plan:?}");
    assert_eq!(counts[&plan.decode[0].worker.worker_id], best);
    // Asking every engine instead finds the same prefixes.
    let (asked_plan, asked) = c.gw.gateway().route_only(&prompt, 0, false).await;
    assert_eq!(asked, 2);
    let blocks = |p: &tl_engine::gateway::plan::Plan| -> Vec<(String, usize)> {
        let mut v: Vec<(String, usize)> = p
            .decode
            .iter()
            .map(|r| (r.worker.worker_id.clone(), r.cached_blocks))
            .collect();
        v.sort();
        v
    };
    assert_eq!(blocks(&asked_plan), blocks(&plan));

    // An engine restart: D1 goes (its stream breaks, the registry drops it), a new D1 comes on
    // new ports, empty; the index follows the new one from its snapshot.
    let old = c.d.remove(0);
    old.kill().await;
    let reg = c.gw.registry_addr().to_string();
    let mut cfg = engine_cfg("D1", Role::Decode, &reg);
    cfg.pool.n_blocks = 24;
    let d1 = EngineNode::start(&cfg).await.unwrap();
    assert!(follows(&ix, "D1", &d1).await, "after a restart");
    assert!(
        ix.keys_of("D1").is_empty(),
        "the old D1's blocks are still listed"
    );
    serve(&gw, 90_000, 3, 64).await;
    assert!(
        follows(&ix, "D1", &d1).await,
        "the restarted engine's stores"
    );
    assert!(follows(&ix, "D2", &c.d[0]).await);

    // A cut stream: a second index follows D2 through a relay the test cuts. It is unsynced
    // at once, subscribes again, and is equal again; changes made while it was cut are in.
    let d2 = &c.d[0];
    let relay = Relay::start(d2.addresses().grpc.clone()).await;
    let upstream = Arc::new(Upstream::new(Duration::from_millis(250), None, 16).unwrap());
    let second = Arc::new(BlockIndex::default());
    let stop = CancellationToken::new();
    let status = {
        let mut s = tl_engine::node::heartbeat::worker_status(d2.state(), &d2.addresses(), 100);
        s.grpc_address = relay.addr.clone();
        s
    };
    tokio::spawn(index::follow(
        Arc::clone(&second),
        Arc::clone(&upstream),
        move || vec![status.clone()],
        Duration::from_millis(50),
        stop.clone(),
    ));
    assert!(follows(&second, "D2", d2).await, "through the relay");
    assert!(relay.cut() >= 1, "no connection to cut");
    assert!(
        eventually(Duration::from_secs(2), || !second.synced("D2")).await,
        "a cut stream still counts as synced"
    );
    serve(&gw, 120_000, 3, 64).await;
    assert!(follows(&second, "D2", d2).await, "after the cut");
    assert!(follows(&ix, "D2", d2).await);
    stop.cancel();
    let t = Instant::now();
    assert!(
        eventually(Duration::from_secs(2), || second.keys_of("D2").is_empty()).await,
        "a stopped follower keeps its entries ({:?})",
        t.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_blocks_is_bounded_and_refused_without_a_decode_role() {
    let c = cluster_with(1, |cfg| cfg.limits.max_block_watchers = 2).await;
    let d = ControlClient::new(&c.d[0].addresses().grpc).unwrap();
    // The gateway holds one watcher slot; a second is free; a third is refused.
    let ix = c.gw.gateway().block_index();
    assert!(eventually(Duration::from_secs(5), || ix.synced("D1")).await);
    let mut held = d.watch_blocks(1 << 20).await.unwrap();
    let first = held.message().await.unwrap().unwrap();
    assert!(first.snapshot && first.epoch != 0 && first.worker_id == "D1");
    let refused = d.watch_blocks(1 << 20).await;
    let code = match refused {
        Err(s) => s.code(),
        Ok(mut s) => match s.message().await {
            Err(s) => s.code(),
            Ok(m) => panic!("a third watcher was served: {m:?}"),
        },
    };
    assert_eq!(code, tonic::Code::ResourceExhausted);
    // A watcher that leaves gives its slot back.
    drop(held);
    let mut again = None;
    for _ in 0..50 {
        if let Ok(mut s) = d.watch_blocks(1 << 20).await
            && let Ok(Some(_)) = s.message().await
        {
            again = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(again.is_some(), "a freed watcher slot was not given back");
    // A prefill engine has no block index to stream.
    let p = ControlClient::new(&c.p.addresses().grpc).unwrap();
    let code = match p.watch_blocks(1 << 20).await {
        Err(s) => s.code(),
        Ok(mut s) => s.message().await.unwrap_err().code(),
    };
    assert_eq!(code, tonic::Code::FailedPrecondition);
}

#[test]
fn tl_bench_route_routes_from_the_index_without_rpcs() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tl"))
        .args([
            "bench",
            "route",
            "--json",
            "--engines",
            "2,3",
            "--calls",
            "20",
        ])
        .args(["--requests", "24", "--documents", "6", "--hit-engines", "2"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for s in v["sizes"].as_array().unwrap() {
        assert_eq!(s["index_rpcs_per_request"], 0.0, "{s}");
        assert_eq!(
            s["cached_blocks_chosen_index"], s["cached_blocks_chosen_fan_out"],
            "{s}"
        );
        assert!(s["cached_blocks_chosen_index"].as_u64().unwrap() > 0, "{s}");
    }
    for k in ["gateways_1", "gateways_2"] {
        let h = &v["hit_rate"][k];
        assert_eq!(h["failed"], 0, "{h}");
        assert!(h["prefix_hit_rate"].as_f64().unwrap() > 0.0, "{h}");
    }
    assert!(v["cpu"]["model_name"].is_string());
}
