//! One request's life in the gateway, as a task of its own: plan the route, prefill on one
//! engine, hand the first token to the client at once, resume on the decode engine and relay the
//! rest. The task reports what happens as [`Out`] messages; the HTTP handler renders them. The
//! task watches the client: one that goes away during Prefill gets the prefill cancelled (and a
//! handle that still arrives released); before the decode engine claimed the handle, the handle
//! is released; after, the decode stream is dropped, which cancels the sequence there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kvwire_grpc::pb::control::WorkerStatus;
use kvwire_grpc::pb::engine::{KvHandle, PrefillRequest, SamplingParams};
use tokio::sync::mpsc;
use tonic::Code;
use tracing::Instrument;
use tracing::field::Empty;

use super::Gateway;
use super::plan::{Ranked, Reason, has_blocks_targets, plan};
use super::upstream::Unclaimed;
use crate::api::sse::StreamEvent;
use crate::api::{
    ApiError, CompletionRequest, ErrorDetail, GenerationParams, LogprobsField, Prompt, RouteInfo,
    TlResume,
};
use crate::net::clients::EventStream;
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
}

impl Job {
    /// Log-probabilities asked for: then every token, the first included, comes from a decode
    /// engine's stream (which computes them), never from a Prefill's handle.
    fn wants_logprobs(&self) -> bool {
        self.choices.logprobs.is_some()
    }
}

/// What the request task tells the HTTP handler.
#[derive(Debug)]
pub enum Out {
    /// Routing done: an engine is producing the answer (tokens follow).
    Start {
        /// The seed used (choice i samples with seed + i).
        seed: u64,
        /// The model that answers.
        model: String,
        /// Where it went.
        route: RouteInfo,
    },
    /// A token of one choice.
    Token {
        /// The choice.
        choice: u32,
        /// The token.
        token: u32,
        /// Its log-probabilities, when asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// One choice is done (the request is, once each of its choices is).
    Done {
        /// The choice.
        choice: u32,
        /// OpenAI's finish reason.
        finish: String,
    },
    /// Failed before the first token.
    Fail(ApiError),
    /// Failed after tokens went out.
    Broken(ErrorDetail),
}

fn broken(message: impl Into<String>) -> Out {
    Out::Broken(ErrorDetail {
        message: message.into(),
        kind: "engine_error".into(),
        code: None,
    })
}

/// One choice as the client has it, while an engine's stream is relayed.
#[derive(Debug)]
struct ChoiceState {
    /// Its index in the response.
    choice: u32,
    /// Every token the client has, in order.
    sent: Vec<u32>,
    /// Finished (its last message sent).
    done: bool,
    /// The engine's next token for it is one the client already has (a Prefill's first token,
    /// announced before the decode engine's stream opened).
    skip: bool,
}

impl ChoiceState {
    fn new(choice: u32) -> Self {
        Self {
            choice,
            sent: Vec::new(),
            done: false,
            skip: false,
        }
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
fn prefill_failure(s: &tonic::Status) -> ApiError {
    match s.code() {
        Code::InvalidArgument => ApiError::bad_request(s.message()),
        Code::ResourceExhausted => {
            ApiError::new(StatusCode::TOO_MANY_REQUESTS, "engine_error", s.message())
        }
        _ => ApiError::new(StatusCode::BAD_GATEWAY, "engine_error", s.message()),
    }
}

/// A Prefill that went through: the handle, the decode engine holding it, and the route.
struct Prefilled {
    handle: KvHandle,
    decode: WorkerStatus,
    route: RouteInfo,
    /// The request counted on its decode engine until its stream there ends (dropped with
    /// this, or kept by whoever relays that stream).
    counted: super::inflight::InFlightGuard,
}

/// Why no Prefill went through.
enum PrefillEnd {
    /// The client left; the prefill was cancelled and any handle released.
    Gone,
    /// The engine refused the request itself (its fault, or a full pool): tell the client.
    Refused(tonic::Status),
    /// No decode engine took the push, or the prefill engine could not be reached.
    NoDecode {
        /// Decode engines tried.
        retries: u32,
    },
}

/// Why a relayed stream stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Relayed {
    /// Finished, ended by the engine's own error event, or the client left: nothing more to do.
    Over,
    /// The engine went away: the stream broke, ended early or was refused (`reset`), or sent
    /// nothing within the stall timeout (`stall`). Worth continuing elsewhere.
    Lost(&'static str),
}

/// A disaggregated request's choice after its first Prefill: what the client has of it, and
/// how to continue it on another decode engine if the one serving it is lost.
struct Continuation<'a> {
    job: &'a Job,
    /// The request id, and the choice's after a failover (`<request id>-c<choice>`); its
    /// Prefills are `<id>-<n>`.
    id: String,
    /// Prefills sent so far (the next one's `n`).
    attempts: u32,
    /// The choice, its tokens and state.
    state: ChoiceState,
    /// Leading tokens of `state.sent` that the current handle's prompt holds (the rest of the
    /// request's prompt, after `job.prompt`).
    held: usize,
    /// The seed the first Prefill reported.
    seed: u64,
    /// Draws one token consumes: 0 greedy, 1 otherwise (every token the same, `spec/pcg32.md`).
    draws_per_token: u32,
    /// Decode engines this request lost.
    lost: Vec<String>,
}

impl Continuation<'_> {
    /// The prompt the current handle holds, and the tokens still to generate (the handle's
    /// first token included).
    fn resume_point(&self) -> (Vec<u32>, u32) {
        let mut p = self.job.prompt.clone();
        p.extend_from_slice(&self.state.sent[..self.held]);
        let max = self
            .job
            .params
            .max_tokens()
            .saturating_sub(self.held as u32);
        (p, max)
    }

