//! The gateway end to end: tokens through its HTTP equal a colocated run, routing by cached
//! prefix and load, client aborts, failover, eviction, and bad requests.

mod common;

use std::time::{Duration, Instant};

use common::{
    cluster, cluster_with, colocated, engine_cfg, eventually, settled, stream_tokens, wait_workers,
};
use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use serde_json::{Value, json};
use tl_engine::api::{ChatMessage, render_chat};
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
use tl_engine::net::clients::{ControlClient, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine::node::heartbeat::worker_status;
use tl_engine_core::sampler::SamplingRequest;

/// The first choice's token ids.
fn tokens_of(v: &Value) -> Vec<u32> {
    choice_tokens(&v["choices"][0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_tokens_equal_colocated() {
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let prompt: Vec<u32> = (30..50).collect();
    for (t, seed) in [(0.0f32, 11u64), (0.9, 12)] {
        let want = colocated(&prompt, t, seed, 10);
        let body = json!({ "prompt": prompt, "max_tokens": 10, "temperature": t, "seed": seed });
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        assert_eq!(tokens_of(&v), want);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 10);
        assert_eq!(v["usage"]["prompt_tokens"], 20);
        assert_eq!(v["tl_route"]["prefill"], "P");
        // Streaming: the same tokens, first chunk first, then [DONE].
        let body = json!({ "prompt": prompt, "max_tokens": 10, "temperature": t, "seed": seed, "stream": true });
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(stream_tokens(&r), want);
    }
    // Chat: rendered with the documented template, equal to a colocated run of that text.
    let msgs =
        json!([{ "role": "system", "content": "be brief" }, { "role": "user", "content": "hi" }]);
    let r = http
        .post(
            &addr,
            "/v1/chat/completions",
            &[],
            json!({ "messages": msgs, "max_tokens": 6, "seed": 3 }).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    let msg = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    let text = render_chat(&[msg("system", "be brief"), msg("user", "hi")]);
    let prompt: Vec<u32> = text.bytes().map(u32::from).collect();
    assert_eq!(tokens_of(&v), colocated(&prompt, 0.0, 3, 6));
    assert!(v["choices"][0]["message"]["content"].is_string());
    // Models, health, workers.
    let m = http.get(&addr, "/v1/models").await.unwrap().json();
    assert_eq!(m["data"][0]["id"], "fake");
    assert_eq!(http.get(&addr, "/health").await.unwrap().status, 200);
    let w = http.get(&addr, "/workers").await.unwrap().json();
    assert_eq!(w["workers"].as_array().unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_prefers_the_cached_prefix_unless_far_more_loaded() {
    // Engines without heartbeats: the test writes their statuses into the registry itself, so
    // the loads are exactly what it says.
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let p = EngineNode::start(&engine_cfg("P", Role::Prefill, ""))
        .await
        .unwrap();
    let d1 = EngineNode::start(&engine_cfg("D1", Role::Decode, ""))
        .await
        .unwrap();
    let d2 = EngineNode::start(&engine_cfg("D2", Role::Decode, ""))
        .await
        .unwrap();
    let register = |node: &EngineNode, running: u32| {
        let mut s = worker_status(node.state(), &node.addresses(), 60_000);
        s.running = running;
        gw.registry().heartbeat(s, Instant::now());
    };
    register(&p, 0);
    register(&d1, 0);
    register(&d2, 0);
    // D2 (the higher id, so a tie would not pick it) holds the prompt's first 32 blocks.
    let prompt: Vec<u32> = (0..130).map(|i| (i * 3 % 256) as u32).collect();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let h = ctl
        .prefill(PrefillRequest {
            cache_scope: Default::default(),
            request_id: "warm".into(),
            prompt_tokens: prompt[..128].to_vec(),
            sampling: Some(SamplingParams::default()),
            decode_target: d2.addresses().kv,
            rng_draws_offset: 0,
            decode_holds: None,
            decode_lookup: String::new(),
        })
        .await
        .unwrap();
    assert!(d2.receiver().unwrap().release(&h.handle_id));
    let http = HttpClient::default();
    let addr = gw.http_addr().to_string();
    let body = json!({ "prompt": prompt, "max_tokens": 3 }).to_string();
    let r = http
        .post(&addr, "/v1/completions", &[], body.clone())
        .await
        .unwrap()
        .json();
    assert_eq!(r["tl_route"]["decode"], "D2", "{r}");
    assert_eq!(r["tl_route"]["cached_blocks"], 32);
    assert!(
        r["tl_route"]["reason"]
            .as_str()
            .unwrap()
            .starts_with("prefix hit")
    );
    // A little more load on D2 does not move the request...
    register(&d2, 1);
    let r = http
        .post(&addr, "/v1/completions", &[], body.clone())
        .await
        .unwrap()
        .json();
    assert_eq!(r["tl_route"]["decode"], "D2", "{r}");
    // ...far more does.
    register(&d2, 40);
    let r = http
        .post(&addr, "/v1/completions", &[], body)
        .await
        .unwrap()
        .json();
    assert_eq!(r["tl_route"]["decode"], "D1", "{r}");
    assert_eq!(r["tl_route"]["cached_blocks"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_abort_after_first_token_frees_everything() {
    // Room for a completion as long as the context (the gateway refuses what cannot fit).
    let c = cluster_with(1, |cfg| cfg.pool.n_blocks = 2048).await;
    let d = &c.d[0];
    let d_base = d.runner().pool().lock().counts().used;
    let http = HttpClient::default();
    let prompt: Vec<u32> = (0..37).collect();
    let body = json!({ "prompt": prompt, "max_tokens": 4000, "stream": true, "seed": 1 });
    let (status, mut stream) = http
        .post_streaming(
            &c.gw.http_addr().to_string(),
            "/v1/completions",
            &[],
            body.to_string(),
        )
        .await
        .unwrap();
    assert_eq!(status, 200);
    use http_body_util::BodyExt;
    let first = stream.frame().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(first.data_ref().unwrap()).contains("\"tokens\""));
    drop(stream);
    assert!(
        settled(d, d_base).await,
        "sequence not cancelled or blocks not freed"
    );
    assert_eq!(d.receiver().unwrap().pending(), 0);
    assert_eq!(c.p.runner().pool().lock().counts().used, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusing_or_stopped_decode_engine_is_routed_around() {
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    let p = EngineNode::start(&engine_cfg("P", Role::Prefill, &reg))
        .await
        .unwrap();
    // D0 sorts first but its pool has another head_dim: its receiver refuses every push
    // (FAILED_PRECONDITION, rule 6), which the gateway answers by trying the next engine.
    let mut odd = engine_cfg("D0", Role::Decode, &reg);
    odd.model.head_dim = 8;
    let d0 = EngineNode::start(&odd).await.unwrap();
    let d1 = EngineNode::start(&engine_cfg("D1", Role::Decode, &reg))
        .await
        .unwrap();
    wait_workers(&gw, 3).await;
    let http = HttpClient::default();
    let addr = gw.http_addr().to_string();
    let prompt: Vec<u32> = (5..25).collect();
    let body = json!({ "prompt": prompt, "max_tokens": 5, "seed": 4 }).to_string();
    let r = http
        .post(&addr, "/v1/completions", &[], body.clone())
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["tl_route"]["decode"], "D1", "{v}");
    assert_eq!(v["tl_route"]["retries"], 1);
    assert_eq!(tokens_of(&v), colocated(&prompt, 0.0, 4, 5));
    assert_eq!(d0.runner().pool().lock().counts().used, 0);

    // D1 stops (and so stops beating): requests fail over to... nothing but D0, which refuses;
    // with a both-role engine present, the gateway falls back to it.
    let b = EngineNode::start(&engine_cfg("B", Role::Both, &reg))
        .await
        .unwrap();
    d1.shutdown(Duration::from_millis(100)).await;
    // The registry forgets D1 after 3 missed beats of 100 ms.
    assert!(
        eventually(Duration::from_secs(3), || !gw
            .registry()
            .list(Instant::now())
            .iter()
            .any(|w| w.worker_id == "D1"))
        .await
    );
    let r = http
        .post(&addr, "/v1/completions", &[], body)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["tl_route"]["decode"], "B", "{v}");
    assert_eq!(tokens_of(&v), colocated(&prompt, 0.0, 4, 5));
    // Without any engine able to serve: 503 with a JSON error.
    b.shutdown(Duration::from_millis(100)).await;
    d0.shutdown(Duration::from_millis(100)).await;
    assert!(
        eventually(Duration::from_secs(3), || gw
            .registry()
            .list(Instant::now())
            .len()
            == 1)
        .await
    );
    let r = http
        .post(
            &addr,
            "/v1/completions",
            &[],
            json!({ "prompt": "x", "max_tokens": 2 }).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"].is_string());
    p.shutdown(Duration::from_millis(100)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_400_and_touch_no_engine() {
    let c = cluster(1).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let pool_p = c.p.runner().pool().lock().counts();
    let pool_d = c.d[0].runner().pool().lock().counts();
    let cases = [
        ("/v1/completions", r#"{"prompt": "", "max_tokens": 4}"#),
        ("/v1/completions", r#"{"prompt": [], "max_tokens": 4}"#),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 0}"#),
        ("/v1/completions", r#"{"prompt": "hi", "temperature": -1}"#),
        ("/v1/completions", r#"{"prompt": "hi", "top_p": 2}"#),
        ("/v1/completions", r#"{"prompt": "hi""#),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "model": "gpt-unknown"}"#,
        ),
        ("/v1/chat/completions", r#"{"messages": []}"#),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#,
        ),
    ];
    for (path, body) in cases {
        let r = http.post(&addr, path, &[], body).await.unwrap();
        assert_eq!(
            r.status,
            400,
            "{path} {body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json();
        assert!(v["error"]["message"].is_string(), "{body}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    assert_eq!(c.p.runner().pool().lock().counts(), pool_p);
    assert_eq!(c.d[0].runner().pool().lock().counts(), pool_d);
    assert_eq!(c.p.state().inflight_prefills(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_in_flight_429_and_timeout_504() {
    let section = GatewaySection {
        max_inflight: 1,
        request_timeout_ms: 400,
        ..GatewaySection::local()
    };
    let gw = GatewayNode::start(&section.into()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    // Slow decode: 20 ms per sequence per step (simulated, sleeping).
    let slow = |id: &str, role| {
        let mut c = engine_cfg(id, role, &reg);
        c.model.decode_us_per_seq = 20_000;
        c
    };
    let p = EngineNode::start(&slow("P", Role::Prefill)).await.unwrap();
    let d = EngineNode::start(&slow("D1", Role::Decode)).await.unwrap();
    wait_workers(&gw, 2).await;
    let addr = gw.http_addr().to_string();
    let http = HttpClient::default();
    // About 1 s of decoding: longer than the 400 ms timeout.
    let long = json!({ "prompt": "slow one", "max_tokens": 50 }).to_string();
    let first = {
        let (http, addr, long) = (http.clone(), addr.clone(), long.clone());
        tokio::spawn(async move {
            http.post(&addr, "/v1/completions", &[], long)
                .await
                .unwrap()
        })
    };
    // The first holds the gateway's one place once it decodes.
    assert!(
        common::eventually(Duration::from_secs(5), || d.runner().running() > 0).await,
        "the first request never reached D1"
    );
    let r = http
        .post(
            &addr,
            "/v1/completions",
            &[],
            json!({ "prompt": "second", "max_tokens": 2 }).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.json()["error"]["message"].is_string());
    let r = first.await.unwrap();
    assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
    // The timed-out request's decode sequence is cancelled, its blocks freed.
    assert!(
        settled(&d, 0).await,
        "sequence not cancelled or blocks not freed"
    );
    assert_eq!(p.runner().pool().lock().counts().used, 0);
    // The timed-out request no longer counts as load on D1.
    let w = http.get(&addr, "/workers").await.unwrap().json();
    let d1 = w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == "D1")
        .unwrap()
        .clone();
    assert_eq!(d1["routed_in_flight"], 0, "{d1}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_abort_during_prefill_cancels_it() {
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    // A slow prefill: 10 ms per prompt token (simulated).
    let mut pc = engine_cfg("P", Role::Prefill, &reg);
    pc.model.prefill_us_per_token = 10_000;
    let p = EngineNode::start(&pc).await.unwrap();
    let d = EngineNode::start(&engine_cfg("D1", Role::Decode, &reg))
        .await
        .unwrap();
    wait_workers(&gw, 2).await;
    let http = HttpClient::default();
    let body = json!({ "prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 4 }).to_string();
    let addr = gw.http_addr().to_string();
    let call = http.post(&addr, "/v1/completions", &[], body);
    // Give up while the prefill (about 400 ms) is still running.
    assert!(
        tokio::time::timeout(Duration::from_millis(150), call)
            .await
            .is_err()
    );
    assert!(
        eventually(Duration::from_secs(3), || p.state().inflight_prefills()
            == 0)
        .await,
        "prefill not cancelled"
    );
    assert!(
        eventually(Duration::from_secs(3), || p
            .runner()
            .pool()
            .lock()
            .counts()
            .used
            == 0)
        .await
    );
    assert!(
        eventually(Duration::from_secs(3), || d.receiver().unwrap().pending()
            == 0)
        .await
    );
    assert_eq!(d.runner().pool().lock().counts().used, 0);
}

/// A client that gives up on a list of prompts ends every prompt's request, not only the
/// first's: the prefill engine stops prefilling and every block comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_abort_of_a_prompt_list_cancels_every_prompt() {
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    // Slow prefills: 30 ms per prompt token, 1.2 s a prompt, 3.6 s for the three.
    let mut pc = engine_cfg("P", Role::Prefill, &reg);
    pc.model.prefill_us_per_token = 30_000;
    let p = EngineNode::start(&pc).await.unwrap();
    let d = EngineNode::start(&engine_cfg("D1", Role::Decode, &reg))
        .await
        .unwrap();
    wait_workers(&gw, 2).await;
    let http = HttpClient::default();
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|i| (0..40).map(|t| (t * 7 + i) % 256).collect())
        .collect();
    let body = json!({ "prompt": prompts, "max_tokens": 4 }).to_string();
    let addr = gw.http_addr().to_string();
    let call = http.post(&addr, "/v1/completions", &[], body);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), call)
            .await
            .is_err()
    );
    // Well before any one prompt's prefill could have ended by itself.
    assert!(
        eventually(Duration::from_secs(2), || p.state().inflight_prefills()
            == 0)
        .await,
        "a prompt's prefill outlived its client"
    );
    // The blocks come back once the engine's step in progress ends (a step is not
    // interrupted).
    assert!(
        eventually(Duration::from_secs(10), || p
            .runner()
            .pool()
            .lock()
            .counts()
            .used
            == 0)
        .await
    );
    assert!(
        eventually(Duration::from_secs(10), || d.receiver().unwrap().pending()
            == 0)
        .await
    );
    assert_eq!(d.runner().pool().lock().counts().used, 0);
}

/// A character split over two byte tokens streams as one character: the streamed chunks'
/// text, concatenated, is byte-equal to the whole response's text, on completions and chat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_equals_text() {
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let mut multibyte = 0;
    for seed in 1..=6u64 {
        for (path, body) in [
            (
                "/v1/completions",
                json!({ "prompt": "Բարեւ, 日本", "max_tokens": 200, "temperature": 1.0, "seed": seed }),
            ),
            (
                "/v1/chat/completions",
                json!({ "messages": [{ "role": "user", "content": "héllo" }], "max_tokens": 200, "temperature": 1.0, "seed": seed }),
            ),
        ] {
            let whole = http.post(&addr, path, &[], body.to_string()).await.unwrap();
            assert_eq!(whole.status, 200);
            let v = whole.json();
            let text = v["choices"][0]["text"]
                .as_str()
                .or(v["choices"][0]["message"]["content"].as_str())
                .unwrap()
                .to_owned();
            let mut streamed_body = body.clone();
            streamed_body["stream"] = json!(true);
            let r = http
                .post(&addr, path, &[], streamed_body.to_string())
                .await
                .unwrap();
            let mut streamed = String::new();
            for e in r.events().unwrap() {
                if let tl_engine::api::sse::StreamEvent::Chunk(ch) = e {
                    for choice in &ch.choices {
                        streamed.push_str(choice.text.as_deref().unwrap_or_default());
                        if let Some(d) = &choice.delta {
                            streamed.push_str(d.content.as_deref().unwrap_or_default());
                        }
                    }
                }
            }
            assert_eq!(streamed, text, "{path} seed {seed}");
            multibyte += text
                .chars()
                .filter(|&ch| ch.len_utf8() > 1 && ch != char::REPLACEMENT_CHARACTER)
                .count();
        }
    }
    // The cases above do split characters (else the test would prove nothing).
    assert!(multibyte > 0, "no multi-byte character was generated");
}

/// OpenAI fields this server does not implement are refused by name, never silently ignored;
/// their "off" values pass; fields OpenAI does not define are refused as unknown. Nothing
/// reaches an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_fields_are_400() {
    let c = cluster(1).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let before = c.p.runner().pool().lock().counts();
    let refused = [
        (
            "/v1/completions",
            json!({ "prompt": "hi", "echo": true }),
            "`echo` is not supported",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "best_of": 3 }),
            "`best_of` is not supported",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "suffix": "x" }),
            "`suffix` is not supported",
        ),
        // Penalties and biases are served, within their ranges.
        (
            "/v1/completions",
            json!({ "prompt": "hi", "logit_bias": { "fifty": 1 } }),
            "`logit_bias.fifty` keys are token ids",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "logit_bias": { "50": 101 } }),
            "biases are in [-100, 100]",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{"role": "user", "content": "hi"}], "logit_bias": { "260": 1 } }),
            "logit_bias token 260 is outside the vocabulary",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "presence_penalty": 2.5 }),
            "presence_penalty 2.5 must be in [-2, 2]",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3 }),
            "frequency_penalty -3 must be in [-2, 2]",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "repetition_penalty": 0 }),
            "`repetition_penalty` must be > 0",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "min_p": 1.5 }),
            "min_p 1.5 must be in [0, 1]",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "stop": ["a", "b", "c", "d", "e"] }),
            "at most 4",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "stop": "" }),
            "`stop` strings are 1 to",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "stop_token_ids": [260] }),
            "outside the vocabulary",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "n": 9 }),
            "`n` must be between 1 and 8",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "n": 0 }),
            "`n` must be between 1 and 8",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "logprobs": 6 }),
            "`logprobs` is at most 5",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "logprobs": true }),
            "`logprobs` on completions is a number",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "top_logprobs": 2 }),
            "`top_logprobs` is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "x" }], "top_logprobs": 2 }),
            "`top_logprobs` needs `logprobs: true`",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "x" }], "logprobs": true, "top_logprobs": 21 }),
            "`top_logprobs` is at most 20",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "x" }], "logprobs": 3 }),
            "`logprobs` on chat completions is true or false",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "tl_resume": { "first_token": 1, "rng_draws_consumed": 0 } }),
            "unknown field `tl_resume`",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "temprature": 0.5 }),
            "unknown field `temprature`",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "stream_options": { "include_usage": true } }),
            "only allowed when `stream` is true",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "x" }], "functions": [] }),
            "`functions` is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "x" }], "response_format": { "type": "yaml" } }),
            "response_format",
        ),
    ];
    for (path, body, says) in refused {
        let r = http.post(&addr, path, &[], body.to_string()).await.unwrap();
        assert_eq!(r.status, 400, "{body}");
        let v = r.json();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{body}: {msg}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    assert_eq!(c.p.runner().pool().lock().counts(), before);
    assert_eq!(c.p.state().inflight_prefills(), 0);
    // What OpenAI clients send as defaults passes.
    let defaults = json!({ "prompt": "hi", "max_tokens": 3, "n": 1, "echo": false, "logprobs": null,
        "frequency_penalty": 0, "presence_penalty": 0, "best_of": 1, "user": "u-1", "stop": null });
    let r = http
        .post(&addr, "/v1/completions", &[], defaults.to_string())
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// `stream_options.include_usage`: a last chunk with no choices and the counts, before `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_include_usage_ends_with_the_counts() {
    use tl_engine::api::sse::StreamEvent;
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    for (path, body) in [
        (
            "/v1/completions",
            json!({ "prompt": "hello", "max_tokens": 5, "stream": true, "stream_options": { "include_usage": true } }),
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "hello" }], "max_tokens": 4, "stream": true, "stream_options": { "include_usage": true } }),
        ),
    ] {
        let r = http.post(&addr, path, &[], body.to_string()).await.unwrap();
        assert_eq!(r.status, 200);
        let events = r.events().unwrap();
        let n = events.len();
        assert_eq!(events[n - 1], StreamEvent::Done);
        let StreamEvent::Chunk(usage) = &events[n - 2] else {
            panic!("{path}: {events:?}");
        };
        assert!(usage.choices.is_empty(), "{path}");
        let u = usage.usage.unwrap();
        let max = body["max_tokens"].as_u64().unwrap() as usize;
        assert_eq!(u.completion_tokens, max, "{path}");
        assert_eq!(u.total_tokens, u.prompt_tokens + max);
        // Every other chunk has no usage.
        assert!(
            events[..n - 2]
                .iter()
                .all(|e| matches!(e, StreamEvent::Chunk(c) if c.usage.is_none()))
        );
        // Without the option, no usage chunk.
        let mut plain = body.clone();
        plain.as_object_mut().unwrap().remove("stream_options");
        let r = http
            .post(&addr, path, &[], plain.to_string())
            .await
            .unwrap();
        let events = r.events().unwrap();
        assert!(
            events
                .iter()
                .all(|e| !matches!(e, StreamEvent::Chunk(c) if c.usage.is_some()))
        );
    }
}

