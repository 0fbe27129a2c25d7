//! What every part of one engine process shares, whatever its role: its id and role, the engine
//! thread's handle, the drain flag, and the count of work in flight. The parts a role builds (the
//! prefill service, the decode front, the KV receiver) hold an `Arc` of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvwire_grpc::KvReceiver;
use tokio::sync::Notify;

use super::config::Role;
use super::runner::Runner;

/// The shared state of one engine node.
#[derive(Debug)]
pub struct NodeState {
    id: String,
    role: Role,
    runner: Runner,
    receiver: Option<Arc<KvReceiver>>,
    draining: AtomicBool,
    drain_started: Arc<Notify>,
    prefills: AtomicUsize,
    prefills_changed: Notify,
    /// The registry this engine beats to, until it first acknowledged a beat (then empty):
    /// not ready before.
    unregistered: std::sync::Mutex<Option<String>>,
}

impl NodeState {
    /// The state of worker `id` with `role`, over the engine thread `runner`, receiving KV with
    /// `receiver` (decode roles).
    #[must_use]
    pub fn new(
        id: impl Into<String>,
        role: Role,
        runner: Runner,
        receiver: Option<Arc<KvReceiver>>,
    ) -> Self {
        Self {
            id: id.into(),
            role,
            runner,
            receiver,
            draining: AtomicBool::new(false),
            drain_started: Arc::new(Notify::new()),
            prefills: AtomicUsize::new(0),
            prefills_changed: Notify::new(),
            unregistered: std::sync::Mutex::new(None),
        }
    }

    /// The KV receiver (decode roles).
    #[must_use]
    pub fn receiver(&self) -> Option<&Arc<KvReceiver>> {
        self.receiver.as_ref()
    }

    /// Notified (once, with a stored permit) when the drain starts: the heartbeat beats at once.
    #[must_use]
    pub fn drain_started(&self) -> Arc<Notify> {
        Arc::clone(&self.drain_started)
    }

    /// The worker id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The role.
    #[must_use]
    pub fn role(&self) -> Role {
        self.role
    }

    /// The engine thread's handle.
    #[must_use]
    pub fn runner(&self) -> &Runner {
        &self.runner
    }

    /// Not ready until `registry` acknowledges a beat ([`registered`](Self::registered)).
    pub fn awaits_registration(&self, registry: &str) {
        *self.unregistered.lock().unwrap_or_else(|e| e.into_inner()) = Some(registry.to_owned());
    }

    /// The registry acknowledged a beat: ready from now on (a later outage of the registry
    /// does not take the engine out of service; the gateway's own view evicts it).
    pub fn registered(&self) {
        self.unregistered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    /// True once draining (it never goes back).
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Starts draining: new prefills, requests and pushes are refused from now on; handles
    /// already pending can still be claimed and released.
    pub fn start_drain(&self) {
        if !self.draining.swap(true, Ordering::SeqCst) {
            if let Some(rx) = &self.receiver {
                rx.start_drain();
            }
            self.drain_started.notify_one();
        }
    }

    /// Prefill calls in flight.
    #[must_use]
    pub fn inflight_prefills(&self) -> usize {
        self.prefills.load(Ordering::SeqCst)
    }

    /// Counts one Prefill call in flight until the guard drops.
    #[must_use]
    pub fn prefill_started(self: &Arc<Self>) -> PrefillInFlight {
        self.prefills.fetch_add(1, Ordering::SeqCst);
        PrefillInFlight(Arc::clone(self))
    }

    /// Requests waiting for prefill, Prefill calls included (what routing calls queue depth).
    #[must_use]
    pub fn queue_depth(&self) -> u32 {
        self.runner.queue_depth() + self.inflight_prefills() as u32
    }

    /// Work not finished: Prefill calls, queued and running sequences, pushes in progress and
    /// handles waiting for a claim.
    #[must_use]
    pub fn remaining_work(&self) -> usize {
        let kv = self.receiver.as_ref().map_or(0, |r| {
            let s = r.stats();
            s.pending + s.inflight
        });
        self.inflight_prefills()
            + self.runner.queue_depth() as usize
            + self.runner.running() as usize
            + kv
    }

    /// Refuses new work from now on and waits up to `deadline` for the work in flight to end;
    /// returns what remains. Woken by every change of the work in flight, never polling.
    pub async fn drain(&self, deadline: Duration) -> usize {
        self.start_drain();
        let end = tokio::time::Instant::now() + deadline;
        loop {
            // Register for both notifications before looking, so a change in between is seen.
            let load = self.runner.load().changed();
            let prefills = self.prefills_changed.notified();
            let mut kv = self.receiver.as_ref().map(|r| Box::pin(r.changed()));
            tokio::pin!(load, prefills);
            load.as_mut().enable();
            prefills.as_mut().enable();
            if let Some(k) = kv.as_mut() {
                k.as_mut().enable();
            }
            let left = self.remaining_work();
            if left == 0 {
                return 0;
            }
            tokio::select! {
                () = load => {}
                () = prefills => {}
                () = async {
                    match kv.as_mut() {
                        Some(k) => k.await,
                        None => std::future::pending().await,
                    }
                } => {}
                () = tokio::time::sleep_until(end) => return self.remaining_work(),
            }
        }
    }
}

/// One Prefill call in flight; dropping it ends the count and wakes a drain.
#[derive(Debug)]
pub struct PrefillInFlight(Arc<NodeState>);

impl Drop for PrefillInFlight {
    fn drop(&mut self) {
        self.0.prefills.fetch_sub(1, Ordering::SeqCst);
        self.0.prefills_changed.notify_waiters();
    }
}

impl crate::net::probes::Probe for NodeState {
    fn ready(&self) -> Result<(), crate::net::probes::NotReady> {
        if self.is_draining() {
            return Err(crate::net::probes::NotReady::Draining {
                worker: self.id.clone(),
            });
        }
        let waiting = self
            .unregistered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match waiting {
            Some(registry) => Err(crate::net::probes::NotReady::Unregistered {
                worker: self.id.clone(),
                registry,
            }),
            None => Ok(()),
        }
    }

    fn drain(
        self: Arc<Self>,
        deadline: std::time::Duration,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<usize>> + Send>> {
        Box::pin(async move { Some(NodeState::drain(&self, deadline).await) })
    }
}