    /// This choice's seed (`spec/pcg32.md`: choice i samples with seed + i).
    fn choice_seed(&self) -> u64 {
        self.seed.wrapping_add(u64::from(self.state.choice))
    }
}

impl Gateway {
    /// Runs one request, sending what happens to `out`. Returns when the request is over or the
    /// client has gone (then after cleaning up).
    pub(super) async fn drive(self: Arc<Self>, job: Job, out: mpsc::Sender<Out>) {
        let id = self.request_id();
        let workers = self.workers_after_startup(&out).await;
        if let Some(m) = job.params.model()
            && !workers.iter().any(|w| w.status.model == m)
        {
            let _ = out
                .send(Out::Fail(ApiError::bad_request(format!(
                    "unknown model {m:?}"
                ))))
                .await;
            return;
        }
        let route_span = tracing::info_span!("route", otel.kind = "internal", reason = Empty);
        let cached = self
            .upstream
            .cached_prefixes(&job.prompt, &has_blocks_targets(&workers))
            .instrument(route_span.clone())
            .await;
        let plan = plan(&workers, &cached, &self.inflight.snapshot(), self.policy());
        let reason = match (plan.decode.first(), &plan.fallback) {
            (Some(d), _) if plan.prefill.is_some() => match d.reason {
                Reason::PrefixHit { .. } => "prefix_hit",
                Reason::ByLoad => "by_load",
                Reason::Colocated => "colocated",
            },
            (_, Some(_)) => "colocated",
            _ => "none",
        };
        self.metrics
            .route_decisions
            .get_or_create(&crate::telemetry::metrics::Reason {
                reason: reason.to_owned(),
            })
            .inc();
        route_span.record("reason", reason);
        drop(route_span);
        tracing::debug!(request_id = %id, reason, "routed");
        let mut retries = 0;
        if let Some(p) = &plan.prefill {
            let mut attempts = 0;
            let sp = sampling(&job.params);
            match self
                .prefill(
                    &id,
                    &mut attempts,
                    p,
                    &plan.decode,
                    &job.prompt,
                    sp,
                    0,
                    &out,
                )
                .await
            {
                Ok(done) => {
                    let c = Continuation {
                        job: &job,
                        id: id.clone(),
                        attempts,
                        state: ChoiceState::new(0),
                        held: 0,
                        seed: done.handle.seed,
                        draws_per_token: done.handle.rng_draws_consumed,
                        lost: Vec::new(),
                    };
                    self.finish_disaggregated(c, done, &out).await;
                    return;
                }
                Err(PrefillEnd::Gone) => return,
                Err(PrefillEnd::Refused(s)) => {
                    let _ = out.send(Out::Fail(prefill_failure(&s))).await;
                    return;
                }
                Err(PrefillEnd::NoDecode { retries: r }) => retries = r,
            }
        }
        // No prefill engine, or no decode engine left: an engine with role both, colocated.
        if let Some(b) = &plan.fallback {
            let route = RouteInfo {
                prefill: b.worker_id.clone(),
                decode: b.worker_id.clone(),
                reason: Reason::Colocated.to_string(),
                retries,
                ..RouteInfo::default()
            };
            self.finish_colocated(&job, b, route, &out).await;
            return;
        }
        let _ = out
            .send(Out::Fail(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "no engine can serve this request now",
            )))
            .await;
    }

