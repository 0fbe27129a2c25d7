//! The prefill side of a transfer: [`KvTransport`] (HasBlocks, PushKv, Release to a target),
//! its gRPC implementation [`GrpcTransport`], and [`transfer`], which sends a prompt's blocks
//! minus the ones the target already holds.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BufMut;
use kvwire::CRC32C_RESIDUE;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use tokio_stream::{Stream, StreamExt};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, ClientTlsConfig};
use tonic::{Code, Request, Status};

use crate::glue::{self, Limits};
use crate::pb::kv::{HasBlocksRequest, KvAck, KvChunk, ReleaseRequest, ReleaseResponse, path};
use crate::store::{BlockId, KvStore, StoreError};

/// The chunks of one push, produced lazily as the transport drains them.
pub type ChunkStream = Pin<Box<dyn Stream<Item = OutChunk> + Send>>;

/// A chunk on its way out. Its payload is either in the message already, or still a block in
/// the sender's pool, copied straight into the gRPC encode buffer when the chunk is encoded: one
/// copy from the slab to the wire buffer, with the envelope's CRC computed on the way.
#[derive(Clone, Debug)]
pub struct OutChunk {
    /// The chunk; its `payload` is empty while the block is still in the pool.
    pub chunk: KvChunk,
    block: Option<LazyBlock>,
}

#[derive(Clone, Debug)]
struct LazyBlock {
    store: Arc<dyn KvStore>,
    id: BlockId,
    envelope_len: usize,
    failed: Arc<Mutex<Option<StoreError>>>,
}

impl From<KvChunk> for OutChunk {
    fn from(chunk: KvChunk) -> Self {
        Self { chunk, block: None }
    }
}

impl OutChunk {
    /// True when the chunk carries a payload (in the message or still in the pool).
    #[must_use]
    pub fn has_payload(&self) -> bool {
        self.block.is_some() || !self.chunk.payload.is_empty()
    }

    /// The chunk with its payload in the message: the envelope written from the pool and its
    /// CRC-32C set. For transports that do not encode protobuf (an in-process one).
    ///
    /// # Errors
    /// When the block is no longer held (also recorded, so the transfer reports it).
    pub fn materialize(self) -> Result<KvChunk, StoreError> {
        let Some(block) = self.block else {
            return Ok(self.chunk);
        };
        let mut envelope = Vec::with_capacity(block.envelope_len);
        if let Err(e) = block.store.write_envelope(block.id, &mut envelope) {
            *block
                .failed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e.clone());
            return Err(e);
        }
        Ok(KvChunk {
            payload_crc32c: kvwire::crc32c(&envelope),
            payload: envelope.into(),
            ..self.chunk
        })
    }
}

/// Encodes [`OutChunk`]s as `tl.kv.v1.KvChunk` (writing a lazy payload from the pool) and
/// decodes [`KvAck`]s.
#[derive(Debug, Default)]
struct PushCodec;

#[derive(Debug, Default)]
struct PushEncoder;

#[derive(Debug, Default)]
struct AckDecoder;

impl Codec for PushCodec {
    type Encode = OutChunk;
    type Decode = KvAck;
    type Encoder = PushEncoder;
    type Decoder = AckDecoder;

    fn encoder(&mut self) -> PushEncoder {
        PushEncoder
    }

    fn decoder(&mut self) -> AckDecoder {
        AckDecoder
    }
}

impl Encoder for PushEncoder {
    type Item = OutChunk;
    type Error = Status;

    fn encode(&mut self, item: OutChunk, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        if let Some(block) = &item.block {
            // One allocation for the whole message: the envelope is written in place.
            let c = &item.chunk;
            buf.reserve(block.envelope_len + c.handle_id.len() + c.model.len() + 64);
        }
        encode_chunk(item, buf)
    }
}

