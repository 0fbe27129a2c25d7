//! What a drill found, typed: one report per drill, printed as its JSON line, with the verdict
//! it exits on computed from the same fields.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Value};

/// Requests by how they ended, the counts every drill reports.
#[derive(Debug, Default, Serialize)]
pub struct Ends {
    /// Requests sent.
    pub requests: usize,
    /// Requests that completed equal to a colocated run.
    pub completed_equal: u64,
    /// Requests answered with an error, in all.
    pub failed: u64,
    /// ... by cause.
    pub failed_by_cause: BTreeMap<String, u64>,
    /// Requests whose answer differed from the colocated run or never came, in all.
    pub lost: u64,
    /// ... by cause.
    pub lost_by_cause: BTreeMap<String, u64>,
}

impl Ends {
    /// The counts of `failed` and `lost` by cause, totalled.
    #[must_use]
    pub fn new(
        requests: usize,
        completed_equal: u64,
        failed: BTreeMap<String, u64>,
        lost: BTreeMap<String, u64>,
    ) -> Self {
        Self {
            requests,
            completed_equal,
            failed: failed.values().sum(),
            failed_by_cause: failed,
            lost: lost.values().sum(),
            lost_by_cause: lost,
        }
    }
}

/// `tl drill` on one gateway (ops.01): a decode engine (or the gateway) faulted and restored
/// under streaming clients.
#[derive(Debug, Serialize)]
pub struct SingleReport {
    /// "ops.01".
    pub drill: &'static str,
    /// The fault injected.
    pub fault: String,
    /// "processes", "netns" or "containers".
    pub mode: &'static str,
    /// Concurrent clients.
    pub clients: usize,
    /// The drill's length.
    pub seconds: f64,
    /// How the requests ended.
    #[serde(flatten)]
    pub ends: Ends,
    /// Streams resumed on another decode engine.
    pub failovers: u64,
    /// Failovers that gave up.
    pub failovers_gave_up: u64,
    /// Requests whose Prefill went to another decode engine after a refusal.
    pub prefill_retried_on_another_decode: usize,
    /// p99 time to first token by phase (before, during, after the fault).
    pub p99_ttft_ms: Map<String, Value>,
    /// p99 time per output token by phase.
    pub p99_tpot_ms: Map<String, Value>,
    /// First routes by phase.
    pub first_routes: Map<String, Value>,
    /// Streams on the victim when the fault landed.
    pub in_flight_at_fault_on_victim: usize,
    /// The extra wait for the next token a failover cost (p50 over those in flight).
    pub failover_extra_ms: Option<f64>,
    /// p50 of the longest gap between two tokens, of the streams on the victim at the fault.
    pub p50_max_gap_ms_in_flight_at_fault: Value,
    /// ... of the streams that ended before it.
    pub p50_max_gap_ms_undisturbed: Value,
    /// Each engine's pool back to its baseline after the drill.
    pub prefill_pool_back_to_baseline: bool,
    /// ...
    pub survivor_pool_back_to_baseline: bool,
    /// ...
    pub restored_pool_back_to_baseline: bool,
    /// The faulted decode engine.
    pub victim: &'static str,
    /// Its blocks in use just before the fault.
    pub victim_blocks_in_use_before_fault: Option<f64>,
    /// The other decode engine.
    pub survivor: &'static str,
    /// The engines' heartbeat interval.
    pub heartbeat_ms: u32,
    /// When the registry stopped listing the victim, after the fault.
    pub evicted_after_ms: Option<f64>,
    /// ... in heartbeats.
    pub evicted_within_beats: Option<f64>,
    /// A request routed to the restored engine completed equal.
    pub rejoined: bool,
    /// After a registry restart, when every engine was listed again.
    pub reregistered_after_ms: Option<f64>,
    /// ... in heartbeats.
    pub reregistered_within_beats: Option<f64>,
    /// The verdict the drill exits on.
    pub passed: bool,
}

/// `tl drill` over several gateways sharing the registry on etcd: a gateway or etcd faulted
/// and restored under clients spread over the gateways.
#[derive(Debug, Serialize)]
pub struct FleetReport {
    /// "gateways".
    pub drill: &'static str,
    /// The fault injected.
    pub fault: Option<String>,
    /// "processes" or "containers".
    pub mode: &'static str,
    /// Gateways.
    pub gateways: usize,
    /// etcd members.
    pub etcd_members: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// The drill's length.
    pub seconds: f64,
    /// How the requests ended.
    #[serde(flatten)]
    pub ends: Ends,
    /// Requests sent without streaming.
    pub non_streamed: u64,
    /// Streams cut because their gateway was killed.
    pub streams_cut_on_killed_gateway: u64,
    /// Streams cut on a gateway that was not killed (must be 0).
    pub streams_cut_on_other_gateways: u64,
    /// Cut streams that were not in flight at the fault (must be 0).
    pub streams_cut_not_in_flight_at_fault: u64,
    /// Requests a client retried.
    pub requests_retried: u64,
    /// The surviving gateways listed every engine for the whole fault.
    pub survivors_listed_every_engine_throughout: bool,
    /// When every gateway listed every engine after the restore.
    pub gateways_list_every_engine_after_restore_ms: Option<f64>,
    /// When etcd listed every engine after the restore (processes only).
    pub etcd_lists_every_engine_after_restore_ms: Option<f64>,
    /// When the fault landed, from the start.
    pub fault_at_s: f64,
    /// When it was undone.
    pub restored_at_s: f64,
    /// p99 of whole requests that completed equal.
    pub p99_request_ms: Value,
    /// Each engine's pool back to its baseline after the drill.
    pub pools_back_to_baseline: BTreeMap<&'static str, bool>,
    /// The verdict the drill exits on.
    pub passed: bool,
}

/// A drill's report.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Report {
    /// One gateway.
    Single(Box<SingleReport>),
    /// Several gateways.
    Fleet(Box<FleetReport>),
}

impl Report {
    /// The verdict: nothing lost or failed, and every check of the drill held.
    #[must_use]
    pub fn passed(&self) -> bool {
        match self {
            Self::Single(r) => r.passed,
            Self::Fleet(r) => r.passed,
        }
    }
}

/// `ms` in heartbeats of `beat_ms`, to two decimals.
#[must_use]
pub fn in_beats(ms: Option<f64>, beat_ms: u32) -> Option<f64> {
    ms.map(|ms| (ms / f64::from(beat_ms) * 100.0).round() / 100.0)
}
