//! Transparent failover: a decode engine lost mid-stream (killed, or silent past the stall
//! timeout) and the gateway continues the request on another one. The client's tokens equal a
//! colocated run's, with no gap and no repeat; beyond the bound it gets a clean error event.

mod common;

use std::time::{Duration, Instant};

use common::{colocated, eventually};
use serde_json::{Value, json};
use tl_engine::api::sse::StreamEvent;
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::{GatewayConfig, GatewaySection};
use tl_engine::net::clients::{EventStream, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};

const MAX_TOKENS: u32 = 14;

/// An engine beating every 100 ms; decode engines take 15 ms a step, so that a test can act
/// between tokens.
fn engine_cfg(id: &str, role: Role, registry: &str) -> Config {
    let mut c = Config::for_worker(id, role, registry);
    c.engine.heartbeat_ms = 100;
    c.pool.n_blocks = 256;
    if role == Role::Decode {
        c.model.decode_us_per_seq = 15_000;
    }
    c
}

struct Cluster {
    gw: GatewayNode,
    p: EngineNode,
    d: Vec<Option<EngineNode>>,
}

impl Cluster {
    async fn start(decoders: usize, gateway: GatewaySection) -> Self {
        let gw = GatewayNode::start(&GatewayConfig::from(gateway))
            .await
            .unwrap();
        let reg = gw.registry_addr().to_string();
        let p = EngineNode::start(&engine_cfg("P", Role::Prefill, &reg))
            .await
            .unwrap();
        let mut d = Vec::new();
        for i in 0..decoders {
            let node = EngineNode::start(&engine_cfg(&format!("D{i}"), Role::Decode, &reg))
                .await
                .unwrap();
            d.push(Some(node));
        }
        assert!(
            eventually(Duration::from_secs(10), || gw
                .registry()
                .list(Instant::now())
                .len()
                == 1 + decoders)
            .await,
            "workers never registered"
        );
        Self { gw, p, d }
    }

    /// The decode engine running a sequence now.
    fn busy(&self) -> Option<usize> {
        self.d
            .iter()
            .position(|n| n.as_ref().is_some_and(|n| n.runner().running() > 0))
    }

    async fn kill(&mut self, i: usize) {
        self.d[i].take().expect("killed twice").kill().await;
    }

