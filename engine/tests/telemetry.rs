//! Metrics: every engine serves Prometheus text on its own listener, and the counters move by
//! exactly what a push moved or what a refusal refused.

use std::collections::HashMap;
use std::time::Duration;

use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use tl_engine::net::clients::{ControlClient, HttpClient};
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tonic::Code;

/// Scrapes `addr` and parses the text with a Prometheus parser: each sample by its name and
/// sorted labels (histograms as their `_count` and `_sum`).
async fn scrape(addr: &str) -> HashMap<String, f64> {
    let r = HttpClient::default().get(addr, "/metrics").await.unwrap();
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let parsed = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    let mut out = HashMap::new();
    for s in parsed.samples {
        let mut labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        let key = format!("{}{{{}}}", s.metric, labels.join(","));
        let v = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(h) => {
                out.insert(
                    format!("{}_count{{}}", s.metric),
                    h.iter().map(|b| b.count).fold(0.0, f64::max),
                );
                continue;
            }
            prometheus_parse::Value::Summary(_) => continue,
        };
        out.insert(key, v);
    }
    out
}

fn get(m: &HashMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

/// The counters that changed between two scrapes, with their deltas (gauges left out).
fn moved(before: &HashMap<String, f64>, after: &HashMap<String, f64>) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = after
        .iter()
        .filter(|(k, _)| k.contains("_total") || k.ends_with("_count{}"))
        .map(|(k, &a)| (k.clone(), a - get(before, k)))
        .filter(|(_, d)| *d != 0.0)
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_moved() {
    let mut pc = Config::for_worker("P", Role::Prefill, "");
    pc.pool.n_blocks = 64;
    let mut dc = Config::for_worker("D", Role::Decode, "");
    dc.pool.n_blocks = 64;
    let p = EngineNode::start(&pc).await.unwrap();
    let d = EngineNode::start(&dc).await.unwrap();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let request = |id: &str, prompt: Vec<u32>| PrefillRequest {
        cache_scope: Default::default(),
        request_id: id.into(),
        prompt_tokens: prompt,
        sampling: Some(SamplingParams {
            seed: Some(1),
            max_tokens: 4,
            ..SamplingParams::default()
        }),
        decode_target: d.addresses().kv,
        rng_draws_offset: 0,
        decode_holds: None,
        decode_lookup: String::new(),
    };
    // The listening line names the metrics listener.
    let line: serde_json::Value = serde_json::from_str(&p.listening_line()).unwrap();
    assert_eq!(line["metrics"], p.metrics_address());

    // A push of 5 blocks (4 full and a tail), then the same prompt again (4 deduped).
    let prompt: Vec<u32> = (0..18).collect();
    let (p0, d0) = (
        scrape(p.metrics_address()).await,
        scrape(d.metrics_address()).await,
    );
    let h = ctl.prefill(request("a", prompt.clone())).await.unwrap();
    assert!(d.receiver().unwrap().release(&h.handle_id));
    let h2 = ctl.prefill(request("b", prompt.clone())).await.unwrap();
    assert_eq!((h.blocks_sent, h.blocks_deduped), (5, 0));
    assert_eq!((h2.blocks_sent, h2.blocks_deduped), (1, 4));
    let bytes = (h.payload_bytes + h2.payload_bytes) as f64;
    let (p1, d1) = (
        scrape(p.metrics_address()).await,
        scrape(d.metrics_address()).await,
    );
    assert_eq!(
        moved(&p0, &p1),
        [
            ("tl_kv_blocks_deduped_total{}".to_owned(), 4.0),
            ("tl_kv_blocks_sent_total{}".to_owned(), 6.0),
            (
                "tl_kv_payload_bytes_total{direction=sent}".to_owned(),
                bytes
            ),
            ("tl_kv_push_seconds_count{}".to_owned(), 2.0),
        ]
    );
    assert_eq!(
        moved(&d0, &d1),
        [
            (
                "tl_kv_payload_bytes_total{direction=received}".to_owned(),
                bytes
            ),
            ("tl_kv_push_seconds_count{}".to_owned(), 2.0),
        ]
    );
    assert_eq!(get(&d1, "tl_kv_handles_pending{}"), 1.0);
    let pool = d.runner().pool().counts();
    assert_eq!(get(&d1, "tl_pool_blocks{state=used}"), pool.used as f64);
    assert_eq!(
        get(&d1, "tl_pool_blocks{state=free}") + get(&d1, "tl_pool_blocks{state=cached}"),
        (pool.free + pool.cached) as f64
    );
    assert!(d.receiver().unwrap().release(&h2.handle_id));

    // A refused push: the decode pool is full, so D refuses with RESOURCE_EXHAUSTED. Nothing
    // else moves on either side.
    let room = d.runner().pool().lock().available();
    let hog = d.runner().pool().lock().allocate(room).unwrap();
    let err = ctl
        .prefill(request("c", (100..118).collect()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    let (p2, d2) = (
        scrape(p.metrics_address()).await,
        scrape(d.metrics_address()).await,
    );
    assert_eq!(moved(&p1, &p2), []);
    assert_eq!(
        moved(&d1, &d2),
        [(
            "tl_kv_push_refused_total{code=RESOURCE_EXHAUSTED}".to_owned(),
            1.0
        )]
    );
    {
        let mut pool = d.runner().pool().lock();
        for id in hog {
            pool.release(id).unwrap();
        }
    }
    // The decode engine's HTTP front counts its requests too.
    let body = serde_json::json!({ "prompt": [1, 2, 3], "max_tokens": 2 });
    let r = HttpClient::default()
        .post(
            &d.addresses().http,
            "/v1/completions",
            &[],
            body.to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let d3 = scrape(d.metrics_address()).await;
    assert_eq!(
        moved(&d2, &d3),
        [(
            "tl_requests_total{endpoint=/v1/completions,status=200}".to_owned(),
            1.0
        )]
    );
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
}

/// The gateway counts requests by endpoint and status, times first tokens and later tokens,
/// counts its routing decisions and reports live workers by role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_metrics_count_requests() {
    use tl_engine::gateway::GatewayNode;
    use tl_engine::gateway::config::GatewayConfig;

    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    let cfg = |id: &str, role| {
        let mut c = Config::for_worker(id, role, &reg);
        c.engine.heartbeat_ms = 100;
        c.pool.n_blocks = 64;
        c
    };
    let p = EngineNode::start(&cfg("P", Role::Prefill)).await.unwrap();
    let d = EngineNode::start(&cfg("D", Role::Decode)).await.unwrap();
    let metrics = gw.metrics_addr().to_string();
    let live = |m: &HashMap<String, f64>| {
        (
            get(m, "tl_workers{role=prefill}"),
            get(m, "tl_workers{role=decode}"),
            get(m, "tl_workers{role=both}"),
        )
    };
    let mut before = HashMap::new();
    for _ in 0..200 {
        before = scrape(&metrics).await;
        if live(&before) == (1.0, 1.0, 0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(live(&before), (1.0, 1.0, 0.0));
    let http = HttpClient::default();
    let addr = gw.http_addr().to_string();
    let body = serde_json::json!({ "prompt": [1, 2, 3, 4, 5], "max_tokens": 6, "seed": 3 });
    let r = http
        .post(&addr, "/v1/completions", &[], body.to_string())
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let bad = serde_json::json!({ "prompt": [1, 2], "max_tokens": 0 });
    let r = http
        .post(&addr, "/v1/completions", &[], bad.to_string())
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    let after = scrape(&metrics).await;
    assert_eq!(
        moved(&before, &after),
        [
            // The valid request waited once for its place (the refused one never queued).
            ("tl_gateway_queue_wait_seconds_count{}".to_owned(), 1.0),
            (
                "tl_requests_total{endpoint=/v1/completions,status=200}".to_owned(),
                1.0
            ),
            (
                "tl_requests_total{endpoint=/v1/completions,status=400}".to_owned(),
                1.0
            ),
            ("tl_route_decisions_total{reason=by_load}".to_owned(), 1.0),
            ("tl_time_per_output_token_seconds_count{}".to_owned(), 1.0),
            ("tl_time_to_first_token_seconds_count{}".to_owned(), 1.0),
        ]
    );
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
    gw.stop().await;
}

/// Every series the ready Grafana dashboard queries is one the processes publish: the names
/// come from the `# TYPE` lines of a real exposition (a counter's `_total`, a histogram's
/// `_bucket`, `_sum` and `_count`), and every expression's brackets balance.
#[test]
fn dashboard_queries_name_real_metrics() {
    use tl_engine::telemetry::metrics::{CodeLabel, Metrics, RequestLabels};
    // Families with open label sets print their TYPE line once a series exists: make one of
    // each, as a serving process would.
    let m = Metrics::new();
    m.set_pool(1, 2, 3);
    tl_engine::gateway::workers_by_role(&m, &[]);
    m.kv_push_refused
        .get_or_create(&CodeLabel {
            code: "RESOURCE_EXHAUSTED".into(),
        })
        .inc();
    m.requests
        .get_or_create(&RequestLabels {
            endpoint: "/v1/completions".into(),
            status: 200,
        })
        .inc();
    let text = m.encode();
    let mut series = std::collections::HashSet::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if (words.next(), words.next()) != (Some("#"), Some("TYPE")) {
            continue;
        }
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        match kind {
            "counter" => {
                series.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    series.insert(format!("{name}{s}"));
                }
            }
            _ => {
                series.insert(name.to_owned());
            }
        }
    }
    assert!(series.contains("tl_kv_blocks_sent_total"), "{series:?}");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/kvwire.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    assert!(exprs.len() >= 11);
    let mut used = std::collections::HashSet::new();
    for e in &exprs {
        let mut depth = 0i32;
        for c in e.chars() {
            match c {
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => depth -= 1,
                _ => {}
            }
            assert!(depth >= 0, "unbalanced: {e}");
        }
        assert_eq!(depth, 0, "unbalanced: {e}");
        for word in e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("tl_") {
                assert!(series.contains(word), "{word} is not published (in {e})");
                used.insert(word.to_owned());
            }
        }
    }
    // The panels the issue asks for: TTFT/TPOT, bytes and dedup, refusals, pool, workers.
    for name in [
        "tl_time_to_first_token_seconds_bucket",
        "tl_time_per_output_token_seconds_bucket",
        "tl_kv_payload_bytes_total",
        "tl_kv_blocks_deduped_total",
        "tl_kv_push_refused_total",
        "tl_pool_blocks",
        "tl_workers",
    ] {
        assert!(used.contains(name), "no panel queries {name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_follow_the_drain() {
    let mut cfg = Config::for_worker("D", Role::Decode, "");
    cfg.engine.drain_probe = true;
    let node = EngineNode::start(&cfg).await.unwrap();
    let m = node.metrics_address().to_owned();
    let http = HttpClient::default();
    assert_eq!(http.get(&m, "/livez").await.unwrap().status, 200);
    assert_eq!(http.get(&m, "/readyz").await.unwrap().status, 200);
    // What a preStop hook runs: drain, answered once nothing is in flight.
    let r = http
        .post(&m, "/drain?deadline_ms=2000", &[], Vec::new())
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["remaining"], 0);
    assert!(node.state().is_draining());
    let r = http.get(&m, "/readyz").await.unwrap();
    assert_eq!(r.status, 503, "a draining engine is not ready");
    assert!(String::from_utf8_lossy(&r.body).contains("draining"));
    // Still alive: it keeps serving what it has until stopped.
    assert_eq!(http.get(&m, "/livez").await.unwrap().status, 200);
    node.shutdown(Duration::from_millis(100)).await;
}

/// Issue 63, class 1: with the defaults (what `tl serve` runs), nobody on the host, loopback
/// included, drains an engine through its probe listener; and with the drain probe on, a web
/// page (a request the browser marks with `Origin`) does not either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_the_defaults_cannot_be_drained_over_its_probes() {
    let node = EngineNode::start(&Config::for_worker("D", Role::Decode, ""))
        .await
        .unwrap();
    let m = node.metrics_address().to_owned();
    let http = HttpClient::default();
    for _ in 0..3 {
        let r = http
            .post(&m, "/drain?deadline_ms=10", &[], Vec::new())
            .await
            .unwrap();
        assert_eq!(r.status, 403);
        assert!(String::from_utf8_lossy(&r.body).contains("drain_probe"));
    }
    assert!(!node.state().is_draining());
    assert_eq!(http.get(&m, "/readyz").await.unwrap().status, 200);
    node.shutdown(Duration::from_millis(100)).await;

    let mut cfg = Config::for_worker("D2", Role::Decode, "");
    cfg.engine.drain_probe = true;
    let node = EngineNode::start(&cfg).await.unwrap();
    let m = node.metrics_address().to_owned();
    let r = http
        .post(
            &m,
            "/drain?deadline_ms=10",
            &[
                ("origin", "http://attacker.example"),
                ("content-type", "text/plain"),
            ],
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 403);
    assert!(!node.state().is_draining());
    node.shutdown(Duration::from_millis(100)).await;
}
