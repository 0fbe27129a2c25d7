//! The decode front: `POST /v1/completions`, OpenAI-compatible, built only on engines with the
//! decode role. With `X-TL-KV-Handle` and `tl_resume` it continues a request a prefill engine
//! started (claiming the transferred blocks); without, it runs the request here.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kvwire::prompt_hashes;
use kvwire_grpc::KvReceiver;
use tl_engine_core::engine::{Choices, Mode, Request, Resume};
use tl_engine_core::logprobs::MAX_TOP_LOGPROBS;
use tl_engine_core::pool::Blocks;
use tl_engine_core::request::Limits;
use tl_engine_core::rng::entropy_seed;
use tl_engine_core::sampler::Sampling;
use tl_engine_core::stop::Stop;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::runner::SeqEvent;
use super::state::NodeState;
use crate::api::render::{self, ChoiceEvent, ChoiceSource};
use crate::api::{
    ApiError, CACHE_SCOPE_HEADER, CompletionRequest, ENGINE_COMPLETION_FIELDS, Flavor,
    KV_HANDLE_HEADER, Prompt, ResponseMeta, TextRender, TlResume, completion_id, parse_fields,
};
use crate::net::tls::PeerRole;

/// The tenant scope a gateway named in [`CACHE_SCOPE_HEADER`] (0, the shared scope, without).
fn cache_scope(headers: &HeaderMap) -> u64 {
    headers
        .get(CACHE_SCOPE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .unwrap_or(0)
}

/// Who may call the decode front: the gateway, and operators.
pub const POLICY: &[PeerRole] = &[PeerRole::Gateway, PeerRole::Admin];

/// The decode front of one node.
#[derive(Debug)]
pub struct DecodeFront {
    state: Arc<NodeState>,
    receiver: Arc<KvReceiver>,
    inflight: Arc<tokio::sync::Semaphore>,
}

impl DecodeFront {
    /// The front of `state`'s engine, resuming the handles `receiver` holds, serving at most
    /// `max_inflight` requests at once (429 beyond).
    #[must_use]
    pub fn new(state: Arc<NodeState>, receiver: Arc<KvReceiver>, max_inflight: usize) -> Self {
        Self {
            state,
            receiver,
            inflight: Arc::new(tokio::sync::Semaphore::new(max_inflight)),
        }
    }

    /// The HTTP app.
    pub fn router(self: Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .with_state(self)
    }

    /// Claims `handle` for `prompt` and starts decoding from it.
    fn resume(
        &self,
        handle: &str,
        prompt: &[u32],
        req: &CompletionRequest,
        sampling: Sampling,
        stop: Stop,
        choices: Choices,
    ) -> Result<(u64, mpsc::UnboundedReceiver<SeqEvent>), ApiError> {
        let not_found = ApiError::not_found;
        let Some(TlResume {
            first_token,
            rng_draws_consumed,
        }) = req.tl_resume
        else {
            return Err(ApiError::bad_request(
                "X-TL-KV-Handle needs a tl_resume body field",
            ));
        };
        let Some(seed) = req.params.seed else {
            return Err(ApiError::bad_request(
                "resuming needs the seed the prefill engine reported",
            ));
        };
        let Some(view) = self.receiver.peek(handle) else {
            return Err(not_found(format!(
                "unknown or already claimed KV handle {handle:?}"
            )));
        };
        let (hashes, tokens) = (view.hashes, view.tokens);
        let runner = self.state.runner();
        let b = runner.model().shape().block_tokens() as usize;
        let mut expect = prompt_hashes(prompt, b);
        if !prompt.len().is_multiple_of(b) {
            expect.push(0);
        }
        // The hashes are only an index: when the chunks carried their tokens (every sender of
        // this project), the prompt is compared token by token, the tail's included.
        let same_tokens = view.prompt.as_deref().is_none_or(|p| p == prompt);
        if hashes != expect || tokens != prompt.len() as u64 || !same_tokens {
            // Not this prompt's blocks: leave the handle to its owner.
            return Err(ApiError::conflict(format!(
                "KV handle {handle:?} holds {tokens} tokens in other blocks than this prompt's {}",
                prompt.len()
            )));
        }
        let Some(claimed) = self.receiver.claim(handle) else {
            return Err(not_found(format!(
                "KV handle {handle:?} was claimed meanwhile"
            )));
        };
        let scope = claimed.scope();
        let blocks = Blocks::new(runner.pool().clone(), claimed.into_ids());
        let (_, events) = runner.resume(Resume {
            prompt: prompt.to_vec(),
            blocks,
            first_token,
            draws: u64::from(rng_draws_consumed),
            sampling,
            seed,
            max_tokens: req.params.max_tokens(),
            stop,
            choices,
            scope,
        });
        Ok((seed, events))
    }

    async fn complete(&self, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
        let req: CompletionRequest = parse_fields(body, ENGINE_COMPLETION_FIELDS)?;
        let runner = self.state.runner();
        let model = runner.model().clone();
        if let Some(m) = req.params.model()
            && m != model.name()
        {
            return Err(ApiError::model_not_found(format!(
                "model {m:?} is not served here"
            )));
        }
        let handle = headers.get(KV_HANDLE_HEADER).and_then(|v| v.to_str().ok());
        // A draining engine takes no new request, but finishes the handles pushed before.
        if self.state.is_draining() && handle.is_none() {
            return Err(ApiError::unavailable("this engine is draining"));
        }
        // Nor one that stopped decoding (its role changed): the gateway tries another.
        if handle.is_none() && !self.state.serving().decodes() {
            return Err(ApiError::wrong_role(format!(
                "worker {} serves as {} now and takes no new request here",
                self.state.id(),
                self.state.serving().name()
            )));
        }
        let Ok(permit) = Arc::clone(&self.inflight).try_acquire_owned() else {
            return Err(ApiError::rate_limited(
                "too many requests in flight on this engine",
            ));
        };
        if matches!(&req.prompt, Prompt::Texts(v) if v.len() != 1)
            || matches!(&req.prompt, Prompt::TokenLists(v) if v.len() != 1)
        {
            return Err(ApiError::bad_field(
                "prompt",
                "is a list of prompts; an engine's front takes one a request (send lists to \
                 the gateway)",
            ));
        }
        // Text through the model's own tokenizer, off the async workers (a 2 MiB prompt takes
        // about half a second).
        let prompt = match &req.prompt {
            Prompt::Text(s) => {
                let (m, s) = (model.clone(), s.clone());
                tokio::task::spawn_blocking(move || m.tokenize(&s))
                    .await
                    .map_err(|_| engine_error("tokenizing the prompt failed"))?
                    .map_err(|e| {
                        ApiError::bad_field("prompt", format_args!("cannot be tokenized: {e}"))
                    })?
            }
            p => p.tokens(),
        };
        let sampling = req
            .params
            .params(&prompt)
            .validate(Limits::of(model.as_ref()))?;
        let vocab = model.tokens();
        let stop = req.params.stop_rules(&vocab)?;
        // The gateway passes chat's alternatives on as a completion's count: the front takes
        // up to chat's bound.
        let choices = req.params.choices(Flavor::Completion, MAX_TOP_LOGPROBS)?;
        let (seed, events) = match handle {
            Some(handle) => self.resume(handle, &prompt, &req, sampling, stop.clone(), choices)?,
            None => {
                let seed = req.params.seed.unwrap_or_else(entropy_seed);
                let (_, ev) = runner.submit(Request {
                    prompt: prompt.clone(),
                    sampling,
                    seed,
                    max_tokens: req.params.max_tokens(),
                    mode: Mode::Generate,
                    draws_offset: 0,
                    stop: stop.clone(),
                    choices,
                    scope: cache_scope(headers),
                });
                (seed, ev)
            }
        };
        let meta = ResponseMeta {
            id: completion_id(),
            model: model.name().to_owned(),
            seed,
            flavor: Flavor::Completion,
            prompt_tokens: prompt.len(),
            route: None,
            stop,
            render: TextRender::new(vocab).with(req.params.specials()),
            continuous_usage: req.params.continuous_usage(),
        };
        let mut src = Sequences {
            events,
            _permit: permit,
        };
        if req.params.streams() {
            // A client that went away closes the stream: dropping the events then cancels the
            // request on the engine thread.
            Ok(render::stream(
                meta,
                choices.n,
                src,
                req.params.include_usage(),
                16,
            ))
        } else {
            render::whole(&meta, choices.n, &mut src).await
        }
    }
}

async fn completions(
    State(front): State<Arc<DecodeFront>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    // The decode side of a request, a child of the caller's span (the gateway's) when its
    // `traceparent` says so.
    let span = tracing::info_span!(
        "engine.decode",
        otel.kind = "internal",
        tl.worker = front.state.id(),
        kv.handle_id = headers
            .get(KV_HANDLE_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default(),
    );
    crate::telemetry::trace::adopt(&span, &headers);
    front
        .complete(&headers, &body)
        .instrument(span)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn engine_error(message: impl Into<String>) -> ApiError {
    ApiError::engine_unavailable(message)
}

/// An engine's events for one request, as the renderer takes them; the request counts as in
/// flight (the permit) until they end.
struct Sequences {
    events: mpsc::UnboundedReceiver<SeqEvent>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl ChoiceSource for Sequences {
    async fn next(&mut self) -> Option<ChoiceEvent> {
        loop {
            return Some(match self.events.recv().await? {
                SeqEvent::Token {
                    choice,
                    token,
                    logprobs,
                    ..
                } => ChoiceEvent::Token {
                    choice,
                    token,
                    logprobs,
                },
                SeqEvent::Finished { choice, reason } => ChoiceEvent::Done {
                    choice,
                    finish: reason.into(),
                },
                SeqEvent::Refused(e) => ChoiceEvent::Failed(e.into()),
                SeqEvent::Failed(e) => ChoiceEvent::Failed(engine_error(e.to_string())),
                SeqEvent::Prefilled(_) => continue,
            });
        }
    }

    /// The engine thread stopped: a whole response says so; a stream just ends, and the
    /// gateway, seeing no finish reason, fails over.
    fn cut_short(&self, stream: bool) -> Option<ApiError> {
        (!stream).then(|| engine_error("the engine stopped"))
    }
}
