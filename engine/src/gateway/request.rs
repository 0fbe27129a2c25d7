//! One request's life in the gateway, as a task of its own: the driver of a
//! [`Session`](super::session::Session). It performs the session's actions (plan with HasBlocks,
//! Prefill, resume and relay a decode stream, release, cancel, send to the client) and feeds back
//! what they bring; every decision is the session's. The driver owns the resources an action
//! takes, so that however the request ends (finished, given up, the client gone, or the task
//! dropped by the request timeout) each is given back:
//! - a Prefill's handle not yet claimed by its decode engine is an [`Unclaimed`], released when
//!   the session says so, or in the background when dropped;
//! - a relayed stream is a task, aborted when its lane closes (dropping the stream cancels the
//!   sequence on the engine);
//! - the request counts on its decode engine ([`RoutedGuard`]) from the Prefill until the
//!   lane's stream ends.

use super::worker::WorkerId;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_grpc::pb::control::WorkerStatus;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};
use tracing::Instrument;
use tracing::field::Empty;

use super::plan::{WorkerView, decode_candidates, has_blocks_targets, plan};
use super::queue::{Place, QueueError, Ticket};
use super::routed::RoutedGuard;
use super::session::{
    Action, LaneId, LossCause, PrefillFailure, RetryPolicy, Session, SessionEvent, Unservable,
};
use super::state::Gateway;
use super::upstream::Unclaimed;
use crate::api::ApiError;
use crate::api::render::ChoiceEvent;
use kvwire_grpc::pb::engine::{GenerateEvents, GenerateRequest};

pub use super::session::{Job, Out};

/// Events the driver's tasks may have queued before the request loop takes them.
const EVENT_QUEUE: usize = 64;

/// What one request's driver holds.
struct Driver<'g> {
    g: &'g Arc<Gateway>,
    out: mpsc::Sender<Out>,
    events: mpsc::Sender<SessionEvent>,
    tasks: JoinSet<()>,
    /// Each lane's relayed stream.
    streams: HashMap<LaneId, AbortHandle>,
    /// Each lane's count on its decode engine.
    counted: HashMap<LaneId, RoutedGuard>,
    /// Each lane's count on its prefill engine while its Prefill call is out.
    prefilling: HashMap<LaneId, RoutedGuard>,
    /// The decode engine of each lane's last Prefill: where its handle lives.
    pushed_to: HashMap<LaneId, WorkerStatus>,
    /// Handles not yet claimed.
    unclaimed: HashMap<LaneId, Unclaimed>,
    /// The request's tenant cache scope.
    scope: u64,
    /// What it may hold at most.
    need: Need,
    /// Its turn in the gateway's queue.
    ticket: Ticket,
    /// Its place on the prefill engines, from the queue until its answer starts (shared with
    /// a [`Action::Wait`] task, which puts the next one here).
    place: Arc<std::sync::Mutex<Option<Place>>>,
}

