//! The gateway's shared state ([`Gateway`]): what every request, handler and task of a gateway
//! reads, below the files that use it (they reach it here, not up in `mod.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_grpc::pb::control::WorkerStatus;
use tokio::sync::Semaphore;

use super::config::GatewaySection;
use super::plan::Policy;
use super::registry::RegistryState;
use super::routed::RoutedLoad;
use super::upstream::Upstream;
use super::{api_keys, fair, index, plan, queue, tenant, text};
use crate::net::limits::LimitsSection;
use crate::net::tls::{Tls, TlsError};
use crate::telemetry::metrics::{Metrics, SharedMetrics};

/// The gateway's shared state.
#[derive(Debug)]
pub struct Gateway {
    pub(super) registry: Arc<RegistryState>,
    pub(super) cfg: GatewaySection,
    pub(super) upstream: Arc<Upstream>,
    pub(super) permits: Arc<Semaphore>,
    /// Templates and tokenizing in progress on the blocking pool (`prep_threads`).
    pub(super) prep: Arc<fair::FairPlaces>,
    pub(super) routed: Arc<RoutedLoad>,
    /// Where requests wait for a place on the prefill engines.
    pub(super) queue: Arc<queue::WaitQueue>,
    /// The decode engines' blocks, from their streams (`route_from_index`).
    pub(super) index: Arc<index::BlockIndex>,
    /// The last snapshot arranged for routing from the index, and the index generation at
    /// which all its decode candidates were seen synced.
    pub(super) fleet: std::sync::Mutex<Option<(Arc<plan::Fleet>, Option<u64>)>>,
    /// Counts plans: spreads colocated requests over equal `both` engines.
    pub(super) spread: std::sync::atomic::AtomicU64,
    pub(super) api_keys: api_keys::ApiKeys,
    pub(super) scopes: tenant::Scopes,
    pub(super) quotas: Arc<tenant::Quotas>,
    pub(super) metrics: SharedMetrics,
    /// The drain on SIGTERM.
    pub(super) drain: Drain,
    /// When this gateway started: for a while after, a request that finds no engine waits for
    /// the engines to register (they beat to a fresh registry within one interval).
    pub(super) started: Instant,
    /// The same, in seconds since the epoch: `created` of `/v1/models`.
    pub(super) started_secs: u64,
    /// The served checkpoint's text side (`[gateway] model_path`); none: the byte tokenizer.
    pub(super) text: Option<Arc<text::GatewayText>>,
    /// The model this gateway tokenizes for (its text side's fingerprint, or the byte
    /// vocabulary's): requests go only to engines that report the same model.
    pub(super) fingerprint: String,
}

impl Gateway {
    /// A gateway over `registry`, reaching the engines over mutual TLS when `tls` is given.
    ///
    /// # Errors
    /// When the TLS client configuration cannot be built.
    pub fn new(
        registry: Arc<RegistryState>,
        cfg: GatewaySection,
        tls: Option<&Tls>,
        api_keys: api_keys::ApiKeys,
        limits: &LimitsSection,
    ) -> Result<Self, TlsError> {
        let scopes = tenant::Scopes::new(
            &scope_secret(&cfg.cache_scope_secret_file)?,
            cfg.shared_cache,
        );
        let api_keys = api_keys.tenants(
            &cfg.tenant_header,
            cfg.unauthenticated_admin,
            cfg.public_unauthenticated,
        );
        let quotas = Arc::new(tenant::Quotas::new(
            match cfg.max_inflight_per_key {
                0 => cfg.max_inflight / 4,
                n => n,
            },
            cfg.max_tokens_in_flight_per_key,
        ));
        let queue = Arc::new(queue::WaitQueue::new(queue::QueueLimits {
            max_queued: cfg.max_queued,
            prefill_tokens: cfg.queue_prefill_tokens.max(1),
            timeout: Duration::from_millis(cfg.queue_timeout_ms),
        }));
        Ok(Self {
            permits: Arc::new(Semaphore::new(cfg.max_inflight.max(1))),
            prep: Arc::new(fair::FairPlaces::new(match cfg.prep_threads {
                0 => std::thread::available_parallelism().map_or(2, |n| n.get().max(2)),
                n => n,
            })),
            upstream: Arc::new(Upstream::new(
                Duration::from_millis(cfg.has_blocks_timeout_ms),
                tls,
                limits.max_peer_channels.max(1),
            )?),
            registry,
            cfg,
            routed: Arc::new(RoutedLoad::default()),
            queue,
            index: Arc::default(),
            fleet: std::sync::Mutex::default(),
            spread: std::sync::atomic::AtomicU64::new(0),
            api_keys,
            scopes,
            quotas,
            metrics: Arc::new(Metrics::new()),
            drain: Drain::default(),
            started: Instant::now(),
            started_secs: crate::api::now_secs(),
            text: None,
            fingerprint: tl_engine_core::model::fingerprint(
                &tl_engine_core::vocab::Vocab::bytes(),
                None,
            ),
        })
    }

