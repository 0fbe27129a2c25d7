//! The gateway: one OpenAI-compatible endpoint over prefill and decode engines, with the worker
//! registry the engines beat to.
//!
//! For each request it picks a prefill engine (live, not draining, shortest queue) and a decode
//! engine (see [`score`]), calls Prefill with that decode target, emits the first token at once,
//! then forwards to the decode engine with the handle and streams the rest. Every request runs
//! in a task of its own that watches the client: a client that goes away during Prefill gets the
//! prefill cancelled (and a handle that still arrives released); before the decode engine claimed
//! the handle, the handle is released; after, the decode request is dropped, which cancels the
//! sequence on the decode engine.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use kvwire::prompt_hashes;
use kvwire_grpc::pb::control::{Role as PbRole, WorkerStatus};
use kvwire_grpc::pb::engine::{KvHandle, PrefillRequest, SamplingParams};
use kvwire_grpc::pb::kv::HasBlocksRequest;
use kvwire_grpc::{GrpcTransport, KvTransport, TransportConfig};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use crate::client::{ControlClient, HttpClient};
use crate::http::{KV_HANDLE_HEADER, Prompt, error, now_secs};
use crate::model::{BYTE_VOCAB, decode_text, encode_text};
use crate::node::{Served, serve_grpc, serve_http};
use crate::registry::{RegistryService, RegistryState};

/// `[gateway]` of the gateway's TOML file; every key optional.
///
/// ```toml
/// [gateway]
/// http_listen = "127.0.0.1:0"      # the OpenAI-compatible front
/// registry_listen = "127.0.0.1:0"  # WorkerRegistry (tl.control.v1) for the engines' heartbeats
/// max_inflight = 256               # requests in flight; beyond it 429
/// request_timeout_ms = 60000       # whole request; beyond it 504
/// has_blocks_timeout_ms = 250      # per decode engine when routing; a slower one is skipped
/// load_penalty_tokens = 64         # routing: cached prefix tokens one in-flight sequence is worth
/// ```
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySection {
    /// HTTP listen address.
    pub http_listen: String,
    /// Registry listen address.
    pub registry_listen: String,
    /// Requests in flight before 429.
    pub max_inflight: usize,
    /// Request timeout in milliseconds (504).
    pub request_timeout_ms: u64,
    /// HasBlocks timeout per decode engine in milliseconds.
    pub has_blocks_timeout_ms: u64,
    /// Routing weight of load against cached prefix (see [`score`]).
    pub load_penalty_tokens: f64,
}

impl Default for GatewaySection {
    fn default() -> Self {
        Self {
            http_listen: "127.0.0.1:0".into(),
            registry_listen: "127.0.0.1:0".into(),
            max_inflight: 256,
            request_timeout_ms: 60_000,
            has_blocks_timeout_ms: 250,
            load_penalty_tokens: 64.0,
        }
    }
}

/// The gateway's configuration file.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// `[gateway]`.
    pub gateway: GatewaySection,
}

impl GatewayConfig {
    /// Reads `path` if given, else the defaults.
    ///
    /// # Errors
    /// I/O or parse errors, as text.
    pub fn load_or_default(path: Option<&std::path::Path>) -> Result<Self, String> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let c: Self = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if c.gateway.max_inflight == 0 || c.gateway.request_timeout_ms == 0 {
            return Err("gateway.max_inflight and gateway.request_timeout_ms must be >= 1".into());
        }
        Ok(c)
    }
}

/// The routing score of a decode engine: cached prefix tokens minus `load_penalty_tokens` per
/// sequence it is running or has queued (as its last heartbeat said, plus the requests this
/// gateway has sent it since). The highest score wins; ties go to the engine with more free
/// blocks, then to the lower worker id.
///
/// With the default penalty of 64, a 32-block prefix at B=4 (128 tokens) outweighs a load
/// difference of one sequence, and is given up once the holder runs two more sequences than
/// another engine.
#[must_use]
pub fn score(cached_prefix_tokens: usize, load: u32, load_penalty_tokens: f64) -> f64 {
    cached_prefix_tokens as f64 - load_penalty_tokens * f64::from(load)
}

