//! The AVX-512F bodies: an output's sixteen running sums are one register, lane `l` the
//! sum of `l`, so the order is [`dot16`]'s as in the AVX2 bodies. With thirty-two
//! registers a tile is six batch rows by four weight rows (twenty-four sums, four weight
//! registers, one batch row register).
//!
//! The crate's one module of hand-written `unsafe`: the AVX-512 intrinsics are not in
//! `pulp` on stable Rust. Each inner function is `unsafe` for one reason, that it must run
//! on a CPU with AVX-512F; the public ones check that first, and panic without it. Every
//! pointer read is inside a slice whose length is checked first.

use core::arch::x86_64::{
    __m256i, __m512, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehl_ps, _mm_shuffle_ps,
    _mm256_add_ps, _mm256_castpd_ps, _mm256_castps256_ps128, _mm256_extractf128_ps,
    _mm256_loadu_si256, _mm512_add_ps, _mm512_castpd512_pd256, _mm512_castps_pd,
    _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_extractf64x4_pd, _mm512_fmadd_ps,
    _mm512_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4, _mm512_shuffle_ps,
    _mm512_slli_epi32,
};

use super::{LANES, tail};
use crate::dtype::{DType, MatRef, widen};

/// Whether this CPU runs these bodies.
pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// The sixteen sums of a register, lane by lane.
#[inline(always)]
fn lanes(v: __m512) -> [f32; LANES] {
    // SAFETY: sixteen f32 lanes are 64 bytes of plain data either way.
    unsafe { core::mem::transmute::<__m512, [f32; LANES]>(v) }
}

/// [`super::combine`] in registers: lanes `l` and `l + 8` (the two halves), then `l` and
/// `l + 4` (the two quarters), then `l` and `l + 2`, then the last two: the same adds of
/// the same pairs, so the same bits.
#[target_feature(enable = "avx512f")]
#[inline]
fn reduce(v: __m512) -> f32 {
    let lo = _mm256_castpd_ps(_mm512_castpd512_pd256(_mm512_castps_pd(v)));
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let t = _mm256_add_ps(lo, hi);
    let u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    let w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps::<1>(w, w)))
}

/// [`super::fma_peak`] on sixteen-lane registers.
pub fn fma_peak(seconds: f64) -> f64 {
    use std::hint::black_box;
    let mut rounds = 1u64 << 16;
    loop {
        let t = std::time::Instant::now();
        assert!(available(), "AVX-512F");
        // SAFETY: the CPU has AVX-512F (asserted just above).
        black_box(unsafe { chains(rounds) });
        let dt = t.elapsed().as_secs_f64();
        if dt >= seconds || rounds >= 1 << 40 {
            return (rounds * 12 * 16 * 2) as f64 / dt;
        }
        rounds *= 2;
    }
}

/// Twelve independent chains of sixteen-lane FMAs, `rounds` steps each.
#[target_feature(enable = "avx512f")]
unsafe fn chains(rounds: u64) -> f32 {
    use std::hint::black_box;
    let a = _mm512_set1_ps(black_box(0.999_99));
    let b = _mm512_set1_ps(black_box(1e-7));
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..rounds {
        for c in &mut acc {
            *c = _mm512_fmadd_ps(*c, a, b);
        }
    }
    acc.iter().map(|c| lanes(*c).iter().sum::<f32>()).sum()
}

/// Sixteen weights of a bf16 or f32 row from element `at` on.
///
/// # Safety
/// AVX-512F, and `row` holds elements `at..at + 16` of `dtype`.
#[inline(always)]
unsafe fn weights(row: &[u8], dtype: DType, at: usize) -> __m512 {
    unsafe {
        if dtype == DType::Bf16 {
            // A bf16 is the top half of its f32: widen each to 32 bits, move it up 16.
            let h = _mm256_loadu_si256(row.as_ptr().add(at * 2).cast::<__m256i>());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_loadu_ps(row.as_ptr().add(at * 4).cast::<f32>())
        }
    }
}

