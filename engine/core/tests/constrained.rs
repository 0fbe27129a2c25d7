//! Constrained decoding in the core, with a constraint written here (the grammar library lives
//! in the engine crate): the mask is obeyed greedy and sampled, the constraint ends the output,
//! every choice gets its own copy, and an engine that resumes a sequence from its tokens (after
//! a prefill elsewhere, or after a failover) continues exactly as one engine would.

use std::sync::Arc;

use kvwire::Shape;
use tl_engine_core::constraint::{Constraint, ConstraintError, Next};
use tl_engine_core::engine::{
    Choices, Engine, FinishReason, GenerateError, Mode, Request, Resume, SeqError, StepEvent,
};
use tl_engine_core::model::{BYTE_VOCAB, FakeModel};
use tl_engine_core::pool::{KvPool, SharedKv};
use tl_engine_core::sampler::{Sampling, SamplingRequest};

const TEST: Shape = Shape::v1(4, 2, 1, 4);

fn engine() -> Engine {
    let model = Arc::new(FakeModel::new("fake", TEST, BYTE_VOCAB, 256));
    Engine::new(model, SharedKv::new(KvPool::new(TEST, 64)))
}

/// Lowercase letters, then a digit, in turns, `len` tokens in all; then nothing more.
#[derive(Clone, Debug)]
struct Turns {
    len: usize,
    taken: Vec<u32>,
}

impl Turns {
    fn boxed(len: usize) -> Box<dyn Constraint> {
        Box::new(Turns {
            len,
            taken: Vec::new(),
        })
    }

    fn allowed_at(i: usize) -> std::ops::RangeInclusive<u32> {
        if i.is_multiple_of(2) {
            u32::from(b'a')..=u32::from(b'z')
        } else {
            u32::from(b'0')..=u32::from(b'9')
        }
    }
}

impl Constraint for Turns {
    fn next(&mut self) -> Result<Next, ConstraintError> {
        if self.taken.len() == self.len {
            return Ok(Next::End);
        }
        let mut bits = vec![0u32; BYTE_VOCAB.div_ceil(32) as usize];
        for t in Self::allowed_at(self.taken.len()) {
            bits[t as usize / 32] |= 1 << (t % 32);
        }
        Ok(Next::Allowed {
            bits,
            may_end: false,
        })
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        if !Self::allowed_at(self.taken.len()).contains(&token) || self.taken.len() == self.len {
            return Err(ConstraintError(format!("token {token} not allowed")));
        }
        self.taken.push(token);
        Ok(())
    }

    fn fork(&self) -> Box<dyn Constraint> {
        Box::new(self.clone())
    }
}

/// Allows nothing at all.
#[derive(Debug)]
struct Nothing;

impl Constraint for Nothing {
    fn next(&mut self) -> Result<Next, ConstraintError> {
        Ok(Next::Allowed {
            bits: Vec::new(),
            may_end: false,
        })
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        Err(ConstraintError(format!("token {token}")))
    }

    fn fork(&self) -> Box<dyn Constraint> {
        Box::new(Nothing)
    }
}

fn sampling(t: f32) -> Sampling {
    Sampling::new(
        SamplingRequest {
            temperature: t,
            frequency_penalty: 0.5,
            ..SamplingRequest::default()
        },
        BYTE_VOCAB,
    )
    .unwrap()
}

fn req(prompt: &[u32], t: f32, n: u32, constraint: Box<dyn Constraint>) -> Request {
    Request {
        prompt: prompt.to_vec(),
        sampling: sampling(t),
        seed: 17,
        max_tokens: 30,
        mode: Mode::Generate,
        draws_offset: 0,
        earlier_output: 0,
        constraint: Some(constraint),
        stop: Default::default(),
        choices: Choices { n, logprobs: None },
        scope: 0,
    }
}

fn obeys(tokens: &[u32]) -> bool {
    tokens
        .iter()
        .enumerate()
        .all(|(i, t)| Turns::allowed_at(i).contains(t))
}

