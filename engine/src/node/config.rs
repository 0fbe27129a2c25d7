//! The engine's TOML configuration. Every key is optional and documented with its default;
//! unknown keys are refused, so a typo is an error rather than a silently ignored setting.
//!
//! ```toml
//! [engine]
//! id = "engine"                 # worker id, unique per registry; part of every handle id
//! role = "both"                 # prefill | decode | both
//! serving = ""                  # the role it takes new work in at start, within `role` (an
//!                               # engine of role both may start as prefill or decode, and be
//!                               # moved at run time by EngineControl.SetRole); "": `role`
//! grpc_listen = "127.0.0.1:0"   # EngineControl (tl.engine.v1); port 0 picks a free port
//! kv_listen = "127.0.0.1:0"     # KvTransfer (tl.kv.v1), served by decode engines
//! http_listen = "127.0.0.1:0"   # POST /v1/completions, served by decode engines
//! gateway_registry = ""         # host:port of the gateway's WorkerRegistry; empty: no heartbeat
//! heartbeat_ms = 2000           # heartbeat interval
//! advertise_address = ""        # host peers reach this engine at; empty: the bound address
//! push_while_prefilling = true  # prefill roles: stream each block as soon as it is written
//! metrics_listen = "127.0.0.1:0" # GET /metrics (Prometheus text), /livez, /readyz, plaintext
//! drain_probe = false           # POST /drain on that listener (a pod's preStop hook): off, since
//!                               # every local user and web page reaches loopback; when on, only
//!                               # loopback callers that are not a browser
//! max_prefill_tokens = 0        # prompt tokens one step prefills (the first waiting request is
//!                               # always admitted); 0: every waiting request
//! max_step_tokens = 0           # tokens one step computes, decodes and prefill chunks together:
//!                               # a longer prompt is prefilled in whole blocks over several
//!                               # steps (chunked prefill); 0: every prompt whole in its step
//! import_threads = 2            # decode roles: threads that check and copy pushed blocks into
//!                               # the pool, off the async workers; 0: on them (block_in_place)
//! import_nice = 10              # the nice value those threads run at (0..=19): a control call
//!                               # that wakes while an import holds a core runs first
//! control_threads = 1           # threads of the control plane's own runtime (EngineControl's
//!                               # port, the heartbeat, the registry client): a control call
//!                               # never queues behind a KV connection's task; 0: share the
//!                               # process's runtime
//! control_realtime = 0          # 1..=99: the control runtime's threads run SCHED_FIFO at this
//!                               # priority (needs CAP_SYS_NICE; refused: a warning, and they
//!                               # run as before); 0: normal scheduling
//!
//! [model]
//! kind = "fake"                 # "fake": the deterministic fake model, named "fake";
//!                               # "llama": the checkpoint at `path`
//! path = ""                     # a GGUF file, or a Hugging Face checkpoint directory
//!                               # (config.json and its safetensors): kind "llama"; L, H, D and
//!                               # vocab come from it
//! name = ""                     # the served model name ("": the file's or directory's name)
//! threads = 0                   # threads of the llama kernels (0: every core)
//! kernels = "simd"              # "simd": the engine's own vector kernels (bf16 read in
//!                               # place, one written order: the same bits on every CPU);
//!                               # "gemm": the gemm crate's FMA kernels; "portable": the
//!                               # "simd" order in plain Rust, the same bits, slower
//! vocab = 260                   # byte-level tokenizer: 256 bytes + 4 specials
//! n_layers = 2                  # L
//! n_kv_heads = 1                # H
//! head_dim = 4                  # D
//! max_context = 4096            # prompt plus completion, in tokens
//! prefill_us_per_token = 0      # simulated compute (sleep) per prompt token prefilled; 0: off
//! decode_us_per_seq = 0         # simulated compute (sleep) per sequence per decode step; 0: off
//! decode_us_per_step = 0        # simulated compute once per step that decodes (the weights); 0: off
//! cost_preset = ""              # "llama-3-8b-h100": the three above from that shape (keys set
//!                               # above 0 override it); see CostModel::llama3_8b_h100
//!
//! [pool]
//! block_tokens = 4              # B
//! n_blocks = 1024               # blocks in the KV pool
//!
//! [registry]                    # the worker registry on etcd, instead of gateway_registry
//! etcd_endpoints = []           # etcd client URLs (https:// with [tls]); empty: not on etcd
//! prefix = "/tl"                # the keys live under <prefix>/workers/ and <prefix>/drain/
//! allow_no_auth = false         # register on an etcd whose auth is off (tests only)
//!
//! [limits]                      # see net/limits.rs: every bound a peer meets, and drain_ms
//!
//! [tls]                         # mutual TLS on every port (see `tl certs`); omitted: plaintext,
//! ca = "certs/ca.pem"           # and then only loopback listen addresses are allowed unless
//! cert = "certs/decode-1.pem"   # allow_insecure = true (a top-level key)
//! key = "certs/decode-1.key"
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvwire::Shape;
use serde::Deserialize;

