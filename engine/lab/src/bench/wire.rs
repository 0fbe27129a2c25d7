//! `tl bench wire`: envelope read and write throughput against raw CRC-32C and memcpy + CRC-32C.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvwire::{Kv, Reader, RecordIn, Shape, crc32c, write_envelope};

use super::{gbps, median, round3};

/// The fp8 example's E4M3 conversion, measured here as it is (not a copy).
#[path = "../../../../kvwire/examples/fp8_v2/e4m3.rs"]
#[allow(dead_code)]
mod e4m3;

/// Arguments of `tl bench wire`.
#[derive(clap::Args, Debug)]
pub struct WireArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// Interleaved rounds per measurement; the median is reported.
    #[arg(long, default_value_t = 7)]
    rounds: u32,
    /// Milliseconds per measurement in each round.
    #[arg(long, default_value_t = 120)]
    ms: u64,
    /// CRC-32C implementation for the envelope reader and writer: auto, crc32c or crc-fast.
    #[arg(long, default_value = "auto")]
    crc: kvwire::CrcImpl,
}

/// One size's figures.
fn wire_case(name: &str, shape: Shape, rounds: u32, budget: Duration) -> serde_json::Value {
    let p = shape.payload_bytes().unwrap_or(0);
    let payload: Vec<u8> = (0..p).map(|i| (i * 31 % 251) as u8).collect();
    let rec = [RecordIn {
        hash: 0x1234,
        fill: shape.block_tokens(),
        payload: &payload,
    }];
    let mut env = Vec::new();
    let _ = kvwire::write_to_vec(&shape, &rec, &mut env);
    let len = env.len();
    let reader = Reader::new().expect_shape(shape);
    let mut out = Vec::with_capacity(len);
    let mut dst = vec![0u8; len];

    let (mut crc, mut read, mut copy_crc, mut write) = (vec![], vec![], vec![], vec![]);
    let (mut by_crc32c, mut by_crc_fast) = (vec![], vec![]);
    let mut planes = vec![];
    let mut fp8 = vec![];
    let mut fp8_out: Vec<u8> = Vec::with_capacity(p / 2);
    let parsed = reader.read(&env).ok();
    let chosen = kvwire::crc32c_impl();
    for _ in 0..rounds {
        // Both crates on this CPU, in the same round.
        for (choice, out) in [
            (kvwire::CrcImpl::Crc32c, &mut by_crc32c),
            (kvwire::CrcImpl::CrcFast, &mut by_crc_fast),
        ] {
            kvwire::set_crc_impl(choice);
            out.push(gbps(len, budget, || {
                black_box(crc32c(black_box(&env[..len - 4])));
            }));
        }
        kvwire::set_crc_impl(chosen.parse().unwrap_or(kvwire::CrcImpl::Auto));
        crc.push(gbps(len, budget, || {
            black_box(crc32c(black_box(&env[..len - 4])));
        }));
        read.push(gbps(len, budget, || {
            if let Ok(e) = reader.read(black_box(&env)) {
                black_box(e.records().map(|r| r.payload.len()).sum::<usize>());
            }
        }));
        copy_crc.push(gbps(len, budget, || {
            dst.copy_from_slice(black_box(&env));
            black_box(crc32c(&dst[..len - 4]));
        }));
        // Every plane of the block as `&[f16]`: no bytes are touched, only checked and cast.
        if let Some(e) = &parsed {
            planes.push(gbps(len, budget, || {
                for r in black_box(e).records() {
                    for layer in 0..shape.dims.n_layers {
                        for kv in [Kv::K, Kv::V] {
                            if let Ok(p) = r.plane(layer, kv) {
                                black_box(p.len());
                            }
                        }
                    }
                }
            }));
        }
        // The example's f16 -> E4M3 conversion through the plane views, per f16 byte in.
        if let Some(e) = &parsed {
            fp8.push(gbps(p, budget, || {
                fp8_out.clear();
                for r in black_box(e).records() {
                    for layer in 0..shape.dims.n_layers {
                        for kv in [Kv::K, Kv::V] {
                            if let Ok(plane) = r.plane(layer, kv) {
                                fp8_out.extend(plane.iter().map(|v| e4m3::to_e4m3(v.to_f32())));
                            }
                        }
                    }
                }
                black_box(fp8_out.len());
            }));
        }
        write.push(gbps(len, budget, || {
            out.clear();
            let _ = black_box(write_envelope(&shape, black_box(&rec), &mut out));
        }));
    }
    let ratios = |a: &[f64], b: &[f64]| {
        let mut r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
        median(&mut r)
    };
    serde_json::json!({
        "case": name,
        "envelope_bytes": len,
        "crc_gbps": round3(median(&mut crc.clone())),
        "crc_gbps_by_impl": {
            "crc32c": round3(median(&mut by_crc32c)),
            "crc-fast": round3(median(&mut by_crc_fast)),
        },
        "read_gbps": round3(median(&mut read.clone())),
        "read_over_crc": round3(ratios(&read, &crc)),
        "memcpy_crc_gbps": round3(median(&mut copy_crc.clone())),
        "write_gbps": round3(median(&mut write.clone())),
        "write_over_memcpy_crc": round3(ratios(&write, &copy_crc)),
        // Time to view every plane of the block as f16, over the time of one CRC pass over the
        // same bytes (throughputs are inverse times): close to 0 means free.
        "plane_view_time_over_crc": round_sig(ratios(&crc, &planes)),
        "plane_view_ns_per_block": round3(len as f64 / median(&mut planes.clone())),
        "f16_to_fp8_gbps": round3(median(&mut fp8.clone())),
        "f16_to_fp8_over_crc": round3(ratios(&fp8, &crc)),
    })
}

/// `x` to 3 significant figures (ratios far below 1 keep their digits).
fn round_sig(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(2 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// Runs `tl bench wire`.
#[must_use]
pub fn wire(args: &WireArgs) -> ExitCode {
    kvwire::set_crc_impl(args.crc);
    let t = Instant::now();
    let budget = Duration::from_millis(args.ms.max(1));
    let rounds = args.rounds.max(1);
    let cases = vec![
        wire_case("test_shape_172B", Shape::v1(4, 2, 1, 4), rounds, budget),
        wire_case("realistic_2MiB", Shape::v1(16, 32, 8, 128), rounds, budget),
    ];
    let out = serde_json::json!({
        "bench": "wire",
        "crc_impl": kvwire::crc32c_impl(),
        "rounds": rounds,
        "ratio": "median of per-round ratios, baseline measured in the same round",
        "cases": cases,
        "elapsed_s": round3(t.elapsed().as_secs_f64()),
    });
    println!("{out}");
    ExitCode::SUCCESS
}