/// One routing decision, reported back in the response's `tl_route` extension.
#[derive(Clone, Debug, Default)]
pub struct Route {
    /// Prefill worker id.
    pub prefill: String,
    /// Decode worker id (or the colocated fallback's).
    pub decode: String,
    /// Why this decode engine.
    pub reason: String,
    /// Full blocks it already held.
    pub cached_blocks: usize,
    /// Decode engines tried before this one.
    pub retries: u32,
}

/// The gateway's shared state.
#[derive(Debug)]
pub struct Gateway {
    registry: Arc<RegistryState>,
    cfg: GatewaySection,
    transport: GrpcTransport,
    controls: Mutex<HashMap<String, ControlClient>>,
    http: HttpClient,
    permits: Arc<Semaphore>,
    /// Requests this gateway has in flight per decode worker.
    routed: Mutex<HashMap<String, u32>>,
    next: AtomicU64,
}

/// Why a request could not be served (before any token was sent).
#[derive(Debug)]
struct Failure {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl Failure {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
        }
    }
}

/// What the per-request task tells the HTTP handler.
#[derive(Debug)]
enum Out {
    /// Routing done, first token known.
    First {
        token: u32,
        seed: u64,
        route: Route,
        handle: Option<KvHandle>,
    },
    /// A later token.
    Token(u32),
    /// Done.
    Done { finish: String },
    /// Failed before the first token.
    Fail(Failure),
    /// Failed after tokens went out.
    Broken(String),
}

/// A validated completion request.
#[derive(Clone, Debug)]
struct Job {
    prompt: Vec<u32>,
    max_tokens: u32,
    temperature: f32,
    top_p: f32,
    top_k: u32,
    seed: Option<u64>,
    model: Option<String>,
}

