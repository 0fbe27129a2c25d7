//! Constrained decoding (structured outputs): which tokens a sequence may take next.
//!
//! The core knows only this trait; a grammar library implements it outside (the engine crate
//! compiles JSON schemas, regular expressions and grammars with `llguidance`). A constraint is a
//! function of the tokens it was fed, so an engine that continues a sequence (the decode engine
//! after a prefill, a survivor after a failover) rebuilds the same state by feeding it the
//! sequence's output so far: nothing but the grammar's text and the tokens moves.
//!
//! At every sampling step the constraint's mask comes first: a token it does not allow gets a
//! logit of minus infinity before the bias, the penalties and the sampler see the logits (vLLM's
//! order). Where the constraint may end, the request's stop token ids (its EOS among them) are
//! allowed too; sampling one of them ends the sequence as a stop rule does. Where it must end,
//! the sequence ends with `stop` without another token.

/// What a constraint allows next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// These tokens: bit `t % 32` of word `t / 32`; `may_end`: the output is complete here, so
    /// a stop token may end it.
    Allowed {
        /// The allowed tokens, 32 to a word.
        bits: Vec<u32>,
        /// The output may end here.
        may_end: bool,
    },
    /// The output is complete and nothing may follow.
    End,
}

impl Next {
    /// Whether `token` is allowed (a stop token where the output may end included).
    #[must_use]
    pub fn allows(&self, token: u32, stop_ids: &[u32]) -> bool {
        match self {
            Next::Allowed { bits, may_end } => {
                bits.get(token as usize / 32)
                    .is_some_and(|w| w >> (token % 32) & 1 == 1)
                    || (*may_end && stop_ids.contains(&token))
            }
            Next::End => false,
        }
    }
}

/// Why a constraint failed (the grammar library's message).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// A constraint on a sequence's next token, fed every token the sequence takes.
pub trait Constraint: Send + std::fmt::Debug {
    /// What may come next.
    ///
    /// # Errors
    /// The library's failure (a step past its bounds, say).
    fn next(&mut self) -> Result<Next, ConstraintError>;

    /// Takes `token`, which [`next`](Self::next) allowed (or earlier output being replayed).
    ///
    /// # Errors
    /// A token the constraint does not allow.
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;

    /// An independent copy in the same state (for the other choices of a request).
    fn fork(&self) -> Box<dyn Constraint>;
}

impl Clone for Box<dyn Constraint> {
    fn clone(&self) -> Self {
        self.fork()
    }
}

/// `logits` with every token `next` does not allow set to minus infinity.
#[must_use]
pub fn mask(logits: &[f32], next: &Next, stop_ids: &[u32]) -> Vec<f32> {
    logits
        .iter()
        .enumerate()
        .map(|(t, &l)| {
            if next.allows(t as u32, stop_ids) {
                l
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_keeps_allowed_tokens_and_stop_tokens_where_the_output_may_end() {
        let logits = [1.0f32; 40];
        let next = Next::Allowed {
            bits: vec![0b1010, 1 << 1],
            may_end: false,
        };
        let m = mask(&logits, &next, &[39]);
        let kept: Vec<usize> = (0..40).filter(|&t| m[t].is_finite()).collect();
        assert_eq!(kept, [1, 3, 33]);
        let next = Next::Allowed {
            bits: vec![0b1010, 1 << 1],
            may_end: true,
        };
        let m = mask(&logits, &next, &[39]);
        let kept: Vec<usize> = (0..40).filter(|&t| m[t].is_finite()).collect();
        assert_eq!(kept, [1, 3, 33, 39]);
        assert!(
            mask(&logits, &Next::End, &[39])
                .iter()
                .all(|l| l.is_infinite())
        );
    }
}
