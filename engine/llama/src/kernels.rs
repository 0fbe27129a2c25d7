//! The arithmetic of the forward pass, written so that a row's result never depends on what else
//! is computed with it: every reduction runs in one fixed order per row (eight lanes over the
//! row, combined in a fixed tree, then the tail), whatever the batch, the chunking of a prompt,
//! or the number of threads. Rust does not reassociate floating-point sums, so the order written
//! is the order run, on every CPU. Weights stay in their checkpoint dtype and are widened to f32
//! one row at a time.

use half::f16;

/// A checkpoint dtype the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
    /// IEEE binary32.
    F32,
}

impl DType {
    /// Bytes per element.
    #[must_use]
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

/// A row-major matrix in checkpoint bytes (little-endian): `rows` x `cols` of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The elements.
    pub bytes: &'a [u8],
    /// Their type.
    pub dtype: DType,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
}

impl MatRef<'_> {
    /// Row `r` widened to f32 into `out` (`cols` long).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let s = self.dtype.size();
        let b = &self.bytes[r * self.cols * s..(r + 1) * self.cols * s];
        widen(b, self.dtype, out);
    }
}

/// `bytes` of `dtype` widened to f32 into `out`.
pub fn widen(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    match dtype {
        DType::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
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

/// `out[i][j] = x[i] . w[j] (+ bias[j])` for the `m = x.len() / w.cols` rows of `x`: each weight
/// row is widened once and used for every row of the batch, so a decode step reads each weight
/// byte once whatever its batch. The columns are split over up to `threads` threads; each output
/// is computed by one thread in the fixed order of [`dot`], so the result is the same bits for
/// any batch and any thread count.
pub fn matmul(x: &[f32], w: MatRef<'_>, bias: Option<&[f32]>, out: &mut [f32], threads: usize) {
    let (k, n) = (w.cols, w.rows);
    let m = x.len() / k;
    debug_assert_eq!(out.len(), m * n);
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

/// `silu(gate) * up`, element by element, into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let s = *g / (1.0 + (-*g).exp());
        *g = s * u;
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
        let mut alone = vec![0f32; n];
        matmul(&x[4 * k..5 * k], w, None, &mut alone, 1);
        for threads in [1, 2, 3] {
            let mut batch = vec![0f32; 9 * n];
            matmul(&x, w, None, &mut batch, threads);
            assert_eq!(
                batch[4 * n..5 * n]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{threads} threads"
            );
        }
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
    }
}
