//! Pool and engine costs: import/export of a 2 MiB block against memcpy, lookup of 1,000 hashes
//! in a pool of 100,000 blocks, and the fake model's decode step per sequence.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvwire::Shape;
use tl_engine_core::engine::{Engine, Mode, Request};
use tl_engine_core::model::{BYTE_VOCAB, FakeModel};
use tl_engine_core::pool::{BlockKey, KvPool, SharedKv};
use tl_engine_core::sampler::{Sampling, SamplingRequest};

const REAL: Shape = Shape::v1(16, 32, 8, 128);
const TEST: Shape = Shape::v1(4, 2, 1, 4);

/// An import with no name (the bench measures the copy).
const ANON: BlockKey<'static> = BlockKey {
    scope: 0,
    hash: 0,
    tokens: &[],
    parent: None,
};

/// Block `i` of the lookup bench: four tokens, a first block of scope 0.
fn tokens(i: u32) -> [u32; 4] {
    [i, i ^ 1, i ^ 2, i ^ 3]
}

fn import_export(c: &mut Criterion) {
    let p = REAL.payload_bytes().expect("fixed shape");
    let src: Vec<u8> = (0..p).map(|i| (i * 7 % 253) as u8).collect();
    let mut dst = vec![0u8; p];
    let pool = SharedKv::new(KvPool::new(REAL, 4));
    let mut g = c.benchmark_group("pool_2MiB");
    g.throughput(Throughput::Bytes(p as u64));
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    g.bench_function("import", |b| {
        b.iter(|| {
            let id = pool.import(ANON, 16, black_box(&src), 0).expect("room");
            pool.lock().release(id).expect("held");
        })
    });
    let id = pool.import(ANON, 16, &src, 0).expect("room");
    g.bench_function("export_copy", |b| {
        b.iter(|| {
            let bytes = pool.read(black_box(id)).expect("exists");
            dst.copy_from_slice(&bytes);
        })
    });
    g.finish();
}

fn lookup(c: &mut Criterion) {
    const N: usize = 100_000;
    let mut pool = KvPool::new(TEST, N);
    let ids = pool.allocate(N).expect("room");
    for (i, &id) in ids.iter().enumerate() {
        let t = tokens(i as u32);
        let key = BlockKey {
            scope: 0,
            hash: kvwire::block_hash(0, &t),
            tokens: &t,
            parent: None,
        };
        pool.register(id, key);
    }
    for id in ids {
        pool.release(id).expect("held");
    }
    // Half present, half absent, spread over the table: each found block's tokens are
    // compared, as every lookup does.
    let probes: Vec<(u64, [u32; 4])> = (0..1000u32)
        .map(|i| {
            let t = tokens(i * 97);
            if i % 2 == 0 {
                (kvwire::block_hash(0, &t), t)
            } else {
                (kvwire::block_hash(1, &t), t)
            }
        })
        .collect();
    let mut g = c.benchmark_group("lookup");
    g.throughput(Throughput::Elements(probes.len() as u64));
    g.bench_function("1000_hashes_in_100k_blocks", |b| {
        b.iter(|| {
            probes
                .iter()
                .filter(|(hash, t)| {
                    let key = BlockKey {
                        scope: 0,
                        hash: *hash,
                        tokens: t,
                        parent: None,
                    };
                    pool.lookup(black_box(key)).is_some()
                })
                .count()
        })
    });
    g.finish();
}

fn decode_step(c: &mut Criterion) {
    const SEQS: u32 = 16;
    let s = Sampling::new(
        SamplingRequest {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 0,
            ..SamplingRequest::default()
        },
        BYTE_VOCAB,
    )
    .expect("valid");
    let mut g = c.benchmark_group("decode_step");
    g.throughput(Throughput::Elements(u64::from(SEQS)));
    // Each iteration: 16 sequences of a 64-token prompt, one decode step for all of them.
    g.bench_function("fake_model_test_shape_16_seqs", |b| {
        b.iter_batched(
            || {
                let model = Arc::new(FakeModel::new("fake", TEST, BYTE_VOCAB, 4096));
                let mut e = Engine::new(model, SharedKv::new(KvPool::new(TEST, 1024)));
                for i in 0..SEQS {
                    let prompt: Vec<u32> = (0..64).map(|t| (t * 7 + i) % 256).collect();
                    e.submit(Request {
                        prompt,
                        sampling: s.clone(),
                        seed: u64::from(i),
                        max_tokens: 100,
                        mode: Mode::Generate,
                        draws_offset: 0,
                        stop: tl_engine_core::stop::Stop::default(),
                        choices: tl_engine_core::engine::Choices::ONE,
                        scope: 0,
                        earlier_output: 0,
                        constraint: None,
                    })
                    .expect("valid");
                }
                e.step(); // prefill
                e
            },
            |mut e| {
                let (events, stats) = e.step();
                assert_eq!(stats.decoded, SEQS as usize);
                (e, events)
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = import_export, lookup, decode_step
}
criterion_main!(benches);