/// `stop` and `stop_token_ids` end the completion on the decode engine at the step that matched,
/// which frees its blocks then (not at max_tokens); the text ends before the stop string, the
/// tokens stay exact, and a stream never sends part of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_frees_blocks_at_the_matching_step() {
    use tl_engine::api::sse::StreamEvent;
    use tl_engine_core::model::decode_text;
    // Slow decode steps and a long max_tokens: a sequence that did not stop would run for a
    // minute.
    let c = cluster_with(1, |cfg| {
        cfg.model.decode_us_per_seq = 30_000;
        cfg.pool.n_blocks = 1024;
    })
    .await;
    let (gw, p, d) = (&c.gw, &c.p, &c.d[0]);
    let http = HttpClient::default();
    let addr = gw.http_addr().to_string();
    let prompt: Vec<u32> = (60..80).collect();
    let max_tokens = 2000;
    let whole = colocated(&prompt, 0.9, 21, 80);
    let printable =
        |t: u32| (0x20..0x7f).contains(&t) && t != u32::from(b'"') && t != u32::from(b'\\');
    // A two-character stop string from the run (matched across two tokens), and where it ends.
    let end = (3..whole.len())
        .find(|&i| printable(whole[i - 1]) && printable(whole[i]))
        .expect("two printable bytes in a row");
    let stop = decode_text(&whole[end - 1..=end]);
    let end = (1..whole.len())
        .find(|&i| decode_text(&whole[i - 1..=i]) == stop)
        .unwrap();
    // A stop token id from the run: its first occurrence ends the completion.
    let id = whole[6];
    let id_end = whole.iter().position(|&t| t == id).unwrap();
    for (body, want_tokens, want_text) in [
        (
            json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9, "seed": 21, "stop": [stop.clone(), "\u{1F980}"] }),
            &whole[..=end],
            decode_text(&whole[..end - 1]),
        ),
        (
            json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9, "seed": 21, "stop_token_ids": [id] }),
            &whole[..=id_end],
            decode_text(&whole[..id_end]),
        ),
    ] {
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{body}");
        assert_eq!(tokens_of(&v), want_tokens, "{body}");
        assert_eq!(v["choices"][0]["text"], want_text.as_str(), "{body}");
        assert_eq!(v["usage"]["completion_tokens"], want_tokens.len());
        // The decode engine ended the sequence at the matching step: nothing runs, and its
        // pool holds no block in use, long before max_tokens could have been reached.
        assert!(
            common::settled(d, 0).await,
            "{body}: the sequence kept running"
        );
        // The engine itself says so (not only the gateway cutting the stream).
        let direct = http
            .post(
                &d.addresses().http,
                "/v1/completions",
                &[],
                body.to_string(),
            )
            .await
            .unwrap();
        let dv = direct.json();
        assert_eq!(dv["choices"][0]["finish_reason"], "stop", "{dv}");
        assert_eq!(tokens_of(&dv), want_tokens);
        assert!(common::settled(d, 0).await);
        assert_eq!(p.runner().pool().lock().counts().used, 0);

        // Streamed: the same tokens and text; the stop string is never sent, not even a part.
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let r = http
            .post(&addr, "/v1/completions", &[], sbody.to_string())
            .await
            .unwrap();
        let (mut text, mut tokens, mut finish) = (String::new(), Vec::<u32>::new(), None);
        for e in r.events().unwrap() {
            if let StreamEvent::Chunk(c) = e {
                for ch in &c.choices {
                    text.push_str(ch.text.as_deref().unwrap_or_default());
                    tokens.extend(&ch.tokens);
                    finish = finish.or(ch.finish_reason);
                }
            }
        }
        assert_eq!(text, want_text, "{body}");
        assert_eq!(tokens, want_tokens, "{body}");
        assert_eq!(finish, Some(tl_engine::api::Finish::Stop));
        assert!(common::settled(d, 0).await);
    }
}

