//! Wire-format throughput: raw CRC-32C per crate, envelope read against raw CRC, envelope write
//! against memcpy + CRC, for the test shape (172 B) and the realistic shape (2 MiB).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvwire::{Reader, Shape, crc32c, write_envelope};
use kvwire_benches::{Case, cases};

fn crc_crates(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32c");
    for case in cases() {
        let data = &case.envelope[..case.envelope.len() - 4];
        g.throughput(Throughput::Bytes(data.len() as u64));
        g.bench_function(format!("crc32c-crate/{}", case.name), |b| {
            b.iter(|| crc32c::crc32c(black_box(data)))
        });
        g.bench_function(format!("crc-fast/{}", case.name), |b| {
            b.iter(|| crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, black_box(data)))
        });
        g.bench_function(format!("kvwire/{}", case.name), |b| {
            b.iter(|| crc32c(black_box(data)))
        });
    }
    g.finish();
}

fn read(c: &mut Criterion) {
    let mut g = c.benchmark_group("read");
    for Case {
        name,
        shape,
        envelope,
        ..
    } in cases()
    {
        g.throughput(Throughput::Bytes(envelope.len() as u64));
        let reader = Reader::new().expect_shape(shape);
        g.bench_function(format!("raw_crc/{name}"), |b| {
            b.iter(|| crc32c(black_box(&envelope[..envelope.len() - 4])))
        });
        g.bench_function(format!("validate_iterate/{name}"), |b| {
            b.iter(|| {
                let env = reader.read(black_box(&envelope)).expect("valid");
                env.records().map(|r| r.payload.len()).sum::<usize>()
            })
        });
    }
    g.finish();
}

fn write(c: &mut Criterion) {
    let mut g = c.benchmark_group("write");
    for case in cases() {
        let len = case.envelope.len();
        g.throughput(Throughput::Bytes(len as u64));
        let mut dst = vec![0u8; len];
        g.bench_function(format!("memcpy_crc/{}", case.name), |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&case.envelope));
                crc32c(&dst[..len - 4])
            })
        });
        let mut out = Vec::with_capacity(len);
        let shape: Shape = case.shape;
        g.bench_function(format!("write_envelope/{}", case.name), |b| {
            b.iter(|| {
                out.clear();
                write_envelope(&shape, black_box(&case.records()), &mut out).expect("valid")
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = crc_crates, read, write
}
criterion_main!(benches);
