//! The `simd` kernels: this model's products written for the CPU's vector unit (AVX-512F, or
//! AVX2 with FMA through `pulp`, chosen at run time: [`Isa`]), reading bf16, f32 and ggml's
//! Q8_0, Q4_0 and Q4_1 weights straight from the checkpoint into registers, and run on the
//! model's kept [`Workers`].
//!
//! **One order for every output.** An output `x . w` keeps sixteen running sums: lane `l` adds
//! `x[t] * w[t]` for `t = l, l + 16, l + 32, ...` in turn, each step one fused multiply-add. The
//! sixteen are then combined in one fixed tree, `((0+8)+(4+12))+((2+10)+(6+14))` and so on (see
//! [`combine`]), the `k mod 16` columns past the last full group are added one by one in order
//! (fused), and the bias last. [`dot16`] writes that order out in plain Rust. Every path below
//! computes exactly it:
//! - a small batch reads the weight rows in place (bf16, f32, Q8_0, Q4_0, Q4_1), one row at a
//!   time against up to four batch rows, so the weights are one sequential stream;
//! - a large batch widens a block of weight rows into a per-thread scratch first (exact: a
//!   bf16, f16 or f32 value is the same f32 either way) and multiplies a tile of batch rows by
//!   a few weight rows (three by two with AVX2; six by four, packed, with AVX-512);
//! - the work is split over threads by output rows, never across a reduction.
//!
//! So a row's outputs are the same bits whatever its batch, its place in the batch, the split,
//! or the thread count, and the same on every x86-64 CPU with AVX-512 or AVX2 and on any other
//! CPU (whose path is [`dot16`] itself): a prefill engine on AVX-512 and a decode engine on
//! AVX2 give the same tokens. `simd_matches_the_written_order` holds every path this CPU runs
//! to [`dot16`]; attention's scores ([`scores`]) are held to [`super::order::dot`] the same way.

use std::cell::RefCell;

use super::order::{LANES, combine, dot16, tail};
use crate::dtype::{MatRef, widen};
use crate::workers::Workers;

/// From this many batch rows up, blocks of weight rows are widened once and shared by the
/// batch.
pub const WIDEN_FROM_ROWS: usize = 12;
/// Floats of widened weights a thread keeps at once (64 KiB: a block stays in L2).
const BLOCK_FLOATS: usize = 16 * 1024;

thread_local! {
    /// A thread's widened weights, kept across products.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A thread's widened f16 rows ([`direct_f16`]), apart from [`SCRATCH`]: the product it
    /// then runs may take that one.
    static F16_ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A thread's copy of a product's batch rows on a cache line ([`widened`]).
    static ALIGNED_ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch of at least `len` floats.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    with(&SCRATCH, len, f)
}

/// Runs `f` with `key`'s buffer of at least `len` floats.
fn with<R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    key.with(|s| {
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

/// A vector path of these kernels. Every one computes the one order of [`dot16`], so they
/// give the same bits; they differ only in the instructions that run it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// [`dot16`]'s plain Rust.
    Portable,
    /// AVX2 with FMA (x86-64-v3, through `pulp`): each output's sixteen sums are two
    /// registers of eight.
    Avx2,
    /// AVX-512F: each output's sixteen sums are one register of sixteen, with wider tiles
    /// (thirty-two registers). bf16 and f32 weights; ggml's block types run the AVX2 bodies.
    Avx512,
}

impl Isa {
    /// The fastest path this CPU runs.
    #[must_use]
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if pulp::x86::V3::try_new().is_some() {
                if v4::available() {
                    return Self::Avx512;
                }
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Every path this CPU runs, the portable one first.
    #[must_use]
    pub fn here() -> Vec<Self> {
        let mut all = vec![Self::Portable];
        if Self::best() != Self::Portable {
            all.push(Self::Avx2);
        }
        if Self::best() == Self::Avx512 {
            all.push(Self::Avx512);
        }
        all
    }

    /// The name a benchmark prints.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2+fma",
            Self::Avx512 => "avx512f",
        }
    }
}

