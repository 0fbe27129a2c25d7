//! The prefill service, built only on engines with the prefill role: runs one prefill on the
//! engine thread, ships the KV with the deduplicating transfer, drops its own references (full
//! blocks stay cached) and answers a [`KvHandle`]; on any failure it drops them before answering.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvwire_grpc::pb::engine::{KvHandle, PrefillRequest};
use kvwire_grpc::{GrpcTransport, KV_FORMAT_V1, KvStore, TransferError};
use tl_engine_core::engine::{Mode, Request, SeqError};
use tl_engine_core::pool::PoolError;
use tl_engine_core::request::{Limits, Params, RequestError};
use tl_engine_core::rng::entropy_seed;
use tl_engine_core::sampler::{Sampling, SamplingRequest};
use tokio::sync::oneshot;
use tonic::{Code, Status};

use super::runner::SeqEvent;
use super::state::NodeState;
use super::store::PoolStore;

/// The one mapping of a refused request to gRPC.
#[must_use]
pub fn request_status(e: &RequestError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// The gRPC status of a sequence that failed while running.
#[must_use]
pub fn seq_status(e: &SeqError) -> Status {
    match e {
        SeqError::Pool(PoolError::Exhausted { .. }) => Status::resource_exhausted(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// Prefill requests in flight, by request id, each with the switch that cancels it.
#[derive(Debug)]
pub struct PrefillService {
    state: Arc<NodeState>,
    transport: GrpcTransport,
    inflight: Mutex<HashMap<String, oneshot::Sender<()>>>,
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
    #[must_use]
    pub fn new(state: Arc<NodeState>, transport: GrpcTransport) -> Self {
        Self {
            state,
            transport,
            inflight: Mutex::new(HashMap::new()),
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
        let sp = req.sampling.unwrap_or_default();
        let params = Params {
            prompt: &req.prompt_tokens,
            // A prefill samples one token; max_tokens (0 on the wire: unset) is the decode
            // side's business.
            max_tokens: sp.max_tokens.max(1),
            sampling: SamplingRequest {
                temperature: sp.temperature,
                top_p: sp.top_p,
                top_k: sp.top_k,
            },
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
        let seed = req
            .sampling
            .and_then(|s| s.seed)
            .unwrap_or_else(entropy_seed);
        let runner = self.state.runner();
        let (key, mut events) = runner.submit(Request {
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
                    runner.cancel(key);
                    return Err(Status::cancelled(format!("request {} was cancelled", req.request_id)));
                }
            }
        };

        // The output's references are dropped when it goes out of scope, on every path below.
        let handle_id = format!(
            "{}-{}-{:016x}",
            self.state.id(),
            req.request_id,
            entropy_seed()
        );
        let store: Arc<dyn KvStore> = Arc::new(PoolStore::new(runner.pool().clone()));
        let model = runner.model().name().to_owned();
        let moved = tokio::select! {
            r = kvwire_grpc::transfer(&self.transport, &req.decode_target, store, &handle_id, &model, output.blocks.ids(), &output.hashes) => r,
            _ = &mut cancelled => {
                // The push is abandoned mid-stream; the decode side undoes it.
                return Err(Status::cancelled(format!("request {} was cancelled", req.request_id)));
            }
        };
        let stats = moved.map_err(transfer_status)?;
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

    /// Stops a queued or running prefill; `true` when one was found.
    pub fn cancel(&self, request_id: &str) -> bool {
        match self.inflight().remove(request_id) {
            Some(tx) => tx.send(()).is_ok(),
            None => false,
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
