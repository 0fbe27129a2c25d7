//! The gateway's HTTP front: `POST /v1/completions`, `POST /v1/chat/completions` (whole or
//! streamed), `GET /v1/models`, `GET /health`, `GET /workers`. Each request is validated (the
//! core's one validation) before anything reaches an engine, admitted under `max_inflight`
//! (429), run by its request task under `request_timeout_ms` (504), and rendered from the task's
//! [`Out`] messages.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde_json::json;
use tl_engine_core::model::{BYTE_VOCAB, encode_text};
use tl_engine_core::request::Limits;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::request::{Job, Out};
use super::state::Gateway;
use super::tenant::{EndUser, MAX_CACHE_SALT};
use super::text::GatewayText;
use crate::api::render::{self, ChoiceEvent, ChoiceSource};
use crate::api::tools;
use crate::api::{
    ApiError, CHAT_FIELDS, COMPLETION_FIELDS, ChatRequest, CompletionRequest, Flavor,
    GenerationParams, MAX_COMPLETION_LOGPROBS, Prompt, ResponseMeta, TextRender, completion_id,
    parse_fields, render_chat,
};
use crate::structured::{Grammars, Spec};
use crate::telemetry::metrics::SharedMetrics;

/// What the gateway can check without an engine: the byte-level tokenizer's vocabulary. The
/// context length is the engine's to check, with the same validation and message.
const GATEWAY_LIMITS: Limits = Limits {
    vocab: BYTE_VOCAB,
    max_context: None,
};

/// The gateway's HTTP app.
pub fn router(g: Arc<Gateway>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/health", get(health))
        .route("/workers", get(workers))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            g.api_keys.clone(),
            super::api_keys::require_key,
        ))
        // Before the key: a web page's request is refused whatever it carries.
        .layer(axum::middleware::from_fn_with_state(
            super::browser::BrowserPolicy::new(
                &g.cfg.allowed_hosts,
                &g.cfg.allowed_origins,
                g.cfg.json_only,
            ),
            super::browser::guard,
        ))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&g.metrics),
            crate::telemetry::metrics::count_requests,
        ))
        .with_state(g)
}

/// A request's token timing: time to first token from its arrival, then time per output token
/// after the first, recorded when it ends.
struct Meter {
    metrics: SharedMetrics,
    arrived: Instant,
    first_at: Option<Instant>,
    tokens: u32,
}

impl Meter {
    fn new(metrics: SharedMetrics, arrived: Instant) -> Self {
        Self {
            metrics,
            arrived,
            first_at: None,
            tokens: 0,
        }
    }

    fn token(&mut self) {
        if self.first_at.is_none() {
            let now = Instant::now();
            self.metrics
                .ttft_seconds
                .observe((now - self.arrived).as_secs_f64());
            self.first_at = Some(now);
        }
        self.tokens += 1;
    }

    fn done(&self) {
        if let Some(first) = self.first_at
            && self.tokens > 1
        {
            let per = first.elapsed().as_secs_f64() / f64::from(self.tokens - 1);
            self.metrics.tpot_seconds.observe(per);
        }
    }
}

/// The request's caller; the key middleware sets it on every request.
type EndUserExt = Option<axum::Extension<EndUser>>;

fn caller_of(c: EndUserExt) -> EndUser {
    c.map(|axum::Extension(c)| c).unwrap_or(EndUser {
        tenant: Vec::new(),
        admin: false,
    })
}

async fn completions(
    State(g): State<Arc<Gateway>>,
    caller: EndUserExt,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let span = request_span("POST /v1/completions", &g.cfg.id, &headers);
    let r = match parse_fields::<CompletionRequest>(&body, COMPLETION_FIELDS) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let listed = matches!(r.prompt, Prompt::Texts(_) | Prompt::TokenLists(_));
    let prompts = r.prompt.split();
    if prompts.is_empty() {
        return ApiError::bad_field("prompt", "is an empty list").into_response();
    }
    let prep = Prep::Completion { prompts, listed };
    start(
        g,
        caller_of(caller),
        prep,
        r.params,
        Flavor::Completion,
        None,
    )
    .instrument(span)
    .await
}