/// Writes `item` as a `tl.kv.v1.KvChunk`: prost's own encoding when the payload is in the
/// message; otherwise the same fields in tag order, exactly as prost would write them, with the
/// payload (tag 6) written from the pool straight into `buf`. `push_encoder_matches_prost`
/// holds the two to the same bytes.
fn encode_chunk<B: BufMut>(item: OutChunk, buf: &mut B) -> Result<(), Status> {
    let Some(block) = item.block else {
        return item
            .chunk
            .encode(buf)
            .map_err(|e| Status::internal(format!("encoding a chunk: {e}")));
    };
    let c = &item.chunk;
    use prost::encoding::{fixed32, string, uint32, uint64};
    if !c.handle_id.is_empty() {
        string::encode(1, &c.handle_id, buf);
    }
    if c.index != 0 {
        uint32::encode(2, &c.index, buf);
    }
    if c.total != 0 {
        uint32::encode(3, &c.total, buf);
    }
    if c.hash != 0 {
        uint64::encode(4, &c.hash, buf);
    }
    if c.kv_format != 0 {
        uint32::encode(5, &c.kv_format, buf);
    }
    encode_key(6, WireType::LengthDelimited, buf);
    encode_varint(block.envelope_len as u64, buf);
    let before = buf.remaining_mut();
    if let Err(e) = block.store.write_envelope(block.id, buf) {
        let msg = e.to_string();
        *block
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
        return Err(Status::internal(msg));
    }
    debug_assert_eq!(before - buf.remaining_mut(), block.envelope_len);
    // The CRC-32C of a whole valid envelope is the residue: no second pass needed.
    fixed32::encode(7, &CRC32C_RESIDUE, buf);
    if !c.model.is_empty() {
        string::encode(8, &c.model, buf);
    }
    Ok(())
}

impl Decoder for AckDecoder {
    type Item = KvAck;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<KvAck>, Status> {
        KvAck::decode(buf)
            .map(Some)
            .map_err(|e| Status::internal(format!("decoding KvAck: {e}")))
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
        }
    }
}

/// [`KvTransport`] over gRPC: one lazily connected channel per target, reused by every call.
/// It is also the process's one channel cache: a gateway reaches an engine's EngineControl over
/// the same [`channel`](Self::channel) (one connection per peer address).
#[derive(Debug)]
pub struct GrpcTransport {
    cfg: TransportConfig,
    tls: Option<ClientTlsConfig>,
    channels: Mutex<Channels>,
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
            channels: Mutex::new(Channels::default()),
        }
    }

    /// Connects over mutual TLS with these settings from now on.
    #[must_use]
    pub fn with_tls(mut self, tls: Option<ClientTlsConfig>) -> Self {
        self.tls = tls;
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
        }
        .connect_lazy();
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

    fn limits(&self) -> Limits {
        Limits {
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
        let call = glue::client_streaming_with(
            ch,
            path::PUSH_KV,
            self.limits(),
            Request::new(chunks),
            PushCodec,
        );
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
}

/// What a transfer moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Blocks sent with a payload.
    pub sent: u32,
    /// Blocks sent as empty payloads (the target held them).
    pub deduped: u32,
    /// Payload bytes (whole envelopes) of the push that succeeded.
    pub payload_bytes: u64,
    /// Payloads resent after the target answered NOT_FOUND (0 when no retry was needed).
    pub resent: u32,
    /// The `kv_format` the blocks travelled in (the first offered that the target serves).
    pub kv_format: u32,
}

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The target refused or could not be reached; the status passes through unchanged.
    #[error("{0}")]
    Rpc(#[from] Status),
    /// A block could not be read from the local pool.
    #[error("local pool: {0}")]
    Store(StoreError),
    /// The caller's arguments do not describe a prompt.
    #[error("{0}")]
    BadRequest(String),
    /// The blocks' producer (a prefill) stopped before writing every block; the push ended
    /// short and the target undid it.
    #[error("the prefill stopped before every block was written: the push was undone")]
    SourceStopped,
}

impl TransferError {
    /// The gRPC code to answer with.
    #[must_use]
    pub fn code(&self) -> Code {
        match self {
            TransferError::Rpc(s) => s.code(),
            TransferError::Store(_) => Code::Internal,
            TransferError::BadRequest(_) => Code::InvalidArgument,
            TransferError::SourceStopped => Code::Aborted,
        }
    }
}

impl From<TransferError> for Status {
    fn from(e: TransferError) -> Status {
        match e {
            TransferError::Rpc(s) => s,
            other => Status::new(other.code(), other.to_string()),
        }
    }
}

