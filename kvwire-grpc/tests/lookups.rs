//! HasBlocks and Release on a port of their own ([`KvLookups`]), over real sockets: the same
//! answers as the KV port, no push taken there, and a sender that asks there falls back to the
//! KV port only when that port does not serve them.

use std::sync::{Arc, Mutex};

use kvwire::{Shape, block_hash};
use kvwire_grpc::memory::MemStore;
use kvwire_grpc::pb::kv::{HasBlocksRequest, KvAck};
use kvwire_grpc::sender::ChunkStream;
use kvwire_grpc::server::tuned_server;
use kvwire_grpc::{
    BlockId, BlockKey, GrpcTransport, H2Limits, KvReceiver, KvStore, KvTransferService,
    KvTransport, Push, TransferError, TransportConfig, has_blocks_at, serve_kv, transfer,
};
use tokio::net::TcpListener;
use tonic::{Code, Status};

const TEST: Shape = Shape::v1(4, 2, 1, 4);

/// Two full blocks and a tail of two.
const PROMPT: [u32; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

fn key<'a>(hash: u64, tokens: &'a [u32], parent: Option<BlockId>) -> BlockKey<'a> {
    BlockKey {
        scope: 0,
        hash,
        tokens,
        parent,
    }
}

/// `PROMPT` on a sending store: its blocks (one reference each) and the full blocks' hashes.
fn prompt_on(src: &MemStore) -> (Vec<BlockId>, Vec<u64>) {
    let h0 = block_hash(0, &PROMPT[..4]);
    let h1 = block_hash(h0, &PROMPT[4..8]);
    let p = TEST.payload_bytes().unwrap();
    let first = src
        .put(key(h0, &PROMPT[..4], None), 4, &vec![1; p])
        .unwrap();
    let second = src
        .put(key(h1, &PROMPT[4..8], Some(first)), 4, &vec![2; p])
        .unwrap();
    let tail = src.put(key(0, &PROMPT[8..], None), 2, &vec![3; p]).unwrap();
    (vec![first, second, tail], vec![h0, h1])
}

fn ask(hashes: &[u64]) -> HasBlocksRequest {
    HasBlocksRequest {
        hashes: hashes.to_vec(),
        kv_format: 1,
        model: "fake".into(),
        tokens: PROMPT[..hashes.len() * 4].to_vec(),
        cache_scope: 0,
    }
}

/// A gRPC transport that notes where each HasBlocks went.
struct Noting {
    inner: GrpcTransport,
    asked: Mutex<Vec<String>>,
}

impl KvTransport for Noting {
    async fn has_blocks(&self, target: &str, req: HasBlocksRequest) -> Result<Vec<bool>, Status> {
        self.asked.lock().unwrap().push(target.to_owned());
        self.inner.has_blocks(target, req).await
    }
    async fn push(&self, target: &str, chunks: ChunkStream) -> Result<KvAck, Status> {
        self.inner.push(target, chunks).await
    }
    async fn release(&self, target: &str, handle_id: &str) -> Result<bool, Status> {
        self.inner.release(target, handle_id).await
    }
    fn lookup_unreachable(&self, lookup: &str) -> bool {
        self.inner.lookup_unreachable(lookup)
    }
    fn lookup_missed(&self, lookup: &str) {
        self.inner.lookup_missed(lookup);
    }
}

/// Serves `router` on a fresh loopback port until the test ends; its address.
async fn serve(router: tonic::transport::server::Router) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
    tokio::spawn(router.serve_with_incoming(incoming));
    addr
}

