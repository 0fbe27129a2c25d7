//! The paged KV block pool: fixed-size blocks laid out exactly like the wire payload, reference
//! counts, a prefix index from chained hash to block, and an LRU of cached blocks.
//!
//! The life of a block:
//!
//! 1. **free**: on the free list, refcount 0, no hash.
//! 2. **used**: [`KvPool::allocate`] or [`KvPool::import`] hands it out with refcount 1; the
//!    model writes its slab; [`KvPool::register`] names it by its chained hash once it is full, so
//!    later prompts with the same prefix find it ([`KvPool::lookup_ref`]).
//! 3. **cached**: when the last reference goes ([`KvPool::release`]), a registered block keeps
//!    its contents and its index entry and joins the LRU; an unregistered one goes back to free.
//! 4. A cached block is either revived by a lookup that takes a reference, or evicted (its index
//!    entry removed) when an allocation finds no free block.
//!
//! `used + cached + free == total` always holds; [`KvPool::check`] verifies that and the index.
//!
//! A block's identity is not its hash. The chained v1 hash (contract section 2) is the index
//! key, with the tenant scope beside it; a block answers for a [`BlockKey`] only when its stored
//! tokens equal the key's exactly and its parent is the block found for the position before, as
//! that parent was when the child was named (a generation per block tells). So a prefix match
//! compares every token of the prefix, and a hash collision, found or crafted, can make a lookup
//! miss but never return another prompt's KV. A block is registered only when its parent is, so
//! every chain in the index starts at a first block of its scope.
//!
//! The bookkeeping (reference counts, fills, the index, the free list, the LRU) and the block
//! data are locked apart. [`SharedKv`] guards the bookkeeping with one mutex held for
//! microseconds; each block's bytes sit behind a lock of their own ([`BlockRef`], [`BlockMut`]),
//! so a model's pass over a sequence, an import's copy or a sender's CRC never holds the pool.
//! Lock order: a block lock may be taken while the pool is locked, never the pool while a block
//! is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kvwire::{Shape, SplitEnvelope};

pub use kvwire::{BlockId, BlockKey};

const NIL: u32 = u32::MAX;

/// Pool errors. Each leaves the pool exactly as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Not enough free or evictable blocks.
    #[error("KV pool exhausted: {requested} blocks requested, {available} free or evictable")]
    Exhausted {
        /// Blocks asked for.
        requested: usize,
        /// Free plus cached blocks.
        available: usize,
    },
    /// The id is not a block of this pool.
    #[error("block {0} is not in the pool")]
    NoSuchBlock(BlockId),
    /// The block holds no reference to release or to take another on.
    #[error("block {0} is not referenced")]
    NotReferenced(BlockId),
    /// The payload is not one block's size, or the fill is not in 1..=B.
    #[error(
        "import of {len} bytes with fill {fill}: a block is {payload} bytes and fill is in 1..=B"
    )]
    BadImport {
        /// Given payload length.
        len: usize,
        /// Given fill.
        fill: u32,
        /// P.
        payload: usize,
    },
}

#[derive(Clone, Copy, Debug)]
struct Meta {
    refs: u32,
    fill: u32,
    /// 0 when unregistered.
    hash: u64,
    prev: u32,
    next: u32,
    /// The tenant scope the block was named in.
    scope: u64,
    /// The parent block when named (NIL for a first block) and that parent's generation then.
    parent: u32,
    parent_gen: u32,
    /// Bumped whenever the block is freed or evicted.
    generation: u32,
    /// How many of the block's tokens are stored (its fill once known, else 0).
    known: u32,
}

impl Meta {
    const FREE: Meta = Meta {
        refs: 0,
        fill: 0,
        hash: 0,
        prev: NIL,
        next: NIL,
        scope: 0,
        parent: NIL,
        parent_gen: 0,
        generation: 0,
        known: 0,
    };
}

/// Counts of the pool's blocks by state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PoolCounts {
    /// All blocks.
    pub total: usize,
    /// On the free list.
    pub free: usize,
    /// Refcount > 0.
    pub used: usize,
    /// Refcount 0 but registered (evictable, revivable).
    pub cached: usize,
    /// Entries in the prefix index.
    pub indexed: usize,
}

/// Room kept before each block's payload in its slab: the head (header and record head) of
/// the block's one-record envelope.
const HEAD_ROOM: usize = kvwire::SPLIT_HEAD_LEN;
/// Room kept after it: the envelope's CRC-32C.
const TAIL_ROOM: usize = kvwire::TRAILER_LEN;

