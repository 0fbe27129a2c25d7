//! The colocated engine: sequences with block tables over the shared pool, prefill that reuses
//! cached prefix blocks, and a step loop that decodes every running sequence together
//! (continuous batching). Pure logic: the servers drive [`Engine::step`] from their own tasks.
//!
//! A sequence's life: [`Engine::submit`] queues it; the next [`Engine::step`] prefills it (taking
//! references on the longest cached prefix, allocating the rest, registering each full block)
//! and samples its first token; later steps feed the last token and sample the next, allocating a
//! block whenever a position starts one and registering blocks as they fill; at `max_tokens`, on
//! cancel, or on an error, its references are released (full blocks stay cached for reuse).
//!
//! A prefill-only request ([`Mode::PrefillOnly`], the prefill role) stops after the first token
//! and hands its blocks out in [`StepEvent::Prefilled`]; [`Engine::resume`] starts a sequence from
//! such blocks (the decode role) with the generator resumed where the prefill left it.

use crate::cost::CostModel;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kvwire::{block_hash, prompt_hashes};

use crate::constraint::{Constraint, ConstraintError, Next, mask};
use crate::logprobs::{MAX_TOP_LOGPROBS, TokenLogprobs, token_logprobs};
use crate::model::{Model, ModelError};
use crate::pool::{BlockId, BlockKey, Blocks, KvPool, PoolError, SharedKv};
use crate::request::{Limits, RequestError, validate_prompt};
use crate::rng::{Pcg32, resume_rng};
use crate::sampler::{History, Sampling};
use crate::scheduler::Scheduler;
use crate::stop::Stop;

/// A sequence's id within one engine.
pub type SeqId = u64;

/// Most completions one request may ask for.
pub const MAX_CHOICES: u32 = 8;

/// How many completions of one prompt a request wants, and what each token reports.
///
/// Choice `i` samples with seed `seed + i` (wrapping) and otherwise exactly as a request of one
/// choice with that seed would (`spec/pcg32.md`), so each equals such a request's completion.
/// The choices share the prompt's full blocks by reference and copy only its partial tail
/// block: one prefill, or one transfer, serves all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choices {
    /// Completions, 1 to [`MAX_CHOICES`].
    pub n: u32,
    /// Report each token's log-probability and this many alternatives (at most
    /// [`MAX_TOP_LOGPROBS`]); `None` reports none.
    pub logprobs: Option<u32>,
}

impl Default for Choices {
    fn default() -> Self {
        Self::ONE
    }
}

impl Choices {
    /// One completion, no log-probabilities.
    pub const ONE: Choices = Choices {
        n: 1,
        logprobs: None,
    };

    /// Checks the bounds.
    ///
    /// # Errors
    /// [`RequestError::Choices`] or [`RequestError::TopLogprobs`].
    pub fn check(&self) -> Result<(), RequestError> {
        if !(1..=MAX_CHOICES).contains(&self.n) {
            return Err(RequestError::Choices {
                n: self.n,
                max: MAX_CHOICES,
            });
        }
        if let Some(k) = self.logprobs
            && k > MAX_TOP_LOGPROBS
        {
            return Err(RequestError::TopLogprobs {
                k,
                max: MAX_TOP_LOGPROBS,
            });
        }
        Ok(())
    }
}

/// Why a running sequence failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SeqError {
    /// No block for the next position.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The model refused a step.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The output's constraint failed, or allows no token here.
    #[error("structured output: {0}")]
    Constraint(#[from] ConstraintError),
}

/// A sequence started from blocks that already hold its prompt's KV (the decode side of a
/// transfer).
#[derive(Debug)]
pub struct Resume {
    /// The prompt the blocks hold.
    pub prompt: Vec<u32>,
    /// One reference on each block, in order.
    pub blocks: Blocks,
    /// The first token, sampled by the prefill engine.
    pub first_token: u32,
    /// Draws the prefill engine consumed.
    pub draws: u64,
    /// Validated sampling.
    pub sampling: Sampling,
    /// How many of the prompt's last tokens are earlier output (see [`Request`]).
    pub earlier_output: u32,
    /// What the output must match, fresh: the core feeds it the earlier output and the first
    /// token (see [`Request`]).
    pub constraint: Option<Box<dyn Constraint>>,
    /// The seed.
    pub seed: u64,
    /// Completion length, first token included.
    pub max_tokens: u32,
    /// When to end before `max_tokens` (the first token counts: it may already end a rule).
    pub stop: Stop,
    /// Completions and log-probabilities. Choice 0 continues from `first_token`; the others,
    /// and the first token's log-probabilities, come from recomputing the prompt's last step
    /// from `blocks` (the same logits the prefill engine sampled from).
    pub choices: Choices,
    /// The tenant scope the blocks were pushed in; the blocks it fills join it.
    pub scope: u64,
}

/// Run to completion, or stop after the first token and hand the blocks out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Generate `max_tokens` tokens here.
    Generate,
    /// Prefill, sample the first token, emit [`StepEvent::Prefilled`].
    PrefillOnly,
}

/// A generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Validated sampling parameters.
    pub sampling: Sampling,
    /// The generator seed.
    pub seed: u64,
    /// Tokens to generate, at least 1.
    pub max_tokens: u32,
    /// Whole generation or prefill only.
    pub mode: Mode,
    /// Draws of the seed's stream already consumed by earlier tokens of the same request (a
    /// request continued on another engine after a failover; 0 normally). The first token
    /// samples from `resume_rng(seed, draws_offset)`.
    pub draws_offset: u64,
    /// How many of the prompt's last tokens are this request's own earlier output (a request
    /// continued on another engine after a failover; 0 normally): the penalties count them as
    /// output, as the engine before did, and the constraint is fed them.
    pub earlier_output: u32,
    /// What the output must match (structured outputs), fresh: the core feeds it the earlier
    /// output. Every choice gets its own copy.
    pub constraint: Option<Box<dyn Constraint>>,
    /// When to end before `max_tokens`.
    pub stop: Stop,
    /// Completions and log-probabilities (one choice only for [`Mode::PrefillOnly`]).
    pub choices: Choices,
    /// The tenant scope its blocks are cached in and looked up in (0: shared).
    pub scope: u64,
}

/// Told, on the engine thread, as a prefill's blocks become final, so a transfer can stream
/// them while the prefill goes on (the push overlaps the compute).
pub trait PrefillProgress: Send + Sync + std::fmt::Debug {
    /// `blocks` is the prompt's whole block table; `blocks[..written]` now hold their final KV
    /// (cached prefix blocks at once, then each block as the model finishes it, the partial
    /// tail last). Called with `written` growing, while the sequence holds its references: an
    /// observer that keeps a block past this call takes a reference of its own.
    fn written(&self, blocks: &[BlockId], written: usize);
}