/// The blocks of a prompt as a prefill writes them: the value is the ids of the blocks written
/// so far, in order, each final (full blocks as they fill, the partial tail after the prompt's
/// last token). The producer holds a reference on each published block until the push ends.
/// A sender dropped before every block is published stops the push.
pub type BlockFeed = tokio::sync::watch::Receiver<Vec<BlockId>>;

/// Where a push finds its blocks.
#[derive(Clone, Debug)]
enum Source {
    /// Every block is written already.
    Ready(Arc<[BlockId]>),
    /// Blocks arrive as a prefill writes them.
    Feed(BlockFeed),
}

/// What one push sends.
#[derive(Clone, Debug)]
struct PushPlan {
    store: Arc<dyn KvStore>,
    /// The format the target accepted: the store's.
    kv_format: u32,
    handle_id: String,
    model: String,
    source: Source,
    total: u32,
    hashes: Arc<[u64]>,
    /// Per chunk: send it empty (the target holds the block).
    skip: Arc<[bool]>,
    /// Set when a block could not be exported (the push then fails).
    failed: Arc<Mutex<Option<StoreError>>>,
    /// Set when the feed stopped before every block was written (the push then ends short, and
    /// the target undoes it).
    stopped: Arc<std::sync::atomic::AtomicBool>,
    envelope_len: usize,
}

impl PushPlan {
    /// The chunks, built one at a time as the transport asks for them: at most the chunks the
    /// HTTP/2 windows admit are ever materialised, however long the prompt. From a feed, a
    /// chunk with a payload waits until its block is written; a deduped one goes at once.
    fn stream(&self) -> ChunkStream {
        let plan = self.clone();
        let total = self.total;
        match &self.source {
            Source::Ready(ids) => {
                let ids = Arc::clone(ids);
                Box::pin(tokio_stream::iter(0..total).map(move |i| plan.chunk(i, ids[i as usize])))
            }
            Source::Feed(feed) => {
                let feed = feed.clone();
                Box::pin(
                    tokio_stream::iter(0..total)
                        .then(move |i| {
                            let (plan, mut feed) = (plan.clone(), feed.clone());
                            async move {
                                if plan.skip[i as usize] {
                                    return Some(plan.chunk(i, 0));
                                }
                                match feed.wait_for(|ids| ids.len() > i as usize).await {
                                    Ok(ids) => Some(plan.chunk(i, ids[i as usize])),
                                    Err(_) => {
                                        plan.stopped.store(true, Ordering::Relaxed);
                                        None
                                    }
                                }
                            }
                        })
                        .map_while(|c| c),
                )
            }
        }
    }

    /// Chunk `index`, lazily holding block `id` unless it is deduped.
    fn chunk(&self, index: u32, id: BlockId) -> OutChunk {
        let i = index as usize;
        let chunk = KvChunk {
            handle_id: self.handle_id.clone(),
            index,
            total: self.total,
            hash: self.hashes.get(i).copied().unwrap_or(0),
            kv_format: self.kv_format,
            payload: bytes::Bytes::new(),
            payload_crc32c: 0,
            model: self.model.clone(),
        };
        let block = (!self.skip[i]).then(|| LazyBlock {
            store: Arc::clone(&self.store),
            id,
            envelope_len: self.envelope_len,
            failed: Arc::clone(&self.failed),
        });
        OutChunk { chunk, block }
    }

    fn take_failure(&self) -> Option<TransferError> {
        if self.stopped.load(Ordering::Relaxed) {
            return Some(TransferError::SourceStopped);
        }
        self.failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .map(TransferError::Store)
    }
}

/// Moves a prompt's KV blocks to `target` under `handle_id`.
///
/// `ids` are the prompt's blocks in order (the partial tail last, if any); `hashes` the chained
/// hashes of its full blocks. Asks HasBlocks, then pushes the blocks the target holds as empty
/// payloads and the rest as one-block envelopes (a full block this pool never registered travels
/// with envelope hash 0 and the chunk hash set). On NOT_FOUND (a block evicted between the two
/// calls) every payload is resent once. The caller keeps its references throughout and drops them
/// afterwards, whatever the outcome.
///
/// # Errors
/// The target's status passed through, a local export failure, or bad arguments.
pub async fn transfer<T: KvTransport + ?Sized>(
    transport: &T,
    target: &str,
    store: Arc<dyn KvStore>,
    handle_id: &str,
    model: &str,
    ids: &[BlockId],
    hashes: &[u64],
) -> Result<TransferStats, TransferError> {
    let source = Source::Ready(ids.into());
    let push = Push {
        target,
        handle_id,
        model,
        hashes,
        n_blocks: ids.len(),
    };
    run_push(transport, &[store], push, source).await
}