/// The prefill engine's push figures: pushes, blocks sent with a payload, payload bytes.
fn pushed(p: &EngineNode) -> (u64, u64, u64) {
    let m = p.metrics();
    let text = m.encode();
    let pushes = text
        .lines()
        .find_map(|l| l.strip_prefix("tl_kv_push_seconds_count "))
        .and_then(|v| v.trim().parse().ok())
        .expect("tl_kv_push_seconds_count");
    let bytes = m
        .kv_payload_bytes
        .get_or_create(&tl_engine::telemetry::metrics::Direction { direction: "sent" })
        .get();
    (pushes, m.kv_blocks_sent.get(), bytes)
}

/// A choice's token ids.
fn choice_tokens(c: &Value) -> Vec<u32> {
    c["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// `n` choices: one Prefill and one push (the same bytes as for one choice), the decode engine
/// forks the choices, choice i equals a colocated run with seed + i, greedy choices are equal,
/// a stream interleaves the choices by index, usage sums them, and the pools end where they
/// began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_prefill() {
    use tl_engine::api::sse::StreamEvent;
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    // Two prompts of one length with no common prefix: the same blocks to send, none deduped.
    let one: Vec<u32> = (10..47).collect();
    let many: Vec<u32> = (110..147).collect();
    let post = |body: Value| {
        let (http, addr) = (&http, &addr);
        async move {
            let r = http
                .post(addr, "/v1/completions", &[], body.to_string())
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            r
        }
    };
    let before = pushed(&c.p);
    post(json!({ "prompt": one, "max_tokens": 8, "temperature": 0.8, "seed": 9 })).await;
    let after_one = pushed(&c.p);
    let v = post(json!({ "prompt": many, "max_tokens": 8, "temperature": 0.8, "seed": 9, "n": 3 }))
        .await
        .json();
    let after_many = pushed(&c.p);
    let delta = |a: (u64, u64, u64), b: (u64, u64, u64)| (b.0 - a.0, b.1 - a.1, b.2 - a.2);
    assert_eq!(delta(before, after_one).0, 1, "one push for n = 1");
    assert_eq!(
        delta(after_one, after_many),
        delta(before, after_one),
        "n = 3 pushes what n = 1 pushes, once"
    );
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        assert_eq!(
            choice_tokens(ch),
            colocated(&many, 0.8, 9 + i as u64, 8),
            "choice {i}"
        );
        assert_eq!(ch["finish_reason"], "length");
    }
    assert_ne!(choice_tokens(&choices[0]), choice_tokens(&choices[1]));
    assert_eq!(v["usage"]["completion_tokens"], 24);
    // Greedy: n equal choices.
    let v = post(json!({ "prompt": many, "max_tokens": 6, "n": 4 }))
        .await
        .json();
    let want = colocated(&many, 0.0, 0, 6);
    let got: Vec<Vec<u32>> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(choice_tokens)
        .collect();
    assert_eq!(got, vec![want; 4]);
    // Streamed, chat and completions: the chunks of each index concatenate to that choice's
    // tokens and text, each index ends once, and the choices interleave.
    for (path, mut body) in [
        (
            "/v1/completions",
            json!({ "prompt": many, "max_tokens": 8, "temperature": 0.8, "seed": 9 }),
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "héllo wörld" }], "max_tokens": 8, "temperature": 0.8, "seed": 9 }),
        ),
    ] {
        body["n"] = json!(3);
        let whole = http
            .post(&addr, path, &[], body.to_string())
            .await
            .unwrap()
            .json();
        body["stream"] = json!(true);
        body["stream_options"] = json!({ "include_usage": true });
        let r = http.post(&addr, path, &[], body.to_string()).await.unwrap();
        assert_eq!(r.status, 200);
        let events = r.events().unwrap();
        assert_eq!(events.last(), Some(&StreamEvent::Done));
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); 3];
        let mut text = vec![String::new(); 3];
        let mut finishes = [0; 3];
        let mut order = Vec::new();
        let mut usage = None;
        for e in &events {
            let StreamEvent::Chunk(c) = e else { continue };
            if c.choices.is_empty() {
                usage = c.usage;
            }
            for ch in &c.choices {
                let i = ch.index as usize;
                order.push(i);
                tokens[i].extend(&ch.tokens);
                let t = ch.text.clone().or(ch.delta.clone().and_then(|d| d.content));
                text[i].push_str(&t.unwrap_or_default());
                finishes[i] += usize::from(ch.finish_reason.is_some());
            }
        }
        assert_eq!(finishes, [1, 1, 1], "{path}");
        assert!(
            order.windows(2).any(|w| w[0] > w[1]),
            "not interleaved: {order:?}"
        );
        for i in 0..3 {
            let w = &whole["choices"][i];
            assert_eq!(tokens[i], choice_tokens(w), "{path} choice {i}");
            let wt = w["text"].as_str().or(w["message"]["content"].as_str());
            assert_eq!(Some(text[i].as_str()), wt, "{path} choice {i}");
        }
        assert_eq!(usage.unwrap().completion_tokens, 24, "{path}");
    }
    c.assert_settled().await;
}

