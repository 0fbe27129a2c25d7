//! The gateway's wait queue: where a request waits, first come first served, for a place on the
//! fleet's prefill engines, instead of being refused while the engines are busy.
//!
//! A request holds a [`Place`] from the moment it leaves the queue until its first token (its
//! prefill is over) or its end. Places are counted in prompt tokens: the prompts in prefill at
//! once stay within `prefill_tokens` per engine that prefills, and one request always fits
//! when nothing else is in prefill, however long its prompt. So the prefill engines are never
//! handed more than they compute within a Prefill's deadline, and the rest wait here, where
//! waiting costs nothing.
//!
//! The queue is bounded twice: at most `max_queued` requests wait (a request beyond gets 429
//! with `Retry-After` at once), and none waits longer than `queue_timeout` (then 429 with
//! `Retry-After`). A request whose Prefill was refused for load (a full pool, a busy engine, a
//! deadline missed while the engines live) comes back here ahead of every later arrival: it
//! keeps its ticket.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Why a request did not get a place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// `max_queued` requests are waiting already.
    #[error("{0} requests are waiting for an engine already (max_queued)")]
    Full(usize),
    /// It waited until its deadline.
    #[error("no engine could take this request within {0} ms (queue_timeout_ms)")]
    TimedOut(u64),
}

/// The queue's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// Requests waiting at once.
    pub max_queued: usize,
    /// Prompt tokens in prefill at once, per engine that prefills.
    pub prefill_tokens: u64,
    /// The longest a request waits, over all its waits.
    pub timeout: Duration,
}

#[derive(Debug, Default)]
struct State {
    /// Tickets waiting, oldest (lowest) first.
    waiting: BTreeSet<u64>,
    next_ticket: u64,
    /// Prompt tokens of the places held.
    tokens: u64,
    /// Places held.
    held: usize,
}

/// The wait queue (see the module).
#[derive(Debug)]
pub struct WaitQueue {
    limits: QueueLimits,
    state: Mutex<State>,
    /// Woken whenever a place is given back or the head of the queue changes.
    changed: Notify,
}

/// A request's turn in the queue: its ticket, kept across its waits, and its deadline.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    id: u64,
    deadline: Instant,
    /// It has been in the queue before: `max_queued` counted it then.
    counted: bool,
}

impl Ticket {
    /// When the request stops waiting.
    #[must_use]
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// A place on the prefill engines, given back when dropped.
#[derive(Debug)]
pub struct Place {
    queue: Arc<WaitQueue>,
    tokens: u64,
}

impl Drop for Place {
    fn drop(&mut self) {
        {
            let mut s = self.queue.lock();
            s.tokens = s.tokens.saturating_sub(self.tokens);
            s.held = s.held.saturating_sub(1);
        }
        self.queue.changed.notify_waiters();
    }
}

/// Takes the ticket out of the waiting set however the wait ends (a place, a timeout, or the
/// waiting future dropped because the client left).
struct Waiting<'q> {
    queue: &'q WaitQueue,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.queue.lock().waiting.remove(&self.id);
        self.queue.changed.notify_waiters();
    }
}

