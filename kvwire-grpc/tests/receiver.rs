//! The receiver's per-chunk rules and the deduplicating transfer, in memory: a [`MemStore`] on
//! each side and a [`LocalTransport`] between them, no socket and no engine. Every refusal is
//! checked with the receiving store's counts and index compared before and after.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvwire::{CRC32C_RESIDUE, RecordIn, Shape, block_hash, crc32c, write_to_vec};
use kvwire_grpc::memory::{LocalTransport, MemSnapshot, MemStore};
use kvwire_grpc::pb::kv::{HasBlocksRequest, KvAck, KvChunk};
use kvwire_grpc::{BlockKey, KvReceiver, KvStore, Push, ReceiverLimits, transfer};
use tonic::{Code, Status};

const TEST: Shape = Shape::v1(4, 2, 1, 4);
const LEASE: Duration = Duration::from_secs(30);

/// A receiving side: its store, its receiver, and a transport that reaches it.
struct Side {
    store: Arc<MemStore>,
    rx: Arc<KvReceiver>,
    transport: LocalTransport,
}

fn side(blocks: usize) -> Side {
    let store = Arc::new(MemStore::new(TEST, blocks));
    let dyn_store: Arc<dyn KvStore> = Arc::clone(&store) as Arc<dyn KvStore>;
    let rx = Arc::new(KvReceiver::new(dyn_store, "fake").with_lease(LEASE));
    Side {
        transport: LocalTransport::new(Arc::clone(&rx)),
        store,
        rx,
    }
}

fn payload(byte: u8) -> Vec<u8> {
    vec![byte; TEST.payload_bytes().unwrap()]
}

/// A one-block envelope of the test shape with a recognisable payload.
fn envelope(shape: Shape, hash: u64, fill: u32, byte: u8) -> Bytes {
    let payload = vec![byte; shape.payload_bytes().unwrap()];
    let mut out = Vec::new();
    let rec = RecordIn {
        hash,
        fill,
        payload: &payload,
    };
    write_to_vec(&shape, &[rec], &mut out).unwrap();
    Bytes::from(out)
}

fn chunk(handle: &str, index: u32, total: u32, hash: u64, payload: Bytes) -> KvChunk {
    let payload_crc32c = if payload.is_empty() {
        0
    } else {
        crc32c(&payload)
    };
    KvChunk {
        handle_id: handle.into(),
        index,
        total,
        hash,
        kv_format: 1,
        payload,
        payload_crc32c,
        model: String::new(),
        tokens: Vec::new(),
        cache_scope: 0,
    }
}

/// `c` carrying its block's tokens.
fn tok(c: KvChunk, tokens: &[u32]) -> KvChunk {
    KvChunk {
        tokens: tokens.to_vec(),
        ..c
    }
}

/// The test prompt: two full blocks and a tail of two.
const PROMPT: [u32; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

/// A block known by its tokens, in scope 0.
fn key(hash: u64, tokens: &[u32], parent: Option<u32>) -> BlockKey<'_> {
    BlockKey {
        scope: 0,
        hash,
        tokens,
        parent,
    }
}

/// A block named by nothing (the sending side of a test needs no name).
const ANON: BlockKey<'static> = BlockKey {
    scope: 0,
    hash: 0,
    tokens: &[],
    parent: None,
};

/// HasBlocks for `PROMPT`'s full blocks in `scope`.
fn ask(hashes: &[u64], scope: u64) -> HasBlocksRequest {
    HasBlocksRequest {
        hashes: hashes.to_vec(),
        kv_format: 1,
        model: "fake".into(),
        tokens: PROMPT[..hashes.len() * 4].to_vec(),
        cache_scope: scope,
    }
}

/// A push to the test's decode side `d` of model `fake`.
fn to_d<'a>(handle_id: &'a str, hashes: &'a [u64], n_blocks: usize) -> Push<'a> {
    Push {
        target: "d",
        handle_id,
        model: "fake",
        hashes,
        n_blocks,
        known: None,
        lookup: None,
        // The test prompt's tokens when the push is of it; else none.
        tokens: if n_blocks == 3 { &PROMPT } else { &[] },
        scope: 0,
    }
}

/// Feeds `chunks` to one push, as the service does.
fn push(rx: &Arc<KvReceiver>, chunks: Vec<KvChunk>) -> Result<KvAck, Status> {
    let mut p = rx.begin_push()?;
    for c in chunks {
        p.accept(c)?;
    }
    Ok(p.finish()?)
}

