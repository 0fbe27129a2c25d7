//! `n` choices from one prefill (the prompt's full blocks shared by reference, its partial tail
//! copied), each equal to a request of one choice with seed `seed + i`; and log-probabilities
//! that a resumed request recomputes from transferred blocks exactly as the colocated run
//! computed them.

use std::sync::Arc;

use kvwire::Shape;
use tl_engine_core::engine::{
    Choices, Engine, Generated, Mode, PrefillOutput, Request, Resume, SeqId, StepEvent,
};
use tl_engine_core::model::{BYTE_VOCAB, FakeModel};
use tl_engine_core::pool::{BlockId, BlockKey, Blocks, KvPool, SharedKv};
use tl_engine_core::sampler::{Sampling, SamplingRequest};
use tl_engine_core::stop::Stop;

const TEST: Shape = Shape::v1(4, 2, 1, 4);

fn engine(blocks: usize) -> Engine {
    let model = Arc::new(FakeModel::new("fake", TEST, BYTE_VOCAB, 256));
    Engine::new(model, SharedKv::new(KvPool::new(TEST, blocks)))
}

fn seeded(t: f32) -> Sampling {
    let r = SamplingRequest {
        temperature: t,
        ..SamplingRequest::default()
    };
    Sampling::new(r, BYTE_VOCAB).unwrap()
}

fn req(prompt: &[u32], s: Sampling, seed: u64, max_tokens: u32, choices: Choices) -> Request {
    Request {
        scope: Default::default(),
        prompt: prompt.to_vec(),
        sampling: s,
        seed,
        max_tokens,
        mode: Mode::Generate,
        draws_offset: 0,
        stop: Stop::default(),
        choices,
        earlier_output: 0,
        constraint: None,
    }
}

fn choices(n: u32, logprobs: Option<u32>) -> Choices {
    Choices { n, logprobs }
}

/// Steps `e` until each of request `id`'s `n` choices has ended.
fn drive(e: &mut Engine, id: SeqId, n: u32) -> Vec<Generated> {
    let mut out = vec![Generated::default(); n as usize];
    let mut open = n;
    while open > 0 {
        open -= absorb(&mut out, id, e.step().0);
    }
    out
}

/// Adds request `id`'s tokens among `events` to `out`; returns the choices that ended.
fn absorb(out: &mut [Generated], id: SeqId, events: Vec<StepEvent>) -> u32 {
    let mut ended = 0;
    for ev in events {
        match ev {
            StepEvent::Token {
                seq,
                choice,
                token,
                logprobs,
                ..
            } if seq == id => {
                out[choice as usize].tokens.push(token);
                out[choice as usize].logprobs.extend(logprobs);
            }
            StepEvent::Finished {
                seq,
                choice,
                reason,
            } if seq == id => {
                out[choice as usize].finish = Some(reason);
                ended += 1;
            }
            StepEvent::Failed { seq, error } if seq == id => panic!("{error}"),
            _ => {}
        }
    }
    ended
}

fn prefill(e: &mut Engine, prompt: &[u32], s: Sampling, seed: u64) -> PrefillOutput {
    let mut r = req(prompt, s, seed, 1, Choices::ONE);
    r.mode = Mode::PrefillOnly;
    let id = e.submit(r).unwrap();
    for ev in e.step().0 {
        if let StepEvent::Prefilled { seq, output } = ev
            && seq == id
        {
            return output;
        }
    }
    panic!("no Prefilled event");
}

/// The prefill's blocks copied into `d`'s pool, as a transfer imports them.
fn transfer(p: &Engine, out: &PrefillOutput, d: &Engine) -> Blocks {
    let b = TEST.block_tokens() as usize;
    let src = p.pool().lock();
    let mut dst = d.pool().lock();
    let ids =
        out.blocks
            .ids()
            .iter()
            .enumerate()
            .fold(Vec::new(), |mut ids: Vec<BlockId>, (i, &bid)| {
                let (bytes, fill) = src.export(bid).unwrap();
                let key = BlockKey {
                    scope: 0,
                    hash: out.hashes.get(i).copied().unwrap_or(0),
                    tokens: &out.prompt[i * b..(i * b + fill as usize)],
                    parent: ids.last().copied(),
                };
                ids.push(dst.import(key, fill, &bytes).unwrap());
                ids
            });
    drop((src, dst));
    Blocks::new(d.pool().clone(), ids)
}

