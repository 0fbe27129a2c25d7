//! Where a push goes: [`KvTransport`] (HasBlocks, PushKv, Release to a target) and its gRPC
//! implementation [`GrpcTransport`], with one cached channel per target.
use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use std::sync::Arc;

use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Status};

use crate::glue::{self, MessageLimits};
use crate::pb::kv::{HasBlocksRequest, KvAck, ReleaseRequest, ReleaseResponse, path};

use super::encode::ChunkStream;

/// HasBlocks at `lookup` when one is given (a decode engine's control port, where the call is
/// answered on threads that imports do not hold), else at `target` (its KV port, the contract's
/// home for it). The lookup port is only a faster way to the same answer, so when it does not
/// give one, `target` is asked: on UNIMPLEMENTED (an engine from before its control port
/// answered lookups) and on UNAVAILABLE (the port unreachable, such as a network policy that lets
/// prefill engines reach only the KV port; logged, and a transport that keeps track, as
/// [`GrpcTransport`] does for [`LOOKUP_RETRY`], passes it over for a while, since each attempt
/// can cost a connect timeout).
/// Any other error is the answer: the KV port would give the same.
///
/// # Errors
/// The status of the call that answered.
pub async fn has_blocks_at<T: KvTransport + ?Sized>(
    transport: &T,
    lookup: Option<&str>,
    target: &str,
    req: HasBlocksRequest,
) -> Result<Vec<bool>, Status> {
    let Some(at) =
        lookup.filter(|l| !l.is_empty() && *l != target && !transport.lookup_unreachable(l))
    else {
        return transport.has_blocks(target, req).await;
    };
    match transport.has_blocks(at, req.clone()).await {
        Err(s) if s.code() == tonic::Code::Unimplemented => transport.has_blocks(target, req).await,
        Err(s) if s.code() == tonic::Code::Unavailable => {
            transport.lookup_missed(at);
            tracing::warn!(
                lookup = at,
                target,
                error = %s.message(),
                "HasBlocks: the lookup port is unreachable; asking the KV port"
            );
            transport.has_blocks(target, req).await
        }
        r => r,
    }
}

/// How the prefill side reaches decode engines.
pub trait KvTransport: Send + Sync {
    /// Asks `target` which hashes it holds.
    fn has_blocks(
        &self,
        target: &str,
        req: HasBlocksRequest,
    ) -> impl Future<Output = Result<Vec<bool>, Status>> + Send;
    /// Streams `chunks` to `target`.
    fn push(
        &self,
        target: &str,
        chunks: ChunkStream,
    ) -> impl Future<Output = Result<KvAck, Status>> + Send;
    /// Releases a handle on `target`.
    fn release(
        &self,
        target: &str,
        handle_id: &str,
    ) -> impl Future<Output = Result<bool, Status>> + Send;
    /// Whether the lookup port `lookup` is to be passed over for now ([`has_blocks_at`]): it
    /// could not be reached lately. `false` unless the transport keeps track.
    fn lookup_unreachable(&self, lookup: &str) -> bool {
        let _ = lookup;
        false
    }
    /// The lookup port `lookup` could not be reached: a transport may pass it over for a while.
    fn lookup_missed(&self, lookup: &str) {
        let _ = lookup;
    }
}

/// Settings of [`GrpcTransport`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransportConfig {
    /// Bound on HasBlocks and Release calls.
    pub call_timeout: Duration,
    /// Bound on a whole push.
    pub push_timeout: Duration,
    /// Bound on establishing a connection.
    pub connect_timeout: Duration,
    /// HTTP/2 stream flow-control window.
    pub stream_window: u32,
    /// HTTP/2 connection flow-control window.
    pub connection_window: u32,
    /// Largest message either way (set from the block size).
    pub max_message: usize,
    /// Channels (connections) kept to peers; beyond it the least recently used is closed.
    pub max_channels: usize,
    /// HTTP/2 keepalive: ping interval and how long an unanswered ping means a dead peer.
    pub keepalive: Option<(Duration, Duration)>,
    /// The most one write to a peer's socket hands the kernel ([`crate::socket::WRITE_CAP`]),
    /// so a 2 MiB message is not one long system call on a core the host's control threads may
    /// want. It holds in plaintext and under [`with_tls`](GrpcTransport::with_tls) (tonic's TLS
    /// runs over the capped socket); a connector from
    /// [`with_connector`](GrpcTransport::with_connector) brings its own sockets. 0 dials as
    /// tonic's own connector does.
    pub write_cap: usize,
}

