//! The gateway's prefix index: which decode engine holds which block, kept from each engine's
//! WatchBlocks stream, so routing asks no engine anything.
//!
//! Per engine the index knows the stream's epoch and the next change number it expects. A
//! snapshot replaces what it knew; a batch applies in order. A number other than the expected
//! one (the engine dropped changes this gateway was too slow for), another epoch (a restarted
//! engine), a stream that breaks, or an engine that lists more blocks than the bound: the
//! engine's entries are dropped, it is *unsynced*, and routing asks it HasBlocks (the fallback)
//! until a new snapshot lands. The index is a hint: the prefill engine still asks HasBlocks
//! once before it pushes, so a stale entry costs a worse route, never a wrong answer.
//!
//! Keys are `(cache_scope, hash)`: a tenant's prompt only ever matches its own scope's blocks.

use super::worker::WorkerId;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvwire_grpc::pb::control::WorkerStatus;
use kvwire_grpc::pb::engine::BlockEvents;
use tokio_util::sync::CancellationToken;

use super::upstream::Upstream;

/// Blocks one engine may list in a gateway's index; beyond, it is routed by HasBlocks.
pub const MAX_BLOCKS_PER_ENGINE: usize = 1 << 20;

/// Largest WatchBlocks message a gateway reads (a snapshot part of 16,384 changes is ~400 KiB).
pub const MAX_MESSAGE: usize = 1 << 20;

type Key = (u64, u64);

#[derive(Debug, Default)]
struct Engine {
    epoch: u64,
    /// The next change number expected.
    next: u64,
    /// A snapshot is complete and every change since applied.
    synced: bool,
    /// A snapshot's parts are arriving.
    loading: bool,
    keys: HashSet<Key>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Counts every change of an engine's synced state (a route planner that checked every
    /// engine synced at one generation need not check again until the next).
    generation: u64,
    engines: HashMap<WorkerId, Engine>,
    /// Engines holding each key, by worker id.
    holders: HashMap<Key, Vec<Arc<str>>>,
}

impl Inner {
    fn clear(&mut self, worker: &str) {
        let Some(e) = self.engines.get_mut(worker) else {
            return;
        };
        self.generation += 1;
        for k in e.keys.drain() {
            if let Some(h) = self.holders.get_mut(&k) {
                h.retain(|w| &**w != worker);
                if h.is_empty() {
                    self.holders.remove(&k);
                }
            }
        }
        e.synced = false;
        e.loading = false;
    }
}

/// What [`BlockIndex::apply`] made of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// In order: the index follows the engine.
    Ok,
    /// Out of order, another epoch, or a batch before any snapshot: the engine is unsynced and
    /// the watcher must subscribe again.
    Gap,
    /// More blocks than the engine's pool holds (or [`MAX_BLOCKS_PER_ENGINE`]): unsynced,
    /// routed by HasBlocks.
    TooLarge,
}

/// Decode engines' blocks, as their streams told this gateway.
#[derive(Debug, Default)]
pub struct BlockIndex {
    inner: Mutex<Inner>,
}

impl BlockIndex {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies one message of `worker`'s stream, at most [`MAX_BLOCKS_PER_ENGINE`] blocks.
    pub fn apply(&self, worker: &WorkerId, m: &BlockEvents) -> Applied {
        self.apply_within(worker, m, MAX_BLOCKS_PER_ENGINE)
    }

    /// [`apply`](Self::apply) with at most `cap` blocks listed for `worker` (its pool's size:
    /// an engine cannot index more blocks than it has, so one that lists more is lying).
    pub fn apply_within(&self, id: &WorkerId, m: &BlockEvents, cap: usize) -> Applied {
        let worker = id.as_str();
        let mut g = self.lock();
        let inner = &mut *g;
        let e = inner.engines.entry(id.clone()).or_default();
        let fresh = m.snapshot && !e.loading;
        let continues = m.snapshot && e.loading && m.epoch == e.epoch && m.seq + 1 == e.next;
        let follows = !m.snapshot && e.synced && m.epoch == e.epoch && m.seq == e.next;
        if !(fresh || continues || follows) {
            inner.clear(worker);
            return Applied::Gap;
        }
        if fresh {
            inner.clear(worker);
        }
        let e = inner
            .engines
            .get_mut(worker)
            .expect("the entry was made above");
        let who: Arc<str> = Arc::from(worker);
        for c in &m.changes {
            let k = (c.cache_scope, c.hash);
            if c.stored {
                if e.keys.insert(k) {
                    inner.holders.entry(k).or_default().push(Arc::clone(&who));
                }
            } else if e.keys.remove(&k)
                && let Some(h) = inner.holders.get_mut(&k)
            {
                h.retain(|w| &**w != worker);
                if h.is_empty() {
                    inner.holders.remove(&k);
                }
            }
        }
        if e.keys.len() > cap.min(MAX_BLOCKS_PER_ENGINE) {
            inner.clear(worker);
            return Applied::TooLarge;
        }
        let e = inner
            .engines
            .get_mut(worker)
            .expect("the entry was made above");
        e.epoch = m.epoch;
        if m.snapshot {
            e.next = m.seq + 1;
            e.loading = m.more;
            e.synced = !m.more;
            inner.generation += 1;
        } else {
            e.next = m.seq + m.changes.len() as u64;
        }
        Applied::Ok
    }