impl Gateway {
    /// A gateway over `registry`.
    #[must_use]
    pub fn new(registry: Arc<RegistryState>, cfg: GatewaySection) -> Self {
        let mut tc = TransportConfig::for_envelope(4096);
        tc.call_timeout = Duration::from_millis(cfg.has_blocks_timeout_ms.max(1));
        Self {
            permits: Arc::new(Semaphore::new(cfg.max_inflight.max(1))),
            registry,
            cfg,
            transport: GrpcTransport::new(tc),
            controls: Mutex::new(HashMap::new()),
            http: HttpClient::default(),
            routed: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }

    fn control(&self, addr: &str) -> Option<ControlClient> {
        let mut m = self
            .controls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(c) = m.get(addr) {
            return Some(c.clone());
        }
        let c = ControlClient::new(addr).ok()?;
        m.insert(addr.to_owned(), c.clone());
        Some(c)
    }

    fn routed(&self, worker: &str, delta: i32) {
        let mut m = self
            .routed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = m.entry(worker.to_owned()).or_insert(0);
        *e = e.saturating_add_signed(delta);
    }

    fn routed_to(&self, worker: &str) -> u32 {
        self.routed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(worker)
            .copied()
            .unwrap_or(0)
    }

    /// The live workers.
    #[must_use]
    pub fn workers(&self) -> Vec<WorkerStatus> {
        self.registry.list(Instant::now())
    }

    /// Decode engines ordered best first for `prompt`, each with its cached prefix (in blocks).
    /// Engines whose HasBlocks fails or times out are left out.
    pub async fn rank_decoders(
        &self,
        prompt: &[u32],
        workers: &[WorkerStatus],
    ) -> Vec<(WorkerStatus, usize, f64)> {
        let decoders: Vec<&WorkerStatus> = workers
            .iter()
            .filter(|w| w.role == PbRole::Decode as i32 && !w.draining && !w.kv_address.is_empty())
            .collect();
        let asks = decoders.iter().map(|w| {
            let hashes = prompt_hashes(prompt, w.block_tokens.max(1) as usize);
            let req = HasBlocksRequest {
                hashes,
                kv_format: kvwire_grpc::KV_FORMAT_V1,
                model: w.model.clone(),
            };
            let limit = Duration::from_millis(self.cfg.has_blocks_timeout_ms.max(1));
            async move {
                tokio::time::timeout(limit, self.transport.has_blocks(&w.kv_address, req)).await
            }
        });
        let answers = join_all(asks).await;
        let mut ranked: Vec<(WorkerStatus, usize, f64)> = decoders
            .into_iter()
            .zip(answers)
            .filter_map(|(w, a)| {
                let present = a.ok()?.ok()?;
                let k = present.iter().take_while(|&&x| x).count();
                let load = w.running + w.queue_depth + self.routed_to(&w.worker_id);
                let s = score(
                    k * w.block_tokens as usize,
                    load,
                    self.cfg.load_penalty_tokens,
                );
                Some((w.clone(), k, s))
            })
            .collect();
        // Best score first; on a tie the engine with more free blocks (which spreads new
        // prefixes over the pools), then the lower id.
        ranked.sort_by(|a, b| {
            b.2.total_cmp(&a.2)
                .then(b.0.free_blocks.cmp(&a.0.free_blocks))
                .then_with(|| a.0.worker_id.cmp(&b.0.worker_id))
        });
        ranked
    }

    fn pick_prefill(workers: &[WorkerStatus], role: PbRole) -> Option<&WorkerStatus> {
        workers
            .iter()
            .filter(|w| w.role == role as i32 && !w.draining)
            .min_by_key(|w| (w.queue_depth + w.running, w.worker_id.clone()))
    }

    /// Runs one request, sending what happens to `out`. Returns when the request is over or the
    /// client has gone (then after cleaning up).
    async fn drive(self: Arc<Self>, job: Job, out: mpsc::Sender<Out>) {
        let id = format!("gw-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let workers = self.workers();
        if let Some(m) = &job.model
            && !workers.iter().any(|w| &w.model == m)
        {
            let _ = out
                .send(Out::Fail(Failure::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    format!("unknown model {m:?}"),
                )))
                .await;
            return;
        }
        let sampling = SamplingParams {
            temperature: job.temperature,
            top_p: job.top_p,
            top_k: job.top_k,
            seed: job.seed,
            max_tokens: job.max_tokens,
        };
        let prefill = Self::pick_prefill(&workers, PbRole::Prefill);
        let ranked = if prefill.is_some() {
            self.rank_decoders(&job.prompt, &workers).await
        } else {
            Vec::new()
        };
        let mut retries = 0;
        if let Some(p) = prefill
            && let Some(ctl) = self.control(&p.grpc_address)
        {
            for (d, cached, _) in ranked.iter().take(2) {
                let req = PrefillRequest {
                    request_id: format!("{id}-{retries}"),
                    prompt_tokens: job.prompt.clone(),
                    sampling: Some(sampling),
                    decode_target: d.kv_address.clone(),
                };
                let reason = if *cached > 0 {
                    format!("prefix hit: {cached} blocks cached")
                } else {
                    "no cached prefix: by load".to_owned()
                };
                let route = Route {
                    prefill: p.worker_id.clone(),
                    decode: d.worker_id.clone(),
                    reason,
                    cached_blocks: *cached,
                    retries,
                };
                let _routed = RoutedGuard::new(&self, &d.worker_id);
                let call = ctl.prefill(req.clone());
                tokio::pin!(call);
                let res = tokio::select! {
                    r = &mut call => Some(r),
                    () = out.closed() => None,
                };
                let res = match res {
                    Some(r) => r,
                    None => {
                        // The client left during Prefill: cancel it, and keep waiting for the
                        // call, so that a handle that still arrives (the push had finished) is
                        // released rather than left to its lease.
                        let _ = ctl.cancel(&req.request_id).await;
                        if let Ok(Ok(h)) =
                            tokio::time::timeout(Duration::from_secs(5), &mut call).await
                        {
                            let _ = self.transport.release(&d.kv_address, &h.handle_id).await;
                        }
                        return;
                    }
                };
                match res {
                    Ok(h) => {
                        self.finish_disaggregated(&job, h, d, route, &out).await;
                        return;
                    }
                    Err(s)
                        if matches!(
                            s.code(),
                            Code::DataLoss | Code::FailedPrecondition | Code::Unavailable
                        ) =>
                    {
                        retries += 1;
                    }
                    Err(s) => {
                        let status = match s.code() {
                            Code::InvalidArgument => StatusCode::BAD_REQUEST,
                            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
                            _ => StatusCode::BAD_GATEWAY,
                        };
                        let _ = out
                            .send(Out::Fail(Failure::new(
                                status,
                                "engine_error",
                                s.message().to_owned(),
                            )))
                            .await;
                        return;
                    }
                }
            }
        }
        // No prefill engine, or no decode engine left: an engine with role both, colocated.
        if let Some(b) =
            Self::pick_prefill(&workers, PbRole::Both).filter(|b| !b.http_address.is_empty())
        {
            let route = Route {
                prefill: b.worker_id.clone(),
                decode: b.worker_id.clone(),
                reason: "fallback: colocated on a both-role engine".into(),
                cached_blocks: 0,
                retries,
            };
            self.finish_colocated(&job, b, route, &out).await;
            return;
        }
        let _ = out
            .send(Out::Fail(Failure::new(
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
        route: Route,
        out: &mpsc::Sender<Out>,
    ) {
        let unclaimed = Unclaimed {
            g: Arc::clone(self),
            kv: d.kv_address.clone(),
            handle: h.handle_id.clone(),
            armed: true,
        };
        let first = Out::First {
            token: h.first_token,
            seed: h.seed,
            route,
            handle: Some(h.clone()),
        };
        if out.send(first).await.is_err() || job.max_tokens <= 1 {
            // Gone before the decode engine claimed the handle (or nothing left to decode).
            unclaimed.release().await;
            if job.max_tokens <= 1 {
                let _ = out
                    .send(Out::Done {
                        finish: "length".into(),
                    })
                    .await;
            }
            return;
        }
        let body = json!({
            "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": job.temperature, "top_p": job.top_p,
            "top_k": job.top_k, "seed": h.seed, "stream": true,
            "tl_resume": { "first_token": h.first_token, "rng_draws_consumed": h.rng_draws_consumed },
        });
        let resp = self
            .http
            .post_streaming(
                &d.http_address,
                "/v1/completions",
                &[(KV_HANDLE_HEADER, &h.handle_id)],
                body.to_string(),
            )
            .await;
        let (status, body) = match resp {
            Ok(x) => x,
            Err(e) => {
                unclaimed.release().await;
                let _ = out.send(Out::Broken(format!("decode engine: {e}"))).await;
                return;
            }
        };
        if status != 200 {
            unclaimed.release().await;
            let _ = out
                .send(Out::Broken(format!("decode engine answered {status}")))
                .await;
            return;
        }
        // The first chunk repeats first_token, which the client already has.
        // A 200 means the decode engine claimed the handle; from here, dropping the stream is
        // what frees its blocks.
        unclaimed.claimed();
        relay_sse(body, out, |_, _| First::Drop).await;
    }

    async fn finish_colocated(
        &self,
        job: &Job,
        b: &WorkerStatus,
        route: Route,
        out: &mpsc::Sender<Out>,
    ) {
        let body = json!({
            "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": job.temperature, "top_p": job.top_p,
            "top_k": job.top_k, "seed": job.seed, "stream": true,
        });
        let (status, body) = match self
            .http
            .post_streaming(&b.http_address, "/v1/completions", &[], body.to_string())
            .await
        {
            Ok(x) => x,
            Err(e) => {
                let _ = out
                    .send(Out::Fail(Failure::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "unavailable",
                        format!("fallback engine: {e}"),
                    )))
                    .await;
                return;
            }
        };
        if status != 200 {
            let _ = out
                .send(Out::Fail(Failure::new(
                    StatusCode::BAD_GATEWAY,
                    "engine_error",
                    format!("fallback engine answered {status}"),
                )))
                .await;
            return;
        }
        let mut route = Some(route);
        relay_sse(body, out, |token, seed| {
            First::Announce(Box::new(Out::First {
                token,
                seed,
                route: route.take().unwrap_or_default(),
                handle: None,
            }))
        })
        .await;
    }
}

/// Counts a request as in flight on a decode worker for as long as it lives, whichever way the
/// request ends (a timeout drops it mid-way).
struct RoutedGuard<'g> {
    g: &'g Gateway,
    worker: String,
}

impl<'g> RoutedGuard<'g> {
    fn new(g: &'g Gateway, worker: &str) -> Self {
        g.routed(worker, 1);
        Self {
            g,
            worker: worker.to_owned(),
        }
    }
}

impl Drop for RoutedGuard<'_> {
    fn drop(&mut self) {
        self.g.routed(&self.worker, -1);
    }
}

/// A handle the decode engine has not claimed yet: released if the request ends first (a
/// client gone, a refused resume, a timeout that drops the request mid-way).
struct Unclaimed {
    g: Arc<Gateway>,
    kv: String,
    handle: String,
    armed: bool,
}

impl Unclaimed {
    /// The decode engine took the handle.
    fn claimed(mut self) {
        self.armed = false;
    }

