//! PCG-XSH-RR 64/32, exactly as `spec/pcg32.md` says: the generator whose state a prefill
//! engine hands to a decode engine as a count of draws.

use kvwire::fnv1a64;

/// The LCG multiplier of PCG32.
pub const PCG_MULT: u64 = 6_364_136_223_846_793_005;

/// The label of the sampling stream.
pub const SAMPLE_LABEL: &str = "sample";

/// A PCG32 generator (64-bit state, 32-bit output, XSH-RR output function).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pcg32 {
    state: u64,
    inc: u64,
}

impl Pcg32 {
    /// Seeded exactly like the reference `pcg32_srandom_r(initstate, initseq)`.
    #[must_use]
    pub fn new(initstate: u64, initseq: u64) -> Self {
        let mut rng = Pcg32 {
            state: 0,
            inc: (initseq << 1) | 1,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(initstate);
        rng.step();
        rng
    }

    #[inline]
    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// The next 32-bit output.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.step();
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// One draw: a uniform in `[0, 1)` from two outputs `a` then `b`: `((a << 32 | b) >> 11) * 2^-53`.
    #[inline]
    pub fn uniform_f64(&mut self) -> f64 {
        let a = u64::from(self.next_u32());
        let b = u64::from(self.next_u32());
        ((a << 32 | b) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Jumps ahead by `delta` outputs in O(log delta) (Brown's LCG skip-ahead).
    pub fn advance(&mut self, mut delta: u64) {
        let (mut acc_mult, mut acc_plus) = (1u64, 0u64);
        let (mut cur_mult, mut cur_plus) = (PCG_MULT, self.inc);
        while delta > 0 {
            if delta & 1 == 1 {
                acc_mult = acc_mult.wrapping_mul(cur_mult);
                acc_plus = acc_plus.wrapping_mul(cur_mult).wrapping_add(cur_plus);
            }
            cur_plus = cur_mult.wrapping_add(1).wrapping_mul(cur_plus);
            cur_mult = cur_mult.wrapping_mul(cur_mult);
            delta >>= 1;
        }
        self.state = acc_mult.wrapping_mul(self.state).wrapping_add(acc_plus);
    }
}

/// The stream named `label` of `seed`: `Pcg32::new(seed, fnv1a64(label))`.
#[must_use]
pub fn stream(seed: u64, label: &str) -> Pcg32 {
    Pcg32::new(seed, fnv1a64(label.as_bytes()))
}

/// The sampling stream of `seed` after `draws` uniforms (two outputs each) were taken.
#[must_use]
pub fn resume_rng(seed: u64, draws: u64) -> Pcg32 {
    let mut rng = stream(seed, SAMPLE_LABEL);
    rng.advance(draws.wrapping_mul(2));
    rng
}

/// A seed from the process's randomness (std's per-process SipHash keys and the clock), for
/// requests that do not give one and for ids that must not be guessable from a counter.
#[must_use]
pub fn entropy_seed() -> u64 {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one(nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_rng_hands_off_the_draws() {
        // The reference known answer.
        let mut r = Pcg32::new(42, 54);
        let got: Vec<u32> = (0..6).map(|_| r.next_u32()).collect();
        assert_eq!(
            got,
            [
                0xa15c02b7, 0x7b47f409, 0xba1d3330, 0x83d2f293, 0xbfa4784b, 0xcbed606e
            ]
        );

        // advance(n) equals n single steps, for a spread of n (0 included).
        for n in [0u64, 1, 2, 3, 7, 64, 1000, 12_345] {
            let mut stepped = Pcg32::new(7, 11);
            for _ in 0..n {
                stepped.next_u32();
            }
            let mut jumped = Pcg32::new(7, 11);
            jumped.advance(n);
            assert_eq!(jumped, stepped, "n = {n}");
        }

        // resume_rng(seed, k) is the sampling stream after k uniforms, for k = 0, 1, 2.
        for seed in [0u64, 1, 0xdead_beef] {
            let mut live = stream(seed, "sample");
            for k in 0..3u64 {
                let mut resumed = resume_rng(seed, k);
                assert_eq!(resumed, live, "seed {seed} k {k}");
                assert_eq!(
                    resumed.uniform_f64().to_bits(),
                    live.clone().uniform_f64().to_bits()
                );
                live.uniform_f64();
            }
        }
        // Different labels are different streams.
        assert_ne!(stream(1, "sample"), stream(1, "logits"));
    }

    #[test]
    fn uniform_is_in_unit_interval_and_uses_53_bits() {
        let mut r = stream(3, "sample");
        for _ in 0..10_000 {
            let u = r.uniform_f64();
            assert!((0.0..1.0).contains(&u));
        }
        // (a << 32 | b) >> 11 for a = b = u32::MAX is the largest value below 1.
        let x = (u64::MAX >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        assert!(x < 1.0);
    }
}
