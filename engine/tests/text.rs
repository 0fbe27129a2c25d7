//! The gateway with `[gateway] model_path`: the checkpoint's chat template and tokenizer make
//! the prompt, its EOS ends a completion unless `ignore_eos`, `/v1/models` reports its context,
//! and a checkpoint whose text the gateway cannot render is refused at start.

mod common;

use common::cluster_of;
use serde_json::{Value, json};
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
use tl_engine::net::clients::HttpClient;
use tl_llama::init::{InitShape, write_checkpoint};
use tl_llama::kernels::DType;

fn checkpoint(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tl-text-{name}-{}", std::process::id()));
    write_checkpoint(&dir, &InitShape::tiny(260), DType::Bf16, 3, 1, 257, 256).unwrap();
    dir
}

fn gateway(dir: &std::path::Path) -> GatewayConfig {
    GatewayConfig {
        gateway: GatewaySection {
            model_path: dir.display().to_string(),
            ..GatewaySection::local()
        },
        ..GatewayConfig::local()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_uses_the_checkpoints_template_and_eos() {
    let dir = checkpoint("eos");
    let path = dir.display().to_string();
    let c = cluster_of(&gateway(&dir), 1, |cfg| {
        cfg.model.kind = "llama".into();
        cfg.model.path = path.clone();
        cfg.model.threads = 1;
        cfg.pool.block_tokens = 16;
        cfg.pool.n_blocks = 256;
    })
    .await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let chat = |seed: u64, ignore: bool| {
        json!({
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 200, "temperature": 1.0, "seed": seed, "ignore_eos": ignore,
        })
        .to_string()
    };
    // Some seed meets EOS (1 in ~260 tokens) within 200 tokens: finish_reason "stop".
    let mut found = None;
    for seed in 0..30 {
        let r = http
            .post(&addr, "/v1/chat/completions", &[], chat(seed, false))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        let used = v["usage"]["completion_tokens"].as_u64().unwrap();
        if v["choices"][0]["finish_reason"] == "stop" {
            assert!(used < 200, "{v}");
            found = Some((seed, used, v));
            break;
        }
        assert_eq!(used, 200, "{v}");
    }
    let (seed, used, stopped) = found.expect("no seed of 30 met EOS in 200 tokens");
    let text = stopped["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    assert!(!text.contains("<|im_end|>"), "{text}");
    // The same request with ignore_eos runs to its length, through the same tokens first.
    let r = http
        .post(&addr, "/v1/chat/completions", &[], chat(seed, true))
        .await
        .unwrap();
    let v: Value = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 200);
    let long = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(long.starts_with(text), "{long:?} / {text:?}");
    assert!(used < 200);
    // The prompt is the template's: ChatML with the generation prompt, in byte ids plus the
    // two specials, so 2 + "user\nHi" + 1 + "\n" + 1 + "assistant\n" tokens.
    let want = 1 + "user\nHi".len() + 1 + 1 + 1 + "assistant\n".len();
    assert_eq!(v["usage"]["prompt_tokens"], want as u64, "{v}");
    // /v1/models names the checkpoint and its context.
    let m: Value = http.get(&addr, "/v1/models").await.unwrap().json();
    assert!(m["data"][0]["max_model_len"].as_u64().unwrap() > 0, "{m}");
    c.gw.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_tokenizer_the_gateway_cannot_render_is_refused_at_start() {
    let dir = checkpoint("refused");
    // Swap two byte tokens: ids no longer the bytes.
    let t = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let mut v: Value = serde_json::from_str(&t).unwrap();
    let vocab = v["model"]["vocab"].as_object_mut().unwrap();
    vocab.insert("a".into(), json!(98));
    vocab.insert("b".into(), json!(97));
    std::fs::write(dir.join("tokenizer.json"), v.to_string()).unwrap();
    let e = GatewayNode::start(&gateway(&dir))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not byte-level"), "{e}");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = GatewayNode::start(&gateway(&dir))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
