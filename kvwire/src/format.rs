//! Formats, the set of formats a reader accepts, and block shapes with checked sizes.

use std::borrow::Cow;
use std::fmt;

use crate::header::{HEADER_LEN, RECORD_HEAD_LEN, TRAILER_LEN};

/// One `(version, dtype)` pair and what it means: the size of one element.
///
/// v1 knows only [`WireFormat::V1_F16`]. A crate adding a format defines its own constant and
/// hands it to a [`Reader`](crate::Reader) through [`Formats::with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireFormat {
    /// The header's `version` field.
    pub version: u16,
    /// The header's `dtype` field.
    pub dtype: u16,
    elem_bytes: u8,
    /// A short name for messages, e.g. `"f16"`.
    pub name: &'static str,
}

impl WireFormat {
    /// `kv.wire.v1`: version 1, dtype 1, IEEE binary16 elements.
    pub const V1_F16: WireFormat = WireFormat::new(1, 1, 2, "f16");

    /// A format of `elem_bytes`-byte elements.
    ///
    /// # Panics
    /// If `elem_bytes` is 0 (in a `const`, at compile time).
    #[must_use]
    pub const fn new(version: u16, dtype: u16, elem_bytes: u8, name: &'static str) -> Self {
        assert!(elem_bytes >= 1, "an element has at least one byte");
        Self {
            version,
            dtype,
            elem_bytes,
            name,
        }
    }

    /// Bytes per element.
    #[must_use]
    pub const fn elem_bytes(&self) -> usize {
        self.elem_bytes as usize
    }
}

/// The formats a reader accepts (rule 4). The default, [`Formats::V1`], reads only v1 f16.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Formats(Cow<'static, [WireFormat]>);

impl Default for Formats {
    fn default() -> Self {
        Self::V1
    }
}

impl Formats {
    /// Only `kv.wire.v1` f16.
    pub const V1: Formats = Formats(Cow::Borrowed(&[WireFormat::V1_F16]));

    /// Exactly the given formats.
    #[must_use]
    pub fn new(formats: impl Into<Vec<WireFormat>>) -> Self {
        Self(Cow::Owned(formats.into()))
    }

    /// These formats plus `format` (replacing one with the same version and dtype).
    ///
    /// ```
    /// use kvwire::{Formats, WireFormat};
    /// const V2: WireFormat = WireFormat::new(2, 2, 1, "e4m3");
    /// let both = Formats::V1.with(V2);
    /// assert_eq!(both.get(2, 2), Some(V2));
    /// assert_eq!(both.iter().count(), 2);
    /// assert_eq!(Formats::V1.get(2, 2), None);
    /// ```
    #[must_use]
    pub fn with(mut self, format: WireFormat) -> Self {
        let list = self.0.to_mut();
        list.retain(|f| (f.version, f.dtype) != (format.version, format.dtype));
        list.push(format);
        self
    }

    /// The accepted format with this version and dtype, if any.
    #[must_use]
    pub fn get(&self, version: u16, dtype: u16) -> Option<WireFormat> {
        self.0
            .iter()
            .copied()
            .find(|f| f.version == version && f.dtype == dtype)
    }

    /// The accepted formats.
    pub fn iter(&self) -> impl Iterator<Item = &WireFormat> {
        self.0.iter()
    }
}

/// The four dimensions of a block: B, L, H, D.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dims {
    /// B: token slots per block.
    pub block_tokens: u32,
    /// L: layers.
    pub n_layers: u32,
    /// H: KV heads.
    pub n_kv_heads: u32,
    /// D: head dimension.
    pub head_dim: u32,
}

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "B={} L={} H={} D={}",
            self.block_tokens, self.n_layers, self.n_kv_heads, self.head_dim
        )
    }
}

/// A block's dimensions and element format: everything needed to size and address a payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// B, L, H, D.
    pub dims: Dims,
    /// The element format.
    pub format: WireFormat,
}

