//! The decode front: `POST /v1/completions`, OpenAI-compatible, built only on engines with the
//! decode role, for direct use. A thin client of the engine's [`Generator`]: it reads the
//! request's JSON, checks it as the gateway does, and runs it as the same typed request a
//! gateway sends over `EngineControl.Generate`, rendering its events with the gateway's renderer.
//! Continuing a prefill engine's handle is Generate's alone.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kvwire_grpc::pb::engine::{GenerateEvents, GenerateRequest};
use tl_engine_core::logprobs::MAX_TOP_LOGPROBS;
use tl_engine_core::request::Limits;
use tracing::Instrument;

use super::generate::{Generator, Started};
use super::state::NodeState;
use super::wire::{sampling_params, stop_rules};
use crate::api::render::{self, ChoiceEvent, ChoiceSource};
use crate::api::{
    ApiError, COMPLETION_FIELDS, CompletionRequest, Flavor, Prompt, ResponseMeta, TextRender,
    completion_id, parse_fields,
};
use crate::net::tls::PeerRole;

/// Who may call the decode front: the gateway, and operators.
pub const POLICY: &[PeerRole] = &[PeerRole::Gateway, PeerRole::Admin];

/// The decode front of one node.
#[derive(Debug)]
pub struct DecodeFront {
    state: Arc<NodeState>,
    generator: Arc<Generator>,
}

impl DecodeFront {
    /// The front of `state`'s engine, running requests on `generator`.
    #[must_use]
    pub fn new(state: Arc<NodeState>, generator: Arc<Generator>) -> Self {
        Self { state, generator }
    }

    /// The HTTP app.
    pub fn router(self: Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .with_state(self)
    }

    async fn complete(&self, body: &[u8]) -> Result<Response, ApiError> {
        let req: CompletionRequest = parse_fields(body, COMPLETION_FIELDS)?;
        let runner = self.state.runner();
        let model = runner.model().clone();
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
                    .map_err(|_| ApiError::engine_unavailable("tokenizing the prompt failed"))?
                    .map_err(|e| {
                        ApiError::bad_field("prompt", format_args!("cannot be tokenized: {e}"))
                    })?
            }
            p => p.tokens(),
        };
        let p = &req.params;
        p.params(&prompt).validate(Limits::of(model.as_ref()))?;
        let vocab = model.tokens();
        let stop = p.stop_rules(&vocab)?;
        let choices = p.choices(Flavor::Completion, MAX_TOP_LOGPROBS)?;
        let s = p.sampling();
        let structured = p.structured()?;
        let structured = structured.map(|(_, spec)| spec);
        let started = self
            .generator
            .start(GenerateRequest {
                prompt_tokens: prompt.clone(),
                sampling: Some(sampling_params(
                    &s,
                    structured.as_ref(),
                    p.seed,
                    p.max_tokens(),
                    0,
                )),
                stop: Some(stop_rules(&stop, 0)),
                n: choices.n,
                logprobs: choices.logprobs,
                cache_scope: 0,
                resume: None,
                model: p.model().unwrap_or_default().to_owned(),
            })
            .await
            .map_err(|s| match s.code() {
                tonic::Code::NotFound => ApiError::model_not_found(s.message()),
                _ => ApiError::from_status(&s),
            })?;
        let meta = ResponseMeta {
            tools: None,
            id: completion_id(),
            model: model.name().to_owned(),
            seed: started.seed,
            flavor: Flavor::Completion,
            prompt_tokens: prompt.len(),
            route: None,
            stop,
            render: TextRender::new(vocab).with(p.specials()),
            continuous_usage: p.continuous_usage(),
        };
        let src = Events::new(started);
        if p.streams() {
            // A client that went away closes the stream: dropping the events then cancels the
            // request on the engine thread.
            Ok(render::stream(meta, choices.n, src, p.include_usage(), 16))
        } else {
            let mut src = src;
            render::whole(&meta, choices.n, &mut src).await
        }
    }
}

async fn completions(
    State(front): State<Arc<DecodeFront>>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    // A child of the caller's span when its `traceparent` says so.
    let span = tracing::info_span!(
        "engine.decode",
        otel.kind = "internal",
        tl.worker = front.state.id(),
    );
    crate::telemetry::trace::adopt(&span, &headers);
    front
        .complete(&body)
        .instrument(span)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A started request's events as the renderer takes them, read from the same stream Generate
/// sends.
struct Events {
    stream: std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<GenerateEvents, tonic::Status>> + Send>,
    >,
    pending: std::collections::VecDeque<ChoiceEvent>,
}

impl Events {
    fn new(started: Started) -> Self {
        Self {
            stream: Box::pin(started.into_stream()),
            pending: std::collections::VecDeque::new(),
        }
    }
}

impl ChoiceSource for Events {
    async fn next(&mut self) -> Option<ChoiceEvent> {
        use futures_util::StreamExt;
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            match self.stream.next().await? {
                Ok(msg) => self.pending.extend(render::choice_events(msg)),
                // The engine thread stopped.
                Err(_) => return None,
            }
        }
    }

    /// The engine thread stopped: a whole response says so; a stream just ends.
    fn cut_short(&self, stream: bool) -> Option<ApiError> {
        (!stream).then(|| ApiError::engine_unavailable("the engine stopped"))
    }
}
