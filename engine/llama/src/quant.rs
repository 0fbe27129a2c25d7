//! ggml's block-quantized weight types: one `#[repr(C)]` struct per type, laid out as ggml
//! writes it (every field a byte array, so a block is read in place from any offset of a
//! checkpoint through a `zerocopy` view), its size asserted at compile time against ggml's
//! `ggml_type_traits`, and its values computed by one [`Block::dequantize`] each, in ggml's
//! reference order.
//!
//! These structs are the one place a block's size and layout are written: [`crate::dtype::DType`]
//! (the types the kernels read in place), the GGUF loader's [`crate::gguf::GgmlType`] (the types
//! a file may hold) and the vector kernels' readers take their figures from here.

use half::f16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// A block of a quantized type, as it sits in a checkpoint's bytes.
pub trait Block: Sized + FromBytes + IntoBytes + KnownLayout + Immutable + Unaligned {
    /// Its name as ggml writes it.
    const NAME: &'static str;
    /// Values one block holds.
    const VALUES: usize;
    /// Bytes one block takes.
    const BYTES: usize = std::mem::size_of::<Self>();

    /// The block's [`Self::VALUES`] values into `out`, each value's arithmetic in f32 as
    /// ggml's reference dequantization writes it.
    fn dequantize(&self, out: &mut [f32]);
}

/// `bytes` (whole blocks of `B`) dequantized into `out` ([`Block::VALUES`] a block).
///
/// # Panics
/// When `bytes` is not whole blocks, or `out` does not hold as many values as they.
pub fn dequantize<B: Block>(bytes: &[u8], out: &mut [f32]) {
    let blocks = <[B]>::ref_from_bytes(bytes).expect("whole blocks");
    assert_eq!(blocks.len() * B::VALUES, out.len(), "whole blocks");
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(B::VALUES)) {
        b.dequantize(y);
    }
}

/// An f16 stored little-endian, widened (exactly).
#[inline(always)]
#[must_use]
pub fn half(b: [u8; 2]) -> f32 {
    f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

/// Q8_0: a scale `d`, then 32 signed bytes `q`; a value is `q * d`.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ8_0 {
    /// The scale, f16.
    pub d: [u8; 2],
    /// The values.
    pub qs: [i8; 32],
}

/// Q4_0: a scale `d`, then 16 bytes of 4-bit `q` (value `j` in the low nibble of byte `j`,
/// value `j + 16` in its high nibble); a value is `(q - 8) * d`.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ4_0 {
    /// The scale, f16.
    pub d: [u8; 2],
    /// The nibbles.
    pub qs: [u8; 16],
}

/// Q4_1: a scale `d` and a minimum `m`, then 16 bytes of 4-bit `q` as Q4_0; a value is
/// `q * d + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ4_1 {
    /// The scale, f16.
    pub d: [u8; 2],
    /// The minimum, f16.
    pub m: [u8; 2],
    /// The nibbles.
    pub qs: [u8; 16],
}

/// Q5_0: a scale `d`, the 32 values' fifth bits in `qh` (a little-endian u32, bit `j` for
/// value `j`), then their low four bits as Q4_0's nibbles; a value is `(q - 16) * d`.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ5_0 {
    /// The scale, f16.
    pub d: [u8; 2],
    /// The fifth bits.
    pub qh: [u8; 4],
    /// The low nibbles.
    pub qs: [u8; 16],
}

/// Q5_1: as Q5_0 with a minimum `m` after the scale; a value is `q * d + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ5_1 {
    /// The scale, f16.
    pub d: [u8; 2],
    /// The minimum, f16.
    pub m: [u8; 2],
    /// The fifth bits.
    pub qh: [u8; 4],
    /// The low nibbles.
    pub qs: [u8; 16],
}

/// Q4_K: 256 values in 8 groups of 32; an f16 super-scale and super-minimum, each group's
/// six-bit scale and minimum packed in 12 bytes, then the nibbles (64 values per 32 bytes:
/// low nibbles first, then high).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ4K {
    /// The super-scale, f16.
    pub d: [u8; 2],
    /// The super-minimum, f16.
    pub dmin: [u8; 2],
    /// The groups' packed six-bit scales and minimums.
    pub scales: [u8; 12],
    /// The nibbles.
    pub qs: [u8; 128],
}

/// Q5_K: as Q4_K, with each value's fifth bit in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ5K {
    /// The super-scale, f16.
    pub d: [u8; 2],
    /// The super-minimum, f16.
    pub dmin: [u8; 2],
    /// The groups' packed six-bit scales and minimums.
    pub scales: [u8; 12],
    /// The fifth bits.
    pub qh: [u8; 32],
    /// The low four bits.
    pub qs: [u8; 128],
}

/// Q6_K: 256 values of six bits (low four in `ql`, high two in `qh`), 16 signed 8-bit scales
/// and an f16 super-scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct BlockQ6K {
    /// The low four bits.
    pub ql: [u8; 128],
    /// The high two bits.
    pub qh: [u8; 64],
    /// The scales of the 16 groups of 16.
    pub scales: [i8; 16],
    /// The super-scale, f16.
    pub d: [u8; 2],
}

// ggml's `ggml_type_traits` sizes: a struct that drifts from them does not compile.
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

impl Block for BlockQ8_0 {
    const NAME: &'static str = "Q8_0";
    const VALUES: usize = 32;

    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = half(self.d);
        for (o, &q) in out[..32].iter_mut().zip(&self.qs) {
            *o = f32::from(q) * d;
        }
    }
}

impl Block for BlockQ4_0 {
    const NAME: &'static str = "Q4_0";
    const VALUES: usize = 32;

    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = half(self.d);
        let (lo, hi) = out[..32].split_at_mut(16);
        for (j, &q) in self.qs.iter().enumerate() {
            lo[j] = (i32::from(q & 0xF) - 8) as f32 * d;
            hi[j] = (i32::from(q >> 4) - 8) as f32 * d;
        }
    }
}

