//! Places on the prep pool (templates and tokenizing), shared fairly between tenants: a freed
//! place goes to the next tenant in turn that has a request waiting (round robin over tenants,
//! first come first served within one), not to the oldest request overall. A tenant with 32
//! requests waiting takes every other place at most while one other tenant waits, so that
//! tenant's request waits behind at most one prep per other waiting tenant, whatever the flood.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

/// The places.
#[derive(Debug)]
pub struct FairPlaces {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    free: usize,
    /// Tenants with requests waiting, in turn order.
    turn: VecDeque<Vec<u8>>,
    /// Each waiting tenant's requests, oldest first.
    waiting: HashMap<Vec<u8>, VecDeque<oneshot::Sender<()>>>,
}

impl Inner {
    /// Gives a place that just came free to the next waiting request in turn (one whose
    /// receiver is still there), or back to the free count.
    fn hand_over(&mut self) {
        while let Some(tenant) = self.turn.pop_front() {
            let Some(q) = self.waiting.get_mut(&tenant) else {
                continue;
            };
            let next = q.pop_front();
            if q.is_empty() {
                self.waiting.remove(&tenant);
            } else {
                self.turn.push_back(tenant);
            }
            if let Some(tx) = next
                && tx.send(()).is_ok()
            {
                return;
            }
        }
        self.free += 1;
    }
}

/// A held place; dropping it hands it on.
#[derive(Debug)]
pub struct Place {
    inner: Arc<Mutex<Inner>>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .hand_over();
    }
}

/// A request waiting for a place: if it is given up (its request timed out or left) after a
/// place was handed to it, the place goes on to the next in turn.
struct Waiting {
    rx: oneshot::Receiver<()>,
    inner: Arc<Mutex<Inner>>,
    done: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.rx.close();
        if self.rx.try_recv().is_ok() {
            self.inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .hand_over();
        }
    }
}

impl FairPlaces {
    /// `n` places (at least one).
    #[must_use]
    pub fn new(n: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                free: n.max(1),
                ..Inner::default()
            })),
        }
    }

    /// A place for a request of `tenant`: at once when one is free and nobody waits, else at
    /// this tenant's turn. Cancel-safe: dropping the future gives up the place or the turn.
    pub async fn acquire(&self, tenant: &[u8]) -> Place {
        let rx = {
            let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            if g.free > 0 && g.turn.is_empty() {
                g.free -= 1;
                return Place {
                    inner: Arc::clone(&self.inner),
                };
            }
            let (tx, rx) = oneshot::channel();
            match g.waiting.get_mut(tenant) {
                Some(q) => q.push_back(tx),
                None => {
                    g.waiting.insert(tenant.to_vec(), VecDeque::from([tx]));
                    g.turn.push_back(tenant.to_vec());
                }
            }
            rx
        };
        let mut w = Waiting {
            rx,
            inner: Arc::clone(&self.inner),
            done: false,
        };
        // The sender is only dropped unsent by `hand_over` after a failed send, which cannot
        // happen while this receiver lives; so this always receives.
        let _ = (&mut w.rx).await;
        w.done = true;
        Place {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Requests waiting for a place (those given up included, until their turn comes).
    #[must_use]
    pub fn waiting(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .waiting
            .values()
            .map(VecDeque::len)
            .sum()
    }

    /// Places free now.
    #[must_use]
    pub fn free(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .free
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// One place; tenant A queues eight requests, then B one: B's is served second (right
    /// after the place A holds now), not ninth.
    #[tokio::test]
    async fn a_flooding_tenant_takes_turns_with_another() {
        let places = Arc::new(FairPlaces::new(1));
        let held = places.acquire(b"a").await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        let mut spawn = |tenant: &'static [u8], tag: &'static str| {
            let (places, order) = (Arc::clone(&places), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let _p = places.acquire(tenant).await;
                order.lock().unwrap().push(tag);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }));
        };
        // Waits (with a deadline) until `n` requests are queued.
        let queued = |n: usize| {
            let places = Arc::clone(&places);
            async move {
                let until = tokio::time::Instant::now() + Duration::from_secs(10);
                while places.waiting() < n {
                    assert!(tokio::time::Instant::now() < until, "never {n} queued");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        for _ in 0..8 {
            spawn(b"a", "a");
        }
        queued(8).await;
        spawn(b"b", "b");
        queued(9).await;
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(order.len(), 9);
        assert_eq!(order.iter().position(|t| *t == "b"), Some(1), "{order:?}");
        assert_eq!(places.free(), 1, "every place came back");
    }

    /// A request that gives up while waiting, or just after its place was handed to it, does
    /// not take the place with it.
    #[tokio::test]
    async fn a_request_that_gives_up_leaves_its_place() {
        let places = Arc::new(FairPlaces::new(1));
        let held = places.acquire(b"a").await;
        // Gives up while waiting.
        let gone = tokio::time::timeout(Duration::from_millis(10), places.acquire(b"b")).await;
        assert!(gone.is_err());
        // Handed a place and dropped before it looked.
        let mut late = Box::pin(places.acquire(b"c"));
        assert!(futures_poll_once(&mut late).await.is_none());
        drop(held);
        drop(late);
        assert_eq!(places.free(), 1);
        let _again = tokio::time::timeout(Duration::from_millis(100), places.acquire(b"d"))
            .await
            .expect("the place is free again");
    }

    /// Polls `f` once.
    async fn futures_poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut *f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