/// What a request's prompts are before they are token ids.
enum Prep {
    /// A completion's prompts: texts through the checkpoint's tokenizer (special tokens added
    /// as transformers adds them), token lists as they are.
    Completion { prompts: Vec<Prompt>, listed: bool },
    /// A chat's messages (and `tools`, which the template sees), through the checkpoint's
    /// chat template (which writes its own special tokens, so none are added again), or the
    /// byte tokenizer's rendering.
    Chat(Vec<tl_llama::Message>, Option<serde_json::Value>),
}

impl Prep {
    /// The prompts' token ids: CPU work a request's body decides (a 2 MB prompt takes about
    /// half a second to tokenize), run where it cannot stall the async workers.
    fn run(self, text: Option<&GatewayText>) -> Result<Vec<Vec<u32>>, ApiError> {
        match self {
            Prep::Completion { prompts, listed } => {
                let mut out = Vec::with_capacity(prompts.len());
                for (i, p) in prompts.into_iter().enumerate() {
                    let at = || {
                        if listed {
                            format!("prompt[{i}]")
                        } else {
                            "prompt".to_owned()
                        }
                    };
                    out.push(match (text, &p) {
                        (Some(t), Prompt::Text(s)) => t.text.encode(s, true).map_err(|e| {
                            ApiError::bad_field(at(), format_args!("cannot be tokenized: {e}"))
                        })?,
                        _ => p.tokens(),
                    });
                }
                Ok(out)
            }
            Prep::Chat(messages, tools) => match text {
                Some(t) if t.text.has_chat_template() => {
                    let s = t
                        .render_chat(&messages, tools.as_ref())
                        .map_err(|e| match e {
                            // The server's fault, not the messages': a 503 the client may retry.
                            tl_llama::TextError::Server(_) => ApiError::unavailable(e.to_string()),
                            _ => ApiError::bad_field("messages", e),
                        })?;
                    let ids = t
                        .text
                        .encode(&s, false)
                        .map_err(|e| ApiError::bad_field("messages", e))?;
                    Ok(vec![ids])
                }
                // A tokenizer without a template (a base model): its ids are not bytes, and
                // no turn format is known. Refused as vLLM refuses it.
                Some(_) => Err(ApiError::bad_field(
                    "messages",
                    "cannot be rendered: the model has no chat template (a base model); send \
                     the text to /v1/completions",
                )),
                None => Ok(vec![encode_text(&render_chat_text(&messages))]),
            },
        }
    }

    /// Whether it is cheap enough to run inline: token lists, or the byte tokenizer on a
    /// body the size bound already holds.
    fn is_cheap(&self, text: Option<&GatewayText>) -> bool {
        text.is_none()
            || matches!(self, Prep::Completion { prompts, .. }
                if prompts.iter().all(|p| !matches!(p, Prompt::Text(_))))
    }
}

/// The byte tokenizer's chat rendering of `messages`.
fn render_chat_text(messages: &[tl_llama::Message]) -> String {
    let m: Vec<crate::api::ChatMessage> = messages
        .iter()
        .map(|m| crate::api::ChatMessage::new(&m.role, &m.content))
        .collect();
    render_chat(&m)
}

/// Runs `prep` on the blocking pool, at most `prep_threads` at once, within the request's
/// timeout: a slow tokenizer or template holds a pool thread, never an async worker, and the
/// pool's place is held until the work really ends (a template's instruction bound ends it).
/// Places go to the tenants in turn ([`super::fair`]): one key's flood of long prompts delays
/// another key's request by at most one prep per waiting key.
///
/// A structured output's spec is compiled here too, once, to refuse a bad one before any
/// engine sees it (400 naming the field, with the library's reason).
async fn prepare(
    g: &Arc<Gateway>,
    tenant: &[u8],
    prep: Prep,
    structured: Option<(String, Spec)>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let text = g.text.clone();
    let cheap = prep.is_cheap(text.as_deref()) && structured.is_none();
    let check = move || match &structured {
        Some((field, spec)) => Grammars::bytes()
            .compile(spec)
            .map(drop)
            .map_err(|e| ApiError::bad_field(field.as_str(), e)),
        None => Ok(()),
    };
    if cheap {
        return prep.run(text.as_deref());
    }
    let deadline = Instant::now() + Duration::from_millis(g.cfg.request_timeout_ms);
    let place = tokio::time::timeout_at(deadline.into(), g.prep.acquire(tenant))
        .await
        .map_err(|_| timed_out())?;
    let work = tokio::task::spawn_blocking(move || {
        let _place = place;
        check()?;
        prep.run(text.as_deref())
    });
    match tokio::time::timeout_at(deadline.into(), work).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(ApiError::engine("preparing the prompt failed")),
        Err(_) => Err(timed_out()),
    }
}