/// A prompt of two full blocks and a tail of 2 tokens on a sending store: its blocks (one
/// reference each) and the chained hashes of the full ones.
fn prompt_on(src: &MemStore) -> (Vec<u32>, Vec<u64>) {
    let h0 = block_hash(0, &[1, 2, 3, 4]);
    let h1 = block_hash(h0, &[5, 6, 7, 8]);
    let first = src
        .put(key(h0, &PROMPT[..4], None), 4, &payload(10))
        .unwrap();
    let ids = vec![
        first,
        src.put(key(h1, &PROMPT[4..8], Some(first)), 4, &payload(11))
            .unwrap(),
        src.put(key(0, &PROMPT[8..], None), 2, &payload(12))
            .unwrap(),
    ];
    (ids, vec![h0, h1])
}

#[tokio::test]
async fn push_accepts_dedups_and_refuses() {
    let d = side(16);
    let src: Arc<MemStore> = Arc::new(MemStore::new(TEST, 16));
    let src_dyn = || Arc::clone(&src) as Arc<dyn KvStore>;
    let (ids, hashes) = prompt_on(&src);

    // Import: nothing held yet; the bytes arrive as they left.
    let st = transfer(
        &d.transport,
        src_dyn(),
        to_d("h1", &hashes, ids.len()),
        &ids,
    )
    .await
    .unwrap();
    assert_eq!((st.sent, st.deduped, st.resent), (3, 0, 0));
    let claimed = d.rx.claim("h1").unwrap();
    assert_eq!(claimed.tokens(), 10);
    assert_eq!(claimed.hashes(), [hashes[0], hashes[1], 0]);
    // Rows past a partial block's fill travel as zeros: compare what each side would send.
    let as_sent = |s: &MemStore, id| {
        let mut v = Vec::new();
        s.write_envelope(id, &mut v).unwrap();
        v
    };
    for (&a, &b) in ids.iter().zip(claimed.ids()) {
        assert_eq!(as_sent(&src, a), as_sent(&d.store, b), "block bytes differ");
    }
    assert_eq!(d.rx.has_blocks(&ask(&hashes, 0)).unwrap(), [true, true]);
    // Another scope, other tokens, or none at all: nothing is present.
    assert_eq!(d.rx.has_blocks(&ask(&hashes, 5)).unwrap(), [false, false]);
    let mut other = ask(&hashes, 0);
    other.tokens[5] = 99;
    assert_eq!(d.rx.has_blocks(&other).unwrap(), [true, false]);
    other.tokens[0] = 99;
    assert_eq!(d.rx.has_blocks(&other).unwrap(), [false, false]);
    let bare = HasBlocksRequest {
        tokens: Vec::new(),
        ..ask(&hashes, 0)
    };
    assert_eq!(d.rx.has_blocks(&bare).unwrap(), [false, false]);
    let short = HasBlocksRequest {
        tokens: vec![1, 2, 3],
        ..ask(&hashes, 0)
    };
    assert_eq!(
        Status::from(d.rx.has_blocks(&short).unwrap_err()).code(),
        Code::InvalidArgument
    );
    drop(claimed);

    // Dedup: the two full blocks are held now; only the tail moves.
    let st = transfer(
        &d.transport,
        src_dyn(),
        to_d("h2", &hashes, ids.len()),
        &ids,
    )
    .await
    .unwrap();
    assert_eq!((st.sent, st.deduped), (1, 2));
    assert!(d.rx.release("h2"));

    // A full block the sender never registered travels with envelope hash 0 and is registered
    // on arrival under the chunk hash.
    let lone = src.put(ANON, 4, &payload(7)).unwrap();
    let h = block_hash(0, &[9, 9, 9, 9]);
    let st = transfer(
        &d.transport,
        src_dyn(),
        Push {
            tokens: &[9, 9, 9, 9],
            ..to_d("h3", &[h], [lone].len())
        },
        &[lone],
    )
    .await
    .unwrap();
    assert_eq!(st.sent, 1);
    let c = d.rx.claim("h3").unwrap();
    assert_eq!(
        d.store.take_ref(key(h, &[9, 9, 9, 9], None)),
        Some(c.ids()[0])
    );
    assert_eq!(d.store.take_ref(key(h, &[9, 9, 9, 8], None)), None);
    d.store.release(c.ids());
    drop(c);

    // A pending handle to collide with.
    push(
        &d.rx,
        vec![chunk("taken", 0, 1, 0, envelope(TEST, 0, 2, 9))],
    )
    .unwrap();
    let before = d.store.snapshot();
    for (name, chunks, code) in refusals() {
        let err = push(&d.rx, chunks).unwrap_err();
        assert_eq!(err.code(), code, "{name}: {err}");
        assert_eq!(d.store.snapshot(), before, "{name} changed the store");
        assert_eq!(d.rx.pending(), 1, "{name}");
        assert_eq!(d.rx.stats().inflight, 0, "{name} left a push in flight");
    }
    let err = push(
        &d.rx,
        vec![chunk("taken", 0, 1, 0, envelope(TEST, 0, 2, 9))],
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert_eq!(d.store.snapshot(), before);

    // Exhaustion: with every block referenced, the import is refused and nothing changes.
    let hog: Vec<u32> = (0..before.free + before.cached)
        .map(|i| d.store.put(ANON, 1, &payload(i as u8)).unwrap())
        .collect();
    let full = d.store.snapshot();
    let err = push(&d.rx, vec![chunk("full", 0, 1, 0, envelope(TEST, 0, 1, 1))]).unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(d.store.snapshot(), full);
    d.store.release(&hog);
    assert!(d.rx.release("taken"));
    assert_eq!(d.store.snapshot().used, 0);
}

/// Each refused push: its chunks and the code. The first chunk of most is a good block with a
/// hash, imported before the refusal, so the undo is checked too.
fn refusals() -> Vec<(&'static str, Vec<KvChunk>, Code)> {
    let good_hash = block_hash(77, &[1, 2, 3, 4]);
    let good = || chunk("bad", 0, 2, good_hash, envelope(TEST, good_hash, 4, 1));
    let with = |f: &dyn Fn(&mut KvChunk)| {
        let mut c = chunk("bad", 1, 2, 0, envelope(TEST, 0, 1, 2));
        f(&mut c);
        c
    };
    let raw = |bytes: Vec<u8>| {
        with(&|c| {
            c.payload_crc32c = crc32c(&bytes);
            c.payload = Bytes::from(bytes.clone());
        })
    };
    let mut v2 = envelope(TEST, 0, 1, 3).to_vec();
    v2[4] = 2;
    let n = v2.len() - 4;
    let c2 = crc32c(&v2[..n]);
    v2[n..].copy_from_slice(&c2.to_le_bytes());
    let pl = vec![0u8; 128];
    let rec = RecordIn {
        hash: 0,
        fill: 1,
        payload: &pl,
    };
    let mut two = Vec::new();
    write_to_vec(&TEST, &[rec, rec], &mut two).unwrap();
    let mut bad_magic = envelope(TEST, 0, 1, 5).to_vec();
    bad_magic[0] = b'X';
    let other_shape = envelope(Shape::v1(4, 2, 1, 8), 0, 1, 4);
    let mut first_format = good();
    first_format.kv_format = 2;
    vec![
        (
            "kv_format 2 on the first chunk",
            vec![first_format],
            Code::FailedPrecondition,
        ),
        (
            "kv_format 2",
            vec![good(), with(&|c| c.kv_format = 2)],
            Code::FailedPrecondition,
        ),
        (
            "kv_format 0",
            vec![good(), with(&|c| c.kv_format = 0)],
            Code::FailedPrecondition,
        ),
        (
            "other model",
            vec![good(), with(&|c| c.model = "llama".into())],
            Code::FailedPrecondition,
        ),
        (
            "empty handle",
            vec![with(&|c| {
                c.handle_id.clear();
                c.index = 0;
            })],
            Code::InvalidArgument,
        ),
        (
            "handle changes",
            vec![good(), with(&|c| c.handle_id = "other".into())],
            Code::InvalidArgument,
        ),
        (
            "index skips",
            vec![good(), with(&|c| c.index = 2)],
            Code::InvalidArgument,
        ),
        (
            "index repeats",
            vec![good(), with(&|c| c.index = 0)],
            Code::InvalidArgument,
        ),
        (
            "total 0",
            vec![with(&|c| {
                c.total = 0;
                c.index = 0;
            })],
            Code::InvalidArgument,
        ),
        (
            "total changes",
            vec![good(), with(&|c| c.total = 3)],
            Code::InvalidArgument,
        ),
        (
            "chunk crc",
            vec![good(), with(&|c| c.payload_crc32c ^= 1)],
            Code::DataLoss,
        ),
        ("bad magic", vec![good(), raw(bad_magic)], Code::DataLoss),
        ("version 2", vec![good(), raw(v2)], Code::FailedPrecondition),
        (
            "shape",
            vec![
                good(),
                with(&|c| {
                    c.payload = other_shape.clone();
                    c.payload_crc32c = CRC32C_RESIDUE;
                }),
            ],
            Code::FailedPrecondition,
        ),
        ("two blocks", vec![good(), raw(two)], Code::InvalidArgument),
        (
            "hash disagrees",
            vec![good(), chunk("bad", 1, 2, 5, envelope(TEST, 6, 4, 1))],
            Code::InvalidArgument,
        ),
        (
            "hash on partial",
            vec![good(), chunk("bad", 1, 2, 5, envelope(TEST, 0, 3, 1))],
            Code::InvalidArgument,
        ),
        (
            "empty with hash 0",
            vec![good(), chunk("bad", 1, 2, 0, Bytes::new())],
            Code::InvalidArgument,
        ),
        (
            "tokens are not the chunk hash's",
            vec![tok(good(), &[1, 2, 3, 5])],
            Code::InvalidArgument,
        ),
        (
            "more tokens than B",
            vec![good(), tok(with(&|_| {}), &[1, 2, 3, 4, 5])],
            Code::InvalidArgument,
        ),
        (
            "tokens not the fill",
            vec![good(), tok(with(&|_| {}), &[1, 2])],
            Code::InvalidArgument,
        ),
        (
            "cache_scope changes",
            vec![good(), with(&|c| c.cache_scope = 3)],
            Code::InvalidArgument,
        ),
        (
            "empty, held, but no tokens",
            vec![chunk(
                "bad",
                0,
                1,
                block_hash(0, &PROMPT[..4]),
                Bytes::new(),
            )],
            Code::NotFound,
        ),
        (
            "empty, held, other scope",
            vec![KvChunk {
                cache_scope: 9,
                ..tok(
                    chunk("bad", 0, 1, block_hash(0, &PROMPT[..4]), Bytes::new()),
                    &PROMPT[..4],
                )
            }],
            Code::NotFound,
        ),
        (
            "empty, held, after another parent",
            vec![
                good(),
                tok(
                    chunk(
                        "bad",
                        1,
                        2,
                        block_hash(good_hash, &PROMPT[4..8]),
                        Bytes::new(),
                    ),
                    &PROMPT[4..8],
                ),
            ],
            Code::NotFound,
        ),
        (
            "empty, not held",
            vec![good(), chunk("bad", 1, 2, 12345, Bytes::new())],
            Code::NotFound,
        ),
        ("stream ends early", vec![good()], Code::InvalidArgument),
        ("no chunk at all", vec![], Code::InvalidArgument),
    ]
}

#[tokio::test]
async fn refused_dedup_drops_the_references_it_took() {
    let d = side(8);
    let src = Arc::new(MemStore::new(TEST, 8));
    let (ids, hashes) = prompt_on(&src);
    let src_dyn = Arc::clone(&src) as Arc<dyn KvStore>;
    transfer(&d.transport, src_dyn, to_d("h", &hashes, ids.len()), &ids)
        .await
        .unwrap();
    assert!(d.rx.release("h"));
    let before = d.store.snapshot();
    assert_eq!(before.cached, 2, "full blocks stay cached");
    // Two deduplicated chunks take references; the third breaks a rule: both are dropped.
    let err = push(
        &d.rx,
        vec![
            tok(chunk("x", 0, 3, hashes[0], Bytes::new()), &PROMPT[..4]),
            tok(chunk("x", 1, 3, hashes[1], Bytes::new()), &PROMPT[4..8]),
            chunk("x", 2, 3, 0, Bytes::new()),
        ],
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(d.store.snapshot(), before);
}

#[test]
fn lease_expires_at_its_deadline() {
    let d = side(8);
    let t0 = Instant::now();
    push(&d.rx, vec![chunk("h", 0, 1, 0, envelope(TEST, 0, 2, 9))]).unwrap();
    let held = MemSnapshot {
        used: 1,
        cached: 0,
        free: 7,
        index: vec![],
    };
    assert_eq!(d.store.snapshot(), held);
    assert_eq!(d.rx.expire_leases(t0 + LEASE - Duration::from_millis(1)), 0);
    assert_eq!(d.rx.pending(), 1);
    // The deadline was set at the end of the push, after t0: a moment past it expires it.
    assert_eq!(d.rx.expire_leases(Instant::now() + LEASE), 1);
    assert_eq!(d.rx.pending(), 0);
    assert_eq!(d.rx.stats().leases_expired, 1);
    assert_eq!(d.store.snapshot().used, 0);
    assert!(
        d.rx.claim("h").is_none(),
        "an expired handle cannot be claimed"
    );
}

#[test]
fn push_limits_refuse_before_taking_blocks() {
    let store = Arc::new(MemStore::new(TEST, 16));
    let limits = ReceiverLimits {
        max_pending_per_peer: Default::default(),
        max_pushes_per_peer: Default::default(),
        max_pushes: 2,
        max_blocks: 3,
        max_pending_handles: 2,
    };
    let rx = Arc::new(
        KvReceiver::new(Arc::clone(&store) as Arc<dyn KvStore>, "fake").with_limits(limits),
    );
    let base = store.snapshot();
    // Concurrent pushes: the third is refused before it reads a chunk.
    let a = rx.begin_push().unwrap();
    let b = rx.begin_push().unwrap();
    let err = Status::from(rx.begin_push().unwrap_err());
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert_eq!(rx.stats().inflight, 2);
    drop((a, b));
    assert_eq!(rx.stats().inflight, 0);
    // total above ceil(max context / B), and a HasBlocks that long: refused before any lookup.
    let err = push(&rx, vec![chunk("t", 0, 4, 0, envelope(TEST, 0, 1, 1))]).unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert_eq!(store.snapshot(), base);
    let long = HasBlocksRequest {
        hashes: [1, 2, 3, 4].to_vec(),
        kv_format: 1,
        model: "fake".into(),
        ..HasBlocksRequest::default()
    };
    let err = Status::from(rx.has_blocks(&long).unwrap_err());
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let three = HasBlocksRequest {
        hashes: [1, 2, 3].to_vec(),
        kv_format: 1,
        model: "fake".into(),
        ..HasBlocksRequest::default()
    };
    assert_eq!(rx.has_blocks(&three).unwrap(), [false; 3]);
    // Pending handles: two held, the third push is refused at its first chunk.
    push(&rx, vec![chunk("h1", 0, 1, 0, envelope(TEST, 0, 1, 1))]).unwrap();
    push(&rx, vec![chunk("h2", 0, 1, 0, envelope(TEST, 0, 1, 2))]).unwrap();
    let held = store.snapshot();
    let err = push(&rx, vec![chunk("h3", 0, 1, 0, envelope(TEST, 0, 1, 3))]).unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert_eq!(store.snapshot(), held, "the refused push took a block");
    // Paused (the engine stopped decoding): no new push, FAILED_PRECONDITION so the sender
    // tries another decode engine, and nothing taken; resumed, pushes are taken again.
    rx.set_paused(true);
    assert!(rx.is_paused());
    let err = Status::from(rx.begin_push().unwrap_err());
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(rx.stats().inflight, 0);
    assert_eq!(store.snapshot(), held, "the refused push took a block");
    rx.set_paused(false);
    assert!(!rx.is_paused());
    drop(rx.begin_push().unwrap());
    assert_eq!(rx.stats().inflight, 0);
    // Draining: no new push, but the held handles can still be claimed and released.
    rx.start_drain();
    let err = Status::from(rx.begin_push().unwrap_err());
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(rx.claim("h1").is_some());
    assert!(rx.release("h2"));
    assert_eq!(store.snapshot(), base);
}

/// What only the engine's tests used to pin, pinned by the receiver's own (found by `cargo
/// mutants`): the accessors, the wake-ups, the exact bound on a push's blocks, and the token
/// count of a prompt whose first block was deduplicated.
#[tokio::test]
async fn bounds_wakeups_and_accessors() {
    let limits = ReceiverLimits {
        max_blocks: 3,
        ..ReceiverLimits::default()
    };
    let store = Arc::new(MemStore::new(TEST, 16));
    let rx = Arc::new(
        KvReceiver::new(Arc::clone(&store) as Arc<dyn KvStore>, "m-1")
            .with_limits(limits)
            .with_lease(Duration::from_millis(40)),
    );
    assert_eq!(rx.limits(), limits);
    assert_eq!(rx.lease(), Duration::from_millis(40));
    assert_eq!(rx.model(), "m-1");
    let shown = format!("{rx:?}");
    assert!(
        shown.contains("KvReceiver") && shown.contains("m-1"),
        "{shown}"
    );

    // A push of exactly max_blocks passes; one more is refused before anything is taken.
    let before = store.snapshot();
    let over = push(&rx, vec![chunk("h-over", 0, 4, 0, envelope(TEST, 0, 4, 1))]).unwrap_err();
    assert_eq!(over.code(), Code::InvalidArgument, "{over:?}");
    assert_eq!(store.snapshot(), before);

    // A cached first block (deduplicated), then two sent: the handle holds 4 + 4 + 2 tokens.
    let h0 = block_hash(0, &[1, 2, 3, 4]);
    let h1 = block_hash(h0, &[5, 6, 7, 8]);
    let cached = store
        .put(key(h0, &PROMPT[..4], None), 4, &payload(9))
        .unwrap();
    store.release(&[cached]);
    let waiter = {
        let rx = Arc::clone(&rx);
        tokio::spawn(async move { rx.changed().await })
    };
    tokio::task::yield_now().await;
    push(
        &rx,
        vec![
            tok(chunk("h", 0, 3, h0, Bytes::new()), &PROMPT[..4]),
            tok(
                chunk("h", 1, 3, h1, envelope(TEST, h1, 4, 2)),
                &PROMPT[4..8],
            ),
            tok(chunk("h", 2, 3, 0, envelope(TEST, 0, 2, 3)), &PROMPT[8..]),
        ],
    )
    .unwrap();
    let view = rx.peek("h").unwrap();
    assert_eq!((view.hashes, view.tokens), (vec![h0, h1, 0], 10));
    assert_eq!(view.prompt.as_deref(), Some(&PROMPT[..]));
    // The push's end woke the waiter.
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("no wake-up at the push's end")
        .unwrap();

    // Nobody claims it: the lease's end frees its blocks and wakes waiters too.
    let waiter = {
        let rx = Arc::clone(&rx);
        tokio::spawn(async move { rx.changed().await })
    };
    tokio::task::yield_now().await;
    // The sweep's clock is an argument: a minute on, the lease has ended.
    assert_eq!(
        rx.expire_leases(Instant::now() + Duration::from_secs(60)),
        1
    );
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("no wake-up at the lease's end")
        .unwrap();
    assert_eq!(rx.peek("h"), None);
    assert_eq!(store.snapshot().used, 0, "blocks in use after the lease");
}

/// One peer cannot take every slot: at its own bound on pushes in progress and on handles held,
/// it is refused (RESOURCE_EXHAUSTED, nothing taken) while another peer still pushes, and its
/// slots come back as its handles are claimed.
#[test]
fn one_peer_cannot_take_every_handle() {
    let store = Arc::new(MemStore::new(TEST, 16));
    let limits = ReceiverLimits {
        max_pushes_per_peer: 1,
        max_pending_per_peer: 1,
        ..ReceiverLimits::default()
    };
    let rx = Arc::new(
        KvReceiver::new(Arc::clone(&store) as Arc<dyn KvStore>, "fake").with_limits(limits),
    );
    let one = |rx: &Arc<KvReceiver>, owner: &[u8], h: &str| -> Result<KvAck, Status> {
        let mut p = rx.begin_push_from(owner.to_vec())?;
        p.accept(chunk(h, 0, 1, 0, envelope(TEST, 0, 1, 1)))?;
        Ok(p.finish()?)
    };
    let a = rx.begin_push_from(b"P1".to_vec()).unwrap();
    let err = Status::from(rx.begin_push_from(b"P1".to_vec()).unwrap_err());
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    drop(a);
    one(&rx, b"P1", "h1").unwrap();
    let held = store.snapshot();
    let err = one(&rx, b"P1", "h2").unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert_eq!(store.snapshot(), held, "the refused push took a block");
    one(&rx, b"P2", "h3").unwrap();
    assert!(rx.claim("h1").is_some());
    one(&rx, b"P1", "h4").unwrap();
    assert!(rx.release("h3") && rx.release("h4"));
    assert_eq!(store.snapshot().used, 0);
}
