//! The hand-written prost messages against `proto/tl/**.proto`, parsed with protox: every
//! message's field names, numbers and types, and every service's methods, so they cannot drift.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::path::PathBuf;

use kvwire_grpc::pb::{control, engine, kv};
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, MapKey, ReflectMessage, Value};

fn pool() -> DescriptorPool {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let mut c = protox::Compiler::new([&root]).unwrap();
    c.include_imports(true);
    c.open_files([
        "tl/kv/v1/kv.proto",
        "tl/engine/v1/engine.proto",
        "tl/control/v1/control.proto",
    ])
    .unwrap();
    c.descriptor_pool()
}

/// A dynamic message of type `name` with these fields set.
fn dynamic(pool: &DescriptorPool, name: &str, fields: &[(&str, Value)]) -> DynamicMessage {
    let desc = pool
        .get_message_by_name(name)
        .unwrap_or_else(|| panic!("{name} is not in the .proto files"));
    let mut m = DynamicMessage::new(desc);
    for (f, v) in fields {
        assert!(
            m.descriptor().get_field_by_name(f).is_some(),
            "{name} has no field {f}"
        );
        m.set_field_by_name(f, v.clone());
    }
    m
}

/// `msg` sets every field to a non-default value; `expected` lists each proto field name with
/// the value it must decode to. Checks both directions of the wire.
fn conform<M: Message + Default + PartialEq + Debug>(
    pool: &DescriptorPool,
    name: &str,
    msg: &M,
    expected: &[(&str, Value)],
) {
    let desc = pool
        .get_message_by_name(name)
        .unwrap_or_else(|| panic!("{name} is not in the .proto files"));
    let proto: BTreeSet<String> = desc.fields().map(|f| f.name().to_owned()).collect();
    let rust: BTreeSet<String> = expected.iter().map(|(n, _)| (*n).to_owned()).collect();
    assert_eq!(
        rust, proto,
        "{name}: the Rust struct's fields are not the .proto's"
    );

    // Rust bytes read by the .proto's descriptor: every field lands where the contract says.
    let decoded = DynamicMessage::decode(desc.clone(), msg.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        decoded.unknown_fields().count(),
        0,
        "{name}: fields the .proto does not know"
    );
    for (field, value) in expected {
        let got = decoded.get_field_by_name(field).unwrap();
        assert_eq!(got.as_ref(), value, "{name}.{field}");
    }
    // Bytes written from the descriptor read back by the Rust struct.
    let built = dynamic(pool, name, expected);
    let back = M::decode(built.encode_to_vec().as_slice()).unwrap();
    assert_eq!(&back, msg, "{name}: decoding the .proto's encoding");
}

