//! The decode side of a transfer, as plain logic: [`KvReceiver`] answers HasBlocks, applies the
//! per-chunk rules of a push in the contract's order, and holds each completed push's blocks
//! under its handle until the engine claims them or someone releases them.
//!
//! The life of a push:
//!
//! 1. [`KvReceiver::begin_push`] returns a [`PushState`]; the server feeds it every chunk as it
//!    arrives ([`PushState::accept`]), so a push is never buffered whole: each payload is
//!    checked (one CRC pass covers the chunk CRC and the envelope trailer) and copied into a
//!    pool block at once.
//! 2. [`PushState::finish`] at the end of the stream moves the blocks under the handle, with a
//!    lease ([`KvReceiver::expire_leases`] releases handles nobody claimed in time).
//! 3. If the push is refused, cut, or abandoned, the [`PushState`] is dropped unfinished and its
//!    drop undoes it: blocks it imported go back free and unregistered (not cached), references
//!    it took on blocks it already held are dropped. The receiver is then as before the push,
//!    apart from cached blocks evicted to make room.
//! 4. [`KvReceiver::claim`] hands the blocks to the engine as a [`Claimed`] guard;
//!    [`KvReceiver::release`] drops them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvwire::{ErrorKind, Formats, ReadError, Reader, block_hash, crc32c};
use tonic::{Code, Status};

use crate::pb::kv::{HasBlocksRequest, KvAck, KvChunk};
use crate::store::{BlockId, BlockKey, KvStore, StoreError};

/// Why a HasBlocks call or a chunk was refused; [`Status`] gets the contract's code.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecvError {
    /// Rule 1: a kv_format or model this receiver does not serve (FAILED_PRECONDITION).
    #[error("{0}")]
    Unserved(String),
    /// Rule 2 and the stream's shape: handle, index, total, count (INVALID_ARGUMENT).
    #[error("{0}")]
    Invalid(String),
    /// Rule 3: the chunk checksum does not match its payload (DATA_LOSS).
    #[error(
        "chunk {index}: payload_crc32c {stated:#010x} but the payload's CRC-32C is {actual:#010x}"
    )]
    Checksum {
        /// Chunk index.
        index: u32,
        /// As sent.
        stated: u32,
        /// As computed.
        actual: u32,
    },
    /// Rule 3: the envelope reader refused the payload (its kind decides the code).
    #[error("chunk {index}: {error}")]
    Envelope {
        /// Chunk index.
        index: u32,
        /// The reader's refusal.
        error: ReadError,
    },
    /// Rule 4: an empty payload names a hash this receiver no longer holds (NOT_FOUND).
    #[error("chunk {index}: block {hash:#018x} is no longer held; resend its payload")]
    Gone {
        /// Chunk index.
        index: u32,
        /// The hash.
        hash: u64,
    },
    /// Rule 5: no free or evictable block (RESOURCE_EXHAUSTED).
    #[error("chunk {index}: the KV pool is exhausted")]
    Exhausted {
        /// Chunk index.
        index: u32,
    },
    /// The store failed otherwise (INTERNAL).
    #[error("chunk {index}: {error}")]
    Store {
        /// Chunk index.
        index: u32,
        /// The store's error.
        error: StoreError,
    },
    /// A bound on what peers may hold is reached: pushes at once, pending handles
    /// (RESOURCE_EXHAUSTED).
    #[error("{0}")]
    Busy(String),
    /// The receiver is draining: it takes no new push (UNAVAILABLE).
    #[error("this receiver is draining and takes no new push")]
    Draining,
    /// The engine does not decode now (its role was changed): it takes no new push
    /// (FAILED_PRECONDITION; the sender tries another decode engine).
    #[error("this engine does not serve as a decode engine now and takes no new push")]
    NotDecoding,
}