    fn failovers(&self, cause: &str, outcome: &str) -> String {
        let text = self.gw.gateway().metrics().encode();
        let key = format!("tl_failovers_total{{cause=\"{cause}\",outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .unwrap_or("missing")
            .to_owned()
    }

    /// Every live engine's pool holds no block in use once the sequences have ended.
    async fn settled(&self) -> bool {
        eventually(Duration::from_secs(5), || {
            self.p.runner().pool().lock().counts().used == 0
                && self.d.iter().flatten().all(|n| {
                    n.runner().running() == 0 && n.runner().pool().lock().counts().used == 0
                })
        })
        .await
    }
}

fn body(prompt: &[u32], t: f32, seed: u64, stream: bool) -> String {
    json!({ "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": t, "seed": seed, "stream": stream })
        .to_string()
}

/// A streamed completion read event by event.
async fn open(gw: &GatewayNode, body: String) -> EventStream {
    let (status, b) = HttpClient::default()
        .post_streaming(&gw.http_addr().to_string(), "/v1/completions", &[], body)
        .await
        .unwrap();
    assert_eq!(status, 200);
    EventStream::new(b)
}

/// What a stream delivered: tokens, finish reasons, the error event if any, and whether
/// `[DONE]` ended it.
#[derive(Debug, Default)]
struct Read {
    tokens: Vec<u32>,
    finish: Vec<tl_engine::api::Finish>,
    error: Option<String>,
    done: bool,
    decode: Option<String>,
}

/// Reads `events` until it ends, or until `stop_after` tokens (then returns early).
async fn read(events: &mut EventStream, into: &mut Read, stop_after: Option<usize>) {
    while let Some(e) = tokio::time::timeout(Duration::from_secs(20), events.next())
        .await
        .expect("the stream went silent")
    {
        match e.unwrap() {
            StreamEvent::Chunk(c) => {
                if let Some(r) = &c.tl_route {
                    into.decode = Some(r.decode.clone());
                }
                for ch in &c.choices {
                    into.tokens.extend(&ch.tokens);
                    into.finish.extend(ch.finish_reason);
                }
                if stop_after.is_some_and(|n| into.tokens.len() >= n) {
                    return;
                }
            }
            StreamEvent::Error(e) => into.error = Some(e.message),
            StreamEvent::Done => {
                into.done = true;
                return;
            }
        }
    }
}

fn index_of(id: &str) -> usize {
    id.strip_prefix('D').unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_continues_the_stream_exactly() {
    let prompt: Vec<u32> = (40..61).collect(); // 5 full blocks and a tail at B = 4
    for (t, seed) in [(0.0f32, 5u64), (0.8, 6)] {
        let want = colocated(&prompt, t, seed, MAX_TOKENS);
        // SSE: kill the decode engine once the client has three tokens.
        let mut c = Cluster::start(2, GatewaySection::local()).await;
        let mut events = open(&c.gw, body(&prompt, t, seed, true)).await;
        let mut got = Read::default();
        read(&mut events, &mut got, Some(3)).await;
        let victim = index_of(got.decode.as_deref().unwrap());
        c.kill(victim).await;
        read(&mut events, &mut got, None).await;
        assert_eq!(got.error, None, "t={t}");
        assert!(got.done, "t={t}: no [DONE]");
        assert_eq!(got.tokens, want, "t={t}: stream differs from colocated");
        assert_eq!(got.finish, [tl_engine::api::Finish::Length]);
        assert_eq!(c.failovers("reset", "resumed"), "1", "t={t}");
        assert!(c.settled().await, "t={t}: blocks left in use");
        drop(events);

        // JSON: kill the engine decoding while the request is in flight, after a few steps.
        let mut c = Cluster::start(2, GatewaySection::local()).await;
        let addr = c.gw.http_addr().to_string();
        let b = body(&prompt, t, seed, false);
        let call = tokio::spawn(async move {
            HttpClient::default()
                .post(&addr, "/v1/completions", &[], b)
                .await
        });
        assert!(
            eventually(Duration::from_secs(5), || c.busy().is_some()).await,
            "no decode engine took the request"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let victim = c.busy().expect("the sequence ended before the kill");
        c.kill(victim).await;
        let r = call.await.unwrap().unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = r.json();
        let tokens: Vec<u32> = v["choices"][0]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tokens, want, "t={t}: JSON differs from colocated");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS);
        assert_eq!(c.failovers("reset", "resumed"), "1", "t={t}");
        assert!(c.settled().await, "t={t}: blocks left in use");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_gives_up_after_the_bound() {
    let prompt: Vec<u32> = (7..30).collect();
    // Two decode engines, both killed one after the other: the second loss finds no engine
    // left, and the client gets an error event, never a silently truncated stream.
    let mut c = Cluster::start(2, GatewaySection::local()).await;
    let mut events = open(&c.gw, body(&prompt, 0.7, 9, true)).await;
    let mut got = Read::default();
    read(&mut events, &mut got, Some(3)).await;
    c.kill(index_of(got.decode.as_deref().unwrap())).await;
    read(&mut events, &mut got, Some(6)).await;
    let other = c.busy().expect("the request did not continue");
    c.kill(other).await;
    read(&mut events, &mut got, None).await;
    let want = colocated(&prompt, 0.7, 9, MAX_TOKENS);
    let err = got.error.expect("no error event");
    assert!(err.contains("no failover"), "{err}");
    assert!(!got.done, "[DONE] after an error");
    assert!(got.tokens.len() >= 6 && got.tokens.len() < want.len());
    assert_eq!(
        got.tokens[..],
        want[..got.tokens.len()],
        "tokens before the error"
    );
    assert_eq!(c.failovers("reset", "resumed"), "1");
    assert_eq!(c.failovers("reset", "gave_up"), "1");
    assert!(c.settled().await);

    // A bound of 1 with three engines: the second loss is not failed over although an engine
    // is left.
    let mut c = Cluster::start(
        3,
        GatewaySection {
            max_failovers: 1,
            ..GatewaySection::local()
        },
    )
    .await;
    let mut events = open(&c.gw, body(&prompt, 0.0, 1, true)).await;
    let mut got = Read::default();
    read(&mut events, &mut got, Some(3)).await;
    c.kill(index_of(got.decode.as_deref().unwrap())).await;
    read(&mut events, &mut got, Some(6)).await;
    c.kill(c.busy().expect("the request did not continue"))
        .await;
    read(&mut events, &mut got, None).await;
    let err = got.error.expect("no error event");
    assert!(err.contains("1 failovers were allowed"), "{err}");
    assert_eq!(c.failovers("reset", "gave_up"), "1");
    assert!(c.settled().await);
}

/// A gateway that has just (re)started knows no engine until their next beats: a request in
/// that window waits for them instead of failing, within `startup_grace_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_gateway_waits_for_registrations() {
    let prompt: Vec<u32> = (1..12).collect();
    for grace_ms in [0, 5_000] {
        let gw = GatewayNode::start(&GatewayConfig::from(GatewaySection {
            startup_grace_ms: grace_ms,
            ..GatewaySection::local()
        }))
        .await
        .unwrap();
        let addr = gw.http_addr().to_string();
        let b = body(&prompt, 0.0, 1, false);
        let call = tokio::spawn(async move {
            HttpClient::default()
                .post(&addr, "/v1/completions", &[], b)
                .await
                .unwrap()
        });
        // The request has reached the gateway: refused already (no grace), or waiting there.
        assert!(
            eventually(Duration::from_secs(5), || call.is_finished()
                || gw.gateway().in_flight() > 0)
            .await,
            "the request never reached the gateway"
        );
        let reg = gw.registry_addr().to_string();
        let p = EngineNode::start(&engine_cfg("P", Role::Prefill, &reg))
            .await
            .unwrap();
        let d = EngineNode::start(&engine_cfg("D0", Role::Decode, &reg))
            .await
            .unwrap();
        let r = call.await.unwrap();
        if grace_ms == 0 {
            assert_eq!(r.status, 503, "no grace: refused at once");
        } else {
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let v: Value = r.json();
            assert_eq!(v["choices"][0]["tokens"].as_array().unwrap().len(), 14);
        }
        p.shutdown(Duration::from_millis(100)).await;
        d.shutdown(Duration::from_millis(100)).await;
        gw.stop().await;
    }
}

/// What a stream of `n` choices received, its decode engine killed once `2 n` tokens arrived.
struct Killed {
    tokens: Vec<Vec<u32>>,
    logprobs: Vec<Vec<tl_engine_core::logprobs::TokenLogprobs>>,
    finish: Vec<Vec<tl_engine::api::Finish>>,
    /// The choice of each token that arrived after the kill.
    after: Vec<usize>,
}

/// Streams `body` through `c`'s gateway and kills the decode engine serving it once `2 n`
/// tokens arrived; reads to `[DONE]` (an error event fails the test).
async fn stream_killing_its_decoder(c: &mut Cluster, body: String, n: usize) -> Killed {
    let mut events = open(&c.gw, body).await;
    let mut k = Killed {
        tokens: vec![Vec::new(); n],
        logprobs: vec![Vec::new(); n],
        finish: vec![Vec::new(); n],
        after: Vec::new(),
    };
    let mut decode = None;
    let mut killed = false;
    let mut done = false;
    while let Some(e) = tokio::time::timeout(Duration::from_secs(20), events.next())
        .await
        .expect("the stream went silent")
    {
        match e.unwrap() {
            StreamEvent::Chunk(ch) => {
                if let Some(r) = &ch.tl_route {
                    decode = Some(r.decode.clone());
                }
                for x in &ch.choices {
                    let i = x.index as usize;
                    if killed {
                        k.after.extend(x.tokens.iter().map(|_| i));
                    }
                    k.tokens[i].extend(&x.tokens);
                    k.logprobs[i]
                        .extend(x.tl_logprobs.clone().into_iter().flatten().map(Into::into));
                    k.finish[i].extend(x.finish_reason);
                }
            }
            StreamEvent::Error(e) => panic!("error event: {}", e.message),
            StreamEvent::Done => {
                done = true;
                break;
            }
        }
        if !killed && k.tokens.iter().map(Vec::len).sum::<usize>() >= 2 * n {
            killed = true;
            c.kill(index_of(decode.as_deref().unwrap())).await;
        }
    }
    assert!(killed && done);
    k
}

/// A request of three choices with logprobs and penalties whose decode engine dies mid-stream:
/// each choice continues on the survivor with its own seed and draws, and every choice's tokens
/// and log-probabilities equal its colocated run's (the logprobs of each failover's first token
/// recomputed there from the pushed KV; the penalties counting the tokens sent before as
/// output).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_continues_every_choice_exactly() {
    use tl_engine_core::engine::Choices;
    let prompt: Vec<u32> = (90..113).collect();
    let (t, seed, n) = (0.8f32, 40u64, 3usize);
    // With penalties that count the output: the engine that continues must count the tokens
    // sent before the failover as output, not as prompt.
    let s = tl_engine_core::sampler::SamplingRequest {
        temperature: t,
        frequency_penalty: 0.7,
        presence_penalty: 0.4,
        repetition_penalty: 1.2,
        ..Default::default()
    };
    let want: Vec<_> = (0..n as u64)
        .map(|i| {
            let one = Choices {
                n: 1,
                logprobs: Some(2),
            };
            Config::default()
                .colocated_choices(&prompt, s.clone(), seed + i, MAX_TOKENS, one)
                .unwrap()
                .swap_remove(0)
        })
        .collect();
    let mut c = Cluster::start(2, GatewaySection::local()).await;
    let b = json!({ "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": t, "seed": seed,
        "stream": true, "n": n, "logprobs": 2, "frequency_penalty": 0.7, "presence_penalty": 0.4,
        "repetition_penalty": 1.2 });
    let got = stream_killing_its_decoder(&mut c, b.to_string(), n).await;
    let (tokens, after) = (&got.tokens, &got.after);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(tokens[i], w.tokens, "choice {i}");
        assert_eq!(got.logprobs[i], w.logprobs, "choice {i}");
        assert_eq!(
            got.finish[i],
            [tl_engine::api::Finish::Length],
            "choice {i}"
        );
    }
    // One failover per choice still running when its engine died.
    let resumed: usize = c.failovers("reset", "resumed").parse().unwrap();
    assert!((1..=n).contains(&resumed), "{resumed}");
    // Several choices continued at once, not one after another.
    if resumed > 1 {
        assert!(after.windows(2).any(|w| w[0] > w[1]), "{after:?}");
    }
    assert!(c.settled().await, "blocks left in use");
}

