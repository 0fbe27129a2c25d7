//! The node's pool as the transfer sees it: [`PoolStore`] implements `kvwire_grpc::KvStore` over
//! the core's [`SharedKv`]. The core knows nothing of gRPC; this adapter is the only place the two
//! meet. The pool's lock is held for bookkeeping only; an import's copy and an envelope's copy
//! and CRC run under the one block's lock.

use kvwire::Shape;
use kvwire_grpc::{BlockId, KvStore, StoreError};
use tl_engine_core::pool::{PoolError, SharedKv};

/// A [`SharedKv`] serving the KV transfer. Imports leave `reserve` blocks free or evictable,
/// so a running sequence never fails for want of a block a push took.
#[derive(Clone, Debug)]
pub struct PoolStore(pub SharedKv, pub usize);

impl PoolStore {
    /// The pool, with no reserve (the sending side, tests).
    #[must_use]
    pub fn new(pool: SharedKv) -> Self {
        Self(pool, 0)
    }

    /// The shape, and the hash and fill of block `id`, which must be referenced.
    fn held(&self, id: BlockId) -> Result<(Shape, u64, u32), StoreError> {
        let pool = self.0.lock();
        match pool.info(id) {
            Ok((hash, fill, refs)) if refs > 0 => Ok((pool.shape(), hash, fill)),
            _ => Err(StoreError::NotHeld(id)),
        }
    }
}

fn store_error(e: PoolError) -> StoreError {
    match e {
        PoolError::Exhausted { .. } => StoreError::Exhausted,
        other => StoreError::pool(other),
    }
}

impl KvStore for PoolStore {
    fn shape(&self) -> Shape {
        self.0.lock().shape()
    }

    fn contains(&self, scope: u64, hashes: &[u64], tokens: &[u32]) -> Vec<bool> {
        // One lock for the walk: at most ceil(max context / B) lookups (the receiver bounds
        // the hashes), each a map probe and a B-token compare.
        let found = self.0.lock().lookup_prefix(scope, hashes, tokens).len();
        (0..hashes.len()).map(|i| i < found).collect()
    }

    fn take_ref(&self, key: kvwire_grpc::BlockKey<'_>) -> Option<BlockId> {
        self.0.lock().lookup_ref(key)
    }

    fn import(
        &self,
        key: kvwire_grpc::BlockKey<'_>,
        fill: u32,
        payload: &[u8],
    ) -> Result<BlockId, StoreError> {
        self.0
            .import(key, fill, payload, self.1)
            .map_err(store_error)
    }

    fn room(&self, scope: u64) -> bool {
        // The import would leave the reserve intact: room. Else a block waits in `scope`: the
        // engine's next step preempts another tenant's request until it fits.
        if self.0.lock().available() > self.1 {
            return true;
        }
        self.0.press(scope, self.1 + 1, std::time::Instant::now());
        false
    }

    fn release(&self, ids: &[BlockId]) {
        let mut pool = self.0.lock();
        for &id in ids {
            let res = pool.release(id);
            debug_assert!(res.is_ok(), "release of block {id}: {res:?}");
        }
    }

    fn release_forget(&self, ids: &[BlockId]) {
        let mut pool = self.0.lock();
        for &id in ids {
            let res = pool.release_forget(id);
            debug_assert!(res.is_ok(), "release_forget of block {id}: {res:?}");
        }
    }

    fn write_envelope(
        &self,
        id: BlockId,
        mut out: &mut dyn bytes::BufMut,
    ) -> Result<u64, StoreError> {
        let (shape, hash, fill) = self.held(id)?;
        // The copy and CRC under the block's lock only; the caller's reference keeps it ours.
        let payload = self.0.read(id).map_err(|_| StoreError::NotHeld(id))?;
        kvwire::write_envelope(
            &shape,
            &[kvwire::RecordIn {
                hash,
                fill,
                payload: &payload,
            }],
            &mut out,
        )
        .map_err(StoreError::pool)?;
        Ok(hash)
    }

