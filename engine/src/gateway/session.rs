//! One request's life in the gateway as a state machine with no I/O: [`Session`] takes
//! [`SessionEvent`]s (the planner answered, a Prefill returned or failed, a chunk of a decode stream,
//! a stream lost or silent, the client gone, the gateway draining) and returns [`Action`]s
//! (plan, prefill, resume, emit to the client, release a handle, cancel a Prefill, close a
//! stream, finish). [`super::request`] performs the actions and feeds back what they bring; every
//! decision is here, so failover, retry and give-up are table tests with no servers
//! (`session_cases`).
//!
//! The invariants it owns:
//! - **Tokens sent.** Each choice keeps every token the client has; nothing is sent twice and
//!   nothing after a choice's end.
//! - **The first token.** A Prefill's handle carries the first token; without log-probabilities
//!   it goes to the client at once and the decode stream's copy of it is skipped
//!   ([`Choice::skip`]). With log-probabilities every token comes from a decode stream, which
//!   computes them.
//! - **The generator.** Choice `i` samples with `seed + i`; a continuation on another engine
//!   starts past the draws its tokens used: `draws_per_token x tokens sent`, where every token
//!   uses the same number (0 greedy, 1 sampled; `spec/pcg32.md`), read from the first handle.
//! - **Stop rules across engines.** Every token is checked against the stop rules over all the
//!   choice's tokens, so a stop string that straddles a failover ends the choice.
//! - **Failover.** A lost decode stream's unfinished choices continue at once, each as a lane of
//!   its own with its own Prefill ids, each at most `max_failovers` times.
//!
//! A *lane* is one engine's stream and the choices it serves: lane 0 serves every choice until
//! its engine is lost; a failover lane serves one choice.

use super::worker::WorkerId;
use std::time::Duration;

use kvwire_grpc::pb::control::WorkerStatus;
use std::collections::HashMap;

use kvwire_grpc::pb::engine::{
    DecodeHolds, GenerateEvents, GenerateRequest, KvHandle, PrefillRequest, Resume, SamplingParams,
};
use tonic::Code;

use super::plan::{FALLBACK_REASON, Plan, Ranked};
use crate::api::render::ChoiceEvent;
use crate::api::{ApiError, ErrorDetail, ErrorKind, Finish, GenerationParams, RouteInfo};
use crate::node::generate::{error_of, logprobs_of, reason_of};
use tl_engine_core::engine::Choices;
use tl_engine_core::logprobs::TokenLogprobs;
use tl_engine_core::stop::Stop;

/// A request that passed validation.
#[derive(Clone, Debug)]
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Its parameters, valid.
    pub params: GenerationParams,
    /// Its stop rules, valid.
    pub stop: Stop,
    /// Its choices and log-probabilities, valid.
    pub choices: Choices,
    /// The tenant cache scope its blocks live in (see `super::tenant`).
    pub scope: u64,
    /// What its output must match, compiled once to check it.
    pub structured: Option<crate::structured::Spec>,
    /// The answer is read as tool calls of this mode.
    pub tools: Option<crate::api::tools::ToolMode>,
}

impl Job {
    /// Log-probabilities asked for: then every token, the first included, comes from a decode
    /// engine's stream (which computes them), never from a Prefill's handle.
    fn wants_logprobs(&self) -> bool {
        self.choices.logprobs.is_some()
    }
}

/// What the request tells the HTTP handler.
#[derive(Debug, PartialEq)]
pub enum Out {
    /// Routing done: an engine is producing the answer (its choices' events follow).
    Start {
        /// The seed used (choice i samples with seed + i).
        seed: u64,
        /// The model that answers.
        model: String,
        /// Where it went.
        route: RouteInfo,
    },
    /// A token or the end of a choice, or the request's failure: before the start, a
    /// [`ChoiceEvent::Failed`] is the whole answer.
    Choice(ChoiceEvent),
}

/// The retry policy of one request: how far it tries before it gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Decode engines one Prefill is tried against, best ranked first, before the request falls
    /// back to a colocated engine (`[gateway] prefill_decode_attempts`).
    pub decode_attempts: usize,
    /// How many times one choice may continue on another decode engine (`max_failovers`).
    pub max_failovers: u32,
    /// Silence on a decode stream (or its opening) that counts as a lost engine
    /// (`stall_timeout_ms`).
    pub stall: Duration,
    /// Silence on a colocated stream that ends it: nothing else holds its state, so the whole
    /// request's timeout (`request_timeout_ms`).
    pub colocated_quiet: Duration,
    /// After a Prefill was cancelled (the client left, the request ended): how long to wait for
    /// a handle that still arrives, to release it rather than leave it to its lease
    /// (`cancel_release_wait_ms`).
    pub release_wait: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            decode_attempts: 2,
            max_failovers: 2,
            stall: Duration::from_secs(3),
            colocated_quiet: Duration::from_secs(30),
            release_wait: Duration::from_secs(5),
        }
    }
}

/// A lane: one engine's stream and the choices it serves.
pub type LaneId = usize;

pub use crate::telemetry::metrics::LossCause;

/// Why a Prefill did not return a handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefillFailure {
    /// The prefill engine's address could not be used.
    Unreachable,
    /// The call took longer than `prefill_timeout_ms`.
    TimedOut,
    /// The call failed with this status.
    Status {
        /// Its code.
        code: Code,
        /// Its message.
        message: String,
    },
}

/// Why the planner found nothing to plan over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unservable {
    /// No live engine serves the model the request names.
    UnknownModel(String),
    /// Live engines exist, but none serves the model this gateway tokenizes for: the message
    /// names both fingerprints.
    OtherModel(String),
}

/// The decode engines' HasBlocks answers, by worker id.
pub type FleetHolds = HashMap<WorkerId, DecodeHolds>;

/// The planner's answer: the plan, and the HasBlocks answer of each decode engine that gave
/// one (handed to the Prefill that pushes there).
pub type Planned = Result<(Plan, FleetHolds), Unservable>;

/// What happened, as the driver saw it.
#[derive(Debug)]
pub enum SessionEvent {
    /// The planner's answer to [`Action::Plan`].
    Planned {
        /// The lane.
        lane: LaneId,
        /// The plan, over the live workers less those excluded, and the HasBlocks answer of
        /// each decode engine that gave one (handed to the Prefill that pushes there).
        plan: Box<Planned>,
    },
    /// The Prefill of [`Action::Prefill`] returned its handle.
    Prefilled {
        /// The lane.
        lane: LaneId,
        /// The handle, held by the Prefill's decode engine.
        handle: KvHandle,
    },
    /// The Prefill of [`Action::Prefill`] failed.
    PrefillFailed {
        /// The lane.
        lane: LaneId,
        /// How.
        failure: PrefillFailure,
    },
    /// The stream of [`Action::Resume`] opened: the decode engine claimed the handle.
    Opened {
        /// The lane.
        lane: LaneId,
    },
    /// A colocated stream ([`Action::Colocated`]) could not be opened.
    OpenFailed {
        /// The lane.
        lane: LaneId,
        /// The status the engine (or the channel to it) answered.
        code: Code,
        /// What went wrong.
        message: String,
    },
    /// A message of the lane's Generate stream: tokens, choices that ended, or the engine's
    /// own error.
    Generated {
        /// The lane.
        lane: LaneId,
        /// The message, its choices numbered as the lane's engine numbers them.
        events: Box<GenerateEvents>,
    },
    /// The lane's stream broke, ended early, was refused, or was silent too long.
    StreamLost {
        /// The lane.
        lane: LaneId,
        /// Why.
        cause: LossCause,
    },
    /// The lane has a place again after [`Action::Wait`]: plan it.
    Placed {
        /// The lane.
        lane: LaneId,
    },
    /// The lane got no place after [`Action::Wait`] (the queue was full or its deadline passed).
    Unplaced {
        /// The lane.
        lane: LaneId,
        /// The answer for the client (429 with `Retry-After`).
        error: ApiError,
    },
    /// The client went away.
    ClientGone,
    /// The gateway is draining and its deadline passed: end what is left.
    Drain,
}

