//! Hand-written prost messages for the part of etcd's v3 API the registry uses: KV, Watch,
//! Lease and the Auth calls that set up users and roles. No build script and no protoc, as for
//! the project's own packages: `tests/etcd_proto.rs` reads etcd's published `.proto` files
//! (Debian's `golang-etcd-server-dev`, the same 3.4 release as `etcd-server`) and checks every
//! field's name, number and type against these structs, so the two cannot drift apart.
//!
//! Every message here carries every field etcd 3.4 defines for it.
#![allow(missing_docs)] // etcd's .proto files document every field.

use bytes::Bytes;

/// gRPC paths of the methods used.
pub mod path {
    pub const RANGE: &str = "/etcdserverpb.KV/Range";
    pub const PUT: &str = "/etcdserverpb.KV/Put";
    pub const DELETE_RANGE: &str = "/etcdserverpb.KV/DeleteRange";
    pub const WATCH: &str = "/etcdserverpb.Watch/Watch";
    pub const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
    pub const LEASE_REVOKE: &str = "/etcdserverpb.Lease/LeaseRevoke";
    pub const LEASE_KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";
    pub const AUTH_ENABLE: &str = "/etcdserverpb.Auth/AuthEnable";
    pub const USER_ADD: &str = "/etcdserverpb.Auth/UserAdd";
    pub const ROLE_ADD: &str = "/etcdserverpb.Auth/RoleAdd";
    pub const ROLE_GRANT_PERMISSION: &str = "/etcdserverpb.Auth/RoleGrantPermission";
    pub const USER_GRANT_ROLE: &str = "/etcdserverpb.Auth/UserGrantRole";
}

// --- etcdserverpb (etcdserver/etcdserverpb/rpc.proto) ---

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseHeader {
    #[prost(uint64, tag = "1")]
    pub cluster_id: u64,
    #[prost(uint64, tag = "2")]
    pub member_id: u64,
    #[prost(int64, tag = "3")]
    pub revision: i64,
    #[prost(uint64, tag = "4")]
    pub raft_term: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeRequest {
    #[prost(bytes = "bytes", tag = "1")]
    pub key: Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    pub range_end: Bytes,
    #[prost(int64, tag = "3")]
    pub limit: i64,
    #[prost(int64, tag = "4")]
    pub revision: i64,
    /// `RangeRequest.SortOrder`.
    #[prost(int32, tag = "5")]
    pub sort_order: i32,
    /// `RangeRequest.SortTarget`.
    #[prost(int32, tag = "6")]
    pub sort_target: i32,
    #[prost(bool, tag = "7")]
    pub serializable: bool,
    #[prost(bool, tag = "8")]
    pub keys_only: bool,
    #[prost(bool, tag = "9")]
    pub count_only: bool,
    #[prost(int64, tag = "10")]
    pub min_mod_revision: i64,
    #[prost(int64, tag = "11")]
    pub max_mod_revision: i64,
    #[prost(int64, tag = "12")]
    pub min_create_revision: i64,
    #[prost(int64, tag = "13")]
    pub max_create_revision: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(message, repeated, tag = "2")]
    pub kvs: Vec<KeyValue>,
    #[prost(bool, tag = "3")]
    pub more: bool,
    #[prost(int64, tag = "4")]
    pub count: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutRequest {
    #[prost(bytes = "bytes", tag = "1")]
    pub key: Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    pub value: Bytes,
    #[prost(int64, tag = "3")]
    pub lease: i64,
    #[prost(bool, tag = "4")]
    pub prev_kv: bool,
    #[prost(bool, tag = "5")]
    pub ignore_value: bool,
    #[prost(bool, tag = "6")]
    pub ignore_lease: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(message, optional, tag = "2")]
    pub prev_kv: Option<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DeleteRangeRequest {
    #[prost(bytes = "bytes", tag = "1")]
    pub key: Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    pub range_end: Bytes,
    #[prost(bool, tag = "3")]
    pub prev_kv: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DeleteRangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub deleted: i64,
    #[prost(message, repeated, tag = "3")]
    pub prev_kvs: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(oneof = "watch_request::RequestUnion", tags = "1, 2, 3")]
    pub request_union: Option<watch_request::RequestUnion>,
}

