//! The simulated compute cost of a step: what a GPU engine would take, slept by the engine's
//! runner after each step, so that benchmarks on a few CPU cores see a GPU's shape of cost.

use std::time::Duration;

/// Optional simulated compute cost, applied by the caller of [`Engine::step`](crate::engine::Engine::step) as a sleep after
/// the step (never by spinning), so several engines sharing few cores do not distort each other.
///
/// It behaves as a GPU engine does: a step that decodes pays once for reading the weights
/// (`decode_per_step`, whatever the batch) and then per sequence for reading its KV
/// (`decode_per_seq`); prefill pays per token computed. One step's parts add up, so a long
/// prefill in a colocated step stalls every decode of that step, as it does on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostModel {
    /// Simulated time per prompt token prefilled (cached prefix tokens cost nothing).
    pub prefill_per_token: Duration,
    /// Simulated time per running sequence per decode step.
    pub decode_per_seq: Duration,
    /// Simulated time of a step that decodes at least one sequence, once per step: reading the
    /// weights, which batching shares.
    pub decode_per_step: Duration,
}

impl CostModel {
    /// Llama-3-8B in bf16 on one H100 SXM, from its published shape and the GPU's datasheet:
    /// - per decode step, the weights read once: 8.03e9 parameters x 2 bytes = 16.06 GB over
    ///   3.35 TB/s of HBM3 = 4.79 ms;
    /// - per sequence, its KV read: 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 bytes =
    ///   128 KiB a token, at a typical 1,024-token context 134 MB = 40 us;
    /// - per prompt token prefilled, compute-bound: 2 x 8.03e9 = 16.1 GFLOP over 989 TFLOP/s
    ///   of dense bf16 at 50% utilisation = 32 us.
    #[must_use]
    pub fn llama3_8b_h100() -> Self {
        Self {
            prefill_per_token: Duration::from_micros(32),
            decode_per_seq: Duration::from_micros(40),
            decode_per_step: Duration::from_micros(4_790),
        }
    }
}
