//! The transfer without an engine and without a socket, quinn-`Pair` style:
//!
//! - [`MemStore`]: a small in-memory [`KvStore`]. It keeps the pool's contract: reference counts,
//!   a prefix index, registered blocks cached at zero references (evicted oldest first when an
//!   import needs room), unregistered ones freed.
//! - [`LocalTransport`]: a [`KvTransport`] that hands each chunk straight to a [`KvReceiver`],
//!   so [`transfer`](crate::transfer) and the receiver's per-chunk rules run in one process,
//!   deterministically.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use bytes::BufMut;
use kvwire::{RecordIn, Shape};

use std::sync::Arc;

use tokio_stream::StreamExt;
use tonic::Status;

use crate::pb::kv::{HasBlocksRequest, KvAck};
use crate::receiver::KvReceiver;
use crate::sender::{ChunkStream, KvTransport};
use crate::store::{BlockId, BlockKey, KvStore, StoreError};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Slot {
    payload: Vec<u8>,
    /// The block's one-record envelope once a push has lent it ([`KvStore::lend_envelope`]);
    /// gone with the slot's content.
    envelope: Option<bytes::Bytes>,
    fill: u32,
    /// 0 when unregistered.
    hash: u64,
    refs: u32,
    /// The identity: the block's tokens, its scope, and its parent with that parent's
    /// generation when this block was named.
    tokens: Vec<u32>,
    scope: u64,
    parent: Option<(BlockId, u32)>,
    /// Bumped each time the slot is freed or evicted, so a child naming it as parent no longer
    /// matches once it holds something else.
    generation: u32,
}

#[derive(Debug)]
struct Inner {
    slots: Vec<Slot>,
    index: HashMap<(u64, u64), BlockId>,
    free: Vec<BlockId>,
    /// Registered blocks with no reference, oldest first.
    cached: VecDeque<BlockId>,
}

/// Counts of a [`MemStore`]'s blocks, and its prefix index: what a test compares before and
/// after an operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemSnapshot {
    /// Blocks with a reference.
    pub used: usize,
    /// Registered blocks without one.
    pub cached: usize,
    /// Free blocks.
    pub free: usize,
    /// The prefix index, sorted.
    pub index: Vec<(u64, BlockId)>,
}

/// An in-memory KV store of `n` blocks of one shape.
#[derive(Debug)]
pub struct MemStore {
    shape: Shape,
    payload: usize,
    inner: Mutex<Inner>,
}