/// What the driver is to do.
#[derive(Debug, PartialEq)]
pub enum Action {
    /// Plan `prompt` over the live workers less `exclude` (lost engines), asking HasBlocks;
    /// answer with [`SessionEvent::Planned`]. `model` on the request's first plan only: the model
    /// asked for ("" when none), which a live worker must serve; while the gateway is young the
    /// first plan waits for engines to register.
    Plan {
        /// The lane.
        lane: LaneId,
        /// The prompt (with the choice's tokens sent, after a failover).
        prompt: Vec<u32>,
        /// Workers not to use.
        exclude: Vec<String>,
        /// The model, on the first plan.
        model: Option<String>,
    },
    /// The fleet refused the lane for load (every decode engine's pool full or busy, the prefill
    /// engine's deadline missed while it lives): give its place back, wait in the gateway's
    /// queue at its old turn, at least `pause`, for a place again; answer with
    /// [`SessionEvent::Placed`] or [`SessionEvent::Unplaced`].
    Wait {
        /// The lane.
        lane: LaneId,
        /// The least wait before the next try.
        pause: Duration,
    },
    /// Count a routing decision (`tl_route_decisions_total{reason}`).
    Routed {
        /// Why it went where it did.
        reason: crate::telemetry::metrics::RouteReason,
    },
    /// Call Prefill on `prefill`, pushing to `decode`; answer with [`SessionEvent::Prefilled`] or
    /// [`SessionEvent::PrefillFailed`]. The request counts on `decode` from here until the lane closes.
    Prefill {
        /// The lane.
        lane: LaneId,
        /// The prefill engine.
        prefill: WorkerStatus,
        /// The decode engine it pushes to.
        decode: WorkerStatus,
        /// The call.
        request: PrefillRequest,
    },
    /// Resume the lane's handle on its decode engine (Generate, the handle in
    /// `request.resume`) and relay the stream; answer with [`SessionEvent::Opened`], then its
    /// messages, or [`SessionEvent::StreamLost`] (also when opening takes longer than `quiet`,
    /// or nothing arrives for that long).
    Resume {
        /// The lane.
        lane: LaneId,
        /// The decode engine.
        decode: WorkerStatus,
        /// The resumed request.
        request: GenerateRequest,
        /// The stall timeout.
        quiet: Duration,
    },
    /// Open a colocated Generate stream on `target` and relay it; answer with its messages,
    /// [`SessionEvent::OpenFailed`] or [`SessionEvent::StreamLost`].
    Colocated {
        /// The lane.
        lane: LaneId,
        /// The `both` engine.
        target: WorkerStatus,
        /// The request.
        request: GenerateRequest,
        /// Silence that ends the stream.
        quiet: Duration,
    },
    /// Send this to the client; a client that has gone comes back as [`SessionEvent::ClientGone`].
    Emit(Out),
    /// Release the lane's unclaimed handle: now (`wait`) or in the background (a partitioned
    /// engine must not hold up a failover).
    Release {
        /// The lane.
        lane: LaneId,
        /// Wait for the release.
        wait: bool,
    },
    /// Cancel the lane's Prefill on its prefill engine. Its answer still comes back as an
    /// event (a handle that arrives is then released), within the policy's `release_wait`.
    Cancel {
        /// The lane.
        lane: LaneId,
        /// The prefill engine.
        prefill: WorkerStatus,
        /// The Prefill's request id.
        request_id: String,
    },
    /// Stop relaying the lane's stream and stop counting it on its engine (dropping the
    /// stream cancels what the engine has left of it).
    Close {
        /// The lane.
        lane: LaneId,
    },
    /// A decode engine was lost (logged).
    Lost {
        /// The lane.
        lane: LaneId,
        /// The engine.
        worker: String,
        /// Why.
        cause: LossCause,
        /// Tokens of the lane's first choice the client had then.
        tokens_sent: usize,
    },
    /// Count a failover (`tl_failovers_total{cause,outcome}`).
    Failover {
        /// The loss it answers.
        cause: LossCause,
        /// Resumed elsewhere (`resumed`), or given up (`gave_up`).
        resumed: bool,
    },
    /// The response is complete: nothing more is emitted.
    Finish,
}

/// One choice as the client has it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Choice {
    /// Every token the client has, in order.
    sent: Vec<u32>,
    /// Finished (its end sent).
    done: bool,
    /// The engine's next token for it is one the client already has (a Prefill's first token,
    /// announced before the decode stream opened).
    skip: bool,
    /// Leading tokens of `sent` that the lane's current handle holds in its prompt.
    held: usize,
}

#[derive(Debug)]
enum Phase {
    /// Waiting for the planner.
    Planning,
    /// A Prefill is out.
    Prefilling(Box<Prefilling>),
    /// The Prefill was cancelled; its answer is awaited to release a handle that arrives.
    Cancelled,
    /// A handle is held by `decode` and not yet claimed: the resume is out.
    Resuming { decode: WorkerStatus },
    /// The lane's stream is relayed (a resume claimed its handle, or colocated).
    Streaming {
        worker: String,
        colocated: bool,
        /// A colocated stream starts the answer with its first message (the seed), answered
        /// by this model.
        start: Option<(RouteInfo, String)>,
    },
    /// Nothing more.
    Over,
}

/// A lane's Prefill in flight, to `decode[next]`.
#[derive(Debug)]
struct Prefilling {
    prefill: WorkerStatus,
    /// Another prefill engine, tried once if this one is unreachable or misses the deadline.
    spare: Option<WorkerStatus>,
    decode: Vec<Ranked>,
    next: usize,
    /// Decode engines that refused the push so far.
    retries: u32,
    /// Lane 0's colocated fallback, when every decode engine tried refuses.
    fallback: Option<WorkerStatus>,
    request_id: String,
    /// The decode engines' HasBlocks answers, by worker id.
    holds: HashMap<WorkerId, DecodeHolds>,
}

#[derive(Debug)]
struct Lane {
    /// The choices it serves: the engine's choice `i` is `choices[i]`.
    choices: Vec<u32>,
    phase: Phase,
    /// Prefill ids are `<id>-<n>`.
    id: String,
    /// Prefills sent (the next one's `n`).
    attempts: u32,
    /// Failovers of this lane's choice so far.
    failovers: u32,
    /// Decode engines this lane's choices lost.
    lost: Vec<String>,
    /// Why it last lost an engine (after a failover).
    cause: Option<LossCause>,
}

/// One request's state.
#[derive(Debug)]
pub struct Session {
    job: Job,
    policy: RetryPolicy,
    choices: Vec<Choice>,
    lanes: Vec<Lane>,
    /// The seed the first Prefill reported (choice i samples with seed + i).
    seed: u64,
    /// Draws one token consumes, from the first handle.
    draws_per_token: u32,
    /// The answer has started (the client got [`Out::Start`]).
    started: bool,
    /// The client has gone: nothing more is emitted.
    gone: bool,
    /// [`Action::Finish`] was returned.
    finished: bool,
    /// Times the request went back to the queue, refused for load.
    waits: u32,
}

impl Session {
    /// A session for `job`, its Prefills named after `id`.
    #[must_use]
    pub fn new(job: Job, id: String, policy: RetryPolicy) -> Self {
        let n = job.choices.n.max(1);
        Self {
            choices: vec![Choice::default(); n as usize],
            lanes: vec![Lane {
                choices: (0..n).collect(),
                phase: Phase::Planning,
                id,
                attempts: 0,
                failovers: 0,
                lost: Vec::new(),
                cause: None,
            }],
            job,
            policy,
            seed: 0,
            draws_per_token: 0,
            started: false,
            gone: false,
            finished: false,
            waits: 0,
        }
    }

    /// The retry policy.
    #[must_use]
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The first actions: plan the request.
    pub fn start(&mut self) -> Vec<Action> {
        vec![Action::Plan {
            lane: 0,
            prompt: self.job.prompt.clone(),
            exclude: Vec::new(),
            model: Some(self.job.params.model().unwrap_or_default().to_owned()),
        }]
    }

    /// True once the response is complete and no lane waits for anything: the driver stops.
    #[must_use]
    pub fn is_over(&self) -> bool {
        (self.finished || self.gone) && self.lanes.iter().all(|l| matches!(l.phase, Phase::Over))
    }

    /// The client has gone (or the response is complete): only clean-up is left.
    #[must_use]
    pub fn is_closing(&self) -> bool {
        self.finished || self.gone
    }

    /// Takes one event; returns what to do, in order.
    pub fn on(&mut self, event: SessionEvent) -> Vec<Action> {
        let mut a = Vec::new();
        match event {
            SessionEvent::Planned { lane, plan } => self.planned(lane, *plan, &mut a),
            SessionEvent::Prefilled { lane, handle } => self.prefilled(lane, handle, &mut a),
            SessionEvent::PrefillFailed { lane, failure } => {
                self.prefill_failed(lane, failure, &mut a)
            }
            SessionEvent::Opened { lane } => {
                if let Some(l) = self.lanes.get_mut(lane)
                    && let Phase::Resuming { decode } = &l.phase
                {
                    l.phase = Phase::Streaming {
                        worker: decode.worker_id.clone(),
                        colocated: false,
                        start: None,
                    };
                }
            }
            SessionEvent::OpenFailed {
                lane,
                code,
                message,
            } => self.open_failed(lane, code, &message, &mut a),
            SessionEvent::Generated { lane, events } => self.generated(lane, *events, &mut a),
            SessionEvent::StreamLost { lane, cause } => self.stream_lost(lane, cause, &mut a),
            SessionEvent::Placed { lane } => {
                if self.live(lane) {
                    a.push(Action::Plan {
                        lane,
                        prompt: self.lane_prompt(lane),
                        exclude: Vec::new(),
                        model: Some(self.job.params.model().unwrap_or_default().to_owned()),
                    });
                } else if let Some(l) = self.lanes.get_mut(lane) {
                    l.phase = Phase::Over;
                }
            }
            SessionEvent::Unplaced { lane, error } => {
                if self.live(lane) {
                    self.lanes[lane].phase = Phase::Over;
                    self.emit(&mut a, Out::Choice(ChoiceEvent::Failed(error)));
                    self.finish(&mut a);
                } else if let Some(l) = self.lanes.get_mut(lane) {
                    l.phase = Phase::Over;
                }
            }
            SessionEvent::ClientGone => {
                if !self.gone {
                    self.gone = true;
                    self.close_all(&mut a);
                }
            }
            SessionEvent::Drain => {
                if !self.is_closing() {
                    let detail = ErrorDetail {
                        message: "the gateway is draining: this request was ended before it \
                                  finished"
                            .into(),
                        kind: ErrorKind::Unavailable.as_str().into(),
                        param: None,
                        code: None,
                    };
                    if self.started {
                        self.emit(&mut a, Out::Choice(ChoiceEvent::Broken(detail)));
                    } else {
                        self.emit(
                            &mut a,
                            Out::Choice(ChoiceEvent::Failed(ApiError::unavailable(detail.message))),
                        );
                    }
                    self.finish(&mut a);
                }
            }
        }
        a
    }