/// Log-probabilities through prefill + decode equal the colocated run's bit for bit (the first
/// token's recomputed by the decode engine from the pushed KV), on completions and chat, whole
/// and streamed, with n > 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_equal_colocated() {
    use tl_engine::api::logprobs::token_str;
    use tl_engine::api::sse::StreamEvent;
    use tl_engine_core::engine::Choices;
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let prompt: Vec<u32> = (40..75).collect();
    let chat = json!([{ "role": "user", "content": "log me" }]);
    let chat_prompt = tl_engine_core::model::encode_text(&render_chat(
        &serde_json::from_value::<Vec<ChatMessage>>(chat.clone()).unwrap(),
    ));
    for (t, seed) in [(0.0f32, 4u64), (0.7, 31)] {
        let s = SamplingRequest {
            temperature: t,
            ..SamplingRequest::default()
        };
        let reference = |p: &[u32], k: u32| {
            let c = Choices {
                n: 2,
                logprobs: Some(k),
            };
            Config::default()
                .colocated_choices(p, s.clone(), seed, 9, c)
                .unwrap()
        };
        // Completions, whole: OpenAI's lists, and the ids extension.
        let want = reference(&prompt, 5);
        let body = json!({ "prompt": prompt, "max_tokens": 9, "temperature": t, "seed": seed, "n": 2, "logprobs": 5 });
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: tl_engine::api::Completion = serde_json::from_slice(&r.body).unwrap();
        for (i, w) in want.iter().enumerate() {
            let ch = &v.choices[i];
            assert_eq!(ch.tokens, w.tokens);
            let got: Vec<tl_engine_core::logprobs::TokenLogprobs> = ch
                .tl_logprobs
                .clone()
                .unwrap()
                .into_iter()
                .map(Into::into)
                .collect();
            assert_eq!(got, w.logprobs, "t {t} choice {i}");
            let Some(tl_engine::api::logprobs::ChoiceLogprobs::Completion(l)) = &ch.logprobs else {
                panic!("no completion logprobs: {:?}", ch.logprobs);
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let want_lp: Vec<f32> = w.logprobs.iter().map(|l| l.logprob).collect();
            assert_eq!(bits(&l.token_logprobs), bits(&want_lp));
            let names: Vec<String> = w.tokens.iter().map(|&t| token_str(t)).collect();
            assert_eq!(l.tokens, names);
            for (top, wl) in l.top_logprobs.iter().zip(&w.logprobs) {
                assert_eq!(top.len(), 5);
                for (tok, p) in &wl.top {
                    assert_eq!(top[&token_str(*tok)].to_bits(), p.to_bits());
                }
            }
            assert_eq!(l.text_offset.len(), w.tokens.len());
        }
        // Chat, streamed: each token's entry arrives with it.
        let want = reference(&chat_prompt, 3);
        let body = json!({ "messages": chat, "max_tokens": 9, "temperature": t, "seed": seed, "n": 2, "logprobs": true, "top_logprobs": 3, "stream": true });
        let r = http
            .post(&addr, "/v1/chat/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let mut got = vec![Vec::new(); 2];
        for e in r.events().unwrap() {
            let StreamEvent::Chunk(c) = e else { continue };
            for ch in c.choices {
                let Some(tl_engine::api::logprobs::ChoiceLogprobs::Chat(l)) = ch.logprobs else {
                    continue;
                };
                got[ch.index as usize].extend(l.content);
            }
        }
        for (i, w) in want.iter().enumerate() {
            assert_eq!(got[i].len(), w.tokens.len(), "t {t} choice {i}");
            for (entry, wl) in got[i].iter().zip(&w.logprobs) {
                assert_eq!(entry.token, token_str(wl.token));
                assert_eq!(entry.logprob.to_bits(), wl.logprob.to_bits());
                let top: Vec<(String, u32)> = entry
                    .top_logprobs
                    .iter()
                    .map(|x| (x.token.clone(), x.logprob.to_bits()))
                    .collect();
                let wtop: Vec<(String, u32)> = wl
                    .top
                    .iter()
                    .map(|(t, p)| (token_str(*t), p.to_bits()))
                    .collect();
                assert_eq!(top, wtop);
            }
        }
    }
    c.assert_settled().await;
}

/// A request counts on its decode engine from its Prefill until its stream ends, not only during
/// the Prefill call: two long streams opened one after the other, with no heartbeat in between
/// to report the first one's load, go to different decode engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inflight_counts_last_until_the_stream_ends() {
    let c = cluster_with(2, |cfg| {
        // One beat at start-up, none for a minute after: only the gateway's own count can tell
        // the planner that the first stream is running.
        cfg.engine.heartbeat_ms = 60_000;
        cfg.model.decode_us_per_seq = 2_000;
    })
    .await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    let open = |seed: u64| {
        let body = json!({
            "prompt": (0..16).collect::<Vec<u32>>(),
            "max_tokens": 400,
            "stream": true,
            "seed": seed,
        });
        let (http, addr) = (http.clone(), addr.clone());
        async move {
            let (status, stream) = http
                .post_streaming(&addr, "/v1/completions", &[], body.to_string())
                .await
                .unwrap();
            assert_eq!(status, 200);
            stream
        }
    };
    use http_body_util::BodyExt;
    let mut first = open(1).await;
    // The first token arrived: the Prefill has returned, the decode stream runs.
    let f = first.frame().await.unwrap().unwrap();
    let text = String::from_utf8_lossy(f.data_ref().unwrap()).into_owned();
    let decode_of = |sse: &str| -> String {
        let data = sse
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .expect("an SSE event");
        let v: Value = serde_json::from_str(data).unwrap();
        v["tl_route"]["decode"].as_str().unwrap().to_owned()
    };
    let d_first = decode_of(&text);
    assert_eq!(
        c.gw.gateway().routed_on(&d_first),
        1,
        "the first stream is counted on {d_first} while it runs"
    );
    let mut second = open(2).await;
    let f = second.frame().await.unwrap().unwrap();
    let d_second = decode_of(&String::from_utf8_lossy(f.data_ref().unwrap()));
    assert_ne!(
        d_first, d_second,
        "the second stream went to the engine already running the first"
    );
    drop(first);
    drop(second);
    // Once the streams end, nothing is counted, and every pool is back to empty.
    assert!(
        eventually(Duration::from_secs(5), || {
            c.gw.gateway().routed_on("D1") == 0 && c.gw.gateway().routed_on("D2") == 0
        })
        .await,
        "a count outlived its stream"
    );
    for d in &c.d {
        assert!(settled(d, 0).await);
    }
}

