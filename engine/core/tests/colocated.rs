//! The fake model and the colocated engine: sensitivity, prefix sharing, reproducibility, and
//! resuming from prefill blocks (in the same pool and in another one).

use std::sync::Arc;

use kvwire::Shape;
use tl_engine_core::engine::{Engine, Mode, PrefillOutput, Request, Resume, StepEvent};
use tl_engine_core::model::{BYTE_VOCAB, FakeModel};
use tl_engine_core::pool::{BlockKey, Blocks, KvPool, SharedKv};
use tl_engine_core::sampler::{Sampling, SamplingRequest};

const TEST: Shape = Shape::v1(4, 2, 1, 4);

fn engine(blocks: usize) -> Engine {
    let model = Arc::new(FakeModel::new("fake", TEST, BYTE_VOCAB, 256));
    Engine::new(model, SharedKv::new(KvPool::new(TEST, blocks)))
}

fn sampling(t: f32, p: f32, k: u32) -> Sampling {
    Sampling::new(
        SamplingRequest {
            temperature: t,
            top_p: p,
            top_k: k,
            ..SamplingRequest::default()
        },
        BYTE_VOCAB,
    )
    .unwrap()
}

fn req(prompt: &[u32], sampling: Sampling, seed: u64, max_tokens: u32, mode: Mode) -> Request {
    Request {
        scope: Default::default(),
        prompt: prompt.to_vec(),
        sampling,
        seed,
        max_tokens,
        mode,
        draws_offset: 0,
        stop: tl_engine_core::stop::Stop::default(),
        choices: tl_engine_core::engine::Choices::ONE,
        earlier_output: 0,
        constraint: None,
    }
}

fn prefill(e: &mut Engine, prompt: &[u32], s: Sampling, seed: u64) -> PrefillOutput {
    e.submit(req(prompt, s, seed, 1, Mode::PrefillOnly))
        .unwrap();
    let (events, _) = e.step();
    for ev in events {
        if let StepEvent::Prefilled { output, .. } = ev {
            return output;
        }
    }
    panic!("no Prefilled event");
}

