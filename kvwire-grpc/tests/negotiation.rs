//! Formats as a value in the transfer: a receiver serves the format its store stores, and a
//! sender offering several (best first) settles on the first the receiver serves, before any
//! block moves. Toy v2 here: "e5m2 by truncation", the high byte of each little-endian f16,
//! written by a view of the sender's v1 pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::BufMut;
use kvwire::{Dims, RecordIn, Shape, WireFormat, prompt_hashes};
use kvwire_grpc::memory::{LocalTransport, MemStore};
use kvwire_grpc::pb::kv::{HasBlocksRequest, KvAck};
use kvwire_grpc::sender::ChunkStream;
use kvwire_grpc::{
    BlockId, BlockKey, KvReceiver, KvStore, KvTransport, Push, StoreError, TransferError,
    transfer_formats,
};
use tonic::{Code, Status};

const V1: Shape = Shape::v1(4, 2, 1, 4);
const DIMS: Dims = V1.dims;

/// A shape of `format` with the test dimensions.
const fn shape(format: WireFormat) -> Shape {
    Shape { dims: DIMS, format }
}

const V2: WireFormat = WireFormat::new(2, 2, 1, "e5m2-toy");

/// The v1 pool seen as v2: every block written as the high bytes of its f16 values.
#[derive(Debug)]
struct HighBytes {
    pool: Arc<MemStore>,
    shape: Shape,
}

impl KvStore for HighBytes {
    fn shape(&self) -> Shape {
        self.shape
    }
    fn contains(&self, scope: u64, hashes: &[u64], tokens: &[u32]) -> Vec<bool> {
        self.pool.contains(scope, hashes, tokens)
    }
    fn take_ref(&self, key: BlockKey<'_>) -> Option<BlockId> {
        self.pool.take_ref(key)
    }
    fn import(&self, _: BlockKey<'_>, _: u32, _: &[u8]) -> Result<BlockId, StoreError> {
        unreachable!("a sending view imports nothing")
    }
    fn release(&self, ids: &[BlockId]) {
        self.pool.release(ids);
    }
    fn release_forget(&self, ids: &[BlockId]) {
        self.pool.release_forget(ids);
    }
    fn write_envelope(&self, id: BlockId, mut out: &mut dyn BufMut) -> Result<u64, StoreError> {
        let (payload, fill) = self.pool.block(id).ok_or(StoreError::NotHeld(id))?;
        let high: Vec<u8> = payload.chunks_exact(2).map(|h| h[1]).collect();
        let hash = self.pool.hash_of(id);
        let rec = RecordIn {
            hash,
            fill,
            payload: &high,
        };
        kvwire::write_envelope(&self.shape, &[rec], &mut out).map_err(StoreError::pool)?;
        Ok(hash)
    }
}

/// Counts the pushes it opens.
struct Counting {
    inner: LocalTransport,
    pushes: AtomicUsize,
}

impl KvTransport for Counting {
    async fn has_blocks(&self, target: &str, req: HasBlocksRequest) -> Result<Vec<bool>, Status> {
        self.inner.has_blocks(target, req).await
    }
    async fn push(&self, target: &str, chunks: ChunkStream) -> Result<KvAck, Status> {
        self.pushes.fetch_add(1, Ordering::SeqCst);
        self.inner.push(target, chunks).await
    }
    async fn release(&self, target: &str, handle_id: &str) -> Result<bool, Status> {
        self.inner.release(target, handle_id).await
    }
}

/// The test prompt: three full blocks of B = 4 and a tail of two.
const PROMPT: [u32; 14] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14];

/// A prompt of 3 full blocks and a tail in a v1 pool: its ids (one reference each), hashes.
fn sender() -> (Arc<MemStore>, Vec<BlockId>, Vec<u64>) {
    let pool = Arc::new(MemStore::new(V1, 16));
    let hashes = prompt_hashes(&PROMPT, 4);
    let p = V1.payload_bytes().unwrap();
    let mut ids = Vec::new();
    let (row, plane) = (V1.row_bytes().unwrap(), V1.plane_bytes().unwrap());
    for i in 0..4u8 {
        let (hash, fill) = match hashes.get(i as usize) {
            Some(&h) => (h, 4),
            None => (0, 2),
        };
        // Token slots past the fill are zeros, as the writer sends them.
        let payload: Vec<u8> = (0..p)
            .map(|j| {
                let filled = (j % plane) / row < fill as usize;
                if filled {
                    (j as u8).wrapping_mul(7) ^ i
                } else {
                    0
                }
            })
            .collect();
        let at = 4 * usize::from(i);
        let key = BlockKey {
            scope: 0,
            hash,
            tokens: &PROMPT[at..(at + 4).min(PROMPT.len())],
            parent: ids.last().copied(),
        };
        ids.push(pool.put(key, fill, &payload).unwrap());
    }
    (pool, ids, hashes)
}

