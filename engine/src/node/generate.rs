//! `EngineControl.Generate`: the decode leg, typed. A gateway sends the request it validated as a
//! [`GenerateRequest`]; the engine continues the handle a Prefill pushed here (or starts from the
//! prompt, colocated) and answers with its tokens as a stream of [`GenerateEvents`]. The engine
//! checks what it alone knows: its role, its drain, its room, its model, the handle's blocks
//! against the prompt, and the bounds of its own types (the core's one validation). The HTTP front
//! ([`super::front`]) is a client of the same [`Generator`].

use std::sync::Arc;

use futures_util::Stream;
use kvwire::prompt_hashes;
use kvwire_grpc::KvReceiver;
use kvwire_grpc::pb::engine::{
    Alternative, ChoiceFinished, Finish, GenerateEvents, GenerateRequest, GeneratedToken, StopRules,
};
use tl_engine_core::engine::{Choices, FinishReason, Mode, Request, Resume, StepEvent};
use tl_engine_core::logprobs::TokenLogprobs;
use tl_engine_core::pool::Blocks;
use tl_engine_core::request::{Limits, Params};
use tl_engine_core::rng::entropy_seed;
use tl_engine_core::stop::Stop;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

use super::runner::Heard;
use super::state::NodeState;
use super::wire::{request_status, sampling_request, seq_status};

/// The most stop rules a request may carry to an engine: the gateway's bounds on what a client
/// names (4 strings of 64 bytes, 64 token ids), with room for the checkpoint's EOS ids.
const MAX_STOP_SEQUENCES: usize = 4;
const MAX_STOP_SEQUENCE_BYTES: usize = 64;
const MAX_STOP_TOKEN_IDS: usize = 128;

/// Events of one request gathered into one message at most.
const EVENTS_PER_MESSAGE: usize = 256;

/// Starts requests on one decode engine.
#[derive(Debug)]
pub struct Generator {
    state: Arc<NodeState>,
    receiver: Arc<KvReceiver>,
    inflight: Arc<Semaphore>,
    aborted: CancellationToken,
}

/// A request that started: its seed, and its engine's events, counted in flight until dropped.
#[derive(Debug)]
pub struct Started {
    /// The seed choice 0 samples with.
    pub seed: u64,
    choices: u32,
    events: mpsc::UnboundedReceiver<Heard>,
    aborted: CancellationToken,
    _permit: OwnedSemaphorePermit,
}

impl Generator {
    /// Requests on `state`'s engine, resuming the handles `receiver` holds, at most
    /// `max_inflight` at once (RESOURCE_EXHAUSTED beyond). When `aborted` fires (the node stops
    /// as a killed process would), every stream ends at once.
    #[must_use]
    pub fn new(
        state: Arc<NodeState>,
        receiver: Arc<KvReceiver>,
        max_inflight: usize,
        aborted: CancellationToken,
    ) -> Self {
        Self {
            state,
            receiver,
            inflight: Arc::new(Semaphore::new(max_inflight.max(1))),
            aborted,
        }
    }

    /// Starts `req`: claims its handle when it resumes one.
    ///
    /// # Errors
    /// NOT_FOUND for another model or an unknown handle; UNAVAILABLE while draining (a resume
    /// is still taken); FAILED_PRECONDITION when the engine no longer decodes;
    /// RESOURCE_EXHAUSTED past `max_inflight`; INVALID_ARGUMENT for what the core's types
    /// refuse, a resume without its seed, or a handle holding another prompt's blocks.
    pub async fn start(&self, req: GenerateRequest) -> Result<Started, Status> {
        let runner = self.state.runner();
        let model = runner.model();
        if !req.model.is_empty() && req.model != model.name() {
            return Err(Status::not_found(format!(
                "model {:?} is not served here",
                req.model
            )));
        }
        // A draining engine takes no new request, but finishes the handles pushed before.
        if req.resume.is_none() {
            if self.state.is_draining() {
                return Err(Status::unavailable("this engine is draining"));
            }
            if !self.state.serving().decodes() {
                return Err(Status::failed_precondition(format!(
                    "worker {} serves as {} now and takes no new request here",
                    self.state.id(),
                    self.state.serving().name()
                )));
            }
        }
        let Ok(permit) = Arc::clone(&self.inflight).try_acquire_owned() else {
            return Err(Status::resource_exhausted(
                "too many requests in flight on this engine",
            ));
        };
        let sp = req.sampling.unwrap_or_default();
        let sampling = Params {
            prompt: &req.prompt_tokens,
            max_tokens: sp.max_tokens,
            sampling: sampling_request(&sp),
        }
        .validate(Limits::of(model.as_ref()))
        .map_err(|e| request_status(&e))?;
        let stop = stop_of(req.stop.unwrap_or_default(), runner.model().tokens())?;
        // Compiled before the handle is claimed: a refused spec leaves it in place.
        let constraint = self.state.constraint(sp.structured.as_ref()).await?;
        let choices = Choices {
            n: req.n.max(1),
            logprobs: req.logprobs,
        };
        let (seed, events) = match req.resume {
            None => {
                let seed = sp.seed.unwrap_or_else(entropy_seed);
                let (_, events) = runner.submit(Request {
                    prompt: req.prompt_tokens,
                    sampling,
                    seed,
                    max_tokens: sp.max_tokens,
                    mode: Mode::Generate,
                    draws_offset: 0,
                    stop,
                    choices,
                    scope: req.cache_scope,
                    earlier_output: sp.earlier_output,
                    constraint,
                });
                (seed, events)
            }
            Some(r) => {
                let Some(seed) = sp.seed else {
                    return Err(Status::invalid_argument(
                        "resuming needs the seed the prefill engine reported",
                    ));
                };
                let blocks = self.claim(&r.handle_id, &req.prompt_tokens)?;
                let (_, events) = runner.resume(Resume {
                    prompt: req.prompt_tokens,
                    blocks: Blocks::new(runner.pool().clone(), blocks.1),
                    first_token: r.first_token,
                    draws: u64::from(r.rng_draws_consumed),
                    sampling,
                    seed,
                    max_tokens: sp.max_tokens,
                    stop,
                    choices,
                    scope: blocks.0,
                    earlier_output: sp.earlier_output,
                    constraint,
                });
                (seed, events)
            }
        };
        Ok(Started {
            seed,
            choices: choices.n,
            events,
            aborted: self.aborted.clone(),
            _permit: permit,
        })
    }