/// One block's slab: its payload with room around it for the one-block envelope's head and
/// CRC, so a sender can lend the whole envelope as one piece ([`SealedEnvelope`]).
#[derive(Clone, Debug)]
struct Slab {
    bytes: Box<[u8]>,
    /// The head and CRC in the room match the payload as it is: set by [`SharedKv::seal`],
    /// cleared by any write of the payload.
    sealed: bool,
    /// Bumped by every write of the payload: a seal that read the payload under the read lock
    /// knows, under the write lock, whether what it read is still there.
    version: u64,
}

impl Slab {
    fn payload(&self) -> &[u8] {
        &self.bytes[HEAD_ROOM..self.bytes.len() - TAIL_ROOM]
    }

    fn payload_mut(&mut self) -> &mut [u8] {
        self.sealed = false;
        self.version = self.version.wrapping_add(1);
        let end = self.bytes.len() - TAIL_ROOM;
        &mut self.bytes[HEAD_ROOM..end]
    }
}

/// A slab, shared so a sender can lend it to the socket after the block's lock is dropped; a
/// writer that finds it lent writes to a copy of its own (copy on write), so what was lent
/// never changes under the send.
type Lendable = Arc<Slab>;

/// The blocks' bytes, each block behind its own lock.
#[derive(Debug)]
struct Slabs(Box<[RwLock<Lendable>]>);

impl Slabs {
    fn lock(&self, id: BlockId) -> Result<&RwLock<Lendable>, PoolError> {
        self.0.get(id as usize).ok_or(PoolError::NoSuchBlock(id))
    }

    fn read(&self, id: BlockId) -> Result<BlockRef<'_>, PoolError> {
        Ok(BlockRef(
            self.lock(id)?
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        ))
    }

    fn write(&self, id: BlockId) -> Result<BlockMut<'_>, PoolError> {
        Ok(BlockMut(
            self.lock(id)?
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        ))
    }

    fn snapshot(&self, id: BlockId) -> Result<BlockSnapshot, PoolError> {
        let slab = self
            .lock(id)?
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(BlockSnapshot(Arc::clone(&slab)))
    }

    fn seal(&self, id: BlockId, head: &[u8; HEAD_ROOM]) -> Result<SealedEnvelope, PoolError> {
        let lock = self.lock(id)?;
        let sealed_with = |slab: &Slab| slab.sealed && slab.bytes[..HEAD_ROOM] == head[..];
        // The CRC is computed under the read lock (readers of the block, the model among them,
        // are not held up); the write lock is taken only to put 44 bytes in place.
        let (version, computed) = {
            let slab = lock
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if sealed_with(&slab) {
                return Ok(SealedEnvelope(Arc::clone(&slab)));
            }
            (slab.version, SplitEnvelope::of(*head, slab.payload()))
        };
        let mut guard = lock
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !sealed_with(&guard) {
            // Written since it was read (rare): the CRC again, of what is there now.
            let envelope = if guard.version == version {
                computed
            } else {
                SplitEnvelope::of(*head, guard.payload())
            };
            let slab = Arc::make_mut(&mut *guard);
            envelope.place(&mut slab.bytes);
            slab.sealed = true;
        }
        Ok(SealedEnvelope(Arc::clone(&guard)))
    }
}

/// One block's bytes, read-locked (other readers may share it; a writer waits).
#[derive(Debug)]
pub struct BlockRef<'a>(RwLockReadGuard<'a, Lendable>);

impl std::ops::Deref for BlockRef<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.payload()
    }
}

impl PartialEq for BlockRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl PartialEq<&[u8]> for BlockRef<'_> {
    fn eq(&self, other: &&[u8]) -> bool {
        **self == **other
    }
}

/// One block's bytes, write-locked. The first write through it while the block is lent
/// ([`BlockSnapshot`], [`SealedEnvelope`]) copies the bytes (once) and writes the copy: what
/// was lent keeps what it saw.
#[derive(Debug)]
pub struct BlockMut<'a>(RwLockWriteGuard<'a, Lendable>);

impl std::ops::Deref for BlockMut<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.payload()
    }
}

impl std::ops::DerefMut for BlockMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        Arc::make_mut(&mut *self.0).payload_mut()
    }
}

/// A block's payload as it was when taken, held without any lock and never changed. It keeps
/// the bytes alive; a writer of the block meanwhile writes a copy. The caller holds a reference
/// on the block while it takes one, as for [`BlockRef`].
#[derive(Clone, Debug)]
pub struct BlockSnapshot(Lendable);

impl AsRef<[u8]> for BlockSnapshot {
    fn as_ref(&self) -> &[u8] {
        self.0.payload()
    }
}

impl std::ops::Deref for BlockSnapshot {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.payload()
    }
}