    /// The lane continues a choice after its decode engine was lost (else it is the request's
    /// first route: lane 0 before any loss).
    fn continuing(&self, lane: LaneId) -> bool {
        self.lanes[lane].cause.is_some()
    }

    /// The lane exists and its events still matter.
    fn live(&self, lane: LaneId) -> bool {
        !self.is_closing()
            && self
                .lanes
                .get(lane)
                .is_some_and(|l| !matches!(l.phase, Phase::Over | Phase::Cancelled))
    }

    fn emit(&mut self, a: &mut Vec<Action>, out: Out) {
        if !self.gone {
            if matches!(out, Out::Start { .. }) {
                self.started = true;
            }
            a.push(Action::Emit(out));
        }
    }

    /// Ends the response: every lane closed, released or cancelled, then [`Action::Finish`].
    fn finish(&mut self, a: &mut Vec<Action>) {
        if !self.finished {
            self.close_all(a);
            self.finished = true;
            a.push(Action::Finish);
        }
    }

    fn close_all(&mut self, a: &mut Vec<Action>) {
        for (i, l) in self.lanes.iter_mut().enumerate() {
            match std::mem::replace(&mut l.phase, Phase::Over) {
                Phase::Prefilling(p) => {
                    l.phase = Phase::Cancelled;
                    a.push(Action::Cancel {
                        lane: i,
                        prefill: p.prefill,
                        request_id: p.request_id,
                    });
                }
                Phase::Cancelled => l.phase = Phase::Cancelled,
                Phase::Resuming { .. } => {
                    // The resume may be opening: stop it, and give the handle back.
                    a.push(Action::Close { lane: i });
                    a.push(Action::Release {
                        lane: i,
                        wait: true,
                    });
                }
                Phase::Streaming { .. } => a.push(Action::Close { lane: i }),
                // A lane waiting for a plan or a place has nothing to give back.
                Phase::Planning | Phase::Over => l.phase = Phase::Over,
            }
        }
    }

    fn planned(&mut self, lane: LaneId, plan: Planned, a: &mut Vec<Action>) {
        if !self.live(lane) {
            if let Some(l) = self.lanes.get_mut(lane) {
                l.phase = Phase::Over;
            }
            return;
        }
        let first = !self.continuing(lane);
        let (plan, holds) = match plan {
            Ok(p) => p,
            Err(u) => {
                let (msg, error) = match u {
                    Unservable::UnknownModel(m) => {
                        let msg = format!("unknown model {m:?}");
                        (msg.clone(), ApiError::bad_request(msg))
                    }
                    // The deployment's fault, not the request's: 503 naming both models.
                    Unservable::OtherModel(msg) => (msg.clone(), ApiError::unavailable(msg)),
                };
                if first {
                    self.emit(a, Out::Choice(ChoiceEvent::Failed(error)));
                    self.finish(a);
                } else {
                    self.give_up(lane, &format!("no failover: {msg}"), a);
                }
                return;
            }
        };
        if first {
            a.push(Action::Routed {
                reason: super::plan::reason_label(&plan),
            });
        }
        let Plan {
            prefill,
            prefill_spare,
            decode,
            fallback,
        } = plan;
        match prefill {
            Some(p) if !decode.is_empty() => {
                self.lanes[lane].phase = Phase::Prefilling(Box::new(Prefilling {
                    prefill: p,
                    spare: prefill_spare,
                    decode,
                    next: 0,
                    retries: 0,
                    fallback: if first { fallback } else { None },
                    request_id: String::new(),
                    holds,
                }));
                self.send_prefill(lane, a);
            }
            _ if !first => {
                let why = if prefill.is_none() {
                    "no prefill engine is live"
                } else {
                    "no other decode engine answered"
                };
                self.give_up(lane, &format!("no failover: {why}"), a);
            }
            _ => self.no_pair(fallback, 0, false, a),
        }
    }

    /// Lane 0, refused for load before its answer started: back to the gateway's queue, the
    /// pause doubling from 50 ms to 1 s with each refusal. The queue's deadline bounds it.
    fn wait(&mut self, a: &mut Vec<Action>) {
        let pause = Duration::from_millis(50u64 << self.waits.min(5)).min(Duration::from_secs(1));
        self.waits = self.waits.saturating_add(1);
        self.lanes[0].phase = Phase::Planning;
        a.push(Action::Wait { lane: 0, pause });
    }

    /// Lane 0 found no disaggregated pair (or every decode engine refused the push, after
    /// `retries`): a `both` engine serves it colocated; without one, a request the live
    /// engines refused for load waits in the queue (`refused`), and one that no live engine
    /// can serve gets 503.
    fn no_pair(
        &mut self,
        fallback: Option<WorkerStatus>,
        retries: u32,
        refused: bool,
        a: &mut Vec<Action>,
    ) {
        if fallback.is_none() && refused {
            self.wait(a);
            return;
        }
        let Some(b) = fallback else {
            self.lanes[0].phase = Phase::Over;
            self.emit(
                a,
                Out::Choice(ChoiceEvent::Failed(ApiError::unavailable(
                    "no engine can serve this request now",
                ))),
            );
            self.finish(a);
            return;
        };
        let route = RouteInfo {
            prefill: b.worker_id.clone(),
            decode: b.worker_id.clone(),
            reason: FALLBACK_REASON.to_owned(),
            retries,
            ..RouteInfo::default()
        };
        let request = self.generate_request(
            self.job.prompt.clone(),
            self.job.params.seed,
            0,
            self.job.choices.n,
            None,
        );
        self.lanes[0].phase = Phase::Streaming {
            worker: b.worker_id.clone(),
            colocated: true,
            start: Some((route, b.model.clone())),
        };
        a.push(Action::Colocated {
            lane: 0,
            target: b,
            request,
            quiet: self.policy.colocated_quiet,
        });
    }

    /// Sends the lane's next Prefill, to `decode[next]`.
    fn send_prefill(&mut self, lane: LaneId, a: &mut Vec<Action>) {
        let sampling = self.sampling(lane);
        let prompt = self.lane_prompt(lane);
        let offset = self.draws_offset(lane);
        let l = &mut self.lanes[lane];
        let Phase::Prefilling(p) = &mut l.phase else {
            return;
        };
        let d = p.decode[p.next].worker.clone();
        p.request_id = format!("{}-{}", l.id, l.attempts);
        l.attempts += 1;
        a.push(Action::Prefill {
            lane,
            prefill: p.prefill.clone(),
            request: PrefillRequest {
                request_id: p.request_id.clone(),
                prompt_tokens: prompt,
                sampling: Some(sampling),
                decode_target: d.kv_address.clone(),
                rng_draws_offset: offset,
                decode_holds: p.holds.get(&d.worker_id).cloned(),
                cache_scope: self.job.scope,
                // Its control port answers HasBlocks off the threads its imports hold.
                decode_lookup: d.grpc_address.clone(),
            },
            decode: d,
        });
    }

    /// The prompt of the lane's next Prefill: the request's, with every token its choice has
    /// after a failover.
    fn lane_prompt(&self, lane: LaneId) -> Vec<u32> {
        let mut p = self.job.prompt.clone();
        if self.continuing(lane) {
            let c = self.lanes[lane].choices[0] as usize;
            p.extend_from_slice(&self.choices[c].sent);
        }
        p
    }

    fn draws_offset(&self, lane: LaneId) -> u32 {
        if !self.continuing(lane) {
            return 0;
        }
        let c = self.lanes[lane].choices[0] as usize;
        self.draws_per_token
            .saturating_mul(self.choices[c].sent.len() as u32)
    }

    /// The lane's Prefill's sampling: the request's, and after a failover its choice's own seed
    /// and the tokens it has left.
    fn sampling(&self, lane: LaneId) -> SamplingParams {
        if self.continuing(lane) {
            let c = self.lanes[lane].choices[0];
            let seed = self.seed.wrapping_add(u64::from(c));
            self.sampling_params(Some(seed), self.choices[c as usize].sent.len() as u32)
        } else {
            self.sampling_params(self.job.params.seed, 0)
        }
    }

    /// The request's sampling with `seed`, for an engine that continues after `held` tokens
    /// (the prompt's last `held` tokens, which the penalties count as output).
    fn sampling_params(&self, seed: Option<u64>, held: u32) -> SamplingParams {
        let p = &self.job.params;
        crate::node::wire::sampling_params(
            &p.sampling(),
            self.job.structured.as_ref(),
            seed,
            p.max_tokens().saturating_sub(held),
            held,
        )
    }

