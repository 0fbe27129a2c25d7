//! The engine's step loop on a thread of its own, and the handle servers use to reach it.
//!
//! The [`Engine`] is pure and synchronous; a step can take long (a long prefill at a realistic
//! shape), so it never runs on an async worker. Servers send commands over a channel; the engine
//! thread applies them between steps and sends each sequence's events to that sequence's
//! subscriber. A subscriber that has gone away (an HTTP client that disconnected, a cancelled
//! RPC) makes the next send fail, and the thread cancels the sequence, releasing its blocks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use tl_engine_core::engine::{Engine, PrefillProgress, Request, Resume, SeqId, StepEvent};
use tl_engine_core::model::Model;
use tl_engine_core::pool::{BlockId, SharedKv};
use tl_engine_core::request::RequestError;
use tokio::sync::{Notify, mpsc as tmpsc};

/// What a subscriber hears about its sequence: the engine's own [`StepEvent`]s for it, or the
/// refusal of the request before any work.
pub type Heard = Result<StepEvent, RequestError>;

/// Requests and sequences the engine holds, published after every command and step, with a
/// notification whenever they change (a drain waits on it instead of polling).
#[derive(Debug, Default)]
pub struct Load {
    queue: AtomicU32,
    running: AtomicU32,
    preemptions: AtomicU64,
    submitted: AtomicU64,
    resumed: AtomicU64,
    changed: Notify,
}

impl Load {
    /// Requests preempted so far.
    #[must_use]
    pub fn preemptions(&self) -> u64 {
        self.preemptions.load(Ordering::Relaxed)
    }

    /// Requests submitted so far (prefills, and requests run here whole).
    #[must_use]
    pub fn submitted(&self) -> u64 {
        self.submitted.load(Ordering::Relaxed)
    }

    /// Sequences started from transferred blocks so far (decodes handed over).
    #[must_use]
    pub fn resumed(&self) -> u64 {
        self.resumed.load(Ordering::Relaxed)
    }

    /// Resolves at the next change of the published figures.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}

enum Cmd {
    Submit(
        u64,
        Box<(Request, Option<Arc<dyn PrefillProgress>>)>,
        tmpsc::UnboundedSender<Heard>,
    ),
    Resume(u64, Box<Resume>, tmpsc::UnboundedSender<Heard>),
    Cancel(u64),
    Stop,
}

/// The handle to a running engine thread. Cloning shares it.
#[derive(Clone, Debug)]
pub struct Runner {
    tx: mpsc::Sender<CmdBox>,
    next: Arc<AtomicU64>,
    load: Arc<Load>,
    pool: SharedKv,
    model: Arc<dyn Model>,
}

/// Commands wrapped so the channel's type is nameable in `Runner`'s Debug.
struct CmdBox(Cmd);

impl std::fmt::Debug for CmdBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cmd")
    }
}

/// The engine thread itself: [`join`](Self::join) stops it and waits until it has ended (its
/// sequences dropped, their blocks released). Dropping it unjoined also asks it to stop.
#[derive(Debug)]
pub struct EngineThread {
    runner: Runner,
    join: Option<JoinHandle<()>>,
}

impl EngineThread {
    /// Stops the thread and waits for it, off the async workers.
    pub async fn join(mut self) {
        self.runner.stop();
        if let Some(j) = self.join.take() {
            // A step in progress finishes first; joining blocks, so not on a runtime worker.
            let _ = tokio::task::spawn_blocking(move || j.join()).await;
        }
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        self.runner.stop();
    }
}

/// A key for a request given to the runner; cancel with it.
pub type Key = u64;

impl Runner {
    /// Starts the engine thread.
    ///
    /// # Errors
    /// When the OS cannot start a thread.
    pub fn start(engine: Engine) -> std::io::Result<(Self, EngineThread)> {
        let (tx, rx) = mpsc::channel::<CmdBox>();
        let load = Arc::new(Load::default());
        let runner = Runner {
            tx,
            next: Arc::new(AtomicU64::new(1)),
            load: Arc::clone(&load),
            pool: engine.pool().clone(),
            model: Arc::clone(engine.model()),
        };
        let join = std::thread::Builder::new()
            .name("tl-engine-step".into())
            .spawn(move || {
                run(engine, rx, &load);
                // Nothing runs any more: whoever waits for the load to fall sees it now.
                load.queue.store(0, Ordering::Relaxed);
                load.running.store(0, Ordering::Relaxed);
                load.changed.notify_waiters();
            })?;
        let thread = EngineThread {
            runner: runner.clone(),
            join: Some(join),
        };
        Ok((runner, thread))
    }

