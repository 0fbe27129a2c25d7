//! Load accounting: the requests this gateway has sent each decode engine and not yet finished.
//! Heartbeats report an engine's load only every `heartbeat_ms`; between beats the route planner
//! adds these counts, so a burst does not all land on the engine that looked idle.

use super::worker::WorkerId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Requests in flight per worker id.
#[derive(Debug, Default)]
pub struct RoutedLoad(Mutex<HashMap<WorkerId, u32>>);

impl RoutedLoad {
    fn lock(&self) -> MutexGuard<'_, HashMap<WorkerId, u32>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts one request on `worker` for as long as the guard lives, whichever way the request
    /// ends (a timeout drops it mid-way).
    #[must_use]
    pub fn enter(self: &Arc<Self>, worker: WorkerId) -> RoutedGuard {
        *self.lock().entry(worker.clone()).or_insert(0) += 1;
        RoutedGuard {
            counts: Arc::clone(self),
            worker,
        }
    }

    /// Requests in flight on `worker`.
    #[must_use]
    pub fn on(&self, worker: &str) -> u32 {
        self.lock().get(worker).copied().unwrap_or(0)
    }

    /// Every count, for the planner.
    #[must_use]
    pub fn snapshot(&self) -> HashMap<WorkerId, u32> {
        self.lock().clone()
    }
}

/// One request counted on one worker.
#[derive(Debug)]
pub struct RoutedGuard {
    counts: Arc<RoutedLoad>,
    worker: WorkerId,
}

impl Drop for RoutedGuard {
    fn drop(&mut self) {
        let mut m = self.counts.lock();
        if let Some(n) = m.get_mut(&self.worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.worker);
            }
        }
    }
}
