//! The block pool: lookups are free (HasBlocks on the real path: `engine/tests/transfer.rs`,
//! `has_blocks_takes_no_reference`), and a model-based property test of every operation.

use std::collections::HashMap;

use kvwire::Shape;
use proptest::prelude::*;
use tl_engine_core::pool::{BlockId, BlockKey, KvPool, PoolCounts, PoolError};

const TEST: Shape = Shape::v1(4, 2, 1, 4);

/// The four tokens the tests name by `h`: different hashes, different tokens.
fn toks(h: u64) -> [u32; 4] {
    [h as u32, (h >> 32) as u32, 7, 9]
}

/// A first block (no parent) of scope 0 holding `tokens`, indexed by `h`.
fn root(h: u64, tokens: &[u32]) -> BlockKey<'_> {
    BlockKey {
        scope: 0,
        hash: h,
        tokens,
        parent: None,
    }
}

/// `pool.register(id, ...)` of the root named `h`.
fn reg(pool: &mut KvPool, id: BlockId, h: u64) -> bool {
    pool.register(id, root(h, &toks(h)))
}

/// `pool.lookup` of the root named `h`.
fn find(pool: &KvPool, h: u64) -> Option<BlockId> {
    pool.lookup(root(h, &toks(h)))
}

#[test]
fn pool_lookup_takes_no_reference() {
    let mut pool = KvPool::new(TEST, 8);
    let ids = pool.allocate(3).unwrap();
    assert!(reg(&mut pool, ids[0], 11));
    assert!(reg(&mut pool, ids[1], 22));
    pool.release(ids[1]).unwrap(); // 22 is now cached
    let before = pool.counts();
    for _ in 0..5 {
        assert_eq!(find(&pool, 11), Some(ids[0]));
        assert_eq!(find(&pool, 22), Some(ids[1]));
        assert_eq!(find(&pool, 33), None);
        assert_eq!(find(&pool, 0), None);
    }
    assert_eq!(pool.counts(), before);
    assert_eq!(pool.info(ids[0]).unwrap().2, 1);
    assert_eq!(pool.info(ids[1]).unwrap().2, 0);
    // A lookup does not refresh the LRU either: the cached block is still the next eviction.
    let more = pool.allocate(5).unwrap();
    assert_eq!(pool.counts().free, 0);
    assert_eq!(find(&pool, 22), Some(ids[1]));
    let evicting = pool.allocate(1).unwrap();
    assert_eq!(evicting, [ids[1]]);
    assert_eq!(find(&pool, 22), None);
    assert!(more.iter().all(|id| pool.info(*id).unwrap().2 == 1));
    pool.check().unwrap();
}

#[test]
fn allocate_is_all_or_nothing_and_import_registers() {
    let mut pool = KvPool::new(TEST, 4);
    let a = pool.allocate(3).unwrap();
    let before = pool.counts();
    assert_eq!(
        pool.allocate(2),
        Err(PoolError::Exhausted {
            requested: 2,
            available: 1
        })
    );
    assert_eq!(pool.counts(), before);
    for id in a {
        pool.release(id).unwrap();
    }
    let payload: Vec<u8> = (0..128).map(|i| i as u8).collect();
    let t77 = toks(77);
    let id = pool.import(root(77, &t77), 4, &payload).unwrap();
    assert_eq!(find(&pool, 77), Some(id));
    let (bytes, fill) = pool.export(id).unwrap();
    assert_eq!((&*bytes, fill), (&payload[..], 4));
    drop(bytes);
    // A second import of the same hash is a private copy, not registered.
    let id2 = pool.import(root(77, &t77), 4, &payload).unwrap();
    assert_eq!(find(&pool, 77), Some(id));
    assert_eq!(pool.info(id2).unwrap().0, 0);
    assert!(matches!(
        pool.import(root(5, &[]), 0, &payload),
        Err(PoolError::BadImport { .. })
    ));
    assert!(matches!(
        pool.import(root(5, &t77), 4, &payload[..100]),
        Err(PoolError::BadImport { .. })
    ));
    // release_forget drops the name of a block nobody else holds.
    pool.release_forget(id).unwrap();
    assert_eq!(find(&pool, 77), None);
    pool.release(id2).unwrap();
    assert_eq!(
        pool.counts(),
        PoolCounts {
            total: 4,
            free: 4,
            used: 0,
            cached: 0,
            indexed: 0
        }
    );
    pool.check().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    Retain(usize),
    Release(usize),
    ReleaseForget(usize),
    ReleaseUnheld(usize),
    Register(usize, u64),
    Lookup(u64),
    LookupRef(u64),
    Import(u64, u32),
}

