//! Sampling one token: greedy, temperature, top-k, top-p, exactly as `spec/pcg32.md` says.
//!
//! Parameters arrive as f32 on every path (gRPC, HTTP JSON, CLI) and are validated once into a
//! [`Sampling`]; they are widened to f64 only here, so the same request samples the same tokens
//! whichever way it came in.

use crate::rng::Pcg32;

/// Sampling parameters as a request states them, before validation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingRequest {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 0 means 1 (the wire's default).
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: u32,
}

impl Default for SamplingRequest {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
        }
    }
}

/// Validated sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    temperature: f32,
    top_p: f32,
    top_k: u32,
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
}

impl Sampling {
    /// Greedy decoding.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
    };

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
        Ok(Self {
            temperature: req.temperature,
            top_p,
            top_k: req.top_k,
        })
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

    /// Samples one token from `logits`; returns it and the number of draws taken (0 or 1).
    ///
    /// Greedy takes the argmax (lowest index on ties). Otherwise: logits / T, top-k, top-p over
    /// the softmax of the top-k survivors, then one draw `u` and the first survivor, in order of
    /// descending probability (ties by lower index), whose cumulative weight exceeds `u * total`.
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn sample(&self, logits: &[f32], rng: &mut Pcg32) -> (u32, u32) {
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
        if self.top_k > 0 {
            cand.truncate(self.top_k as usize);
        }
        let max = cand[0].1;
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
        }
    }

    #[test]
    fn greedy_takes_argmax_lowest_index_and_no_draw() {
        let mut rng = stream(1, "sample");
        let before = rng;
        let s = Sampling::new(SamplingRequest::default(), 10).unwrap();
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0], &mut rng), (1, 0));
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
                    let (t, d) = s.sample(&logits, &mut rng);
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
            assert_eq!(s.sample(&logits, &mut rng), (1, 1));
        }
        // top_k = 2 only ever yields the two best.
        let s = Sampling::new(req(1.0, 1.0, 2), 4).unwrap();
        let seen: std::collections::BTreeSet<u32> =
            (0..500).map(|_| s.sample(&logits, &mut rng).0).collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [1, 2]);
        // A tiny top_p keeps only the most likely token.
        let s = Sampling::new(req(1.0, 1e-6, 0), 4).unwrap();
        assert!((0..100).all(|_| s.sample(&logits, &mut rng).0 == 1));
        // p(1) = e^5 / (e^5 + e^4 + e + 1) ~ 0.7; top_p just above that keeps two, at it one.
        let w: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
        let p1 = (w[1] / w.iter().sum::<f64>()) as f32;
        let s = Sampling::new(req(1.0, p1 * 0.999, 0), 4).unwrap();
        assert!((0..300).all(|_| s.sample(&logits, &mut rng).0 == 1));
        let s = Sampling::new(req(1.0, (p1 + 0.01).min(1.0), 0), 4).unwrap();
        let seen: std::collections::BTreeSet<u32> =
            (0..500).map(|_| s.sample(&logits, &mut rng).0).collect();
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
}