impl RecvError {
    /// The gRPC code the contract gives this refusal.
    #[must_use]
    pub fn code(&self) -> Code {
        match self {
            RecvError::Unserved(_) => Code::FailedPrecondition,
            RecvError::Invalid(_) => Code::InvalidArgument,
            RecvError::Checksum { .. } => Code::DataLoss,
            RecvError::Envelope { error, .. } => match error.kind() {
                ErrorKind::Format => Code::DataLoss,
                _ => Code::FailedPrecondition,
            },
            RecvError::Gone { .. } => Code::NotFound,
            RecvError::Exhausted { .. } | RecvError::Busy(_) => Code::ResourceExhausted,
            RecvError::Store { .. } => Code::Internal,
            RecvError::Draining => Code::Unavailable,
            RecvError::NotDecoding => Code::FailedPrecondition,
        }
    }
}

impl From<RecvError> for Status {
    fn from(e: RecvError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

/// Blocks held under a completed push's handle.
#[derive(Debug)]
struct HeldHandle {
    ids: Vec<BlockId>,
    hashes: Vec<u64>,
    tokens: u64,
    /// The prompt the chunks named, when every chunk carried its tokens.
    prompt: Option<Vec<u32>>,
    scope: u64,
    /// The peer that pushed it.
    owner: Vec<u8>,
    deadline: Instant,
}

/// What a held handle names, for the claimer to compare with its request before claiming.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandleView {
    /// The chunk hashes, in order (0 for the tail).
    pub hashes: Vec<u64>,
    /// Tokens the blocks hold (the sum of their fills).
    pub tokens: u64,
    /// The prompt the chunks named, token by token; `None` when a chunk carried no tokens (an
    /// older sender), and then only the hashes can be compared.
    pub prompt: Option<Vec<u32>>,
    /// The tenant scope the push was made in.
    pub scope: u64,
}

#[derive(Debug, Default)]
struct State {
    pending: HashMap<String, HeldHandle>,
    /// Handles of pushes in progress.
    inflight: HashSet<String>,
    /// Pushes in progress, counted from before their first chunk.
    active: usize,
    /// Per peer (its certificate, or its address): pushes in progress and handles held.
    peers: HashMap<Vec<u8>, (usize, usize)>,
    leases_expired: u64,
}

/// Counters a receiver keeps for operators and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Handles held now.
    pub pending: usize,
    /// Pushes in progress (counted from before their first chunk).
    pub inflight: usize,
    /// Handles released because their lease ran out.
    pub leases_expired: u64,
    /// HasBlocks questions answered (a routing gateway's and a pushing prefill engine's).
    pub has_blocks_answered: u64,
}

/// What one receiver lets its peers hold at once (spec/limits.md). Every bound is checked
/// before anything is looked up or imported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReceiverLimits {
    /// Pushes in progress at once (RESOURCE_EXHAUSTED beyond).
    pub max_pushes: usize,
    /// Blocks in one push (chunk 0's `total`) and hashes in one HasBlocks: the most a prompt
    /// can have, ceil(max context / B) (INVALID_ARGUMENT beyond).
    pub max_blocks: u32,
    /// Handles held for a claim at once (RESOURCE_EXHAUSTED beyond).
    pub max_pending_handles: usize,
    /// Pushes one peer may have in progress (0: no bound of its own).
    pub max_pushes_per_peer: usize,
    /// Handles one peer's pushes may hold at once (0: no bound of its own), so one prefill
    /// certificate cannot take every slot of `max_pending_handles`.
    pub max_pending_per_peer: usize,
}

impl Default for ReceiverLimits {
    fn default() -> Self {
        Self {
            max_pushes: 64,
            max_blocks: 1 << 16,
            max_pending_handles: 256,
            max_pushes_per_peer: 0,
            max_pending_per_peer: 0,
        }
    }
}

impl State {
    /// `owner`'s entry: (pushes in progress, handles held).
    fn peer(&mut self, owner: &[u8]) -> &mut (usize, usize) {
        self.peers.entry(owner.to_vec()).or_default()
    }