/// The gateway's SERVER span of one request, a child of the client's own `traceparent` when
/// it sends one.
fn request_span(
    name: &'static str,
    gateway: &str,
    headers: &axum::http::HeaderMap,
) -> tracing::Span {
    let span = tracing::info_span!(
        "http",
        otel.name = name,
        otel.kind = "server",
        tl.worker = gateway
    );
    crate::telemetry::trace::adopt(&span, headers);
    span
}

async fn chat(
    State(g): State<Arc<Gateway>>,
    caller: EndUserExt,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let span = request_span("POST /v1/chat/completions", &g.cfg.id, &headers);
    let r: ChatRequest = match parse_fields(&body, CHAT_FIELDS) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let m: Vec<tl_llama::Message> = r
        .messages
        .iter()
        .map(|m| tl_llama::Message {
            role: m.role.clone(),
            content: m.text(),
        })
        .collect();
    let tools = match tools::tool_mode(
        r.tools.as_deref(),
        r.tool_choice.as_ref(),
        r.parallel_tool_calls,
    ) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let listed = r.tools.as_ref().map(|t| json!(t));
    start(
        g,
        caller_of(caller),
        Prep::Chat(m, listed),
        r.params,
        Flavor::Chat,
        tools,
    )
    .instrument(span)
    .await
}

