//! Traces in one process, with an in-memory exporter: a disaggregated prefill yields the prefill
//! side's `kv.transfer` CLIENT span and the decode side's SERVER span in one trace, the second
//! a child of the first, both carrying the push's figures.

use std::time::Duration;

use kvwire_grpc::pb::engine::{PrefillRequest, SamplingParams};
use opentelemetry::trace::{SpanId, SpanKind, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tl_engine::net::clients::ControlClient;
use tl_engine::node::EngineNode;
use tl_engine::node::config::{Config, Role};
use tl_engine::telemetry::{LogFormat, init};

fn attr(s: &SpanData, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// One in-memory exporter for the whole test binary (the subscriber is process-wide); each
/// test looks only at its own trace.
fn traced() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static T: std::sync::OnceLock<(InMemorySpanExporter, SdkTracerProvider)> =
        std::sync::OnceLock::new();
    T.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        init(LogFormat::Text, Some(provider.tracer("tl-test")));
        (exporter, provider)
    })
}

/// The span named `name` of `kind`.
fn find<'a>(spans: &'a [SpanData], name: &str, kind: SpanKind) -> &'a SpanData {
    spans
        .iter()
        .find(|s| s.name == name && s.span_kind == kind)
        .unwrap_or_else(|| panic!("no {name} {kind:?} span in {spans:#?}"))
}

