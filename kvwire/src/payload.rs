//! Addressing inside a payload: layer-major, K plane then V plane, `[token][head][dim]`.

use half::f16;

use crate::format::Shape;

/// Which plane of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kv {
    /// Keys, the first plane of each layer.
    K = 0,
    /// Values, the second.
    V = 1,
}

/// One element's coordinates in a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pos {
    /// Layer, `0..L`.
    pub layer: u32,
    /// K or V.
    pub kv: Kv,
    /// Token slot, `0..B`.
    pub token: u32,
    /// KV head, `0..H`.
    pub head: u32,
    /// Dimension, `0..D`.
    pub dim: u32,
}

/// Why a plane cannot be viewed, or built, as `[f16]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlaneError {
    /// The format's element is not 2 bytes (an fp8 format, say): read its bytes instead.
    #[error("format {name} has {elem_bytes}-byte elements, not f16's 2")]
    NotF16 {
        /// The format's name.
        name: &'static str,
        /// Its element size.
        elem_bytes: usize,
    },
    /// No such layer.
    #[error("layer {layer} outside 0..{n_layers}")]
    Layer {
        /// The layer asked for.
        layer: u32,
        /// L.
        n_layers: u32,
    },
    /// The slice does not start on a 2-byte boundary in memory (a buffer at an odd address).
    #[error("the plane starts at an odd address: copy it to view it")]
    Misaligned,
    /// The slice is not `2 * L` planes long.
    #[error("{got} bytes is not {want} (2 * L planes)")]
    Length {
        /// What was given.
        got: usize,
        /// What the shape needs.
        want: usize,
    },
    /// This target is big-endian: the wire's little-endian f16 cannot be viewed in place.
    #[error("big-endian target: the wire's little-endian f16 cannot be viewed in place")]
    BigEndian,
}

impl Shape {
    /// Checks that this shape's elements are f16 and this target can view them in place.
    pub(crate) fn f16_in_place(&self) -> Result<(), PlaneError> {
        if self.format.elem_bytes() != 2 {
            return Err(PlaneError::NotF16 {
                name: self.format.name,
                elem_bytes: self.format.elem_bytes(),
            });
        }
        if cfg!(target_endian = "big") {
            return Err(PlaneError::BigEndian);
        }
        Ok(())
    }

    /// The `(layer, kv)` plane of `payload` (P bytes of this shape) as `[f16]`, zero-copy:
    /// `B * H * D` values, `[token][head][dim]`. Token slots past a record's fill are zeros.
    ///
    /// # Errors
    /// [`PlaneError`]: not a 2-byte format, a layer out of range, a payload of the wrong size,
    /// a slice at an odd address, or a big-endian target (where the view would be byte-swapped;
    /// use [`get_f16`](Self::get_f16), which decodes little-endian everywhere).
    pub fn f16_plane<'p>(
        &self,
        payload: &'p [u8],
        layer: u32,
        kv: Kv,
    ) -> Result<&'p [f16], PlaneError> {
        self.f16_in_place()?;
        let want = self.payload_bytes().unwrap_or(usize::MAX);
        if payload.len() != want {
            return Err(PlaneError::Length {
                got: payload.len(),
                want,
            });
        }
        let n_layers = self.dims.n_layers;
        if layer >= n_layers {
            return Err(PlaneError::Layer { layer, n_layers });
        }
        // payload_bytes() succeeded, so the plane size and this product fit.
        let plane = self.plane_bytes().unwrap_or(0);
        let start = (layer as usize * 2 + kv as usize) * plane;
        bytemuck::try_cast_slice(&payload[start..start + plane]).map_err(|_| PlaneError::Misaligned)
    }

    /// Byte offset of `pos`: `((((l*2 + kv)*B + t)*H + h)*D + d) * elem`; `None` when any
    /// coordinate is out of range.
    #[must_use]
    pub fn offset(&self, pos: Pos) -> Option<usize> {
        let d = &self.dims;
        if pos.layer >= d.n_layers
            || pos.token >= d.block_tokens
            || pos.head >= d.n_kv_heads
            || pos.dim >= d.head_dim
        {
            return None;
        }
        let plane = pos.layer as usize * 2 + pos.kv as usize;
        let row = plane * d.block_tokens as usize + pos.token as usize;
        let elem = (row * d.n_kv_heads as usize + pos.head as usize) * d.head_dim as usize
            + pos.dim as usize;
        elem.checked_mul(self.format.elem_bytes())
    }

    /// The f16 at `pos`; `None` out of range, for a short payload, or a format that is not 2 bytes.
    #[must_use]
    pub fn get_f16(&self, payload: &[u8], pos: Pos) -> Option<f16> {
        if self.format.elem_bytes() != 2 {
            return None;
        }
        let at = self.offset(pos)?;
        let bytes = payload.get(at..at + 2)?;
        Some(f16::from_le_bytes([bytes[0], bytes[1]]))
    }

    /// ```
    /// use half::f16;
    /// use kvwire::{Kv, Pos, Shape};
    /// let shape = Shape::v1(4, 2, 1, 4);
    /// let mut payload = vec![0u8; shape.payload_bytes().unwrap()];
    /// let pos = Pos { layer: 1, kv: Kv::K, token: 2, head: 0, dim: 3 };
    /// assert!(shape.put_f16(&mut payload, pos, f16::from_f32(0.5)));
    /// assert_eq!(shape.get_f16(&payload, pos), Some(f16::from_f32(0.5)));
    /// assert_eq!(shape.offset(pos), Some(((1 * 2 + 0) * 4 + 2) * 4 * 2 + 3 * 2));
    /// assert_eq!(shape.f16_plane(&payload, 1, Kv::K).unwrap()[2 * 4 + 3], f16::from_f32(0.5));
    /// ```
    ///
    /// Stores `value` at `pos`; `false` (and nothing written) in the cases [`get_f16`](Self::get_f16) gives `None`.
    pub fn put_f16(&self, payload: &mut [u8], pos: Pos, value: f16) -> bool {
        if self.format.elem_bytes() != 2 {
            return false;
        }
        let Some(at) = self.offset(pos) else {
            return false;
        };
        match payload.get_mut(at..at + 2) {
            Some(dst) => {
                dst.copy_from_slice(&value.to_le_bytes());
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_the_contract() {
        let s = Shape::v1(4, 2, 1, 4);
        let at = |layer, kv, token, dim| {
            s.offset(Pos {
                layer,
                kv,
                token,
                head: 0,
                dim,
            })
        };
        assert_eq!(at(0, Kv::K, 0, 0), Some(0));
        assert_eq!(at(0, Kv::K, 1, 0), Some(8));
        assert_eq!(at(0, Kv::V, 0, 0), Some(32));
        assert_eq!(at(1, Kv::K, 0, 0), Some(64));
        assert_eq!(at(1, Kv::V, 3, 3), Some(126));
        assert_eq!(at(2, Kv::K, 0, 0), None);
        assert_eq!(at(0, Kv::K, 4, 0), None);
        let mut p = vec![0u8; 128];
        let pos = Pos {
            layer: 1,
            kv: Kv::V,
            token: 2,
            head: 0,
            dim: 1,
        };
        assert!(s.put_f16(&mut p, pos, f16::from_f32(-0.5)));
        assert_eq!(s.get_f16(&p, pos), Some(f16::from_f32(-0.5)));
        assert!(!s.put_f16(&mut p[..10], pos, f16::ONE));
    }
}