/// The gateway's HasBlocks answer travels with the Prefill: each decode engine is asked once per
/// request (by the routing gateway), never again by the prefill engine before its push, and the
/// push dedups exactly as if it had asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_engines_are_asked_has_blocks_once_per_request() {
    let c = cluster(2).await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    let asked = |c: &common::Cluster| -> Vec<u64> {
        c.d.iter()
            .map(|d| d.receiver().unwrap().stats().has_blocks_answered)
            .collect()
    };
    let before = asked(&c);
    let prompt: Vec<u32> = (0..37).collect();
    let body = json!({ "prompt": prompt, "max_tokens": 4, "seed": 3 }).to_string();
    let first: Value = http
        .post(&addr, "/v1/completions", &[], body.clone())
        .await
        .unwrap()
        .json();
    assert_eq!(tokens_of(&first), colocated(&prompt, 0.0, 3, 4));
    let after_one = asked(&c);
    for (i, (a, b)) in after_one.iter().zip(&before).enumerate() {
        assert_eq!(
            a - b,
            1,
            "D{}: asked {} times for one request",
            i + 1,
            a - b
        );
    }
    // The same prompt again: the engine that holds it is asked once more, and the push sends
    // only the tail (every full block deduplicated by the gateway's answer).
    let second: Value = http
        .post(&addr, "/v1/completions", &[], body)
        .await
        .unwrap()
        .json();
    assert_eq!(tokens_of(&second), tokens_of(&first));
    assert_eq!(second["tl_route"]["cached_blocks"], 9, "{second}");
    assert_eq!(second["tl_route"]["blocks_deduped"], 9, "{second}");
    assert_eq!(second["tl_route"]["blocks_sent"], 1, "{second}");
    for (i, (a, b)) in asked(&c).iter().zip(&after_one).enumerate() {
        assert_eq!(
            a - b,
            1,
            "D{}: asked {} times for the second request",
            i + 1,
            a - b
        );
    }
    for d in &c.d {
        assert!(settled(d, 0).await);
    }
}

