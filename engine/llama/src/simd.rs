//! The `simd` kernels: this model's products written for the CPU's vector unit (AVX2 with FMA,
//! through `pulp`, chosen at run time), reading bf16 and f32 weights straight from the
//! checkpoint into registers, and run on the model's kept [`Workers`].
//!
//! **One order for every output.** An output `x . w` keeps sixteen running sums: lane `l` adds
//! `x[t] * w[t]` for `t = l, l + 16, l + 32, ...` in turn, each step one fused multiply-add. The
//! sixteen are then combined in one fixed tree, `((0+8)+(4+12))+((2+10)+(6+14))` and so on (see
//! [`combine`]), the `k mod 16` columns past the last full group are added one by one in order
//! (fused), and the bias last. [`dot16`] writes that order out in plain Rust. Every path below
//! computes exactly it:
//! - a small batch reads the weight rows in place, four at a time, each batch row against them;
//! - a large batch widens a block of weight rows into a per-thread scratch first (exact: a
//!   bf16, f16 or f32 value is the same f32 either way) and multiplies a tile of batch rows by
//!   a pair of weight rows;
//! - the work is split over threads by output rows, never across a reduction.
//!
//! So a row's outputs are the same bits whatever its batch, its place in the batch, the split,
//! or the thread count, and the same on every x86-64 CPU with AVX2 and on any other CPU (whose
//! path is [`dot16`] itself). `simd_matches_the_written_order` holds each path to [`dot16`].

use std::cell::RefCell;

use crate::kernels::{MatRef, widen};
use crate::workers::Workers;

/// Running sums per output.
pub const LANES: usize = 16;
/// From this many batch rows up, blocks of weight rows are widened once and shared by the
/// batch.
pub const WIDEN_FROM_ROWS: usize = 12;
/// Floats of widened weights a thread keeps at once (64 KiB: a block stays in L2).
const BLOCK_FLOATS: usize = 16 * 1024;

/// Combines the sixteen running sums in the one fixed tree: lanes `l` and `l + 8`, then `l`
/// and `l + 4`, then `l` and `l + 2`, then the last two.
#[inline(always)]
#[must_use]
pub fn combine(acc: [f32; LANES]) -> f32 {
    let mut t = [0f32; 8];
    for l in 0..8 {
        t[l] = acc[l] + acc[l + 8];
    }
    let u = [t[0] + t[4], t[1] + t[5], t[2] + t[6], t[3] + t[7]];
    let v = [u[0] + u[2], u[1] + u[3]];
    v[0] + v[1]
}

/// The one order, written out: `x . w` in sixteen fused running sums, [`combine`]d, then the
/// columns past the last full group of sixteen, fused, in order.
#[must_use]
pub fn dot16(x: &[f32], w: &[f32]) -> f32 {
    let k = x.len().min(w.len());
    let full = k / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (xc, wc) in x[..full]
        .chunks_exact(LANES)
        .zip(w[..full].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] = xc[l].mul_add(wc[l], acc[l]);
        }
    }
    tail(combine(acc), &x[full..k], &w[full..k])
}

/// Adds `x[t] * w[t]` for the columns past the last full group, fused, in order.
#[inline(always)]
fn tail(mut s: f32, x: &[f32], w: &[f32]) -> f32 {
    for (a, b) in x.iter().zip(w) {
        s = a.mul_add(*b, s);
    }
    s
}

thread_local! {
    /// A thread's widened weights, kept across products.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch of at least `len` floats.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0.0);
        }
        f(&mut s[..len])
    })
}

/// Runs `f` compiled for AVX2 and FMA where the CPU has them. Plain Rust in `f` keeps its
/// meaning (Rust never reorders or fuses float arithmetic on its own); it only gets wider
/// instructions.
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(f);
    }
    f()
}

