//! `[limits]`: what one peer can take, for every process (spec/limits.md). Every key is
//! optional; the defaults are the contract's.
//!
//! ```toml
//! [limits]
//! max_pushes = 64                # pushes in progress per receiver (RESOURCE_EXHAUSTED beyond)
//! push_idle_ms = 10000           # a push with no chunk for this long is undone
//! push_deadline_ms = 60000       # one whole push
//! decode_reserve_blocks = 0      # blocks pushes may not take (0: 1/8 of the pool)
//! max_pending_handles = 256      # handles waiting for a claim per receiver
//! max_pushes_per_peer = 0        # pushes one prefill identity may have in progress (0: half)
//! max_pending_per_peer = 0       # handles one prefill identity may hold (0: half)
//! handle_lease_ms = 30000        # a handle nobody claims or releases is freed after this
//! import_wait_ms = 1000          # a pushed block finding the pool full waits this long for the
//!                                # engine to preempt another tenant's request (then 429)
//! h2_max_streams = 128           # HTTP/2 streams per connection
//! keepalive_ms = 10000           # HTTP/2 ping interval...
//! keepalive_timeout_ms = 20000   # ...and how long an unanswered ping means a dead peer
//! small_message_bytes = 1048576  # HasBlocks, Release, Info, Heartbeat, ListWorkers messages
//! header_read_ms = 10000         # HTTP request headers must arrive within this
//! max_body_bytes = 2097152       # HTTP request body (413 beyond)
//! request_read_ms = 30000        # a whole HTTP request (headers and body) must arrive within this
//! http_max_conns_per_ip = 64     # HTTP connections open at once from one address
//! http_max_conns = 4096          # HTTP connections open at once; at the cap the oldest that has
//!                                # not delivered a whole request is closed for a newcomer
//! http_max_inflight = 256        # requests decoding on an engine, Generate and its HTTP front (429 beyond)
//! max_peer_channels = 256        # outgoing connections kept, least recently used closed first
//! registry_max_workers = 1024    # workers a registry holds (RESOURCE_EXHAUSTED beyond)
//! max_block_watchers = 16        # WatchBlocks streams open at once on an engine (RESOURCE_EXHAUSTED)
//! drain_ms = 5000                # drain on SIGTERM
//! ```

use std::time::Duration;

use kvwire_grpc::{H2Limits, ServiceLimits};
use serde::Deserialize;

use super::server::HttpLimits;

/// `[limits]`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    /// Pushes in progress per receiver.
    pub max_pushes: usize,
    /// A push with no chunk for this long is undone.
    pub push_idle_ms: u64,
    /// One whole push.
    pub push_deadline_ms: u64,
    /// A pushed handle nobody claims or releases is freed after this (its lease).
    pub handle_lease_ms: u64,
    /// How long a pushed block finding the pool full waits for room (the engine preempts
    /// another tenant's request to make it); 0: refused at once.
    pub import_wait_ms: u64,
    /// Blocks pushes may not take, kept for running sequences; 0: 1/8 of the pool.
    pub decode_reserve_blocks: u32,
    /// Handles waiting for a claim per receiver.
    pub max_pending_handles: usize,
    /// Pushes one peer may have in progress (0: half of `max_pushes`).
    pub max_pushes_per_peer: usize,
    /// Handles one peer may hold waiting for a claim (0: half of `max_pending_handles`).
    pub max_pending_per_peer: usize,
    /// HTTP/2 streams per connection.
    pub h2_max_streams: u32,
    /// HTTP/2 keepalive ping interval.
    pub keepalive_ms: u64,
    /// An unanswered ping after this closes the connection.
    pub keepalive_timeout_ms: u64,
    /// Largest small gRPC message.
    pub small_message_bytes: usize,
    /// HTTP request headers must arrive within this.
    pub header_read_ms: u64,
    /// Largest HTTP request body.
    pub max_body_bytes: usize,
    /// A whole HTTP request, headers and body, must arrive within this (milliseconds).
    pub request_read_ms: u64,
    /// HTTP connections one source address may hold open at once.
    pub http_max_conns_per_ip: usize,
    /// HTTP connections open at once per listener.
    pub http_max_conns: usize,
    /// Requests decoding on an engine, over Generate and its HTTP front together.
    pub http_max_inflight: usize,
    /// Outgoing connections kept.
    pub max_peer_channels: usize,
    /// Workers a registry holds.
    pub registry_max_workers: usize,
    /// WatchBlocks streams open at once on a decode engine (gateways, each one).
    pub max_block_watchers: usize,
    /// Drain on SIGTERM.
    pub drain_ms: u64,
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            max_pushes: 64,
            push_idle_ms: 10_000,
            handle_lease_ms: 30_000,
            import_wait_ms: 1_000,
            push_deadline_ms: 60_000,
            decode_reserve_blocks: 0,
            max_pending_handles: 256,
            max_pushes_per_peer: 0,
            max_pending_per_peer: 0,
            h2_max_streams: 128,
            keepalive_ms: 10_000,
            keepalive_timeout_ms: 20_000,
            small_message_bytes: 1 << 20,
            header_read_ms: 10_000,
            max_body_bytes: 2 << 20,
            request_read_ms: 30_000,
            http_max_conns_per_ip: 64,
            http_max_conns: 4096,
            http_max_inflight: 256,
            max_peer_channels: 256,
            registry_max_workers: 1024,
            max_block_watchers: 16,
            drain_ms: 5_000,
        }
    }
}

