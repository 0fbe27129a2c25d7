//! The gateway's TOML configuration: `[gateway]`, every key optional, unknown keys refused.
//!
//! ```toml
//! [gateway]
//! id = "gw"                        # prefix of request ids (<id>-<128 random bits in hex>)
//! api_keys_file = ""               # one API key a line, # comments (or env TL_API_KEYS, comma
//!                                  # separated); each key is a tenant
//! admin_keys_file = ""             # admin keys, likewise (or env TL_ADMIN_KEYS): they also see
//!                                  # tl_route and /workers
//! public_unauthenticated = false   # serve /v1/* without a key while no tenant key exists (admin
//!                                  # keys do not close it); no key at all is a start-up error
//!                                  # unless this is true
//! unauthenticated_admin = false    # with no keys: every caller sees tl_route and /workers
//! tenant_header = ""               # take the tenant from this header (a trusted front sets it)
//! allowed_hosts = []               # Host names served to callers on loopback besides localhost
//!                                  # and IP addresses (DNS rebinding); ["*"]: any
//! allowed_origins = []             # browser origins served besides loopback ones; ["*"]: any
//! json_only = true                 # a POST body must be Content-Type: application/json (415)
//! shared_cache = false             # one tenant for everyone: all requests share cached blocks
//! cache_scope_secret_file = ""     # HMAC key of the cache scopes (empty: random at start)
//! http_listen = "127.0.0.1:0"      # the OpenAI-compatible front
//! registry_listen = "127.0.0.1:0"  # WorkerRegistry (tl.control.v1) for the engines' heartbeats
//! max_inflight = 256               # requests in flight; beyond it 429
//! max_queued = 128                 # requests waiting for a place on the prefill engines;
//!                                  # beyond it 429 with Retry-After
//! queue_timeout_ms = 60000         # the longest a request waits for a place (over all its
//!                                  # waits); then 429 with Retry-After
//! queue_prefill_tokens = 1024      # prompt tokens in prefill at once per engine that
//!                                  # prefills (one request always, however long)
//! request_timeout_ms = 60000       # whole request; beyond it 504
//! has_blocks_timeout_ms = 250      # per decode engine when routing; a slower one is skipped
//! route_from_index = true          # route from the engines' WatchBlocks streams; HasBlocks
//!                                  # only to engines whose stream is down or behind
//! load_penalty_tokens = 64         # routing: cached prefix tokens one in-flight sequence is worth
//! stall_timeout_ms = 3000          # a decode stream with no event for this long has failed over
//! max_failovers = 2                # times one request may continue on another decode engine
//! startup_grace_ms = 5000          # after a (re)start, a request finding no engine waits this
//!                                  # long for the engines to register before 503
//! prefill_decode_attempts = 2      # decode engines one Prefill tries (best ranked first) before
//!                                  # the request falls back to a `both` engine
//! cancel_release_wait_ms = 5000    # after cancelling a Prefill (the client left), how long to
//!                                  # wait for a handle that still arrives, to release it
//! max_inflight_per_key = 0         # requests in flight per tenant (0: max_inflight / 4); beyond
//!                                  # it 429, so one key cannot take every slot
//! max_tokens_in_flight_per_key = 0 # tokens in flight per tenant, each request counting its
//!                                  # prompt plus n x max_tokens (0: no token bound); beyond it
//!                                  # 429, except a tenant's first request
//! prefill_timeout_ms = 10000       # one Prefill call (compute and push); a prefill engine that
//!                                  # takes longer is given up: the request falls back to a
//!                                  # `both` engine, or fails with 503
//! model_path = ""                 # the checkpoint the engines serve (a Hugging Face directory
//!                                  # or a GGUF file): its tokenizer, chat template, EOS ids,
//!                                  # vocabulary and context; "": the fake model's byte tokenizer
//! template_fuel = 5000000          # instructions one chat-template render may run; beyond 400
//! template_max_bytes = 16777216    # bytes one render may write; beyond 400
//! template_memory_mib = 512        # memory one render may take in its own process; beyond 400
//! template_timeout_ms = 2000       # time one render may take in its own process; beyond 400
//! prep_threads = 0                 # templates and tokenizing run at most this many at a time,
//!                                  # off the async workers (0: the cores, at least 2)
//!
//! [gateway.public_tls]             # HTTPS on the public endpoint (no client certificates)
//! cert = "public.pem"
//! key = "public.key"
//!
//! [tls]                            # mutual TLS on the registry and toward the engines
//! ca = "certs/ca.pem"
//! cert = "certs/gw.pem"
//! key = "certs/gw.key"
//!
//! [registry]                       # the workers from etcd as well (see crate::etcd)
//! etcd_endpoints = []              # etcd client URLs (https:// with [tls]); empty: none
//! prefix = "/tl"                   # <prefix>/workers/<role>/<id>, <prefix>/drain/<id>
//! stale_ms = 15000                 # route on the last snapshot this long without etcd
//!
//! [planner]                        # moves engines of role both between prefill and decode
//! enabled = false                  #   (see gateway::roles; enable on one gateway only)
//! interval_ms = 250                # how often it looks
//! cooldown_ms = 3000               # at least this long between two moves
//! prefill_queue_high = 3.0         # Prefill calls per prefill engine: a decode engine moves
//! prefill_queue_low = 1.0          # at most this over one engine fewer: a prefill engine may
//!                                  #   move to decode
//! decode_running_high = 32.0       # sequences per decode engine: a prefill engine moves (and
//!                                  #   a decode engine moves only if the rest stay below)
//! smoothing = 0.3                  # weight of the newest sample in the smoothed signals
//! ```
//!
//! `allow_insecure = true` (top level) allows non-loopback listen addresses without `[tls]`.

