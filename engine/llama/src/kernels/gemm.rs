//! The `gemm` crate's f32 micro-kernels ([`super::Kernels::Gemm`]), driven so that a row's
//! reduction order never depends on its batch, on the model's kept [`Workers`].

use super::simd::{self, Isa, Product};
use crate::dtype::{MatRef, widen};
use crate::workers::Workers;

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

/// [`super::matmul`] on the `gemm` crate: the weight rows are split over `workers`,
/// each widening [`GEMM_ROWS`] rows at a time from the checkpoint dtype into a scratch and
/// multiplying the batch by them. A row's outputs are the same bits for any batch, any
/// thread count and any split (see [`gemm_rows`]).
pub fn matmul_gemm(
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    workers: &Workers,
) {
    let (m, k, n) = dims(x, w, out);
    if m == 0 || n == 0 {
        return;
    }
    if n < 2 {
        // One output feature: no gemm call can be invariant; the written order is.
        let product = Product { w, bias, out };
        return simd::matmul_many_on(Isa::Portable, x, &mut [product], workers);
    }
    let threads = if n * k < 1 << 16 {
        1
    } else {
        workers.threads().clamp(1, n / 2)
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
    let mut parts: Vec<Vec<f32>> = vec![Vec::new(); ranges.len()];
    let jobs: Vec<((usize, usize), &mut Vec<f32>)> =
        ranges.iter().copied().zip(&mut parts).collect();
    workers.each(jobs, |((a, b), part)| *part = columns(a, b));
    for ((j0, j1), part) in ranges.into_iter().zip(parts) {
        let width = j1 - j0;
        for i in 0..m {
            out[i * n + j0..i * n + j1].copy_from_slice(&part[i * width..(i + 1) * width]);
        }
    }
}

/// A product's sizes: `m` rows of `x`, `k` inputs, `n` outputs (`out` holds `m x n`).
fn dims(x: &[f32], w: MatRef<'_>, out: &[f32]) -> (usize, usize, usize) {
    let (k, n) = (w.cols, w.rows);
    let m = x.len() / k.max(1);
    debug_assert_eq!(out.len(), m * n);
    (m, k, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::kernels::tests::mat;

    /// The gemm path's promise over the shapes a model has and the edges of the crate's own
    /// paths: every batch from 1 (padded past the matrix-vector kernel) to 70, depths below and
    /// above one call's 512, weights with few rows (the horizontal kernels' range) and many, on
    /// 1 to 5 threads (so the weight rows split differently), with a bias: each row is the same
    /// bits as that row computed alone on one thread, and within 1e-4 of the written order.
    #[test]
    fn gemm_is_batch_invariant() {
        let one = Workers::new(1);
        let pools: Vec<Workers> = (1..=5).map(Workers::new).collect();
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
                        matmul_gemm(&x[i * k..(i + 1) * k], w, Some(&bias), &mut o, &one);
                        o.iter().map(|v| v.to_bits()).collect()
                    })
                    .collect();
                let mut portable = vec![0f32; n];
                let product = Product {
                    w,
                    bias: Some(&bias),
                    out: &mut portable,
                };
                simd::matmul_many_on(Isa::Portable, &x[..k], &mut [product], &one);
                for (a, p) in alone[0].iter().zip(&portable) {
                    let a = f32::from_bits(*a);
                    assert!((a - p).abs() <= 1e-4 * p.abs().max(1.0), "{a} vs {p}");
                }
                for m in 1..=70 {
                    let threads = 1 + m % 5;
                    let mut out = vec![0f32; m * n];
                    matmul_gemm(&x[..m * k], w, Some(&bias), &mut out, &pools[threads - 1]);
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
}