/// `out[i][j] = x[i] . w[j] (+ bias[j])` for the `m = x.len() / w.cols` rows of `x`, each output
/// in the order of [`dot16`], on `workers`.
pub fn matmul_simd(
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    workers: &Workers,
) {
    let (k, n) = (w.cols, w.rows);
    let m = x.len() / k.max(1);
    if m == 0 || n == 0 {
        return;
    }
    debug_assert_eq!(out.len(), m * n);
    // Small products are not worth a second thread.
    let threads = if m * n * k < 1 << 16 {
        1
    } else {
        workers.threads()
    };
    // Split by output rows, in multiples of four; every batch row goes to every thread.
    let per = n.div_ceil(threads).div_ceil(4) * 4;
    let ranges: Vec<(usize, usize)> = (0..n)
        .step_by(per)
        .map(|j0| (j0, (j0 + per).min(n)))
        .collect();
    let job = |(j0, j1, dst): (usize, usize, &mut [f32])| {
        if m < WIDEN_FROM_ROWS {
            direct(x, w, bias, j0, j1, dst);
        } else {
            widened(x, w, bias, j0, j1, dst);
        }
    };
    if m == 1 {
        // One batch row: each range's outputs are a contiguous piece of `out`.
        let mut parts = Vec::with_capacity(ranges.len());
        let mut rest = &mut out[..];
        for &(j0, j1) in &ranges {
            let (a, b) = rest.split_at_mut(j1 - j0);
            parts.push((j0, j1, a));
            rest = b;
        }
        workers.each(parts, job);
        return;
    }
    // Each range's outputs go to a piece of `tmp` (m rows of its width), then to `out`.
    let mut tmp = vec![0f32; m * n];
    let mut parts = Vec::with_capacity(ranges.len());
    let mut rest = &mut tmp[..];
    for &(j0, j1) in &ranges {
        let (a, b) = rest.split_at_mut(m * (j1 - j0));
        parts.push((j0, j1, a));
        rest = b;
    }
    workers.each(parts, job);
    let mut at = 0;
    for &(j0, j1) in &ranges {
        let width = j1 - j0;
        for i in 0..m {
            out[i * n + j0..i * n + j1].copy_from_slice(&tmp[at..at + width]);
            at += width;
        }
    }
}

/// Outputs `j0..j1` of every batch row, into `dst` (row-major, `j1 - j0` wide), reading the
/// weight rows in place.
fn direct(x: &[f32], w: MatRef<'_>, bias: Option<&[f32]>, j0: usize, j1: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(v3::Direct {
            simd,
            x,
            w,
            bias,
            j0,
            j1,
            dst,
        });
    }
    direct_portable(x, w, bias, j0, j1, dst);
}

/// [`direct`] without a vector unit: each weight row widened, then [`dot16`].
fn direct_portable(
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    let k = w.cols;
    let width = j1 - j0;
    with_scratch(k, |row| {
        for j in j0..j1 {
            w.row_into(j, row);
            let b = bias.map_or(0.0, |b| b[j]);
            for (i, xi) in x.chunks_exact(k).enumerate() {
                dst[i * width + j - j0] = dot16(xi, row) + b;
            }
        }
    });
}

/// Outputs `j0..j1` of every batch row, into `dst` (row-major, `j1 - j0` wide), widening
/// blocks of those weight rows into this thread's scratch once for the whole batch.
fn widened(x: &[f32], w: MatRef<'_>, bias: Option<&[f32]>, j0: usize, j1: usize, dst: &mut [f32]) {
    let k = w.cols;
    let width = j1 - j0;
    let block = (BLOCK_FLOATS / k.max(1)).clamp(2, width.max(2)) & !1;
    with_scratch(block * k, |scratch| {
        let mut j = j0;
        while j < j1 {
            let e = (j + block).min(j1);
            let s = w.dtype.size();
            let ws = &mut scratch[..(e - j) * k];
            vectorized(|| widen_fast(&w.bytes[j * k * s..e * k * s], w.dtype, ws));
            let ws = &*ws;
            #[cfg(target_arch = "x86_64")]
            if let Some(simd) = pulp::x86::V3::try_new() {
                simd.vectorize(v3::Widened {
                    simd,
                    x,
                    ws,
                    k,
                    width,
                    at: j - j0,
                    bias: bias.map(|b| &b[j..e]),
                    dst: &mut *dst,
                });
                j = e;
                continue;
            }
            for (i, xi) in x.chunks_exact(k).enumerate() {
                for (r, wr) in ws.chunks_exact(k).enumerate() {
                    dst[i * width + j - j0 + r] = dot16(xi, wr) + bias.map_or(0.0, |b| b[j + r]);
                }
            }
            j = e;
        }
    });
}

