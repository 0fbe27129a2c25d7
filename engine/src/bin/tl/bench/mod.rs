//! `tl bench`: quick benchmarks that print one JSON line. Figures are ratios against baselines
//! measured in the same run, interleaved, because absolute speeds on a shared machine drift.

pub(crate) mod control;
pub(crate) mod serve;
pub(crate) mod transfer;
pub(crate) mod ttft;
pub(crate) mod wire;

use std::time::{Duration, Instant};

/// Whatever stopped a bench; printed to stderr with exit status 1.
pub(crate) type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// Runs `f` repeatedly for about `budget` and returns GB/s for `bytes` per call.
pub(crate) fn gbps(bytes: usize, budget: Duration, mut f: impl FnMut()) -> f64 {
    // Calibrate the batch so clock reads are negligible.
    let mut batch = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..batch {
            f();
        }
        if t.elapsed() >= Duration::from_millis(2) || batch >= 1 << 30 {
            break;
        }
        batch *= 2;
    }
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < budget {
        for _ in 0..batch {
            f();
        }
        calls += batch;
    }
    (bytes as f64 * calls as f64) / start.elapsed().as_secs_f64() / 1e9
}

/// The median of `v` (which it sorts).
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub(crate) fn ms(d: Duration) -> f64 {
    round3(d.as_secs_f64() * 1e3)
}
