//! SentencePiece's BPE as a GGUF file carries it (`tokenizer.ggml.model = "llama"`): pieces
//! with scores and types, and no merge list. It tokenizes as llama.cpp does:
//! - the text is first cut at the control and user-defined pieces (Gemma's runs of spaces, tabs
//!   and newlines, its HTML tags, `<start_of_turn>`), which become their ids whole; where two
//!   could start at one place the longer wins, and the leftmost match is taken first;
//! - each run of text between them has its spaces written `▁` (and a `▁` in front where the
//!   file asks for a space prefix), and starts as one symbol a character;
//! - the adjacent pair whose joined text is a piece with the highest score is merged, the
//!   leftmost first among equal scores, until no pair joins into a piece;
//! - a symbol left that is no piece is written as its bytes' `<0xNN>` pieces.
//!
//! Decoding writes `▁` back as a space and a byte piece as its byte.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// Token types as GGUF writes them (`tokenizer.ggml.token_type`).
pub mod kind {
    /// A piece of text.
    pub const NORMAL: u8 = 1;
    /// The unknown token.
    pub const UNKNOWN: u8 = 2;
    /// A control token (`<bos>`, `<start_of_turn>`): no text of its own.
    pub const CONTROL: u8 = 3;
    /// A piece matched before the others, as it is written (Gemma's whitespace runs, tags).
    pub const USER_DEFINED: u8 = 4;
    /// Unused.
    pub const UNUSED: u8 = 5;
    /// `<0xNN>`: one byte.
    pub const BYTE: u8 = 6;
}

/// Why a vocabulary cannot be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpmError {
    /// The three lists differ in length.
    #[error("tokenizer.ggml.tokens has {tokens} entries, scores {scores}, token_type {types}")]
    Lengths {
        /// Pieces.
        tokens: usize,
        /// Scores.
        scores: usize,
        /// Types.
        types: usize,
    },
    /// A byte has no `<0xNN>` piece, so text outside the pieces could not be written.
    #[error("no byte piece <0x{0:02X}>: byte fallback needs all 256")]
    NoByte(u8),
    /// The special pieces could not be indexed.
    #[error("special pieces: {0}")]
    Specials(String),
}

/// A SentencePiece BPE vocabulary.
pub struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<u8>,
    ids: HashMap<String, u32>,
    bytes: [u32; 256],
    /// Control and user-defined pieces, found in the text before anything else.
    specials: aho_corasick::AhoCorasick,
    special_ids: Vec<u32>,
    bos: Option<u32>,
    space_prefix: bool,
}

impl std::fmt::Debug for Spm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spm")
            .field("pieces", &self.pieces.len())
            .field("specials", &self.special_ids.len())
            .field("bos", &self.bos)
            .field("space_prefix", &self.space_prefix)
            .finish_non_exhaustive()
    }
}

/// A pair of adjacent symbols whose joined text is a piece, queued by that piece's score.
#[derive(Debug, PartialEq)]
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Pair {}

