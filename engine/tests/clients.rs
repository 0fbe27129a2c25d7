//! What the field's benchmark tools really send, replayed through the gateway (one prefill,
//! two decode engines), with the checks each tool makes of the answer; and OpenAI's other
//! input shapes: prompt lists, token lists, text parts, continuous usage.
//!
//! The fixtures in `tests/fixtures/clients/` were captured from inference-perf 0.7.0,
//! guidellm 0.8.1 (chat, its default, and completions) and aiperf 0.13.0 running against
//! `tl gateway` through `tests/clients/record.py`, a recording proxy: each line is one request
//! as the tool sent it (method, path, headers, JSON body; the API key redacted).

mod common;

use serde_json::{Value, json};
use tl_engine::api::{ChatMessage, render_chat};
use tl_engine::net::clients::HttpClient;
use tl_engine_core::model::{decode_text, encode_text};

/// One server-sent-events body as its `data:` payloads, checking the framing: every event is
/// one `data: ` line and a blank line, and the last is `[DONE]`.
fn sse(name: &str, body: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(body).unwrap_or_else(|e| panic!("{name}: not UTF-8: {e}"));
    assert!(text.ends_with("\n\n"), "{name}: the stream ends mid-event");
    let events: Vec<&str> = text.trim_end().split("\n\n").collect();
    assert_eq!(
        events.last(),
        Some(&"data: [DONE]"),
        "{name}: no [DONE] last"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            let d = e
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("{name}: not a data event: {e:?}"));
            assert!(!d.contains('\n'), "{name}: one line an event");
            serde_json::from_str(d).unwrap_or_else(|err| panic!("{name}: {d}: {err}"))
        })
        .collect()
}

/// The completion length a request asks for, as the tools read it.
fn asked_tokens(body: &Value) -> u64 {
    body["max_completion_tokens"]
        .as_u64()
        .or(body["max_tokens"].as_u64())
        .unwrap_or(16)
}