    /// The typed request a decode engine runs: `prompt` (the request's, with the `held` tokens
    /// its choice has), `n` choices from `seed`, continuing `resume` when given. The engine sees
    /// only its own tokens: `max_tokens` and `min_tokens` count the ones sent before.
    fn generate_request(
        &self,
        prompt: Vec<u32>,
        seed: Option<u64>,
        held: u32,
        n: u32,
        resume: Option<Resume>,
    ) -> GenerateRequest {
        GenerateRequest {
            prompt_tokens: prompt,
            sampling: Some(self.sampling_params(seed, held)),
            stop: Some(crate::node::wire::stop_rules(&self.job.stop, held)),
            n,
            logprobs: self.job.choices.logprobs,
            cache_scope: self.job.scope,
            resume,
            model: String::new(),
        }
    }

    fn prefill_failed(&mut self, lane: LaneId, failure: PrefillFailure, a: &mut Vec<Action>) {
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        if !matches!(l.phase, Phase::Prefilling { .. }) || self.finished || self.gone {
            // A cancelled Prefill answered: nothing to release.
            l.phase = Phase::Over;
            return;
        }
        let Phase::Prefilling(p) = &mut l.phase else {
            return;
        };
        let refused = match failure {
            // The prefill engine itself failed: another one, once, with the same decode
            // engines; then the colocated fallback.
            PrefillFailure::Unreachable | PrefillFailure::TimedOut if p.spare.is_some() => {
                if let Some(next) = p.spare.take() {
                    p.prefill = next;
                    p.retries += 1;
                }
                self.send_prefill(lane, a);
                return;
            }
            PrefillFailure::Unreachable | PrefillFailure::TimedOut => None,
            // FAILED_PRECONDITION: the prefill engine no longer prefills (its role changed
            // since the plan's snapshot), or the decode engine no longer decodes. The spare
            // prefill engine first, with the same decode engine; a decode engine that refused
            // refuses again, and the next one is tried then.
            PrefillFailure::Status {
                code: Code::FailedPrecondition,
                ..
            } if p.spare.is_some() => {
                if let Some(next) = p.spare.take() {
                    p.prefill = next;
                    p.retries += 1;
                }
                self.send_prefill(lane, a);
                return;
            }
            PrefillFailure::Status { code, message } if !retryable(code) => Some((code, message)),
            PrefillFailure::Status { .. } => {
                p.retries += 1;
                p.next += 1;
                if p.next < p.decode.len().min(self.policy.decode_attempts) {
                    self.send_prefill(lane, a);
                    return;
                }
                None
            }
        };
        let (retries, fallback) = (p.retries, p.fallback.take());
        l.phase = Phase::Over;
        let first = !self.continuing(lane);
        match refused {
            // A full pool or a busy engine: the request waits for room, at its turn.
            Some((Code::ResourceExhausted, _)) if first => self.wait(a),
            Some((code, message)) if first => {
                self.emit(
                    a,
                    Out::Choice(ChoiceEvent::Failed(prefill_refusal(code, message))),
                );
                self.finish(a);
            }
            Some((_, message)) => {
                self.give_up(
                    lane,
                    &format!("no failover: prefill engine refused: {message}"),
                    a,
                );
            }
            None if first => self.no_pair(fallback, retries, true, a),
            None => self.give_up(
                lane,
                &format!("no failover: {retries} decode engines refused the push"),
                a,
            ),
        }
    }

    fn prefilled(&mut self, lane: LaneId, h: KvHandle, a: &mut Vec<Action>) {
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        let prev = std::mem::replace(&mut l.phase, Phase::Over);
        let Phase::Prefilling(p) = prev else {
            // Cancelled meanwhile: the handle arrived anyway, so give it back.
            a.push(Action::Release { lane, wait: true });
            return;
        };
        if self.is_closing() {
            a.push(Action::Release { lane, wait: true });
            return;
        }
        let Prefilling {
            prefill,
            decode,
            next,
            retries,
            ..
        } = *p;
        let d = decode[next].clone();
        self.lanes[lane].phase = Phase::Resuming {
            decode: d.worker.clone(),
        };
        if !self.continuing(lane) {
            self.seed = h.seed;
            self.draws_per_token = h.rng_draws_consumed;
            let mut route = RouteInfo {
                prefill: prefill.worker_id.clone(),
                decode: d.worker.worker_id.clone(),
                reason: d.reason.to_string(),
                cached_blocks: d.cached_blocks,
                retries,
                ..RouteInfo::default()
            };
            route.blocks_sent = Some(h.blocks_sent);
            route.blocks_deduped = Some(h.blocks_deduped);
            route.payload_bytes = Some(h.payload_bytes);
            self.emit(
                a,
                Out::Start {
                    seed: h.seed,
                    model: d.worker.model.clone(),
                    route,
                },
            );
        } else if let Some(cause) = self.lanes[lane].cause {
            a.push(Action::Failover {
                cause,
                resumed: true,
            });
        }
        let first_choice = self.lanes[lane].choices[0];
        self.choices[first_choice as usize].held = self.choices[first_choice as usize].sent.len();
        if !self.job.wants_logprobs() {
            // The first token goes out at once (time to first token is the Prefill's); the
            // decode stream's copy of it is skipped.
            self.choices[first_choice as usize].skip = true;
            self.announce(first_choice, h.first_token, None, a);
            if self.lanes[lane].choices.len() == 1 && self.choices[first_choice as usize].done {
                self.lanes[lane].phase = Phase::Over;
                a.push(Action::Release { lane, wait: true });
                self.finish_if_done(a);
                return;
            }
        }
        let held = self.choices[first_choice as usize].held;
        let mut prompt = self.job.prompt.clone();
        prompt.extend_from_slice(&self.choices[first_choice as usize].sent[..held]);
        let n = self.lanes[lane].choices.len() as u32;
        let request = self.generate_request(
            prompt,
            Some(h.seed),
            held as u32,
            n,
            Some(Resume {
                handle_id: h.handle_id,
                first_token: h.first_token,
                rng_draws_consumed: h.rng_draws_consumed,
            }),
        );
        a.push(Action::Resume {
            lane,
            decode: d.worker,
            request,
            quiet: self.policy.stall,
        });
    }

    /// Sends `token` as the next token of `choice`, then its end when a stop rule matches or
    /// `max_tokens` is reached.
    fn announce(
        &mut self,
        choice: u32,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        a: &mut Vec<Action>,
    ) {
        self.emit(
            a,
            Out::Choice(ChoiceEvent::Token {
                choice,
                token,
                logprobs,
            }),
        );
        let c = &mut self.choices[choice as usize];
        c.sent.push(token);
        let finish = if self.job.stop.matched(&c.sent).is_some() {
            Finish::Stop
        } else if c.sent.len() >= self.job.params.max_tokens() as usize {
            Finish::Length
        } else {
            return;
        };
        self.end_choice(choice, finish, a);
    }

    fn end_choice(&mut self, choice: u32, finish: Finish, a: &mut Vec<Action>) {
        self.choices[choice as usize].done = true;
        self.emit(a, Out::Choice(ChoiceEvent::Finished { choice, finish }));
    }

    fn finish_if_done(&mut self, a: &mut Vec<Action>) {
        if self.choices.iter().all(|c| c.done) {
            self.finish(a);
        }
    }

    fn generated(&mut self, lane: LaneId, mut ev: GenerateEvents, a: &mut Vec<Action>) {
        if !self.live(lane) {
            return;
        }
        if let Phase::Streaming { start, .. } = &mut self.lanes[lane].phase
            && let Some((route, model)) = start.take()
        {
            self.emit(
                a,
                Out::Start {
                    seed: ev.seed,
                    model,
                    route,
                },
            );
        }
        // Owned: each token's log-probabilities move on to the client's chunk, uncopied.
        for mut t in std::mem::take(&mut ev.tokens) {
            let Some(&choice) = self.lanes[lane].choices.get(t.choice as usize) else {
                continue;
            };
            let st = &mut self.choices[choice as usize];
            if st.done || std::mem::take(&mut st.skip) {
                continue;
            }
            self.emit(
                a,
                Out::Choice(ChoiceEvent::Token {
                    choice,
                    token: t.token,
                    logprobs: logprobs_of(&mut t),
                }),
            );
            let st = &mut self.choices[choice as usize];
            st.sent.push(t.token);
            // The engine ends its sequence at the step that matched and says so; this check
            // also catches a stop string that straddles a failover (the new engine sees only
            // its own tokens).
            if self.job.stop.matched(&st.sent).is_some() {
                self.end_choice(choice, Finish::Stop, a);
            }
        }
        for e in &ev.finished {
            if let Some(&choice) = self.lanes[lane].choices.get(e.choice as usize)
                && !self.choices[choice as usize].done
            {
                self.end_choice(choice, reason_of(e.finish).into(), a);
            }
        }
        if let Some(s) = error_of(&ev) {
            // The engine's own failure, after the answer started: no failover.
            self.emit(
                a,
                Out::Choice(ChoiceEvent::Broken(ApiError::from_status(&s).detail())),
            );
            self.finish(a);
            return;
        }
        let lane_done = self.lanes[lane]
            .choices
            .iter()
            .all(|&c| self.choices[c as usize].done);
        if lane_done {
            self.lanes[lane].phase = Phase::Over;
            a.push(Action::Close { lane });
            self.finish_if_done(a);
        }
    }