/// Penalties, biases and min_p, through a prefill engine and two decode engines: each choice
/// equals its colocated run token for token (the prefill engine samples the first token under
/// them, the decode engine goes on from the same tokens), greedy and seeded, and each setting
/// changes the output it is meant to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_and_biases_are_applied_and_exact_across_prefill_and_decode() {
    use tl_engine_core::engine::Choices;
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let prompt: Vec<u32> = (60..90).chain(60..70).collect();
    let (max_tokens, n) = (24u32, 2u32);
    let plain = |t: f32, seed: u64| {
        let s = SamplingRequest {
            temperature: t,
            ..SamplingRequest::default()
        };
        Config::default()
            .colocated(&prompt, s, seed, max_tokens)
            .unwrap()
    };
    let greedy = plain(0.0, 0);
    let cases: Vec<(Value, SamplingRequest)> = vec![
        // Negative: the output's tokens are favoured, once and per time (the fake model's
        // output rarely repeats by itself).
        (
            json!({ "frequency_penalty": -2, "presence_penalty": -2 }),
            SamplingRequest {
                frequency_penalty: -2.0,
                presence_penalty: -2.0,
                ..SamplingRequest::default()
            },
        ),
        (
            json!({ "repetition_penalty": 3 }),
            SamplingRequest {
                repetition_penalty: 3.0,
                ..SamplingRequest::default()
            },
        ),
        (
            json!({ "temperature": 0.8, "presence_penalty": 1.0, "repetition_penalty": 1.3 }),
            SamplingRequest {
                temperature: 0.8,
                presence_penalty: 1.0,
                repetition_penalty: 1.3,
                ..SamplingRequest::default()
            },
        ),
        (
            json!({ "temperature": 1.0, "min_p": 0.2, "logit_bias": { greedy[0].to_string(): -100 } }),
            SamplingRequest {
                temperature: 1.0,
                min_p: 0.2,
                logit_bias: vec![(greedy[0], -100.0)],
                ..SamplingRequest::default()
            },
        ),
        (
            json!({ "logit_bias": { "65": 100 } }),
            SamplingRequest {
                logit_bias: vec![(65, 100.0)],
                ..SamplingRequest::default()
            },
        ),
    ];
    for (fields, s) in cases {
        let seed = 31u64;
        let mut body = json!({ "prompt": prompt, "max_tokens": max_tokens, "seed": seed, "n": n });
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        let want = Config::default()
            .colocated_choices(
                &prompt,
                s.clone(),
                seed,
                max_tokens,
                Choices { n, logprobs: None },
            )
            .unwrap();
        for i in 0..n as usize {
            let got = choice_tokens(&v["choices"][i]);
            assert_eq!(got, want[i].tokens, "{fields} choice {i}");
        }
        // Applied: choice 0 differs from the same sampling without them.
        assert_ne!(want[0].tokens, plain(s.temperature, seed), "{fields}");
    }
    // A +100 bias takes every greedy step.
    let forced = Config::default()
        .colocated(
            &prompt,
            SamplingRequest {
                logit_bias: vec![(65, 100.0)],
                ..SamplingRequest::default()
            },
            0,
            max_tokens,
        )
        .unwrap();
    assert!(forced.iter().all(|&t| t == 65), "{forced:?}");
    c.assert_settled().await;
}