/// Outputs `j0..j1` of every batch row of `x` against bf16 or f32 weight rows read in
/// place, into `dst` (row-major, `j1 - j0` wide): two weight rows at a time (two chains of
/// sums for one batch row), against four batch rows or one.
///
/// Panics on a CPU without AVX-512F, or with weights of another type.
pub fn direct(
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    assert!(available(), "AVX-512F");
    assert!(matches!(w.dtype, DType::Bf16 | DType::F32));
    // SAFETY: the CPU has AVX-512F and the weights are bf16 or f32 (asserted just above).
    unsafe { direct_avx512(x, w, bias, j0, j1, dst) }
}

/// [`direct`], its checks made.
///
/// # Safety
/// The CPU has AVX-512F; `w` is bf16 or f32.
#[target_feature(enable = "avx512f")]
unsafe fn direct_avx512(
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    let k = w.cols;
    let s = w.dtype.row_bytes(k);
    assert!(w.bytes.len() >= j1 * s && x.len().is_multiple_of(k.max(1)));
    let m = x.len() / k.max(1);
    let width = j1 - j0;
    let mut j = j0;
    while j < j1 {
        let nr = (j1 - j).min(2);
        let mut i = 0;
        while i < m {
            let mr = if m - i >= 4 { 4 } else { 1 };
            // SAFETY: AVX-512F, rows `j..j + nr` and batch rows `i..i + mr` exist.
            unsafe {
                match (mr, nr) {
                    (4, 2) => put(in_place::<4, 2>(x, i, w, j), i, j - j0, width, bias, j, dst),
                    (4, _) => put(in_place::<4, 1>(x, i, w, j), i, j - j0, width, bias, j, dst),
                    (_, 2) => put(in_place::<1, 2>(x, i, w, j), i, j - j0, width, bias, j, dst),
                    _ => put(in_place::<1, 1>(x, i, w, j), i, j - j0, width, bias, j, dst),
                }
            }
            i += mr;
        }
        j += nr;
    }
}

/// Writes a tile's outputs (batch rows from `i0`, weight rows from `r0`, found at column
/// `c0` of `dst`) with their bias (from `b0`).
#[inline(always)]
fn put<const MR: usize, const NR: usize>(
    o: [[f32; NR]; MR],
    i0: usize,
    c0: usize,
    width: usize,
    bias: Option<&[f32]>,
    b0: usize,
    dst: &mut [f32],
) {
    for (i, o) in o.iter().enumerate() {
        for (r, v) in o.iter().enumerate() {
            dst[(i0 + i) * width + c0 + r] = v + bias.map_or(0.0, |b| b[b0 + r]);
        }
    }
}

/// Batch rows `i0..i0 + MR` of `x` against weight rows `j0..j0 + NR` of `w`, read in place.
///
/// # Safety
/// AVX-512F; those rows exist; `w` is bf16 or f32.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn in_place<const MR: usize, const NR: usize>(
    x: &[f32],
    i0: usize,
    w: MatRef<'_>,
    j0: usize,
) -> [[f32; NR]; MR] {
    let k = w.cols;
    let s = w.dtype.row_bytes(k);
    let xs = &x[i0 * k..(i0 + MR) * k];
    let rows: [&[u8]; NR] = core::array::from_fn(|r| &w.bytes[(j0 + r) * s..(j0 + r + 1) * s]);
    let full = k / LANES;
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    for c in 0..full {
        let at = c * LANES;
        let mut wv = [_mm512_setzero_ps(); NR];
        for r in 0..NR {
            // SAFETY: `at + 16 <= k`, the row's length.
            wv[r] = unsafe { weights(rows[r], w.dtype, at) };
        }
        for i in 0..MR {
            // SAFETY: `i * k + at + 16 <= MR * k`, the length of `xs`.
            let xv = unsafe { _mm512_loadu_ps(xs.as_ptr().add(i * k + at)) };
            for r in 0..NR {
                acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
            }
        }
    }
    let done = full * LANES;
    let mut out = [[0f32; NR]; MR];
    let mut wt = [0f32; LANES];
    for r in 0..NR {
        // The columns past the last full group: widened, then added in order.
        widen(
            &rows[r][w.dtype.row_bytes(done)..],
            w.dtype,
            &mut wt[..k - done],
        );
        for i in 0..MR {
            let xi = &xs[i * k + done..(i + 1) * k];
            out[i][r] = tail(reduce(acc[i][r]), xi, &wt[..k - done]);
        }
    }
    out
}