impl TransportConfig {
    /// Windows sized for multi-MiB messages (tonic's 64 KiB defaults cap a loopback push at a
    /// fraction of raw TCP) and a message limit that fits one envelope of `block_envelope` bytes
    /// (and at least 4 MiB).
    #[must_use]
    pub fn for_envelope(block_envelope: usize) -> Self {
        Self {
            call_timeout: Duration::from_secs(5),
            push_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(2),
            stream_window: 32 << 20,
            connection_window: 64 << 20,
            // One envelope plus the chunk's fields, but never below tonic's 4 MiB default: a
            // HasBlocks request for a long prompt at a small block shape is larger than a block.
            max_message: (block_envelope + 1024).max(4 << 20),
            max_channels: 256,
            keepalive: Some((Duration::from_secs(10), Duration::from_secs(20))),
            write_cap: crate::socket::WRITE_CAP,
        }
    }
}

/// [`KvTransport`] over gRPC: one lazily connected channel per target, reused by every call.
/// It is also the process's one channel cache: a gateway reaches an engine's EngineControl over
/// the same [`channel`](Self::channel) (one connection per peer address).
pub struct GrpcTransport {
    cfg: TransportConfig,
    tls: Option<ClientTlsConfig>,
    connect: Option<Connect>,
    channels: Mutex<Channels>,
    /// Lookup ports that could not be reached, and when; each passed over for [`LOOKUP_RETRY`].
    /// At most `max_channels` are kept.
    lookup_misses: Mutex<HashMap<String, Instant>>,
}

/// How long [`GrpcTransport`] passes over a lookup port it could not reach ([`has_blocks_at`]).
pub const LOOKUP_RETRY: Duration = Duration::from_secs(30);

/// Makes the channel of a configured plaintext endpoint with a connector of the caller's own
/// (TLS that checks more than tonic's settings can say, such as the server's role).
pub type Connect = Arc<dyn Fn(Endpoint) -> Channel + Send + Sync>;

impl std::fmt::Debug for GrpcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcTransport")
            .field("cfg", &self.cfg)
            .field("tls", &self.tls.is_some())
            .field("connect", &self.connect.is_some())
            .finish_non_exhaustive()
    }
}

/// The channel cache: one channel per target, at most `max_channels`, with a use stamp each.
#[derive(Debug, Default)]
struct Channels {
    map: HashMap<String, (Channel, u64)>,
    clock: u64,
}

impl GrpcTransport {
    /// A transport with these settings.
    #[must_use]
    pub fn new(cfg: TransportConfig) -> Self {
        Self {
            cfg,
            tls: None,
            connect: None,
            channels: Mutex::new(Channels::default()),
            lookup_misses: Mutex::new(HashMap::new()),
        }
    }

    /// Connects over mutual TLS with these settings from now on.
    #[must_use]
    pub fn with_tls(mut self, tls: Option<ClientTlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// Makes every channel with `connect`, over an `http://` endpoint carrying these settings
    /// (windows, keepalive, timeouts); the connector brings its own TLS. Replaces
    /// [`with_tls`](Self::with_tls).
    #[must_use]
    pub fn with_connector(mut self, connect: Option<Connect>) -> Self {
        if connect.is_some() {
            self.tls = None;
        }
        self.connect = connect;
        self
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> TransportConfig {
        self.cfg
    }

    /// The channel to `target` (`host:port`), created on first use. At most `max_channels` are
    /// kept: a new one closes the least recently used (its calls in flight finish).
    ///
    /// # Errors
    /// INVALID_ARGUMENT when `target` is not a `host:port`.
    pub fn channel(&self, target: &str) -> Result<Channel, Status> {
        let mut cache = self
            .channels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.clock += 1;
        let now = cache.clock;
        if let Some((c, used)) = cache.map.get_mut(target) {
            *used = now;
            return Ok(c.clone());
        }
        while cache.map.len() >= self.cfg.max_channels.max(1) {
            let oldest = cache
                .map
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => cache.map.remove(&k),
                None => break,
            };
        }
        let c = glue::endpoint(target, self.cfg.connect_timeout, self.tls.as_ref())?
            .initial_stream_window_size(self.cfg.stream_window)
            .initial_connection_window_size(self.cfg.connection_window)
            .http2_adaptive_window(false);
        let c = match self.cfg.keepalive {
            Some((every, timeout)) => c
                .http2_keep_alive_interval(every)
                .keep_alive_timeout(timeout)
                .keep_alive_while_idle(true),
            None => c,
        };
        let c = match &self.connect {
            Some(connect) => connect(c),
            None if self.cfg.write_cap > 0 => {
                c.connect_with_connector_lazy(crate::socket::CappedDialer {
                    connect_timeout: self.cfg.connect_timeout,
                    write_cap: self.cfg.write_cap,
                })
            }
            None => c.connect_lazy(),
        };
        cache.map.insert(target.to_owned(), (c.clone(), now));
        Ok(c)
    }

    /// Channels cached now.
    #[must_use]
    pub fn channels(&self) -> usize {
        self.channels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map
            .len()
    }

    fn limits(&self) -> MessageLimits {
        MessageLimits {
            max_decode: self.cfg.max_message,
            max_encode: self.cfg.max_message,
        }
    }
}

impl KvTransport for GrpcTransport {
    async fn has_blocks(&self, target: &str, req: HasBlocksRequest) -> Result<Vec<bool>, Status> {
        let ch = self.channel(target)?;
        let call = glue::unary::<_, crate::pb::kv::HasBlocksResponse>(
            ch,
            path::HAS_BLOCKS,
            self.limits(),
            Request::new(req),
        );
        Ok(glue::bounded(self.cfg.call_timeout, "HasBlocks", call)
            .await?
            .present)
    }

