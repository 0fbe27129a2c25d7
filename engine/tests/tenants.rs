//! Tenants cannot touch each other (issue 23): block identity that a hash collision cannot
//! forge, private caches per API key, and routing internals only for admins. Every test runs a
//! gateway, a prefill engine and decode engines in process, and checks the pools after.

mod common;

use std::time::Duration;

use serde_json::{Value, json};
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::HttpClient;

use common::{Cluster, cluster_of, eventually};

/// The FNV-1a-64 collision `kvwire/examples/fnv_collision.rs` found: two different 16-token
/// blocks with the same kv.wire.v1 hash.
fn collision() -> (Vec<u32>, Vec<u32>, u64) {
    let v: Value =
        serde_json::from_str(include_str!("fixtures/fnv_collision.json")).expect("fixture");
    let toks = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let hash =
        u64::from_str_radix(v["hash"].as_str().unwrap().trim_start_matches("0x"), 16).expect("hex");
    (toks("a_tokens"), toks("b_tokens"), hash)
}

/// The colocated reference at block size 16.
fn colocated16(prompt: &[u32], seed: u64, max_tokens: u32) -> Vec<u32> {
    let mut cfg = tl_engine::node::config::Config::default();
    cfg.pool.block_tokens = 16;
    let s = tl_engine_core::sampler::SamplingRequest {
        temperature: 0.8,
        ..Default::default()
    };
    cfg.colocated(prompt, s, seed, max_tokens).unwrap()
}

fn tokens_of(v: &Value) -> Vec<u32> {
    v["choices"][0]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no tokens in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

async fn complete(addr: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| ("authorization", a))
        .into_iter()
        .collect();
    let r = HttpClient::default()
        .post(addr, "/v1/completions", &headers, body.to_string())
        .await
        .unwrap();
    (r.status, r.json())
}

/// Every engine holds no block in use and no handle once the requests are over.
async fn settled(c: &Cluster) {
    let idle = || {
        std::iter::once(&c.p).chain(&c.d).all(|e| {
            let counts = e.runner().pool().counts();
            counts.used == 0 && e.receiver().is_none_or(|r| r.pending() == 0)
        })
    };
    assert!(
        eventually(Duration::from_secs(10), idle).await,
        "blocks or handles left in use"
    );
    for e in std::iter::once(&c.p).chain(&c.d) {
        e.runner().pool().lock().check().unwrap();
    }
}

/// Tenant A sends a block, then B a different block with the same hash (a real FNV-1a-64
/// collision), both through the gateway in one shared scope: B's tokens are B's colocated run,
/// not A's continuation. Against hash-only matching, B's first block is deduplicated onto A's
/// KV and its output changes (the fake model reads every KV byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_blocks_never_share_kv() {
    let (a, b, hash) = collision();
    assert_ne!(a, b);
    assert_eq!(kvwire::block_hash(0, &a), hash);
    assert_eq!(
        kvwire::block_hash(0, &b),
        hash,
        "the fixture is a collision"
    );
    let tail: Vec<u32> = b" and then".iter().map(|&c| u32::from(c)).collect();
    let (pa, pb) = ([&a[..], &tail].concat(), [&b[..], &tail].concat());
    let want_b = colocated16(&pb, 5, 6);
    assert_ne!(
        colocated16(&pa, 5, 6),
        want_b,
        "the two prompts must differ in output for the test to mean anything"
    );

    // One tenant for everyone: the collision meets in one scope, the hardest case.
    let c = cluster_of(&GatewayConfig::local(), 1, |cfg| cfg.pool.block_tokens = 16).await;
    let addr = c.gw.http_addr().to_string();
    let req = |p: &[u32]| json!({ "prompt": p, "max_tokens": 6, "seed": 5, "temperature": 0.8 });
    let (s, ra) = complete(&addr, None, &req(&pa)).await;
    assert_eq!(s, 200, "{ra}");
    assert_eq!(tokens_of(&ra), colocated16(&pa, 5, 6));
    // A's first block is cached on both engines now; B's prompt names its hash.
    let (s, rb) = complete(&addr, None, &req(&pb)).await;
    assert_eq!(s, 200, "{rb}");
    assert_eq!(tokens_of(&rb), want_b, "B got A's continuation: {rb}");
    assert_eq!(rb["tl_route"]["cached_blocks"], 0, "{rb}");
    assert_eq!(rb["tl_route"]["blocks_deduped"], 0, "{rb}");
    // And A again still finds its own block.
    let (_, ra2) = complete(&addr, None, &req(&pa)).await;
    assert_eq!(tokens_of(&ra2), tokens_of(&ra));
    assert_eq!(ra2["tl_route"]["blocks_deduped"], 1, "{ra2}");
    settled(&c).await;
}

