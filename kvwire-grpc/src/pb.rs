//! Hand-written prost messages for the three packages of `proto/tl/**`. No build script and no
//! protoc: `tests/proto_conformance.rs` parses the `.proto` files and checks every field's name,
//! number and type against these structs, so the two cannot drift apart.
#![allow(missing_docs)] // The .proto files document every field.

/// `tl.kv.v1`: the KV transfer.
pub mod kv {
    use bytes::Bytes;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct HasBlocksRequest {
        #[prost(uint64, repeated, tag = "1")]
        pub hashes: Vec<u64>,
        #[prost(uint32, tag = "2")]
        pub kv_format: u32,
        #[prost(string, tag = "3")]
        pub model: String,
        /// The prompt's tokens, B per hash: a block is present only when its stored tokens, and
        /// every earlier block's, equal these.
        #[prost(uint32, repeated, tag = "4")]
        pub tokens: Vec<u32>,
        /// The tenant scope (0: shared).
        #[prost(uint64, tag = "5")]
        pub cache_scope: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct HasBlocksResponse {
        #[prost(bool, repeated, tag = "1")]
        pub present: Vec<bool>,
    }

    /// One block of a push. `payload` decodes as a [`Bytes`] slice of tonic's receive buffer:
    /// no copy until the receiver imports it into its pool.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KvChunk {
        #[prost(string, tag = "1")]
        pub handle_id: String,
        #[prost(uint32, tag = "2")]
        pub index: u32,
        #[prost(uint32, tag = "3")]
        pub total: u32,
        #[prost(uint64, tag = "4")]
        pub hash: u64,
        #[prost(uint32, tag = "5")]
        pub kv_format: u32,
        #[prost(bytes = "bytes", tag = "6")]
        pub payload: Bytes,
        #[prost(fixed32, tag = "7")]
        pub payload_crc32c: u32,
        #[prost(string, tag = "8")]
        pub model: String,
        /// The block's tokens (its fill), checked against `hash`.
        #[prost(uint32, repeated, tag = "9")]
        pub tokens: Vec<u32>,
        /// The tenant scope of the push (0: shared).
        #[prost(uint64, tag = "10")]
        pub cache_scope: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KvAck {
        #[prost(string, tag = "1")]
        pub handle_id: String,
        #[prost(uint32, tag = "2")]
        pub blocks_received: u32,
        #[prost(uint32, tag = "3")]
        pub blocks_deduped: u32,
        #[prost(uint64, tag = "4")]
        pub payload_bytes: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ReleaseRequest {
        #[prost(string, tag = "1")]
        pub handle_id: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ReleaseResponse {
        #[prost(bool, tag = "1")]
        pub released: bool,
    }

    /// Method paths of `tl.kv.v1.KvTransfer`.
    pub mod path {
        pub const SERVICE: &str = "tl.kv.v1.KvTransfer";
        pub const HAS_BLOCKS: &str = "/tl.kv.v1.KvTransfer/HasBlocks";
        pub const PUSH_KV: &str = "/tl.kv.v1.KvTransfer/PushKv";
        pub const RELEASE: &str = "/tl.kv.v1.KvTransfer/Release";
    }
}

/// `tl.engine.v1`: driving an engine.
pub mod engine {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SamplingParams {
        #[prost(float, tag = "1")]
        pub temperature: f32,
        #[prost(float, tag = "2")]
        pub top_p: f32,
        #[prost(uint32, tag = "3")]
        pub top_k: u32,
        #[prost(uint64, optional, tag = "4")]
        pub seed: Option<u64>,
        #[prost(uint32, tag = "5")]
        pub max_tokens: u32,
        /// 0 = off.
        #[prost(float, tag = "6")]
        pub min_p: f32,
        /// 0 = off.
        #[prost(float, tag = "7")]
        pub presence_penalty: f32,
        /// 0 = off.
        #[prost(float, tag = "8")]
        pub frequency_penalty: f32,
        /// 0 (unset) and 1 = off.
        #[prost(float, tag = "9")]
        pub repetition_penalty: f32,
        /// Token id -> bias.
        #[prost(btree_map = "uint32, float", tag = "10")]
        pub logit_bias: std::collections::BTreeMap<u32, f32>,
        /// The prompt's last tokens that are the request's own earlier output (failover).
        #[prost(uint32, tag = "11")]
        pub earlier_output: u32,
        /// What the output must match; absent: anything.
        #[prost(message, optional, tag = "12")]
        pub structured: Option<Structured>,
    }

    /// A structured output's spec (its kind's name and its text).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct Structured {
        #[prost(string, tag = "1")]
        pub kind: String,
        #[prost(string, tag = "2")]
        pub text: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PrefillRequest {
        #[prost(string, tag = "1")]
        pub request_id: String,
        #[prost(uint32, repeated, tag = "2")]
        pub prompt_tokens: Vec<u32>,
        #[prost(message, optional, tag = "3")]
        pub sampling: Option<SamplingParams>,
        #[prost(string, tag = "4")]
        pub decode_target: String,
        /// Draws already consumed by earlier tokens of the same request (failover; 0 normally).
        #[prost(uint32, tag = "5")]
        pub rng_draws_offset: u32,
        /// The decode engine's HasBlocks answer as the gateway got it while routing; absent:
        /// the prefill engine asks.
        #[prost(message, optional, tag = "6")]
        pub decode_holds: Option<DecodeHolds>,
        /// The tenant scope the prompt's blocks are cached and deduplicated in (0: shared).
        #[prost(uint64, tag = "7")]
        pub cache_scope: u64,
        /// Where the decode engine also answers HasBlocks, on its control threads (its
        /// EngineControl address); empty: at decode_target.
        #[prost(string, tag = "8")]
        pub decode_lookup: String,
    }

    /// A decode engine's HasBlocks answer: its format, and one flag per full block.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DecodeHolds {
        #[prost(uint32, tag = "1")]
        pub kv_format: u32,
        #[prost(bool, repeated, tag = "2")]
        pub present: Vec<bool>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KvHandle {
        #[prost(string, tag = "1")]
        pub handle_id: String,
        #[prost(uint32, tag = "2")]
        pub first_token: u32,
        #[prost(uint64, repeated, tag = "3")]
        pub block_hashes: Vec<u64>,
        #[prost(uint32, tag = "4")]
        pub rng_draws_consumed: u32,
        #[prost(uint64, tag = "5")]
        pub seed: u64,
        #[prost(uint32, tag = "6")]
        pub prompt_tokens: u32,
        #[prost(string, tag = "7")]
        pub decode_target: String,
        #[prost(uint32, tag = "8")]
        pub blocks_sent: u32,
        #[prost(uint32, tag = "9")]
        pub blocks_deduped: u32,
        #[prost(uint64, tag = "10")]
        pub payload_bytes: u64,
        #[prost(uint32, tag = "11")]
        pub kv_format: u32,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct InfoRequest {}

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct InfoResponse {
        #[prost(string, tag = "1")]
        pub worker_id: String,
        #[prost(string, repeated, tag = "2")]
        pub roles: Vec<String>,
        #[prost(string, tag = "3")]
        pub model: String,
        #[prost(uint32, tag = "4")]
        pub kv_format: u32,
        #[prost(uint32, tag = "5")]
        pub block_tokens: u32,
        #[prost(uint32, tag = "6")]
        pub n_layers: u32,
        #[prost(uint32, tag = "7")]
        pub n_kv_heads: u32,
        #[prost(uint32, tag = "8")]
        pub head_dim: u32,
        #[prost(uint32, tag = "9")]
        pub free_blocks: u32,
        #[prost(uint32, tag = "10")]
        pub total_blocks: u32,
        #[prost(uint32, tag = "11")]
        pub queue_depth: u32,
        #[prost(uint32, tag = "12")]
        pub running: u32,
        #[prost(bool, tag = "13")]
        pub draining: bool,
        #[prost(uint32, tag = "14")]
        pub pending_handles: u32,
        #[prost(uint32, tag = "15")]
        pub used_blocks: u32,
        #[prost(uint32, tag = "16")]
        pub cached_blocks: u32,
        #[prost(string, repeated, tag = "17")]
        pub serving: Vec<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CancelRequest {
        #[prost(string, tag = "1")]
        pub request_id: String,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct CancelResponse {
        #[prost(bool, tag = "1")]
        pub cancelled: bool,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct DrainRequest {
        #[prost(int64, tag = "1")]
        pub deadline_ms: i64,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct DrainResponse {
        #[prost(int32, tag = "1")]
        pub remaining: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SetRoleRequest {
        #[prost(string, tag = "1")]
        pub role: String,
        #[prost(int64, tag = "2")]
        pub deadline_ms: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SetRoleResponse {
        #[prost(string, repeated, tag = "1")]
        pub serving: Vec<String>,
        #[prost(int32, tag = "2")]
        pub remaining: i32,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct WatchBlocksRequest {}

    /// One change to an engine's prefix index.
    #[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
    pub struct BlockChange {
        /// The tenant scope (0: shared).
        #[prost(uint64, tag = "1")]
        pub cache_scope: u64,
        /// The block's chained v1 hash.
        #[prost(uint64, tag = "2")]
        pub hash: u64,
        /// true: stored; false: evicted.
        #[prost(bool, tag = "3")]
        pub stored: bool,
    }

    /// One message of a WatchBlocks stream: a snapshot (first), or changes numbered from `seq`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct BlockEvents {
        /// Random per engine process.
        #[prost(uint64, tag = "1")]
        pub epoch: u64,
        #[prost(bool, tag = "2")]
        pub snapshot: bool,
        #[prost(uint64, tag = "3")]
        pub seq: u64,
        #[prost(message, repeated, tag = "4")]
        pub changes: Vec<BlockChange>,
        #[prost(string, tag = "5")]
        pub worker_id: String,
        /// A snapshot continues in the next message.
        #[prost(bool, tag = "6")]
        pub more: bool,
    }

    /// A request's stop rules.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StopRules {
        #[prost(bytes = "vec", repeated, tag = "1")]
        pub sequences: Vec<Vec<u8>>,
        #[prost(uint32, repeated, tag = "2")]
        pub token_ids: Vec<u32>,
        #[prost(uint32, tag = "3")]
        pub min_tokens: u32,
    }

    /// What a Prefill's handle continues from.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Resume {
        #[prost(string, tag = "1")]
        pub handle_id: String,
        #[prost(uint32, tag = "2")]
        pub first_token: u32,
        #[prost(uint32, tag = "3")]
        pub rng_draws_consumed: u32,
    }

    /// A request for a decode engine's Generate.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GenerateRequest {
        #[prost(uint32, repeated, tag = "1")]
        pub prompt_tokens: Vec<u32>,
        #[prost(message, optional, tag = "2")]
        pub sampling: Option<SamplingParams>,
        #[prost(message, optional, tag = "3")]
        pub stop: Option<StopRules>,
        #[prost(uint32, tag = "4")]
        pub n: u32,
        #[prost(uint32, optional, tag = "5")]
        pub logprobs: Option<u32>,
        #[prost(uint64, tag = "6")]
        pub cache_scope: u64,
        #[prost(message, optional, tag = "7")]
        pub resume: Option<Resume>,
        #[prost(string, tag = "8")]
        pub model: String,
    }

    /// One of the most likely tokens at a step.
    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Alternative {
        #[prost(uint32, tag = "1")]
        pub token: u32,
        #[prost(float, tag = "2")]
        pub logprob: f32,
    }

    /// One token of one choice.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GeneratedToken {
        #[prost(uint32, tag = "1")]
        pub choice: u32,
        #[prost(uint32, tag = "2")]
        pub token: u32,
        #[prost(float, optional, tag = "3")]
        pub logprob: Option<f32>,
        #[prost(message, repeated, tag = "4")]
        pub top: Vec<Alternative>,
    }

    /// Why a choice ended.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Finish {
        Unspecified = 0,
        Length = 1,
        Stop = 2,
        Context = 3,
    }

    /// A choice that ended.
    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct ChoiceFinished {
        #[prost(uint32, tag = "1")]
        pub choice: u32,
        #[prost(enumeration = "Finish", tag = "2")]
        pub finish: i32,
    }

    /// One message of a Generate stream.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GenerateEvents {
        #[prost(uint64, tag = "1")]
        pub seed: u64,
        #[prost(message, repeated, tag = "2")]
        pub tokens: Vec<GeneratedToken>,
        #[prost(message, repeated, tag = "3")]
        pub finished: Vec<ChoiceFinished>,
        #[prost(int32, tag = "4")]
        pub error_code: i32,
        #[prost(string, tag = "5")]
        pub error: String,
    }

    /// Method paths of `tl.engine.v1.EngineControl`.
    pub mod path {
        pub const SERVICE: &str = "tl.engine.v1.EngineControl";
        pub const PREFILL: &str = "/tl.engine.v1.EngineControl/Prefill";
        pub const INFO: &str = "/tl.engine.v1.EngineControl/Info";
        pub const CANCEL: &str = "/tl.engine.v1.EngineControl/Cancel";
        pub const DRAIN: &str = "/tl.engine.v1.EngineControl/Drain";
        pub const WATCH_BLOCKS: &str = "/tl.engine.v1.EngineControl/WatchBlocks";
        pub const SET_ROLE: &str = "/tl.engine.v1.EngineControl/SetRole";
        pub const GENERATE: &str = "/tl.engine.v1.EngineControl/Generate";
    }
}

/// `tl.control.v1`: the worker registry.
pub mod control {
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Role {
        Unspecified = 0,
        Prefill = 1,
        Decode = 2,
        Both = 3,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WorkerStatus {
        #[prost(string, tag = "1")]
        pub worker_id: String,
        #[prost(string, tag = "2")]
        pub http_address: String,
        #[prost(string, tag = "3")]
        pub grpc_address: String,
        #[prost(string, tag = "4")]
        pub kv_address: String,
        #[prost(enumeration = "Role", tag = "5")]
        pub role: i32,
        #[prost(string, tag = "6")]
        pub model: String,
        #[prost(uint32, tag = "7")]
        pub kv_format: u32,
        #[prost(uint32, tag = "8")]
        pub queue_depth: u32,
        #[prost(uint32, tag = "9")]
        pub running: u32,
        #[prost(uint32, tag = "10")]
        pub free_blocks: u32,
        #[prost(uint32, tag = "11")]
        pub total_blocks: u32,
        #[prost(bool, tag = "12")]
        pub draining: bool,
        #[prost(uint32, tag = "13")]
        pub block_tokens: u32,
        #[prost(uint32, tag = "14")]
        pub heartbeat_ms: u32,
        /// The longest sequence this worker can ever hold (0: not reported).
        #[prost(uint32, tag = "15")]
        pub usable_context: u32,
        #[prost(enumeration = "Role", tag = "16")]
        pub serving: i32,
        /// What the worker serves, hashed: its vocabulary and its model's configuration
        /// (`tl_engine_core::model::fingerprint`); empty: not reported.
        #[prost(string, tag = "17")]
        pub fingerprint: String,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct HeartbeatAck {
        #[prost(bool, tag = "1")]
        pub drain: bool,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct ListWorkersRequest {}

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ListWorkersResponse {
        #[prost(message, repeated, tag = "1")]
        pub workers: Vec<WorkerStatus>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SetDrainRequest {
        #[prost(string, tag = "1")]
        pub worker_id: String,
        #[prost(bool, tag = "2")]
        pub drain: bool,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct SetDrainResponse {
        #[prost(bool, tag = "1")]
        pub found: bool,
    }

    /// Method paths of `tl.control.v1.WorkerRegistry`.
    pub mod path {
        pub const SERVICE: &str = "tl.control.v1.WorkerRegistry";
        pub const HEARTBEAT: &str = "/tl.control.v1.WorkerRegistry/Heartbeat";
        pub const LIST_WORKERS: &str = "/tl.control.v1.WorkerRegistry/ListWorkers";
        pub const SET_DRAIN: &str = "/tl.control.v1.WorkerRegistry/SetDrain";
    }
}
