//! The prefill service, built only on engines with the prefill role: runs one prefill on the
//! engine thread, ships the KV with the deduplicating transfer, drops its own references (full
//! blocks stay cached) and answers a [`KvHandle`]; on any failure it drops them before answering.
//!
//! The push overlaps the prefill: HasBlocks is asked as soon as the prefill starts (the hashes
//! depend only on the prompt), and each missing block is streamed as soon as the model has
//! written it ([`Feed`]). A prefill that fails or is cancelled midway drops the push, whose
//! stream is reset, and the decode side undoes it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvwire::prompt_hashes;
use kvwire_grpc::pb::engine::{DecodeHolds, KvHandle, PrefillRequest};
use kvwire_grpc::{
    BlockId, GrpcTransport, KvStore, KvTransport, Push, TransferError, TransferStats,
};
use tl_engine_core::engine::{Mode, PrefillOutput, PrefillProgress, Request, StepEvent};
use tl_engine_core::pool::{Blocks, SharedKv};
use tl_engine_core::request::{Limits, Params};
use tl_engine_core::rng::entropy_seed;
use tl_engine_core::sampler::Sampling;
use tokio::sync::{mpsc as tmpsc, oneshot, watch};
use tonic::{Code, Status};
use tracing::Instrument;

use super::runner::Heard;
use super::state::NodeState;
use super::store::PoolStore;
use super::wire::{request_status, sampling_request, seq_status};
use crate::telemetry::metrics::SharedMetrics;

/// Prefill requests in flight, by request id, each with the switch that cancels it.
#[derive(Debug)]
pub struct PrefillService {
    state: Arc<NodeState>,
    transport: Arc<GrpcTransport>,
    inflight: Mutex<HashMap<String, oneshot::Sender<()>>>,
    pipelined: bool,
    metrics: SharedMetrics,
    /// The runtime pushes run on: the one the service was made on (the process's data plane),
    /// not the control runtime its Prefill calls are answered on, so that a push's encoding
    /// and writes never hold the thread that answers Info, Cancel and Drain.
    data: tokio::runtime::Handle,
}

/// A push running on the data-plane runtime, as a future of its outcome. Dropping it aborts
/// the push (its stream is reset when the task is dropped, and the decode side undoes it);
/// [`stop`](Self::stop) also waits until that has happened.
struct Pushing(Option<tokio::task::JoinHandle<Result<TransferStats, TransferError>>>);

impl Future for Pushing {
    type Output = Result<TransferStats, TransferError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let Some(task) = self.0.as_mut() else {
            return std::task::Poll::Ready(Err(TransferError::Rpc(Status::internal(
                "the push was polled after it ended",
            ))));
        };
        let out = std::task::ready!(std::pin::Pin::new(task).poll(cx));
        // Ended: nothing left to abort or wait for.
        self.0 = None;
        std::task::Poll::Ready(out.unwrap_or_else(|e| {
            Err(TransferError::Rpc(Status::internal(format!(
                "the push task ended: {e}"
            ))))
        }))
    }
}

impl Pushing {
    /// Aborts the push, if it is still running, and waits until its task (and so its stream
    /// and its references) is gone.
    async fn stop(mut self) {
        if let Some(mut task) = self.0.take() {
            task.abort();
            let _ = (&mut task).await;
        }
    }
}

impl Drop for Pushing {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// What one push needs, owned, so that it can run as a task of its own.
struct PushJob {
    transport: Arc<GrpcTransport>,
    store: Arc<dyn KvStore>,
    target: String,
    lookup: String,
    handle_id: String,
    model: String,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    scope: u64,
    known: Option<DecodeHolds>,
}

impl PushJob {
    fn push(&self, n_blocks: usize) -> Push<'_> {
        Push {
            target: &self.target,
            handle_id: &self.handle_id,
            model: &self.model,
            hashes: &self.hashes,
            n_blocks,
            // Each chunk carries its tokens: the decode engine deduplicates only onto a block
            // with the same tokens in the same scope, and the claim compares every token.
            tokens: &self.tokens,
            scope: self.scope,
            // The gateway's HasBlocks answer while routing: the decode engine is asked once.
            known: self.known.as_ref().map(|h| kvwire_grpc::Holds {
                kv_format: h.kv_format,
                present: &h.present,
            }),
            // Asked where the decode engine answers it on its control threads, when the
            // gateway says where.
            lookup: Some(self.lookup.as_str()),
        }
    }
}