/// Writes the keys files: tenant key `key-a` (after a comment line, which is no key) and the
/// admin key `key-b`.
fn keyed_gateway(dir: &std::path::Path) -> GatewayConfig {
    std::fs::create_dir_all(dir).unwrap();
    let (keys, admin) = (dir.join("keys"), dir.join("admin"));
    std::fs::write(&keys, "# tenants, one a line\nkey-a\n\n").unwrap();
    std::fs::write(&admin, "key-b\n").unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.gateway.api_keys_file = keys.display().to_string();
    cfg.gateway.admin_keys_file = admin.display().to_string();
    cfg
}

/// What B learns from one request: its tokens, its usage, and what its route says about the
/// cache.
fn seen(v: &Value) -> (Vec<u32>, Value, Value, Value, Value) {
    let r = &v["tl_route"];
    (
        tokens_of(v),
        v["usage"].clone(),
        r["cached_blocks"].clone(),
        r["blocks_deduped"].clone(),
        r["blocks_sent"].clone(),
    )
}

/// B's answers, usage and transfer are the same whether or not tenant A sent the same prompt
/// first; A sees no routing internals; B's own requests share as before, unless B salts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_learns_nothing_of_anothers_cache() {
    let dir = std::env::temp_dir().join(format!("tl-tenants-{}", std::process::id()));
    let cfg = keyed_gateway(&dir);
    let prompt: Vec<u32> = (0..37).collect();
    let body = json!({ "prompt": prompt, "max_tokens": 4, "seed": 3, "temperature": 0.5 });

    // A fresh deployment: B alone.
    let fresh = cluster_of(&cfg, 2, |_| {}).await;
    let (s, alone) = complete(&fresh.gw.http_addr().to_string(), Some("key-b"), &body).await;
    assert_eq!(s, 200, "{alone}");
    assert_eq!(alone["tl_route"]["blocks_sent"], 10, "{alone}");
    settled(&fresh).await;
    drop(fresh);

    // Another deployment where A sent the same prompt first.
    let c = cluster_of(&cfg, 2, |_| {}).await;
    let addr = c.gw.http_addr().to_string();
    let (s, ra) = complete(&addr, Some("key-a"), &body).await;
    assert_eq!(s, 200, "{ra}");
    assert!(ra.get("tl_route").is_none(), "a tenant saw routing: {ra}");
    let (s, after_a) = complete(&addr, Some("key-b"), &body).await;
    assert_eq!(s, 200, "{after_a}");
    assert_eq!(seen(&after_a), seen(&alone), "B learned of A's prefix");

    // B's own second request shares B's blocks; with a cache_salt it does not.
    let (_, again) = complete(&addr, Some("key-b"), &body).await;
    assert_eq!(again["tl_route"]["blocks_deduped"], 9, "{again}");
    let mut salted = body.clone();
    salted["cache_salt"] = json!("per-user-7");
    let (_, s1) = complete(&addr, Some("key-b"), &salted).await;
    assert_eq!(
        seen(&s1),
        seen(&alone),
        "a salted request shared an unsalted one"
    );

    // A comment line is not a key; /workers is for admin keys only.
    assert_eq!(
        complete(&addr, Some("# tenants, one a line"), &body)
            .await
            .0,
        401
    );
    let http = HttpClient::default();
    let get = |key: Option<&'static str>| {
        let (http, addr) = (http.clone(), addr.clone());
        async move {
            let auth = key.map(|k| format!("Bearer {k}"));
            let h: Vec<(&str, &str)> = auth
                .as_deref()
                .map(|a| ("authorization", a))
                .into_iter()
                .collect();
            http.get_with(&addr, "/workers", &h).await.unwrap().status
        }
    };
    assert_eq!(get(None).await, 401);
    assert_eq!(get(Some("key-a")).await, 403);
    assert_eq!(get(Some("key-b")).await, 200);
    settled(&c).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A gateway with no key at all refuses to start unless told to serve the public.