/// The instruction set the kernels run on this CPU: `avx512f` (bf16 and f32 weights; the
/// block types on AVX2), `avx2+fma` (x86-64-v3, through `pulp`), else `portable` ([`dot16`]'s
/// plain Rust). All give the same bits.
#[must_use]
pub fn isa() -> &'static str {
    Isa::best().name()
}

/// The most f32 fused multiply-adds one thread runs, in FLOP/s (two per lane), over about
/// `seconds`: twelve independent chains of FMAs on registers, as wide as the kernels' own
/// instruction set ([`isa`]) runs them (the ceiling their products are held to).
#[must_use]
pub fn fma_peak(seconds: f64) -> f64 {
    use std::hint::black_box;
    #[cfg(target_arch = "x86_64")]
    if Isa::best() == Isa::Avx512 {
        return v4::fma_peak(seconds);
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        struct Chains(pulp::x86::V3, u64);
        impl pulp::NullaryFnOnce for Chains {
            type Output = f32;
            #[inline(always)]
            fn call(self) -> f32 {
                let Chains(simd, rounds) = self;
                let a = simd.splat_f32x8(black_box(0.999_99));
                let b = simd.splat_f32x8(black_box(1e-7));
                let mut acc = [simd.splat_f32x8(1.0); 12];
                for _ in 0..rounds {
                    for c in &mut acc {
                        *c = simd.mul_add_f32x8(*c, a, b);
                    }
                }
                let mut s = 0f32;
                for c in acc {
                    let l: [f32; 8] = pulp::cast(c);
                    s += l.iter().sum::<f32>();
                }
                s
            }
        }
        let mut rounds = 1u64 << 16;
        loop {
            let t = std::time::Instant::now();
            black_box(simd.vectorize(Chains(simd, rounds)));
            let dt = t.elapsed().as_secs_f64();
            if dt >= seconds || rounds >= 1 << 40 {
                return (rounds * 12 * 8 * 2) as f64 / dt;
            }
            rounds *= 2;
        }
    }
    let t = std::time::Instant::now();
    let mut acc = [1f32; 12];
    let mut n = 0u64;
    while t.elapsed().as_secs_f64() < seconds {
        for _ in 0..1 << 16 {
            for c in &mut acc {
                *c = c.mul_add(black_box(0.999_99), 1e-7);
            }
        }
        n += 1 << 16;
    }
    black_box(acc);
    (n * 12 * 2) as f64 / t.elapsed().as_secs_f64()
}

/// Attention scores: `out[p] = dot(q, keys[p * stride + at..][..q.len()]) * scale` for every
/// position `p < out.len()`, each dot in [`super::order::dot`]'s order (eight running sums,
/// unfused, the tree `((0+1)+(2+3))+((4+5)+(6+7))`, then the tail), and their maximum (NaNs
/// skipped, as `f32::max` does). With AVX2 eight positions run at once, their trees summed
/// by horizontal adds, which add the same pairs; so every path gives the same bits.
pub fn scores(
    q: &[f32],
    keys: &[f32],
    stride: usize,
    at: usize,
    scale: f32,
    out: &mut [f32],
) -> f32 {
    scores_on(Isa::best(), q, keys, stride, at, scale, out)
}

/// [`scores`] on the path `isa`.
pub fn scores_on(
    isa: Isa,
    q: &[f32],
    keys: &[f32],
    stride: usize,
    at: usize,
    scale: f32,
    out: &mut [f32],
) -> f32 {
    let d = q.len();
    let key = |p: usize| &keys[p * stride + at..p * stride + at + d];
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable
        && d.is_multiple_of(8)
        && let Some(simd) = pulp::x86::V3::try_new()
    {
        done = simd.vectorize(v3::Scores {
            simd,
            q,
            keys,
            stride,
            at,
            scale,
            out: &mut *out,
        });
    }
    for (p, s) in out.iter_mut().enumerate().skip(done) {
        *s = super::order::dot(q, key(p)) * scale;
    }
    let mut max = [f32::NEG_INFINITY; 8];
    let mut chunks = out.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            max[l] = max[l].max(c[l]);
        }
    }
    let mut m = f32::NEG_INFINITY;
    for v in max.iter().chain(chunks.remainder()) {
        m = m.max(*v);
    }
    m
}

