//! Sampling one token: logit bias, penalties, greedy, temperature, min-p, top-k, top-p, exactly
//! as `spec/pcg32.md` says.
//!
//! Parameters arrive as f32 on every path (gRPC, HTTP JSON, CLI) and are validated once into a
//! [`Sampling`]; they are widened to f64 only here, so the same request samples the same tokens
//! whichever way it came in.
//!
//! Penalties and biases change the logits before anything else, in vLLM's order and f32
//! arithmetic: `logit_bias` added, then the repetition penalty on every token of the prompt or
//! the output, then the frequency and presence penalties on the output's tokens. They read only
//! the sequence's own tokens ([`History`]), so an engine that resumes a sequence from its tokens
//! applies exactly what the engine before it would have: nothing but the tokens has to move.

use std::sync::Arc;

use crate::rng::Pcg32;

/// The most `logit_bias` entries a request may carry (each is applied on every token).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Sampling parameters as a request states them, before validation.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingRequest {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 0 means 1 (the wire's default).
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: u32,
    /// Keep the tokens at least this fraction as likely as the most likely one; 0 = off.
    pub min_p: f32,
    /// Subtracted once from every token the output holds; in [-2, 2], 0 = off.
    pub presence_penalty: f32,
    /// Subtracted from each token's logit per time the output holds it; in [-2, 2], 0 = off.
    pub frequency_penalty: f32,
    /// Divides the positive logits (multiplies the others) of every token the prompt or the
    /// output holds; > 0, 1 = off, and 0 means 1 (the wire's default).
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens, each in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingRequest {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

/// Validated sampling parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    temperature: f32,
    top_p: f32,
    top_k: u32,
    min_p: f32,
    presence: f32,
    frequency: f32,
    repetition: f32,
    /// Sorted by token, one entry per token.
    bias: Arc<[(u32, f32)]>,
}

/// The tokens a sequence holds, which the penalties read: its prompt and what it has generated
/// (on an engine that continues a sequence, the tokens generated before it are `output`).
#[derive(Clone, Copy, Debug, Default)]
pub struct History<'a> {
    /// The request's prompt.
    pub prompt: &'a [u32],
    /// The tokens generated so far.
    pub output: &'a [u32],
}

/// Why sampling parameters were refused (gRPC INVALID_ARGUMENT, HTTP 400).
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    /// temperature must be finite and >= 0.
    #[error("temperature {0} must be finite and >= 0")]
    Temperature(f32),
    /// top_p must be in (0, 1].
    #[error("top_p {0} must be in (0, 1]")]
    TopP(f32),
    /// top_k must not exceed the vocabulary.
    #[error("top_k {top_k} exceeds the vocabulary of {vocab}")]
    TopK {
        /// Requested k.
        top_k: u32,
        /// Vocabulary size.
        vocab: u32,
    },
    /// min_p must be in [0, 1].
    #[error("min_p {0} must be in [0, 1]")]
    MinP(f32),
    /// presence_penalty must be in [-2, 2].
    #[error("presence_penalty {0} must be in [-2, 2]")]
    PresencePenalty(f32),
    /// frequency_penalty must be in [-2, 2].
    #[error("frequency_penalty {0} must be in [-2, 2]")]
    FrequencyPenalty(f32),
    /// repetition_penalty must be finite and > 0.
    #[error("repetition_penalty {0} must be finite and > 0")]
    RepetitionPenalty(f32),
    /// Too many logit_bias entries.
    #[error("logit_bias has {0} entries; at most {MAX_LOGIT_BIAS}")]
    LogitBiasEntries(usize),
    /// A logit_bias token outside the vocabulary.
    #[error("logit_bias token {token} is outside the vocabulary of {vocab}")]
    LogitBiasToken {
        /// The token.
        token: u32,
        /// Vocabulary size.
        vocab: u32,
    },
    /// A logit_bias value outside [-100, 100].
    #[error("logit_bias for token {token} is {bias}; biases are in [-100, 100]")]
    LogitBiasValue {
        /// The token.
        token: u32,
        /// Its bias.
        bias: f32,
    },
}