/// A full block's one-record envelope (head, payload, CRC-32C) in the block's own memory, as
/// [`SharedKv::seal`] left it: what a sender hands the socket by reference
/// (`bytes::Bytes::from_owner`) instead of copying the block into a message. Like a
/// [`BlockSnapshot`] it never changes while held.
#[derive(Clone, Debug)]
pub struct SealedEnvelope(Lendable);

impl AsRef<[u8]> for SealedEnvelope {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes
    }
}

impl SealedEnvelope {
    /// The payload within the envelope.
    #[must_use]
    pub fn payload(&self) -> &[u8] {
        self.0.payload()
    }
}

/// Told of every change to a pool's prefix index, under the pool's lock: `(scope, hash, stored)`,
/// `stored` false for an entry removed (evicted, or forgotten with its block). It must not
/// block: an engine forwards the change to its WatchBlocks subscribers.
pub type IndexObserver = Box<dyn FnMut(u64, u64, bool) + Send>;

struct Observer(Option<IndexObserver>);

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Observer(set)"
        } else {
            "Observer(none)"
        })
    }
}

impl Observer {
    fn tell(&mut self, scope: u64, hash: u64, stored: bool) {
        if let Some(f) = &mut self.0 {
            f(scope, hash, stored);
        }
    }
}

/// A fixed pool of KV blocks of one [`Shape`].
#[derive(Debug)]
pub struct KvPool {
    shape: Shape,
    payload: usize,
    data: Arc<Slabs>,
    meta: Vec<Meta>,
    /// B tokens per block: what each block holds, for exact comparison.
    tokens: Vec<u32>,
    index: HashMap<(u64, u64), BlockId>,
    free: Vec<BlockId>,
    /// LRU of cached blocks: `lru_head` is the least recently used.
    lru_head: u32,
    lru_tail: u32,
    used: usize,
    cached: usize,
    evictions: u64,
    observer: Observer,
}

impl KvPool {
    /// A pool of `n_blocks` zeroed blocks.
    ///
    /// # Panics
    /// If the shape is invalid, its payload overflows, or `n_blocks` does not fit in a `u32`.
    #[must_use]
    pub fn new(shape: Shape, n_blocks: usize) -> Self {
        assert!(shape.is_valid(), "every dimension must be >= 1");
        assert!(n_blocks < NIL as usize, "too many blocks");
        let payload = shape.payload_bytes().expect("block size overflows");
        payload.checked_mul(n_blocks).expect("pool size overflows");
        let data = (0..n_blocks)
            .map(|_| {
                RwLock::new(Arc::new(Slab {
                    bytes: vec![0; HEAD_ROOM + payload + TAIL_ROOM].into_boxed_slice(),
                    sealed: false,
                    version: 0,
                }))
            })
            .collect();
        Self {
            shape,
            payload,
            data: Arc::new(Slabs(data)),
            meta: vec![Meta::FREE; n_blocks],
            tokens: vec![0; n_blocks * shape.block_tokens() as usize],
            index: HashMap::with_capacity(n_blocks),
            // Popped from the end: lower ids are handed out first.
            free: (0..n_blocks as u32).rev().collect(),
            lru_head: NIL,
            lru_tail: NIL,
            used: 0,
            cached: 0,
            evictions: 0,
            observer: Observer(None),
        }
    }

    /// Touches every page of the slabs so the kernel maps them now rather than on the first
    /// import or prefill that lands there (a 2 MiB block is 512 page faults). Engines call this
    /// at start, as serving engines reserve their KV memory up front.
    pub fn prefault(&mut self) {
        for block in &self.data.0 {
            let mut b = block
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for page in Arc::make_mut(&mut b).bytes.chunks_mut(4096) {
                page[0] = std::hint::black_box(0);
            }
        }
    }

    /// The block shape.
    #[must_use]
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// P, bytes per block.
    #[must_use]
    pub fn payload_bytes(&self) -> usize {
        self.payload
    }

    /// Counts by state.
    #[must_use]
    pub fn counts(&self) -> PoolCounts {
        PoolCounts {
            total: self.meta.len(),
            free: self.free.len(),
            used: self.used,
            cached: self.cached,
            indexed: self.index.len(),
        }
    }

    /// The prefix index as sorted `(hash, block)` pairs, for comparing states in tests.
    #[must_use]
    pub fn index_snapshot(&self) -> Vec<(u64, BlockId)> {
        let mut v: Vec<(u64, BlockId)> = self.index.iter().map(|(&(_, h), &id)| (h, id)).collect();
        v.sort_unstable();
        v
    }

    /// Calls `f` for every later change to the prefix index (replacing any earlier observer).
    pub fn set_observer(&mut self, f: IndexObserver) {
        self.observer = Observer(Some(f));
    }

