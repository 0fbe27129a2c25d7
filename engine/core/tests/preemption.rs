//! Preemption: a pool too small for every running sequence pauses the youngest request instead
//! of failing it, and the request resumes, by recomputation or from its still cached blocks,
//! with exactly the tokens (and log-probabilities) it would have produced alone.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvwire::Shape;
use tl_engine_core::engine::{Choices, Engine, Generated, Mode, Request, SeqError, StepEvent};
use tl_engine_core::model::{BYTE_VOCAB, FakeModel};
use tl_engine_core::pool::{KvPool, PoolError, SharedKv};
use tl_engine_core::sampler::{Sampling, SamplingRequest};

/// B = 4 tokens per block.
const SHAPE: Shape = Shape::v1(4, 2, 1, 4);

fn engine(blocks: usize) -> Engine {
    let model = Arc::new(FakeModel::new("fake", SHAPE, BYTE_VOCAB, 256));
    Engine::new(model, SharedKv::new(KvPool::new(SHAPE, blocks)))
}

fn request(prompt: &[u32], seeded: bool, seed: u64, max_tokens: u32, n: u32) -> Request {
    let sampling = if seeded {
        SamplingRequest {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 0,
            ..SamplingRequest::default()
        }
    } else {
        SamplingRequest::default()
    };
    Request {
        prompt: prompt.to_vec(),
        sampling: Sampling::new(sampling, BYTE_VOCAB).unwrap(),
        seed,
        max_tokens,
        mode: Mode::Generate,
        draws_offset: 0,
        earlier_output: 0,
        stop: Default::default(),
        choices: Choices {
            n,
            logprobs: Some(2),
        },
        scope: 7,
        constraint: None,
    }
}

/// Each (request, choice)'s completion.
type Completions = HashMap<(u64, u32), Generated>;

/// Steps until idle; every request's choices as they ended, and every failure.
fn run_all(e: &mut Engine) -> (Completions, Vec<(u64, SeqError)>) {
    let mut out = Completions::new();
    let mut failed = Vec::new();
    let mut steps = 0;
    while !e.is_idle() {
        steps += 1;
        assert!(steps < 10_000, "no progress");
        step_into(e, &mut out, &mut failed);
    }
    (out, failed)
}

/// One step, its events recorded.
fn step_into(e: &mut Engine, out: &mut Completions, failed: &mut Vec<(u64, SeqError)>) {
    step_at(e, Instant::now(), out, failed);
}

/// One step at `now`.
fn step_at(e: &mut Engine, now: Instant, out: &mut Completions, failed: &mut Vec<(u64, SeqError)>) {
    for ev in e.step_at(now).0 {
        match ev {
            StepEvent::Token {
                seq,
                choice,
                token,
                index,
                logprobs,
            } => {
                let g = out.entry((seq, choice)).or_default();
                assert_eq!(
                    index as usize,
                    g.tokens.len(),
                    "token index of {seq}/{choice}"
                );
                g.tokens.push(token);
                g.logprobs.extend(logprobs);
            }
            StepEvent::Finished {
                seq,
                choice,
                reason,
            } => out.entry((seq, choice)).or_default().finish = Some(reason),
            StepEvent::Failed { seq, error } => failed.push((seq, error)),
            StepEvent::Prefilled { .. } => panic!("no prefill-only request here"),
        }
    }
}

fn prompts() -> Vec<Vec<u32>> {
    // Two share a first block, so a resume can find part of its KV cached.
    vec![
        b"the quick brown".iter().map(|&c| u32::from(c)).collect(),
        b"the quick red fox".iter().map(|&c| u32::from(c)).collect(),
        b"lorem ipsum".iter().map(|&c| u32::from(c)).collect(),
    ]
}

fn assert_back_to_baseline(e: &Engine) {
    let pool = e.pool().lock();
    pool.check().unwrap();
    let c = pool.counts();
    assert_eq!(c.used, 0, "{c:?}");
    assert_eq!(c.free + c.cached, c.total, "{c:?}");
}

#[test]
fn preempted_sequence_resumes_exactly() {
    const MAX_TOKENS: u32 = 40;
    for seeded in [false, true] {
        // Each request alone, in a pool that never runs dry.
        let mut alone = Vec::new();
        for (i, p) in prompts().iter().enumerate() {
            let mut e = engine(256);
            let n = if i == 1 { 2 } else { 1 };
            alone.push(
                e.generate_choices(request(p, seeded, 11 + i as u64, MAX_TOKENS, n))
                    .unwrap(),
            );
        }
        // All three together, in a pool that holds the longest one (15 blocks at n = 2) but
        // not all of them (about 40).
        let mut e = engine(16);
        let ids: Vec<u64> = prompts()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let n = if i == 1 { 2 } else { 1 };
                e.submit(request(p, seeded, 11 + i as u64, MAX_TOKENS, n))
                    .unwrap()
            })
            .collect();
        let (out, failed) = run_all(&mut e);
        assert!(failed.is_empty(), "seeded {seeded}: {failed:?}");
        assert!(
            e.preemptions() >= 2,
            "seeded {seeded}: the pool was meant to force preemption, got {}",
            e.preemptions()
        );
        for (i, id) in ids.iter().enumerate() {
            for (choice, want) in alone[i].iter().enumerate() {
                let got = &out[&(*id, choice as u32)];
                assert_eq!(got, want, "seeded {seeded}, request {i}, choice {choice}");
            }
        }
        assert_back_to_baseline(&e);
    }
}

