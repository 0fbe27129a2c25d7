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
    ApiError, CompletionRequest, ErrorDetail, GenerationParams, Prompt, RouteInfo, TlResume,
};
use crate::net::clients::EventStream;
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
}

/// What the request task tells the HTTP handler.
#[derive(Debug)]
pub enum Out {
    /// Routing done, first token known.
    First {
        /// The token.
        token: u32,
        /// The seed used.
        seed: u64,
        /// The model that answers.
        model: String,
        /// Where it went.
        route: RouteInfo,
    },
    /// A later token.
    Token(u32),
    /// Done.
    Done {
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

/// What to do with the first token of a relayed stream.
enum First {
    /// The client already has it (it came with the KvHandle).
    Drop,
    /// Announce it as the first token, with the route.
    Announce(RouteInfo),
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

/// A disaggregated request after its first token: what the client has, and how to continue it
/// on another decode engine if this one is lost.
struct Continuation<'a> {
    job: &'a Job,
    /// The request id; Prefills are `<id>-<n>`.
    id: &'a str,
    /// Prefills sent so far (the next one's `n`).
    attempts: u32,
    /// Every token the client has, in order.
    sent: Vec<u32>,
    /// The seed the first Prefill reported.
    seed: u64,
    /// Draws one token consumes: 0 greedy, 1 otherwise (every token the same, `spec/pcg32.md`).
    draws_per_token: u32,
    /// Decode engines this request lost.
    lost: Vec<String>,
}

impl Continuation<'_> {
    /// The prompt a decode engine holds once it holds the prompt and every sent token but the
    /// last (which it takes as its first input).
    fn resume_prompt(&self) -> Vec<u32> {
        let mut p = self.job.prompt.clone();
        p.extend_from_slice(&self.sent[..self.sent.len().saturating_sub(1)]);
        p
    }

    /// Tokens still to generate, the one being resumed from included.
    fn resume_max_tokens(&self) -> u32 {
        let before = self.sent.len().saturating_sub(1) as u32;
        self.job.params.max_tokens().saturating_sub(before)
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
                        id: &id,
                        attempts,
                        sent: Vec::new(),
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
            let _counted = self.inflight.enter(&d.worker.worker_id);
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
                    });
                }
                Err(s) if retryable(s.code()) => retries += 1,
                Err(s) => return Err(PrefillEnd::Refused(s)),
            }
        }
        Err(PrefillEnd::NoDecode { retries })
    }

    /// Sends the first token, then relays the decode engine's stream; when that engine is lost,
    /// continues the request on another one (up to `max_failovers` times), so that the client
    /// sees one unbroken stream.
    async fn finish_disaggregated(
        self: &Arc<Self>,
        mut c: Continuation<'_>,
        first: Prefilled,
        out: &mpsc::Sender<Out>,
    ) {
        let Prefilled {
            handle: h,
            decode,
            mut route,
        } = first;
        route.blocks_sent = Some(h.blocks_sent);
        route.blocks_deduped = Some(h.blocks_deduped);
        route.payload_bytes = Some(h.payload_bytes);
        let first = Out::First {
            token: h.first_token,
            seed: h.seed,
            model: decode.model.clone(),
            route,
        };
        let mut current = (h, decode);
        let mut next = Some(first);
        let mut failovers = 0;
        loop {
            let (h, d) = &current;
            let unclaimed = Unclaimed::new(Arc::clone(&self.upstream), &d.kv_address, &h.handle_id);
            // Announce the handle's first token (a new token: the first of the request, or the
            // one a failover's Prefill sampled).
            let msg = next.take().unwrap_or(Out::Token(h.first_token));
            if out.send(msg).await.is_err() {
                // Gone before the decode engine claimed the handle.
                unclaimed.release().await;
                return;
            }
            c.sent.push(h.first_token);
            // The first token (from the Prefill) may already end a stop rule.
            if c.job.stop.matched(&c.sent).is_some() {
                unclaimed.release().await;
                let _ = out
                    .send(Out::Done {
                        finish: "stop".into(),
                    })
                    .await;
                return;
            }
            if c.sent.len() >= c.job.params.max_tokens() as usize {
                unclaimed.release().await;
                let _ = out
                    .send(Out::Done {
                        finish: "length".into(),
                    })
                    .await;
                return;
            }
            let cause = match self.resume(&mut c, h, d, unclaimed, out).await {
                Relayed::Over => return,
                Relayed::Lost(cause) => cause,
            };
            tracing::warn!(
                request_id = %c.id,
                worker = %d.worker_id,
                cause,
                tokens_sent = c.sent.len(),
                "decode stream lost"
            );
            c.lost.push(d.worker_id.clone());
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
                        c.sent.len()
                    )))
                    .await;
                return;
            }
            failovers += 1;
            match self.continue_elsewhere(&mut c, out).await {
                Ok(p) => {
                    counted("resumed");
                    current = (p.handle, p.decode);
                }
                Err(None) => return,
                Err(Some(why)) => {
                    counted("gave_up");
                    let _ = out
                        .send(broken(format!(
                            "decode engine lost ({cause}) after {} tokens; no failover: {why}",
                            c.sent.len()
                        )))
                        .await;
                    return;
                }
            }
        }
    }

    /// Resumes handle `h` on decode engine `d` and relays its stream.
    async fn resume(
        &self,
        c: &mut Continuation<'_>,
        h: &KvHandle,
        d: &WorkerStatus,
        unclaimed: Unclaimed,
        out: &mpsc::Sender<Out>,
    ) -> Relayed {
        let req = CompletionRequest {
            prompt: Prompt::Tokens(c.resume_prompt()),
            params: GenerationParams {
                model: None,
                seed: Some(h.seed),
                stream: Some(true),
                max_tokens: Some(c.resume_max_tokens()),
                ..c.job.params.clone()
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
                // stream is what frees its blocks. Its first chunk repeats first_token, which
                // the client already has.
                unclaimed.claimed();
                relay(events, out, First::Drop, stall, &mut c.sent, &c.job.stop).await
            }
            // Refused, unreachable, or silent: the handle is released in the background (a
            // partitioned engine must not hold up the failover).
            Ok(Err(_)) => Relayed::Lost("reset"),
            Err(_) => Relayed::Lost("stall"),
        }
    }

    /// After decode engines in `c.lost` were lost: a Prefill of the prompt and every token sent
    /// on a prefill engine, with the generator advanced past the draws those tokens used, pushed
    /// to another decode engine. `Err(None)` when the client left meanwhile.
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
        prompt.extend_from_slice(&c.sent);
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
        let max_tokens = c
            .job
            .params
            .max_tokens()
            .saturating_sub(c.sent.len() as u32);
        let mut sp = sampling(&c.job.params);
        sp.seed = Some(c.seed);
        sp.max_tokens = max_tokens;
        let offset = c.draws_per_token.saturating_mul(c.sent.len() as u32);
        match self
            .prefill(
                c.id,
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
                ..job.params.clone()
            },
            tl_resume: None,
        };
        match self.upstream.stream(&b.http_address, None, &req).await {
            Ok(events) => {
                // No failover for a colocated request (nothing else holds its state): a lost
                // stream is reported; the whole request's timeout bounds a silent one.
                let quiet = Duration::from_millis(self.cfg.request_timeout_ms.max(1));
                let mut sent = Vec::new();
                if let Relayed::Lost(cause) = relay(
                    events,
                    out,
                    First::Announce(route),
                    quiet,
                    &mut sent,
                    &job.stop,
                )
                .await
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

/// Forwards an engine's stream as [`Out`] messages; `first` says what becomes of the first
/// token. Every token the client was sent is appended to `sent`. Dropping `events` on return
/// closes the engine's request, which cancels its sequence.
async fn relay(
    mut events: EventStream,
    out: &mpsc::Sender<Out>,
    first: First,
    stall: Duration,
    sent: &mut Vec<u32>,
    stop: &Stop,
) -> Relayed {
    let mut first = Some(first);
    loop {
        let event = tokio::select! {
            e = tokio::time::timeout(stall, events.next()) => e,
            () = out.closed() => return Relayed::Over,
        };
        let chunk = match event {
            Err(_) => return Relayed::Lost("stall"),
            Ok(Some(Ok(StreamEvent::Chunk(c)))) => c,
            // An engine ends a stream after the chunk with its finish reason; a [DONE] before
            // it is a stream cut short.
            Ok(Some(Ok(StreamEvent::Done)) | Some(Err(_)) | None) => {
                return Relayed::Lost("reset");
            }
            Ok(Some(Ok(StreamEvent::Error(e)))) => {
                let _ = out.send(Out::Broken(e)).await;
                return Relayed::Over;
            }
        };
        for choice in &chunk.choices {
            for &t in &choice.tokens {
                let msg = match first.take() {
                    None => Out::Token(t),
                    Some(First::Drop) => continue,
                    Some(First::Announce(route)) => Out::First {
                        token: t,
                        seed: chunk.seed,
                        model: chunk.model.clone(),
                        route,
                    },
                };
                if out.send(msg).await.is_err() {
                    return Relayed::Over;
                }
                sent.push(t);
                // The engine ends its sequence at the step that matched and says so; this
                // check also catches a stop string that straddles a failover (the new engine
                // sees only its own tokens). Dropping the stream cancels what is left.
                if stop.matched(sent).is_some() {
                    let _ = out
                        .send(Out::Done {
                            finish: "stop".into(),
                        })
                        .await;
                    return Relayed::Over;
                }
            }
            if let Some(f) = &choice.finish_reason {
                let _ = out.send(Out::Done { finish: f.clone() }).await;
                return Relayed::Over;
            }
        }
    }
}
