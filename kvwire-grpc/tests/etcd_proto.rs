//! The hand-written etcd messages (`kvwire_grpc::etcd`) against etcd's own published `.proto`
//! files, as Debian ships them for etcd 3.4 (`golang-etcd-server-dev`, installed here with apt
//! when missing, as `.ci/run` does). For every message used, each field etcd defines is filled
//! with a value that only the right number and type carry through, encoded from etcd's
//! descriptor, decoded by the Rust struct, encoded again and compared: a missing field, a wrong
//! number or a narrower type loses the value. Every method path is checked against etcd's
//! services, with its streaming shape.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvwire_grpc::etcd::{self, path};
use prost::Message;
use prost_reflect::{
    DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, Value,
};

const GOCODE: &str = "/usr/share/gocode/src";
const RPC: &str = "etcd/etcdserver/etcdserverpb/rpc.proto";

/// Debian's package of etcd's sources, installed when missing (this runs as root here).
fn sources() -> PathBuf {
    let root = Path::new(GOCODE);
    let rpc = root.join("go.etcd.io").join(RPC);
    if !rpc.exists() {
        let install = || {
            Command::new("flock")
                .args(["/tmp/tl-apt.lock", "apt-get", "install", "-y", "-q"])
                .args(["--no-install-recommends", "golang-etcd-server-dev"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .is_ok_and(|s| s.success())
        };
        if !install() {
            let _ = Command::new("flock")
                .args(["/tmp/tl-apt.lock", "apt-get", "update", "-q"])
                .status();
            assert!(
                install(),
                "this test reads etcd's .proto files from Debian's golang-etcd-server-dev; \
                 `apt-get install golang-etcd-server-dev` failed"
            );
        }
    }
    assert!(rpc.exists(), "{} is missing", rpc.display());
    root.to_owned()
}

fn pool() -> DescriptorPool {
    let src = sources();
    let mut c = protox::Compiler::new([
        src.join("go.etcd.io"),
        src.join("github.com/gogo/protobuf"),
        src.join("github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis"),
    ])
    .unwrap();
    c.include_imports(true);
    c.open_files([RPC]).unwrap();
    c.descriptor_pool()
}

/// A value of `field`'s kind that only that kind, at that number, carries back unchanged.
fn sample(field: &FieldDescriptor, depth: usize) -> Value {
    let one = match field.kind() {
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(-(1 << 40) - 3),
        Kind::Uint64 | Kind::Fixed64 => Value::U64(u64::MAX - 5),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(-70_000),
        Kind::Uint32 | Kind::Fixed32 => Value::U32(u32::MAX - 5),
        Kind::Bool => Value::Bool(true),
        Kind::String => Value::String(format!("{} value", field.name())),
        Kind::Bytes => Value::Bytes(format!("{} \u{ff}", field.name()).into_bytes().into()),
        Kind::Enum(e) => Value::EnumNumber(e.values().last().map_or(0, |v| v.number())),
        Kind::Message(m) => Value::Message(filled(&m, depth + 1, None)),
        Kind::Float | Kind::Double => unreachable!("etcd's messages used here have no floats"),
    };
    if field.is_list() {
        Value::List(vec![one.clone(), one])
    } else {
        one
    }
}

/// `desc` with every field set (of a oneof, only `oneof_pick`, else the first).
fn filled(desc: &MessageDescriptor, depth: usize, oneof_pick: Option<&str>) -> DynamicMessage {
    let mut m = DynamicMessage::new(desc.clone());
    if depth > 3 {
        return m;
    }
    for f in desc.fields() {
        if let Some(o) = f.containing_oneof() {
            let first = o.fields().next().map(|x| x.name().to_owned());
            if oneof_pick.map_or(first.as_deref() != Some(f.name()), |p| p != f.name()) {
                continue;
            }
        }
        m.set_field(&f, sample(&f, depth));
    }
    m
}

/// Every field of etcd's `name` survives the trip through the Rust struct `M`.
fn conform<M: Message + Default>(pool: &DescriptorPool, name: &str) -> usize {
    let desc = pool
        .get_message_by_name(name)
        .unwrap_or_else(|| panic!("{name} is not in etcd's .proto files"));
    let oneofs: Vec<Option<String>> = match desc.oneofs().next() {
        Some(o) => o.fields().map(|f| Some(f.name().to_owned())).collect(),
        None => vec![None],
    };
    for pick in oneofs {
        let sent = filled(&desc, 0, pick.as_deref());
        let rust = M::decode(sent.encode_to_vec().as_slice())
            .unwrap_or_else(|e| panic!("{name}: the Rust struct cannot read etcd's bytes: {e}"));
        let back = DynamicMessage::decode(desc.clone(), rust.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            back, sent,
            "{name} ({pick:?}): a field etcd defines was lost or changed by the Rust struct"
        );
    }
    desc.fields().count()
}

#[test]
fn etcd_messages_match_etcds_published_protos() {
    let p = pool();
    let mut fields = 0;
    macro_rules! check {
        ($($rust:ident => $proto:literal),* $(,)?) => {
            $( fields += conform::<etcd::$rust>(&p, $proto); )*
        };
    }
    check!(
        ResponseHeader => "etcdserverpb.ResponseHeader",
        RangeRequest => "etcdserverpb.RangeRequest",
        RangeResponse => "etcdserverpb.RangeResponse",
        PutRequest => "etcdserverpb.PutRequest",
        PutResponse => "etcdserverpb.PutResponse",
        DeleteRangeRequest => "etcdserverpb.DeleteRangeRequest",
        DeleteRangeResponse => "etcdserverpb.DeleteRangeResponse",
        WatchRequest => "etcdserverpb.WatchRequest",
        WatchCreateRequest => "etcdserverpb.WatchCreateRequest",
        WatchCancelRequest => "etcdserverpb.WatchCancelRequest",
        WatchProgressRequest => "etcdserverpb.WatchProgressRequest",
        WatchResponse => "etcdserverpb.WatchResponse",
        LeaseGrantRequest => "etcdserverpb.LeaseGrantRequest",
        LeaseGrantResponse => "etcdserverpb.LeaseGrantResponse",
        LeaseRevokeRequest => "etcdserverpb.LeaseRevokeRequest",
        LeaseRevokeResponse => "etcdserverpb.LeaseRevokeResponse",
        LeaseKeepAliveRequest => "etcdserverpb.LeaseKeepAliveRequest",
        LeaseKeepAliveResponse => "etcdserverpb.LeaseKeepAliveResponse",
        AuthEnableRequest => "etcdserverpb.AuthEnableRequest",
        AuthEnableResponse => "etcdserverpb.AuthEnableResponse",
        AuthUserAddRequest => "etcdserverpb.AuthUserAddRequest",
        AuthUserAddResponse => "etcdserverpb.AuthUserAddResponse",
        AuthRoleAddRequest => "etcdserverpb.AuthRoleAddRequest",
        AuthRoleAddResponse => "etcdserverpb.AuthRoleAddResponse",
        AuthRoleGrantPermissionRequest => "etcdserverpb.AuthRoleGrantPermissionRequest",
        AuthRoleGrantPermissionResponse => "etcdserverpb.AuthRoleGrantPermissionResponse",
        AuthUserGrantRoleRequest => "etcdserverpb.AuthUserGrantRoleRequest",
        AuthUserGrantRoleResponse => "etcdserverpb.AuthUserGrantRoleResponse",
        KeyValue => "mvccpb.KeyValue",
        Event => "mvccpb.Event",
        UserAddOptions => "authpb.UserAddOptions",
        Permission => "authpb.Permission",
    );
    // A check that compared nothing would pass: the messages above hold this many fields.
    assert!(fields >= 80, "only {fields} fields compared");
}

#[test]
fn etcd_method_paths_match_etcds_services() {
    let p = pool();
    // (path, request, response, client streams, server streams)
    let methods = [
        (path::RANGE, "RangeRequest", "RangeResponse", false, false),
        (path::PUT, "PutRequest", "PutResponse", false, false),
        (
            path::DELETE_RANGE,
            "DeleteRangeRequest",
            "DeleteRangeResponse",
            false,
            false,
        ),
        (path::WATCH, "WatchRequest", "WatchResponse", true, true),
        (
            path::LEASE_GRANT,
            "LeaseGrantRequest",
            "LeaseGrantResponse",
            false,
            false,
        ),
        (
            path::LEASE_REVOKE,
            "LeaseRevokeRequest",
            "LeaseRevokeResponse",
            false,
            false,
        ),
        (
            path::LEASE_KEEP_ALIVE,
            "LeaseKeepAliveRequest",
            "LeaseKeepAliveResponse",
            true,
            true,
        ),
        (
            path::AUTH_ENABLE,
            "AuthEnableRequest",
            "AuthEnableResponse",
            false,
            false,
        ),
        (
            path::USER_ADD,
            "AuthUserAddRequest",
            "AuthUserAddResponse",
            false,
            false,
        ),
        (
            path::ROLE_ADD,
            "AuthRoleAddRequest",
            "AuthRoleAddResponse",
            false,
            false,
        ),
        (
            path::ROLE_GRANT_PERMISSION,
            "AuthRoleGrantPermissionRequest",
            "AuthRoleGrantPermissionResponse",
            false,
            false,
        ),
        (
            path::USER_GRANT_ROLE,
            "AuthUserGrantRoleRequest",
            "AuthUserGrantRoleResponse",
            false,
            false,
        ),
    ];
    for (path, req, resp, cs, ss) in methods {
        let (service, method) = path[1..].split_once('/').unwrap();
        let s = p
            .get_service_by_name(service)
            .unwrap_or_else(|| panic!("{path}: etcd has no service {service}"));
        let m = s
            .methods()
            .find(|m| m.name() == method)
            .unwrap_or_else(|| panic!("{path}: {service} has no method {method}"));
        assert_eq!(
            m.input().full_name(),
            format!("etcdserverpb.{req}"),
            "{path}"
        );
        assert_eq!(
            m.output().full_name(),
            format!("etcdserverpb.{resp}"),
            "{path}"
        );
        assert_eq!(
            (m.is_client_streaming(), m.is_server_streaming()),
            (cs, ss),
            "{path}"
        );
    }
}
