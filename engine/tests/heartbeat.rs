//! The heartbeat client and the worker registry: fields, failure counting, the sticky drain,
//! the schedule, and the real gRPC registry.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvwire_grpc::pb::control::{HeartbeatAck, Role as PbRole, WorkerStatus};
use kvwire_grpc::{GrpcTransport, TransportConfig};
use tl_engine::config::{Config, Role};
use tl_engine::control::Worker;
use tl_engine::engine::Engine;
use tl_engine::node::RegistryNode;
use tl_engine::registry::{
    Addresses, GrpcRegistry, Heartbeat, Registry, spawn_heartbeat, worker_status,
};
use tl_engine::runner::Runner;
use tonic::{Code, Status};

#[derive(Clone, Copy, Debug)]
enum Reply {
    Ack(bool),
    Fail,
    Hang,
}

#[derive(Default)]
struct FakeRegistry {
    replies: Mutex<VecDeque<Reply>>,
    seen: Mutex<Vec<(Instant, WorkerStatus)>>,
}

impl FakeRegistry {
    fn with(replies: &[Reply]) -> Arc<Self> {
        Arc::new(Self {
            replies: Mutex::new(replies.iter().copied().collect()),
            seen: Mutex::default(),
        })
    }
}

impl Registry for FakeRegistry {
    async fn heartbeat(&self, status: WorkerStatus) -> Result<HeartbeatAck, Status> {
        self.seen.lock().unwrap().push((Instant::now(), status));
        let next = self
            .replies
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Reply::Ack(false));
        match next {
            Reply::Ack(drain) => Ok(HeartbeatAck { drain }),
            Reply::Fail => Err(Status::unavailable("down")),
            Reply::Hang => std::future::pending().await,
        }
    }
}

fn worker(id: &str, role: Role) -> Worker {
    let cfg = Config::default();
    let (runner, _) = Runner::start(Engine::new(cfg.build_model(), cfg.build_pool()));
    let transport = GrpcTransport::new(TransportConfig::for_envelope(172));
    Worker::new(id, role, runner, transport, None)
}

fn status(q: u32) -> WorkerStatus {
    WorkerStatus {
        worker_id: "w".into(),
        queue_depth: q,
        heartbeat_ms: 100,
        ..Default::default()
    }
}

#[test]
fn worker_status_fields() {
    let addrs = Addresses {
        http: "127.0.0.1:3".into(),
        grpc: "127.0.0.1:1".into(),
        kv: "127.0.0.1:2".into(),
    };
    let p = worker("p", Role::Prefill);
    let s = worker_status(&p, &addrs, 250);
    assert_eq!(
        (s.worker_id.as_str(), s.role, s.kv_format, s.heartbeat_ms),
        ("p", PbRole::Prefill as i32, 1, 250)
    );
    assert_eq!(
        s.kv_address, "",
        "only a decode engine advertises kv_address"
    );
    assert_eq!(s.http_address, "");
    assert_eq!(s.grpc_address, "127.0.0.1:1");
    assert_eq!(
        (
            s.model.as_str(),
            s.block_tokens,
            s.total_blocks,
            s.free_blocks
        ),
        ("fake", 4, 1024, 1024)
    );
    assert!(!s.draining);
    for (role, pb) in [(Role::Decode, PbRole::Decode), (Role::Both, PbRole::Both)] {
        let d = worker("d", role);
        let s = worker_status(&d, &addrs, 250);
        assert_eq!(s.role, pb as i32);
        assert_eq!(s.kv_address, "127.0.0.1:2");
        assert_eq!(s.http_address, "127.0.0.1:3");
    }
    // Live load: blocks taken show at once, and a drain shows in the next status.
    let held = p.runner().pool().lock().allocate(10).unwrap();
    assert_eq!(worker_status(&p, &addrs, 250).free_blocks, 1014);
    p.start_drain();
    assert!(worker_status(&p, &addrs, 250).draining);
    for id in held {
        p.runner().pool().lock().release(id).unwrap();
    }
}

