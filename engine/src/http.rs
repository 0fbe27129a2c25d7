//! The engine's HTTP front: `POST /v1/completions`, OpenAI-compatible, served by engines with
//! the decode role. With `X-TL-KV-Handle` and `tl_resume` it continues a request a prefill
//! engine started (claiming the transferred blocks); without, it runs the request here.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kvwire::prompt_hashes;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::control::Worker;
use crate::engine::{FinishReason, Mode, Request};
use crate::model::{decode_text, encode_text};
use crate::pool::Blocks;
use crate::runner::{Resume, SeqEvent};
use crate::sampler::{Sampling, SamplingRequest};

/// The header naming a transferred KV handle.
pub const KV_HANDLE_HEADER: &str = "x-tl-kv-handle";

/// A prompt as token ids or as text (byte-level tokenizer).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Prompt {
    /// Token ids.
    Tokens(Vec<u32>),
    /// Text.
    Text(String),
}

impl Prompt {
    /// The token ids.
    #[must_use]
    pub fn tokens(&self) -> Vec<u32> {
        match self {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Text(s) => encode_text(s),
        }
    }
}

/// Where a prefill engine left a request.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
pub struct TlResume {
    /// The first token, sampled by the prefill engine.
    pub first_token: u32,
    /// Draws it consumed.
    pub rng_draws_consumed: u32,
}

/// `POST /v1/completions` body. Unknown OpenAI fields are ignored. temperature and top_p are
/// parsed as f32, as on every other path.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// Model; omitted means this engine's.
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Completion length (OpenAI's default, 16, when omitted).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// 0 = greedy (the default).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass (default 1).
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k (default 0, off).
    #[serde(default)]
    pub top_k: Option<u32>,
    /// Seed; the engine picks one when omitted (required to resume).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Resume point, with the `X-TL-KV-Handle` header.
    #[serde(default)]
    pub tl_resume: Option<TlResume>,
}

/// An OpenAI-style error response.
#[must_use]
pub fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body =
        json!({ "error": { "message": message.into(), "type": kind, "code": status.as_u16() } });
    (status, Json(body)).into_response()
}

fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// A completion id.
#[must_use]
pub fn completion_id() -> String {
    format!("cmpl-{:016x}", crate::cli::pick_seed())
}

/// Seconds since the Unix epoch, for OpenAI's `created`.
#[must_use]
pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The reason string OpenAI uses.
#[must_use]
pub fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length | FinishReason::Context => "length",
    }
}

/// The HTTP app of an engine.
pub fn router(worker: Arc<Worker>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .with_state(worker)
}

async fn completions(
    State(w): State<Arc<Worker>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad(format!("malformed request: {e}")),
    };
    let model = w.runner().model().clone();
    if let Some(m) = &req.model
        && !m.is_empty()
        && m != model.name()
    {
        return error(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("model {m:?} is not served here"),
        );
    }
    if w.is_draining() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "this engine is draining",
        );
    }
    let prompt = req.prompt.tokens();
    if prompt.is_empty() {
        return bad("empty prompt");
    }
    let vocab = model.vocab();
    if let Some(t) = prompt.iter().find(|t| **t >= vocab) {
        return bad(format!("token {t} is outside the vocabulary of {vocab}"));
    }
    if prompt.len() > model.max_context() as usize {
        return bad(format!(
            "prompt of {} tokens exceeds the context of {}",
            prompt.len(),
            model.max_context()
        ));
    }
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens == 0 {
        return bad("max_tokens must be >= 1");
    }
    let sreq = SamplingRequest {
        temperature: req.temperature.unwrap_or(0.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.unwrap_or(0),
    };
    let sampling = match Sampling::new(sreq, vocab) {
        Ok(s) => s,
        Err(e) => return bad(e.to_string()),
    };
    let stream = req.stream.unwrap_or(false);
    let handle = headers
        .get(KV_HANDLE_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);

    let (seed, first, events) = match handle {
        Some(handle) => {
            let Some(resume) = req.tl_resume else {
                return bad("X-TL-KV-Handle needs a tl_resume body field");
            };
            let Some(seed) = req.seed else {
                return bad("resuming needs the seed the prefill engine reported");
            };
            let Some(rx) = w.receiver() else {
                return error(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    "this engine receives no KV",
                );
            };
            let Some((hashes, tokens)) = rx.peek(&handle) else {
                return error(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("unknown or already claimed KV handle {handle:?}"),
                );
            };
            let b = model.shape().block_tokens() as usize;
            let mut expect = prompt_hashes(&prompt, b);
            if !prompt.len().is_multiple_of(b) {
                expect.push(0);
            }
            if hashes != expect || tokens != prompt.len() as u64 {
                // Not this prompt's blocks: leave the handle to its owner.
                return error(
                    StatusCode::CONFLICT,
                    "conflict",
                    format!(
                        "KV handle {handle:?} holds {tokens} tokens in other blocks than this prompt's {}",
                        prompt.len()
                    ),
                );
            }
            let Some(claimed) = rx.claim(&handle) else {
                return error(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("KV handle {handle:?} was claimed meanwhile"),
                );
            };
            let blocks = Blocks::new(w.runner().pool().clone(), claimed.into_ids());
            let (_, ev) = w.runner().resume(Resume {
                prompt: prompt.clone(),
                blocks,
                first_token: resume.first_token,
                draws: u64::from(resume.rng_draws_consumed),
                sampling,
                seed,
                max_tokens,
            });
            (seed, Some(resume.first_token), ev)
        }
        None => {
            let seed = req.seed.unwrap_or_else(crate::cli::pick_seed);
            let (_, ev) = w.runner().submit(Request {
                prompt: prompt.clone(),
                sampling,
                seed,
                max_tokens,
                mode: Mode::Generate,
            });
            (seed, None, ev)
        }
    };
    let meta = Meta {
        id: completion_id(),
        model: model.name().to_owned(),
        prompt_tokens: prompt.len(),
        seed,
    };
    if stream {
        sse(meta, first, events)
    } else {
        collect(meta, first, events).await
    }
}