#[tokio::test]
async fn a_gateway_without_keys_needs_public_unauthenticated() {
    let dir = std::env::temp_dir().join(format!("tl-nokeys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("keys");
    std::fs::write(&empty, "# nobody yet\n\n").unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.gateway.api_keys_file = empty.display().to_string();
    let Err(err) = tl_engine::gateway::GatewayNode::start(&cfg).await else {
        panic!("started with no key");
    };
    assert!(err.to_string().contains("public_unauthenticated"), "{err}");
    cfg.gateway.public_unauthenticated = true;
    let gw = tl_engine::gateway::GatewayNode::start(&cfg).await.unwrap();
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// One rule for callers without a key: `public_unauthenticated` serves `/v1/*` to anyone while
/// no tenant key is configured, admin keys or not (adding one for `/workers` does not close the
/// public endpoint; tenant keys do, `api_keys_guard_the_public_endpoint`); a wrong key is still
/// 401, and `/workers` without a key is 401, on a gateway with admin keys and on one with none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_unauthenticated_stays_public_beside_admin_keys() {
    let dir = std::env::temp_dir().join(format!("tl-public-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let admin = dir.join("admin");
    std::fs::write(&admin, "key-ops\n").unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.gateway.public_unauthenticated = true;
    cfg.gateway.admin_keys_file = admin.display().to_string();
    let c = cluster_of(&cfg, 1, |_| {}).await;
    let addr = c.gw.http_addr().to_string();
    let body = json!({ "prompt": "hi", "max_tokens": 2 });
    assert_eq!(complete(&addr, None, &body).await.0, 200);
    assert_eq!(complete(&addr, Some("key-ops"), &body).await.0, 200);
    assert_eq!(complete(&addr, Some("wrong"), &body).await.0, 401);
    let http = HttpClient::default();
    let workers = |h: Vec<(&'static str, &'static str)>| {
        let (http, addr) = (http.clone(), addr.clone());
        async move { http.get_with(&addr, "/workers", &h).await.unwrap().status }
    };
    assert_eq!(workers(vec![]).await, 401);
    assert_eq!(
        workers(vec![("authorization", "Bearer key-ops")]).await,
        200
    );
    settled(&c).await;
    // No key at all, admin not opened: /workers is 401 without a key there too.
    let mut open = GatewayConfig::default();
    open.gateway.public_unauthenticated = true;
    let gw = tl_engine::gateway::GatewayNode::start(&open).await.unwrap();
    let r = http
        .get_with(&gw.http_addr().to_string(), "/workers", &[])
        .await
        .unwrap();
    assert_eq!(r.status, 401);
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request no engine could ever hold is refused with 400 `context_length_exceeded` (never a
/// 429 or 503 that clients retry), before any engine is asked anything; one that fits is
/// served. The figure is the engines' usable context: the pool after the decode reserve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_can_never_fit_are_400_context_length_exceeded() {
    let c = cluster_of(&GatewayConfig::local(), 1, |_| {}).await;
    let addr = c.gw.http_addr().to_string();
    let usable =
        c.gw.gateway()
            .workers()
            .iter()
            .map(|w| w.usable_context)
            .min()
            .unwrap();
    // 256 blocks of 4 less the 1/8 reserve on the decode engine.
    assert_eq!(usable, 224 * 4);
    let asked = || c.d[0].receiver().unwrap().stats().has_blocks_answered;
    let before = (asked(), c.p.runner().pool().counts());
    let prompt: Vec<u32> = (0..800).map(|i| i % 200).collect();
    for (max_tokens, n) in [(97, 1), (u32::MAX, 1), (30, 4)] {
        let body = json!({ "prompt": prompt, "max_tokens": max_tokens, "n": n });
        let (status, v) = complete(&addr, None, &body).await;
        assert_eq!(status, 400, "{max_tokens} x {n}: {v}");
        assert_eq!(v["error"]["type"], "context_length_exceeded", "{v}");
    }
    assert_eq!((asked(), c.p.runner().pool().counts()), before);
    let (status, v) = complete(&addr, None, &json!({ "prompt": prompt, "max_tokens": 96 })).await;
    assert_eq!(status, 200, "{v}");
    settled(&c).await;
}

/// SIGTERM's drain on the gateway: new requests are refused at once (503, and `/health` says
/// draining), streams that finish within the grace finish whole with `[DONE]`, and a stream
/// still running at its end gets an error event naming the drain, never a silent cut. The
/// engines are left holding nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_sigterm_finishes_or_ends_every_stream() {
    use tl_engine::api::sse::StreamEvent;
    // 20 ms a decode step: 5 tokens take 0.1 s, 400 take 8 s.
    let Cluster { gw, p, d } = cluster_of(&GatewayConfig::local(), 1, |cfg| {
        cfg.model.decode_us_per_seq = 20_000
    })
    .await;
    let addr = gw.http_addr().to_string();
    let g = std::sync::Arc::clone(gw.gateway());
    let stream = |max_tokens: u32| {
        let addr = addr.clone();
        tokio::spawn(async move {
            let body = json!({ "prompt": "drain me", "max_tokens": max_tokens, "stream": true });
            let r = HttpClient::default()
                .post(&addr, "/v1/completions", &[], body.to_string())
                .await
                .unwrap();
            assert_eq!(r.status, 200);
            r.events().unwrap()
        })
    };
    let (short, long) = ((stream(5), stream(5)), stream(400));
    assert!(
        eventually(Duration::from_secs(5), || g.in_flight() == 3).await,
        "the requests never started"
    );
    let refused = {
        let (g, addr) = (std::sync::Arc::clone(&g), addr.clone());
        tokio::spawn(async move {
            while !g.is_draining() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let http = HttpClient::default();
            let body = json!({ "prompt": "late", "max_tokens": 2 }).to_string();
            let r = http
                .post(&addr, "/v1/completions", &[], body)
                .await
                .unwrap();
            let health = http.get(&addr, "/health").await.unwrap();
            (r.status, health.status, health.json())
        })
    };
    let began = std::time::Instant::now();
    let ended = gw.shutdown(Duration::from_millis(800)).await;
    let took = began.elapsed();
    assert_eq!(ended, 1, "only the long stream outlived the grace");
    assert!(took < Duration::from_millis(800 + 1500), "{took:?}");
    let (status, health, hv) = refused.await.unwrap();
    assert_eq!((status, health), (503, 503), "{hv}");
    assert_eq!(hv["status"], "draining");
    for s in [short.0, short.1] {
        let events = s.await.unwrap();
        assert_eq!(events.last(), Some(&StreamEvent::Done), "{events:?}");
        let tokens: usize = events
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Chunk(c) => {
                    Some(c.choices.iter().map(|ch| ch.tokens.len()).sum::<usize>())
                }
                _ => None,
            })
            .sum::<usize>();
        assert_eq!(tokens, 5);
    }
    let events = long.await.unwrap();
    let Some(StreamEvent::Error(e)) = events.last() else {
        panic!("the long stream ended without an error event: {events:?}");
    };
    assert!(e.message.contains("draining"), "{e:?}");
    assert!(events.len() > 2, "it streamed before it was ended");
    let idle = || {
        [&p, &d[0]]
            .iter()
            .all(|e| e.runner().pool().counts().used == 0)
    };
    assert!(
        eventually(Duration::from_secs(10), idle).await,
        "the engines kept blocks"
    );
}

/// A prefill engine that stalls (here: 200 ms per prompt token, as good as stopped) holds a
/// request no longer than `prefill_timeout_ms`: the request falls back to a `both` engine and
/// answers what the colocated run answers, long before the stalled Prefill would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_prefill_engine_holds_requests_only_until_the_prefill_deadline() {
    use tl_engine::node::EngineNode;
    use tl_engine::node::config::Role;
    let mut gw = GatewayConfig::local();
    gw.gateway.prefill_timeout_ms = 300;
    let c = cluster_of(&gw, 1, |cfg| {
        if cfg.engine.role == Role::Prefill {
            cfg.model.prefill_us_per_token = 200_000;
        }
    })
    .await;
    let reg = c.gw.registry_addr().to_string();
    let both = EngineNode::start(&common::engine_cfg("B", Role::Both, &reg))
        .await
        .unwrap();
    common::wait_workers(&c.gw, 3).await;
    let addr = c.gw.http_addr().to_string();
    let prompt: Vec<u32> = (1..=20).collect();
    let began = std::time::Instant::now();
    let (status, v) = complete(
        &addr,
        None,
        &json!({ "prompt": prompt, "max_tokens": 4, "seed": 2, "temperature": 0.7 }),
    )
    .await;
    let took = began.elapsed();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["tl_route"]["decode"], "B", "{v}");
    assert_eq!(tokens_of(&v), common::colocated(&prompt, 0.7, 2, 4));
    // 20 tokens at 200 ms would be 4 s.
    assert!(took < Duration::from_millis(2500), "{took:?}");
    settled(&c).await;
    drop(both);
}