/// Admits, prepares, validates, then serves: the key's admission comes before any template or
/// tokenizing runs, and nothing reaches an engine before the request is known to be valid.
/// `prep` gives one or more prompts (a completion's list of prompts): each is a job of `n`
/// choices.
async fn start(
    g: Arc<Gateway>,
    caller: EndUser,
    prep: Prep,
    mut params: GenerationParams,
    flavor: Flavor,
    tools: Option<(tools::ToolMode, Option<Spec>)>,
) -> Response {
    let salt = params.cache_salt.as_deref();
    if salt.is_some_and(|s| s.len() > MAX_CACHE_SALT) {
        return ApiError::bad_field(
            "cache_salt",
            format!("is longer than {MAX_CACHE_SALT} bytes"),
        )
        .into_response();
    }
    if g.is_draining() {
        return ApiError::unavailable("the gateway is draining; send the request to another")
            .into_response();
    }
    let scope = g.scopes.scope(&caller.tenant, salt);
    // The key's first place, before any work: its size is counted once its prompts are known.
    let mut quota = match g.quotas.take(&caller.tenant, 0) {
        Ok(q) => q,
        Err(e) => return over_quota(e, 0).into_response(),
    };
    let structured = match (params.structured(), &tools) {
        (Err(e), _) => return e.into_response(),
        (Ok(Some((field, _))), Some((_, Some(_)))) => {
            return ApiError::bad_field(
                field,
                "cannot be asked for with `tool_choice` required or a named function",
            )
            .into_response();
        }
        (Ok(None), Some((_, Some(spec)))) => Some(("tools".to_owned(), spec.clone())),
        (Ok(s), _) => s,
    };
    let tool_mode = tools.map(|(m, _)| m);
    let spec = structured.as_ref().map(|(_, s)| s.clone());
    let prompts = match prepare(&g, &caller.tenant, prep, structured).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let vocab = g
        .text
        .as_ref()
        .map_or_else(tl_engine_core::vocab::Vocab::bytes, |t| {
            Arc::clone(&t.vocab)
        });
    let limits = g.text.as_ref().map_or(GATEWAY_LIMITS, |t| t.limits);
    for p in &prompts {
        if let Err(e) = fits(&g, p.len(), &params) {
            return e.into_response();
        }
        if let Err(e) = params.params(p).validate(limits) {
            return ApiError::from(e).into_response();
        }
    }
    let mut stop = match params.stop_rules(&vocab) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    // The checkpoint's EOS ends the completion (finish_reason "stop") unless ignore_eos.
    if let Some(t) = &g.text
        && params.ignore_eos != Some(true)
    {
        for &id in t.text.eos_ids() {
            if !stop.token_ids.contains(&id) {
                stop.token_ids.push(id);
                params.stop_token_ids.get_or_insert_with(Vec::new).push(id);
            }
        }
    }
    let choices = match params.choices(flavor, MAX_COMPLETION_LOGPROBS) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    // What the request may hold at most: its prompts and every token of every choice.
    let tokens: u64 = prompts
        .iter()
        .map(|p| p.len() as u64 + u64::from(choices.n) * u64::from(params.max_tokens()))
        .sum();
    let jobs: Vec<Job> = prompts
        .into_iter()
        .map(|prompt| Job {
            prompt,
            params: params.clone(),
            stop: stop.clone(),
            choices,
            scope,
            structured: spec.clone(),
            tools: tool_mode.clone(),
        })
        .collect();
    // Each prompt of a list is a request in flight, for the key as for the gateway.
    if let Err(e) = quota.grow(jobs.len() - 1, tokens) {
        return over_quota(e, tokens).into_response();
    }
    serve(g, jobs, flavor, caller.admin, quota)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn over_quota(e: super::tenant::OverQuota, tokens: u64) -> ApiError {
    match e {
        super::tenant::OverQuota::Requests => ApiError::rate_limited(
            "too many requests in flight for this API key (max_inflight_per_key)",
        ),
        super::tenant::OverQuota::Tokens => ApiError::rate_limited(format!(
            "this API key has too many tokens in flight to add {tokens} more \
             (max_tokens_in_flight_per_key)"
        )),
    }
}

/// Refuses, with 400 `context_length_exceeded`, a request no live worker could ever hold: its
/// prompt plus `max_tokens` (for n choices, which share the prompt's blocks, the prompt plus n
/// completions) against the largest usable context a serving worker reports (the route then
/// takes only engines that hold it). A 429 or 503 would make clients retry for ever.
fn fits(g: &Gateway, prompt: usize, params: &GenerationParams) -> Result<(), ApiError> {
    let (prefill_room, decode_room) = held_context(g);
    if let Some(room) = prefill_room
        && prompt as u64 > u64::from(room)
    {
        return Err(ApiError::context_length_exceeded(format!(
            "the prompt has {prompt} tokens; the prefill engines hold at most {room}"
        )));
    }
    let Some(usable) = decode_room else {
        return Ok(());
    };
    let n = u64::from(params.n.unwrap_or(1).max(1));
    let need = prompt as u64 + n * u64::from(params.max_tokens());
    if need > u64::from(usable) {
        return Err(ApiError::context_length_exceeded(format!(
            "this request needs {need} tokens ({prompt} in the prompt, {} x {n} to complete) \
             but the engines hold at most {usable}; shorten the prompt or lower max_tokens",
            params.max_tokens()
        )));
    }
    Ok(())
}

/// The most a request may hold: on the prefill engines (the prompt), and on the engines that
/// decode (the whole sequence), each the largest usable context a live one reports. A request
/// is routed only to engines that hold it, so one engine with a small pool lowers no one's
/// limit; it only takes no request it cannot hold.
fn held_context(g: &Gateway) -> (Option<u32>, Option<u32>) {
    let workers = g.workers();
    let live = || {
        workers
            .iter()
            .filter(|w| w.usable_context > 0 && !w.draining)
    };
    // A prefill engine holds the prompt only; a decoding one the whole sequence.
    let prefill = live()
        .filter(|w| w.kv_address.is_empty())
        .map(|w| w.usable_context)
        .max();
    let decode = live()
        .filter(|w| !w.kv_address.is_empty())
        .map(|w| w.usable_context)
        .max();
    (prefill, decode)
}

fn timed_out() -> ApiError {
    ApiError::timeout("the request timed out")
}

/// `ev` as the request's choice `by + ` its own: prompt `i` of a list has choices `i * n ..`.
fn shifted(ev: Out, by: u32) -> Out {
    match ev {
        Out::Choice(ChoiceEvent::Token {
            choice,
            token,
            logprobs,
        }) => Out::Choice(ChoiceEvent::Token {
            choice: choice + by,
            token,
            logprobs,
        }),
        Out::Choice(ChoiceEvent::Finished { choice, finish }) => {
            Out::Choice(ChoiceEvent::Finished {
                choice: choice + by,
                finish,
            })
        }
        other => other,
    }
}

async fn serve(
    g: Arc<Gateway>,
    jobs: Vec<Job>,
    flavor: Flavor,
    admin: bool,
    quota: super::tenant::Held,
) -> Result<Response, ApiError> {
    // One permit a prompt: a list of prompts is as many requests in flight.
    let Ok(permit) = Arc::clone(&g.permits).try_acquire_many_owned(jobs.len() as u32) else {
        return Err(ApiError::rate_limited("too many requests in flight"));
    };
    let held = Arc::new((permit, quota));
    let arrived = Instant::now();
    let (tx, mut rx) = mpsc::channel::<Out>(64);
    let timeout = Duration::from_millis(g.cfg.request_timeout_ms);
    let first = &jobs[0];
    let stream = first.params.streams();
    let include_usage = first.params.include_usage();
    let continuous_usage = first.params.continuous_usage();
    let specials = first.params.specials();
    let prompt_tokens = jobs.iter().map(|j| j.prompt.len()).sum();
    let stop = first.stop.clone();
    let per_prompt = first.choices.n;
    let tools = first.tools.clone();
    let k = jobs.len();
    for (i, job) in jobs.into_iter().enumerate() {
        let g = Arc::clone(&g);
        let held = Arc::clone(&held);
        // The first prompt's events go straight through; each other's through a task that
        // numbers its choices after the ones before.
        let job_tx = if i == 0 {
            tx.clone()
        } else {
            let (job_tx, mut job_rx) = mpsc::channel::<Out>(64);
            let tx = tx.clone();
            let by = i as u32 * per_prompt;
            // A client that leaves closes `tx`: dropping `job_rx` then ends this prompt's
            // request task too (it watches its channel), so no prompt of the list outlives it.
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        ev = job_rx.recv() => {
                            let Some(ev) = ev else { return };
                            if tx.send(shifted(ev, by)).await.is_err() {
                                return;
                            }
                        }
                        () = tx.closed() => return,
                    }
                }
            });
            job_tx
        };
        tokio::spawn(
            async move {
                let _held = held;
                // On timeout the drive future is dropped; the handler then answers 504.
                let _ = tokio::time::timeout(timeout, g.drive(job, job_tx)).await;
            }
            .instrument(tracing::Span::current()),
        );
    }
    drop(tx);
    // Wait for every prompt's route (or the first failure) before answering anything; the
    // choice events of a prompt routed early wait their turn.
    let mut early = std::collections::VecDeque::new();
    let mut started = None;
    let mut starts = 0;
    while starts < k {
        match rx.recv().await {
            Some(Out::Start { seed, model, route }) => {
                // Where it went, what was cached and deduplicated: kept in the logs and the
                // `route` span; in the response only for an admin, since to anyone else a
                // cached prefix says what another request held.
                tracing::info!(
                    decode = route.decode.as_str(),
                    cached_blocks = route.cached_blocks,
                    reason = route.reason.as_str(),
                    "routed"
                );
                starts += 1;
                started.get_or_insert((seed, model, route));
            }
            Some(Out::Choice(ChoiceEvent::Failed(f))) => return Err(f),
            Some(Out::Choice(e)) if starts > 0 => early.push_back(e),
            Some(other) => {
                return Err(ApiError::engine(format!("unexpected {other:?}")));
            }
            None => return Err(timed_out()),
        }
    }
    let Some((seed, model, route)) = started else {
        return Err(timed_out());
    };
    let render = g
        .text
        .as_ref()
        .map_or_else(TextRender::default, |t| {
            TextRender::new(Arc::clone(&t.vocab))
        })
        .with(specials);
    let meta = ResponseMeta {
        id: completion_id(),
        model,
        seed,
        flavor,
        prompt_tokens,
        route: admin.then_some(route),
        stop,
        render,
        continuous_usage,
        tools,
    };
    let mut src = Answer {
        rx,
        early,
        meter: Meter::new(Arc::clone(&g.metrics), arrived),
    };
    let n = per_prompt * k as u32;
    if stream {
        return Ok(render::stream(meta, n, src, include_usage, 64));
    }
    render::whole(&meta, n, &mut src).await
}