    /// The published load, with its change notification.
    #[must_use]
    pub fn load(&self) -> &Arc<Load> {
        &self.load
    }

    /// The pool.
    #[must_use]
    pub fn pool(&self) -> &SharedKv {
        &self.pool
    }

    /// The model.
    #[must_use]
    pub fn model(&self) -> &Arc<dyn Model> {
        &self.model
    }

    /// Requests waiting for prefill.
    #[must_use]
    pub fn queue_depth(&self) -> u32 {
        self.load.queue.load(Ordering::Relaxed)
    }

    /// Sequences decoding.
    #[must_use]
    pub fn running(&self) -> u32 {
        self.load.running.load(Ordering::Relaxed)
    }

    /// Requests preempted so far: paused with their blocks given back, to resume exactly.
    #[must_use]
    pub fn preemptions(&self) -> u64 {
        self.load.preemptions()
    }

    fn key(&self) -> Key {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    #[must_use]
    pub fn submit(&self, req: Request) -> (Key, tmpsc::UnboundedReceiver<Heard>) {
        self.submit_observed(req, None)
    }

    /// [`submit`](Self::submit), with `progress` told on the engine thread as the prefill's
    /// blocks are written.
    #[must_use]
    pub fn submit_observed(
        &self,
        req: Request,
        progress: Option<Arc<dyn PrefillProgress>>,
    ) -> (Key, tmpsc::UnboundedReceiver<Heard>) {
        self.load.submitted.fetch_add(1, Ordering::Relaxed);
        self.start_seq(|key, tx| Cmd::Submit(key, Box::new((req, progress)), tx))
    }

    /// Starts a sequence from transferred blocks; as [`submit`](Self::submit).
    #[must_use]
    pub fn resume(&self, r: Resume) -> (Key, tmpsc::UnboundedReceiver<Heard>) {
        self.load.resumed.fetch_add(1, Ordering::Relaxed);
        self.start_seq(|key, tx| Cmd::Resume(key, Box::new(r), tx))
    }

    fn start_seq(
        &self,
        cmd: impl FnOnce(Key, tmpsc::UnboundedSender<Heard>) -> Cmd,
    ) -> (Key, tmpsc::UnboundedReceiver<Heard>) {
        let (etx, erx) = tmpsc::unbounded_channel();
        let key = self.key();
        // A send error means the engine thread is gone; the receiver then reports nothing and
        // the caller sees a closed stream.
        let _ = self.tx.send(CmdBox(cmd(key, etx)));
        (key, erx)
    }

    /// Cancels a queued or running request.
    pub fn cancel(&self, key: Key) {
        let _ = self.tx.send(CmdBox(Cmd::Cancel(key)));
    }

    /// Stops the engine thread (sequences still running are dropped, releasing their blocks).
    pub fn stop(&self) {
        let _ = self.tx.send(CmdBox(Cmd::Stop));
    }
}

/// An observed prefill under a simulated cost: each block is reported only once the simulated
/// time of the tokens before it has passed (cached prefix blocks cost nothing), as a real
/// model's blocks would be. The targets are absolute (from the first report), so a sleep's
/// overshoot is not added up block after block; the simulated time covered is counted so the
/// step's own sleep leaves it out.
#[derive(Debug)]
struct Paced {
    inner: Arc<dyn PrefillProgress>,
    per_token: Duration,
    block_tokens: usize,
    prompt_len: usize,
    /// When the first report came, the tokens it covered (the cached prefix), and the
    /// simulated time counted into `slept` so far.
    start: std::sync::Mutex<Option<(std::time::Instant, usize, Duration)>>,
    slept: Arc<AtomicU64>,
}

fn paced(
    inner: Arc<dyn PrefillProgress>,
    engine: &Engine,
    req: &Request,
    slept: &Arc<AtomicU64>,
) -> Arc<dyn PrefillProgress> {
    let per_token = engine.cost().prefill_per_token;
    if per_token.is_zero() {
        return inner;
    }
    Arc::new(Paced {
        inner,
        per_token,
        block_tokens: engine.model().shape().block_tokens() as usize,
        prompt_len: req.prompt.len(),
        start: std::sync::Mutex::new(None),
        slept: Arc::clone(slept),
    })
}

impl PrefillProgress for Paced {
    fn written(&self, blocks: &[BlockId], written: usize) {
        let tokens = (written * self.block_tokens).min(self.prompt_len);
        let mut start = self
            .start
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &mut *start {
            None => *start = Some((std::time::Instant::now(), tokens, Duration::ZERO)),
            Some((at, base, counted)) => {
                let covered = self.per_token * tokens.saturating_sub(*base) as u32;
                let target = *at + covered;
                let now = std::time::Instant::now();
                if target > now {
                    std::thread::sleep(target - now);
                }
                let more = covered.saturating_sub(*counted);
                *counted = covered;
                self.slept
                    .fetch_add(more.as_nanos() as u64, Ordering::Relaxed);
            }
        }
        drop(start);
        self.inner.written(blocks, written);
    }
}

fn run(mut engine: Engine, rx: mpsc::Receiver<CmdBox>, load: &Load) {
    let slept = Arc::new(AtomicU64::new(0));
    // Each request's subscriber, and its choices still open.
    let mut subs: HashMap<SeqId, (Key, tmpsc::UnboundedSender<Heard>, u32)> = HashMap::new();
    let mut seq_of: HashMap<Key, SeqId> = HashMap::new();
    loop {
        // Block for work when idle; otherwise take whatever commands are waiting.
        let first = if engine.is_idle() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            rx.try_recv().ok()
        };
        let mut next = first;
        while let Some(CmdBox(cmd)) = next {
            match cmd {
                Cmd::Submit(key, req, tx) => {
                    let (request, progress) = *req;
                    let progress = progress.map(|p| paced(p, &engine, &request, &slept));
                    let n = request.choices.n;
                    match engine.submit_observed(request, progress) {
                        Ok(seq) => {
                            subs.insert(seq, (key, tx, n));
                            seq_of.insert(key, seq);
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                }
                Cmd::Resume(key, r, tx) => match (r.choices.n, engine.resume(*r)) {
                    (n, Ok(seq)) => {
                        subs.insert(seq, (key, tx, n));
                        seq_of.insert(key, seq);
                    }
                    (_, Err(e)) => {
                        let _ = tx.send(Err(e));
                    }
                },
                Cmd::Cancel(key) => {
                    if let Some(seq) = seq_of.remove(&key) {
                        engine.cancel(seq);
                        subs.remove(&seq);
                    }
                }
                Cmd::Stop => return,
            }
            next = rx.try_recv().ok();
        }
        publish(&engine, load);
        if engine.is_idle() {
            continue;
        }
        let (events, stats) = engine.step_at(std::time::Instant::now());
        // Simulated compute happens before its results exist: sleep, then deliver. A prefill
        // whose blocks are observed (a streaming push) already slept block by block.
        let cost = engine
            .simulated_cost(stats)
            .saturating_sub(Duration::from_nanos(slept.swap(0, Ordering::Relaxed)));
        if !cost.is_zero() {
            std::thread::sleep(cost);
        }
        for ev in events {
            // `ends`: the choices this event ends (all of them for a failure).
            let (seq, ends) = match &ev {
                StepEvent::Token { seq, .. } => (*seq, 0),
                StepEvent::Finished { seq, .. } => (*seq, 1),
                StepEvent::Failed { seq, .. } | StepEvent::Prefilled { seq, .. } => {
                    (*seq, u32::MAX)
                }
            };
            let msg = Ok(ev);
            let mut last = false;
            let delivered = subs.get_mut(&seq).is_some_and(|(_, tx, open)| {
                *open = open.saturating_sub(ends);
                last = *open == 0;
                tx.send(msg).is_ok()
            });
            if last || !delivered {
                if !last {
                    // Nobody listens any more: stop the work and free its blocks.
                    engine.cancel(seq);
                }
                if let Some((key, ..)) = subs.remove(&seq) {
                    seq_of.remove(&key);
                }
            }
        }
        publish(&engine, load);
    }
}

fn publish(engine: &Engine, load: &Load) {
    let queue = engine.queue_depth() as u32;
    let running = engine.running() as u32;
    let old_queue = load.queue.swap(queue, Ordering::Relaxed);
    let old_running = load.running.swap(running, Ordering::Relaxed);
    load.preemptions
        .store(engine.preemptions(), Ordering::Relaxed);
    if (old_queue, old_running) != (queue, running) {
        load.changed.notify_waiters();
    }
}