/// Every numeric setting is range-checked when a node starts: a zero that would refuse
/// everything (or nothing), a NaN weight, a pool too large to index. The message names the key.
#[test]
fn out_of_range_settings_are_refused_naming_the_key() {
    type G = fn(&mut GatewayConfig);
    let gateway: [(&str, G); 6] = [
        ("limits.max_pushes", |c| c.limits.max_pushes = 0),
        ("limits.header_read_ms", |c| c.limits.header_read_ms = 0),
        ("limits.max_body_bytes", |c| c.limits.max_body_bytes = 0),
        ("gateway.stall_timeout_ms", |c| {
            c.gateway.stall_timeout_ms = 0
        }),
        ("gateway.load_penalty_tokens", |c| {
            c.gateway.load_penalty_tokens = f64::NAN;
        }),
        ("gateway.prefill_timeout_ms", |c| {
            c.gateway.prefill_timeout_ms = 0
        }),
    ];
    assert!(GatewayConfig::local().validate().is_ok());
    for (key, set) in gateway {
        let mut c = GatewayConfig::local();
        set(&mut c);
        let e = c.validate().expect_err(key).to_string();
        assert!(e.contains(key) && e.contains("out of range"), "{key}: {e}");
    }
    type E = fn(&mut tl_engine::node::config::Config);
    let engine: [(&str, E); 3] = [
        ("pool.n_blocks", |c| c.pool.n_blocks = u32::MAX),
        ("pool.n_blocks", |c| c.pool.n_blocks = 0),
        ("limits.max_pending_handles", |c| {
            c.limits.max_pending_handles = 0
        }),
    ];
    for (key, set) in engine {
        let mut c = tl_engine::node::config::Config::default();
        set(&mut c);
        let e = c.validate().expect_err(key).to_string();
        assert!(e.contains(key), "{key}: {e}");
    }
}

