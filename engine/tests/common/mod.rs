//! Helpers shared by the library's integration tests (and, through `engine/cli/tests/common`,
//! the `tl` binary's): pools, prefills, decode servers, snapshots, fleets, pinned models.
#![allow(dead_code)] // each test file uses a different subset

pub mod fetch;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::Shape;
use kvwire_grpc::{GrpcTransport, KvReceiver, KvServerHandle, KvStore, TransportConfig, serve_kv};
use tl_engine::node::EngineNode;
use tl_engine::node::store::PoolStore;
use tl_engine_core::engine::{Engine, Mode, PrefillOutput, Request, StepEvent};
use tl_engine_core::model::{BYTE_VOCAB, FakeModel};
use tl_engine_core::pool::{BlockId, KvPool, PoolCounts, SharedKv};
use tl_engine_core::sampler::Sampling;

pub const TEST: Shape = Shape::v1(4, 2, 1, 4);

pub fn engine(shape: Shape, blocks: usize) -> Engine {
    let model = Arc::new(FakeModel::new("fake", shape, BYTE_VOCAB, 4096));
    Engine::new(model, SharedKv::new(KvPool::new(shape, blocks)))
}

/// Prefills `prompt` and returns its blocks (references held by the output).
pub fn prefill(e: &mut Engine, prompt: &[u32]) -> PrefillOutput {
    e.submit(Request {
        scope: Default::default(),
        prompt: prompt.to_vec(),
        sampling: Sampling::greedy(),
        seed: 0,
        max_tokens: 1,
        mode: Mode::PrefillOnly,
        draws_offset: 0,
        stop: tl_engine_core::stop::Stop::default(),
        choices: tl_engine_core::engine::Choices::ONE,
        earlier_output: 0,
        constraint: None,
    })
    .unwrap();
    for ev in e.step().0 {
        if let StepEvent::Prefilled { output, .. } = ev {
            return output;
        }
    }
    panic!("no Prefilled event");
}

/// Everything a test compares before and after: counts and the prefix index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub counts: PoolCounts,
    pub index: Vec<(u64, BlockId)>,
}

pub fn snapshot(pool: &SharedKv) -> Snapshot {
    let p = pool.lock();
    p.check().unwrap();
    Snapshot {
        counts: p.counts(),
        index: p.index_snapshot(),
    }
}

/// A decode side: a pool, its receiver, and a KvTransfer server on 127.0.0.1:0.
pub struct Decode {
    pub pool: SharedKv,
    pub rx: Arc<KvReceiver>,
    pub server: KvServerHandle,
    pub addr: String,
}

pub async fn decode_side(shape: Shape, blocks: usize, lease: Duration) -> Decode {
    let pool = SharedKv::new(KvPool::new(shape, blocks));
    let store: Arc<dyn KvStore> = Arc::new(PoolStore::new(pool.clone()));
    let rx = Arc::new(KvReceiver::new(store, "fake").with_lease(lease));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = serve_kv(listener, Arc::clone(&rx)).unwrap();
    let addr = server.local_addr().to_string();
    Decode {
        pool,
        rx,
        server,
        addr,
    }
}

pub fn transport(shape: Shape) -> GrpcTransport {
    GrpcTransport::new(TransportConfig::for_envelope(
        shape.envelope_len(1).unwrap(),
    ))
}

pub fn store(pool: &SharedKv) -> Arc<dyn KvStore> {
    Arc::new(PoolStore::new(pool.clone()))
}

/// Polls `cond` until it holds or `limit` passes.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    eventually_async(limit, || std::future::ready(cond())).await
}

/// The async form of [`eventually`]: polls the future `cond` makes every 10 ms until one
/// yields true or `limit` passes (then one last try decides).
pub async fn eventually_async<F: std::future::Future<Output = bool>>(
    limit: Duration,
    mut cond: impl FnMut() -> F,
) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond().await
}

/// Waits until `node` runs no sequence and its pool has exactly `used` blocks in use (the
/// end state of every cancel and abort test); false when that has not happened in 5 s.
pub async fn settled(node: &EngineNode, used: usize) -> bool {
    let runner = node.runner();
    eventually(Duration::from_secs(5), || {
        runner.running() == 0 && runner.pool().lock().counts().used == used
    })
    .await
}

/// The tokens of a streamed response, checking that it ends with `[DONE]` and has no error.
pub fn stream_tokens(r: &tl_engine::net::clients::HttpResponse) -> Vec<u32> {
    use tl_engine::api::sse::StreamEvent;
    let events = r.events().unwrap();
    assert_eq!(events.last(), Some(&StreamEvent::Done), "{events:?}");
    events
        .iter()
        .flat_map(|e| match e {
            StreamEvent::Chunk(c) => c.choices.iter().flat_map(|c| c.tokens.clone()).collect(),
            StreamEvent::Error(e) => panic!("stream error: {e:?}"),
            StreamEvent::Done => Vec::new(),
        })
        .collect()
}

/// The tokens one engine generates for `prompt` by itself (the colocated reference), at
/// temperature `t` with `seed`.
pub fn colocated(prompt: &[u32], t: f32, seed: u64, max_tokens: u32) -> Vec<u32> {
    let s = tl_engine_core::sampler::SamplingRequest {
        temperature: t,
        ..Default::default()
    };
    tl_engine::node::config::Config::default()
        .colocated(prompt, s, seed, max_tokens)
        .unwrap()
}

