//! The weights as the checkpoint holds them: their element or block types, a matrix of them in
//! checkpoint bytes, and their exact widening to f32. The kernels of every set read them
//! through these.

use half::f16;

/// A checkpoint dtype the kernels read: an element type, or one of ggml's block-quantized types
/// (32 values a block), read as they are and dequantized where they are used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
    /// IEEE binary32.
    F32,
    /// ggml's Q8_0: an f16 scale `d`, then 32 signed bytes `q`; a value is `q * d`.
    Q8_0,
    /// ggml's Q4_0: an f16 scale `d`, then 16 bytes of 4-bit `q` (value `j` in the low nibble of
    /// byte `j`, value `j + 16` in its high nibble); a value is `(q - 8) * d`.
    Q4_0,
    /// ggml's Q4_1: f16 `d` and `m`, then 16 bytes of 4-bit `q` as Q4_0; a value is `q * d + m`.
    Q4_1,
}

impl DType {
    /// Bytes per element (an element type), or per block over its values (a block type; use
    /// [`Self::row_bytes`] for whole rows).
    #[must_use]
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
        }
    }

    /// Values per block: 1 for an element type.
    #[must_use]
    pub fn block_values(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 | DType::F32 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
        }
    }

    /// Bytes of `values` values (a whole number of blocks).
    #[must_use]
    pub fn row_bytes(self, values: usize) -> usize {
        values / self.block_values() * self.size()
    }
}

/// One block of a block type (`bytes` of [`DType::size`]) dequantized into `out` (32 values),
/// each value's arithmetic in f32 as ggml's reference dequantization writes it.
#[inline(always)]
pub fn dequantize_block(dtype: DType, b: &[u8], out: &mut [f32]) {
    let h = |at: usize| f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
    match dtype {
        DType::Q8_0 => {
            let d = h(0);
            for (o, &q) in out[..32].iter_mut().zip(&b[2..34]) {
                *o = f32::from(q as i8) * d;
            }
        }
        DType::Q4_0 => {
            let d = h(0);
            let (lo, hi) = out[..32].split_at_mut(16);
            for j in 0..16 {
                let q = b[2 + j];
                lo[j] = (i32::from(q & 0xF) - 8) as f32 * d;
                hi[j] = (i32::from(q >> 4) - 8) as f32 * d;
            }
        }
        DType::Q4_1 => {
            let (d, m) = (h(0), h(2));
            let (lo, hi) = out[..32].split_at_mut(16);
            for j in 0..16 {
                let q = b[4 + j];
                lo[j] = f32::from(q & 0xF) * d + m;
                hi[j] = f32::from(q >> 4) * d + m;
            }
        }
        DType::Bf16 | DType::F16 | DType::F32 => {
            widen(b, dtype, out);
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
        let s = self.dtype.row_bytes(self.cols);
        widen(&self.bytes[r * s..(r + 1) * s], self.dtype, out);
    }
}

/// `bytes` of `dtype` widened to f32 into `out` (exact for every dtype, so when and in what
/// pieces a value is widened never changes a bit). Aligned input goes through `half`'s slice
/// conversions (F16C and friends where the CPU has them); unaligned input element by element.
pub fn widen(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    if dtype.block_values() > 1 {
        for (b, o) in bytes
            .chunks_exact(dtype.size())
            .zip(out.chunks_exact_mut(32))
        {
            dequantize_block(dtype, b, o);
        }
        return;
    }
    let n = out.len().min(bytes.len() / dtype.size());
    let (bytes, out) = (&bytes[..n * dtype.size()], &mut out[..n]);
    match dtype {
        DType::Bf16 => match bytemuck::try_cast_slice::<u8, half::bf16>(bytes) {
            Ok(h) => h.convert_to_f32_slice(out),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
                }
            }
        },
        DType::F16 => match bytemuck::try_cast_slice::<u8, f16>(bytes) {
            Ok(h) => h.convert_to_f32_slice(out),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
        },
        DType::F32 => match bytemuck::try_cast_slice::<u8, f32>(bytes) {
            Ok(f) => out.copy_from_slice(f),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        },
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => unreachable!("block types return above"),
    }
}