    /// Every `(scope, hash)` in the prefix index, sorted: what an index observer has been told
    /// so far, for a subscriber's snapshot.
    #[must_use]
    pub fn index_keys(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.index.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Cached blocks evicted so far.
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Blocks an allocation could get now: free plus cached.
    #[must_use]
    pub fn available(&self) -> usize {
        self.free.len() + self.cached
    }

    fn meta(&self, id: BlockId) -> Result<&Meta, PoolError> {
        self.meta.get(id as usize).ok_or(PoolError::NoSuchBlock(id))
    }

    /// Takes `n` blocks with refcount 1, fill 0 and no hash: free blocks first, then the least
    /// recently used cached blocks (which lose their index entries). All or nothing.
    ///
    /// # Errors
    /// [`PoolError::Exhausted`] when fewer than `n` blocks are free or cached; nothing changes.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        if n > self.available() {
            return Err(PoolError::Exhausted {
                requested: n,
                available: self.available(),
            });
        }
        Ok((0..n).map(|_| self.take_one()).collect())
    }

    /// One block; the caller checked that one is available.
    fn take_one(&mut self) -> BlockId {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.lru_head;
                debug_assert!(id != NIL, "take_one without an available block");
                self.lru_unlink(id);
                self.cached -= 1;
                let m = self.meta[id as usize];
                self.index.remove(&(m.scope, m.hash));
                self.observer.tell(m.scope, m.hash, false);
                self.evictions += 1;
                id
            }
        };
        let m = &mut self.meta[id as usize];
        debug_assert_eq!(m.refs, 0);
        *m = Meta {
            refs: 1,
            // A new life: children named after the old contents no longer match.
            generation: m.generation.wrapping_add(1),
            ..Meta::FREE
        };
        self.used += 1;
        id
    }

    /// Takes one more reference on a used or cached block (a cached block becomes used).
    ///
    /// # Errors
    /// When the block does not exist or is free.
    pub fn retain(&mut self, id: BlockId) -> Result<(), PoolError> {
        let m = *self.meta(id)?;
        if m.refs == 0 {
            if m.hash == 0 {
                return Err(PoolError::NotReferenced(id));
            }
            self.lru_unlink(id);
            self.cached -= 1;
            self.used += 1;
        }
        self.meta[id as usize].refs += 1;
        Ok(())
    }

    /// Drops one reference. At zero a registered block becomes cached (most recently used), an
    /// unregistered one free.
    ///
    /// # Errors
    /// When the block does not exist or holds no reference.
    pub fn release(&mut self, id: BlockId) -> Result<(), PoolError> {
        self.drop_ref(id, false)
    }

    /// Drops one reference like [`release`](Self::release), but a block that reaches zero is
    /// unregistered and freed rather than cached: for blocks whose contents must not outlive a
    /// failed operation (a refused push's imports).
    ///
    /// # Errors
    /// As [`release`](Self::release).
    pub fn release_forget(&mut self, id: BlockId) -> Result<(), PoolError> {
        self.drop_ref(id, true)
    }

    fn drop_ref(&mut self, id: BlockId, forget: bool) -> Result<(), PoolError> {
        let m = *self.meta(id)?;
        if m.refs == 0 {
            return Err(PoolError::NotReferenced(id));
        }
        self.meta[id as usize].refs -= 1;
        if m.refs > 1 {
            return Ok(());
        }
        self.used -= 1;
        if m.hash != 0 && !forget {
            self.cached += 1;
            self.lru_push_back(id);
        } else {
            if m.hash != 0 {
                self.index.remove(&(m.scope, m.hash));
                self.observer.tell(m.scope, m.hash, false);
            }
            let meta = &mut self.meta[id as usize];
            *meta = Meta {
                generation: meta.generation.wrapping_add(1),
                ..Meta::FREE
            };
            self.free.push(id);
        }
        Ok(())
    }

    /// Stores a used block's tokens for later comparison (a tail, or a block not yet named).
    /// `false`, and no change, when there are more than B, the block is not referenced, or it is
    /// named (a named block's tokens are final).
    pub fn set_tokens(&mut self, id: BlockId, tokens: &[u32]) -> bool {
        let b = self.shape.block_tokens() as usize;
        let Ok(m) = self.meta(id) else { return false };
        if tokens.len() > b || m.refs == 0 || m.hash != 0 {
            return false;
        }
        let at = id as usize * b;
        self.tokens[at..at + tokens.len()].copy_from_slice(tokens);
        self.meta[id as usize].known = tokens.len() as u32;
        true
    }

    /// The tokens stored for a block (empty when none are known).
    #[must_use]
    pub fn tokens_of(&self, id: BlockId) -> &[u32] {
        let b = self.shape.block_tokens() as usize;
        match self.meta.get(id as usize) {
            Some(m) => &self.tokens[id as usize * b..][..m.known as usize],
            None => &[],
        }
    }

    /// Names a used, full block by `key` in the prefix index, storing its tokens. `false`, and
    /// no change, when the hash is 0, the tokens are not B, the parent is not itself named (a
    /// chain is only found from its first block), another block already holds the key (ours
    /// stays private), this block already has a name, or it is not referenced.
    pub fn register(&mut self, id: BlockId, key: BlockKey<'_>) -> bool {
        let b = self.shape.block_tokens() as usize;
        let Ok(m) = self.meta(id) else { return false };
        if key.hash == 0 || key.tokens.len() != b || m.refs == 0 || m.hash != 0 {
            return false;
        }
        let (parent, parent_gen) = match key.parent {
            None => (NIL, 0),
            Some(p) => match self.meta(p) {
                Ok(pm) if pm.hash != 0 && p != id => (p, pm.generation),
                _ => return false,
            },
        };
        if self.index.contains_key(&(key.scope, key.hash)) {
            return false;
        }
        self.index.insert((key.scope, key.hash), id);
        self.observer.tell(key.scope, key.hash, true);
        let at = id as usize * b;
        self.tokens[at..at + b].copy_from_slice(key.tokens);
        let m = &mut self.meta[id as usize];
        m.hash = key.hash;
        m.scope = key.scope;
        m.parent = parent;
        m.parent_gen = parent_gen;
        m.known = b as u32;
        true
    }

    /// The block `key` names, if any: same scope and hash, the same tokens, and `key.parent` as
    /// it was when the block was named. Takes no reference and changes nothing, not even the
    /// LRU order: asking is free.
    #[must_use]
    pub fn lookup(&self, key: BlockKey<'_>) -> Option<BlockId> {
        if key.hash == 0 {
            return None;
        }
        let id = *self.index.get(&(key.scope, key.hash))?;
        let m = &self.meta[id as usize];
        let parent_ok = match key.parent {
            None => m.parent == NIL,
            Some(p) => {
                m.parent == p
                    && self.meta.get(p as usize).map(|pm| pm.generation) == Some(m.parent_gen)
            }
        };
        (parent_ok && self.tokens_of(id) == key.tokens).then_some(id)
    }

    /// The block `key` names with one reference taken on it.
    pub fn lookup_ref(&mut self, key: BlockKey<'_>) -> Option<BlockId> {
        let id = self.lookup(key)?;
        self.retain(id).ok()?;
        Some(id)
    }

    /// The blocks holding the longest cached prefix of a prompt: `hashes` are its full blocks'
    /// chained hashes, `tokens` the prompt (at least B per hash). Takes no reference.
    #[must_use]
    pub fn lookup_prefix(&self, scope: u64, hashes: &[u64], tokens: &[u32]) -> Vec<BlockId> {
        let b = self.shape.block_tokens() as usize;
        let mut found: Vec<BlockId> = Vec::new();
        for (&hash, tokens) in hashes.iter().zip(tokens.chunks_exact(b)) {
            let key = BlockKey {
                scope,
                hash,
                tokens,
                parent: found.last().copied(),
            };
            match self.lookup(key) {
                Some(id) => found.push(id),
                None => break,
            }
        }
        found
    }

    /// A block's hash (0 when unregistered), fill and refcount.
    ///
    /// # Errors
    /// When the block does not exist.
    pub fn info(&self, id: BlockId) -> Result<(u64, u32, u32), PoolError> {
        self.meta(id).map(|m| (m.hash, m.fill, m.refs))
    }

    /// A block's payload bytes (read-locked) and fill.
    ///
    /// # Errors
    /// When the block does not exist.
    pub fn export(&self, id: BlockId) -> Result<(BlockRef<'_>, u32), PoolError> {
        let fill = self.meta(id)?.fill;
        Ok((self.data.read(id)?, fill))
    }

    /// A used block's payload (write-locked), for the model to write.
    ///
    /// # Errors
    /// When the block does not exist or is not referenced.
    pub fn payload_mut(&mut self, id: BlockId) -> Result<BlockMut<'_>, PoolError> {
        if self.meta(id)?.refs == 0 {
            return Err(PoolError::NotReferenced(id));
        }
        self.data.write(id)
    }

    /// Sets a used block's fill.
    ///
    /// # Errors
    /// When the block does not exist or is not referenced.
    pub fn set_fill(&mut self, id: BlockId, fill: u32) -> Result<(), PoolError> {
        if self.meta(id)?.refs == 0 {
            return Err(PoolError::NotReferenced(id));
        }
        self.meta[id as usize].fill = fill;
        Ok(())
    }

    /// A new block holding `payload` (P bytes) with `fill` tokens, refcount 1. Registered under
    /// `hash` when it is non-zero and no other block holds it. One copy into the slab.
    ///
    /// # Errors
    /// [`PoolError::BadImport`] for a wrong size or fill, [`PoolError::Exhausted`] with no free
    /// or evictable block; the pool is unchanged.
    pub fn import(
        &mut self,
        key: BlockKey<'_>,
        fill: u32,
        payload: &[u8],
    ) -> Result<BlockId, PoolError> {
        self.check_import(fill, payload.len())?;
        let id = self.allocate(1)?[0];
        let copied = self
            .data
            .write(id)
            .map(|mut block| crate::copy::copy_to_pool(&mut block, payload));
        if let Err(e) = copied {
            // Cannot happen for a block just allocated; if it did, give the block back.
            let _ = self.release(id);
            return Err(e);
        }
        self.finish_import(id, key, fill);
        Ok(id)
    }

    fn check_import(&self, fill: u32, len: usize) -> Result<(), PoolError> {
        if len != self.payload || fill == 0 || fill > self.shape.block_tokens() {
            return Err(PoolError::BadImport {
                len,
                fill,
                payload: self.payload,
            });
        }
        Ok(())
    }

    /// An imported block's fill, tokens and name, once its bytes are in: named when the key's
    /// tokens are its fill and [`register`](Self::register) accepts it.
    fn finish_import(&mut self, id: BlockId, key: BlockKey<'_>, fill: u32) {
        self.meta[id as usize].fill = fill;
        if key.tokens.len() == fill as usize && !self.register(id, key) {
            self.set_tokens(id, key.tokens);
        }
    }

    fn lru_unlink(&mut self, id: BlockId) {
        let Meta { prev, next, .. } = self.meta[id as usize];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        let m = &mut self.meta[id as usize];
        m.prev = NIL;
        m.next = NIL;
    }

    fn lru_push_back(&mut self, id: BlockId) {
        let tail = self.lru_tail;
        {
            let m = &mut self.meta[id as usize];
            m.prev = tail;
            m.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else {
            self.meta[tail as usize].next = id;
        }
        self.lru_tail = id;
    }

    /// Verifies every invariant; `Err` says which one broke. Used by tests and debug builds.
    ///
    /// # Errors
    /// The first broken invariant, described.
    pub fn check(&self) -> Result<(), InvariantError> {
        let total = self.meta.len();
        let used = self.meta.iter().filter(|m| m.refs > 0).count();
        let cached = self
            .meta
            .iter()
            .filter(|m| m.refs == 0 && m.hash != 0)
            .count();
        if used != self.used || cached != self.cached {
            return Err(InvariantError(format!(
                "counters used {}/{} cached {}/{}",
                self.used, used, self.cached, cached
            )));
        }
        if used + cached + self.free.len() != total {
            return Err(InvariantError(format!(
                "used {used} + cached {cached} + free {} != total {total}",
                self.free.len()
            )));
        }
        for &id in &self.free {
            let m = &self.meta[id as usize];
            if m.refs != 0 || m.hash != 0 {
                return Err(InvariantError(format!(
                    "free block {id} has refs {} hash {:#x}",
                    m.refs, m.hash
                )));
            }
        }
        for (&(scope, hash), &id) in &self.index {
            if self.meta.get(id as usize).map(|m| (m.scope, m.hash)) != Some((scope, hash)) {
                return Err(InvariantError(format!(
                    "index {hash:#x} -> {id} but the block says otherwise"
                )));
            }
        }
        let named = self.meta.iter().filter(|m| m.hash != 0).count();
        if named != self.index.len() {
            return Err(InvariantError(format!(
                "{named} named blocks but {} index entries",
                self.index.len()
            )));
        }
        let (mut n, mut at, mut prev) = (0, self.lru_head, NIL);
        while at != NIL {
            let m = &self.meta[at as usize];
            if m.refs != 0 || m.hash == 0 || m.prev != prev {
                return Err(InvariantError(format!(
                    "LRU holds block {at} with refs {} hash {:#x}",
                    m.refs, m.hash
                )));
            }
            n += 1;
            if n > total {
                return Err(InvariantError("LRU has a cycle".into()));
            }
            prev = at;
            at = m.next;
        }
        if n != cached || self.lru_tail != prev {
            return Err(InvariantError(format!(
                "LRU has {n} blocks, {cached} cached"
            )));
        }
        Ok(())
    }
}

