//! A client of etcd's v3 gRPC API over the hand-written messages of [`kvwire_grpc::etcd`].
//!
//! Several endpoints (the members of one cluster) are tried in turn: a call that finds its
//! member unreachable moves on to the next, and later calls start from the one that answered.
//! Every call is bounded by the client's timeout. Over mutual TLS the process presents its own
//! certificate; etcd, with `--client-cert-auth`, takes its common name as the user.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvwire_grpc::etcd::{self as pb, path};
use kvwire_grpc::glue::{self, MessageLimits};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status, Streaming};

use crate::net::tls::Tls;

/// Why an etcd client could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// No endpoint was given.
    #[error("no etcd endpoint")]
    NoEndpoint,
    /// An endpoint is not an `http://` or `https://` URL.
    #[error("etcd endpoint {0:?}: {1}")]
    Endpoint(String, String),
}

/// etcd's answers are small here (one deployment's workers); this bounds a lying member.
const LIMITS: MessageLimits = MessageLimits {
    max_decode: 16 << 20,
    max_encode: 1 << 20,
};

/// A client of one etcd cluster.
#[derive(Debug)]
pub struct Etcd {
    members: Vec<(String, Channel)>,
    current: AtomicUsize,
    timeout: Duration,
}

impl Etcd {
    /// A client of the members at `endpoints`, over mutual TLS with `tls` (then each endpoint
    /// must be `https://`), each call bounded by `timeout`. Connects on first use.
    ///
    /// # Errors
    /// No endpoint, or one that is not a URL of the right scheme.
    pub fn new(
        endpoints: &[String],
        tls: Option<&Tls>,
        timeout: Duration,
    ) -> Result<Self, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoint);
        }
        let mut members = Vec::with_capacity(endpoints.len());
        for url in endpoints {
            let bad = |m: &dyn std::fmt::Display| EtcdError::Endpoint(url.clone(), m.to_string());
            let https = url.starts_with("https://");
            if !https && !url.starts_with("http://") {
                return Err(bad(&"not an http:// or https:// URL"));
            }
            if https != tls.is_some() {
                return Err(bad(&if https {
                    "https:// needs [tls] (the process's own certificate)"
                } else {
                    "with [tls] set, etcd is reached over https:// only"
                }));
            }
            let mut ep = Endpoint::from_shared(url.clone())
                .map_err(|e| bad(&e))?
                .connect_timeout(timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(1))
                .keep_alive_timeout(timeout)
                .keep_alive_while_idle(true);
            if let Some(t) = tls {
                ep = ep.tls_config(t.tonic_client()).map_err(|e| bad(&e))?;
            }
            members.push((url.clone(), ep.connect_lazy()));
        }
        Ok(Self {
            members,
            current: AtomicUsize::new(0),
            timeout,
        })
    }

    /// Each call's bound.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The client URLs, comma separated (for messages).
    #[must_use]
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|(u, _)| u.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The member calls start from, and its channel.
    fn member(&self, offset: usize) -> (usize, &(String, Channel)) {
        let i = (self.current.load(Ordering::Relaxed) + offset) % self.members.len();
        (i, &self.members[i])
    }

    /// True for a status that says "this member, not the request": try the next one.
    fn try_next(s: &Status) -> bool {
        matches!(
            s.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
        )
    }

    /// Runs `call` on one member's channel after another, from the last that answered, until
    /// one answers or says something about the request itself; each try bounded.
    async fn on_members<T, F, Fut>(&self, p: &'static str, call: F) -> Result<T, Status>
    where
        F: Fn(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut last = None;
        for offset in 0..self.members.len() {
            let (i, (url, ch)) = self.member(offset);
            match glue::bounded(self.timeout, p, call(ch.clone())).await {
                Ok(r) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(r);
                }
                Err(s) if Self::try_next(&s) => {
                    tracing::debug!(member = url.as_str(), error = %s, "etcd member unreachable");
                    last = Some(s);
                }
                Err(s) => return Err(s),
            }
        }
        Err(last.unwrap_or_else(|| Status::unavailable("no etcd member")))
    }

    async fn unary<Req, Resp>(&self, p: &'static str, req: Req) -> Result<Resp, Status>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        self.on_members(p, |ch| {
            glue::unary::<Req, Resp>(ch, p, LIMITS, Request::new(req.clone()))
        })
        .await
    }

    /// Puts `value` at `key`, attached to `lease` (0: none); returns the revision.
    ///
    /// # Errors
    /// etcd's status (PERMISSION_DENIED for a key the caller may not write), or UNAVAILABLE.
    pub async fn put(&self, key: &str, value: Bytes, lease: i64) -> Result<i64, Status> {
        let r: pb::PutResponse = self
            .unary(
                path::PUT,
                pb::PutRequest {
                    key: Bytes::copy_from_slice(key.as_bytes()),
                    value,
                    lease,
                    ..Default::default()
                },
            )
            .await?;
        Ok(r.header.map_or(0, |h| h.revision))
    }

    /// The value at `key` and its lease, if any.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    pub async fn get(&self, key: &str) -> Result<Option<pb::KeyValue>, Status> {
        let r: pb::RangeResponse = self
            .unary(
                path::RANGE,
                pb::RangeRequest {
                    key: Bytes::copy_from_slice(key.as_bytes()),
                    ..Default::default()
                },
            )
            .await?;
        Ok(r.kvs.into_iter().next())
    }

    /// Every key starting with `prefix`, and the revision they were read at.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    pub async fn get_prefix(&self, prefix: &str) -> Result<(Vec<pb::KeyValue>, i64), Status> {
        let r: pb::RangeResponse = self
            .unary(
                path::RANGE,
                pb::RangeRequest {
                    key: Bytes::copy_from_slice(prefix.as_bytes()),
                    range_end: pb::prefix_end(prefix.as_bytes()),
                    ..Default::default()
                },
            )
            .await?;
        Ok((r.kvs, r.header.map_or(0, |h| h.revision)))
    }

    /// Deletes `key`; returns how many keys went.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    pub async fn delete(&self, key: &str) -> Result<i64, Status> {
        let r: pb::DeleteRangeResponse = self
            .unary(
                path::DELETE_RANGE,
                pb::DeleteRangeRequest {
                    key: Bytes::copy_from_slice(key.as_bytes()),
                    ..Default::default()
                },
            )
            .await?;
        Ok(r.deleted)
    }

    /// A new lease of `ttl_s` seconds; returns its id.
    ///
    /// # Errors
    /// As [`put`](Self::put), or FAILED_PRECONDITION with etcd's error text.
    pub async fn lease_grant(&self, ttl_s: i64) -> Result<i64, Status> {
        let r: pb::LeaseGrantResponse = self
            .unary(
                path::LEASE_GRANT,
                pb::LeaseGrantRequest { ttl: ttl_s, id: 0 },
            )
            .await?;
        if !r.error.is_empty() {
            return Err(Status::failed_precondition(r.error));
        }
        Ok(r.id)
    }

    /// Revokes a lease: its keys go at once.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    pub async fn lease_revoke(&self, id: i64) -> Result<(), Status> {
        let _: pb::LeaseRevokeResponse = self
            .unary(path::LEASE_REVOKE, pb::LeaseRevokeRequest { id })
            .await?;
        Ok(())
    }

    /// Renews a lease once; returns its new TTL in seconds (0 or less: the lease is gone).
    ///
    /// # Errors
    /// As [`put`](Self::put).
    pub async fn keep_alive_once(&self, id: i64) -> Result<i64, Status> {
        self.on_members(path::LEASE_KEEP_ALIVE, |ch| async move {
            let (tx, rx) = mpsc::channel(1);
            tx.send(pb::LeaseKeepAliveRequest { id })
                .await
                .map_err(|_| Status::internal("keepalive stream closed"))?;
            let mut answers: Streaming<pb::LeaseKeepAliveResponse> = glue::streaming(
                ch,
                path::LEASE_KEEP_ALIVE,
                LIMITS,
                Request::new(ReceiverStream::new(rx)),
            )
            .await?;
            let r = answers
                .message()
                .await?
                .ok_or_else(|| Status::unavailable("etcd ended the keepalive stream"))?;
            drop(tx);
            Ok(r.ttl)
        })
        .await
    }

    /// Watches every key starting with `prefix` from `start_revision` on, with progress
    /// answers on request. The watch lives as long as the returned [`Watch`].
    ///
    /// # Errors
    /// As [`put`](Self::put); a refused watch is PERMISSION_DENIED or FAILED_PRECONDITION.
    pub async fn watch(&self, prefix: &str, start_revision: i64) -> Result<Watch, Status> {
        self.watch_range(prefix, pb::prefix_end(prefix.as_bytes()), start_revision)
            .await
    }

    /// Watches the one key `key` from now on (a caller allowed to read only that key).
    ///
    /// # Errors
    /// As [`watch`](Self::watch).
    pub async fn watch_key(&self, key: &str) -> Result<Watch, Status> {
        self.watch_range(key, Bytes::new(), 0).await
    }

    async fn watch_range(
        &self,
        key: &str,
        range_end: Bytes,
        start_revision: i64,
    ) -> Result<Watch, Status> {
        self.on_members(path::WATCH, |ch| {
            let create = pb::WatchRequest {
                request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                    pb::WatchCreateRequest {
                        key: Bytes::copy_from_slice(key.as_bytes()),
                        range_end: range_end.clone(),
                        start_revision,
                        ..Default::default()
                    },
                )),
            };
            async move {
                let (tx, rx) = mpsc::channel(4);
                tx.send(create)
                    .await
                    .map_err(|_| Status::internal("watch stream closed"))?;
                let mut events: Streaming<pb::WatchResponse> = glue::streaming(
                    ch,
                    path::WATCH,
                    LIMITS,
                    Request::new(ReceiverStream::new(rx)),
                )
                .await?;
                let first = events
                    .message()
                    .await?
                    .ok_or_else(|| Status::unavailable("etcd ended the watch stream"))?;
                if first.canceled || !first.created {
                    return Err(Status::failed_precondition(format!(
                        "etcd refused the watch: {}",
                        first.cancel_reason
                    )));
                }
                Ok(Watch { tx, events })
            }
        })
        .await
    }

    /// Calls one Auth method (used by [`super::auth`]).
    pub(crate) async fn auth<Req, Resp>(&self, p: &'static str, req: Req) -> Result<Resp, Status>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        self.unary(p, req).await
    }
}

/// An open watch: its events, and the sending side that keeps it open.
#[derive(Debug)]
pub struct Watch {
    tx: mpsc::Sender<pb::WatchRequest>,
    events: Streaming<pb::WatchResponse>,
}

impl Watch {
    /// The next answer: events, or a progress report; `None` when etcd ended the stream.
    ///
    /// # Errors
    /// The stream's status.
    pub async fn next(&mut self) -> Result<Option<pb::WatchResponse>, Status> {
        self.events.message().await
    }

    /// Asks etcd for a progress report (an answer with the current revision and no events):
    /// the way a quiet watch proves its member is still there.
    ///
    /// # Errors
    /// UNAVAILABLE when the stream is gone.
    pub async fn request_progress(&self) -> Result<(), Status> {
        self.tx
            .send(pb::WatchRequest {
                request_union: Some(pb::watch_request::RequestUnion::ProgressRequest(
                    pb::WatchProgressRequest {},
                )),
            })
            .await
            .map_err(|_| Status::unavailable("watch stream closed"))
    }
}