    fn lend_envelope(&self, id: BlockId) -> Result<Option<bytes::Bytes>, StoreError> {
        let (shape, hash, fill) = self.held(id)?;
        if fill != shape.block_tokens() {
            // The unfilled rows go out as zeros, never as what the slab holds there.
            return Ok(None);
        }
        let head = kvwire::full_block_head(&shape, hash, fill).map_err(StoreError::pool)?;
        // The envelope in the block's own memory, never changed while the send holds it (a
        // writer copies); the block's lock is held only while it is sealed.
        let sealed = self
            .0
            .seal(id, &head)
            .map_err(|_| StoreError::NotHeld(id))?;
        Ok(Some(bytes::Bytes::from_owner(sealed)))
    }
}

#[cfg(test)]
mod tests {
    use kvwire::Shape;
    use kvwire_grpc::{KvStore, StoreError};
    use tl_engine_core::pool::{KvPool, PoolError, SharedKv};

    use super::PoolStore;

    const ANON: kvwire_grpc::BlockKey<'static> = kvwire_grpc::BlockKey {
        scope: 0,
        hash: 0,
        tokens: &[],
        parent: None,
    };

    #[test]
    fn store_errors_keep_the_pool_error() {
        let shape = Shape::v1(4, 2, 1, 4);
        let store = PoolStore::new(SharedKv::new(KvPool::new(shape, 1)));
        let p = shape.payload_bytes().unwrap();
        // A wrong size: the pool's own typed error, reachable as the source.
        let err = store.import(ANON, 4, &[0; 3]).unwrap_err();
        let StoreError::Pool(source) = &err else {
            panic!("{err:?}");
        };
        assert_eq!(
            source.downcast_ref::<PoolError>(),
            Some(&PoolError::BadImport {
                len: 3,
                fill: 4,
                payload: p
            })
        );
        // Exhaustion keeps its own variant (the receiver maps it to RESOURCE_EXHAUSTED).
        let id = store.import(ANON, 4, &vec![0; p]).unwrap();
        assert!(matches!(
            store.import(ANON, 4, &vec![0; p]),
            Err(StoreError::Exhausted)
        ));
        store.release(&[id]);
        assert!(matches!(
            store.write_envelope(id, &mut Vec::new()),
            Err(StoreError::NotHeld(i)) if i == id
        ));
        assert!(matches!(
            store.lend_envelope(id),
            Err(StoreError::NotHeld(i)) if i == id
        ));
    }

    /// A full block is lent in parts that join to the written envelope, its payload the pool's
    /// own memory; a partial one is not lent (its unfilled rows are sent as zeros).
    #[test]
    fn a_full_block_is_lent_and_a_partial_one_written() {
        let shape = Shape::v1(4, 2, 1, 4);
        let p = shape.payload_bytes().unwrap();
        let store = PoolStore::new(SharedKv::new(KvPool::new(shape, 2)));
        let payload: Vec<u8> = (0..p).map(|i| (i * 5 + 1) as u8).collect();
        let tokens = [1, 2, 3, 4];
        let key = kvwire_grpc::BlockKey {
            scope: 0,
            hash: 77,
            tokens: &tokens,
            parent: None,
        };
        let full = store.import(key, 4, &payload).unwrap();
        let lent = store.lend_envelope(full).unwrap().unwrap();
        let mut written = Vec::new();
        store.write_envelope(full, &mut written).unwrap();
        assert_eq!(lent, written);
        let at = kvwire::SPLIT_HEAD_LEN;
        assert_eq!(lent[at..].as_ptr(), store.0.read(full).unwrap().as_ptr());
        // The pool writes its block afterwards: the lent bytes stay as they were sent.
        store.0.write(full).unwrap()[0] ^= 0xff;
        assert_eq!(&lent[at..at + p], &payload[..]);
        drop(lent);
        let partial = store.import(ANON, 2, &payload).unwrap();
        assert!(store.lend_envelope(partial).unwrap().is_none());
        store.release(&[full, partial]);
        assert_eq!(store.0.counts().used, 0);
    }
}