use std::path::Path;

use serde::Deserialize;

use crate::net::is_loopback_listen;
use crate::net::limits::{InvalidSetting, LimitsSection, in_range};
use crate::net::tls::{PublicTls, TlsSection};
use crate::toml_file;

/// `[gateway]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySection {
    /// The gateway's id: the prefix of its request ids.
    pub id: String,
    /// A file of API keys, one a line; empty: none from a file (see also `TL_API_KEYS`).
    pub api_keys_file: String,
    /// A file of admin keys, one a line (see also `TL_ADMIN_KEYS`).
    pub admin_keys_file: String,
    /// Serve `/v1/*` without any key. Without it, no key configured is a start-up error.
    pub public_unauthenticated: bool,
    /// Without keys, treat every caller as an admin (a local single-user gateway: `tl demo`).
    pub unauthenticated_admin: bool,
    /// A request header naming the tenant, set by a trusted front (empty: the API key is the
    /// tenant).
    pub tenant_header: String,
    /// `Host` names served to callers on loopback besides `localhost` and IP addresses (a web
    /// page that rebinds its own name to loopback sends its own name); `["*"]`: any.
    pub allowed_hosts: Vec<String>,
    /// Browser origins (`scheme://host[:port]`) served besides loopback ones; `["*"]`: any.
    pub allowed_origins: Vec<String>,
    /// Refuse a `POST` body that is not `Content-Type: application/json` (415): a web page
    /// cannot send that cross-site without a preflight.
    pub json_only: bool,
    /// Every tenant shares one cache scope (a single-tenant deployment); `cache_salt` still
    /// separates.
    pub shared_cache: bool,
    /// The HMAC key of the cache scopes; empty: 32 random bytes at start (scopes then change
    /// when the gateway restarts, and differ between gateways).
    pub cache_scope_secret_file: String,
    /// HTTPS on the public endpoint.
    pub public_tls: Option<PublicTls>,
    /// HTTP listen address.
    pub http_listen: String,
    /// Registry listen address.
    pub registry_listen: String,
    /// `GET /metrics` listen address (plaintext, any address).
    pub metrics_listen: String,
    /// Requests in flight before 429.
    pub max_inflight: usize,
    /// Requests waiting for a place on the prefill engines before 429 (see
    /// [`super::queue`]).
    pub max_queued: usize,
    /// The longest a request waits for a place, over all its waits (milliseconds), before
    /// 429.
    pub queue_timeout_ms: u64,
    /// Prompt tokens in prefill at once, per engine that prefills.
    pub queue_prefill_tokens: u64,
    /// Request timeout in milliseconds (504).
    pub request_timeout_ms: u64,
    /// HasBlocks timeout per decode engine in milliseconds.
    pub has_blocks_timeout_ms: u64,
    /// Route from a prefix index kept from the decode engines' WatchBlocks streams, asking
    /// HasBlocks only of engines whose stream is down or behind; false: ask every decode
    /// engine HasBlocks per request.
    pub route_from_index: bool,
    /// Routing weight of load against cached prefix (see [`super::plan::score`]).
    pub load_penalty_tokens: f64,
    /// A decode engine's stream that sends nothing for this long (milliseconds) is given up and
    /// the request continues on another decode engine.
    pub stall_timeout_ms: u64,
    /// How many times one request may continue on another decode engine (0: never).
    pub max_failovers: u32,
    /// For this long after the gateway starts, a request that finds no engine able to serve it
    /// waits for engines to register (a restarted gateway's registry is empty until the next
    /// beats) instead of answering 503 at once.
    pub startup_grace_ms: u64,
    /// Decode engines one Prefill is tried against, best ranked first, before the request
    /// falls back to a colocated engine (at least 1).
    pub prefill_decode_attempts: u32,
    /// After a Prefill was cancelled (the client left): how long to wait for a handle that
    /// still arrives, to release it rather than leave it to its lease (milliseconds).
    pub cancel_release_wait_ms: u64,
    /// The longest one Prefill call may take (compute and push), in milliseconds.
    pub prefill_timeout_ms: u64,
    /// Requests one tenant may have in flight (0: a quarter of `max_inflight`, at least 1).
    pub max_inflight_per_key: usize,
    /// Tokens one tenant may have in flight, a request counting its prompt and `n` x
    /// `max_tokens` (0: no token bound). A tenant's first request is never refused by it.
    pub max_tokens_in_flight_per_key: u64,
    /// The checkpoint the engines serve (a directory or a GGUF file), for its text side ("":
    /// the byte tokenizer).
    pub model_path: String,
    /// Instructions one chat-template render may run (minijinja's fuel).
    pub template_fuel: u64,
    /// Bytes one chat-template render may write.
    pub template_max_bytes: usize,
    /// Templates and tokenizing running at once, on the blocking pool (0: the cores, at
    /// least 2).
    pub prep_threads: usize,
    /// Memory one chat-template render may take, in its own process (MiB).
    pub template_memory_mib: u64,
    /// How long one chat-template render may take, in its own process (milliseconds).
    pub template_timeout_ms: u64,
    /// The executable that renders templates in processes of their own (`tl`, which
    /// `tl gateway` and `tl serve` set to themselves). `None`: templates render in the
    /// gateway's process, bounded in instructions and bytes but not in memory.
    #[serde(skip)]
    pub render_worker: Option<std::path::PathBuf>,
}