/// One product of [`matmul_many`]: `out[i][j] = x[i] . w[j] (+ bias[j])`.
#[derive(Debug)]
pub struct Product<'a, 'o> {
    /// The weights.
    pub w: MatRef<'a>,
    /// Their bias.
    pub bias: Option<&'a [f32]>,
    /// `m` rows of `w.rows` outputs.
    pub out: &'o mut [f32],
}

/// Runs `op` compiled for AVX2 and FMA where the CPU has them, as [`vectorized`]; an `op` whose
/// `call` is `#[inline(always)]` is inlined there, body and all.
pub fn run<Op: pulp::NullaryFnOnce>(op: Op) -> Op::Output {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(op);
    }
    op.call()
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
    matmul_many(x, &mut [Product { w, bias, out }], workers);
}

/// A run of one product's output rows given to one thread: outputs `j0..j1` of every batch
/// row go to `dst` (`m` rows of `j1 - j0`).
struct Piece<'a, 'd> {
    w: MatRef<'a>,
    bias: Option<&'a [f32]>,
    j0: usize,
    j1: usize,
    dst: &'d mut [f32],
}

/// Several products of the same batch rows `x` (Q, K and V; gate and up), their output rows
/// split over the threads together, so they cost one hand-over instead of one each. Each
/// output is in the order of [`dot16`], as alone.
pub fn matmul_many(x: &[f32], products: &mut [Product<'_, '_>], workers: &Workers) {
    matmul_many_on(Isa::best(), x, products, workers);
}

/// [`matmul_many`] on the vector path `isa` (one this CPU runs: see [`Isa::here`]; a path it
/// lacks falls back to the next narrower one).
pub fn matmul_many_on(isa: Isa, x: &[f32], products: &mut [Product<'_, '_>], workers: &Workers) {
    let Some(k) = products.first().map(|p| p.w.cols) else {
        return;
    };
    let m = x.len() / k.max(1);
    let total: usize = products.iter().map(|p| p.w.rows).sum();
    if m == 0 || total == 0 {
        return;
    }
    debug_assert!(
        products
            .iter()
            .all(|p| p.w.cols == k && p.out.len() == m * p.w.rows)
    );
    // Small products are not worth a second thread.
    let threads = if m * total * k < 1 << 16 {
        1
    } else {
        workers.threads()
    };
    // Output rows are cut into runs of about `total / threads` (a multiple of four within each
    // product), every batch row going to every run.
    let share = total.div_ceil(threads).div_ceil(4) * 4;
    let mut cuts: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new()];
    let mut room = share;
    for (p, prod) in products.iter().enumerate() {
        let n = prod.w.rows;
        let mut j = 0;
        while j < n {
            if room == 0 {
                cuts.push(Vec::new());
                room = share;
            }
            let e = (j + room).min(n);
            cuts.last_mut().expect("one run at least").push((p, j, e));
            room -= e - j;
            j = e;
        }
    }
    // With one batch row a run's outputs are pieces of the products' own outputs; with more,
    // pieces of `tmp` (m rows of their width each), copied out after.
    let meta: Vec<(MatRef<'_>, Option<&[f32]>)> = products.iter().map(|p| (p.w, p.bias)).collect();
    let mut tmp = if m == 1 {
        Vec::new()
    } else {
        vec![0f32; m * total]
    };
    let mut outs: Vec<&mut [f32]> = if m == 1 {
        products.iter_mut().map(|p| &mut *p.out).collect()
    } else {
        let mut rest = &mut tmp[..];
        let mut v = Vec::with_capacity(products.len());
        for (w, _) in &meta {
            let (a, b) = rest.split_at_mut(m * w.rows);
            v.push(a);
            rest = b;
        }
        v
    };
    let mut parts: Vec<Vec<Piece<'_, '_>>> = Vec::with_capacity(cuts.len());
    {
        // Hand out each product's output (or its `tmp`) front to back, in the runs' order.
        let mut rests: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut **o).collect();
        for run in &cuts {
            let mut pieces = Vec::with_capacity(run.len());
            for &(p, j0, j1) in run {
                let rest = std::mem::take(&mut rests[p]);
                let (a, b) = rest.split_at_mut(m * (j1 - j0));
                rests[p] = b;
                pieces.push(Piece {
                    w: meta[p].0,
                    bias: meta[p].1,
                    j0,
                    j1,
                    dst: a,
                });
            }
            parts.push(pieces);
        }
    }
    workers.each(parts, |pieces| {
        for piece in pieces {
            let Piece {
                w,
                bias,
                j0,
                j1,
                dst,
            } = piece;
            if m < WIDEN_FROM_ROWS {
                direct(isa, x, w, bias, j0, j1, dst);
            } else {
                widened(isa, x, w, bias, j0, j1, dst);
            }
        }
    });
    if m == 1 {
        return;
    }
    drop(outs);
    let mut at = 0;
    for (p, prod) in products.iter_mut().enumerate() {
        let n = prod.w.rows;
        for &(_, j0, j1) in cuts.iter().flatten().filter(|c| c.0 == p) {
            let width = j1 - j0;
            for i in 0..m {
                prod.out[i * n + j0..i * n + j1].copy_from_slice(&tmp[at..at + width]);
                at += width;
            }
        }
    }
}

