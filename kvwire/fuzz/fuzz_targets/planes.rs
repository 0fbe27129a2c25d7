//! The plane-view check both reader targets run on every envelope they read.

use half::f16;
use kvwire::{Kv, PlaneError, Pos};

/// Every plane of a read record views as `[f16]` (or is refused as misaligned exactly when the
/// payload sits at an odd address), has `B * H * D` values, and agrees with the scalar reader at
/// both ends.
pub fn check_planes(env: &kvwire::Envelope<'_>) {
    let s = env.shape();
    let n = (s.dims.block_tokens * s.dims.n_kv_heads * s.dims.head_dim) as usize;
    for r in env.records() {
        for layer in 0..s.dims.n_layers {
            for kv in [Kv::K, Kv::V] {
                let plane = match r.plane(layer, kv) {
                    Ok(p) => p,
                    Err(PlaneError::Misaligned) => {
                        assert_eq!(r.payload.as_ptr() as usize % 2, 1);
                        continue;
                    }
                    Err(e) => panic!("a read v1 record's plane refused: {e}"),
                };
                assert_eq!(plane.len(), n);
                let at = |token, head, dim| Pos { layer, kv, token, head, dim };
                let last = at(s.dims.block_tokens - 1, s.dims.n_kv_heads - 1, s.dims.head_dim - 1);
                assert_eq!(Some(plane[0]).map(f16::to_bits), s.get_f16(r.payload, at(0, 0, 0)).map(f16::to_bits));
                assert_eq!(Some(plane[n - 1]).map(f16::to_bits), s.get_f16(r.payload, last).map(f16::to_bits));
            }
        }
    }
}