    fn open_failed(&mut self, lane: LaneId, code: Code, message: &str, a: &mut Vec<Action>) {
        if !self.live(lane) {
            return;
        }
        let colocated = matches!(
            self.lanes[lane].phase,
            Phase::Streaming {
                colocated: true,
                ..
            }
        );
        if !colocated {
            self.stream_lost(lane, LossCause::Reset, a);
            return;
        }
        // FAILED_PRECONDITION: the engine stopped decoding since the plan's snapshot (its role
        // changed) and took nothing: planned again without it, a bounded number of times.
        let l = &mut self.lanes[lane];
        if code == Code::FailedPrecondition
            && let Phase::Streaming { worker, .. } = &l.phase
            && l.lost.len() < self.policy.max_failovers.max(1) as usize
        {
            l.lost.push(worker.clone());
            l.phase = Phase::Planning;
            a.push(Action::Plan {
                lane,
                prompt: self.lane_prompt(lane),
                exclude: self.lanes[lane].lost.clone(),
                model: Some(self.job.params.model().unwrap_or_default().to_owned()),
            });
            return;
        }
        // The engine is full, busy or draining: the request waits for room, at its turn.
        if lane == 0 && !self.started && matches!(code, Code::ResourceExhausted | Code::Unavailable)
        {
            self.wait(a);
            return;
        }
        self.lanes[lane].phase = Phase::Over;
        let e = ApiError::engine(format!("fallback engine: {message} ({code:?})"));
        self.emit(a, Out::Choice(ChoiceEvent::Failed(e)));
        self.finish(a);
    }

    fn stream_lost(&mut self, lane: LaneId, cause: LossCause, a: &mut Vec<Action>) {
        if !self.live(lane) {
            return;
        }
        let l = &mut self.lanes[lane];
        let (worker, colocated) = match std::mem::replace(&mut l.phase, Phase::Over) {
            Phase::Resuming { decode } => {
                // Refused, unreachable, or silent: the handle is released in the background.
                a.push(Action::Release { lane, wait: false });
                (decode.worker_id, false)
            }
            Phase::Streaming {
                worker, colocated, ..
            } => {
                a.push(Action::Close { lane });
                (worker, colocated)
            }
            other => {
                l.phase = other;
                return;
            }
        };
        if colocated {
            // No failover for a colocated request: nothing else holds its state.
            self.emit(
                a,
                Out::Choice(ChoiceEvent::Broken(engine_detail(format!(
                    "engine stream lost ({})",
                    cause.label()
                )))),
            );
            self.finish(a);
            return;
        }
        let unfinished: Vec<u32> = l
            .choices
            .iter()
            .copied()
            .filter(|&c| !self.choices[c as usize].done)
            .collect();
        a.push(Action::Lost {
            lane,
            worker: worker.clone(),
            cause,
            tokens_sent: self.choices[l.choices[0] as usize].sent.len(),
        });
        let mut lost = l.lost.clone();
        lost.push(worker);
        let targets: Vec<LaneId> = if l.choices.len() == 1 {
            // A failover lane: the same lane tries again, its failovers counted on.
            l.lost = lost;
            l.cause = Some(cause);
            unfinished.iter().map(|_| lane).collect()
        } else {
            // Each unfinished choice continues on its own, all at once: each a lane of its own
            // now (its seed, its draws, its Prefills).
            let several = unfinished.len() > 1;
            let (id, attempts) = (l.id.clone(), l.attempts);
            unfinished
                .iter()
                .map(|&c| {
                    self.lanes.push(Lane {
                        choices: vec![c],
                        phase: Phase::Planning,
                        id: if several {
                            format!("{id}-c{c}")
                        } else {
                            id.clone()
                        },
                        attempts,
                        failovers: 0,
                        lost: lost.clone(),
                        cause: Some(cause),
                    });
                    self.lanes.len() - 1
                })
                .collect()
        };
        for t in targets {
            let c = self.lanes[t].choices[0];
            self.choices[c as usize].skip = false;
            if self.lanes[t].failovers >= self.policy.max_failovers {
                let msg = format!(
                    "decode engine lost ({}) after {} tokens, and {} failovers were allowed",
                    cause.label(),
                    self.choices[c as usize].sent.len(),
                    self.lanes[t].failovers
                );
                a.push(Action::Failover {
                    cause,
                    resumed: false,
                });
                self.lanes[t].phase = Phase::Over;
                self.emit(a, Out::Choice(ChoiceEvent::Broken(engine_detail(msg))));
                self.finish(a);
                return;
            }
            self.lanes[t].failovers += 1;
            self.lanes[t].phase = Phase::Planning;
            a.push(Action::Plan {
                lane: t,
                prompt: self.lane_prompt(t),
                exclude: self.lanes[t].lost.clone(),
                model: None,
            });
        }
    }

    /// A failover lane cannot continue: the request ends with an error naming why.
    fn give_up(&mut self, lane: LaneId, why: &str, a: &mut Vec<Action>) {
        let l = &mut self.lanes[lane];
        l.phase = Phase::Over;
        let cause = l.cause.unwrap_or(LossCause::Reset);
        let sent = self.choices[l.choices[0] as usize].sent.len();
        a.push(Action::Failover {
            cause,
            resumed: false,
        });
        let msg = format!(
            "decode engine lost ({}) after {sent} tokens; {why}",
            cause.label()
        );
        self.emit(a, Out::Choice(ChoiceEvent::Broken(engine_detail(msg))));
        self.finish(a);
    }
}

fn engine_detail(message: String) -> ErrorDetail {
    ErrorDetail {
        message,
        kind: ErrorKind::Engine.as_str().into(),
        param: None,
        code: None,
    }
}

/// A Prefill that failed this way is worth trying on the next decode engine: the push was
/// refused or corrupted there, the engine could not be reached, or it did not answer in time
/// (a partitioned decode engine: the prefill engine's call to it timed out).
fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::DataLoss | Code::FailedPrecondition | Code::Unavailable | Code::DeadlineExceeded
    )
}

/// A Prefill refusal as the client sees it: the engine's INVALID_ARGUMENT is the request's fault
/// (400 with the core's message, as if the gateway had found it), a full pool is 429.
fn prefill_refusal(code: Code, message: String) -> ApiError {
    match code {
        Code::InvalidArgument => ApiError::bad_request(message),
        Code::ResourceExhausted => ApiError::engine_busy(message),
        _ => ApiError::engine(message),
    }
}

#[cfg(test)]
mod tests {
    use kvwire_grpc::pb::control::Role as PbRole;

    use super::*;
    use crate::gateway::plan::Reason;

    const SEED: u64 = 7;
    const MAX: u32 = 8;

    fn worker(id: &str, role: PbRole) -> WorkerStatus {
        WorkerStatus {
            worker_id: id.into(),
            role: role as i32,
            kv_address: format!("{id}:kv"),
            http_address: format!("{id}:http"),
            grpc_address: format!("{id}:grpc"),
            model: "fake".into(),
            block_tokens: 4,
            ..WorkerStatus::default()
        }
    }

    /// A plan: prefill engine P, these decode engines in order, and an optional `both` engine.
    /// A plan with no prefill and decode pair: only `fallback`, a `both` engine, if any.
    fn unpaired(fallback: Option<&str>) -> SessionEvent {
        SessionEvent::Planned {
            lane: 0,
            plan: Box::new(Ok((
                Plan {
                    prefill: None,
                    decode: Vec::new(),
                    fallback: fallback.map(|b| worker(b, PbRole::Both)),
                    prefill_spare: None,
                },
                FleetHolds::new(),
            ))),
        }
    }

    fn plan(decode: &[&str], fallback: Option<&str>) -> SessionEvent {
        plan_for(0, decode, fallback)
    }

    fn plan_for(lane: LaneId, decode: &[&str], fallback: Option<&str>) -> SessionEvent {
        SessionEvent::Planned {
            lane,
            plan: Box::new(Ok((
                Plan {
                    prefill: Some(worker("P", PbRole::Prefill)),
                    decode: decode
                        .iter()
                        .map(|d| Ranked {
                            worker: worker(d, PbRole::Decode),
                            cached_blocks: 0,
                            score: 0.0,
                            reason: Reason::ByLoad,
                        })
                        .collect(),
                    fallback: fallback.map(|b| worker(b, PbRole::Both)),
                    prefill_spare: None,
                },
                holds(decode),
            ))),
        }
    }

    /// As [`plan`], with a second prefill engine P2 to try when P fails.
    fn plan_with_spare(decode: &[&str], fallback: Option<&str>) -> SessionEvent {
        let SessionEvent::Planned { lane, plan } = plan_for(0, decode, fallback) else {
            unreachable!()
        };
        let Ok((mut p, holds)) = *plan else {
            unreachable!()
        };
        p.prefill_spare = Some(worker("P2", PbRole::Prefill));
        SessionEvent::Planned {
            lane,
            plan: Box::new(Ok((p, holds))),
        }
    }