/// One key cannot take every slot: at `max_inflight_per_key` its next request is 429 while
/// another key is still served, and its places come back as its requests end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_cannot_take_every_slot() {
    let dir = std::env::temp_dir().join(format!("tl-quota-{}", std::process::id()));
    let mut cfg = keyed_gateway(&dir);
    cfg.gateway.max_inflight_per_key = 2;
    let c = cluster_of(&cfg, 1, |cfg| cfg.model.decode_us_per_seq = 20_000).await;
    let addr = c.gw.http_addr().to_string();
    let body = json!({ "prompt": "slow", "max_tokens": 25 });
    let heavy: Vec<_> = (0..2)
        .map(|_| {
            let (addr, body) = (addr.clone(), body.clone());
            tokio::spawn(async move { complete(&addr, Some("key-a"), &body).await.0 })
        })
        .collect();
    let g = std::sync::Arc::clone(c.gw.gateway());
    assert!(eventually(Duration::from_secs(5), || g.in_flight() == 2).await);
    let (status, v) = complete(&addr, Some("key-a"), &body).await;
    assert_eq!(status, 429, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("API key"),
        "{v}"
    );
    let (status, v) = complete(
        &addr,
        Some("key-b"),
        &json!({ "prompt": "x", "max_tokens": 2 }),
    )
    .await;
    assert_eq!(status, 200, "another key is served meanwhile: {v}");
    for h in heavy {
        assert_eq!(h.await.unwrap(), 200);
    }
    let (status, _) = complete(
        &addr,
        Some("key-a"),
        &json!({ "prompt": "x", "max_tokens": 2 }),
    )
    .await;
    assert_eq!(status, 200, "the places came back");
    settled(&c).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A list of k prompts takes k of its key's places, as it takes k of the gateway's: with
/// `max_inflight_per_key` = 2, a list of 3 prompts is 429 naming the key's bound (before any
/// engine sees it), a list of 2 is served, and the key's places all come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_list_counts_each_prompt_against_its_key() {
    let dir = std::env::temp_dir().join(format!("tl-quota-list-{}", std::process::id()));
    let mut cfg = keyed_gateway(&dir);
    cfg.gateway.max_inflight_per_key = 2;
    let c = cluster_of(&cfg, 1, |_| {}).await;
    let addr = c.gw.http_addr().to_string();
    let used = c.d[0].runner().pool().lock().counts().used;
    let (status, v) = complete(
        &addr,
        Some("key-a"),
        &json!({ "prompt": ["a", "b", "c"], "max_tokens": 2 }),
    )
    .await;
    assert_eq!(status, 429, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_inflight_per_key"),
        "{v}"
    );
    assert_eq!(c.d[0].runner().pool().lock().counts().used, used);
    let (status, v) = complete(
        &addr,
        Some("key-a"),
        &json!({ "prompt": ["a", "b"], "max_tokens": 2 }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    let g = std::sync::Arc::clone(c.gw.gateway());
    assert!(eventually(Duration::from_secs(5), || g.in_flight() == 0).await);
    let (status, v) = complete(
        &addr,
        Some("key-a"),
        &json!({ "prompt": ["a", "b"], "max_tokens": 2 }),
    )
    .await;
    assert_eq!(status, 200, "the places came back: {v}");
    settled(&c).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// 4,096 connections trickling their headers from one address take only that address's share
/// of the public port: a request from another address is served at once. A trickled body is
/// cut off at the whole-request deadline with 408.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_requests_cannot_lock_out_others() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut gw = GatewayConfig::local();
    gw.limits.request_read_ms = 300;
    let c = cluster_of(&gw, 1, |_| {}).await;
    let addr = c.gw.http_addr();
    let mut held = Vec::new();
    for _ in 0..4096 {
        let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
            continue;
        };
        // Headers that never end.
        let _ = s
            .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            .await;
        held.push(s);
    }
    // A legitimate client elsewhere (another loopback address).
    let request = |body: &'static str, len: usize| async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut s = sock.connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {len}\r\nConnection: close\r\n\r\n{body}"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    };
    let body = r#"{"prompt":"hello","max_tokens":2}"#;
    let served = tokio::time::timeout(Duration::from_secs(1), request(body, body.len()))
        .await
        .expect("the legitimate request waited behind the trickling ones");
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    // A body that stops half-way: 408 at the request's deadline, not a connection held for ever.
    let cut = tokio::time::timeout(Duration::from_secs(5), request("{\"prompt\":", 40))
        .await
        .expect("a trickled body held its connection");
    assert!(cut.starts_with("HTTP/1.1 408"), "{cut}");
    drop(held);
    settled(&c).await;
}

