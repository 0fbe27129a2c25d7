//! Engines that change role at run time (EngineControl.SetRole): an engine of role both moves
//! between decode and prefill under streaming load, and nothing is lost. Every request equals
//! its colocated run, the pools end where they began, and a stale call against the old role is
//! refused with the contract's code, touching nothing.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{colocated, eventually, wait_workers};
use serde_json::json;
use tl_engine::api::sse::StreamEvent;
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::{ControlClient, EventStream, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tokio::sync::Mutex;
use tonic::Code;

const MAX_TOKENS: u32 = 12;

/// An engine of `role` serving as `serving` at start; 4 ms a decode step per sequence, so a
/// stream lasts about 50 ms and the moves land while streams run.
fn cfg(id: &str, role: Role, serving: Option<Role>, registry: &str) -> Config {
    let mut c = common::engine_cfg(id, role, registry);
    c.engine.serving = serving;
    c.model.decode_us_per_seq = 4_000;
    c.model.prefill_us_per_token = 200;
    c
}

/// What one request got: its tokens, the engines that prefilled and decoded it, any error.
#[derive(Debug, Default)]
struct Got {
    tokens: Vec<u32>,
    prefill: String,
    decode: String,
    error: Option<String>,
    done: bool,
}

async fn complete(gw: &str, prompt: &[u32], t: f32, seed: u64) -> Got {
    let body = json!({
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": t, "seed": seed, "stream": true,
    })
    .to_string();
    let (status, b) = HttpClient::default()
        .post_streaming(gw, "/v1/completions", &[], body)
        .await
        .unwrap();
    assert_eq!(status, 200);
    let mut events = EventStream::new(b);
    let mut got = Got::default();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(20), events.next())
        .await
        .expect("the stream went silent")
    {
        match e.unwrap() {
            StreamEvent::Chunk(c) => {
                if let Some(r) = &c.tl_route {
                    got.prefill.clone_from(&r.prefill);
                    got.decode.clone_from(&r.decode);
                }
                for ch in &c.choices {
                    got.tokens.extend(&ch.tokens);
                }
            }
            StreamEvent::Error(e) => got.error = Some(e.message),
            StreamEvent::Done => {
                got.done = true;
                break;
            }
        }
    }
    got
}

/// Request `i`'s prompt: its own first token, so no two share a block.
fn prompt_of(i: usize) -> Vec<u32> {
    let first = 1 + i as u32;
    std::iter::once(first)
        .chain((0..8 + (i % 7) as u32).map(|k| 60 + k))
        .collect()
}

/// Polls until the gateway's view has `id` serving as `role`.
async fn seen_as(gw: &GatewayNode, id: &str, role: Role) -> bool {
    eventually(Duration::from_secs(5), || {
        gw.registry()
            .list(Instant::now())
            .iter()
            .any(|w| w.worker_id == id && tl_engine::gateway::worker::serving_role(w) == Some(role))
    })
    .await
}