/// `Err` naming `key` and its range when `v` is outside `lo..=hi`.
///
/// # Errors
/// The message operators read at start-up.
pub fn in_range<T: PartialOrd + std::fmt::Display>(
    key: &str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), InvalidSetting> {
    if v < lo || v > hi {
        return Err(InvalidSetting::new(
            key,
            format!("= {v} is out of range: it must be in {lo}..={hi}"),
        ));
    }
    Ok(())
}

/// A setting a process refuses to start with: the key, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key} {why}")]
pub struct InvalidSetting {
    /// The key, dotted (`limits.max_pushes`).
    pub key: String,
    /// What is wrong with its value, as a sentence that follows the key.
    pub why: String,
}

impl InvalidSetting {
    /// `key`, refused because of `why`.
    #[must_use]
    pub fn new(key: impl Into<String>, why: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            why: why.into(),
        }
    }
}

impl LimitsSection {
    /// Every bound range-checked, so that a zero (a bound that would refuse everything or
    /// nothing) or an absurd figure stops the process at start rather than silently.
    ///
    /// # Errors
    /// The first key out of range, with its range.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        const DAY_MS: u64 = 86_400_000;
        in_range("limits.max_pushes", self.max_pushes, 1, 1 << 16)?;
        in_range("limits.push_idle_ms", self.push_idle_ms, 1, DAY_MS)?;
        in_range("limits.push_deadline_ms", self.push_deadline_ms, 1, DAY_MS)?;
        in_range("limits.handle_lease_ms", self.handle_lease_ms, 1, DAY_MS)?;
        in_range("limits.import_wait_ms", self.import_wait_ms, 0, 600_000)?;
        in_range(
            "limits.max_pending_handles",
            self.max_pending_handles,
            1,
            1 << 20,
        )?;
        in_range("limits.h2_max_streams", self.h2_max_streams, 1, 1 << 16)?;
        in_range(
            "limits.max_block_watchers",
            self.max_block_watchers,
            1,
            1024,
        )?;
        in_range("limits.keepalive_ms", self.keepalive_ms, 1, DAY_MS)?;
        in_range(
            "limits.keepalive_timeout_ms",
            self.keepalive_timeout_ms,
            1,
            DAY_MS,
        )?;
        in_range(
            "limits.small_message_bytes",
            self.small_message_bytes,
            1 << 10,
            1 << 30,
        )?;
        in_range("limits.header_read_ms", self.header_read_ms, 1, 600_000)?;
        in_range("limits.request_read_ms", self.request_read_ms, 1, 600_000)?;
        in_range(
            "limits.http_max_conns_per_ip",
            self.http_max_conns_per_ip,
            1,
            1 << 16,
        )?;
        in_range("limits.http_max_conns", self.http_max_conns, 1, 1 << 20)?;
        in_range(
            "limits.max_body_bytes",
            self.max_body_bytes,
            1 << 10,
            1 << 30,
        )?;
        in_range(
            "limits.http_max_inflight",
            self.http_max_inflight,
            1,
            1 << 20,
        )?;
        in_range(
            "limits.max_peer_channels",
            self.max_peer_channels,
            1,
            1 << 16,
        )?;
        in_range(
            "limits.registry_max_workers",
            self.registry_max_workers,
            1,
            1 << 20,
        )?;
        in_range("limits.drain_ms", self.drain_ms, 0, DAY_MS)?;
        Ok(())
    }

    /// The HTTP/2 bounds of every gRPC server.
    #[must_use]
    pub fn h2(&self) -> H2Limits {
        H2Limits {
            max_streams: self.h2_max_streams.max(1),
            keepalive: Duration::from_millis(self.keepalive_ms.max(1)),
            keepalive_timeout: Duration::from_millis(self.keepalive_timeout_ms.max(1)),
        }
    }

    /// The KvTransfer service's deadlines and message bounds.
    #[must_use]
    pub fn service(&self) -> ServiceLimits {
        ServiceLimits {
            push_idle: Duration::from_millis(self.push_idle_ms.max(1)),
            push_deadline: Duration::from_millis(self.push_deadline_ms.max(1)),
            import_wait: Duration::from_millis(self.import_wait_ms),
            small_message: self.small_message_bytes.max(1024),
        }
    }

    /// The bounds of every HTTP server.
    #[must_use]
    pub fn http(&self) -> HttpLimits {
        HttpLimits {
            header_read: Duration::from_millis(self.header_read_ms.max(1)),
            request_read: Duration::from_millis(self.request_read_ms.max(1)),
            max_body: self.max_body_bytes,
            per_ip: self.http_max_conns_per_ip.max(1),
            max_conns: self.http_max_conns.max(1),
        }
    }

    /// Blocks kept from pushes in a pool of `n_blocks`.
    #[must_use]
    pub fn reserve(&self, n_blocks: u32) -> usize {
        if self.decode_reserve_blocks == 0 {
            (n_blocks / 8) as usize
        } else {
            self.decode_reserve_blocks.min(n_blocks) as usize
        }
    }

    /// The drain deadline.
    #[must_use]
    pub fn drain(&self) -> Duration {
        Duration::from_millis(self.drain_ms)
    }
}