/// A structured request (two choices under a regex) whose decode engine dies mid-stream: the
/// survivor compiles the same spec and feeds it the tokens each choice had sent, so every
/// choice goes on under the grammar exactly where it stood, and equals its colocated run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_continues_a_structured_output_exactly() {
    use tl_engine::structured::Spec;
    use tl_engine_core::engine::Choices;
    let prompt: Vec<u32> = (70..93).collect();
    let (t, seed, n) = (0.8f32, 9u64, 2usize);
    // Each position constrained, ending with the stream.
    let regex = format!("[a-m][n-z0-9]{{{}}}", MAX_TOKENS - 1);
    let spec = Spec::regex(&regex);
    let s = tl_engine_core::sampler::SamplingRequest {
        temperature: t,
        ..Default::default()
    };
    let want = Config::default()
        .colocated_structured(
            &prompt,
            s,
            seed,
            MAX_TOKENS,
            Choices {
                n: n as u32,
                logprobs: None,
            },
            Default::default(),
            &spec,
        )
        .unwrap();
    let mut c = Cluster::start(2, GatewaySection::local()).await;
    let b = json!({ "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": t, "seed": seed,
        "stream": true, "n": n, "guided_regex": regex });
    let tokens = stream_killing_its_decoder(&mut c, b.to_string(), n)
        .await
        .tokens;
    for (i, w) in want.iter().enumerate() {
        assert_eq!(tokens[i], w.tokens, "choice {i}");
        let text: Vec<u8> = tokens[i].iter().map(|&t| t as u8).collect();
        assert!((b'a'..=b'm').contains(&text[0]), "{text:?}");
        assert!(
            text[1..]
                .iter()
                .all(|b| b.is_ascii_digit() || (b'n'..=b'z').contains(b)),
            "{text:?}"
        );
    }
    let resumed: usize = c.failovers("reset", "resumed").parse().unwrap();
    assert!((1..=n).contains(&resumed), "{resumed}");
    assert!(c.settled().await, "blocks left in use");
}