impl SamplingError {
    /// The request field it is about, as the OpenAI API names it.
    #[must_use]
    pub fn field(&self) -> &'static str {
        match self {
            Self::Temperature(_) => "temperature",
            Self::TopP(_) => "top_p",
            Self::TopK { .. } => "top_k",
            Self::MinP(_) => "min_p",
            Self::PresencePenalty(_) => "presence_penalty",
            Self::FrequencyPenalty(_) => "frequency_penalty",
            Self::RepetitionPenalty(_) => "repetition_penalty",
            Self::LogitBiasEntries(_)
            | Self::LogitBiasToken { .. }
            | Self::LogitBiasValue { .. } => "logit_bias",
        }
    }
}

impl Sampling {
    /// Greedy decoding.
    #[must_use]
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            bias: Arc::new([]),
        }
    }

    /// Validates `req` for a model of `vocab` tokens.
    ///
    /// # Errors
    /// A [`SamplingError`] naming the first out-of-range parameter.
    pub fn new(req: SamplingRequest, vocab: u32) -> Result<Self, SamplingError> {
        if !req.temperature.is_finite() || req.temperature < 0.0 {
            return Err(SamplingError::Temperature(req.temperature));
        }
        // 0 on the wire is "unset", which means 1.
        let top_p = if req.top_p == 0.0 { 1.0 } else { req.top_p };
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(SamplingError::TopP(req.top_p));
        }
        if req.top_k > vocab {
            return Err(SamplingError::TopK {
                top_k: req.top_k,
                vocab,
            });
        }
        if !(0.0..=1.0).contains(&req.min_p) {
            return Err(SamplingError::MinP(req.min_p));
        }
        if !(-2.0..=2.0).contains(&req.presence_penalty) {
            return Err(SamplingError::PresencePenalty(req.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&req.frequency_penalty) {
            return Err(SamplingError::FrequencyPenalty(req.frequency_penalty));
        }
        let repetition = if req.repetition_penalty == 0.0 {
            1.0
        } else {
            req.repetition_penalty
        };
        if !repetition.is_finite() || repetition <= 0.0 {
            return Err(SamplingError::RepetitionPenalty(req.repetition_penalty));
        }
        if req.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(SamplingError::LogitBiasEntries(req.logit_bias.len()));
        }
        let mut bias = req.logit_bias;
        for &(token, b) in &bias {
            if token >= vocab {
                return Err(SamplingError::LogitBiasToken { token, vocab });
            }
            if !(-100.0..=100.0).contains(&b) {
                return Err(SamplingError::LogitBiasValue { token, bias: b });
            }
        }
        // One entry per token, the last stated winning (as a JSON object's last key does).
        bias.reverse();
        bias.sort_by_key(|&(t, _)| t);
        bias.dedup_by_key(|&mut (t, _)| t);
        Ok(Self {
            temperature: req.temperature,
            top_p,
            top_k: req.top_k,
            min_p: req.min_p,
            presence: req.presence_penalty,
            frequency: req.frequency_penalty,
            repetition,
            bias: bias.into(),
        })
    }

    /// The request these parameters were validated from (for a peer that validates again).
    #[must_use]
    pub fn request(&self) -> SamplingRequest {
        SamplingRequest {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence,
            frequency_penalty: self.frequency,
            repetition_penalty: self.repetition,
            logit_bias: self.bias.to_vec(),
        }
    }

    /// True when sampling consumes no draws.
    #[must_use]
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Draws every token takes: 0 greedy, 1 otherwise (`spec/pcg32.md`).
    #[must_use]
    pub fn draws_per_token(&self) -> u32 {
        u32::from(!self.is_greedy())
    }

    /// The validated temperature.
    #[must_use]
    pub fn temperature(&self) -> f32 {
        self.temperature
    }

    /// The validated top_p (never 0).
    #[must_use]
    pub fn top_p(&self) -> f32 {
        self.top_p
    }

    /// The validated top_k (0 = off).
    #[must_use]
    pub fn top_k(&self) -> u32 {
        self.top_k
    }

    /// True when the logits are changed before sampling (a bias or a penalty is set).
    #[must_use]
    pub fn reshapes_logits(&self) -> bool {
        !self.bias.is_empty()
            || self.presence != 0.0
            || self.frequency != 0.0
            || self.repetition != 1.0
    }

    /// `logits` with the bias and the penalties applied, in vLLM's order and f32 arithmetic:
    /// bias; repetition (`l / r` where `l > 0`, else `l * r`) on every token of the prompt or
    /// the output; then `l -= frequency * count + presence` on every token the output holds.
    #[must_use]
    pub fn reshape(&self, logits: &[f32], history: History<'_>) -> Vec<f32> {
        let mut l = logits.to_vec();
        for &(t, b) in self.bias.iter() {
            if let Some(x) = l.get_mut(t as usize) {
                *x += b;
            }
        }
        if self.repetition != 1.0 {
            let mut seen = vec![false; l.len()];
            for &t in history.prompt.iter().chain(history.output) {
                if let Some(s) = seen.get_mut(t as usize) {
                    *s = true;
                }
            }
            for (x, _) in l.iter_mut().zip(&seen).filter(|(_, s)| **s) {
                *x = if *x > 0.0 {
                    *x / self.repetition
                } else {
                    *x * self.repetition
                };
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            let mut counts: std::collections::BTreeMap<u32, u32> = Default::default();
            for &t in history.output {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= self.frequency * n as f32;
                    *x -= self.presence;
                }
            }
        }
        l
    }

    /// Samples one token from `logits` for a sequence holding `history`; returns it and the
    /// number of draws taken (0 or 1). The bias and penalties apply first
    /// ([`reshape`](Self::reshape)).
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn sample(&self, logits: &[f32], history: History<'_>, rng: &mut Pcg32) -> (u32, u32) {
        if self.reshapes_logits() {
            self.sample_reshaped(&self.reshape(logits, history), rng)
        } else {
            self.sample_reshaped(logits, rng)
        }
    }

    /// Samples from logits the bias and penalties were already applied to.
    ///
    /// Greedy takes the argmax (lowest index on ties). Otherwise: logits / T, min-p and top-k
    /// (each keeps a prefix of the candidates in order of descending probability, ties by lower
    /// index), top-p over the softmax of those survivors, then one draw `u` and the first
    /// survivor whose cumulative weight exceeds `u * total`.
    fn sample_reshaped(&self, logits: &[f32], rng: &mut Pcg32) -> (u32, u32) {
        assert!(!logits.is_empty(), "no logits to sample from");
        if self.is_greedy() {
            let mut best = 0;
            for (i, &l) in logits.iter().enumerate() {
                if l > logits[best] {
                    best = i;
                }
            }
            return (best as u32, 0);
        }
        let t = f64::from(self.temperature);
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, f64::from(l) / t))
            .collect();
        // Descending by scaled logit (= by probability), ties by lower index.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // Tokens a constraint ruled out (minus infinity) are never candidates, not even as the
        // rounding's last resort.
        let possible = cand.iter().take_while(|c| c.1 > f64::NEG_INFINITY).count();
        cand.truncate(possible.max(1));
        let max = cand[0].1;
        if self.min_p > 0.0 {
            // p_i / p_max = exp(s_i - s_max) >= min_p; the first candidate always stays.
            let floor = f64::from(self.min_p).ln();
            let keep = cand.iter().take_while(|&&(_, s)| s - max >= floor).count();
            cand.truncate(keep.max(1));
        }
        if self.top_k > 0 {
            cand.truncate(self.top_k as usize);
        }
        let mut weights: Vec<f64> = cand.iter().map(|&(_, s)| (s - max).exp()).collect();
        if self.top_p < 1.0 {
            let total: f64 = weights.iter().sum();
            let p = f64::from(self.top_p);
            let mut cum = 0.0;
            let mut keep = weights.len();
            for (i, w) in weights.iter().enumerate() {
                cum += w / total;
                if cum >= p {
                    keep = i + 1;
                    break;
                }
            }
            weights.truncate(keep);
        }
        let total: f64 = weights.iter().sum();
        let target = rng.uniform_f64() * total;
        let mut cum = 0.0;
        for (i, w) in weights.iter().enumerate() {
            cum += w;
            if cum > target {
                return (cand[i].0, 1);
            }
        }
        // Rounding left the target at the very top: the last survivor.
        (cand[weights.len() - 1].0, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::stream;

    fn req(temperature: f32, top_p: f32, top_k: u32) -> SamplingRequest {
        SamplingRequest {
            temperature,
            top_p,
            top_k,
            ..SamplingRequest::default()
        }
    }

    #[test]
    fn greedy_takes_argmax_lowest_index_and_no_draw() {
        let mut rng = stream(1, "sample");
        let before = rng;
        let s = Sampling::new(SamplingRequest::default(), 10).unwrap();
        assert_eq!(
            s.sample(&[1.0, 3.0, 3.0, 2.0], History::default(), &mut rng),
            (1, 0)
        );
        assert_eq!(rng, before, "greedy consumed a draw");
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_takes_one_draw() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.7).collect();
        let s = Sampling::new(req(0.8, 0.9, 20), 50).unwrap();
        let run = |seed| {
            let mut rng = stream(seed, "sample");
            let toks: Vec<u32> = (0..32)
                .map(|_| {
                    let (t, d) = s.sample(&logits, History::default(), &mut rng);
                    assert_eq!(d, 1);
                    t
                })
                .collect();
            toks
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn top_k_and_top_p_boundaries() {
        let logits = [0.0f32, 5.0, 4.0, 1.0];
        // top_k = 1 is greedy with a draw.
        let s = Sampling::new(req(1.0, 1.0, 1), 4).unwrap();
        let mut rng = stream(9, "sample");
        for _ in 0..100 {
            assert_eq!(s.sample(&logits, History::default(), &mut rng), (1, 1));
        }
        // top_k = 2 only ever yields the two best.
        let s = Sampling::new(req(1.0, 1.0, 2), 4).unwrap();
        let seen: std::collections::BTreeSet<u32> = (0..500)
            .map(|_| s.sample(&logits, History::default(), &mut rng).0)
            .collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [1, 2]);
        // A tiny top_p keeps only the most likely token.
        let s = Sampling::new(req(1.0, 1e-6, 0), 4).unwrap();
        assert!((0..100).all(|_| s.sample(&logits, History::default(), &mut rng).0 == 1));
        // p(1) = e^5 / (e^5 + e^4 + e + 1) ~ 0.7; top_p just above that keeps two, at it one.
        let w: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
        let p1 = (w[1] / w.iter().sum::<f64>()) as f32;
        let s = Sampling::new(req(1.0, p1 * 0.999, 0), 4).unwrap();
        assert!((0..300).all(|_| s.sample(&logits, History::default(), &mut rng).0 == 1));
        let s = Sampling::new(req(1.0, (p1 + 0.01).min(1.0), 0), 4).unwrap();
        let seen: std::collections::BTreeSet<u32> = (0..500)
            .map(|_| s.sample(&logits, History::default(), &mut rng).0)
            .collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn validation_ranges() {
        assert_eq!(
            Sampling::new(req(-1.0, 1.0, 0), 4),
            Err(SamplingError::Temperature(-1.0))
        );
        assert!(Sampling::new(req(f32::NAN, 1.0, 0), 4).is_err());
        assert!(Sampling::new(req(f32::INFINITY, 1.0, 0), 4).is_err());
        assert_eq!(
            Sampling::new(req(1.0, 1.5, 0), 4),
            Err(SamplingError::TopP(1.5))
        );
        assert!(Sampling::new(req(1.0, -0.1, 0), 4).is_err());
        assert_eq!(Sampling::new(req(1.0, 0.0, 0), 4).unwrap().top_p(), 1.0);
        assert_eq!(
            Sampling::new(req(1.0, 1.0, 5), 4),
            Err(SamplingError::TopK { top_k: 5, vocab: 4 })
        );
        assert!(Sampling::new(req(1.0, 1.0, 4), 4).is_ok());
    }

    fn with(f: impl FnOnce(&mut SamplingRequest)) -> Sampling {
        let mut r = SamplingRequest::default();
        f(&mut r);
        Sampling::new(r, 6).unwrap()
    }

    #[test]
    fn penalties_follow_vllms_definition() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -0.5, 1.0];
        let h = History {
            prompt: &[0, 1],
            output: &[3, 3, 4],
        };
        // Repetition: every token of the prompt or the output; positive divided, others
        // multiplied.
        let r = with(|r| r.repetition_penalty = 2.0).reshape(&logits, h);
        assert_eq!(r, [1.0, -2.0, 0.5, 1.5, -1.0, 1.0]);
        // Frequency: per occurrence in the output only (token 3 twice, 4 once; the prompt's
        // tokens untouched).
        let f = with(|r| r.frequency_penalty = 0.5).reshape(&logits, h);
        assert_eq!(f, [2.0, -1.0, 0.5, 2.0, -1.0, 1.0]);
        // Presence: once per token the output holds.
        let p = with(|r| r.presence_penalty = -0.25).reshape(&logits, h);
        assert_eq!(p, [2.0, -1.0, 0.5, 3.25, -0.25, 1.0]);
        // Bias first, then repetition on the biased value: token 1's -1 + 3 = 2 is positive,
        // so it is divided.
        let b = with(|r| {
            r.logit_bias = vec![(1, 3.0), (5, -100.0)];
            r.repetition_penalty = 2.0;
        })
        .reshape(&logits, h);
        assert_eq!(b, [1.0, 1.0, 0.5, 1.5, -1.0, -99.0]);
        // All off: the logits as they were, and no copy asked for.
        let off = with(|_| {});
        assert!(!off.reshapes_logits());
        assert_eq!(off.reshape(&logits, h), logits);
    }

    #[test]
    fn penalties_steer_greedy_and_bias_forces_a_token() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -0.5, 1.0];
        let mut rng = stream(3, "sample");
        let h = History {
            prompt: &[0],
            output: &[3],
        };
        assert_eq!(with(|_| {}).sample(&logits, h, &mut rng), (3, 0));
        // 3 - 2 (frequency) = 1 < 2: token 0 wins.
        let s = with(|r| r.frequency_penalty = 2.0);
        assert_eq!(s.sample(&logits, h, &mut rng), (0, 0));
        // Repetition 4 on both 0 and 3 leaves 0.5 and 0.75: token 5 (1.0) wins.
        let s = with(|r| r.repetition_penalty = 4.0);
        assert_eq!(s.sample(&logits, h, &mut rng), (5, 0));
        // A +100 bias wins under sampling too.
        let s = with(|r| {
            r.temperature = 1.0;
            r.logit_bias = vec![(4, 100.0)];
        });
        assert!((0..200).all(|_| s.sample(&logits, h, &mut rng).0 == 4));
    }

    #[test]
    fn min_p_keeps_tokens_at_least_that_fraction_as_likely_as_the_best() {
        // At T = 1, p_i / p_max = exp(l_i - 3): 1, 0.37 (2.0), 0.14 (1.0), 0.08 (0.5), ...
        let logits = [2.0f32, -1.0, 0.5, 3.0, -0.5, 1.0];
        let mut rng = stream(11, "sample");
        let seen = |min_p: f32, rng: &mut Pcg32| {
            let s = with(|r| {
                r.temperature = 1.0;
                r.min_p = min_p;
            });
            (0..2000)
                .map(|_| s.sample(&logits, History::default(), rng).0)
                .collect::<std::collections::BTreeSet<u32>>()
                .into_iter()
                .collect::<Vec<_>>()
        };
        assert_eq!(seen(0.3, &mut rng), [0, 3]);
        assert_eq!(seen(0.1, &mut rng), [0, 3, 5]);
        assert_eq!(seen(1.0, &mut rng), [3]);
        assert_eq!(seen(0.0, &mut rng), [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn penalty_and_bias_ranges_are_checked() {
        let bad = |f: fn(&mut SamplingRequest)| {
            let mut r = SamplingRequest::default();
            f(&mut r);
            Sampling::new(r, 6).unwrap_err()
        };
        assert_eq!(bad(|r| r.min_p = 1.5), SamplingError::MinP(1.5));
        assert_eq!(
            bad(|r| r.presence_penalty = 2.5),
            SamplingError::PresencePenalty(2.5)
        );
        assert!(matches!(
            bad(|r| r.frequency_penalty = f32::NAN),
            SamplingError::FrequencyPenalty(_)
        ));
        assert_eq!(
            bad(|r| r.repetition_penalty = -1.0),
            SamplingError::RepetitionPenalty(-1.0)
        );
        assert_eq!(
            bad(|r| r.logit_bias = vec![(6, 1.0)]),
            SamplingError::LogitBiasToken { token: 6, vocab: 6 }
        );
        assert_eq!(
            bad(|r| r.logit_bias = vec![(2, 101.0)]),
            SamplingError::LogitBiasValue {
                token: 2,
                bias: 101.0
            }
        );
        assert_eq!(
            bad(|r| r.logit_bias = vec![(0, 1.0); MAX_LOGIT_BIAS + 1]),
            SamplingError::LogitBiasEntries(MAX_LOGIT_BIAS + 1)
        );
        // 0 on the wire means 1; a token stated twice keeps its last bias.
        let s = with(|r| {
            r.repetition_penalty = 0.0;
            r.logit_bias = vec![(2, 1.0), (2, -1.0)];
        });
        assert_eq!(s.request().repetition_penalty, 1.0);
        assert_eq!(s.request().logit_bias, [(2, -1.0)]);
    }
}