    /// Each decode engine's HasBlocks answer: engine `i` (in plan order) holds its first `i`
    /// blocks of 3.
    fn holds(decode: &[&str]) -> HashMap<WorkerId, DecodeHolds> {
        decode
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let present = (0..3).map(|b| b < i).collect();
                (
                    WorkerId::new((*d).to_owned()),
                    DecodeHolds {
                        kv_format: 1,
                        present,
                    },
                )
            })
            .collect()
    }

    fn no_prefill(lane: LaneId) -> SessionEvent {
        SessionEvent::Planned {
            lane,
            plan: Box::new(Ok((Plan::default(), HashMap::new()))),
        }
    }

    /// A Prefill's handle: first token `first`, `draws` draws consumed in all.
    fn handle(lane: LaneId, first: u32, draws: u32, seed: u64) -> SessionEvent {
        SessionEvent::Prefilled {
            lane,
            handle: KvHandle {
                handle_id: format!("h{lane}-{first}"),
                first_token: first,
                rng_draws_consumed: draws,
                seed,
                ..KvHandle::default()
            },
        }
    }

    fn failed(lane: LaneId, code: Code) -> SessionEvent {
        SessionEvent::PrefillFailed {
            lane,
            failure: PrefillFailure::Status {
                code,
                message: format!("{code:?}"),
            },
        }
    }

    /// A message of the lane's stream: (engine choice index, tokens, finish).
    fn chunk(lane: LaneId, parts: &[(u32, &[u32], Option<Finish>)]) -> SessionEvent {
        use kvwire_grpc::pb::engine::{ChoiceFinished, GeneratedToken};
        SessionEvent::Generated {
            lane,
            events: Box::new(GenerateEvents {
                seed: SEED,
                tokens: parts
                    .iter()
                    .flat_map(|(i, t, _)| {
                        t.iter().map(|&token| GeneratedToken {
                            choice: *i,
                            token,
                            ..GeneratedToken::default()
                        })
                    })
                    .collect(),
                finished: parts
                    .iter()
                    .filter_map(|(i, _, f)| {
                        f.map(|f| ChoiceFinished {
                            choice: *i,
                            finish: match f {
                                Finish::Length => kvwire_grpc::pb::engine::Finish::Length,
                                Finish::Stop | Finish::ToolCalls => {
                                    kvwire_grpc::pb::engine::Finish::Stop
                                }
                            } as i32,
                        })
                    })
                    .collect(),
                ..GenerateEvents::default()
            }),
        }
    }

    fn lost(lane: LaneId, cause: LossCause) -> SessionEvent {
        SessionEvent::StreamLost { lane, cause }
    }

    /// Each action in a line short enough to read in a table.
    fn show(a: &Action) -> String {
        match a {
            Action::Plan {
                lane,
                prompt,
                exclude,
                model,
            } => format!(
                "plan {lane} len={} excl={exclude:?}{}",
                prompt.len(),
                if model.is_some() { " first" } else { "" }
            ),
            Action::Routed { reason } => format!("routed {}", reason.label()),
            Action::Prefill {
                lane,
                prefill,
                decode,
                request,
            } => {
                let s = request.sampling.clone().unwrap_or_default();
                format!(
                    "prefill {lane} {} to {} len={} seed={:?} max={} offset={}{}",
                    request.request_id,
                    decode.worker_id,
                    request.prompt_tokens.len(),
                    s.seed,
                    s.max_tokens,
                    request.rng_draws_offset,
                    if prefill.worker_id == "P" {
                        String::new()
                    } else {
                        format!(" via {}", prefill.worker_id)
                    }
                )
            }
            Action::Resume {
                lane,
                decode,
                request,
                ..
            } => {
                let s = request.sampling.clone().unwrap_or_default();
                format!(
                    "resume {lane} {} on {} len={} n={} max={} seed={:?}",
                    request.resume.as_ref().map_or("", |r| r.handle_id.as_str()),
                    decode.worker_id,
                    request.prompt_tokens.len(),
                    request.n.max(1),
                    s.max_tokens,
                    s.seed
                )
            }
            Action::Colocated { lane, target, .. } => {
                format!("colocated {lane} on {}", target.worker_id)
            }
            Action::Emit(Out::Start { seed, route, .. }) => format!(
                "start seed={seed} {}->{} retries={}",
                route.prefill, route.decode, route.retries
            ),
            Action::Emit(Out::Choice(ChoiceEvent::Token { choice, token, .. })) => {
                format!("token {choice}:{token}")
            }
            Action::Emit(Out::Choice(ChoiceEvent::Finished { choice, finish })) => {
                format!("done {choice}:{finish:?}")
            }
            Action::Emit(Out::Choice(ChoiceEvent::Failed(e))) => {
                format!("fail {} {}", e.status().as_u16(), e.message)
            }
            Action::Emit(Out::Choice(ChoiceEvent::Broken(e))) => format!("broken {}", e.message),
            Action::Release { lane, wait } => {
                format!("release {lane}{}", if *wait { "" } else { " background" })
            }
            Action::Cancel {
                lane, request_id, ..
            } => format!("cancel {lane} {request_id}"),
            Action::Close { lane } => format!("close {lane}"),
            Action::Lost {
                lane,
                worker,
                cause,
                tokens_sent,
            } => format!("lost {lane} {worker} {} after {tokens_sent}", cause.label()),
            Action::Failover { cause, resumed } => format!(
                "failover {} {}",
                cause.label(),
                if *resumed { "resumed" } else { "gave_up" }
            ),
            Action::Wait { lane, pause } => format!("wait {lane} {}ms", pause.as_millis()),
            Action::Finish => "finish".into(),
        }
    }

    fn job(n: u32, temperature: f32, logprobs: bool, stop: &[&[u8]]) -> Job {
        Job {
            prompt: (0..10).collect(),
            params: GenerationParams {
                max_tokens: Some(MAX),
                temperature: Some(temperature),
                seed: Some(SEED),
                ..GenerationParams::default()
            },
            stop: Stop {
                sequences: stop.iter().map(|s| s.to_vec()).collect(),
                token_ids: Vec::new(),
                ..Stop::default()
            },
            choices: Choices {
                n,
                logprobs: logprobs.then_some(2),
            },
            scope: 0,
            structured: None,
            tools: None,
        }
    }

    struct Case {
        name: &'static str,
        job: Job,
        policy: RetryPolicy,
        /// Each event, and the actions it must give, in order.
        steps: Vec<(SessionEvent, &'static [&'static str])>,
        /// The session is over at the end.
        over: bool,
    }

    /// The request's first step: planned on P with `decode` (D1 first), its Prefill to D1.
    fn routed(decode: &[&str]) -> (SessionEvent, &'static [&'static str]) {
        (
            plan(decode, None),
            &[
                "routed by_load",
                "prefill 0 r-0 to D1 len=10 seed=Some(7) max=8 offset=0",
            ],
        )
    }

    /// The request planned on P with D1 then D2, prefilled onto D1 (first token 100, `draws`
    /// draws), and its stream on D1 opened: the steps every failover case starts with.
    fn opened(draws: u32) -> Vec<(SessionEvent, &'static [&'static str])> {
        vec![
            routed(&["D1", "D2"]),
            (
                handle(0, 100, draws, SEED),
                &[
                    "start seed=7 P->D1 retries=0",
                    "token 0:100",
                    "resume 0 h0-100 on D1 len=10 n=1 max=8 seed=Some(7)",
                ],
            ),
            (SessionEvent::Opened { lane: 0 }, &[]),
        ]
    }

    fn with(
        mut head: Vec<(SessionEvent, &'static [&'static str])>,
        tail: Vec<(SessionEvent, &'static [&'static str])>,
    ) -> Vec<(SessionEvent, &'static [&'static str])> {
        head.extend(tail);
        head
    }

    fn cases() -> Vec<Case> {
        let policy = RetryPolicy::default();
        vec![
            Case {
                name: "a role changed since the plan (FAILED_PRECONDITION): the spare prefill \
                       engine with the same decode engine, then the next decode engine",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    (
                        plan_with_spare(&["D1", "D2"], Some("B")),
                        &[
                            "routed by_load",
                            "prefill 0 r-0 to D1 len=10 seed=Some(7) max=8 offset=0",
                        ],
                    ),
                    (
                        failed(0, Code::FailedPrecondition),
                        &["prefill 0 r-1 to D1 len=10 seed=Some(7) max=8 offset=0 via P2"],
                    ),
                    (
                        failed(0, Code::FailedPrecondition),
                        &["prefill 0 r-2 to D2 len=10 seed=Some(7) max=8 offset=0 via P2"],
                    ),
                ],
                over: false,
            },
            Case {
                name: "a colocated engine that stopped decoding (421): planned again without it",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    (
                        plan_for(0, &[], Some("B")),
                        &["routed colocated", "colocated 0 on B"],
                    ),
                    (
                        SessionEvent::OpenFailed {
                            lane: 0,
                            code: Code::FailedPrecondition,
                            message: "wrong role".into(),
                        },
                        &["plan 0 len=10 excl=[\"B\"] first"],
                    ),
                    (
                        plan_for(0, &[], Some("B2")),
                        &["routed colocated", "colocated 0 on B2"],
                    ),
                ],
                over: false,
            },
            Case {
                name: "a prefill engine past its deadline: once more on the spare, then colocated",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    (
                        plan_with_spare(&["D1", "D2"], Some("B")),
                        &[
                            "routed by_load",
                            "prefill 0 r-0 to D1 len=10 seed=Some(7) max=8 offset=0",
                        ],
                    ),
                    (
                        SessionEvent::PrefillFailed {
                            lane: 0,
                            failure: PrefillFailure::TimedOut,
                        },
                        &["prefill 0 r-1 to D1 len=10 seed=Some(7) max=8 offset=0 via P2"],
                    ),
                    (
                        SessionEvent::PrefillFailed {
                            lane: 0,
                            failure: PrefillFailure::Unreachable,
                        },
                        &["colocated 0 on B"],
                    ),
                ],
                over: false,
            },
            Case {
                name: "no failure: the first token from the handle, the rest from the stream",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: with(
                    opened(0),
                    vec![
                        (chunk(0, &[(0, &[100, 101], None)]), &["token 0:101"]),
                        (
                            chunk(
                                0,
                                &[(0, &[102, 103, 104, 105, 106, 107], Some(Finish::Length))],
                            ),
                            &[
                                "token 0:102",
                                "token 0:103",
                                "token 0:104",
                                "token 0:105",
                                "token 0:106",
                                "token 0:107",
                                "done 0:Length",
                                "close 0",
                                "finish",
                            ],
                        ),
                        // The stream's end after the finish changes nothing.
                        (lost(0, LossCause::Reset), &[]),
                    ],
                ),
                over: true,
            },
            Case {
                name: "kill before the first token (logprobs: every token from the stream)",
                job: job(1, 0.0, true, &[]),
                policy,
                steps: vec![
                    routed(&["D1", "D2"]),
                    (
                        handle(0, 100, 0, SEED),
                        &[
                            "start seed=7 P->D1 retries=0",
                            "resume 0 h0-100 on D1 len=10 n=1 max=8 seed=Some(7)",
                        ],
                    ),
                    (SessionEvent::Opened { lane: 0 }, &[]),
                    (
                        lost(0, LossCause::Reset),
                        &[
                            "close 0",
                            "lost 0 D1 reset after 0",
                            "plan 0 len=10 excl=[\"D1\"]",
                        ],
                    ),
                    (
                        plan(&["D2"], None),
                        &["prefill 0 r-1 to D2 len=10 seed=Some(7) max=8 offset=0"],
                    ),
                    (
                        handle(0, 100, 0, SEED),
                        &[
                            "failover reset resumed",
                            "resume 0 h0-100 on D2 len=10 n=1 max=8 seed=Some(7)",
                        ],
                    ),
                ],
                over: false,
            },
            Case {
                name: "kill after 3 tokens, greedy: no draws to skip",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: with(
                    opened(0),
                    vec![
                        (
                            chunk(0, &[(0, &[100, 101, 102], None)]),
                            &["token 0:101", "token 0:102"],
                        ),
                        (
                            lost(0, LossCause::Reset),
                            &[
                                "close 0",
                                "lost 0 D1 reset after 3",
                                "plan 0 len=13 excl=[\"D1\"]",
                            ],
                        ),
                        (
                            plan(&["D2"], None),
                            &["prefill 0 r-1 to D2 len=13 seed=Some(7) max=5 offset=0"],
                        ),
                        (
                            handle(0, 103, 0, SEED),
                            &[
                                "failover reset resumed",
                                "token 0:103",
                                "resume 0 h0-103 on D2 len=13 n=1 max=5 seed=Some(7)",
                            ],
                        ),
                        (SessionEvent::Opened { lane: 0 }, &[]),
                        // The new engine's first token is the handle's: skipped.
                        (chunk(0, &[(0, &[103, 104], None)]), &["token 0:104"]),
                    ],
                ),
                over: false,
            },
            Case {
                name: "kill after 3 tokens, seeded: the generator skips their 3 draws",
                job: job(1, 0.8, false, &[]),
                policy,
                steps: with(
                    opened(1),
                    vec![
                        (
                            chunk(0, &[(0, &[100, 101, 102], None)]),
                            &["token 0:101", "token 0:102"],
                        ),
                        (
                            lost(0, LossCause::Reset),
                            &[
                                "close 0",
                                "lost 0 D1 reset after 3",
                                "plan 0 len=13 excl=[\"D1\"]",
                            ],
                        ),
                        (
                            plan(&["D2"], None),
                            &["prefill 0 r-1 to D2 len=13 seed=Some(7) max=5 offset=3"],
                        ),
                    ],
                ),
                over: false,
            },
            Case {
                name: "a stall counts as a loss with its own cause",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: with(
                    opened(0),
                    vec![
                        (
                            lost(0, LossCause::Stall),
                            &[
                                "close 0",
                                "lost 0 D1 stall after 1",
                                "plan 0 len=11 excl=[\"D1\"]",
                            ],
                        ),
                        (
                            plan(&["D2"], None),
                            &["prefill 0 r-1 to D2 len=11 seed=Some(7) max=7 offset=0"],
                        ),
                        (
                            handle(0, 101, 0, SEED),
                            &[
                                "failover stall resumed",
                                "token 0:101",
                                "resume 0 h0-101 on D2 len=11 n=1 max=7 seed=Some(7)",
                            ],
                        ),
                    ],
                ),
                over: false,
            },
            Case {
                name: "a refused resume releases the handle in the background and fails over",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    routed(&["D1", "D2"]),
                    (
                        handle(0, 100, 0, SEED),
                        &[
                            "start seed=7 P->D1 retries=0",
                            "token 0:100",
                            "resume 0 h0-100 on D1 len=10 n=1 max=8 seed=Some(7)",
                        ],
                    ),
                    (
                        lost(0, LossCause::Reset),
                        &[
                            "release 0 background",
                            "lost 0 D1 reset after 1",
                            "plan 0 len=11 excl=[\"D1\"]",
                        ],
                    ),
                ],
                over: false,
            },
            Case {
                name: "the Prefill's DEADLINE_EXCEEDED tries the next decode engine, then falls back",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    (
                        plan(&["D1", "D2", "D3"], Some("B")),
                        &[
                            "routed by_load",
                            "prefill 0 r-0 to D1 len=10 seed=Some(7) max=8 offset=0",
                        ],
                    ),
                    (
                        failed(0, Code::DeadlineExceeded),
                        &["prefill 0 r-1 to D2 len=10 seed=Some(7) max=8 offset=0"],
                    ),
                    // Two attempts allowed: D3 is not tried; the both engine serves it.
                    (failed(0, Code::DeadlineExceeded), &["colocated 0 on B"]),
                    (
                        chunk(0, &[(0, &[5], None)]),
                        &["start seed=7 B->B retries=2", "token 0:5"],
                    ),
                ],
                over: false,
            },
            Case {
                name: "every push refused, no both engine: back to the queue, planned again",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    routed(&["D1", "D2"]),
                    (
                        failed(0, Code::Unavailable),
                        &["prefill 0 r-1 to D2 len=10 seed=Some(7) max=8 offset=0"],
                    ),
                    // The engines live and refused for load: the request waits, never 503.
                    (failed(0, Code::DataLoss), &["wait 0 50ms"]),
                    (
                        SessionEvent::Placed { lane: 0 },
                        &["plan 0 len=10 excl=[] first"],
                    ),
                    (
                        plan(&["D2"], None),
                        &[
                            "routed by_load",
                            "prefill 0 r-2 to D2 len=10 seed=Some(7) max=8 offset=0",
                        ],
                    ),
                    // A full pool: waits again, the pause doubled.
                    (failed(0, Code::ResourceExhausted), &["wait 0 100ms"]),
                    // The queue's deadline passed: 429 (with Retry-After), never 503.
                    (
                        SessionEvent::Unplaced {
                            lane: 0,
                            error: ApiError::rate_limited("no place"),
                        },
                        &["fail 429 no place", "finish"],
                    ),
                ],
                over: true,
            },
            Case {
                name: "no prefill engine in the plan and no both engine: 503",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![(
                    unpaired(None),
                    &[
                        "routed none",
                        "fail 503 no engine can serve this request now",
                        "finish",
                    ],
                )],
                over: true,
            },
            Case {
                name: "a full fallback engine (429) sends the request back to the queue",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    (
                        unpaired(Some("B")),
                        &["routed colocated", "colocated 0 on B"],
                    ),
                    (
                        SessionEvent::OpenFailed {
                            lane: 0,
                            code: Code::ResourceExhausted,
                            message: "busy".into(),
                        },
                        &["wait 0 50ms"],
                    ),
                    (SessionEvent::ClientGone, &[]),
                ],
                over: true,
            },
            Case {
                name: "the request's own fault is 400 at once, no retry",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    routed(&["D1", "D2"]),
                    (
                        failed(0, Code::InvalidArgument),
                        &["fail 400 InvalidArgument", "finish"],
                    ),
                ],
                over: true,
            },
            Case {
                name: "a stop string split across a failover ends the choice",
                job: job(1, 0.0, false, &[b"xy"]),
                policy,
                steps: vec![
                    routed(&["D1", "D2"]),
                    (
                        handle(0, 120, 0, SEED),
                        &[
                            "start seed=7 P->D1 retries=0",
                            "token 0:120",
                            "resume 0 h0-120 on D1 len=10 n=1 max=8 seed=Some(7)",
                        ],
                    ),
                    (SessionEvent::Opened { lane: 0 }, &[]),
                    // 'x' is the last token D1 sends; 'y' is the failover Prefill's first.
                    (
                        chunk(0, &[(0, &[120, u32::from(b'x')], None)]),
                        &["token 0:120"],
                    ),
                    (
                        lost(0, LossCause::Reset),
                        &[
                            "close 0",
                            "lost 0 D1 reset after 2",
                            "plan 0 len=12 excl=[\"D1\"]",
                        ],
                    ),
                    (
                        plan(&["D2"], None),
                        &["prefill 0 r-1 to D2 len=12 seed=Some(7) max=6 offset=0"],
                    ),
                    (
                        handle(0, u32::from(b'y'), 0, SEED),
                        &[
                            "failover reset resumed",
                            "token 0:121",
                            "done 0:Stop",
                            "release 0",
                            "finish",
                        ],
                    ),
                ],
                over: true,
            },
            Case {
                name: "n=3 with one choice done: the two others continue at once, each on its own",
                job: job(3, 0.8, false, &[]),
                policy,
                steps: vec![
                    routed(&["D1", "D2"]),
                    (
                        handle(0, 100, 1, SEED),
                        &[
                            "start seed=7 P->D1 retries=0",
                            "token 0:100",
                            "resume 0 h0-100 on D1 len=10 n=3 max=8 seed=Some(7)",
                        ],
                    ),
                    (SessionEvent::Opened { lane: 0 }, &[]),
                    (
                        chunk(
                            0,
                            &[
                                (0, &[100, 101], None),
                                (1, &[50], Some(Finish::Stop)),
                                (2, &[60, 61], None),
                            ],
                        ),
                        // One message: its tokens, then the choices that ended.
                        &[
                            "token 0:101",
                            "token 1:50",
                            "token 2:60",
                            "token 2:61",
                            "done 1:Stop",
                        ],
                    ),
                    (
                        lost(0, LossCause::Reset),
                        &[
                            "close 0",
                            "lost 0 D1 reset after 2",
                            "plan 1 len=12 excl=[\"D1\"]",
                            "plan 2 len=12 excl=[\"D1\"]",
                        ],
                    ),
                    // Choice 2: seed + 2, its own Prefill ids, its 2 draws skipped.
                    (
                        plan_for(2, &["D2"], None),
                        &["prefill 2 r-c2-1 to D2 len=12 seed=Some(9) max=6 offset=2"],
                    ),
                    (
                        plan_for(1, &["D2"], None),
                        &["prefill 1 r-c0-1 to D2 len=12 seed=Some(7) max=6 offset=2"],
                    ),
                    (
                        handle(2, 62, 3, SEED + 2),
                        &[
                            "failover reset resumed",
                            "token 2:62",
                            "resume 2 h2-62 on D2 len=12 n=1 max=6 seed=Some(9)",
                        ],
                    ),
                ],
                over: false,
            },
            Case {
                name: "the client leaves during a failover's Prefill: cancelled, its handle released",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: with(
                    opened(0),
                    vec![
                        (
                            lost(0, LossCause::Reset),
                            &[
                                "close 0",
                                "lost 0 D1 reset after 1",
                                "plan 0 len=11 excl=[\"D1\"]",
                            ],
                        ),
                        (
                            plan(&["D2"], None),
                            &["prefill 0 r-1 to D2 len=11 seed=Some(7) max=7 offset=0"],
                        ),
                        (SessionEvent::ClientGone, &["cancel 0 r-1"]),
                        // The push had finished: the handle still arrives, and goes back.
                        (handle(0, 101, 0, SEED), &["release 0"]),
                    ],
                ),
                over: true,
            },
            Case {
                name: "the client leaves while streaming: the stream closes, nothing more is sent",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: with(
                    opened(0),
                    vec![
                        (SessionEvent::ClientGone, &["close 0"]),
                        (chunk(0, &[(0, &[100, 101], None)]), &[]),
                    ],
                ),
                over: true,
            },
            Case {
                name: "the bound reached: the second loss gives up with an error event",
                job: job(1, 0.0, false, &[]),
                policy: RetryPolicy {
                    max_failovers: 1,
                    ..policy
                },
                steps: with(
                    opened(0),
                    vec![
                        (
                            lost(0, LossCause::Reset),
                            &[
                                "close 0",
                                "lost 0 D1 reset after 1",
                                "plan 0 len=11 excl=[\"D1\"]",
                            ],
                        ),
                        (
                            plan(&["D2", "D3"], None),
                            &["prefill 0 r-1 to D2 len=11 seed=Some(7) max=7 offset=0"],
                        ),
                        (
                            handle(0, 101, 0, SEED),
                            &[
                                "failover reset resumed",
                                "token 0:101",
                                "resume 0 h0-101 on D2 len=11 n=1 max=7 seed=Some(7)",
                            ],
                        ),
                        (SessionEvent::Opened { lane: 0 }, &[]),
                        (
                            lost(0, LossCause::Stall),
                            &[
                                "close 0",
                                "lost 0 D2 stall after 2",
                                "failover stall gave_up",
                                "broken decode engine lost (stall) after 2 tokens, and 1 failovers were allowed",
                                "finish",
                            ],
                        ),
                    ],
                ),
                over: true,
            },
            Case {
                name: "no engine left to fail over to: an error event naming why",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: with(
                    opened(0),
                    vec![
                        (
                            lost(0, LossCause::Reset),
                            &[
                                "close 0",
                                "lost 0 D1 reset after 1",
                                "plan 0 len=11 excl=[\"D1\"]",
                            ],
                        ),
                        (
                            no_prefill(0),
                            &[
                                "failover reset gave_up",
                                "broken decode engine lost (reset) after 1 tokens; no failover: no prefill engine is live",
                                "finish",
                            ],
                        ),
                    ],
                ),
                over: true,
            },
            Case {
                name: "drain: what is left ends with an error naming the drain",
                job: job(2, 0.0, false, &[]),
                policy,
                steps: vec![
                    routed(&["D1"]),
                    (
                        handle(0, 100, 0, SEED),
                        &[
                            "start seed=7 P->D1 retries=0",
                            "token 0:100",
                            "resume 0 h0-100 on D1 len=10 n=2 max=8 seed=Some(7)",
                        ],
                    ),
                    (
                        SessionEvent::Drain,
                        &[
                            "broken the gateway is draining: this request was ended before it finished",
                            "close 0",
                            "release 0",
                            "finish",
                        ],
                    ),
                ],
                over: true,
            },
            Case {
                name: "drain before the answer started: 503",
                job: job(1, 0.0, false, &[]),
                policy,
                steps: vec![
                    routed(&["D1"]),
                    (
                        SessionEvent::Drain,
                        &[
                            "fail 503 the gateway is draining: this request was ended before it finished",
                            "cancel 0 r-0",
                            "finish",
                        ],
                    ),
                    (failed(0, Code::Cancelled), &[]),
                ],
                over: true,
            },
            Case {
                name: "a first token that ends the request releases the handle unresumed",
                job: job(1, 0.0, false, &[b"d"]),
                policy,
                steps: vec![
                    routed(&["D1"]),
                    (
                        handle(0, u32::from(b'd'), 0, SEED),
                        &[
                            "start seed=7 P->D1 retries=0",
                            "token 0:100",
                            "done 0:Stop",
                            "release 0",
                            "finish",
                        ],
                    ),
                ],
                over: true,
            },
        ]
    }

    /// The gateway's HasBlocks answer travels with the Prefill to the engine it pushes to, so
    /// the decode engine is asked once per request; a retry carries the next engine's.
    #[test]
    fn the_prefill_carries_its_decode_engines_answer() {
        let holds_of = |a: &[Action]| -> Vec<Option<Vec<bool>>> {
            a.iter()
                .filter_map(|x| match x {
                    Action::Prefill { request, .. } => {
                        Some(request.decode_holds.as_ref().map(|h| h.present.clone()))
                    }
                    _ => None,
                })
                .collect()
        };
        // Each Prefill names its decode engine's KV port and, for HasBlocks, its control port.
        let ports_of = |a: &[Action]| -> Vec<(String, String)> {
            a.iter()
                .filter_map(|x| match x {
                    Action::Prefill { request, .. } => {
                        Some((request.decode_target.clone(), request.decode_lookup.clone()))
                    }
                    _ => None,
                })
                .collect()
        };
        let mut s = Session::new(job(1, 0.0, false, &[]), "r".into(), RetryPolicy::default());
        s.start();
        let a = s.on(plan(&["D1", "D2"], None));
        assert_eq!(holds_of(&a), [Some(vec![false, false, false])]);
        assert_eq!(ports_of(&a), [("D1:kv".into(), "D1:grpc".into())]);
        let a = s.on(failed(0, Code::Unavailable));
        assert_eq!(holds_of(&a), [Some(vec![true, false, false])]);
        assert_eq!(ports_of(&a), [("D2:kv".into(), "D2:grpc".into())]);
        // An engine that gave no answer is not in the plan; one in the plan without an answer
        // (an older gateway's) leaves the prefill engine to ask.
        let mut s = Session::new(job(1, 0.0, false, &[]), "r".into(), RetryPolicy::default());
        s.start();
        let SessionEvent::Planned { plan, .. } = plan(&["D1"], None) else {
            unreachable!()
        };
        let Ok((p, _)) = *plan else { unreachable!() };
        let a = s.on(SessionEvent::Planned {
            lane: 0,
            plan: Box::new(Ok((p, HashMap::new()))),
        });
        assert_eq!(holds_of(&a), [None]);
    }

    #[test]
    fn session_cases() {
        for c in cases() {
            let mut s = Session::new(c.job, "r".into(), c.policy);
            let first: Vec<String> = s.start().iter().map(show).collect();
            assert_eq!(first, ["plan 0 len=10 excl=[] first"], "{}", c.name);
            for (i, (event, want)) in c.steps.into_iter().enumerate() {
                let got: Vec<String> = s.on(event).iter().map(show).collect();
                assert_eq!(got, want, "{}: step {i}", c.name);
            }
            assert_eq!(s.is_over(), c.over, "{}: over", c.name);
        }
    }
}
