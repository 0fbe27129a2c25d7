//! The arithmetic of the forward pass, written so that a row's result never depends on what else
//! is computed with it: every reduction runs in one fixed order per row (eight lanes over the
//! row, combined in a fixed tree, then the tail), whatever the batch, the chunking of a prompt,
//! or the number of threads. Rust does not reassociate floating-point sums, so the order written
//! is the order run, on every CPU. Weights stay in their checkpoint dtype and are widened to f32
//! one row at a time.

pub use crate::dtype::{DType, MatRef, dequantize_block, widen};
use crate::workers::Workers;

/// Which matrix-multiply kernels a model runs. All are batch-invariant; they differ in speed
/// and in what else they promise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// This crate's own vector kernels ([`crate::simd`]): bf16 and f32 weights read in place,
    /// one written order per output (sixteen fused lanes, a fixed tree), on kept threads. The
    /// same bits on every CPU, with AVX-512, AVX2 or neither.
    #[default]
    Simd,
    /// The `gemm` crate's f32 micro-kernels (FMA, chosen at run time for the CPU), driven so
    /// that no row's reduction order depends on its batch (see [`matmul_gemm`]). The bits are
    /// the same on every machine with the same CPU features.
    Gemm,
    /// The plain Rust kernels ([`matmul_portable`]): no FMA, one written order, so the same
    /// bits on every CPU (a fleet of mixed CPUs stays exact), at a fraction of the speed.
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
    match kernels {
        Kernels::Simd => crate::simd::matmul_simd(x, w, bias, out, workers),
        Kernels::Gemm => matmul_gemm(x, w, bias, out, workers.threads()),
        Kernels::Portable => matmul_portable(x, w, bias, out, workers.threads()),
    }
}

/// Several products of the same rows `x` with `kernels`: with `simd` their output rows are
/// split over the threads together (one hand-over for all); the others run one by one.
pub fn matmul_many(
    kernels: Kernels,
    x: &[f32],
    products: &mut [crate::simd::Product<'_, '_>],
    workers: &Workers,
) {
    match kernels {
        Kernels::Simd => crate::simd::matmul_many(x, products, workers),
        _ => {
            for p in products {
                matmul(kernels, x, p.w, p.bias, p.out, workers);
            }
        }
    }
}

/// The dot product of `a` and `b` in the one fixed order: eight running sums over the row's
/// full groups of eight, combined as ((0+1)+(2+3))+((4+5)+(6+7)), then the tail in order.
#[must_use]
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let full = n / 8 * 8;
    for (x, y) in a[..full].chunks_exact(8).zip(b[..full].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for i in full..n {
        s += a[i] * b[i];
    }
    s
}

/// [`dot`] of `x` with four rows at once, sharing the loads of `x`: each result is the same
/// bits as [`dot`] of `x` with that row (the same eight running sums, the same combination).
#[must_use]
#[inline(always)]
pub fn dot4(x: &[f32], w: [&[f32]; 4]) -> [f32; 4] {
    let n = x.len();
    let full = n / 8 * 8;
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i < full {
        let xs = &x[i..i + 8];
        for (a, r) in acc.iter_mut().zip(&w) {
            let ws = &r[i..i + 8];
            for l in 0..8 {
                a[l] += xs[l] * ws[l];
            }
        }
        i += 8;
    }
    let mut out = [0f32; 4];
    for ((o, a), r) in out.iter_mut().zip(&acc).zip(&w) {
        let mut s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        for t in full..n {
            s += x[t] * r[t];
        }
        *o = s;
    }
    out
}

/// [`dot4`] of each `k`-wide row of `x` with the four rows `w`, into `out`. (An AVX2 build of
/// this loop, chosen at run time, gave the same bits but ran a third slower on an AMD EPYC of
/// family 26: the baseline build is kept.)
fn quads(x: &[f32], w: [&[f32]; 4], k: usize, out: &mut [[f32; 4]]) {
    for (i, q) in out.iter_mut().enumerate() {
        *q = dot4(&x[i * k..(i + 1) * k], w);
    }
}

