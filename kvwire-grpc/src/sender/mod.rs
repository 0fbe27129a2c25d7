//! The prefill side of a transfer: [`KvTransport`] (HasBlocks, PushKv, Release to a target),
//! its gRPC implementation [`GrpcTransport`], and [`transfer`], which sends a prompt's blocks
//! minus the ones the target already holds.

mod body;
mod encode;
mod transport;

use self::encode::LazyBlock;
pub use self::encode::{ChunkStream, OutChunk};
pub use self::transport::{
    Connect, GrpcTransport, KvTransport, LOOKUP_RETRY, TransportConfig, has_blocks_at,
};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio_stream::StreamExt;
use tonic::{Code, Status};

use crate::pb::kv::{HasBlocksRequest, KvChunk};
use crate::store::{BlockId, KvStore, StoreError};

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
    /// The prompt, B tokens to a chunk (empty: chunks carry none).
    tokens: Arc<[u32]>,
    block_tokens: usize,
    scope: u64,
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
        let b = self.block_tokens;
        let tokens = self
            .tokens
            .get(i * b..((i + 1) * b).min(self.tokens.len()))
            .unwrap_or(&[])
            .to_vec();
        let chunk = KvChunk {
            handle_id: self.handle_id.clone(),
            index,
            total: self.total,
            hash: self.hashes.get(i).copied().unwrap_or(0),
            kv_format: self.kv_format,
            payload: bytes::Bytes::new(),
            payload_crc32c: 0,
            model: self.model.clone(),
            tokens,
            cache_scope: self.scope,
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

/// Moves a prompt's KV blocks to `push.target` under `push.handle_id`.
///
/// `ids` are the prompt's blocks in order (the partial tail last, if any), `push.n_blocks` of
/// them; `push.hashes` the chained hashes of its full blocks. Asks HasBlocks, then pushes the blocks the target holds as empty
/// payloads and the rest as one-block envelopes (a full block this pool never registered travels
/// with envelope hash 0 and the chunk hash set). On NOT_FOUND (a block evicted between the two
/// calls) every payload is resent once. The caller keeps its references throughout and drops them
/// afterwards, whatever the outcome.
///
/// # Errors
/// The target's status passed through, a local export failure, or bad arguments.
pub async fn transfer<T: KvTransport + ?Sized>(
    transport: &T,
    store: Arc<dyn KvStore>,
    push: Push<'_>,
    ids: &[BlockId],
) -> Result<TransferStats, TransferError> {
    if ids.len() != push.n_blocks {
        return Err(TransferError::BadRequest(format!(
            "{} block ids for a push of {} blocks",
            ids.len(),
            push.n_blocks
        )));
    }
    run_push(transport, &[store], push, Source::Ready(ids.into())).await
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
/// use kvwire_grpc::{BlockKey, KvReceiver, KvStore, Push, transfer_formats};
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
/// let id = as_v1.put(BlockKey::ANON, 2, &vec![0u8; v1.payload_bytes().unwrap()]).unwrap();
/// let offer: [Arc<dyn KvStore>; 2] = [as_v2, as_v1];
/// let push = Push {
///     target: "d", handle_id: "h", model: "fake", hashes: &[], n_blocks: 1, known: None, lookup: None,
///     tokens: &[1, 2], scope: 0,
/// };
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
/// use kvwire_grpc::{BlockKey, KvReceiver, KvStore, Push, transfer_streaming};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let shape = Shape::v1(4, 2, 1, 4);
/// let rx = Arc::new(KvReceiver::new(Arc::new(MemStore::new(shape, 8)), "fake"));
/// let t = LocalTransport::new(Arc::clone(&rx));
/// let prefill = Arc::new(MemStore::new(shape, 8));
/// let hashes = prompt_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
/// // The prefill publishes each block's id as soon as the block is written.
/// let (written, feed) = tokio::sync::watch::channel(Vec::new());
/// let push = Push {
///     target: "d", handle_id: "h", model: "fake", hashes: &hashes, n_blocks: 2, known: None, lookup: None,
///     tokens: &[1, 2, 3, 4, 5, 6, 7, 8], scope: 0,
/// };
/// let moving = transfer_streaming(&t, Arc::clone(&prefill) as Arc<dyn KvStore>, push, feed);
/// let writing = async {
///     let payload = vec![5u8; shape.payload_bytes().unwrap()];
///     for _ in &hashes {
///         let id = prefill.put(BlockKey::ANON, 4, &payload).unwrap();
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
    /// The prompt's tokens. Each chunk carries its block's, so the target compares them
    /// before it deduplicates onto a block it holds (the hash alone is only an index), and the
    /// claim can check every token, the tail's included. Empty: chunks carry none (an older
    /// sender's behaviour), and nothing is deduplicated.
    pub tokens: &'a [u32],
    /// The tenant scope the blocks are cached and deduplicated in (0: shared).
    pub scope: u64,
    /// What the target already answered HasBlocks for these hashes (the gateway asked it while
    /// routing): the push goes by it instead of asking again, when it is in the first offered
    /// format and has one flag per hash. A block evicted since is found missing by the push
    /// (NOT_FOUND), and every payload is resent once, as when the push asked itself.
    pub known: Option<Holds<'a>>,
    /// Where the target also answers HasBlocks, on threads its imports do not hold (a decode
    /// engine's control port); `None`: it is asked at `target` ([`has_blocks_at`]).
    pub lookup: Option<&'a str>,
}

/// A target's HasBlocks answer: in which format, and one flag per full block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holds<'a> {
    /// The format it was asked in.
    pub kv_format: u32,
    /// Whether it holds each block.
    pub present: &'a [bool],
}

