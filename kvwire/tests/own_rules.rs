//! The rules and accessors that only kvwire's dependents used to exercise, pinned by kvwire's own
//! tests (found by `cargo mutants --package kvwire`: `tests/mutants/cargo-mutants.sh`): a zero
//! dimension in each place, a zero-block envelope, the exact 32-byte boundary of rule 1, the
//! bounds of `Shape::offset`, the writer's fill bounds, the messages and the accessors.

use kvwire::{
    Dims, ErrorKind, HEADER_LEN, Kv, MAGIC, Pos, ReadError, Reader, RecordIn, Shape, WriteError,
    crc32c, write_to_vec,
};

const TEST: Shape = Shape::v1(4, 2, 1, 4);

/// A header (v1 f16) with these counts, an empty body and a correct trailer: 32 bytes.
fn header_only(n_blocks: u32, dims: [u32; 4]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&n_blocks.to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    assert_eq!(b.len(), HEADER_LEN);
    let c = crc32c(&b);
    b.extend_from_slice(&c.to_le_bytes());
    b
}

fn one_block(shape: &Shape, hash: u64, fill: u32) -> Vec<u8> {
    let payload = vec![7u8; shape.payload_bytes().unwrap()];
    let mut out = Vec::new();
    write_to_vec(
        shape,
        &[RecordIn {
            hash,
            fill,
            payload: &payload,
        }],
        &mut out,
    )
    .unwrap();
    out
}

#[test]
fn a_zero_dimension_anywhere_is_invalid_and_refused() {
    assert!(TEST.is_valid());
    for zero in 0..4 {
        let mut d = [4, 2, 1, 4];
        d[zero] = 0;
        let shape = Shape::v1(d[0], d[1], d[2], d[3]);
        assert!(!shape.is_valid(), "dimension {zero} is 0: {}", shape.dims);
        // The writer refuses it.
        assert_eq!(
            write_to_vec(&shape, &[], &mut Vec::new()),
            Err(WriteError::ZeroDimension),
            "dimension {zero}"
        );
        // The reader refuses it by rule 5, whatever the length.
        let buf = header_only(1, d);
        let err = Reader::new().read(&buf).unwrap_err();
        assert!(
            matches!(err, ReadError::ZeroCount { n_blocks: 1, .. }),
            "dimension {zero}: {err}"
        );
        assert_eq!(err.kind(), ErrorKind::Format);
    }
}