/// Checks one replayed response as the tools read it: OpenAI's field names and objects, the
/// SSE framing, one finish reason per choice, the usage each mode asks for, and (since every
/// tool here sets `ignore_eos` or the fake model never ends early) exactly the tokens asked.
fn check_response(name: &str, req: &Value, status: u16, body: &[u8]) {
    assert_eq!(status, 200, "{name}: {}", String::from_utf8_lossy(body));
    let chat = req["messages"].is_array();
    let want = asked_tokens(req);
    let model = req["model"].as_str();
    if req["stream"] == true {
        let chunks = sse(name, body);
        let usage_asked = req["stream_options"]["include_usage"] == true;
        let continuous = usage_asked && req["stream_options"]["continuous_usage_stats"] == true;
        let mut text = String::new();
        let mut finishes = Vec::new();
        let mut last_so_far = 0;
        let body_chunks = if usage_asked {
            let (last, rest) = chunks.split_last().unwrap();
            assert_eq!(
                last["choices"],
                json!([]),
                "{name}: the usage chunk has no choices"
            );
            assert_eq!(last["usage"]["completion_tokens"], want, "{name}: {last}");
            let u = &last["usage"];
            assert_eq!(
                u["total_tokens"].as_u64(),
                Some(u["prompt_tokens"].as_u64().unwrap() + want),
                "{name}"
            );
            rest
        } else {
            &chunks[..]
        };
        for c in body_chunks {
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            assert_eq!(c["object"], object, "{name}: {c}");
            assert!(c["id"].is_string() && c["created"].is_u64(), "{name}: {c}");
            if let Some(m) = model {
                assert_eq!(c["model"], m, "{name}");
            }
            let ch = &c["choices"][0];
            let piece = if chat {
                assert_eq!(ch["delta"]["role"], "assistant", "{name}: {c}");
                &ch["delta"]["content"]
            } else {
                &ch["text"]
            };
            text.push_str(
                piece
                    .as_str()
                    .unwrap_or_else(|| panic!("{name}: no text in {c}")),
            );
            if let Some(f) = ch["finish_reason"].as_str() {
                finishes.push(f.to_owned());
            }
            if continuous {
                // vLLM's continuous usage: every chunk, the counts so far, never going back.
                let so_far = c["usage"]["completion_tokens"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{name}: no usage in {c}"));
                assert!(so_far >= last_so_far && so_far <= want, "{name}: {c}");
                last_so_far = so_far;
            } else {
                assert!(
                    c.get("usage").is_none(),
                    "{name}: usage in a body chunk: {c}"
                );
            }
        }
        assert_eq!(finishes, ["length"], "{name}: one finish, `length`");
        if continuous {
            assert_eq!(last_so_far, want, "{name}");
        }
    } else {
        let v: Value = serde_json::from_slice(body).unwrap();
        let object = if chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        assert_eq!(v["object"], object, "{name}: {v}");
        let ch = &v["choices"][0];
        let text = if chat {
            &ch["message"]["content"]
        } else {
            &ch["text"]
        };
        assert!(text.is_string(), "{name}: {v}");
        assert_eq!(ch["finish_reason"], "length", "{name}");
        assert_eq!(v["usage"]["completion_tokens"], want, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_send_what_they_send_and_get_what_they_expect() {
    let c = common::cluster(2).await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/clients");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let tools: Vec<String> = files
        .iter()
        .map(|f| f.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    for t in [
        "aiperf-chat",
        "aiperf-completions",
        "guidellm-chat",
        "guidellm-completions",
        "inference-perf-chat",
        "inference-perf-completion",
    ] {
        assert!(tools.iter().any(|x| x == t), "no fixture {t}: {tools:?}");
    }
    let mut replayed = 0;
    for f in &files {
        let tool = f.file_stem().unwrap().to_string_lossy().into_owned();
        for (i, line) in std::fs::read_to_string(f).unwrap().lines().enumerate() {
            let rec: Value = serde_json::from_str(line).unwrap();
            let name = format!("{tool} #{i}");
            let headers: Vec<(String, String)> = rec["headers"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| *k != "authorization" && *k != "accept-encoding")
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect();
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let path = rec["path"].as_str().unwrap();
            match rec["method"].as_str().unwrap() {
                "GET" => {
                    let r = http.get_with(&addr, path, &headers).await.unwrap();
                    match path {
                        // guidellm's readiness check.
                        "/health" => assert_eq!(r.status, 200, "{name}"),
                        // aiperf looks for Prometheus metrics on the API port: the gateway
                        // serves them on its metrics listener, so this is OpenAI's 404.
                        _ => {
                            assert_eq!(r.status, 404, "{name}");
                            assert!(r.json()["error"]["message"].is_string(), "{name}");
                        }
                    }
                }
                "POST" => {
                    let body = rec["body"].to_string();
                    let r = http.post(&addr, path, &headers, body).await.unwrap();
                    check_response(&name, &rec["body"], r.status, &r.body);
                }
                m => panic!("{name}: method {m}"),
            }
            replayed += 1;
        }
    }
    assert!(replayed >= 18, "{replayed} requests replayed");
}

/// `vllm bench serve --backend openai` (completions): the request vLLM's benchmark builds
/// (`async_request_openai_completions` in `vllm/benchmarks/lib/endpoint_request_func.py`: the
/// model, a text prompt, `repetition_penalty: 1.0`, `max_tokens`, `logprobs: null`, a stream with
/// `include_usage`, and `ignore_eos` as its `--ignore-eos` sets it), checked as vLLM reads it.
/// Until the penalties were served this was a 400 naming `repetition_penalty`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_bench_serve_completions_request_is_served() {
    let c = common::cluster(2).await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    for ignore_eos in [false, true] {
        let mut req = json!({
            "model": "fake", "prompt": "the ranks of random words vLLM sends", "repetition_penalty": 1.0,
            "max_tokens": 12, "logprobs": null, "stream": true,
            "stream_options": { "include_usage": true },
        });
        if ignore_eos {
            req["ignore_eos"] = json!(true);
        }
        let name = format!("vllm bench serve, ignore_eos {ignore_eos}");
        let r = http
            .post(&addr, "/v1/completions", &[], req.to_string())
            .await
            .unwrap();
        check_response(&name, &req, r.status, &r.body);
        // As vLLM counts: chunks with choices give the TTFT and the gaps; the usage chunk gives
        // the output tokens.
        let chunks = sse(&name, &r.body);
        let with_choices = chunks
            .iter()
            .filter(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty()))
            .count();
        assert!(with_choices >= 1, "{name}");
        let usage = chunks.iter().rev().find_map(|c| c["usage"].as_object());
        assert_eq!(usage.unwrap()["completion_tokens"], 12, "{name}");
    }
}

/// Completions' four prompt shapes: a string list gives one completion per prompt, numbered
/// as OpenAI numbers them (prompt i, choice c: index i * n + c), with usage summed over
/// prompts; a token list is one prompt; a list of token lists is several. Each choice equals
/// the colocated run of its prompt and seed; a stream carries the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_prompt_lists_and_token_lists() {
    let c = common::cluster(2).await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    let (seed, max, t) = (11u64, 8u32, 0.9f32);
    let prompts = ["one prompt", "a second one", "and a third"];
    let ask = |prompt: Value, n: u32, stream: bool| {
        let body = json!({
            "prompt": prompt, "n": n, "max_tokens": max, "temperature": t, "seed": seed,
            "stream": stream,
        });
        let (http, addr) = (http.clone(), addr.clone());
        async move {
            let r = http
                .post(&addr, "/v1/completions", &[], body.to_string())
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            r
        }
    };
    // Choice c of a prompt: the colocated run with seed + c (as n choices are seeded).
    let want = |p: &[u32], c: u32| common::colocated(p, t, seed + u64::from(c), max);
    let v = ask(json!(prompts), 2, false).await.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6, "{v}");
    for (i, p) in prompts.iter().enumerate() {
        for c in 0..2u32 {
            let ch = &choices[i * 2 + c as usize];
            assert_eq!(ch["index"], i * 2 + c as usize);
            let tokens = want(&encode_text(p), c);
            let got: Vec<u32> = serde_json::from_value(ch["tokens"].clone()).unwrap();
            assert_eq!(got, tokens, "prompt {i} choice {c}");
            assert_eq!(ch["text"], decode_text(&tokens));
        }
    }
    let prompt_tokens: usize = prompts.iter().map(|p| p.len()).sum();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 6 * max as usize);
    // The same streamed: per index, the same tokens.
    let r = ask(json!(prompts), 2, true).await;
    let mut streamed = vec![Vec::<u32>::new(); 6];
    for chunk in sse("prompt list stream", &r.body) {
        let ch = &chunk["choices"][0];
        let i = ch["index"].as_u64().unwrap() as usize;
        streamed[i].extend(serde_json::from_value::<Vec<u32>>(ch["tokens"].clone()).unwrap());
    }
    for (i, s) in streamed.iter().enumerate() {
        assert_eq!(
            *s,
            want(&encode_text(prompts[i / 2]), (i % 2) as u32),
            "index {i}"
        );
    }
    // A token list is one prompt; a list of token lists is several.
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| encode_text(p)).collect();
    let one = ask(json!(ids[1]), 1, false).await.json();
    assert_eq!(one["choices"].as_array().unwrap().len(), 1);
    assert_eq!(one["choices"][0]["tokens"], json!(want(&ids[1], 0)));
    let lists = ask(json!(ids), 1, false).await.json();
    for (i, p) in ids.iter().enumerate() {
        assert_eq!(lists["choices"][i]["index"], i);
        assert_eq!(lists["choices"][i]["tokens"], json!(want(p, 0)));
    }
    // Shape errors name the field; nothing reached an engine.
    let before = c.p.runner().pool().lock().counts();
    for (body, param, says) in [
        (json!({ "prompt": ["a", 3] }), "prompt", "mixing"),
        (json!({ "prompt": [[1, 2], "b"] }), "prompt", "mixing"),
        (json!({ "prompt": [1, -2] }), "prompt[1]", "negative"),
        (
            json!({ "prompt": {"text": "a"} }),
            "prompt",
            "a list of strings",
        ),
        (json!({ "prompt": [] , "max_tokens": 2}), "", "empty"),
        (
            json!({ "prompt": vec!["x"; 33] }),
            "prompt",
            "more than 32 prompts",
        ),
        (
            json!({ "prompt": vec!["x"; 9], "n": 8 }),
            "prompt",
            "more than 64",
        ),
        (
            json!({ "prompt": "a", "stop": ["x", ""] }),
            "stop[1]",
            "1 to 64",
        ),
        (json!({ "prompt": "a", "stop": ["x", 3] }), "stop", "string"),
        (
            json!({ "prompt": "a", "temperature": "hot" }),
            "temperature",
            "f32",
        ),
        (
            json!({ "prompt": "a", "max_tokens": -1 }),
            "max_tokens",
            "u32",
        ),
        (
            json!({ "prompt": "a", "metadata": { "k": 3 } }),
            "metadata.k",
            "string",
        ),
        (json!({ "prompt": "a", "foo": 1 }), "foo", "unknown field"),
    ] {
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{body}");
        let e = &r.json()["error"];
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(says), "{body}: {msg}");
        if !param.is_empty() {
            assert_eq!(e["param"], param, "{body}: {e}");
            assert!(msg.contains(&format!("`{param}`")), "{body}: {msg}");
        }
    }
    assert_eq!(c.p.runner().pool().lock().counts(), before);
}

