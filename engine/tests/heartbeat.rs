//! The heartbeat client and the worker registry: fields, failure counting, the sticky drain,
//! the schedule and eviction (on tokio's paused clock and an injected `now`: exact, instant),
//! and one roundtrip through the real gRPC registry.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvwire_grpc::pb::control::{HeartbeatAck, Role as PbRole, WorkerStatus};
use tl_engine::gateway::registry::{RegistryNode, RegistryState};
use tl_engine::net::clients::RegistryClient;
use tl_engine::node::config::{Config, Role};
use tl_engine::node::heartbeat::{Addresses, Heartbeat, Registry, worker_status};
use tl_engine::node::runner::{EngineThread, Runner};
use tl_engine::node::state::NodeState;
use tl_engine_core::engine::Engine;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
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

fn node(id: &str, role: Role) -> (NodeState, EngineThread) {
    let cfg = Config::default();
    let (runner, thread) =
        Runner::start(Engine::new(cfg.build_model().unwrap(), cfg.build_pool())).unwrap();
    (NodeState::new(id, role, runner, None), thread)
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
    let (p, _thread) = node("p", Role::Prefill);
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
        let (d, _t) = node("d", role);
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

#[tokio::test(start_paused = true)]
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
    // A registry that hangs is bounded by the timeout, exactly.
    let t = Instant::now();
    assert_eq!(
        hb.beat_once(status(0)).await.unwrap_err().code(),
        Code::DeadlineExceeded
    );
    assert_eq!(t.elapsed(), Duration::from_millis(100));
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

#[tokio::test(start_paused = true)]
async fn heartbeat_beats_on_schedule() {
    let reg = FakeRegistry::with(&[Reply::Fail, Reply::Ack(false), Reply::Ack(true)]);
    let hb = Arc::new(Heartbeat::new(Arc::clone(&reg), Duration::from_millis(50)));
    let counter = Arc::new(Mutex::new(0u32));
    let drained = Arc::new(Mutex::new(0u32));
    let (c, dr) = (Arc::clone(&counter), Arc::clone(&drained));
    let stop = CancellationToken::new();
    let start = Instant::now();
    let task = tokio::spawn(Arc::clone(&hb).run(
        Duration::from_millis(100),
        move || {
            let mut n = c.lock().unwrap();
            *n += 1;
            status(*n)
        },
        || {},
        move || *dr.lock().unwrap() += 1,
        Arc::new(tokio::sync::Notify::new()),
        stop.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(450)).await;
    let seen: Vec<(Instant, WorkerStatus)> = reg.seen.lock().unwrap().clone();
    // At once, then every interval exactly; a failed beat does not stop the loop.
    let at: Vec<Duration> = seen.iter().map(|(t, _)| *t - start).collect();
    let ms = Duration::from_millis;
    assert_eq!(at, [ms(0), ms(100), ms(200), ms(300), ms(400)]);
    for w in seen.windows(2) {
        // Fresh load every beat.
        assert_eq!(w[1].1.queue_depth, w[0].1.queue_depth + 1);
    }
    assert_eq!(*drained.lock().unwrap(), 1, "on_drain runs once");
    // Stop is immediate, even while a beat hangs.
    reg.replies
        .lock()
        .unwrap()
        .extend([Reply::Hang, Reply::Hang]);
    tokio::time::sleep(ms(120)).await;
    let t = Instant::now();
    stop.cancel();
    task.await.unwrap();
    assert_eq!(t.elapsed(), Duration::ZERO, "stop waited");
    let n = reg.seen.lock().unwrap().len();
    tokio::time::sleep(ms(250)).await;
    assert_eq!(reg.seen.lock().unwrap().len(), n, "beats after stop");
}

#[test]
fn registry_evicts_after_three_missed_beats() {
    let reg = RegistryState::default();
    let t0 = std::time::Instant::now();
    let ms = Duration::from_millis;
    let mut a = status(1);
    a.worker_id = "a".into();
    a.heartbeat_ms = 200;
    let mut b = status(2);
    b.worker_id = "b".into();
    b.heartbeat_ms = 0; // unsaid: the default interval, 2 s
    assert!(!reg.heartbeat(a.clone(), t0).drain);
    reg.heartbeat(b, t0);
    let ids = |now| -> Vec<String> { reg.list(now).into_iter().map(|w| w.worker_id).collect() };
    assert_eq!(ids(t0 + ms(600)), ["a", "b"], "evicted at exactly 3 beats");
    assert_eq!(ids(t0 + ms(601)), ["b"], "kept past 3 missed beats");
    assert_eq!(ids(t0 + ms(6000)), ["b"]);
    assert!(ids(t0 + ms(6001)).is_empty());
    // A drain request reaches the worker on its next ack, and survives its re-registration.
    reg.heartbeat(a.clone(), t0 + ms(7000));
    assert!(reg.set_drain("a", true));
    assert!(!reg.set_drain("nobody", true));
    assert!(reg.heartbeat(a, t0 + ms(7100)).drain);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_registry_roundtrip() {
    let node = RegistryNode::start("127.0.0.1:0", None, "127.0.0.1:0")
        .await
        .unwrap();
    let addr = node.addr().to_string();
    let client = RegistryClient::new(&addr, Duration::from_millis(500)).unwrap();
    let hb = Heartbeat::new(client.clone(), Duration::from_millis(500));
    let mut s = status(3);
    s.worker_id = "alpha".into();
    s.heartbeat_ms = 60_000;
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
    // An anonymous beat without a worker id is refused.
    let mut nameless = s.clone();
    nameless.worker_id.clear();
    assert_eq!(
        client.heartbeat(nameless).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    // An unreachable registry (refused, or the connection closed under the call) errors within
    // the timeout as UNAVAILABLE or DEADLINE_EXCEEDED.
    node.stop().await;
    let err = hb.beat_once(s).await.unwrap_err();
    assert!(
        matches!(err.code(), Code::Unavailable | Code::DeadlineExceeded),
        "{err}"
    );
    assert_eq!(hb.failures(), 1);
}

/// A second address beating for an id whose lease is held is refused with ALREADY_EXISTS and
/// counted, and takes nothing from the live worker; once the first has missed three beats, the
/// new address may take the id. The live worker's own beats (same addresses) go on meanwhile.
#[test]
fn a_second_address_cannot_take_a_live_worker_id() {
    let reg = RegistryState::default();
    let t0 = std::time::Instant::now();
    let ms = Duration::from_millis;
    let mut live = status(1);
    live.worker_id = "decode-1".into();
    live.heartbeat_ms = 200;
    let mut impostor = live.clone();
    impostor.grpc_address = "127.0.0.1:9".into();
    impostor.http_address = "127.0.0.1:10".into();
    reg.record(live.clone(), t0, 16).unwrap();
    let err = reg.record(impostor.clone(), t0 + ms(100), 16).unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    assert!(err.message().contains("decode-1"), "{err:?}");
    assert_eq!(reg.identity_conflicts(), 1);
    let addr = |now| reg.list(now)[0].grpc_address.clone();
    assert_eq!(addr(t0 + ms(100)), live.grpc_address);
    reg.record(live.clone(), t0 + ms(200), 16).unwrap();
    assert!(reg.record(impostor.clone(), t0 + ms(700), 16).is_err());
    assert_eq!(reg.identity_conflicts(), 2);
    // The first is silent past three beats (200 + 600 ms): the id is free again.
    reg.record(impostor.clone(), t0 + ms(801), 16).unwrap();
    assert_eq!(addr(t0 + ms(801)), impostor.grpc_address);
    assert_eq!(reg.identity_conflicts(), 2);
}