#[test]
fn a_request_that_outgrows_the_whole_pool_alone_fails_cleanly() {
    let mut e = engine(5);
    let p = &prompts()[0];
    let id = e.submit(request(p, false, 1, 40, 1)).unwrap();
    let (out, failed) = run_all(&mut e);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, id);
    assert!(
        matches!(failed[0].1, SeqError::Pool(PoolError::Exhausted { .. })),
        "{failed:?}"
    );
    // It ran until the pool's 5 blocks (20 positions) were full.
    let got = out[&(id, 0)].tokens.len();
    assert!(
        (4..=6).contains(&got),
        "{got} tokens before the pool ran dry"
    );
    assert_back_to_baseline(&e);
}

#[test]
fn cancelling_a_preempted_request_frees_nothing_twice() {
    let mut e = engine(16);
    let ids: Vec<u64> = prompts()
        .iter()
        .map(|p| e.submit(request(p, true, 3, 40, 1)).unwrap())
        .collect();
    while e.preemptions() == 0 {
        assert!(!e.is_idle(), "finished without preempting");
        e.step();
    }
    // The youngest was paused; cancel it while it waits, then run the others out.
    assert!(e.cancel(ids[2]));
    e.pool().lock().check().unwrap();
    let mut ended = 0;
    while !e.is_idle() {
        for ev in e.step().0 {
            match ev {
                StepEvent::Failed { seq, error } => panic!("{seq}: {error}"),
                StepEvent::Finished { seq, .. } => {
                    assert_ne!(seq, ids[2], "the cancelled request ran on");
                    ended += 1;
                }
                _ => {}
            }
        }
    }
    assert_eq!(ended, 2);
    assert_back_to_baseline(&e);
}

/// An import of another tenant waiting for room (`SharedKv::press`) makes the engine preempt
/// the tenant holding the most blocks, youngest request first, until the room is there; the
/// preempted requests still finish with exactly their own tokens. A tenant's own waiting import
/// never preempts that tenant.
#[test]
fn a_waiting_import_of_another_tenant_preempts_the_biggest_holder() {
    let mut e = engine(24);
    let ids: Vec<u64> = prompts()
        .iter()
        .take(2)
        .enumerate()
        .map(|(i, p)| e.submit(request(p, true, 5 + i as u64, 30, 1)).unwrap())
        .collect();
    let (mut out, mut failed) = (Completions::new(), Vec::new());
    // Run until the two requests (scope 7) hold most of the pool.
    while e.pool().lock().available() > 6 {
        assert!(!e.is_idle());
        step_into(&mut e, &mut out, &mut failed);
    }
    // The steps' clock, moved by hand: a call for room ages out after PRESSURE_TTL.
    let ttl = tl_engine_core::pool::PRESSURE_TTL;
    let t0 = Instant::now();
    // Scope 7's own import waiting: nothing is preempted for it.
    e.pool().press(7, 12, t0);
    step_at(&mut e, t0, &mut out, &mut failed);
    assert_eq!(e.preemptions(), 0, "a tenant preempted itself");
    // Another scope's import, once scope 7's call has lapsed: the youngest of scope 7 gives
    // its blocks back at once.
    let t1 = t0 + ttl * 2;
    e.pool().press(99, 12, t1);
    step_at(&mut e, t1, &mut out, &mut failed);
    assert_eq!(e.preemptions(), 1);
    assert!(e.pool().lock().available() >= 12);
    assert_eq!(e.running(), 1, "the older request runs on");
    // Within the TTL the call still holds: nothing more is preempted, the room stays.
    step_at(&mut e, t1 + ttl / 2, &mut out, &mut failed);
    assert_eq!(e.preemptions(), 1);
    // The pressure lapses; both finish with the tokens they would have produced alone.
    let t2 = t1 + ttl * 2;
    while !e.is_idle() {
        step_at(&mut e, t2, &mut out, &mut failed);
    }
    assert!(failed.is_empty(), "{failed:?}");
    for (i, id) in ids.iter().enumerate() {
        let mut alone = engine(256);
        let want = alone
            .generate_choices(request(&prompts()[i], true, 5 + i as u64, 30, 1))
            .unwrap();
        assert_eq!(out[&(*id, 0)], want[0], "request {i}");
    }
    assert_back_to_baseline(&e);
}