#[test]
fn fake_model_is_sensitive_to_every_cached_kv_byte() {
    let mut e = engine(16);
    let prompt: Vec<u32> = (0..10).map(|i| 40 + i).collect();
    let out = prefill(&mut e, &prompt, Sampling::greedy(), 0);
    let ids = out.blocks.ids().to_vec();
    assert_eq!(ids.len(), 3);
    let model = e.model().clone();
    let pool = e.pool().clone();
    let seq: Vec<u32> = prompt.iter().copied().chain([7]).collect();
    let base = model.decode(&pool, &seq, &ids).unwrap();
    assert_eq!(
        model.decode(&pool, &seq, &ids).unwrap(),
        base,
        "not deterministic"
    );
    let row = TEST.row_bytes().unwrap();
    let plane = row * 4;
    let mut checked = 0;
    for (bi, &id) in ids.iter().enumerate() {
        // Positions 0..10 are the prompt's; position 10 is rewritten by every decode call.
        let rows = (10 - bi * 4).min(4);
        for p in 0..TEST.planes() {
            for byte in p * plane..p * plane + rows * row {
                pool.write(id).unwrap()[byte] ^= 0x01;
                let changed = model.decode(&pool, &seq, &ids).unwrap();
                pool.write(id).unwrap()[byte] ^= 0x01;
                assert_ne!(
                    changed, base,
                    "block {bi} byte {byte} did not change the logits"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 10 * TEST.planes() * row);
    assert_eq!(model.decode(&pool, &seq, &ids).unwrap(), base);
    drop(pool);
    drop(out);
}

#[test]
fn prompts_sharing_a_prefix_share_its_blocks() {
    let mut e = engine(32);
    let a: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9].to_vec();
    let b: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8, 100, 101, 102].to_vec();
    let oa = prefill(&mut e, &a, Sampling::greedy(), 1);
    let ob = prefill(&mut e, &b, Sampling::greedy(), 1);
    assert_eq!(oa.cached_blocks, 0);
    assert_eq!(ob.cached_blocks, 2);
    assert_eq!(oa.blocks.ids()[..2], ob.blocks.ids()[..2]);
    assert_ne!(oa.blocks.ids()[2], ob.blocks.ids()[2]);
    assert_eq!(oa.hashes, ob.hashes[..2]);
    {
        let pool = e.pool().lock();
        assert_eq!(
            pool.info(oa.blocks.ids()[0]).unwrap().2,
            2,
            "shared block holds both references"
        );
        assert_eq!(pool.counts().used, 4);
    }
    drop(oa);
    drop(ob);
    let c = e.pool().lock().counts();
    assert_eq!(
        (c.used, c.cached),
        (0, 2),
        "full blocks stay cached, tails go free"
    );
    e.pool().lock().check().unwrap();
}

#[test]
fn same_seed_same_tokens() {
    let prompt: Vec<u32> = b"hello, world".iter().map(|&b| u32::from(b)).collect();
    let s = sampling(0.9, 0.95, 50);
    let run = |seed| {
        engine(64)
            .generate(req(&prompt, s.clone(), seed, 12, Mode::Generate))
            .unwrap()
    };
    let a = run(7);
    assert_eq!(a.len(), 12);
    assert_eq!(a, run(7));
    assert_ne!(a, run(8));
    // Greedy does not depend on the seed.
    let g = |seed| {
        engine(64)
            .generate(req(&prompt, Sampling::greedy(), seed, 12, Mode::Generate))
            .unwrap()
    };
    assert_eq!(g(1), g(2));
}

/// Runs `prompt` uninterrupted, then as prefill + resume, (a) in the same engine and (b) with the
/// blocks exported into another engine's pool, and compares.
fn resume_matches(prompt: &[u32], s: Sampling, seed: u64) {
    let full = engine(64)
        .generate(req(prompt, s.clone(), seed, 12, Mode::Generate))
        .unwrap();

    // (a) same pool.
    let mut e = engine(64);
    let out = prefill(&mut e, prompt, s.clone(), seed);
    assert_eq!(out.first_token, full[0]);
    assert_eq!(out.draws, u32::from(!s.is_greedy()));
    let id = e
        .resume(Resume {
            scope: Default::default(),
            prompt: prompt.to_vec(),
            blocks: out.blocks,
            first_token: out.first_token,
            draws: u64::from(out.draws),
            sampling: s.clone(),
            seed,
            max_tokens: 12,
            stop: tl_engine_core::stop::Stop::default(),
            choices: tl_engine_core::engine::Choices::ONE,
            earlier_output: 0,
            constraint: None,
        })
        .unwrap();
    let rest = e.run_to_end(id).unwrap();
    assert_eq!([&[out.first_token][..], &rest].concat(), full);

    // (b) another pool: export every block, import it on the other side, resume there.
    let mut p = engine(64);
    let mut d = engine(64);
    let out = prefill(&mut p, prompt, s.clone(), seed);
    let mut imported = Vec::new();
    {
        let src = p.pool().lock();
        let mut dst = d.pool().lock();
        for (i, &bid) in out.blocks.ids().iter().enumerate() {
            let (bytes, fill) = src.export(bid).unwrap();
            let b = TEST.block_tokens() as usize;
            let key = BlockKey {
                scope: 0,
                hash: out.hashes.get(i).copied().unwrap_or(0),
                tokens: &out.prompt[i * b..(i * b + fill as usize)],
                parent: imported.last().copied(),
            };
            imported.push(dst.import(key, fill, &bytes).unwrap());
        }
    }
    let blocks = Blocks::new(d.pool().clone(), imported);
    let id = d
        .resume(Resume {
            scope: Default::default(),
            prompt: prompt.to_vec(),
            blocks,
            first_token: out.first_token,
            draws: u64::from(out.draws),
            sampling: s,
            seed,
            max_tokens: 12,
            stop: tl_engine_core::stop::Stop::default(),
            choices: tl_engine_core::engine::Choices::ONE,
            earlier_output: 0,
            constraint: None,
        })
        .unwrap();
    let rest = d.run_to_end(id).unwrap();
    assert_eq!(
        [&[out.first_token][..], &rest].concat(),
        full,
        "seed {seed}"
    );
    drop(out);
    for eng in [&p, &d] {
        let c = eng.pool().lock().counts();
        assert_eq!(c.used, 0, "blocks leaked");
        eng.pool().lock().check().unwrap();
    }
}

#[test]
fn resumed_prefill_equals_uninterrupted_run() {
    let prompts: [Vec<u32>; 3] = [vec![5, 6, 7], (0..8).collect(), (10..21).collect()];
    for prompt in &prompts {
        resume_matches(prompt, Sampling::greedy(), 0);
        resume_matches(prompt, sampling(0.8, 0.9, 0), 42);
        resume_matches(prompt, sampling(1.3, 1.0, 20), 0xdead_beef);
    }
}

#[test]
fn continuous_batching_interleaves_and_frees() {
    let mut e = engine(64);
    let s = sampling(0.7, 1.0, 0);
    let a = e
        .submit(req(&[1, 2, 3, 4, 5], s.clone(), 1, 6, Mode::Generate))
        .unwrap();
    e.step();
    // b joins while a is decoding; both progress in the same steps.
    let b = e
        .submit(req(&[9, 9, 9], s.clone(), 2, 4, Mode::Generate))
        .unwrap();
    let (events, stats) = e.step();
    assert_eq!(stats.decoded, 1);
    assert!(
        events
            .iter()
            .any(|ev| matches!(ev, StepEvent::Token { seq, .. } if *seq == b))
    );
    let (events, stats) = e.step();
    assert_eq!(stats.decoded, 2);
    assert_eq!(
        events
            .iter()
            .filter(|ev| matches!(ev, StepEvent::Token { .. }))
            .count(),
        2
    );
    assert!(e.cancel(a));
    assert!(!e.cancel(a));
    while !e.is_idle() {
        e.step();
    }
    let c = e.pool().lock().counts();
    assert_eq!(c.used, 0);
    // Each solo run gives the same tokens as the batched one (sequences do not disturb each other).
    let solo = engine(64)
        .generate(req(&[9, 9, 9], s.clone(), 2, 4, Mode::Generate))
        .unwrap();
    let mut e2 = engine(64);
    e2.submit(req(&[1, 2, 3, 4, 5], s.clone(), 1, 6, Mode::Generate))
        .unwrap();
    let bid = e2.submit(req(&[9, 9, 9], s, 2, 4, Mode::Generate)).unwrap();
    let mut got = Vec::new();
    while !e2.is_idle() {
        for ev in e2.step().0 {
            if let StepEvent::Token { seq, token, .. } = ev
                && seq == bid
            {
                got.push(token);
            }
        }
    }
    assert_eq!(got, solo);
}

#[test]
fn exhausted_pool_fails_the_request_and_frees() {
    let mut e = engine(2);
    let before = e.pool().lock().counts();
    let r = e.generate(req(
        &(0..12).collect::<Vec<_>>(),
        Sampling::greedy(),
        0,
        2,
        Mode::Generate,
    ));
    assert!(r.is_err());
    assert_eq!(e.pool().lock().counts(), before);
    // A request that fits, but whose decode needs one block too many, fails mid-way and frees.
    let r = e.generate(req(
        &(0..8).collect::<Vec<_>>(),
        Sampling::greedy(),
        0,
        3,
        Mode::Generate,
    ));
    assert!(r.is_err());
    assert_eq!(e.pool().lock().counts().used, 0);
    e.pool().lock().check().unwrap();
}

/// Wraps the fake model and records the size of every `write` call.
#[derive(Debug)]
struct Recording {
    inner: FakeModel,
    writes: std::sync::Mutex<Vec<usize>>,
}

impl tl_engine_core::model::Model for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn shape(&self) -> Shape {
        self.inner.shape()
    }
    fn vocab(&self) -> u32 {
        self.inner.vocab()
    }
    fn max_context(&self) -> u32 {
        self.inner.max_context()
    }
    fn write(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[tl_engine_core::pool::BlockId],
    ) -> Result<(), tl_engine_core::model::ModelError> {
        self.writes.lock().unwrap().push(tokens.len());
        self.inner.write(pool, tokens, first_pos, blocks)
    }
    fn logits(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        blocks: &[tl_engine_core::pool::BlockId],
    ) -> Result<Vec<f32>, tl_engine_core::model::ModelError> {
        self.inner.logits(pool, tokens, blocks)
    }
}

