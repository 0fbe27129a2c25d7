//! What each token id stands for as text: its bytes (a byte-level BPE token's bytes, a
//! SentencePiece piece with `▁` as a space, a byte-fallback token's one byte) and whether it is
//! special. Stop strings are matched on these bytes, streamed text is decoded from them, and
//! log-probabilities name tokens by them, so nothing outside the fake model assumes that ids
//! 0..=255 are bytes.

use std::sync::{Arc, OnceLock};

/// Byte tokens 0..=255, then these specials.
pub const BOS: u32 = 256;
/// End of sequence (the fake model never samples it on purpose; it is just a vocabulary entry).
pub const EOS: u32 = 257;
/// Padding.
pub const PAD: u32 = 258;
/// Unknown.
pub const UNK: u32 = 259;
/// The byte-level vocabulary: 256 bytes and 4 specials.
pub const BYTE_VOCAB: u32 = 260;

/// Each token's bytes and whether it is special, for a vocabulary of [`len`](Self::len) ids.
#[derive(Clone, PartialEq, Eq)]
pub struct Vocab {
    /// Every piece's bytes, one after another.
    bytes: Vec<u8>,
    /// Where piece `i` ends in `bytes` (it starts where `i - 1` ends).
    ends: Vec<u32>,
    /// Whether piece `i` is special (a control token: BOS, EOS, end of turn, ...).
    special: Vec<bool>,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("tokens", &self.len())
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// The names of the fake model's specials, ids 256..=259.
pub const BYTE_SPECIALS: [&str; 4] = ["<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"];

impl Vocab {
    /// A vocabulary of `pieces` in id order: each token's bytes and whether it is special.
    ///
    /// # Panics
    /// When the pieces add up to 4 GiB or more (no tokenizer comes near).
    pub fn new<I, B>(pieces: I) -> Self
    where
        I: IntoIterator<Item = (B, bool)>,
        B: AsRef<[u8]>,
    {
        let mut v = Self {
            bytes: Vec::new(),
            ends: Vec::new(),
            special: Vec::new(),
        };
        for (b, s) in pieces {
            v.bytes.extend_from_slice(b.as_ref());
            v.ends
                .push(u32::try_from(v.bytes.len()).expect("a vocabulary under 4 GiB"));
            v.special.push(s);
        }
        v
    }

    /// The fake model's vocabulary: ids 0..=255 the bytes, then [`BYTE_SPECIALS`]; shared.
    #[must_use]
    pub fn bytes() -> Arc<Self> {
        static BYTES: OnceLock<Arc<Vocab>> = OnceLock::new();
        Arc::clone(BYTES.get_or_init(|| {
            let bytes = (0..=255u8).map(|b| (vec![b], false));
            let specials = BYTE_SPECIALS.iter().map(|s| (s.as_bytes().to_vec(), true));
            let v = Vocab::new(bytes.chain(specials));
            debug_assert_eq!(v.len() as u32, BYTE_VOCAB);
            Arc::new(v)
        }))
    }

    /// How many ids it names.
    #[must_use]
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether it names none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Token `id`'s bytes (a special's are its name); empty for an id past the vocabulary.
    #[must_use]
    pub fn piece(&self, id: u32) -> &[u8] {
        let i = id as usize;
        let Some(&end) = self.ends.get(i) else {
            return &[];
        };
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start as usize..end as usize]
    }

    /// Whether `id` is special (ids past the vocabulary are not).
    #[must_use]
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Token `id`'s bytes as generated text carries them: none for a special, which text leaves
    /// out unless asked to show it.
    #[must_use]
    pub fn text_bytes(&self, id: u32) -> &[u8] {
        if self.is_special(id) {
            &[]
        } else {
            self.piece(id)
        }
    }

    /// `ids` as text: their bytes (specials left out) decoded as UTF-8, lossily.
    #[must_use]
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&t| self.text_bytes(t).iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_found_by_id() {
        let v = Vocab::new([(b"ab".as_slice(), false), (b"", false), (b"<s>", true)]);
        assert_eq!(v.len(), 3);
        assert_eq!(v.piece(0), b"ab");
        assert_eq!(v.piece(1), b"");
        assert_eq!(v.piece(2), b"<s>");
        assert_eq!(v.piece(3), b"");
        assert!(v.is_special(2) && !v.is_special(0) && !v.is_special(99));
        assert_eq!(v.text_bytes(2), b"");
        assert_eq!(v.decode(&[0, 2, 0]), "abab");
        let b = Vocab::bytes();
        assert_eq!(b.len(), 260);
        assert_eq!(b.piece(0x41), b"A");
        assert_eq!(b.piece(257), b"<|eos|>");
        assert!(b.is_special(256) && !b.is_special(255));
    }
}