    /// A Prefill of `prompt` on `p`, pushing to the first of (at most two of) `decode` that
    /// takes it. `draws_offset` is `PrefillRequest.rng_draws_offset`; `attempts` numbers the
    /// Prefills of this request, so each has its own request id.
    #[allow(clippy::too_many_arguments)]
    async fn prefill(
        &self,
        id: &str,
        attempts: &mut u32,
        p: &WorkerStatus,
        decode: &[Ranked],
        prompt: &[u32],
        sampling: SamplingParams,
        draws_offset: u32,
        out: &mpsc::Sender<Out>,
    ) -> Result<Prefilled, PrefillEnd> {
        let Ok(ctl) = self.upstream.control(&p.grpc_address) else {
            return Err(PrefillEnd::NoDecode { retries: 0 });
        };
        let mut retries = 0;
        for d in decode.iter().take(2) {
            let req = PrefillRequest {
                request_id: format!("{id}-{attempts}"),
                prompt_tokens: prompt.to_vec(),
                sampling: Some(sampling),
                decode_target: d.worker.kv_address.clone(),
                rng_draws_offset: draws_offset,
            };
            *attempts += 1;
            // Counted from the Prefill until the decode stream ends (the guard travels with
            // the handle), so routing between heartbeats sees every stream this gateway runs.
            let counted = self.inflight.enter(&d.worker.worker_id);
            let call = ctl.prefill(req.clone());
            tokio::pin!(call);
            let res = tokio::select! {
                r = &mut call => r,
                () = out.closed() => {
                    // The client left during Prefill: cancel it, and keep waiting for the
                    // call, so that a handle that still arrives (the push had finished) is
                    // released rather than left to its lease.
                    let _ = ctl.cancel(&req.request_id).await;
                    if let Ok(Ok(h)) = tokio::time::timeout(Duration::from_secs(5), &mut call).await {
                        self.upstream.release(&d.worker.kv_address, &h.handle_id).await;
                    }
                    return Err(PrefillEnd::Gone);
                }
            };
            match res {
                Ok(handle) => {
                    return Ok(Prefilled {
                        handle,
                        decode: d.worker.clone(),
                        route: route(p, d, retries),
                        counted,
                    });
                }
                Err(s) if retryable(s.code()) => retries += 1,
                Err(s) => return Err(PrefillEnd::Refused(s)),
            }
        }
        Err(PrefillEnd::NoDecode { retries })
    }