    /// Claims `handle` for `prompt`: its scope and blocks.
    fn claim(&self, handle: &str, prompt: &[u32]) -> Result<(u64, Vec<u32>), Status> {
        let Some(view) = self.receiver.peek(handle) else {
            return Err(Status::not_found(format!(
                "unknown or already claimed KV handle {handle:?}"
            )));
        };
        let b = self.state.runner().model().shape().block_tokens() as usize;
        let mut expect = prompt_hashes(prompt, b);
        if !prompt.len().is_multiple_of(b) {
            expect.push(0);
        }
        // The hashes are only an index: when the chunks carried their tokens (every sender of
        // this project), the prompt is compared token by token, the tail's included.
        let same_tokens = view.prompt.as_deref().is_none_or(|p| p == prompt);
        if view.hashes != expect || view.tokens != prompt.len() as u64 || !same_tokens {
            // Not this prompt's blocks: the handle stays its owner's.
            return Err(Status::invalid_argument(format!(
                "KV handle {handle:?} holds {} tokens in other blocks than this prompt's {}",
                view.tokens,
                prompt.len()
            )));
        }
        let Some(claimed) = self.receiver.claim(handle) else {
            return Err(Status::not_found(format!(
                "KV handle {handle:?} was claimed meanwhile"
            )));
        };
        Ok((claimed.scope(), claimed.into_ids()))
    }
}

/// The core's stop rules from the wire's, within the engine's bounds.
fn stop_of(rules: StopRules, vocab: Arc<tl_engine_core::vocab::Vocab>) -> Result<Stop, Status> {
    if rules.sequences.len() > MAX_STOP_SEQUENCES
        || rules
            .sequences
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_SEQUENCE_BYTES)
    {
        return Err(Status::invalid_argument(format!(
            "at most {MAX_STOP_SEQUENCES} stop sequences of 1 to {MAX_STOP_SEQUENCE_BYTES} bytes"
        )));
    }
    if rules.token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(Status::invalid_argument(format!(
            "at most {MAX_STOP_TOKEN_IDS} stop token ids"
        )));
    }
    Ok(Stop {
        sequences: rules.sequences,
        token_ids: rules.token_ids,
        min_tokens: rules.min_tokens,
        vocab,
    })
}

impl Started {
    /// The request's events as the Generate stream sends them: the seed first, then the tokens
    /// and ends gathered since the last message; an in-band error ends it. An engine thread that
    /// stopped before every choice ended, or a node aborted, ends it with UNAVAILABLE (the caller
    /// fails over).
    /// Dropping the stream drops the events, which cancels what the engine has left of the
    /// request.
    pub fn into_stream(self) -> impl Stream<Item = Result<GenerateEvents, Status>> + Send {
        let first = GenerateEvents {
            seed: self.seed,
            ..GenerateEvents::default()
        };
        let state = (Some(first), self, 0u32, false);
        futures_util::stream::unfold(state, |(first, mut s, mut ended, over)| async move {
            if let Some(f) = first {
                return Some((Ok(f), (None, s, ended, false)));
            }
            if over {
                return None;
            }
            let mut msg = GenerateEvents::default();
            let next = tokio::select! {
                e = s.events.recv() => e,
                () = s.aborted.cancelled() => None,
            };
            let Some(e) = next else {
                let lost = Status::unavailable("the engine stopped");
                return Some((Err(lost), (None, s, ended, true)));
            };
            let mut next = Some(e);
            let mut taken = 0;
            while let Some(e) = next.take() {
                taken += 1;
                if add(&mut msg, e, &mut ended) {
                    return Some((Ok(msg), (None, s, ended, true)));
                }
                if taken < EVENTS_PER_MESSAGE {
                    next = s.events.try_recv().ok();
                }
            }
            let done = ended >= s.choices;
            Some((Ok(msg), (None, s, ended, done)))
        })
    }
}

