//! The AVX2 + FMA bodies: the sixteen running sums are two registers of eight.

use core::arch::x86_64::__m128i;
use half::f16;
use pulp::x86::V3;

use pulp::{NullaryFnOnce, f32x8, i32x8, u16x8, u32x8};

use zerocopy::{FromBytes, IntoBytes};

use super::{LANES, combine, tail};
use crate::dtype::{DType, MatRef, widen};
use crate::quant::{Block, BlockQ4_0, BlockQ4_1, BlockQ8_0};

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

/// The values of a Q8_0, Q4_0 or Q4_1 block (`T` 0, 1, 2), dequantized in registers with
/// the same f32 arithmetic as [`crate::dtype::dequantize_block`] (an exact conversion, then one rounded
/// multiply, and for Q4_1 one rounded add), so the same values.
#[inline(always)]
fn block<const T: u8>(simd: V3, b: &[u8]) -> [Sums; 2] {
    if T == 0 {
        let b = BlockQ8_0::ref_from_bytes(&b[..BlockQ8_0::BYTES]).expect("one block");
        let d = simd.splat_f32x8(half_to_f32(u16::from_le_bytes(b.d)));
        // 32 signed bytes: four groups of eight, each sign-extended to eight lanes.
        let (q0, q1) = b.qs.as_bytes().split_at(16);
        let q0: [u8; 16] = q0.try_into().expect("16 bytes");
        let q1: [u8; 16] = q1.try_into().expect("16 bytes");
        let (q0, q1): (__m128i, __m128i) = (pulp::cast(q0), pulp::cast(q1));
        let (h0, h1) = (
            simd.sse2._mm_srli_si128::<8>(q0),
            simd.sse2._mm_srli_si128::<8>(q1),
        );
        let v = [
            signed(simd, q0, d),
            signed(simd, h0, d),
            signed(simd, q1, d),
            signed(simd, h1, d),
        ];
        return [(v[0], v[1]), (v[2], v[3])];
    }
    let (d, m, q) = if T == 1 {
        let b = BlockQ4_0::ref_from_bytes(&b[..BlockQ4_0::BYTES]).expect("one block");
        (b.d, None, b.qs)
    } else {
        let b = BlockQ4_1::ref_from_bytes(&b[..BlockQ4_1::BYTES]).expect("one block");
        (b.d, Some(b.m), b.qs)
    };
    let d = simd.splat_f32x8(half_to_f32(u16::from_le_bytes(d)));
    let m = m.map(|m| simd.splat_f32x8(half_to_f32(u16::from_le_bytes(m))));
    let q: __m128i = pulp::cast(q);
    let hq = simd.sse2._mm_srli_si128::<8>(q);
    let (b0, b1): (u32x8, u32x8) = (
        pulp::cast(simd.avx2._mm256_cvtepu8_epi32(q)),
        pulp::cast(simd.avx2._mm256_cvtepu8_epi32(hq)),
    );
    let low = simd.splat_u32x8(0xF);
    // Values 0..16 are the low nibbles of bytes 0..16, values 16..32 their high nibbles.
    let nibbles = [
        simd.and_u32x8(b0, low),
        simd.and_u32x8(b1, low),
        simd.shr_const_u32x8::<4>(b0),
        simd.shr_const_u32x8::<4>(b1),
    ];
    let v = [
        nibble(simd, nibbles[0], d, m),
        nibble(simd, nibbles[1], d, m),
        nibble(simd, nibbles[2], d, m),
        nibble(simd, nibbles[3], d, m),
    ];
    [(v[0], v[1]), (v[2], v[3])]
}

/// Eight signed bytes (the low half of `q`) times `d`.
#[inline(always)]
fn signed(simd: V3, q: __m128i, d: f32x8) -> f32x8 {
    let i: i32x8 = pulp::cast(simd.avx2._mm256_cvtepi8_epi32(q));
    simd.mul_f32x8(simd.convert_i32x8_to_f32x8(i), d)
}

/// Eight nibbles as Q4_0 (`(q - 8) * d`, no `m`) or Q4_1 (`q * d + m`) values.
#[inline(always)]
fn nibble(simd: V3, n: u32x8, d: f32x8, m: Option<f32x8>) -> f32x8 {
    match m {
        None => {
            let n = simd.wrapping_sub_i32x8(pulp::cast(n), simd.splat_i32x8(8));
            simd.mul_f32x8(simd.convert_i32x8_to_f32x8(n), d)
        }
        Some(m) => {
            let n = simd.convert_i32x8_to_f32x8(pulp::cast(n));
            simd.add_f32x8(simd.mul_f32x8(n, d), m)
        }
    }
}

#[test]
fn every_f16_scale_widens_as_half_does() {
    for h in 0..=u16::MAX {
        let (a, b) = (half_to_f32(h), f16::from_bits(h).to_f32());
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{h:#x}"
        );
    }
}