impl Gateway {
    /// The retry policy of every request, from `[gateway]`.
    pub(super) fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            decode_attempts: self.cfg.prefill_decode_attempts.max(1) as usize,
            max_failovers: self.cfg.max_failovers,
            stall: Duration::from_millis(self.cfg.stall_timeout_ms.max(1)),
            colocated_quiet: Duration::from_millis(self.cfg.request_timeout_ms.max(1)),
            release_wait: Duration::from_millis(self.cfg.cancel_release_wait_ms),
        }
    }

    /// Runs one request, sending what happens to `out`. Returns when the request is over or the
    /// client has gone (then after cleaning up, within the policy's `release_wait`).
    pub(super) async fn drive(self: Arc<Self>, job: Job, out: mpsc::Sender<Out>) {
        let scope = job.scope;
        // What the request may hold at most: its prompt on a prefill engine, and its prompt
        // plus every choice's tokens on the engine that decodes it.
        let need = Need {
            prompt: job.prompt.len() as u64,
            whole: job.prompt.len() as u64
                + u64::from(job.choices.n) * u64::from(job.params.max_tokens()),
        };
        // A place on the prefill engines first: the request waits here, at its turn, while
        // they are busy (429 past the queue's bounds), and leaves if the client does.
        let mut ticket = self.queue.ticket();
        let place = tokio::select! {
            p = self.place(&mut ticket, need.prompt, None) => p,
            () = out.closed() => return,
            () = self.drain.cut.cancelled() => Err(ApiError::unavailable(
                "the gateway is draining: this request was ended before it started",
            )),
        };
        let place = match place {
            Ok(p) => p,
            Err(e) => {
                let _ = out.send(Out::Choice(ChoiceEvent::Failed(e))).await;
                return;
            }
        };
        let mut session = Session::new(job, self.request_id(), self.retry_policy());
        let release_wait = session.policy().release_wait;
        let (events, mut rx) = mpsc::channel(EVENT_QUEUE);
        let mut d = Driver {
            g: &self,
            out: out.clone(),
            events,
            tasks: JoinSet::new(),
            streams: HashMap::new(),
            counted: HashMap::new(),
            prefilling: HashMap::new(),
            pushed_to: HashMap::new(),
            unclaimed: HashMap::new(),
            scope,
            need,
            ticket,
            place: Arc::new(std::sync::Mutex::new(Some(place))),
        };
        let mut pending: VecDeque<Action> = session.start().into();
        let mut client_gone = false;
        let mut drained = false;
        let mut cleanup_by: Option<tokio::time::Instant> = None;
        loop {
            while let Some(action) = pending.pop_front() {
                if let Some(e) = d.perform(action).await {
                    pending.extend(session.on(e));
                }
            }
            if session.is_over() {
                return;
            }
            if session.is_closing() && cleanup_by.is_none() {
                cleanup_by = Some(tokio::time::Instant::now() + release_wait);
            }
            let event = tokio::select! {
                Some(e) = rx.recv() => e,
                () = out.closed(), if !client_gone => {
                    client_gone = true;
                    SessionEvent::ClientGone
                }
                // The gateway's drain ran out: the request ends with an error naming it.
                () = self.drain.cut.cancelled(), if !drained => {
                    drained = true;
                    SessionEvent::Drain
                }
                () = sleep_until(cleanup_by), if cleanup_by.is_some() => {
                    // What is left ends with its lease.
                    return;
                }
            };
            d.observe(&event).await;
            pending.extend(session.on(event));
        }
    }

    /// A place on the prefill engines for a prompt of `tokens`, at the ticket's turn (see
    /// [`super::queue`]); `again`: the place a request refused for load gives back, and its
    /// pause.
    async fn place(
        &self,
        ticket: &mut Ticket,
        tokens: u64,
        again: Option<(Place, Duration)>,
    ) -> Result<Place, ApiError> {
        let engines = || {
            self.registry
                .snapshot_shared(Instant::now())
                .iter()
                .filter(|w| !w.status.draining && w.role().is_some_and(|r| r.prefills()))
                .count()
        };
        let waited = Instant::now();
        let r = self.queue.enter(ticket, tokens, engines, again).await;
        self.metrics
            .queue_wait_seconds
            .observe(waited.elapsed().as_secs_f64());
        r.map_err(|e| {
            let outcome = match e {
                QueueError::Full(_) => "full",
                QueueError::TimedOut(_) => "timed_out",
            };
            tracing::info!(outcome, "no place in the queue: 429");
            ApiError::rate_limited(e.to_string())
        })
    }

    /// The live workers, less `exclude`. With `first`, while the gateway is young
    /// (`startup_grace_ms`) and they cannot serve a request yet, waits for registrations.
    async fn workers_for(&self, exclude: &[String], first: bool) -> Arc<[WorkerView]> {
        let grace_end = self.started + Duration::from_millis(self.cfg.startup_grace_ms);
        loop {
            let beat = self.registry.next_beat();
            tokio::pin!(beat);
            beat.as_mut().enable();
            let all = self.registry.snapshot_shared(Instant::now());
            let workers: Arc<[WorkerView]> = if exclude.is_empty() {
                all
            } else {
                all.iter()
                    .filter(|w| !exclude.contains(&w.status.worker_id))
                    .cloned()
                    .collect()
            };
            let now = Instant::now();
            if !first || now >= grace_end || servable(&workers, self) {
                return workers;
            }
            let _ = tokio::time::timeout(grace_end - now, beat).await;
        }
    }
}

