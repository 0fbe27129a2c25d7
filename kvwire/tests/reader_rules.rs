//! Each of the eight reader rules, in order, with its error kind, and no allocation on any path.
#![allow(unsafe_code)] // the counting allocator below; nothing else.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvwire::{ErrorKind, ReadError, Reader, RecordIn, Shape, block_hash, crc32c, write_to_vec};

/// Counts allocations made by the current thread, so tests running in parallel do not interfere.
struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counter is a
// const-initialised thread-local Cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> usize {
    ALLOCS.with(Cell::get)
}

const TEST: Shape = Shape::v1(4, 2, 1, 4);

fn one_block(hash: u64, fill: u32) -> Vec<u8> {
    let payload: Vec<u8> = (0..128u32).map(|i| (i % 251) as u8).collect();
    let mut out = Vec::new();
    write_to_vec(
        &TEST,
        &[RecordIn {
            hash,
            fill,
            payload: &payload,
        }],
        &mut out,
    )
    .unwrap();
    out
}

fn recrc(buf: &mut [u8]) {
    let n = buf.len() - 4;
    let c = crc32c(&buf[..n]);
    buf[n..].copy_from_slice(&c.to_le_bytes());
}

fn set_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Reads `buf` and returns the result, asserting that reading allocated nothing.
fn read_no_alloc(reader: &Reader, buf: &[u8]) -> Result<(usize, u32), ReadError> {
    let before = allocs();
    let res = reader
        .read(buf)
        .map(|env| (env.n_blocks(), env.records().map(|r| r.n_tokens).sum()));
    let after = allocs();
    assert_eq!(after, before, "reading {} bytes allocated", buf.len());
    res
}

