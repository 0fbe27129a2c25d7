//! Properties: round trips, single-bit corruption, and no panic on any input.

use kvwire::{ErrorKind, Reader, RecordIn, Shape, WriteError, split_full, write_to_vec};
use proptest::prelude::*;

fn shape() -> impl Strategy<Value = Shape> {
    (1u32..=5, 1u32..=3, 1u32..=3, 1u32..=4).prop_map(|(b, l, h, d)| Shape::v1(b, l, h, d))
}

/// A shape and 1..4 records: (hash, fill, full payload).
fn envelope() -> impl Strategy<Value = (Shape, Vec<(u64, u32, Vec<u8>)>)> {
    shape().prop_flat_map(|s| {
        let p = s.payload_bytes().unwrap();
        let b = s.block_tokens();
        let rec = (
            1..=b,
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), p),
        )
            .prop_map(move |(fill, h, payload)| {
                let hash = if fill == b { h } else { 0 };
                (hash, fill, payload)
            });
        (Just(s), proptest::collection::vec(rec, 1..4))
    })
}

fn write(s: &Shape, recs: &[(u64, u32, Vec<u8>)]) -> Vec<u8> {
    let ins: Vec<_> = recs
        .iter()
        .map(|(hash, fill, p)| RecordIn {
            hash: *hash,
            fill: *fill,
            payload: p,
        })
        .collect();
    let mut out = Vec::new();
    write_to_vec(s, &ins, &mut out).unwrap();
    out
}

proptest! {
    /// A split envelope joined again is the written one; a partial block is refused, not split.
    #[test]
    fn split_full_joins_to_the_written_envelope((s, recs) in envelope()) {
        for (hash, fill, p) in &recs {
            let rec = RecordIn { hash: *hash, fill: *fill, payload: p };
            let got = split_full(&s, rec);
            if *fill == s.block_tokens() {
                let split = got.unwrap();
                let joined = [&split.head[..], p, &split.crc.to_le_bytes()].concat();
                prop_assert_eq!(joined.len(), split.len(p.len()));
                prop_assert_eq!(&joined, &write(&s, &[(*hash, *fill, p.clone())]));
            } else {
                let refused = matches!(got, Err(WriteError::NotFull { fill: f, .. }) if f == *fill);
                prop_assert!(refused);
            }
        }
    }

    #[test]
    fn write_then_read_round_trips((s, recs) in envelope()) {
        let out = write(&s, &recs);
        prop_assert_eq!(Some(out.len()), s.envelope_len(recs.len()));
        let env = Reader::new().expect_shape(s).read(&out).unwrap();
        prop_assert_eq!(env.n_blocks(), recs.len());
        let row = s.row_bytes().unwrap();
        let b = s.block_tokens() as usize;
        for (got, (hash, fill, p)) in env.records().zip(&recs) {
            prop_assert_eq!((got.hash, got.n_tokens), (*hash, *fill));
            let f = *fill as usize;
            for (gp, pp) in got.payload.chunks_exact(row * b).zip(p.chunks_exact(row * b)) {
                prop_assert_eq!(&gp[..row * f], &pp[..row * f]);
                prop_assert!(gp[row * f..].iter().all(|&x| x == 0));
            }
        }
    }

    #[test]
    fn short_payload_form_equals_full_form((s, recs) in envelope()) {
        // Cutting each plane to its first `fill` rows writes the same envelope.
        let row = s.row_bytes().unwrap();
        let b = s.block_tokens() as usize;
        let short: Vec<_> = recs.iter().map(|(h, f, p)| {
            let compact: Vec<u8> = p.chunks_exact(row * b).flat_map(|pl| pl[..row * *f as usize].to_vec()).collect();
            (*h, *f, compact)
        }).collect();
        prop_assert_eq!(write(&s, &short), write(&s, &recs));
    }

    #[test]
    fn any_flipped_bit_is_refused_as_format((s, recs) in envelope(), pick in any::<prop::sample::Index>()) {
        let mut out = write(&s, &recs);
        let bit = pick.index(out.len() * 8);
        out[bit / 8] ^= 1 << (bit % 8);
        let err = Reader::new().expect_shape(s).read(&out).unwrap_err();
        prop_assert_eq!(err.kind(), ErrorKind::Format, "bit {}: {}", bit, err);
    }

    #[test]
    fn no_input_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Reader::new().read(&bytes);
        let _ = Reader::new().expect_shape(Shape::v1(4, 2, 1, 4)).read(&bytes);
    }

    #[test]
    fn header_like_inputs_do_not_panic(mut bytes in proptest::collection::vec(any::<u8>(), 32..400), fields in proptest::collection::vec(any::<u32>(), 5)) {
        // Valid magic, version and CRC, arbitrary counts: exercises rules 5 to 8 rather than 2 and 3.
        bytes[..4].copy_from_slice(b"TLKV");
        bytes[4..8].copy_from_slice(&[1, 0, 1, 0]);
        for (i, f) in fields.iter().enumerate() {
            bytes[8 + 4 * i..12 + 4 * i].copy_from_slice(&(f % 8).to_le_bytes());
        }
        let n = bytes.len() - 4;
        let c = kvwire::crc32c(&bytes[..n]);
        bytes[n..].copy_from_slice(&c.to_le_bytes());
        if let Ok(env) = Reader::new().read(&bytes) {
            prop_assert_eq!(env.records().count(), env.n_blocks());
        }
    }
}