/// The prefill's blocks as they are written, for the push: each published block carries a
/// reference of the feed's own (taken on the engine thread, under the pool's lock, while the
/// sequence still holds its own), so a block being sent is never reused, whatever the prefill
/// does next. The references go when the feed does.
#[derive(Debug)]
struct Feed {
    pool: SharedKv,
    tx: watch::Sender<Vec<BlockId>>,
}

impl Feed {
    fn new(pool: SharedKv) -> Self {
        Self {
            pool,
            tx: watch::Sender::new(Vec::new()),
        }
    }
}

impl PrefillProgress for Feed {
    fn written(&self, blocks: &[BlockId], written: usize) {
        self.tx.send_if_modified(|held| {
            let from = held.len();
            if written <= from {
                return false;
            }
            let mut pool = self.pool.lock();
            for &id in &blocks[from..written.min(blocks.len())] {
                // The sequence holds a reference, so this cannot fail.
                if pool.retain(id).is_err() {
                    break;
                }
                held.push(id);
            }
            held.len() > from
        });
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        let held = self.tx.send_replace(Vec::new());
        if held.is_empty() {
            return;
        }
        let mut pool = self.pool.lock();
        for id in held {
            let res = pool.release(id);
            debug_assert!(res.is_ok(), "feed block {id}: {res:?}");
        }
    }
}

/// Removes a request from the in-flight table however its Prefill call ends.
struct Registered<'s> {
    service: &'s PrefillService,
    request_id: String,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.service.inflight().remove(&self.request_id);
    }
}

impl PrefillService {
    /// The prefill service of `state`'s engine, pushing KV with `transport`.
    /// With `pipelined`, each block is streamed as soon as it is written; otherwise the push
    /// starts after the whole prefill. Pushes run on the runtime this is called on.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    #[must_use]
    pub fn new(
        state: Arc<NodeState>,
        transport: GrpcTransport,
        pipelined: bool,
        metrics: SharedMetrics,
    ) -> Self {
        Self {
            state,
            transport: Arc::new(transport),
            inflight: Mutex::new(HashMap::new()),
            pipelined,
            metrics,
            data: tokio::runtime::Handle::current(),
        }
    }