/// Every batch row of `x` against the widened weight rows `ws` (`k` wide), into `dst`
/// (rows `width` wide, these outputs from column `at`), plus `bias`: tiles of six batch
/// rows by four weight rows, the weight rows read for each tile from this thread's
/// scratch.
///
/// Panics on a CPU without AVX-512F.
pub fn widened(
    x: &[f32],
    ws: &[f32],
    k: usize,
    width: usize,
    at: usize,
    bias: Option<&[f32]>,
    dst: &mut [f32],
) {
    assert!(available(), "AVX-512F");
    // SAFETY: the CPU has AVX-512F (asserted just above).
    unsafe { widened_avx512(x, ws, k, width, at, bias, dst) }
}

/// [`widened`], its check made.
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn widened_avx512(
    x: &[f32],
    ws: &[f32],
    k: usize,
    width: usize,
    at: usize,
    bias: Option<&[f32]>,
    dst: &mut [f32],
) {
    assert!(k > 0 && x.len().is_multiple_of(k) && ws.len().is_multiple_of(k));
    let (m, nb) = (x.len() / k, ws.len() / k);
    let full = k / LANES;
    // The weight rows packed four at a time: a group's sixteen values of column group `c`
    // for each of its rows side by side, so a tile reads one stream, not four.
    // The packed weights start on a cache line (and the batch rows, copied once by
    // `widened`), so no sixteen-float load straddles two lines.
    super::with(&PACKED, nb * full * LANES + LANES, |packed| {
        let off = packed.as_ptr().align_offset(64);
        let packed = &mut packed[off..off + nb * full * LANES];
        for (g, rows) in ws.chunks(4 * k).enumerate() {
            let nr = rows.len() / k;
            let dst = &mut packed[g * 4 * full * LANES..][..nr * full * LANES];
            for c in 0..full {
                for r in 0..nr {
                    dst[(c * nr + r) * LANES..][..LANES]
                        .copy_from_slice(&rows[r * k + c * LANES..][..LANES]);
                }
            }
        }
        let packed = &*packed;
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(6);
            // SAFETY: AVX-512F; batch rows `i..i + mr` of `x` exist.
            unsafe {
                match mr {
                    6 => band::<6>(x, i, ws, packed, nb, k, width, at, bias, i, dst),
                    5 => band::<5>(x, i, ws, packed, nb, k, width, at, bias, i, dst),
                    4 => band::<4>(x, i, ws, packed, nb, k, width, at, bias, i, dst),
                    3 => band::<3>(x, i, ws, packed, nb, k, width, at, bias, i, dst),
                    2 => band::<2>(x, i, ws, packed, nb, k, width, at, bias, i, dst),
                    _ => band::<1>(x, i, ws, packed, nb, k, width, at, bias, i, dst),
                }
            }
            i += mr;
        }
    });
}

thread_local! {
    /// A thread's weight rows packed for [`tile`].
    static PACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Batch rows `i0..i0 + MR` against every weight row of `ws`, four at a time.
///
/// # Safety
/// AVX-512F; those batch rows exist.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn band<const MR: usize>(
    x: &[f32],
    i0: usize,
    ws: &[f32],
    packed: &[f32],
    nb: usize,
    k: usize,
    width: usize,
    at: usize,
    bias: Option<&[f32]>,
    out_row: usize,
    dst: &mut [f32],
) {
    let mut r = 0;
    while r < nb {
        let nr = (nb - r).min(4);
        let b = bias.map(|b| &b[r..]);
        // SAFETY: AVX-512F; rows `r..r + nr` of `ws` and the batch rows exist.
        unsafe {
            match nr {
                4 => put(
                    tile::<MR, 4>(x, i0, ws, packed, r, k),
                    out_row,
                    at + r,
                    width,
                    b,
                    0,
                    dst,
                ),
                3 => put(
                    tile::<MR, 3>(x, i0, ws, packed, r, k),
                    out_row,
                    at + r,
                    width,
                    b,
                    0,
                    dst,
                ),
                2 => put(
                    tile::<MR, 2>(x, i0, ws, packed, r, k),
                    out_row,
                    at + r,
                    width,
                    b,
                    0,
                    dst,
                ),
                _ => put(
                    tile::<MR, 1>(x, i0, ws, packed, r, k),
                    out_row,
                    at + r,
                    width,
                    b,
                    0,
                    dst,
                ),
            }
        }
        r += nr;
    }
}