    /// The same gateway tokenizing with `text` (the checkpoint the engines serve).
    #[must_use]
    pub fn with_text(mut self, text: Option<Arc<text::GatewayText>>) -> Self {
        if let Some(t) = &text {
            self.fingerprint.clone_from(&t.fingerprint);
        }
        self.text = text;
        self
    }

    /// The model this gateway tokenizes for, as engines report theirs.
    #[must_use]
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The prefix index kept from the decode engines' streams.
    #[must_use]
    pub fn block_index(&self) -> &Arc<index::BlockIndex> {
        &self.index
    }

    /// The gateway's metrics.
    #[must_use]
    pub fn metrics(&self) -> &SharedMetrics {
        &self.metrics
    }

    /// The live workers.
    #[must_use]
    pub fn workers(&self) -> Vec<WorkerStatus> {
        self.registry.list(Instant::now())
    }

    /// The registry.
    #[must_use]
    pub fn registry(&self) -> &Arc<RegistryState> {
        &self.registry
    }

    /// Requests this gateway has on `worker` now: from each one's Prefill until its stream
    /// there ends.
    #[must_use]
    pub fn routed_on(&self, worker: &str) -> u32 {
        self.routed.on(worker)
    }

    pub(super) fn policy(&self) -> Policy {
        Policy {
            load_penalty_tokens: self.cfg.load_penalty_tokens,
            // What a Prefill tries, and one more (the failover's pick comes from a new plan).
            ranked: self.cfg.prefill_decode_attempts as usize + 1,
            spread: self
                .spread
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// `<gateway id>-<128 random bits in hex>`: never reused, not guessable, so nobody can
    /// cancel another client's request by naming it.
    pub(super) fn request_id(&self) -> String {
        format!("{}-{}", self.cfg.id, crate::net::tls::random_hex::<16>())
    }
}

/// A gateway's drain: `started` refuses new requests (503, and `/health` says so); `cut` ends
/// the requests still running with an error event naming the drain.
#[derive(Debug, Default)]
pub(super) struct Drain {
    pub(super) started: tokio_util::sync::CancellationToken,
    pub(super) cut: tokio_util::sync::CancellationToken,
}

impl Gateway {
    /// Whether a drain has begun.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.drain.started.is_cancelled()
    }

    /// Requests waiting for a place on the prep pool (templates and tokenizing).
    #[must_use]
    pub fn prep_waiting(&self) -> usize {
        self.prep.waiting()
    }

    /// Requests running now.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.cfg.max_inflight.max(1) - self.permits.available_permits()
    }

    /// Drains: new requests are refused from now; running ones get until `grace` to finish;
    /// then each one left ends with an error event naming the drain (never a silent cut), and
    /// gets up to half a second to release what it holds on the engines. Returns how many were
    /// ended.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.drain.started.cancel();
        let idle = async {
            while self.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        if tokio::time::timeout(grace, idle).await.is_ok() {
            return 0;
        }
        let ended = self.in_flight();
        tracing::warn!(ended, "drain time is up: ending the requests still running");
        self.drain.cut.cancel();
        // The process must be gone within drain_ms plus a second (spec/limits.md): what a
        // request cannot release by then ends with its lease on the engine.
        let wait = self
            .retry_policy()
            .release_wait
            .min(Duration::from_millis(500));
        let _ = tokio::time::timeout(wait, async {
            while self.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        ended
    }
}

/// The cache scopes' HMAC key: the file's bytes, or 32 random bytes.
fn scope_secret(file: &str) -> Result<Vec<u8>, TlsError> {
    if file.is_empty() {
        return Ok(crate::net::tls::random_hex::<32>().into_bytes());
    }
    match std::fs::read(file) {
        Ok(bytes) if bytes.len() >= 16 => Ok(bytes),
        Ok(_) => Err(TlsError::Io {
            path: file.to_owned(),
            source: std::io::Error::other("a cache scope secret needs at least 16 bytes"),
        }),
        Err(source) => Err(TlsError::Io {
            path: file.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::gateway::config::GatewaySection;
    use crate::gateway::registry::RegistryState;

    #[test]
    fn request_ids_are_random_and_prefixed() {
        let g = Gateway::new(
            Arc::new(RegistryState::default()),
            GatewaySection {
                id: "gw-a".into(),
                ..GatewaySection::default()
            },
            None,
            api_keys::ApiKeys::default(),
            &LimitsSection::default(),
        )
        .unwrap();
        let ids: HashSet<String> = (0..1000).map(|_| g.request_id()).collect();
        assert_eq!(ids.len(), 1000, "an id repeated");
        for id in ids.iter().take(10) {
            let hex = id.strip_prefix("gw-a-").unwrap();
            assert_eq!(hex.len(), 32, "{id}: 128 bits");
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
    }
}