/// [`transfer`] offering several formats, best first: one store per format, each a view of the
/// same pool (so `ids` name the same blocks in all of them) writing its own envelopes. HasBlocks
/// goes out in the first format; a target that answers FAILED_PRECONDITION (a format it does not
/// serve) is asked in the next, before any block moves. The format the blocks travelled in is
/// [`TransferStats::kv_format`]. A v1-only target and a v1+v2 sender therefore agree on v1 with
/// no change to the protocol.
///
/// ```
/// use std::sync::Arc;
/// use kvwire::{Shape, WireFormat};
/// use kvwire_grpc::memory::{LocalTransport, MemStore};
/// use kvwire_grpc::{KvReceiver, KvStore, Push, transfer_formats};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let v1 = Shape::v1(4, 2, 1, 4);
/// // A decode engine still on v1.
/// let decode: Arc<dyn KvStore> = Arc::new(MemStore::new(v1, 8));
/// let rx = Arc::new(KvReceiver::new(decode, "fake"));
/// // A prefill engine offering v2 then v1 (a toy: the v2 store would be a converting view of
/// // the same pool, so that `ids` name the same blocks in both).
/// let v2 = Shape { format: WireFormat::new(2, 2, 1, "e4m3"), ..v1 };
/// let as_v2 = Arc::new(MemStore::new(v2, 8));
/// let as_v1 = Arc::new(MemStore::new(v1, 8));
/// let id = as_v1.put(0, 2, &vec![0u8; v1.payload_bytes().unwrap()]).unwrap();
/// let offer: [Arc<dyn KvStore>; 2] = [as_v2, as_v1];
/// let push = Push { target: "d", handle_id: "h", model: "fake", hashes: &[], n_blocks: 1 };
/// let stats = transfer_formats(&LocalTransport::new(rx), &offer, push, &[id]).await.unwrap();
/// assert_eq!(stats.kv_format, 1); // negotiated down
/// # });
/// ```
///
/// # Errors
/// As [`transfer`]; when the target serves none of the formats, its FAILED_PRECONDITION for the
/// last one, and no push was opened. [`TransferError::BadRequest`] for an empty list.
pub async fn transfer_formats<T: KvTransport + ?Sized>(
    transport: &T,
    stores: &[Arc<dyn KvStore>],
    push: Push<'_>,
    ids: &[BlockId],
) -> Result<TransferStats, TransferError> {
    run_push(transport, stores, push, Source::Ready(ids.into())).await
}

/// [`transfer`] while a prefill still writes the blocks: HasBlocks first (the hashes depend
/// only on the prompt's tokens), then each missing block streamed as soon as `feed` publishes
/// it, in index order, deduped blocks as empty chunks in their places. The prompt has `n_blocks`
/// blocks (`hashes.len()` full ones, plus a partial tail when one more).
///
/// Dropping the returned future mid-push resets the stream, and the target undoes the push.
///
/// ```
/// use std::sync::Arc;
/// use kvwire::{Shape, prompt_hashes};
/// use kvwire_grpc::memory::{LocalTransport, MemStore};
/// use kvwire_grpc::{KvReceiver, KvStore, Push, transfer_streaming};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let shape = Shape::v1(4, 2, 1, 4);
/// let rx = Arc::new(KvReceiver::new(Arc::new(MemStore::new(shape, 8)), "fake"));
/// let t = LocalTransport::new(Arc::clone(&rx));
/// let prefill = Arc::new(MemStore::new(shape, 8));
/// let hashes = prompt_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
/// // The prefill publishes each block's id as soon as the block is written.
/// let (written, feed) = tokio::sync::watch::channel(Vec::new());
/// let push = Push { target: "d", handle_id: "h", model: "fake", hashes: &hashes, n_blocks: 2 };
/// let moving = transfer_streaming(&t, Arc::clone(&prefill) as Arc<dyn KvStore>, push, feed);
/// let writing = async {
///     let payload = vec![5u8; shape.payload_bytes().unwrap()];
///     for &h in &hashes {
///         let id = prefill.put(h, 4, &payload).unwrap();
///         written.send_modify(|ids| ids.push(id));
///         tokio::task::yield_now().await; // the model computing the next block
///     }
/// };
/// let (stats, ()) = tokio::join!(moving, writing);
/// assert_eq!(stats.unwrap().sent, 2);
/// assert!(rx.claim("h").is_some());
/// # });
/// ```
///
/// # Errors
/// As [`transfer`], and [`TransferError::SourceStopped`] when the feed closes before every block
/// was written (the target undoes the push).
pub async fn transfer_streaming<T: KvTransport + ?Sized>(
    transport: &T,
    store: Arc<dyn KvStore>,
    push: Push<'_>,
    feed: BlockFeed,
) -> Result<TransferStats, TransferError> {
    run_push(transport, &[store], push, Source::Feed(feed)).await
}