/// A key's running streams are never killed because a decode pool runs dry: three seeded
/// streams that together need 60 blocks of a 48-block pool all finish, each with exactly its
/// colocated tokens, because the engine preempts the youngest and resumes it by recomputation
/// (`tl_preemptions_total` counts it). Before preemption, the youngest failed with "KV pool
/// exhausted" mid-stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_runs_dry_pauses_streams_instead_of_killing_them() {
    use tl_engine::node::EngineNode;
    use tl_engine::node::config::Role;
    let gw = tl_engine::gateway::GatewayNode::start(&GatewayConfig::local())
        .await
        .unwrap();
    let mut cfg = common::engine_cfg("B", Role::Both, &gw.registry_addr().to_string());
    cfg.pool.n_blocks = 48;
    cfg.model.decode_us_per_seq = 2_000;
    let both = EngineNode::start(&cfg).await.unwrap();
    common::wait_workers(&gw, 1).await;
    let addr = gw.http_addr().to_string();
    let streams: Vec<_> = (0..3u64)
        .map(|i| {
            let addr = addr.clone();
            let prompt: Vec<u32> = (0..20).map(|t| 30 + t * 3 + i as u32).collect();
            tokio::spawn(async move {
                let body = json!({ "prompt": prompt, "max_tokens": 60, "seed": i,
                                   "temperature": 0.7, "stream": true });
                let r = HttpClient::default()
                    .post(&addr, "/v1/completions", &[], body.to_string())
                    .await
                    .unwrap();
                (prompt, i, r)
            })
        })
        .collect();
    for s in streams {
        let (prompt, seed, r) = s.await.unwrap();
        assert_eq!(r.status, 200, "{:?}", r.body);
        // Ends with [DONE], no error event: the stream was not cut.
        let got = common::stream_tokens(&r);
        assert_eq!(
            got,
            common::colocated(&prompt, 0.7, seed, 60),
            "seed {seed}"
        );
    }
    let text = both.metrics().encode();
    let preempted: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tl_preemptions_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no tl_preemptions_total in {text}"));
    assert!(preempted >= 1, "the pool was meant to run dry");
    let pool = both.runner().pool();
    assert!(eventually(Duration::from_secs(5), || pool.counts().used == 0).await);
    pool.lock().check().unwrap();
}

/// One key filling a decode pool cannot lock another key out of it: the other key's push
/// waits (`import_wait_ms`) while the engine preempts the filling key's youngest request, so
/// the request is served with its colocated tokens instead of 429, and every stream of the
/// first key still ends with its own tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_makes_room_for_another_tenant() {
    let dir = std::env::temp_dir().join(format!("tl-room-{}", std::process::id()));
    let cfg = keyed_gateway(&dir);
    let c = cluster_of(&cfg, 1, |cfg| {
        if cfg.engine.role == tl_engine::node::config::Role::Decode {
            cfg.pool.n_blocks = 96;
            cfg.model.decode_us_per_seq = 1_500;
        }
    })
    .await;
    let addr = c.gw.http_addr().to_string();
    // Key a: two requests of 4 choices, 80 tokens each: far more than 96 blocks of 4 tokens.
    let heavy: Vec<_> = (0..2u64)
        .map(|i| {
            let addr = addr.clone();
            tokio::spawn(async move {
                let body = json!({ "prompt": format!("heavy {i}"), "max_tokens": 80, "n": 4,
                                   "seed": i, "temperature": 0.7 });
                complete(&addr, Some("key-a"), &body).await
            })
        })
        .collect();
    let d = c.d[0].runner().clone();
    assert!(
        eventually(Duration::from_secs(5), || d.pool().counts().free < 20).await,
        "key a never filled the pool"
    );
    let prompt: Vec<u32> = (0..24).map(|t| 40 + t).collect();
    let (status, v) = complete(
        &addr,
        Some("key-b"),
        &json!({ "prompt": prompt, "max_tokens": 8, "seed": 3, "temperature": 0.7 }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(tokens_of(&v), common::colocated(&prompt, 0.7, 3, 8));
    for h in heavy {
        let (status, v) = h.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"].as_array().unwrap().len(), 4);
    }
    assert!(d.preemptions() >= 1, "nothing was preempted");
    settled(&c).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Trickling connections from many addresses, each within its per-address share, fill the
/// public port's whole connection cap: a newcomer still gets in, because the oldest connection
/// that never delivered a request is closed for it, and its request is served within 1 s.
/// Connections that have delivered a request are not the ones closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_the_oldest_silent_connection_makes_way() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut gw = GatewayConfig::local();
    gw.limits.http_max_conns = 64;
    gw.limits.http_max_conns_per_ip = 16;
    let c = cluster_of(&gw, 1, |_| {}).await;
    let addr = c.gw.http_addr();
    let connect_from = |ip: String| async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        sock.connect(addr).await.unwrap()
    };
    // A client that delivered a request and keeps its connection open (keep-alive).
    let mut kept = connect_from("127.0.0.9".into()).await;
    let body = r#"{"prompt":"hello","max_tokens":2}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    kept.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    // 6 addresses x 16 trickling connections: more than the cap of 64.
    let mut held = Vec::new();
    for i in 0..96 {
        let mut s = connect_from(format!("127.0.0.{}", 10 + i / 16)).await;
        let _ = s
            .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            .await;
        held.push(s);
    }
    let request = || async move {
        let mut s = connect_from("127.0.0.3".into()).await;
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    };
    let served = tokio::time::timeout(Duration::from_secs(1), request())
        .await
        .expect("the newcomer waited behind the trickling connections");
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    // The kept-alive connection that proved itself is still served.
    kept.write_all(head.as_bytes()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(1), kept.read(&mut buf))
        .await
        .expect("the proven connection was not answered")
        .unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    drop(held);
    settled(&c).await;
}

