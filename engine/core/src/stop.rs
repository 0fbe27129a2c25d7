//! Stop rules: a completion ends when its text contains a stop sequence (OpenAI's `stop`,
//! matched across token boundaries on the tokens' bytes as [`Vocab`] gives them) or its last
//! token is a stop token id (`stop_token_ids`). A sequence counts where it overlaps the newest
//! token's bytes, so the engine ends a completion at the step whose token completes the match,
//! and the returned text ends where the match begins.

use std::sync::Arc;

use crate::vocab::Vocab;

/// The stop rules of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stop {
    /// Byte sequences, each non-empty.
    pub sequences: Vec<Vec<u8>>,
    /// Token ids.
    pub token_ids: Vec<u32>,
    /// vLLM's `min_tokens`: no rule ends a completion shorter than this (a stop token or
    /// string before it is generated text like any other).
    pub min_tokens: u32,
    /// What the tokens are as bytes: the sequences are matched on these.
    pub vocab: Arc<Vocab>,
}

impl Default for Stop {
    fn default() -> Self {
        Self {
            sequences: Vec::new(),
            token_ids: Vec::new(),
            min_tokens: 0,
            vocab: Vocab::bytes(),
        }
    }
}

/// Where a rule matched, counted back from the end of the completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matched {
    /// Trailing tokens the match touches (1 for a stop token id).
    pub tokens: usize,
    /// Bytes of the first of them that come before the match and stay in the text.
    pub keep: usize,
}

/// The tail of a completion as bytes: the last tokens' bytes, at least `want` of them before the
/// newest token's, with each byte's token (its index in the completion).
struct Tail {
    bytes: Vec<u8>,
    owner: Vec<usize>,
    /// Where the newest token's bytes begin in `bytes`.
    newest: usize,
}