    /// Starts the answer, then relays the decode engine's stream of the request's choices. A
    /// choice whose decode engine is lost continues on another one (up to `max_failovers` times
    /// each), so that the client sees every choice unbroken; after a loss the unfinished
    /// choices continue at once, each as a request of its own with its seed.
    async fn finish_disaggregated(
        self: &Arc<Self>,
        mut c: Continuation<'_>,
        first: Prefilled,
        out: &mpsc::Sender<Out>,
    ) {
        let Prefilled {
            handle: h,
            decode: d,
            mut route,
            counted,
        } = first;
        route.blocks_sent = Some(h.blocks_sent);
        route.blocks_deduped = Some(h.blocks_deduped);
        route.payload_bytes = Some(h.payload_bytes);
        let unclaimed = Unclaimed::new(Arc::clone(&self.upstream), &d.kv_address, &h.handle_id);
        let start = Out::Start {
            seed: h.seed,
            model: d.model.clone(),
            route,
        };
        if out.send(start).await.is_err() {
            unclaimed.release().await;
            return;
        }
        let mut states: Vec<ChoiceState> = (0..c.job.choices.n).map(ChoiceState::new).collect();
        if !c.job.wants_logprobs() {
            // The first token goes out at once (time to first token is the Prefill's).
            states[0].skip = true;
            if !announce(out, &mut states[0], h.first_token, c.job).await {
                unclaimed.release().await;
                return;
            }
            if c.job.choices.n == 1 && states[0].done {
                unclaimed.release().await;
                return;
            }
        }
        let at = c.resume_point();
        let cause = match self
            .resume(c.job, at, &h, &d, unclaimed, &mut states, out)
            .await
        {
            Relayed::Over => return,
            Relayed::Lost(cause) => cause,
        };
        // The lost engine no longer runs this request.
        drop(counted);
        self.lost(&c, &d, cause);
        c.lost.push(d.worker_id.clone());
        // Each unfinished choice continues on its own, all at once: each is a request of its
        // own now (its seed, its draws, its Prefills).
        let unfinished: Vec<ChoiceState> = states.into_iter().filter(|s| !s.done).collect();
        let several = unfinished.len() > 1;
        let each = unfinished.into_iter().map(|mut state| {
            state.skip = false;
            let mut ci = Continuation {
                job: c.job,
                id: if several {
                    format!("{}-c{}", c.id, state.choice)
                } else {
                    c.id.clone()
                },
                attempts: c.attempts,
                held: state.sent.len(),
                state,
                seed: c.seed,
                draws_per_token: c.draws_per_token,
                lost: c.lost.clone(),
            };
            async move { self.fail_over(&mut ci, cause, out).await }
        });
        futures_util::future::join_all(each).await;
    }

    fn lost(&self, c: &Continuation<'_>, d: &WorkerStatus, cause: &str) {
        tracing::warn!(
            request_id = %c.id,
            worker = %d.worker_id,
            cause,
            choice = c.state.choice,
            tokens_sent = c.state.sent.len(),
            "decode stream lost"
        );
    }

    /// Continues choice `c.state` after its decode engine was lost (`cause`), until it is done
    /// or the failovers allowed are spent. False when the request is over (given up, or the
    /// client left).
    async fn fail_over(
        self: &Arc<Self>,
        c: &mut Continuation<'_>,
        mut cause: &'static str,
        out: &mpsc::Sender<Out>,
    ) -> bool {
        let mut failovers = 0;
        loop {
            let counted = |outcome| {
                self.metrics
                    .failovers
                    .get_or_create(&crate::telemetry::metrics::FailoverLabels { cause, outcome })
                    .inc();
            };
            if failovers >= self.cfg.max_failovers {
                counted("gave_up");
                let _ = out
                    .send(broken(format!(
                        "decode engine lost ({cause}) after {} tokens, and {failovers} failovers were allowed",
                        c.state.sent.len()
                    )))
                    .await;
                return false;
            }
            failovers += 1;
            let (h, d, _counted) = match self.continue_elsewhere(c, out).await {
                Ok(p) => {
                    counted("resumed");
                    (p.handle, p.decode, p.counted)
                }
                Err(None) => return false,
                Err(Some(why)) => {
                    counted("gave_up");
                    let _ = out
                        .send(broken(format!(
                            "decode engine lost ({cause}) after {} tokens; no failover: {why}",
                            c.state.sent.len()
                        )))
                        .await;
                    return false;
                }
            };
            let unclaimed = Unclaimed::new(Arc::clone(&self.upstream), &d.kv_address, &h.handle_id);
            c.held = c.state.sent.len();
            if !c.job.wants_logprobs() {
                // The new token the failover's Prefill sampled.
                c.state.skip = true;
                if !announce(out, &mut c.state, h.first_token, c.job).await {
                    unclaimed.release().await;
                    return false;
                }
                if c.state.done {
                    unclaimed.release().await;
                    return true;
                }
            }
            let at = c.resume_point();
            let mut one = [std::mem::replace(&mut c.state, ChoiceState::new(0))];
            let relayed = self
                .resume(c.job, at, &h, &d, unclaimed, &mut one, out)
                .await;
            let [state] = one;
            c.state = state;
            match relayed {
                Relayed::Over => return c.state.done,
                Relayed::Lost(again) => {
                    self.lost(c, &d, again);
                    c.lost.push(d.worker_id.clone());
                    cause = again;
                }
            }
        }
    }

