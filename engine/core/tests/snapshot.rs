//! A block lent to a sender as a snapshot: it holds the bytes as they were when taken, whatever
//! the block's writers do afterwards, and the pool's own bytes follow the writers.

use kvwire::Shape;
use tl_engine_core::pool::{BlockKey, KvPool, SharedKv};

const SHAPE: Shape = Shape::v1(4, 2, 1, 4);

fn key(tokens: &[u32]) -> BlockKey<'_> {
    BlockKey {
        scope: 0,
        hash: 0,
        tokens,
        parent: None,
    }
}

#[test]
fn a_snapshot_keeps_what_it_saw_and_a_writer_writes_a_copy() {
    let shared = SharedKv::new(KvPool::new(SHAPE, 2));
    let p = SHAPE.payload_bytes().unwrap();
    let first = vec![3u8; p];
    let id = shared.import(key(&[1, 2, 3, 4]), 4, &first, 0).unwrap();
    let snap = shared.snapshot(id).unwrap();
    let lent = snap.as_ptr();
    // While nothing writes, the snapshot is the block's own memory (no copy was taken).
    assert_eq!(shared.read(id).unwrap().as_ptr(), lent);
    {
        let mut w = shared.write(id).unwrap();
        w[0] = 9;
        w[p - 1] = 8;
    }
    assert_eq!(
        &snap[..],
        &first[..],
        "the snapshot changed under its holder"
    );
    assert_eq!(snap.as_ptr(), lent);
    let now = shared.read(id).unwrap();
    assert_eq!((now[0], now[p - 1], now[1]), (9, 8, 3));
    assert_ne!(now.as_ptr(), lent, "the writer wrote the lent memory");
    drop(now);
    // With the snapshot gone, a writer writes in place again.
    drop(snap);
    let before = shared.read(id).unwrap().as_ptr();
    shared.write(id).unwrap()[1] = 7;
    assert_eq!(shared.read(id).unwrap().as_ptr(), before);
    assert_eq!(shared.read(id).unwrap()[1], 7);
    shared.lock().release(id).unwrap();
    shared.lock().check().unwrap();
}

#[test]
fn a_snapshot_outlives_the_blocks_reuse() {
    let shared = SharedKv::new(KvPool::new(SHAPE, 1));
    let p = SHAPE.payload_bytes().unwrap();
    let id = shared
        .import(key(&[5, 5, 5, 5]), 4, &vec![1u8; p], 0)
        .unwrap();
    let snap = shared.snapshot(id).unwrap();
    shared.lock().release(id).unwrap();
    // The only block is freed and handed to another import, which overwrites it.
    let again = shared
        .import(key(&[6, 6, 6, 6]), 4, &vec![2u8; p], 0)
        .unwrap();
    assert_eq!(again, id);
    assert!(snap.iter().all(|&b| b == 1));
    assert!(shared.read(again).unwrap().iter().all(|&b| b == 2));
    assert!(shared.snapshot(99).is_err());
    shared.lock().release(again).unwrap();
    assert_eq!(shared.counts().used, 0);
}

#[test]
fn a_sealed_envelope_is_the_written_one_and_is_resealed_only_when_changed() {
    let shared = SharedKv::new(KvPool::new(SHAPE, 1));
    let p = SHAPE.payload_bytes().unwrap();
    let payload: Vec<u8> = (0..p).map(|i| (i * 3 + 2) as u8).collect();
    let id = shared.import(key(&[1, 1, 1, 1]), 4, &payload, 0).unwrap();
    let written = |hash: u64, payload: &[u8]| {
        let mut v = Vec::new();
        let rec = kvwire::RecordIn {
            hash,
            fill: 4,
            payload,
        };
        kvwire::write_to_vec(&SHAPE, &[rec], &mut v).unwrap();
        v
    };
    let head = kvwire::full_block_head(&SHAPE, 0, 4).unwrap();
    let sealed = shared.seal(id, &head).unwrap();
    assert_eq!(sealed.as_ref(), &written(0, &payload)[..]);
    assert_eq!(sealed.payload().as_ptr(), shared.read(id).unwrap().as_ptr());
    // Sealed again with the same head: the same memory, nothing rewritten.
    let again = shared.seal(id, &head).unwrap();
    assert_eq!(again.as_ref().as_ptr(), sealed.as_ref().as_ptr());
    drop(again);
    // Another head (the block was named since): a new envelope, the lent one unchanged.
    let named = kvwire::full_block_head(&SHAPE, 42, 4).unwrap();
    let renamed = shared.seal(id, &named).unwrap();
    assert_eq!(renamed.as_ref(), &written(42, &payload)[..]);
    assert_eq!(sealed.as_ref(), &written(0, &payload)[..]);
    drop((sealed, renamed));
    // A write of the payload unseals it: the next seal has the new bytes and CRC.
    shared.write(id).unwrap()[5] ^= 0x55;
    let mut changed = payload.clone();
    changed[5] ^= 0x55;
    assert_eq!(
        shared.seal(id, &named).unwrap().as_ref(),
        &written(42, &changed)[..]
    );
    assert!(shared.seal(9, &named).is_err());
    shared.lock().release(id).unwrap();
    shared.lock().check().unwrap();
}

/// Sealing while another thread writes the block: every envelope sealed is whole (its CRC is
/// over its own bytes, and its payload is one write's, never a mix), whichever of the two got
/// the block's lock first.
#[test]
fn a_seal_racing_a_writer_never_lends_a_stale_crc() {
    let shared = SharedKv::new(KvPool::new(SHAPE, 1));
    let p = SHAPE.payload_bytes().unwrap();
    let id = shared
        .import(key(&[2, 2, 2, 2]), 4, &vec![0u8; p], 0)
        .unwrap();
    let head = kvwire::full_block_head(&SHAPE, 0, 4).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    /// Stops the writer however the loop below ends (a failed assertion too), so the scope
    /// joins it instead of waiting forever.
    struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut k = 0u8;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                k = k.wrapping_add(1);
                shared.write(id).unwrap().fill(k);
            }
        });
        let _stop = Stop(&stop);
        for _ in 0..20_000 {
            let sealed = shared.seal(id, &head).unwrap();
            let env = kvwire::Reader::new()
                .expect_shape(SHAPE)
                .read(sealed.as_ref())
                .expect("a sealed envelope with a stale CRC");
            let payload = sealed.payload();
            assert!(payload.iter().all(|&b| b == payload[0]), "a torn payload");
            assert_eq!(env.n_blocks(), 1);
        }
    });
    shared.lock().release(id).unwrap();
    shared.lock().check().unwrap();
}