/// An f16's value as f32 (exact): normal numbers by moving the bits, the rest through
/// `half`.
#[inline(always)]
fn half_to_f32(h: u16) -> f32 {
    let e = (h >> 10) & 0x1F;
    if e == 0 || e == 0x1F {
        return f16::from_bits(h).to_f32();
    }
    let sign = u32::from(h & 0x8000) << 16;
    f32::from_bits(sign | ((u32::from(h & 0x7FFF) + 0x1_C000) << 13))
}

/// The outputs of `M` batch rows `xs` against one weight row read in place: `D` bytes hold
/// `C` groups of sixteen values, which `load` widens once for all `M`, in order. (One row
/// at a time keeps the weights one sequential stream, which the prefetchers follow: four
/// rows interleaved ran at two thirds of the speed on a Zen 3.)
#[inline(always)]
fn row<const M: usize, const K: u8, const D: usize>(
    simd: V3,
    xs: [&[f32]; M],
    row: &[u8],
    dtype: DType,
) -> [f32; M] {
    const C: usize = 2;
    let k = xs[0].len();
    let units = k / (LANES * C);
    let mut acc = [zero(simd); M];
    for (u, wc) in row[..units * D].chunks_exact(D).enumerate() {
        let wv = unit::<K>(simd, wc);
        let at = u * LANES * C;
        for c in 0..C {
            for i in 0..M {
                let xv = floats(&xs[i][at + c * LANES..at + (c + 1) * LANES]);
                acc[i] = fma(simd, xv, wv[c], acc[i]);
            }
        }
    }
    let done = units * LANES * C;
    let rest = k - done;
    let mut wt = [0f32; 2 * LANES];
    // Past the last whole unit (element types only; a block type's rows are whole blocks):
    // the rest of the last group of sixteen, then the tail.
    widen(&row[units * D..], dtype, &mut wt[..rest]);
    let full = rest / LANES * LANES;
    std::array::from_fn(|i| {
        let x = xs[i];
        let mut a = acc[i];
        if full == LANES {
            a = fma(
                simd,
                floats(&x[done..done + LANES]),
                floats(&wt[..LANES]),
                a,
            );
        }
        tail(combine(lanes(a)), &x[done + full..k], &wt[full..rest])
    })
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
            DType::Bf16 => columns::<0, 64>(simd, x, w, bias, j0, j1, dst),
            DType::F32 => columns::<1, 128>(simd, x, w, bias, j0, j1, dst),
            DType::Q8_0 => columns::<2, { BlockQ8_0::BYTES }>(simd, x, w, bias, j0, j1, dst),
            DType::Q4_0 => columns::<3, { BlockQ4_0::BYTES }>(simd, x, w, bias, j0, j1, dst),
            DType::Q4_1 => columns::<4, { BlockQ4_1::BYTES }>(simd, x, w, bias, j0, j1, dst),
            DType::F16 | DType::Q5_0 | DType::Q5_1 => {
                unreachable!("f16, Q5_0 and Q5_1 rows are widened before they get here")
            }
        }
    }
}

/// Thirty-two values (two groups of sixteen) of a row of kind `K` (bf16, f32, Q8_0, Q4_0,
/// Q4_1), widened in registers. A function, not a closure, so that it is always inlined
/// into the AVX2 context.
#[inline(always)]
fn unit<const K: u8>(simd: V3, b: &[u8]) -> [Sums; 2] {
    match K {
        0 => [bf16s(simd, &b[..32]), bf16s(simd, &b[32..64])],
        1 => [f32s(&b[..64]), f32s(&b[64..128])],
        2 => block::<0>(simd, b),
        3 => block::<1>(simd, b),
        _ => block::<2>(simd, b),
    }
}

