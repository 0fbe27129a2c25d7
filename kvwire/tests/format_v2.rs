//! A format v2 defined outside kvwire, through its public API only.

use kvwire::{ErrorKind, Formats, Reader, RecordIn, Shape, WireFormat, block_hash, write_to_vec};

/// A toy fp8-like format: version 2, dtype 2, one byte per element.
const TOY_V2: WireFormat = WireFormat::new(2, 2, 1, "toy8");

#[test]
fn format_v2_plugs_in_from_outside() {
    let mut shape = Shape::v1(4, 2, 1, 4);
    shape.format = TOY_V2;
    // One-byte elements halve the payload of the same dimensions.
    assert_eq!(shape.payload_bytes(), Some(64));

    let payload: Vec<u8> = (0..64).collect();
    let hash = block_hash(0, &[7, 7, 7, 7]);
    let mut env = Vec::new();
    let n = write_to_vec(
        &shape,
        &[RecordIn {
            hash,
            fill: 4,
            payload: &payload,
        }],
        &mut env,
    )
    .unwrap();
    assert_eq!(n, 28 + 12 + 64 + 4);
    assert_eq!(&env[4..8], &[2, 0, 2, 0]);

    let v2_reader = Reader::new()
        .formats(Formats::V1.with(TOY_V2))
        .expect_shape(shape);
    let read = v2_reader.read(&env).unwrap();
    assert_eq!(read.shape().format, TOY_V2);
    let rec = read.records().next().unwrap();
    assert_eq!(
        (rec.hash, rec.n_tokens, rec.payload),
        (hash, 4, &payload[..])
    );

    // The default reader refuses it as a format it does not read, not as corruption.
    let err = Reader::new().read(&env).unwrap_err();
    assert_eq!((err.kind(), err.rule()), (ErrorKind::Version, 4));
    // And a v2-only pool refuses v1 envelopes of the same dimensions as a shape mismatch.
    let mut v1 = Vec::new();
    write_to_vec(
        &Shape::v1(4, 2, 1, 4),
        &[RecordIn {
            hash,
            fill: 4,
            payload: &[0; 128],
        }],
        &mut v1,
    )
    .unwrap();
    let err = v2_reader.read(&v1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Shape);
}
