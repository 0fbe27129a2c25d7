//! As `read_envelope`, but the trailer is rewritten to the input's CRC-32C (and the magic set when
//! the input is long enough), so the fuzzer reaches rules 4 to 8 instead of stopping at the CRC.
#![no_main]

use kvwire::{Reader, Shape, crc32c};
use libfuzzer_sys::fuzz_target;

mod planes;
use planes::check_planes;

fuzz_target!(|data: &[u8]| {
    let mut buf = data.to_vec();
    if buf.len() >= 32 {
        buf[..4].copy_from_slice(b"TLKV");
        let n = buf.len() - 4;
        let c = crc32c(&buf[..n]);
        buf[n..].copy_from_slice(&c.to_le_bytes());
    }
    for reader in [Reader::new(), Reader::new().expect_shape(Shape::v1(4, 2, 1, 4))] {
        if let Ok(env) = reader.read(&buf) {
            check_planes(&env);
            assert_eq!(env.records().count(), env.n_blocks());
            for r in env.records() {
                assert_eq!(r.payload.len(), env.payload_bytes());
                assert!(r.n_tokens >= 1 && r.n_tokens <= env.shape().block_tokens());
            }
        }
    }
});

