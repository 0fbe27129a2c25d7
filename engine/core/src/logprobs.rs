//! Log-probabilities as OpenAI reports them: the log-softmax of the model's logits, before
//! temperature, top-k and top-p, for the chosen token and the `k` most likely ones.
//!
//! Computed in f64 from the f32 logits and rounded to f32 once, by one function: a decode engine
//! that recomputes a step from transferred KV gets the same logits, so the same values bit for
//! bit as the engine that ran the whole request.

/// Most alternatives a step reports (OpenAI's chat limit; completions allow 5).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// What a log-probability that is not a finite number is reported as, end to end (engine,
/// gateway, client): JSON has no NaN or infinity (serde writes `null`, which no reader of an
/// `f32` takes), and a token whose logit is `-inf`, or logits broken into NaN or `+inf` by a
/// model, have no meaningful value. -9999.0 is what vLLM reports for an impossible token.
pub const NOT_FINITE_LOGPROB: f32 = -9999.0;

/// One generated token's log-probability and the most likely alternatives at its step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The token chosen.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The `k` most likely tokens and their log-probabilities, most likely first (ties by lower
    /// token id).
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities of `token` and the `k` most likely tokens under `logits`.
///
/// # Panics
/// If `logits` is empty or `token` is outside it.
#[must_use]
pub fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let max = f64::from(max);
    let sum: f64 = logits.iter().map(|&l| (f64::from(l) - max).exp()).sum();
    let log_z = max + sum.ln();
    let lp = |l: f32| {
        let v = (f64::from(l) - log_z) as f32;
        if v.is_finite() { v } else { NOT_FINITE_LOGPROB }
    };
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(order.len());
    if k > 0 {
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        order.select_nth_unstable_by(k - 1, by_logit);
        order.truncate(k);
        order.sort_unstable_by(by_logit);
    } else {
        order.clear();
    }
    TokenLogprobs {
        token,
        logprob: lp(logits[token as usize]),
        top: order
            .into_iter()
            .map(|t| (t, lp(logits[t as usize])))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 63 (a finding): logits with NaN or infinities give no NaN or infinite
    /// log-probability (JSON cannot carry them): each such value is [`NOT_FINITE_LOGPROB`],
    /// and finite ones are untouched.
    #[test]
    fn logprobs_are_always_finite() {
        for logits in [
            vec![1.0f32, f32::NAN, 0.5],
            vec![1.0, f32::INFINITY, 0.5],
            vec![f32::NEG_INFINITY, 2.0, 0.5],
            vec![f32::NEG_INFINITY; 3],
        ] {
            for token in 0..3 {
                let l = token_logprobs(&logits, token, 3);
                for v in std::iter::once(l.logprob).chain(l.top.iter().map(|t| t.1)) {
                    assert!(v.is_finite(), "{logits:?} token {token}: {v}");
                    assert!(v <= 0.0, "{logits:?}: {v}");
                }
            }
        }
        // -inf on one token among finite ones: that token reports the constant, the others
        // their true values.
        let l = token_logprobs(&[f32::NEG_INFINITY, 0.0, 0.0], 0, 0);
        assert_eq!(l.logprob, NOT_FINITE_LOGPROB);
        let l = token_logprobs(&[f32::NEG_INFINITY, 0.0, 0.0], 1, 0);
        assert_eq!(l.logprob, (0.5f64).ln() as f32);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_in_order() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let l = token_logprobs(&logits, 4, 3);
        let z: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        let want = |i: usize| (f64::from(logits[i]) - z.ln()) as f32;
        assert_eq!(l.logprob, want(4));
        // Ties (tokens 1 and 2) by lower id, then token 0.
        assert_eq!(l.top, vec![(1, want(1)), (2, want(1)), (0, want(0))]);
        let total: f64 = (0..5)
            .map(|i| f64::from(token_logprobs(&logits, i, 0).logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 0, 99).top.len(), 5);
    }
}
