//! The gateway with `[gateway] model_path`: the checkpoint's chat template and tokenizer make
//! the prompt, its EOS ends a completion unless `ignore_eos`, `/v1/models` reports its context,
//! a tokenizer whose ids are not the bytes is rendered through its own pieces, and a checkpoint
//! without a tokenizer is refused at start.

mod common;

use common::cluster_of;
use serde_json::{Value, json};
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
use tl_engine::net::clients::HttpClient;
use tl_llama::LlamaConfig;
use tl_llama::init::write_checkpoint;
use tl_llama::kernels::DType;

fn checkpoint(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tl-text-{name}-{}", std::process::id()));
    write_checkpoint(&dir, &LlamaConfig::tiny(260), DType::Bf16, 3, 1, 257, 256).unwrap();
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

/// The gateway on `dir`'s text side over one prefill and one decode engine serving `dir`.
async fn llama_cluster(dir: &std::path::Path) -> common::Cluster {
    llama_cluster_with(dir, GatewaySection::local()).await
}

/// [`llama_cluster`] with a gateway of `section` (its `model_path` set to `dir`).
async fn llama_cluster_with(dir: &std::path::Path, section: GatewaySection) -> common::Cluster {
    let path = dir.display().to_string();
    let gw = GatewayConfig {
        gateway: GatewaySection {
            model_path: path.clone(),
            ..section
        },
        ..GatewayConfig::local()
    };
    cluster_of(&gw, 1, |cfg| {
        cfg.set_model(&path);
        cfg.model.threads = 1;
        cfg.pool.block_tokens = 16;
        cfg.pool.n_blocks = 256;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_uses_the_checkpoints_template_and_eos() {
    let dir = checkpoint("eos");
    let c = llama_cluster(&dir).await;
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

/// A tokenizer whose ids are not the bytes (two swapped) is served: the gateway and the engines
/// render text through its pieces, so the text is the tokenizer's own decoding. A checkpoint
/// without a tokenizer is refused at start, naming the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_that_is_not_byte_level_is_served_through_its_pieces() {
    let dir = checkpoint("swapped");
    let t = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let mut v: Value = serde_json::from_str(&t).unwrap();
    let vocab = v["model"]["vocab"].as_object_mut().unwrap();
    vocab.insert("a".into(), json!(98));
    vocab.insert("b".into(), json!(97));
    std::fs::write(dir.join("tokenizer.json"), v.to_string()).unwrap();
    let text = tl_llama::Text::load(&dir).unwrap();
    assert_eq!(text.vocab().piece(98), b"a");
    assert_eq!(text.encode("ab", false).unwrap(), [98, 97]);
    let c = llama_cluster(&dir).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let mut swapped = 0;
    for seed in 0..40 {
        let r = http
            .post(
                &addr,
                "/v1/completions",
                &[],
                json!({"prompt": "ab", "max_tokens": 40, "temperature": 1.0, "seed": seed,
                       "ignore_eos": true})
                .to_string(),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        assert_eq!(v["usage"]["prompt_tokens"], 2);
        let tokens: Vec<u32> = v["choices"][0]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let got = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(got, text.decode(&tokens), "seed {seed}");
        if tokens.iter().any(|&t| t == 97 || t == 98) && got.is_char_boundary(0) {
            swapped += 1;
            if swapped == 3 {
                break;
            }
        }
    }
    assert!(swapped > 0, "no completion held a swapped id");
    c.gw.stop().await;
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = GatewayNode::start(&gateway(&dir))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// vLLM's `ignore_eos`, `min_tokens`, `skip_special_tokens` and
/// `spaces_between_special_tokens` on a model that ends sequences: the tiny checkpoint, whose
/// EOS some seed meets early. ignore_eos runs to the length; min_tokens past the EOS continues
/// through the same tokens (EOS included); the EOS shows in the text only when asked, spaced
/// unless asked not to; streamed text equals the whole text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignore_eos_and_min_tokens() {
    let dir = checkpoint("min");
    let text_side = tl_llama::Text::load(&dir).unwrap();
    let eos: Vec<u64> = text_side.eos_ids().iter().map(|&t| u64::from(t)).collect();
    let c = llama_cluster(&dir).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let max = 120u64;
    let ask = |seed: u64, extra: Value| {
        let mut v = json!({
            "prompt": "Hi", "max_tokens": max, "temperature": 1.0, "seed": seed,
        });
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (http, addr) = (http.clone(), addr.clone());
        async move {
            let r = http
                .post(&addr, "/v1/completions", &[], v.to_string())
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            r
        }
    };
    let tokens = |v: &Value| -> Vec<u64> {
        v["choices"][0]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    // A seed that meets EOS early enough to leave room after it.
    let mut found = None;
    for seed in 0..60 {
        let v = ask(seed, json!({})).await.json();
        let t = tokens(&v);
        if v["choices"][0]["finish_reason"] == "stop" && (t.len() as u64) < max - 20 {
            found = Some((seed, t, v));
            break;
        }
    }
    let (seed, stopped, v) = found.expect("no seed of 60 met EOS early");
    let used = stopped.len();
    assert!(eos.contains(&stopped[used - 1]), "{v}");
    let eos_name = text_side.token_text(stopped[used - 1] as u32);
    assert!(
        !v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .contains(&eos_name)
    );

    // ignore_eos: to the length, through the same tokens.
    let all = ask(seed, json!({ "ignore_eos": true })).await.json();
    assert_eq!(all["choices"][0]["finish_reason"], "length", "{all}");
    let all = tokens(&all);
    assert_eq!(all.len() as u64, max);
    assert_eq!(all[..used], stopped[..]);

    // min_tokens past the EOS: EOS is text like any other before it; the completion ends at
    // the next EOS at or after min_tokens, or at the length.
    let min = used + 10;
    let m = ask(seed, json!({ "min_tokens": min })).await.json();
    let mt = tokens(&m);
    let next_eos = (min - 1..all.len()).find(|&i| eos.contains(&all[i]));
    match next_eos {
        Some(i) => {
            assert_eq!(m["choices"][0]["finish_reason"], "stop", "{m}");
            assert_eq!(mt[..], all[..=i]);
        }
        None => {
            assert_eq!(m["choices"][0]["finish_reason"], "length", "{m}");
            assert_eq!(mt, all);
        }
    }
    assert_eq!(
        mt[used - 1],
        stopped[used - 1],
        "the early EOS is in the completion"
    );
    // min_tokens above max_tokens is refused, naming the field.
    let r = http
        .post(
            &addr,
            "/v1/completions",
            &[],
            json!({ "prompt": "Hi", "max_tokens": 4, "min_tokens": 5 }).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "min_tokens");

    // The EOS in the text: only when asked, spaced by default.
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_owned();
    assert!(!text(&m).contains(&eos_name));
    let shown = ask(
        seed,
        json!({ "min_tokens": min, "skip_special_tokens": false }),
    )
    .await
    .json();
    assert!(text(&shown).contains(&format!(" {eos_name}")), "{shown}");
    let tight = ask(
        seed,
        json!({ "min_tokens": min, "skip_special_tokens": false,
                "spaces_between_special_tokens": false }),
    )
    .await
    .json();
    assert!(text(&tight).contains(&eos_name), "{tight}");
    // Spaced: one space at every boundary between a special and its neighbour, over the
    // tokens the text shows (a final EOS that stopped the completion is cut).
    let shown_tokens = match m["choices"][0]["finish_reason"].as_str() {
        Some("stop") => &mt[..mt.len() - 1],
        _ => &mt[..],
    };
    let boundaries = (1..shown_tokens.len())
        .filter(|&i| shown_tokens[i] >= 256 || shown_tokens[i - 1] >= 256)
        .count();
    assert_eq!(text(&tight).len() + boundaries, text(&shown).len());
    // Streamed, the same text.
    let r = ask(
        seed,
        json!({ "min_tokens": min, "skip_special_tokens": false, "stream": true }),
    )
    .await;
    let mut streamed = String::new();
    for line in String::from_utf8_lossy(&r.body).lines() {
        if let Some(d) = line.strip_prefix("data: ")
            && d != "[DONE]"
        {
            let chunk: Value = serde_json::from_str(d).unwrap();
            streamed.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(streamed, text(&shown));
    c.gw.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint whose chat template never ends, or writes without end, is refused per request
/// with 400 naming the bound it passed; the renders run off the async workers, so `/health`
/// answers at once meanwhile, and other requests are served. No engine saw a refused request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_loops_or_floods_is_refused_and_the_gateway_stays_up() {
    let dir = checkpoint("tmpl");
    let cfg_path = dir.join("tokenizer_config.json");
    let mut tc: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    tc["chat_template"] = json!(
        "{% if messages[0]['content'] == 'flood' %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}\
         {% else %}{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i %}{% endfor %}{% endfor %}{% endif %}"
    );
    std::fs::write(&cfg_path, tc.to_string()).unwrap();
    let path = dir.display().to_string();
    let gw = GatewayConfig {
        gateway: GatewaySection {
            model_path: path.clone(),
            template_fuel: 2_000_000,
            template_max_bytes: 1 << 20,
            ..GatewaySection::local()
        },
        ..GatewayConfig::local()
    };
    let c = cluster_of(&gw, 1, |cfg| {
        cfg.set_model(&path);
        cfg.model.threads = 1;
        cfg.pool.block_tokens = 16;
        cfg.pool.n_blocks = 64;
    })
    .await;
    let used = |n: &tl_engine::node::EngineNode| n.runner().pool().lock().counts().used;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let chat = |content: &str| {
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": 4}).to_string()
    };
    let loops: Vec<_> = (0..3)
        .map(|_| {
            let (http, addr, body) = (http.clone(), addr.clone(), chat("loop"));
            tokio::spawn(async move { http.post(&addr, "/v1/chat/completions", &[], body).await })
        })
        .collect();
    // Meanwhile the gateway answers at once.
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let r = http.get(&addr, "/health").await.unwrap();
        assert_eq!(r.status, 200);
        assert!(
            t.elapsed() < std::time::Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        let r = http
            .post(
                &addr,
                "/v1/completions",
                &[],
                json!({"prompt": "hi", "max_tokens": 2}).to_string(),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    for l in loops {
        let r = l.await.unwrap().unwrap();
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("2000000 instructions"), "{m}");
        assert_eq!(v["error"]["param"], "messages");
    }
    // Once the completions are done (every engine idle, no handle pending), what the pools
    // hold; the refusals below change nothing.
    assert!(
        common::eventually(std::time::Duration::from_secs(5), || {
            std::iter::once(&c.p)
                .chain(&c.d)
                .all(|n| n.runner().running() == 0 && n.receiver().is_none_or(|r| r.pending() == 0))
        })
        .await,
        "the completions did not end"
    );
    let before = (used(&c.p), used(&c.d[0]));
    let r = http
        .post(&addr, "/v1/chat/completions", &[], chat("loop"))
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    let r = http
        .post(&addr, "/v1/chat/completions", &[], chat("flood"))
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    let v: Value = r.json();
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("1048576 bytes"), "{m}");
    assert!(
        common::eventually(std::time::Duration::from_secs(3), || {
            (used(&c.p), used(&c.d[0])) == before
        })
        .await,
        "the pools are not as they were"
    );
    c.gw.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A template that grows a string without writing it (`x ~ x`, forty times over) would take
/// terabytes, past fuel and the output bound: in its render process it ends that process at
/// `template_memory_mib`, and one that runs too long is killed at `template_timeout_ms`. Each is
/// a bound refused by name; the next render starts a new process and is served.
#[test]
fn a_template_past_its_memory_or_time_ends_its_render_process_only() {
    use tl_engine::gateway::sandbox::{Sandbox, SandboxLimits};
    use tl_llama::text::{ChatTemplate, RenderBounds};
    use tl_llama::{Message, TextError};
    let source = "{% set ns = namespace(x='xxxxxxxx') %}\
        {% if messages[0]['content'] == 'grow' %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}\
        {% elif messages[0]['content'] == 'slow' %}{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}\
        {% endif %}[{{ messages[0]['content'] }}]";
    let template = ChatTemplate::new(
        source.into(),
        None,
        None,
        RenderBounds {
            fuel: 1 << 40,
            max_bytes: 1 << 20,
        },
    )
    .unwrap();
    let say = |s: &str| {
        vec![Message {
            role: "user".into(),
            content: s.into(),
        }]
    };
    let limits = |memory_mib, ms| SandboxLimits {
        exe: env!("CARGO_BIN_EXE_tl").into(),
        memory_mib,
        timeout: std::time::Duration::from_millis(ms),
    };
    let s = Sandbox::new(&template, limits(128, 20_000));
    assert_eq!(s.render(&say("hi"), None, true).unwrap(), "[hi]");
    assert_eq!(s.idle(), 1, "a render process is kept for the next render");
    match s.render(&say("grow"), None, true) {
        Err(TextError::Bound(m)) => assert!(m.contains("memory bound of 128 MiB"), "{m}"),
        other => panic!("a doubling template gave {other:?}"),
    }
    assert_eq!(s.idle(), 0, "the process that ran past its memory is gone");
    assert_eq!(s.render(&say("again"), None, true).unwrap(), "[again]");
    let s = Sandbox::new(&template, limits(128, 300));
    assert_eq!(s.render(&say("hi"), None, true).unwrap(), "[hi]");
    let t = std::time::Instant::now();
    match s.render(&say("slow"), None, true) {
        Err(TextError::Bound(m)) => assert!(m.contains("time bound of 300 ms"), "{m}"),
        other => panic!("a 10^8-step template gave {other:?}"),
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(s.render(&say("after"), None, true).unwrap(), "[after]");
    // The template's own errors pass through unchanged.
    let bad = ChatTemplate::new(
        "{{ raise_exception('no system role') }}".into(),
        None,
        None,
        RenderBounds::default(),
    )
    .unwrap();
    match Sandbox::new(&bad, limits(128, 5_000)).render(&say("hi"), None, true) {
        Err(TextError::Template(m)) => assert!(m.contains("no system role"), "{m}"),
        other => panic!("raise_exception gave {other:?}"),
    }
}

/// Through the gateway: a chat whose template grows without bound is a 400 on `messages`
/// naming the memory bound, the gateway stays up and serves the next chat, and the pools are
/// as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_takes_all_memory_is_refused_and_the_gateway_stays_up() {
    let dir = checkpoint("grow");
    let cfg_path = dir.join("tokenizer_config.json");
    let mut tc: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    tc["chat_template"] = json!(
        "{% set ns = namespace(x='xxxxxxxx') %}{% if messages[0]['content'] == 'grow' %}\
         {% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{% endif %}\
         {{ messages[0]['content'] }}"
    );
    std::fs::write(&cfg_path, tc.to_string()).unwrap();
    let path = dir.display().to_string();
    let gw = GatewayConfig {
        gateway: GatewaySection {
            model_path: path.clone(),
            template_memory_mib: 64,
            render_worker: Some(env!("CARGO_BIN_EXE_tl").into()),
            ..GatewaySection::local()
        },
        ..GatewayConfig::local()
    };
    let c = cluster_of(&gw, 1, |cfg| {
        cfg.set_model(&path);
        cfg.model.threads = 1;
        cfg.pool.block_tokens = 16;
        cfg.pool.n_blocks = 64;
    })
    .await;
    let used = |n: &tl_engine::node::EngineNode| n.runner().pool().lock().counts().used;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let chat = |content: &str| {
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2}).to_string()
    };
    let before = (used(&c.p), used(&c.d[0]));
    for _ in 0..2 {
        let r = http
            .post(&addr, "/v1/chat/completions", &[], chat("grow"))
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("memory bound of 64 MiB"), "{m}");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(http.get(&addr, "/health").await.unwrap().status, 200);
    }
    assert_eq!(
        (used(&c.p), used(&c.d[0])),
        before,
        "a refusal changed a pool"
    );
    let r = http
        .post(&addr, "/v1/chat/completions", &[], chat("hello"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    c.gw.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Tokenizing is CPU a request's body decides: four 1.9 MB text prompts at once are tokenized
/// on the blocking pool (after the key's admission), so `/health` keeps answering at once on
/// the two async workers, and each prompt is then refused as longer than the context, with the
/// pools as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_text_prompts_are_tokenized_off_the_async_workers() {
    let dir = checkpoint("huge");
    let c = llama_cluster(&dir).await;
    let used = |n: &tl_engine::node::EngineNode| n.runner().pool().lock().counts().used;
    let before = (used(&c.p), used(&c.d[0]));
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let prompt = "a few words, again and again. ".repeat(1_900_000 / 30);
    let body = json!({"prompt": prompt, "max_tokens": 2}).to_string();
    let big: Vec<_> = (0..4)
        .map(|_| {
            let (http, addr, body) = (http.clone(), addr.clone(), body.clone());
            tokio::spawn(async move { http.post(&addr, "/v1/completions", &[], body).await })
        })
        .collect();
    let mut slowest = std::time::Duration::ZERO;
    while !big.iter().all(tokio::task::JoinHandle::is_finished) {
        let t = std::time::Instant::now();
        assert_eq!(http.get(&addr, "/health").await.unwrap().status, 200);
        slowest = slowest.max(t.elapsed());
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(
        slowest < std::time::Duration::from_millis(300),
        "/health took {slowest:?} while prompts were tokenized"
    );
    for b in big {
        let r = b.await.unwrap().unwrap();
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        assert_eq!(v["error"]["type"], "context_length_exceeded", "{v}");
    }
    assert_eq!((used(&c.p), used(&c.d[0])), before);
    c.gw.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 63, class 6: the prep pool (templates and tokenizing) is shared fairly between keys.
/// With one prep thread, key A queues twelve 1.9 MB prompts (each tokenized, then refused as
/// too long); key B's short chat, sent after them, is answered while most of A's still wait:
/// B's prep comes at its turn (after the one A holds), not after A's whole queue (first come
/// first served, B waited for 11 of them; the bound of 6 leaves room for a slow machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_keys_flood_of_long_prompts_does_not_stall_another_key() {
    let dir = checkpoint("fair");
    let c = llama_cluster_with(
        &dir,
        GatewaySection {
            prep_threads: 1,
            tenant_header: "x-tenant".into(),
            // A's twelve tokenizations run one after the other; on a slow (debug, loaded)
            // machine they outlast the default 60 s deadline, and the last would be 504s
            // instead of the refusal this test expects of each.
            request_timeout_ms: 300_000,
            queue_timeout_ms: 300_000,
            ..GatewaySection::local()
        },
    )
    .await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let prompt = "a few words, again and again. ".repeat(1_900_000 / 30);
    let body = json!({"prompt": prompt, "max_tokens": 2}).to_string();
    let flood: Vec<_> = (0..12)
        .map(|_| {
            let (http, addr, body, done) = (http.clone(), addr.clone(), body.clone(), done.clone());
            tokio::spawn(async move {
                let r = http
                    .post(&addr, "/v1/completions", &[("x-tenant", "a")], body)
                    .await
                    .unwrap();
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                r.status
            })
        })
        .collect();
    // Until A's requests hold the prep thread and queue behind it.
    assert!(
        common::eventually(std::time::Duration::from_secs(30), || {
            c.gw.gateway().prep_waiting() >= 8
        })
        .await,
        "A's prompts never queued for the prep thread"
    );
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    let r = http
        .post(
            &addr,
            "/v1/chat/completions",
            &[("x-tenant", "b")],
            chat.to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let a_done = done.load(std::sync::atomic::Ordering::SeqCst);
    assert!(a_done <= 6, "B waited for {a_done} of A's 12 preps");
    for f in flood {
        assert_eq!(f.await.unwrap(), 400);
    }
    c.gw.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A request's `tools` reach the checkpoint's chat template as its `tools` (transformers'
/// name): the prompt grows by exactly what the template wrote for them, and `role: "tool"`
/// messages render as the template says; the forced call is answered as `tool_calls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_are_rendered_through_the_checkpoints_template() {
    let dir = checkpoint("tools");
    let cfg_path = dir.join("tokenizer_config.json");
    let mut tc: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    tc["chat_template"] = json!(
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}\
         {% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    );
    std::fs::write(&cfg_path, tc.to_string()).unwrap();
    let c = llama_cluster(&dir).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let city = json!({ "type": "object", "properties": { "city": { "enum": ["Paris", "Rome"] } },
        "required": ["city"], "additionalProperties": false });
    let tools =
        json!([{ "type": "function", "function": { "name": "get_weather", "parameters": city } }]);
    let messages = json!([
        { "role": "user", "content": "Hi" },
        { "role": "tool", "tool_call_id": "call_1", "content": "sunny" },
    ]);
    let ask = |with_tools: bool| {
        let mut b = json!({ "messages": messages, "max_tokens": 32, "temperature": 0.0 });
        if with_tools {
            b["tools"] = tools.clone();
            b["tool_choice"] = json!({ "type": "function", "function": { "name": "get_weather" } });
        }
        b.to_string()
    };
    let plain: Value = http
        .post(&addr, "/v1/chat/completions", &[], ask(false))
        .await
        .unwrap()
        .json();
    let r = http
        .post(&addr, "/v1/chat/completions", &[], ask(true))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let called: Value = r.json();
    // ChatML in byte ids plus the specials: the tool turn is rendered, and the tools add
    // exactly "<tools>get_weather;</tools>".
    let turns = 2 * (1 + 1 + 1) + "user\nHi".len() + "tool\nsunny".len() + 1 + "assistant\n".len();
    assert_eq!(plain["usage"]["prompt_tokens"], turns as u64, "{plain}");
    assert_eq!(
        called["usage"]["prompt_tokens"],
        (turns + "<tools>get_weather;</tools>".len()) as u64,
        "{called}"
    );
    let choice = &called["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{called}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["Paris", "Rome"].contains(&args["city"].as_str().unwrap()),
        "{args}"
    );
    c.gw.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}