#[test]
fn prefill_writes_block_by_block_and_still_matches() {
    use tl_engine_core::model::Model;
    let rec = Arc::new(Recording {
        inner: FakeModel::new("fake", TEST, BYTE_VOCAB, 256),
        writes: Default::default(),
    });
    let mut e = Engine::new(rec.clone(), SharedKv::new(KvPool::new(TEST, 64)));
    let prompt: Vec<u32> = (0..10).collect();
    let s = sampling(0.9, 1.0, 0);
    let got = e
        .generate(req(&prompt, s.clone(), 3, 6, Mode::Generate))
        .unwrap();
    // Prefill: one write per block (4, 4, 2), then one per decode step.
    let writes = rec.writes.lock().unwrap().clone();
    assert_eq!(writes[..3], [4, 4, 2]);
    assert!(writes[3..].iter().all(|&n| n == 1));
    assert_eq!(writes.len(), 3 + 5);
    assert_eq!(
        got,
        engine(64)
            .generate(req(&prompt, s, 3, 6, Mode::Generate))
            .unwrap()
    );
    assert_eq!(rec.vocab(), BYTE_VOCAB);
}

#[test]
fn logits_take_no_pool_lock() {
    let mut e = engine(32);
    let prompt: Vec<u32> = (0..23).map(|i| (i * 11 % 256) as u32).collect();
    let out = prefill(&mut e, &prompt, Sampling::greedy(), 1);
    let model = Arc::clone(e.model());
    let quiet: Vec<Vec<f32>> = [1, 4, 5, 22, 23]
        .iter()
        .map(|&n| {
            model
                .logits(e.pool(), &prompt[..n], out.blocks.ids())
                .unwrap()
        })
        .collect();
    // The same passes while another thread holds the pool's lock: they must not need it.
    let held = e.pool().lock();
    let (tx, rx) = std::sync::mpsc::channel();
    let (pool, ids) = (e.pool().clone(), out.blocks.ids().to_vec());
    let m = Arc::clone(&model);
    let p = prompt.clone();
    let t = std::thread::spawn(move || {
        let busy: Vec<Vec<f32>> = [1, 4, 5, 22, 23]
            .iter()
            .map(|&n| m.logits(&pool, &p[..n], &ids).unwrap())
            .collect();
        tx.send(busy).unwrap();
    });
    // A deadlock guard, not a speed check: the passes take microseconds.
    let busy = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("logits waited for the pool's lock");
    drop(held);
    t.join().unwrap();
    assert_eq!(busy, quiet);
    // A table too short for n is refused.
    assert!(model.logits(e.pool(), &[7; 40], out.blocks.ids()).is_err());
}