    async fn push(&self, target: &str, chunks: ChunkStream) -> Result<KvAck, Status> {
        let ch = self.channel(target)?;
        let call = super::body::push(ch, path::PUSH_KV, self.limits(), chunks);
        glue::bounded(self.cfg.push_timeout, "PushKv", call).await
    }

    async fn release(&self, target: &str, handle_id: &str) -> Result<bool, Status> {
        let ch = self.channel(target)?;
        let req = Request::new(ReleaseRequest {
            handle_id: handle_id.to_owned(),
        });
        let call = glue::unary::<_, ReleaseResponse>(ch, path::RELEASE, self.limits(), req);
        Ok(glue::bounded(self.cfg.call_timeout, "Release", call)
            .await?
            .released)
    }

    fn lookup_unreachable(&self, lookup: &str) -> bool {
        self.lookup_misses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(lookup)
            .is_some_and(|at| at.elapsed() < LOOKUP_RETRY)
    }

    fn lookup_missed(&self, lookup: &str) {
        let mut misses = self
            .lookup_misses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if misses.len() >= self.cfg.max_channels.max(1) && !misses.contains_key(lookup) {
            misses.retain(|_, at| at.elapsed() < LOOKUP_RETRY);
            if misses.len() >= self.cfg.max_channels.max(1) {
                let oldest = misses
                    .iter()
                    .min_by_key(|(_, at)| **at)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    misses.remove(&k);
                }
            }
        }
        misses.insert(lookup.to_owned(), Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::{GrpcTransport, KvTransport, TransportConfig};
    use std::time::Duration;

    /// Unreachable lookup ports are remembered, at most `max_channels` of them (the oldest goes
    /// first), so a peer cannot grow the record by naming ports.
    #[test]
    fn unreachable_lookups_are_remembered_within_a_bound() {
        let mut cfg = TransportConfig::for_envelope(1 << 10);
        cfg.max_channels = 2;
        let t = GrpcTransport::new(cfg);
        assert!(!t.lookup_unreachable("a:1"));
        t.lookup_missed("a:1");
        std::thread::sleep(Duration::from_millis(2));
        t.lookup_missed("b:1");
        assert!(t.lookup_unreachable("a:1") && t.lookup_unreachable("b:1"));
        std::thread::sleep(Duration::from_millis(2));
        t.lookup_missed("c:1");
        assert!(!t.lookup_unreachable("a:1"), "the oldest is forgotten");
        assert!(t.lookup_unreachable("b:1") && t.lookup_unreachable("c:1"));
        assert_eq!(t.lookup_misses.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn channel_cache_is_bounded_least_recently_used_first() {
        let mut cfg = super::TransportConfig::for_envelope(172);
        cfg.max_channels = 2;
        let t = super::GrpcTransport::new(cfg);
        let a = t.channel("127.0.0.1:1").unwrap();
        t.channel("127.0.0.1:2").unwrap();
        // Use the first again: the second is now the least recently used.
        t.channel("127.0.0.1:1").unwrap();
        t.channel("127.0.0.1:3").unwrap();
        assert_eq!(t.channels(), 2);
        let cache = t.channels.lock().unwrap();
        let mut kept: Vec<&str> = cache.map.keys().map(String::as_str).collect();
        kept.sort_unstable();
        assert_eq!(kept, ["127.0.0.1:1", "127.0.0.1:3"]);
        drop(a);
    }
}