/// Structured outputs through a prefill engine and two decode engines: the prefill engine
/// samples the first token under the grammar, the decode engine compiles the same spec and
/// feeds it that token, and every choice equals its colocated run, greedy and seeded; each
/// output matches. Bad specs are 400 naming the field, and nothing reaches an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_match_and_equal_colocated_across_prefill_and_decode() {
    use tl_engine::structured::Spec;
    use tl_engine_core::engine::Choices;
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let prompt: Vec<u32> = (60..95).collect();
    let schema = json!({
        "type": "object",
        "properties": {
            "ok": { "type": "boolean" },
            "colour": { "enum": ["red", "green", "blue"] },
            "tags": { "type": "array", "items": { "enum": ["a", "b"] }, "maxItems": 3 }
        },
        "required": ["ok", "colour", "tags"],
        "additionalProperties": false
    });
    let cases: Vec<(Value, Spec)> = vec![
        (
            json!({ "guided_regex": "[a-z]{3}-[0-9]{4}" }),
            Spec::regex("[a-z]{3}-[0-9]{4}"),
        ),
        (
            json!({ "structured_outputs": { "choice": ["alpha", "beta", "gamma delta"] } }),
            Spec::choice(&["alpha".into(), "beta".into(), "gamma delta".into()]).unwrap(),
        ),
        (
            json!({ "response_format": { "type": "json_schema",
                "json_schema": { "name": "r", "schema": schema.clone(), "strict": true } } }),
            Spec::json_schema(&schema),
        ),
    ];
    let n = 3u32;
    for (fields, spec) in &cases {
        for (t, seed) in [(0.0f32, 0u64), (0.9, 5)] {
            let mut body = json!({ "prompt": prompt, "max_tokens": 60, "temperature": t,
                "seed": seed, "n": n });
            for (k, v) in fields.as_object().unwrap() {
                body[k] = v.clone();
            }
            let r = http
                .post(&addr, "/v1/completions", &[], body.to_string())
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let v = r.json();
            let s = SamplingRequest {
                temperature: t,
                ..SamplingRequest::default()
            };
            let want = Config::default()
                .colocated_structured(
                    &prompt,
                    s,
                    seed,
                    60,
                    Choices { n, logprobs: None },
                    Default::default(),
                    spec,
                )
                .unwrap();
            for i in 0..n as usize {
                let ch = &v["choices"][i];
                assert_eq!(
                    choice_tokens(ch),
                    want[i].tokens,
                    "{fields} t {t} choice {i}"
                );
                assert_eq!(
                    ch["finish_reason"], "stop",
                    "{fields}: the grammar ended it"
                );
                let text = ch["text"].as_str().unwrap();
                match spec.kind {
                    tl_engine::structured::Kind::JsonSchema => {
                        let doc: Value = serde_json::from_str(text).unwrap();
                        assert!(doc["ok"].is_boolean(), "{text}");
                        assert!(
                            ["red", "green", "blue"].contains(&doc["colour"].as_str().unwrap())
                        );
                        assert!(doc["tags"].as_array().unwrap().len() <= 3, "{text}");
                        assert_eq!(doc.as_object().unwrap().len(), 3, "{text}");
                    }
                    _ if fields.get("guided_regex").is_some() => {
                        let b = text.as_bytes();
                        assert_eq!(b.len(), 8, "{text}");
                        assert!(b[..3].iter().all(u8::is_ascii_lowercase), "{text}");
                        assert_eq!(b[3], b'-', "{text}");
                        assert!(b[4..].iter().all(u8::is_ascii_digit), "{text}");
                    }
                    _ => assert!(["alpha", "beta", "gamma delta"].contains(&text), "{text}"),
                }
            }
        }
    }
    // Refused by name, before any engine: a schema the library refuses, two constraints at
    // once, an unreadable choice list, JSON text that is not JSON.
    let before = c.p.runner().pool().lock().counts();
    let refused = [
        (
            json!({ "prompt": "hi", "response_format": { "type": "json_schema", "json_schema":
                { "name": "x", "schema": { "type": "integer", "minimum": 5, "maximum": 1 } } } }),
            "response_format.json_schema.schema",
        ),
        (
            json!({ "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"] }),
            "guided_choice",
        ),
        (
            json!({ "prompt": "hi", "guided_choice": [] }),
            "guided_choice",
        ),
        (
            json!({ "prompt": "hi", "guided_json": "{not json" }),
            "guided_json",
        ),
        (
            json!({ "prompt": "hi", "guided_regex": "([" }),
            "guided_regex",
        ),
        (
            json!({ "prompt": "hi", "guided_grammar": "a".repeat(70_000) }),
            "guided_grammar",
        ),
    ];
    for (body, field) in refused {
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{body}");
        let v = r.json();
        assert_eq!(v["error"]["param"], field, "{}", v["error"]["message"]);
    }
    assert_eq!(c.p.runner().pool().lock().counts(), before);
    c.assert_settled().await;
}