    /// Resumes handle `h` (holding `at.0`, with `at.1` tokens to generate) on decode engine `d`
    /// for the choices `states` (in the engine's order) and relays its stream.
    #[allow(clippy::too_many_arguments)]
    async fn resume(
        &self,
        job: &Job,
        at: (Vec<u32>, u32),
        h: &KvHandle,
        d: &WorkerStatus,
        unclaimed: Unclaimed,
        states: &mut [ChoiceState],
        out: &mpsc::Sender<Out>,
    ) -> Relayed {
        let req = CompletionRequest {
            prompt: Prompt::Tokens(at.0),
            params: GenerationParams {
                model: None,
                seed: Some(h.seed),
                stream: Some(true),
                stream_options: None,
                max_tokens: Some(at.1),
                n: Some(states.len() as u32),
                logprobs: job.choices.logprobs.map(LogprobsField::Count),
                top_logprobs: None,
                ..job.params.clone()
            },
            tl_resume: Some(TlResume {
                first_token: h.first_token,
                rng_draws_consumed: h.rng_draws_consumed,
            }),
        };
        let stall = self.stall_timeout();
        let opened = tokio::select! {
            r = tokio::time::timeout(
                stall,
                self.upstream.stream(&d.http_address, Some(&h.handle_id), &req),
            ) => r,
            () = out.closed() => {
                unclaimed.release().await;
                return Relayed::Over;
            }
        };
        match opened {
            Ok(Ok(events)) => {
                // A 200 means the decode engine claimed the handle; from here, dropping the
                // stream is what frees its blocks.
                unclaimed.claimed();
                relay(events, out, None, stall, states, &job.stop).await
            }
            // Refused, unreachable, or silent: the handle is released in the background (a
            // partitioned engine must not hold up the failover).
            Ok(Err(_)) => Relayed::Lost("reset"),
            Err(_) => Relayed::Lost("stall"),
        }
    }

    /// After decode engines in `c.lost` were lost: a Prefill of the prompt and every token of
    /// the choice sent, on a prefill engine, with the choice's seed and the generator advanced
    /// past the draws those tokens used, pushed to another decode engine. `Err(None)` when the
    /// client left meanwhile.
    async fn continue_elsewhere(
        &self,
        c: &mut Continuation<'_>,
        out: &mpsc::Sender<Out>,
    ) -> Result<Prefilled, Option<String>> {
        let workers: Vec<_> = self
            .registry
            .snapshot(Instant::now())
            .into_iter()
            .filter(|w| !c.lost.contains(&w.status.worker_id))
            .collect();
        let mut prompt = c.job.prompt.clone();
        prompt.extend_from_slice(&c.state.sent);
        let cached = self
            .upstream
            .cached_prefixes(&prompt, &has_blocks_targets(&workers))
            .await;
        let plan = plan(&workers, &cached, &self.inflight.snapshot(), self.policy());
        let Some(p) = &plan.prefill else {
            return Err(Some("no prefill engine is live".into()));
        };
        if plan.decode.is_empty() {
            return Err(Some("no other decode engine answered".into()));
        }
        let sent = c.state.sent.len() as u32;
        let mut sp = sampling(&c.job.params);
        sp.seed = Some(c.choice_seed());
        sp.max_tokens = c.job.params.max_tokens().saturating_sub(sent);
        let offset = c.draws_per_token.saturating_mul(sent);
        match self
            .prefill(
                &c.id,
                &mut c.attempts,
                p,
                &plan.decode,
                &prompt,
                sp,
                offset,
                out,
            )
            .await
        {
            Ok(p) => Ok(p),
            Err(PrefillEnd::Gone) => Err(None),
            Err(PrefillEnd::Refused(s)) => {
                Err(Some(format!("prefill engine refused: {}", s.message())))
            }
            Err(PrefillEnd::NoDecode { retries }) => {
                Err(Some(format!("{retries} decode engines refused the push")))
            }
        }
    }

