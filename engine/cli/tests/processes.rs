//! The real binaries as child processes: `tl registry`, a prefill and a decode `tl engine`,
//! registration seen through ListWorkers, one disaggregated request, then SIGTERM for all.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvwire_grpc::pb::control::Role;
use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use serde_json::{Value, json};
use tl_engine::net::clients::RegistryClient;
use tl_engine::net::clients::{ControlClient, HttpClient};
use tl_engine::net::server::free_loopback_port;
use tl_engine::node::config::Config;
use tl_engine_core::engine::{Engine, Mode, Request};
use tl_engine_core::sampler::{Sampling, SamplingRequest};

/// A child process killed on drop, so a failing test leaves nothing running.
struct Proc {
    child: Child,
    listening: Value,
}

impl Proc {
    fn start(args: &[&str]) -> Proc {
        Self::start_env(args, &[])
    }

    fn start_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tl"))
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let listening: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{args:?} printed {line:?}: {e}"));
        assert_eq!(listening["event"], "listening");
        Proc { child, listening }
    }

    fn addr(&self, key: &str) -> String {
        self.listening[key]
            .as_str()
            .unwrap_or_else(|| panic!("no {key} in {}", self.listening))
            .to_owned()
    }

    /// SIGTERM, then the exit status (within `limit`).
    fn terminate(mut self, limit: Duration) -> Option<i32> {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_and_engines_as_processes() {
    let reg = Proc::start(&["registry", "--listen", "127.0.0.1:0"]);
    let reg_addr = reg.addr("registry");
    let p = Proc::start(&[
        "engine",
        "--role",
        "prefill",
        "--id",
        "P",
        "--gateway-registry",
        &reg_addr,
    ]);
    let d = Proc::start(&[
        "engine",
        "--role",
        "decode",
        "--id",
        "D",
        "--gateway-registry",
        &reg_addr,
    ]);
    assert!(
        p.listening.get("kv").is_none() && p.listening.get("http").is_none(),
        "{}",
        p.listening
    );

    // Both register (their first beat is immediate).
    let client = RegistryClient::new(&reg_addr, Duration::from_secs(1)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let workers = loop {
        let w = client.list_workers().await.unwrap_or_default();
        if w.len() == 2 || Instant::now() > end {
            break w;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(workers.len(), 2, "{workers:?}");
    let dec = workers
        .iter()
        .find(|w| w.role == Role::Decode as i32)
        .unwrap();
    assert_eq!(dec.kv_address, d.addr("kv"));
    assert_eq!(dec.http_address, d.addr("http"));
    let pre = workers
        .iter()
        .find(|w| w.role == Role::Prefill as i32)
        .unwrap();
    assert_eq!(pre.grpc_address, p.addr("grpc"));
    assert!(pre.kv_address.is_empty());

    // One disaggregated request, equal to a colocated run.
    let prompt: Vec<u32> = b"the quick brown fox"
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    let ctl = ControlClient::new(&pre.grpc_address).unwrap();
    let h = ctl
        .prefill(PrefillRequest {
            cache_scope: Default::default(),
            request_id: "proc-1".into(),
            prompt_tokens: prompt.clone(),
            sampling: Some(SamplingParams {
                temperature: 0.7,
                top_p: 0.95,
                top_k: 0,
                seed: Some(99),
                max_tokens: 12,
                ..SamplingParams::default()
            }),
            decode_target: dec.kv_address.clone(),
            rng_draws_offset: 0,
            decode_holds: None,
            // Asked on the decode engine's control port, as a gateway says.
            decode_lookup: dec.grpc_address.clone(),
        })
        .await
        .unwrap();
    let got = common::resume(&dec.grpc_address, &prompt, &h, (0.7, 0.95, 0), 12)
        .await
        .unwrap()
        .tokens[0]
        .clone();
    let cfg = Config::default();
    let sampling = Sampling::new(
        SamplingRequest {
            temperature: 0.7,
            top_p: 0.95,
            top_k: 0,
            ..SamplingRequest::default()
        },
        cfg.model.vocab,
    )
    .unwrap();
    let want = Engine::new(cfg.build_model().unwrap(), cfg.build_pool())
        .generate(Request {
            scope: Default::default(),
            prompt,
            sampling,
            seed: 99,
            max_tokens: 12,
            mode: Mode::Generate,
            draws_offset: 0,
            stop: tl_engine_core::stop::Stop::default(),
            choices: tl_engine_core::engine::Choices::ONE,
            earlier_output: 0,
            constraint: None,
        })
        .unwrap();
    assert_eq!(got, want);

    // SIGTERM: each drains and exits 0, promptly when idle.
    for proc in [p, d, reg] {
        assert_eq!(proc.terminate(Duration::from_secs(5)), Some(0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_within_deadline_whatever_peers_do() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = std::env::temp_dir().join(format!("tl-sigterm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("engine.toml");
    // A 500 ms drain; every peer below would hold the process far longer on its own.
    std::fs::write(
        &cfg,
        "[engine]\nrole = \"decode\"\n[model]\ndecode_us_per_seq = 2000\n\
         [limits]\ndrain_ms = 500\npush_idle_ms = 60000\nheader_read_ms = 60000\n",
    )
    .unwrap();
    let d = Proc::start(&["engine", "--config", cfg.to_str().unwrap(), "--id", "D"]);
    let (kv, http) = (d.addr("kv"), d.addr("http"));

    // 1. A push that sends one chunk and then nothing.
    let t = std::sync::Arc::new(kvwire_grpc::GrpcTransport::new(
        kvwire_grpc::TransportConfig::for_envelope(172),
    ));
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let t2 = std::sync::Arc::clone(&t);
    let kv2 = kv.clone();
    let _stalled_push = tokio::spawn(async move {
        use kvwire_grpc::KvTransport;
        t2.push(
            &kv2,
            Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)),
        )
        .await
    });
    let payload = {
        let p = vec![1u8; 128];
        let mut out = Vec::new();
        let rec = kvwire::RecordIn {
            hash: 0,
            fill: 1,
            payload: &p,
        };
        kvwire::write_to_vec(&kvwire::Shape::v1(4, 2, 1, 4), &[rec], &mut out).unwrap();
        bytes::Bytes::from(out)
    };
    tx.send(kvwire_grpc::OutChunk::from(kvwire_grpc::pb::kv::KvChunk {
        handle_id: "stall".into(),
        total: 2,
        kv_format: 1,
        payload_crc32c: kvwire::crc32c(&payload),
        payload,
        ..Default::default()
    }))
    .await
    .unwrap();
    // 2. Half an HTTP request header, then silence.
    let mut half = tokio::net::TcpStream::connect(&http).await.unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
        .await
        .unwrap();
    // 3. A streaming generation whose reader never reads.
    let mut deaf = tokio::net::TcpStream::connect(&http).await.unwrap();
    let body = r#"{"prompt": [1, 2, 3], "max_tokens": 4000, "stream": true, "seed": 1}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    deaf.write_all(req.as_bytes()).await.unwrap();
    // Its answer started (the first bytes arrive); from here the reader reads nothing more.
    let mut first = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), deaf.read(&mut first))
        .await
        .expect("the generation never answered")
        .unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &first[..n]);

    let t0 = Instant::now();
    let code = d.terminate(Duration::from_secs(5));
    let took = t0.elapsed();
    assert_eq!(code, Some(0), "did not exit 0 within 5 s");
    // drain_ms + 1 s.
    assert!(took < Duration::from_millis(1500), "exit took {took:?}");
    drop((tx, half, deaf));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A client's request with its own `traceparent` through `tl gateway`, a prefill and a decode
/// `tl engine`, each a process exporting spans over OTLP/gRPC to a receiver this test runs: one
/// trace holds the gateway's SERVER span, P's Prefill, `engine.prefill` and `kv.transfer`
/// spans, and D's `kv.transfer` and `engine.decode` spans, each under the right parent, from
/// the right service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_crosses_processes() {
    use tl_engine::telemetry::receiver::Receiver;

    let receiver = Receiver::start().await.unwrap();
    let otlp = receiver.addr().to_string();
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str())];
    let gw = Proc::start_env(
        &[
            "gateway",
            "--public-unauthenticated",
            "--http-listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
        ],
        &env,
    );
    let reg = gw.addr("registry");
    let engine = |role: &str, id: &str| {
        Proc::start_env(
            &[
                "engine",
                "--role",
                role,
                "--id",
                id,
                "--gateway-registry",
                &reg,
            ],
            &env,
        )
    };
    let (_p, _d) = (engine("prefill", "P"), engine("decode", "D"));
    let http = HttpClient::default();
    let addr = gw.addr("http");
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        // `/workers` is for admin keys; `/health` counts the live workers for anyone.
        let r = http.get(&addr, "/health").await.unwrap();
        if r.json()["workers"] == 2 {
            break;
        }
        assert!(Instant::now() < end, "engines never registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let client_span = "b7ad6b7169203331";
    let traceparent = format!("00-{trace_id}-{client_span}-01");
    let body = json!({ "prompt": (0..18).collect::<Vec<u32>>(), "max_tokens": 4, "seed": 9 });
    let r = http
        .post(
            &addr,
            "/v1/completions",
            &[("traceparent", &traceparent)],
            body.to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));

    let wanted = [
        "POST /v1/completions",
        "route",
        "EngineControl/Prefill",
        "engine.prefill",
        "EngineControl/Generate",
        "engine.decode",
    ];
    let end = Instant::now() + Duration::from_secs(10);
    let spans = loop {
        let spans: Vec<_> = receiver
            .spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect();
        let complete = wanted.iter().all(|w| spans.iter().any(|s| s.name == *w))
            && spans.iter().filter(|s| s.name == "kv.transfer").count() == 2;
        if complete || Instant::now() > end {
            break spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let find = |name: &str, kind: i32| {
        spans
            .iter()
            .find(|s| s.name == name && s.kind == kind)
            .unwrap_or_else(|| panic!("no {name} (kind {kind}) in {spans:#?}"))
    };
    let (internal, server, client) = (1, 2, 3);
    let request = find("POST /v1/completions", server);
    let route = find("route", internal);
    let call = find("EngineControl/Prefill", server);
    let compute = find("engine.prefill", internal);
    let push = find("kv.transfer", client);
    let receive = find("kv.transfer", server);
    let resume = find("EngineControl/Generate", server);
    let decode = find("engine.decode", internal);
    assert_eq!(request.parent_span_id, client_span);
    assert_eq!(route.parent_span_id, request.span_id);
    assert_eq!(call.parent_span_id, request.span_id);
    assert_eq!(compute.parent_span_id, call.span_id);
    assert_eq!(push.parent_span_id, call.span_id);
    assert_eq!(receive.parent_span_id, push.span_id);
    assert_eq!(resume.parent_span_id, request.span_id);
    assert_eq!(decode.parent_span_id, resume.span_id);
    assert_eq!(request.service, "tl-gateway");
    for s in [call, compute, push, receive, resume, decode] {
        assert_eq!(s.service, "tl-engine", "{}", s.name);
    }
    assert_eq!(push.attr("tl.worker"), Some("P"));
    assert_eq!(receive.attr("tl.worker"), Some("D"));
    assert_eq!(decode.attr("tl.worker"), Some("D"));
    assert_eq!(receive.attr("kv.blocks_sent"), push.attr("kv.blocks_sent"));
    assert_eq!(push.attr("kv.blocks_sent"), Some("5"));
}

/// P/D equals colocated on the real transformer, across processes: `tl model init` writes a
/// tiny Llama checkpoint, a prefill and a decode `tl engine --model DIR` serve it, and each
/// request, greedy and seeded, prefilled in one process and decoded in the other, has exactly
/// the tokens of a colocated run of the same checkpoint in this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_colocated_on_the_real_model_across_processes() {
    let dir = std::env::temp_dir().join(format!("tl-proc-llama-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_tl"))
        .args(["model", "init", "--dir"])
        .arg(&dir)
        .args(["--seed", "5"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let model = dir.display().to_string();
    let reg = Proc::start(&["registry", "--listen", "127.0.0.1:0"]);
    let reg_addr = reg.addr("registry");
    let engine = |role: &str, id: &str| {
        Proc::start(&[
            "engine",
            "--role",
            role,
            "--id",
            id,
            "--gateway-registry",
            &reg_addr,
            "--model",
            &model,
        ])
    };
    let (p, d) = (engine("prefill", "P"), engine("decode", "D"));
    let ctl = ControlClient::new(&p.addr("grpc")).unwrap();
    let mut cfg = Config::default();
    cfg.set_model(&model);
    let prompts: [Vec<u32>; 2] = [
        b"the quick brown fox"
            .iter()
            .map(|&b| u32::from(b))
            .collect(),
        (0..37).map(|i| (i * 7 + 1) % 256).collect(),
    ];
    for (n, prompt) in prompts.iter().enumerate() {
        for (t, seed) in [(0.0f32, 1u64), (0.8, 77)] {
            let h = ctl
                .prefill(PrefillRequest {
                    cache_scope: 0,
                    request_id: format!("llama-{n}-{seed}"),
                    prompt_tokens: prompt.clone(),
                    sampling: Some(SamplingParams {
                        temperature: t,
                        top_p: 1.0,
                        top_k: 0,
                        seed: Some(seed),
                        max_tokens: 16,
                        ..SamplingParams::default()
                    }),
                    decode_target: d.addr("kv"),
                    decode_lookup: String::new(),
                    rng_draws_offset: 0,
                    decode_holds: None,
                })
                .await
                .unwrap();
            let got = common::resume(&d.addr("grpc"), prompt, &h, (t, 1.0, 0), 16)
                .await
                .unwrap()
                .tokens[0]
                .clone();
            let s = SamplingRequest {
                temperature: t,
                ..SamplingRequest::default()
            };
            let want = cfg.colocated(prompt, s, seed, 16).unwrap();
            assert_eq!(got, want, "prompt {n}, temperature {t}");
        }
    }
    for proc in [p, d, reg] {
        assert_eq!(proc.terminate(Duration::from_secs(5)), Some(0));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An engine pointed at a registry that is not there says so on stderr at its first beat,
/// naming the address and the error, and again at every missed beat (backing off); `/readyz`
/// stays 503 until a beat is acknowledged, then turns 200 once a registry comes up there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_cannot_reach_its_registry_says_so() {
    // A loopback port with nothing on it, for a registry to take later.
    let addr = format!("127.0.0.1:{}", free_loopback_port().unwrap());
    let dir = std::env::temp_dir().join(format!("tl-unreachable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("engine.toml");
    std::fs::write(&cfg, "[engine]\nheartbeat_ms = 200\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tl"))
        .args(["engine", "--role", "decode", "--id", "lonely", "--config"])
        .arg(&cfg)
        .args(["--gateway-registry", &addr])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let listening: Value = serde_json::from_str(&line).unwrap();
    let metrics = listening["metrics"].as_str().unwrap().to_owned();
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, String)>();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), l));
        }
    });
    let mut child = scopeguard(child);
    // Two complaints, each naming the address and the error.
    let mut complaints = Vec::new();
    while complaints.len() < 2 {
        let (at, l) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("no complaint on stderr within 5 s");
        if l.contains("cannot reach the gateway registry") {
            assert!(l.contains(&addr), "{l}");
            assert!(l.contains("error"), "{l}");
            complaints.push(at);
        }
    }
    assert!(
        complaints[0] - started < Duration::from_secs(2),
        "the first complaint came {:?} after the start",
        complaints[0] - started
    );
    let http = HttpClient::default();
    let r = http.get(&metrics, "/readyz").await.unwrap();
    assert_eq!(r.status, 503, "ready before any beat was acknowledged");
    assert!(String::from_utf8_lossy(&r.body).contains(&addr));
    // A registry comes up at that address: the engine registers and turns ready.
    let _reg = Proc::start(&["registry", "--listen", &addr]);
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        if http.get(&metrics, "/readyz").await.unwrap().status == 200 {
            break;
        }
        assert!(
            Instant::now() < end,
            "not ready 5 s after the registry came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.0.kill();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kills the child on drop, so a failing assertion leaves nothing running.
struct Guard(Child);

fn scopeguard(c: Child) -> Guard {
    Guard(c)
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