/// An engine of `role` registering with `registry`, beating every 100 ms, 256 blocks.
pub fn engine_cfg(
    id: &str,
    role: tl_engine::node::config::Role,
    registry: &str,
) -> tl_engine::node::config::Config {
    let mut c = tl_engine::node::config::Config::for_worker(id, role, registry);
    c.engine.heartbeat_ms = 100;
    c.pool.n_blocks = 256;
    c
}

/// Waits until `n` workers are registered with `gw` (panics after 10 s).
pub async fn wait_workers(gw: &tl_engine::gateway::GatewayNode, n: usize) {
    assert!(
        eventually(Duration::from_secs(10), || gw
            .registry()
            .list(Instant::now())
            .len()
            == n)
        .await,
        "workers never registered"
    );
}

/// A gateway with its registry, a prefill engine `P` and decode engines `D1..`, in process.
pub struct Cluster {
    pub gw: tl_engine::gateway::GatewayNode,
    pub p: EngineNode,
    pub d: Vec<EngineNode>,
}

impl Cluster {
    /// Asserts that every engine ends with nothing running and no block in use.
    pub async fn assert_settled(&self) {
        for node in std::iter::once(&self.p).chain(&self.d) {
            assert!(settled(node, 0).await, "{}", node.state().id());
        }
    }
}

/// [`cluster_with`] without changes.
pub async fn cluster(decoders: usize) -> Cluster {
    cluster_with(decoders, |_| {}).await
}

/// A gateway configured by `gw`, a prefill engine and `decoders` decode engines, every engine's
/// configuration (the prefill engine's too) passed through `tweak` first.
pub async fn cluster_of(
    gw: &tl_engine::gateway::config::GatewayConfig,
    decoders: usize,
    tweak: impl Fn(&mut tl_engine::node::config::Config),
) -> Cluster {
    use tl_engine::node::config::Role;
    let mut pc = engine_cfg("P", Role::Prefill, "");
    tweak(&mut pc);
    let mut fleet = tl_engine::fleet::LocalFleet::builder(gw.clone()).engine(pc);
    for i in 1..=decoders {
        let mut cfg = engine_cfg(&format!("D{i}"), Role::Decode, "");
        tweak(&mut cfg);
        fleet = fleet.engine(cfg);
    }
    let fleet = fleet.start().await.unwrap();
    let mut engines = fleet.engines.into_iter();
    let p = engines.next().expect("the prefill engine");
    Cluster {
        gw: fleet.gateway,
        p,
        d: engines.collect(),
    }
}

/// A gateway, a prefill engine and `decoders` decode engines, each decode configuration passed
/// through `tweak` first.
pub async fn cluster_with(
    decoders: usize,
    tweak: impl Fn(&mut tl_engine::node::config::Config),
) -> Cluster {
    use tl_engine::node::config::Role;
    let gw = tl_engine::gateway::config::GatewayConfig::local();
    cluster_of(&gw, decoders, |cfg| {
        if cfg.engine.role == Role::Decode {
            tweak(cfg);
        }
    })
    .await
}

/// Debian's etcd-server, installed when missing (this runs as root here).
pub fn etcd_installed() {
    let found = || {
        std::process::Command::new(tl_engine::etcd::member::binary())
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if found() {
        return;
    }
    let install = || {
        std::process::Command::new("flock")
            .args(["/tmp/tl-apt.lock", "apt-get", "install", "-y", "-q"])
            .args(["--no-install-recommends", "etcd-server"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install() {
        let _ = std::process::Command::new("flock")
            .args(["/tmp/tl-apt.lock", "apt-get", "update", "-q"])
            .status();
        assert!(
            install(),
            "these tests need etcd: `apt-get install etcd-server` failed"
        );
    }
    assert!(found(), "etcd-server installed but `etcd --version` fails");
}

/// Resumes the Prefill answer `h` for `prompt` over the decode engine's Generate at `grpc` (its
/// EngineControl address), as a gateway does, sampling with `t`, `top_p`, `top_k` from the
/// handle's seed: the whole answer, or the refusal.
pub async fn resume(
    grpc: &str,
    prompt: &[u32],
    h: &kvwire_grpc::pb::engine::KvHandle,
    (t, top_p, top_k): (f32, f32, u32),
    max_tokens: u32,
) -> Result<tl_engine::node::generate::Collected, tonic::Status> {
    use kvwire_grpc::pb::engine::{GenerateRequest, Resume, SamplingParams};
    let req = GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        sampling: Some(SamplingParams {
            temperature: t,
            top_p,
            top_k,
            seed: Some(h.seed),
            max_tokens,
            ..SamplingParams::default()
        }),
        resume: Some(Resume {
            handle_id: h.handle_id.clone(),
            first_token: h.first_token,
            rng_draws_consumed: h.rng_draws_consumed,
        }),
        ..GenerateRequest::default()
    };
    let ctl = tl_engine::net::clients::ControlClient::new(grpc)?;
    tl_engine::node::generate::collect(ctl.generate(req).await?).await
}