/// HasBlocks in each offered format, in order, until the target serves one: that store, and
/// which of `hashes` the target holds. Moves no block.
async fn negotiate<T: KvTransport + ?Sized>(
    transport: &T,
    stores: &[Arc<dyn KvStore>],
    p: &Push<'_>,
) -> Result<(Arc<dyn KvStore>, Vec<bool>), TransferError> {
    let hashes = p.hashes;
    if let (Some(k), Some(first)) = (p.known, stores.first())
        && k.kv_format == first.kv_format()
        && k.present.len() == hashes.len()
    {
        return Ok((Arc::clone(first), k.present.to_vec()));
    }
    let mut last = None;
    for store in stores {
        // With one format and no full block there is nothing to ask.
        if hashes.is_empty() && stores.len() == 1 {
            return Ok((Arc::clone(store), Vec::new()));
        }
        let b = store.shape().block_tokens() as usize;
        let req = HasBlocksRequest {
            hashes: hashes.to_vec(),
            kv_format: store.kv_format(),
            model: p.model.to_owned(),
            tokens: p.tokens.get(..hashes.len() * b).unwrap_or(&[]).to_vec(),
            cache_scope: p.scope,
        };
        match has_blocks_at(transport, p.lookup, p.target, req).await {
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
    if !p.tokens.is_empty() && p.tokens.len().div_ceil(b as usize) != n {
        return Err(TransferError::BadRequest(format!(
            "{} tokens are not {n} blocks of B = {b}",
            p.tokens.len()
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
        tokens: p.tokens.into(),
        block_tokens: b as usize,
        scope: p.scope,
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

    use bytes::BytesMut;
    use kvwire::{RecordIn, Shape, crc32c, write_to_vec};
    use prost::Message;

    use std::collections::VecDeque;

    use super::encode::{LazyBlock, OutChunk, encode_chunk, encode_message};
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
            let tokens: Vec<u32> = (0..fill).collect();
            let key = crate::BlockKey {
                scope: 7,
                hash,
                tokens: &tokens,
                parent: None,
            };
            let id = store.put(key, fill, payload).unwrap();
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
                tokens: (0..fill).map(|t| t * 300 + index).collect(),
                cache_scope: hash.rotate_left(7),
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
            encode_chunk(lazy.clone(), &mut ours).unwrap();
            let whole = KvChunk {
                payload_crc32c: crc32c(&envelope),
                payload: envelope.into(),
                ..chunk
            };
            assert_eq!(ours.as_ref(), whole.encode_to_vec(), "chunk {index}");
            // As framed for the wire: a full block's payload is the store's own bytes, lent,
            // between the fields before and after it; a partial one is written into one buffer.
            let mut pieces = VecDeque::new();
            encode_message(lazy.clone(), 1 << 20, &mut pieces).unwrap();
            let joined: Vec<u8> = pieces.iter().flat_map(|b| b.iter().copied()).collect();
            let mut framed = vec![0u8];
            framed.extend_from_slice(&(whole.encoded_len() as u32).to_be_bytes());
            framed.extend_from_slice(&whole.encode_to_vec());
            assert_eq!(joined, framed, "chunk {index} as framed");
            if fill == 4 {
                assert_eq!(pieces.len(), 3);
                let lent = store.lend_envelope(id).unwrap().unwrap();
                assert_eq!(pieces[1].as_ptr(), lent.as_ptr(), "the envelope was copied");
            } else {
                assert_eq!(pieces.len(), 1);
                assert!(store.lend_envelope(id).unwrap().is_none());
            }
            // Over the limit: OUT_OF_RANGE, and nothing queued.
            let mut none = VecDeque::new();
            let err = encode_message(lazy, framed.len() - 6, &mut none).unwrap_err();
            assert_eq!(err.code(), tonic::Code::OutOfRange);
            assert!(none.is_empty());
            let mut plain = VecDeque::new();
            encode_message(OutChunk::from(whole.clone()), 1 << 20, &mut plain).unwrap();
            assert_eq!(plain.len(), 1);
            assert_eq!(plain[0].as_ref(), &framed[..]);
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
        assert!(encode_chunk(lazy.clone(), &mut BytesMut::new()).is_err());
        assert!(failed.lock().unwrap().take().is_some());
        let mut none = VecDeque::new();
        let err = encode_message(lazy, 1 << 20, &mut none).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);
        assert!(none.is_empty());
        assert!(failed.lock().unwrap().is_some());
    }
}
