//! One request validation behind every door: the same bad request gets the same message from
//! the gateway's OpenAI endpoint, an engine's HTTP front, EngineControl.Prefill and `tl
//! generate`, each with its own code (400, INVALID_ARGUMENT, a non-zero exit), and no pool
//! changes.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use serde_json::json;
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::{ControlClient, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tonic::Code;

/// One bad request, stated once, sent through every door that can carry it.
struct Case {
    prompt: Vec<u32>,
    max_tokens: u32,
    temperature: f32,
    top_p: f32,
    top_k: u32,
    /// The one message every door answers.
    message: &'static str,
    /// Prefill reads max_tokens 0 as "unset" (the decode side's business).
    via_prefill: bool,
    /// clap refuses an empty `--prompt-tokens` before validation runs.
    via_cli: bool,
}

fn case(message: &'static str) -> Case {
    Case {
        prompt: vec![104, 105],
        max_tokens: 4,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        message,
        via_prefill: true,
        via_cli: true,
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            prompt: vec![],
            via_cli: false,
            ..case("the prompt is empty")
        },
        Case {
            prompt: vec![1, 999],
            ..case("token 999 at position 1 is outside the vocabulary of 260")
        },
        Case {
            prompt: vec![7; 4097],
            ..case("the prompt has 4097 tokens; the context holds 4096")
        },
        Case {
            max_tokens: 0,
            via_prefill: false,
            ..case("max_tokens must be >= 1")
        },
        Case {
            temperature: -1.0,
            ..case("temperature -1 must be finite and >= 0")
        },
        Case {
            top_p: 2.0,
            ..case("top_p 2 must be in (0, 1]")
        },
        Case {
            top_k: 300,
            ..case("top_k 300 exceeds the vocabulary of 260")
        },
    ]
}

fn http_body(c: &Case) -> String {
    json!({
        "prompt": c.prompt, "max_tokens": c.max_tokens, "temperature": c.temperature,
        "top_p": c.top_p, "top_k": c.top_k, "seed": 1,
    })
    .to_string()
}

async fn http_message(http: &HttpClient, addr: &str, c: &Case) -> String {
    let r = http
        .post(addr, "/v1/completions", &[], http_body(c))
        .await
        .unwrap();
    assert_eq!(
        r.status,
        400,
        "{addr}: {}",
        String::from_utf8_lossy(&r.body)
    );
    let v = r.json();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    v["error"]["message"].as_str().unwrap().to_owned()
}

fn cli_message(c: &Case) -> String {
    let tokens: Vec<String> = c.prompt.iter().map(u32::to_string).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_tl"))
        .args(["generate", "--prompt-tokens", &tokens.join(",")])
        .arg(format!("--max-tokens={}", c.max_tokens))
        .arg(format!("--temperature={}", c.temperature))
        .arg(format!("--top-p={}", c.top_p))
        .arg(format!("--top-k={}", c.top_k))
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8(out.stderr).unwrap();
    err.trim()
        .strip_prefix("error: ")
        .unwrap_or_else(|| panic!("{err}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_validation_for_every_door() {
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    let cfg = |id, role| {
        let mut c = Config::for_worker(id, role, &reg);
        c.engine.heartbeat_ms = 50;
        c
    };
    let p = EngineNode::start(&cfg("P", Role::Prefill)).await.unwrap();
    let d = EngineNode::start(&cfg("D", Role::Decode)).await.unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    while gw.registry().list(std::time::Instant::now()).len() < 2 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = (
        p.runner().pool().lock().counts(),
        d.runner().pool().lock().counts(),
    );
    let http = HttpClient::default();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let gateway = gw.http_addr().to_string();
    let engine = d.addresses().http;
    for c in cases() {
        let want = c.message;
        if want.contains("the context holds") {
            // The gateway knows more than the context: what the engines' pools can hold. It
            // refuses as OpenAI does, with the figure it has.
            let r = http
                .post(&gateway, "/v1/completions", &[], http_body(&c))
                .await
                .unwrap();
            assert_eq!(r.status, 400);
            assert_eq!(r.json()["error"]["type"], "context_length_exceeded");
        } else {
            assert_eq!(http_message(&http, &gateway, &c).await, want, "gateway");
        }
        assert_eq!(http_message(&http, &engine, &c).await, want, "engine HTTP");
        if c.via_prefill {
            let req = PrefillRequest {
                cache_scope: Default::default(),
                request_id: "r".into(),
                prompt_tokens: c.prompt.clone(),
                sampling: Some(SamplingParams {
                    temperature: c.temperature,
                    top_p: c.top_p,
                    top_k: c.top_k,
                    seed: Some(1),
                    max_tokens: c.max_tokens,
                    ..SamplingParams::default()
                }),
                decode_target: d.addresses().kv,
                rng_draws_offset: 0,
                decode_holds: None,
                decode_lookup: String::new(),
            };
            let s = ctl.prefill(req).await.unwrap_err();
            assert_eq!(s.code(), Code::InvalidArgument, "{s}");
            assert_eq!(s.message(), want, "EngineControl.Prefill");
        }
        if c.via_cli {
            assert_eq!(cli_message(&c), want, "tl generate");
        }
    }
    assert_eq!(
        (
            p.runner().pool().lock().counts(),
            d.runner().pool().lock().counts()
        ),
        before,
        "a refused request touched a pool"
    );
    assert_eq!(p.state().inflight_prefills(), 0);
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
    gw.stop().await;
}
