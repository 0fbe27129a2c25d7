//! Pushes over gRPC into a service whose large imports run on an [`ImportLane`]: the blocks
//! arrive as they left, and a push refused part-way (the store fills up on the lane thread)
//! leaves the receiving store exactly as it was.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvwire::{Shape, prompt_hashes};
use kvwire_grpc::memory::MemStore;
use kvwire_grpc::server::tuned_server;
use kvwire_grpc::{
    BlockId, BlockKey, GrpcTransport, H2Limits, ImportLane, KvReceiver, KvStore, KvTransferService,
    Push, ServiceLimits, TransportConfig, transfer,
};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::server::TcpIncoming;

/// 64 KiB of payload a block: above the size from which imports leave the async workers.
const BIG: Shape = Shape::v1(16, 4, 2, 128);
const BLOCKS: usize = 6;

fn prompt() -> Vec<u32> {
    (0..(BLOCKS * 16) as u32).map(|t| t * 3 + 1).collect()
}

fn sender() -> (Arc<MemStore>, Vec<BlockId>, Vec<u64>) {
    let store = Arc::new(MemStore::new(BIG, BLOCKS));
    let tokens = prompt();
    let hashes = prompt_hashes(&tokens, 16);
    let p = BIG.payload_bytes().unwrap();
    let mut ids = Vec::new();
    for (i, &hash) in hashes.iter().enumerate() {
        let payload: Vec<u8> = (0..p)
            .map(|j| (j as u8).wrapping_mul(31) ^ i as u8)
            .collect();
        let key = BlockKey {
            scope: 0,
            hash,
            tokens: &tokens[16 * i..16 * (i + 1)],
            parent: ids.last().copied(),
        };
        ids.push(store.put(key, 16, &payload).unwrap());
    }
    (store, ids, hashes)
}

/// Serves `rx` on 127.0.0.1:0 with an import lane; the lane's threads are counted as they
/// start. Returns the address and the stop signal.
async fn serve(rx: Arc<KvReceiver>, started: Arc<AtomicUsize>) -> (String, CancellationToken) {
    let lane = ImportLane::with_thread_start("test-import", 2, move || {
        started.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let limits = ServiceLimits {
        import_wait: std::time::Duration::ZERO,
        ..ServiceLimits::default()
    };
    let svc = KvTransferService::with_limits(rx, limits)
        .with_import_lane(lane)
        .into_service();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let server = tuned_server(H2Limits::default())
        .add_service(svc)
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), stop.clone().cancelled_owned());
    tokio::spawn(server);
    (addr, stop)
}

/// A receiver over an empty store of `blocks` blocks.
fn receiver(blocks: usize) -> (Arc<MemStore>, Arc<KvReceiver>) {
    let store = Arc::new(MemStore::new(BIG, blocks));
    let rx = Arc::new(KvReceiver::new(
        Arc::clone(&store) as Arc<dyn KvStore>,
        "fake",
    ));
    (store, rx)
}

fn push<'a>(target: &'a str, handle: &'a str, hashes: &'a [u64], tokens: &'a [u32]) -> Push<'a> {
    Push {
        target,
        handle_id: handle,
        model: "fake",
        hashes,
        n_blocks: BLOCKS,
        known: None,
        lookup: None,
        tokens,
        scope: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_through_the_lane_arrives_whole_and_a_refused_one_is_undone() {
    let (src, ids, hashes) = sender();
    let tokens = prompt();
    let transport = GrpcTransport::new(TransportConfig::for_envelope(BIG.envelope_len(1).unwrap()));

    // Room for every block: the push arrives byte for byte.
    let (store, rx) = receiver(BLOCKS);
    let started = Arc::new(AtomicUsize::new(0));
    let (addr, stop) = serve(Arc::clone(&rx), Arc::clone(&started)).await;
    let st = transfer(
        &transport,
        Arc::clone(&src) as Arc<dyn KvStore>,
        push(&addr, "whole", &hashes, &tokens),
        &ids,
    )
    .await
    .unwrap();
    assert_eq!(st.sent as usize, BLOCKS);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while started.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < end {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert_eq!(
        started.load(Ordering::SeqCst),
        2,
        "the lane's threads ran their start hook"
    );
    let claimed = rx.claim("whole").unwrap();
    let bytes = |s: &MemStore, id| {
        let mut v = Vec::new();
        s.write_envelope(id, &mut v).unwrap();
        v
    };
    for (&a, &b) in ids.iter().zip(claimed.ids()) {
        assert_eq!(bytes(&src, a), bytes(&store, b), "block bytes differ");
    }
    drop(claimed);
    stop.cancel();

    // Room for half: the push is refused when the store is full, after the blocks that fitted
    // were imported on the lane; it is undone and the store is as it was.
    let (small, rx) = receiver(BLOCKS / 2);
    let (addr, stop) = serve(Arc::clone(&rx), Arc::new(AtomicUsize::new(0))).await;
    let before = small.snapshot();
    let err = transfer(
        &transport,
        Arc::clone(&src) as Arc<dyn KvStore>,
        push(&addr, "half", &hashes, &tokens),
        &ids,
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    // The undo runs when the server's push state is dropped, just after the status is sent.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while small.snapshot() != before && std::time::Instant::now() < end {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        small.snapshot(),
        before,
        "the refused push left blocks behind"
    );
    assert_eq!(rx.stats().pending, 0);
    assert!(rx.claim("half").is_none());
    stop.cancel();
}
