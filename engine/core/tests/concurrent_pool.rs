//! The shared pool under concurrent use: threads that act like the engine (allocate, write,
//! register, read, release), like the KV receiver (import, take a reference on a cached block,
//! release or forget) and like control calls (lookups, counts without the lock) run at once.
//! After every operation, under the same lock, the pool's invariants are checked; every thread
//! checks that the blocks it holds keep the bytes it wrote; at the end every reference is given
//! back and the pool is whole.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use kvwire::Shape;
use tl_engine_core::pool::{BlockId, BlockKey, KvPool, SharedKv};
use tl_engine_core::rng::Pcg32;

const SHAPE: Shape = Shape::v1(4, 2, 1, 4);
const BLOCKS: usize = 24;
const THREADS: u64 = 4;
const OPS: usize = 4_000;

/// Checks the pool's invariants; called with the lock held right after an operation.
fn checked(pool: &KvPool, what: &str) {
    if let Err(e) = pool.check() {
        panic!("after {what}: {e}");
    }
}

/// One thread's life: `OPS` random operations over blocks it holds (each tagged with a byte it
/// wrote there, re-read on every check) and a few shared hashes.
fn worker(shared: &SharedKv, seed: u64) {
    let mut rng = Pcg32::new(seed, 7);
    // Blocks this thread holds one reference on, with the byte it expects in them when it
    // wrote them itself (`None` for a shared, cached block it took a reference on).
    let mut held: HashMap<BlockId, Option<u8>> = HashMap::new();
    let payload = SHAPE.payload_bytes().unwrap_or(0);
    for n in 0..OPS {
        let tag = (seed as u8).wrapping_mul(31).wrapping_add(n as u8);
        // Few hashes across all threads: collisions, revival and eviction happen often.
        let hash = u64::from(rng.next_u32() % 8) + 1;
        let tokens = [hash as u32; 4];
        let key = BlockKey {
            scope: 0,
            hash,
            tokens: &tokens,
            parent: None,
        };
        let pick = |held: &HashMap<BlockId, Option<u8>>, r: u32| {
            let mut ids: Vec<BlockId> = held.keys().copied().collect();
            ids.sort_unstable();
            ids.get(r as usize % ids.len().max(1)).copied()
        };
        let r = rng.next_u32();
        let op = rng.next_u32() % 6;
        // The engine and the receiver write block bytes outside the pool's lock.
        match op {
            // The engine: a fresh block (bookkeeping under the lock), written with our tag under
            // the block's lock only, then its fill under the pool's lock again.
            0 if held.len() < 6 => {
                let got = shared.lock().allocate(1);
                if let Ok(ids) = got {
                    shared.write(ids[0]).unwrap().fill(tag);
                    let mut p = shared.lock();
                    p.set_fill(ids[0], 4).unwrap();
                    checked(&p, "allocate");
                    held.insert(ids[0], Some(tag));
                }
            }
            // The receiver: an import (the copy outside the pool's lock), registered when the
            // hash is free.
            1 if held.len() < 6 => {
                if let Ok(id) = shared.import(key, 4, &vec![tag; payload], 0) {
                    held.insert(id, Some(tag));
                }
                checked(&shared.lock(), "import");
            }
            _ => {}
        }
        let mut p = shared.lock();
        match op {
            0 | 1 => {}
            // Naming one of ours, so other threads can share it.
            2 => {
                if let Some(id) = pick(&held, r) {
                    p.register(id, key);
                }
                checked(&p, "register");
            }
            // A lookup that takes a reference (a dedup, a prefix hit).
            3 if held.len() < 6 => {
                if let Some(id) = p.lookup_ref(key) {
                    // Ours already? Then it is a second reference: give it back at once.
                    match held.entry(id) {
                        std::collections::hash_map::Entry::Occupied(_) => p.release(id).unwrap(),
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(None);
                        }
                    }
                }
                checked(&p, "lookup_ref");
            }
            // Release (cache it) or forget (free and unregister) one of ours.
            4 | 5 => {
                if let Some(id) = pick(&held, r) {
                    let tagged = held.remove(&id).flatten();
                    // Only a block nobody else can hold may be forgotten: an unshared tag.
                    let shared_now = p.info(id).unwrap().2 > 1;
                    if tagged.is_some() && !shared_now && r.is_multiple_of(3) {
                        p.release_forget(id).unwrap();
                    } else {
                        p.release(id).unwrap();
                    }
                }
                checked(&p, "release");
            }
            _ => {
                let _ = p.lookup(key);
                checked(&p, "lookup");
            }
        }
        for &id in held.keys() {
            assert!(p.info(id).unwrap().2 >= 1, "block {id} lost our reference");
        }
        drop(p);
        // What we wrote is still there, read without the pool's lock: nobody writes or reuses
        // a block we hold.
        for (&id, &tag) in &held {
            if let Some(t) = tag {
                // Shared blocks (registered and taken by others) keep their bytes too.
                let bytes = shared.read(id).unwrap();
                assert!(bytes.iter().all(|&b| b == t), "block {id} was overwritten");
            }
        }
        // The counts a control call reads without the lock are some release's exact figures.
        let c = shared.counts();
        assert_eq!(c.used + c.cached + c.free, c.total, "{c:?}");
    }
    let mut p = shared.lock();
    for id in held.into_keys() {
        p.release(id).unwrap();
    }
    checked(&p, "final release");
}

#[test]
fn concurrent_use_keeps_every_invariant() {
    let shared = SharedKv::new(KvPool::new(SHAPE, BLOCKS));
    let start = Arc::new(Barrier::new(THREADS as usize + 1));
    let done = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (shared, start) = (shared.clone(), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                worker(&shared, 100 + t);
            })
        })
        .collect();
    // A control-plane reader: lookups and lock-free counts, all the while.
    let reader = {
        let (shared, done, start) = (shared.clone(), Arc::clone(&done), Arc::clone(&start));
        std::thread::spawn(move || {
            start.wait();
            let mut reads = 0u64;
            while !done.load(Ordering::Relaxed) {
                let c = shared.counts();
                assert_eq!(c.total, BLOCKS);
                let hashes: Vec<bool> = {
                    let p = shared.lock();
                    (1..=8u64)
                        .map(|h| {
                            let key = BlockKey {
                                scope: 0,
                                hash: h,
                                tokens: &[h as u32; 4],
                                parent: None,
                            };
                            p.lookup(key).is_some()
                        })
                        .collect()
                };
                assert_eq!(hashes.len(), 8);
                reads += 1;
            }
            reads
        })
    };
    for t in threads {
        t.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    let p = shared.lock();
    p.check().unwrap();
    let c = p.counts();
    assert_eq!(c.used, 0, "a reference was not given back: {c:?}");
    assert_eq!(c.free + c.cached, BLOCKS);
}