/// Every engine runs nothing and holds no block in use and no pending handle.
async fn at_baseline(nodes: &[&EngineNode]) -> bool {
    eventually(Duration::from_secs(5), || {
        nodes.iter().all(|n| {
            n.runner().running() == 0
                && n.runner().pool().lock().counts().used == 0
                && n.receiver()
                    .is_none_or(|r| r.pending() == 0 && r.stats().inflight == 0)
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_change_loses_nothing() {
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    let p = EngineNode::start(&cfg("P", Role::Prefill, None, &reg))
        .await
        .unwrap();
    let x = EngineNode::start(&cfg("X", Role::Both, Some(Role::Decode), &reg))
        .await
        .unwrap();
    let d = EngineNode::start(&cfg("D", Role::Decode, None, &reg))
        .await
        .unwrap();
    wait_workers(&gw, 3).await;
    assert!(seen_as(&gw, "X", Role::Decode).await);
    let x_ctl = ControlClient::new(&x.addresses().grpc).unwrap();
    let front = gw.http_addr().to_string();

    // Streaming load: a request every 20 ms, each its own prompt (no prefix is shared, so
    // routing goes by load), greedy and seeded alternately.
    let n = 60usize;
    let got: Arc<Mutex<Vec<(usize, Got)>>> = Arc::default();
    let load = {
        let (got, front) = (Arc::clone(&got), front.clone());
        tokio::spawn(async move {
            let mut tasks = Vec::new();
            for i in 0..n {
                let (got, front) = (Arc::clone(&got), front.clone());
                tasks.push(tokio::spawn(async move {
                    let prompt = prompt_of(i);
                    let (t, seed) = if i % 2 == 0 {
                        (0.0, 0)
                    } else {
                        (0.9, 100 + i as u64)
                    };
                    let r = complete(&front, &prompt, t, seed).await;
                    got.lock().await.push((i, r));
                }));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for t in tasks {
                t.await.unwrap();
            }
        })
    };

    // decode -> prefill while streams run on X: they finish there, and the move waits for them
    // and for X's pending handles. Moved once X decodes, so there is work for the move to wait
    // for (`remaining == 0` then says it ended).
    assert!(
        eventually(Duration::from_secs(10), || x.runner().running() > 0).await,
        "no stream reached X"
    );
    let moved = x_ctl.set_role(Role::Prefill, 10_000).await.unwrap();
    assert_eq!(moved.serving, vec!["prefill".to_owned()]);
    assert_eq!(moved.remaining, 0, "X's decode work did not end");
    assert!(
        seen_as(&gw, "X", Role::Prefill).await,
        "the registry never heard"
    );
    // prefill -> decode, once Prefill calls reach X (each is a submission on its engine
    // thread; nothing else is sent to X while it prefills).
    let submitted = x.runner().load().submitted();
    assert!(
        eventually(Duration::from_secs(10), || x.runner().load().submitted()
            > submitted)
        .await,
        "no Prefill call reached X"
    );
    let back = x_ctl.set_role(Role::Decode, 10_000).await.unwrap();
    assert_eq!(back.serving, vec!["decode".to_owned()]);
    assert_eq!(back.remaining, 0, "X's Prefill calls did not end");
    assert!(seen_as(&gw, "X", Role::Decode).await);
    load.await.unwrap();

    let got = std::mem::take(&mut *got.lock().await);
    assert_eq!(got.len(), n);
    let (mut x_prefilled, mut x_decoded) = (0, 0);
    for (i, r) in &got {
        let prompt = prompt_of(*i);
        let (t, seed) = if i % 2 == 0 {
            (0.0, 0)
        } else {
            (0.9, 100 + *i as u64)
        };
        assert!(r.error.is_none() && r.done, "request {i}: {r:?}");
        assert_eq!(
            r.tokens,
            colocated(&prompt, t, seed, MAX_TOKENS),
            "request {i} ({} -> {})",
            r.prefill,
            r.decode
        );
        x_prefilled += usize::from(r.prefill == "X");
        x_decoded += usize::from(r.decode == "X");
    }
    eprintln!("X prefilled {x_prefilled} and decoded {x_decoded} of {n}");
    // X really served in both roles: the moves were not no-ops.
    assert!(x_prefilled > 0, "X never prefilled: {got:?}");
    assert!(x_decoded > 0, "X never decoded: {got:?}");

    // Stale calls against the old role are refused and take nothing.
    let before = x.runner().pool().lock().counts();
    let stale = x_ctl
        .prefill(kvwire_grpc::pb::engine::PrefillRequest {
            request_id: "stale".into(),
            prompt_tokens: vec![1, 2, 3, 4, 5],
            decode_target: d.addresses().kv.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale}");
    // A stale colocated request at X's front while X prefills: 421, nothing taken.
    assert_eq!(
        x_ctl
            .set_role(Role::Prefill, 1_000)
            .await
            .unwrap()
            .remaining,
        0
    );
    let r = HttpClient::default()
        .post(
            &x.addresses().http,
            "/v1/completions",
            &[],
            json!({"prompt": [1, 2, 3], "max_tokens": 2}).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 421, "{:?}", r.body);
    assert_eq!(x.runner().pool().lock().counts(), before);
    x_ctl.set_role(Role::Decode, 0).await.unwrap();
    // The longest deadline a caller can write is taken (the engine bounds its wait at 600 s).
    let far = x_ctl.set_role(Role::Decode, i64::MAX).await.unwrap();
    assert_eq!(far.remaining, 0);
    assert!(x_ctl.drain(i64::MAX).await.is_ok());
    // An engine configured prefill cannot decode.
    let p_ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let refused = p_ctl.set_role(Role::Decode, 0).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
    assert_eq!(p.state().serving(), Role::Prefill);
    assert_eq!(x.runner().pool().lock().counts(), before);

    assert!(
        at_baseline(&[&p, &x, &d]).await,
        "the pools did not go back"
    );
    for id in ["P", "X", "D"] {
        assert_eq!(gw.gateway().routed_on(id), 0, "{id} still counted");
    }
}

/// The planner (`[planner]`) sees the prefill engine's queue grow while two engines of role
/// both decode, and moves one of them to prefill; every request still equals its colocated
/// run, the move is counted, and the pools go back to baseline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_moves_a_decode_engine_to_a_queueing_prefill() {
    let mut gcfg = GatewayConfig::local();
    gcfg.planner = tl_engine::gateway::roles::PlannerSection {
        enabled: true,
        interval_ms: 50,
        // The first move waits one cooldown of watching; no second is possible (one decode
        // engine would be left, and decode never reaches its mark).
        cooldown_ms: 300,
        prefill_queue_high: 2.0,
        prefill_queue_low: 0.5,
        decode_running_high: 1_000.0,
        smoothing: 0.5,
    };
    let gw = GatewayNode::start(&gcfg).await.unwrap();
    let reg = gw.registry_addr().to_string();
    // Prefill at 2 ms a token: a 40-token prompt takes 80 ms, so a burst queues on P.
    let slow = |mut c: Config| {
        c.model.prefill_us_per_token = 2_000;
        c
    };
    let p = EngineNode::start(&slow(cfg("P", Role::Prefill, None, &reg)))
        .await
        .unwrap();
    let x1 = EngineNode::start(&slow(cfg("X1", Role::Both, Some(Role::Decode), &reg)))
        .await
        .unwrap();
    let x2 = EngineNode::start(&slow(cfg("X2", Role::Both, Some(Role::Decode), &reg)))
        .await
        .unwrap();
    wait_workers(&gw, 3).await;
    let front = gw.http_addr().to_string();
    let prompt_of = |i: usize| -> Vec<u32> {
        std::iter::once(1 + i as u32)
            .chain((0..39).map(|k| 70 + k))
            .collect()
    };
    let mut tasks = Vec::new();
    for i in 0..24 {
        let (front, prompt) = (front.clone(), prompt_of(i));
        tasks.push(tokio::spawn(async move {
            complete(&front, &prompt, 0.7, 500 + i as u64).await
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let moved = eventually(Duration::from_secs(10), || {
        gw.registry().list(Instant::now()).iter().any(|w| {
            w.worker_id.starts_with('X')
                && tl_engine::gateway::worker::serving_role(w) == Some(Role::Prefill)
        })
    })
    .await;
    assert!(moved, "the planner moved no engine");
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        assert!(r.error.is_none() && r.done, "request {i}: {r:?}");
        assert_eq!(
            r.tokens,
            colocated(&prompt_of(i), 0.7, 500 + i as u64, MAX_TOKENS)
        );
    }
    let text = gw.gateway().metrics().encode();
    assert!(
        text.lines().any(|l| l
            .starts_with("tl_role_changes_total{from=\"decode\",to=\"prefill\",outcome=\"ok\"} 1")),
        "{text}"
    );
    // One engine still decodes: the planner never empties a role.
    let decoding = gw
        .registry()
        .list(Instant::now())
        .iter()
        .filter(|w| tl_engine::gateway::worker::serving_role(w) == Some(Role::Decode))
        .count();
    assert_eq!(decoding, 1);
    assert!(
        at_baseline(&[&p, &x1, &x2]).await,
        "the pools did not go back"
    );
}

/// `tl role` moves an engine of role both and prints what it serves in; an engine configured
/// prefill refuses (exit 1, nothing changed), and an unknown role is a usage error (exit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tl_role_moves_an_engine_and_reports_refusals() {
    let x = EngineNode::start(&cfg("X", Role::Both, None, ""))
        .await
        .unwrap();
    let p = EngineNode::start(&cfg("P", Role::Prefill, None, ""))
        .await
        .unwrap();
    let tl = |engine: String, role: &'static str| {
        tokio::task::spawn_blocking(move || {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_tl"))
                .args([
                    "role",
                    "--engine",
                    &engine,
                    "--role",
                    role,
                    "--wait-ms",
                    "1000",
                ])
                .output()
                .unwrap();
            (
                out.status.code().unwrap(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        })
    };
    let (code, out, err) = tl(x.addresses().grpc, "prefill").await.unwrap();
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["serving"], json!(["prefill"]), "{v}");
    assert_eq!(v["remaining"], 0, "{v}");
    assert_eq!(x.state().serving(), Role::Prefill);
    let (code, _, err) = tl(p.addresses().grpc, "decode").await.unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("FailedPrecondition"), "{err}");
    assert_eq!(p.state().serving(), Role::Prefill);
    let (code, _, err) = tl(x.addresses().grpc, "sideways").await.unwrap();
    assert_eq!(code, 2, "{err}");
    assert_eq!(x.state().serving(), Role::Prefill);
}
