//! The official `openai` Python client, pinned below, against the gateway over one prefill and
//! two decode engines, as a new user would use it: completions and chat, whole and streamed,
//! `stop`, `n = 3`, logprobs and `stream_options.include_usage`. Every choice is compared with
//! the colocated run of its seed: tokens, text, finish reason, and every log-probability bit for
//! bit.
//!
//! The test installs the client itself (`pip install --target` into Cargo's test directory), so
//! `cargo test --workspace` needs nothing installed by hand beyond Python 3 with pip. Without
//! them it fails and says so; it never skips.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use tl_engine::api::logprobs::token_str;
use tl_engine::api::{ChatMessage, render_chat};
use tl_engine::node::config::Config;
use tl_engine_core::engine::Choices;
use tl_engine_core::logprobs::TokenLogprobs;
use tl_engine_core::model::{decode_text, encode_text};
use tl_engine_core::sampler::SamplingRequest;
use tl_engine_core::stop::Stop;

/// The client version the test drives.
const CLIENT: &str = "openai==3.57.0";

/// langchain-openai's version, for its completions LLM (`langchain_openai.OpenAI`).
const LANGCHAIN: &str = "langchain-openai==1.7.4";

/// A directory holding the pinned `spec` (fetched once, found again by its own marker: a
/// system-wide install of another version never stands in for it).
fn installed(spec: &str, _module: &str) -> PathBuf {
    common::fetch::pinned(&[spec])
}

/// The pinned openai client's directory.
fn client_dir() -> PathBuf {
    installed(CLIENT, "openai")
}

/// Runs `tests/openai/client.py` with `plan` on stdin; returns what it printed.
fn run_client(plan: &Value) -> Value {
    run_script("client.py", &client_dir(), plan)
}