#[tokio::test]
async fn beat_once_counts_failures_and_drain() {
    let reg = FakeRegistry::with(&[
        Reply::Fail,
        Reply::Hang,
        Reply::Ack(false),
        Reply::Fail,
        Reply::Ack(true),
        Reply::Ack(false),
    ]);
    let hb = Heartbeat::new(Arc::clone(&reg), Duration::from_millis(100));
    assert_eq!(
        hb.beat_once(status(0)).await.unwrap_err().code(),
        Code::Unavailable
    );
    assert_eq!(hb.failures(), 1);
    // A registry that hangs is bounded by the timeout.
    let t = Instant::now();
    assert_eq!(
        hb.beat_once(status(0)).await.unwrap_err().code(),
        Code::DeadlineExceeded
    );
    assert!(
        t.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(hb.failures(), 2);
    // A success resets the count.
    assert!(!hb.beat_once(status(0)).await.unwrap());
    assert_eq!(hb.failures(), 0);
    assert!(hb.beat_once(status(0)).await.is_err());
    assert_eq!(hb.failures(), 1);
    // Drain is sticky: one ack with drain, then acks without, still drain.
    assert!(hb.beat_once(status(0)).await.unwrap());
    assert!(hb.beat_once(status(0)).await.unwrap());
    assert!(hb.drain_requested());
    assert_eq!(hb.failures(), 0);
    assert_eq!(hb.beats(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_beats_on_schedule() {
    let reg = FakeRegistry::with(&[Reply::Fail, Reply::Ack(false), Reply::Ack(true)]);
    let hb = Arc::new(Heartbeat::new(Arc::clone(&reg), Duration::from_millis(50)));
    let counter = Arc::new(Mutex::new(0u32));
    let drained = Arc::new(Mutex::new(0u32));
    let (c, dr) = (Arc::clone(&counter), Arc::clone(&drained));
    let start = Instant::now();
    let task = spawn_heartbeat(
        Arc::clone(&hb),
        Duration::from_millis(100),
        move || {
            let mut n = c.lock().unwrap();
            *n += 1;
            status(*n)
        },
        move || *dr.lock().unwrap() += 1,
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    let seen: Vec<(Instant, WorkerStatus)> = reg.seen.lock().unwrap().clone();
    assert!(
        seen.len() >= 3 && seen.len() <= 6,
        "{} beats in 450 ms",
        seen.len()
    );
    // At once, then about every interval; a failed beat does not stop the loop.
    assert!(seen[0].0 - start < Duration::from_millis(50));
    for w in seen.windows(2) {
        let gap = w[1].0 - w[0].0;
        assert!(
            gap >= Duration::from_millis(90) && gap < Duration::from_millis(400),
            "gap {gap:?}"
        );
        // Fresh load every beat.
        assert_eq!(w[1].1.queue_depth, w[0].1.queue_depth + 1);
    }
    assert_eq!(*drained.lock().unwrap(), 1, "on_drain runs once");
    // Stop is prompt, even while a beat hangs.
    reg.replies
        .lock()
        .unwrap()
        .extend([Reply::Hang, Reply::Hang]);
    tokio::time::sleep(Duration::from_millis(120)).await;
    let t = Instant::now();
    task.stop().await;
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "stop took {:?}",
        t.elapsed()
    );
    let n = reg.seen.lock().unwrap().len();
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(reg.seen.lock().unwrap().len(), n, "beats after stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_registry_roundtrip() {
    let node = RegistryNode::start("127.0.0.1:0").await.unwrap();
    let addr = node.addr().to_string();
    let client = GrpcRegistry::new(&addr, Duration::from_millis(500)).unwrap();
    let hb = Heartbeat::new(client.clone(), Duration::from_millis(500));
    let mut s = status(3);
    s.worker_id = "alpha".into();
    s.heartbeat_ms = 200;
    assert!(!hb.beat_once(s.clone()).await.unwrap());
    let listed = client.list_workers().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].worker_id.as_str(), listed[0].queue_depth),
        ("alpha", 3)
    );
    // SetDrain: the next ack carries it; unknown workers are reported.
    assert!(client.set_drain("alpha", true).await.unwrap());
    assert!(!client.set_drain("nobody", true).await.unwrap());
    assert!(hb.beat_once(s.clone()).await.unwrap());
    // Clearing the request does not undo the worker's drain (sticky on the worker side).
    assert!(client.set_drain("alpha", false).await.unwrap());
    assert!(hb.beat_once(s.clone()).await.unwrap());
    // Eviction after 3 missed beats of 200 ms.
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        client.list_workers().await.unwrap().len(),
        1,
        "evicted too early"
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(
        client.list_workers().await.unwrap().is_empty(),
        "not evicted after 3 missed beats"
    );
    // An unreachable registry (refused, or the connection closed under the call) errors within
    // the timeout as UNAVAILABLE or DEADLINE_EXCEEDED.
    node.stop().await;
    let t = Instant::now();
    let err = hb.beat_once(s).await.unwrap_err();
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    assert!(
        matches!(err.code(), Code::Unavailable | Code::DeadlineExceeded),
        "{err}"
    );
    assert_eq!(hb.failures(), 1);
}
