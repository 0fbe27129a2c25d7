//! f16 plane views: `Record::plane` is a zero-copy `&[f16]` over the received bytes, equal to the
//! scalar reader everywhere; `RecordIn::from_f16` writes planes without a cast by hand; every
//! refusal is typed.

use half::f16;
use kvwire::{
    Dims, Formats, Kv, PlaneError, Pos, Reader, RecordIn, Shape, WireFormat, write_to_vec,
};

/// B=4, L=2, H=2, D=3: planes of 24 values, a 192-byte payload.
const SHAPE: Shape = Shape::v1(4, 2, 2, 3);

/// The `2 * L` planes of one block, every value distinct and exactly representable.
fn planes(seed: u16) -> Vec<f16> {
    let n = SHAPE.payload_bytes().unwrap() / 2;
    (0..n)
        .map(|i| f16::from_f32(f32::from(seed) + i as f32 / 8.0))
        .collect()
}

fn envelope(blocks: &[Vec<f16>]) -> Vec<u8> {
    let recs: Vec<RecordIn<'_>> = blocks
        .iter()
        .enumerate()
        .map(|(i, p)| RecordIn::from_f16(&SHAPE, 100 + i as u64, 4, p).unwrap())
        .collect();
    let mut out = Vec::new();
    write_to_vec(&SHAPE, &recs, &mut out).unwrap();
    out
}

#[test]
fn planes_are_views_equal_to_scalar_reads() {
    let blocks = [planes(1), planes(2), planes(3)];
    let buf = envelope(&blocks);
    let env = Reader::new().expect_shape(SHAPE).read(&buf).unwrap();
    let d = SHAPE.dims;
    let n = (d.block_tokens * d.n_kv_heads * d.head_dim) as usize;
    for (r, block) in env.records().zip(&blocks) {
        for layer in 0..d.n_layers {
            for kv in [Kv::K, Kv::V] {
                let plane = r.plane(layer, kv).unwrap();
                assert_eq!(plane.len(), n);
                // A view of the received bytes, not a copy.
                let at = plane.as_ptr() as usize - buf.as_ptr() as usize;
                assert!(at + n * 2 <= buf.len());
                // The writer's input, plane by plane.
                let i = (layer as usize * 2 + kv as usize) * n;
                assert_eq!(plane, &block[i..i + n]);
                // And the scalar reader, element by element.
                let mut k = 0;
                for token in 0..d.block_tokens {
                    for head in 0..d.n_kv_heads {
                        for dim in 0..d.head_dim {
                            let pos = Pos {
                                layer,
                                kv,
                                token,
                                head,
                                dim,
                            };
                            assert_eq!(SHAPE.get_f16(r.payload, pos), Some(plane[k]));
                            k += 1;
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn plane_refusals_are_typed() {
    let buf = envelope(&[planes(1)]);
    let env = Reader::new().read(&buf).unwrap();
    let r = env.records().next().unwrap();
    assert_eq!(
        r.plane(2, Kv::K),
        Err(PlaneError::Layer {
            layer: 2,
            n_layers: 2
        })
    );

    // The same envelope at an odd address: readable (the reader needs no alignment), but the
    // planes cannot be viewed in place.
    let mut odd = vec![0u8; buf.len() + 1];
    let start = usize::from((odd.as_ptr() as usize).is_multiple_of(2));
    odd[start..start + buf.len()].copy_from_slice(&buf);
    let env = Reader::new().read(&odd[start..start + buf.len()]).unwrap();
    let r = env.records().next().unwrap();
    assert_eq!(r.plane(0, Kv::V), Err(PlaneError::Misaligned));
    // The scalar reader still works there.
    let pos = Pos {
        layer: 0,
        kv: Kv::V,
        token: 0,
        head: 0,
        dim: 0,
    };
    assert_eq!(SHAPE.get_f16(r.payload, pos), Some(planes(1)[24]));

    // A one-byte format (fp8) has no f16 planes.
    const FP8: WireFormat = WireFormat::new(2, 2, 1, "e4m3");
    let fp8 = Shape {
        dims: Dims {
            block_tokens: 4,
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 3,
        },
        format: FP8,
    };
    let payload = vec![0u8; fp8.payload_bytes().unwrap()];
    let mut out = Vec::new();
    write_to_vec(
        &fp8,
        &[RecordIn {
            hash: 0,
            fill: 1,
            payload: &payload,
        }],
        &mut out,
    )
    .unwrap();
    let env = Reader::new()
        .formats(Formats::V1.with(FP8))
        .read(&out)
        .unwrap();
    let r = env.records().next().unwrap();
    let not_f16 = PlaneError::NotF16 {
        name: "e4m3",
        elem_bytes: 1,
    };
    assert_eq!(r.plane(0, Kv::K), Err(not_f16));
    assert_eq!(
        RecordIn::from_f16(&fp8, 0, 1, &planes(1)[..48]).unwrap_err(),
        not_f16
    );
    // A payload of the wrong size.
    assert_eq!(
        RecordIn::from_f16(&SHAPE, 0, 1, &planes(1)[..95]).unwrap_err(),
        PlaneError::Length {
            got: 190,
            want: 192
        }
    );
    assert_eq!(
        SHAPE.f16_plane(&[0u8; 10], 0, Kv::K),
        Err(PlaneError::Length { got: 10, want: 192 })
    );
}

/// On little-endian targets (every one this project builds on) the view decodes as the wire's
/// little-endian f16; on a big-endian target it is refused rather than byte-swapped.
#[test]
fn planes_follow_the_targets_byte_order() {
    // Encoded element by element (little-endian on every target), not through a view.
    let block = planes(7);
    let mut payload = vec![0u8; SHAPE.payload_bytes().unwrap()];
    for (i, v) in block.iter().enumerate() {
        payload[i * 2..i * 2 + 2].copy_from_slice(&v.to_le_bytes());
    }
    let mut buf = Vec::new();
    let rec = RecordIn {
        hash: 0,
        fill: 4,
        payload: &payload,
    };
    write_to_vec(&SHAPE, &[rec], &mut buf).unwrap();
    let env = Reader::new().read(&buf).unwrap();
    let r = env.records().next().unwrap();
    if cfg!(target_endian = "little") {
        assert_eq!(r.plane(0, Kv::K).unwrap(), &block[..24]);
        assert_eq!(r.plane(1, Kv::V).unwrap(), &block[72..]);
    } else {
        assert_eq!(r.plane(0, Kv::K), Err(PlaneError::BigEndian));
        assert_eq!(
            RecordIn::from_f16(&SHAPE, 0, 4, &block).unwrap_err(),
            PlaneError::BigEndian
        );
    }
}