impl Shape {
    /// A v1 (f16) shape.
    #[must_use]
    pub const fn v1(block_tokens: u32, n_layers: u32, n_kv_heads: u32, head_dim: u32) -> Self {
        Self {
            dims: Dims {
                block_tokens,
                n_layers,
                n_kv_heads,
                head_dim,
            },
            format: WireFormat::V1_F16,
        }
    }

    /// B, tokens per block.
    #[must_use]
    pub const fn block_tokens(&self) -> u32 {
        self.dims.block_tokens
    }

    /// True when every dimension is at least 1.
    #[must_use]
    pub const fn is_valid(&self) -> bool {
        let d = &self.dims;
        d.block_tokens >= 1 && d.n_layers >= 1 && d.n_kv_heads >= 1 && d.head_dim >= 1
    }

    /// Bytes of one token's row in a plane: `H * D * elem`.
    #[must_use]
    pub fn row_bytes(&self) -> Option<usize> {
        (self.dims.n_kv_heads as usize)
            .checked_mul(self.dims.head_dim as usize)?
            .checked_mul(self.format.elem_bytes())
    }

    /// Bytes of one K or V plane: `B * H * D * elem`.
    #[must_use]
    pub fn plane_bytes(&self) -> Option<usize> {
        self.row_bytes()?
            .checked_mul(self.dims.block_tokens as usize)
    }

    /// Number of planes: `2 * L` (K then V for each layer).
    #[must_use]
    pub fn planes(&self) -> usize {
        2 * self.dims.n_layers as usize
    }

    /// P, the payload bytes of one block: `2 * L * H * B * D * elem`; `None` on overflow.
    #[must_use]
    pub fn payload_bytes(&self) -> Option<usize> {
        self.plane_bytes()?.checked_mul(self.planes())
    }

    /// E, the bytes of an envelope of `n` blocks: `28 + n * (12 + P) + 4`; `None` on overflow.
    ///
    /// ```
    /// use kvwire::Shape;
    /// let s = Shape::v1(16, 32, 8, 128); // a realistic block: 2 MiB of f16
    /// assert_eq!(s.payload_bytes(), Some(2 << 20));
    /// assert_eq!(s.envelope_len(1), Some(28 + 12 + (2 << 20) + 4));
    /// assert_eq!(Shape::v1(1 << 31, 1 << 31, 1 << 31, 1 << 31).envelope_len(1), None);
    /// ```
    #[must_use]
    pub fn envelope_len(&self, n: usize) -> Option<usize> {
        let record = self.payload_bytes()?.checked_add(RECORD_HEAD_LEN)?;
        record.checked_mul(n)?.checked_add(HEADER_LEN + TRAILER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_of_the_contract_shapes() {
        let test = Shape::v1(4, 2, 1, 4);
        assert_eq!(test.payload_bytes(), Some(128));
        assert_eq!(test.envelope_len(1), Some(172));
        let real = Shape::v1(16, 32, 8, 128);
        assert_eq!(real.payload_bytes(), Some(2 << 20));
        let huge = Shape::v1(u32::MAX, u32::MAX, u32::MAX, u32::MAX);
        assert_eq!(huge.payload_bytes(), None);
        assert_eq!(Shape::v1(1, 1, 1, 1).envelope_len(usize::MAX), None);
    }

    #[test]
    fn formats_extend_and_replace() {
        let toy = WireFormat::new(2, 2, 1, "toy");
        let f = Formats::V1.with(toy);
        assert_eq!(f.get(2, 2), Some(toy));
        assert_eq!(f.get(1, 1), Some(WireFormat::V1_F16));
        assert_eq!(Formats::V1.get(2, 2), None);
        let f = f.with(WireFormat::new(2, 2, 4, "toy32"));
        assert_eq!(f.iter().count(), 2);
        assert_eq!(f.get(2, 2).map(|f| f.elem_bytes()), Some(4));
    }
}