/// The request task's messages after the start, as the renderer takes them; the time to first
/// token and per token recorded on the way.
struct Answer {
    rx: mpsc::Receiver<Out>,
    /// Events that came before every prompt had started.
    early: std::collections::VecDeque<ChoiceEvent>,
    meter: Meter,
}

impl ChoiceSource for Answer {
    async fn next(&mut self) -> Option<ChoiceEvent> {
        if let Some(e) = self.early.pop_front() {
            if matches!(e, ChoiceEvent::Token { .. }) {
                self.meter.token();
            }
            return Some(e);
        }
        loop {
            match self.rx.recv().await? {
                Out::Choice(e) => {
                    if matches!(e, ChoiceEvent::Token { .. }) {
                        self.meter.token();
                    }
                    return Some(e);
                }
                Out::Start { .. } => {}
            }
        }
    }

    /// The request task was dropped by the request timeout.
    fn cut_short(&self, _stream: bool) -> Option<ApiError> {
        Some(timed_out())
    }

    fn finished(&mut self) {
        self.meter.done();
    }
}

/// `GET /v1/models`: one entry per model the live engines serve.
#[derive(Debug, Serialize)]
struct ModelList {
    object: &'static str,
    data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
struct ModelCard {
    id: String,
    object: &'static str,
    /// When this gateway started (a model has no creation time of its own here).
    created: u64,
    owned_by: &'static str,
    /// The longest sequence served, as vLLM reports it: the checkpoint's context length as
    /// far as the engines hold it (the same figure a request is checked against).
    #[serde(skip_serializing_if = "Option::is_none")]
    max_model_len: Option<u32>,
}

fn model_cards(g: &Gateway) -> Vec<ModelCard> {
    // The length advertised is the length accepted: the checkpoint's, as far as the engines
    // hold it.
    let (prefill, decode) = held_context(g);
    let max_model_len = [g.text.as_ref().map(|t| t.max_model_len), prefill, decode]
        .into_iter()
        .flatten()
        .min();
    let mut names: Vec<String> = g.workers().into_iter().map(|w| w.model).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|id| ModelCard {
            id,
            object: "model",
            created: g.started_secs,
            owned_by: "kvwire",
            max_model_len,
        })
        .collect()
}

