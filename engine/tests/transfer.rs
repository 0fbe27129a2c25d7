//! The deduplicating transfer end to end over loopback gRPC: what moves, what is refused, and
//! that every path, happy or not, leaves both pools as they were.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use kvwire::{RecordIn, Shape, block_hash, crc32c, write_to_vec};
use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use kvwire_grpc::pb::kv::{HasBlocksRequest, KvAck, KvChunk};
use kvwire_grpc::sender::ChunkStream;
use kvwire_grpc::{GrpcTransport, KvTransport, OutChunk, transfer};
use tl_engine::net::clients::ControlClient;
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tokio_stream::StreamExt;
use tonic::{Code, Status};

const LEASE: Duration = Duration::from_secs(30);

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| (seed * 31 + i * 7) % 256).collect()
}

/// A one-block envelope of the test shape with a recognisable payload.
fn envelope(shape: Shape, hash: u64, fill: u32, byte: u8) -> Bytes {
    let payload = vec![byte; shape.payload_bytes().unwrap()];
    let mut out = Vec::new();
    write_to_vec(
        &shape,
        &[RecordIn {
            hash,
            fill,
            payload: &payload,
        }],
        &mut out,
    )
    .unwrap();
    Bytes::from(out)
}

fn chunk(handle: &str, index: u32, total: u32, hash: u64, payload: Bytes) -> KvChunk {
    let payload_crc32c = if payload.is_empty() {
        0
    } else {
        crc32c(&payload)
    };
    KvChunk {
        cache_scope: Default::default(),
        tokens: Default::default(),
        handle_id: handle.into(),
        index,
        total,
        hash,
        kv_format: 1,
        payload,
        payload_crc32c,
        model: String::new(),
    }
}

async fn push_raw(t: &GrpcTransport, addr: &str, chunks: Vec<KvChunk>) -> Result<KvAck, Status> {
    t.push(
        addr,
        Box::pin(tokio_stream::iter(chunks.into_iter().map(OutChunk::from))),
    )
    .await
}

/// A push of model `fake` to `target`.
fn push_of<'a>(
    target: &'a str,
    handle_id: &'a str,
    hashes: &'a [u64],
    n_blocks: usize,
    tokens: &'a [u32],
) -> kvwire_grpc::Push<'a> {
    kvwire_grpc::Push {
        scope: 0,
        tokens,
        target,
        handle_id,
        model: "fake",
        hashes,
        n_blocks,
        known: None,
        lookup: None,
    }
}

