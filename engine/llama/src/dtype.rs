//! The weights as the checkpoint holds them: their element or block types, a matrix of them in
//! checkpoint bytes, and their exact widening to f32. The kernels of every set read them
//! through these.

use half::f16;

use crate::quant::{Block, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0};

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
    /// ggml's Q8_0 ([`BlockQ8_0`]).
    Q8_0,
    /// ggml's Q4_0 ([`BlockQ4_0`]).
    Q4_0,
    /// ggml's Q4_1 ([`BlockQ4_1`]).
    Q4_1,
    /// ggml's Q5_0 ([`BlockQ5_0`]).
    Q5_0,
    /// ggml's Q5_1 ([`BlockQ5_1`]).
    Q5_1,
}

impl DType {
    /// Bytes per element (an element type), or per block over its values (a block type; use
    /// [`Self::row_bytes`] for whole rows).
    #[must_use]
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::Q8_0 => BlockQ8_0::BYTES,
            DType::Q4_0 => BlockQ4_0::BYTES,
            DType::Q4_1 => BlockQ4_1::BYTES,
            DType::Q5_0 => BlockQ5_0::BYTES,
            DType::Q5_1 => BlockQ5_1::BYTES,
        }
    }

    /// Values per block: 1 for an element type.
    #[must_use]
    pub fn block_values(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 | DType::F32 => 1,
            DType::Q8_0 => BlockQ8_0::VALUES,
            DType::Q4_0 => BlockQ4_0::VALUES,
            DType::Q4_1 => BlockQ4_1::VALUES,
            DType::Q5_0 => BlockQ5_0::VALUES,
            DType::Q5_1 => BlockQ5_1::VALUES,
        }
    }

    /// Bytes of `values` values (a whole number of blocks).
    #[must_use]
    pub fn row_bytes(self, values: usize) -> usize {
        values / self.block_values() * self.size()
    }
}

/// One block of a block type (`b` is [`DType::size`] bytes) dequantized into `out` by its
/// [`Block`] (an element type is widened).
#[inline(always)]
pub fn dequantize_block(dtype: DType, b: &[u8], out: &mut [f32]) {
    fn one<B: Block>(b: &[u8], out: &mut [f32]) {
        B::ref_from_bytes(b).expect("one block").dequantize(out);
    }
    match dtype {
        DType::Q8_0 => one::<BlockQ8_0>(b, out),
        DType::Q4_0 => one::<BlockQ4_0>(b, out),
        DType::Q4_1 => one::<BlockQ4_1>(b, out),
        DType::Q5_0 => one::<BlockQ5_0>(b, out),
        DType::Q5_1 => one::<BlockQ5_1>(b, out),
        DType::Bf16 | DType::F16 | DType::F32 => widen(b, dtype, out),
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
            .zip(out.chunks_exact_mut(dtype.block_values()))
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
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
            unreachable!("block types return above")
        }
    }
}