/// What failover relies on: generating from the prompt plus the first k tokens of a run, with
/// the generator advanced past the draws those k tokens used, yields exactly the rest of the
/// run, for every k, greedy and seeded.
#[test]
fn continuing_after_k_tokens_with_their_draws_equals_the_whole_run() {
    let prompt: Vec<u32> = (10..33).collect();
    for (s, per_token) in [(sampling(0.0, 1.0, 0), 0), (sampling(0.9, 0.95, 40), 1)] {
        let whole = engine(64)
            .generate(req(&prompt, s.clone(), 77, 12, Mode::Generate))
            .unwrap();
        for k in 1..12 {
            let mut p = prompt.clone();
            p.extend_from_slice(&whole[..k]);
            let mut r = req(&p, s.clone(), 77, 12 - k as u32, Mode::Generate);
            r.draws_offset = per_token * k as u64;
            let rest = engine(64).generate(r).unwrap();
            assert_eq!(rest, whole[k..], "k = {k}, per_token = {per_token}");
        }
        // Without the offset a seeded continuation diverges (this is what the field is for).
        if per_token == 1 {
            let mut p = prompt.clone();
            p.extend_from_slice(&whole[..4]);
            let rest = engine(64)
                .generate(req(&p, s, 77, 8, Mode::Generate))
                .unwrap();
            assert_ne!(rest, whole[4..]);
        }
    }
}

