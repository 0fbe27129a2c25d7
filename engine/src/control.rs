//! `tl.engine.v1.EngineControl`: the service a gateway drives, over a [`PrefillBackend`].
//!
//! [`Worker`] is the engine's backend: Prefill validates everything before any work, runs the
//! prefill on the engine thread, ships the KV with the deduplicating transfer, drops its own
//! references (full blocks stay cached) and answers a [`KvHandle`]; on any failure it drops them
//! before answering.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_grpc::glue::{self, Limits, ResponseFuture};
use kvwire_grpc::pb::engine::{
    CancelRequest, CancelResponse, DrainRequest, DrainResponse, InfoRequest, InfoResponse,
    KvHandle, PrefillRequest, path,
};
use kvwire_grpc::{GrpcTransport, KV_FORMAT_V1, KvReceiver, KvStore};
use tokio::sync::oneshot;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::{Code, Status};

use crate::config::Role;
use crate::engine::{Mode, Request, RequestError, SeqError};
use crate::pool::PoolError;
use crate::runner::{Runner, SeqEvent};
use crate::sampler::{Sampling, SamplingRequest};

/// What EngineControl needs of an engine.
pub trait PrefillBackend: Send + Sync + 'static {
    /// Runs one prefill and ships its KV to `decode_target`.
    fn prefill(&self, req: PrefillRequest)
    -> impl Future<Output = Result<KvHandle, Status>> + Send;
    /// Live figures.
    fn info(&self) -> InfoResponse;
    /// Stops a queued or running prefill; `true` when one was found.
    fn cancel(&self, request_id: &str) -> bool;
    /// Refuses new work from now on and waits up to `deadline` for in-flight work; returns how
    /// much remains.
    fn drain(&self, deadline: Duration) -> impl Future<Output = i32> + Send;
}

/// The EngineControl service over a backend.
#[derive(Debug)]
pub struct EngineControlService<B> {
    backend: Arc<B>,
}

impl<B> Clone for EngineControlService<B> {
    fn clone(&self) -> Self {
        Self {
            backend: Arc::clone(&self.backend),
        }
    }
}

impl<B: PrefillBackend> EngineControlService<B> {
    /// Serves `backend`.
    #[must_use]
    pub fn new(backend: Arc<B>) -> Self {
        Self { backend }
    }
}

impl<B> NamedService for EngineControlService<B> {
    const NAME: &'static str = path::SERVICE;
}

impl<B: PrefillBackend> tower_service::Service<http::Request<Body>> for EngineControlService<B> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> ResponseFuture {
        let b = Arc::clone(&self.backend);
        let limits = Limits::default();
        match req.uri().path() {
            path::PREFILL => glue::serve_unary(req, limits, move |m: PrefillRequest| async move {
                b.prefill(m).await
            }),
            path::INFO => glue::serve_unary(req, limits, move |_: InfoRequest| async move {
                Ok::<_, Status>(b.info())
            }),
            path::CANCEL => glue::serve_unary(req, limits, move |m: CancelRequest| async move {
                Ok::<_, Status>(CancelResponse {
                    cancelled: b.cancel(&m.request_id),
                })
            }),
            path::DRAIN => glue::serve_unary(req, limits, move |m: DrainRequest| async move {
                let wait = Duration::from_millis(m.deadline_ms.max(0) as u64);
                Ok::<_, Status>(DrainResponse {
                    remaining: b.drain(wait).await,
                })
            }),
            other => glue::unimplemented(other),
        }
    }
}

/// The engine's EngineControl backend (and the state its HTTP front and heartbeat read).
#[derive(Debug)]
pub struct Worker {
    id: String,
    role: Role,
    runner: Runner,
    transport: GrpcTransport,
    receiver: Option<Arc<KvReceiver>>,
    draining: AtomicBool,
    inflight: Mutex<HashMap<String, oneshot::Sender<()>>>,
}

/// Removes a request from the in-flight table however its Prefill call ends.
struct InflightGuard<'w> {
    worker: &'w Worker,
    request_id: String,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.worker.inflight().remove(&self.request_id);
    }
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