/// A pool invariant that [`KvPool::check`] found broken (a bug in the pool, never bad input).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("pool invariant broken: {0}")]
pub struct InvariantError(pub String);

/// The pool shared by a server's tasks and the engine thread.
///
/// [`lock`](Self::lock) is for bookkeeping: reference counts, fills, lookups, registration,
/// allocation. Block bytes are read and written through [`read`](Self::read),
/// [`write`](Self::write) and [`import`](Self::import) without that lock, each block behind its
/// own. Whoever touches a block's bytes holds a reference on it (a [`Blocks`] guard, a lease):
/// the reference keeps the block from being reused, the block's lock keeps the access
/// race-free. Never call [`lock`](Self::lock) while holding a [`BlockRef`] or [`BlockMut`].
///
/// The counts are published whenever the lock is released, so the figures a control call reports
/// ([`SharedKv::counts`]) never wait for the pool's work.
#[derive(Clone, Debug)]
pub struct SharedKv {
    pool: Arc<Mutex<KvPool>>,
    data: Arc<Slabs>,
    counts: Arc<PublishedCounts>,
    pressure: Arc<Pressure>,
}

/// Imports waiting for room, by scope: what the engine preempts for. Each entry is the free
/// blocks the waiting import needs and when it last said so; an entry not renewed within
/// [`PRESSURE_TTL`] is gone (the import got its block, or gave up).
#[derive(Debug, Default)]
struct Pressure(Mutex<std::collections::HashMap<u64, (usize, std::time::Instant)>>);