impl Ord for Pair {
    fn cmp(&self, other: &Self) -> Ordering {
        // The highest score first; among equal scores, the leftmost.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// One symbol of a run: bytes `start..start + len` of its text, linked to its neighbours.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// The vocabulary of `pieces`, their `scores` and `kinds` ([`kind`]), beginning a text with
    /// `bos` when one is given, and with a `▁` when `space_prefix`.
    ///
    /// # Errors
    /// Lists of different lengths, or a byte without its `<0xNN>` piece.
    pub fn new(
        pieces: Vec<String>,
        scores: Vec<f32>,
        kinds: Vec<u8>,
        bos: Option<u32>,
        space_prefix: bool,
    ) -> Result<Self, SpmError> {
        if pieces.len() != scores.len() || pieces.len() != kinds.len() {
            return Err(SpmError::Lengths {
                tokens: pieces.len(),
                scores: scores.len(),
                types: kinds.len(),
            });
        }
        // As llama.cpp's map is filled: a text written twice names its last id.
        let mut ids = HashMap::with_capacity(pieces.len());
        for (id, p) in pieces.iter().enumerate() {
            ids.insert(p.clone(), id as u32);
        }
        let mut bytes = [0u32; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = *ids
                .get(&format!("<0x{b:02X}>"))
                .ok_or(SpmError::NoByte(b as u8))?;
        }
        let special_ids: Vec<u32> = (0..pieces.len() as u32)
            .filter(|&id| {
                let k = kinds[id as usize];
                (k == kind::CONTROL || k == kind::USER_DEFINED) && !pieces[id as usize].is_empty()
            })
            .collect();
        let specials = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(special_ids.iter().map(|&id| &pieces[id as usize]))
            .map_err(|e| SpmError::Specials(e.to_string()))?;
        Ok(Self {
            pieces,
            scores,
            kinds,
            ids,
            bytes,
            specials,
            special_ids,
            bos,
            space_prefix,
        })
    }

    /// Pieces in the vocabulary.
    #[must_use]
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// Whether it has none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Token ids of `text`, after the BOS when `add_special` and the file asks for one.
    #[must_use]
    pub fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && let Some(b) = self.bos {
            out.push(b);
        }
        let mut at = 0;
        let mut after_special = true;
        for m in self.specials.find_iter(text) {
            self.encode_run(&text[at..m.start()], after_special, &mut out);
            out.push(self.special_ids[m.pattern().as_usize()]);
            after_special = true;
            at = m.end();
        }
        self.encode_run(&text[at..], after_special, &mut out);
        out
    }

    /// One run of text between special pieces.
    fn encode_run(&self, run: &str, after_special: bool, out: &mut Vec<u32>) {
        if run.is_empty() {
            return;
        }
        let mut text = String::with_capacity(run.len() + 3);
        if self.space_prefix && after_special {
            text.push('\u{2581}');
        }
        for c in run.chars() {
            text.push(if c == ' ' { '\u{2581}' } else { c });
        }
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                prev: None,
                next: None,
            })
            .collect();
        let n = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = i.checked_sub(1);
            s.next = (i + 1 < n).then_some(i + 1);
        }
        let mut queue = BinaryHeap::new();
        for i in 1..n {
            self.queue_pair(&text, &symbols, i - 1, i, &mut queue);
        }
        while let Some(p) = queue.pop() {
            let (l, r) = (symbols[p.left], symbols[p.right]);
            // A pair one of whose symbols has changed since it was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != p.len {
                continue;
            }
            symbols[p.left].len += r.len;
            symbols[p.right].len = 0;
            symbols[p.left].next = r.next;
            if let Some(next) = r.next {
                symbols[next].prev = Some(p.left);
            }
            if let Some(prev) = l.prev {
                self.queue_pair(&text, &symbols, prev, p.left, &mut queue);
            }
            if let Some(next) = r.next {
                self.queue_pair(&text, &symbols, p.left, next, &mut queue);
            }
        }
        let mut at = (n > 0).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().map(|b| self.bytes[b as usize])),
            }
            at = s.next;
        }
    }

    fn queue_pair(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Pair>,
    ) {
        let (l, r) = (symbols[left], symbols[right]);
        let joined = &text[l.start..l.start + l.len + r.len];
        if let Some(&id) = self.ids.get(joined) {
            queue.push(Pair {
                score: self.scores[id as usize],
                left,
                right,
                len: l.len + r.len,
            });
        }
    }

    /// The bytes token `id` stands for, and whether it is a control token (which has no text
    /// of its own: its bytes are its name): a piece with `▁` as a space, a byte piece's byte.
    /// `None` for an id outside the vocabulary.
    #[must_use]
    pub fn bytes_of(&self, id: u32) -> Option<(Vec<u8>, bool)> {
        let piece = self.pieces.get(id as usize)?;
        Some(match self.kinds[id as usize] {
            kind::BYTE => match byte_piece(piece) {
                Some(b) => (vec![b], false),
                None => (piece.clone().into_bytes(), false),
            },
            kind::CONTROL => (piece.clone().into_bytes(), true),
            kind::USER_DEFINED => (piece.clone().into_bytes(), false),
            _ => (piece.replace('\u{2581}', " ").into_bytes(), false),
        })
    }

    /// The text of `ids`, control tokens left out when `skip_special` (and ids outside the
    /// vocabulary always); bytes that are not UTF-8 become U+FFFD.
    #[must_use]
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut out = Vec::new();
        for &id in ids {
            if let Some((bytes, control)) = self.bytes_of(id)
                && !(control && skip_special)
            {
                out.extend_from_slice(&bytes);
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The id of a piece written so.
    #[must_use]
    pub fn id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// The pieces of control tokens, with their ids.
    pub fn controls(&self) -> impl Iterator<Item = (u32, String)> + '_ {
        self.kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == kind::CONTROL)
            .map(|(id, _)| (id as u32, self.pieces[id].clone()))
    }

    /// Piece `id` as written.
    #[must_use]
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }
}