/// Tool calls: a grammar enforces a named function's arguments, and `required` (one call with
/// `parallel_tool_calls: false`), answered as `message.tool_calls` with `finish_reason:
/// "tool_calls"`, whole and streamed; a tool message goes back in; `auto` reads Hermes'
/// `<tool_call>` blocks out of the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_named_required_and_auto() {
    use tl_engine::api::sse::StreamEvent;
    let c = cluster(2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let city = json!({ "type": "object", "properties": { "city": { "enum": ["Paris", "Rome"] } },
        "required": ["city"], "additionalProperties": false });
    let tools = json!([
        { "type": "function", "function": { "name": "get_weather", "parameters": city } },
        { "type": "function", "function": { "name": "get_time", "parameters": city } },
    ]);
    let messages = json!([
        { "role": "user", "content": "weather?" },
        { "role": "assistant", "content": null, "tool_calls": [{ "id": "call_1", "type": "function",
            "function": { "name": "get_time", "arguments": "{\"city\":\"Rome\"}" } }] },
        { "role": "tool", "tool_call_id": "call_1", "content": "noon" },
    ]);
    let named = json!({ "type": "function", "function": { "name": "get_weather" } });
    for (choice, parallel) in [(named, true), (json!("required"), false)] {
        for stream in [false, true] {
            let body = json!({ "messages": messages, "tools": tools, "tool_choice": choice,
                "parallel_tool_calls": parallel, "max_tokens": 64, "stream": stream,
                "temperature": 0.7, "seed": 3 });
            let r = http
                .post(&addr, "/v1/chat/completions", &[], body.to_string())
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let (calls, finish, content) = if stream {
                let mut calls = Vec::new();
                let mut finish = None;
                let mut content = String::new();
                for e in r.events().unwrap() {
                    let StreamEvent::Chunk(ch) = e else { continue };
                    for x in &ch.choices {
                        if let Some(d) = &x.delta {
                            content.push_str(d.content.as_deref().unwrap_or_default());
                            calls.extend(d.tool_calls.clone().into_iter().flatten());
                        }
                        finish = finish.or(x.finish_reason);
                    }
                }
                (calls, finish, content)
            } else {
                let v: tl_engine::api::Completion = serde_json::from_slice(&r.body).unwrap();
                let m = v.choices[0].message.clone().unwrap();
                assert_eq!(m.content, None, "{choice}");
                (
                    m.tool_calls.unwrap_or_default(),
                    v.choices[0].finish_reason,
                    String::new(),
                )
            };
            assert_eq!(
                content, "",
                "{choice} stream {stream}: no text beside the calls"
            );
            assert_eq!(finish, Some(tl_engine::api::Finish::ToolCalls), "{choice}");
            assert_eq!(calls.len(), 1, "{choice} stream {stream}: {calls:?}");
            let f = &calls[0].function;
            if choice.is_object() {
                assert_eq!(f.name, "get_weather");
            } else {
                assert!(
                    ["get_weather", "get_time"].contains(&f.name.as_str()),
                    "{f:?}"
                );
            }
            let args: Value = serde_json::from_str(&f.arguments).unwrap();
            assert!(
                ["Paris", "Rome"].contains(&args["city"].as_str().unwrap()),
                "{args}"
            );
            assert!(calls[0].id.starts_with("call_"));
        }
    }
    // `auto` (the default with tools): the model's own Hermes blocks are read as calls (here
    // written under a regex, the fake model being random), with the words around them kept;
    // words alone stay text.
    let hermes =
        r#"Checking.<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}</tool_call>"#;
    for stream in [false, true] {
        let body = json!({ "messages": [{ "role": "user", "content": "time?" }], "tools": tools,
            "guided_regex": tl_engine::structured::Spec::choice(&[hermes.into()]).unwrap().text, "max_tokens": 120, "stream": stream });
        let r = http
            .post(&addr, "/v1/chat/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let said = if stream {
            let mut said = tl_engine::api::AssistantText {
                role: "assistant".into(),
                content: None,
                tool_calls: None,
            };
            for e in r.events().unwrap() {
                let StreamEvent::Chunk(ch) = e else { continue };
                for x in &ch.choices {
                    let d = x.delta.clone().unwrap();
                    if let Some(t) = d.content.filter(|t| !t.is_empty()) {
                        said.content.get_or_insert_default().push_str(&t);
                    }
                    if d.tool_calls.is_some() {
                        said.tool_calls = d.tool_calls;
                    }
                    if x.finish_reason.is_some() {
                        assert_eq!(x.finish_reason, Some(tl_engine::api::Finish::ToolCalls));
                    }
                }
            }
            said
        } else {
            let v: tl_engine::api::Completion = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(
                v.choices[0].finish_reason,
                Some(tl_engine::api::Finish::ToolCalls)
            );
            v.choices[0].message.clone().unwrap()
        };
        assert_eq!(
            said.content.as_deref(),
            Some("Checking."),
            "stream {stream}"
        );
        let calls = said.tool_calls.unwrap();
        assert_eq!(calls[0].function.name, "get_time");
        assert_eq!(calls[0].function.arguments, r#"{"city":"Rome"}"#);
    }
    let body = json!({ "messages": [{ "role": "user", "content": "hi" }], "tools": tools,
        "tool_choice": "auto", "max_tokens": 8 });
    let r: Value = http
        .post(&addr, "/v1/chat/completions", &[], body.to_string())
        .await
        .unwrap()
        .json();
    assert!(r["choices"][0]["message"]["tool_calls"].is_null(), "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
    // A choice naming no tool, `auto` or `required` without tools, and a call a grammar
    // enforces beside another constraint are refused by name.
    let refused = [
        (json!({ "tool_choice": "auto" }), "tool_choice"),
        (
            json!({ "tools": tools, "tool_choice": "sometimes" }),
            "tool_choice",
        ),
        (
            json!({ "tools": tools, "tool_choice": { "type": "function", "function": { "name": "x" } } }),
            "tool_choice.function.name",
        ),
        (
            json!({ "tools": tools, "tool_choice": "required", "guided_regex": "a" }),
            "guided_regex",
        ),
        (json!({ "functions": [] }), "functions"),
    ];
    for (fields, param) in refused {
        let mut body = json!({ "messages": [{ "role": "user", "content": "x" }] });
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = http
            .post(&addr, "/v1/chat/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(
            r.json()["error"]["param"],
            param,
            "{}",
            r.json()["error"]["message"]
        );
    }
    c.assert_settled().await;
}
