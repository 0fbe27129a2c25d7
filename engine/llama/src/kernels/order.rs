//! The written orders the kernels compute: plain Rust, the reference every vector path is
//! held to bit for bit, and the path a CPU without a vector unit runs.
//!
//! Two reductions, one per kind of operation:
//! - **a product against the weights** (every `matmul`): [`dot16`], sixteen fused running sums
//!   combined in [`combine`]'s tree, then the tail fused. The AVX2 and AVX-512 bodies in
//!   [`super::simd`] compute exactly it; [`super::Kernels::Portable`] runs it as written.
//! - **a reduction over activations** (RMSNorm's sum of squares, attention's `q . k`): [`dot`],
//!   eight running sums, unfused, combined `((0+1)+(2+3))+((4+5)+(6+7))`, then the tail. The
//!   AVX2 scores run eight positions at once whose horizontal adds add the same pairs.
//!
//! Rust neither reassociates nor fuses float arithmetic on its own, so the order written here is
//! the order run, on every CPU.

/// Running sums per output.
pub const LANES: usize = 16;
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
pub(crate) fn tail(mut s: f32, x: &[f32], w: &[f32]) -> f32 {
    for (a, b) in x.iter().zip(w) {
        s = a.mul_add(*b, s);
    }
    s
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
