//! Any bytes into the reader, with and without an expected shape: a typed result, never a panic.
//! Inputs that pass are written back and must reproduce themselves byte for byte.
#![no_main]

use kvwire::{Reader, RecordIn, Shape, write_to_vec};
use libfuzzer_sys::fuzz_target;

mod planes;
use planes::check_planes;

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