/// The byte a `<0xNN>` piece (SentencePiece's byte fallback) stands for.
pub(crate) fn byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small vocabulary: the 256 byte pieces, `<bos>`, a user-defined run of two spaces, and
    /// pieces whose scores decide the merges.
    fn vocab(space_prefix: bool) -> Spm {
        let mut pieces: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        let mut kinds = vec![kind::BYTE; 256];
        let mut scores = vec![0.0; 256];
        for (p, k, s) in [
            ("<bos>", kind::CONTROL, -1000.0),
            ("  ", kind::USER_DEFINED, -1000.0),
            ("a", kind::NORMAL, -1.0),
            ("b", kind::NORMAL, -2.0),
            ("c", kind::NORMAL, -3.0),
            ("\u{2581}", kind::NORMAL, -4.0),
            ("ab", kind::NORMAL, -10.0),
            ("bc", kind::NORMAL, -5.0),
            ("abc", kind::NORMAL, -6.0),
            ("\u{2581}a", kind::NORMAL, -7.0),
        ] {
            pieces.push(p.into());
            kinds.push(k);
            scores.push(s);
        }
        Spm::new(pieces, scores, kinds, Some(256), space_prefix).unwrap()
    }

    fn ids(v: &Spm, pieces: &[&str]) -> Vec<u32> {
        pieces.iter().map(|p| v.id(p).unwrap()).collect()
    }

    #[test]
    fn the_best_scored_pair_merges_first() {
        let v = vocab(false);
        // "bc" (-5) before "ab" (-10), then "a" + "bc" joins into "abc".
        assert_eq!(v.encode("abc", false), ids(&v, &["abc"]));
        // "ab" then nothing joins "ab" + "ab".
        assert_eq!(v.encode("abab", false), ids(&v, &["ab", "ab"]));
        assert_eq!(v.encode(" a", true), ids(&v, &["<bos>", "\u{2581}a"]));
    }

    #[test]
    fn specials_are_cut_first_and_bytes_fall_back() {
        let v = vocab(false);
        assert_eq!(
            v.encode("a  b<bos>", false),
            ids(&v, &["a", "  ", "b", "<bos>"])
        );
        // "é" is no piece: its two bytes.
        assert_eq!(v.encode("é", false), ids(&v, &["<0xC3>", "<0xA9>"]));
        assert_eq!(v.decode(&v.encode("é a  b", false), true), "é a  b");
        assert_eq!(v.decode(&ids(&v, &["<bos>", "a"]), true), "a");
        assert_eq!(v.decode(&ids(&v, &["<bos>", "a"]), false), "<bos>a");
    }

    #[test]
    fn a_space_prefix_starts_each_run_after_a_special() {
        let v = vocab(true);
        assert_eq!(
            v.encode("a<bos>a", false),
            ids(&v, &["\u{2581}a", "<bos>", "\u{2581}a"])
        );
    }

    #[test]
    fn a_vocabulary_without_every_byte_is_refused() {
        let e = Spm::new(vec!["a".into()], vec![0.0], vec![kind::NORMAL], None, false);
        assert_eq!(e.unwrap_err(), SpmError::NoByte(0));
        let e = Spm::new(vec!["a".into()], vec![], vec![kind::NORMAL], None, false);
        assert!(matches!(e, Err(SpmError::Lengths { .. })));
    }
}