    /// Drops what is known of `worker` until its next snapshot (its stream broke).
    pub fn unsync(&self, worker: &WorkerId) {
        self.lock().clear(worker.as_str());
    }

    /// Forgets `worker` (it left the registry).
    pub fn forget(&self, worker: &WorkerId) {
        let mut g = self.lock();
        g.clear(worker.as_str());
        g.engines.remove(worker);
    }

    /// The generation of the engines' synced states (see [`BlockIndex::all_synced`]).
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Whether every engine of `workers` is synced, and the generation that holds for.
    #[must_use]
    pub fn all_synced<'a>(&self, mut workers: impl Iterator<Item = &'a str>) -> (bool, u64) {
        let g = self.lock();
        let all = workers.all(|w| g.engines.get(w).is_some_and(|e| e.synced));
        (all, g.generation)
    }

    /// The synced engines holding the leading blocks of a prompt of chained hashes `hashes` in
    /// `scope`, each with how many (at least one). The work is in the blocks held.
    #[must_use]
    pub fn hits(&self, scope: u64, hashes: &[u64]) -> Vec<(Arc<str>, usize)> {
        let g = self.lock();
        let mut out: Vec<(Arc<str>, usize)> = Vec::new();
        let Some(first) = hashes.first().and_then(|h| g.holders.get(&(scope, *h))) else {
            return out;
        };
        let mut live: Vec<Arc<str>> = first
            .iter()
            .filter(|w| g.engines.get(&***w).is_some_and(|e| e.synced))
            .cloned()
            .collect();
        for (i, h) in hashes.iter().enumerate().skip(1) {
            let holders = g.holders.get(&(scope, *h));
            let (stay, gone): (Vec<Arc<str>>, Vec<Arc<str>>) = live
                .into_iter()
                .partition(|w| holders.is_some_and(|hs| hs.iter().any(|x| x == w)));
            out.extend(gone.into_iter().map(|w| (w, i)));
            live = stay;
            if live.is_empty() {
                break;
            }
        }
        out.extend(live.into_iter().map(|w| (w, hashes.len())));
        out
    }

    /// Whether `worker`'s stream is followed now.
    #[must_use]
    pub fn synced(&self, worker: &str) -> bool {
        self.lock().engines.get(worker).is_some_and(|e| e.synced)
    }

    /// Every `(scope, hash)` the index lists for `worker`, sorted (tests compare it with the
    /// engine's own index).
    #[must_use]
    pub fn keys_of(&self, worker: &str) -> Vec<(u64, u64)> {
        let mut v: Vec<Key> = self
            .lock()
            .engines
            .get(worker)
            .map(|e| e.keys.iter().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// For a prompt of chained block hashes `hashes` in `scope`: the leading blocks each
    /// engine of `engines` holds, for the synced ones; the others are returned apart, to be
    /// asked HasBlocks. The work is in the blocks held, not in the number of engines.
    #[must_use]
    pub fn prefixes<'a>(
        &self,
        scope: u64,
        hashes: &[u64],
        engines: &[&'a str],
    ) -> (HashMap<WorkerId, usize>, Vec<&'a str>) {
        let g = self.lock();
        let mut counts = HashMap::new();
        let mut unsynced = Vec::new();
        for &w in engines {
            if g.engines.get(w).is_some_and(|e| e.synced) {
                counts.insert(WorkerId::new(w.to_owned()), 0);
            } else {
                unsynced.push(w);
            }
        }
        // Engines still matching after i blocks.
        let mut live: Vec<Arc<str>> = match hashes.first().and_then(|h| g.holders.get(&(scope, *h)))
        {
            Some(h) => h
                .iter()
                .filter(|w| counts.contains_key(&***w))
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        for (i, h) in hashes.iter().enumerate() {
            if live.is_empty() {
                break;
            }
            if i > 0 {
                let holders = g.holders.get(&(scope, *h));
                live.retain(|w| holders.is_some_and(|hs| hs.iter().any(|x| x == w)));
            }
            for w in &live {
                if let Some(c) = counts.get_mut(&**w) {
                    *c = i + 1;
                }
            }
        }
        (counts, unsynced)
    }
}

/// Follows every live decode engine's WatchBlocks stream into `index` until `stop`: a stream
/// for each engine the registry lists, ended when it leaves. `workers` is polled every
/// `every` for the engines to follow.
pub async fn follow(
    index: Arc<BlockIndex>,
    upstream: Arc<Upstream>,
    workers: impl Fn() -> Vec<WorkerStatus> + Send + 'static,
    every: Duration,
    stop: CancellationToken,
) {
    // worker id -> (the address followed, its task's token)
    let mut followed: HashMap<WorkerId, (String, CancellationToken)> = HashMap::new();
    loop {
        let all = workers();
        let live: HashMap<WorkerId, String> = all
            .iter()
            .filter(|w| !w.kv_address.is_empty() && !w.grpc_address.is_empty())
            .map(|w| (WorkerId::of(w), w.grpc_address.clone()))
            .collect();
        let pools: HashMap<&str, usize> = all
            .iter()
            .map(|w| (w.worker_id.as_str(), w.total_blocks as usize))
            .collect();
        followed.retain(|id, (addr, token)| {
            let keep = live.get(id) == Some(addr);
            if !keep {
                token.cancel();
                index.forget(id);
            }
            keep
        });
        for (id, addr) in live {
            if followed.contains_key(&id) {
                continue;
            }
            let token = stop.child_token();
            // 0: not reported; the gateway's own bound then.
            let cap = match pools.get(id.as_str()) {
                Some(&n) if n > 0 => n,
                _ => MAX_BLOCKS_PER_ENGINE,
            };
            tokio::spawn(watch_one(
                Arc::clone(&index),
                Arc::clone(&upstream),
                (id.clone(), addr.clone(), cap),
                token.clone(),
            ));
            followed.insert(id, (addr, token));
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(every) => {}
        }
    }
    for (id, (_, token)) in followed {
        token.cancel();
        index.forget(&id);
    }
}

/// One engine's stream, subscribed again (after 100 ms, doubling to 2 s while it fails) each
/// time it breaks or shows a gap.
async fn watch_one(
    index: Arc<BlockIndex>,
    upstream: Arc<Upstream>,
    (id, addr, cap): (WorkerId, String, usize),
    stop: CancellationToken,
) {
    const FIRST: Duration = Duration::from_millis(100);
    let mut backoff = FIRST;
    while !stop.is_cancelled() {
        let watched = async {
            let mut stream = upstream.control(&addr)?.watch_blocks(MAX_MESSAGE).await?;
            while let Some(m) = stream.message().await? {
                match index.apply_within(&id, &m, cap) {
                    Applied::Ok => backoff = FIRST,
                    Applied::Gap => return Ok::<_, tonic::Status>(()),
                    Applied::TooLarge => {
                        backoff = Duration::from_secs(30);
                        return Ok(());
                    }
                }
            }
            Ok(())
        };
        let ended = tokio::select! {
            () = stop.cancelled() => break,
            r = watched => r,
        };
        index.unsync(&id);
        if let Err(s) = ended {
            tracing::debug!(worker = %id, code = ?s.code(), error = %s.message(), "WatchBlocks ended");
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2).max(backoff));
    }
    index.unsync(&id);
}

#[cfg(test)]
mod tests {
    use kvwire_grpc::pb::engine::BlockChange;

    use super::*;

    fn msg(epoch: u64, snapshot: bool, seq: u64, changes: &[(u64, bool)]) -> BlockEvents {
        BlockEvents {
            epoch,
            snapshot,
            seq,
            changes: changes
                .iter()
                .map(|&(hash, stored)| BlockChange {
                    cache_scope: 0,
                    hash,
                    stored,
                })
                .collect(),
            worker_id: "D".into(),
            more: false,
        }
    }

    #[test]
    fn snapshots_batches_and_gaps() {
        let ix = BlockIndex::default();
        let d = ["D"];
        // A batch before any snapshot is a gap.
        assert_eq!(
            ix.apply(&WorkerId::new("D".into()), &msg(1, false, 1, &[(5, true)])),
            Applied::Gap
        );
        assert!(!ix.synced("D"));
        assert_eq!(
            ix.apply(
                &WorkerId::new("D".into()),
                &msg(1, true, 3, &[(5, true), (6, true)])
            ),
            Applied::Ok
        );
        assert!(ix.synced("D"));
        // 5 then 6 chain: two leading blocks; 7 is not held.
        assert_eq!(ix.prefixes(0, &[5, 6, 7], &d).0["D"], 2);
        // Another scope sees nothing.
        assert_eq!(ix.prefixes(9, &[5, 6], &d).0["D"], 0);
        assert_eq!(
            ix.apply(
                &WorkerId::new("D".into()),
                &msg(1, false, 4, &[(5, false), (7, true)])
            ),
            Applied::Ok
        );
        assert_eq!(ix.keys_of("D"), [(0, 6), (0, 7)]);
        assert_eq!(ix.prefixes(0, &[5, 6, 7], &d).0["D"], 0);
        // Change 6 was expected; 7 is a gap: unsynced, nothing kept, asked HasBlocks.
        assert_eq!(
            ix.apply(&WorkerId::new("D".into()), &msg(1, false, 7, &[(8, true)])),
            Applied::Gap
        );
        assert!(ix.keys_of("D").is_empty());
        assert_eq!(ix.prefixes(0, &[6], &d).1, ["D"]);
        // Another epoch (a restart) starts over from its snapshot.
        assert_eq!(
            ix.apply(&WorkerId::new("D".into()), &msg(2, true, 0, &[])),
            Applied::Ok
        );
        assert_eq!(
            ix.apply(&WorkerId::new("D".into()), &msg(1, false, 1, &[(8, true)])),
            Applied::Gap
        );
    }

    #[test]
    fn a_snapshot_in_parts_is_synced_at_its_last_part() {
        let ix = BlockIndex::default();
        let mut first = msg(1, true, 10, &[(1, true)]);
        first.more = true;
        assert_eq!(ix.apply(&WorkerId::new("D".into()), &first), Applied::Ok);
        assert!(!ix.synced("D"));
        assert_eq!(
            ix.apply(&WorkerId::new("D".into()), &msg(1, true, 10, &[(2, true)])),
            Applied::Ok
        );
        assert!(ix.synced("D"));
        assert_eq!(ix.keys_of("D"), [(0, 1), (0, 2)]);
        assert_eq!(
            ix.apply(&WorkerId::new("D".into()), &msg(1, false, 11, &[(3, true)])),
            Applied::Ok
        );
        assert_eq!(ix.keys_of("D").len(), 3);
    }

    #[test]
    fn hits_list_the_synced_holders_with_their_prefix() {
        let ix = BlockIndex::default();
        ix.apply(
            &WorkerId::new("A".into()),
            &msg(1, true, 0, &[(1, true), (2, true), (3, true)]),
        );
        ix.apply(
            &WorkerId::new("B".into()),
            &msg(1, true, 0, &[(1, true), (3, true)]),
        );
        let mut loading = msg(1, true, 0, &[(1, true)]);
        loading.more = true;
        ix.apply(&WorkerId::new("C".into()), &loading);
        let mut h = ix.hits(0, &[1, 2, 3]);
        h.sort();
        assert_eq!(h, [(Arc::from("A"), 3), (Arc::from("B"), 1)]);
        assert!(ix.hits(0, &[9]).is_empty() && ix.hits(5, &[1]).is_empty());
        let (all, g) = ix.all_synced(["A", "B"].into_iter());
        assert!(all);
        assert!(!ix.all_synced(["A", "C"].into_iter()).0);
        ix.unsync(&WorkerId::new("B".into()));
        assert!(ix.generation() > g);
    }

    #[test]
    fn an_engine_listing_more_blocks_than_its_pool_is_dropped() {
        let ix = BlockIndex::default();
        let three = [(1, true), (2, true), (3, true)];
        assert_eq!(
            ix.apply_within(&WorkerId::new("D".into()), &msg(1, true, 0, &three), 2),
            Applied::TooLarge
        );
        assert!(!ix.synced("D") && ix.keys_of("D").is_empty());
        assert_eq!(
            ix.apply_within(&WorkerId::new("D".into()), &msg(1, true, 0, &three), 3),
            Applied::Ok
        );
        // A batch that grows it past the pool drops it as well.
        assert_eq!(
            ix.apply_within(
                &WorkerId::new("D".into()),
                &msg(1, false, 1, &[(4, true)]),
                3
            ),
            Applied::TooLarge
        );
        assert!(ix.keys_of("D").is_empty());
    }

    #[test]
    fn prefixes_count_per_engine_and_forget_drops_an_engine() {
        let ix = BlockIndex::default();
        ix.apply(
            &WorkerId::new("A".into()),
            &msg(1, true, 0, &[(1, true), (2, true), (3, true)]),
        );
        ix.apply(
            &WorkerId::new("B".into()),
            &msg(1, true, 0, &[(1, true), (3, true)]),
        );
        let (c, rest) = ix.prefixes(0, &[1, 2, 3], &["A", "B", "C"]);
        assert_eq!((c["A"], c["B"]), (3, 1));
        assert_eq!(rest, ["C"]);
        ix.forget(&WorkerId::new("A".into()));
        let (c, rest) = ix.prefixes(0, &[1, 2, 3], &["A", "B"]);
        assert_eq!((c.get("A"), c["B"]), (None, 1));
        assert_eq!(rest, ["A"]);
    }
}