struct Meta {
    id: String,
    model: String,
    prompt_tokens: usize,
    seed: u64,
}

async fn collect(
    meta: Meta,
    first: Option<u32>,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
) -> Response {
    let mut tokens: Vec<u32> = first.into_iter().collect();
    let reason = loop {
        match events.recv().await {
            Some(SeqEvent::Token { token, .. }) => tokens.push(token),
            Some(SeqEvent::Finished(r)) => break r,
            Some(SeqEvent::Refused(e)) => return bad(e.to_string()),
            Some(SeqEvent::Failed(e)) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "engine_error",
                    e.to_string(),
                );
            }
            Some(SeqEvent::Prefilled(_)) => {}
            None => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "engine_error",
                    "the engine stopped",
                );
            }
        }
    };
    let body = json!({
        "id": meta.id,
        "object": "text_completion",
        "created": now_secs(),
        "model": meta.model,
        "seed": meta.seed,
        "choices": [{
            "index": 0,
            "text": decode_text(&tokens),
            "tokens": tokens,
            "logprobs": Value::Null,
            "finish_reason": finish_str(reason),
        }],
        "usage": {
            "prompt_tokens": meta.prompt_tokens,
            "completion_tokens": tokens.len(),
            "total_tokens": meta.prompt_tokens + tokens.len(),
        },
    });
    Json(body).into_response()
}

/// One streamed chunk in OpenAI's shape, with the token ids as an extension.
#[must_use]
pub fn chunk_json(
    id: &str,
    model: &str,
    seed: u64,
    tokens: &[u32],
    finish: Option<&str>,
) -> String {
    json!({
        "id": id,
        "object": "text_completion",
        "created": now_secs(),
        "model": model,
        "seed": seed,
        "choices": [{ "index": 0, "text": decode_text(tokens), "tokens": tokens, "logprobs": Value::Null, "finish_reason": finish }],
    })
    .to_string()
}

fn sse(meta: Meta, first: Option<u32>, mut events: mpsc::UnboundedReceiver<SeqEvent>) -> Response {
    let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(16);
    tokio::spawn(async move {
        let send = |data: String| {
            let tx = tx.clone();
            async move { tx.send(Ok(SseEvent::default().data(data))).await.is_ok() }
        };
        if let Some(t) = first
            && !send(chunk_json(&meta.id, &meta.model, meta.seed, &[t], None)).await
        {
            return;
        }
        loop {
            let data = match events.recv().await {
                Some(SeqEvent::Token { token, .. }) => chunk_json(&meta.id, &meta.model, meta.seed, &[token], None),
                Some(SeqEvent::Finished(r)) => {
                    let _ = send(chunk_json(&meta.id, &meta.model, meta.seed, &[], Some(finish_str(r)))).await;
                    break;
                }
                Some(SeqEvent::Failed(e)) => json!({ "error": { "message": e.to_string(), "type": "engine_error" } }).to_string(),
                Some(SeqEvent::Refused(e)) => json!({ "error": { "message": e.to_string(), "type": "invalid_request_error" } }).to_string(),
                Some(SeqEvent::Prefilled(_)) => continue,
                None => break,
            };
            // A client that went away closes the stream: dropping `events` then cancels the
            // sequence on the engine thread.
            if !send(data).await {
                return;
            }
        }
        let _ = send("[DONE]".to_owned()).await;
    });
    Sse::new(ReceiverStream::new(rx)).into_response()
}
