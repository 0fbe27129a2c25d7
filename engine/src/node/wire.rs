//! What crosses `EngineControl` between the gateway and the engines, in both directions: a
//! request's sampling and stop rules as the wire carries them and back, and the core's refusals
//! and failures as gRPC statuses. Prefill and Generate read their requests through it.

use kvwire_grpc::pb::engine::{SamplingParams, StopRules, Structured};
use tl_engine_core::engine::SeqError;
use tl_engine_core::pool::PoolError;
use tl_engine_core::request::RequestError;
use tl_engine_core::sampler::SamplingRequest;
use tl_engine_core::stop::Stop;
use tonic::Status;

use crate::structured::Spec;

/// A request's sampling as the wire carries it: with `seed`, `max_tokens` (this engine's), and
/// `earlier_output` (the prompt's last tokens that are the request's own output, after a
/// failover). [`sampling_request`] reads it back.
#[must_use]
pub fn sampling_params(
    s: &SamplingRequest,
    structured: Option<&Spec>,
    seed: Option<u64>,
    max_tokens: u32,
    earlier_output: u32,
) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        seed,
        max_tokens,
        min_p: s.min_p,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: s.repetition_penalty,
        logit_bias: s.logit_bias.iter().copied().collect(),
        earlier_output,
        structured: structured.map(|s| Structured {
            kind: s.kind.name().to_owned(),
            text: s.text.clone(),
        }),
    }
}

/// A request's stop rules as the wire carries them, for an engine that continues after `held`
/// tokens of its output (`min_tokens` counts the ones sent before).
#[must_use]
pub fn stop_rules(stop: &Stop, held: u32) -> StopRules {
    StopRules {
        sequences: stop.sequences.clone(),
        token_ids: stop.token_ids.clone(),
        min_tokens: stop.min_tokens.saturating_sub(held),
    }
}

/// The sampling a peer sent, as stated, for [`Params::validate`] (which bounds every field):
/// the inverse of [`sampling_params`].
pub(crate) fn sampling_request(sp: &SamplingParams) -> SamplingRequest {
    SamplingRequest {
        temperature: sp.temperature,
        top_p: sp.top_p,
        top_k: sp.top_k,
        min_p: sp.min_p,
        presence_penalty: sp.presence_penalty,
        frequency_penalty: sp.frequency_penalty,
        repetition_penalty: sp.repetition_penalty,
        // A map on the wire: at most one bias per token.
        logit_bias: sp.logit_bias.iter().map(|(&t, &b)| (t, b)).collect(),
    }
}

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
