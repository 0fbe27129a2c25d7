//! The contract's worked example, byte for byte, and the published check values.

use kvwire::{Reader, RecordIn, Shape, block_hash, crc32c, f16, fnv1a64, write_to_vec};

#[test]
fn hand_example_envelope() {
    // Check values of the two primitives.
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);

    // B=2, L=1, H=1, D=2; tokens [1, 2]; K = [[1, 2], [3, 4]], V = [[0.5, -1], [0, 0.25]].
    let shape = Shape::v1(2, 1, 1, 2);
    let mut hashed = Vec::new();
    hashed.extend_from_slice(&0u64.to_le_bytes());
    hashed.extend_from_slice(&1u32.to_le_bytes());
    hashed.extend_from_slice(&2u32.to_le_bytes());
    assert_eq!(fnv1a64(&hashed), 0xA91A_B0C1_027B_9366);
    let hash = block_hash(0, &[1, 2]);
    assert_eq!(hash, 0xA91A_B0C1_027B_9366);
    // A second block chains on the first: the same tokens under another parent name another block.
    let second = block_hash(hash, &[3, 4]);
    let mut chained = hash.to_le_bytes().to_vec();
    chained.extend_from_slice(&3u32.to_le_bytes());
    chained.extend_from_slice(&4u32.to_le_bytes());
    assert_eq!(second, fnv1a64(&chained));
    assert_ne!(block_hash(hash, &[1, 2]), hash);

    let payload: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 0.5, -1.0, 0.0, 0.25]
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect();
    assert_eq!(
        payload,
        [
            0x00, 0x3c, 0x00, 0x40, 0x00, 0x42, 0x00, 0x44, 0x00, 0x38, 0x00, 0xbc, 0x00, 0x00,
            0x00, 0x34
        ]
    );
    assert_eq!(shape.payload_bytes(), Some(16));
    assert_eq!(shape.envelope_len(1), Some(60));

    let mut out = Vec::new();
    let n = write_to_vec(
        &shape,
        &[RecordIn {
            hash,
            fill: 2,
            payload: &payload,
        }],
        &mut out,
    )
    .unwrap();
    assert_eq!(n, 60);
    let mut expected = Vec::new();
    expected.extend_from_slice(b"TLKV");
    for v in [1u16, 1] {
        expected.extend_from_slice(&v.to_le_bytes());
    }
    for v in [1u32, 2, 1, 1, 2] {
        expected.extend_from_slice(&v.to_le_bytes());
    }
    expected.extend_from_slice(&0xA91A_B0C1_027B_9366u64.to_le_bytes());
    expected.extend_from_slice(&2u32.to_le_bytes());
    expected.extend_from_slice(&payload);
    assert_eq!(crc32c(&expected), 0x4F0B_541C);
    expected.extend_from_slice(&[0x1c, 0x54, 0x0b, 0x4f]);
    assert_eq!(out, expected);

    let env = Reader::new().expect_shape(shape).read(&out).unwrap();
    assert_eq!(env.crc(), 0x4F0B_541C);
    let recs: Vec<_> = env.records().collect();
    assert_eq!(recs.len(), 1);
    assert_eq!(
        (recs[0].hash, recs[0].n_tokens, recs[0].payload),
        (hash, 2, &payload[..])
    );
    assert_eq!(crc32c(&out), kvwire::CRC32C_RESIDUE);
}
