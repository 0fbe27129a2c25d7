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
//! to [`dot16`]; attention's scores ([`scores`]) are held to `kernels::dot` the same way.

use std::cell::RefCell;

use crate::dtype::{MatRef, widen};
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
/// position `p < out.len()`, each dot in [`crate::kernels::dot`]'s order (eight running sums,
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
        *s = crate::kernels::dot(q, key(p)) * scale;
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
    if w.dtype == DType::F16 {
        // No f16 conversion in registers here: the rows are widened (exactly) into this
        // thread's scratch, a block at a time, and read as f32.
        return direct_f16(isa, x, w, bias, j0, j1, dst);
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

/// [`direct`] on f16 weights: blocks of rows widened into this thread's scratch, then read as
/// f32 (the same values, so the same bits).
fn direct_f16(
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
            widen(&w.bytes[j * k * 2..e * k * 2], w.dtype, wide);
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
mod v3 {
    //! The AVX2 + FMA bodies: the sixteen running sums are two registers of eight.

    use core::arch::x86_64::__m128i;
    use half::f16;
    use pulp::x86::V3;

    use pulp::{NullaryFnOnce, f32x8, i32x8, u16x8, u32x8};

    use super::{LANES, combine, tail};
    use crate::dtype::{DType, MatRef, widen};

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
        let d = simd.splat_f32x8(half_to_f32(u16::from_le_bytes([b[0], b[1]])));
        if T == 0 {
            // 32 signed bytes: four groups of eight, each sign-extended to eight lanes.
            let q0: [u8; 16] = b[2..18].try_into().expect("16 bytes");
            let q1: [u8; 16] = b[18..34].try_into().expect("16 bytes");
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
        let at = if T == 1 { 2 } else { 4 };
        let q: [u8; 16] = b[at..at + 16].try_into().expect("16 bytes");
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
        let m = if T == 1 {
            None
        } else {
            Some(simd.splat_f32x8(half_to_f32(u16::from_le_bytes([b[2], b[3]]))))
        };
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
                DType::Q8_0 => columns::<2, 34>(simd, x, w, bias, j0, j1, dst),
                DType::Q4_0 => columns::<3, 18>(simd, x, w, bias, j0, j1, dst),
                DType::Q4_1 => columns::<4, 20>(simd, x, w, bias, j0, j1, dst),
                DType::F16 => unreachable!("f16 rows are widened before they get here"),
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
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, clippy::needless_range_loop)]
mod v4 {
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
        _mm512_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4,
        _mm512_shuffle_ps, _mm512_slli_epi32,
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
}

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
                    if dtype == DType::Q4_1 {
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
    /// on 1 to 3 threads; bf16, f16, f32, Q8_0, Q4_0 and Q4_1) is the order [`dot16`] writes
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
                        (crate::kernels::dot(&q, k) * 0.125).to_bits()
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