/// A receiver whose store stores `format`, and a transport to it.
fn receiver(format: WireFormat) -> (Arc<MemStore>, Arc<KvReceiver>, Counting) {
    let store = Arc::new(MemStore::new(shape(format), 16));
    let rx = Arc::new(KvReceiver::new(
        Arc::clone(&store) as Arc<dyn KvStore>,
        "fake",
    ));
    let t = Counting {
        inner: LocalTransport::new(Arc::clone(&rx)),
        pushes: AtomicUsize::new(0),
    };
    (store, rx, t)
}

fn push<'a>(handle: &'a str, hashes: &'a [u64]) -> Push<'a> {
    Push {
        target: "d",
        handle_id: handle,
        model: "fake",
        hashes,
        n_blocks: 4,
        known: None,
        lookup: None,
        tokens: &PROMPT,
        scope: 0,
    }
}

#[tokio::test]
async fn mixed_version_peers_negotiate_down() {
    let (pool, ids, hashes) = sender();
    let v2_view: Arc<dyn KvStore> = Arc::new(HighBytes {
        pool: Arc::clone(&pool),
        shape: shape(V2),
    });
    let v1_store: Arc<dyn KvStore> = Arc::clone(&pool) as Arc<dyn KvStore>;
    let offer = [v2_view, v1_store];
    let before = pool.snapshot();

    // A v1-only receiver: v2 is refused at HasBlocks, v1 accepted, and the blocks arrive as the
    // sender holds them.
    let (store1, rx1, t1) = receiver(WireFormat::V1_F16);
    let s1 = transfer_formats(&t1, &offer, push("h1", &hashes), &ids)
        .await
        .unwrap();
    assert_eq!(s1.kv_format, 1);
    assert_eq!((s1.sent, s1.deduped), (4, 0));
    assert_eq!(
        t1.pushes.load(Ordering::SeqCst),
        1,
        "one push, in the agreed format"
    );
    let claimed = rx1.claim("h1").unwrap().into_ids();
    for (got, sent) in claimed.iter().zip(&ids) {
        assert_eq!(store1.block(*got), pool.block(*sent));
    }

    // A receiver that stores v2 takes the first offer: half the payload, the high bytes.
    let (store2, rx2, t2) = receiver(V2);
    let s2 = transfer_formats(&t2, &offer, push("h2", &hashes), &ids)
        .await
        .unwrap();
    assert_eq!(s2.kv_format, 2);
    assert!(s2.payload_bytes < s1.payload_bytes, "{s2:?} vs {s1:?}");
    let claimed = rx2.claim("h2").unwrap().into_ids();
    for (got, sent) in claimed.iter().zip(&ids) {
        let (v2, fill2) = store2.block(*got).unwrap();
        let (v1, fill1) = pool.block(*sent).unwrap();
        assert_eq!(fill2, fill1);
        let high: Vec<u8> = v1.chunks_exact(2).map(|h| h[1]).collect();
        assert_eq!(v2, high);
    }
    // The sender's pool is as it was: the caller still holds its one reference per block.
    assert_eq!(pool.snapshot(), before);
}

#[tokio::test]
async fn unknown_format_fails_cleanly_before_any_block_moves() {
    let (pool, ids, hashes) = sender();
    const V3: WireFormat = WireFormat::new(3, 3, 1, "unknown");
    let v3: Arc<dyn KvStore> = Arc::new(HighBytes {
        pool: Arc::clone(&pool),
        shape: shape(V3),
    });
    let before = pool.snapshot();
    for (offer, what) in [
        (vec![Arc::clone(&v3)], "v3 only"),
        (
            vec![
                Arc::clone(&v3),
                Arc::new(HighBytes {
                    pool: Arc::clone(&pool),
                    shape: shape(V2),
                }) as Arc<dyn KvStore>,
            ],
            "v3 then v2",
        ),
    ] {
        let (store, rx, t) = receiver(WireFormat::V1_F16);
        let empty = store.snapshot();
        let err = transfer_formats(&t, &offer, push("h", &hashes), &ids)
            .await
            .unwrap_err();
        let TransferError::Rpc(s) = &err else {
            panic!("{what}: {err:?}");
        };
        assert_eq!(s.code(), Code::FailedPrecondition, "{what}: {s}");
        assert!(s.message().contains("not served here"), "{what}: {s}");
        // Nothing moved: no push was opened, the receiver holds nothing, both pools unchanged.
        assert_eq!(t.pushes.load(Ordering::SeqCst), 0, "{what}");
        assert_eq!(rx.stats().pending + rx.stats().inflight, 0, "{what}");
        assert_eq!(store.snapshot(), empty, "{what}");
        assert_eq!(pool.snapshot(), before, "{what}");
    }
    // An empty offer is the caller's mistake, refused before any call.
    let (_, _, t) = receiver(WireFormat::V1_F16);
    let err = transfer_formats(&t, &[], push("h", &hashes), &ids)
        .await
        .unwrap_err();
    assert!(matches!(err, TransferError::BadRequest(_)), "{err:?}");
    assert_eq!(t.pushes.load(Ordering::SeqCst), 0);
}