fn op() -> impl Strategy<Value = Op> {
    // Few distinct hashes so collisions, re-registration and revival happen often.
    let hash = 0u64..6;
    prop_oneof![
        (0usize..4).prop_map(Op::Allocate),
        any::<usize>().prop_map(Op::Retain),
        any::<usize>().prop_map(Op::Release),
        any::<usize>().prop_map(Op::ReleaseForget),
        any::<usize>().prop_map(Op::ReleaseUnheld),
        (any::<usize>(), hash.clone()).prop_map(|(i, h)| Op::Register(i, h)),
        hash.clone().prop_map(Op::Lookup),
        hash.clone().prop_map(Op::LookupRef),
        (hash, 1u32..=4).prop_map(|(h, f)| Op::Import(h, f)),
    ]
}

/// The reference model: per-block refcount and name, the LRU order, the index.
#[derive(Debug)]
struct Model {
    refs: Vec<u32>,
    hash: Vec<u64>,
    lru: Vec<BlockId>,
    index: HashMap<u64, BlockId>,
}

impl Model {
    fn counts(&self) -> PoolCounts {
        let used = self.refs.iter().filter(|r| **r > 0).count();
        PoolCounts {
            total: self.refs.len(),
            free: self.refs.len() - used - self.lru.len(),
            used,
            cached: self.lru.len(),
            indexed: self.index.len(),
        }
    }

    /// Checks that `got` is what allocation should take, and applies it.
    fn take(&mut self, got: &[BlockId]) -> Result<(), TestCaseError> {
        for &id in got {
            let i = id as usize;
            prop_assert_eq!(self.refs[i], 0, "allocated a referenced block");
            if self.hash[i] != 0 {
                // Eviction: only when nothing is free, and only the least recently used.
                prop_assert_eq!(self.counts().free, 0, "evicted while free blocks remain");
                prop_assert_eq!(
                    self.lru.first().copied(),
                    Some(id),
                    "evicted out of LRU order"
                );
                self.lru.remove(0);
                self.index.remove(&self.hash[i]);
                self.hash[i] = 0;
            }
            self.refs[i] = 1;
        }
        Ok(())
    }