/// Chat `content` as a list of text parts is the same request as the string the parts make
/// (joined by newlines, as vLLM joins them); another part type is 400 naming its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_text_parts_equal_a_string() {
    let c = common::cluster(1).await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    let ask = |messages: Value| {
        let body = json!({ "messages": messages, "max_tokens": 10, "temperature": 0.7, "seed": 3 });
        let (http, addr) = (http.clone(), addr.clone());
        async move {
            http.post(&addr, "/v1/chat/completions", &[], body.to_string())
                .await
                .unwrap()
        }
    };
    let parts = ask(json!([
        { "role": "system", "content": [{ "type": "text", "text": "Be brief." }] },
        { "role": "user", "content": [
            { "type": "text", "text": "Hello," },
            { "type": "text", "text": "world" },
        ] },
    ]))
    .await;
    assert_eq!(
        parts.status,
        200,
        "{}",
        String::from_utf8_lossy(&parts.body)
    );
    let string = ask(json!([
        { "role": "system", "content": "Be brief." },
        { "role": "user", "content": "Hello,\nworld" },
    ]))
    .await;
    let (p, s) = (parts.json(), string.json());
    assert_eq!(p["choices"], s["choices"]);
    assert_eq!(p["usage"], s["usage"]);
    let want = render_chat(&[
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hello,\nworld"),
    ]);
    assert_eq!(p["usage"]["prompt_tokens"], want.len());
    // An assistant turn with null content is an empty one.
    let r = ask(json!([
        { "role": "user", "content": "hi" },
        { "role": "assistant", "content": null },
        { "role": "user", "content": "again" },
    ]))
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    for (messages, param) in [
        (
            json!([{ "role": "user", "content": [
                { "type": "text", "text": "look" },
                { "type": "image_url", "image_url": { "url": "data:," } },
            ] }]),
            "messages[0].content[1].type",
        ),
        (
            json!([{ "role": "user", "content": "a" }, { "role": "user", "content": [
                { "type": "input_audio", "input_audio": {} },
            ] }]),
            "messages[1].content[0].type",
        ),
        (
            json!([{ "role": "user", "content": [{ "type": "text" }] }]),
            "messages[0].content[0].text",
        ),
        (
            json!([{ "role": "user", "content": 7 }]),
            "messages[0].content",
        ),
        (json!([{ "content": "no role" }]), "messages[0]"),
        (json!([]), "messages"),
    ] {
        let r = ask(messages.clone()).await;
        assert_eq!(r.status, 400, "{messages}");
        let e = &r.json()["error"];
        assert_eq!(e["param"], param, "{messages}: {e}");
    }
}

