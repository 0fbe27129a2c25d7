//! The worker registry on its two backends: the gateway's own (engines beat to it over gRPC)
//! and etcd (engines hold a lease and a key; gateways mirror a watch). One contract suite runs
//! on both. Then what only etcd does: identities kept to their own keys by etcd's auth over
//! mutual TLS, and two gateways serving the same engines.
//!
//! etcd is Debian's `etcd-server` 3.4, installed with apt when missing (as `.ci/run` does);
//! each test starts its own members on free loopback ports with their own data directories.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{etcd_installed, eventually, eventually_async};
use kvwire_grpc::pb::control::{Role as PbRole, WorkerStatus};
use tl_engine::etcd::member::{Member, MemberTls, start_cluster};
use tl_engine::etcd::{Etcd, Keys, auth};
use tl_engine::gateway::mirror::mirror;
use tl_engine::gateway::registry::{RegistryNode, RegistryState};
use tl_engine::net::clients::RegistryClient;
use tl_engine::net::role::Role as WRole;
use tl_engine::net::tls::{PeerId, PeerRole, Tls, issue};
use tl_engine::node::heartbeat::Heartbeat;
use tl_engine::node::registrar::EtcdRegistrar;
use tokio_util::sync::CancellationToken;
use tonic::Code;

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("etcd")
        .join(format!("{name}-{}", tl_engine::net::tls::random_hex::<4>()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const BEAT_MS: u32 = 300;

fn status(id: &str, grpc: &str, queue: u32) -> WorkerStatus {
    WorkerStatus {
        worker_id: id.into(),
        http_address: format!("{grpc}-http"),
        grpc_address: grpc.into(),
        kv_address: format!("{grpc}-kv"),
        role: PbRole::Decode as i32,
        model: "fake".into(),
        kv_format: 1,
        queue_depth: queue,
        total_blocks: 64,
        free_blocks: 60,
        block_tokens: 4,
        heartbeat_ms: BEAT_MS,
        ..Default::default()
    }
}

/// One backend, as the contract sees it: beats from engines, a gateway's view of them.
enum Backend {
    InProcess(RegistryNode),
    Etcd {
        _members: Vec<Member>,
        etcd: Arc<Etcd>,
        view: Arc<RegistryState>,
        stop: CancellationToken,
    },
}

impl Backend {
    async fn in_process() -> Self {
        Backend::InProcess(
            RegistryNode::start("127.0.0.1:0", None, "127.0.0.1:0")
                .await
                .unwrap(),
        )
    }

    async fn etcd(name: &str) -> Self {
        etcd_installed();
        let members = start_cluster(&tmp(name), 1, None).unwrap();
        let urls: Vec<String> = members.iter().map(|m| m.client_url.clone()).collect();
        let etcd = Arc::new(Etcd::new(&urls, None, Duration::from_secs(2)).unwrap());
        let view = Arc::new(RegistryState::default());
        let e = Arc::clone(&etcd);
        view.mirror_etcd(
            Duration::from_secs(15),
            Arc::new(move |id: String, drain: bool| {
                let e = Arc::clone(&e);
                tokio::spawn(async move {
                    tl_engine::etcd::drain::set_drain(&e, &Keys::new("/tl"), &id, drain)
                        .await
                        .unwrap();
                });
            }),
            Instant::now(),
        );
        let stop = CancellationToken::new();
        tokio::spawn(mirror(
            Arc::clone(&etcd),
            Keys::new("/tl"),
            Arc::clone(&view),
            stop.clone(),
        ));
        Backend::Etcd {
            _members: members,
            etcd,
            view,
            stop,
        }
    }

    /// What the gateway routes over.
    fn view(&self) -> &Arc<RegistryState> {
        match self {
            Backend::InProcess(n) => n.state(),
            Backend::Etcd { view, .. } => view,
        }
    }

    /// An engine's heartbeat to this backend.
    fn beater(&self) -> Beater {
        let t = Duration::from_secs(2);
        match self {
            Backend::InProcess(n) => Beater::Grpc(Heartbeat::new(
                RegistryClient::new(&n.addr().to_string(), t).unwrap(),
                t,
            )),
            Backend::Etcd { etcd, .. } => Beater::Etcd(Heartbeat::new(
                EtcdRegistrar::new(Arc::clone(etcd), Keys::new("/tl"), BEAT_MS).allow_no_auth(true),
                t,
            )),
        }
    }

    fn listed(&self, id: &str) -> Option<WorkerStatus> {
        self.view()
            .list(Instant::now())
            .into_iter()
            .find(|w| w.worker_id == id)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Backend::Etcd { stop, .. } = self {
            stop.cancel();
        }
    }
}

enum Beater {
    Grpc(Heartbeat<RegistryClient>),
    Etcd(Heartbeat<EtcdRegistrar>),
}

impl Beater {
    async fn beat(&self, s: WorkerStatus) -> Result<bool, tonic::Status> {
        match self {
            Beater::Grpc(h) => h.beat_once(s).await,
            Beater::Etcd(h) => h.beat_once(s).await,
        }
    }
}

/// The contract every registry backend keeps.
async fn contract(b: Backend) {
    let wait = Duration::from_secs(10);
    let e1 = b.beater();
    // A beat registers the worker with the status it sent.
    assert!(!e1.beat(status("w1", "10.0.0.1:1", 0)).await.unwrap());
    assert!(
        eventually(wait, || b.listed("w1")
            == Some(status("w1", "10.0.0.1:1", 0)))
        .await,
        "a registered worker is listed with its status: {:?}",
        b.listed("w1")
    );
    // A changed status is seen.
    e1.beat(status("w1", "10.0.0.1:1", 7)).await.unwrap();
    assert!(
        eventually(wait, || b.listed("w1").is_some_and(|w| w.queue_depth == 7)).await,
        "a changed load reaches the gateway"
    );
    // A second worker beside it; the list is sorted by id.
    let e2 = b.beater();
    e2.beat(status("w2", "10.0.0.2:1", 0)).await.unwrap();
    assert!(eventually(wait, || b.view().list(Instant::now()).len() == 2).await);
    let ids: Vec<String> = b
        .view()
        .list(Instant::now())
        .into_iter()
        .map(|w| w.worker_id)
        .collect();
    assert_eq!(ids, ["w1", "w2"]);
    // A second address for a live id is refused, and the first keeps the id.
    let thief = b.beater();
    let err = thief.beat(status("w1", "10.9.9.9:1", 0)).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert_eq!(b.listed("w1").unwrap().grpc_address, "10.0.0.1:1");
    // Out-of-bounds statuses are refused.
    let long = "x".repeat(200);
    let err = b.beater().beat(status(&long, "10.0.0.3:1", 0)).await;
    match &b {
        Backend::InProcess(_) => assert_eq!(err.unwrap_err().code(), Code::InvalidArgument),
        // etcd stores any key an engine may write; the gateway's mirror refuses to list it.
        Backend::Etcd { etcd, .. } => {
            let _ = err;
            // A status written under a role its key does not name (what a decode identity
            // would write if it could) is not listed either; the same status under its own
            // role's key is.
            use prost::Message;
            let prefill = WorkerStatus {
                role: PbRole::Prefill as i32,
                ..status("w9", "10.0.0.9:1", 0)
            };
            let bytes = || bytes::Bytes::from(prefill.encode_to_vec());
            let keys = Keys::new("/tl");
            // The mirror applies etcd's events in revision order: once a marker written after
            // a key is listed, the key's own event was applied too.
            let applied = async |marker: &str| {
                let m = WorkerStatus {
                    role: PbRole::Prefill as i32,
                    ..status(marker, "10.0.0.8:1", 0)
                };
                let key = keys.worker(WRole::Prefill, marker);
                etcd.put(&key, bytes::Bytes::from(m.encode_to_vec()), 0)
                    .await
                    .unwrap();
                assert!(eventually(wait, || b.listed(marker).is_some()).await);
                etcd.delete(&key).await.unwrap();
                assert!(eventually(wait, || b.listed(marker).is_none()).await);
            };
            etcd.put(&keys.worker(WRole::Decode, "w9"), bytes(), 0)
                .await
                .unwrap();
            applied("m1").await;
            assert!(
                b.listed(&long).is_none(),
                "a worker id beyond the bound is not listed"
            );
            assert!(
                b.listed("w9").is_none(),
                "a prefill status under a decode key was listed"
            );
            etcd.put(&keys.worker(WRole::Prefill, "w9"), bytes(), 0)
                .await
                .unwrap();
            assert!(
                eventually(wait, || b
                    .listed("w9")
                    .is_some_and(|w| w.role == PbRole::Prefill as i32))
                .await
            );
            // The decode key going away leaves the prefill listing alone; its own key's does not.
            etcd.delete(&keys.worker(WRole::Decode, "w9"))
                .await
                .unwrap();
            applied("m2").await;
            assert!(b.listed("w9").is_some(), "another role's key took w9 away");
            etcd.delete(&keys.worker(WRole::Prefill, "w9"))
                .await
                .unwrap();
            assert!(eventually(wait, || b.listed("w9").is_none()).await);
        }
    }
    // A drain request from the gateway reaches the engine at a later beat, and stays.
    assert!(b.view().set_drain("w1", true));
    assert!(
        !b.view().set_drain("nobody", true),
        "draining an unknown worker finds nothing"
    );
    let mut drained = false;
    for _ in 0..40 {
        if e1.beat(status("w1", "10.0.0.1:1", 7)).await.unwrap() {
            drained = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(drained, "the engine never heard the drain request");
    assert!(
        !e2.beat(status("w2", "10.0.0.2:1", 0)).await.unwrap(),
        "only w1 was asked to drain"
    );
    // A worker that stops beating is forgotten (three beats; on etcd, its lease's TTL).
    let start = Instant::now();
    let gone = eventually(Duration::from_secs(15), || b.listed("w1").is_none()).await;
    assert!(gone, "a silent worker was never forgotten");
    assert!(
        start.elapsed() >= Duration::from_millis(u64::from(BEAT_MS) * 2),
        "forgotten too soon"
    );
    // After that, its id may register from another address.
    thief.beat(status("w1", "10.9.9.9:1", 0)).await.unwrap();
    assert!(
        eventually(wait, || b
            .listed("w1")
            .is_some_and(|w| w.grpc_address == "10.9.9.9:1"))
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_contract_in_process() {
    contract(Backend::in_process().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_contract_on_etcd() {
    contract(Backend::etcd("contract").await).await;
}

/// Certificates for a TLS cluster: the members', and one for each identity named.
fn certs(dir: &Path, ids: &[(&str, PeerRole)]) -> (MemberTls, Vec<Tls>) {
    let m = issue(dir, "etcd-0", PeerRole::Etcd, &[]).unwrap();
    let member = MemberTls {
        ca: m.ca.clone(),
        cert: m.cert.clone(),
        key: m.key.clone(),
    };
    let tls = ids
        .iter()
        .map(|(id, role)| Tls::load(&issue(dir, id, *role, &[]).unwrap().section()).unwrap())
        .collect();
    (member, tls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_cannot_write_another_engines_key() {
    etcd_installed();
    let dir = tmp("auth");
    let (member, tls) = certs(
        &dir,
        &[
            ("ops", PeerRole::Admin),
            ("d1", PeerRole::Decode),
            ("d2", PeerRole::Decode),
            ("gw", PeerRole::Gateway),
        ],
    );
    let members = start_cluster(&dir.join("data"), 1, Some(&member)).unwrap();
    let urls = vec![members[0].client_url.clone()];
    let t = Duration::from_secs(5);
    let client = |i: usize| Arc::new(Etcd::new(&urls, Some(&tls[i]), t).unwrap());
    let (admin, d1, d2, gw) = (client(0), client(1), client(2), client(3));
    let keys = Keys::new("/tl");
    // Only an admin identity may turn auth on: a decode engine's certificate is refused before
    // anything is written, and the admin's own init then goes through.
    let e = auth::init(&d1, &keys, tls[1].identity())
        .await
        .expect_err("a decode identity running init");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("admin"), "{e:?}");
    auth::init(&admin, &keys, tls[0].identity()).await.unwrap();
    for t in &tls[1..] {
        auth::grant(&admin, &keys, t.identity()).await.unwrap();
    }
    let v = || bytes::Bytes::from_static(b"x");
    let denied = |r: Result<i64, tonic::Status>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
    };
    // Each engine writes its own key, and no other.
    d1.put(&keys.worker(WRole::Decode, "d1"), v(), 0)
        .await
        .unwrap();
    denied(
        d1.put(&keys.worker(WRole::Decode, "d2"), v(), 0).await,
        "d1 writing d2's key",
    );
    denied(
        d2.put(&keys.worker(WRole::Decode, "d1"), v(), 0).await,
        "d2 writing d1's key",
    );
    denied(
        d1.put(&keys.worker(WRole::Decode, "d3"), v(), 0).await,
        "d1 writing a key of nobody's",
    );
    denied(
        d1.delete(&keys.worker(WRole::Decode, "d2")).await,
        "d1 deleting d2's key",
    );
    // A decode identity cannot list itself as prefill or both: the key names the role, and
    // etcd gives its certificate only the decode one.
    for role in [WRole::Prefill, WRole::Both] {
        denied(
            d1.put(&keys.worker(role, "d1"), v(), 0).await,
            "d1 writing its own id under another role",
        );
    }
    // An engine does not drain itself or others, nor read the others' statuses.
    denied(
        d1.put(&keys.drain("d1"), v(), 0).await,
        "d1 writing its drain key",
    );
    denied(
        d1.put(&keys.drain("d2"), v(), 0).await,
        "d1 writing d2's drain key",
    );
    let e = d1
        .get(&keys.worker(WRole::Decode, "d2"))
        .await
        .expect_err("d1 reading d2's key");
    assert_eq!(e.code(), Code::PermissionDenied);
    // A gateway reads every worker and writes drain keys, but no worker's key.
    denied(
        gw.put(&keys.worker(WRole::Decode, "d1"), v(), 0).await,
        "the gateway writing d1's key",
    );
    assert_eq!(gw.get_prefix(&keys.workers()).await.unwrap().0.len(), 1);
    tl_engine::etcd::drain::set_drain(&gw, &keys, "d1", true)
        .await
        .unwrap();
    // The engine's registrar works within its rights: lease, key, drain key read.
    let reg = Heartbeat::new(
        EtcdRegistrar::new(Arc::clone(&d1), keys.clone(), BEAT_MS),
        t,
    );
    assert!(
        reg.beat_once(status("d1", "127.0.0.1:1", 0)).await.unwrap(),
        "d1 sees its drain key"
    );
    // A registrar beating for another id is refused by etcd, not by our own code.
    let liar = Heartbeat::new(
        EtcdRegistrar::new(Arc::clone(&d2), keys.clone(), BEAT_MS),
        t,
    );
    let e = liar
        .beat_once(status("d1", "127.0.0.1:9", 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // So is d1's registrar beating with a role its certificate does not hold.
    let claims_prefill = WorkerStatus {
        role: PbRole::Prefill as i32,
        ..status("d1", "127.0.0.1:1", 0)
    };
    let e = reg.beat_once(claims_prefill).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A client without a certificate of this CA does not get in at all.
    let other = tmp("other-ca");
    let stranger = Tls::load(
        &issue(&other, "d1", PeerRole::Decode, &[])
            .unwrap()
            .section(),
    )
    .unwrap();
    let s = Etcd::new(&urls, Some(&stranger), Duration::from_secs(2)).unwrap();
    assert!(
        s.put(&keys.worker(WRole::Decode, "d1"), v(), 0)
            .await
            .is_err(),
        "a stranger's certificate was let in"
    );
    // And the one good write stays as d1 left it.
    let kvs = admin.get_prefix(&keys.workers()).await.unwrap().0;
    assert_eq!(kvs.len(), 1);
    assert_eq!(
        PeerId::parse(&auth::user(tls[1].identity())).unwrap().id,
        "d1"
    );
}

/// A streamed, seeded completion through the gateway at `addr`, checked against a colocated
/// run of the same request.
async fn served_equal(addr: &str, prompt: &[u32], seed: u64) {
    let http = tl_engine::net::clients::HttpClient::default();
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": seed, "stream": true
    });
    let r = http
        .post(addr, "/v1/completions", &[], body.to_string())
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        common::stream_tokens(&r),
        common::colocated(prompt, 0.8, seed, 8)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_serve_the_same_engines_through_an_etcd_outage() {
    use tl_engine::gateway::GatewayNode;
    use tl_engine::gateway::config::GatewayConfig;
    use tl_engine::node::EngineNode;
    use tl_engine::node::config::Role;
    etcd_installed();
    let mut members = start_cluster(&tmp("two-gateways"), 1, None).unwrap();
    let reg = tl_engine::etcd::RegistrySection {
        allow_no_auth: true,
        etcd_endpoints: vec![members[0].client_url.clone()],
        stale_ms: 30_000,
        ..Default::default()
    };
    let mut gcfg = GatewayConfig::local();
    gcfg.registry = reg.clone();
    let g1 = GatewayNode::start(&gcfg).await.unwrap();
    let g2 = GatewayNode::start(&gcfg).await.unwrap();
    let mut engines = Vec::new();
    for (id, role) in [
        ("P", Role::Prefill),
        ("D1", Role::Decode),
        ("D2", Role::Decode),
    ] {
        let mut c = common::engine_cfg(id, role, "");
        c.engine.heartbeat_ms = 300;
        c.registry = reg.clone();
        engines.push(EngineNode::start(&c).await.unwrap());
    }
    // Neither gateway was beaten to: both learn the engines from etcd.
    common::wait_workers(&g1, 3).await;
    common::wait_workers(&g2, 3).await;
    let prompt: Vec<u32> = (40..61).collect();
    served_equal(&g1.http_addr().to_string(), &prompt, 1).await;
    served_equal(&g2.http_addr().to_string(), &prompt, 2).await;

    // etcd goes away: both gateways route on their snapshot (stale_ms is 30 s here) and the
    // engines keep serving.
    members[0].kill();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for (i, g) in [&g1, &g2].into_iter().enumerate() {
        assert_eq!(
            g.registry().list(Instant::now()).len(),
            3,
            "gateway {i} lost its snapshot"
        );
        served_equal(&g.http_addr().to_string(), &prompt, 10 + i as u64).await;
    }
    // etcd is back: the engines renew in time, the gateways' watches resume, and a change
    // made after the outage reaches both (D2 stops; its lease ends; both forget it).
    members[0].restart().unwrap();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(g1.registry().list(Instant::now()).len(), 3);
    let d2 = engines.pop().unwrap();
    d2.shutdown(Duration::from_secs(1)).await;
    for (i, g) in [&g1, &g2].into_iter().enumerate() {
        assert!(
            eventually(Duration::from_secs(15), || g
                .registry()
                .list(Instant::now())
                .len()
                == 2)
            .await,
            "gateway {i} never learned, after etcd came back, that D2 stopped"
        );
    }
    // One gateway stops; the other serves on.
    g1.stop().await;
    served_equal(&g2.http_addr().to_string(), &prompt, 20).await;
    // Every block taken was given back: the engines hold only cached prefixes.
    for e in &engines {
        assert!(common::settled(e, 0).await, "an engine kept blocks in use");
    }
}

/// Whether the member at `client_url` says, on its `/metrics`, that it leads the cluster.
async fn is_leader(client_url: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(host) = client_url.strip_prefix("http://") else {
        return false;
    };
    let get = async {
        let mut s = tokio::net::TcpStream::connect(host).await?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: etcd\r\n\r\n")
            .await?;
        let mut body = String::new();
        s.read_to_string(&mut body).await?;
        std::io::Result::Ok(body)
    };
    match tokio::time::timeout(Duration::from_secs(2), get).await {
        Ok(Ok(body)) => body.lines().any(|l| l.trim() == "etcd_server_is_leader 1"),
        _ => false,
    }
}

/// The index of the member that leads, once one does (up to 10 s).
async fn leader_of(members: &[Member]) -> usize {
    let limit = Instant::now() + Duration::from_secs(10);
    while Instant::now() < limit {
        for (i, m) in members.iter().enumerate() {
            if m.pid().is_some() && is_leader(&m.client_url).await {
                return i;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no etcd member became leader within 10 s");
}

/// Beats `hb` with queue depths `qs`, one a beat interval; returns the failed beats (with
/// their errors) and how many times the view did not list the worker.
async fn beat_through(
    hb: &Heartbeat<EtcdRegistrar>,
    view: &RegistryState,
    qs: std::ops::RangeInclusive<u32>,
) -> (Vec<(u32, String)>, usize) {
    let (mut failed, mut missing) = (Vec::new(), 0);
    for q in qs {
        if let Err(e) = hb.beat_once(status("w", "10.0.0.1:1", q)).await {
            failed.push((q, format!("{e:?}")));
        }
        if view.list(Instant::now()).iter().all(|w| w.worker_id != "w") {
            missing += 1;
        }
        tokio::time::sleep(Duration::from_millis(u64::from(BEAT_MS))).await;
    }
    (failed, missing)
}

/// Losing a follower costs nothing: not one beat fails. Losing the leader costs what Raft
/// costs: writes wait for an election (an election timeout or two), so a beat in that window
/// may run out of time; but the lease rides through it (a new leader extends every lease),
/// the gateway's view never loses the worker, and once a beat goes through, the rest do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_survives_losing_one_of_three_etcd_members() {
    etcd_installed();
    let mut members = start_cluster(&tmp("three"), 3, None).unwrap();
    let leader = leader_of(&members).await;
    // The follower is the member both clients talk to first.
    let follower = (leader + 1) % members.len();
    let mut urls: Vec<String> = members.iter().map(|m| m.client_url.clone()).collect();
    urls.swap(0, follower);
    let client = || Arc::new(Etcd::new(&urls, None, Duration::from_secs(2)).unwrap());
    let view = Arc::new(RegistryState::default());
    view.mirror_etcd(Duration::from_secs(15), Arc::new(|_, _| {}), Instant::now());
    let stop = CancellationToken::new();
    tokio::spawn(mirror(
        client(),
        Keys::new("/tl"),
        Arc::clone(&view),
        stop.clone(),
    ));
    let hb = Heartbeat::new(
        EtcdRegistrar::new(client(), Keys::new("/tl"), BEAT_MS).allow_no_auth(true),
        Duration::from_secs(3),
    );
    let listed = |q: u32| {
        view.list(Instant::now())
            .iter()
            .any(|w| w.worker_id == "w" && w.queue_depth == q)
    };
    hb.beat_once(status("w", "10.0.0.1:1", 0)).await.unwrap();
    assert!(eventually(Duration::from_secs(10), || listed(0)).await);

    // A follower is killed (SIGKILL): the clients move to the next member, no beat fails.
    members[follower].kill();
    let (failed, missing) = beat_through(&hb, &view, 1..=10).await;
    assert!(
        failed.is_empty(),
        "beats failed with a follower lost: {failed:?}"
    );
    assert_eq!(missing, 0, "the gateway's view lost the worker");
    assert!(
        eventually(Duration::from_secs(10), || listed(10)).await,
        "a status written after the loss never reached the gateway's view"
    );

    // The follower comes back and catches up (a linearizable read through it answers only
    // once it has); then the leader is killed.
    members[follower].restart().unwrap();
    let probe = Etcd::new(
        &[members[follower].client_url.clone()],
        None,
        Duration::from_secs(1),
    )
    .unwrap();
    assert!(
        eventually_async(Duration::from_secs(20), || async {
            probe.get("/tl/probe").await.is_ok()
        })
        .await,
        "the restarted member did not answer within 20 s"
    );
    let leader = leader_of(&members).await;
    members[leader].kill();
    let first = 11;
    let (failed, missing) = beat_through(&hb, &view, first..=first + 14).await;
    assert_eq!(
        missing, 0,
        "the gateway's view lost the worker in the election"
    );
    assert!(
        failed.len() <= 3,
        "more beats failed than an election explains: {failed:?}"
    );
    if let Some((last_failed, _)) = failed.last() {
        assert!(
            *last_failed < first + 10,
            "beats still failed after the election: {failed:?}"
        );
    }
    assert!(
        eventually(Duration::from_secs(10), || listed(first + 14)).await,
        "a status written after the election never reached the gateway's view"
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_drains_when_its_key_is_written_not_at_its_next_beat() {
    use tl_engine::gateway::GatewayNode;
    use tl_engine::gateway::config::GatewayConfig;
    use tl_engine::node::EngineNode;
    use tl_engine::node::config::Role;
    etcd_installed();
    let members = start_cluster(&tmp("drain"), 1, None).unwrap();
    let reg = tl_engine::etcd::RegistrySection {
        allow_no_auth: true,
        etcd_endpoints: vec![members[0].client_url.clone()],
        ..Default::default()
    };
    let mut gcfg = GatewayConfig::local();
    gcfg.registry = reg.clone();
    let gw = GatewayNode::start(&gcfg).await.unwrap();
    let mut c = common::engine_cfg("D1", Role::Decode, "");
    // A beat a minute: a drain that waited for the next beat would take that long.
    c.engine.heartbeat_ms = 60_000;
    c.registry = reg;
    let d = EngineNode::start(&c).await.unwrap();
    common::wait_workers(&gw, 1).await;
    assert!(!d.state().is_draining());
    let asked = Instant::now();
    assert!(gw.registry().set_drain("D1", true), "the gateway knows D1");
    assert!(
        eventually(Duration::from_secs(5), || d.state().is_draining()).await,
        "the engine did not drain within 5 s of its drain key being written"
    );
    // It beats at once with draining = true, and the gateway's view says so.
    assert!(
        eventually(Duration::from_secs(5), || gw
            .registry()
            .list(Instant::now())
            .iter()
            .any(|w| w.draining))
        .await,
        "the draining engine's status never reached the gateway"
    );
    assert!(asked.elapsed() < Duration::from_secs(10));
}

/// `tl etcd ARGS...` with the identity `id`'s certificate from `dir`: its JSON line, or its
/// stderr when it failed.
fn tl_etcd(dir: &Path, url: &str, id: &str, args: &[&str]) -> Result<serde_json::Value, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_tl"))
        .arg("etcd")
        .args(args)
        .args(["--etcd-endpoints", url])
        .arg("--tls-ca")
        .arg(dir.join("ca.pem"))
        .arg("--tls-cert")
        .arg(dir.join(format!("{id}.pem")))
        .arg("--tls-key")
        .arg(dir.join(format!("{id}.key")))
        .output()
        .unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tl_etcd_sets_up_auth_and_grants_identities_as_the_readme_says() {
    etcd_installed();
    let dir = tmp("cli");
    let (member, tls) = certs(&dir, &[("ops", PeerRole::Admin), ("d1", PeerRole::Decode)]);
    let members = start_cluster(&dir.join("data"), 1, Some(&member)).unwrap();
    let url = members[0].client_url.as_str();
    // An engine's init container waits for auth, and gives up at its deadline while it is off.
    let e = tl_etcd(&dir, url, "d1", &["wait", "--wait-ms", "1200"]).unwrap_err();
    assert!(e.contains("still off"), "{e}");
    let v = tl_etcd(&dir, url, "ops", &["init"]).unwrap();
    assert_eq!(v["auth"], "enabled");
    assert_eq!(
        tl_etcd(&dir, url, "d1", &["wait", "--wait-ms", "5000"]).unwrap()["auth"],
        "enabled"
    );
    assert_eq!(v["superuser"], "spiffe://tl/admin/ops");
    // Before its grant, d1 may do nothing; auth is on.
    let d1 = Etcd::new(&[url.to_owned()], Some(&tls[1]), Duration::from_secs(5)).unwrap();
    let keys = Keys::new("/tl");
    let e = d1
        .put(
            &keys.worker(WRole::Decode, "d1"),
            bytes::Bytes::from_static(b"x"),
            0,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let v = tl_etcd(
        &dir,
        url,
        "ops",
        &["grant", "--id", "d1", "--role", "decode"],
    )
    .unwrap();
    assert_eq!(v["role"], "tl-decode-d1");
    d1.put(
        &keys.worker(WRole::Decode, "d1"),
        bytes::Bytes::from_static(b"x"),
        0,
    )
    .await
    .unwrap();
    // An engine's certificate cannot grant, nor drain.
    let e = tl_etcd(&dir, url, "d1", &["grant", "--id", "d1", "--role", "admin"]).unwrap_err();
    assert!(e.contains("permission denied"), "{e}");
    let e = tl_etcd(&dir, url, "d1", &["drain", "--id", "d1"]).unwrap_err();
    assert!(e.contains("permission denied"), "{e}");
    // The admin drains; a second init is harmless.
    assert_eq!(
        tl_etcd(&dir, url, "ops", &["drain", "--id", "d1"]).unwrap()["drain"],
        true
    );
    assert!(d1.get(&keys.drain("d1")).await.unwrap().is_some());
    tl_etcd(&dir, url, "ops", &["init"]).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_shuts_down_leaves_etcd_at_once() {
    use tl_engine::node::EngineNode;
    use tl_engine::node::config::Role;
    etcd_installed();
    let members = start_cluster(&tmp("leave"), 1, None).unwrap();
    let url = members[0].client_url.clone();
    let mut c = common::engine_cfg("D1", Role::Decode, "");
    // Beats 2 s apart: the lease (three beats) would keep the key for 6 s.
    c.engine.heartbeat_ms = 2_000;
    c.registry = tl_engine::etcd::RegistrySection {
        allow_no_auth: true,
        etcd_endpoints: vec![url.clone()],
        ..Default::default()
    };
    let d = EngineNode::start(&c).await.unwrap();
    let etcd = Etcd::new(&[url], None, Duration::from_secs(2)).unwrap();
    let key = Keys::new(tl_engine::etcd::DEFAULT_PREFIX).worker(Role::Decode, "D1");
    let mut listed = false;
    for _ in 0..100 {
        if etcd.get(&key).await.unwrap().is_some() {
            listed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(listed, "the engine never registered");
    let t = Instant::now();
    d.shutdown(Duration::from_millis(100)).await;
    assert!(
        etcd.get(&key).await.unwrap().is_none(),
        "the key outlived a graceful shutdown"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_refuses_an_etcd_whose_auth_is_off_unless_allowed() {
    use tl_engine::node::EngineNode;
    etcd_installed();
    let members = start_cluster(&tmp("no-auth"), 1, None).unwrap();
    let url = members[0].client_url.clone();
    let mut c = common::engine_cfg("D1", WRole::Decode, "");
    c.registry = tl_engine::etcd::RegistrySection {
        etcd_endpoints: vec![url.clone()],
        ..Default::default()
    };
    let Err(e) = EngineNode::start(&c).await else {
        panic!("an engine started on an etcd without auth");
    };
    assert!(e.to_string().contains("auth off"), "{e}");
    // The registrar checks again before each new registration (an etcd that did not answer
    // at start), and writes nothing.
    let etcd = Arc::new(Etcd::new(&[url], None, Duration::from_secs(2)).unwrap());
    let reg = Heartbeat::new(
        EtcdRegistrar::new(Arc::clone(&etcd), Keys::new("/tl"), BEAT_MS),
        Duration::from_secs(2),
    );
    let e = reg
        .beat_once(status("D1", "127.0.0.1:1", 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let keys = Keys::new("/tl");
    assert!(etcd.get_prefix(&keys.workers()).await.unwrap().0.is_empty());
    // The flag lets it run.
    c.registry.allow_no_auth = true;
    let d = EngineNode::start(&c).await.unwrap();
    let key = keys.worker(WRole::Decode, "D1");
    assert!(
        eventually_async(Duration::from_secs(10), || async {
            etcd.get(&key).await.unwrap().is_some()
        })
        .await,
        "the allowed engine never registered"
    );
    d.shutdown(Duration::from_millis(100)).await;
}