#[test]
fn n_choices_fork_from_one_prefill() {
    let b = TEST.block_tokens() as usize;
    // A partial tail block (copied per choice), and a prompt of whole blocks (nothing copied).
    for len in [3 * b + 2, 3 * b] {
        let prompt: Vec<u32> = (0..len as u32).map(|i| 60 + i * 3).collect();
        for (s, seed) in [(seeded(0.9), 21u64), (Sampling::greedy(), 5)] {
            let mut e = engine(64);
            let id = e
                .submit(req(&prompt, s.clone(), seed, 9, choices(4, None)))
                .unwrap();
            let (events, stats) = e.step();
            assert_eq!(stats.prefilled_tokens, len, "one prefill serves 4 choices");
            let firsts: Vec<u32> = events
                .iter()
                .filter_map(|ev| match ev {
                    StepEvent::Token {
                        seq,
                        choice,
                        index: 0,
                        ..
                    } if *seq == id => Some(*choice),
                    _ => None,
                })
                .collect();
            assert_eq!(firsts, vec![0, 1, 2, 3]);
            // The full blocks once, and one tail block per choice.
            let tails = if len % b == 0 { 0 } else { 4 };
            assert_eq!(e.pool().lock().counts().used, len / b + tails);
            let mut got = vec![Generated::default(); 4];
            let mut open = 4 - absorb(&mut got, id, events);
            while open > 0 {
                open -= absorb(&mut got, id, e.step().0);
            }
            assert_eq!(e.pool().lock().counts().used, 0, "blocks leaked");
            e.pool().lock().check().unwrap();
            for (i, g) in got.iter().enumerate() {
                let alone = engine(64)
                    .generate(req(&prompt, s.clone(), seed + i as u64, 9, Choices::ONE))
                    .unwrap();
                assert_eq!(g.tokens, alone, "choice {i} of len {len}, {s:?}");
            }
            if s.is_greedy() {
                assert!(got.iter().all(|g| g.tokens == got[0].tokens));
            } else {
                assert_ne!(got[0].tokens, got[1].tokens, "seeds do not differ");
            }
        }
    }
}

#[test]
fn choices_and_logprobs_are_refused_out_of_bounds() {
    let mut e = engine(8);
    let prompt = [1, 2, 3];
    for c in [choices(0, None), choices(9, None), choices(1, Some(21))] {
        assert!(e.submit(req(&prompt, Sampling::greedy(), 0, 4, c)).is_err());
    }
    let mut r = req(&prompt, Sampling::greedy(), 0, 4, choices(2, None));
    r.mode = Mode::PrefillOnly;
    assert!(e.submit(r).is_err());
    assert!(e.is_idle());
    assert_eq!(e.pool().lock().counts().used, 0);
}