use crate::net::is_loopback_listen;
use crate::net::limits::LimitsSection;
use crate::net::tls::TlsSection;
use crate::toml_file;

use tl_engine_core::cost::CostModel;
use tl_engine_core::model::{BYTE_VOCAB, FakeModel, Model};

/// A loaded checkpoint's identity: directory, name, B, threads, context.
type LlamaKey = (std::path::PathBuf, String, u32, usize, u32, &'static str);
use tl_engine_core::pool::{KvPool, SharedKv};

pub use crate::net::role::{Role, UnknownRole};

/// The whole configuration file.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[engine]`.
    pub engine: EngineSection,
    /// `[model]`.
    pub model: ModelSection,
    /// `[pool]`.
    pub pool: PoolSection,
    /// `[tls]`: mutual TLS on every port and connection (spec/identities.md).
    pub tls: Option<TlsSection>,
    /// Without `[tls]`, listen on non-loopback addresses anyway.
    pub allow_insecure: bool,
    /// `[limits]`: what one peer can take (spec/limits.md).
    pub limits: LimitsSection,
    /// `[telemetry]`: where spans are exported (spec/telemetry.md).
    pub telemetry: crate::telemetry::TelemetrySection,
    /// `[registry]`: the worker registry on etcd (`etcd_endpoints`), instead of the
    /// gateway's own (`[engine] gateway_registry`).
    pub registry: crate::etcd::RegistrySection,
}

/// `[engine]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSection {
    /// Worker id.
    pub id: String,
    /// Role.
    pub role: Role,
    /// The role it takes new work in at start (within `role`); `None`: `role`.
    pub serving: Option<Role>,
    /// EngineControl listen address.
    pub grpc_listen: String,
    /// KvTransfer listen address.
    pub kv_listen: String,
    /// HTTP listen address.
    pub http_listen: String,
    /// The gateway's registry, or empty.
    pub gateway_registry: String,
    /// Heartbeat interval in milliseconds.
    pub heartbeat_ms: u32,
    /// The host (IP or DNS name) peers reach this engine at, advertised to the registry with
    /// the bound ports; empty: the bound address (which must then not be unspecified).
    pub advertise_address: String,
    /// Prefill role: stream each block to the decode engine as soon as the prefill has written
    /// it (true), or push after the whole prefill (false).
    pub push_while_prefilling: bool,
    /// `GET /metrics` listen address (plaintext: metrics carry no secrets, and a scraper
    /// usually reaches it from outside, so it may be any address).
    pub metrics_listen: String,
    /// `POST /drain` on the metrics listener: off by default (a drain cannot be undone, and
    /// every local user and web page reaches loopback); a pod's `preStop` hook turns it on.
    pub drain_probe: bool,
    /// Prompt tokens one engine step may prefill (the first waiting request is always
    /// admitted, however long); 0: every waiting request.
    pub max_prefill_tokens: usize,
    /// Tokens one step computes, decodes and prefill chunks together (chunked prefill); 0: off.
    pub max_step_tokens: usize,
    /// Decode roles: threads that check and copy pushed blocks into the pool (the import
    /// lane); 0: no lane, the async workers import in place.
    pub import_threads: usize,
    /// The nice value of the import lane's threads (0..=19); raising a thread's nice value
    /// needs no privilege.
    pub import_nice: i32,
    /// Worker threads of the control plane's own runtime (EngineControl's port, the heartbeat
    /// and its registry client); 0: they share the process's runtime with the data plane.
    pub control_threads: usize,
    /// 1..=99: the control runtime's threads run `SCHED_FIFO` at this priority, so a control
    /// call that wakes while the data plane holds both cores runs at the next point the kernel
    /// may switch; 0 (the default): normal scheduling. Needs `CAP_SYS_NICE` (or an
    /// `RLIMIT_RTPRIO` this high); when refused the engine logs a warning and runs as before.
    pub control_realtime: u8,
}