    /// The live workers; while the gateway is young (`startup_grace_ms`) and they cannot serve a
    /// request yet, waits for registrations (or the client leaving) instead of failing it.
    async fn workers_after_startup(&self, out: &mpsc::Sender<Out>) -> Vec<super::plan::WorkerView> {
        let grace_end = self.started + Duration::from_millis(self.cfg.startup_grace_ms);
        loop {
            let workers = self.registry.snapshot(Instant::now());
            let cached: std::collections::HashMap<String, usize> =
                super::plan::decode_candidates(&workers)
                    .into_iter()
                    .map(|w| (w.worker_id.clone(), 0))
                    .collect();
            let servable = !plan(
                &workers,
                &cached,
                &std::collections::HashMap::new(),
                self.policy(),
            )
            .is_empty();
            if servable || Instant::now() >= grace_end || out.is_closed() {
                return workers;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stall_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.stall_timeout_ms.max(1))
    }

    async fn finish_colocated(
        &self,
        job: &Job,
        b: &WorkerStatus,
        route: RouteInfo,
        out: &mpsc::Sender<Out>,
    ) {
        let req = CompletionRequest {
            prompt: Prompt::Tokens(job.prompt.clone()),
            params: GenerationParams {
                model: None,
                stream: Some(true),
                stream_options: None,
                n: Some(job.choices.n),
                logprobs: job.choices.logprobs.map(LogprobsField::Count),
                top_logprobs: None,
                ..job.params.clone()
            },
            tl_resume: None,
        };
        match self.upstream.stream(&b.http_address, None, &req).await {
            Ok(events) => {
                // No failover for a colocated request (nothing else holds its state): a lost
                // stream is reported; the whole request's timeout bounds a silent one.
                let quiet = Duration::from_millis(self.cfg.request_timeout_ms.max(1));
                let mut states: Vec<ChoiceState> =
                    (0..job.choices.n).map(ChoiceState::new).collect();
                if let Relayed::Lost(cause) =
                    relay(events, out, Some(route), quiet, &mut states, &job.stop).await
                {
                    let _ = out
                        .send(broken(format!("engine stream lost ({cause})")))
                        .await;
                }
            }
            Err(e) => {
                let status = match e {
                    super::upstream::OpenError::Status(_) => StatusCode::BAD_GATEWAY,
                    _ => StatusCode::SERVICE_UNAVAILABLE,
                };
                let kind = if status == StatusCode::BAD_GATEWAY {
                    "engine_error"
                } else {
                    "unavailable"
                };
                let _ = out
                    .send(Out::Fail(ApiError::new(
                        status,
                        kind,
                        format!("fallback engine: {e}"),
                    )))
                    .await;
            }
        }
    }
}

fn sampling(p: &GenerationParams) -> SamplingParams {
    let s = p.sampling();
    SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        seed: p.seed,
        max_tokens: p.max_tokens(),
    }
}