    fn inflight(&self) -> MutexGuard<'_, HashMap<String, oneshot::Sender<()>>> {
        self.inflight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Validates a PrefillRequest in the contract's order, before any work: the RPC's own fields,
    /// then the core's one request validation, then the drain.
    fn validate(&self, req: &PrefillRequest) -> Result<Sampling, Status> {
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("empty request_id"));
        }
        if req.decode_target.is_empty() {
            return Err(Status::invalid_argument("empty decode_target"));
        }
        let sp = req.sampling.clone().unwrap_or_default();
        let params = Params {
            prompt: &req.prompt_tokens,
            // A prefill samples one token; max_tokens (0 on the wire: unset) is the decode
            // side's business.
            max_tokens: sp.max_tokens.max(1),
            sampling: sampling_request(&sp),
        };
        let sampling = params
            .validate(Limits::of(self.state.runner().model().as_ref()))
            .map_err(|e| request_status(&e))?;
        if self.state.is_draining() {
            return Err(Status::unavailable(format!(
                "worker {} is draining",
                self.state.id()
            )));
        }
        Ok(sampling)
    }

    /// Runs one prefill and ships its KV to `decode_target`.
    ///
    /// # Errors
    /// The contract's codes: INVALID_ARGUMENT, UNAVAILABLE (draining, or the target unreachable),
    /// ALREADY_EXISTS, CANCELLED, RESOURCE_EXHAUSTED, and the decode side's verdict unchanged.
    pub async fn prefill(&self, req: PrefillRequest) -> Result<KvHandle, Status> {
        // The call's own span (EngineControl/Prefill), when traced, names this worker.
        tracing::Span::current().record("tl.worker", self.state.id());
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
        let _registered = Registered {
            service: self,
            request_id: req.request_id.clone(),
        };
        let _counted = self.state.prefill_started();
        // Counted first, then checked: a role change that waits for the Prefill calls to end
        // either sees this one or this one sees the change.
        self.state.serves_prefill()?;
        let seed = req
            .sampling
            .as_ref()
            .and_then(|s| s.seed)
            .unwrap_or_else(entropy_seed);
        let earlier_output = req.sampling.as_ref().map_or(0, |s| s.earlier_output);
        let constraint = self
            .state
            .constraint(req.sampling.as_ref().and_then(|s| s.structured.as_ref()))
            .await?;
        let runner = self.state.runner();
        let request = Request {
            prompt: req.prompt_tokens.clone(),
            sampling,
            seed,
            max_tokens: 1,
            mode: Mode::PrefillOnly,
            draws_offset: u64::from(req.rng_draws_offset),
            stop: tl_engine_core::stop::Stop::default(),
            choices: tl_engine_core::engine::Choices::ONE,
            scope: req.cache_scope,
            earlier_output,
            constraint,
        };
        let handle_id = format!(
            "{}-{}-{:016x}",
            self.state.id(),
            req.request_id,
            entropy_seed()
        );
        let store: Arc<dyn KvStore> = Arc::new(PoolStore::new(runner.pool().clone()));
        let model = runner.model().name().to_owned();
        let b = runner.model().shape().block_tokens() as usize;
        let hashes = prompt_hashes(&req.prompt_tokens, b);
        let n_blocks = req.prompt_tokens.len().div_ceil(b);
        let job = PushJob {
            transport: Arc::clone(&self.transport),
            store,
            target: req.decode_target.clone(),
            lookup: req.decode_lookup.clone(),
            handle_id: handle_id.clone(),
            model,
            hashes: hashes.clone(),
            tokens: req.prompt_tokens.clone(),
            scope: req.cache_scope,
            known: req.decode_holds.clone(),
        };
        let started = std::time::Instant::now();
        // Whatever ends this call early (a failure, a cancel, the client going away) drops the
        // prefill's output and the push: the blocks' references go, the stream is reset, and
        // the decode side undoes what it imported.
        let (output, stats) = if self.pipelined {
            self.pipelined(&req, request, job, n_blocks, &mut cancelled)
                .await?
        } else {
            self.serial(&req.request_id, request, job, &mut cancelled)
                .await?
        };
        debug_assert_eq!(output.hashes, hashes);
        self.metrics.push_sent(
            stats.sent,
            stats.deduped,
            stats.payload_bytes,
            started.elapsed(),
        );
        tracing::info!(
            request_id = %req.request_id,
            handle_id = %handle_id,
            worker_id = %self.state.id(),
            blocks_sent = stats.sent,
            blocks_deduped = stats.deduped,
            payload_bytes = stats.payload_bytes,
            "prefilled and pushed"
        );
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
            kv_format: stats.kv_format,
        })
    }

    /// The prefill with each block pushed as soon as it is written: the compute and the push
    /// overlap, each under a span of its own.
    async fn pipelined(
        &self,
        req: &PrefillRequest,
        request: Request,
        job: PushJob,
        n_blocks: usize,
        cancelled: &mut oneshot::Receiver<()>,
    ) -> Result<(PrefillOutput, TransferStats), Status> {
        let runner = self.state.runner();
        let handle_id = job.handle_id.clone();
        let feed = Arc::new(Feed::new(runner.pool().clone()));
        let blocks = feed.tx.subscribe();
        // The feed (and its references) lives until this call returns: the push may still
        // be sending blocks after the sequence has left the engine.
        let (key, mut events) = runner.submit_observed(request, Some(feed.clone()));
        // The compute (submit to first token) and the push (HasBlocks to ack) overlap:
        // two sibling spans under the call's own.
        let mut computing = Some(tracing::info_span!(
            "engine.prefill",
            otel.kind = "internal",
            tl.worker = self.state.id(),
            prompt_tokens = req.prompt_tokens.len()
        ));
        let transfer = transfer_span(&handle_id, self.state.id());
        // On the data-plane runtime, holding the feed (and so its blocks) while it runs.
        let mut push = {
            let (span, feed) = (transfer.clone(), Arc::clone(&feed));
            self.on_data(async move {
                let _feed = feed;
                let push = job.push(n_blocks);
                kvwire_grpc::transfer_streaming(
                    &*job.transport,
                    Arc::clone(&job.store),
                    push,
                    blocks,
                )
                .instrument(span)
                .await
            })
        };
        let (mut output, mut moved) = (None, None);
        let ended: Result<(), Status> = loop {
            if output.is_some() && moved.is_some() {
                break Ok(());
            }
            tokio::select! {
                ev = events.recv(), if output.is_none() => match prefill_event(ev) {
                    Some(Ok(out)) => {
                        computing = None;
                        output = Some(out);
                    }
                    Some(Err(e)) => break Err(e),
                    None => {}
                },
                r = &mut push, if moved.is_none() => match r {
                    Ok(stats) => {
                        record_transfer(&transfer, Ok(&stats));
                        moved = Some(stats);
                    }
                    Err(e) => {
                        record_transfer(&transfer, Err(e.code()));
                        // The decode side refused: no reason to go on computing.
                        runner.cancel(key);
                        break Err(transfer_status(e));
                    }
                },
                _ = &mut *cancelled => {
                    runner.cancel(key);
                    break Err(cancelled_status(&req.request_id));
                }
            }
        };
        drop(computing);
        match (ended, output, moved) {
            (Ok(()), Some(output), Some(stats)) => Ok((output, stats)),
            (Ok(()), ..) => Err(Status::internal("prefill ended without output")),
            (Err(e), _, moved) => {
                // A failed push is answered once the engine thread has let the sequence go, so
                // the caller sees the pool as it was; the stream is reset first (the decode side
                // undoes what it imported). A cancel is not waited for: nobody is listening,
                // and the blocks come back when the thread next reads its commands.
                push.stop().await;
                if e.code() != Code::Cancelled {
                    settle(&mut events).await;
                }
                tracing::warn!(
                    request_id = %req.request_id,
                    handle_id = %handle_id,
                    worker_id = %self.state.id(),
                    code = ?e.code(),
                    error = %e.message(),
                    "prefill failed"
                );
                if moved.is_some() {
                    // The push completed before the prefill failed or was cancelled: the decode
                    // side holds a handle nobody will claim. Release it now rather than at the
                    // end of its lease.
                    self.release_abandoned(&req.decode_target, &handle_id);
                }
                Err(e)
            }
        }
    }

    /// The prefill, then the push of its blocks.
    async fn serial(
        &self,
        request_id: &str,
        request: Request,
        job: PushJob,
        cancelled: &mut oneshot::Receiver<()>,
    ) -> Result<(PrefillOutput, TransferStats), Status> {
        let runner = self.state.runner();
        let (key, mut events) = runner.submit(request);
        let mut output = loop {
            tokio::select! {
                ev = events.recv() => match prefill_event(ev) {
                    Some(Ok(out)) => break out,
                    Some(Err(e)) => return Err(e),
                    None => {}
                },
                _ = &mut *cancelled => {
                    runner.cancel(key);
                    return Err(cancelled_status(request_id));
                }
            }
        };
        // The push owns the prefill's block references until it ends.
        let held = std::mem::replace(
            &mut output.blocks,
            Blocks::new(runner.pool().clone(), Vec::new()),
        );
        let job = PushJob {
            hashes: output.hashes.clone(),
            ..job
        };
        let mut push = self.on_data(async move {
            let push = job.push(held.len());
            kvwire_grpc::transfer(&*job.transport, Arc::clone(&job.store), push, held.ids()).await
        });
        let moved = tokio::select! {
            r = &mut push => r,
            _ = &mut *cancelled => {
                push.stop().await;
                return Err(cancelled_status(request_id));
            }
        };
        Ok((output, moved.map_err(transfer_status)?))
    }

    /// `push` as a task on the data-plane runtime.
    fn on_data(
        &self,
        push: impl Future<Output = Result<TransferStats, TransferError>> + Send + 'static,
    ) -> Pushing {
        Pushing(Some(self.data.spawn(push)))
    }

    /// Releases, in the background and bounded by the transport's call timeout, a handle the
    /// decode side holds for a push whose Prefill failed afterwards. On the data-plane runtime,
    /// so that a channel it opens has its connection there, as the pushes' have.
    fn release_abandoned(&self, target: &str, handle_id: &str) {
        let transport = Arc::clone(&self.transport);
        let (target, handle_id) = (target.to_owned(), handle_id.to_owned());
        self.data.spawn(async move {
            // Best effort: the lease frees it anyway if this fails.
            let _ = transport.release(&target, &handle_id).await;
        });
    }

    /// Stops a queued or running prefill; `true` when one was found.
    pub fn cancel(&self, request_id: &str) -> bool {
        match self.inflight().remove(request_id) {
            Some(tx) => tx.send(()).is_ok(),
            None => false,
        }
    }
}