/// A source over its share of connections is answered, not dropped: its request gets 429 with
/// `Retry-After` and the connection closes, within a second, and its held connections are
/// still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_its_share_of_connections_a_source_gets_429_with_retry_after() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut gw = GatewayConfig::local();
    gw.limits.http_max_conns_per_ip = 2;
    let c = cluster_of(&gw, 1, |_| {}).await;
    let addr = c.gw.http_addr();
    let connect = || async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.7:0".parse().unwrap()).unwrap();
        sock.connect(addr).await.unwrap()
    };
    let body = r#"{"prompt":"hello","max_tokens":2}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // Two connections, the share, held open (half a request each).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = connect().await;
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            .await
            .unwrap();
        held.push(s);
    }
    let mut third = connect().await;
    third.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), third.read_to_end(&mut out))
        .await
        .expect("the refused connection was not answered and closed")
        .unwrap();
    let out = String::from_utf8_lossy(&out).to_lowercase();
    assert!(out.starts_with("http/1.1 429"), "{out}");
    assert!(out.contains("retry-after: 1\r\n"), "{out}");
    assert!(out.contains("\"rate_limit\""), "{out}");
    // The held ones finish their requests and are served.
    for mut s in held {
        let rest = format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(rest.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert!(
            got.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&got)
        );
    }
    settled(&c).await;
}

/// A prefill engine past the Prefill deadline is replaced by another prefill engine, once,
/// before any colocated fallback: the request is disaggregated still, with its colocated
/// tokens, within the deadline plus one prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_prefill_engine_is_replaced_by_another() {
    use tl_engine::node::EngineNode;
    use tl_engine::node::config::Role;
    let mut gw = GatewayConfig::local();
    gw.gateway.prefill_timeout_ms = 300;
    let c = cluster_of(&gw, 1, |cfg| {
        if cfg.engine.role == Role::Prefill {
            cfg.model.prefill_us_per_token = 200_000;
        }
    })
    .await;
    let reg = c.gw.registry_addr().to_string();
    // "P2" sorts after "P": with equal load, P is planned first and stalls.
    let p2 = EngineNode::start(&common::engine_cfg("P2", Role::Prefill, &reg))
        .await
        .unwrap();
    common::wait_workers(&c.gw, 3).await;
    let prompt: Vec<u32> = (1..=20).collect();
    let began = std::time::Instant::now();
    let (status, v) = complete(
        &c.gw.http_addr().to_string(),
        None,
        &json!({ "prompt": prompt, "max_tokens": 4, "seed": 2, "temperature": 0.7 }),
    )
    .await;
    let took = began.elapsed();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["tl_route"]["prefill"], "P2", "{v}");
    assert_eq!(v["tl_route"]["decode"], "D1", "{v}");
    assert_eq!(tokens_of(&v), common::colocated(&prompt, 0.7, 2, 4));
    assert!(took < Duration::from_millis(2500), "{took:?}");
    p2.shutdown(Duration::from_secs(1)).await;
    settled(&c).await;
}

/// With `tenant_header` configured, a request that does not name its tenant is refused (400,
/// naming the header) before it takes anything: it is not served as an unlimited, shared empty
/// tenant. The same request naming a tenant is served; the pools end as they began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_tenant_header_is_refused() {
    let mut gw = GatewayConfig::local();
    gw.gateway.tenant_header = "x-tenant".into();
    let c = cluster_of(&gw, 1, |_| {}).await;
    let addr = c.gw.http_addr().to_string();
    let before = c.d[0].runner().pool().lock().counts().used;
    let body = json!({"prompt": "hello", "max_tokens": 4}).to_string();
    let http = HttpClient::default();
    for headers in [vec![], vec![("x-tenant", "")]] {
        let r = http
            .post(&addr, "/v1/completions", &headers, body.clone())
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        assert!(
            v["error"]["message"].as_str().unwrap().contains("x-tenant"),
            "{v}"
        );
    }
    assert_eq!(c.d[0].runner().pool().lock().counts().used, before);
    let r = http
        .post(&addr, "/v1/completions", &[("x-tenant", "acme")], body)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    c.gw.stop().await;
}