/// The receiver's rules are tested in memory (`kvwire-grpc/tests/receiver.rs`); over a real
/// socket, each refusal keeps its code, an imported block arrives byte for byte in the engine's
/// pool, and the pool is unchanged by every refused push.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_refusals_keep_their_codes_over_grpc() {
    let d = decode_side(TEST, 8, LEASE).await;
    let t = transport(TEST);
    let mut p = engine(TEST, 16);
    let out = prefill(&mut p, &prompt(1, 10));
    let st = transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "h1",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert_eq!((st.sent, st.deduped), (3, 0));
    let claimed = d.rx.claim("h1").unwrap();
    {
        let (src, dst) = (p.pool().lock(), d.pool.lock());
        for (&a, &b) in out.blocks.ids().iter().zip(claimed.ids()) {
            assert_eq!(src.export(a).unwrap(), dst.export(b).unwrap());
        }
    }
    drop(claimed);
    drop(out);

    let good_hash = block_hash(77, &[1, 2, 3, 4]);
    let good = || chunk("bad", 0, 2, good_hash, envelope(TEST, good_hash, 4, 1));
    let mut wrong_format = chunk("bad", 1, 2, 0, envelope(TEST, 0, 1, 2));
    wrong_format.kv_format = 2;
    let mut wrong_crc = chunk("bad", 1, 2, 0, envelope(TEST, 0, 1, 2));
    wrong_crc.payload_crc32c ^= 1;
    let cases = [
        (
            "kv_format 2",
            vec![good(), wrong_format],
            Code::FailedPrecondition,
        ),
        (
            "index skips",
            vec![good(), chunk("bad", 2, 2, 0, envelope(TEST, 0, 1, 2))],
            Code::InvalidArgument,
        ),
        ("chunk crc", vec![good(), wrong_crc], Code::DataLoss),
        (
            "empty, not held",
            vec![good(), chunk("bad", 1, 2, 12345, Bytes::new())],
            Code::NotFound,
        ),
    ];
    let before = snapshot(&d.pool);
    for (name, chunks, code) in cases {
        let err = push_raw(&t, &d.addr, chunks).await.unwrap_err();
        assert_eq!(err.code(), code, "{name}: {err}");
        assert_eq!(snapshot(&d.pool), before, "{name} changed the pool");
    }
    let room = d.pool.lock().available();
    let hog = d.pool.lock().allocate(room).unwrap();
    let full = snapshot(&d.pool);
    let err = push_raw(
        &t,
        &d.addr,
        vec![chunk("full", 0, 1, 0, envelope(TEST, 0, 1, 1))],
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(snapshot(&d.pool), full);
    for id in hog {
        d.pool.lock().release(id).unwrap();
    }
    assert_eq!(snapshot(&d.pool).counts.used, 0);
    assert_eq!(snapshot(p.pool()).counts.used, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_the_handle() {
    let d = decode_side(TEST, 32, LEASE).await;
    let t = transport(TEST);
    let mut p = engine(TEST, 32);
    let baseline = snapshot(&d.pool);
    let out = prefill(&mut p, &prompt(2, 11));
    transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "r1",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    // The transfer took no reference of its own on the prefill side: only the prefill output's.
    assert_eq!(snapshot(p.pool()).counts.used, 3);
    drop(out);
    assert_eq!(
        snapshot(p.pool()).counts.used,
        0,
        "the prefill pool holds references after a push"
    );
    assert_eq!(d.rx.pending(), 1);
    assert_eq!(snapshot(&d.pool).counts.used, 3);
    assert!(t.release(&d.addr, "r1").await.unwrap());
    assert_eq!(d.rx.pending(), 0);
    let after = snapshot(&d.pool);
    assert_eq!(after.counts.used, 0);
    assert_eq!(after.counts.cached, 2, "full blocks stay cached for dedup");
    assert!(!t.release(&d.addr, "r1").await.unwrap(), "second release");
    assert!(
        !t.release(&d.addr, "never-seen").await.unwrap(),
        "unknown handle"
    );
    assert_eq!(snapshot(&d.pool), after);
    assert_eq!(baseline.counts.used, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_moved_are_missing_blocks_plus_tail() {
    let d = decode_side(TEST, 64, LEASE).await;
    let t = transport(TEST);
    let mut p = engine(TEST, 64);
    let per_block = (44 + TEST.payload_bytes().unwrap()) as u64;
    let long = prompt(3, 22); // F = 5 full blocks, tail t = 1
    // Nothing cached: k = 0.
    let out = prefill(&mut p, &long);
    let st = transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "b0",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert_eq!(
        (st.sent, st.deduped, st.payload_bytes),
        (6, 0, 6 * per_block)
    );
    d.rx.release("b0");
    drop(out);
    // A prefix cached: a prompt sharing the first 3 blocks, then 2 new full blocks and a tail.
    let mut shared = long[..12].to_vec();
    shared.extend(prompt(4, 10));
    let out = prefill(&mut p, &shared);
    assert_eq!(out.hashes.len(), 5);
    let st = transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "b1",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert_eq!(
        (st.sent, st.deduped, st.payload_bytes),
        (3, 3, 3 * per_block)
    );
    d.rx.release("b1");
    drop(out);
    // All cached: an exact multiple of B (no tail) whose blocks are all held.
    let out = prefill(&mut p, &long[..20]);
    let st = transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "b2",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert_eq!((st.sent, st.deduped, st.payload_bytes), (0, 5, 0));
    d.rx.release("b2");
    drop(out);
    assert_eq!(snapshot(&d.pool).counts.used, 0);
    assert_eq!(snapshot(p.pool()).counts.used, 0);
}

/// Forwards one connection to `upstream`, cutting both directions once `limit` bytes went up.
async fn cutting_proxy(upstream: String, limit: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
            return;
        };
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let down = tokio::spawn(async move {
            let _ = tokio::io::copy(&mut sr, &mut cw).await;
        });
        let mut sent = 0;
        let mut buf = vec![0u8; 16 * 1024];
        while sent < limit {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let n = n.min(limit - sent);
            if sw.write_all(&buf[..n]).await.is_err() {
                break;
            }
            sent += n;
        }
        // Cut: drop both halves of both connections (RST/FIN mid-stream).
        down.abort();
    });
    addr
}

/// An engine of `role` at a 16 KiB-block shape (B=4, L=8, H=4, D=32), so a cut lands in the
/// middle of the payloads.
async fn node(id: &str, role: Role) -> EngineNode {
    let mut c = Config::for_worker(id, role, "");
    c.model.n_layers = 8;
    c.model.n_kv_heads = 4;
    c.model.head_dim = 32;
    c.pool.n_blocks = 64;
    EngineNode::start(&c).await.unwrap()
}

/// A push started by a real Prefill (EngineControl on P) and cut mid-stream by a proxy in front
/// of D, then one refused by D: each time P's pool returns to its baseline, D's too (counts and
/// index), and the next Prefill goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_reset_frees_both_sides() {
    let p = node("P", Role::Prefill).await;
    let d = node("D", Role::Decode).await;
    let (pool_p, pool_d) = (p.runner().pool().clone(), d.runner().pool().clone());
    let rx = d.receiver().unwrap();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let kv = d.addresses().kv;
    let (p_base, d_base) = (snapshot(&pool_p), snapshot(&pool_d));
    let request = |id: &str, seed: u32, target: &str| PrefillRequest {
        cache_scope: Default::default(),
        request_id: id.into(),
        prompt_tokens: prompt(seed, 40), // 10 blocks, 160 KiB
        sampling: Some(SamplingParams {
            seed: Some(1),
            max_tokens: 4,
            ..SamplingParams::default()
        }),
        decode_target: target.into(),
        rng_draws_offset: 0,
        decode_holds: None,
        decode_lookup: String::new(),
    };
    // P's prompts stay cached there (refcount 0): the baseline to return to is "nothing used".
    let p_back = |what: &str| {
        let now = snapshot(&pool_p);
        assert_eq!(
            now.counts.used, p_base.counts.used,
            "P after {what}: {now:?}"
        );
    };
    let d_back = |what: &str| {
        let now = snapshot(&pool_d);
        assert_eq!(now, d_base, "D after {what}");
        assert_eq!(
            (rx.pending(), rx.stats().inflight),
            (0, 0),
            "D after {what}"
        );
    };

    // Cut mid-stream: a connection lost mid-push is UNAVAILABLE (the gateway may retry
    // elsewhere); the decode side notices the broken stream and undoes the push.
    let proxy = cutting_proxy(kv.clone(), 60 * 1024).await;
    let err = ctl.prefill(request("cut", 5, &proxy)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(
        eventually(Duration::from_secs(5), || rx.stats().inflight == 0).await,
        "push still in flight"
    );
    assert!(
        eventually(Duration::from_secs(5), || pool_p.counts().used
            == p_base.counts.used)
        .await
    );
    p_back("a cut push");
    d_back("a cut push");

    // Refused by D: every block it could take is taken, so the import is RESOURCE_EXHAUSTED.
    let room = pool_d.lock().available();
    let hog = pool_d.lock().allocate(room).unwrap();
    let err = ctl.prefill(request("refused", 6, &kv)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    {
        let mut pool = pool_d.lock();
        for id in hog {
            pool.release(id).unwrap();
        }
    }
    assert!(
        eventually(Duration::from_secs(5), || pool_p.counts().used
            == p_base.counts.used)
        .await
    );
    p_back("a refused push");
    d_back("a refused push");

    // Both sides keep serving: the same prompt goes through directly.
    let h = ctl.prefill(request("after", 5, &kv)).await.unwrap();
    assert_eq!((h.blocks_sent, h.blocks_deduped), (10, 0));
    assert!(rx.release(&h.handle_id));
    p_back("a good push");
    assert_eq!(snapshot(&pool_d).counts.used, 0);
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_push_frees_decode_blocks() {
    let d = decode_side(TEST, 32, LEASE).await;
    let t = transport(TEST);
    let base = snapshot(&d.pool);
    let ten: Vec<KvChunk> = (0..10u32)
        .map(|i| chunk("gone", i, 10, 0, envelope(TEST, 0, 1, i as u8)))
        .collect();

    // Sends 5 of 10 chunks, then never ends the stream; the client gives up and drops the call.
    let five = tokio_stream::iter(ten[..5].to_vec())
        .map(OutChunk::from)
        .chain(tokio_stream::pending());
    let call = t.push(&d.addr, Box::pin(five) as ChunkStream);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), call)
            .await
            .is_err()
    );
    assert!(eventually(Duration::from_secs(5), || d.rx.stats().inflight == 0).await);
    assert_eq!(snapshot(&d.pool), base);

    // Half-closes after 5 of 10: INVALID_ARGUMENT, and the pool is clean.
    let err = push_raw(&t, &d.addr, ten[..5].to_vec()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(snapshot(&d.pool), base);
    assert_eq!(d.rx.pending(), 0);
}

/// Wraps a transport: evicts the decode side's cached blocks right after HasBlocks, and counts
/// pushes and payload chunks.
struct EvictingTransport {
    inner: GrpcTransport,
    decode_pool: tl_engine_core::pool::SharedKv,
    pushes: AtomicU32,
    payloads: Arc<AtomicU32>,
}

impl KvTransport for EvictingTransport {
    async fn has_blocks(&self, target: &str, req: HasBlocksRequest) -> Result<Vec<bool>, Status> {
        let r = self.inner.has_blocks(target, req).await;
        // Evict every cached block: take all available blocks, then give them back (free).
        let mut pool = self.decode_pool.lock();
        let n = pool.available();
        let ids = pool.allocate(n).unwrap();
        for id in ids {
            pool.release(id).unwrap();
        }
        r
    }

    async fn push(&self, target: &str, chunks: ChunkStream) -> Result<KvAck, Status> {
        self.pushes.fetch_add(1, Ordering::SeqCst);
        let payloads = Arc::clone(&self.payloads);
        let counted = chunks.map(move |c: OutChunk| {
            if c.has_payload() {
                payloads.fetch_add(1, Ordering::SeqCst);
            }
            c
        });
        self.inner.push(target, Box::pin(counted)).await
    }

    async fn release(&self, target: &str, handle_id: &str) -> Result<bool, Status> {
        self.inner.release(target, handle_id).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_block_is_resent() {
    let d = decode_side(TEST, 32, LEASE).await;
    let plain = transport(TEST);
    let mut p = engine(TEST, 32);
    let pr = prompt(6, 14); // 3 full blocks and a tail
    let out = prefill(&mut p, &pr);
    // Warm the decode side so HasBlocks says "present" for all three full blocks.
    transfer(
        &plain,
        store(p.pool()),
        push_of(
            &d.addr,
            "warm",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert!(d.rx.release("warm"));
    assert_eq!(snapshot(&d.pool).counts.cached, 3);

    let t = EvictingTransport {
        inner: transport(TEST),
        decode_pool: d.pool.clone(),
        pushes: AtomicU32::new(0),
        payloads: Arc::new(AtomicU32::new(0)),
    };
    let st = transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "evicted",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert_eq!(t.pushes.load(Ordering::SeqCst), 2);
    assert_eq!(st.resent, 4);
    assert_eq!((st.sent, st.deduped), (4, 0));
    // First push: the tail only (its first empty chunk hit NOT_FOUND, possibly before the tail
    // was produced); second push: every payload exactly once.
    let payloads = t.payloads.load(Ordering::SeqCst);
    assert!(
        (4..=5).contains(&payloads),
        "{payloads} payload chunks produced"
    );
    let c = d.rx.claim("evicted").unwrap();
    {
        let (src, dst) = (p.pool().lock(), d.pool.lock());
        for (&a, &b) in out.blocks.ids().iter().zip(c.ids()) {
            assert_eq!(src.export(a).unwrap(), dst.export(b).unwrap());
        }
    }
    drop(c);
    drop(out);
    assert_eq!(snapshot(&d.pool).counts.used, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handle_lease_expires() {
    let d = decode_side(TEST, 32, Duration::from_millis(200)).await;
    let t = transport(TEST);
    let mut p = engine(TEST, 32);
    let base = snapshot(&d.pool);
    let out = prefill(&mut p, &prompt(7, 6));
    transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "lease-a",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "lease-b",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    drop(out);
    let claimed = d.rx.claim("lease-b").unwrap();
    assert!(eventually(Duration::from_secs(3), || d.rx.pending() == 0).await);
    assert_eq!(d.rx.stats().leases_expired, 1);
    // The claimed handle's blocks are untouched by the lease.
    {
        let pool = d.pool.lock();
        for &id in claimed.ids() {
            assert!(pool.info(id).unwrap().2 >= 1);
        }
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        claimed
            .ids()
            .iter()
            .all(|&id| d.pool.lock().info(id).unwrap().2 >= 1)
    );
    drop(claimed);
    let after = snapshot(&d.pool);
    assert_eq!(after.counts.used, base.counts.used);
    assert_eq!(d.rx.stats().leases_expired, 1);
}

/// HasBlocks is free on the decode side's real path: the engine's `KvStore` (`PoolStore`), the
/// receiver's handler and the RPC each answer without taking a reference or changing any count,
/// the index or the LRU; the pool's own lookup likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn has_blocks_takes_no_reference() {
    let d = decode_side(TEST, 32, LEASE).await;
    let t = transport(TEST);
    let mut p = engine(TEST, 32);
    let out = prefill(&mut p, &prompt(8, 9));
    transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "hb",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    d.rx.release("hb");
    let before = snapshot(&d.pool);
    // Both full blocks are cached (refcount 0) on the decode side now.
    assert_eq!((before.counts.used, before.counts.cached), (0, 2));
    let mut hashes = out.hashes.clone();
    hashes.push(424_242);
    let mut tokens = out.prompt[..8].to_vec();
    tokens.extend([1, 2, 3, 4]);
    let ask = || HasBlocksRequest {
        hashes: hashes.clone(),
        kv_format: 1,
        model: "fake".into(),
        tokens: tokens.clone(),
        cache_scope: 0,
    };
    // In process: the pool, the store and the receiver, each asked three times.
    for _ in 0..3 {
        {
            let pool = d.pool.lock();
            assert_eq!(pool.lookup_prefix(0, &hashes, &tokens).len(), 2);
        }
        assert_eq!(
            d.rx.store().contains(0, &hashes, &tokens),
            [true, true, false]
        );
        assert_eq!(d.rx.has_blocks(&ask()).unwrap(), [true, true, false]);
        assert_eq!(
            snapshot(&d.pool),
            before,
            "an in-process HasBlocks changed the pool"
        );
    }
    // A lookup does not refresh the LRU: the first cached block is still the next eviction.
    let lru_first = d.pool.lock().lookup_prefix(0, &hashes, &tokens)[0];
    // Over the RPC.
    for _ in 0..3 {
        let req = ask();
        assert_eq!(
            t.has_blocks(&d.addr, req).await.unwrap(),
            [true, true, false]
        );
    }
    assert_eq!(snapshot(&d.pool), before);
    for (fmt, model, code) in [
        (2, "fake", Code::FailedPrecondition),
        (0, "", Code::FailedPrecondition),
        (1, "other", Code::FailedPrecondition),
    ] {
        let req = HasBlocksRequest {
            kv_format: fmt,
            model: model.into(),
            ..ask()
        };
        assert_eq!(t.has_blocks(&d.addr, req).await.unwrap_err().code(), code);
    }
    assert_eq!(snapshot(&d.pool), before);
    let free = before.counts.free;
    let taken = d.pool.lock().allocate(free + 1).unwrap();
    assert_eq!(taken[free], lru_first, "HasBlocks refreshed the LRU");
    let mut pool = d.pool.lock();
    for id in taken {
        pool.release(id).unwrap();
    }
    drop(pool);
    drop(out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_transfers_with_shared_prefixes() {
    let d = decode_side(TEST, 512, LEASE).await;
    let t = Arc::new(transport(TEST));
    let mut p = engine(TEST, 512);
    let base = snapshot(&d.pool);
    let system: Vec<u32> = prompt(9, 16); // 4 shared blocks
    let mut outs = Vec::new();
    for i in 0..16u32 {
        let mut pr = system.clone();
        pr.extend(prompt(100 + i, 5 + i % 7));
        outs.push(prefill(&mut p, &pr));
    }
    let mut tasks = Vec::new();
    for (i, out) in outs.iter().enumerate() {
        let (t, addr, st) = (Arc::clone(&t), d.addr.clone(), store(p.pool()));
        let (ids, hashes) = (out.blocks.ids().to_vec(), out.hashes.clone());
        let tokens = out.prompt.clone();
        tasks.push(tokio::spawn(async move {
            transfer(
                t.as_ref(),
                st,
                push_of(&addr, &format!("c{i}"), &hashes, ids.len(), &tokens),
                &ids,
            )
            .await
        }));
    }
    let mut deduped = 0;
    for task in tasks {
        let st = task.await.unwrap().unwrap();
        deduped += st.deduped;
    }
    assert_eq!(d.rx.pending(), 16);
    {
        let pool = d.pool.lock();
        pool.check().unwrap();
        // The shared prefix blocks are registered once; every handle holds a reference on them
        // (imported, or deduped against a block another push registered).
        let shared = pool.lookup_prefix(0, &outs[0].hashes[..4], &outs[0].prompt);
        assert_eq!(shared.len(), 4);
        for id in shared {
            assert!(pool.info(id).unwrap().2 >= 1);
        }
    }
    for i in 0..16 {
        assert!(d.rx.release(&format!("c{i}")));
    }
    drop(outs);
    let after = snapshot(&d.pool);
    assert_eq!(after.counts.used, base.counts.used);
    assert_eq!(
        after.counts.used + after.counts.cached + after.counts.free,
        after.counts.total
    );
    assert_eq!(snapshot(p.pool()).counts.used, 0);
    // Concurrent pushes may all import the prefix (HasBlocks raced), but a later transfer dedups.
    let _ = deduped;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_target_is_unavailable() {
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().to_string()
    };
    let t = transport(TEST);
    let mut p = engine(TEST, 16);
    let out = prefill(&mut p, &prompt(10, 9));
    let err = transfer(
        &t,
        store(p.pool()),
        push_of(
            &closed,
            "u",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let err = transfer(
        &t,
        store(p.pool()),
        push_of(
            "not a target",
            "u",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    drop(out);
    assert_eq!(snapshot(p.pool()).counts.used, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompt_at_a_small_block_shape() {
    // 1,000 blocks of 172 bytes: the HasBlocks request (1,000 hashes, about 10 KB) is far larger
    // than one envelope, which once made the message limit refuse it.
    let d = decode_side(TEST, 4096, LEASE).await;
    let t = transport(TEST);
    let mut p = engine(TEST, 4096);
    let out = prefill(&mut p, &prompt(11, 4000));
    assert_eq!(out.hashes.len(), 1000);
    let st = transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "long",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert_eq!((st.sent, st.deduped), (1000, 0));
    let st = transfer(
        &t,
        store(p.pool()),
        push_of(
            &d.addr,
            "long-again",
            &out.hashes,
            out.blocks.ids().len(),
            &out.prompt,
        ),
        out.blocks.ids(),
    )
    .await
    .unwrap();
    assert_eq!((st.sent, st.deduped), (0, 1000));
    assert!(d.rx.release("long") && d.rx.release("long-again"));
    drop(out);
    assert_eq!(snapshot(&d.pool).counts.used, 0);
}