/// Batch rows `i0..i0 + MR` of `x` by widened weight rows `r0..r0 + NR` of `ws`.
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile<const MR: usize, const NR: usize>(
    x: &[f32],
    i0: usize,
    ws: &[f32],
    packed: &[f32],
    r0: usize,
    k: usize,
) -> [[f32; NR]; MR] {
    let xs = &x[i0 * k..(i0 + MR) * k];
    let wr = &ws[r0 * k..(r0 + NR) * k];
    let full = k / LANES;
    // Rows `r0..r0 + NR` are one packed group (`r0` a multiple of four).
    let wp = &packed[r0 * full * LANES..(r0 + NR) * full * LANES];
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    for c in 0..full {
        let at = c * LANES;
        let mut wv = [_mm512_setzero_ps(); NR];
        for r in 0..NR {
            // SAFETY: `(c * NR + r + 1) * 16 <= NR * full * 16`, the length of `wp`.
            wv[r] = unsafe { _mm512_loadu_ps(wp.as_ptr().add((c * NR + r) * LANES)) };
        }
        for i in 0..MR {
            // SAFETY: `i * k + at + 16 <= MR * k`, the length of `xs`.
            let xv = unsafe { _mm512_loadu_ps(xs.as_ptr().add(i * k + at)) };
            for r in 0..NR {
                acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
            }
        }
    }
    let f = full * LANES;
    let mut out = [[0f32; NR]; MR];
    if NR == 4 && f == k {
        // Four outputs of a batch row reduced together: the same adds of the same pairs.
        for i in 0..MR {
            let four = reduce4([acc[i][0], acc[i][1], acc[i][2], acc[i][3]]);
            out[i][..4].copy_from_slice(&four);
        }
        return out;
    }
    for i in 0..MR {
        for r in 0..NR {
            out[i][r] = tail(
                reduce(acc[i][r]),
                &xs[i * k + f..(i + 1) * k],
                &wr[r * k + f..(r + 1) * k],
            );
        }
    }
    out
}

/// [`reduce`] of four registers at once, lane for lane the same adds: halves (`l`, `l + 8`)
/// of two registers side by side in one, then quarters (`l`, `l + 4`) of four, then
/// `l`, `l + 2` and the last two within each 128-bit block; the results are lane 0 of
/// each block.
#[target_feature(enable = "avx512f")]
#[inline]
fn reduce4(a: [__m512; 4]) -> [f32; 4] {
    // [a.q0, a.q1, b.q0, b.q1] + [a.q2, a.q3, b.q2, b.q3]: each lane l < 8 of a and b plus
    // its lane l + 8.
    let halves = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    };
    let (p, q) = (halves(a[0], a[1]), halves(a[2], a[3]));
    // [p.q0, p.q2, q.q0, q.q2] + [p.q1, p.q3, q.q1, q.q3]: lane l < 4 plus l + 4, per input.
    let r = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(p, q),
        _mm512_shuffle_f32x4::<0xDD>(p, q),
    );
    // Within each block: lanes 0 and 1 plus lanes 2 and 3, then lane 0 plus lane 1.
    let s = _mm512_add_ps(r, _mm512_shuffle_ps::<0xEE>(r, r));
    let t = _mm512_add_ps(s, _mm512_shuffle_ps::<0x55>(s, s));
    let l = lanes(t);
    [l[0], l[4], l[8], l[12]]
}