    /// Releases it now.
    async fn release(mut self) {
        self.armed = false;
        let _ = self.g.transport.release(&self.kv, &self.handle).await;
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (g, kv, handle) = (
            Arc::clone(&self.g),
            std::mem::take(&mut self.kv),
            std::mem::take(&mut self.handle),
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = g.transport.release(&kv, &handle).await;
            });
        }
    }
}

/// Awaits every future (HasBlocks to each decode engine at once).
async fn join_all<F: std::future::Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out = Vec::with_capacity(handles.len());
    // Poll them together: each is driven by the same task, so they overlap in time.
    let mut pending: Vec<Option<std::pin::Pin<Box<F>>>> = handles.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (i, slot) in pending.iter_mut().enumerate() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        results[i] = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(results.into_iter().flatten());
    out
}

/// What to do with the first token of a relayed stream.
enum First {
    /// The client already has it (it came with the KvHandle).
    Drop,
    /// Announce it as the first token, with the route.
    Announce(Box<Out>),
}

/// Reads an engine's SSE body and forwards its tokens; `first` says what becomes of the first
/// one. Dropping `body` on return closes the engine's request, which cancels its sequence.
async fn relay_sse(
    mut body: hyper::body::Incoming,
    out: &mpsc::Sender<Out>,
    mut first: impl FnMut(u32, u64) -> First,
) {
    let mut buf = String::new();
    let mut seen_first = false;
    loop {
        let frame = tokio::select! {
            f = body.frame() => f,
            () = out.closed() => return,
        };
        let Some(Ok(frame)) = frame else {
            let _ = out
                .send(Out::Broken("engine stream ended early".into()))
                .await;
            return;
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(d) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if d == "[DONE]" {
                    return;
                }
                let v: Value = serde_json::from_str(d).unwrap_or(Value::Null);
                if let Some(e) = v.get("error") {
                    let _ = out
                        .send(Out::Broken(
                            e["message"].as_str().unwrap_or("engine error").to_owned(),
                        ))
                        .await;
                    return;
                }
                let seed = v["seed"].as_u64().unwrap_or(0);
                let choice = &v["choices"][0];
                for t in choice["tokens"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_u64)
                {
                    let msg = if seen_first {
                        Some(Out::Token(t as u32))
                    } else {
                        seen_first = true;
                        match first(t as u32, seed) {
                            First::Drop => None,
                            First::Announce(m) => Some(*m),
                        }
                    };
                    if let Some(m) = msg
                        && out.send(m).await.is_err()
                    {
                        return;
                    }
                }
                if let Some(f) = choice["finish_reason"].as_str()
                    && out
                        .send(Out::Done {
                            finish: f.to_owned(),
                        })
                        .await
                        .is_err()
                {
                    return;
                }
            }
        }
    }
}