impl Default for EngineSection {
    fn default() -> Self {
        Self {
            id: "engine".into(),
            role: Role::Both,
            serving: None,
            grpc_listen: "127.0.0.1:0".into(),
            kv_listen: "127.0.0.1:0".into(),
            http_listen: "127.0.0.1:0".into(),
            gateway_registry: String::new(),
            heartbeat_ms: 2000,
            advertise_address: String::new(),
            push_while_prefilling: true,
            metrics_listen: "127.0.0.1:0".into(),
            drain_probe: false,
            max_prefill_tokens: 0,
            max_step_tokens: 0,
            import_threads: 2,
            import_nice: 10,
            control_threads: 1,
            control_realtime: 0,
        }
    }
}

/// `[model]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Model kind: `fake`, or `llama` (a checkpoint at `path`).
    pub kind: ModelKind,
    /// The checkpoint of a `llama` model, a GGUF file or a Hugging Face directory (setting it
    /// makes the kind `llama`).
    pub path: String,
    /// The served name of a `llama` model (empty: the directory's name).
    pub name: String,
    /// Threads of the llama kernels (0: every core).
    pub threads: usize,
    /// The llama matrix-multiply kernels: `simd`, `gemm` or `portable`.
    pub kernels: tl_llama::kernels::Kernels,
    /// Vocabulary size.
    pub vocab: u32,
    /// L.
    pub n_layers: u32,
    /// H.
    pub n_kv_heads: u32,
    /// D.
    pub head_dim: u32,
    /// Context length.
    pub max_context: u32,
    /// Simulated microseconds per prompt token prefilled.
    pub prefill_us_per_token: u64,
    /// Simulated microseconds per sequence per decode step.
    pub decode_us_per_seq: u64,
    /// Simulated microseconds once per step that decodes (the weights' read).
    pub decode_us_per_step: u64,
    /// A named cost model the three figures above default to ("": none; "llama-3-8b-h100").
    pub cost_preset: CostPreset,
}

/// `[model] kind`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// The deterministic fake model (`spec/fake-model.md`), named `fake`.
    #[default]
    Fake,
    /// A Llama-family checkpoint at `[model] path`.
    Llama,
}

impl ModelKind {
    /// Its configuration name, which is also the fake model's served name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Fake => "fake",
            Self::Llama => "llama",
        }
    }
}

/// `[model] cost_preset`: a named simulated cost model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum CostPreset {
    /// None: the three figures alone (0, the default, is no cost).
    #[default]
    #[serde(rename = "")]
    None,
    /// Llama-3-8B on an H100 ([`CostModel::llama3_8b_h100`]).
    #[serde(rename = "llama-3-8b-h100")]
    Llama3_8bH100,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            kind: ModelKind::Fake,
            path: String::new(),
            name: String::new(),
            threads: 0,
            kernels: tl_llama::kernels::Kernels::Simd,
            vocab: BYTE_VOCAB,
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 4,
            max_context: 4096,
            prefill_us_per_token: 0,
            decode_us_per_seq: 0,
            decode_us_per_step: 0,
            cost_preset: CostPreset::None,
        }
    }
}

/// `[pool]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolSection {
    /// B.
    pub block_tokens: u32,
    /// Blocks in the pool.
    pub n_blocks: u32,
}

impl Default for PoolSection {
    fn default() -> Self {
        Self {
            block_tokens: 4,
            n_blocks: 1024,
        }
    }
}

/// The machine's memory in bytes (`MemTotal` of /proc/meminfo), where it can be read.
fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

pub use crate::toml_file::ConfigError;