fn seq_status(e: &SeqError) -> Status {
    match e {
        SeqError::Pool(PoolError::Exhausted { .. }) => Status::resource_exhausted(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// The gRPC status for a request refused by the engine.
#[must_use]
pub fn request_status(e: &RequestError) -> Status {
    Status::invalid_argument(e.to_string())
}

impl Worker {
    /// A worker named `id` with `role`, driving `runner`; `receiver` when it decodes.
    #[must_use]
    pub fn new(
        id: impl Into<String>,
        role: Role,
        runner: Runner,
        transport: GrpcTransport,
        receiver: Option<Arc<KvReceiver>>,
    ) -> Self {
        Self {
            id: id.into(),
            role,
            runner,
            transport,
            receiver,
            draining: AtomicBool::new(false),
            inflight: Mutex::new(HashMap::new()),
        }
    }

    fn inflight(&self) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<()>>> {
        self.inflight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The worker id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The role.
    #[must_use]
    pub fn role(&self) -> Role {
        self.role
    }

    /// The engine thread's handle.
    #[must_use]
    pub fn runner(&self) -> &Runner {
        &self.runner
    }

    /// The KV receiver, for a worker that decodes.
    #[must_use]
    pub fn receiver(&self) -> Option<&Arc<KvReceiver>> {
        self.receiver.as_ref()
    }

    /// True once draining (it never goes back).
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Starts draining: new work is refused from now on.
    pub fn start_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Prefill calls in flight.
    #[must_use]
    pub fn inflight_prefills(&self) -> usize {
        self.inflight().len()
    }

    /// Work not finished: Prefill calls, queued and running sequences.
    #[must_use]
    pub fn remaining_work(&self) -> usize {
        self.inflight_prefills()
            + self.runner.queue_depth() as usize
            + self.runner.running() as usize
    }

    /// Validates a PrefillRequest in the contract's order, before any work.
    fn validate(&self, req: &PrefillRequest) -> Result<Sampling, Status> {
        if !self.role.prefills() {
            return Err(Status::failed_precondition(format!(
                "worker {} has no prefill role",
                self.id
            )));
        }
        if req.request_id.is_empty() {
            return Err(invalid("empty request_id"));
        }
        if req.prompt_tokens.is_empty() {
            return Err(invalid("empty prompt"));
        }
        if req.decode_target.is_empty() {
            return Err(invalid("empty decode_target"));
        }
        let model = self.runner.model();
        let vocab = model.vocab();
        if let Some((pos, t)) = req
            .prompt_tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t >= vocab)
        {
            return Err(invalid(format!(
                "token {t} at position {pos} is outside the vocabulary of {vocab}"
            )));
        }
        if req.prompt_tokens.len() > model.max_context() as usize {
            return Err(invalid(format!(
                "prompt of {} tokens exceeds the context of {}",
                req.prompt_tokens.len(),
                model.max_context()
            )));
        }
        let sp = req.sampling.unwrap_or_default();
        let sampling = Sampling::new(
            SamplingRequest {
                temperature: sp.temperature,
                top_p: sp.top_p,
                top_k: sp.top_k,
            },
            vocab,
        )
        .map_err(|e| invalid(e.to_string()))?;
        if self.is_draining() {
            return Err(Status::unavailable(format!(
                "worker {} is draining",
                self.id
            )));
        }
        Ok(sampling)
    }
}

impl PrefillBackend for Worker {
    async fn prefill(&self, req: PrefillRequest) -> Result<KvHandle, Status> {
        let sampling = self.validate(&req)?;
        let (cancel_tx, mut cancelled) = oneshot::channel();
        {
            let mut inflight = self.inflight();
            if inflight.contains_key(&req.request_id) {
                return Err(Status::already_exists(format!(
                    "request {} is already running",
                    req.request_id
                )));
            }
            inflight.insert(req.request_id.clone(), cancel_tx);
        }
        let _guard = InflightGuard {
            worker: self,
            request_id: req.request_id.clone(),
        };
        let seed = req
            .sampling
            .and_then(|s| s.seed)
            .unwrap_or_else(crate::cli::pick_seed);

        let (key, mut events) = self.runner.submit(Request {
            prompt: req.prompt_tokens.clone(),
            sampling,
            seed,
            max_tokens: 1,
            mode: Mode::PrefillOnly,
        });
        let output = loop {
            tokio::select! {
                ev = events.recv() => match ev {
                    Some(SeqEvent::Prefilled(out)) => break out,
                    Some(SeqEvent::Refused(e)) => return Err(request_status(&e)),
                    Some(SeqEvent::Failed(e)) => return Err(seq_status(&e)),
                    Some(_) => {}
                    None => return Err(Status::unavailable("the engine stopped")),
                },
                _ = &mut cancelled => {
                    self.runner.cancel(key);
                    return Err(Status::cancelled(format!("request {} was cancelled", req.request_id)));
                }
            }
        };

        // The output's references are dropped when it goes out of scope, on every path below.
        let handle_id = format!(
            "{}-{}-{:016x}",
            self.id,
            req.request_id,
            crate::cli::pick_seed()
        );
        let store: Arc<dyn KvStore> = Arc::new(self.runner.pool().clone());
        let model = self.runner.model().name().to_owned();
        let moved = tokio::select! {
            r = kvwire_grpc::transfer(&self.transport, &req.decode_target, store, &handle_id, &model, output.blocks.ids(), &output.hashes) => r,
            _ = &mut cancelled => {
                // The push is abandoned mid-stream; the decode side undoes it.
                return Err(Status::cancelled(format!("request {} was cancelled", req.request_id)));
            }
        };
        let stats = moved.map_err(|e| {
            let code = e.code();
            let status = Status::from(e);
            // Pass the decode side's verdict through unchanged; an unreachable target is UNAVAILABLE.
            match code {
                Code::Unknown => Status::unavailable(status.message().to_owned()),
                _ => status,
            }
        })?;
        Ok(KvHandle {
            handle_id,
            first_token: output.first_token,
            block_hashes: output.hashes.clone(),
            rng_draws_consumed: output.draws,
            seed: output.seed,
            prompt_tokens: output.prompt_tokens as u32,
            decode_target: req.decode_target,
            blocks_sent: stats.sent,
            blocks_deduped: stats.deduped,
            payload_bytes: stats.payload_bytes,
            kv_format: KV_FORMAT_V1,
        })
    }

    fn info(&self) -> InfoResponse {
        let model = self.runner.model();
        let shape = model.shape();
        let counts = self.runner.pool().lock().counts();
        InfoResponse {
            worker_id: self.id.clone(),
            roles: self.role.names(),
            model: model.name().to_owned(),
            kv_format: KV_FORMAT_V1,
            block_tokens: shape.dims.block_tokens,
            n_layers: shape.dims.n_layers,
            n_kv_heads: shape.dims.n_kv_heads,
            head_dim: shape.dims.head_dim,
            free_blocks: counts.free as u32,
            total_blocks: counts.total as u32,
            queue_depth: self.runner.queue_depth() + self.inflight_prefills() as u32,
            running: self.runner.running(),
            draining: self.is_draining(),
            pending_handles: self.receiver.as_ref().map_or(0, |r| r.pending() as u32),
            used_blocks: counts.used as u32,
            cached_blocks: counts.cached as u32,
        }
    }

    fn cancel(&self, request_id: &str) -> bool {
        match self.inflight().remove(request_id) {
            Some(tx) => tx.send(()).is_ok(),
            None => false,
        }
    }

    async fn drain(&self, deadline: Duration) -> i32 {
        self.start_drain();
        let end = Instant::now() + deadline;
        while self.remaining_work() > 0 && Instant::now() < end {
            tokio::time::sleep(
                Duration::from_millis(5).min(end.saturating_duration_since(Instant::now())),
            )
            .await;
        }
        self.remaining_work() as i32
    }
}
