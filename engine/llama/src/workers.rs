//! The threads a model's products run on: started once with the model and kept, so a decode
//! step's two hundred products pay no thread start. A forward pass runs on one of them
//! ([`Workers::run`]); between products the others spin a moment before they sleep, and the
//! pass's own thread takes a share of each product instead of sleeping while it waits.

/// A model's compute threads.
pub struct Workers {
    threads: usize,
    pool: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Workers {
    /// `threads` kept compute threads. When they cannot be started, every share runs on the
    /// caller.
    #[must_use]
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let pool = (threads > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("tl-compute-{i}"))
                    .build()
                    .ok()
            })
            .flatten();
        let threads = if pool.is_some() { threads } else { 1 };
        Self { threads, pool }
    }

    /// Threads a product is split over.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on one of the kept threads, so that the products it makes hand their shares
    /// to the others without a sleep and a wake-up each.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) if pool.current_thread_index().is_none() => pool.install(f),
            _ => f(),
        }
    }

    /// Runs `job` on every part of `parts`, the first on the calling thread and the others on
    /// the kept threads, and returns when all are done. A part's result never depends on which
    /// thread ran it.
    pub fn each<T: Send, F: Fn(T) + Sync>(&self, parts: Vec<T>, job: F) {
        let Some(pool) = &self.pool else {
            parts.into_iter().for_each(job);
            return;
        };
        self.run(|| {
            let mut parts = parts.into_iter();
            let Some(first) = parts.next() else {
                return;
            };
            debug_assert!(pool.current_thread_index().is_some());
            rayon::in_place_scope(|s| {
                let job = &job;
                for p in parts {
                    s.spawn(move |_| job(p));
                }
                job(first);
            });
        });
    }
}