/// The sampling and output fields both endpoints share (OpenAI's names; unknown fields are
/// ignored). temperature and top_p are parsed as f32, as on every other path.
#[derive(Debug, Default, Deserialize)]
struct Params {
    #[serde(default)]
    model: Option<String>,
    #[serde(default, alias = "max_completion_tokens")]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    #[serde(flatten)]
    params: Params,
}

/// One chat message.
#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: String,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(flatten)]
    params: Params,
}

/// The chat template: each message as `<|role|>\n{content}\n`, then `<|assistant|>\n`, tokenized
/// byte by byte.
#[must_use]
pub fn render_chat(messages: &[(String, String)]) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    s.push_str("<|assistant|>\n");
    s
}

fn validate(prompt: Vec<u32>, p: Params) -> Result<Job, String> {
    if prompt.is_empty() {
        return Err("empty prompt".into());
    }
    let max_tokens = p.max_tokens.unwrap_or(16);
    if max_tokens == 0 {
        return Err("max_tokens must be >= 1".into());
    }
    let temperature = p.temperature.unwrap_or(0.0);
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(format!("temperature {temperature} must be finite and >= 0"));
    }
    let top_p = p.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(format!("top_p {top_p} must be in (0, 1]"));
    }
    if let Some(t) = prompt.iter().find(|t| **t >= BYTE_VOCAB) {
        return Err(format!("token {t} is outside the vocabulary"));
    }
    Ok(Job {
        prompt,
        max_tokens,
        temperature,
        top_p,
        top_k: p.top_k.unwrap_or(0),
        seed: p.seed,
        model: p.model.filter(|m| !m.is_empty()),
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavor {
    Completion,
    Chat,
}

async fn completions(State(g): State<Arc<Gateway>>, body: axum::body::Bytes) -> Response {
    match serde_json::from_slice::<CompletionBody>(&body) {
        Ok(b) => start(g, b.prompt.tokens(), b.params, Flavor::Completion).await,
        Err(e) => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("malformed request: {e}"),
        ),
    }
}

async fn chat(State(g): State<Arc<Gateway>>, body: axum::body::Bytes) -> Response {
    let b: ChatBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("malformed request: {e}"),
            );
        }
    };
    if b.messages.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "no messages",
        );
    }
    let msgs: Vec<(String, String)> = b
        .messages
        .into_iter()
        .map(|m| (m.role, m.content))
        .collect();
    start(g, encode_text(&render_chat(&msgs)), b.params, Flavor::Chat).await
}