/// The result of a prefill-only request.
#[derive(Debug)]
pub struct PrefillOutput {
    /// The sampled first token.
    pub first_token: u32,
    /// One reference on each block of the prompt, in order (the partial tail last).
    pub blocks: Blocks,
    /// The chained hash of each full block of the prompt.
    pub hashes: Vec<u64>,
    /// Draws consumed once the first token is sampled: the request's `draws_offset` plus the
    /// first token's (0 greedy, 1 otherwise).
    pub draws: u32,
    /// The seed.
    pub seed: u64,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Blocks found in the prefix cache rather than computed.
    pub cached_blocks: usize,
    /// The prompt the blocks hold (a push carries it, block by block).
    pub prompt: Vec<u32>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// max_tokens reached.
    Length,
    /// The context is full.
    Context,
    /// A stop rule matched the completion's end.
    Stop,
}

/// What a step produced.
#[derive(Debug)]
pub enum StepEvent {
    /// A token of one choice; `index` 0 is the first token of its completion.
    Token {
        /// The request (the id `submit` or `resume` returned).
        seq: SeqId,
        /// The choice, 0 to n - 1.
        choice: u32,
        /// The token.
        token: u32,
        /// Its index in the completion.
        index: u32,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// One choice ended normally; its blocks are released. The request is over once each of
    /// its choices has finished.
    Finished {
        /// The request.
        seq: SeqId,
        /// The choice.
        choice: u32,
        /// Why.
        reason: FinishReason,
    },
    /// The request failed: every choice has ended and released its blocks.
    Failed {
        /// The request.
        seq: SeqId,
        /// Why.
        error: SeqError,
    },
    /// A prefill-only request is done.
    Prefilled {
        /// The sequence (no longer in the engine).
        seq: SeqId,
        /// Its first token and blocks.
        output: PrefillOutput,
    },
}

#[derive(Debug)]
struct Seq {
    /// The request's id (choice 0's own id); events and cancellation use it.
    group: SeqId,
    choice: u32,
    /// Choices still to fork from this one once its first token is known (n - 1 on choice 0).
    fanout: u32,
    /// Resumed, its first token not yet announced.
    announce: bool,
    logprobs: Option<u32>,
    /// Draws consumed before the first token (the request's offset).
    draws_base: u64,
    /// Prompt, then every sampled token (the last one not yet fed to the model).
    tokens: Vec<u32>,
    prompt_len: usize,
    blocks: Blocks,
    /// Chained hashes of the full blocks so far.
    hashes: Vec<u64>,
    /// Positions whose KV is in the pool.
    n_cached: usize,
    sampling: Sampling,
    /// Where its output starts in `tokens` (before `prompt_len` when the prompt ends with
    /// earlier output): the penalties read the tokens on either side.
    output_from: usize,
    /// What its output must match, fed every output token so far.
    constraint: Option<Box<dyn Constraint>>,
    /// The constraint as it stood before the first token, while other choices remain to fork.
    constraint_at_prompt: Option<Box<dyn Constraint>>,
    rng: Pcg32,
    draws: u64,
    seed: u64,
    max_tokens: u32,
    stop: Stop,
    mode: Mode,
    progress: Option<Arc<dyn PrefillProgress>>,
    scope: u64,
    /// Preempted: its blocks went back to the pool, and it waits to recompute the KV of its
    /// first `n_cached` positions (cached full blocks reused) before decoding on from its own
    /// generator, exactly where it stopped.
    recompute: bool,
}

/// A sequence's next token from `logits`, and the draws it took: under its constraint's mask
/// (the token then fed to it; a stop token, which ends the sequence, is not), with its sampling
/// and generator. `None`: the constraint ended the output.
fn pick(
    constraint: Option<&mut Box<dyn Constraint>>,
    sampling: &Sampling,
    history: History<'_>,
    stop_ids: &[u32],
    logits: &[f32],
    rng: &mut Pcg32,
) -> Result<Option<(u32, u32)>, SeqError> {
    let Some(c) = constraint else {
        return Ok(Some(sampling.sample(logits, history, rng)));
    };
    let next = c.next()?;
    let may_end = match &next {
        Next::End => return Ok(None),
        Next::Allowed { may_end, .. } => *may_end,
    };
    let masked = mask(logits, &next, stop_ids);
    if masked.iter().all(|&l| l == f32::NEG_INFINITY) {
        if may_end {
            return Ok(None);
        }
        return Err(
            ConstraintError("no token of the vocabulary continues the output".into()).into(),
        );
    }
    let (token, draws) = sampling.sample(&masked, history, rng);
    if !stop_ids.contains(&token) {
        c.commit(token)?;
    }
    Ok(Some((token, draws)))
}

/// A constraint that ends the output before its first token.
fn empty_output() -> SeqError {
    ConstraintError("the constraint allows only an empty output".into()).into()
}

/// A fresh constraint fed `output` (a sequence's output so far, replayed on the engine that
/// continues it).
fn replay(
    constraint: Option<Box<dyn Constraint>>,
    output: &[u32],
) -> Result<Option<Box<dyn Constraint>>, RequestError> {
    let Some(mut c) = constraint else {
        return Ok(None);
    };
    for &t in output {
        c.commit(t)
            .map_err(|e| RequestError::Constraint(e.to_string()))?;
    }
    Ok(Some(c))
}

/// Earlier output is part of the prompt: at most all of it.
fn check_earlier_output(earlier: u32, prompt: usize) -> Result<(), RequestError> {
    if earlier as usize > prompt {
        return Err(RequestError::EarlierOutput {
            earlier,
            len: prompt,
        });
    }
    Ok(())
}

/// A sequence's `tokens` as the penalties read them: its output starts at `output_from`.
fn history(tokens: &[u32], output_from: usize) -> History<'_> {
    let (prompt, output) = tokens.split_at(output_from.min(tokens.len()));
    History { prompt, output }
}

/// What every sequence of a request shares, and where its generator stands.
struct SeqRules {
    sampling: Sampling,
    /// Of the prompt's tokens, how many at its end are earlier output.
    earlier_output: usize,
    seed: u64,
    /// Draws of `seed`'s stream already consumed.
    draws: u64,
    max_tokens: u32,
    stop: Stop,
    logprobs: Option<u32>,
    scope: u64,
}

impl Seq {
    /// Choice 0 of request `group` over `tokens` (the first `prompt_len` its prompt), waiting to
    /// be prefilled; its generator `draws` draws into `seed`'s stream. The one place a sequence
    /// is made: a submitted, resumed or forked one changes only the fields that differ.
    fn new(group: SeqId, tokens: Vec<u32>, prompt_len: usize, blocks: Blocks, r: SeqRules) -> Self {
        Self {
            group,
            choice: 0,
            fanout: 0,
            announce: false,
            logprobs: r.logprobs,
            draws_base: r.draws,
            tokens,
            prompt_len,
            blocks,
            hashes: Vec::new(),
            n_cached: 0,
            sampling: r.sampling,
            output_from: prompt_len - r.earlier_output.min(prompt_len),
            constraint: None,
            constraint_at_prompt: None,
            rng: resume_rng(r.seed, r.draws),
            draws: r.draws,
            seed: r.seed,
            max_tokens: r.max_tokens,
            stop: r.stop,
            mode: Mode::Generate,
            progress: None,
            scope: r.scope,
            recompute: false,
        }
    }