/// A stop rule ends the sequence at the step whose token completes it, and its blocks go back
/// to the pool at that step (not at max_tokens).
#[test]
fn stop_ends_the_sequence_at_the_matching_step() {
    use tl_engine_core::engine::FinishReason;
    use tl_engine_core::stop::Stop;
    let prompt: Vec<u32> = (20..31).collect();
    let whole = engine(64)
        .generate(req(&prompt, sampling(0.9, 1.0, 0), 3, 40, Mode::Generate))
        .unwrap();
    // A two-byte stop sequence taken from the run, and where it first ends.
    let seq = vec![whole[9] as u8, whole[10] as u8];
    let end = (1..whole.len())
        .find(|&i| whole[i - 1] == u32::from(seq[0]) && whole[i] == u32::from(seq[1]))
        .unwrap();
    for stop in [
        Stop {
            sequences: vec![seq.clone()],
            token_ids: vec![],
            ..Stop::default()
        },
        Stop {
            sequences: vec![],
            token_ids: vec![whole[end]],
            ..Stop::default()
        },
    ] {
        let first_id = whole.iter().position(|&t| stop.token_ids.contains(&t));
        let want_len = first_id.map_or(end + 1, |i| i + 1);
        let mut e = engine(64);
        let mut r = req(&prompt, sampling(0.9, 1.0, 0), 3, 40, Mode::Generate);
        r.stop = stop.clone();
        let id = e.submit(r).unwrap();
        let mut got = Vec::new();
        let mut steps = 0;
        let reason = loop {
            steps += 1;
            let (events, _) = e.step();
            let mut done = None;
            for ev in events {
                match ev {
                    StepEvent::Token { seq, token, .. } if seq == id => got.push(token),
                    StepEvent::Finished { seq, reason, .. } if seq == id => done = Some(reason),
                    _ => {}
                }
            }
            if let Some(r) = done {
                break r;
            }
            assert!(steps < 100, "never finished");
        };
        assert_eq!(reason, FinishReason::Stop, "{stop:?}");
        assert_eq!(got, whole[..want_len], "{stop:?}");
        // The blocks went back when the sequence finished.
        assert_eq!(e.pool().lock().counts().used, 0, "{stop:?}");
    }
}

/// Runs `requests` on `e`: each `(prompt, sampling, seed, submitted at step)`; returns every
/// request's tokens per choice, and for each step the requests that got a token in it.
fn interleaved(
    e: &mut Engine,
    requests: &[(Vec<u32>, Sampling, u64, usize, u32)],
) -> (Vec<Vec<Vec<u32>>>, Vec<Vec<usize>>) {
    let mut ids = vec![None; requests.len()];
    let mut tokens: Vec<Vec<Vec<u32>>> = requests
        .iter()
        .map(|r| vec![Vec::new(); r.4 as usize])
        .collect();
    let mut done = vec![0u32; requests.len()];
    let mut steps = Vec::new();
    for step in 0..10_000 {
        for (i, (prompt, s, seed, at, n)) in requests.iter().enumerate() {
            if *at == step {
                let mut r = req(prompt, s.clone(), *seed, 12, Mode::Generate);
                r.choices = tl_engine_core::engine::Choices { n: *n, ..r.choices };
                ids[i] = Some(e.submit(r).unwrap());
            }
        }
        let (events, _) = e.step();
        let mut got = Vec::new();
        for ev in events {
            let of = |seq| ids.iter().position(|&id| id == Some(seq)).unwrap();
            match ev {
                StepEvent::Token {
                    seq, choice, token, ..
                } => {
                    let i = of(seq);
                    tokens[i][choice as usize].push(token);
                    got.push(i);
                }
                StepEvent::Finished { seq, .. } => done[of(seq)] += 1,
                other => panic!("{other:?}"),
            }
        }
        steps.push(got);
        if requests.iter().zip(&done).all(|(r, &d)| d == r.4) && e.is_idle() {
            return (tokens, steps);
        }
    }
    panic!("the requests never ended");
}