/// Validates, then serves: nothing reaches an engine before the request is known to be valid.
async fn start(g: Arc<Gateway>, prompt: Vec<u32>, params: Params, flavor: Flavor) -> Response {
    let stream = params.stream.unwrap_or(false);
    match validate(prompt, params) {
        Ok(job) => serve(g, job, stream, flavor).await,
        Err(m) => error(StatusCode::BAD_REQUEST, "invalid_request_error", m),
    }
}

fn route_json(r: &Route, h: Option<&KvHandle>) -> Value {
    json!({
        "prefill": r.prefill, "decode": r.decode, "reason": r.reason, "cached_blocks": r.cached_blocks, "retries": r.retries,
        "blocks_sent": h.map(|h| h.blocks_sent), "blocks_deduped": h.map(|h| h.blocks_deduped), "payload_bytes": h.map(|h| h.payload_bytes),
    })
}

async fn serve(g: Arc<Gateway>, job: Job, stream: bool, flavor: Flavor) -> Response {
    let Ok(permit) = Arc::clone(&g.permits).try_acquire_owned() else {
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit",
            "too many requests in flight",
        );
    };
    let (tx, mut rx) = mpsc::channel::<Out>(64);
    let timeout = Duration::from_millis(g.cfg.request_timeout_ms);
    let prompt_tokens = job.prompt.len();
    tokio::spawn({
        let g = Arc::clone(&g);
        async move {
            let _permit = permit;
            // On timeout the drive future is dropped; the handler then answers 504.
            let _ = tokio::time::timeout(timeout, g.drive(job, tx)).await;
        }
    });
    let model = "fake".to_owned();
    let id = crate::http::completion_id();
    // Wait for the first token (or the failure) before answering anything.
    let (first, seed, route, handle) = match rx.recv().await {
        Some(Out::First {
            token,
            seed,
            route,
            handle,
        }) => (token, seed, route, handle),
        Some(Out::Fail(f)) => return error(f.status, f.kind, f.message),
        Some(other) => {
            return error(
                StatusCode::BAD_GATEWAY,
                "engine_error",
                format!("unexpected {other:?}"),
            );
        }
        None => {
            return error(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout",
                "the request timed out",
            );
        }
    };
    let route_v = route_json(&route, handle.as_ref());
    if stream {
        let (stx, srx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
        tokio::spawn(async move {
            let chunk = |toks: &[u32], finish: Option<&str>| {
                sse_chunk(flavor, &id, &model, seed, toks, finish, &route_v)
            };
            if stx
                .send(Ok(SseEvent::default().data(chunk(&[first], None))))
                .await
                .is_err()
            {
                return;
            }
            loop {
                let data = match rx.recv().await {
                    Some(Out::Token(t)) => chunk(&[t], None),
                    Some(Out::Done { finish }) => {
                        let _ = stx.send(Ok(SseEvent::default().data(chunk(&[], Some(&finish))))).await;
                        break;
                    }
                    Some(Out::Broken(m)) => json!({ "error": { "message": m, "type": "engine_error" } }).to_string(),
                    Some(_) => continue,
                    None => json!({ "error": { "message": "the request timed out", "type": "timeout" } }).to_string(),
                };
                let end = data.contains("\"error\"");
                // A client that left closes `stx`; returning drops `rx`, which ends the drive task.
                if stx.send(Ok(SseEvent::default().data(data))).await.is_err() || end {
                    return;
                }
            }
            let _ = stx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        });
        return Sse::new(ReceiverStream::new(srx)).into_response();
    }
    let mut tokens = vec![first];
    let finish = loop {
        match rx.recv().await {
            Some(Out::Token(t)) => tokens.push(t),
            Some(Out::Done { finish }) => break finish,
            Some(Out::Broken(m)) => return error(StatusCode::BAD_GATEWAY, "engine_error", m),
            Some(_) => {}
            None => {
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout",
                    "the request timed out",
                );
            }
        }
    };
    let text = decode_text(&tokens);
    let usage = json!({ "prompt_tokens": prompt_tokens, "completion_tokens": tokens.len(), "total_tokens": prompt_tokens + tokens.len() });
    let body = match flavor {
        Flavor::Completion => json!({
            "id": id, "object": "text_completion", "created": now_secs(), "model": model, "seed": seed,
            "choices": [{ "index": 0, "text": text, "tokens": tokens, "logprobs": Value::Null, "finish_reason": finish }],
            "usage": usage, "tl_route": route_v,
        }),
        Flavor::Chat => json!({
            "id": id, "object": "chat.completion", "created": now_secs(), "model": model, "seed": seed,
            "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "tokens": tokens, "logprobs": Value::Null, "finish_reason": finish }],
            "usage": usage, "tl_route": route_v,
        }),
    };
    Json(body).into_response()
}

