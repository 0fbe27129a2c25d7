//! Span export never holds a request up: with the collector's port answering nothing (it
//! accepts connections and stays silent), requests are served as usual while the exporter's
//! batches time out, and the spans it drops are counted.

use std::time::{Duration, Instant};

use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use tl_engine::net::clients::ControlClient;
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine::telemetry::{LogFormat, export, start};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exporter_outage_never_blocks_requests() {
    // A collector that accepts and never answers: every export waits for its timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = silent.local_addr().unwrap().to_string();
    let provider =
        std::thread::spawn(move || start(LogFormat::Text, Some(&endpoint), "tl-engine", "outage"))
            .join()
            .unwrap()
            .expect("an exporter");
    let p = EngineNode::start(&Config::for_worker("P", Role::Prefill, ""))
        .await
        .unwrap();
    let d = EngineNode::start(&Config::for_worker("D", Role::Decode, ""))
        .await
        .unwrap();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    // 50 disaggregated prefills, each well within a deadline far below one export timeout:
    // none waits for the exporter.
    let started = Instant::now();
    for i in 0..50u32 {
        let one = Instant::now();
        let h = ctl
            .prefill(PrefillRequest {
                cache_scope: Default::default(),
                request_id: format!("r{i}"),
                prompt_tokens: (i..i + 18).collect(),
                sampling: Some(SamplingParams {
                    seed: Some(1),
                    max_tokens: 2,
                    ..SamplingParams::default()
                }),
                decode_target: d.addresses().kv,
                rng_draws_offset: 0,
                decode_holds: None,
                decode_lookup: String::new(),
            })
            .await
            .unwrap();
        assert!(d.receiver().unwrap().release(&h.handle_id));
        assert!(
            one.elapsed() < export::EXPORT_TIMEOUT,
            "request {i} waited {:?}",
            one.elapsed()
        );
    }
    let served = started.elapsed();
    // Flushing waits for the stuck exports to time out; their spans are counted as dropped.
    let flushed = tokio::task::spawn_blocking(move || {
        let _ = provider.force_flush();
        let _ = provider.shutdown();
    });
    let _ = tokio::time::timeout(Duration::from_secs(30), flushed).await;
    assert!(
        export::spans_dropped() > 0,
        "no dropped span was counted (served in {served:?})"
    );
    let scraped = tl_engine::net::clients::HttpClient::default()
        .get(p.metrics_address(), "/metrics")
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&scraped.body).into_owned();
    assert!(
        text.lines()
            .any(|l| l.starts_with("tl_trace_spans_dropped_total ") && !l.ends_with(" 0")),
        "{text}"
    );
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
    drop(silent);
}