/// `workers` less those that serve another model than `gateway`'s fingerprint names; when
/// that leaves none of several, the refusal naming both models.
fn same_model(workers: Arc<[WorkerView]>, gateway: &str) -> Result<Arc<[WorkerView]>, Unservable> {
    let same = |w: &WorkerView| tl_engine_core::model::same_model(gateway, &w.status.fingerprint);
    if workers.iter().all(same) {
        return Ok(workers);
    }
    let kept: Arc<[WorkerView]> = workers.iter().filter(|w| same(w)).cloned().collect();
    if kept.is_empty() {
        let other = &workers[0].status;
        return Err(Unservable::OtherModel(format!(
            "no engine serves the model this gateway tokenizes for: engine {} serves {:?} \
             (fingerprint {}), this gateway's text side is fingerprint {gateway} ({}); give the \
             gateway the engines' checkpoint as [gateway] model_path",
            other.worker_id,
            other.model,
            other.fingerprint,
            if gateway.ends_with("-c-") {
                "the byte tokenizer, no model_path"
            } else {
                "its model_path"
            }
        )));
    }
    for w in workers.iter().filter(|w| !same(w)) {
        tracing::debug!(
            worker = %w.status.worker_id,
            fingerprint = %w.status.fingerprint,
            gateway = gateway,
            "an engine serves another model than this gateway's: not routed to"
        );
    }
    Ok(kept)
}

/// The most one request may hold: its prompt, and its prompt plus every choice's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Need {
    /// On a prefill engine.
    pub prompt: u64,
    /// On the engine that decodes it.
    pub whole: u64,
}

/// `workers` less those that report a context too small for this request (a prefill engine
/// below its prompt, an engine that decodes below the whole): a route never takes them, and
/// they do not lower what the others serve. The snapshot is shared as it is when every worker
/// can hold the request (the usual case).
fn holding(workers: Arc<[WorkerView]>, need: Need) -> Arc<[WorkerView]> {
    let fits = |w: &WorkerView| {
        let room = u64::from(w.status.usable_context);
        let decodes = !w.status.kv_address.is_empty() || w.is(crate::net::role::Role::Both);
        room == 0 || room >= if decodes { need.whole } else { need.prompt }
    };
    if workers.iter().all(fits) {
        return workers;
    }
    for w in workers.iter().filter(|w| !fits(w)) {
        tracing::debug!(
            worker = w.status.worker_id.as_str(),
            usable_context = w.status.usable_context,
            need = need.whole,
            "left out of the route: its context is too small for this request"
        );
    }
    workers.iter().filter(|w| fits(w)).cloned().collect()
}