    /// Gives its blocks back (full ones stay cached, so a resume may find them) and marks it to
    /// be recomputed: tokens, hashes and generator are kept.
    fn preempt(mut self) -> Self {
        let pool = self.blocks.pool().clone();
        drop(std::mem::replace(
            &mut self.blocks,
            Blocks::new(pool, Vec::new()),
        ));
        self.recompute = true;
        self
    }

    /// Prompt tokens a prefill of it computes at most: its prompt, or every position whose KV
    /// it had when preempted.
    fn fill_len(&self) -> usize {
        if self.recompute {
            self.n_cached
        } else {
            self.prompt_len
        }
    }

    fn generated(&self) -> u32 {
        (self.tokens.len() - self.prompt_len) as u32
    }
}

/// Figures of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Prompt tokens computed (not found cached).
    pub prefilled_tokens: usize,
    /// Sequences decoded.
    pub decoded: usize,
    /// Requests preempted (every choice's blocks given back) so the others could go on.
    pub preempted: usize,
    /// Preempted sequences whose KV was recomputed (their tokens count in `prefilled_tokens`).
    pub recomputed: usize,
}

/// The engine: a model, a pool, and its sequences.
#[derive(Debug)]
pub struct Engine {
    model: Arc<dyn Model>,
    pool: SharedKv,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    next_id: SeqId,
    cost: CostModel,
    scheduler: Scheduler,
    preemptions: u64,
    /// The prompt being prefilled chunk by chunk across steps (`max_step_tokens`), if any.
    partial: Option<Partial>,
}

/// A prompt whose prefill spans steps (chunked prefill): its blocks, all taken at its first
/// chunk, and how far its KV is written.
#[derive(Debug)]
struct Partial {
    seq: Seq,
    blocks: Blocks,
    hashes: Vec<u64>,
    /// Prompt tokens whose KV is in `blocks`.
    written: usize,
    /// Of those, the ones found cached (a prefix of whole blocks).
    reused: usize,
}

impl Engine {
    /// An engine over `pool`, whose shape must be the model's.
    ///
    /// # Panics
    /// If the pool's shape is not the model's.
    #[must_use]
    pub fn new(model: Arc<dyn Model>, pool: SharedKv) -> Self {
        assert_eq!(
            pool.lock().shape(),
            model.shape(),
            "pool and model shapes differ"
        );
        Self {
            model,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            cost: CostModel::default(),
            scheduler: Scheduler::default(),
            preemptions: 0,
            partial: None,
        }
    }

    /// Sets the simulated compute cost (see [`CostModel`]).
    pub fn set_cost(&mut self, cost: CostModel) {
        self.cost = cost;
    }

    /// Sets the admission policy (see [`Scheduler`]).
    pub fn set_scheduler(&mut self, scheduler: Scheduler) {
        self.scheduler = scheduler;
    }

    /// The simulated compute cost.
    #[must_use]
    pub fn cost(&self) -> CostModel {
        self.cost
    }

    /// The model.
    #[must_use]
    pub fn model(&self) -> &Arc<dyn Model> {
        &self.model
    }

    /// The pool.
    #[must_use]
    pub fn pool(&self) -> &SharedKv {
        &self.pool
    }

    /// Requests waiting for prefill.
    #[must_use]
    pub fn queue_depth(&self) -> usize {
        self.waiting.len() + usize::from(self.partial.is_some())
    }