impl Default for GatewaySection {
    fn default() -> Self {
        Self {
            id: "gw".into(),
            api_keys_file: String::new(),
            admin_keys_file: String::new(),
            public_unauthenticated: false,
            unauthenticated_admin: false,
            tenant_header: String::new(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            json_only: true,
            shared_cache: false,
            cache_scope_secret_file: String::new(),
            public_tls: None,
            http_listen: "127.0.0.1:0".into(),
            registry_listen: "127.0.0.1:0".into(),
            metrics_listen: "127.0.0.1:0".into(),
            max_inflight: 256,
            max_queued: 128,
            queue_timeout_ms: 60_000,
            queue_prefill_tokens: 1_024,
            request_timeout_ms: 60_000,
            has_blocks_timeout_ms: 250,
            route_from_index: true,
            load_penalty_tokens: 64.0,
            stall_timeout_ms: 3_000,
            max_failovers: 2,
            startup_grace_ms: 5_000,
            prefill_decode_attempts: 2,
            cancel_release_wait_ms: 5_000,
            prefill_timeout_ms: 10_000,
            max_inflight_per_key: 0,
            max_tokens_in_flight_per_key: 0,
            model_path: String::new(),
            template_fuel: 5_000_000,
            template_max_bytes: 16 << 20,
            prep_threads: 0,
            template_memory_mib: 512,
            template_timeout_ms: 2_000,
            render_worker: None,
        }
    }
}

/// The gateway's configuration file.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// `[gateway]`.
    pub gateway: GatewaySection,
    /// `[tls]`: mutual TLS on the registry and toward the engines (spec/identities.md).
    pub tls: Option<TlsSection>,
    /// Without `[tls]`, listen on non-loopback addresses anyway.
    pub allow_insecure: bool,
    /// `[limits]`: what one peer can take (spec/limits.md).
    pub limits: LimitsSection,
    /// `[telemetry]`: where spans are exported (spec/telemetry.md).
    pub telemetry: crate::telemetry::TelemetrySection,
    /// `[registry]`: the workers from etcd (`etcd_endpoints`, `prefix`, `stale_ms`); none:
    /// only the engines that beat to this gateway's own registry.
    pub registry: crate::etcd::RegistrySection,
    /// `[planner]`: moving engines of role both between prefill and decode (off by default).
    pub planner: PlannerSection,
}