/// How long an import's call for room counts after it was last made.
pub const PRESSURE_TTL: std::time::Duration = std::time::Duration::from_millis(20);

/// Imports waiting for room: the free blocks the neediest one wants, and the scopes waiting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pressed {
    /// Free (or evictable) blocks the neediest waiting import wants to see.
    pub free_wanted: usize,
    /// The scopes of the waiting imports.
    pub scopes: Vec<u64>,
}

/// The counts as of the last release of the pool lock: a copy behind a lock of its own, held
/// only to copy five words, so a reader never waits behind the pool's work and always sees one
/// release's consistent figures.
#[derive(Debug, Default)]
struct PublishedCounts(Mutex<PoolCounts>);

impl PublishedCounts {
    fn store(&self, c: PoolCounts) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = c;
    }

    fn load(&self) -> PoolCounts {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl SharedKv {
    /// Shares `pool`.
    #[must_use]
    pub fn new(pool: KvPool) -> Self {
        let counts = Arc::new(PublishedCounts::default());
        counts.store(pool.counts());
        Self {
            data: Arc::clone(&pool.data),
            pool: Arc::new(Mutex::new(pool)),
            counts,
            pressure: Arc::default(),
        }
    }

    /// An import in `scope` is waiting, as of `now`, until `free_wanted` blocks are free or
    /// evictable (a push's receiver calls it again while it waits): the engine preempts running
    /// requests of other tenants to make that room (see `Engine::step_at`).
    pub fn press(&self, scope: u64, free_wanted: usize, now: std::time::Instant) {
        let mut p = self
            .pressure
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = p.entry(scope).or_insert((0, now));
        *e = (free_wanted.max(e.0), now);
    }

    /// The imports waiting at `now` (calls older than [`PRESSURE_TTL`] are forgotten).
    #[must_use]
    pub fn pressed(&self, now: std::time::Instant) -> Pressed {
        let mut p = self
            .pressure
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if p.is_empty() {
            return Pressed::default();
        }
        p.retain(|_, (_, at)| now.saturating_duration_since(*at) <= PRESSURE_TTL);
        Pressed {
            free_wanted: p.values().map(|(n, _)| *n).max().unwrap_or(0),
            scopes: p.keys().copied().collect(),
        }
    }

    /// A block's bytes, read-locked, without the pool's lock. The caller holds a reference on
    /// the block.
    ///
    /// # Errors
    /// When the block does not exist.
    pub fn read(&self, id: BlockId) -> Result<BlockRef<'_>, PoolError> {
        self.data.read(id)
    }

    /// A block's bytes as they are now, kept alive by the snapshot and unchanged by later
    /// writes ([`BlockSnapshot`]), without the pool's lock. The caller holds a reference on the
    /// block.
    ///
    /// # Errors
    /// When the block does not exist.
    pub fn snapshot(&self, id: BlockId) -> Result<BlockSnapshot, PoolError> {
        self.data.snapshot(id)
    }

    /// The one-record envelope of a full block, in the block's own memory: `head` (from
    /// `kvwire::full_block_head`) written into the room before the payload and the CRC-32C into
    /// the room after it, unless they are there already for the payload as it is. The envelope
    /// then never changes while held ([`SealedEnvelope`]). Sealing reads the payload once under
    /// the block's read lock and takes its write lock only to put the 44 bytes in place;
    /// sealing again with the same head reads nothing. The caller
    /// holds a reference on the block and names it full.
    ///
    /// # Errors
    /// When the block does not exist.
    pub fn seal(
        &self,
        id: BlockId,
        head: &[u8; kvwire::SPLIT_HEAD_LEN],
    ) -> Result<SealedEnvelope, PoolError> {
        self.data.seal(id, head)
    }

    /// A block's bytes, write-locked, without the pool's lock. The caller holds a reference on
    /// the block and is its only writer (a block being filled is not yet in the index).
    ///
    /// # Errors
    /// When the block does not exist.
    pub fn write(&self, id: BlockId) -> Result<BlockMut<'_>, PoolError> {
        self.data.write(id)
    }

    /// [`KvPool::import`] with the copy outside the pool's lock: a block is taken (refcount 1,
    /// not yet named), filled under its own lock, then given its fill and name. Refused with
    /// [`PoolError::Exhausted`] when it would leave `reserve` or fewer blocks free or evictable.
    /// Nobody can find the block by its hash before its bytes are in.
    ///
    /// # Errors
    /// As [`KvPool::import`]; the pool is unchanged.
    pub fn import(
        &self,
        key: BlockKey<'_>,
        fill: u32,
        payload: &[u8],
        reserve: usize,
    ) -> Result<BlockId, PoolError> {
        let id = {
            let mut pool = self.lock();
            pool.check_import(fill, payload.len())?;
            if pool.available() <= reserve {
                return Err(PoolError::Exhausted {
                    requested: reserve + 1,
                    available: pool.available(),
                });
            }
            pool.allocate(1)?[0]
        };
        match self.data.write(id) {
            Ok(mut block) => crate::copy::copy_to_pool(&mut block, payload),
            Err(e) => {
                // Cannot happen for a block just allocated; if it did, give the block back.
                let _ = self.lock().release(id);
                return Err(e);
            }
        }
        self.lock().finish_import(id, key, fill);
        Ok(id)
    }

    /// Locks the pool. A panic while holding the lock leaves the pool's counts consistent (each
    /// method updates them last), so a poisoned lock is taken over rather than propagated.
    pub fn lock(&self) -> PoolGuard<'_> {
        PoolGuard {
            guard: self
                .pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            counts: &self.counts,
        }
    }

    /// The counts as of the last release of the lock, without taking it: one release's
    /// consistent figures.
    #[must_use]
    pub fn counts(&self) -> PoolCounts {
        self.counts.load()
    }
}