/// Outputs `j0..j1` of every batch row, into `dst` (row-major, `j1 - j0` wide), reading the
/// weight rows in place.
fn direct(
    isa: Isa,
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    use crate::dtype::DType;
    if matches!(w.dtype, DType::F16 | DType::Q5_0 | DType::Q5_1) {
        // No f16 conversion or fifth bits in registers here: the rows are widened (exactly)
        // into this thread's scratch, a block at a time, and read as f32.
        return direct_widened(isa, x, w, bias, j0, j1, dst);
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && matches!(w.dtype, DType::Bf16 | DType::F32) && v4::available() {
        return v4::direct(x, w, bias, j0, j1, dst);
    }
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable
        && let Some(simd) = pulp::x86::V3::try_new()
    {
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

/// [`direct`] on f16, Q5_0 or Q5_1 weights: blocks of rows widened into this thread's
/// scratch, then read as f32 (the same values, so the same bits).
fn direct_widened(
    isa: Isa,
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    let k = w.cols;
    let m = x.len() / k.max(1);
    let width = j1 - j0;
    let block = (BLOCK_FLOATS / k.max(1)).max(1);
    with(&F16_ROWS, block * k, |scratch| {
        let mut piece = Vec::new();
        let mut j = j0;
        while j < j1 {
            let e = (j + block).min(j1);
            let wide = &mut scratch[..(e - j) * k];
            let s = w.dtype.row_bytes(k);
            widen(&w.bytes[j * s..e * s], w.dtype, wide);
            let f32s = MatRef {
                bytes: bytemuck::cast_slice(wide),
                dtype: crate::dtype::DType::F32,
                rows: e - j,
                cols: k,
            };
            piece.clear();
            piece.resize(m * (e - j), 0.0);
            direct(isa, x, f32s, bias.map(|b| &b[j..e]), 0, e - j, &mut piece);
            for i in 0..m {
                dst[i * width + j - j0..i * width + e - j0]
                    .copy_from_slice(&piece[i * (e - j)..(i + 1) * (e - j)]);
            }
            j = e;
        }
    });
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
fn widened(
    isa: Isa,
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    // The AVX-512 tiles read the batch rows sixteen floats at a time: copied once onto a cache
    // line (when a row is whole lines), so no load straddles two lines.
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512
        && w.cols.is_multiple_of(LANES)
        && x.as_ptr().align_offset(64) != 0
        && v4::available()
    {
        return with(&ALIGNED_ROWS, x.len() + LANES, |buf| {
            let off = buf.as_ptr().align_offset(64);
            let xa = &mut buf[off..off + x.len()];
            xa.copy_from_slice(x);
            widened_blocks(isa, xa, w, bias, j0, j1, dst);
        });
    }
    widened_blocks(isa, x, w, bias, j0, j1, dst);
}

/// [`widened`], the batch rows where they are.
fn widened_blocks(
    isa: Isa,
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    let k = w.cols;
    let width = j1 - j0;
    let block = (BLOCK_FLOATS / k.max(1)).clamp(2, width.max(2)) & !1;
    with_scratch(block * k, |scratch| {
        let mut j = j0;
        while j < j1 {
            let e = (j + block).min(j1);
            let s = w.dtype.row_bytes(k);
            let ws = &mut scratch[..(e - j) * k];
            vectorized(|| widen_fast(&w.bytes[j * s..e * s], w.dtype, ws));
            let ws = &*ws;
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx512 && v4::available() {
                v4::widened(x, ws, k, width, j - j0, bias.map(|b| &b[j..e]), dst);
                j = e;
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if isa != Isa::Portable
                && let Some(simd) = pulp::x86::V3::try_new()
            {
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
fn widen_fast(bytes: &[u8], dtype: crate::dtype::DType, out: &mut [f32]) {
    if dtype == crate::dtype::DType::Bf16 {
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
        }
    } else {
        widen(bytes, dtype, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod v3;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, clippy::needless_range_loop)]
mod v4;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn weights(n: usize, k: usize, dtype: DType) -> Vec<u8> {
        let hash = |i: usize| ((i as u32).wrapping_mul(2_654_435_761) >> 7) as usize;
        if dtype.block_values() > 1 {
            // Whole blocks: scales of either sign and every byte value in the quants.
            return (0..n * k / 32)
                .flat_map(|b| {
                    let d = half::f16::from_f32((hash(b) % 200) as f32 / 4000.0 - 0.02);
                    let m = half::f16::from_f32((hash(b + 7) % 100) as f32 / 1000.0 - 0.05);
                    let mut block = d.to_le_bytes().to_vec();
                    if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                        block.extend(m.to_le_bytes());
                    }
                    let quants = dtype.size() - block.len();
                    block.extend((0..quants).map(|q| hash(b * 64 + q) as u8));
                    block
                })
                .collect();
        }
        (0..n * k)
            .flat_map(|i| {
                let v = (hash(i) % 2000) as f32 / 1000.0 - 1.0;
                match dtype {
                    DType::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                    _ => v.to_le_bytes().to_vec(),
                }
            })
            .collect()
    }

    /// Every vector path this CPU runs (portable, AVX2, AVX-512: [`Isa::here`]) and every
    /// shape within it (rows read in place against four and one batch rows, one or two weight
    /// rows at once; widened blocks, tiles of one to six batch rows by one to four weight rows;
    /// on 1 to 3 threads; bf16, f16, f32, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1) is the order [`dot16`] writes
    /// out, bit for bit, for every row of every batch from 1 to 40.
    /// So batch 1 and batch N take the same order: if either path changed its order, the row
    /// would differ from [`dot16`] here.
    #[test]
    fn simd_matches_the_written_order() {
        let types = [
            DType::Bf16,
            DType::F32,
            DType::F16,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
        ];
        for (n, k) in [
            (9usize, 16usize),
            (23, 100),
            (64, 576),
            (130, 1536),
            (6, 7),
            (7, 32),
        ] {
            for dtype in types.into_iter().filter(|t| k % t.block_values() == 0) {
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
                for (isa, threads) in Isa::here()
                    .into_iter()
                    .flat_map(|isa| [1, 2, 3].map(|t| (isa, t)))
                {
                    let workers = Workers::new(threads);
                    for m in (1..=40).filter(|m| *m < 14 || m % 7 == 0 || *m == 40) {
                        let mut out = vec![0f32; m * n];
                        matmul_many_on(
                            isa,
                            &x[..m * k],
                            &mut [Product {
                                w,
                                bias: Some(&bias),
                                out: &mut out,
                            }],
                            &workers,
                        );
                        // The same product beside another (its first rows, no bias) in one
                        // call: the same bits, and the other's rows are its own.
                        let (mut with, mut other) = (vec![0f32; m * n], vec![0f32; m * n.min(5)]);
                        let small = MatRef {
                            rows: n.min(5),
                            bytes: &bytes[..n.min(5) * dtype.row_bytes(k)],
                            ..w
                        };
                        matmul_many_on(
                            isa,
                            &x[..m * k],
                            &mut [
                                Product {
                                    w: small,
                                    bias: None,
                                    out: &mut other,
                                },
                                Product {
                                    w,
                                    bias: Some(&bias),
                                    out: &mut with,
                                },
                            ],
                            &workers,
                        );
                        assert_eq!(
                            with.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                        );
                        for i in 0..m {
                            for j in 0..n.min(5) {
                                w.row_into(j, &mut row);
                                assert_eq!(
                                    other[i * n.min(5) + j].to_bits(),
                                    dot16(&x[i * k..(i + 1) * k], &row).to_bits()
                                );
                            }
                        }
                        for i in 0..m {
                            let got: Vec<u32> = out[i * n..(i + 1) * n]
                                .iter()
                                .map(|v| v.to_bits())
                                .collect();
                            assert_eq!(
                                got, expect[i],
                                "n {n} k {k} {dtype:?}: row {i} of a batch of {m} on {threads} threads, {isa:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Attention scores on every path: each the bits of `kernels::dot(q, key) * scale`, and
    /// the maximum theirs, for head sizes with and without a tail and any count of positions.
    #[test]
    fn scores_are_the_written_dot_on_every_path() {
        for (d, stride, at) in [
            (64usize, 192usize, 64usize),
            (16, 16, 0),
            (24, 48, 24),
            (20, 40, 0),
        ] {
            for n in [1usize, 7, 8, 9, 31, 64, 100] {
                let keys: Vec<f32> = (0..n * stride)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
                    .collect();
                let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
                let want: Vec<u32> = (0..n)
                    .map(|p| {
                        let k = &keys[p * stride + at..p * stride + at + d];
                        (crate::kernels::order::dot(&q, k) * 0.125).to_bits()
                    })
                    .collect();
                let want_max = want
                    .iter()
                    .map(|b| f32::from_bits(*b))
                    .fold(f32::NEG_INFINITY, f32::max);
                for isa in Isa::here() {
                    let mut out = vec![0f32; n];
                    let max = scores_on(isa, &q, &keys, stride, at, 0.125, &mut out);
                    let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{isa:?} d {d} n {n}");
                    assert_eq!(max.to_bits(), want_max.to_bits(), "{isa:?} d {d} n {n}");
                }
            }
        }
    }

    /// Subnormal inputs and products, and sums that overflow, through every path: the same
    /// bits as [`dot16`] (no path flushes a subnormal to zero or saturates).
    #[test]
    fn every_path_keeps_subnormals_and_overflow() {
        let (n, k) = (6usize, 53usize);
        let tiny = f32::from_bits(1); // the smallest subnormal
        let vals = [
            tiny, -tiny, 1e-39, 3e38, -2.5e38, 1.0, 1e-20, 0.0, -0.0, 7e-45,
        ];
        // Even rows only small values (subnormal sums), odd rows every kind (overflow).
        let x: Vec<f32> = (0..20 * k)
            .map(|i| {
                let pick = i * 7 + i / 3;
                if (i / k) % 2 == 0 {
                    [tiny, -tiny, 1e-39, 7e-45, 0.0][pick % 5]
                } else {
                    vals[pick % vals.len()]
                }
            })
            .collect();
        for dtype in [DType::Bf16, DType::F32] {
            let bytes: Vec<u8> = (0..n * k)
                .flat_map(|i| {
                    let v = [1e-38f32, 2.0, -1e-30, 1e20, 0.5, f32::from_bits(3)][i % 6];
                    match dtype {
                        DType::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                        _ => v.to_le_bytes().to_vec(),
                    }
                })
                .collect();
            let w = MatRef {
                bytes: &bytes,
                dtype,
                rows: n,
                cols: k,
            };
            let mut row = vec![0f32; k];
            for isa in Isa::here() {
                for m in [1, 4, 5, 13, 20] {
                    let mut out = vec![0f32; m * n];
                    matmul_many_on(
                        isa,
                        &x[..m * k],
                        &mut [Product {
                            w,
                            bias: None,
                            out: &mut out,
                        }],
                        &Workers::new(1),
                    );
                    for i in 0..m {
                        for j in 0..n {
                            w.row_into(j, &mut row);
                            let want = dot16(&x[i * k..(i + 1) * k], &row);
                            let got = out[i * n + j];
                            assert!(
                                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                                "{isa:?} {dtype:?} batch {m} row {i} out {j}: {got:e} vs {want:e}"
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
