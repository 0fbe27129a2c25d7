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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_transfer_spans_link_prefill_and_decode() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    init(LogFormat::Text, Some(provider.tracer("tl-test")));

    let p = EngineNode::start(&Config::for_worker("P", Role::Prefill, ""))
        .await
        .unwrap();
    let d = EngineNode::start(&Config::for_worker("D", Role::Decode, ""))
        .await
        .unwrap();
    let ctl = ControlClient::new(&p.addresses().grpc).unwrap();
    let h = ctl
        .prefill(PrefillRequest {
            request_id: "traced".into(),
            prompt_tokens: (0..18).collect(),
            sampling: Some(SamplingParams {
                seed: Some(1),
                max_tokens: 4,
                ..SamplingParams::default()
            }),
            decode_target: d.addresses().kv,
        })
        .await
        .unwrap();
    assert_eq!((h.blocks_sent, h.blocks_deduped), (5, 0));

    // The spans end as their calls do: wait for all four.
    let mut spans = Vec::new();
    for _ in 0..200 {
        let _ = provider.force_flush();
        spans = exporter.get_finished_spans().unwrap();
        let n = |name: &str| spans.iter().filter(|s| s.name == name).count();
        if n("kv.transfer") == 2 && n("EngineControl/Prefill") == 1 && n("engine.prefill") == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let find = |name: &str, kind: SpanKind| {
        spans
            .iter()
            .find(|s| s.name == name && s.span_kind == kind)
            .unwrap_or_else(|| panic!("no {name} {kind:?} span in {spans:#?}"))
    };
    let call = find("EngineControl/Prefill", SpanKind::Server);
    let compute = find("engine.prefill", SpanKind::Internal);
    let client = find("kv.transfer", SpanKind::Client);
    let server = find("kv.transfer", SpanKind::Server);
    let trace = call.span_context.trace_id();
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