/// How long a failed call waits for the engine thread to drop its sequence: one engine step at
/// most, in practice; bounded so that a wedged engine cannot hold the answer.
const CANCEL_SETTLE: Duration = Duration::from_secs(5);

/// Waits, up to [`CANCEL_SETTLE`], until the engine thread has dropped a sequence it was told
/// to cancel (or that failed): it closes the sequence's event stream after releasing its
/// blocks. A prefill on the engine thread holds its blocks until the thread next reads its
/// commands, so an answer sent before then would leave them held for a moment after the error.
/// On the same prefill engine a retry would queue behind that step anyway.
async fn settle(events: &mut tmpsc::UnboundedReceiver<Heard>) {
    let drained = async { while events.recv().await.is_some() {} };
    let _ = tokio::time::timeout(CANCEL_SETTLE, drained).await;
}

/// What one engine event means to a Prefill: its output, its failure, or nothing yet (the
/// pipelined and the plain Prefill read the engine's events through this one function).
/// The answer to a Prefill that was cancelled.
fn cancelled_status(request_id: &str) -> Status {
    Status::cancelled(format!("request {request_id} was cancelled"))
}

fn prefill_event(
    ev: Option<Heard>,
) -> Option<Result<tl_engine_core::engine::PrefillOutput, Status>> {
    match ev {
        Some(Ok(StepEvent::Prefilled { output, .. })) => Some(Ok(output)),
        Some(Err(e)) => Some(Err(request_status(&e))),
        Some(Ok(StepEvent::Failed { error, .. })) => Some(Err(seq_status(&error))),
        Some(_) => None,
        None => Some(Err(Status::unavailable("the engine stopped"))),
    }
}

