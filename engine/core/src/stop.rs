//! Stop rules: a completion ends when its bytes end with a stop sequence (OpenAI's `stop`,
//! matched across token boundaries) or its last token is a stop token id (`stop_token_ids`).
//! Tokens are bytes (plus specials), so a stop string is matched as its UTF-8 bytes.

/// The stop rules of one request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stop {
    /// Byte sequences, each non-empty.
    pub sequences: Vec<Vec<u8>>,
    /// Token ids.
    pub token_ids: Vec<u32>,
    /// vLLM's `min_tokens`: no rule ends a completion shorter than this (a stop token or
    /// string before it is generated text like any other).
    pub min_tokens: u32,
}

/// Whether `tokens` are exactly the bytes `bytes`.
fn same_bytes(tokens: &[u32], bytes: &[u8]) -> bool {
    tokens.len() == bytes.len() && tokens.iter().zip(bytes).all(|(&t, &b)| t == u32::from(b))
}

impl Stop {
    /// No rule.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty() && self.token_ids.is_empty()
    }

    /// When `completion` (the tokens generated so far) ends a rule: how many trailing tokens
    /// form it (the stop sequence's length, or 1 for a stop token id).
    #[must_use]
    pub fn matched(&self, completion: &[u32]) -> Option<usize> {
        if (completion.len() as u64) < u64::from(self.min_tokens) {
            return None;
        }
        let last = *completion.last()?;
        if self.token_ids.contains(&last) {
            return Some(1);
        }
        self.sequences
            .iter()
            .filter(|s| !s.is_empty() && s.len() <= completion.len())
            .find(|s| same_bytes(&completion[completion.len() - s.len()..], s))
            .map(Vec::len)
    }

    /// How many trailing tokens of `completion` could still begin a stop sequence: a stream
    /// holds them back until the next tokens decide.
    #[must_use]
    pub fn pending(&self, completion: &[u32]) -> usize {
        self.sequences
            .iter()
            .flat_map(|s| {
                (1..s.len().min(completion.len() + 1))
                    .filter(|&k| same_bytes(&completion[completion.len() - k..], &s[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    #[test]
    fn matches_across_tokens_and_holds_back_prefixes() {
        let stop = Stop {
            sequences: vec![b"END".to_vec(), "é".as_bytes().to_vec()],
            token_ids: vec![259],
            min_tokens: 0,
        };
        assert_eq!(stop.matched(&toks("abcEND")), Some(3));
        assert_eq!(stop.matched(&toks("abcEN")), None);
        assert_eq!(stop.pending(&toks("abcEN")), 2);
        assert_eq!(stop.pending(&toks("abcE")), 1);
        assert_eq!(stop.pending(&toks("abc")), 0);
        // A two-byte character split over two tokens.
        assert_eq!(stop.pending(&[0x61, 0xC3]), 1);
        assert_eq!(stop.matched(&[0x61, 0xC3, 0xA9]), Some(2));
        // A stop token id.
        assert_eq!(stop.matched(&[0x61, 259]), Some(1));
        assert_eq!(stop.matched(&[]), None);
        assert!(Stop::default().is_empty());
        // min_tokens: nothing ends a completion shorter than it.
        let min = Stop {
            min_tokens: 4,
            ..stop.clone()
        };
        assert_eq!(min.matched(&toks("END")), None);
        assert_eq!(min.matched(&[0x61, 0x62, 259]), None);
        assert_eq!(min.matched(&toks("aEND")), Some(3));
        assert_eq!(min.matched(&[0x61, 0x62, 0x63, 259]), Some(1));
        assert_eq!(Stop::default().matched(&toks("x")), None);
    }
}