impl Stop {
    /// No rule.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty() && self.token_ids.is_empty()
    }

    fn longest(&self) -> usize {
        self.sequences.iter().map(Vec::len).max().unwrap_or(0)
    }

    fn tail(&self, completion: &[u32], want: usize) -> Tail {
        let mut from = completion.len();
        let mut before = 0usize;
        while from > 0 {
            from -= 1;
            if from + 1 < completion.len() {
                before += self.vocab.text_bytes(completion[from]).len();
                if before >= want {
                    break;
                }
            }
        }
        let mut t = Tail {
            bytes: Vec::new(),
            owner: Vec::new(),
            newest: 0,
        };
        for (i, &id) in completion.iter().enumerate().skip(from) {
            if i + 1 == completion.len() {
                t.newest = t.bytes.len();
            }
            let b = self.vocab.text_bytes(id);
            t.bytes.extend_from_slice(b);
            t.owner.extend(std::iter::repeat_n(i, b.len()));
        }
        t
    }

    fn at(&self, completion: &[u32], t: &Tail, start: usize) -> Matched {
        let token = t.owner[start];
        let first = t.owner.iter().position(|&o| o == token).unwrap_or(start);
        Matched {
            tokens: completion.len() - token,
            keep: start - first,
        }
    }

    /// Whether the newest token of `completion` (the tokens generated so far) ends it, and
    /// where: the earliest stop sequence that overlaps the newest token's bytes, or the newest
    /// token itself when it is a stop token id.
    #[must_use]
    pub fn matched(&self, completion: &[u32]) -> Option<Matched> {
        if (completion.len() as u64) < u64::from(self.min_tokens) {
            return None;
        }
        let last = *completion.last()?;
        if self.token_ids.contains(&last) {
            return Some(Matched { tokens: 1, keep: 0 });
        }
        let longest = self.longest();
        if longest == 0 || self.vocab.text_bytes(last).is_empty() {
            return None;
        }
        let t = self.tail(completion, longest - 1);
        let start = self
            .sequences
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| {
                // Occurrences that end inside the newest token's bytes.
                let lo = t.newest.saturating_sub(s.len() - 1);
                t.bytes
                    .get(lo..)?
                    .windows(s.len())
                    .position(|w| w == s.as_slice())
                    .map(|p| lo + p)
            })
            .min()?;
        Some(self.at(completion, &t, start))
    }

    /// How many trailing tokens of `completion` could still begin a stop sequence: the tokens
    /// that the longest end of its bytes that is a proper prefix of a sequence touches (and any
    /// byte-less tokens after them). A stream holds them back until the next tokens decide.
    #[must_use]
    pub fn pending(&self, completion: &[u32]) -> usize {
        let longest = self.longest();
        if longest < 2 || completion.is_empty() {
            return 0;
        }
        let t = self.tail(completion, longest - 1);
        let n = t.bytes.len();
        let k = self
            .sequences
            .iter()
            .flat_map(|s| {
                (1..s.len().min(n + 1))
                    .filter(|&k| t.bytes[n - k..] == s[..k])
                    .max()
            })
            .max()
            .unwrap_or(0);
        if k == 0 {
            return 0;
        }
        self.at(completion, &t, n - k).tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    fn m(tokens: usize, keep: usize) -> Option<Matched> {
        Some(Matched { tokens, keep })
    }

    #[test]
    fn matches_across_tokens_and_holds_back_prefixes() {
        let stop = Stop {
            sequences: vec![b"END".to_vec(), "é".as_bytes().to_vec()],
            token_ids: vec![259],
            ..Stop::default()
        };
        assert_eq!(stop.matched(&toks("abcEND")), m(3, 0));
        assert_eq!(stop.matched(&toks("abcEN")), None);
        assert_eq!(stop.pending(&toks("abcEN")), 2);
        assert_eq!(stop.pending(&toks("abcE")), 1);
        assert_eq!(stop.pending(&toks("abc")), 0);
        // A two-byte character split over two tokens.
        assert_eq!(stop.pending(&[0x61, 0xC3]), 1);
        assert_eq!(stop.matched(&[0x61, 0xC3, 0xA9]), m(2, 0));
        // A stop token id.
        assert_eq!(stop.matched(&[0x61, 259]), m(1, 0));
        assert_eq!(stop.matched(&[]), None);
        assert!(Stop::default().is_empty());
        // min_tokens: nothing ends a completion shorter than it.
        let min = Stop {
            min_tokens: 4,
            ..stop.clone()
        };
        assert_eq!(min.matched(&toks("END")), None);
        assert_eq!(min.matched(&[0x61, 0x62, 259]), None);
        assert_eq!(min.matched(&toks("aEND")), m(3, 0));
        assert_eq!(min.matched(&[0x61, 0x62, 0x63, 259]), m(1, 0));
        assert_eq!(Stop::default().matched(&toks("x")), None);
    }

    /// Multi-byte pieces: a stop that begins inside one token and ends inside another is found
    /// at the token that completes it, with the bytes before it kept.
    #[test]
    fn matches_inside_multibyte_pieces() {
        let vocab = Arc::new(Vocab::new([
            (b"Hello".as_slice(), false), // 0
            (b" wor", false),             // 1
            (b"ld.", false),              // 2
            (b"<|im_end|>", true),        // 3
            (b"\nUs", false),             // 4
            (b"er:", false),              // 5
        ]));
        let stop = Stop {
            sequences: vec![b"world".to_vec(), b"\nUser:".to_vec()],
            token_ids: vec![3],
            min_tokens: 0,
            vocab,
        };
        assert_eq!(stop.matched(&[0, 1]), None);
        assert_eq!(stop.pending(&[0, 1]), 1, "\" wor\" may begin \"world\"");
        // "world" begins one byte into " wor" and ends inside "ld.".
        assert_eq!(stop.matched(&[0, 1, 2]), m(2, 1));
        // A special has no bytes: it neither matches nor breaks a sequence.
        assert_eq!(stop.matched(&[0, 1, 3]), m(1, 0));
        assert_eq!(stop.matched(&[0, 4]), None);
        assert_eq!(stop.pending(&[0, 4]), 1);
        assert_eq!(stop.matched(&[0, 4, 5]), m(2, 0));
        // A match that lies wholly before the newest token was the earlier step's.
        assert_eq!(stop.matched(&[0, 4, 5, 0]), None);
    }
}