/// Outputs `j0..j1` of every batch row of `x` into `dst` (row-major, `j1 - j0` wide).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn columns<const K: u8, const D: usize>(
    simd: V3,
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    let k = w.cols;
    let s = w.dtype.row_bytes(k);
    let row_of = |j: usize| &w.bytes[j * s..(j + 1) * s];
    let width = j1 - j0;
    let m = x.len() / k;
    let xr = |i: usize| &x[i * k..(i + 1) * k];
    for j in j0..j1 {
        let b = bias.map_or(0.0, |b| b[j]);
        let mut put = |i: usize, v: f32| dst[i * width + j - j0] = v + b;
        let mut i = 0;
        while i + 4 <= m {
            let o = row::<4, K, D>(
                simd,
                [xr(i), xr(i + 1), xr(i + 2), xr(i + 3)],
                row_of(j),
                w.dtype,
            );
            for (r, v) in o.into_iter().enumerate() {
                put(i + r, v);
            }
            i += 4;
        }
        while i < m {
            let [v] = row::<1, K, D>(simd, [xr(i)], row_of(j), w.dtype);
            put(i, v);
            i += 1;
        }
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
    if MR == 3 && NR == 2 {
        // The hot tile with its twelve sums in named locals, so that they stay in
        // registers (LLVM kept the array form on the stack); the batch rows are read
        // straight into the multiply-adds.
        let (mut a00, mut a01, mut a10) = (acc[0][0], acc[0][1], acc[1][0]);
        let (mut a11, mut a20, mut a21) = (acc[1][1], acc[2][0], acc[2][1]);
        let n = full * LANES;
        let it = xs[0][..n]
            .chunks_exact(LANES)
            .zip(xs[1][..n].chunks_exact(LANES))
            .zip(xs[2][..n].chunks_exact(LANES))
            .zip(ws[0][..n].chunks_exact(LANES))
            .zip(ws[1][..n].chunks_exact(LANES));
        for ((((x0, x1), x2), w0), w1) in it {
            let (w0, w1) = (floats(w0), floats(w1));
            a00 = fma(simd, floats(x0), w0, a00);
            a01 = fma(simd, floats(x0), w1, a01);
            a10 = fma(simd, floats(x1), w0, a10);
            a11 = fma(simd, floats(x1), w1, a11);
            a20 = fma(simd, floats(x2), w0, a20);
            a21 = fma(simd, floats(x2), w1, a21);
        }
        acc[0] = std::array::from_fn(|r| [a00, a01][r]);
        acc[1] = std::array::from_fn(|r| [a10, a11][r]);
        acc[2] = std::array::from_fn(|r| [a20, a21][r]);
    } else if MR == 2 && NR == 2 {
        // The hot tile with its eight sums in named locals, so that they stay in registers
        // (LLVM kept the array form on the stack).
        let (mut a00, mut a01, mut a10, mut a11) = (acc[0][0], acc[0][1], acc[1][0], acc[1][1]);
        let it = xs[0][..full * LANES]
            .chunks_exact(LANES)
            .zip(xs[1][..full * LANES].chunks_exact(LANES))
            .zip(ws[0][..full * LANES].chunks_exact(LANES))
            .zip(ws[1][..full * LANES].chunks_exact(LANES));
        for (((x0, x1), w0), w1) in it {
            let (w0, w1) = (floats(w0), floats(w1));
            let x0 = floats(x0);
            a00 = fma(simd, x0, w0, a00);
            a01 = fma(simd, x0, w1, a01);
            let x1 = floats(x1);
            a10 = fma(simd, x1, w0, a10);
            a11 = fma(simd, x1, w1, a11);
        }
        acc[0][0] = a00;
        acc[0][1] = a01;
        acc[1][0] = a10;
        acc[1][1] = a11;
    } else {
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
    }
    let f = full * LANES;
    std::array::from_fn(|i| {
        std::array::from_fn(|r| tail(combine(lanes(acc[i][r])), &xs[i][f..k], &ws[r][f..k]))
    })
}

pub(super) struct Scores<'a> {
    pub simd: V3,
    pub q: &'a [f32],
    pub keys: &'a [f32],
    pub stride: usize,
    pub at: usize,
    pub scale: f32,
    pub out: &'a mut [f32],
}

impl NullaryFnOnce for Scores<'_> {
    /// How many positions it scored (whole groups of eight).
    type Output = usize;

    #[inline(always)]
    fn call(self) -> usize {
        let Self {
            simd,
            q,
            keys,
            stride,
            at,
            scale,
            out,
        } = self;
        let d = q.len();
        let groups = out.len() / 8;
        let sc = simd.splat_f32x8(scale);
        let avx = simd.avx;
        for g in 0..groups {
            let mut acc = [simd.splat_f32x8(0.0); 8];
            for c in 0..d / 8 {
                let qv: [f32; 8] = q[c * 8..c * 8 + 8].try_into().expect("8 floats");
                let qv: f32x8 = pulp::cast(qv);
                for (p, a) in acc.iter_mut().enumerate() {
                    let o = (g * 8 + p) * stride + at + c * 8;
                    let kv: [f32; 8] = keys[o..o + 8].try_into().expect("8 floats");
                    // `acc += q * k`, unfused, as `kernels::dot`.
                    *a = simd.add_f32x8(*a, simd.mul_f32x8(qv, pulp::cast(kv)));
                }
            }
            // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]: two
            // rounds give each position's (0+1)+(2+3) in the low half and (4+5)+(6+7) in
            // the high half; the last add joins the halves.
            let h = |a: f32x8, b: f32x8| -> f32x8 {
                pulp::cast(avx._mm256_hadd_ps(pulp::cast(a), pulp::cast(b)))
            };
            let g0 = h(h(acc[0], acc[1]), h(acc[2], acc[3]));
            let g1 = h(h(acc[4], acc[5]), h(acc[6], acc[7]));
            let lo = avx._mm256_permute2f128_ps::<0x20>(pulp::cast(g0), pulp::cast(g1));
            let hi = avx._mm256_permute2f128_ps::<0x31>(pulp::cast(g0), pulp::cast(g1));
            let sum = simd.add_f32x8(pulp::cast(lo), pulp::cast(hi));
            let v: [f32; 8] = pulp::cast(simd.mul_f32x8(sum, sc));
            out[g * 8..g * 8 + 8].copy_from_slice(&v);
        }
        groups * 8
    }
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
        // Three batch rows by two weight rows: twelve sums and four weight registers,
        // AVX2's sixteen, the batch rows read from memory by the multiply-adds.
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
