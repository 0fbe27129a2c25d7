//! A lane of threads for the receiver's bulk work: checking and copying a pushed block into the
//! store. Running that work on threads of its own, rather than on the async workers that also
//! answer HasBlocks and the engine's control calls, lets an engine give those threads a lower
//! scheduling priority (a `nice` value set in [`ImportLane::with_thread_start`]), so a control
//! call that wakes while a 2 MiB import holds a core is scheduled ahead of the import.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send>;

/// Dedicated import threads fed from one queue. Each push has at most one import in the lane at
/// a time (its chunks are imported in order), so the queue holds at most one job per push in
/// flight, which the receiver bounds. Cloning shares the same threads; they end when the last
/// clone is dropped and the queue has drained.
#[derive(Clone, Debug)]
pub struct ImportLane {
    tx: mpsc::Sender<Job>,
    threads: usize,
}

impl ImportLane {
    /// A lane of `threads` threads (at least one) named `name-N`.
    ///
    /// # Errors
    /// When a thread cannot be spawned.
    pub fn new(name: &str, threads: usize) -> std::io::Result<Self> {
        Self::with_thread_start(name, threads, || {})
    }

    /// A lane whose threads each run `start` first (to lower their priority, pin them, name
    /// them to a profiler).
    ///
    /// # Errors
    /// When a thread cannot be spawned.
    pub fn with_thread_start(
        name: &str,
        threads: usize,
        start: impl Fn() + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let start = Arc::new(start);
        for i in 0..threads {
            let (rx, start) = (Arc::clone(&rx), Arc::clone(&start));
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    start();
                    loop {
                        // The lock is held only while waiting for the next job.
                        let job = rx
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return, // every sender is gone
                        }
                    }
                })?;
        }
        Ok(Self { tx, threads })
    }

    /// Threads of the lane.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on a lane thread and waits for its result without holding an async worker.
    /// When the caller stops waiting (a cancelled call), `f` still runs to its end and its
    /// result is dropped on the lane thread, so whatever `f` owns is undone there.
    ///
    /// # Errors
    /// When the lane's threads are gone (`f` then never ran, and is dropped).
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, LaneClosed> {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = done.send(f());
        });
        // An unbounded queue's send never blocks the async worker.
        self.tx.send(job).map_err(|_| LaneClosed)?;
        result.await.map_err(|_| LaneClosed)
    }
}

/// The lane's threads have ended (one panicked, or the process is stopping).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the import lane's threads have stopped")]
pub struct LaneClosed;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn runs_jobs_on_its_own_threads_after_the_start_hook() {
        let started = Arc::new(AtomicUsize::new(0));
        let s = Arc::clone(&started);
        let lane = ImportLane::with_thread_start("lane-test", 2, move || {
            s.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let name = lane
            .run(|| std::thread::current().name().map(str::to_owned))
            .await
            .unwrap();
        assert!(name.is_some_and(|n| n.starts_with("lane-test-")));
        assert_eq!(lane.run(|| 6 * 7).await, Ok(42));
        // Each thread runs the hook once, before its first job (the second may still be
        // starting).
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while started.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < end {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(started.load(Ordering::SeqCst), 2);
        assert_eq!(lane.threads(), 2);
    }

    #[tokio::test]
    async fn a_job_whose_caller_stopped_waiting_still_runs_and_drops_its_state_there() {
        struct Undo(Arc<AtomicUsize>);
        impl Drop for Undo {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let lane = ImportLane::new("lane-cancel", 1).unwrap();
        let undone = Arc::new(AtomicUsize::new(0));
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let state = Undo(Arc::clone(&undone));
        let call = lane.run(move || {
            let _ = wait.recv();
            state
        });
        // Polled once (the job is queued), then dropped: the caller is gone.
        let mut call = Box::pin(call);
        assert!(futures_poll_once(&mut call).await.is_none());
        drop(call);
        go.send(()).unwrap();
        // The next job runs after the first, so the first's result has been dropped by then.
        lane.run(|| ()).await.unwrap();
        assert_eq!(undone.load(Ordering::SeqCst), 1);
    }

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