#[test]
fn chunked_prefill_equals_whole_prefill() {
    use tl_engine_core::scheduler::Scheduler;
    // A long prompt (61 tokens: 15 full blocks and a tail) arriving while two short ones
    // decode, one of them with two choices.
    let long: Vec<u32> = (0..61).map(|i| (i * 7 + 3) % 250).collect();
    let short: Vec<u32> = (0..6).map(|i| 100 + i).collect();
    let other: Vec<u32> = (0..9).map(|i| 30 + i).collect();
    for (t, seed) in [(0.0, 0), (0.9, 42)] {
        let s = sampling(t, 1.0, 0);
        let reqs = [
            (short.clone(), s.clone(), seed, 0, 1),
            (other.clone(), s.clone(), seed + 1, 0, 2),
            (long.clone(), s, seed + 2, 2, 1),
        ];
        let mut whole = engine(128);
        let (want, _) = interleaved(&mut whole, &reqs);
        let mut chunked = engine(128);
        chunked.set_scheduler(Scheduler {
            max_step_tokens: Some(8),
            ..Scheduler::default()
        });
        let (got, steps) = interleaved(&mut chunked, &reqs);
        assert_eq!(got, want, "temperature {t}");
        // The long prompt took several steps, and the short requests got a token in each.
        let first_long = steps.iter().position(|g| g.contains(&2)).unwrap();
        assert!(
            first_long >= 2 + 61 / 8 - 2,
            "prefilled in {first_long} steps"
        );
        // Until it has its 12 tokens, the short request gets one every step: the long
        // prompt's chunks never stall it.
        let mut short_tokens = 0;
        for (k, g) in steps.iter().enumerate().take(first_long) {
            if short_tokens < 12 {
                assert!(g.contains(&0), "step {k}: the short request stalled");
            }
            short_tokens += g.iter().filter(|&&i| i == 0).count();
        }
        for e in [&whole, &chunked] {
            e.pool().lock().check().unwrap();
            assert_eq!(e.pool().lock().counts().used, 0);
        }
    }
    // Prefill only: the same blocks and first token, whole or chunked.
    let mut whole = engine(64);
    let a = prefill(&mut whole, &long, sampling(0.9, 1.0, 0), 5);
    let mut chunked = engine(64);
    chunked.set_scheduler(Scheduler {
        max_step_tokens: Some(8),
        ..Scheduler::default()
    });
    chunked
        .submit(req(&long, sampling(0.9, 1.0, 0), 5, 1, Mode::PrefillOnly))
        .unwrap();
    let mut out = None;
    for _ in 0..100 {
        for ev in chunked.step().0 {
            if let StepEvent::Prefilled { output, .. } = ev {
                out = Some(output);
            }
        }
        if out.is_some() {
            break;
        }
        assert_eq!(
            chunked.queue_depth(),
            1,
            "a half-prefilled prompt is still queued"
        );
    }
    let b = out.unwrap();
    assert_eq!(
        (b.first_token, &b.hashes, b.draws),
        (a.first_token, &a.hashes, a.draws)
    );
    for (x, y) in a.blocks.ids().iter().zip(b.blocks.ids()) {
        assert_eq!(
            *whole.pool().read(*x).unwrap(),
            *chunked.pool().read(*y).unwrap()
        );
    }
}

#[test]
fn cancelling_a_half_prefilled_prompt_gives_its_blocks_back() {
    use tl_engine_core::scheduler::Scheduler;
    let mut e = engine(64);
    e.set_scheduler(Scheduler {
        max_step_tokens: Some(8),
        ..Scheduler::default()
    });
    let long: Vec<u32> = (0..61).map(|i| (i * 5 + 1) % 250).collect();
    let id = e
        .submit(req(&long, Sampling::greedy(), 0, 4, Mode::Generate))
        .unwrap();
    e.step();
    e.step();
    assert!(e.pool().lock().counts().used > 0, "nothing was taken yet");
    assert!(e.cancel(id));
    assert!(e.is_idle());
    let c = e.pool().lock().counts();
    assert_eq!(c.used, 0);
    e.pool().lock().check().unwrap();
}