fn route(p: &WorkerStatus, d: &Ranked, retries: u32) -> RouteInfo {
    RouteInfo {
        prefill: p.worker_id.clone(),
        decode: d.worker.worker_id.clone(),
        reason: d.reason.to_string(),
        cached_blocks: d.cached_blocks,
        retries,
        ..RouteInfo::default()
    }
}

/// Sends `token` as the next token of `state`'s choice, and its end when it ends a stop rule or
/// reaches `max_tokens`. False when the client has gone.
async fn announce(out: &mpsc::Sender<Out>, state: &mut ChoiceState, token: u32, job: &Job) -> bool {
    let msg = Out::Token {
        choice: state.choice,
        token,
        logprobs: None,
    };
    if out.send(msg).await.is_err() {
        return false;
    }
    state.sent.push(token);
    let finish = if job.stop.matched(&state.sent).is_some() {
        "stop"
    } else if state.sent.len() >= job.params.max_tokens() as usize {
        "length"
    } else {
        return true;
    };
    state.done = true;
    let done = Out::Done {
        choice: state.choice,
        finish: finish.into(),
    };
    out.send(done).await.is_ok()
}

/// Forwards an engine's stream as [`Out`] messages, the engine's choice `i` as `states[i]`;
/// with `start`, the first chunk starts the answer (its seed and model, and this route).
/// Returns when every choice is done. Dropping `events` on return closes the engine's request,
/// which cancels what is left of it.
async fn relay(
    mut events: EventStream,
    out: &mpsc::Sender<Out>,
    mut start: Option<RouteInfo>,
    stall: Duration,
    states: &mut [ChoiceState],
    stop: &Stop,
) -> Relayed {
    while states.iter().any(|s| !s.done) {
        let event = tokio::select! {
            e = tokio::time::timeout(stall, events.next()) => e,
            () = out.closed() => return Relayed::Over,
        };
        let mut chunk = match event {
            Err(_) => return Relayed::Lost("stall"),
            Ok(Some(Ok(StreamEvent::Chunk(c)))) => c,
            // An engine ends a stream after the chunks with its finish reasons; a [DONE] before
            // them is a stream cut short.
            Ok(Some(Ok(StreamEvent::Done)) | Some(Err(_)) | None) => {
                return Relayed::Lost("reset");
            }
            Ok(Some(Ok(StreamEvent::Error(e)))) => {
                let _ = out.send(Out::Broken(e)).await;
                return Relayed::Over;
            }
        };
        if let Some(route) = start.take() {
            let msg = Out::Start {
                seed: chunk.seed,
                model: chunk.model.clone(),
                route,
            };
            if out.send(msg).await.is_err() {
                return Relayed::Over;
            }
        }
        // Owned: each token's log-probabilities move on to the client's chunk, uncopied.
        for choice in std::mem::take(&mut chunk.choices) {
            let Some(state) = states.get_mut(choice.index as usize) else {
                continue;
            };
            let mut logprobs = choice.tl_logprobs.into_iter().flatten();
            for &t in &choice.tokens {
                let lp = logprobs.next().map(TokenLogprobs::from);
                if state.done {
                    break;
                }
                if std::mem::take(&mut state.skip) {
                    continue;
                }
                let msg = Out::Token {
                    choice: state.choice,
                    token: t,
                    logprobs: lp,
                };
                if out.send(msg).await.is_err() {
                    return Relayed::Over;
                }
                state.sent.push(t);
                // The engine ends its sequence at the step that matched and says so; this
                // check also catches a stop string that straddles a failover (the new engine
                // sees only its own tokens).
                if stop.matched(&state.sent).is_some() {
                    state.done = true;
                    let done = Out::Done {
                        choice: state.choice,
                        finish: "stop".into(),
                    };
                    if out.send(done).await.is_err() {
                        return Relayed::Over;
                    }
                }
            }
            if let Some(f) = &choice.finish_reason
                && !state.done
            {
                state.done = true;
                let done = Out::Done {
                    choice: state.choice,
                    finish: f.clone(),
                };
                if out.send(done).await.is_err() {
                    return Relayed::Over;
                }
            }
        }
    }
    Relayed::Over
}