impl Block for BlockQ4_1 {
    const NAME: &'static str = "Q4_1";
    const VALUES: usize = 32;

    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (half(self.d), half(self.m));
        let (lo, hi) = out[..32].split_at_mut(16);
        for (j, &q) in self.qs.iter().enumerate() {
            lo[j] = f32::from(q & 0xF) * d + m;
            hi[j] = f32::from(q >> 4) * d + m;
        }
    }
}

/// The 32 five-bit values of a Q5_0 or Q5_1 block, in order: value `j` and `j + 16` from byte
/// `j`'s low and high nibble, each with its fifth bit from `qh`.
#[inline(always)]
fn five_bits(qh: [u8; 4], qs: &[u8; 16]) -> impl Iterator<Item = (usize, u8, u8)> + '_ {
    let h = u32::from_le_bytes(qh);
    qs.iter().enumerate().map(move |(j, &q)| {
        let lo = (q & 0xF) | ((((h >> j) << 4) & 0x10) as u8);
        let hi = (q >> 4) | (((h >> (j + 12)) & 0x10) as u8);
        (j, lo, hi)
    })
}

impl Block for BlockQ5_0 {
    const NAME: &'static str = "Q5_0";
    const VALUES: usize = 32;

    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = half(self.d);
        let (lo, hi) = out[..32].split_at_mut(16);
        for (j, x0, x1) in five_bits(self.qh, &self.qs) {
            lo[j] = (i32::from(x0) - 16) as f32 * d;
            hi[j] = (i32::from(x1) - 16) as f32 * d;
        }
    }
}

impl Block for BlockQ5_1 {
    const NAME: &'static str = "Q5_1";
    const VALUES: usize = 32;

    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (half(self.d), half(self.m));
        let (lo, hi) = out[..32].split_at_mut(16);
        for (j, x0, x1) in five_bits(self.qh, &self.qs) {
            lo[j] = f32::from(x0) * d + m;
            hi[j] = f32::from(x1) * d + m;
        }
    }
}

/// Q4_K's and Q5_K's six-bit scale and minimum `j` (0..8) from their 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// The values of a Q4_K or Q5_K block: 8 groups of 32, group `2c` from the low four bits of
/// `value(c, l)`'s pair and group `2c + 1` from the high, each `d * scale * q - dmin * min`.
fn dequantize_k4(
    (d, dmin): ([u8; 2], [u8; 2]),
    scales: &[u8; 12],
    y: &mut [f32],
    value: impl Fn(usize, usize) -> (u8, u8),
) {
    let (d, dmin) = (half(d), half(dmin));
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1, dmin * m1);
        let (d2, m2) = (d * sc2, dmin * m2);
        let y = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            let (lo, hi) = value(c, l);
            y[l] = d1 * f32::from(lo) - m1;
            y[l + 32] = d2 * f32::from(hi) - m2;
        }
    }
}

impl Block for BlockQ4K {
    const NAME: &'static str = "Q4_K";
    const VALUES: usize = 256;

    fn dequantize(&self, y: &mut [f32]) {
        dequantize_k4((self.d, self.dmin), &self.scales, y, |c, l| {
            let q = self.qs[32 * c + l];
            (q & 0xF, q >> 4)
        });
    }
}

impl Block for BlockQ5K {
    const NAME: &'static str = "Q5_K";
    const VALUES: usize = 256;

    fn dequantize(&self, y: &mut [f32]) {
        dequantize_k4((self.d, self.dmin), &self.scales, y, |c, l| {
            let q = self.qs[32 * c + l];
            let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
            let hi1 = if self.qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if self.qh[l] & u2 != 0 { 16 } else { 0 };
            ((q & 0xF) + hi1, (q >> 4) + hi2)
        });
    }
}

impl Block for BlockQ6K {
    const NAME: &'static str = "Q6_K";
    const VALUES: usize = 256;

    fn dequantize(&self, y: &mut [f32]) {
        let d = half(self.d);
        for n in 0..2 {
            let (ql, qh, sc) = (
                &self.ql[64 * n..],
                &self.qh[32 * n..],
                &self.scales[8 * n..],
            );
            let y = &mut y[128 * n..128 * n + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = i32::from((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                let q2 = i32::from((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                let s = |i: usize| f32::from(sc[i]);
                y[l] = d * s(is) * q1 as f32;
                y[l + 32] = d * s(is + 2) * q2 as f32;
                y[l + 64] = d * s(is + 4) * q3 as f32;
                y[l + 96] = d * s(is + 6) * q4 as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block read in place from an odd offset: every field is bytes, so no alignment is
    /// asked of the checkpoint.
    #[test]
    fn blocks_read_in_place_at_any_offset() {
        let mut bytes = [0u8; 1 + 2 * BlockQ8_0::BYTES];
        bytes[1..3].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        bytes[3] = (-6i8).to_ne_bytes()[0];
        let blocks = <[BlockQ8_0]>::ref_from_bytes(&bytes[1..]).expect("two blocks");
        assert_eq!(blocks.len(), 2);
        let mut y = [0f32; 64];
        dequantize::<BlockQ8_0>(&bytes[1..], &mut y);
        assert_eq!((y[0], y[1], y[32]), (-3.0, 0.0, 0.0));
    }

    /// Bytes that are not whole blocks are refused, not read short.
    #[test]
    #[should_panic(expected = "whole blocks")]
    fn a_partial_block_is_refused() {
        let mut y = [0f32; 32];
        dequantize::<BlockQ4_0>(&[0u8; 17], &mut y);
    }
}
