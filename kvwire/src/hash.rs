//! Block names: FNV-1a 64 chained over a parent hash and the block's token ids, and the key a
//! cache finds a block by ([`BlockKey`]), of which the name is only the index.

/// FNV-1a 64 offset basis.
pub const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64 prime.
pub const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

#[inline]
fn fnv_update(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// FNV-1a 64 of `bytes`.
///
/// ```
/// assert_eq!(kvwire::fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
/// ```
#[must_use]
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv_update(FNV_OFFSET_BASIS, bytes)
}

/// The chained hash of one block: FNV-1a 64 over `le64(parent)` then `le32` of each token.
///
/// A result of 0 becomes 1, because 0 on the wire means "no name" (a partial or unregistered
/// block). The first block of a prompt has parent 0.
///
/// ```
/// use kvwire::{block_hash, prompt_hashes};
/// let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
/// let h0 = block_hash(0, &prompt[..4]);
/// let h1 = block_hash(h0, &prompt[4..8]);
/// // Two full blocks at B = 4; the ninth token is a partial block, not named.
/// assert_eq!(prompt_hashes(&prompt, 4), vec![h0, h1]);
/// // A block's name depends on everything before it.
/// assert_ne!(block_hash(0, &prompt[4..8]), h1);
/// ```
#[must_use]
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = fnv_update(FNV_OFFSET_BASIS, &parent.to_le_bytes());
    for t in tokens {
        h = fnv_update(h, &t.to_le_bytes());
    }
    if h == 0 { 1 } else { h }
}

/// One chained hash per FULL block of `tokens` (blocks of `block_tokens` tokens), starting from
/// parent 0. A partial tail gets none; `block_tokens == 0` gives none.
#[must_use]
pub fn prompt_hashes(tokens: &[u32], block_tokens: usize) -> Vec<u64> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut parent = 0;
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            parent = block_hash(parent, block);
            parent
        })
        .collect()
}

/// Where a cache holds a block: a slot of its pool.
pub type BlockId = u32;

/// What names a block in a cache. The chained hash is only the index: two different token
/// blocks can share it, and a collision is found in minutes. A cached block answers for a key
/// only when its stored `tokens` equal these exactly, its parent is the block found for the
/// previous position (so the whole prefix is compared, not only this block), and it lives in
/// the same tenant `scope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockKey<'a> {
    /// The tenant scope (0: shared).
    pub scope: u64,
    /// The chained hash: the index.
    pub hash: u64,
    /// The block's tokens: the identity.
    pub tokens: &'a [u32],
    /// The block holding the previous position's tokens; `None` for a prompt's first block.
    pub parent: Option<BlockId>,
}

impl BlockKey<'static> {
    /// No name: a block imported this way is never found by a lookup (a sender's own blocks,
    /// which it names by id).
    pub const ANON: BlockKey<'static> = BlockKey {
        scope: 0,
        hash: 0,
        tokens: &[],
        parent: None,
    };
}

impl<'a> BlockKey<'a> {
    /// A prompt's first block in the shared scope.
    #[must_use]
    pub fn first(hash: u64, tokens: &'a [u32]) -> Self {
        Self {
            scope: 0,
            hash,
            tokens,
            parent: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_check_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn prompt_hashes_chain_and_skip_the_tail() {
        let toks = [1, 2, 3, 4, 5];
        let hs = prompt_hashes(&toks, 2);
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0], block_hash(0, &[1, 2]));
        assert_eq!(hs[1], block_hash(hs[0], &[3, 4]));
        assert!(prompt_hashes(&toks, 0).is_empty());
        assert!(prompt_hashes(&toks[..1], 2).is_empty());
    }
}