/// True when some route exists over `workers` (every decode engine taken as holding nothing).
fn servable(workers: &[WorkerView], g: &Gateway) -> bool {
    let cached: HashMap<WorkerId, usize> = decode_candidates(workers)
        .into_iter()
        .map(|w| (WorkerId::of(w), 0))
        .collect();
    !plan(workers, &cached, &HashMap::new(), g.policy()).is_empty()
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

impl Driver<'_> {
    /// Runs `task` as the lane's stream (aborted when the lane closes, or with the request).
    fn lane_task<F>(
        &mut self,
        lane: LaneId,
        task: impl FnOnce(Arc<Gateway>, mpsc::Sender<SessionEvent>) -> F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        let fut = task(Arc::clone(self.g), self.events.clone());
        let h = self.tasks.spawn(fut.in_current_span());
        self.streams.insert(lane, h);
    }

    /// Keeps the driver's books on an event before the session sees it.
    async fn observe(&mut self, event: &SessionEvent) {
        match event {
            SessionEvent::Prefilled { lane, handle } => {
                self.prefilling.remove(lane);
                if let Some(d) = self.pushed_to.get(lane) {
                    self.unclaimed.insert(
                        *lane,
                        Unclaimed::new(
                            Arc::clone(&self.g.upstream),
                            &d.kv_address,
                            &handle.handle_id,
                        ),
                    );
                }
            }
            SessionEvent::PrefillFailed { lane, .. } => {
                self.counted.remove(lane);
                self.prefilling.remove(lane);
            }
            SessionEvent::Opened { lane } => {
                // A 200 means the decode engine claimed the handle; from here, dropping the
                // stream is what frees its blocks.
                if let Some(u) = self.unclaimed.remove(lane) {
                    u.claimed();
                }
            }
            _ => {}
        }
    }

    /// Performs one action; an event it brings at once (the client gone, an unusable address)
    /// comes back for the session.
    async fn perform(&mut self, action: Action) -> Option<SessionEvent> {
        match action {
            Action::Plan {
                lane,
                prompt,
                exclude,
                model,
            } => self.plan(lane, prompt, exclude, model),
            Action::Routed { reason } => {
                self.g
                    .metrics
                    .route_decisions
                    .get_or_create(&crate::telemetry::metrics::Reason { reason })
                    .inc();
                tracing::debug!(reason = reason.label(), "routed");
            }
            Action::Prefill {
                lane,
                prefill,
                decode,
                request,
            } => return self.prefill(lane, &prefill, decode, request),
            Action::Resume {
                lane,
                decode,
                request,
                quiet,
            } => self.lane_task(lane, async move |g, tx| {
                let opened =
                    tokio::time::timeout(quiet, g.upstream.generate(&decode.grpc_address, request))
                        .await;
                let events = match opened {
                    Ok(Ok(events)) => events,
                    Ok(Err(_)) => return lost(&tx, lane, LossCause::Reset).await,
                    Err(_) => return lost(&tx, lane, LossCause::Stall).await,
                };
                if tx.send(SessionEvent::Opened { lane }).await.is_ok() {
                    relay(events, &tx, lane, quiet).await;
                }
            }),
            Action::Colocated {
                lane,
                target,
                request,
                quiet,
            } => {
                // Counted on its engine until the lane closes, as a disaggregated one is on
                // its decode engine: the next plans see it before the engine's next beat.
                self.counted
                    .insert(lane, self.g.routed.enter(WorkerId::of(&target)));
                self.lane_task(lane, async move |g, tx| {
                    colocated(&g, &target, request, &tx, lane, quiet).await;
                });
            }
            Action::Wait { lane, pause } => self.wait(lane, pause),
            Action::Emit(o) => {
                if matches!(o, Out::Start { .. }) {
                    // The answer starts: its prefill is over, and its place goes to the next.
                    self.take_place();
                }
                if self.out.send(o).await.is_err() {
                    return Some(SessionEvent::ClientGone);
                }
            }
            Action::Release { lane, wait } => {
                if let Some(u) = self.unclaimed.remove(&lane) {
                    if wait {
                        u.release().await;
                    } else {
                        // Dropped: released in the background (a partitioned engine must not
                        // hold up the failover).
                        drop(u);
                    }
                }
                self.counted.remove(&lane);
            }
            Action::Cancel {
                prefill,
                request_id,
                ..
            } => {
                if let Ok(ctl) = self.g.upstream.control(&prefill.grpc_address) {
                    // A hung prefill engine must not hold the request's clean-up past its
                    // bound; the Prefill's own answer is still awaited within it.
                    let wait = self.g.retry_policy().release_wait;
                    let _ = tokio::time::timeout(wait, ctl.cancel(&request_id)).await;
                }
            }
            Action::Close { lane } => {
                if let Some(h) = self.streams.remove(&lane) {
                    h.abort();
                }
                self.counted.remove(&lane);
            }
            Action::Lost {
                lane,
                worker,
                cause,
                tokens_sent,
            } => {
                tracing::warn!(
                    lane,
                    worker = %worker,
                    cause = cause.label(),
                    tokens_sent,
                    "decode stream lost"
                );
            }
            Action::Failover { cause, resumed } => {
                let outcome = if resumed {
                    crate::telemetry::metrics::FailoverOutcome::Resumed
                } else {
                    crate::telemetry::metrics::FailoverOutcome::GaveUp
                };
                self.g
                    .metrics
                    .failovers
                    .get_or_create(&crate::telemetry::metrics::FailoverLabels { cause, outcome })
                    .inc();
            }
            Action::Finish => self.take_place(),
        }
        None
    }

    /// Gives the request's place on the prefill engines back, if it holds one.
    fn take_place(&self) {
        self.place
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }

    /// [`Action::Plan`]: the planner runs as a task of the request's.
    fn plan(
        &mut self,
        lane: LaneId,
        prompt: Vec<u32>,
        exclude: Vec<String>,
        model: Option<String>,
    ) {
        let (g, tx, scope) = (Arc::clone(self.g), self.events.clone(), self.scope);
        let need = self.need;
        self.tasks.spawn(
            async move {
                let plan = g
                    .plan_for(&prompt, scope, &exclude, model.as_deref(), need)
                    .await;
                let plan = Box::new(plan);
                let _ = tx.send(SessionEvent::Planned { lane, plan }).await;
            }
            .in_current_span(),
        );
    }

    /// [`Action::Prefill`]: the call as a task, bounded by `prefill_timeout_ms`.
    fn prefill(
        &mut self,
        lane: LaneId,
        prefill: &WorkerStatus,
        decode: WorkerStatus,
        request: kvwire_grpc::pb::engine::PrefillRequest,
    ) -> Option<SessionEvent> {
        let Ok(ctl) = self.g.upstream.control(&prefill.grpc_address) else {
            return Some(SessionEvent::PrefillFailed {
                lane,
                failure: PrefillFailure::Unreachable,
            });
        };
        // Counted from the Prefill until the lane's stream ends, so routing between
        // heartbeats sees every stream this gateway runs.
        self.counted
            .insert(lane, self.g.routed.enter(WorkerId::of(&decode)));
        // And on its prefill engine until the Prefill answers, so the next plans spread
        // a burst over the prefill engines before their next beat.
        self.prefilling
            .insert(lane, self.g.routed.enter(WorkerId::of(prefill)));
        self.pushed_to.insert(lane, decode);
        let tx = self.events.clone();
        let deadline = Duration::from_millis(self.g.cfg.prefill_timeout_ms.max(1));
        self.tasks.spawn(
            async move {
                // A stalled prefill engine (stopped, partitioned, overloaded) holds the
                // request no longer than this: dropping the call resets its stream, and
                // the engine drops the prefill and its push.
                let answer = tokio::time::timeout(deadline, ctl.prefill(request)).await;
                let e = match answer {
                    Err(_) => SessionEvent::PrefillFailed {
                        lane,
                        failure: PrefillFailure::TimedOut,
                    },
                    Ok(Ok(handle)) => SessionEvent::Prefilled { lane, handle },
                    Ok(Err(s)) => SessionEvent::PrefillFailed {
                        lane,
                        failure: PrefillFailure::Status {
                            code: s.code(),
                            message: s.message().to_owned(),
                        },
                    },
                };
                let _ = tx.send(e).await;
            }
            .in_current_span(),
        );
        None
    }

    /// [`Action::Wait`]: nothing of the lane's last try is counted anywhere now; a task waits
    /// for the next place at the request's old turn.
    fn wait(&mut self, lane: LaneId, pause: Duration) {
        self.counted.remove(&lane);
        self.prefilling.remove(&lane);
        let (g, tx, slot) = (
            Arc::clone(self.g),
            self.events.clone(),
            Arc::clone(&self.place),
        );
        let (mut ticket, tokens) = (self.ticket, self.need.prompt);
        self.tasks.spawn(
            async move {
                let old = slot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                let again = match old {
                    Some(p) => Some((p, pause)),
                    None => {
                        tokio::time::sleep(pause).await;
                        None
                    }
                };
                let event = match g.place(&mut ticket, tokens, again).await {
                    Ok(p) => {
                        *slot
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(p);
                        SessionEvent::Placed { lane }
                    }
                    Err(error) => SessionEvent::Unplaced { lane, error },
                };
                let _ = tx.send(event).await;
            }
            .in_current_span(),
        );
    }
}

