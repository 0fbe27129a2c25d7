//! Inputs shared by the benchmarks: one-block envelopes of the test and realistic shapes.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use kvwire::{RecordIn, Shape, write_to_vec};

/// One benchmark input.
#[derive(Debug)]
pub struct Case {
    /// Short name used in benchmark ids.
    pub name: &'static str,
    /// The block shape.
    pub shape: Shape,
    /// One full block's payload.
    pub payload: Vec<u8>,
    /// That block as a one-block envelope.
    pub envelope: Vec<u8>,
}

impl Case {
    /// The record the envelope was written from.
    #[must_use]
    pub fn records(&self) -> [RecordIn<'_>; 1] {
        [RecordIn {
            hash: 0x5eed,
            fill: self.shape.block_tokens(),
            payload: &self.payload,
        }]
    }
}

/// The test shape (172-byte envelope) and the realistic shape (2 MiB payload).
///
/// # Panics
/// Never for these fixed shapes.
#[must_use]
pub fn cases() -> Vec<Case> {
    [
        ("172B", Shape::v1(4, 2, 1, 4)),
        ("2MiB", Shape::v1(16, 32, 8, 128)),
    ]
    .into_iter()
    .map(|(name, shape)| {
        let p = shape.payload_bytes().expect("fixed shape");
        let payload: Vec<u8> = (0..p).map(|i| (i * 31 % 251) as u8).collect();
        let mut case = Case {
            name,
            shape,
            payload,
            envelope: Vec::new(),
        };
        let mut env = Vec::new();
        write_to_vec(&shape, &case.records(), &mut env).expect("fixed shape");
        case.envelope = env;
        case
    })
    .collect()
}