pub mod watch_request {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum RequestUnion {
        #[prost(message, tag = "1")]
        CreateRequest(super::WatchCreateRequest),
        #[prost(message, tag = "2")]
        CancelRequest(super::WatchCancelRequest),
        #[prost(message, tag = "3")]
        ProgressRequest(super::WatchProgressRequest),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchCreateRequest {
    #[prost(bytes = "bytes", tag = "1")]
    pub key: Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    pub range_end: Bytes,
    #[prost(int64, tag = "3")]
    pub start_revision: i64,
    #[prost(bool, tag = "4")]
    pub progress_notify: bool,
    /// `WatchCreateRequest.FilterType`.
    #[prost(int32, repeated, tag = "5")]
    pub filters: Vec<i32>,
    #[prost(bool, tag = "6")]
    pub prev_kv: bool,
    #[prost(int64, tag = "7")]
    pub watch_id: i64,
    #[prost(bool, tag = "8")]
    pub fragment: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchCancelRequest {
    #[prost(int64, tag = "1")]
    pub watch_id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchProgressRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub watch_id: i64,
    #[prost(bool, tag = "3")]
    pub created: bool,
    #[prost(bool, tag = "4")]
    pub canceled: bool,
    #[prost(int64, tag = "5")]
    pub compact_revision: i64,
    #[prost(string, tag = "6")]
    pub cancel_reason: String,
    #[prost(bool, tag = "7")]
    pub fragment: bool,
    #[prost(message, repeated, tag = "11")]
    pub events: Vec<Event>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantRequest {
    #[prost(int64, tag = "1")]
    pub ttl: i64,
    #[prost(int64, tag = "2")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    #[prost(string, tag = "4")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseRevokeRequest {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseRevokeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveRequest {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthEnableRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthEnableResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthUserAddRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub password: String,
    #[prost(message, optional, tag = "3")]
    pub options: Option<UserAddOptions>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthUserAddResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthRoleAddRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthRoleAddResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthRoleGrantPermissionRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub perm: Option<Permission>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthRoleGrantPermissionResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthUserGrantRoleRequest {
    #[prost(string, tag = "1")]
    pub user: String,
    #[prost(string, tag = "2")]
    pub role: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthUserGrantRoleResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

// --- mvccpb (mvcc/mvccpb/kv.proto) ---

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(bytes = "bytes", tag = "1")]
    pub key: Bytes,
    #[prost(int64, tag = "2")]
    pub create_revision: i64,
    #[prost(int64, tag = "3")]
    pub mod_revision: i64,
    #[prost(int64, tag = "4")]
    pub version: i64,
    #[prost(bytes = "bytes", tag = "5")]
    pub value: Bytes,
    #[prost(int64, tag = "6")]
    pub lease: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// `Event.EventType`: [`EVENT_PUT`] or [`EVENT_DELETE`].
    #[prost(int32, tag = "1")]
    pub r#type: i32,
    #[prost(message, optional, tag = "2")]
    pub kv: Option<KeyValue>,
    #[prost(message, optional, tag = "3")]
    pub prev_kv: Option<KeyValue>,
}

/// `mvccpb.Event.EventType.PUT`.
pub const EVENT_PUT: i32 = 0;
/// `mvccpb.Event.EventType.DELETE`.
pub const EVENT_DELETE: i32 = 1;

// --- authpb (auth/authpb/auth.proto) ---

#[derive(Clone, PartialEq, prost::Message)]
pub struct UserAddOptions {
    #[prost(bool, tag = "1")]
    pub no_password: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Permission {
    /// `Permission.Type`: [`PERM_READ`], [`PERM_WRITE`] or [`PERM_READWRITE`].
    #[prost(int32, tag = "1")]
    pub perm_type: i32,
    #[prost(bytes = "bytes", tag = "2")]
    pub key: Bytes,
    #[prost(bytes = "bytes", tag = "3")]
    pub range_end: Bytes,
}

pub const PERM_READ: i32 = 0;
pub const PERM_WRITE: i32 = 1;
pub const PERM_READWRITE: i32 = 2;

/// The end of the range of every key that starts with `prefix` (etcd's `GetPrefixRangeEnd`):
/// the prefix with its last byte below 0xff incremented and what follows dropped; `\0` (every
/// key) when there is none.
#[must_use]
pub fn prefix_end(prefix: &[u8]) -> Bytes {
    let mut end = prefix.to_vec();
    while let Some(&last) = end.last() {
        if last < 0xff {
            *end.last_mut().expect("not empty") += 1;
            return Bytes::from(end);
        }
        end.pop();
    }
    Bytes::from_static(b"\0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(&prefix_end(b"/tl/workers/")[..], b"/tl/workers0");
        assert_eq!(&prefix_end(b"a\xff")[..], b"b");
        assert_eq!(&prefix_end(b"\xff\xff")[..], b"\0");
    }
}