impl Gateway {
    /// Plans `prompt` over the live workers less `exclude`, asking the decode engines HasBlocks.
    /// With `model` (the request's first plan), the model must be served by a live worker, and
    /// while the gateway is young it waits for engines to register.
    async fn plan_for(
        &self,
        prompt: &[u32],
        scope: u64,
        exclude: &[String],
        model: Option<&str>,
        need: Need,
    ) -> super::session::Planned {
        let first = exclude.is_empty() && model.is_some();
        let workers = holding(self.workers_for(exclude, first).await, need);
        // Only engines of the model this gateway tokenizes for: another model's would read
        // these token ids as other text.
        let workers = same_model(workers, &self.fingerprint)?;
        if let Some(m) = model.filter(|m| !m.is_empty())
            && !workers.iter().any(|w| w.status.model == m)
        {
            return Err(Unservable::UnknownModel(m.to_owned()));
        }
        let route_span = tracing::info_span!("route", otel.kind = "internal", reason = Empty);
        if self.cfg.route_from_index
            && exclude.is_empty()
            && let Some(p) = self.plan_from_index(prompt, scope, &workers)
        {
            route_span.record("reason", super::plan::reason_label(&p).label());
            return Ok((p, HashMap::new()));
        }
        let (holds, cached) = self
            .cached_prefixes(
                prompt,
                scope,
                &has_blocks_targets(&workers),
                self.cfg.route_from_index,
            )
            .instrument(route_span.clone())
            .await;
        let p = plan(&workers, &cached, &self.routed.snapshot(), self.policy());
        route_span.record("reason", super::plan::reason_label(&p).label());
        Ok((p, holds))
    }
}