#[test]
fn the_output_obeys_the_mask_and_ends_where_the_constraint_does() {
    let prompt: Vec<u32> = (40..60).collect();
    for t in [0.0, 0.9] {
        let all = engine()
            .generate_choices(req(&prompt, t, 3, Turns::boxed(9)))
            .unwrap();
        for (i, g) in all.iter().enumerate() {
            assert_eq!(g.tokens.len(), 9, "t {t} choice {i}: {:?}", g.tokens);
            assert!(obeys(&g.tokens), "t {t} choice {i}: {:?}", g.tokens);
            assert_eq!(g.finish, Some(FinishReason::Stop));
        }
        // Unconstrained, the same request takes other tokens.
        let free = engine()
            .generate(Request {
                constraint: None,
                ..req(&prompt, t, 1, Turns::boxed(9))
            })
            .unwrap();
        assert!(!obeys(&free[..9]), "t {t}: {free:?}");
        if t > 0.0 {
            // Each choice samples with its own seed under its own copy.
            assert_ne!(all[0].tokens, all[1].tokens);
        }
    }
}

#[test]
fn a_resumed_sequence_replays_its_output_into_a_fresh_constraint() {
    let prompt: Vec<u32> = (40..60).collect();
    for t in [0.0f32, 0.9] {
        let whole = engine()
            .generate_choices(req(&prompt, t, 2, Turns::boxed(11)))
            .unwrap();
        // Prefill (choice 0's first token under the constraint), then resume with a fresh
        // constraint: the core feeds it the first token.
        let mut p = engine();
        let one = Request {
            mode: Mode::PrefillOnly,
            choices: Choices::ONE,
            ..req(&prompt, t, 1, Turns::boxed(11))
        };
        p.submit(one).unwrap();
        let out = p
            .step()
            .0
            .into_iter()
            .find_map(|e| match e {
                StepEvent::Prefilled { output, .. } => Some(output),
                _ => None,
            })
            .unwrap();
        // The same pool (the transfer is tested elsewhere); a fresh constraint.
        let mut d = p;
        let blocks = out.blocks;
        let r = req(&prompt, t, 2, Turns::boxed(11));
        let id = d
            .resume(Resume {
                prompt: prompt.clone(),
                blocks,
                first_token: out.first_token,
                draws: u64::from(out.draws),
                sampling: r.sampling,
                earlier_output: 0,
                constraint: r.constraint,
                seed: 17,
                max_tokens: 30,
                stop: Default::default(),
                choices: r.choices,
                scope: 0,
            })
            .unwrap();
        let mut got = vec![Vec::new(); 2];
        let mut open = 2;
        while open > 0 {
            for e in d.step().0 {
                match e {
                    StepEvent::Token {
                        seq, choice, token, ..
                    } if seq == id => got[choice as usize].push(token),
                    StepEvent::Finished { seq, .. } if seq == id => open -= 1,
                    StepEvent::Failed { error, .. } => panic!("{error}"),
                    _ => {}
                }
            }
        }
        for i in 0..2 {
            assert_eq!(got[i], whole[i].tokens, "t {t} choice {i}");
        }
        // After a failover: the prompt ends with 4 tokens of output, fed to a fresh
        // constraint; the rest equals the whole run's rest.
        let k = 4;
        let cont = engine()
            .generate(Request {
                prompt: [&prompt[..], &whole[0].tokens[..k]].concat(),
                earlier_output: k as u32,
                draws_offset: if t > 0.0 { k as u64 } else { 0 },
                ..req(&prompt, t, 1, Turns::boxed(11))
            })
            .unwrap();
        assert_eq!(cont, whole[0].tokens[k..], "t {t}");
    }
}

#[test]
fn a_constraint_that_allows_nothing_fails_the_request_and_frees_its_blocks() {
    let mut e = engine();
    let before = e.pool().lock().counts();
    let prompt: Vec<u32> = (40..60).collect();
    let got = e.generate(req(&prompt, 0.0, 1, Box::new(Nothing)));
    assert!(
        matches!(got, Err(GenerateError::Seq(SeqError::Constraint(_)))),
        "{got:?}"
    );
    // Its full prompt blocks stay cached; nothing is held.
    assert_eq!(e.pool().lock().counts().used, before.used);
    // Earlier output the constraint refuses is refused before any work.
    let bad = Request {
        prompt: [&prompt[..], &[b'7' as u32]].concat(),
        earlier_output: 1,
        ..req(&prompt, 0.0, 1, Turns::boxed(4))
    };
    assert!(matches!(
        e.submit(bad),
        Err(tl_engine_core::request::RequestError::Constraint(_))
    ));
}
