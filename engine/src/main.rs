//! `tl`: one binary for every role of the kvwire engine.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tl",
    version,
    about = "kvwire engine: inspect envelopes, run engines, benchmark"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Validate a kv.wire.v1 envelope file and print its header and records.
    ///
    /// Exit status: 0 valid; 3 format refusal; 4 version refusal; 5 shape refusal; 2 usage or I/O.
    Inspect(tl_engine::cli::InspectArgs),
    /// Colocated generation on one engine; prints `{"tokens":[...],"seed":S}`.
    Generate(tl_engine::cli::GenerateArgs),
    /// Benchmarks that print one JSON line.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// Envelope read and write throughput against raw CRC-32C and memcpy, measured in the same run.
    Wire(tl_engine::bench::WireArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            // clap's own exit codes: 0 for --help/--version, 2 for usage errors.
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match cli.cmd {
        Cmd::Inspect(args) => tl_engine::cli::inspect(&args),
        Cmd::Generate(args) => tl_engine::cli::generate(&args),
        Cmd::Bench {
            which: BenchCmd::Wire(args),
        } => tl_engine::bench::wire(&args),
    }
}