impl Gateway {
    /// The plan of `prompt` over `workers` from the prefix index alone, when every decode
    /// candidate's stream is followed (and they share one block size): the engines holding a
    /// prefix are scored, the others walked in load order ([`super::plan::plan_walk`]), so
    /// the work does not grow with the fleet. `None`: route the other way.
    fn plan_from_index(
        &self,
        prompt: &[u32],
        scope: u64,
        workers: &Arc<[WorkerView]>,
    ) -> Option<super::plan::Plan> {
        let policy = self.policy();
        let (fleet, verified) = {
            let mut g = self
                .fleet
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match &*g {
                Some((f, v)) if Arc::ptr_eq(&f.snap, workers) => (Arc::clone(f), *v),
                _ => {
                    let f = Arc::new(super::plan::Fleet::new(
                        Arc::clone(workers),
                        policy.load_penalty_tokens,
                    ));
                    *g = Some((Arc::clone(&f), None));
                    (f, None)
                }
            }
        };
        if fleet.block_sizes.len() > 1 {
            return None;
        }
        if verified != Some(self.index.generation()) {
            let (all, generation) = self
                .index
                .all_synced(fleet.candidates().map(|w| w.worker_id.as_str()));
            if !all {
                return None;
            }
            if let Some((f, v)) = &mut *self
                .fleet
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                && Arc::ptr_eq(f, &fleet)
            {
                *v = Some(generation);
            }
        }
        let hits = match fleet.block_sizes.first() {
            Some(&b) => self
                .index
                .hits(scope, &kvwire::prompt_hashes(prompt, b as usize)),
            None => Vec::new(),
        };
        let hits: HashMap<&str, usize> = hits.iter().map(|(w, k)| (&**w, *k)).collect();
        Some(super::plan::plan_walk(
            &fleet,
            &hits,
            &self.routed.snapshot(),
            policy,
        ))
    }

