//! What every part of one engine process shares, whatever its role: its id and role, the engine
//! thread's handle, the drain flag, and the count of work in flight. The parts a role builds (the
//! prefill service, the decode front, the KV receiver) hold an `Arc` of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use kvwire_grpc::KvReceiver;
use tokio::sync::Notify;

use tl_engine_core::constraint::Constraint;

use super::config::Role;
use super::runner::Runner;
use crate::structured::{Grammars, Kind, MAX_SPEC_BYTES, Spec, StructuredError};

/// The shared state of one engine node.
#[derive(Debug)]
pub struct NodeState {
    id: String,
    role: Role,
    /// The role it takes new work in now (within `role`; see [`NodeState::set_serving`]).
    serving: AtomicU8,
    runner: Runner,
    receiver: Option<Arc<KvReceiver>>,
    draining: AtomicBool,
    /// Wakes the heartbeat: a drain started, or the serving role changed.
    drain_started: Arc<Notify>,
    prefills: AtomicUsize,
    prefills_changed: Notify,
    /// The registry this engine beats to, until it first acknowledged a beat (then empty):
    /// not ready before.
    unregistered: std::sync::Mutex<Option<String>>,
    /// The structured-output compiler for the model's vocabulary, built at the first request
    /// that asks for one.
    grammars: tokio::sync::OnceCell<Arc<Grammars>>,
}

impl NodeState {
    /// A request's structured-output spec compiled over the model's vocabulary, off the async
    /// workers (the compiler itself is built once, at the first such request).
    ///
    /// # Errors
    /// INVALID_ARGUMENT for a spec of an unknown kind, past its bounds, or refused.
    pub async fn constraint(
        &self,
        spec: Option<&kvwire_grpc::pb::engine::Structured>,
    ) -> Result<Option<Box<dyn Constraint>>, tonic::Status> {
        let Some(s) = spec else {
            return Ok(None);
        };
        let refused =
            |e: StructuredError| tonic::Status::invalid_argument(format!("structured output: {e}"));
        let kind =
            Kind::named(&s.kind).ok_or_else(|| refused(StructuredError::Kind(s.kind.clone())))?;
        if s.text.len() > MAX_SPEC_BYTES {
            return Err(refused(StructuredError::TooLarge(s.text.len())));
        }
        let spec = Spec {
            kind,
            text: s.text.clone(),
        };
        let lost = |_| tonic::Status::internal("compiling the structured output stopped");
        let grammars = self
            .grammars
            .get_or_try_init(|| async {
                let vocab = self.runner.model().tokens();
                tokio::task::spawn_blocking(move || Grammars::new(&vocab).map(Arc::new))
                    .await
                    .map_err(lost)?
                    .map_err(refused)
            })
            .await?;
        let grammars = Arc::clone(grammars);
        let compiled = tokio::task::spawn_blocking(move || grammars.compile(&spec))
            .await
            .map_err(lost)?
            .map_err(refused)?;
        Ok(Some(Box::new(compiled)))
    }

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
            serving: AtomicU8::new(role_code(role)),
            runner,
            receiver,
            draining: AtomicBool::new(false),
            drain_started: Arc::new(Notify::new()),
            prefills: AtomicUsize::new(0),
            prefills_changed: Notify::new(),
            unregistered: std::sync::Mutex::new(None),
            grammars: tokio::sync::OnceCell::new(),
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

    /// The role it takes new work in now: its configured role, unless
    /// [`set_serving`](Self::set_serving) changed it.
    #[must_use]
    pub fn serving(&self) -> Role {
        match self.serving.load(Ordering::SeqCst) {
            0 => Role::Prefill,
            1 => Role::Decode,
            _ => Role::Both,
        }
    }

    /// Takes new work in `to` from now on, and returns the role it served before. Only an
    /// engine configured `both` has the parts of every role, so only it can change; any engine
    /// can be set to its own role. Leaving decode pauses the KV receiver (new pushes are
    /// refused with FAILED_PRECONDITION, held handles can still be claimed); the heartbeat
    /// beats at once, so every registry hears of it.
    ///
    /// # Errors
    /// [`RoleChangeRefused`] when `to` is not within the configured role; nothing changed.
    pub fn set_serving(&self, to: Role) -> Result<Role, RoleChangeRefused> {
        if self.role != Role::Both && to != self.role {
            return Err(RoleChangeRefused {
                worker: self.id.clone(),
                configured: self.role,
                asked: to,
            });
        }
        let before = self.serving.swap(role_code(to), Ordering::SeqCst);
        if let Some(rx) = &self.receiver {
            rx.set_paused(!to.decodes());
        }
        if before != role_code(to) {
            self.drain_started.notify_one();
        }
        Ok(match before {
            0 => Role::Prefill,
            1 => Role::Decode,
            _ => Role::Both,
        })
    }

    /// Ok while it takes new Prefill calls.
    ///
    /// # Errors
    /// FAILED_PRECONDITION naming the role it serves in now: the gateway tries another
    /// prefill engine.
    pub fn serves_prefill(&self) -> Result<(), tonic::Status> {
        let now = self.serving();
        if now.prefills() {
            Ok(())
        } else {
            Err(tonic::Status::failed_precondition(format!(
                "worker {} serves as {} now, not prefill",
                self.id,
                now.name()
            )))
        }
    }

    /// Work of the roles `left` still in flight: leaving decode, running and queued sequences
    /// (less one per Prefill call, which runs one there), pushes in progress and handles waiting
    /// for a claim; leaving prefill, Prefill calls.
    #[must_use]
    pub fn remaining_of(&self, left: Role, now: Role) -> usize {
        let mut n = 0;
        if left.decodes() && !now.decodes() {
            // The engine thread's sequences less the one each Prefill call runs there.
            n += (self.remaining_work() - self.inflight_prefills())
                .saturating_sub(self.inflight_prefills());
        }
        if left.prefills() && !now.prefills() {
            n += self.inflight_prefills();
        }
        n
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
        self.wait_for(deadline, || self.remaining_work()).await
    }

    /// Waits up to `deadline` until `left()` (a count of work in flight) is 0, and returns its
    /// last value. Woken by every change of the work in flight, never polling.
    pub async fn wait_for(&self, deadline: Duration, left: impl Fn() -> usize) -> usize {
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
            let n = left();
            if n == 0 {
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
                () = tokio::time::sleep_until(end) => return left(),
            }
        }
    }
}

fn role_code(r: Role) -> u8 {
    match r {
        Role::Prefill => 0,
        Role::Decode => 1,
        Role::Both => 2,
    }
}

/// A role change an engine cannot make: it lacks the parts of the role asked for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("worker {worker} is configured {} and cannot serve as {}", configured.name(), asked.name())]
pub struct RoleChangeRefused {
    /// The engine.
    pub worker: String,
    /// Its configured role.
    pub configured: Role,
    /// The role asked for.
    pub asked: Role,
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