/// What a push is: where it goes, under which handle, and the prompt's blocks.
#[derive(Clone, Copy, Debug)]
pub struct Push<'a> {
    /// The decode engine's KvTransfer address.
    pub target: &'a str,
    /// The handle the blocks are held under there.
    pub handle_id: &'a str,
    /// The model the KV belongs to.
    pub model: &'a str,
    /// The chained hashes of the prompt's full blocks.
    pub hashes: &'a [u64],
    /// The prompt's blocks: `hashes.len()`, plus one for a partial tail.
    pub n_blocks: usize,
}

/// HasBlocks in each offered format, in order, until the target serves one: that store, and
/// which of `hashes` the target holds. Moves no block.
async fn negotiate<T: KvTransport + ?Sized>(
    transport: &T,
    stores: &[Arc<dyn KvStore>],
    p: &Push<'_>,
) -> Result<(Arc<dyn KvStore>, Vec<bool>), TransferError> {
    let hashes = p.hashes;
    let mut last = None;
    for store in stores {
        // With one format and no full block there is nothing to ask.
        if hashes.is_empty() && stores.len() == 1 {
            return Ok((Arc::clone(store), Vec::new()));
        }
        let req = HasBlocksRequest {
            hashes: hashes.to_vec(),
            kv_format: store.kv_format(),
            model: p.model.to_owned(),
        };
        match transport.has_blocks(p.target, req).await {
            Ok(got) if got.len() == hashes.len() => return Ok((Arc::clone(store), got)),
            Ok(got) => {
                return Err(TransferError::Rpc(Status::internal(format!(
                    "HasBlocks answered {} flags for {} hashes",
                    got.len(),
                    hashes.len()
                ))));
            }
            Err(s) if s.code() == Code::FailedPrecondition => last = Some(s),
            Err(s) => return Err(TransferError::Rpc(s)),
        }
    }
    Err(match last {
        Some(s) => TransferError::Rpc(s),
        None => TransferError::BadRequest("no format offered".into()),
    })
}