/// The locked pool; releasing it publishes the counts.
#[derive(Debug)]
pub struct PoolGuard<'a> {
    guard: MutexGuard<'a, KvPool>,
    counts: &'a PublishedCounts,
}

impl std::ops::Deref for PoolGuard<'_> {
    type Target = KvPool;

    fn deref(&self) -> &KvPool {
        &self.guard
    }
}

impl std::ops::DerefMut for PoolGuard<'_> {
    fn deref_mut(&mut self) -> &mut KvPool {
        &mut self.guard
    }
}

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        self.counts.store(self.guard.counts());
    }
}

/// References on blocks that are released when the guard drops, so an error path cannot forget
/// them. [`Blocks::into_ids`] hands the references on to a new owner instead.
#[derive(Debug)]
pub struct Blocks {
    pool: SharedKv,
    ids: Vec<BlockId>,
}

impl Blocks {
    /// Owns one reference on each of `ids` (already taken), releasing them on drop.
    #[must_use]
    pub fn new(pool: SharedKv, ids: Vec<BlockId>) -> Self {
        Self { pool, ids }
    }

    /// The blocks, in order.
    #[must_use]
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    /// Adds one more owned reference.
    pub fn push(&mut self, id: BlockId) {
        self.ids.push(id);
    }

    /// Number of blocks.
    #[must_use]
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// No blocks.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Keeps the references and hands them to the caller, who must release them.
    #[must_use]
    pub fn into_ids(mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.ids)
    }

    /// The pool these references are in.
    #[must_use]
    pub fn pool(&self) -> &SharedKv {
        &self.pool
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let mut pool = self.pool.lock();
        // Last block first: the LRU then evicts a chain from its end, and a cached prefix stays
        // findable (a block is only found through its parent).
        for &id in self.ids.iter().rev() {
            let res = pool.release(id);
            debug_assert!(
                res.is_ok(),
                "guard released block {id} it did not hold: {res:?}"
            );
        }
    }
}
