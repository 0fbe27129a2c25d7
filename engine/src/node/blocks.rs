//! `EngineControl.WatchBlocks`: a decode engine's prefix index as a stream, so gateways route
//! from their own copy of it instead of asking every engine HasBlocks per request.
//!
//! The pool tells the [`BlockFeed`] of every index change under its lock; the feed numbers
//! them and broadcasts them. A subscriber takes, under that same lock, the index's keys, the
//! number of the last change, and its receiver: so the snapshot and the changes after it meet
//! exactly. The broadcast holds the last [`BACKLOG`] changes; a subscriber that falls further
//! behind loses some, and the next message's `seq` shows the gap to the watcher, which
//! subscribes again for a new snapshot.
//!
//! What one watcher can take is bounded: at most `max_watchers` streams at once
//! (RESOURCE_EXHAUSTED beyond), a fixed backlog whatever it reads, a few messages queued for its
//! connection, and a stream that has not taken a message for `idle` ends (DEADLINE_EXCEEDED).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvwire_grpc::pb::engine::{BlockChange, BlockEvents};
use tl_engine_core::pool::SharedKv;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

/// Changes kept for subscribers that are behind.
pub const BACKLOG: usize = 16_384;

/// Changes in one message at most: snapshots are cut into parts this long (each part about
/// 24 bytes a change, well under the 1 MiB small-message bound).
pub const MAX_CHANGES_PER_MESSAGE: usize = 16_384;

/// One numbered change.
#[derive(Clone, Copy, Debug)]
struct Numbered {
    seq: u64,
    change: BlockChange,
}

/// The index changes of one engine's pool, for its WatchBlocks subscribers.
#[derive(Debug)]
pub struct BlockFeed {
    worker_id: String,
    epoch: u64,
    pool: SharedKv,
    tx: broadcast::Sender<Numbered>,
    /// The number of the last change published (0: none yet). Written under the pool's lock.
    seq: Arc<AtomicU64>,
    watchers: Arc<Semaphore>,
    idle: Duration,
}

impl BlockFeed {
    /// Attaches a feed to `pool` (replacing any earlier observer): from now on every change to
    /// its index is numbered and broadcast. At most `max_watchers` streams at once; a stream
    /// whose watcher takes nothing for `idle` ends.
    #[must_use]
    pub fn attach(pool: &SharedKv, worker_id: &str, max_watchers: usize, idle: Duration) -> Self {
        let (tx, _) = broadcast::channel(BACKLOG);
        let seq = Arc::new(AtomicU64::new(0));
        {
            let (tx, seq) = (tx.clone(), Arc::clone(&seq));
            pool.lock()
                .set_observer(Box::new(move |cache_scope, hash, stored| {
                    // Under the pool's lock: numbering and sending are in the index's order.
                    let n = seq.fetch_add(1, Ordering::Relaxed) + 1;
                    // No receiver: nobody watches; the change is still counted.
                    let _ = tx.send(Numbered {
                        seq: n,
                        change: BlockChange {
                            cache_scope,
                            hash,
                            stored,
                        },
                    });
                }));
        }
        // Random per process: a restarted engine is told apart by it.
        let epoch = u64::from_str_radix(&crate::net::tls::random_hex::<8>(), 16).unwrap_or(1);
        Self {
            worker_id: worker_id.to_owned(),
            epoch: epoch.max(1),
            pool: pool.clone(),
            tx,
            seq,
            watchers: Arc::new(Semaphore::new(max_watchers.max(1))),
            idle,
        }
    }

    /// This process's epoch.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The number of the last change so far.
    #[must_use]
    pub fn seq(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// A new subscription: the snapshot as messages, then every change after it.
    ///
    /// # Errors
    /// RESOURCE_EXHAUSTED when `max_watchers` streams are open.
    pub fn subscribe(&self) -> Result<ReceiverStream<Result<BlockEvents, Status>>, Status> {
        let permit = Arc::clone(&self.watchers)
            .try_acquire_owned()
            .map_err(|_| {
                Status::resource_exhausted("WatchBlocks: too many watchers on this engine")
            })?;
        let (keys, seq, rx) = {
            let pool = self.pool.lock();
            (pool.index_keys(), self.seq(), self.tx.subscribe())
        };
        let (out, stream) = mpsc::channel(4);
        let head = Head {
            epoch: self.epoch,
            worker_id: self.worker_id.clone(),
        };
        tokio::spawn(forward(head, keys, seq, rx, out, self.idle, permit));
        Ok(ReceiverStream::new(stream))
    }
}

/// What every message of one stream carries.
struct Head {
    epoch: u64,
    worker_id: String,
}

impl Head {
    fn message(&self, snapshot: bool, seq: u64, changes: Vec<BlockChange>) -> BlockEvents {
        BlockEvents {
            epoch: self.epoch,
            snapshot,
            seq,
            changes,
            worker_id: self.worker_id.clone(),
            more: false,
        }
    }
}

/// Sends the snapshot in parts, then the changes in batches, until the watcher goes, stops
/// reading for `idle`, or the engine's feed ends. Holds `_permit` (a watcher slot) as long.
async fn forward(
    head: Head,
    keys: Vec<(u64, u64)>,
    seq: u64,
    mut rx: broadcast::Receiver<Numbered>,
    out: mpsc::Sender<Result<BlockEvents, Status>>,
    idle: Duration,
    _permit: OwnedSemaphorePermit,
) {
    let send = |m: Result<BlockEvents, Status>| {
        let out = out.clone();
        async move { matches!(tokio::time::timeout(idle, out.send(m)).await, Ok(Ok(()))) }
    };
    let mut parts: Vec<Vec<BlockChange>> = keys
        .chunks(MAX_CHANGES_PER_MESSAGE)
        .map(|c| {
            c.iter()
                .map(|&(cache_scope, hash)| BlockChange {
                    cache_scope,
                    hash,
                    stored: true,
                })
                .collect()
        })
        .collect();
    if parts.is_empty() {
        parts.push(Vec::new());
    }
    let last = parts.len() - 1;
    for (i, changes) in parts.into_iter().enumerate() {
        let mut m = head.message(true, seq, changes);
        m.more = i < last;
        if !send(Ok(m)).await {
            return;
        }
    }
    // A change read ahead that does not follow the batch before it (after a loss).
    let mut carry: Option<Numbered> = None;
    loop {
        let first = match carry.take() {
            Some(n) => n,
            None => {
                let got = tokio::select! {
                    got = rx.recv() => got,
                    // The watcher went while nothing changed: give its slot back now.
                    () = out.closed() => return,
                };
                match got {
                    Ok(n) => n,
                    // Changes were lost to this watcher: the next one's number shows the gap.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        };
        let mut changes = vec![first.change];
        let mut next = first.seq + 1;
        while changes.len() < MAX_CHANGES_PER_MESSAGE {
            match rx.try_recv() {
                Ok(n) if n.seq == next => {
                    changes.push(n.change);
                    next += 1;
                }
                Ok(n) => {
                    carry = Some(n);
                    break;
                }
                Err(_) => break,
            }
        }
        if !send(Ok(head.message(false, first.seq, changes))).await {
            // The watcher stopped reading for `idle`, or went.
            let _ = out.try_send(Err(Status::deadline_exceeded(
                "WatchBlocks: the watcher took nothing for too long",
            )));
            return;
        }
    }
}