/// A product's sizes: `m` rows of `x`, `k` inputs, `n` outputs (`out` holds `m x n`).
fn dims(x: &[f32], w: MatRef<'_>, out: &[f32]) -> (usize, usize, usize) {
    let (k, n) = (w.cols, w.rows);
    let m = x.len() / k.max(1);
    debug_assert_eq!(out.len(), m * n);
    (m, k, n)
}

/// The portable kernels' [`matmul`]: `out[i][j] = x[i] . w[j] (+ bias[j])` for the `m = x.len() / w.cols` rows of `x`: each weight
/// row is widened once and used for every row of the batch, so a decode step reads each weight
/// byte once whatever its batch. The columns are split over up to `threads` threads; each output
/// is computed by one thread in the fixed order of [`dot`], so the result is the same bits for
/// any batch and any thread count.
pub fn matmul_portable(
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) {
    let (m, k, n) = dims(x, w, out);
    let threads = threads.clamp(1, n.max(1));
    // Small products are not worth a thread.
    let threads = if n * k < 1 << 16 { 1 } else { threads };
    let per = n.div_ceil(threads);
    // Four weight rows at a time share each load of a batch row; a remainder one by one.
    // Either way each output is `dot` in its one order, so the grouping changes no bit.
    let column = |j0: usize, j1: usize, dst: &mut Vec<f32>| {
        let mut rows = vec![0f32; 4 * k];
        let mut j = j0;
        let mut quad = vec![[0f32; 4]; m];
        while j + 4 <= j1 {
            for (r, chunk) in rows.chunks_exact_mut(k).enumerate() {
                w.row_into(j + r, chunk);
            }
            let (r0, rest) = rows.split_at(k);
            let (r1, rest) = rest.split_at(k);
            let (r2, r3) = rest.split_at(k);
            quads(x, [r0, r1, r2, r3], k, &mut quad);
            for r in 0..4 {
                let b = bias.map_or(0.0, |b| b[j + r]);
                dst.extend(quad.iter().map(|q| q[r] + b));
            }
            j += 4;
        }
        while j < j1 {
            let row = &mut rows[..k];
            w.row_into(j, row);
            let b = bias.map_or(0.0, |b| b[j]);
            for i in 0..m {
                dst.push(dot(&x[i * k..(i + 1) * k], row) + b);
            }
            j += 1;
        }
    };
    if threads == 1 {
        let mut t = Vec::with_capacity(m * n);
        column(0, n, &mut t);
        scatter(&t, 0, n, m, out);
        return;
    }
    let parts: Vec<(usize, usize, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (j0, j1) = (t * per, ((t + 1) * per).min(n));
                s.spawn(move || {
                    let mut v = Vec::with_capacity((j1.saturating_sub(j0)) * m);
                    column(j0, j1.max(j0), &mut v);
                    (j0, j1.max(j0), v)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a matmul thread panicked"))
            .collect()
    });
    for (j0, j1, v) in parts {
        scatter(&v, j0, j1, m, &mut *out);
    }
}

/// Writes columns `j0..j1` (stored column-major, `m` per column) into the row-major `out`.
fn scatter(cols: &[f32], j0: usize, j1: usize, m: usize, out: &mut [f32]) {
    let n = out.len() / m.max(1);
    for (c, j) in (j0..j1).enumerate() {
        for i in 0..m {
            out[i * n + j] = cols[c * m + i];
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

/// Depth of one `gemm` call: every call sees at most this many columns of `x`, so the crate's
/// own depth blocking (which depends on the problem's shape) never splits a reduction; the
/// pieces are summed into the output in order.
const GEMM_DEPTH: usize = 512;
/// Weight rows widened to f32 at a time (a scratch that stays in L2).
const GEMM_ROWS: usize = 256;

/// The rows of `x` as `gemm` must see them: the crate takes other paths, with other reduction
/// orders, for one-row products (a matrix-vector kernel) and for products of at most 256
/// outputs (horizontal kernels). Padding the batch with zero rows past both keeps every call
/// on the blocked micro-kernels, where an output is one FMA chain over the depth whatever the
/// batch, the other rows or the split of the weight rows. (Tested here by
/// `gemm_is_batch_invariant` over batches 1..=300 and random splits.)
fn gemm_rows(m: usize, nw: usize) -> usize {
    m.max(2).max(256 / nw.max(1) + 1)
}

/// `dst[i * nw + j] = x[i] . w[j]` for `mm` rows of `x` (`k` wide) and `nw >= 2` rows of `w`.
#[allow(unsafe_code)]
fn gemm_block(x: &[f32], mm: usize, k: usize, w: &[f32], nw: usize, dst: &mut [f32]) {
    assert!(nw >= 2 && x.len() >= mm * k && w.len() >= nw * k && dst.len() >= mm * nw);
    let mut k0 = 0;
    while k0 < k {
        let kb = GEMM_DEPTH.min(k - k0);
        // SAFETY: dst is mm x nw row-major (row stride nw), x is mm x k (row stride k) read
        // from column k0 for kb columns, w is nw x k read the same way as the transposed
        // right-hand side; the assert above bounds every element the call touches, and the
        // three slices do not overlap (dst is the only mutable one).
        unsafe {
            gemm::gemm(
                mm,
                nw,
                kb,
                dst.as_mut_ptr(),
                1,
                nw as isize,
                k0 > 0,
                x.as_ptr().add(k0),
                1,
                k as isize,
                w.as_ptr().add(k0),
                k as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        k0 += kb;
    }
}

/// [`matmul`] on the `gemm` crate: the weight rows are split over up to `threads` threads,
/// each widening [`GEMM_ROWS`] rows at a time from the checkpoint dtype into a scratch and
/// multiplying the batch by them. A row's outputs are the same bits for any batch, any
/// thread count and any split (see [`gemm_rows`]).
pub fn matmul_gemm(
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) {
    let (m, k, n) = dims(x, w, out);
    if m == 0 || n == 0 {
        return;
    }
    if n < 2 {
        // One output feature: no gemm call can be invariant; the portable dot is.
        return matmul_portable(x, w, bias, out, 1);
    }
    let threads = if n * k < 1 << 16 {
        1
    } else {
        threads.clamp(1, n / 2)
    };
    // Each thread's range is at least two rows; the last takes the remainder.
    let per = n.div_ceil(threads).max(2);
    let columns = |j0: usize, j1: usize| -> Vec<f32> {
        let mut dst = vec![0f32; m * (j1 - j0)];
        let mut scratch = vec![0f32; GEMM_ROWS.min(j1 - j0) * k];
        let mut padded = Vec::new();
        let mut part = Vec::new();
        let mut j = j0;
        while j < j1 {
            let mut e = (j + GEMM_ROWS).min(j1);
            if j1 - e == 1 {
                e = j1; // never leave a one-row block
            }
            let nw = e - j;
            if scratch.len() < nw * k {
                scratch.resize(nw * k, 0.0);
            }
            let s = w.dtype.row_bytes(k);
            widen(&w.bytes[j * s..e * s], w.dtype, &mut scratch[..nw * k]);
            let mm = gemm_rows(m, nw);
            let xs = if mm == m {
                x
            } else {
                padded.clear();
                padded.extend_from_slice(x);
                padded.resize(mm * k, 0.0);
                &padded[..]
            };
            part.clear();
            part.resize(mm * nw, 0.0);
            gemm_block(xs, mm, k, &scratch, nw, &mut part);
            let width = j1 - j0;
            for i in 0..m {
                let row = &mut dst[i * width + (j - j0)..i * width + (e - j0)];
                row.copy_from_slice(&part[i * nw..(i + 1) * nw]);
                if let Some(b) = bias {
                    for (o, b) in row.iter_mut().zip(&b[j..e]) {
                        *o += b;
                    }
                }
            }
            j = e;
        }
        dst
    };
    let mut ranges = Vec::new();
    let mut j0 = 0;
    while j0 < n {
        let mut j1 = (j0 + per).min(n);
        if n - j1 < 2 {
            j1 = n;
        }
        ranges.push((j0, j1));
        j0 = j1;
    }
    let parts: Vec<Vec<f32>> = if ranges.len() == 1 {
        vec![columns(0, n)]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = ranges
                .iter()
                .map(|&(a, b)| {
                    let columns = &columns;
                    s.spawn(move || columns(a, b))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a matmul thread panicked"))
                .collect()
        })
    };
    for ((j0, j1), part) in ranges.into_iter().zip(parts) {
        let width = j1 - j0;
        for i in 0..m {
            out[i * n + j0..i * n + j1].copy_from_slice(&part[i * width..(i + 1) * width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(rows: usize, cols: usize, seed: u32) -> Vec<u8> {
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
        }
    }

    /// The gemm path's promise over the shapes a model has and the edges of the crate's own
    /// paths: every batch from 1 (padded past the matrix-vector kernel) to 70, depths below and
    /// above one call's 512, weights with few rows (the horizontal kernels' range) and many, on
    /// 1 to 5 threads (so the weight rows split differently), with a bias: each row is the same
    /// bits as that row computed alone on one thread, and within 1e-4 of the portable kernels.
    #[test]
    fn gemm_is_batch_invariant() {
        for (n, k) in [
            (2usize, 64usize),
            (3, 600),
            (40, 300),
            (192, 1100),
            (600, 96),
        ] {
            let bytes = mat(n, k, 11);
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
            for dtype in [DType::F32, DType::Bf16] {
                let bytes: Vec<u8> = match dtype {
                    DType::F32 => bytes.clone(),
                    _ => bytes.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect(),
                };
                let w = MatRef {
                    bytes: &bytes,
                    dtype,
                    rows: n,
                    cols: k,
                };
                let x: Vec<f32> = (0..70 * k)
                    .map(|i| ((i * 53 % 211) as f32 - 105.0) / 128.0)
                    .collect();
                let alone: Vec<Vec<u32>> = (0..70)
                    .map(|i| {
                        let mut o = vec![0f32; n];
                        matmul_gemm(&x[i * k..(i + 1) * k], w, Some(&bias), &mut o, 1);
                        o.iter().map(|v| v.to_bits()).collect()
                    })
                    .collect();
                let mut portable = vec![0f32; n];
                matmul_portable(&x[..k], w, Some(&bias), &mut portable, 1);
                for (a, p) in alone[0].iter().zip(&portable) {
                    let a = f32::from_bits(*a);
                    assert!((a - p).abs() <= 1e-4 * p.abs().max(1.0), "{a} vs {p}");
                }
                for m in 1..=70 {
                    let threads = 1 + m % 5;
                    let mut out = vec![0f32; m * n];
                    matmul_gemm(&x[..m * k], w, Some(&bias), &mut out, threads);
                    for i in 0..m {
                        let row: Vec<u32> = out[i * n..(i + 1) * n]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        assert_eq!(
                            row, alone[i],
                            "n {n} k {k} {dtype:?}: row {i} of {m} on {threads} threads"
                        );
                    }
                }
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
    fn four_rows_at_once_are_four_dots() {
        for n in [1usize, 7, 8, 9, 64, 301] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<Vec<f32>> = (0..4)
                .map(|r| (0..n).map(|i| ((i * 3 + r) as f32 * 0.11).cos()).collect())
                .collect();
            let four = dot4(&x, [&w[0], &w[1], &w[2], &w[3]]);
            for r in 0..4 {
                assert_eq!(four[r].to_bits(), dot(&x, &w[r]).to_bits(), "n {n} row {r}");
            }
        }
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
