//! Finds two different 16-token blocks with the same kv.wire.v1 block hash (contract section 2),
//! to show that the chained FNV-1a-64 hash is an index and not an identity.
//!
//! Method: a parallel collision search with distinguished points (van Oorschot and Wiener). The
//! step function maps a 64-bit value to a block, one nibble per token (tokens `a`..`p`, so the
//! pair is printable text), and hashes that block with parent 0. Two different inputs that reach
//! the same output are two different blocks with the same hash. Each thread walks several trails
//! at once so that the multiply chains of FNV-1a overlap.
//!
//! `cargo run --release -p kvwire --example fnv_collision [threads] [dp_bits]`
//! prints the pair as JSON. The pair found on this project's first run is kept as the fixture
//! `engine/tests/fixtures/fnv_collision.json`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const PRIME: u64 = 0x100000001b3;
const BASIS: u64 = 0xcbf29ce484222325;
const LANES: usize = 8;

/// The block a 64-bit value names: token i is `b'a'` plus nibble i.
fn tokens_of(x: u64) -> [u32; 16] {
    let mut t = [0u32; 16];
    for (i, slot) in t.iter_mut().enumerate() {
        *slot = u32::from(b'a') + ((x >> (4 * i)) & 0xf) as u32;
    }
    t
}

/// fnv1a64 state after the parent's eight zero bytes.
fn after_parent() -> u64 {
    let mut h = BASIS;
    for _ in 0..8 {
        h = h.wrapping_mul(PRIME);
    }
    h
}

/// `block_hash(0, tokens_of(x))`, written out: the low byte of each token, then its three zero bytes.
#[inline(always)]
fn step(start: u64, x: u64) -> u64 {
    let mut h = start;
    for i in 0..16 {
        let b = u64::from(b'a') + ((x >> (4 * i)) & 0xf);
        h = (h ^ b).wrapping_mul(PRIME);
        h = h.wrapping_mul(PRIME);
        h = h.wrapping_mul(PRIME);
        h = h.wrapping_mul(PRIME);
    }
    if h == 0 { 1 } else { h }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e3779b97f4a7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

struct Trail {
    start: u64,
    len: u64,
}

/// Walks two trails that end at the same distinguished point to where they merge.
fn merge(s0: u64, a: &Trail, b: &Trail) -> Option<(u64, u64)> {
    let (long, short) = if a.len >= b.len { (a, b) } else { (b, a) };
    let mut x = long.start;
    let mut y = short.start;
    for _ in 0..(long.len - short.len) {
        x = step(s0, x);
    }
    if x == y {
        // One trail starts on the other: no collision between different inputs.
        return None;
    }
    loop {
        let nx = step(s0, x);
        let ny = step(s0, y);
        if nx == ny {
            return Some((x, y));
        }
        x = nx;
        y = ny;
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let dp_bits: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(22);
    let dp_mask = (1u64 << dp_bits) - 1;
    let s0 = after_parent();
    let points: Arc<Mutex<HashMap<u64, Trail>>> = Arc::default();
    let found: Arc<Mutex<Option<(u64, u64)>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let steps = Arc::new(AtomicU64::new(0));
    let began = Instant::now();
    let mut handles = Vec::new();
    for t in 0..threads {
        let (points, found, done, steps) =
            (points.clone(), found.clone(), done.clone(), steps.clone());
        handles.push(std::thread::spawn(move || {
            let mut seed = 0x5eed_0000 + t as u64;
            let mut start = [0u64; LANES];
            let mut x = [0u64; LANES];
            let mut len = [0u64; LANES];
            for l in 0..LANES {
                start[l] = splitmix(&mut seed);
                x[l] = start[l];
            }
            let mut local = 0u64;
            while !done.load(Ordering::Relaxed) {
                for _ in 0..4096 {
                    for l in 0..LANES {
                        x[l] = step(s0, x[l]);
                        len[l] += 1;
                    }
                    for l in 0..LANES {
                        // A trail that runs 40x the expected length is in a cycle: restart it.
                        if x[l] & dp_mask != 0 && len[l] < (40u64 << dp_bits) {
                            continue;
                        }
                        if x[l] & dp_mask == 0 {
                            let trail = Trail {
                                start: start[l],
                                len: len[l],
                            };
                            let mut map = points.lock().unwrap();
                            if let Some(other) = map.get(&x[l]) {
                                if let Some(pair) = merge(s0, other, &trail) {
                                    *found.lock().unwrap() = Some(pair);
                                    done.store(true, Ordering::Relaxed);
                                }
                            } else {
                                map.insert(x[l], trail);
                            }
                        }
                        start[l] = splitmix(&mut seed);
                        x[l] = start[l];
                        local += len[l];
                        len[l] = 0;
                    }
                }
                steps.fetch_add(local, Ordering::Relaxed);
                local = 0;
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    let (a, b) = found
        .lock()
        .unwrap()
        .expect("the search ends only with a pair");
    let (ta, tb) = (tokens_of(a), tokens_of(b));
    assert_ne!(ta, tb);
    let (ha, hb) = (kvwire::block_hash(0, &ta), kvwire::block_hash(0, &tb));
    assert_eq!(
        ha, hb,
        "the written-out step must agree with kvwire::block_hash"
    );
    let text = |t: &[u32; 16]| t.iter().map(|&c| char::from(c as u8)).collect::<String>();
    println!(
        "{{\"hash\":\"{ha:#018x}\",\"a\":\"{}\",\"b\":\"{}\",\"a_tokens\":{:?},\"b_tokens\":{:?},\"steps\":{},\"seconds\":{:.1},\"threads\":{threads}}}",
        text(&ta),
        text(&tb),
        ta,
        tb,
        steps.load(Ordering::Relaxed),
        began.elapsed().as_secs_f64()
    );
}