async fn models(State(g): State<Arc<Gateway>>) -> Response {
    Json(ModelList {
        object: "list",
        data: model_cards(&g),
    })
    .into_response()
}

/// `GET /v1/models/{id}`: the model's entry, or 404 `model_not_found`. Ids may hold slashes
/// (`org/name`), as Hugging Face names do.
async fn model(
    State(g): State<Arc<Gateway>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match model_cards(&g).into_iter().find(|m| m.id == id) {
        Some(card) => Json(card).into_response(),
        None => {
            let mut e = ApiError::model_not_found(format!("the model `{id}` does not exist"));
            e.param = Some("model".into());
            e.into_response()
        }
    }
}

/// Any other path: 404 with OpenAI's error object.
async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::not_found(format!("no route for {}", uri.path())).into_response()
}

/// A known path with another method: 405 with OpenAI's error object.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError::method_not_allowed(format!("{method} is not allowed on {}", uri.path()))
        .into_response()
}

async fn health(State(g): State<Arc<Gateway>>) -> Response {
    let w = g.workers();
    if g.is_draining() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "draining", "workers": w.len() })),
        )
            .into_response();
    }
    let ok = w.iter().any(|w| !w.draining);
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({ "status": if ok { "ok" } else { "no workers" }, "workers": w.len() })),
    )
        .into_response()
}

async fn workers(State(g): State<Arc<Gateway>>, caller: EndUserExt) -> Response {
    let caller = caller_of(caller);
    if !caller.admin {
        // No key presented: 401, as for any guarded path; a tenant's key: 403.
        if caller.tenant.is_empty() {
            return ApiError::unauthorized("/workers needs an admin key").into_response();
        }
        return ApiError::permission_denied("/workers needs an admin key").into_response();
    }
    let list: Vec<serde_json::Value> = g
        .registry
        .snapshot(Instant::now())
        .into_iter()
        .map(|v| {
            let w = v.status;
            let name = |r: Option<crate::net::role::Role>| r.map_or("unspecified", |r| r.name());
            let role = name(crate::net::role::Role::from_wire(w.role));
            let serving = name(super::worker::serving_role(&w));
            json!({
                "worker_id": w.worker_id, "role": role, "serving": serving, "model": w.model, "http_address": w.http_address,
                "grpc_address": w.grpc_address, "kv_address": w.kv_address, "kv_format": w.kv_format,
                "queue_depth": w.queue_depth, "running": w.running, "free_blocks": w.free_blocks,
                "total_blocks": w.total_blocks, "draining": w.draining, "block_tokens": w.block_tokens,
                "heartbeat_ms": w.heartbeat_ms, "routed_in_flight": g.routed.on(&w.worker_id),
            })
        })
        .collect();
    Json(json!({ "workers": list })).into_response()
}
