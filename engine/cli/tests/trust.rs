//! Trust: mutual TLS on every internal port, authorization by certificate role
//! (spec/identities.md), heartbeats that speak only for their own identity, API keys on the public
//! endpoint, and secure-by-default listen addresses. Every refusal leaves the pools unchanged.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvwire_grpc::pb::control::{Role as PbRole, WorkerStatus};
use kvwire_grpc::pb::engine::{GenerateRequest, PrefillRequest};
use kvwire_grpc::pb::kv::{HasBlocksRequest, KvChunk};
use kvwire_grpc::{GrpcTransport, KvTransport, OutChunk, TransportConfig};
use rustls::pki_types::pem::PemObject;
use tl_engine::gateway::GatewayNode;
use tl_engine::gateway::config::GatewayConfig;
use tl_engine::net::clients::{ControlClient, HttpClient, HttpResponse, RegistryClient};
use tl_engine::net::tls::{PeerRole, Tls, TlsSection, issue};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine_core::pool::PoolCounts;
use tonic::{Code, Status};

/// A directory of certificates, removed at the end.
struct Certs(PathBuf);

impl Certs {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "tl-trust-{name}-{}-{}",
            std::process::id(),
            tl_engine::net::tls::random_hex::<4>()
        ));
        Self(p)
    }

    fn issue(&self, id: &str, role: PeerRole) -> TlsSection {
        issue(&self.0, id, role, &[]).unwrap().section()
    }

    fn tls(&self, id: &str, role: PeerRole) -> Tls {
        Tls::load(&self.issue(id, role)).unwrap()
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A gateway, a prefill and a decode engine, all over mutual TLS with one CA.
struct Cluster {
    gw: GatewayNode,
    p: EngineNode,
    d: EngineNode,
    certs: Certs,
}

impl Cluster {
    async fn start() -> Self {
        let certs = Certs::new("cluster");
        let gw = GatewayNode::start(&GatewayConfig {
            tls: Some(certs.issue("gw", PeerRole::Gateway)),
            ..GatewayConfig::local()
        })
        .await
        .unwrap();
        let reg = gw.registry_addr().to_string();
        let cfg = |id: &str, role: Role, peer: PeerRole| {
            let mut c = Config::for_worker(id, role, &reg);
            c.engine.heartbeat_ms = 50;
            c.tls = Some(certs.issue(id, peer));
            c
        };
        let p = EngineNode::start(&cfg("P", Role::Prefill, PeerRole::Prefill))
            .await
            .unwrap();
        let d = EngineNode::start(&cfg("D", Role::Decode, PeerRole::Decode))
            .await
            .unwrap();
        assert!(
            common::eventually(Duration::from_secs(5), || gw
                .registry()
                .list(std::time::Instant::now())
                .len()
                == 2)
            .await,
            "the engines did not register over mutual TLS"
        );
        Self { gw, p, d, certs }
    }

    fn pools(&self) -> (PoolCounts, PoolCounts) {
        (
            self.p.runner().pool().lock().counts(),
            self.d.runner().pool().lock().counts(),
        )
    }

    async fn stop(self) {
        self.p.shutdown(Duration::from_secs(1)).await;
        self.d.shutdown(Duration::from_secs(1)).await;
        self.gw.stop().await;
    }
}

/// One client of every port, with one identity (or none: plaintext).
struct Caller {
    ctl: ControlClient,
    kv: GrpcTransport,
    reg: RegistryClient,
    http: HttpClient,
}

impl Caller {
    fn new(c: &Cluster, tls: Option<&Tls>) -> Self {
        let t = tls.map(Tls::tonic_client);
        Self {
            ctl: ControlClient::with_tls(&c.p.addresses().grpc, t.as_ref()).unwrap(),
            kv: GrpcTransport::new(TransportConfig::for_envelope(4096)).with_tls(t.clone()),
            reg: RegistryClient::with_tls(
                &c.gw.registry_addr().to_string(),
                Duration::from_secs(2),
                t.as_ref(),
            )
            .unwrap(),
            http: match tls {
                Some(t) => HttpClient::tls(t.client_config(&[]).unwrap()),
                None => HttpClient::default(),
            },
        }
    }
}

fn has_blocks() -> HasBlocksRequest {
    HasBlocksRequest {
        cache_scope: Default::default(),
        tokens: Default::default(),
        hashes: vec![1],
        kv_format: 1,
        model: "fake".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refuses_plaintext_and_foreign_ca() {
    let c = Cluster::start().await;
    let before = c.pools();
    let kv = c.d.addresses().kv;
    let lookup = c.d.addresses().grpc;
    let http = c.d.addresses().http;
    let foreign = Certs::new("foreign");
    let strangers = [
        ("plaintext", None),
        ("foreign CA", Some(foreign.tls("gw", PeerRole::Gateway))),
    ];
    for (name, tls) in &strangers {
        let s = Caller::new(&c, tls.as_ref());
        assert!(
            s.ctl.info().await.is_err(),
            "{name}: EngineControl answered"
        );
        assert!(
            s.kv.has_blocks(&kv, has_blocks()).await.is_err(),
            "{name}: KvTransfer answered"
        );
        assert!(
            s.kv.has_blocks(&lookup, has_blocks()).await.is_err(),
            "{name}: the control port's HasBlocks answered"
        );
        assert!(
            s.reg.list_workers().await.is_err(),
            "{name}: the registry answered"
        );
        assert!(
            s.http
                .post(&http, "/v1/completions", &[], "{}")
                .await
                .is_err(),
            "{name}: the decode front answered"
        );
    }
    // The deployment's own gateway certificate gets through on every port.
    let gw = Caller::new(&c, Some(&c.certs.tls("gw2", PeerRole::Gateway)));
    assert_eq!(gw.ctl.info().await.unwrap().worker_id, "P");
    assert_eq!(gw.kv.has_blocks(&kv, has_blocks()).await.unwrap(), [false]);
    assert_eq!(
        gw.kv.has_blocks(&lookup, has_blocks()).await.unwrap(),
        [false]
    );
    assert_eq!(gw.reg.list_workers().await.unwrap().len(), 2);
    let r = gw
        .http
        .post(&http, "/v1/completions", &[], "{}")
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(c.pools(), before);
    c.stop().await;
}

fn denied<T>(r: Result<T, Status>) -> bool {
    matches!(r, Err(s) if s.code() == Code::PermissionDenied)
}

/// Every call of section 7's table, made as `role`: `Err(PERMISSION_DENIED-ish)` is `true`.
async fn denied_calls(c: &Cluster, role: PeerRole) -> Vec<(&'static str, bool)> {
    let id = format!("t-{}", role.as_str());
    let tls = c.certs.tls(&id, role);
    let who = Caller::new(c, Some(&tls));
    let (kv, http) = (c.d.addresses().kv, c.d.addresses().http);
    // The decode engine's control port, which also answers HasBlocks and Release.
    let lookup = c.d.addresses().grpc;
    let bad_chunk = KvChunk {
        kv_format: 1,
        total: 1,
        ..KvChunk::default()
    };
    let push = Box::pin(tokio_stream::iter([OutChunk::from(bad_chunk)]));
    let pb_role = match role {
        PeerRole::Prefill => PbRole::Prefill,
        PeerRole::Decode => PbRole::Decode,
        _ => PbRole::Both,
    };
    let beat = WorkerStatus {
        worker_id: id.clone(),
        role: pb_role as i32,
        heartbeat_ms: 60_000,
        ..WorkerStatus::default()
    };
    let http_status = who
        .http
        .post(&http, "/v1/completions", &[], "{}")
        .await
        .map(|r: HttpResponse| r.status)
        .unwrap();
    vec![
        (
            "HasBlocks",
            denied(who.kv.has_blocks(&kv, has_blocks()).await),
        ),
        ("PushKv", denied(who.kv.push(&kv, push).await)),
        ("Release", denied(who.kv.release(&kv, "nope").await)),
        (
            "HasBlocks on the control port",
            denied(who.kv.has_blocks(&lookup, has_blocks()).await),
        ),
        (
            "Release on the control port",
            denied(who.kv.release(&lookup, "nope").await),
        ),
        (
            "Prefill",
            denied(who.ctl.prefill(PrefillRequest::default()).await),
        ),
        ("Cancel", denied(who.ctl.cancel("nope").await)),
        (
            "Generate",
            denied(
                ControlClient::with_tls(&lookup, Some(&tls.tonic_client()))
                    .unwrap()
                    .generate(GenerateRequest::default())
                    .await,
            ),
        ),
        ("Info", denied(who.ctl.info().await)),
        ("POST /v1/completions", http_status == 403),
        ("Heartbeat", denied(who.reg.heartbeat(beat).await)),
        ("ListWorkers", denied(who.reg.list_workers().await)),
        ("SetDrain", denied(who.reg.set_drain("nobody", true).await)),
        // Last: an allowed Drain drains P (it answers at once with deadline 0).
        ("Drain", denied(who.ctl.drain(0).await)),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_are_enforced_on_every_call() {
    use PeerRole::{Admin, Both, Decode, Gateway, Prefill};
    let c = Cluster::start().await;
    let before = c.pools();
    // Section 7's table: who may call what.
    let allowed: [(&str, &[PeerRole]); 14] = [
        ("HasBlocks", &[Gateway, Prefill, Both]),
        ("PushKv", &[Prefill, Both]),
        ("Release", &[Gateway, Prefill, Both]),
        ("HasBlocks on the control port", &[Gateway, Prefill, Both]),
        ("Release on the control port", &[Gateway, Prefill, Both]),
        ("Prefill", &[Gateway, Admin]),
        ("Cancel", &[Gateway, Admin]),
        ("Generate", &[Gateway, Admin]),
        ("Info", &PeerRole::ALL),
        ("POST /v1/completions", &[Gateway, Admin]),
        ("Heartbeat", &[Prefill, Decode, Both]),
        ("ListWorkers", &[Gateway, Admin]),
        ("SetDrain", &[Gateway, Admin]),
        ("Drain", &[Gateway, Admin]),
    ];
    for role in PeerRole::ALL {
        let got = denied_calls(&c, role).await;
        for ((call, denied), (name, roles)) in got.into_iter().zip(allowed) {
            assert_eq!(call, name);
            assert_eq!(
                denied,
                !roles.contains(&role),
                "{} calling {call}: denied = {denied}",
                role.as_str()
            );
        }
    }
    assert_eq!(c.pools(), before, "a refused call touched a pool");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_cannot_speak_for_another_identity() {
    let c = Cluster::start().await;
    let me = Caller::new(&c, Some(&c.certs.tls("d9", PeerRole::Decode)));
    let status = |id: &str, role: PbRole| WorkerStatus {
        worker_id: id.into(),
        role: role as i32,
        heartbeat_ms: 60_000,
        ..WorkerStatus::default()
    };
    let ids = |c: &Cluster| -> Vec<String> {
        c.gw.registry()
            .list(std::time::Instant::now())
            .into_iter()
            .map(|w| w.worker_id)
            .collect()
    };
    // Another worker's id (even a real one), or another role: refused, nothing recorded.
    for (id, role) in [
        ("D", PbRole::Decode),
        ("someone", PbRole::Decode),
        ("d9", PbRole::Prefill),
        ("d9", PbRole::Both),
    ] {
        let err = me.reg.heartbeat(status(id, role)).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{id} {role:?}: {err}");
    }
    assert!(!ids(&c).contains(&"d9".to_owned()));
    assert!(!ids(&c).contains(&"someone".to_owned()));
    // Its own identity: recorded.
    me.reg
        .heartbeat(status("d9", PbRole::Decode))
        .await
        .unwrap();
    assert!(ids(&c).contains(&"d9".to_owned()));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_the_public_endpoint() {
    let certs = Certs::new("keys");
    std::fs::create_dir_all(certs.path()).unwrap();
    let file = certs.path().join("keys");
    std::fs::write(&file, "k-one\n\nk-two\n").unwrap();
    let mut cfg = GatewayConfig::local();
    cfg.gateway.api_keys_file = file.display().to_string();
    let gw = GatewayNode::start(&cfg).await.unwrap();
    let addr = gw.http_addr().to_string();
    let http = HttpClient::default();
    let body = r#"{"prompt": "hi", "max_tokens": 2}"#;
    for (name, headers) in [
        ("no key", vec![]),
        ("wrong key", vec![("authorization", "Bearer k-three")]),
        ("not bearer", vec![("authorization", "Basic k-one")]),
        ("prefix of a key", vec![("authorization", "Bearer k-on")]),
    ] {
        let r = http
            .post(&addr, "/v1/completions", &headers, body)
            .await
            .unwrap();
        assert_eq!(r.status, 401, "{name}");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error", "{name}");
        assert!(r.json()["error"]["message"].is_string(), "{name}");
    }
    let r = http.get(&addr, "/v1/models").await.unwrap();
    assert_eq!(r.status, 401);
    // A good key passes to the request (no engine is registered: 503).
    let r = http
        .post(
            &addr,
            "/v1/completions",
            &[("authorization", "Bearer k-two")],
            body,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    // /health stays open.
    assert_ne!(http.get(&addr, "/health").await.unwrap().status, 401);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_non_loopback_listen_is_refused() {
    for addr in ["0.0.0.0:0", "10.0.0.1:80", "[::]:0", "example.com:80"] {
        let mut c = Config::default();
        c.engine.kv_listen = addr.into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("not a loopback address"), "{addr}: {err}");
        c.allow_insecure = true;
        c.validate().unwrap();
        c.allow_insecure = false;
        c.tls = Some(TlsSection::default());
        c.validate().unwrap();

        let mut g = GatewayConfig::local();
        g.gateway.registry_listen = addr.into();
        assert!(g.validate().is_err(), "{addr}");
        g.allow_insecure = true;
        g.validate().unwrap();
    }
    // The same from the command line, refused before anything is bound.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tl"))
        .args(["engine", "--grpc-listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a loopback address"));
    // The address peers are told is the advertised one, with the bound port.
    let mut c = Config::for_worker("adv", Role::Decode, "");
    c.engine.advertise_address = "localhost".into();
    let node = EngineNode::start(&c).await.unwrap();
    let a = node.addresses();
    for addr in [&a.grpc, &a.kv, &a.http] {
        assert!(addr.starts_with("localhost:"), "{addr}");
    }
    node.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_endpoint_speaks_https_without_client_certificates() {
    let certs = Certs::new("public");
    let issued = issue(certs.path(), "public", PeerRole::Gateway, &[]).unwrap();
    let mut cfg = GatewayConfig::local();
    cfg.gateway.public_tls = Some(tl_engine::net::tls::PublicTls {
        cert: issued.cert.clone(),
        key: issued.key.clone(),
    });
    let gw = GatewayNode::start(&cfg).await.unwrap();
    let addr = gw.http_addr().to_string();
    // An end user's client: trusts the server's CA, presents no certificate.
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read(&issued.ca).unwrap();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&ca) {
        roots.add(c.unwrap()).unwrap();
    }
    let client = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let https = HttpClient::tls(std::sync::Arc::new(client));
    let r = https.get(&addr, "/v1/models").await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // Plain HTTP to the HTTPS port gets no answer.
    assert!(
        HttpClient::default()
            .get(&addr, "/v1/models")
            .await
            .is_err()
    );
    gw.stop().await;
}

/// 300 silent connections from one address (the 270 that kept a restarting engine out for
/// 8.5 s) take at most that address's share of the handshake slots: each beyond it closes that
/// address's oldest silent one. And a peer of the deployment, from the same address, still
/// gets through at once while they stay, because a new handshake displaces the oldest pending
/// one instead of being refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_cannot_hold_more_than_the_handshake_slots() {
    use tl_engine::net::server::MAX_HANDSHAKES_PER_SOURCE;
    use tokio::io::AsyncReadExt;
    let c = Cluster::start().await;
    let addr = c.p.addresses().grpc;
    let mut silent = Vec::new();
    for _ in 0..300 {
        silent.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    // The oldest were closed by the server (read returns 0); the newest are still pending.
    let mut closed = 0;
    for s in &mut silent {
        let mut buf = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
            closed += 1;
        }
    }
    assert!(
        closed >= 300 - MAX_HANDSHAKES_PER_SOURCE,
        "{closed} of 300 silent connections closed"
    );
    let gw = Caller::new(&c, Some(&c.certs.tls("gw3", PeerRole::Gateway)));
    let began = std::time::Instant::now();
    let info = gw.ctl.info().await;
    assert!(info.is_ok(), "{info:?}");
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
    drop(silent);
    c.stop().await;
}

/// Engines that advertise an address no certificate names (as pods advertise their IP): with
/// `peer_name`, peers verify the name every engine certificate carries instead, and requests go
/// through; without it, the dialed address is verified and the pair is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_name_verifies_engines_reached_at_unnamed_addresses() {
    let certs = Certs::new("peer-name");
    for peer_name in [None, Some("kvwire-engine")] {
        let section = |id: &str, role: PeerRole| TlsSection {
            peer_name: peer_name.map(str::to_owned),
            // Issued again on the second pass.
            ..tl_engine::net::tls::issue_with(
                certs.path(),
                id,
                role,
                &["kvwire-engine".to_owned()],
                true,
            )
            .unwrap()
            .section()
        };
        let gw = GatewayNode::start(&GatewayConfig {
            tls: Some(section("gw", PeerRole::Gateway)),
            ..GatewayConfig::local()
        })
        .await
        .unwrap();
        let reg = gw.registry_addr().to_string();
        let cfg = |id: &str, role: Role, peer: PeerRole| {
            let mut c = Config::for_worker(id, role, &reg);
            c.engine.heartbeat_ms = 50;
            // 127.0.0.2 is loopback, but no certificate names it.
            for l in [
                &mut c.engine.grpc_listen,
                &mut c.engine.kv_listen,
                &mut c.engine.http_listen,
            ] {
                *l = "127.0.0.2:0".into();
            }
            c.tls = Some(section(id, peer));
            c
        };
        let p = EngineNode::start(&cfg("P", Role::Prefill, PeerRole::Prefill))
            .await
            .unwrap();
        let d = EngineNode::start(&cfg("D", Role::Decode, PeerRole::Decode))
            .await
            .unwrap();
        assert!(d.addresses().kv.starts_with("127.0.0.2:"));
        assert!(
            common::eventually(Duration::from_secs(5), || gw
                .registry()
                .list(std::time::Instant::now())
                .len()
                == 2)
            .await
        );
        let r = HttpClient::default()
            .post(
                &gw.http_addr().to_string(),
                "/v1/completions",
                &[],
                r#"{"prompt": "hello there", "max_tokens": 4}"#,
            )
            .await
            .unwrap();
        if peer_name.is_some() {
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            assert_eq!(
                r.json()["choices"][0]["tokens"].as_array().unwrap().len(),
                4
            );
        } else {
            assert_ne!(r.status, 200, "an unnamed address passed verification");
        }
        assert_eq!(p.runner().pool().lock().counts().used, 0);
        assert!(common::settled(&d, 0).await);
        p.shutdown(Duration::from_secs(1)).await;
        d.shutdown(Duration::from_secs(1)).await;
        gw.stop().await;
    }
    // A peer_name no certificate can carry is refused when the configuration loads.
    let bad = TlsSection {
        peer_name: Some("not a name".into()),
        ..certs.issue("x", PeerRole::Prefill)
    };
    let e = Tls::load(&bad).unwrap_err();
    assert!(e.to_string().contains("peer_name"), "{e}");
}

/// Outgoing connections check the server's role, not only its CA. An engine whose registry
/// address is answered by a decode engine's certificate (an impostor registry) never registers
/// there, so the impostor cannot drain it; a prefill engine told to push to a server holding a
/// gateway certificate refuses the handshake, and its pool is as before. Against CA-only
/// verification the impostor recorded the engine, and its `drain: true` drained it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outgoing_connections_check_the_servers_role() {
    use tl_engine::gateway::registry::RegistryNode;
    let c = Cluster::start().await;
    let impostor_tls = c.certs.tls("decode-2", PeerRole::Decode);
    let impostor = RegistryNode::start("127.0.0.1:0", Some(&impostor_tls), "127.0.0.1:0")
        .await
        .unwrap();
    let mut cfg = Config::for_worker("D9", Role::Decode, &impostor.addr().to_string());
    cfg.engine.heartbeat_ms = 50;
    cfg.tls = Some(c.certs.issue("D9", PeerRole::Decode));
    let d9 = EngineNode::start(&cfg).await.unwrap();
    let failures = || {
        let text = d9.metrics().encode();
        text.lines()
            .find_map(|l| l.strip_prefix("tl_heartbeat_failures_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(
        common::eventually(Duration::from_secs(5), || failures() >= 3).await,
        "the heartbeat never failed"
    );
    let now = std::time::Instant::now();
    assert!(
        impostor.state().list(now).is_empty(),
        "the engine registered with an impostor: {:?}",
        impostor.state().list(now)
    );
    assert!(
        !impostor.state().set_drain("D9", true),
        "the impostor knows D9"
    );
    assert!(!d9.state().is_draining(), "D9 was drained");

    // A push to a server that is not a decode engine (the gateway's registry port).
    let before = c.pools();
    let gw = Caller::new(&c, Some(&c.certs.tls("gw2", PeerRole::Gateway)));
    let r = gw
        .ctl
        .prefill(PrefillRequest {
            request_id: "to-a-gateway".into(),
            prompt_tokens: (1..=20).collect(),
            decode_target: c.gw.registry_addr().to_string(),
            ..PrefillRequest::default()
        })
        .await;
    let err = r.expect_err("a push to a gateway's port went through");
    assert!(
        err.message().contains("expected a decode or both identity"),
        "{err:?}"
    );
    // Nothing held: the prompt's computed blocks are only cached (evictable) on P, and D saw
    // nothing.
    let idle = || {
        let (p, d) = c.pools();
        p.used == 0 && d == before.1
    };
    assert!(
        common::eventually(Duration::from_secs(5), idle).await,
        "{:?}",
        c.pools()
    );
    c.p.runner().pool().lock().check().unwrap();
    d9.shutdown(Duration::from_secs(1)).await;
    impostor.stop().await;
    c.stop().await;
}