impl WaitQueue {
    /// A queue with these bounds.
    #[must_use]
    pub fn new(limits: QueueLimits) -> Self {
        Self {
            limits,
            state: Mutex::default(),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new request's ticket, its deadline `queue_timeout` from now.
    #[must_use]
    pub fn ticket(&self) -> Ticket {
        let mut s = self.lock();
        let id = s.next_ticket;
        s.next_ticket += 1;
        Ticket {
            id,
            deadline: Instant::now() + self.limits.timeout,
            counted: false,
        }
    }

    /// Requests waiting now.
    #[must_use]
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Places held now, and their prompt tokens.
    #[must_use]
    pub fn held(&self) -> (usize, u64) {
        let s = self.lock();
        (s.held, s.tokens)
    }

    /// Waits for a place for a prompt of `tokens`, until the ticket's deadline. `engines`
    /// tells how many engines prefill now (read at every try: engines come and go); with none,
    /// one place is given at a time, so a request still reaches the planner, which answers
    /// that nothing serves it.
    ///
    /// `again`: a request refused for load comes back with the place it held and a pause. It
    /// rejoins at its old turn before giving the place back (so nobody who came later passes
    /// it), and takes no place before the pause is over (so a full fleet is not asked again at
    /// once; those behind it wait too, as they would meet the same full fleet).
    ///
    /// # Errors
    /// [`QueueError::Full`] at once when `max_queued` requests wait already (a ticket's first
    /// wait only), and [`QueueError::TimedOut`] at the deadline.
    pub async fn enter(
        self: &Arc<Self>,
        ticket: &mut Ticket,
        tokens: u64,
        engines: impl Fn() -> usize,
        again: Option<(Place, Duration)>,
    ) -> Result<Place, QueueError> {
        let not_before = again.as_ref().map(|(_, pause)| Instant::now() + *pause);
        {
            let mut s = self.lock();
            if !ticket.counted && s.waiting.len() >= self.limits.max_queued {
                return Err(QueueError::Full(s.waiting.len()));
            }
            ticket.counted = true;
            s.waiting.insert(ticket.id);
        }
        let _waiting = Waiting {
            queue: self,
            id: ticket.id,
        };
        drop(again);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = Instant::now();
            let paused = not_before.is_some_and(|t| now < t);
            if !paused {
                // Read before the lock: the registry's snapshot is not held under it.
                let budget = self
                    .limits
                    .prefill_tokens
                    .saturating_mul(engines().max(1) as u64);
                let mut s = self.lock();
                let head = s.waiting.first() == Some(&ticket.id);
                if head && (s.held == 0 || s.tokens.saturating_add(tokens) <= budget) {
                    s.tokens = s.tokens.saturating_add(tokens);
                    s.held += 1;
                    drop(s);
                    return Ok(Place {
                        queue: Arc::clone(self),
                        tokens,
                    });
                }
            }
            if now >= ticket.deadline {
                return Err(QueueError::TimedOut(self.limits.timeout.as_millis() as u64));
            }
            // Engines that come and go do not notify: look again now and then.
            let mut wake = (ticket.deadline - now).min(Duration::from_millis(250));
            if let Some(t) = not_before.filter(|t| now < *t) {
                wake = wake.min(t - now);
            }
            let _ = tokio::time::timeout(wake, changed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(max_queued: usize, prefill_tokens: u64, timeout_ms: u64) -> Arc<WaitQueue> {
        Arc::new(WaitQueue::new(QueueLimits {
            max_queued,
            prefill_tokens,
            timeout: Duration::from_millis(timeout_ms),
        }))
    }

    /// Yields until `n` requests wait (at most 5 s), instead of sleeping a fixed time.
    async fn until_waiting(q: &WaitQueue, n: usize) {
        let end = Instant::now() + Duration::from_secs(5);
        while q.waiting() != n {
            assert!(Instant::now() < end, "{} waiting, not {n}", q.waiting());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    async fn enter(q: &Arc<WaitQueue>, tokens: u64, engines: usize) -> Result<Place, QueueError> {
        let mut t = q.ticket();
        q.enter(&mut t, tokens, || engines, None).await
    }

    #[tokio::test]
    async fn places_within_the_budget_then_first_come_first_served() {
        let q = queue(8, 100, 5_000);
        let a = enter(&q, 60, 1).await.unwrap();
        // 60 + 60 > 100: the second waits until the first gives its place back.
        let (mut t2, mut t3) = (q.ticket(), q.ticket());
        let q2 = Arc::clone(&q);
        let second =
            tokio::spawn(async move { q2.enter(&mut t2, 60, || 1, None).await.map(|p| p.tokens) });
        let q3 = Arc::clone(&q);
        let third = tokio::spawn(async move {
            // Arrives after the second: may not pass it, even though 30 would fit.
            tokio::time::sleep(Duration::from_millis(20)).await;
            q3.enter(&mut t3, 30, || 1, None).await.map(|p| p.tokens)
        });
        until_waiting(&q, 2).await;
        assert!(!second.is_finished() && !third.is_finished());
        drop(a);
        assert_eq!(second.await.unwrap(), Ok(60));
        assert_eq!(third.await.unwrap(), Ok(30));
        assert_eq!((q.waiting(), q.held()), (0, (0, 0)));
    }

    #[tokio::test]
    async fn one_place_always_fits_and_engines_scale_the_budget() {
        let q = queue(8, 100, 5_000);
        // Longer than the budget: still let in alone.
        let long = enter(&q, 1_000, 1).await.unwrap();
        assert_eq!(q.held(), (1, 1_000));
        drop(long);
        // Two engines: twice the budget.
        let a = enter(&q, 100, 2).await.unwrap();
        let b = enter(&q, 100, 2).await.unwrap();
        assert_eq!(q.held(), (2, 200));
        drop((a, b));
        assert_eq!(q.held(), (0, 0));
    }

    #[tokio::test]
    async fn full_and_timed_out_leave_nothing_held() {
        let q = queue(1, 10, 150);
        let held = enter(&q, 10, 1).await.unwrap();
        let q2 = Arc::clone(&q);
        let waiter = tokio::spawn(async move { enter(&q2, 10, 1).await.map(|_| ()) });
        until_waiting(&q, 1).await;
        // One waits already: a newcomer is refused at once.
        assert_eq!(enter(&q, 10, 1).await.map(|_| ()), Err(QueueError::Full(1)));
        assert_eq!(waiter.await.unwrap(), Err(QueueError::TimedOut(150)));
        assert_eq!((q.waiting(), q.held()), (0, (1, 10)));
        drop(held);
        assert_eq!(q.held(), (0, 0));
    }

    #[tokio::test]
    async fn a_request_back_for_another_try_keeps_its_turn_after_its_pause() {
        let q = queue(1, 10, 5_000);
        let mut first = q.ticket();
        let p = q.enter(&mut first, 10, || 1, None).await.unwrap();
        let mut later = q.ticket();
        let q2 = Arc::clone(&q);
        let waiter =
            tokio::spawn(async move { q2.enter(&mut later, 10, || 1, None).await.map(|_| ()) });
        until_waiting(&q, 1).await;
        // The first was refused for load and comes back with its place and a pause: it is let
        // in although one waits already (max_queued 1), the later one does not pass it while
        // it pauses, and it gets the place after the pause.
        let t0 = Instant::now();
        let again = q
            .enter(&mut first, 10, || 1, Some((p, Duration::from_millis(100))))
            .await;
        assert!(again.is_ok());
        assert!(t0.elapsed() >= Duration::from_millis(100));
        assert!(!waiter.is_finished());
        drop(again);
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert_eq!((q.waiting(), q.held()), (0, (0, 0)));
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_queue() {
        let q = queue(4, 10, 5_000);
        let held = enter(&q, 10, 1).await.unwrap();
        let gone = tokio::time::timeout(Duration::from_millis(50), enter(&q, 10, 1)).await;
        assert!(gone.is_err());
        assert_eq!(q.waiting(), 0);
        // The next one is at the head, not stuck behind the gone ticket.
        drop(held);
        assert!(enter(&q, 10, 1).await.is_ok());
    }
}