/// `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries the
/// usage so far, which counts every token of every choice once; the final usage chunk still
/// comes last. Without it, no body chunk carries usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_usage_stats_counts_every_chunk() {
    let c = common::cluster(2).await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    for (path, body) in [
        (
            "/v1/completions",
            json!({ "prompt": "count me", "n": 2, "max_tokens": 7 }),
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "count me" }], "max_tokens": 7 }),
        ),
    ] {
        for continuous in [true, false] {
            let mut b = body.clone();
            b["stream"] = json!(true);
            b["stream_options"] =
                json!({ "include_usage": true, "continuous_usage_stats": continuous });
            let r = http.post(&addr, path, &[], b.to_string()).await.unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let chunks = sse(path, &r.body);
            let (last, rest) = chunks.split_last().unwrap();
            let n = body["n"].as_u64().unwrap_or(1);
            let prompt = last["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(last["usage"]["completion_tokens"], 7 * n);
            let mut tokens = 0u64;
            for ch in rest {
                tokens += ch["choices"][0]["tokens"].as_array().unwrap().len() as u64;
                if continuous {
                    let u = &ch["usage"];
                    assert_eq!(u["completion_tokens"], tokens, "{ch}");
                    assert_eq!(u["prompt_tokens"], prompt, "{ch}");
                    assert_eq!(u["total_tokens"], prompt + tokens, "{ch}");
                } else {
                    assert!(ch.get("usage").is_none(), "{ch}");
                }
            }
            assert_eq!(tokens, 7 * n);
        }
    }
}

/// The models endpoints as clients read them, and OpenAI's error object on every error status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_and_error_bodies_as_clients_read_them() {
    let c = common::cluster(1).await;
    let addr = c.gw.http_addr().to_string();
    let http = HttpClient::default();
    let list = http.get(&addr, "/v1/models").await.unwrap().json();
    let card = &list["data"][0];
    for field in ["id", "object", "created", "owned_by"] {
        assert!(!card[field].is_null(), "{field} missing: {list}");
    }
    let id = card["id"].as_str().unwrap();
    let one = http.get(&addr, &format!("/v1/models/{id}")).await.unwrap();
    assert_eq!(one.status, 200);
    assert_eq!(one.json(), *card);
    for (method, path, status) in [
        ("GET", "/v1/models/no-such-model", 404),
        ("GET", "/v1/nothing", 404),
        ("GET", "/v1/completions", 405),
        ("POST", "/v1/models", 405),
    ] {
        let r = if method == "GET" {
            http.get(&addr, path).await.unwrap()
        } else {
            http.post(&addr, path, &[], "{}").await.unwrap()
        };
        assert_eq!(r.status, status, "{method} {path}");
        let e = r.json();
        assert!(e["error"]["message"].is_string(), "{method} {path}: {e}");
        assert!(e["error"]["type"].is_string(), "{method} {path}: {e}");
    }
}