/// The prefill side's `kv.transfer` span (kind CLIENT); the decode side's SERVER span is its
/// child, through the `traceparent` the push carries.
fn transfer_span(handle_id: &str, worker: &str) -> tracing::Span {
    tracing::info_span!(
        "kv.transfer",
        otel.kind = "client",
        tl.worker = worker,
        kv.handle_id = handle_id,
        kv.blocks_sent = tracing::field::Empty,
        kv.blocks_deduped = tracing::field::Empty,
        kv.payload_bytes = tracing::field::Empty,
        rpc.grpc.status_code = tracing::field::Empty,
    )
}

/// What a transfer moved, or its code, on its span.
fn record_transfer(span: &tracing::Span, r: Result<&kvwire_grpc::TransferStats, Code>) {
    match r {
        Ok(st) => {
            span.record("kv.blocks_sent", st.sent);
            span.record("kv.blocks_deduped", st.deduped);
            span.record("kv.payload_bytes", st.payload_bytes);
            span.record("rpc.grpc.status_code", 0);
        }
        Err(code) => {
            span.record("rpc.grpc.status_code", code as i32);
        }
    }
}

/// The decode side's verdict passes through unchanged; an unreachable target is UNAVAILABLE.
fn transfer_status(e: TransferError) -> Status {
    let code = e.code();
    let status = Status::from(e);
    match code {
        Code::Unknown => Status::unavailable(status.message().to_owned()),
        _ => status,
    }
}