/// Runs `tests/openai/{script}` with `dir` on the Python path and `plan` on stdin; returns
/// what it printed.
fn run_script(script: &str, dir: &std::path::Path, plan: &Value) -> Value {
    let script = format!("{}/tests/openai/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new("python3")
        .arg(&script)
        .env("PYTHONPATH", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(plan.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What one choice must be: the colocated run with its seed, cut at the first stop match.
#[derive(Debug)]
struct Want {
    tokens: Vec<u32>,
    text: String,
    finish: &'static str,
    logprobs: Vec<TokenLogprobs>,
}

fn want(prompt: &[u32], t: f32, seed: u64, max: u32, k: Option<u32>, stop: &Stop) -> Want {
    let s = SamplingRequest {
        temperature: t,
        ..SamplingRequest::default()
    };
    let choices = Choices { n: 1, logprobs: k };
    let g = Config::default()
        .colocated_choices(prompt, s, seed, max, choices)
        .unwrap()
        .swap_remove(0);
    let end = (1..=g.tokens.len()).find(|&e| stop.matched(&g.tokens[..e]).is_some());
    let (end, cut, finish) = match end {
        Some(e) => (e, stop.matched(&g.tokens[..e]).unwrap().tokens, "stop"),
        None => (g.tokens.len(), 0, "length"),
    };
    let tokens = g.tokens[..end].to_vec();
    Want {
        text: decode_text(&tokens[..end - cut]),
        logprobs: g.logprobs.into_iter().take(end).collect(),
        tokens,
        finish,
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON number as the f32 it was printed from.
fn bits(v: &Value) -> u32 {
    (v.as_f64().unwrap_or_else(|| panic!("not a number: {v}")) as f32).to_bits()
}

/// One token's logprobs entry: its name, its value's bits, and the alternatives'.
type Entry = (String, u32, Vec<(String, u32)>);

/// One choice's logprobs (either endpoint's shape, one response's or a stream's chunks
/// concatenated) against `w`: names, values and alternatives, bit for bit.
fn check_logprobs(name: &str, chat: bool, lp: &[Value], w: &Want, k: usize) {
    let entries: Vec<Entry> = if chat {
        lp.iter()
            .flat_map(|l| l["content"].as_array().unwrap().clone())
            .map(|e| {
                let top = e["top_logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| (t["token"].as_str().unwrap().to_owned(), bits(&t["logprob"])))
                    .collect();
                (
                    e["token"].as_str().unwrap().to_owned(),
                    bits(&e["logprob"]),
                    top,
                )
            })
            .collect()
    } else {
        lp.iter()
            .flat_map(|l| {
                let tokens = l["tokens"].as_array().unwrap().clone();
                let values = l["token_logprobs"].as_array().unwrap().clone();
                let tops = l["top_logprobs"].as_array().unwrap().clone();
                tokens
                    .into_iter()
                    .zip(values)
                    .zip(tops)
                    .map(|((t, v), top)| {
                        let top: Vec<(String, u32)> = top
                            .as_object()
                            .unwrap()
                            .iter()
                            .map(|(t, p)| (t.clone(), bits(p)))
                            .collect();
                        (t.as_str().unwrap().to_owned(), bits(&v), top)
                    })
            })
            .collect()
    };
    assert_eq!(entries.len(), w.tokens.len(), "{name}: one entry per token");
    for (j, ((token, value, top), l)) in entries.into_iter().zip(&w.logprobs).enumerate() {
        assert_eq!(token, token_str(l.token), "{name} token {j}");
        assert_eq!(value, l.logprob.to_bits(), "{name} token {j}");
        assert_eq!(top.len(), k, "{name} token {j}");
        let mut want_top: Vec<(String, u32)> = l
            .top
            .iter()
            .map(|(t, p)| (token_str(*t), p.to_bits()))
            .collect();
        let mut top = top;
        if !chat {
            // Completions' alternatives are a map: no order to compare.
            top.sort();
            want_top.sort();
        }
        assert_eq!(top, want_top, "{name} token {j}");
    }
}

/// A whole response against the choices wanted.
fn check_whole(name: &str, r: &Value, chat: bool, wants: &[Want], k: Option<u32>) {
    let body = r
        .get("body")
        .unwrap_or_else(|| panic!("{name}: no response: {r}"));
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), wants.len(), "{name}");
    for (i, (c, w)) in choices.iter().zip(wants).enumerate() {
        let name = format!("{name} choice {i}");
        assert_eq!(c["index"], i, "{name}");
        assert_eq!(ids(&c["tokens"]), w.tokens, "{name}");
        let text = if chat {
            &c["message"]["content"]
        } else {
            &c["text"]
        };
        assert_eq!(text.as_str(), Some(w.text.as_str()), "{name}");
        assert_eq!(c["finish_reason"], w.finish, "{name}");
        match k {
            Some(k) => check_logprobs(&name, chat, &[c["logprobs"].clone()], w, k as usize),
            None => assert!(c["logprobs"].is_null(), "{name}"),
        }
    }
    let sum: usize = wants.iter().map(|w| w.tokens.len()).sum();
    assert_eq!(body["usage"]["completion_tokens"], sum, "{name}");
}

/// A stream against the choices wanted: per index, the chunks' tokens, text and logprobs
/// concatenate to the choice's; one finish per index; the usage chunk last.
fn check_stream(name: &str, r: &Value, chat: bool, wants: &[Want], k: Option<u32>) {
    let chunks = r["chunks"]
        .as_array()
        .unwrap_or_else(|| panic!("{name}: no stream: {r}"));
    let n = wants.len();
    let mut tokens = vec![Vec::new(); n];
    let mut text = vec![String::new(); n];
    let mut finish = vec![Vec::new(); n];
    let mut lps = vec![Vec::new(); n];
    for c in chunks {
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            tokens[i].extend(ids(&ch["tokens"]));
            let t = if chat {
                &ch["delta"]["content"]
            } else {
                &ch["text"]
            };
            text[i].push_str(t.as_str().unwrap_or_default());
            if let Some(f) = ch["finish_reason"].as_str() {
                finish[i].push(f.to_owned());
            }
            if !ch["logprobs"].is_null() {
                lps[i].push(ch["logprobs"].clone());
            }
        }
    }
    for (i, w) in wants.iter().enumerate() {
        let name = format!("{name} choice {i}");
        assert_eq!(tokens[i], w.tokens, "{name}");
        assert_eq!(text[i], w.text, "{name}");
        assert_eq!(finish[i], vec![w.finish.to_owned()], "{name}");
        if let Some(k) = k {
            check_logprobs(&name, chat, &lps[i], w, k as usize);
        }
    }
    let last = chunks.last().unwrap();
    assert_eq!(
        last["choices"],
        json!([]),
        "{name}: the usage chunk comes last"
    );
    let sum: usize = wants.iter().map(|w| w.tokens.len()).sum();
    assert_eq!(last["usage"]["completion_tokens"], sum, "{name}");
}

/// The first seed from `from` whose run of `prompt` holds two printable bytes in a row from
/// its fourth token on, and those two bytes: a stop string that run will meet.
fn seed_and_stop(prompt: &[u32], t: f32, from: u64, max: u32) -> (u64, String) {
    let printable =
        |t: u32| (0x21..0x7f).contains(&t) && t != u32::from(b'"') && t != u32::from(b'\\');
    (from..from + 100)
        .find_map(|seed| {
            let tokens = common::colocated(prompt, t, seed, max);
            let end =
                (4..tokens.len()).find(|&i| printable(tokens[i - 1]) && printable(tokens[i]))?;
            Some((seed, decode_text(&tokens[end - 1..=end])))
        })
        .expect("a run with two printable bytes in a row")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_round_trip() {
    // Installed before the cluster starts (pip takes seconds).
    let dir = tokio::task::spawn_blocking(client_dir).await.unwrap();
    assert!(dir.exists());
    let c = common::cluster(2).await;
    let model = Config::default().model.kind.name().to_owned();
    let base_url = format!("http://{}/v1", c.gw.http_addr());

    let (t, max) = (0.8f32, 24);
    let prompt_text = "The quick brown fox";
    let prompt = encode_text(prompt_text);
    let (seed, stop) = seed_and_stop(&prompt, t, 5, max);
    let stops = Stop {
        sequences: vec![stop.as_bytes().to_vec()],
        token_ids: Vec::new(),
        ..Stop::default()
    };
    let messages = json!([
        { "role": "system", "content": "Answer in one line." },
        { "role": "user", "content": "Dîtes-moi: où est le café? 日本語" },
    ]);
    let chat_prompt = encode_text(&render_chat(
        &serde_json::from_value::<Vec<ChatMessage>>(messages.clone()).unwrap(),
    ));
    let (chat_seed, chat_stop) = seed_and_stop(&chat_prompt, t, 50, max);
    let chat_stops = Stop {
        sequences: vec![chat_stop.as_bytes().to_vec()],
        token_ids: Vec::new(),
        ..Stop::default()
    };

    let completion = json!({ "model": model, "prompt": prompt_text, "max_tokens": max, "temperature": t, "seed": seed });
    let with = |base: &Value, extra: Value| {
        let mut v = base.clone();
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    };
    let usage = json!({ "stream_options": { "include_usage": true } });
    let comp_n3 = with(
        &completion,
        json!({ "n": 3, "logprobs": 3, "stop": [stop] }),
    );
    let chat = json!({ "model": model, "messages": messages, "max_tokens": max, "temperature": t, "seed": chat_seed,
        "n": 3, "logprobs": true, "top_logprobs": 2, "stop": chat_stop });
    let request = |name: &str, api: &str, stream: bool, kwargs: &Value| json!({ "name": name, "api": api, "stream": stream, "kwargs": kwargs });
    let plan = json!({
        "base_url": base_url,
        "requests": [
            { "name": "models", "api": "models", "stream": false, "kwargs": {} },
            request("completion", "completions", false, &completion),
            request("completion_stream", "completions", true, &with(&completion, usage.clone())),
            request("completion_n3", "completions", false, &comp_n3),
            request("completion_n3_stream", "completions", true, &with(&comp_n3, usage.clone())),
            request("chat_n3", "chat", false, &chat),
            request("chat_n3_stream", "chat", true, &with(&chat, usage.clone())),
            request("chat_greedy_n2", "chat", false, &json!({ "model": model, "messages": messages, "max_tokens": 8, "n": 2 })),
            request("n_too_many", "completions", false, &with(&completion, json!({ "n": 9 }))),
            request("echo_refused", "completions", false, &with(&completion, json!({ "echo": true }))),
        ],
    });
    let got = tokio::task::spawn_blocking(move || run_client(&plan))
        .await
        .unwrap();
    assert!(
        got["openai_version"]
            .as_str()
            .is_some_and(|v| CLIENT.ends_with(v)),
        "{}",
        got["openai_version"]
    );

    let models: Vec<&str> = got["models"]["body"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(models, vec![model.as_str()]);

    let none = Stop::default();
    let plain = [want(&prompt, t, seed, max, None, &none)];
    check_whole("completion", &got["completion"], false, &plain, None);
    check_stream(
        "completion_stream",
        &got["completion_stream"],
        false,
        &plain,
        None,
    );

    let n3: Vec<Want> = (0..3)
        .map(|i| want(&prompt, t, seed + i, max, Some(3), &stops))
        .collect();
    assert_eq!(
        n3[0].finish, "stop",
        "the stop string comes from choice 0's run"
    );
    check_whole("completion_n3", &got["completion_n3"], false, &n3, Some(3));
    check_stream(
        "completion_n3_stream",
        &got["completion_n3_stream"],
        false,
        &n3,
        Some(3),
    );

    let chat_n3: Vec<Want> = (0..3)
        .map(|i| want(&chat_prompt, t, chat_seed + i, max, Some(2), &chat_stops))
        .collect();
    assert_eq!(chat_n3[0].finish, "stop");
    check_whole("chat_n3", &got["chat_n3"], true, &chat_n3, Some(2));
    check_stream(
        "chat_n3_stream",
        &got["chat_n3_stream"],
        true,
        &chat_n3,
        Some(2),
    );

    let greedy: Vec<Want> = (0..2)
        .map(|_| want(&chat_prompt, 0.0, 0, 8, None, &none))
        .collect();
    check_whole(
        "chat_greedy_n2",
        &got["chat_greedy_n2"],
        true,
        &greedy,
        None,
    );

    for (name, says) in [
        ("n_too_many", "`n` must be between 1 and 8"),
        ("echo_refused", "`echo` is not supported"),
    ] {
        let e = &got[name]["error"];
        assert_eq!(e["status"], 400, "{name}: {}", got[name]);
        assert!(e["message"].as_str().unwrap().contains(says), "{name}: {e}");
    }
    for node in [&c.p, &c.d[0], &c.d[1]] {
        assert!(common::settled(node, 0).await, "{}", node.state().id());
    }
}

/// langchain-openai's completions LLM sends `"prompt": [...]` (a list even for one prompt):
/// invoke, stream, batch and generate all work, and each text is the greedy colocated run of
/// its prompt, with langchain's own finish reasons and summed usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn langchain_completions_llm_sends_prompt_lists() {
    let dir = tokio::task::spawn_blocking(|| installed(LANGCHAIN, "langchain_openai"))
        .await
        .unwrap();
    let c = common::cluster(2).await;
    let model = Config::default().model.kind.name().to_owned();
    let max = 12;
    let prompts = ["hello", "The quick brown fox", "Dîtes-moi"];
    let plan = json!({
        "base_url": format!("http://{}/v1", c.gw.http_addr()),
        "model": model,
        "prompts": prompts,
        "max_tokens": max,
    });
    let out = tokio::task::spawn_blocking(move || run_script("langchain_llm.py", &dir, &plan))
        .await
        .unwrap();
    let greedy = |p: &str| decode_text(&common::colocated(&encode_text(p), 0.0, 0, max));
    assert_eq!(out["invoke"], greedy(prompts[0]), "{out}");
    let streamed: String = out["stream"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(streamed, greedy(prompts[0]));
    let batch: Vec<&str> = out["batch"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(batch, prompts.map(greedy));
    let generated = out["generate"].as_array().unwrap();
    assert_eq!(generated.len(), prompts.len());
    for (g, p) in generated.iter().zip(prompts) {
        assert_eq!(g[0]["text"], greedy(p));
        assert_eq!(g[0]["finish_reason"], "length");
    }
    assert_eq!(
        out["token_usage"]["completion_tokens"],
        max as usize * prompts.len(),
        "{out}"
    );
    let prompt_tokens: usize = prompts.iter().map(|p| p.len()).sum();
    assert_eq!(out["token_usage"]["prompt_tokens"], prompt_tokens);
}

/// `tl serve --model` on the Gemma 3 270M file (a base model, SentencePiece vocabulary,
/// sliding-window layers), as a user runs it: the official client's completion of "The capital
/// of France is" continues it in words, greedy.
#[test]
fn tl_serve_completes_with_gemma3_through_the_official_client() {
    let gguf = common::fetch::gemma3_gguf();
    let dir = client_dir();
    let (child, listening, _) = start_serve(&gguf);
    assert_eq!(listening["model"], "gemma-3-270m-q4_k_m");
    let plan = json!({
        "base_url": listening["base_url"],
        "requests": [
            {"name": "france", "api": "completions", "stream": false, "kwargs": {
                "model": listening["model"], "max_tokens": 12, "temperature": 0.0,
                "prompt": "The capital of France is"}},
        ],
    });
    let got = run_script("client.py", &dir, &plan);
    let text = got["france"]["body"]["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // The float64 reference's greedy continuation (gemma3_matches_the_independent_reference).
    assert!(
        text.starts_with(" the capital of the country of France."),
        "{got}"
    );
    stop_serve(child);
}

/// `tl serve --model GGUF` on a free port: the child, its listening line, what it said before.
fn start_serve(gguf: &std::path::Path) -> (std::process::Child, Value, String) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tl"))
        .args([
            "serve",
            "--port",
            "0",
            "--threads",
            "1",
            "--kv-cache-mib",
            "64",
            "--model",
        ])
        .arg(gguf)
        .env_remove("TL_API_KEYS")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut said = Vec::new();
    let listening: Value = loop {
        let line = lines
            .next()
            .expect("tl serve ended before it listened")
            .unwrap();
        said.push(line.clone());
        if line.starts_with('{') {
            break serde_json::from_str(&line).unwrap();
        }
    };
    (child, listening, said.join("\n"))
}

/// SIGTERM to `child`: it drains and exits 0 within 20 s.
fn stop_serve(mut child: std::process::Child) {
    let pid = child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("tl serve did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

/// A tool-calling round trip on the trained model through `tl serve` (1P + 2D), with the
/// official client (whole and streamed, the client accumulating the deltas) and with
/// langchain-openai's `bind_tools`: the forced call parses into the library's own
/// `tool_calls` with arguments valid for the schema, the tool's answer goes back as a `tool`
/// message, and the model answers in text.
#[test]
fn tool_calling_round_trip_with_the_official_client_and_langchain() {
    let gguf = common::fetch::smollm2_gguf();
    let openai = client_dir();
    let langchain = installed(LANGCHAIN, "langchain_openai");
    let (child, listening, _) = start_serve(&gguf);
    for (framework, dir, stream) in [
        ("openai", &openai, false),
        ("openai", &openai, true),
        ("langchain", &langchain, false),
    ] {
        let plan = json!({
            "base_url": listening["base_url"], "model": listening["model"],
            "framework": framework, "stream": stream,
        });
        let got = run_script("tools.py", dir, &plan);
        assert_eq!(got["call"]["name"], "get_weather", "{framework}: {got}");
        let city = got["call"]["arguments"]["city"]
            .as_str()
            .unwrap_or_default();
        assert!(!city.is_empty() && city.len() <= 24, "{framework}: {got}");
        if framework == "openai" {
            assert_eq!(got["finish_reason"], "tool_calls", "{got}");
        }
        assert!(
            !got["answer"].as_str().unwrap_or_default().is_empty(),
            "{framework}: {got}"
        );
    }
    stop_serve(child);
}

/// `tl serve --model <the SmolLM2 GGUF>` as a user runs it: the official client's chat call
/// answers "Paris", `/v1/models` lists the model by its file's name, and SIGTERM stops it.
#[test]
fn tl_serve_answers_the_official_client_with_paris() {
    let gguf = common::fetch::smollm2_gguf();
    let dir = client_dir();
    let (child, listening, said) = start_serve(&gguf);
    assert!(said.contains("no API key set"), "{said}");
    assert_eq!(listening["model"], "SmolLM2-135M-Instruct.Q4_1");
    let plan = json!({
        "base_url": listening["base_url"],
        "requests": [
            {"name": "models", "api": "models", "stream": false, "kwargs": {}},
            {"name": "paris", "api": "chat", "stream": false, "kwargs": {
                "model": listening["model"], "max_tokens": 24, "temperature": 0.0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}},
        ],
    });
    let got = run_script("client.py", &dir, &plan);
    let answer = got["paris"]["body"]["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(got["models"]["body"][0]["id"], listening["model"], "{got}");
    assert!(answer.contains("Paris"), "{got}");
    stop_serve(child);
}