#[test]
fn envelope_reader_rules() {
    // The counter sees this thread's allocations (so a zero difference below means something).
    let before = allocs();
    let probe = std::hint::black_box(vec![0u8; 64]);
    assert!(allocs() > before);
    drop(probe);

    let reader = Reader::new().expect_shape(TEST);
    let any_shape = Reader::new();
    let hash = block_hash(0, &[1, 2, 3, 4]);
    let good = one_block(hash, 4);
    assert_eq!(read_no_alloc(&reader, &good), Ok((1, 4)));

    // What the writer made reads back record by record: every hash, fill and payload, in
    // order (full blocks named, the partial tail unnamed).
    let p = TEST.payload_bytes().unwrap();
    let payloads: Vec<Vec<u8>> = (0..3u8)
        .map(|k| {
            (0..p)
                .map(|i| (i as u8).wrapping_mul(3).wrapping_add(k))
                .collect()
        })
        .collect();
    let h0 = block_hash(0, &[1, 2, 3, 4]);
    let h1 = block_hash(h0, &[5, 6, 7, 8]);
    let written = [(h0, 4), (h1, 4), (0, 2)];
    let recs: Vec<RecordIn> = written
        .iter()
        .zip(&payloads)
        .map(|(&(hash, fill), payload)| RecordIn {
            hash,
            fill,
            payload,
        })
        .collect();
    let mut many = Vec::new();
    write_to_vec(&TEST, &recs, &mut many).unwrap();
    let env = reader.read(&many).unwrap();
    let read: Vec<(u64, u32)> = env.records().map(|r| (r.hash, r.n_tokens)).collect();
    assert_eq!(read, written);
    for (r, payload) in env.records().zip(&payloads) {
        let rows = TEST.row_bytes().unwrap() * r.n_tokens as usize;
        // Each plane's filled rows are the writer's input; the rest of a partial block is zero.
        for (got, want) in r
            .payload
            .chunks(p / TEST.planes())
            .zip(payload.chunks(p / TEST.planes()))
        {
            assert_eq!(got[..rows], want[..rows]);
            assert!(got[rows..].iter().all(|&b| b == 0));
        }
    }

    let expect = |buf: &[u8], r: &Reader, rule: u8, kind: ErrorKind| {
        let err = read_no_alloc(r, buf).unwrap_err();
        assert_eq!((err.rule(), err.kind()), (rule, kind), "{err}");
    };

    // Rule 1: length >= 32, for every shorter length, empty included.
    for len in 0..32 {
        expect(&good[..len], &reader, 1, ErrorKind::Format);
    }

    // Rule 2: magic, even with an otherwise consistent CRC.
    let mut b = good.clone();
    b[3] = b'X';
    recrc(&mut b);
    expect(&b, &reader, 2, ErrorKind::Format);

    // Rule 3: a flipped bit in the payload, the trailer, or the version field is corruption.
    for bit in [400, 171 * 8 + 7, 4 * 8] {
        let mut b = good.clone();
        b[bit / 8] ^= 1 << (bit % 8);
        expect(&b, &reader, 3, ErrorKind::Format);
    }

    // Rule 4: a good CRC on another (version, dtype) is a format this reader does not read.
    for (at, v) in [(4usize, 2u16), (6, 2), (4, 0)] {
        let mut b = good.clone();
        b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        recrc(&mut b);
        expect(&b, &reader, 4, ErrorKind::Version);
    }

    // Rule 5: zero counts, a length that disagrees, sizes that overflow.
    for at in [8usize, 12, 16, 20, 24] {
        let mut b = good.clone();
        set_u32(&mut b, at, 0);
        recrc(&mut b);
        expect(&b, &any_shape, 5, ErrorKind::Format);
    }
    let mut b = good.clone();
    set_u32(&mut b, 8, 2);
    recrc(&mut b);
    expect(&b, &reader, 5, ErrorKind::Format);
    let mut b = good.clone();
    for at in [8, 12, 16, 20, 24] {
        set_u32(&mut b, at, u32::MAX);
    }
    recrc(&mut b);
    assert!(matches!(
        reader.read(&b),
        Err(ReadError::BadLength { expected: None, .. })
    ));
    expect(&b, &reader, 5, ErrorKind::Format);
    let mut b = good.clone();
    b.extend_from_slice(&[0; 4]);
    recrc(&mut b);
    expect(&b, &reader, 5, ErrorKind::Format);

    // Rule 6: a valid envelope of another shape, against this pool's shape only.
    let other = Shape::v1(4, 2, 1, 8);
    let payload = vec![0u8; other.payload_bytes().unwrap()];
    let mut b = Vec::new();
    write_to_vec(
        &other,
        &[RecordIn {
            hash: 0,
            fill: 4,
            payload: &payload,
        }],
        &mut b,
    )
    .unwrap();
    expect(&b, &reader, 6, ErrorKind::Shape);
    assert!(any_shape.read(&b).is_ok());

    // Rule 7: fill 0 and fill > B.
    for fill in [0, 5, u32::MAX] {
        let mut b = one_block(0, 1);
        set_u32(&mut b, 36, fill);
        recrc(&mut b);
        expect(&b, &reader, 7, ErrorKind::Format);
    }

    // Rule 8: a hash on a partial block.
    let mut b = one_block(0, 3);
    b[28..36].copy_from_slice(&hash.to_le_bytes());
    recrc(&mut b);
    expect(&b, &reader, 8, ErrorKind::Format);

    // Order: with rules 7 and 8 both broken (8 in an earlier record), rule 7 is reported.
    let payload = vec![0u8; 128];
    let mut b = Vec::new();
    let recs = [
        RecordIn {
            hash: 0,
            fill: 4,
            payload: &payload,
        },
        RecordIn {
            hash: 0,
            fill: 4,
            payload: &payload,
        },
    ];
    write_to_vec(&TEST, &recs, &mut b).unwrap();
    b[28..36].copy_from_slice(&hash.to_le_bytes());
    set_u32(&mut b, 36, 2); // record 0: hashed partial (rule 8)
    set_u32(&mut b, 28 + 140 + 8, 9); // record 1: fill 9 (rule 7)
    recrc(&mut b);
    expect(&b, &reader, 7, ErrorKind::Format);
}
