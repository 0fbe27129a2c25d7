//! `tl serve` under load, as `vllm bench serve` loads it: 64 streamed chat completions at once
//! on the default topology (1 prefill + 2 decode engines) with KV caches far too small to
//! hold them all. Every request completes, or, past the queue's bound, gets 429 with
//! `Retry-After`; none gets 503 while the engines live, every answer of one prompt is the same
//! text (greedy: batching and waiting change no bit), and the engines end with nothing running.

mod common;

use std::time::{Duration, Instant};

use common::served::Served;
use serde_json::{Value, json};
use tl_engine::net::clients::HttpClient;

const ADMIN: &str = "load-test-admin-key";
const KEY: &str = "load-test-tenant-key";
const STREAMS: usize = 64;
const MAX_TOKENS: u32 = 6;

/// A `tl serve` process, stopped when dropped.
fn serve(extra: &[&str]) -> Served {
    let mut args = vec!["--kv-cache-mib", "6"];
    args.extend_from_slice(extra);
    common::served::serve(
        std::path::Path::new(env!("CARGO_BIN_EXE_tl")),
        &args,
        &[("TL_API_KEYS", KEY), ("TL_ADMIN_KEYS", ADMIN)],
    )
}

#[derive(Debug)]
struct Got {
    status: u16,
    text: String,
    finish: Option<String>,
    retry_after: Option<String>,
}

async fn chat(client: &HttpClient, addr: &str, model: &str, i: usize) -> Got {
    let prompts = [
        "What is the capital of France?",
        "Name three colours.",
        "Count from one to five.",
        "Say hello in Spanish.",
    ];
    let body = json!({
        "model": model, "stream": true, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": true,
        "messages": [{"role": "user", "content": prompts[i % prompts.len()]}],
    });
    let r = client
        .post(
            addr,
            "/v1/chat/completions",
            &[("authorization", &format!("Bearer {KEY}"))],
            body.to_string(),
        )
        .await
        .unwrap();
    let retry_after = r
        .headers
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let mut got = Got {
        status: r.status,
        text: String::new(),
        finish: None,
        retry_after,
    };
    if r.status != 200 {
        return got;
    }
    for line in String::from_utf8_lossy(&r.body).lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert!(v.get("error").is_none(), "an error mid-stream: {v}");
        for c in v["choices"].as_array().into_iter().flatten() {
            if let Some(t) = c["delta"]["content"].as_str() {
                got.text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                got.finish = Some(f.to_owned());
            }
        }
    }
    got
}

/// Sends requests `ids` at once (request `i` asks prompt `i % 4`) and returns what each got.
fn load(s: &Served, ids: impl IntoIterator<Item = usize>) -> Vec<(usize, Got)> {
    let rt = common::served::runtime();
    rt.block_on(async {
        let client = HttpClient::default();
        let mut tasks = Vec::new();
        for i in ids {
            let client = client.clone();
            let (addr, model) = (s.addr.clone(), s.model.clone());
            tasks.push(tokio::spawn(async move {
                (i, chat(&client, &addr, &model, i).await)
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// Every engine of `s`, as `/workers` lists it, once nothing runs or waits on any (within
/// 30 s): the pools have given back every request's blocks.
fn settled(s: &Served) -> Vec<Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = HttpClient::default();
        let auth = format!("Bearer {ADMIN}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = client
                .get_with(&s.addr, "/workers", &[("authorization", auth.as_str())])
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{:?}", r.body);
            let workers = r.json()["workers"].as_array().unwrap().clone();
            let idle = workers.len() == 3
                && workers.iter().all(|w| {
                    w["running"] == 0 && w["queue_depth"] == 0 && w["routed_in_flight"] == 0
                });
            if idle {
                return workers;
            }
            assert!(Instant::now() < deadline, "engines still busy: {workers:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// Every answer of one prompt is the same text (greedy), and has `MAX_TOKENS` tokens' worth.
fn same_text_per_prompt(got: &[(usize, Got)]) {
    let mut by_prompt: std::collections::HashMap<usize, &str> = Default::default();
    for (i, g) in got.iter().filter(|(_, g)| g.status == 200) {
        assert_eq!(g.finish.as_deref(), Some("length"), "request {i}: {g:?}");
        assert!(!g.text.is_empty(), "request {i}: {g:?}");
        let first = by_prompt.entry(i % 4).or_insert(&g.text);
        assert_eq!(
            *first, g.text,
            "request {i} differs from its prompt's first answer"
        );
    }
}

/// The process's compute threads, by name (`tl-compute-N`, the model's kept threads).
fn compute_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("tl-compute"))
        .count()
}

#[test]
fn sixty_four_streams_on_small_pools_all_complete() {
    let s = serve(&[]);
    let got = load(&s, 0..STREAMS);
    // One compute budget for the process: its three engines share the cores' threads, never
    // a set each.
    if std::path::Path::new("/proc/self/task").exists() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let n = compute_threads(s.child.id());
        assert!(n <= cores, "{n} compute threads on {cores} cores");
        assert!(
            cores == 1 || n == cores,
            "{n} compute threads on {cores} cores"
        );
    }
    let failed: Vec<_> = got.iter().filter(|(_, g)| g.status != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {STREAMS} failed: {failed:?}",
        failed.len()
    );
    same_text_per_prompt(&got);
    settled(&s);
}

#[test]
fn past_the_queue_bound_429_with_retry_after_and_never_503() {
    // At most 4 may wait: of 64 sent at once, some are refused at once with 429.
    let s = serve(&["--max-queued", "4"]);
    let got = load(&s, 0..STREAMS);
    let mut statuses: Vec<u16> = got.iter().map(|(_, g)| g.status).collect();
    statuses.sort_unstable();
    statuses.dedup();
    assert!(
        statuses.iter().all(|c| [200, 429].contains(c)),
        "statuses {statuses:?}"
    );
    let refused: Vec<_> = got.iter().filter(|(_, g)| g.status == 429).collect();
    assert!(!refused.is_empty(), "the queue bound of 4 refused nothing");
    assert!(refused.len() < STREAMS, "every request was refused");
    for (_, g) in &refused {
        assert_eq!(g.retry_after.as_deref(), Some("1"), "{g:?}");
    }
    same_text_per_prompt(&got);
    settled(&s);
    // A refused request, sent again once the load has passed: served, with the same answer.
    let i = refused[0].0;
    let again = load(&s, [i]);
    assert_eq!(again[0].1.status, 200, "{again:?}");
    let all: Vec<(usize, Got)> = got.into_iter().chain(again).collect();
    same_text_per_prompt(&all);
}