/// The finished spans once `done` holds of them (or after 2 s).
async fn spans_when(done: impl Fn(&[SpanData]) -> bool) -> Vec<SpanData> {
    let (exporter, provider) = traced();
    let mut spans = Vec::new();
    for _ in 0..200 {
        let _ = provider.force_flush();
        spans = exporter.get_finished_spans().unwrap();
        if done(&spans) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    spans
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_transfer_spans_link_prefill_and_decode() {
    traced();

    let p = EngineNode::start(&Config::for_worker("P", Role::Prefill, ""))
        .await
        .unwrap();
    let d = EngineNode::start(&Config::for_worker("D", Role::Decode, ""))
        .await
        .unwrap();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let h = ctl
        .prefill(PrefillRequest {
            cache_scope: Default::default(),
            request_id: "traced".into(),
            prompt_tokens: (0..18).collect(),
            sampling: Some(SamplingParams {
                seed: Some(1),
                max_tokens: 4,
                ..SamplingParams::default()
            }),
            decode_target: d.addresses().kv,
            rng_draws_offset: 0,
            decode_holds: None,
            decode_lookup: String::new(),
        })
        .await
        .unwrap();
    assert_eq!((h.blocks_sent, h.blocks_deduped), (5, 0));

    // The spans end as their calls do: wait for all four of this handle's trace.
    let mine = |s: &SpanData| attr(s, "kv.handle_id").as_deref() == Some(h.handle_id.as_str());
    let trace_of = |all: &[SpanData]| {
        all.iter()
            .find(|s| mine(s))
            .map(|s| s.span_context.trace_id())
    };
    let complete = |all: &[SpanData]| {
        trace_of(all).is_some_and(|t| {
            all.iter().filter(|s| mine(s)).count() == 2
                && all
                    .iter()
                    .filter(|s| s.span_context.trace_id() == t)
                    .count()
                    >= 4
        })
    };
    let all = spans_when(complete).await;
    let trace = trace_of(&all).expect("no kv.transfer span");
    let spans: Vec<SpanData> = all
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .collect();
    let find = |name: &str, kind: SpanKind| find(&spans, name, kind);
    let call = find("EngineControl/Prefill", SpanKind::Server);
    let compute = find("engine.prefill", SpanKind::Internal);
    let client = find("kv.transfer", SpanKind::Client);
    let server = find("kv.transfer", SpanKind::Server);
    for s in [compute, client, server] {
        assert_eq!(
            s.span_context.trace_id(),
            trace,
            "{} in another trace",
            s.name
        );
    }
    assert_eq!(
        call.parent_span_id,
        SpanId::INVALID,
        "the call had no parent"
    );
    assert_eq!(compute.parent_span_id, call.span_context.span_id());
    assert_eq!(client.parent_span_id, call.span_context.span_id());
    assert_eq!(server.parent_span_id, client.span_context.span_id());
    // Both sides' figures equal the KvHandle's (the ack's).
    for s in [client, server] {
        assert_eq!(attr(s, "kv.blocks_sent"), Some(h.blocks_sent.to_string()));
        assert_eq!(
            attr(s, "kv.blocks_deduped"),
            Some(h.blocks_deduped.to_string())
        );
        assert_eq!(
            attr(s, "kv.payload_bytes"),
            Some(h.payload_bytes.to_string())
        );
        assert_eq!(attr(s, "kv.handle_id"), Some(h.handle_id.clone()));
        assert_eq!(attr(s, "rpc.grpc.status_code"), Some("0".into()));
    }
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
}

/// A client's request with its own `traceparent`, through the gateway over a prefill and a
/// decode engine: one trace, the client's span its root, holding the gateway's SERVER span,
/// `route`, P's Prefill call, both `kv.transfer` spans, D's Generate call and its
/// `engine.decode`, each under the right parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trace_covers_gateway_prefill_and_decode() {
    use tl_engine::gateway::GatewayNode;
    use tl_engine::gateway::config::GatewayConfig;
    use tl_engine::net::clients::HttpClient;

    traced();
    let gw = GatewayNode::start(&GatewayConfig::local()).await.unwrap();
    let reg = gw.registry_addr().to_string();
    let cfg = |id: &str, role| {
        let mut c = Config::for_worker(id, role, &reg);
        c.engine.heartbeat_ms = 100;
        c
    };
    let p = EngineNode::start(&cfg("P", Role::Prefill)).await.unwrap();
    let d = EngineNode::start(&cfg("D", Role::Decode)).await.unwrap();
    for _ in 0..200 {
        if gw.registry().list(std::time::Instant::now()).len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{client_span}-01");
    let body =
        serde_json::json!({ "prompt": (0..18).collect::<Vec<u32>>(), "max_tokens": 4, "seed": 2 });
    let r = HttpClient::default()
        .post(
            &gw.http_addr().to_string(),
            "/v1/completions",
            &[("traceparent", traceparent.as_str())],
            body.to_string(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let ours = |s: &SpanData| s.span_context.trace_id().to_string() == trace_id;
    let names = [
        "POST /v1/completions",
        "route",
        "EngineControl/Prefill",
        "engine.prefill",
        "kv.transfer",
        "EngineControl/Generate",
        "engine.decode",
    ];
    let spans: Vec<SpanData> = spans_when(|all| {
        names
            .iter()
            .all(|n| all.iter().any(|s| ours(s) && s.name == *n))
            && all
                .iter()
                .filter(|s| ours(s) && s.name == "kv.transfer")
                .count()
                == 2
    })
    .await
    .into_iter()
    .filter(|s| ours(s))
    .collect();
    let find = |name: &str, kind: SpanKind| find(&spans, name, kind);
    let request = find("POST /v1/completions", SpanKind::Server);
    let route = find("route", SpanKind::Internal);
    let call = find("EngineControl/Prefill", SpanKind::Server);
    let client = find("kv.transfer", SpanKind::Client);
    let server = find("kv.transfer", SpanKind::Server);
    let resume = find("EngineControl/Generate", SpanKind::Server);
    let decode = find("engine.decode", SpanKind::Internal);
    assert_eq!(request.parent_span_id.to_string(), client_span);
    assert_eq!(route.parent_span_id, request.span_context.span_id());
    assert_eq!(call.parent_span_id, request.span_context.span_id());
    assert_eq!(client.parent_span_id, call.span_context.span_id());
    assert_eq!(server.parent_span_id, client.span_context.span_id());
    assert_eq!(resume.parent_span_id, request.span_context.span_id());
    assert_eq!(decode.parent_span_id, resume.span_context.span_id());
    assert_eq!(attr(decode, "kv.handle_id"), attr(client, "kv.handle_id"));
    p.shutdown(Duration::from_secs(1)).await;
    d.shutdown(Duration::from_secs(1)).await;
    gw.stop().await;
}
