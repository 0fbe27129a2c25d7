//! The arithmetic of the forward pass, written so that a row's result never depends on what else
//! is computed with it: every reduction runs in one fixed order per row ([`order`]), whatever
//! the batch, the chunking of a prompt, or the number of threads. Weights stay in their
//! checkpoint dtype and are widened to f32 where they are used.
//!
//! - [`order`]: the written reference orders, one per kind of reduction;
//! - [`simd`]: the products on the CPU's vector unit (AVX-512, AVX2), each path falling back
//!   to the written order and held to it bit for bit;
//! - [`gemm`]: the `gemm` crate's micro-kernels, kept as an option.
//!
//! Every product runs on the model's kept [`Workers`]: no kernel starts a thread.

pub mod gemm;
pub mod order;
pub mod simd;

pub use self::order::dot;
pub use crate::dtype::{DType, MatRef, dequantize_block, widen};
use crate::workers::Workers;

/// Which matrix-multiply kernels a model runs. All are batch-invariant; they differ in speed
/// and in what else they promise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// This crate's own vector kernels ([`simd`]): weights read in place, one written order per
    /// output ([`order::dot16`]), on kept threads. The same bits on every CPU, with AVX-512,
    /// AVX2 or neither.
    #[default]
    Simd,
    /// The `gemm` crate's f32 micro-kernels (FMA, chosen at run time for the CPU), driven so
    /// that no row's reduction order depends on its batch (see [`gemm::matmul_gemm`]). The
    /// bits are the same on every machine with the same CPU features.
    Gemm,
    /// [`order::dot16`] as written, in plain Rust ([`simd::Isa::Portable`]): no vector unit
    /// asked for, the same bits as `simd` on every CPU, at a fraction of the speed.
    Portable,
}

impl Kernels {
    /// The kernels a `[model] kernels` value names.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "simd" => Some(Self::Simd),
            "gemm" => Some(Self::Gemm),
            "portable" => Some(Self::Portable),
            _ => None,
        }
    }

    /// The configuration name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Simd => "simd",
            Self::Gemm => "gemm",
            Self::Portable => "portable",
        }
    }
}

/// `out[i][j] = x[i] . w[j] (+ bias[j])` with `kernels` on `workers`.
pub fn matmul(
    kernels: Kernels,
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    workers: &Workers,
) {
    matmul_many(kernels, x, &mut [simd::Product { w, bias, out }], workers);
}

/// Several products of the same rows `x` with `kernels`: with `simd` and `portable` their
/// output rows are split over the threads together (one hand-over for all); `gemm` runs them
/// one by one.
pub fn matmul_many(
    kernels: Kernels,
    x: &[f32],
    products: &mut [simd::Product<'_, '_>],
    workers: &Workers,
) {
    match kernels {
        Kernels::Simd => simd::matmul_many(x, products, workers),
        Kernels::Portable => simd::matmul_many_on(simd::Isa::Portable, x, products, workers),
        Kernels::Gemm => {
            for p in products {
                gemm::matmul_gemm(x, p.w, p.bias, p.out, workers);
            }
        }
    }
}

/// RMSNorm of each `dim`-wide row of `x` in place: `x / sqrt(mean(x^2) + eps) * weight`.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let ms = dot(row, row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// Rotates one head (`cos`/`sin` per pair, half the head long) in Llama's layout: dimension `i`
/// pairs with `i + d/2`.
pub fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    for i in 0..half {
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos[i] - b * sin[i];
        head[i + half] = b * cos[i] + a * sin[i];
    }
}

/// `e^x` in f32, written out so that it is the same bits on every CPU and vectorizes (no call
/// into the C library, whose `expf` differs between its builds): `x` clamped to [-88, 88],
/// split as `n ln 2 + r` with `|r| <= ln 2 / 2` (ln 2 in two parts, so the split is exact to f32),
/// `e^r` as `1 + r + r^2 P(r)` with Cephes' degree-5 minimax `P` (within about 1 ulp), scaled
/// by `2^n` through the exponent bits. Below -87.3 the result is 0 (or a value that small);
/// every step is a plain f32 operation, unfused, in the order written.
#[inline(always)]
#[must_use]
pub fn exp(x: f32) -> f32 {
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let x = x.clamp(-88.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = (x - n * C1) - n * C2;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = (p * (r * r) + r) + 1.0;
    // n is in [-127, 127]: 2^n is a normal f32 for n >= -126, and 0 for n = -127.
    let scale = f32::from_bits(((n as i32 + 127).max(0) as u32) << 23);
    e * scale
}

/// `silu(gate) * up`, element by element, into `gate`.
#[inline(always)]
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let s = *g / (1.0 + exp(-*g));
        *g = s * u;
    }
}

