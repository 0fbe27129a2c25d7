//! Request validation, written once. Every door (the gateway's OpenAI endpoint, an engine's HTTP
//! front, `EngineControl.Prefill`, `tl generate`) turns what it received into [`Params`] and calls
//! [`Params::validate`]; each maps the one [`RequestError`] to its own code once (HTTP 400,
//! INVALID_ARGUMENT, exit status), so the same bad request gets the same message everywhere.
//!
//! Checks run in the contract's order: the prompt (empty, a token outside the vocabulary, longer
//! than the context), then `max_tokens`, then the sampling parameters.

use crate::model::Model;
use crate::sampler::{Sampling, SamplingError, SamplingRequest};

/// Why a request was refused before any work.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A token id outside the vocabulary.
    #[error("token {token} at position {pos} is outside the vocabulary of {vocab}")]
    BadToken {
        /// The token.
        token: u32,
        /// Its position.
        pos: usize,
        /// Vocabulary size.
        vocab: u32,
    },
    /// The prompt does not fit the context.
    #[error("the prompt has {len} tokens; the context holds {max}")]
    TooLong {
        /// Prompt length.
        len: usize,
        /// Context length.
        max: u32,
    },
    /// max_tokens must be at least 1.
    #[error("max_tokens must be >= 1")]
    ZeroMaxTokens,
    /// A sampling parameter is out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// `n` outside 1..=max.
    #[error("n must be between 1 and {max}; got {n}")]
    Choices {
        /// Requested choices.
        n: u32,
        /// The most allowed.
        max: u32,
    },
    /// Too many alternatives per token asked for.
    #[error("at most {max} top log-probabilities per token; got {k}")]
    TopLogprobs {
        /// Requested alternatives.
        k: u32,
        /// The most allowed.
        max: u32,
    },
    /// A prefill-only request makes one choice and no log-probabilities (the decode engine
    /// makes the others).
    #[error("a prefill-only request has one choice and no log-probabilities")]
    PrefillChoices,
    /// The constraint refused the sequence's earlier output.
    #[error("structured output: {0}")]
    Constraint(String),
    /// More earlier output than the prompt holds.
    #[error("earlier_output {earlier} is more than the prompt's {len} tokens")]
    EarlierOutput {
        /// Tokens said to be earlier output.
        earlier: u32,
        /// Prompt length.
        len: usize,
    },
    /// Resumed blocks do not cover the prompt.
    #[error("{blocks} blocks cannot hold a prompt of {len} tokens at {block_tokens} per block")]
    BlocksDoNotFit {
        /// Blocks given.
        blocks: usize,
        /// Prompt length.
        len: usize,
        /// B.
        block_tokens: u32,
    },
}

/// What a model accepts: the bounds a request is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Vocabulary size: token ids are below it.
    pub vocab: u32,
    /// Longest prompt, or `None` where the context is not known (the gateway checks what it can;
    /// the engine behind it checks the rest with the same function and message).
    pub max_context: Option<u32>,
}

impl Limits {
    /// The limits of `model`.
    #[must_use]
    pub fn of(model: &dyn Model) -> Self {
        Self {
            vocab: model.vocab(),
            max_context: Some(model.max_context()),
        }
    }
}

/// A generation request as a door received it, before validation.
#[derive(Clone, Debug, PartialEq)]
pub struct Params<'a> {
    /// Prompt token ids.
    pub prompt: &'a [u32],
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Sampling parameters as stated (top_p 0 means 1, the wire's "unset").
    pub sampling: SamplingRequest,
}

impl Params<'_> {
    /// Checks the request against `limits`; returns the validated sampling.
    ///
    /// # Errors
    /// The first problem, in the order of the module docs.
    pub fn validate(&self, limits: Limits) -> Result<Sampling, RequestError> {
        validate_prompt(self.prompt, limits)?;
        if self.max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        Ok(Sampling::new(self.sampling.clone(), limits.vocab)?)
    }
}

/// Checks a prompt alone: not empty, every token in the vocabulary, within the context.
///
/// # Errors
/// The first problem found.
pub fn validate_prompt(prompt: &[u32], limits: Limits) -> Result<(), RequestError> {
    if prompt.is_empty() {
        return Err(RequestError::EmptyPrompt);
    }
    let vocab = limits.vocab;
    if let Some((pos, &token)) = prompt.iter().enumerate().find(|(_, t)| **t >= vocab) {
        return Err(RequestError::BadToken { token, pos, vocab });
    }
    if let Some(max) = limits.max_context
        && prompt.len() > max as usize
    {
        return Err(RequestError::TooLong {
            len: prompt.len(),
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        vocab: 10,
        max_context: Some(4),
    };

    fn params(prompt: &[u32], max_tokens: u32, temperature: f32, top_p: f32) -> Params<'_> {
        Params {
            prompt,
            max_tokens,
            sampling: SamplingRequest {
                temperature,
                top_p,
                top_k: 0,
                ..SamplingRequest::default()
            },
        }
    }

    #[test]
    fn checks_run_in_the_contract_order() {
        let cases: [(Params<'_>, Option<RequestError>); 7] = [
            (params(&[1, 2], 1, 0.0, 1.0), None),
            (params(&[], 0, -1.0, 2.0), Some(RequestError::EmptyPrompt)),
            (
                params(&[1, 10], 0, -1.0, 2.0),
                Some(RequestError::BadToken {
                    token: 10,
                    pos: 1,
                    vocab: 10,
                }),
            ),
            (
                params(&[1; 5], 0, -1.0, 2.0),
                Some(RequestError::TooLong { len: 5, max: 4 }),
            ),
            (
                params(&[1], 0, -1.0, 2.0),
                Some(RequestError::ZeroMaxTokens),
            ),
            (
                params(&[1], 1, -1.0, 2.0),
                Some(RequestError::Sampling(SamplingError::Temperature(-1.0))),
            ),
            // top_p 0 is the wire's "unset": accepted as 1.
            (params(&[1], 1, 0.5, 0.0), None),
        ];
        for (p, want) in cases {
            assert_eq!(p.validate(LIMITS).err(), want, "{p:?}");
        }
        let open = Limits {
            max_context: None,
            ..LIMITS
        };
        assert!(params(&[1; 5], 1, 0.0, 1.0).validate(open).is_ok());
    }
}
