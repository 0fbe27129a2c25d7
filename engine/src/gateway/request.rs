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

/// A request that passed validation.
#[derive(Clone, Debug)]
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Its parameters, valid.
    pub params: GenerationParams,
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

/// A Prefill that failed this way is worth trying on the next decode engine.
fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::DataLoss | Code::FailedPrecondition | Code::Unavailable
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

impl Gateway {
    /// Runs one request, sending what happens to `out`. Returns when the request is over or the
    /// client has gone (then after cleaning up).
    pub(super) async fn drive(self: Arc<Self>, job: Job, out: mpsc::Sender<Out>) {
        let id = self.request_id();
        let workers = self.registry.snapshot(Instant::now());
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
        if let Some(p) = &plan.prefill
            && let Ok(ctl) = self.upstream.control(&p.grpc_address)
        {
            for d in plan.decode.iter().take(2) {
                let req = PrefillRequest {
                    request_id: format!("{id}-{retries}"),
                    prompt_tokens: job.prompt.clone(),
                    sampling: Some(sampling(&job.params)),
                    decode_target: d.worker.kv_address.clone(),
                };
                let route = route(p, d, retries);
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
                        return;
                    }
                };
                match res {
                    Ok(h) => {
                        self.finish_disaggregated(&job, h, &d.worker, route, &out)
                            .await;
                        return;
                    }
                    Err(s) if retryable(s.code()) => retries += 1,
                    Err(s) => {
                        let _ = out.send(Out::Fail(prefill_failure(&s))).await;
                        return;
                    }
                }
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

    async fn finish_disaggregated(
        self: &Arc<Self>,
        job: &Job,
        h: KvHandle,
        d: &WorkerStatus,
        mut route: RouteInfo,
        out: &mpsc::Sender<Out>,
    ) {
        let unclaimed = Unclaimed::new(Arc::clone(&self.upstream), &d.kv_address, &h.handle_id);
        route.blocks_sent = Some(h.blocks_sent);
        route.blocks_deduped = Some(h.blocks_deduped);
        route.payload_bytes = Some(h.payload_bytes);
        let first = Out::First {
            token: h.first_token,
            seed: h.seed,
            model: d.model.clone(),
            route,
        };
        let max_tokens = job.params.max_tokens();
        if out.send(first).await.is_err() || max_tokens <= 1 {
            // Gone before the decode engine claimed the handle (or nothing left to decode).
            unclaimed.release().await;
            if max_tokens <= 1 {
                let _ = out
                    .send(Out::Done {
                        finish: "length".into(),
                    })
                    .await;
            }
            return;
        }
        let req = CompletionRequest {
            prompt: Prompt::Tokens(job.prompt.clone()),
            params: GenerationParams {
                model: None,
                seed: Some(h.seed),
                stream: Some(true),
                ..job.params.clone()
            },
            tl_resume: Some(TlResume {
                first_token: h.first_token,
                rng_draws_consumed: h.rng_draws_consumed,
            }),
        };
        match self
            .upstream
            .stream(&d.http_address, Some(&h.handle_id), &req)
            .await
        {
            Ok(events) => {
                // A 200 means the decode engine claimed the handle; from here, dropping the
                // stream is what frees its blocks. Its first chunk repeats first_token, which
                // the client already has.
                unclaimed.claimed();
                relay(events, out, First::Drop).await;
            }
            Err(e) => {
                unclaimed.release().await;
                let _ = out.send(broken(format!("decode engine: {e}"))).await;
            }
        }
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
            Ok(events) => relay(events, out, First::Announce(route)).await,
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
/// token. Dropping `events` on return closes the engine's request, which cancels its sequence.
async fn relay(mut events: EventStream, out: &mpsc::Sender<Out>, first: First) {
    let mut first = Some(first);
    loop {
        let event = tokio::select! {
            e = events.next() => e,
            () = out.closed() => return,
        };
        let msgs: Vec<Out> = match event {
            Some(Ok(StreamEvent::Chunk(c))) => {
                let mut msgs = Vec::new();
                for choice in &c.choices {
                    for &t in &choice.tokens {
                        match first.take() {
                            None => msgs.push(Out::Token(t)),
                            Some(First::Drop) => {}
                            Some(First::Announce(route)) => msgs.push(Out::First {
                                token: t,
                                seed: c.seed,
                                model: c.model.clone(),
                                route,
                            }),
                        }
                    }
                    if let Some(f) = &choice.finish_reason {
                        msgs.push(Out::Done { finish: f.clone() });
                    }
                }
                msgs
            }
            Some(Ok(StreamEvent::Done)) => return,
            Some(Ok(StreamEvent::Error(e))) => vec![Out::Broken(e)],
            Some(Err(_)) | None => vec![broken("engine stream ended early")],
        };
        for m in msgs {
            let end = matches!(m, Out::Broken(_));
            if out.send(m).await.is_err() || end {
                return;
            }
        }
    }
}