/// `gelu(gate) * up`, element by element, into `gate`, GELU in its tanh form:
/// `x / (1 + e^(-2u))` with `u = sqrt(2/pi) (x + 0.044715 x^3)`, which is
/// `x (1 + tanh u) / 2` with the tanh written through [`exp`] (the same bits on every CPU).
#[inline(always)]
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let t = C * (x + 0.044_715 * x * x * x);
        *g = x / (1.0 + exp(-2.0 * t)) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `rows` x `cols` f32 matrix of values in [-0.5, 0.5), as bytes, from `seed`.
    pub(super) fn mat(rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        (0..rows * cols)
            .flat_map(|i| {
                let v = ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000;
                (v as f32 / 1000.0 - 0.5).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn a_row_is_the_same_bits_in_any_batch_and_on_any_thread_count() {
        let (k, n) = (300, 520);
        let bytes = mat(n, k, 7);
        let w = MatRef {
            bytes: &bytes,
            dtype: DType::F32,
            rows: n,
            cols: k,
        };
        let x: Vec<f32> = (0..9 * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let mut simd = Vec::new();
        for kernels in [Kernels::Simd, Kernels::Gemm, Kernels::Portable] {
            let mut alone = vec![0f32; n];
            matmul(
                kernels,
                &x[4 * k..5 * k],
                w,
                None,
                &mut alone,
                &Workers::new(1),
            );
            for threads in [1, 2, 3] {
                let mut batch = vec![0f32; 9 * n];
                matmul(kernels, &x, w, None, &mut batch, &Workers::new(threads));
                assert_eq!(
                    batch[4 * n..5 * n]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{kernels:?} on {threads} threads"
                );
            }
            match kernels {
                Kernels::Simd => simd = alone.iter().map(|v| v.to_bits()).collect(),
                // The written order, run as written: the vector paths' bits.
                Kernels::Portable => {
                    let bits: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(bits, simd, "portable is simd's order");
                }
                Kernels::Gemm => {}
            }
        }
    }

    /// The written `exp` is within 2.5e-7 (relative: about 2 ulp) of the true value over the
    /// range attention and SiLU use, exact at 0, and 0 far below.
    #[test]
    fn exp_is_close_to_the_c_library_everywhere_it_is_used() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-200.0), 0.0);
        let mut worst = 0f64;
        for i in 0..=2_000_000 {
            let x = -87.0 + 174.0 * f64::from(i) / 2_000_000.0;
            let got = f64::from(exp(x as f32));
            let want = f64::from(x as f32).exp();
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
    }

    #[test]
    fn widening_reads_each_dtype() {
        let mut out = [0f32; 2];
        widen(&[0x80, 0x3f, 0x00, 0xc0], DType::Bf16, &mut out);
        assert_eq!(out, [1.0, -2.0]);
        widen(&[0x00, 0x3c, 0x00, 0xb8], DType::F16, &mut out);
        assert_eq!(out, [1.0, -0.5]);
        // Aligned and unaligned input give the same values, for every dtype and every bit
        // pattern of the two-byte types (a NaN stays a NaN; the hardware conversion may quiet
        // a signalling one, which no K, V or weight the engine computes is).
        let all: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let mut shifted = vec![0u8; all.len() + 1];
        shifted[1..].copy_from_slice(&all);
        for dtype in [DType::Bf16, DType::F16, DType::F32] {
            let n = all.len() / dtype.size();
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            widen(&all, dtype, &mut a);
            widen(&shifted[1..], dtype, &mut b);
            let bits = |v: &[f32]| {
                v.iter()
                    .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&a), bits(&b), "{dtype:?}");
        }
    }
}