#[test]
fn the_32_byte_boundary_and_a_zero_block_envelope() {
    // Exactly 32 bytes passes rule 1 (a header and a trailer) and is refused by rule 5 as an
    // envelope of no block: the rule that refuses it is pinned, not just that one does.
    let buf = header_only(0, [4, 2, 1, 4]);
    assert_eq!(buf.len(), 32);
    let err = Reader::new().read(&buf).unwrap_err();
    assert!(
        matches!(err, ReadError::ZeroCount { n_blocks: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().starts_with("rule 5"), "{err}");
    // 31 bytes is rule 1.
    let err = Reader::new().read(&buf[..31]).unwrap_err();
    assert_eq!(err, ReadError::TooShort { len: 31 });
    // One block announced in 32 bytes: rule 5's length, naming what the header implies.
    let buf = header_only(1, [4, 2, 1, 4]);
    let want = TEST.envelope_len(1).unwrap();
    let err = Reader::new().read(&buf).unwrap_err();
    assert_eq!(
        err,
        ReadError::BadLength {
            len: 32,
            expected: Some(want)
        }
    );
    assert!(err.to_string().contains(&want.to_string()), "{err}");
    // A header whose size overflows says so.
    let buf = header_only(u32::MAX, [u32::MAX, u32::MAX, u32::MAX, u32::MAX]);
    let err = Reader::new().read(&buf).unwrap_err();
    assert!(
        matches!(err, ReadError::BadLength { expected: None, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("an overflowing size"), "{err}");
}

#[test]
fn offset_refuses_each_coordinate_out_of_range_alone() {
    let ok = Pos {
        layer: 1,
        kv: Kv::V,
        token: 3,
        head: 0,
        dim: 3,
    };
    // The last element of the payload.
    assert_eq!(
        TEST.offset(ok),
        Some(TEST.payload_bytes().unwrap() - TEST.format.elem_bytes())
    );
    let over = [
        Pos { layer: 2, ..ok },
        Pos { token: 4, ..ok },
        Pos { head: 1, ..ok },
        Pos { dim: 4, ..ok },
    ];
    for p in over {
        assert_eq!(TEST.offset(p), None, "{p:?}");
    }
}

#[test]
fn the_writer_refuses_a_fill_of_zero_and_one_past_b() {
    let payload = vec![0u8; TEST.payload_bytes().unwrap()];
    for fill in [0, 5] {
        let r = write_to_vec(
            &TEST,
            &[RecordIn {
                hash: 0,
                fill,
                payload: &payload,
            }],
            &mut Vec::new(),
        );
        assert_eq!(
            r,
            Err(WriteError::BadFill {
                record: 0,
                fill,
                block_tokens: 4
            }),
            "fill {fill}"
        );
    }
    for fill in [1, 4] {
        let mut out = Vec::new();
        let rec = RecordIn {
            hash: 0,
            fill,
            payload: &payload,
        };
        assert!(write_to_vec(&TEST, &[rec], &mut out).is_ok(), "fill {fill}");
    }
}

#[test]
fn a_payload_larger_than_a_copy_piece_round_trips() {
    // A block of 1 MiB crosses the writer's 64 KiB pieces many times over: every byte arrives
    // and the checksum covers them all.
    let shape = Shape::v1(16, 8, 8, 64);
    let payload: Vec<u8> = (0..shape.payload_bytes().unwrap())
        .map(|i| (i % 253) as u8)
        .collect();
    let mut out = Vec::new();
    write_to_vec(
        &shape,
        &[RecordIn {
            hash: 9,
            fill: 16,
            payload: &payload,
        }],
        &mut out,
    )
    .unwrap();
    let env = Reader::new().read(&out).unwrap();
    let rec = env.records().next().unwrap();
    assert_eq!(rec.payload, &payload[..]);
}

#[test]
fn accessors_and_messages() {
    let buf = one_block(&TEST, 0, 3);
    let env = Reader::new().read(&buf).unwrap();
    assert_eq!(env.payload_bytes(), TEST.payload_bytes().unwrap());
    assert_eq!(env.payload_bytes(), 128);
    let records = env.records();
    assert_eq!(records.size_hint(), (1, Some(1)));
    assert_eq!(records.len(), 1);

    let two = {
        let payload = vec![1u8; 128];
        let r = RecordIn {
            hash: 0,
            fill: 4,
            payload: &payload,
        };
        let mut out = Vec::new();
        write_to_vec(&TEST, &[r, r], &mut out).unwrap();
        out
    };
    let env = Reader::new().read(&two).unwrap();
    let mut records = env.records();
    assert_eq!(records.size_hint(), (2, Some(2)));
    records.next();
    assert_eq!(records.size_hint(), (1, Some(1)));

    let reader = Reader::new().expect_shape(TEST);
    assert_eq!(reader.expected_shape(), Some(&TEST));
    assert_eq!(Reader::new().expected_shape(), None);

    let d = Dims {
        block_tokens: 4,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 8,
    };
    assert_eq!(d.to_string(), "B=4 L=2 H=1 D=8");
    assert_eq!(ErrorKind::Format.to_string(), "format");
    assert_eq!(ErrorKind::Version.to_string(), "version");
    assert_eq!(ErrorKind::Shape.to_string(), "shape");
}

#[test]
fn the_crc_override_picks_the_implementation() {
    use kvwire::{CrcImpl, crc32c_impl, set_crc_impl};
    set_crc_impl(CrcImpl::Crc32c);
    assert_eq!(crc32c_impl(), "crc32c");
    let a = crc32c(b"123456789");
    set_crc_impl(CrcImpl::CrcFast);
    assert_eq!(crc32c_impl(), "crc-fast");
    let b = crc32c(b"123456789");
    set_crc_impl(CrcImpl::Auto);
    // Both give the check value of CRC-32C.
    assert_eq!((a, b), (0xE306_9283, 0xE306_9283));
}