#[test]
fn proto_matches_hand_written_messages() {
    let p = pool();
    use Value::*;
    let u64s = |v: &[u64]| List(v.iter().map(|&x| U64(x)).collect());

    // tl.kv.v1
    conform(
        &p,
        "tl.kv.v1.HasBlocksRequest",
        &kv::HasBlocksRequest {
            hashes: vec![1, u64::MAX],
            kv_format: 1,
            model: "m".into(),
            tokens: vec![3, u32::MAX],
            cache_scope: u64::MAX - 1,
        },
        &[
            ("hashes", u64s(&[1, u64::MAX])),
            ("kv_format", U32(1)),
            ("model", String("m".into())),
            ("tokens", List(vec![U32(3), U32(u32::MAX)])),
            ("cache_scope", U64(u64::MAX - 1)),
        ],
    );
    conform(
        &p,
        "tl.kv.v1.HasBlocksResponse",
        &kv::HasBlocksResponse {
            present: vec![true, false],
        },
        &[("present", List(vec![Bool(true), Bool(false)]))],
    );
    conform(
        &p,
        "tl.kv.v1.KvChunk",
        &kv::KvChunk {
            handle_id: "h".into(),
            index: 2,
            total: 3,
            hash: 4,
            kv_format: 5,
            payload: bytes::Bytes::from_static(b"xyz"),
            payload_crc32c: 0xFFFF_FFFE,
            model: "m".into(),
            tokens: vec![0, 9],
            cache_scope: 11,
        },
        &[
            ("handle_id", String("h".into())),
            ("index", U32(2)),
            ("total", U32(3)),
            ("hash", U64(4)),
            ("kv_format", U32(5)),
            ("payload", Value::Bytes(bytes::Bytes::from_static(b"xyz"))),
            ("payload_crc32c", U32(0xFFFF_FFFE)),
            ("model", String("m".into())),
            ("tokens", List(vec![U32(0), U32(9)])),
            ("cache_scope", U64(11)),
        ],
    );
    conform(
        &p,
        "tl.kv.v1.KvAck",
        &kv::KvAck {
            handle_id: "h".into(),
            blocks_received: 1,
            blocks_deduped: 2,
            payload_bytes: 1 << 40,
        },
        &[
            ("handle_id", String("h".into())),
            ("blocks_received", U32(1)),
            ("blocks_deduped", U32(2)),
            ("payload_bytes", U64(1 << 40)),
        ],
    );
    conform(
        &p,
        "tl.kv.v1.ReleaseRequest",
        &kv::ReleaseRequest {
            handle_id: "h".into(),
        },
        &[("handle_id", String("h".into()))],
    );
    conform(
        &p,
        "tl.kv.v1.ReleaseResponse",
        &kv::ReleaseResponse { released: true },
        &[("released", Bool(true))],
    );

    // tl.engine.v1
    let sp = engine::SamplingParams {
        temperature: 0.5,
        top_p: 0.25,
        top_k: 7,
        seed: Some(9),
        max_tokens: 12,
        min_p: 0.125,
        presence_penalty: -1.5,
        frequency_penalty: 0.75,
        repetition_penalty: 1.25,
        logit_bias: [(3, -100.0)].into(),
        earlier_output: 4,
        structured: Some(engine::Structured {
            kind: "regex".into(),
            text: "[0-9]+".into(),
        }),
    };
    let structured_fields = [
        ("kind", String("regex".into())),
        ("text", String("[0-9]+".into())),
    ];
    conform(
        &p,
        "tl.engine.v1.Structured",
        sp.structured.as_ref().unwrap(),
        &structured_fields,
    );
    let sp_fields = [
        ("temperature", F32(0.5)),
        ("top_p", F32(0.25)),
        ("top_k", U32(7)),
        ("seed", U64(9)),
        ("max_tokens", U32(12)),
        ("min_p", F32(0.125)),
        ("presence_penalty", F32(-1.5)),
        ("frequency_penalty", F32(0.75)),
        ("repetition_penalty", F32(1.25)),
        ("logit_bias", Map([(MapKey::U32(3), F32(-100.0))].into())),
        ("earlier_output", U32(4)),
        (
            "structured",
            Message(dynamic(&p, "tl.engine.v1.Structured", &structured_fields)),
        ),
    ];
    conform(&p, "tl.engine.v1.SamplingParams", &sp, &sp_fields);
    let holds_fields = [
        ("kv_format", U32(1)),
        ("present", List(vec![Bool(true), Bool(false)])),
    ];
    conform(
        &p,
        "tl.engine.v1.PrefillRequest",
        &engine::PrefillRequest {
            request_id: "r".into(),
            prompt_tokens: vec![1, 2],
            sampling: Some(sp.clone()),
            decode_target: "d:1".into(),
            rng_draws_offset: 7,
            decode_holds: Some(engine::DecodeHolds {
                kv_format: 1,
                present: vec![true, false],
            }),
            cache_scope: 42,
            decode_lookup: "d:2".into(),
        },
        &[
            ("request_id", String("r".into())),
            ("prompt_tokens", List(vec![U32(1), U32(2)])),
            (
                "sampling",
                Message(dynamic(&p, "tl.engine.v1.SamplingParams", &sp_fields)),
            ),
            ("decode_target", String("d:1".into())),
            ("rng_draws_offset", U32(7)),
            (
                "decode_holds",
                Message(dynamic(&p, "tl.engine.v1.DecodeHolds", &holds_fields)),
            ),
            ("cache_scope", U64(42)),
            ("decode_lookup", String("d:2".into())),
        ],
    );
    conform(
        &p,
        "tl.engine.v1.DecodeHolds",
        &engine::DecodeHolds {
            kv_format: 1,
            present: vec![true, false],
        },
        &holds_fields,
    );
    conform(
        &p,
        "tl.engine.v1.KvHandle",
        &engine::KvHandle {
            handle_id: "h".into(),
            first_token: 1,
            block_hashes: vec![2, 3],
            rng_draws_consumed: 4,
            seed: 5,
            prompt_tokens: 6,
            decode_target: "d".into(),
            blocks_sent: 7,
            blocks_deduped: 8,
            payload_bytes: 9,
            kv_format: 10,
        },
        &[
            ("handle_id", String("h".into())),
            ("first_token", U32(1)),
            ("block_hashes", u64s(&[2, 3])),
            ("rng_draws_consumed", U32(4)),
            ("seed", U64(5)),
            ("prompt_tokens", U32(6)),
            ("decode_target", String("d".into())),
            ("blocks_sent", U32(7)),
            ("blocks_deduped", U32(8)),
            ("payload_bytes", U64(9)),
            ("kv_format", U32(10)),
        ],
    );
    conform(&p, "tl.engine.v1.InfoRequest", &engine::InfoRequest {}, &[]);
    conform(
        &p,
        "tl.engine.v1.InfoResponse",
        &engine::InfoResponse {
            worker_id: "w".into(),
            roles: vec!["prefill".into(), "decode".into()],
            model: "m".into(),
            kv_format: 1,
            block_tokens: 2,
            n_layers: 3,
            n_kv_heads: 4,
            head_dim: 5,
            free_blocks: 6,
            total_blocks: 7,
            queue_depth: 8,
            running: 9,
            draining: true,
            pending_handles: 10,
            used_blocks: 11,
            cached_blocks: 12,
            serving: vec!["decode".into()],
        },
        &[
            ("worker_id", String("w".into())),
            (
                "roles",
                List(vec![String("prefill".into()), String("decode".into())]),
            ),
            ("model", String("m".into())),
            ("kv_format", U32(1)),
            ("block_tokens", U32(2)),
            ("n_layers", U32(3)),
            ("n_kv_heads", U32(4)),
            ("head_dim", U32(5)),
            ("free_blocks", U32(6)),
            ("total_blocks", U32(7)),
            ("queue_depth", U32(8)),
            ("running", U32(9)),
            ("draining", Bool(true)),
            ("pending_handles", U32(10)),
            ("used_blocks", U32(11)),
            ("cached_blocks", U32(12)),
            ("serving", List(vec![String("decode".into())])),
        ],
    );
    conform(
        &p,
        "tl.engine.v1.CancelRequest",
        &engine::CancelRequest {
            request_id: "r".into(),
        },
        &[("request_id", String("r".into()))],
    );
    conform(
        &p,
        "tl.engine.v1.CancelResponse",
        &engine::CancelResponse { cancelled: true },
        &[("cancelled", Bool(true))],
    );
    conform(
        &p,
        "tl.engine.v1.DrainRequest",
        &engine::DrainRequest { deadline_ms: -5 },
        &[("deadline_ms", I64(-5))],
    );
    conform(
        &p,
        "tl.engine.v1.DrainResponse",
        &engine::DrainResponse { remaining: -3 },
        &[("remaining", I32(-3))],
    );
    conform(
        &p,
        "tl.engine.v1.SetRoleRequest",
        &engine::SetRoleRequest {
            role: "prefill".into(),
            deadline_ms: -6,
        },
        &[("role", String("prefill".into())), ("deadline_ms", I64(-6))],
    );
    conform(
        &p,
        "tl.engine.v1.SetRoleResponse",
        &engine::SetRoleResponse {
            serving: vec!["prefill".into(), "decode".into()],
            remaining: -4,
        },
        &[
            (
                "serving",
                List(vec![String("prefill".into()), String("decode".into())]),
            ),
            ("remaining", I32(-4)),
        ],
    );

    conform(
        &p,
        "tl.engine.v1.WatchBlocksRequest",
        &engine::WatchBlocksRequest {},
        &[],
    );
    let change = engine::BlockChange {
        cache_scope: u64::MAX,
        hash: 7,
        stored: true,
    };
    let change_fields = [
        ("cache_scope", U64(u64::MAX)),
        ("hash", U64(7)),
        ("stored", Bool(true)),
    ];
    conform(&p, "tl.engine.v1.BlockChange", &change, &change_fields);
    conform(
        &p,
        "tl.engine.v1.BlockEvents",
        &engine::BlockEvents {
            epoch: 9,
            snapshot: true,
            seq: 11,
            changes: vec![change],
            worker_id: "w".into(),
            more: true,
        },
        &[
            ("epoch", U64(9)),
            ("snapshot", Bool(true)),
            ("seq", U64(11)),
            (
                "changes",
                List(vec![Message(dynamic(
                    &p,
                    "tl.engine.v1.BlockChange",
                    &change_fields,
                ))]),
            ),
            ("worker_id", String("w".into())),
            ("more", Bool(true)),
        ],
    );

    // The typed decode leg.
    let stop = engine::StopRules {
        sequences: vec![b"ab".to_vec(), vec![0xFF]],
        token_ids: vec![2, 3],
        min_tokens: 4,
    };
    let stop_fields = [
        (
            "sequences",
            List(vec![
                Value::Bytes(bytes::Bytes::from_static(b"ab")),
                Value::Bytes(bytes::Bytes::from_static(&[0xFF])),
            ]),
        ),
        ("token_ids", List(vec![U32(2), U32(3)])),
        ("min_tokens", U32(4)),
    ];
    conform(&p, "tl.engine.v1.StopRules", &stop, &stop_fields);
    let resume = engine::Resume {
        handle_id: "h".into(),
        first_token: 5,
        rng_draws_consumed: 6,
    };
    let resume_fields = [
        ("handle_id", String("h".into())),
        ("first_token", U32(5)),
        ("rng_draws_consumed", U32(6)),
    ];
    conform(&p, "tl.engine.v1.Resume", &resume, &resume_fields);
    conform(
        &p,
        "tl.engine.v1.GenerateRequest",
        &engine::GenerateRequest {
            prompt_tokens: vec![1, 2],
            sampling: Some(sp),
            stop: Some(stop),
            n: 3,
            logprobs: Some(2),
            cache_scope: u64::MAX,
            resume: Some(resume),
            model: "m".into(),
        },
        &[
            ("prompt_tokens", List(vec![U32(1), U32(2)])),
            (
                "sampling",
                Message(dynamic(&p, "tl.engine.v1.SamplingParams", &sp_fields)),
            ),
            (
                "stop",
                Message(dynamic(&p, "tl.engine.v1.StopRules", &stop_fields)),
            ),
            ("n", U32(3)),
            ("logprobs", U32(2)),
            ("cache_scope", U64(u64::MAX)),
            (
                "resume",
                Message(dynamic(&p, "tl.engine.v1.Resume", &resume_fields)),
            ),
            ("model", String("m".into())),
        ],
    );
    let alt = engine::Alternative {
        token: 7,
        logprob: -0.5,
    };
    let alt_fields = [("token", U32(7)), ("logprob", F32(-0.5))];
    conform(&p, "tl.engine.v1.Alternative", &alt, &alt_fields);
    let token = engine::GeneratedToken {
        choice: 1,
        token: 7,
        logprob: Some(-0.5),
        top: vec![alt],
    };
    let token_fields = [
        ("choice", U32(1)),
        ("token", U32(7)),
        ("logprob", F32(-0.5)),
        (
            "top",
            List(vec![Message(dynamic(
                &p,
                "tl.engine.v1.Alternative",
                &alt_fields,
            ))]),
        ),
    ];
    conform(&p, "tl.engine.v1.GeneratedToken", &token, &token_fields);
    let end = engine::ChoiceFinished {
        choice: 2,
        finish: engine::Finish::Context as i32,
    };
    let end_fields = [("choice", U32(2)), ("finish", EnumNumber(3))];
    conform(&p, "tl.engine.v1.ChoiceFinished", &end, &end_fields);
    conform(
        &p,
        "tl.engine.v1.GenerateEvents",
        &engine::GenerateEvents {
            seed: 11,
            tokens: vec![token],
            finished: vec![end],
            error_code: 8,
            error: "full".into(),
        },
        &[
            ("seed", U64(11)),
            (
                "tokens",
                List(vec![Message(dynamic(
                    &p,
                    "tl.engine.v1.GeneratedToken",
                    &token_fields,
                ))]),
            ),
            (
                "finished",
                List(vec![Message(dynamic(
                    &p,
                    "tl.engine.v1.ChoiceFinished",
                    &end_fields,
                ))]),
            ),
            ("error_code", I32(8)),
            ("error", String("full".into())),
        ],
    );
    let finishes = p.get_enum_by_name("tl.engine.v1.Finish").unwrap();
    let named: Vec<(std::string::String, i32)> = finishes
        .values()
        .map(|v| (v.name().to_owned(), v.number()))
        .collect();
    assert_eq!(
        named,
        [
            ("FINISH_UNSPECIFIED".into(), 0),
            ("FINISH_LENGTH".into(), 1),
            ("FINISH_STOP".into(), 2),
            ("FINISH_CONTEXT".into(), 3)
        ]
    );
    assert_eq!(
        [
            engine::Finish::Unspecified,
            engine::Finish::Length,
            engine::Finish::Stop,
            engine::Finish::Context
        ]
        .map(|f| f as i32),
        [0, 1, 2, 3]
    );

    // tl.control.v1
    let roles = p.get_enum_by_name("tl.control.v1.Role").unwrap();
    let named: Vec<(std::string::String, i32)> = roles
        .values()
        .map(|v| (v.name().to_owned(), v.number()))
        .collect();
    assert_eq!(
        named,
        [
            ("ROLE_UNSPECIFIED".into(), 0),
            ("ROLE_PREFILL".into(), 1),
            ("ROLE_DECODE".into(), 2),
            ("ROLE_BOTH".into(), 3)
        ]
    );
    assert_eq!(
        [
            control::Role::Unspecified,
            control::Role::Prefill,
            control::Role::Decode,
            control::Role::Both
        ]
        .map(|r| r as i32),
        [0, 1, 2, 3]
    );
    let ws = control::WorkerStatus {
        usable_context: 8,
        worker_id: "w".into(),
        http_address: "h".into(),
        grpc_address: "g".into(),
        kv_address: "k".into(),
        role: control::Role::Both as i32,
        model: "m".into(),
        kv_format: 1,
        queue_depth: 2,
        running: 3,
        free_blocks: 4,
        total_blocks: 5,
        draining: true,
        block_tokens: 6,
        heartbeat_ms: 7,
        serving: control::Role::Decode as i32,
        fingerprint: "v1-c-".into(),
    };
    let ws_fields = [
        ("worker_id", String("w".into())),
        ("http_address", String("h".into())),
        ("grpc_address", String("g".into())),
        ("kv_address", String("k".into())),
        ("role", EnumNumber(3)),
        ("model", String("m".into())),
        ("kv_format", U32(1)),
        ("queue_depth", U32(2)),
        ("running", U32(3)),
        ("free_blocks", U32(4)),
        ("total_blocks", U32(5)),
        ("draining", Bool(true)),
        ("block_tokens", U32(6)),
        ("heartbeat_ms", U32(7)),
        ("usable_context", U32(8)),
        ("serving", EnumNumber(2)),
        ("fingerprint", String("v1-c-".into())),
    ];
    conform(&p, "tl.control.v1.WorkerStatus", &ws, &ws_fields);
    conform(
        &p,
        "tl.control.v1.HeartbeatAck",
        &control::HeartbeatAck { drain: true },
        &[("drain", Bool(true))],
    );
    conform(
        &p,
        "tl.control.v1.ListWorkersRequest",
        &control::ListWorkersRequest {},
        &[],
    );
    conform(
        &p,
        "tl.control.v1.ListWorkersResponse",
        &control::ListWorkersResponse { workers: vec![ws] },
        &[(
            "workers",
            List(vec![Message(dynamic(
                &p,
                "tl.control.v1.WorkerStatus",
                &ws_fields,
            ))]),
        )],
    );
    conform(
        &p,
        "tl.control.v1.SetDrainRequest",
        &control::SetDrainRequest {
            worker_id: "w".into(),
            drain: true,
        },
        &[("worker_id", String("w".into())), ("drain", Bool(true))],
    );
    conform(
        &p,
        "tl.control.v1.SetDrainResponse",
        &control::SetDrainResponse { found: true },
        &[("found", Bool(true))],
    );

    // Every message of the three packages was checked above (a map's entry type, which protoc
    // makes for `logit_bias`, with the message that holds it).
    let checked = 6 + 23 + 6;
    assert_eq!(
        p.all_messages().filter(|m| !m.is_map_entry()).count(),
        checked,
        "a message was added to the .proto files without a conformance check"
    );
}