impl GatewaySection {
    /// The embedded gateway of one machine (`tl demo`, benches, tests): no keys, served to
    /// the local user, who sees routing internals.
    #[must_use]
    pub fn local() -> Self {
        Self {
            public_unauthenticated: true,
            unauthenticated_admin: true,
            ..Self::default()
        }
    }
}

impl GatewayConfig {
    /// [`GatewaySection::local`] with every other section at its default.
    #[must_use]
    pub fn local() -> Self {
        GatewaySection::local().into()
    }
}

impl From<GatewaySection> for GatewayConfig {
    fn from(gateway: GatewaySection) -> Self {
        Self {
            gateway,
            ..Self::default()
        }
    }
}

/// A gateway configuration that cannot be used: the one configuration error, whose messages
/// name the key (`gateway.id`).
pub use crate::toml_file::ConfigError as GatewayConfigError;

impl GatewayConfig {
    /// Reads `path` if given, else the defaults.
    ///
    /// # Errors
    /// I/O, parse or range errors.
    pub fn load_or_default(path: Option<&Path>) -> Result<Self, GatewayConfigError> {
        let c = Self::read_or_default(path)?;
        c.validate()?;
        Ok(c)
    }

    /// Reads `path` if given, else the defaults, without validating: for a caller that applies
    /// overrides (command-line flags) first and calls [`validate`](Self::validate) after.
    ///
    /// # Errors
    /// I/O or parse errors.
    pub fn read_or_default(path: Option<&Path>) -> Result<Self, GatewayConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        Ok(toml_file::read(path)?)
    }

    /// Checks ranges, and that a gateway without `[tls]` listens on loopback only (unless
    /// `allow_insecure`).
    ///
    /// # Errors
    /// The first problem.
    pub fn validate(&self) -> Result<(), GatewayConfigError> {
        let g = &self.gateway;
        let ranges = || -> Result<(), crate::net::limits::InvalidSetting> {
            const DAY_MS: u64 = 86_400_000;
            in_range("gateway.max_inflight", g.max_inflight, 1, 1 << 20)?;
            in_range("gateway.max_queued", g.max_queued, 0, 1 << 20)?;
            in_range("gateway.queue_timeout_ms", g.queue_timeout_ms, 0, DAY_MS)?;
            in_range(
                "gateway.queue_prefill_tokens",
                g.queue_prefill_tokens,
                1,
                1 << 24,
            )?;
            in_range("gateway.template_fuel", g.template_fuel, 1_000, 1 << 40)?;
            in_range(
                "gateway.template_max_bytes",
                g.template_max_bytes,
                1_024,
                1 << 30,
            )?;
            in_range("gateway.prep_threads", g.prep_threads, 0, 1_024)?;
            in_range(
                "gateway.template_memory_mib",
                g.template_memory_mib,
                16,
                1 << 20,
            )?;
            in_range(
                "gateway.template_timeout_ms",
                g.template_timeout_ms,
                10,
                DAY_MS,
            )?;
            in_range(
                "gateway.request_timeout_ms",
                g.request_timeout_ms,
                1,
                DAY_MS,
            )?;
            in_range(
                "gateway.has_blocks_timeout_ms",
                g.has_blocks_timeout_ms,
                1,
                600_000,
            )?;
            in_range("gateway.stall_timeout_ms", g.stall_timeout_ms, 1, DAY_MS)?;
            in_range("gateway.max_failovers", g.max_failovers, 0, 64)?;
            in_range("gateway.startup_grace_ms", g.startup_grace_ms, 0, 600_000)?;
            in_range(
                "gateway.prefill_decode_attempts",
                g.prefill_decode_attempts,
                1,
                64,
            )?;
            in_range(
                "gateway.cancel_release_wait_ms",
                g.cancel_release_wait_ms,
                0,
                600_000,
            )?;
            in_range(
                "gateway.prefill_timeout_ms",
                g.prefill_timeout_ms,
                1,
                DAY_MS,
            )?;
            // NaN compares false both ways: refused by the range too.
            let p = g.load_penalty_tokens;
            if p.is_nan() {
                return Err(crate::net::limits::InvalidSetting::new(
                    "gateway.load_penalty_tokens",
                    format!("= {p} is out of range: it must be in 0..=1000000"),
                ));
            }
            in_range("gateway.load_penalty_tokens", p, 0.0, 1e6)?;
            self.limits.validate()
        };
        ranges()?;
        self.planner.validate()?;
        if g.id.is_empty() {
            return Err(GatewayConfigError::Invalid(
                "gateway.id must not be empty".into(),
            ));
        }
        if self.tls.is_none() && !self.allow_insecure {
            for (key, addr) in [
                ("http_listen", &g.http_listen),
                ("registry_listen", &g.registry_listen),
            ] {
                // The public endpoint may face the world when it is HTTPS.
                if key == "http_listen" && g.public_tls.is_some() {
                    continue;
                }
                if !is_loopback_listen(addr) {
                    return Err(GatewayConfigError::Invalid(format!(
                        "gateway.{key} {addr:?} is not a loopback address: configure [tls], or set allow_insecure = true"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// `[planner]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlannerSection {
    /// Move engines at all.
    pub enabled: bool,
    /// How often it looks, ms.
    pub interval_ms: u64,
    /// At least this long between two moves, ms.
    pub cooldown_ms: u64,
    /// Prefill calls waiting or running per prefill engine at which a decode engine moves to
    /// prefill.
    pub prefill_queue_high: f64,
    /// Prefill pressure (over one engine fewer) at most which a prefill engine may move to
    /// decode.
    pub prefill_queue_low: f64,
    /// Running sequences per decode engine at which a prefill engine moves to decode, and
    /// below which (over one engine fewer) a decode engine may move to prefill.
    pub decode_running_high: f64,
    /// Weight of the newest sample in the smoothed signals, in (0, 1].
    pub smoothing: f64,
}

impl Default for PlannerSection {
    fn default() -> Self {
        Self {
            enabled: false,
            interval_ms: 250,
            cooldown_ms: 3_000,
            prefill_queue_high: 3.0,
            prefill_queue_low: 1.0,
            decode_running_high: 32.0,
            smoothing: 0.3,
        }
    }
}

impl PlannerSection {
    /// Checks ranges.
    ///
    /// # Errors
    /// The first value out of range, named.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(InvalidSetting::new(
                "planner.smoothing",
                format!("{} is not in (0, 1]", self.smoothing),
            ));
        }
        if self.interval_ms == 0 {
            return Err(InvalidSetting::new(
                "planner.interval_ms",
                "must be at least 1",
            ));
        }
        let finite_pos = |x: f64| x.is_finite() && x >= 0.0;
        if !finite_pos(self.prefill_queue_high)
            || !finite_pos(self.prefill_queue_low)
            || !finite_pos(self.decode_running_high)
        {
            return Err(InvalidSetting::new(
                "planner",
                "marks must be finite and not negative",
            ));
        }
        if self.prefill_queue_low >= self.prefill_queue_high {
            return Err(InvalidSetting::new(
                "planner.prefill_queue_low",
                format!(
                    "{} must be below prefill_queue_high {}",
                    self.prefill_queue_low, self.prefill_queue_high
                ),
            ));
        }
        Ok(())
    }
}