/// Adds `e` to `msg`; true when it ends the stream (an error).
fn add(msg: &mut GenerateEvents, e: Heard, ended: &mut u32) -> bool {
    match e {
        Ok(StepEvent::Token {
            choice,
            token,
            logprobs,
            ..
        }) => msg.tokens.push(generated(choice, token, logprobs)),
        Ok(StepEvent::Finished { choice, reason, .. }) => {
            *ended += 1;
            msg.finished.push(ChoiceFinished {
                choice,
                finish: finish_of(reason) as i32,
            });
        }
        Err(e) => {
            let s = request_status(&e);
            msg.error_code = s.code() as i32;
            msg.error = s.message().to_owned();
            return true;
        }
        Ok(StepEvent::Failed { error: e, .. }) => {
            let s = seq_status(&e);
            msg.error_code = s.code() as i32;
            msg.error = s.message().to_owned();
            return true;
        }
        Ok(StepEvent::Prefilled { .. }) => {}
    }
    false
}

/// One token on the wire.
#[must_use]
pub fn generated(choice: u32, token: u32, logprobs: Option<TokenLogprobs>) -> GeneratedToken {
    let (logprob, top) = match logprobs {
        Some(l) => (
            Some(l.logprob),
            l.top
                .into_iter()
                .map(|(token, logprob)| Alternative { token, logprob })
                .collect(),
        ),
        None => (None, Vec::new()),
    };
    GeneratedToken {
        choice,
        token,
        logprob,
        top,
    }
}

/// A token's log-probabilities from the wire: `None` when none were sent.
#[must_use]
pub fn logprobs_of(t: &mut GeneratedToken) -> Option<TokenLogprobs> {
    t.logprob.map(|logprob| TokenLogprobs {
        token: t.token,
        logprob,
        top: std::mem::take(&mut t.top)
            .into_iter()
            .map(|a| (a.token, a.logprob))
            .collect(),
    })
}

/// The wire's finish reason.
#[must_use]
pub fn finish_of(r: FinishReason) -> Finish {
    match r {
        FinishReason::Length => Finish::Length,
        FinishReason::Stop => Finish::Stop,
        FinishReason::Context => Finish::Context,
    }
}

/// The core's finish reason from the wire's (an unknown one reads as the length reached).
#[must_use]
pub fn reason_of(f: i32) -> FinishReason {
    match Finish::try_from(f) {
        Ok(Finish::Stop) => FinishReason::Stop,
        Ok(Finish::Context) => FinishReason::Context,
        _ => FinishReason::Length,
    }
}

/// The in-band error of a message, as a status.
#[must_use]
pub fn error_of(msg: &GenerateEvents) -> Option<Status> {
    (msg.error_code != 0).then(|| Status::new(Code::from_i32(msg.error_code), msg.error.clone()))
}

/// A whole Generate answer, as a client that reads it to the end has it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    /// The seed choice 0 sampled with.
    pub seed: u64,
    /// Each choice's tokens.
    pub tokens: Vec<Vec<u32>>,
    /// Each choice's end, when it ended.
    pub finish: Vec<Option<FinishReason>>,
}

/// Reads `stream` to its end.
///
/// # Errors
/// The call's status, or the engine's in-band error.
pub async fn collect(mut stream: tonic::Streaming<GenerateEvents>) -> Result<Collected, Status> {
    let mut out = Collected::default();
    while let Some(msg) = stream.message().await? {
        if let Some(e) = error_of(&msg) {
            return Err(e);
        }
        // Only the first message carries the seed.
        if msg.seed != 0 {
            out.seed = msg.seed;
        }
        for t in msg.tokens {
            let c = t.choice as usize;
            if out.tokens.len() <= c {
                out.tokens.resize(c + 1, Vec::new());
                out.finish.resize(c + 1, None);
            }
            out.tokens[c].push(t.token);
        }
        for e in msg.finished {
            let c = e.choice as usize;
            if out.finish.len() <= c {
                out.tokens.resize(c + 1, Vec::new());
                out.finish.resize(c + 1, None);
            }
            out.finish[c] = Some(reason_of(e.finish));
        }
    }
    Ok(out)
}
