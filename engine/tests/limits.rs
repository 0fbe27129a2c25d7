//! What one peer can take (spec/limits.md), against real engines on 127.0.0.1:0: stalled
//! and vanished pushes are undone, running sequences keep their reserve, the registry bounds
//! hostile heartbeats, and a drain honours the handles pushed before it. Every case ends with
//! the pool back at its baseline.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{TEST, eventually};
use kvwire::{RecordIn, Shape, write_to_vec};
use kvwire_grpc::pb::control::WorkerStatus;
use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use kvwire_grpc::pb::kv::KvChunk;
use kvwire_grpc::{GrpcTransport, KvTransport, OutChunk, TransportConfig};
use serde_json::json;
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::{ControlClient, HttpClient, RegistryClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

fn decode_cfg(id: &str) -> Config {
    let mut c = Config::for_worker(id, Role::Decode, "");
    c.pool.n_blocks = 64;
    c
}

fn envelope(shape: Shape, fill: u32, byte: u8) -> bytes::Bytes {
    let payload = vec![byte; shape.payload_bytes().unwrap()];
    let rec = RecordIn {
        hash: 0,
        fill,
        payload: &payload,
    };
    let mut out = Vec::new();
    write_to_vec(&shape, &[rec], &mut out).unwrap();
    out.into()
}

/// Chunk `index` of a push of `total` partial blocks (no hashes: nothing to dedup).
fn chunk(handle: &str, index: u32, total: u32) -> OutChunk {
    let payload = envelope(TEST, 1, index as u8);
    OutChunk::from(KvChunk {
        cache_scope: Default::default(),
        tokens: Default::default(),
        handle_id: handle.into(),
        index,
        total,
        hash: 0,
        kv_format: 1,
        payload_crc32c: kvwire::crc32c(&payload),
        payload,
        model: String::new(),
    })
}

/// A push whose chunks the test feeds by hand: it stalls whenever the test stops feeding.
fn open_push(
    t: &Arc<GrpcTransport>,
    addr: &str,
) -> (
    mpsc::Sender<OutChunk>,
    tokio::task::JoinHandle<Result<kvwire_grpc::pb::kv::KvAck, tonic::Status>>,
) {
    let (tx, rx) = mpsc::channel(4);
    let (t, addr) = (Arc::clone(t), addr.to_owned());
    let call = tokio::spawn(async move { t.push(&addr, Box::pin(ReceiverStream::new(rx))).await });
    (tx, call)
}

fn transport() -> Arc<GrpcTransport> {
    Arc::new(GrpcTransport::new(TransportConfig::for_envelope(
        TEST.envelope_len(1).unwrap(),
    )))
}

fn used(node: &EngineNode) -> usize {
    node.runner().pool().lock().counts().used
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_push_is_undone_after_idle_timeout() {
    let mut cfg = decode_cfg("D");
    cfg.limits.push_idle_ms = 200;
    cfg.limits.max_pushes = 1;
    let d = EngineNode::start(&cfg).await.unwrap();
    let kv = d.addresses().kv;
    let rx = Arc::clone(d.receiver().unwrap());
    let t = transport();
    // Two of three chunks, then silence.
    let (tx, call) = open_push(&t, &kv);
    tx.send(chunk("stall", 0, 3)).await.unwrap();
    tx.send(chunk("stall", 1, 3)).await.unwrap();
    assert!(eventually(Duration::from_secs(2), || used(&d) == 2).await);
    // While it stalls it holds the one push slot: another push is refused before it is read.
    let (tx2, call2) = open_push(&t, &kv);
    // (The refusal may close the call before this chunk is even taken.)
    let _ = tx2.send(chunk("second", 0, 1)).await;
    drop(tx2);
    let err = call2.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    // The stall is undone by the idle deadline, not by the client.
    let t0 = Instant::now();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(eventually(Duration::from_secs(2), || used(&d) == 0).await);
    assert_eq!(rx.stats().inflight, 0);
    assert_eq!(rx.pending(), 0);
    drop(tx);
    d.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_sequences_keep_their_reserve() {
    let mut cfg = decode_cfg("D");
    cfg.pool.n_blocks = 16;
    cfg.limits.decode_reserve_blocks = 4;
    let d = EngineNode::start(&cfg).await.unwrap();
    let kv = d.addresses().kv;
    let t = transport();
    // Pushes take every block but the reserve: 12, then a thirteenth is refused.
    let (tx, call) = open_push(&t, &kv);
    for i in 0..12 {
        tx.send(chunk("hog", i, 12)).await.unwrap();
    }
    drop(tx);
    call.await.unwrap().unwrap();
    assert_eq!(used(&d), 12);
    let (tx, call) = open_push(&t, &kv);
    tx.send(chunk("one-more", 0, 1)).await.unwrap();
    drop(tx);
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert_eq!(used(&d), 12);
    // A sequence that needs three blocks as it runs still gets them.
    let body = json!({ "prompt": [1, 2, 3, 4], "max_tokens": 8, "seed": 1 });
    let r = HttpClient::default()
        .post(
            &d.addresses().http,
            "/v1/completions",
            &[],
            body.to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.json()["choices"][0]["tokens"].as_array().unwrap().len(),
        8
    );
    assert!(d.receiver().unwrap().release("hog"));
    assert!(eventually(Duration::from_secs(2), || used(&d) == 0).await);
    d.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_bounds_hostile_heartbeats() {
    let mut cfg = GatewayConfig::local();
    cfg.limits.registry_max_workers = 3;
    let gw = GatewayNode::start(&cfg).await.unwrap();
    let reg = RegistryClient::new(&gw.registry_addr().to_string(), Duration::from_secs(2)).unwrap();
    let beat = |id: &str, ms: u32| WorkerStatus {
        worker_id: id.into(),
        heartbeat_ms: ms,
        ..WorkerStatus::default()
    };
    let refused = [
        ("empty id", beat("", 100), Code::InvalidArgument),
        (
            "129-byte id",
            beat(&"x".repeat(129), 100),
            Code::InvalidArgument,
        ),
        (
            "257-byte address",
            WorkerStatus {
                kv_address: "a".repeat(257),
                ..beat("w", 100)
            },
            Code::InvalidArgument,
        ),
        // A 2 MiB message is refused by the decoder before it is read into a status.
        (
            "2 MiB id",
            beat(&"x".repeat(2 << 20), 100),
            Code::OutOfRange,
        ),
    ];
    for (name, status, code) in refused {
        let err = reg.heartbeat(status).await.unwrap_err();
        assert_eq!(err.code(), code, "{name}: {}", err.message());
    }
    assert!(gw.registry().list(std::time::Instant::now()).is_empty());
    // heartbeat_ms is clamped, not refused.
    reg.heartbeat(beat("fast", 1)).await.unwrap();
    reg.heartbeat(beat("slow", u32::MAX)).await.unwrap();
    reg.heartbeat(beat(&"x".repeat(128), 1000)).await.unwrap();
    let ms: Vec<(usize, u32)> = gw
        .registry()
        .list(std::time::Instant::now())
        .into_iter()
        .map(|w| (w.worker_id.len(), w.heartbeat_ms))
        .collect();
    assert!(
        ms.contains(&(4, 100)) && ms.contains(&(4, 60_000)),
        "{ms:?}"
    );
    // Full: a new worker is refused, a known one may still beat.
    let err = reg.heartbeat(beat("fourth", 1000)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    reg.heartbeat(beat("fast", 100)).await.unwrap();
    assert_eq!(gw.registry().list(std::time::Instant::now()).len(), 3);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_honours_pending_handles() {
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    let p = EngineNode::start(&Config::for_worker("P", Role::Prefill, ""))
        .await
        .unwrap();
    let mut dc = decode_cfg("D");
    dc.engine.gateway_registry = reg;
    dc.engine.heartbeat_ms = 60_000;
    let d = EngineNode::start(&dc).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || gw
            .registry()
            .list(std::time::Instant::now())
            .len()
            == 1)
        .await
    );
    let (pa, da) = (p.addresses(), d.addresses());
    let ctl = ControlClient::new(&pa.grpc).unwrap();
    let prompt: Vec<u32> = (1..=10).collect();
    let prefill = |id: &str| PrefillRequest {
        cache_scope: Default::default(),
        request_id: id.into(),
        prompt_tokens: prompt.clone(),
        sampling: Some(SamplingParams {
            seed: Some(5),
            max_tokens: 6,
            ..SamplingParams::default()
        }),
        decode_target: da.kv.clone(),
        rng_draws_offset: 0,
        decode_holds: None,
        decode_lookup: String::new(),
    };
    let h = ctl.prefill(prefill("before")).await.unwrap();
    // Drain D: the pending handle is work that remains; the drain is announced at once.
    let dctl = ControlClient::new(&da.grpc).unwrap();
    assert_eq!(dctl.drain(0).await.unwrap(), 1, "the pending handle counts");
    assert!(
        eventually(Duration::from_secs(2), || gw
            .registry()
            .list(std::time::Instant::now())
            .iter()
            .any(|w| w.draining))
        .await,
        "no beat at once on drain (the interval is 60 s)"
    );
    // New pushes are refused; so is a new request on D's front.
    let err = ctl.prefill(prefill("after")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let http = HttpClient::default();
    let plain = json!({ "prompt": prompt, "max_tokens": 2, "seed": 1 });
    let r = http
        .post(&da.http, "/v1/completions", &[], plain.to_string())
        .await
        .unwrap();
    assert_eq!(r.status, 503);
    // The handle pushed before the drain is still claimed and decoded.
    let got = common::resume(&da.grpc, &prompt, &h, (0.0, 1.0, 0), 6)
        .await
        .unwrap();
    assert_eq!(got.tokens[0].len(), 6);
    assert_eq!(dctl.drain(1000).await.unwrap(), 0);
    assert_eq!(used(&d), 0);
    assert_eq!(used(&p), 0);
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
    gw.stop().await;
}

/// A TCP proxy that forwards both ways until `frozen` is set, then stops forwarding (holding
/// both connections open): a peer that vanished without a FIN or RST.
async fn freezing_proxy(upstream: String, frozen: Arc<AtomicBool>) -> String {
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
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        let pump = |mut r: tokio::net::tcp::OwnedReadHalf,
                    mut w: tokio::net::tcp::OwnedWriteHalf,
                    frozen: Arc<AtomicBool>| async move {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n) = r.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                if frozen.load(Ordering::SeqCst) {
                    // Swallow everything from now on; keep the sockets open.
                    std::future::pending::<()>().await;
                }
                if w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            (r, w)
        };
        let up = tokio::spawn(pump(cr, sw, Arc::clone(&frozen)));
        let down = tokio::spawn(pump(sr, cw, frozen));
        let _ = tokio::join!(up, down);
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_peer_is_detected_by_keepalive() {
    let mut cfg = decode_cfg("D");
    cfg.limits.keepalive_ms = 100;
    cfg.limits.keepalive_timeout_ms = 200;
    cfg.limits.push_idle_ms = 60_000;
    let d = EngineNode::start(&cfg).await.unwrap();
    let frozen = Arc::new(AtomicBool::new(false));
    let proxy = freezing_proxy(d.addresses().kv, Arc::clone(&frozen)).await;
    // The sender's own keepalive is off: only the receiver's can find the dead peer.
    let mut tc = TransportConfig::for_envelope(TEST.envelope_len(1).unwrap());
    tc.keepalive = None;
    let t = Arc::new(GrpcTransport::new(tc));
    let (tx, _call) = open_push(&t, &proxy);
    tx.send(chunk("gone", 0, 2)).await.unwrap();
    assert!(eventually(Duration::from_secs(2), || used(&d) == 1).await);
    frozen.store(true, Ordering::SeqCst);
    // No FIN, no RST, no idle deadline for a minute: the unanswered pings close the connection,
    // and the push is undone.
    let t0 = Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || used(&d) == 0).await,
        "the vanished push still holds blocks"
    );
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert_eq!(d.receiver().unwrap().stats().inflight, 0);
    drop(tx);
    d.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_front_bounds_requests_in_flight() {
    let mut cfg = decode_cfg("D");
    cfg.limits.http_max_inflight = 1;
    cfg.model.decode_us_per_seq = 2000;
    let d = EngineNode::start(&cfg).await.unwrap();
    let http = HttpClient::default();
    let addr = d.addresses().http;
    let long = json!({ "prompt": [1, 2, 3], "max_tokens": 2000, "seed": 1, "stream": true });
    let (status, body) = http
        .post_streaming(&addr, "/v1/completions", &[], long.to_string())
        .await
        .unwrap();
    assert_eq!(status, 200);
    let short = json!({ "prompt": [1, 2, 3], "max_tokens": 1, "seed": 1 });
    let r = http
        .post(&addr, "/v1/completions", &[], short.to_string())
        .await
        .unwrap();
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    // The client leaves: its sequence is cancelled, the slot and the blocks come back.
    drop(body);
    assert!(eventually(Duration::from_secs(3), || used(&d) == 0).await);
    assert!(
        eventually(Duration::from_secs(3), || d.runner().running() == 0).await,
        "the abandoned sequence still runs"
    );
    let mut ok = false;
    for _ in 0..50 {
        let r = http
            .post(&addr, "/v1/completions", &[], short.to_string())
            .await
            .unwrap();
        if r.status == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "the slot was not given back");
    d.shutdown(Duration::from_secs(1)).await;
}