#[tokio::test]
async fn lookups_answer_as_the_kv_port_and_take_no_push() {
    let store = Arc::new(MemStore::new(TEST, 16));
    let rx = Arc::new(KvReceiver::new(
        Arc::clone(&store) as Arc<dyn KvStore>,
        "fake",
    ));
    let kv = serve_kv(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        Arc::clone(&rx),
    )
    .unwrap();
    let kv = kv.local_addr().to_string();
    let lookups = KvTransferService::new(Arc::clone(&rx))
        .lookups()
        .into_service();
    let lookups = serve(tuned_server(H2Limits::default()).add_service(lookups)).await;
    let t = Noting {
        inner: GrpcTransport::new(TransportConfig::for_envelope(TEST.envelope_len(1).unwrap())),
        asked: Mutex::new(Vec::new()),
    };
    let src: Arc<MemStore> = Arc::new(MemStore::new(TEST, 16));
    let (ids, hashes) = prompt_on(&src);
    let push = |handle_id, target, lookup| Push {
        target,
        handle_id,
        model: "fake",
        hashes: &hashes,
        n_blocks: 3,
        known: None,
        lookup,
        tokens: &PROMPT,
        scope: 0,
    };

    // Nothing held yet: both ports say so.
    assert_eq!(
        t.has_blocks(&lookups, ask(&hashes)).await.unwrap(),
        [false; 2]
    );
    assert_eq!(t.has_blocks(&kv, ask(&hashes)).await.unwrap(), [false; 2]);
    t.asked.lock().unwrap().clear();

    // A push that names the lookup port asks there, and only there.
    let sent = transfer(
        &t,
        Arc::clone(&src) as Arc<dyn KvStore>,
        push("h1", &kv, Some(&lookups)),
        &ids,
    )
    .await
    .unwrap();
    assert_eq!((sent.sent, sent.deduped), (3, 0));
    assert_eq!(*t.asked.lock().unwrap(), std::slice::from_ref(&lookups));
    assert_eq!(
        t.has_blocks(&lookups, ask(&hashes)).await.unwrap(),
        [true; 2]
    );
    assert_eq!(t.has_blocks(&kv, ask(&hashes)).await.unwrap(), [true; 2]);

    // A push to the lookup port is refused before it takes anything.
    let held = store.snapshot();
    let (ids, _) = prompt_on(&src);
    let err = transfer(
        &t,
        Arc::clone(&src) as Arc<dyn KvStore>,
        push("h2", &lookups, None),
        &ids,
    )
    .await
    .unwrap_err();
    match err {
        TransferError::Rpc(s) => assert_eq!(s.code(), Code::Unimplemented, "{s:?}"),
        e => panic!("{e:?}"),
    }
    assert_eq!(store.snapshot(), held);
    assert_eq!(rx.stats().pending, 1);

    // Release there lets the handle go, once, as on the KV port.
    assert!(t.release(&lookups, "h1").await.unwrap());
    assert!(!t.release(&kv, "h1").await.unwrap());
    assert_eq!(rx.stats().pending, 0);
    assert_eq!(store.snapshot().used, 0);

    // A lookup port nobody answers on (port 1: connection refused) costs a try, not the push:
    // the KV port is asked, and finds the full blocks still cached.
    let (ids, _) = prompt_on(&src);
    t.asked.lock().unwrap().clear();
    let sent = transfer(
        &t,
        Arc::clone(&src) as Arc<dyn KvStore>,
        push("h3", &kv, Some("127.0.0.1:1")),
        &ids,
    )
    .await
    .unwrap();
    assert_eq!((sent.sent, sent.deduped), (1, 2));
    assert_eq!(*t.asked.lock().unwrap(), ["127.0.0.1:1", kv.as_str()]);
    assert!(t.release(&kv, "h3").await.unwrap());
    // And for a while after, that port is passed over: the next push asks the KV port alone.
    let (ids, _) = prompt_on(&src);
    t.asked.lock().unwrap().clear();
    transfer(
        &t,
        Arc::clone(&src) as Arc<dyn KvStore>,
        push("h4", &kv, Some("127.0.0.1:1")),
        &ids,
    )
    .await
    .unwrap();
    assert_eq!(*t.asked.lock().unwrap(), [kv.as_str()]);
    assert!(t.release(&kv, "h4").await.unwrap());
    // The lookup port that answers is never passed over.
    assert!(!t.lookup_unreachable(&lookups));
}

/// Answers HasBlocks by target: `kv` holds everything, `ctl` nothing, `old` predates lookups,
/// `down` cannot be reached, `denied` refuses the caller.
struct Scripted(Mutex<Vec<String>>);

impl KvTransport for Scripted {
    async fn has_blocks(&self, target: &str, req: HasBlocksRequest) -> Result<Vec<bool>, Status> {
        self.0.lock().unwrap().push(target.to_owned());
        match target {
            "old" => Err(Status::unimplemented("no such service")),
            "down" => Err(Status::unavailable("connection refused")),
            "denied" => Err(Status::permission_denied("not a caller of lookups")),
            _ => Ok(vec![target == "kv"; req.hashes.len()]),
        }
    }
    async fn push(&self, _: &str, _: ChunkStream) -> Result<KvAck, Status> {
        unreachable!("no push here")
    }
    async fn release(&self, _: &str, _: &str) -> Result<bool, Status> {
        unreachable!("no release here")
    }
}

#[tokio::test]
async fn a_lookup_port_is_passed_over_only_when_it_gives_no_answer() {
    let hashes = [1, 2];
    for (lookup, asked, answer) in [
        (Some("ctl"), &["ctl"][..], Ok(vec![false; 2])),
        (Some("old"), &["old", "kv"][..], Ok(vec![true; 2])),
        (Some("down"), &["down", "kv"][..], Ok(vec![true; 2])),
        (Some("denied"), &["denied"][..], Err(Code::PermissionDenied)),
        (None, &["kv"][..], Ok(vec![true; 2])),
        (Some(""), &["kv"][..], Ok(vec![true; 2])),
        (Some("kv"), &["kv"][..], Ok(vec![true; 2])),
    ] {
        let t = Scripted(Mutex::new(Vec::new()));
        let got = has_blocks_at(&t, lookup, "kv", ask(&hashes)).await;
        assert_eq!(got.map_err(|s| s.code()), answer, "{lookup:?}");
        assert_eq!(*t.0.lock().unwrap(), asked, "{lookup:?}");
    }
}