fn sse_chunk(
    flavor: Flavor,
    id: &str,
    model: &str,
    seed: u64,
    toks: &[u32],
    finish: Option<&str>,
    route: &Value,
) -> String {
    match flavor {
        Flavor::Completion => json!({
            "id": id, "object": "text_completion", "created": now_secs(), "model": model, "seed": seed,
            "choices": [{ "index": 0, "text": decode_text(toks), "tokens": toks, "logprobs": Value::Null, "finish_reason": finish }],
            "tl_route": route,
        }),
        Flavor::Chat => json!({
            "id": id, "object": "chat.completion.chunk", "created": now_secs(), "model": model, "seed": seed,
            "choices": [{ "index": 0, "delta": { "role": "assistant", "content": decode_text(toks) }, "tokens": toks, "finish_reason": finish }],
            "tl_route": route,
        }),
    }
    .to_string()
}

async fn models(State(g): State<Arc<Gateway>>) -> Response {
    let mut names: Vec<String> = g.workers().into_iter().map(|w| w.model).collect();
    names.sort();
    names.dedup();
    let data: Vec<Value> = names
        .iter()
        .map(|m| json!({ "id": m, "object": "model", "owned_by": "kvwire" }))
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

async fn health(State(g): State<Arc<Gateway>>) -> Response {
    let w = g.workers();
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

async fn workers(State(g): State<Arc<Gateway>>) -> Response {
    let list: Vec<Value> = g
        .workers()
        .into_iter()
        .map(|w| {
            let role = match PbRole::try_from(w.role).unwrap_or(PbRole::Unspecified) {
                PbRole::Prefill => "prefill",
                PbRole::Decode => "decode",
                PbRole::Both => "both",
                PbRole::Unspecified => "unspecified",
            };
            json!({
                "worker_id": w.worker_id, "role": role, "model": w.model, "http_address": w.http_address,
                "grpc_address": w.grpc_address, "kv_address": w.kv_address, "kv_format": w.kv_format,
                "queue_depth": w.queue_depth, "running": w.running, "free_blocks": w.free_blocks,
                "total_blocks": w.total_blocks, "draining": w.draining, "block_tokens": w.block_tokens,
                "heartbeat_ms": w.heartbeat_ms, "routed_in_flight": g.routed_to(&w.worker_id),
            })
        })
        .collect();
    Json(json!({ "workers": list })).into_response()
}

/// The gateway's HTTP app.
pub fn router(g: Arc<Gateway>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/workers", get(workers))
        .with_state(g)
}

/// A running gateway: registry and HTTP front.
#[derive(Debug)]
pub struct GatewayNode {
    gateway: Arc<Gateway>,
    registry: Served,
    http: Served,
}

impl GatewayNode {
    /// Starts a gateway.
    ///
    /// # Errors
    /// When an address cannot be bound.
    pub async fn start(cfg: &GatewaySection) -> std::io::Result<Self> {
        let state = Arc::new(RegistryState::default());
        let reg_listener = tokio::net::TcpListener::bind(&cfg.registry_listen).await?;
        let registry = serve_grpc(reg_listener, RegistryService::new(Arc::clone(&state)))?;
        let gateway = Arc::new(Gateway::new(state, cfg.clone()));
        let http_listener = tokio::net::TcpListener::bind(&cfg.http_listen).await?;
        let http = serve_http(http_listener, router(Arc::clone(&gateway)))?;
        Ok(Self {
            gateway,
            registry,
            http,
        })
    }

    /// The gateway.
    #[must_use]
    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// The registry's state.
    #[must_use]
    pub fn registry(&self) -> &Arc<RegistryState> {
        &self.gateway.registry
    }

    /// HTTP address.
    #[must_use]
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.http.addr()
    }

    /// Registry address.
    #[must_use]
    pub fn registry_addr(&self) -> std::net::SocketAddr {
        self.registry.addr()
    }

    /// The listening line.
    #[must_use]
    pub fn listening_line(&self) -> String {
        json!({ "event": "listening", "http": self.http_addr().to_string(), "registry": self.registry_addr().to_string() }).to_string()
    }

    /// Stops both servers.
    pub async fn stop(self) {
        self.http.stop().await;
        self.registry.stop().await;
    }
}
