//! Any bytes into the reader, with and without an expected shape: a typed result, never a panic.
//! Inputs that pass are written back and must reproduce themselves byte for byte.
#![no_main]

use half::f16;
use kvwire::{Kv, PlaneError, Pos, Reader, RecordIn, Shape, write_to_vec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Reader::new().expect_shape(Shape::v1(4, 2, 1, 4)).read(data);
    if let Ok(env) = Reader::new().read(data) {
        check_planes(&env);
        let recs: Vec<_> = env
            .records()
            .map(|r| RecordIn { hash: r.hash, fill: r.n_tokens, payload: r.payload })
            .collect();
        let mut out = Vec::new();
        // A valid envelope may hold non-zero bytes past a fill, which the writer zeroes, so only
        // fully filled envelopes must round-trip exactly.
        write_to_vec(&env.shape(), &recs, &mut out).expect("a read envelope is writable");
        if recs.iter().all(|r| r.fill == env.shape().block_tokens()) {
            assert_eq!(out, data);
        }
    }
});

/// Every plane of a read record views as `[f16]` (or is refused as misaligned exactly when the
/// payload sits at an odd address), has `B * H * D` values, and agrees with the scalar reader at
/// both ends.
fn check_planes(env: &kvwire::Envelope<'_>) {
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