impl MemStore {
    /// A store of `n` zeroed blocks.
    ///
    /// # Panics
    /// If the shape's payload size overflows.
    #[must_use]
    pub fn new(shape: Shape, n: usize) -> Self {
        let payload = shape.payload_bytes().expect("block size overflows");
        Self {
            shape,
            payload,
            inner: Mutex::new(Inner {
                slots: vec![Slot::default(); n],
                index: HashMap::new(),
                free: (0..n as BlockId).rev().collect(),
                cached: VecDeque::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts and index.
    #[must_use]
    pub fn snapshot(&self) -> MemSnapshot {
        let s = self.lock();
        let mut index: Vec<(u64, BlockId)> = s.index.iter().map(|(&(_, h), &id)| (h, id)).collect();
        index.sort_unstable();
        MemSnapshot {
            used: s.slots.iter().filter(|b| b.refs > 0).count(),
            cached: s.cached.len(),
            free: s.free.len(),
            index,
        }
    }

    /// The hash block `id` is registered under (0 when unregistered or unknown).
    #[must_use]
    pub fn hash_of(&self, id: BlockId) -> u64 {
        self.lock().slots.get(id as usize).map_or(0, |b| b.hash)
    }

    /// A block's payload and fill (test inspection).
    #[must_use]
    pub fn block(&self, id: BlockId) -> Option<(Vec<u8>, u32)> {
        let s = self.lock();
        s.slots
            .get(id as usize)
            .map(|b| (b.payload.clone(), b.fill))
    }

    /// Puts a block holding `payload` with `fill` tokens, named by `key` as
    /// [`KvStore::import`] names it, and returns it with one reference: the sending side of a
    /// test.
    ///
    /// # Errors
    /// As [`KvStore::import`].
    pub fn put(&self, key: BlockKey<'_>, fill: u32, payload: &[u8]) -> Result<BlockId, StoreError> {
        self.import(key, fill, payload)
    }

    fn drop_ref(&self, ids: &[BlockId], forget: bool) {
        let mut s = self.lock();
        for &id in ids {
            let Some(b) = s.slots.get_mut(id as usize) else {
                continue;
            };
            debug_assert!(b.refs > 0, "release of unreferenced block {id}");
            b.refs = b.refs.saturating_sub(1);
            if b.refs > 0 {
                continue;
            }
            let (hash, scope) = (b.hash, b.scope);
            if hash != 0 && !forget {
                s.cached.push_back(id);
            } else {
                if hash != 0 {
                    s.index.remove(&(scope, hash));
                }
                s.reset(id);
                s.free.push(id);
            }
        }
    }
}

impl Inner {
    fn reset(&mut self, id: BlockId) {
        let generation = self.slots[id as usize].generation.wrapping_add(1);
        self.slots[id as usize] = Slot {
            generation,
            ..Slot::default()
        };
    }

    /// The block `key` names: same scope and hash, the same tokens, and the given parent as it
    /// was when the block was named.
    fn find(&self, key: BlockKey<'_>) -> Option<BlockId> {
        if key.hash == 0 {
            return None;
        }
        let id = *self.index.get(&(key.scope, key.hash))?;
        let b = &self.slots[id as usize];
        let parent = key
            .parent
            .map(|p| (p, self.slots.get(p as usize).map_or(0, |s| s.generation)));
        (b.tokens == key.tokens && b.parent == parent).then_some(id)
    }
}

impl KvStore for MemStore {
    fn shape(&self) -> Shape {
        self.shape
    }

    fn contains(&self, scope: u64, hashes: &[u64], tokens: &[u32]) -> Vec<bool> {
        let s = self.lock();
        let b = self.shape.block_tokens() as usize;
        let mut out = vec![false; hashes.len()];
        let mut parent = None;
        for (i, (&hash, tokens)) in hashes.iter().zip(tokens.chunks_exact(b)).enumerate() {
            let key = BlockKey {
                scope,
                hash,
                tokens,
                parent,
            };
            let Some(id) = s.find(key) else { break };
            out[i] = true;
            parent = Some(id);
        }
        out
    }

    fn take_ref(&self, key: BlockKey<'_>) -> Option<BlockId> {
        let mut s = self.lock();
        let id = s.find(key)?;
        if s.slots[id as usize].refs == 0 {
            s.cached.retain(|&c| c != id);
        }
        s.slots[id as usize].refs += 1;
        Some(id)
    }

    fn import(&self, key: BlockKey<'_>, fill: u32, payload: &[u8]) -> Result<BlockId, StoreError> {
        if payload.len() != self.payload || fill == 0 || fill > self.shape.block_tokens() {
            return Err(StoreError::pool(std::io::Error::other(format!(
                "a block is {} bytes with fill in 1..={}",
                self.payload,
                self.shape.block_tokens()
            ))));
        }
        let mut s = self.lock();
        let id = match s.free.pop() {
            Some(id) => id,
            None => {
                let id = s.cached.pop_front().ok_or(StoreError::Exhausted)?;
                let old = &s.slots[id as usize];
                let old = (old.scope, old.hash);
                s.index.remove(&old);
                s.reset(id);
                id
            }
        };
        let parent = match key.parent {
            None => Some(None),
            Some(p) => s
                .slots
                .get(p as usize)
                .filter(|ps| ps.hash != 0)
                .map(|ps| Some((p, ps.generation))),
        };
        let known = key.tokens.len() == fill as usize;
        let named = key.hash != 0
            && known
            && fill == self.shape.block_tokens()
            && parent.is_some()
            && !s.index.contains_key(&(key.scope, key.hash));
        if named {
            s.index.insert((key.scope, key.hash), id);
        }
        let slot = &mut s.slots[id as usize];
        *slot = Slot {
            payload: payload.to_vec(),
            envelope: None,
            fill,
            hash: if named { key.hash } else { 0 },
            refs: 1,
            tokens: if known {
                key.tokens.to_vec()
            } else {
                Vec::new()
            },
            scope: key.scope,
            parent: parent.flatten(),
            generation: slot.generation,
        };
        Ok(id)
    }

    fn release(&self, ids: &[BlockId]) {
        self.drop_ref(ids, false);
    }

    fn release_forget(&self, ids: &[BlockId]) {
        self.drop_ref(ids, true);
    }

    fn write_envelope(&self, id: BlockId, mut out: &mut dyn BufMut) -> Result<u64, StoreError> {
        let s = self.lock();
        let b = s
            .slots
            .get(id as usize)
            .filter(|b| b.refs > 0)
            .ok_or(StoreError::NotHeld(id))?;
        let rec = RecordIn {
            hash: b.hash,
            fill: b.fill,
            payload: &b.payload,
        };
        kvwire::write_envelope(&self.shape, &[rec], &mut out).map_err(StoreError::pool)?;
        Ok(b.hash)
    }

    fn lend_envelope(&self, id: BlockId) -> Result<Option<bytes::Bytes>, StoreError> {
        let mut s = self.lock();
        let b = s
            .slots
            .get_mut(id as usize)
            .filter(|b| b.refs > 0)
            .ok_or(StoreError::NotHeld(id))?;
        if b.fill != self.shape.block_tokens() {
            return Ok(None);
        }
        if let Some(env) = &b.envelope {
            return Ok(Some(env.clone()));
        }
        // Written once per block content, then lent as often as it is sent.
        let mut env = Vec::new();
        let rec = RecordIn {
            hash: b.hash,
            fill: b.fill,
            payload: &b.payload,
        };
        kvwire::write_to_vec(&self.shape, &[rec], &mut env).map_err(StoreError::pool)?;
        let env = bytes::Bytes::from(env);
        b.envelope = Some(env.clone());
        Ok(Some(env))
    }
}

/// A [`KvTransport`] to one in-process [`KvReceiver`] (the target address is ignored).
#[derive(Clone, Debug)]
pub struct LocalTransport {
    rx: Arc<KvReceiver>,
}

impl LocalTransport {
    /// A transport whose every call lands on `rx`.
    #[must_use]
    pub fn new(rx: Arc<KvReceiver>) -> Self {
        Self { rx }
    }
}

impl KvTransport for LocalTransport {
    async fn has_blocks(&self, _target: &str, req: HasBlocksRequest) -> Result<Vec<bool>, Status> {
        Ok(self.rx.has_blocks(&req)?)
    }

    async fn push(&self, _target: &str, mut chunks: ChunkStream) -> Result<KvAck, Status> {
        // As the gRPC service does: dropping `push` on an early return undoes it.
        let mut push = self.rx.begin_push()?;
        while let Some(out) = chunks.next().await {
            let chunk = out
                .materialize()
                .map_err(|e| Status::internal(e.to_string()))?;
            push.accept(chunk)?;
        }
        Ok(push.finish()?)
    }

    async fn release(&self, _target: &str, handle_id: &str) -> Result<bool, Status> {
        Ok(self.rx.release(handle_id))
    }
}
