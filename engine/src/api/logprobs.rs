//! Log-probabilities in OpenAI's two shapes: completions' parallel lists
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` entries
//! (`token`, `logprob`, `bytes`, `top_logprobs`). Values are the core's
//! [`TokenLogprobs`], carried unchanged (f32, printed shortest-exact), so a client reads the
//! very numbers the engine computed.
//!
//! A token's string is its piece as text: its bytes when they are valid UTF-8 by themselves
//! (so that a completion's pieces concatenate to its text), `bytes:\xNN...` for a piece that is
//! part of a character (OpenAI's notation for tokens that are not valid UTF-8 by themselves),
//! and a special token's name.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::{Deserialize, Serialize};
use tl_engine_core::logprobs::TokenLogprobs;
use tl_engine_core::vocab::Vocab;

use super::{Detok, Flavor, TextRender};

/// The text of token `t` of `vocab`, as logprobs name it.
#[must_use]
pub fn piece_str(vocab: &Vocab, t: u32) -> String {
    let piece = vocab.piece(t);
    match std::str::from_utf8(piece) {
        Ok(s) => s.to_owned(),
        Err(_) => {
            let mut out = String::from("bytes:");
            for b in piece {
                let _ = write!(out, "\\x{b:02x}");
            }
            out
        }
    }
}

/// The text of one token of the fake model's byte vocabulary, as logprobs name it.
#[must_use]
pub fn token_str(t: u32) -> String {
    piece_str(&Vocab::bytes(), t)
}

/// The bytes of one token (chat's `bytes`): none for a special.
#[must_use]
pub fn piece_bytes(vocab: &Vocab, t: u32) -> Option<Vec<u8>> {
    (!vocab.is_special(t)).then(|| vocab.piece(t).to_vec())
}

/// A token's log-probabilities with ids (the `tl_logprobs` extension): what an engine sends the
/// gateway, which renders OpenAI's shapes from it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct TlLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl From<TokenLogprobs> for TlLogprob {
    fn from(l: TokenLogprobs) -> Self {
        Self {
            token: l.token,
            logprob: l.logprob,
            top: l.top,
        }
    }
}

impl From<TlLogprob> for TokenLogprobs {
    fn from(l: TlLogprob) -> Self {
        Self {
            token: l.token,
            logprob: l.logprob,
            top: l.top,
        }
    }
}

/// Completions' `logprobs`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f32>,
    /// The most likely tokens at each step, by text.
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    /// Each token's offset in the completion's text, in characters.
    pub text_offset: Vec<usize>,
}

/// One alternative of chat's `top_logprobs`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ChatTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes (null for a special).
    pub bytes: Option<Vec<u8>>,
}

/// One entry of chat's `logprobs.content`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes (null for a special).
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at this step.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// Chat's `logprobs`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct ChatLogprobs {
    /// One entry per token.
    pub content: Vec<ChatTokenLogprob>,
}

/// A choice's `logprobs`, in its endpoint's shape.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum ChoiceLogprobs {
    /// `/v1/completions`.
    Completion(CompletionLogprobs),
    /// `/v1/chat/completions`.
    Chat(ChatLogprobs),
}

/// Text offsets as a completion streams: the characters of the text before each token.
#[derive(Clone, Debug, Default)]
pub struct Offsets {
    text: Detok,
    chars: usize,
}

impl Offsets {
    /// Offsets in text rendered as `render` says.
    #[must_use]
    pub fn new(render: TextRender) -> Self {
        Self {
            text: Detok::new(render),
            chars: 0,
        }
    }

    /// The offsets of `tokens`, continuing after the ones before.
    pub fn next(&mut self, tokens: &[u32]) -> Vec<usize> {
        tokens
            .iter()
            .map(|&t| {
                let at = self.chars;
                self.chars += self.text.push(&[t]).chars().count();
                at
            })
            .collect()
    }
}

/// `lps` in `flavor`'s shape, with `offsets` (from [`Offsets`]) for a completion; tokens named
/// by `names`'s vocabulary (the checkpoint's tokenizer, or the fake vocabulary).
#[must_use]
pub fn render(
    flavor: Flavor,
    lps: &[TokenLogprobs],
    offsets: Vec<usize>,
    names: &TextRender,
) -> ChoiceLogprobs {
    let vocab = &names.vocab;
    let token_str = |t: u32| piece_str(vocab, t);
    let token_bytes = |t: u32| piece_bytes(vocab, t);
    match flavor {
        Flavor::Completion => ChoiceLogprobs::Completion(CompletionLogprobs {
            tokens: lps.iter().map(|l| token_str(l.token)).collect(),
            token_logprobs: lps.iter().map(|l| l.logprob).collect(),
            top_logprobs: lps
                .iter()
                .map(|l| l.top.iter().map(|&(t, p)| (token_str(t), p)).collect())
                .collect(),
            text_offset: offsets,
        }),
        Flavor::Chat => ChoiceLogprobs::Chat(ChatLogprobs {
            content: lps
                .iter()
                .map(|l| ChatTokenLogprob {
                    token: token_str(l.token),
                    logprob: l.logprob,
                    bytes: token_bytes(l.token),
                    top_logprobs: l
                        .top
                        .iter()
                        .map(|&(t, p)| ChatTopLogprob {
                            token: token_str(t),
                            logprob: p,
                            bytes: token_bytes(t),
                        })
                        .collect(),
                })
                .collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits a model broke into NaN and infinities cross the engine-to-gateway hop and come
    /// back as the same numbers (never JSON `null`, which the gateway could not read, and which
    /// once made it report a healthy engine as lost).
    #[test]
    fn broken_logits_cross_the_wire_as_numbers() {
        let logits = [f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY];
        for token in 0..4 {
            let l = TlLogprob::from(tl_engine_core::logprobs::token_logprobs(&logits, token, 4));
            let json = serde_json::to_string(&l).unwrap();
            assert!(!json.contains("null"), "{json}");
            let back: TlLogprob = serde_json::from_str(&json).unwrap();
            assert_eq!(back, l);
        }
    }

    #[test]
    fn token_strings_are_distinct_and_offsets_count_characters() {
        let names: std::collections::HashSet<String> = (0..260).map(token_str).collect();
        assert_eq!(names.len(), 260, "two tokens share a name");
        assert_eq!(token_str(u32::from(b'a')), "a");
        assert_eq!(token_str(0xC3), "bytes:\\xc3");
        // "aé" then "b": é is two byte tokens, one character.
        let mut o = Offsets::default();
        assert_eq!(o.next(&[0x61, 0xC3]), vec![0, 1]);
        assert_eq!(o.next(&[0xA9, 0x62]), vec![1, 2]);
    }
}