/// One engine with a small pool sets no one's context: a decode engine registered with 8 blocks
/// takes no request it cannot hold, a 116-token request is still served (by the engine that
/// holds it), `/v1/models` advertises what that engine holds, and a request past every engine
/// is refused with 400 `context_length_exceeded`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_small_engine_sets_no_ones_context() {
    let c = cluster_of(&GatewayConfig::local(), 2, |cfg| {
        if cfg.engine.id == "D2" {
            cfg.pool.n_blocks = 8;
        }
    })
    .await;
    let addr = c.gw.http_addr().to_string();
    let small = c.d[1].runner().pool().lock().counts().used;
    let prompt: Vec<u32> = (0..100u32).map(|i| 97 + i % 26).collect();
    for seed in 0..4u64 {
        let (status, v) = complete(
            &addr,
            None,
            &json!({ "prompt": prompt, "max_tokens": 16, "seed": seed, "temperature": 0.8 }),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(tokens_of(&v).len(), 16);
    }
    assert_eq!(
        c.d[1].runner().pool().lock().counts().used,
        small,
        "the small engine took none of them"
    );
    let m: Value = HttpClient::default()
        .get(&addr, "/v1/models")
        .await
        .unwrap()
        .json();
    let len = m["data"][0]["max_model_len"].as_u64().unwrap();
    assert!(len >= 116, "{m}");
    let (status, v) = complete(
        &addr,
        None,
        &json!({ "prompt": prompt, "max_tokens": len - 99 }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "context_length_exceeded", "{v}");
    settled(&c).await;
}

/// A body whose `Content-Length` is over `max_body_bytes` is refused with 413 as soon as the
/// headers are in, before a byte of it is sent: a client streaming a large upload learns at
/// once, and the gateway reads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_content_length_is_refused_before_the_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = cluster_of(&GatewayConfig::local(), 1, |_| {}).await;
    let mut s = tokio::net::TcpStream::connect(c.gw.http_addr())
        .await
        .unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
          Content-Length: 10000000\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
        .await
        .expect("an answer before any body was sent")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    c.gw.stop().await;
}

/// Issue 63, class 2: a keyless gateway on loopback serves no web page. DNS rebinding (a
/// `Host` naming another site) and a cross-site page's `Origin` get 403, a `text/plain` or
/// form body 415, each before an engine is asked; an SDK's request (an IP or `localhost` as
/// `Host`, JSON, no `Origin`) and a loopback page's are served, and the pools are as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_use_a_keyless_gateway_on_loopback() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = cluster_of(&GatewayConfig::local(), 1, |_| {}).await;
    let addr = c.gw.http_addr();
    let raw = |method: &'static str, path: &'static str, headers: String, body: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    };
    let body = r#"{"prompt":"hello","max_tokens":2}"#;
    let json = "Content-Type: application/json\r\n";
    for (method, path, headers, body, want) in [
        // DNS rebinding: the page's own name, resolved to 127.0.0.1.
        (
            "POST",
            "/v1/completions",
            format!("Host: attacker.example:{}\r\n{json}", addr.port()),
            body,
            "403",
        ),
        (
            "GET",
            "/v1/models",
            format!("Host: attacker.example:{}\r\n", addr.port()),
            "",
            "403",
        ),
        (
            "GET",
            "/workers",
            "Host: rebind.attacker.example\r\n".to_owned(),
            "",
            "403",
        ),
        // A cross-site page's "simple" request, and its JSON one.
        (
            "POST",
            "/v1/completions",
            "Host: localhost\r\nOrigin: http://attacker.example\r\nContent-Type: text/plain\r\n"
                .to_owned(),
            body,
            "403",
        ),
        (
            "POST",
            "/v1/completions",
            format!("Host: localhost\r\nOrigin: https://attacker.example\r\n{json}"),
            body,
            "403",
        ),
        // A body that is not JSON, from anywhere.
        (
            "POST",
            "/v1/completions",
            "Host: localhost\r\nContent-Type: text/plain\r\n".to_owned(),
            body,
            "415",
        ),
        (
            "POST",
            "/v1/chat/completions",
            "Host: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\n".to_owned(),
            body,
            "415",
        ),
        // What an SDK or curl sends, and a page served from loopback.
        (
            "POST",
            "/v1/completions",
            format!("Host: 127.0.0.1:{}\r\n{json}", addr.port()),
            body,
            "200",
        ),
        (
            "POST",
            "/v1/completions",
            format!("Host: localhost:{}\r\n{json}", addr.port()),
            body,
            "200",
        ),
        (
            "POST",
            "/v1/completions",
            format!("Host: localhost\r\nOrigin: http://localhost:3000\r\n{json}"),
            body,
            "200",
        ),
        (
            "GET",
            "/v1/models",
            "Host: localhost\r\n".to_owned(),
            "",
            "200",
        ),
    ] {
        let got = raw(method, path, headers.clone(), body).await;
        assert!(
            got.starts_with(&format!("HTTP/1.1 {want}")),
            "{method} {path} with {headers:?}: {got}"
        );
        if want != "200" {
            assert!(got.contains("\"error\""), "an OpenAI-style error: {got}");
        }
    }
    settled(&c).await;
}