async fn run_push<T: KvTransport + ?Sized>(
    transport: &T,
    stores: &[Arc<dyn KvStore>],
    p: Push<'_>,
    source: Source,
) -> Result<TransferStats, TransferError> {
    let Some(first) = stores.first() else {
        return Err(TransferError::BadRequest("no format offered".into()));
    };
    let b = first.shape().block_tokens();
    let (n, hashes) = (p.n_blocks, p.hashes);
    if n == 0 || hashes.len() > n || n > hashes.len() + 1 {
        return Err(TransferError::BadRequest(format!(
            "{n} blocks and {} full-block hashes do not describe a prompt (B = {b})",
            hashes.len()
        )));
    }
    let (store, present) = negotiate(transport, stores, &p).await?;
    let shape = store.shape();
    let skip: Vec<bool> = (0..n)
        .map(|i| present.get(i).copied().unwrap_or(false))
        .collect();
    if let Source::Feed(feed) = &source {
        // The stream opens once the prefill has begun (its first block written), so a prefill
        // queued behind others does not hold an idle push open on the target.
        feed.clone()
            .wait_for(|ids| !ids.is_empty())
            .await
            .map_err(|_| TransferError::SourceStopped)?;
    }
    let mut plan = PushPlan {
        kv_format: store.kv_format(),
        store,
        handle_id: p.handle_id.to_owned(),
        model: p.model.to_owned(),
        source,
        total: n as u32,
        hashes: hashes.into(),
        skip: skip.into(),
        failed: Arc::new(Mutex::new(None)),
        stopped: Arc::default(),
        envelope_len: shape
            .envelope_len(1)
            .ok_or_else(|| TransferError::BadRequest("the block shape overflows".into()))?,
    };
    let mut resent = 0;
    let ack = match transport.push(p.target, plan.stream()).await {
        Ok(ack) => ack,
        Err(s) if s.code() == Code::NotFound && plan.take_failure().is_none() => {
            // Every block was written by now (the first push read them all).
            plan.skip = vec![false; n].into();
            resent = n as u32;
            transport.push(p.target, plan.stream()).await?
        }
        Err(s) => return Err(plan.take_failure().unwrap_or(TransferError::Rpc(s))),
    };
    if let Some(e) = plan.take_failure() {
        return Err(e);
    }
    Ok(TransferStats {
        sent: ack.blocks_received,
        deduped: ack.blocks_deduped,
        payload_bytes: ack.payload_bytes,
        resent,
        kv_format: plan.kv_format,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

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

    use bytes::BytesMut;
    use kvwire::{RecordIn, Shape, crc32c, write_to_vec};
    use prost::Message;

    use super::{LazyBlock, OutChunk, encode_chunk};
    use crate::memory::MemStore;
    use crate::pb::kv::KvChunk;
    use crate::store::KvStore;

    #[test]
    fn push_encoder_matches_prost() {
        let shape = Shape::v1(4, 2, 1, 4);
        let p = shape.payload_bytes().unwrap();
        let store = Arc::new(MemStore::new(shape, 4));
        let full: Vec<u8> = (0..p).map(|i| (i * 7) as u8).collect();
        let tail: Vec<u8> = (0..p).map(|i| (i * 13 + 1) as u8).collect();
        let cases = [
            // (hash, fill, payload, handle, index, total, model)
            (0xdead_beef_u64, 4, &full, "h-1", 0, 3, "fake"),
            (0, 2, &tail, "h-1", 2, 3, ""),
            (u64::MAX, 4, &full, "", 1, 0, "m"),
        ];
        for (hash, fill, payload, handle, index, total, model) in cases {
            let id = store.put(hash, fill, payload).unwrap();
            let mut envelope = Vec::new();
            let rec = RecordIn {
                hash,
                fill,
                payload,
            };
            write_to_vec(&shape, &[rec], &mut envelope).unwrap();
            let chunk = KvChunk {
                handle_id: handle.into(),
                index,
                total,
                hash,
                kv_format: 1,
                payload: bytes::Bytes::new(),
                payload_crc32c: 0,
                model: model.into(),
            };
            let store_dyn: Arc<dyn KvStore> = Arc::clone(&store) as Arc<dyn KvStore>;
            let lazy = OutChunk {
                chunk: chunk.clone(),
                block: Some(LazyBlock {
                    store: store_dyn,
                    id,
                    envelope_len: envelope.len(),
                    failed: Arc::new(Mutex::new(None)),
                }),
            };
            let mut ours = BytesMut::new();
            encode_chunk(lazy, &mut ours).unwrap();
            let whole = KvChunk {
                payload_crc32c: crc32c(&envelope),
                payload: envelope.into(),
                ..chunk
            };
            assert_eq!(ours.as_ref(), whole.encode_to_vec(), "chunk {index}");
            // And the plain path (payload already in the message) is prost's own.
            let mut plain = BytesMut::new();
            encode_chunk(OutChunk::from(whole.clone()), &mut plain).unwrap();
            assert_eq!(plain.as_ref(), whole.encode_to_vec());
            store.release(&[id]);
        }
        // A block no longer held fails the encode and records why.
        let lazy = OutChunk {
            chunk: KvChunk::default(),
            block: Some(LazyBlock {
                store: Arc::clone(&store) as Arc<dyn KvStore>,
                id: 3,
                envelope_len: shape.envelope_len(1).unwrap(),
                failed: Arc::new(Mutex::new(None)),
            }),
        };
        let failed = Arc::clone(&lazy.block.as_ref().unwrap().failed);
        assert!(encode_chunk(lazy, &mut BytesMut::new()).is_err());
        assert!(failed.lock().unwrap().is_some());
    }
}