    /// Forgets `owner` once it holds nothing.
    fn tidy(&mut self, owner: &[u8]) {
        if self.peers.get(owner) == Some(&(0, 0)) {
            self.peers.remove(owner);
        }
    }

    fn handle_gone(&mut self, owner: &[u8]) {
        let p = self.peer(owner);
        p.1 = p.1.saturating_sub(1);
        self.tidy(owner);
    }
}

/// The decode side of the transfer.
///
/// ```
/// use std::sync::Arc;
/// use std::time::{Duration, Instant};
/// use kvwire::{Shape, prompt_hashes};
/// use kvwire_grpc::memory::{LocalTransport, MemStore};
/// use kvwire_grpc::pb::kv::HasBlocksRequest;
/// use kvwire_grpc::{BlockKey, KvReceiver, KvStore, Push, transfer};
///
/// let shape = Shape::v1(4, 2, 1, 4);
/// let store = Arc::new(MemStore::new(shape, 8));
/// let rx = Arc::new(
///     KvReceiver::new(Arc::clone(&store) as Arc<dyn KvStore>, "fake")
///         .with_lease(Duration::from_secs(30)),
/// );
/// let hashes = prompt_hashes(&[1, 2, 3, 4], 4);
/// // HasBlocks: free, takes no reference; the tokens decide, the hashes only index them.
/// let ask = HasBlocksRequest {
///     hashes: hashes.clone(), kv_format: 1, model: "fake".into(), tokens: vec![1, 2, 3, 4], cache_scope: 0,
/// };
/// assert_eq!(rx.has_blocks(&ask).unwrap(), vec![false]);
/// // Another format or model is refused (FAILED_PRECONDITION).
/// let v2 = HasBlocksRequest { kv_format: 2, ..ask.clone() };
/// assert_eq!(rx.has_blocks(&v2).unwrap_err().code(), tonic::Code::FailedPrecondition);
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let prefill = Arc::new(MemStore::new(shape, 8));
/// let id = prefill.put(BlockKey::ANON, 4, &vec![3u8; shape.payload_bytes().unwrap()]).unwrap();
/// let t = LocalTransport::new(Arc::clone(&rx));
/// let push = Push {
///     target: "d", handle_id: "h", model: "fake", hashes: &hashes, n_blocks: 1, known: None, lookup: None,
///     tokens: &[1, 2, 3, 4], scope: 0,
/// };
/// transfer(&t, prefill as Arc<dyn KvStore>, push, &[id]).await.unwrap();
/// # });
/// // The handle waits for its claim: the prompt it holds can be checked first.
/// let held = rx.peek("h").unwrap();
/// assert_eq!((held.hashes, held.prompt), (hashes.clone(), Some(vec![1, 2, 3, 4])));
/// // Now the block is present, for these tokens only.
/// assert_eq!(rx.has_blocks(&ask).unwrap(), vec![true]);
/// let other = HasBlocksRequest { tokens: vec![1, 2, 3, 5], ..ask.clone() };
/// assert_eq!(rx.has_blocks(&other).unwrap(), vec![false]);
/// assert_eq!(rx.stats().pending, 1);
/// // Nobody claims it: at the end of its lease its blocks go back (or call `release`).
/// assert_eq!(rx.expire_leases(Instant::now() + Duration::from_secs(31)), 1);
/// assert_eq!((rx.stats().pending, store.snapshot().used), (0, 0));
/// ```
pub struct KvReceiver {
    store: Arc<dyn KvStore>,
    /// The one `kv_format` served: the store's.
    kv_format: u32,
    model: String,
    reader: Reader,
    block_tokens: u32,
    lease: Duration,
    limits: ReceiverLimits,
    draining: std::sync::atomic::AtomicBool,
    paused: std::sync::atomic::AtomicBool,
    changed: tokio::sync::Notify,
    state: Mutex<State>,
    has_blocks_answered: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for KvReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvReceiver")
            .field("model", &self.model)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl KvReceiver {
    /// The default lease of a held handle.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

    /// A receiver importing into `store`, serving `model`, with the default lease.
    #[must_use]
    pub fn new(store: Arc<dyn KvStore>, model: impl Into<String>) -> Self {
        let shape = store.shape();
        Self {
            block_tokens: shape.block_tokens(),
            // The store's format, whatever it is: a crate adding one (v2, fp8) needs no change
            // here, only a store of that shape.
            reader: Reader::new()
                .formats(Formats::new([shape.format]))
                .expect_shape(shape),
            kv_format: store.kv_format(),
            store,
            model: model.into(),
            lease: Self::DEFAULT_LEASE,
            limits: ReceiverLimits::default(),
            draining: std::sync::atomic::AtomicBool::new(false),
            paused: std::sync::atomic::AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
            state: Mutex::new(State::default()),
            has_blocks_answered: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Sets the bounds on what peers may hold.
    #[must_use]
    pub fn with_limits(mut self, limits: ReceiverLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The bounds in force.
    #[must_use]
    pub fn limits(&self) -> ReceiverLimits {
        self.limits
    }

    /// Refuses new pushes from now on (UNAVAILABLE); handles already held can still be claimed
    /// and released until their lease ends.
    pub fn start_drain(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops (`true`) or resumes (`false`) taking new pushes, refused meanwhile with
    /// [`RecvError::NotDecoding`]; handles already held can still be claimed and released.
    /// Unlike a drain it can be undone: an engine whose role changes pauses its receiver.
    pub fn set_paused(&self, paused: bool) {
        self.paused
            .store(paused, std::sync::atomic::Ordering::SeqCst);
    }

    /// True while new pushes are refused by [`set_paused`](Self::set_paused).
    #[must_use]
    pub fn is_paused(&self) -> bool {
        self.paused.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Resolves at the next change of what the receiver holds (a push ending, a handle claimed,
    /// released or expired).
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    fn notify(&self) {
        self.changed.notify_waiters();
    }

    /// Sets how long a completed push's blocks wait for a claim.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The lease.
    #[must_use]
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The store.
    #[must_use]
    pub fn store(&self) -> &Arc<dyn KvStore> {
        &self.store
    }

    /// The model served.
    #[must_use]
    pub fn model(&self) -> &str {
        &self.model
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a poisoned lock is usable.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn check_format(&self, kv_format: u32, model: &str) -> Result<(), RecvError> {
        // Rule 1: a kv_format other than the store's (0 included), or a non-empty model that
        // differs.
        if kv_format != self.kv_format {
            return Err(RecvError::Unserved(format!(
                "kv_format {kv_format} is not served here (only {})",
                self.kv_format
            )));
        }
        if !model.is_empty() && model != self.model {
            return Err(RecvError::Unserved(format!(
                "model {model:?} is not served here ({:?})",
                self.model
            )));
        }
        Ok(())
    }

    /// Which of the request's blocks this receiver holds: a leading run of blocks whose stored
    /// tokens equal the request's, in its scope. A request without its tokens (an older peer)
    /// finds nothing present. Takes no reference and changes no count.
    ///
    /// # Errors
    /// FAILED_PRECONDITION for a format or model this receiver does not serve; INVALID_ARGUMENT
    /// for more hashes than a prompt can have, or tokens that are not B per hash.
    pub fn has_blocks(&self, req: &HasBlocksRequest) -> Result<Vec<bool>, RecvError> {
        self.check_format(req.kv_format, &req.model)?;
        let hashes = &req.hashes;
        if hashes.len() > self.limits.max_blocks as usize {
            return Err(RecvError::Invalid(format!(
                "{} hashes; a prompt has at most {} blocks",
                hashes.len(),
                self.limits.max_blocks
            )));
        }
        let b = self.block_tokens as usize;
        if !req.tokens.is_empty() && req.tokens.len() != hashes.len() * b {
            return Err(RecvError::Invalid(format!(
                "{} tokens for {} hashes; B = {b} per hash",
                req.tokens.len(),
                hashes.len()
            )));
        }
        self.has_blocks_answered
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.store.contains(req.cache_scope, hashes, &req.tokens))
    }

    /// Starts receiving one push, before any of it is read: refused while draining, or when
    /// `max_pushes` pushes are already in progress.
    ///
    /// # Errors
    /// [`RecvError::Draining`] or [`RecvError::Busy`]; nothing was taken.
    pub fn begin_push(self: &Arc<Self>) -> Result<PushState, RecvError> {
        self.begin_push_from(Vec::new())
    }

    /// [`begin_push`](Self::begin_push) for a push from `owner` (its certificate, or its
    /// address), held to the per-peer bounds too.
    ///
    /// # Errors
    /// As [`begin_push`](Self::begin_push), and [`RecvError::Busy`] at the peer's own bound.
    pub fn begin_push_from(self: &Arc<Self>, owner: Vec<u8>) -> Result<PushState, RecvError> {
        if self.draining.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(RecvError::Draining);
        }
        if self.is_paused() {
            return Err(RecvError::NotDecoding);
        }
        {
            let mut s = self.state();
            if s.active >= self.limits.max_pushes {
                return Err(RecvError::Busy(format!(
                    "{} pushes are already in progress here",
                    s.active
                )));
            }
            let per = self.limits.max_pushes_per_peer;
            if per > 0 && s.peer(&owner).0 >= per {
                s.tidy(&owner);
                return Err(RecvError::Busy(format!(
                    "this peer already has {per} pushes in progress here"
                )));
            }
            s.active += 1;
            s.peer(&owner).0 += 1;
        }
        Ok(PushState {
            rx: Arc::clone(self),
            handle: None,
            total: 0,
            next: 0,
            ids: Vec::new(),
            imported: Vec::new(),
            hashes: Vec::new(),
            tokens: 0,
            prompt: Some(Vec::new()),
            scope: 0,
            owner,
            ack: KvAck::default(),
        })
    }

    /// What `handle` holds, without claiming it.
    #[must_use]
    pub fn peek(&self, handle: &str) -> Option<HandleView> {
        self.state().pending.get(handle).map(|h| HandleView {
            hashes: h.hashes.clone(),
            tokens: h.tokens,
            prompt: h.prompt.clone(),
            scope: h.scope,
        })
    }

    /// Takes the blocks held under `handle` (their references move to the caller).
    #[must_use]
    pub fn claim(&self, handle: &str) -> Option<Claimed> {
        let held = {
            let mut s = self.state();
            let held = s.pending.remove(handle)?;
            s.handle_gone(&held.owner);
            held
        };
        self.notify();
        Some(Claimed {
            store: Arc::clone(&self.store),
            ids: held.ids,
            hashes: held.hashes,
            tokens: held.tokens,
            scope: held.scope,
        })
    }

    /// Drops the blocks held under `handle`. `false` for an unknown (or already released or
    /// claimed) handle, which is not an error.
    pub fn release(&self, handle: &str) -> bool {
        let held = {
            let mut s = self.state();
            let held = s.pending.remove(handle);
            if let Some(h) = &held {
                s.handle_gone(&h.owner);
            }
            held
        };
        match held {
            Some(h) => {
                self.store.release(&h.ids);
                self.notify();
                true
            }
            None => false,
        }
    }

    /// Handles held now.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.state().pending.len()
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> ReceiverStats {
        let s = self.state();
        ReceiverStats {
            pending: s.pending.len(),
            inflight: s.active,
            leases_expired: s.leases_expired,
            has_blocks_answered: self
                .has_blocks_answered
                .load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Releases every handle whose lease ended before `now`; returns how many.
    pub fn expire_leases(&self, now: Instant) -> usize {
        let expired: Vec<HeldHandle> = {
            let mut s = self.state();
            let gone: Vec<String> = s
                .pending
                .iter()
                .filter(|(_, h)| h.deadline <= now)
                .map(|(k, _)| k.clone())
                .collect();
            let held: Vec<HeldHandle> = gone.iter().filter_map(|k| s.pending.remove(k)).collect();
            for h in &held {
                s.handle_gone(&h.owner);
            }
            s.leases_expired += held.len() as u64;
            held
        };
        for h in &expired {
            self.store.release(&h.ids);
        }
        if !expired.is_empty() {
            self.notify();
        }
        expired.len()
    }
}

/// The blocks of a claimed handle: one reference on each, released on drop unless taken.
#[derive(Debug)]
pub struct Claimed {
    store: Arc<dyn KvStore>,
    ids: Vec<BlockId>,
    hashes: Vec<u64>,
    tokens: u64,
    scope: u64,
}

impl Claimed {
    /// The tenant scope the push was made in: the resumed sequence's blocks join it.
    #[must_use]
    pub fn scope(&self) -> u64 {
        self.scope
    }

    /// The blocks, in chunk order.
    #[must_use]
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    /// The chunk hashes, in order (0 for the tail).
    #[must_use]
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    /// Tokens the blocks hold (the sum of their fills).
    #[must_use]
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Takes the references; the caller must release them.
    #[must_use]
    pub fn into_ids(mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.ids)
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.store.release(&self.ids);
        }
    }
}

/// One push in progress. Dropping it unfinished undoes everything it did.
#[derive(Debug)]
pub struct PushState {
    rx: Arc<KvReceiver>,
    handle: Option<String>,
    total: u32,
    next: u32,
    ids: Vec<BlockId>,
    /// Per id: imported by this push (undo frees and unregisters) or a reference it took.
    imported: Vec<bool>,
    hashes: Vec<u64>,
    tokens: u64,
    /// The chunks' tokens so far; `None` once a chunk came without them.
    prompt: Option<Vec<u32>>,
    scope: u64,
    owner: Vec<u8>,
    ack: KvAck,
}

/// The chunk's identity: its tokens must be what its hash says, chained from `parent_hash`
/// (the hash is only an index, but a sender that names a block by one set of tokens and hashes
/// another is broken).
fn check_identity(rx: &KvReceiver, chunk: &KvChunk, parent_hash: u64) -> Result<(), RecvError> {
    let index = chunk.index;
    let b = rx.block_tokens as usize;
    if chunk.tokens.len() > b {
        return Err(RecvError::Invalid(format!(
            "chunk {index}: {} tokens in one block of {b}",
            chunk.tokens.len()
        )));
    }
    if chunk.hash != 0
        && chunk.tokens.len() == b
        && block_hash(parent_hash, &chunk.tokens) != chunk.hash
    {
        return Err(RecvError::Invalid(format!(
            "chunk {index}: hash {:#018x} is not the hash of its tokens",
            chunk.hash
        )));
    }
    Ok(())
}

impl PushState {
    /// Applies the receiver rules to one chunk, in the contract's order, and imports or
    /// references its block.
    ///
    /// # Errors
    /// The first rule the chunk breaks. The push is then over: drop this state.
    pub fn accept(&mut self, chunk: KvChunk) -> Result<(), RecvError> {
        let rx = Arc::clone(&self.rx);
        // Rule 1: format and model.
        rx.check_format(chunk.kv_format, &chunk.model)?;
        self.check_place(&rx, &chunk)?;
        check_identity(&rx, &chunk, self.hashes.last().copied().unwrap_or(0))?;
        let key = BlockKey {
            scope: self.scope,
            hash: chunk.hash,
            tokens: &chunk.tokens,
            parent: self.ids.last().copied(),
        };
        if chunk.payload.is_empty() {
            self.reference(&rx, &chunk, key)?;
        } else {
            self.import(&rx, &chunk, key)?;
        }
        if chunk.tokens.is_empty() {
            self.prompt = None;
        } else if let Some(p) = &mut self.prompt {
            p.extend_from_slice(&chunk.tokens);
        }
        self.hashes.push(chunk.hash);
        self.next += 1;
        Ok(())
    }

    /// Rule 2: the chunk's handle (the first one opens the push, within the receiver's
    /// bounds), its order, its total and its scope.
    fn check_place(&mut self, rx: &KvReceiver, chunk: &KvChunk) -> Result<(), RecvError> {
        match &self.handle {
            None => {
                if chunk.handle_id.is_empty() {
                    return Err(RecvError::Invalid("empty handle_id".into()));
                }
                let mut s = rx.state();
                if s.pending.contains_key(&chunk.handle_id) || s.inflight.contains(&chunk.handle_id)
                {
                    return Err(RecvError::Invalid(format!(
                        "handle {} is already pending here",
                        chunk.handle_id
                    )));
                }
                if chunk.total == 0 {
                    return Err(RecvError::Invalid("total is 0".into()));
                }
                if chunk.total > rx.limits.max_blocks {
                    return Err(RecvError::Invalid(format!(
                        "total {}; a prompt has at most {} blocks",
                        chunk.total, rx.limits.max_blocks
                    )));
                }
                if s.pending.len() >= rx.limits.max_pending_handles {
                    return Err(RecvError::Busy(format!(
                        "{} handles are already waiting for a claim here",
                        s.pending.len()
                    )));
                }
                let per = rx.limits.max_pending_per_peer;
                if per > 0 && s.peer(&self.owner).1 >= per {
                    return Err(RecvError::Busy(format!(
                        "this peer already holds {per} handles waiting for a claim here"
                    )));
                }
                s.inflight.insert(chunk.handle_id.clone());
                drop(s);
                self.total = chunk.total;
                self.scope = chunk.cache_scope;
                self.ack.handle_id.clone_from(&chunk.handle_id);
                self.handle = Some(chunk.handle_id.clone());
            }
            Some(h) if *h != chunk.handle_id => {
                return Err(RecvError::Invalid(format!(
                    "handle_id changed from {h} to {}",
                    chunk.handle_id
                )));
            }
            Some(_) => {}
        }
        if chunk.total != self.total {
            return Err(RecvError::Invalid(format!(
                "total changed from {} to {}",
                self.total, chunk.total
            )));
        }
        if chunk.index != self.next || chunk.index >= self.total {
            return Err(RecvError::Invalid(format!(
                "chunk index {} but {} expected of {}",
                chunk.index, self.next, self.total
            )));
        }
        let index = chunk.index;
        if chunk.cache_scope != self.scope {
            return Err(RecvError::Invalid(format!(
                "chunk {index}: cache_scope changed within the push"
            )));
        }
        Ok(())
    }

    /// Rule 4: an empty payload names a block the receiver said it holds.
    fn reference(
        &mut self,
        rx: &KvReceiver,
        chunk: &KvChunk,
        key: BlockKey<'_>,
    ) -> Result<(), RecvError> {
        let index = chunk.index;
        if chunk.hash == 0 {
            return Err(RecvError::Invalid(format!(
                "chunk {index}: empty payload with hash 0"
            )));
        }
        // Deduplicated only onto the block with these very tokens after the same chain, in
        // this scope: a colliding hash, another tenant's block, or no tokens at all are
        // "not held", and the sender resends every payload.
        let id = rx.store.take_ref(key).ok_or(RecvError::Gone {
            index,
            hash: chunk.hash,
        })?;
        self.ids.push(id);
        self.imported.push(false);
        self.tokens += u64::from(rx.block_tokens);
        self.ack.blocks_deduped += 1;
        Ok(())
    }

    /// Rules 3 and 5: the payload in full, then its import.
    fn import(
        &mut self,
        rx: &KvReceiver,
        chunk: &KvChunk,
        key: BlockKey<'_>,
    ) -> Result<(), RecvError> {
        let index = chunk.index;
        // Rule 3: the payload in full, always. One CRC pass: it must equal the chunk's CRC,
        // and (being over a whole envelope) the residue, which proves the trailer.
        let actual = crc32c(&chunk.payload);
        if actual != chunk.payload_crc32c {
            return Err(RecvError::Checksum {
                index,
                stated: chunk.payload_crc32c,
                actual,
            });
        }
        let env = rx
            .reader
            .read_with_crc(&chunk.payload, actual)
            .map_err(|error| RecvError::Envelope { index, error })?;
        if env.n_blocks() != 1 {
            return Err(RecvError::Invalid(format!(
                "chunk {index}: {} blocks in the envelope, not 1",
                env.n_blocks()
            )));
        }
        let Some(rec) = env.records().next() else {
            return Err(RecvError::Invalid(format!("chunk {index}: no record")));
        };
        if rec.hash != 0 && rec.hash != chunk.hash {
            return Err(RecvError::Invalid(format!(
                "chunk {index}: envelope hash {:#018x} differs from chunk hash {:#018x}",
                rec.hash, chunk.hash
            )));
        }
        if chunk.hash != 0 && rec.n_tokens < rx.block_tokens {
            return Err(RecvError::Invalid(format!(
                "chunk {index}: hash on a partial block (fill {})",
                rec.n_tokens
            )));
        }
        if !chunk.tokens.is_empty() && chunk.tokens.len() != rec.n_tokens as usize {
            return Err(RecvError::Invalid(format!(
                "chunk {index}: {} tokens for a block of fill {}",
                chunk.tokens.len(),
                rec.n_tokens
            )));
        }
        // Rule 5: import. A full block sent with envelope hash 0 is registered under the
        // chunk's hash.
        let name = if rec.hash != 0 { rec.hash } else { chunk.hash };
        let id = rx
            .store
            .import(BlockKey { hash: name, ..key }, rec.n_tokens, rec.payload)
            .map_err(|error| match error {
                StoreError::Exhausted => RecvError::Exhausted { index },
                error => RecvError::Store { index, error },
            })?;
        self.ids.push(id);
        self.imported.push(true);
        self.tokens += u64::from(rec.n_tokens);
        self.ack.blocks_received += 1;
        self.ack.payload_bytes += chunk.payload.len() as u64;
        Ok(())
    }

    /// Ends the push: the blocks are now held under the handle, leased.
    ///
    /// # Errors
    /// INVALID_ARGUMENT when fewer than `total` chunks arrived (or none); the push is undone.
    pub fn finish(mut self) -> Result<KvAck, RecvError> {
        let Some(handle) = self.handle.clone() else {
            return Err(RecvError::Invalid("the push carried no chunk".into()));
        };
        if self.next < self.total {
            return Err(RecvError::Invalid(format!(
                "stream ended after {} of {} chunks",
                self.next, self.total
            )));
        }
        let held = HeldHandle {
            ids: std::mem::take(&mut self.ids),
            hashes: std::mem::take(&mut self.hashes),
            tokens: self.tokens,
            prompt: self.prompt.take(),
            scope: self.scope,
            owner: self.owner.clone(),
            deadline: Instant::now() + self.rx.lease,
        };
        self.imported.clear();
        let mut s = self.rx.state();
        s.inflight.remove(&handle);
        s.peer(&self.owner).1 += 1;
        s.pending.insert(handle, held);
        drop(s);
        self.handle = None;
        Ok(std::mem::take(&mut self.ack))
    }
}

impl Drop for PushState {
    fn drop(&mut self) {
        let (mut fresh, mut referenced) = (Vec::new(), Vec::new());
        for (&id, &imported) in self.ids.iter().zip(&self.imported) {
            if imported {
                fresh.push(id)
            } else {
                referenced.push(id)
            }
        }
        if !fresh.is_empty() {
            self.rx.store.release_forget(&fresh);
        }
        if !referenced.is_empty() {
            self.rx.store.release(&referenced);
        }
        {
            let mut s = self.rx.state();
            if let Some(h) = self.handle.take() {
                s.inflight.remove(&h);
            }
            s.active -= 1;
            let p = s.peer(&self.owner);
            p.0 = p.0.saturating_sub(1);
            s.tidy(&self.owner);
        }
        self.rx.notify();
    }
}