    /// Sequences decoding.
    #[must_use]
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests preempted so far (see [`step`](Self::step)).
    #[must_use]
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// True when nothing waits or runs.
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.partial.is_none()
    }

    /// Checks a prompt against the model (the one validation of [`crate::request`]).
    ///
    /// # Errors
    /// The first problem found.
    pub fn validate_prompt(&self, prompt: &[u32]) -> Result<(), RequestError> {
        validate_prompt(prompt, Limits::of(self.model.as_ref()))
    }

    fn new_id(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Queues a request; it is prefilled by the next [`step`](Self::step).
    ///
    /// # Errors
    /// A [`RequestError`] before anything is queued or allocated.
    pub fn submit(&mut self, req: Request) -> Result<SeqId, RequestError> {
        self.submit_observed(req, None)
    }

    /// [`submit`](Self::submit), with `progress` told as the prefill's blocks are written.
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    pub fn submit_observed(
        &mut self,
        req: Request,
        progress: Option<Arc<dyn PrefillProgress>>,
    ) -> Result<SeqId, RequestError> {
        self.validate_prompt(&req.prompt)?;
        if req.max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        check_earlier_output(req.earlier_output, req.prompt.len())?;
        req.choices.check()?;
        if req.mode == Mode::PrefillOnly && req.choices != Choices::ONE {
            return Err(RequestError::PrefillChoices);
        }
        let prompt_len = req.prompt.len();
        let earlier = &req.prompt[prompt_len - req.earlier_output as usize..];
        let constraint = replay(req.constraint, earlier)?;
        let id = self.new_id();
        let rules = SeqRules {
            sampling: req.sampling,
            earlier_output: req.earlier_output as usize,
            seed: req.seed,
            draws: req.draws_offset,
            max_tokens: req.max_tokens,
            stop: req.stop,
            logprobs: req.choices.logprobs,
            scope: req.scope,
        };
        let blocks = Blocks::new(self.pool.clone(), Vec::new());
        self.waiting.push_back(Seq {
            fanout: req.choices.n - 1,
            mode: req.mode,
            progress,
            constraint,
            ..Seq::new(id, req.prompt, prompt_len, blocks, rules)
        });
        Ok(id)
    }

    /// Starts decoding from blocks that already hold the prompt's KV (imported from a prefill
    /// engine): `first_token` was sampled there after `draws` draws of the seed's stream. The
    /// first token counts as the completion's token 0; the next step samples token 1.
    ///
    /// # Errors
    /// A [`RequestError`] when the prompt is invalid or the blocks cannot hold it; the blocks are
    /// then released (the guard drops).
    pub fn resume(&mut self, r: Resume) -> Result<SeqId, RequestError> {
        let Resume {
            prompt,
            blocks,
            first_token,
            draws,
            sampling,
            earlier_output,
            constraint,
            seed,
            max_tokens,
            stop,
            choices,
            scope,
        } = r;
        self.validate_prompt(&prompt)?;
        if max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        check_earlier_output(earlier_output, prompt.len())?;
        choices.check()?;
        if first_token >= self.model.vocab() {
            return Err(RequestError::BadToken {
                token: first_token,
                pos: prompt.len(),
                vocab: self.model.vocab(),
            });
        }
        let b = self.model.shape().block_tokens();
        if blocks.len() != prompt.len().div_ceil(b as usize) {
            return Err(RequestError::BlocksDoNotFit {
                blocks: blocks.len(),
                len: prompt.len(),
                block_tokens: b,
            });
        }
        // The constraint as the engine before left it: fed the earlier output (for the other
        // choices, which fork from the prompt), then the first token.
        let earlier = &prompt[prompt.len() - earlier_output as usize..];
        let mut constraint = replay(constraint, earlier)?;
        let constraint_at_prompt = constraint
            .as_ref()
            .filter(|_| choices.n > 1)
            .map(|c| c.fork());
        if let Some(c) = constraint.as_mut()
            && !stop.token_ids.contains(&first_token)
        {
            c.commit(first_token)
                .map_err(|e| RequestError::Constraint(e.to_string()))?;
        }
        let id = self.new_id();
        let hashes = prompt_hashes(&prompt, b as usize);
        let prompt_len = prompt.len();
        let mut tokens = prompt;
        tokens.push(first_token);
        // Every token takes the same draws (spec/pcg32.md): the first took 0 or 1.
        let draws_base = draws.saturating_sub(u64::from(sampling.draws_per_token()));
        let rules = SeqRules {
            sampling,
            earlier_output: earlier_output as usize,
            seed,
            draws,
            max_tokens,
            stop,
            logprobs: choices.logprobs,
            scope,
        };
        self.running.push(Seq {
            fanout: choices.n - 1,
            announce: true,
            constraint,
            constraint_at_prompt,
            draws_base,
            hashes,
            n_cached: prompt_len,
            ..Seq::new(id, tokens, prompt_len, blocks, rules)
        });
        Ok(id)
    }

    /// Cancels a waiting or running request (every choice of it) and releases its blocks.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| s.group != id);
        self.running.retain(|s| s.group != id);
        // A prompt half prefilled: its blocks go back with it.
        let partial = self.partial.as_ref().is_some_and(|p| p.seq.group == id);
        if partial {
            self.partial = None;
        }
        partial || self.waiting.len() + self.running.len() < before
    }

    /// One step: decode every sequence that was running before it (a resumed request first
    /// announces its first token and forks its other choices), then prefill the waiting requests
    /// the [`Scheduler`] admits. Returns the events in order and the step's figures.
    ///
    /// A running sequence is never failed because the pool ran dry. When the step's new blocks
    /// outnumber the blocks an allocation could get, the youngest request gives every choice's
    /// blocks back and waits at the head of the queue (a step that preempts admits nothing).
    /// Later it recomputes its KV, reusing whatever of it is still cached, and decodes on from
    /// its own generator: its tokens are exactly those it would have produced. Only a request
    /// alone in the engine that still finds no block fails.
    ///
    /// `now` is the step's time, which the imports' calls for room are aged against (the core
    /// reads no clock itself).
    pub fn step_at(&mut self, now: std::time::Instant) -> (Vec<StepEvent>, StepStats) {
        let mut events = Vec::new();
        let mut stats = StepStats::default();
        self.decode_running(&mut events, &mut stats, now);
        if stats.preempted == 0 {
            self.prefill_waiting(&mut events, &mut stats, now);
        }
        (events, stats)
    }

    /// [`Self::step_at`] the wall clock's now: for a caller with no clock of its own (a test, a
    /// bench, `generate`).
    pub fn step(&mut self) -> (Vec<StepEvent>, StepStats) {
        self.step_at(std::time::Instant::now())
    }

    /// The step's decode: every sequence running before it, in one model pass; a request that
    /// finds no block pauses (counted in `stats.preempted`) at the head of the queue.
    fn decode_running(
        &mut self,
        events: &mut Vec<StepEvent>,
        stats: &mut StepStats,
        now: std::time::Instant,
    ) {
        let mut batch = Vec::with_capacity(self.running.len());
        for mut seq in std::mem::take(&mut self.running) {
            if !seq.announce {
                batch.push(seq);
                continue;
            }
            seq.announce = false;
            let group = seq.group;
            match self.open_resumed(seq, events) {
                Ok(choices) => batch.extend(choices),
                Err(error) => events.push(StepEvent::Failed { seq: group, error }),
            }
        }
        let mut preempted = self.make_room(&mut batch, now);
        let mut failed: Vec<SeqId> = Vec::new();
        let mut paused: Vec<SeqId> = preempted.iter().map(|s| s.group).collect();
        paused.dedup();
        // One request left holding blocks: when it finds no block, nothing else would free one.
        let alone = batch
            .iter()
            .all(|s| Some(s.group) == batch.first().map(|f| f.group));
        // Each sequence gets the block its next position needs; then one model pass decodes
        // them all (every weight read once per step), then each samples.
        let mut ready = Vec::with_capacity(batch.len());
        for mut seq in batch {
            if failed.contains(&seq.group) {
                // A sibling failed this step: the request is over.
                continue;
            }
            if paused.contains(&seq.group) {
                preempted.push(seq.preempt());
                continue;
            }
            // A resumed sequence may be complete before its first step (max_tokens 1).
            if let Some(reason) = self.finish_reason(&seq) {
                events.push(finished(&seq, reason));
                continue;
            }
            match self.reserve_block(&mut seq) {
                Ok(()) => ready.push(seq),
                // No block for its next position (another thread's import took the last
                // ones): nothing changed, so the request pauses instead of failing.
                Err(SeqError::Pool(PoolError::Exhausted { .. })) if !alone => {
                    paused.push(seq.group);
                    preempted.push(seq.preempt());
                }
                Err(error) => {
                    failed.push(seq.group);
                    events.push(StepEvent::Failed {
                        seq: seq.group,
                        error,
                    });
                }
            }
        }
        let (gone, ready): (Vec<Seq>, Vec<Seq>) = ready
            .into_iter()
            .partition(|s| paused.contains(&s.group) || failed.contains(&s.group));
        preempted.extend(
            gone.into_iter()
                .filter(|s| paused.contains(&s.group))
                .map(Seq::preempt),
        );
        let mut keep = Vec::with_capacity(ready.len());
        let inputs: Vec<(&[u32], &[BlockId])> = ready
            .iter()
            .map(|s| (&s.tokens[..=s.n_cached], s.blocks.ids()))
            .collect();
        match self.model.decode_batch(&self.pool, &inputs) {
            Ok(all) => {
                drop(inputs);
                for (mut seq, logits) in ready.into_iter().zip(all) {
                    stats.decoded += 1;
                    let (token, logprobs) = match self.finish_decode(&mut seq, &logits) {
                        Ok(Some(t)) => t,
                        // The constraint ended the output: a stop, with no further token.
                        Ok(None) => {
                            events.push(finished(&seq, FinishReason::Stop));
                            continue;
                        }
                        Err(error) => {
                            failed.push(seq.group);
                            events.push(StepEvent::Failed {
                                seq: seq.group,
                                error,
                            });
                            continue;
                        }
                    };
                    events.push(StepEvent::Token {
                        seq: seq.group,
                        choice: seq.choice,
                        token,
                        index: seq.generated() - 1,
                        logprobs,
                    });
                    match self.finish_reason(&seq) {
                        Some(reason) => events.push(finished(&seq, reason)),
                        None => keep.push(seq),
                    }
                }
            }
            Err(error) => {
                drop(inputs);
                // The pass failed for every sequence in it.
                for seq in &ready {
                    if !failed.contains(&seq.group) {
                        failed.push(seq.group);
                        events.push(StepEvent::Failed {
                            seq: seq.group,
                            error: SeqError::Model(error),
                        });
                    }
                }
            }
        }
        // Siblings that decoded before the failure, and now end with it; siblings that decoded
        // before their request paused, and now pause with it.
        keep.retain(|s| !failed.contains(&s.group));
        let (pause, keep): (Vec<Seq>, Vec<Seq>) =
            keep.into_iter().partition(|s| paused.contains(&s.group));
        preempted.extend(pause.into_iter().map(Seq::preempt));
        self.running = keep;
        stats.preempted = paused.len();
        self.preemptions += paused.len() as u64;
        // Oldest first at the head of the queue, ahead of every new request.
        preempted.sort_by_key(|s| (s.group, s.choice));
        for seq in preempted.into_iter().rev() {
            self.waiting.push_front(seq);
        }
    }

    /// The step's prefill: the waiting requests the [`Scheduler`] admits, within what the
    /// step's token budget leaves after its decodes.
    fn prefill_waiting(
        &mut self,
        events: &mut Vec<StepEvent>,
        stats: &mut StepStats,
        now: std::time::Instant,
    ) {
        // Chunked prefill: what the step's token budget leaves after its decodes (at least a
        // block, so a prompt always advances). Without a budget a prompt is prefilled whole.
        let b = self.model.shape().block_tokens() as usize;
        let mut left = self
            .scheduler
            .max_step_tokens
            .map(|t| t.saturating_sub(stats.decoded).max(b));
        if let Some(p) = self.partial.take() {
            self.advance(p, &mut left, stats, events);
            if self.partial.is_some() {
                // Still prefilling: first come, first served, nothing behind it goes ahead.
                return;
            }
        }
        let admitted = self.scheduler.admit(self.waiting.iter().map(Seq::fill_len));
        for _ in 0..admitted {
            if left == Some(0) {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if seq.recompute {
                match self.resume_preempted(&mut seq, now) {
                    Ok(Some(computed)) => {
                        stats.prefilled_tokens += computed;
                        stats.recomputed += 1;
                        if let Some(l) = &mut left {
                            *l = l.saturating_sub(computed);
                        }
                        self.running.push(seq);
                        continue;
                    }
                    // Not yet: it stays first in line, and nothing behind it goes ahead.
                    Ok(None) => {
                        self.waiting.push_front(seq);
                        break;
                    }
                    Err(error) => {
                        let group = seq.group;
                        self.waiting.retain(|s| s.group != group);
                        self.running.retain(|s| s.group != group);
                        events.push(StepEvent::Failed { seq: group, error });
                        continue;
                    }
                }
            }
            match self.fill_begin(&seq, seq.prompt_len) {
                Ok((blocks, hashes, reused)) => {
                    let p = Partial {
                        seq,
                        blocks,
                        hashes,
                        written: reused,
                        reused,
                    };
                    self.advance(p, &mut left, stats, events);
                    if self.partial.is_some() {
                        break;
                    }
                }
                Err(error) => events.push(StepEvent::Failed {
                    seq: seq.group,
                    error,
                }),
            }
        }
    }

    /// Whether `seq`'s next decode step starts a block.
    fn needs_block(&self, seq: &Seq) -> bool {
        let b = self.model.shape().block_tokens() as usize;
        self.finish_reason(seq).is_none() && seq.n_cached / b >= seq.blocks.len()
    }

    /// Preempts requests of `batch` until the blocks its step starts fit in what the pool can
    /// give, and until imports of other tenants waiting for room ([`SharedKv::press`]) have it;
    /// returns them, blocks given back. The victim is the youngest request of the tenant (cache
    /// scope) holding the most blocks: with one tenant, simply the youngest. A tenant's waiting
    /// import never preempts that tenant's own requests, and the step's growth never preempts
    /// the last request left.
    fn make_room(&self, batch: &mut Vec<Seq>, now: std::time::Instant) -> Vec<Seq> {
        let mut out = Vec::new();
        let pressed = self.pool.pressed(now);
        loop {
            let need = batch.iter().filter(|s| self.needs_block(s)).count();
            let available = self.pool.lock().available();
            let victim = if need > available {
                victim(batch, &[], 2)
            } else if pressed.free_wanted > 0 && need + pressed.free_wanted > available {
                victim(batch, &pressed.scopes, 1)
            } else {
                None
            };
            let Some(group) = victim else {
                return out;
            };
            let (gone, rest): (Vec<Seq>, Vec<Seq>) = std::mem::take(batch)
                .into_iter()
                .partition(|s| s.group == group);
            *batch = rest;
            out.extend(gone.into_iter().map(Seq::preempt));
        }
    }

    /// Recomputes a preempted sequence's KV when the pool can hold it with a block to spare
    /// for each running sequence; `Ok(None)` when it cannot yet (nothing taken). Returns the
    /// tokens computed. Alone in the engine it is tried whatever the margin, and fails if even
    /// that finds no room.
    fn resume_preempted(
        &mut self,
        seq: &mut Seq,
        now: std::time::Instant,
    ) -> Result<Option<usize>, SeqError> {
        let b = self.model.shape().block_tokens() as usize;
        let blocks = seq.n_cached.div_ceil(b);
        let alone = self.running.is_empty();
        // Room for it, a block for each running sequence, and what waiting imports asked for.
        let wanted = blocks + self.running.len() + self.pool.pressed(now).free_wanted;
        if !alone && self.pool.lock().available() < wanted {
            return Ok(None);
        }
        match self.fill(seq, seq.n_cached) {
            Ok((filled, hashes, computed)) => {
                debug_assert_eq!(hashes, seq.hashes[..hashes.len()]);
                seq.blocks = filled;
                seq.recompute = false;
                Ok(Some(computed))
            }
            Err(SeqError::Pool(PoolError::Exhausted { .. })) if !alone => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A resumed request's first step: the prompt's last step is recomputed from the
    /// transferred blocks when its logits are needed (other choices, log-probabilities).
    fn open_resumed(&self, seq: Seq, events: &mut Vec<StepEvent>) -> Result<Vec<Seq>, SeqError> {
        let logits = if seq.fanout > 0 || seq.logprobs.is_some() {
            Some(
                self.model
                    .logits(&self.pool, &seq.tokens[..seq.prompt_len], seq.blocks.ids())?,
            )
        } else {
            None
        };
        self.open_choices(seq, logits.as_deref(), events)
    }

    /// Announces the first token of choice 0 (sampled already) and forks the other choices from
    /// the same logits, each announcing its own first token. On an error every choice is
    /// dropped, releasing its blocks.
    fn open_choices(
        &self,
        mut first: Seq,
        logits: Option<&[f32]>,
        events: &mut Vec<StepEvent>,
    ) -> Result<Vec<Seq>, SeqError> {
        let fanout = std::mem::take(&mut first.fanout);
        let mut choices = Vec::with_capacity(fanout as usize + 1);
        events.push(first_token(&first, logits));
        choices.push(first);
        if fanout > 0 {
            let logits = logits.expect("logits are computed for every fork");
            for i in 1..=fanout {
                let child = self.fork(&choices[0], logits, i)?;
                events.push(first_token(&child, Some(logits)));
                choices.push(child);
            }
        }
        choices[0].constraint_at_prompt = None;
        Ok(choices)
    }

    /// Choice `choice` of `parent`'s request, its first token sampled from the prompt's `logits`
    /// with seed `parent.seed + choice`: references on the prompt's full blocks, a copy of its
    /// partial tail block.
    fn fork(&self, parent: &Seq, logits: &[f32], choice: u32) -> Result<Seq, SeqError> {
        let b = self.model.shape().block_tokens() as usize;
        let full = parent.prompt_len / b;
        let tail = (!parent.prompt_len.is_multiple_of(b)).then(|| parent.blocks.ids()[full]);
        let (ids, fill) = {
            let mut pool = self.pool.lock();
            let mut held = LockedRefs::new(&mut pool);
            for &id in &parent.blocks.ids()[..full] {
                held.pool.retain(id)?;
                held.ids.push(id);
            }
            let mut fill = 0;
            if let Some(src) = tail {
                fill = held.pool.info(src)?.1;
                let fresh = held.pool.allocate(1)?;
                held.ids.extend(fresh);
            }
            (held.commit(), fill)
        };
        let blocks = Blocks::new(self.pool.clone(), ids);
        if let Some(src) = tail {
            let dst = blocks.ids()[full];
            // Two blocks' own locks (the source is shared and no longer written); the pool's
            // lock only for the fill.
            self.pool.write(dst)?.copy_from_slice(&self.pool.read(src)?);
            self.pool.lock().set_fill(dst, fill)?;
        }
        let seed = parent.seed.wrapping_add(u64::from(choice));
        let mut rng = resume_rng(seed, parent.draws_base);
        let mut constraint = parent.constraint_at_prompt.as_ref().map(|c| c.fork());
        let (token, draws) = pick(
            constraint.as_mut(),
            &parent.sampling,
            history(&parent.tokens[..parent.prompt_len], parent.output_from),
            &parent.stop.token_ids,
            logits,
            &mut rng,
        )?
        .ok_or_else(empty_output)?;
        let mut tokens = parent.tokens[..parent.prompt_len].to_vec();
        tokens.push(token);
        let rules = SeqRules {
            sampling: parent.sampling.clone(),
            earlier_output: parent.prompt_len - parent.output_from,
            seed,
            draws: parent.draws_base + u64::from(draws),
            max_tokens: parent.max_tokens,
            stop: parent.stop.clone(),
            logprobs: parent.logprobs,
            scope: parent.scope,
        };
        Ok(Seq {
            choice,
            draws_base: parent.draws_base,
            hashes: parent.hashes.clone(),
            n_cached: parent.prompt_len,
            // The generator as the first token's sampling left it.
            rng,
            constraint,
            ..Seq::new(parent.group, tokens, parent.prompt_len, blocks, rules)
        })
    }

    /// The simulated time of a step with these figures.
    #[must_use]
    pub fn simulated_cost(&self, stats: StepStats) -> Duration {
        let fixed = if stats.decoded > 0 {
            self.cost.decode_per_step
        } else {
            Duration::ZERO
        };
        self.cost.prefill_per_token * stats.prefilled_tokens as u32
            + self.cost.decode_per_seq * stats.decoded as u32
            + fixed
    }

    fn finish_reason(&self, seq: &Seq) -> Option<FinishReason> {
        if seq.stop.matched(&seq.tokens[seq.prompt_len..]).is_some() {
            // At the step that matched: the sequence ends and its blocks go back now.
            Some(FinishReason::Stop)
        } else if seq.generated() >= seq.max_tokens {
            Some(FinishReason::Length)
        } else if seq.tokens.len() > self.model.max_context() as usize {
            // The next input would sit past the context.
            Some(FinishReason::Context)
        } else {
            None
        }
    }

    /// Writes the next chunk of `p`'s prompt, as much as `left` allows (all of it without a
    /// budget; whole blocks, at least one, with one); a prompt that is complete then samples
    /// its first token and starts decoding (or, prefill only, hands its blocks over). One that
    /// is not stays [`Engine::partial`] for the next step. A failure ends the request and gives
    /// its blocks back.
    fn advance(
        &mut self,
        mut p: Partial,
        left: &mut Option<usize>,
        stats: &mut StepStats,
        events: &mut Vec<StepEvent>,
    ) {
        let b = self.model.shape().block_tokens() as usize;
        let len = p.seq.prompt_len;
        let to = match *left {
            None => len,
            Some(l) => (p.written + (l / b).max(1) * b).min(len),
        };
        if let Err(error) = self.fill_range(&p.seq, &p.blocks, &p.hashes, len, p.written, to) {
            events.push(StepEvent::Failed {
                seq: p.seq.group,
                error,
            });
            return;
        }
        stats.prefilled_tokens += to - p.written;
        if let Some(l) = left {
            *l = l.saturating_sub(to - p.written);
        }
        p.written = to;
        if to < len {
            self.partial = Some(p);
            return;
        }
        self.prefilled(p, events);
    }

    /// A prompt whose KV is all written: its logits, its first token sampled (appended to
    /// `seq.tokens`), then its choices start decoding, or (prefill only) its blocks are handed
    /// over in a [`PrefillOutput`].
    fn prefilled(&mut self, p: Partial, events: &mut Vec<StepEvent>) {
        let Partial {
            mut seq,
            blocks,
            hashes,
            reused,
            ..
        } = p;
        // The logits pass reads the whole prompt's KV, one block's lock at a time.
        let logits =
            match self
                .model
                .logits(&self.pool, &seq.tokens[..seq.prompt_len], blocks.ids())
            {
                Ok(l) => l,
                Err(e) => {
                    events.push(StepEvent::Failed {
                        seq: seq.group,
                        error: SeqError::Model(e),
                    });
                    return;
                }
            };
        seq.blocks = blocks;
        seq.hashes = hashes;
        seq.n_cached = seq.prompt_len;
        if seq.fanout > 0 {
            seq.constraint_at_prompt = seq.constraint.as_ref().map(|c| c.fork());
        }
        let picked = pick(
            seq.constraint.as_mut(),
            &seq.sampling,
            history(&seq.tokens, seq.output_from),
            &seq.stop.token_ids,
            &logits,
            &mut seq.rng,
        )
        .and_then(|p| p.ok_or_else(empty_output));
        let (token, draws) = match picked {
            Ok(p) => p,
            Err(error) => {
                events.push(StepEvent::Failed {
                    seq: seq.group,
                    error,
                });
                return;
            }
        };
        seq.draws += u64::from(draws);
        seq.tokens.push(token);
        if seq.mode == Mode::PrefillOnly {
            let b = self.model.shape().block_tokens() as usize;
            let output = PrefillOutput {
                first_token: seq.tokens[seq.prompt_len],
                hashes: seq.hashes.clone(),
                draws: seq.draws as u32,
                seed: seq.seed,
                prompt_tokens: seq.prompt_len,
                cached_blocks: reused / b,
                prompt: seq.tokens[..seq.prompt_len].to_vec(),
                blocks: std::mem::replace(
                    &mut seq.blocks,
                    Blocks::new(self.pool.clone(), Vec::new()),
                ),
            };
            events.push(StepEvent::Prefilled {
                seq: seq.group,
                output,
            });
            return;
        }
        let group = seq.group;
        match self.open_choices(seq, Some(&logits), events) {
            Ok(choices) => {
                for seq in choices {
                    match self.finish_reason(&seq) {
                        Some(reason) => events.push(finished(&seq, reason)),
                        None => self.running.push(seq),
                    }
                }
            }
            Err(error) => events.push(StepEvent::Failed { seq: group, error }),
        }
    }

    /// Blocks holding the KV of `seq.tokens[..len]`: references on the longest cached prefix,
    /// the rest allocated and written by the model, each full block registered in `seq`'s
    /// scope as it is written (`seq.progress` told). Returns them, the full blocks' chained
    /// hashes, and the tokens computed. Nothing is kept on an error.
    fn fill(&self, seq: &Seq, len: usize) -> Result<(Blocks, Vec<u64>, usize), SeqError> {
        let (blocks, hashes, start) = self.fill_begin(seq, len)?;
        self.fill_range(seq, &blocks, &hashes, len, start, len)?;
        Ok((blocks, hashes, len - start))
    }

    /// The blocks of `seq.tokens[..len]`, all taken at once: references on the longest cached
    /// prefix, the rest allocated (all or nothing). Returns them, the full blocks' chained
    /// hashes, and the tokens found cached (whole blocks).
    fn fill_begin(&self, seq: &Seq, len: usize) -> Result<(Blocks, Vec<u64>, usize), SeqError> {
        let b = self.model.shape().block_tokens() as usize;
        let prompt = &seq.tokens[..len];
        let hashes = prompt_hashes(prompt, b);
        let n_blocks = prompt.len().div_ceil(b);
        // Under the lock: references on the cached prefix and the rest allocated, all or nothing.
        let (ids, reused) = {
            let mut pool = self.pool.lock();
            let mut held = LockedRefs::new(&mut pool);
            // The hash finds a candidate; its tokens and its parent decide (pool.rs).
            for (&hash, tokens) in hashes.iter().zip(prompt.chunks_exact(b)) {
                let key = BlockKey {
                    scope: seq.scope,
                    hash,
                    tokens,
                    parent: held.ids.last().copied(),
                };
                match held.pool.lookup_ref(key) {
                    Some(id) => held.ids.push(id),
                    None => break,
                }
            }
            let reused = held.ids.len();
            let fresh = held.pool.allocate(n_blocks - reused)?;
            held.ids.extend(fresh);
            (held.commit(), reused)
        };
        // From here the guard frees them on any error (it locks the pool itself, so it is
        // only ever dropped with the lock released).
        let blocks = Blocks::new(self.pool.clone(), ids);
        // The model writes block by block, each under that block's lock only: imports, lookups
        // and control calls on the same pool never wait for it.
        let start = reused * b;
        if let Some(p) = &seq.progress {
            p.written(blocks.ids(), reused);
        }
        Ok((blocks, hashes, start))
    }

    /// Writes the KV of `seq.tokens[from..to]` (of a prompt of `len` tokens; `from` at a block's
    /// start) into `blocks`, in chunks of the model's choosing, naming each full block as it
    /// is written and telling `seq.progress`.
    fn fill_range(
        &self,
        seq: &Seq,
        blocks: &Blocks,
        hashes: &[u64],
        len: usize,
        from: usize,
        to: usize,
    ) -> Result<(), SeqError> {
        let b = self.model.shape().block_tokens() as usize;
        let prompt = &seq.tokens[..len];
        let told = |written| {
            if let Some(p) = &seq.progress {
                p.written(blocks.ids(), written);
            }
        };
        // A chunk of the model's choosing (a block for the fake model; a few hundred tokens
        // for a transformer, whose matmuls want rows) is written in one pass; then its blocks
        // are named one by one.
        let chunk = b * self.model.prefill_chunk_blocks().max(1);
        for c in (from..to).step_by(chunk) {
            let end = (c + chunk).min(to);
            self.model
                .write(&self.pool, &prompt[c..end], c, blocks.ids())?;
            for at in (c..end).step_by(b) {
                let upto = (at + b).min(prompt.len());
                let i = at / b;
                // A full block is final once written: named now, so a push streaming it sends
                // the same envelope as one sent after the prefill. False when another sequence
                // registered the same block first: ours stays private.
                let mut pool = self.pool.lock();
                match hashes.get(i) {
                    Some(&hash) => {
                        let key = BlockKey {
                            scope: seq.scope,
                            hash,
                            tokens: &prompt[at..upto],
                            parent: i.checked_sub(1).map(|p| blocks.ids()[p]),
                        };
                        pool.register(blocks.ids()[i], key);
                    }
                    // The tail's tokens, so a claim of these blocks can compare every token.
                    None => {
                        pool.set_tokens(blocks.ids()[i], &prompt[at..upto]);
                    }
                }
                drop(pool);
                told(i + 1);
            }
        }
        Ok(())
    }

    /// The block `seq`'s next position needs, when it starts one (the pool's lock, briefly).
    /// Nothing changes on an error.
    fn reserve_block(&mut self, seq: &mut Seq) -> Result<(), SeqError> {
        let b = self.model.shape().block_tokens() as usize;
        if seq.n_cached / b >= seq.blocks.len() {
            let id = self.pool.lock().allocate(1)?[0];
            seq.blocks.push(id);
        }
        Ok(())
    }

    /// After the model wrote `seq`'s last token's KV and gave `logits` for the next: registers
    /// the block it filled, samples the next token; returns it and, when asked for, its
    /// log-probabilities.
    fn finish_decode(
        &mut self,
        seq: &mut Seq,
        logits: &[f32],
    ) -> Result<Option<(u32, Option<TokenLogprobs>)>, SeqError> {
        let b = self.model.shape().block_tokens() as usize;
        seq.n_cached += 1;
        if seq.n_cached.is_multiple_of(b) {
            let i = seq.n_cached / b - 1;
            let parent = if i == 0 { 0 } else { seq.hashes[i - 1] };
            let tokens = &seq.tokens[i * b..(i + 1) * b];
            let h = block_hash(parent, tokens);
            let key = BlockKey {
                scope: seq.scope,
                hash: h,
                tokens,
                parent: i.checked_sub(1).map(|p| seq.blocks.ids()[p]),
            };
            self.pool.lock().register(seq.blocks.ids()[i], key);
            seq.hashes.push(h);
        }
        let Some((token, draws)) = pick(
            seq.constraint.as_mut(),
            &seq.sampling,
            history(&seq.tokens, seq.output_from),
            &seq.stop.token_ids,
            logits,
            &mut seq.rng,
        )?
        else {
            return Ok(None);
        };
        seq.draws += u64::from(draws);
        seq.tokens.push(token);
        let logprobs = seq
            .logprobs
            .map(|k| token_logprobs(logits, token, k as usize));
        Ok(Some((token, logprobs)))
    }

    /// Runs one request to completion by itself (no other sequence is stepped differently) and
    /// returns its completion (choice 0's). For the CLI and tests.
    ///
    /// # Errors
    /// The request's refusal or the sequence's failure.
    pub fn generate(&mut self, req: Request) -> Result<Vec<u32>, GenerateError> {
        let mut all = self.generate_choices(req)?;
        Ok(all.swap_remove(0).tokens)
    }

    /// As [`generate`](Self::generate), returning every choice, in order, with its
    /// log-probabilities (when asked for) and why it ended.
    ///
    /// # Errors
    /// The request's refusal or the sequence's failure.
    pub fn generate_choices(&mut self, req: Request) -> Result<Vec<Generated>, GenerateError> {
        let n = req.choices.n;
        let id = self.submit(Request {
            mode: Mode::Generate,
            ..req
        })?;
        self.collect(id, n)
    }

    /// Like [`generate`](Self::generate) for a request already started with
    /// [`resume`](Self::resume) (one choice): steps until it ends and returns the tokens it
    /// sampled after the first.
    ///
    /// # Errors
    /// The sequence's failure.
    pub fn run_to_end(&mut self, id: SeqId) -> Result<Vec<u32>, GenerateError> {
        if !self.running.iter().any(|s| s.group == id) {
            return Ok(Vec::new());
        }
        let mut tokens = self.collect(id, 1)?.swap_remove(0).tokens;
        tokens.remove(0);
        Ok(tokens)
    }

    /// Steps until each of request `id`'s `n` choices has ended; returns them.
    fn collect(&mut self, id: SeqId, n: u32) -> Result<Vec<Generated>, GenerateError> {
        let mut out = vec![Generated::default(); n as usize];
        let mut open = n;
        while open > 0 {
            let (events, _) = self.step();
            for e in events {
                match e {
                    StepEvent::Token {
                        seq,
                        choice,
                        token,
                        logprobs,
                        ..
                    } if seq == id => {
                        let g = &mut out[choice as usize];
                        g.tokens.push(token);
                        g.logprobs.extend(logprobs);
                    }
                    StepEvent::Finished {
                        seq,
                        choice,
                        reason,
                    } if seq == id => {
                        out[choice as usize].finish = Some(reason);
                        open -= 1;
                    }
                    StepEvent::Failed { seq, error } if seq == id => return Err(error.into()),
                    _ => {}
                }
            }
        }
        Ok(out)
    }
}

/// The request to preempt from `batch`: the youngest of the scope holding the most blocks,
/// never of a scope in `spare`, and only while at least `keep_groups` requests run.
fn victim(batch: &[Seq], spare: &[u64], keep_groups: usize) -> Option<SeqId> {
    let mut groups: Vec<SeqId> = batch.iter().map(|s| s.group).collect();
    groups.sort_unstable();
    groups.dedup();
    if groups.len() < keep_groups {
        return None;
    }
    let mut held: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for s in batch.iter().filter(|s| !spare.contains(&s.scope)) {
        *held.entry(s.scope).or_default() += s.blocks.len();
    }
    // Most blocks first; equal holdings go to the lower scope, so the choice is reproducible.
    let (&scope, _) = held.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
    batch
        .iter()
        .filter(|s| s.scope == scope)
        .map(|s| s.group)
        .max()
}

/// One choice of a request run to its end.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generated {
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// Each token's log-probabilities (empty unless asked for).
    pub logprobs: Vec<TokenLogprobs>,
    /// Why it ended.
    pub finish: Option<FinishReason>,
}

/// The event of `seq` ending.
fn finished(seq: &Seq, reason: FinishReason) -> StepEvent {
    StepEvent::Finished {
        seq: seq.group,
        choice: seq.choice,
        reason,
    }
}

/// The event announcing `seq`'s first token, with its log-probabilities under `logits` when
/// asked for.
fn first_token(seq: &Seq, logits: Option<&[f32]>) -> StepEvent {
    let token = seq.tokens[seq.prompt_len];
    StepEvent::Token {
        seq: seq.group,
        choice: seq.choice,
        token,
        index: 0,
        logprobs: seq
            .logprobs
            .zip(logits)
            .map(|(k, l)| token_logprobs(l, token, k as usize)),
    }
}

/// A request refused or a sequence failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GenerateError {
    /// Refused before any work.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// Failed while running.
    #[error(transparent)]
    Seq(#[from] SeqError),
}

/// References taken while the pool is locked, released (inside the same lock) unless committed:
/// the in-lock twin of [`Blocks`], whose drop takes the lock itself.
struct LockedRefs<'p> {
    pool: &'p mut KvPool,
    ids: Vec<BlockId>,
}

impl<'p> LockedRefs<'p> {
    fn new(pool: &'p mut KvPool) -> Self {
        Self {
            pool,
            ids: Vec::new(),
        }
    }

    fn commit(mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.ids)
    }
}

impl Drop for LockedRefs<'_> {
    fn drop(&mut self) {
        for &id in &self.ids {
            // Plain release: reused prefix blocks go back to the cache, fresh ones (not yet
            // registered) to the free list.
            let res = self.pool.release(id);
            debug_assert!(res.is_ok(), "held block {id}: {res:?}");
        }
    }
}