    fn release(&mut self, id: BlockId, forget: bool) {
        let i = id as usize;
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            if self.hash[i] != 0 && !forget {
                self.lru.push(id);
            } else if self.hash[i] != 0 {
                self.index.remove(&self.hash[i]);
                self.hash[i] = 0;
            }
        }
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    const N: usize = 6;
    let mut pool = KvPool::new(TEST, N);
    let mut m = Model {
        refs: vec![0; N],
        hash: vec![0; N],
        lru: vec![],
        index: HashMap::new(),
    };
    let mut held: Vec<BlockId> = Vec::new(); // one entry per reference we own
    let payload = vec![0xAB; 128];
    // What a WatchBlocks subscriber rebuilds from the observer's changes alone: at every step
    // it must be the index. A change that does not alter it (a second store, an eviction of
    // something absent) is a bug a subscriber would carry.
    let replayed = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    let bad = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let (replayed, bad) = (replayed.clone(), bad.clone());
        pool.set_observer(Box::new(move |scope, hash, stored| {
            let mut r = replayed.lock().unwrap();
            let changed = if stored {
                r.insert((scope, hash))
            } else {
                r.remove(&(scope, hash))
            };
            if !changed {
                bad.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    for op in ops {
        match op {
            Op::Allocate(n) => match pool.allocate(n) {
                Ok(ids) => {
                    prop_assert_eq!(ids.len(), n);
                    m.take(&ids)?;
                    held.extend(ids);
                }
                Err(PoolError::Exhausted {
                    requested,
                    available,
                }) => {
                    prop_assert_eq!(requested, n);
                    prop_assert_eq!(available, m.counts().free + m.counts().cached);
                    prop_assert!(n > available);
                }
                Err(e) => prop_assert!(false, "{e}"),
            },
            Op::Retain(k) if !held.is_empty() => {
                let id = held[k % held.len()];
                pool.retain(id).unwrap();
                m.refs[id as usize] += 1;
                held.push(id);
            }
            Op::Release(k) | Op::ReleaseForget(k) if !held.is_empty() => {
                let id = held.swap_remove(k % held.len());
                let forget = matches!(op, Op::ReleaseForget(_));
                if forget {
                    pool.release_forget(id).unwrap()
                } else {
                    pool.release(id).unwrap()
                }
                m.release(id, forget);
            }
            Op::ReleaseUnheld(k) => {
                let id = (k % N) as BlockId;
                if m.refs[id as usize] == 0 {
                    let before = pool.counts();
                    prop_assert_eq!(pool.release(id), Err(PoolError::NotReferenced(id)));
                    prop_assert_eq!(pool.counts(), before);
                }
            }
            Op::Register(k, h) if !held.is_empty() => {
                let id = held[k % held.len()];
                let i = id as usize;
                // A named block keeps its name; a taken name leaves the block private.
                let expect = h != 0 && m.hash[i] == 0 && !m.index.contains_key(&h);
                prop_assert_eq!(reg(&mut pool, id, h), expect);
                if expect {
                    m.hash[i] = h;
                    m.index.insert(h, id);
                }
            }
            Op::Lookup(h) => {
                let before = pool.counts();
                prop_assert_eq!(
                    find(&pool, h),
                    if h == 0 {
                        None
                    } else {
                        m.index.get(&h).copied()
                    }
                );
                prop_assert_eq!(pool.counts(), before);
            }
            Op::LookupRef(h) => {
                let got = pool.lookup_ref(root(h, &toks(h)));
                let want = if h == 0 {
                    None
                } else {
                    m.index.get(&h).copied()
                };
                prop_assert_eq!(got, want);
                if let Some(id) = got {
                    if m.refs[id as usize] == 0 {
                        m.lru.retain(|&x| x != id);
                    }
                    m.refs[id as usize] += 1;
                    held.push(id);
                }
            }
            Op::Import(h, fill) => {
                match pool.import(root(h, &toks(h)[..fill as usize]), fill, &payload) {
                    Ok(id) => {
                        m.take(&[id])?;
                        // Named only when full: a partial block's tokens are not a key.
                        if h != 0 && fill == 4 && !m.index.contains_key(&h) {
                            m.hash[id as usize] = h;
                            m.index.insert(h, id);
                        }
                        prop_assert_eq!(pool.info(id).unwrap(), (m.hash[id as usize], fill, 1));
                        held.push(id);
                    }
                    Err(PoolError::Exhausted { .. }) => {
                        prop_assert_eq!(m.counts().free + m.counts().cached, 0)
                    }
                    Err(e) => prop_assert!(false, "{e}"),
                }
            }
            _ => {}
        }
        if let Err(e) = pool.check() {
            prop_assert!(false, "invariant: {e}");
        }
        prop_assert_eq!(pool.counts(), m.counts());
        prop_assert!(!bad.load(std::sync::atomic::Ordering::Relaxed));
        let keys: Vec<(u64, u64)> = replayed.lock().unwrap().iter().copied().collect();
        prop_assert_eq!(keys, pool.index_keys());
        for (i, (&r, &h)) in m.refs.iter().zip(&m.hash).enumerate() {
            let (ph, _, pr) = pool.info(i as BlockId).unwrap();
            prop_assert_eq!((ph, pr), (h, r), "block {}", i);
        }
    }
    // Nothing leaks: once every reference is dropped, nothing is used.
    for id in held.drain(..) {
        pool.release(id).unwrap();
    }
    let c = pool.counts();
    prop_assert_eq!(c.used, 0);
    prop_assert_eq!(c.free + c.cached, N);
    prop_assert!(pool.check().is_ok());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn pool_matches_its_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops)?;
    }
}

#[test]
fn published_counts_follow_every_release_without_the_lock() {
    use tl_engine_core::pool::SharedKv;
    let shared = SharedKv::new(KvPool::new(Shape::v1(4, 2, 1, 4), 8));
    assert_eq!(shared.counts().free, 8);
    let ids = shared.lock().allocate(3).unwrap();
    assert_eq!((shared.counts().used, shared.counts().free), (3, 5));
    {
        let mut p = shared.lock();
        assert!(reg(&mut p, ids[0], 42));
        p.release(ids[0]).unwrap();
        // While the lock is held the published figures are those of the last release.
        assert_eq!(shared.counts().used, 3);
    }
    let c = shared.counts();
    assert_eq!((c.used, c.cached, c.free, c.indexed), (2, 1, 5, 1));
    assert_eq!(c, shared.lock().counts());
}

/// The hash is an index, not an identity: a block with the same hash and other tokens, another
/// scope, or another parent is not found; a second block under a taken key stays private.
#[test]
fn a_block_answers_only_for_its_tokens_its_parent_and_its_scope() {
    let mut pool = KvPool::new(TEST, 8);
    let ids = pool.allocate(3).unwrap();
    let (a, b) = ([1, 2, 3, 4], [5, 6, 7, 8]);
    let h0 = kvwire::block_hash(0, &a);
    let h1 = kvwire::block_hash(h0, &b);
    let key = |hash, tokens, parent, scope| BlockKey {
        scope,
        hash,
        tokens,
        parent,
    };
    assert!(pool.register(ids[0], key(h0, &a[..], None, 3)));
    assert!(pool.register(ids[1], key(h1, &b[..], Some(ids[0]), 3)));
    assert_eq!(pool.lookup_prefix(3, &[h0, h1], &[a, b].concat()), ids[..2]);
    // The same hashes with other tokens (a collision): not found, nothing after either.
    assert_eq!(pool.lookup(key(h0, &[1, 2, 3, 5], None, 3)), None);
    assert_eq!(pool.lookup_prefix(3, &[h0, h1], &[[9; 4], b].concat()), []);
    // Another scope: nothing shared.
    assert_eq!(pool.lookup_prefix(4, &[h0, h1], &[a, b].concat()), []);
    // The right tokens after the wrong parent (or as a first block): not found.
    assert_eq!(pool.lookup(key(h1, &b[..], None, 3)), None);
    assert_eq!(pool.lookup(key(h1, &b[..], Some(ids[2]), 3)), None);
    // A colliding block cannot take the name; a block whose parent is unnamed is not named.
    assert!(!pool.register(ids[2], key(h0, &[9; 4][..], None, 3)));
    assert!(!pool.register(ids[2], key(77, &b[..], Some(ids[2]), 3)));
    // A tail's tokens are kept for the claim's comparison, never as a key.
    assert!(pool.set_tokens(ids[2], &[1, 2]));
    assert_eq!(pool.tokens_of(ids[2]), [1, 2]);
    assert!(
        !pool.set_tokens(ids[0], &[1]),
        "a named block's tokens are final"
    );
    pool.check().unwrap();
}

/// A child names its parent's life: once the parent is evicted and its slot holds another
/// prompt under the same name, the old child is not found after it.
#[test]
fn a_reused_parent_does_not_revive_its_old_children() {
    let mut pool = KvPool::new(TEST, 2);
    let ids = pool.allocate(2).unwrap();
    let (a, b) = ([1, 2, 3, 4], [5, 6, 7, 8]);
    let h0 = kvwire::block_hash(0, &a);
    let h1 = kvwire::block_hash(h0, &b);
    assert!(pool.register(ids[0], root(h0, &a)));
    let child = BlockKey {
        scope: 0,
        hash: h1,
        tokens: &b,
        parent: Some(ids[0]),
    };
    assert!(pool.register(ids[1], child));
    // Release the parent first: it is evicted first, and comes back under the same key.
    pool.release(ids[0]).unwrap();
    pool.release(ids[1]).unwrap();
    let again = pool.allocate(1).unwrap()[0];
    assert_eq!(again, ids[0]);
    assert!(pool.register(again, root(h0, &a)));
    assert_eq!(
        pool.lookup(child),
        None,
        "the child outlived its parent's life"
    );
    assert_eq!(pool.lookup_prefix(0, &[h0, h1], &[a, b].concat()), [again]);
    pool.check().unwrap();
}