/// A request prefilled on one engine and resumed with n choices and logprobs on another (its
/// blocks exported and imported, as a transfer does) equals the colocated run bit for bit:
/// tokens, and every log-probability, the first token's included (recomputed from the
/// imported blocks).
#[test]
fn resumed_choices_and_logprobs_equal_the_colocated_run() {
    let b = TEST.block_tokens() as usize;
    let prompt: Vec<u32> = (0..(2 * b + 3) as u32).map(|i| 100 + i).collect();
    for (s, seed) in [(seeded(0.8), 77u64), (Sampling::greedy(), 3)] {
        let want = engine(64)
            .generate_choices(req(&prompt, s.clone(), seed, 7, choices(3, Some(5))))
            .unwrap();
        let mut p = engine(64);
        let mut d = engine(64);
        let out = prefill(&mut p, &prompt, s.clone(), seed);
        let id = resume_on(
            &mut d,
            &p,
            &out,
            &req(&prompt, s.clone(), seed, 7, choices(3, Some(5))),
        );
        let got = drive(&mut d, id, 3);
        assert_eq!(got, want, "{s:?}");
        for g in &got {
            assert_eq!(g.logprobs.len(), g.tokens.len());
            for (l, &t) in g.logprobs.iter().zip(&g.tokens) {
                assert_eq!(l.token, t);
                assert_eq!(l.top.len(), 5);
                assert!(l.logprob <= 0.0 && l.top[0].1 >= l.logprob);
            }
        }
        let bits = |g: &[Generated]| -> Vec<u32> {
            g.iter()
                .flat_map(|g| g.logprobs.iter().map(|l| l.logprob.to_bits()))
                .collect()
        };
        assert_eq!(bits(&got), bits(&want));
        drop(out);
        for eng in [&p, &d] {
            assert_eq!(eng.pool().lock().counts().used, 0, "blocks leaked");
        }
    }
}

/// Log-probabilities are the model's, before temperature: the first step's are the same at
/// any temperature.
#[test]
fn logprobs_do_not_depend_on_temperature() {
    let prompt: Vec<u32> = (0..9).map(|i| 33 + 5 * i).collect();
    let first = |t: f32| {
        let s = if t == 0.0 {
            Sampling::greedy()
        } else {
            seeded(t)
        };
        let g = engine(32)
            .generate_choices(req(&prompt, s, 1, 1, choices(1, Some(5))))
            .unwrap();
        g[0].logprobs[0].top.clone()
    };
    let cold = first(0.0);
    assert_eq!(cold.len(), 5);
    assert_eq!(first(0.3), cold);
    assert_eq!(first(1.7), cold);
}

/// Resumes `r` on `d` from `out` (prefilled on `p`), its blocks transferred into `d`'s pool.
fn resume_on(d: &mut Engine, p: &Engine, out: &PrefillOutput, r: &Request) -> SeqId {
    let blocks = transfer(p, out, d);
    d.resume(Resume {
        scope: Default::default(),
        prompt: r.prompt.clone(),
        blocks,
        first_token: out.first_token,
        draws: u64::from(out.draws),
        sampling: r.sampling.clone(),
        seed: r.seed,
        max_tokens: r.max_tokens,
        stop: r.stop.clone(),
        choices: r.choices,
        earlier_output: 0,
        constraint: None,
    })
    .unwrap()
}

/// The next step fails request `id`, and `e` is left idle with no block in use.
fn fails_and_frees(e: &mut Engine, id: SeqId) {
    let events = e.step().0;
    assert!(
        events
            .iter()
            .any(|ev| matches!(ev, StepEvent::Failed { seq, .. } if *seq == id)),
        "{events:?}"
    );
    assert!(e.is_idle());
    assert_eq!(e.pool().lock().counts().used, 0, "blocks leaked");
    e.pool().lock().check().unwrap();
}

/// A fork that finds no block for its tail fails the whole request, and every block it or its
/// siblings took goes back (prefilled here, and resumed from transferred blocks).
#[test]
fn a_fork_without_a_block_fails_the_request_and_frees_everything() {
    let b = TEST.block_tokens() as usize;
    let prompt: Vec<u32> = (0..(3 * b + 2) as u32).collect();
    // The prompt's 4 blocks and one more: the second fork's tail does not fit.
    let mut e = engine(5);
    let id = e
        .submit(req(&prompt, seeded(0.5), 1, 6, choices(4, None)))
        .unwrap();
    fails_and_frees(&mut e, id);

    let mut p = engine(8);
    let out = prefill(&mut p, &prompt, seeded(0.5), 1);
    let mut d = engine(5);
    let r = req(&prompt, seeded(0.5), 1, 6, choices(4, Some(2)));
    let id = resume_on(&mut d, &p, &out, &r);
    fails_and_frees(&mut d, id);
}