/// [`widen`], with bf16 written so that it vectorizes (the same values: a bf16 is the top half
/// of its f32).
#[inline(always)]
fn widen_fast(bytes: &[u8], dtype: crate::kernels::DType, out: &mut [f32]) {
    if dtype == crate::kernels::DType::Bf16 {
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
        }
    } else {
        widen(bytes, dtype, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod v3 {
    //! The AVX2 + FMA bodies: the sixteen running sums are two registers of eight.

    use pulp::x86::V3;
    use pulp::{NullaryFnOnce, f32x8, u16x8};

    use super::{LANES, combine, tail, with_scratch};
    use crate::kernels::{DType, MatRef, widen};

    type Sums = (f32x8, f32x8);

    #[inline(always)]
    fn zero(simd: V3) -> Sums {
        (simd.splat_f32x8(0.0), simd.splat_f32x8(0.0))
    }

    #[inline(always)]
    fn fma(simd: V3, a: Sums, b: Sums, c: Sums) -> Sums {
        (
            simd.mul_add_f32x8(a.0, b.0, c.0),
            simd.mul_add_f32x8(a.1, b.1, c.1),
        )
    }

    #[inline(always)]
    fn lanes(s: Sums) -> [f32; LANES] {
        let (a, b): ([f32; 8], [f32; 8]) = (pulp::cast(s.0), pulp::cast(s.1));
        let mut out = [0f32; LANES];
        out[..8].copy_from_slice(&a);
        out[8..].copy_from_slice(&b);
        out
    }

    /// Sixteen f32 values from 64 bytes.
    #[inline(always)]
    fn f32s(c: &[u8]) -> Sums {
        let (a, b) = c.split_at(32);
        let a: [u8; 32] = a.try_into().expect("32 bytes");
        let b: [u8; 32] = b.try_into().expect("32 bytes");
        (pulp::cast(a), pulp::cast(b))
    }

    /// Sixteen f32 values.
    #[inline(always)]
    fn floats(c: &[f32]) -> Sums {
        let a: [f32; 8] = c[..8].try_into().expect("8 floats");
        let b: [f32; 8] = c[8..16].try_into().expect("8 floats");
        (pulp::cast(a), pulp::cast(b))
    }

    /// Sixteen bf16 values (32 bytes) widened in registers: each one's bits moved up 16.
    #[inline(always)]
    fn bf16s(simd: V3, c: &[u8]) -> Sums {
        let (a, b) = c.split_at(16);
        let a: [u8; 16] = a.try_into().expect("16 bytes");
        let b: [u8; 16] = b.try_into().expect("16 bytes");
        let wide = |h: [u8; 16]| -> f32x8 {
            let h: u16x8 = pulp::cast(h);
            pulp::cast(simd.shl_const_u32x8::<16>(simd.convert_u16x8_to_u32x8(h)))
        };
        (wide(a), wide(b))
    }

    /// The outputs of one batch row `x` against four weight rows read in place (`D` bytes per
    /// sixteen values, `load` widening them).
    #[inline(always)]
    fn four<const D: usize>(
        simd: V3,
        x: &[f32],
        rows: [&[u8]; 4],
        load: impl Fn(&[u8]) -> Sums,
        dtype: DType,
    ) -> [f32; 4] {
        let k = x.len();
        let full = k / LANES;
        let mut acc = [zero(simd); 4];
        for c in 0..full {
            let xv = floats(&x[c * LANES..(c + 1) * LANES]);
            for r in 0..4 {
                let wv = load(&rows[r][c * D..(c + 1) * D]);
                acc[r] = fma(simd, xv, wv, acc[r]);
            }
        }
        let mut out = [0f32; 4];
        let mut wt = [0f32; LANES];
        for r in 0..4 {
            let rest = k - full * LANES;
            widen(&rows[r][full * D..], dtype, &mut wt[..rest]);
            out[r] = tail(combine(lanes(acc[r])), &x[full * LANES..], &wt[..rest]);
        }
        out
    }

    /// One weight row's outputs for every batch row (the rows past the last four).
    #[inline(always)]
    fn one<const D: usize>(
        simd: V3,
        x: &[f32],
        row: &[u8],
        load: impl Fn(&[u8]) -> Sums,
        dtype: DType,
    ) -> f32 {
        let k = x.len();
        let full = k / LANES;
        let mut acc = zero(simd);
        for c in 0..full {
            let xv = floats(&x[c * LANES..(c + 1) * LANES]);
            acc = fma(simd, xv, load(&row[c * D..(c + 1) * D]), acc);
        }
        let rest = k - full * LANES;
        let mut wt = [0f32; LANES];
        widen(&row[full * D..], dtype, &mut wt[..rest]);
        tail(combine(lanes(acc)), &x[full * LANES..], &wt[..rest])
    }

    pub(super) struct Direct<'a> {
        pub simd: V3,
        pub x: &'a [f32],
        pub w: MatRef<'a>,
        pub bias: Option<&'a [f32]>,
        pub j0: usize,
        pub j1: usize,
        pub dst: &'a mut [f32],
    }

    impl NullaryFnOnce for Direct<'_> {
        type Output = ();

        #[inline(always)]
        fn call(self) {
            let Self {
                simd,
                x,
                w,
                bias,
                j0,
                j1,
                dst,
            } = self;
            match w.dtype {
                DType::Bf16 => columns::<32>(simd, x, w, bias, j0, j1, dst, |c| bf16s(simd, c)),
                DType::F32 => columns::<64>(simd, x, w, bias, j0, j1, dst, f32s),
                DType::F16 => {
                    // No f16 conversion in registers here: four rows at a time are widened
                    // (exactly) into this thread's scratch and read as f32.
                    let k = w.cols;
                    with_scratch(4 * k, |s| {
                        let mut j = j0;
                        while j < j1 {
                            let e = (j + 4).min(j1);
                            let s = &mut s[..(e - j) * k];
                            widen(&w.bytes[j * k * 2..e * k * 2], DType::F16, s);
                            let wide = MatRef {
                                bytes: bytemuck::cast_slice(s),
                                dtype: DType::F32,
                                rows: e - j,
                                cols: k,
                            };
                            let width = j1 - j0;
                            let m = x.len() / k;
                            let mut piece = vec![0f32; m * (e - j)];
                            columns::<64>(simd, x, wide, None, 0, e - j, &mut piece, f32s);
                            for i in 0..m {
                                for r in 0..e - j {
                                    let b = bias.map_or(0.0, |b| b[j + r]);
                                    // The bias is added last, after the whole sum, as on the
                                    // other paths.
                                    dst[i * width + j - j0 + r] = piece[i * (e - j) + r] + b;
                                }
                            }
                            j = e;
                        }
                    });
                }
            }
        }
    }

    /// Outputs `j0..j1` of every batch row of `x` into `dst` (row-major, `j1 - j0` wide).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn columns<const D: usize>(
        simd: V3,
        x: &[f32],
        w: MatRef<'_>,
        bias: Option<&[f32]>,
        j0: usize,
        j1: usize,
        dst: &mut [f32],
        load: impl Fn(&[u8]) -> Sums + Copy,
    ) {
        let k = w.cols;
        let s = w.dtype.size();
        let row = |j: usize| &w.bytes[j * k * s..(j + 1) * k * s];
        let width = j1 - j0;
        let mut j = j0;
        while j + 4 <= j1 {
            let rows = [row(j), row(j + 1), row(j + 2), row(j + 3)];
            for (i, xi) in x.chunks_exact(k).enumerate() {
                let o = four::<D>(simd, xi, rows, load, w.dtype);
                for r in 0..4 {
                    dst[i * width + j - j0 + r] = o[r] + bias.map_or(0.0, |b| b[j + r]);
                }
            }
            j += 4;
        }
        while j < j1 {
            for (i, xi) in x.chunks_exact(k).enumerate() {
                dst[i * width + j - j0] =
                    one::<D>(simd, xi, row(j), load, w.dtype) + bias.map_or(0.0, |b| b[j]);
            }
            j += 1;
        }
    }

    /// `MR` batch rows by `NR` widened weight rows.
    #[inline(always)]
    fn tile<const MR: usize, const NR: usize>(
        simd: V3,
        xs: [&[f32]; MR],
        ws: [&[f32]; NR],
        k: usize,
    ) -> [[f32; NR]; MR] {
        let full = k / LANES;
        let mut acc = [[zero(simd); NR]; MR];
        for c in 0..full {
            let at = c * LANES;
            let wv: [Sums; NR] = std::array::from_fn(|r| floats(&ws[r][at..at + LANES]));
            for i in 0..MR {
                let xv = floats(&xs[i][at..at + LANES]);
                for r in 0..NR {
                    acc[i][r] = fma(simd, xv, wv[r], acc[i][r]);
                }
            }
        }
        let f = full * LANES;
        std::array::from_fn(|i| {
            std::array::from_fn(|r| tail(combine(lanes(acc[i][r])), &xs[i][f..k], &ws[r][f..k]))
        })
    }

    pub(super) struct Widened<'a> {
        pub simd: V3,
        /// The batch rows.
        pub x: &'a [f32],
        /// Widened weight rows, `ws.len() / k` of them.
        pub ws: &'a [f32],
        pub k: usize,
        /// Outputs per batch row in `dst`.
        pub width: usize,
        /// Where the first weight row's outputs go in each row of `dst`.
        pub at: usize,
        /// The bias of those weight rows.
        pub bias: Option<&'a [f32]>,
        pub dst: &'a mut [f32],
    }

    impl Widened<'_> {
        #[inline(always)]
        fn rows<const MR: usize>(&mut self, i0: usize) {
            let (k, n, j) = (self.k, self.width, self.at);
            let nb = self.ws.len() / k;
            let xs: [&[f32]; MR] = std::array::from_fn(|i| &self.x[(i0 + i) * k..(i0 + i + 1) * k]);
            let w = |r: usize| &self.ws[r * k..(r + 1) * k];
            let mut r = 0;
            while r + 2 <= nb {
                let o = tile::<MR, 2>(self.simd, xs, [w(r), w(r + 1)], k);
                for (i, o) in o.iter().enumerate() {
                    for (c, v) in o.iter().enumerate() {
                        let b = self.bias.map_or(0.0, |b| b[r + c]);
                        self.dst[(i0 + i) * n + j + r + c] = v + b;
                    }
                }
                r += 2;
            }
            if r < nb {
                let o = tile::<MR, 1>(self.simd, xs, [w(r)], k);
                for (i, o) in o.iter().enumerate() {
                    let b = self.bias.map_or(0.0, |b| b[r]);
                    self.dst[(i0 + i) * n + j + r] = o[0] + b;
                }
            }
        }
    }

    impl NullaryFnOnce for Widened<'_> {
        type Output = ();

        #[inline(always)]
        fn call(mut self) {
            let m = self.x.len() / self.k;
            let mut i = 0;
            while i + 3 <= m {
                self.rows::<3>(i);
                i += 3;
            }
            match m - i {
                2 => self.rows::<2>(i),
                1 => self.rows::<1>(i),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::DType;

    fn weights(n: usize, k: usize, dtype: DType) -> Vec<u8> {
        (0..n * k)
            .flat_map(|i| {
                let v =
                    (((i as u32).wrapping_mul(2_654_435_761) >> 7) % 2000) as f32 / 1000.0 - 1.0;
                match dtype {
                    DType::F32 => v.to_le_bytes().to_vec(),
                    DType::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                }
            })
            .collect()
    }

    /// Every path (rows read in place, four and one at a time; widened blocks, tiles of three,
    /// two and one; split by output rows or by batch rows, on 1 to 3 threads; each dtype) is
    /// the order [`dot16`] writes out, bit for bit, for every row of every batch from 1 to 40.
    /// So batch 1 and batch N take the same order: if either path changed its order, the row
    /// would differ from [`dot16`] here.
    #[test]
    fn simd_matches_the_written_order() {
        for (n, k) in [(9usize, 16usize), (23, 100), (64, 576), (130, 1536), (6, 7)] {
            for dtype in [DType::Bf16, DType::F32, DType::F16] {
                let bytes = weights(n, k, dtype);
                let w = MatRef {
                    bytes: &bytes,
                    dtype,
                    rows: n,
                    cols: k,
                };
                let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 1.0).collect();
                let x: Vec<f32> = (0..40 * k)
                    .map(|i| ((i * 53 % 211) as f32 - 105.0) / 97.0)
                    .collect();
                let mut row = vec![0f32; k];
                let expect: Vec<Vec<u32>> = (0..40)
                    .map(|i| {
                        (0..n)
                            .map(|j| {
                                w.row_into(j, &mut row);
                                (dot16(&x[i * k..(i + 1) * k], &row) + bias[j]).to_bits()
                            })
                            .collect()
                    })
                    .collect();
                for threads in [1, 2, 3] {
                    let workers = Workers::new(threads);
                    for m in (1..=40).filter(|m| *m < 14 || m % 7 == 0 || *m == 40) {
                        let mut out = vec![0f32; m * n];
                        matmul_simd(&x[..m * k], w, Some(&bias), &mut out, &workers);
                        for i in 0..m {
                            let got: Vec<u32> = out[i * n..(i + 1) * n]
                                .iter()
                                .map(|v| v.to_bits())
                                .collect();
                            assert_eq!(
                                got, expect[i],
                                "n {n} k {k} {dtype:?}: row {i} of a batch of {m} on {threads} threads"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The written order itself: sixteen lanes, the tree, then the tail, fused. A change to
    /// [`dot16`] or [`combine`] (eight lanes, another tree, an unfused step) fails here.
    #[test]
    fn the_written_order_is_sixteen_fused_lanes_a_fixed_tree_then_the_tail() {
        let k = 37;
        let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.731).sin() * 3.0).collect();
        let w: Vec<f32> = (0..k).map(|i| (i as f32 * 1.37).cos() / 7.0).collect();
        let mut acc = [0f32; 16];
        for t in 0..32 {
            acc[t % 16] = x[t].mul_add(w[t], acc[t % 16]);
        }
        let l = |i: usize| acc[i] + acc[i + 8];
        let mut s = ((l(0) + l(4)) + (l(2) + l(6))) + ((l(1) + l(5)) + (l(3) + l(7)));
        for t in 32..k {
            s = x[t].mul_add(w[t], s);
        }
        assert_eq!(dot16(&x, &w).to_bits(), s.to_bits());
    }
}
