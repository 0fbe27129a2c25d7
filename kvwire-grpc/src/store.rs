//! What the transfer needs of a KV pool. The engine's pool implements [`KvStore`]; the
//! dependency points kvwire <- kvwire-grpc <- engine, so this crate never names the engine.
//!
//! Every method takes `&self` and locks internally for a short critical section (metadata, or
//! one block's memcpy); none is called across an `.await`.

use std::sync::Arc;

use bytes::BufMut;
use kvwire::Shape;

pub use kvwire::{BlockId, BlockKey};

/// Why the store refused.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No free or evictable block.
    #[error("KV pool exhausted")]
    Exhausted,
    /// The block does not exist or is not referenced.
    #[error("block {0} is not held")]
    NotHeld(BlockId),
    /// The pool refused otherwise (a bad payload size, a failed envelope write): its own typed
    /// error, kept as the source so a caller can downcast it.
    #[error("{0}")]
    Pool(Arc<dyn std::error::Error + Send + Sync>),
}

impl StoreError {
    /// Wraps a pool's own error.
    pub fn pool(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Pool(Arc::new(e))
    }
}

/// A KV pool as the transfer sees it.
pub trait KvStore: Send + Sync + std::fmt::Debug + 'static {
    /// The pool's block shape (the receiver's expected envelope shape).
    fn shape(&self) -> Shape;

    /// The `kv_format` of the envelopes this store reads and writes: its format's version
    /// (1 for `kv.wire.v1`). A receiver serves exactly this format; a sender offering several
    /// formats offers one store per format (views of one pool that convert on the way out).
    fn kv_format(&self) -> u32 {
        u32::from(self.shape().format.version)
    }

    /// For each hash of a prompt (`tokens` holds B tokens per hash), whether a block holds it
    /// with those tokens after the same prefix, in `scope`: true for a leading run of blocks
    /// only, and all false when `tokens` is short. Takes no reference and changes no count.
    fn contains(&self, scope: u64, hashes: &[u64], tokens: &[u32]) -> Vec<bool>;

    /// The block `key` names (tokens compared exactly, parent and scope equal), with one
    /// reference taken on it.
    fn take_ref(&self, key: BlockKey<'_>) -> Option<BlockId>;

    /// A new block holding `payload` (P bytes) with `fill` tokens, refcount 1, remembering
    /// `key.tokens` (when they are its `fill` tokens) for later comparison. Registered under
    /// the key when its hash is non-zero, it is full, its parent is registered (or it is a
    /// first block) and no block holds the key yet.
    ///
    /// # Errors
    /// [`StoreError::Exhausted`] when no block is free or evictable.
    fn import(&self, key: BlockKey<'_>, fill: u32, payload: &[u8]) -> Result<BlockId, StoreError>;

    /// Whether an [`import`](Self::import) in `scope` would find a block now. A store whose
    /// owner can make room (an engine preempting another tenant's request) is told by a `false`
    /// answer that a block is waiting; the receiver asks again while it waits. The default
    /// always answers yes (the import then decides).
    fn room(&self, scope: u64) -> bool {
        let _ = scope;
        true
    }

    /// Drops one reference on each block; a registered block reaching zero stays cached.
    fn release(&self, ids: &[BlockId]);

    /// Drops one reference on each block; a block reaching zero is unregistered and freed.
    fn release_forget(&self, ids: &[BlockId]);

    /// Appends a one-block envelope of block `id` (with its registered hash, or 0) to `out`, in
    /// one copy plus the CRC, and returns that hash. The caller reserves room (the envelope is
    /// `shape().envelope_len(1)` bytes): the transfer writes it straight into the gRPC encode
    /// buffer.
    ///
    /// # Errors
    /// When the block is not held; then nothing was written.
    fn write_envelope(&self, id: BlockId, out: &mut dyn BufMut) -> Result<u64, StoreError>;

    /// The one-block envelope of block `id` (the bytes [`write_envelope`](Self::write_envelope)
    /// writes) lent rather than copied: the gRPC sender hands it to HTTP/2 and the socket where
    /// it lies. `Ok(None)` when this store cannot lend its bytes or the block is partial (its
    /// unfilled rows go out as zeros, which takes a copy): the sender then calls
    /// [`write_envelope`](Self::write_envelope). The default is `Ok(None)`.
    ///
    /// The lent bytes must never change while they live (a pool lends a snapshot and copies on
    /// write).
    ///
    /// # Errors
    /// When the block is not held.
    fn lend_envelope(&self, id: BlockId) -> Result<Option<bytes::Bytes>, StoreError> {
        let _ = id;
        Ok(None)
    }
}