#[test]
fn method_paths_match_the_services() {
    let p = pool();
    // (service, method path constant, input, output, client streaming, server streaming)
    let methods = [
        (
            kv::path::SERVICE,
            kv::path::HAS_BLOCKS,
            "tl.kv.v1.HasBlocksRequest",
            "tl.kv.v1.HasBlocksResponse",
            false,
            false,
        ),
        (
            kv::path::SERVICE,
            kv::path::PUSH_KV,
            "tl.kv.v1.KvChunk",
            "tl.kv.v1.KvAck",
            true,
            false,
        ),
        (
            kv::path::SERVICE,
            kv::path::RELEASE,
            "tl.kv.v1.ReleaseRequest",
            "tl.kv.v1.ReleaseResponse",
            false,
            false,
        ),
        (
            engine::path::SERVICE,
            engine::path::PREFILL,
            "tl.engine.v1.PrefillRequest",
            "tl.engine.v1.KvHandle",
            false,
            false,
        ),
        (
            engine::path::SERVICE,
            engine::path::INFO,
            "tl.engine.v1.InfoRequest",
            "tl.engine.v1.InfoResponse",
            false,
            false,
        ),
        (
            engine::path::SERVICE,
            engine::path::CANCEL,
            "tl.engine.v1.CancelRequest",
            "tl.engine.v1.CancelResponse",
            false,
            false,
        ),
        (
            engine::path::SERVICE,
            engine::path::DRAIN,
            "tl.engine.v1.DrainRequest",
            "tl.engine.v1.DrainResponse",
            false,
            false,
        ),
        (
            engine::path::SERVICE,
            engine::path::WATCH_BLOCKS,
            "tl.engine.v1.WatchBlocksRequest",
            "tl.engine.v1.BlockEvents",
            false,
            true,
        ),
        (
            engine::path::SERVICE,
            engine::path::SET_ROLE,
            "tl.engine.v1.SetRoleRequest",
            "tl.engine.v1.SetRoleResponse",
            false,
            false,
        ),
        (
            engine::path::SERVICE,
            engine::path::GENERATE,
            "tl.engine.v1.GenerateRequest",
            "tl.engine.v1.GenerateEvents",
            false,
            true,
        ),
        (
            control::path::SERVICE,
            control::path::HEARTBEAT,
            "tl.control.v1.WorkerStatus",
            "tl.control.v1.HeartbeatAck",
            false,
            false,
        ),
        (
            control::path::SERVICE,
            control::path::LIST_WORKERS,
            "tl.control.v1.ListWorkersRequest",
            "tl.control.v1.ListWorkersResponse",
            false,
            false,
        ),
        (
            control::path::SERVICE,
            control::path::SET_DRAIN,
            "tl.control.v1.SetDrainRequest",
            "tl.control.v1.SetDrainResponse",
            false,
            false,
        ),
    ];
    let mut seen = 0;
    for svc in p.services() {
        for m in svc.methods() {
            let path = format!("/{}/{}", svc.full_name(), m.name());
            let row = methods
                .iter()
                .find(|r| r.1 == path)
                .unwrap_or_else(|| panic!("{path} has no hand-written path"));
            assert_eq!(row.0, svc.full_name());
            assert_eq!(
                (m.input().full_name(), m.output().full_name()),
                (row.2, row.3),
                "{path}"
            );
            assert_eq!(m.is_client_streaming(), row.4, "{path}");
            assert_eq!(m.is_server_streaming(), row.5, "{path}");
            seen += 1;
        }
    }
    assert_eq!(seen, methods.len());
}