/// Why a colocated reference run could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// The model could not be built.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The request was refused or failed.
    #[error(transparent)]
    Generate(#[from] tl_engine_core::engine::GenerateError),
    /// The structured output's spec was refused.
    #[error(transparent)]
    Structured(#[from] crate::structured::StructuredError),
}

impl Config {
    /// The defaults for a worker named `id` with `role`, beating to the registry at `registry`
    /// (empty: no heartbeat).
    #[must_use]
    pub fn for_worker(id: &str, role: Role, registry: &str) -> Self {
        let mut c = Self::default();
        c.engine.id = id.into();
        c.engine.role = role;
        c.engine.gateway_registry = registry.into();
        c
    }

    /// Reads and validates a file.
    ///
    /// # Errors
    /// I/O, parse, or validation errors.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let cfg: Config = toml_file::read(path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads `path` if given, else the defaults, without validating: for a caller that applies
    /// overrides (command-line flags) first and calls [`validate`](Self::validate) after.
    ///
    /// # Errors
    /// I/O or parse errors.
    pub fn read_or_default(path: Option<&Path>) -> Result<Self, ConfigError> {
        match path {
            Some(p) => Ok(toml_file::read(p)?),
            None => Ok(Self::default()),
        }
    }

    /// Reads `path` if given, else the defaults.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn load_or_default(path: Option<&Path>) -> Result<Self, ConfigError> {
        match path {
            Some(p) => Self::load(p),
            None => Ok(Self::default()),
        }
    }

    /// `--model`: `fake`, or a checkpoint (a GGUF file or a directory) served as a Llama-family
    /// model.
    pub fn set_model(&mut self, model: &str) {
        if model == "fake" {
            self.model.kind = ModelKind::Fake;
            self.model.path.clear();
        } else {
            self.model.kind = ModelKind::Llama;
            self.model.path = model.to_owned();
        }
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// The first value out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        crate::net::limits::in_range("engine.import_threads", self.engine.import_threads, 0, 64)
            .and_then(|()| {
                crate::net::limits::in_range("engine.import_nice", self.engine.import_nice, 0, 19)
            })
            .and_then(|()| {
                crate::net::limits::in_range(
                    "engine.control_threads",
                    self.engine.control_threads,
                    0,
                    8,
                )
            })
            .and_then(|()| {
                crate::net::limits::in_range(
                    "engine.control_realtime",
                    self.engine.control_realtime,
                    0,
                    99,
                )
            })?;
        if let Some(s) = self.engine.serving
            && self.engine.role != Role::Both
            && s != self.engine.role
        {
            return Err(ConfigError::Invalid(format!(
                "engine.serving {:?} is not within engine.role {:?}: only an engine of role both \
                 can serve as another",
                s.name(),
                self.engine.role.name()
            )));
        }
        let m = &self.model;
        match (m.kind, m.path.is_empty()) {
            (ModelKind::Fake, true) => {}
            (_, false) => {
                // The checkpoint is checked whole (config, every tensor) before anything else.
                self.build_model()?;
            }
            (ModelKind::Llama, true) => {
                return Err(ConfigError::Invalid(
                    "model.kind \"llama\" needs model.path, a GGUF file or checkpoint directory"
                        .into(),
                ));
            }
        }
        if m.vocab == 0 || m.max_context == 0 {
            return Err(ConfigError::Invalid(
                "model.vocab and model.max_context must be >= 1".into(),
            ));
        }
        if !self.shape().is_valid() || self.shape().payload_bytes().is_none() {
            return Err(ConfigError::Invalid(
                "pool.block_tokens and the model's dimensions must be >= 1".into(),
            ));
        }
        crate::net::limits::in_range("pool.n_blocks", self.pool.n_blocks, 1, 1 << 24)
            .and_then(|()| {
                crate::net::limits::in_range("pool.block_tokens", self.pool.block_tokens, 1, 4096)
            })
            .and_then(|()| self.limits.validate())?;
        let bytes = self
            .shape()
            .payload_bytes()
            .and_then(|p| p.checked_mul(self.pool.n_blocks as usize));
        if bytes.is_none_or(|b| b > (1 << 40)) {
            return Err(ConfigError::Invalid("the pool would exceed 1 TiB".into()));
        }
        // The pool is mapped and faulted in at start: one larger than the machine's memory
        // would be killed there, or later, instead of refused here.
        if let (Some(b), Some(mem)) = (bytes, machine_memory())
            && b as u64 > mem
        {
            return Err(ConfigError::Invalid(format!(
                "pool.n_blocks = {}: the pool would take {} MiB, more than this machine's {} MiB \
                 of memory",
                self.pool.n_blocks,
                b >> 20,
                mem >> 20
            )));
        }
        if self.engine.heartbeat_ms == 0 {
            return Err(ConfigError::Invalid(
                "engine.heartbeat_ms must be >= 1".into(),
            ));
        }
        if self.engine.id.is_empty() {
            return Err(ConfigError::Invalid("engine.id must not be empty".into()));
        }
        if self.registry.on_etcd() && !self.engine.gateway_registry.is_empty() {
            return Err(ConfigError::Invalid(
                "set one registry: engine.gateway_registry or registry.etcd_endpoints".into(),
            ));
        }
        if self.tls.is_none() && !self.allow_insecure {
            let e = &self.engine;
            for (key, addr) in [
                ("grpc_listen", &e.grpc_listen),
                ("kv_listen", &e.kv_listen),
                ("http_listen", &e.http_listen),
            ] {
                if !is_loopback_listen(addr) {
                    return Err(ConfigError::Invalid(format!(
                        "engine.{key} {addr:?} is not a loopback address: configure [tls], or set allow_insecure = true"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The KV block shape.
    #[must_use]
    pub fn shape(&self) -> Shape {
        let m = &self.model;
        if let Some(Ok(c)) = self.llama_config() {
            return Shape::v1(
                self.pool.block_tokens,
                c.layers as u32,
                c.kv_heads as u32,
                c.head_dim as u32,
            );
        }
        Shape::v1(self.pool.block_tokens, m.n_layers, m.n_kv_heads, m.head_dim)
    }

    /// The checkpoint's configuration, for a `llama` model.
    #[must_use]
    pub fn llama_config(&self) -> Option<Result<tl_llama::LlamaConfig, tl_llama::CheckpointError>> {
        if self.model.path.is_empty() {
            return None;
        }
        Some(tl_llama::config_of(Path::new(&self.model.path)))
    }

    /// The model this configuration describes: the fake model, or the checkpoint at
    /// `model.path`, loaded once per process and shared (its weights are memory-mapped).
    ///
    /// # Errors
    /// A checkpoint that cannot be served, naming the file, field or tensor.
    pub fn build_model(&self) -> Result<Arc<dyn Model>, ConfigError> {
        let m = &self.model;
        if m.path.is_empty() {
            return Ok(Arc::new(FakeModel::new(
                m.kind.name(),
                self.shape(),
                m.vocab,
                m.max_context,
            )));
        }
        let dir = Path::new(&m.path);
        let name = if m.name.is_empty() {
            tl_llama::default_name(dir)
        } else {
            m.name.clone()
        };
        let threads = match m.threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            n => n,
        };
        let kernels = m.kernels;
        let key = (
            dir.to_path_buf(),
            name.clone(),
            self.pool.block_tokens,
            threads,
            m.max_context,
            kernels.name(),
        );
        static LOADED: std::sync::OnceLock<
            std::sync::Mutex<std::collections::HashMap<LlamaKey, Arc<tl_llama::Llama>>>,
        > = std::sync::OnceLock::new();
        let cache = LOADED.get_or_init(Default::default);
        let mut cache = cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(l) = cache.get(&key) {
            return Ok(l.clone());
        }
        let l = tl_llama::Llama::load(dir, &name, self.pool.block_tokens, threads, m.max_context)
            .map_err(|e| ConfigError::Invalid(format!("model.path {}: {e}", m.path)))?
            .with_kernels(kernels);
        // Its tokenizer's view of the ids, for stop strings; without one, the byte vocabulary.
        let l = match tl_llama::Text::load(dir) {
            Ok(t) => l.with_text(Arc::new(t)),
            Err(_) => l,
        };
        let l = Arc::new(l);
        cache.insert(key, l.clone());
        Ok(l)
    }

    /// The pool this configuration describes, its memory mapped up front.
    #[must_use]
    pub fn build_pool(&self) -> SharedKv {
        let mut pool = KvPool::new(self.shape(), self.pool.n_blocks as usize);
        pool.prefault();
        SharedKv::new(pool)
    }

    /// The tokens one engine of this configuration generates for `prompt` by itself: the
    /// colocated reference that every disaggregated, resumed or failed-over run of the same
    /// request must equal (a pool just large enough, no simulated cost).
    ///
    /// # Errors
    /// The request's refusal (invalid sampling, token or length).
    pub fn colocated(
        &self,
        prompt: &[u32],
        sampling: tl_engine_core::sampler::SamplingRequest,
        seed: u64,
        max_tokens: u32,
    ) -> Result<Vec<u32>, ReferenceError> {
        let one = tl_engine_core::engine::Choices::ONE;
        let mut all = self.colocated_choices(prompt, sampling, seed, max_tokens, one)?;
        Ok(all.swap_remove(0).tokens)
    }

    /// As [`colocated`](Self::colocated) with `choices`: every choice, with its
    /// log-probabilities when asked for.
    ///
    /// # Errors
    /// As [`colocated`](Self::colocated).
    pub fn colocated_choices(
        &self,
        prompt: &[u32],
        sampling: tl_engine_core::sampler::SamplingRequest,
        seed: u64,
        max_tokens: u32,
        choices: tl_engine_core::engine::Choices,
    ) -> Result<Vec<tl_engine_core::engine::Generated>, ReferenceError> {
        let stop = tl_engine_core::stop::Stop::default();
        self.colocated_run(prompt, sampling, seed, max_tokens, choices, stop, None)
    }

    /// As [`colocated_choices`](Self::colocated_choices) with stop rules and a structured
    /// output (compiled over this model's vocabulary, as an engine compiles it).
    ///
    /// # Errors
    /// As [`colocated`](Self::colocated), or the spec refused.
    #[allow(clippy::too_many_arguments)]
    pub fn colocated_structured(
        &self,
        prompt: &[u32],
        sampling: tl_engine_core::sampler::SamplingRequest,
        seed: u64,
        max_tokens: u32,
        choices: tl_engine_core::engine::Choices,
        stop: tl_engine_core::stop::Stop,
        spec: &crate::structured::Spec,
    ) -> Result<Vec<tl_engine_core::engine::Generated>, ReferenceError> {
        let vocab = self.build_model()?.tokens();
        let grammar = crate::structured::Grammars::new(&vocab)?.compile(spec)?;
        self.colocated_run(
            prompt,
            sampling,
            seed,
            max_tokens,
            choices,
            stop,
            Some(Box::new(grammar)),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn colocated_run(
        &self,
        prompt: &[u32],
        sampling: tl_engine_core::sampler::SamplingRequest,
        seed: u64,
        max_tokens: u32,
        choices: tl_engine_core::engine::Choices,
        stop: tl_engine_core::stop::Stop,
        constraint: Option<Box<dyn tl_engine_core::constraint::Constraint>>,
    ) -> Result<Vec<tl_engine_core::engine::Generated>, ReferenceError> {
        let model = self.build_model()?;
        let params = tl_engine_core::request::Params {
            prompt,
            max_tokens,
            sampling,
        };
        let sampling = params
            .validate(tl_engine_core::request::Limits::of(model.as_ref()))
            .map_err(tl_engine_core::engine::GenerateError::from)?;
        let per_choice =
            (prompt.len() + max_tokens as usize).div_ceil(self.shape().block_tokens() as usize);
        let blocks = per_choice * choices.n as usize;
        let pool = SharedKv::new(KvPool::new(self.shape(), blocks + 1));
        Ok(
            tl_engine_core::engine::Engine::new(model, pool).generate_choices(
                tl_engine_core::engine::Request {
                    prompt: prompt.to_vec(),
                    sampling,
                    seed,
                    max_tokens,
                    mode: tl_engine_core::engine::Mode::Generate,
                    draws_offset: 0,
                    stop,
                    choices,
                    scope: 0,
                    earlier_output: 0,
                    constraint,
                },
            )?,
        )
    }

    /// The simulated compute cost.
    #[must_use]
    pub fn cost(&self) -> CostModel {
        let base = match self.model.cost_preset {
            CostPreset::Llama3_8bH100 => CostModel::llama3_8b_h100(),
            CostPreset::None => CostModel::default(),
        };
        let or = |us: u64, d: Duration| if us > 0 { Duration::from_micros(us) } else { d };
        CostModel {
            prefill_per_token: or(self.model.prefill_us_per_token, base.prefill_per_token),
            decode_per_seq: or(self.model.decode_us_per_seq, base.decode_per_seq),
            decode_per_step: or(self.model.decode_us_per_step, base.decode_per_step),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_test_shape_and_unknown_keys_are_refused() {
        let c = Config::default();
        assert_eq!(c.shape(), Shape::v1(4, 2, 1, 4));
        assert_eq!(c.pool.n_blocks, 1024);
        assert_eq!(c.model.vocab, BYTE_VOCAB);
        c.validate().unwrap();
        let parsed: Config =
            toml::from_str("[engine]\nrole = \"decode\"\n[pool]\nn_blocks = 8\n").unwrap();
        assert_eq!(parsed.engine.role, Role::Decode);
        assert_eq!(parsed.pool.n_blocks, 8);
        assert_eq!(parsed.pool.block_tokens, 4);
        assert!(toml::from_str::<Config>("[pool]\nn_block = 8\n").is_err());
        assert!(toml::from_str::<Config>("[nope]\n").is_err());
        assert!(toml::from_str::<Config>("[engine]\nrole = \"sideways\"\n").is_err());
        let bad: Config = toml::from_str("[pool]\nblock_tokens = 0\n").unwrap();
        assert!(bad.validate().is_err());
        assert_eq!(Role::Both.names(), ["prefill", "decode"]);
        // The import lane: two threads at nice 10 unless told; a nice value that would raise
        // the threads' priority (which needs privilege) or one past 19 is refused at start.
        assert_eq!((c.engine.import_threads, c.engine.import_nice), (2, 10));
        assert_eq!(c.engine.control_threads, 1);
        assert_eq!(c.engine.control_realtime, 0);
        for (key, ok) in [
            ("import_nice = -1", false),
            ("import_nice = 20", false),
            ("import_threads = 65", false),
            ("import_threads = 0", true),
            ("import_nice = 0", true),
            ("control_threads = 0", true),
            ("control_threads = 9", false),
            ("control_realtime = 99", true),
            ("control_realtime = 100", false),
        ] {
            let c: Config = toml::from_str(&format!("[engine]\n{key}\n")).unwrap();
            let r = c.validate();
            assert_eq!(r.is_ok(), ok, "{key}: {r:?}");
            if let Err(e) = r {
                let field = key.split(' ').next().unwrap_or_default();
                assert!(e.to_string().contains(&format!("engine.{field}")), "{e}");
            }
        }
    }

    #[test]
    fn the_cost_model_batches_like_a_gpu_and_presets_are_overridable() {
        use tl_engine_core::engine::{Engine, StepStats};
        let mut c: Config = toml::from_str("[model]\ncost_preset = \"llama-3-8b-h100\"\n").unwrap();
        c.validate().unwrap();
        assert_eq!(c.cost(), CostModel::llama3_8b_h100());
        let model = c.build_model().unwrap();
        let mut e = Engine::new(model, c.build_pool());
        e.set_cost(c.cost());
        let step = |prefilled_tokens, decoded| StepStats {
            prefilled_tokens,
            decoded,
            ..StepStats::default()
        };
        // The weights are read once a step: 8 sequences cost far less than 8 steps of one.
        let one = e.simulated_cost(step(0, 1));
        let eight = e.simulated_cost(step(0, 8));
        assert!(eight < one * 2, "{eight:?} vs {one:?}");
        assert_eq!(eight - one, c.cost().decode_per_seq * 7);
        // A prefill in the same step adds to it: a colocated decode waits for it.
        let mixed = e.simulated_cost(step(2048, 8));
        assert_eq!(mixed, eight + c.cost().prefill_per_token * 2048);
        // A step that only prefills pays no decode step.
        assert_eq!(
            e.simulated_cost(step(10, 0)),
            c.cost().prefill_per_token * 10
        );
        // A key set above 0 overrides the preset; an unknown preset is refused.
        c.model.decode_us_per_step = 1_000;
        assert_eq!(c.cost().decode_per_step, Duration::from_millis(1));
        let e = toml::from_str::<Config>("[model]\ncost_preset = \"a100-maybe\"\n").unwrap_err();
        assert!(e.to_string().contains("llama-3-8b-h100"), "{e}");
    }

    /// A pool sized past the machine's memory (65,536 KV heads pass every per-field bound) is
    /// refused by `validate`, naming `pool.n_blocks`, before anything is mapped.
    #[test]
    fn a_pool_past_the_machines_memory_is_refused() {
        let mut c = Config::default();
        c.model.n_kv_heads = 65_536;
        c.pool.n_blocks = 4096;
        let mem = machine_memory().expect("/proc/meminfo");
        let bytes = c.shape().payload_bytes().unwrap() as u64 * 4096;
        assert!(
            bytes > mem,
            "the case must exceed this machine ({bytes} vs {mem})"
        );
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("pool.n_blocks") && e.contains("memory"), "{e}");
    }
}