    /// The leading full blocks of `prompt` each decode engine of `targets` holds: from the
    /// prefix index for engines whose stream it follows, from HasBlocks for the others (whose
    /// answers are also returned, handed on to the Prefill that pushes there).
    pub(crate) async fn cached_prefixes(
        &self,
        prompt: &[u32],
        scope: u64,
        targets: &[&WorkerStatus],
        from_index: bool,
    ) -> (super::session::FleetHolds, HashMap<WorkerId, usize>) {
        let mut cached = HashMap::new();
        let ask: Vec<&WorkerStatus> = if from_index {
            // Engines of one block size share one hashing of the prompt.
            let mut by_b: HashMap<u32, Vec<&str>> = HashMap::new();
            for w in targets {
                by_b.entry(w.block_tokens.max(1))
                    .or_default()
                    .push(&w.worker_id);
            }
            let mut unsynced = Vec::new();
            for (b, ids) in by_b {
                let hashes = kvwire::prompt_hashes(prompt, b as usize);
                let (found, rest) = self.index.prefixes(scope, &hashes, &ids);
                cached.extend(found);
                unsynced.extend(rest.into_iter().map(str::to_owned));
            }
            targets
                .iter()
                .copied()
                .filter(|w| unsynced.contains(&w.worker_id))
                .collect()
        } else {
            targets.to_vec()
        };
        let holds = if ask.is_empty() {
            HashMap::new()
        } else {
            self.upstream.cached_prefixes(prompt, scope, &ask).await
        };
        cached.extend(
            holds
                .iter()
                .map(|(id, h)| (id.clone(), h.present.iter().take_while(|&&x| x).count())),
        );
        (holds, cached)
    }

    /// Routes `prompt` as a request's first plan would, without serving it, from the prefix
    /// index (`from_index`, with HasBlocks for engines whose stream is down) or by asking every
    /// decode engine: the plan, and how many decode engines answered HasBlocks (for
    /// `tl bench route` and the tests).
    pub async fn route_only(
        &self,
        prompt: &[u32],
        scope: u64,
        from_index: bool,
    ) -> (super::plan::Plan, usize) {
        let workers = self.registry.snapshot_shared(Instant::now());
        if from_index && let Some(p) = self.plan_from_index(prompt, scope, &workers) {
            return (p, 0);
        }
        let targets = has_blocks_targets(&workers);
        let (holds, cached) = self
            .cached_prefixes(prompt, scope, &targets, from_index)
            .await;
        let asked = holds.len();
        (
            plan(&workers, &cached, &self.routed.snapshot(), self.policy()),
            asked,
        )
    }
}

async fn lost(tx: &mpsc::Sender<SessionEvent>, lane: LaneId, cause: LossCause) {
    let _ = tx.send(SessionEvent::StreamLost { lane, cause }).await;
}

/// Opens a colocated Generate stream on `target` and relays it.
async fn colocated(
    g: &Gateway,
    target: &WorkerStatus,
    request: GenerateRequest,
    tx: &mpsc::Sender<SessionEvent>,
    lane: LaneId,
    quiet: Duration,
) {
    let opened =
        tokio::time::timeout(quiet, g.upstream.generate(&target.grpc_address, request)).await;
    match opened {
        Ok(Ok(events)) => relay(events, tx, lane, quiet).await,
        Ok(Err(s)) => {
            let _ = tx
                .send(SessionEvent::OpenFailed {
                    lane,
                    code: s.code(),
                    message: s.message().to_owned(),
                })
                .await;
        }
        Err(_) => lost(tx, lane, LossCause::Stall).await,
    }
}

/// Forwards an engine's Generate stream as events of `lane` until it ends, breaks or goes
/// quiet for `quiet`. The task is aborted when the lane closes; dropping `events` resets the
/// call, which cancels what the engine has left of the request.
async fn relay(
    mut events: tonic::Streaming<GenerateEvents>,
    tx: &mpsc::Sender<SessionEvent>,
    lane: LaneId,
    quiet: Duration,
) {
    loop {
        let e = match tokio::time::timeout(quiet, events.message()).await {
            Err(_) => SessionEvent::StreamLost {
                lane,
                cause: LossCause::Stall,
            },
            Ok(Ok(Some(events))) => SessionEvent::Generated {
                lane,
                events: Box::new(events),
            },
            // An engine ends a stream after every choice's end (or its in-band error); an end
            // before them, or a broken call, is a stream cut short (the session ignores it once
            // the lane is done).
            Ok(Ok(None) | Err(_)) => SessionEvent::StreamLost {
                lane,
                cause: LossCause::Reset,
            },
        };
        let end = !matches!(&e, SessionEvent::Generated { events, .. } if events.error_code == 0);
        if tx.send(e).await.is_err() || end {
            return;
        }
    }
}
