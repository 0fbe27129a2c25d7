//! EngineControl and the decode side's resume, across real servers on 127.0.0.1:0: a prompt
//! prefilled on one engine and decoded on another emits exactly the tokens of one engine.

mod common;

use std::time::Duration;

use common::{eventually, settled};
use kvwire_grpc::pb::engine::{GenerateRequest, KvHandle, PrefillRequest, Resume, SamplingParams};
use serde_json::json;
use tl_engine::net::clients::{ControlClient, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine::node::generate::{Collected, collect};
use tl_engine_core::engine::FinishReason;
use tl_engine_core::sampler::SamplingRequest;
use tonic::Code;

fn config(id: &str, role: Role) -> Config {
    let mut c = Config::for_worker(id, role, "");
    c.pool.n_blocks = 256;
    c
}

fn colocated(prompt: &[u32], t: f32, p: f32, k: u32, seed: u64, n: u32) -> Vec<u32> {
    let s = SamplingRequest {
        temperature: t,
        top_p: p,
        top_k: k,
        ..SamplingRequest::default()
    };
    Config::default().colocated(prompt, s, seed, n).unwrap()
}

fn sampling(t: f32, p: f32, k: u32, seed: Option<u64>, n: u32) -> Option<SamplingParams> {
    Some(SamplingParams {
        temperature: t,
        top_p: p,
        top_k: k,
        seed,
        max_tokens: n,
        ..SamplingParams::default()
    })
}

/// Resumes over the decode engine's Generate (at its EngineControl address `grpc`), as a
/// gateway does: the whole answer, or the refusal.
async fn resume(grpc: &str, req: GenerateRequest) -> Result<Collected, tonic::Status> {
    let ctl = ControlClient::new(grpc).unwrap();
    collect(ctl.generate(req).await?).await
}

/// The resume of `handle` (the Prefill's answer `h`) for `prompt`, `n` tokens.
fn resume_request(
    prompt: &[u32],
    h: &KvHandle,
    handle: &str,
    t: f32,
    p: f32,
    k: u32,
    n: u32,
) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        sampling: sampling(t, p, k, Some(h.seed), n),
        resume: Some(Resume {
            handle_id: handle.to_owned(),
            first_token: h.first_token,
            rng_draws_consumed: h.rng_draws_consumed,
        }),
        ..GenerateRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_colocated() {
    let p = EngineNode::start(&config("P", Role::Prefill))
        .await
        .unwrap();
    let d = EngineNode::start(&config("D", Role::Decode)).await.unwrap();
    let (pa, da) = (p.addresses(), d.addresses());
    let ctl = ControlClient::new(&pa.grpc).unwrap();
    let prompts: [Vec<u32>; 3] = [vec![72, 105, 33], (10..18).collect(), (100..110).collect()];
    let settings: [(f32, f32, u32, Option<u64>); 3] = [
        (0.0, 1.0, 0, None),
        (0.8, 0.9, 0, Some(7)),
        (1.2, 1.0, 40, Some(0xfeed)),
    ];
    let mut n = 0;
    for prompt in &prompts {
        for &(t, tp, k, seed) in &settings {
            let h = ctl
                .prefill(PrefillRequest {
                    cache_scope: Default::default(),
                    request_id: format!("r{n}"),
                    prompt_tokens: prompt.clone(),
                    sampling: sampling(t, tp, k, seed, 12),
                    decode_target: da.kv.clone(),
                    rng_draws_offset: 0,
                    decode_holds: None,
                    decode_lookup: String::new(),
                })
                .await
                .unwrap();
            assert_eq!(h.prompt_tokens as usize, prompt.len());
            assert_eq!(h.block_hashes.len(), prompt.len() / 4);
            assert_eq!(h.rng_draws_consumed, u32::from(t != 0.0));
            assert!(
                h.handle_id.starts_with(&format!("P-r{n}-")),
                "{}",
                h.handle_id
            );
            if let Some(s) = seed {
                assert_eq!(h.seed, s);
            }
            let want = colocated(prompt, t, tp, k, h.seed, 12);
            assert_eq!(h.first_token, want[0]);
            let got = resume(
                &da.grpc,
                resume_request(prompt, &h, &h.handle_id, t, tp, k, 12),
            )
            .await
            .unwrap();
            assert_eq!(got.seed, h.seed);
            assert_eq!(got.finish, [Some(FinishReason::Length)]);
            assert_eq!(got.tokens, [want], "prompt {prompt:?} t={t} seed={seed:?}");
            n += 1;
        }
    }
    // Everything was claimed and finished: nothing pending, nothing used, on either side.
    assert!(eventually(Duration::from_secs(2), || d.runner().running() == 0).await);
    assert_eq!(d.receiver().unwrap().pending(), 0);
    assert_eq!(d.runner().pool().lock().counts().used, 0);
    assert_eq!(p.runner().pool().lock().counts().used, 0);
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
}

/// A prefill engine and a decode engine, a control client of the prefill engine, and a good
/// PrefillRequest to vary.
struct Pair {
    p: EngineNode,
    d: EngineNode,
    ctl: ControlClient,
    dctl: ControlClient,
    target: String,
}

impl Pair {
    async fn start() -> Self {
        let p = EngineNode::start(&config("P", Role::Prefill))
            .await
            .unwrap();
        let d = EngineNode::start(&config("D", Role::Decode)).await.unwrap();
        let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
        let dctl = ControlClient::new(&d.addresses().grpc).unwrap();
        let target = d.addresses().kv;
        Self {
            p,
            d,
            ctl,
            dctl,
            target,
        }
    }

    fn good(&self) -> PrefillRequest {
        PrefillRequest {
            cache_scope: Default::default(),
            request_id: "ok".into(),
            prompt_tokens: vec![1, 2, 3, 4, 5],
            sampling: sampling(0.0, 1.0, 0, Some(1), 4),
            decode_target: self.target.clone(),
            rng_draws_offset: 0,
            decode_holds: None,
            decode_lookup: String::new(),
        }
    }

    async fn stop(self) {
        self.p.shutdown(Duration::from_secs(1)).await;
        self.d.shutdown(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_refuses_bad_requests_before_any_work() {
    let pair = Pair::start().await;
    let (p, d, ctl) = (&pair.p, &pair.d, &pair.ctl);
    let good = || pair.good();
    let before = p.runner().pool().lock().counts();
    let cases: Vec<(&str, PrefillRequest, Code)> = vec![
        (
            "empty request_id",
            PrefillRequest {
                request_id: String::new(),
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "empty prompt",
            PrefillRequest {
                prompt_tokens: vec![],
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "empty target",
            PrefillRequest {
                decode_target: String::new(),
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "token outside vocab",
            PrefillRequest {
                prompt_tokens: vec![1, 260],
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "prompt longer than context",
            PrefillRequest {
                prompt_tokens: vec![1; 4097],
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "negative temperature",
            PrefillRequest {
                sampling: sampling(-1.0, 1.0, 0, None, 4),
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "NaN temperature",
            PrefillRequest {
                sampling: sampling(f32::NAN, 1.0, 0, None, 4),
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "top_p above 1",
            PrefillRequest {
                sampling: sampling(1.0, 1.5, 0, None, 4),
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "top_p negative",
            PrefillRequest {
                sampling: sampling(1.0, -0.5, 0, None, 4),
                ..good()
            },
            Code::InvalidArgument,
        ),
        (
            "top_k above vocab",
            PrefillRequest {
                sampling: sampling(1.0, 1.0, 261, None, 4),
                ..good()
            },
            Code::InvalidArgument,
        ),
    ];
    for (name, req, code) in cases {
        let err = ctl.prefill(req).await.unwrap_err();
        assert_eq!(err.code(), code, "{name}: {err}");
        assert_eq!(
            p.runner().pool().lock().counts(),
            before,
            "{name} touched the pool"
        );
    }
    // top_p 0 on the wire means 1: accepted.
    let h = ctl
        .prefill(PrefillRequest {
            sampling: sampling(0.5, 0.0, 0, Some(3), 4),
            ..good()
        })
        .await
        .unwrap();
    assert!(d.receiver().unwrap().release(&h.handle_id));
    pair.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_to_an_unreachable_target() {
    let pair = Pair::start().await;
    let (p, ctl) = (&pair.p, &pair.ctl);
    let good = || pair.good();
    // An unreachable decode target: UNAVAILABLE, and the prefill pool holds no reference.
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().to_string()
    };
    let err = ctl
        .prefill(PrefillRequest {
            decode_target: closed,
            ..good()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert_eq!(p.runner().pool().lock().counts().used, 0);

    pair.stop().await;
}

/// The same refusal while the engine thread is still computing the prefill (20 ms a token): the
/// push fails at once, and the answer waits until the engine has let the sequence and its
/// blocks go, so a caller that sees UNAVAILABLE sees the pool as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_to_an_unreachable_target_answers_after_its_blocks_are_free() {
    let mut pc = config("P", Role::Prefill);
    pc.model.prefill_us_per_token = 20_000;
    let p = EngineNode::start(&pc).await.unwrap();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().to_string()
    };
    let before = p.runner().pool().lock().counts();
    let err = ctl
        .prefill(PrefillRequest {
            cache_scope: Default::default(),
            request_id: "slow-unreachable".into(),
            prompt_tokens: (0..40).collect(),
            sampling: sampling(0.0, 1.0, 0, Some(1), 4),
            decode_target: closed,
            rng_draws_offset: 0,
            decode_holds: None,
            decode_lookup: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let after = p.runner().pool().lock().counts();
    assert_eq!(after.used, 0, "answered with blocks still held: {after:?}");
    assert_eq!(after.total, before.total);
    p.runner().pool().lock().check().unwrap();
    p.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_rpc_validation_and_info() {
    let pair = Pair::start().await;
    let (d, ctl, dctl) = (&pair.d, &pair.ctl, &pair.dctl);
    // A decode-only engine refuses Prefill before any work: its pool and its receiver are as
    // they were, and nothing was pushed anywhere.
    let d_before = d.runner().pool().lock().counts();
    let err = dctl.prefill(pair.good()).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(d.runner().pool().lock().counts(), d_before);
    assert_eq!(d.receiver().unwrap().pending(), 0);
    assert_eq!(d.state().inflight_prefills(), 0);
    // One accepted prompt of one full block and a tail, its handle released.
    let h = ctl.prefill(pair.good()).await.unwrap();
    assert!(d.receiver().unwrap().release(&h.handle_id));
    // Info.
    let info = ctl.info().await.unwrap();
    assert_eq!(info.worker_id, "P");
    assert_eq!(info.roles, ["prefill"]);
    assert_eq!(
        (
            info.model.as_str(),
            info.kv_format,
            info.block_tokens,
            info.n_layers,
            info.n_kv_heads,
            info.head_dim
        ),
        ("fake", 1, 4, 2, 1, 4)
    );
    assert_eq!(info.total_blocks, 256);
    assert_eq!(info.used_blocks, 0);
    assert_eq!(
        info.cached_blocks, 1,
        "the full block of the accepted prompt stays cached"
    );
    assert_eq!(
        info.free_blocks + info.cached_blocks + info.used_blocks,
        info.total_blocks
    );
    assert!(!info.draining);
    let dinfo = dctl.info().await.unwrap();
    assert_eq!(dinfo.roles, ["decode"]);
    assert_eq!(dinfo.pending_handles, 0);

    pair.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_stuck_prefill_and_ids_are_unique() {
    let pair = Pair::start().await;
    let (p, ctl) = (&pair.p, &pair.ctl);
    let good = || pair.good();
    // Cancel: a prefill stuck on a decode target that never answers is cancelled.
    let black_hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole = black_hole.local_addr().unwrap().to_string();
    let ctl2 = ctl.clone();
    let stuck_req = PrefillRequest {
        request_id: "stuck".into(),
        decode_target: hole,
        ..good()
    };
    let stuck = tokio::spawn(async move { ctl2.prefill(stuck_req).await });
    assert!(
        eventually(Duration::from_secs(2), || p.state().inflight_prefills()
            == 1)
        .await
    );
    // The same request id again while it runs: ALREADY_EXISTS.
    let dup = ctl
        .prefill(PrefillRequest {
            request_id: "stuck".into(),
            ..good()
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists);
    assert!(ctl.cancel("stuck").await.unwrap());
    assert!(!ctl.cancel("stuck").await.unwrap());
    let err = stuck.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Cancelled);
    assert!(
        eventually(Duration::from_secs(2), || p
            .runner()
            .pool()
            .lock()
            .counts()
            .used
            == 0)
        .await
    );
    drop(black_hole);

    pair.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_refuses_new_work_and_sticks() {
    let pair = Pair::start().await;
    let ctl = &pair.ctl;
    let good = || pair.good();
    // Drain: new work is refused, nothing remains, and it sticks.
    assert_eq!(ctl.drain(500).await.unwrap(), 0);
    assert_eq!(
        ctl.prefill(good()).await.unwrap_err().code(),
        Code::Unavailable
    );
    assert!(ctl.info().await.unwrap().draining);
    pair.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_refusals_and_client_abort() {
    let p = EngineNode::start(&config("P", Role::Prefill))
        .await
        .unwrap();
    let d = EngineNode::start(&config("D", Role::Decode)).await.unwrap();
    let (pa, da) = (p.addresses(), d.addresses());
    let ctl = ControlClient::new(&pa.grpc).unwrap();
    let http = HttpClient::default();
    let prompt: Vec<u32> = (1..=10).collect();
    let pre = |id: &str| PrefillRequest {
        cache_scope: Default::default(),
        request_id: id.into(),
        prompt_tokens: prompt.clone(),
        sampling: sampling(0.0, 1.0, 0, Some(5), 8),
        decode_target: da.kv.clone(),
        rng_draws_offset: 0,
        decode_holds: None,
        decode_lookup: String::new(),
    };
    let h = ctl.prefill(pre("a")).await.unwrap();
    let req = |prompt: &[u32], handle: &str| resume_request(prompt, &h, handle, 0.0, 1.0, 0, 8);
    // Unknown handle: NOT_FOUND. Another prompt: INVALID_ARGUMENT and the handle is still
    // there. Without the seed: INVALID_ARGUMENT.
    let e = resume(&da.grpc, req(&prompt, "nope")).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let other: Vec<u32> = (2..=11).collect();
    let e = resume(&da.grpc, req(&other, &h.handle_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("other blocks"), "{e}");
    let mut seedless = req(&prompt, &h.handle_id);
    seedless.sampling.as_mut().unwrap().seed = None;
    let e = resume(&da.grpc, seedless).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert_eq!(d.receiver().unwrap().pending(), 1);
    // The right prompt works once; a second claim is NOT_FOUND.
    let got = resume(&da.grpc, req(&prompt, &h.handle_id)).await.unwrap();
    assert_eq!(got.tokens[0].len(), 8);
    let e = resume(&da.grpc, req(&prompt, &h.handle_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    // Another model: 404; bad bodies: 400.
    let r = http
        .post(
            &da.http,
            "/v1/completions",
            &[],
            json!({"prompt": "hi", "model": "gpt-x"}).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 404);
    for body in [
        "{",
        r#"{"prompt": []}"#,
        r#"{"prompt": "x", "max_tokens": 0}"#,
        r#"{"prompt": "x", "temperature": -1}"#,
    ] {
        let r = http
            .post(&da.http, "/v1/completions", &[], body)
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{body}");
        assert!(r.json()["error"]["message"].is_string(), "{body}");
    }
    // A colocated request on the decode engine, text prompt.
    let r = http
        .post(
            &da.http,
            "/v1/completions",
            &[],
            json!({"prompt": "hello", "max_tokens": 5, "seed": 1}).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let want = colocated(b"hello".map(u32::from).as_ref(), 0.0, 1.0, 0, 1, 5);
    let got: Vec<u64> = r.json()["choices"][0]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(got, want.iter().map(|&t| u64::from(t)).collect::<Vec<_>>());

    // Client abort mid-stream: the decode sequence is cancelled and its blocks released.
    let h = ctl.prefill(pre("b")).await.unwrap();
    let dctl = ControlClient::new(&da.grpc).unwrap();
    let mut stream = dctl
        .generate(resume_request(
            &prompt,
            &h,
            &h.handle_id,
            0.0,
            1.0,
            0,
            100_000,
        ))
        .await
        .unwrap();
    // The seed, then tokens: the sequence runs.
    let mut tokens = 0;
    while tokens == 0 {
        tokens += stream.message().await.unwrap().unwrap().tokens.len();
    }
    assert_eq!(d.runner().running(), 1);
    drop(stream);
    assert!(
        settled(&d, 0).await,
        "sequence not cancelled or blocks not freed"
    );
    assert_eq!(d.receiver().unwrap().pending(), 0);
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
}

/// The same requests through a prefill engine that streams each block as soon as it is written
/// and through one that pushes after the whole prefill: every KvHandle field (but the random
/// handle id), every token and every byte moved must be equal, greedy and seeded, for a fresh
/// prompt, a prompt both sides hold already, one sharing a cached prefix with an earlier one and
/// one without a partial tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_push_equals_serial_push() {
    async fn run(pipelined: bool) -> Vec<(KvHandle, Vec<u32>)> {
        let mut pc = config("P", Role::Prefill);
        pc.engine.push_while_prefilling = pipelined;
        let p = EngineNode::start(&pc).await.unwrap();
        let d = EngineNode::start(&config("D", Role::Decode)).await.unwrap();
        let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
        let (target, dgrpc) = (d.addresses().kv, d.addresses().grpc);
        let fresh: Vec<u32> = (0..37).collect();
        let prompts: [Vec<u32>; 4] = [
            fresh.clone(),
            fresh.clone(),
            (0..20).chain(200..217).collect(),
            (50..82).collect(),
        ];
        let mut out = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            for (j, (t, seed)) in [(0.0, 1), (0.9, 0xbeef)].into_iter().enumerate() {
                let mut h = ctl
                    .prefill(PrefillRequest {
                        cache_scope: Default::default(),
                        request_id: format!("r{i}-{j}"),
                        prompt_tokens: prompt.clone(),
                        sampling: sampling(t, 1.0, 0, Some(seed), 8),
                        decode_target: target.clone(),
                        rng_draws_offset: 0,
                        decode_holds: None,
                        decode_lookup: String::new(),
                    })
                    .await
                    .unwrap();
                let got = resume(
                    &dgrpc,
                    resume_request(prompt, &h, &h.handle_id, t, 1.0, 0, 8),
                )
                .await
                .unwrap();
                let tokens = got.tokens[0].clone();
                assert_eq!(tokens, colocated(prompt, t, 1.0, 0, seed, 8));
                h.handle_id.clear();
                h.decode_target.clear();
                out.push((h, tokens));
            }
        }
        assert!(eventually(Duration::from_secs(2), || d.runner().running() == 0).await);
        assert_eq!(d.receiver().unwrap().pending(), 0);
        assert_eq!(d.runner().pool().lock().counts().used, 0);
        assert_eq!(p.runner().pool().lock().counts().used, 0);
        p.runner().pool().lock().check().unwrap();
        d.runner().pool().lock().check().unwrap();
        p.shutdown(Duration::from_secs(1)).await;
        d.shutdown(Duration::from_secs(1)).await;
        out
    }
    let pipelined = run(true).await;
    let serial = run(false).await;
    assert_eq!(pipelined, serial);
    // The cases did cover a fresh push, a wholly deduped one and a partly deduped one.
    let sent_dedup: Vec<(u32, u32)> = pipelined
        .iter()
        .map(|(h, _)| (h.blocks_sent, h.blocks_deduped))
        .collect();
    assert_eq!(sent_dedup[0], (10, 0));
    assert_eq!(sent_dedup[2], (1, 9));
    assert_eq!(sent_dedup[4], (5, 5));
    assert_eq!(sent_dedup[6], (8, 0));
}

/// A prefill cancelled while its blocks stream out: the decode side has imported some of them
/// when the cancel lands; the stream is reset, the decode side undoes the push, and neither pool
/// keeps a reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_prefill_undoes_a_push_midway() {
    let mut pc = config("P", Role::Prefill);
    // 20 ms per token: 80 ms per block of a 10-block prompt, the blocks reported as they fill.
    pc.model.prefill_us_per_token = 20_000;
    let p = EngineNode::start(&pc).await.unwrap();
    let d = EngineNode::start(&config("D", Role::Decode)).await.unwrap();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let req = PrefillRequest {
        cache_scope: Default::default(),
        request_id: "slow".into(),
        prompt_tokens: (0..40).collect(),
        sampling: sampling(0.0, 1.0, 0, Some(1), 4),
        decode_target: d.addresses().kv,
        rng_draws_offset: 0,
        decode_holds: None,
        decode_lookup: String::new(),
    };
    let c2 = ctl.clone();
    let call = tokio::spawn(async move { c2.prefill(req).await });
    // Blocks arrive on the decode side while the prefill still runs.
    let dpool = d.runner().pool().clone();
    assert!(
        eventually(Duration::from_secs(5), || {
            d.receiver().unwrap().stats().inflight == 1 && dpool.counts().used >= 1
        })
        .await,
        "no block arrived before the prefill ended"
    );
    assert!(ctl.cancel("slow").await.unwrap());
    assert_eq!(call.await.unwrap().unwrap_err().code(), Code::Cancelled);
    assert!(
        eventually(Duration::from_secs(5), || {
            let s = d.receiver().unwrap().stats();
            s.inflight == 0 && s.pending == 0 && dpool.counts().used == 0
        })
        .await,
        "the decode side kept the push: {:?}",
        dpool.counts()
    );
    assert!(
        eventually(Duration::from_secs(5), || p.runner().pool().counts().used
            == 0)
        .await
    );
    p.runner().pool().lock().check().unwrap();
    d.runner().pool().lock().check().unwrap();
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
}

/// Generate's refusals, each before any work, each leaving the decode engine's pool as it was:
/// an engine without the decode role, another model, what the core's types refuse, stop rules
/// past the engine's bounds, a full engine (its `http_max_inflight`), and a draining one; a
/// request the engine thread refuses after the start ends with an in-band error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_refuses_before_any_work() {
    use kvwire_grpc::pb::engine::StopRules;
    let p = EngineNode::start(&config("P", Role::Prefill))
        .await
        .unwrap();
    let mut dc = config("D", Role::Decode);
    dc.limits.http_max_inflight = 1;
    dc.model.decode_us_per_seq = 2_000;
    let d = EngineNode::start(&dc).await.unwrap();
    let ok = || GenerateRequest {
        prompt_tokens: (1..=10).collect(),
        sampling: sampling(0.0, 1.0, 0, Some(3), 4),
        ..GenerateRequest::default()
    };
    let counts = |n: &EngineNode| n.runner().pool().lock().counts();
    let before = counts(&d);
    let generate = |addr: String, req: GenerateRequest| async move {
        ControlClient::new(&addr).unwrap().generate(req).await
    };
    let grpc = d.addresses().grpc;
    let code = |r: Result<_, tonic::Status>| r.map(|_| ()).unwrap_err().code();

    // No decode role.
    let r = generate(p.addresses().grpc, ok()).await;
    assert_eq!(code(r), Code::FailedPrecondition);
    // Another model.
    let mut other = ok();
    other.model = "gpt-x".into();
    assert_eq!(code(generate(grpc.clone(), other).await), Code::NotFound);
    // The core's types: an empty prompt, a token outside the vocabulary, max_tokens 0, a
    // temperature that is not finite.
    for bad in [
        GenerateRequest {
            prompt_tokens: vec![],
            ..ok()
        },
        GenerateRequest {
            prompt_tokens: vec![u32::MAX],
            ..ok()
        },
        GenerateRequest {
            sampling: sampling(0.0, 1.0, 0, Some(3), 0),
            ..ok()
        },
        GenerateRequest {
            sampling: sampling(f32::NAN, 1.0, 0, Some(3), 4),
            ..ok()
        },
        GenerateRequest {
            stop: Some(StopRules {
                sequences: vec![b"x".to_vec(); 5],
                ..StopRules::default()
            }),
            ..ok()
        },
        GenerateRequest {
            stop: Some(StopRules {
                token_ids: vec![1; 129],
                ..StopRules::default()
            }),
            ..ok()
        },
    ] {
        let e = generate(grpc.clone(), bad.clone())
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e}");
    }
    assert_eq!(counts(&d), before, "a refusal touched the pool");

    // Past the engine's room: one long request holds its one place.
    let mut long = ok();
    long.sampling = sampling(0.0, 1.0, 0, Some(3), 100_000);
    let mut held = generate(grpc.clone(), long).await.unwrap();
    while held.message().await.unwrap().unwrap().tokens.is_empty() {}
    assert_eq!(
        code(generate(grpc.clone(), ok()).await),
        Code::ResourceExhausted
    );
    drop(held);
    assert!(
        settled(&d, 0).await,
        "the dropped stream left blocks in use"
    );

    // Nine choices: the engine thread refuses it after the start, in band.
    let e = collect(
        generate(grpc.clone(), GenerateRequest { n: 9, ..ok() })
            .await
            .unwrap(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");

    // A draining engine takes no new request.
    let dctl = ControlClient::new(&grpc).unwrap();
    assert_eq!(dctl.drain(0).await.unwrap(), 0);
    assert_eq!(code(generate(grpc.clone(), ok()).await), Code::Unavailable);
    assert!(settled(&d, 0).await);
    assert_eq!(d.receiver().unwrap().pending(), 0);
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
}
