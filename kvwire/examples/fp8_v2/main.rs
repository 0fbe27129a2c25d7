//! A KV format of your own on top of `kvwire`, without changing the crate: v2 as fp8 (E4M3).
//!
//! 1. Define the format: version 2, dtype 2, one byte per element.
//! 2. Read a v1 envelope and take each block's planes as `&[f16]` (zero-copy views).
//! 3. Convert every value to E4M3 and write a v2 envelope with the same dimensions.
//! 4. Read both back with one reader that accepts v1 and v2.
//! 5. Print the sizes (v2 carries half the payload), the largest relative conversion error and
//!    the conversion's speed.
//!
//! Run: `cargo run --release -p kvwire --example fp8_v2`; the conversion is in `e4m3.rs`. It exits non-zero if a check fails.
//!
//! E4M3 here is the OCP 8-bit float "E4M3FN": 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
//! bits, no infinities, one NaN pattern per sign (`S.1111.111`), largest finite value 448. The
//! conversion is written out below (round to nearest, ties to even, saturating) rather than
//! taken from a crate: it is twenty lines, and the example should show every step.

use std::time::Instant;

use half::f16;
use kvwire::{Formats, Kv, Reader, RecordIn, Shape, WireFormat, prompt_hashes, write_to_vec};

mod e4m3;

use e4m3::{from_e4m3, to_e4m3};

/// `kv.wire` v2: one byte per element, E4M3.
const V2_E4M3: WireFormat = WireFormat::new(2, 2, 1, "e4m3");

/// Deterministic KV-like values: mostly in [-4, 4], some small.
fn values(n: usize, seed: u64) -> Vec<f16> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            f16::from_f64((u - 0.5) * 8.0)
        })
        .collect()
}

fn main() {
    // A v1 envelope, as a prefill engine would send it: 4 full blocks of a 64-token prompt.
    let v1 = Shape::v1(16, 4, 2, 64);
    let prompt: Vec<u32> = (0..64).collect();
    let hashes = prompt_hashes(&prompt, v1.dims.block_tokens as usize);
    let per_block = v1.payload_bytes().expect("the shape's sizes fit") / 2;
    let blocks: Vec<Vec<f16>> = (0..hashes.len() as u64)
        .map(|i| values(per_block, 0x5eed + i))
        .collect();
    let records: Vec<RecordIn<'_>> = hashes
        .iter()
        .zip(&blocks)
        .map(|(&h, b)| RecordIn::from_f16(&v1, h, 16, b).expect("f16 planes of the v1 shape"))
        .collect();
    let mut v1_bytes = Vec::new();
    write_to_vec(&v1, &records, &mut v1_bytes).expect("a valid v1 envelope");

    // Read it, and build v2 records from its planes, viewed in place.
    let env = Reader::new()
        .expect_shape(v1)
        .read(&v1_bytes)
        .expect("v1 reads");
    let v2 = Shape {
        dims: v1.dims,
        format: V2_E4M3,
    };
    let started = Instant::now();
    let converted: Vec<(u64, u32, Vec<u8>)> = env
        .records()
        .map(|r| {
            let mut out = Vec::with_capacity(v2.payload_bytes().unwrap_or(0));
            for layer in 0..v1.dims.n_layers {
                for kv in [Kv::K, Kv::V] {
                    let plane = r.plane(layer, kv).expect("v1 planes are f16 views");
                    out.extend(plane.iter().map(|v| to_e4m3(v.to_f32())));
                }
            }
            (r.hash, r.n_tokens, out)
        })
        .collect();
    let seconds = started.elapsed().as_secs_f64();
    let v2_records: Vec<RecordIn<'_>> = converted
        .iter()
        .map(|(hash, fill, payload)| RecordIn {
            hash: *hash,
            fill: *fill,
            payload,
        })
        .collect();
    let mut v2_bytes = Vec::new();
    write_to_vec(&v2, &v2_records, &mut v2_bytes).expect("a valid v2 envelope");

    // One reader for a rollout: v1 and v2 both accepted; the default reader refuses v2.
    let both = Reader::new().formats(Formats::V1.with(V2_E4M3));
    let back_v1 = both.read(&v1_bytes).expect("v1 through the mixed reader");
    let back_v2 = both.read(&v2_bytes).expect("v2 through the mixed reader");
    assert!(
        Reader::new().read(&v2_bytes).is_err(),
        "a v1-only reader refuses v2"
    );
    assert_eq!(back_v2.shape().format, V2_E4M3);
    assert_eq!(back_v2.n_blocks(), back_v1.n_blocks());

    // Compare every value, in the normal range, relative to the original.
    let mut worst = 0.0f32;
    for (r1, r2) in back_v1.records().zip(back_v2.records()) {
        assert_eq!(r1.hash, r2.hash);
        let mut original = Vec::new();
        for layer in 0..v1.dims.n_layers {
            for kv in [Kv::K, Kv::V] {
                original.extend_from_slice(r1.plane(layer, kv).expect("f16 view"));
            }
        }
        for (x, &b) in original.iter().zip(r2.payload) {
            let x = x.to_f32();
            if x.abs() >= f32::powi(2.0, -6) {
                worst = worst.max(((from_e4m3(b) - x) / x).abs());
            }
        }
    }
    let p1 = back_v1.payload_bytes();
    let p2 = back_v2.payload_bytes();
    assert_eq!(p2 * 2, p1, "v2 carries half the payload");
    // Three mantissa bits, round to nearest: at most half a step, 2^-4 of the value.
    assert!(worst <= 1.0 / 16.0, "relative error {worst} above 2^-4");
    let converted_bytes = p1 * back_v1.n_blocks();
    println!(
        "{}",
        serde_json::json!({
            "example": "fp8_v2",
            "blocks": back_v1.n_blocks(),
            "v1_envelope_bytes": v1_bytes.len(),
            "v2_envelope_bytes": v2_bytes.len(),
            "v1_payload_bytes": p1,
            "v2_payload_bytes": p2,
            "v2_over_v1_payload": p2 as f64 / p1 as f64,
            "max_relative_error": worst,
            "f16_to_fp8_gbps": converted_bytes as f64 / seconds / 1e9,
        })
    );
}
