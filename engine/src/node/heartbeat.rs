//! The heartbeat: every `heartbeat_ms` the node tells the gateway's WorkerRegistry where it
//! serves and how loaded it is. A beat is bounded by a timeout; consecutive failures are counted
//! and reset by a success; the loop never stops on failure; an ack with `drain = true` is
//! remembered for good and starts the node's drain.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use kvwire_grpc::pb::control::{HeartbeatAck, Role as PbRole, WorkerStatus};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::state::NodeState;
use crate::net::clients::RegistryClient;

/// What the heartbeat needs of a registry.
pub trait Registry: Send + Sync + 'static {
    /// Sends one beat.
    fn heartbeat(
        &self,
        status: WorkerStatus,
    ) -> impl Future<Output = Result<HeartbeatAck, Status>> + Send;
}

impl<R: Registry> Registry for Arc<R> {
    fn heartbeat(
        &self,
        status: WorkerStatus,
    ) -> impl Future<Output = Result<HeartbeatAck, Status>> + Send {
        R::heartbeat(self, status)
    }
}

impl Registry for RegistryClient {
    fn heartbeat(
        &self,
        status: WorkerStatus,
    ) -> impl Future<Output = Result<HeartbeatAck, Status>> + Send {
        RegistryClient::heartbeat(self, status)
    }
}

/// The addresses a worker serves, as registered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Addresses {
    /// HTTP front (decode roles).
    pub http: String,
    /// EngineControl.
    pub grpc: String,
    /// KvTransfer (decode roles).
    pub kv: String,
}

/// A node's status for one beat, with its live load.
#[must_use]
pub fn worker_status(node: &NodeState, addrs: &Addresses, heartbeat_ms: u32) -> WorkerStatus {
    let role = node.role();
    let runner = node.runner();
    let model = runner.model();
    // Published at every release of the pool lock: a beat never waits behind compute.
    let counts = runner.pool().counts();
    // Only an engine that receives KV advertises where to push it and where to resume.
    let if_decodes = |a: &String| {
        if role.decodes() {
            a.clone()
        } else {
            String::new()
        }
    };
    WorkerStatus {
        worker_id: node.id().to_owned(),
        http_address: if_decodes(&addrs.http),
        grpc_address: addrs.grpc.clone(),
        kv_address: if_decodes(&addrs.kv),
        role: PbRole::from(role) as i32,
        model: model.name().to_owned(),
        kv_format: kvwire_grpc::KV_FORMAT_V1,
        queue_depth: node.queue_depth(),
        running: runner.running(),
        // Blocks on the free list; cached blocks are evictable but still hold someone's prefix.
        free_blocks: counts.free as u32,
        total_blocks: counts.total as u32,
        draining: node.is_draining(),
        block_tokens: model.shape().block_tokens(),
        heartbeat_ms,
        // Set by the node, which knows its pool's reserve.
        usable_context: 0,
        serving: PbRole::from(node.serving()) as i32,
        // Set by the node, which hashes its model once.
        fingerprint: String::new(),
    }
}

/// The heartbeat's memory: consecutive failures, beats sent, and the sticky drain flag.
#[derive(Debug)]
pub struct Heartbeat<R> {
    registry: R,
    /// The registry's address, for the log.
    target: String,
    timeout: Duration,
    failures: AtomicU32,
    failed_total: AtomicU64,
    beats: AtomicU64,
    drain: AtomicBool,
}

impl<R: Registry> Heartbeat<R> {
    /// A heartbeat to `registry`, each beat bounded by `timeout`.
    pub fn new(registry: R, timeout: Duration) -> Self {
        Self {
            registry,
            target: String::new(),
            timeout,
            failures: AtomicU32::new(0),
            failed_total: AtomicU64::new(0),
            beats: AtomicU64::new(0),
            drain: AtomicBool::new(false),
        }
    }

    /// The same, logging `target` as the registry's address.
    #[must_use]
    pub fn named(mut self, target: impl Into<String>) -> Self {
        self.target = target.into();
        self
    }

    /// Consecutive failed beats (0 after a success).
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::SeqCst)
    }

    /// Failed beats since the start.
    pub fn failed_total(&self) -> u64 {
        self.failed_total.load(Ordering::Relaxed)
    }

    /// Beats attempted.
    pub fn beats(&self) -> u64 {
        self.beats.load(Ordering::SeqCst)
    }

    /// True once any ack said drain.
    pub fn drain_requested(&self) -> bool {
        self.drain.load(Ordering::SeqCst)
    }

    /// Sends one beat, bounded by the timeout. Returns whether the worker must drain (sticky:
    /// once true, true for good).
    ///
    /// # Errors
    /// The registry's status or DEADLINE_EXCEEDED; the failure is counted.
    pub async fn beat_once(&self, status: WorkerStatus) -> Result<bool, Status> {
        self.beats.fetch_add(1, Ordering::SeqCst);
        let res = match tokio::time::timeout(self.timeout, self.registry.heartbeat(status)).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "heartbeat took longer than {:?}",
                self.timeout
            ))),
        };
        match res {
            Ok(ack) => {
                self.failures.store(0, Ordering::SeqCst);
                if ack.drain {
                    self.drain.store(true, Ordering::SeqCst);
                }
                Ok(self.drain_requested())
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::SeqCst);
                self.failed_total.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Beats at once, then every `interval` and whenever `wake` is notified (a drain started),
    /// with a fresh status each time, until `stop` fires (promptly: a beat in progress is
    /// abandoned). Never stops on failure: each failed beat is logged on stderr with the
    /// registry's address and the error, and the next waits [`backoff`] intervals. `on_ack`
    /// runs at every acknowledged beat; `on_drain` (once) when an ack first says drain.
    pub async fn run(
        self: Arc<Self>,
        interval: Duration,
        status: impl Fn() -> WorkerStatus + Send,
        on_ack: impl Fn() + Send,
        on_drain: impl Fn() + Send,
        wake: Arc<Notify>,
        stop: CancellationToken,
    ) {
        let mut drained = false;
        let mut acked = false;
        loop {
            let failing = self.failures();
            tokio::select! {
                r = self.beat_once(status()) => match r {
                    Ok(drain) => {
                        if !acked {
                            tracing::info!(registry = self.target.as_str(), "registered");
                        } else if failing > 0 {
                            tracing::info!(
                                registry = self.target.as_str(),
                                failed_beats = failing,
                                "reached the gateway registry again"
                            );
                        }
                        acked = true;
                        on_ack();
                        if drain && !drained {
                            drained = true;
                            on_drain();
                        }
                    }
                    Err(e) => {
                        let failures = self.failures();
                        tracing::warn!(
                            registry = self.target.as_str(),
                            code = ?e.code(),
                            error = e.message(),
                            failures,
                            retry_in_ms = (interval * backoff(failures)).as_millis() as u64,
                            "cannot reach the gateway registry; retrying"
                        );
                    }
                },
                () = stop.cancelled() => return,
            }
            let wait = interval * backoff(self.failures());
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = wake.notified() => {}
                () = stop.cancelled() => return,
            }
        }
    }
}

/// Intervals to wait after `failures` consecutive failed beats: 1, then 2, then 4 for good. A
/// registry that is down is not asked every interval, and one that is back hears from the
/// engine within 4 intervals (it evicts after 3 missed beats, so the engine registers anew).
#[must_use]
pub fn backoff(failures: u32) -> u32 {
    match failures {
        0 | 1 => 1,
        2 => 2,
        _ => 4,
    }
}
