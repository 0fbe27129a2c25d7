//! `tl inspect`: validate a kv.wire.v1 envelope file and print its header and records.

use std::path::PathBuf;
use std::process::ExitCode;

use kvwire::{ErrorKind, Reader, Shape};

/// Arguments of `tl inspect`.
#[derive(clap::Args, Debug)]
pub(crate) struct InspectArgs {
    /// The envelope file.
    file: PathBuf,
    /// Refuse envelopes whose shape is not B,L,H,D (as a receiving pool would).
    #[arg(long, value_parser = parse_shape, value_name = "B,L,H,D")]
    shape: Option<Shape>,
}

/// Parses `B,L,H,D` into a v1 shape (clap shows the message as it is).
fn parse_shape(s: &str) -> Result<Shape, String> {
    let parts: Vec<u32> = s
        .split(',')
        .map(|p| p.trim().parse::<u32>().map_err(|e| format!("{p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    match parts[..] {
        [b, l, h, d] if b > 0 && l > 0 && h > 0 && d > 0 => Ok(Shape::v1(b, l, h, d)),
        _ => Err(format!(
            "expected four positive integers B,L,H,D, got {s:?}"
        )),
    }
}

/// The exit status `tl inspect` uses for a refusal of this kind.
#[must_use]
fn refusal_exit_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::Format => 3,
        ErrorKind::Version => 4,
        ErrorKind::Shape => 5,
        // A kind added later is still a refusal; treat it as corruption.
        _ => 3,
    }
}

/// Runs `tl inspect`: prints the header and one line per record, or one `refused:` line to stderr.
#[must_use]
pub(crate) fn inspect(args: &InspectArgs) -> ExitCode {
    let bytes = match std::fs::read(&args.file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {}: {e}", args.file.display());
            return ExitCode::from(2);
        }
    };
    let mut reader = Reader::new();
    if let Some(shape) = args.shape {
        reader = reader.expect_shape(shape);
    }
    match reader.read(&bytes) {
        Ok(env) => {
            let h = env.header();
            let s = env.shape();
            println!(
                "envelope {} bytes: version {} dtype {} ({}) n_blocks {} {} payload {} bytes crc32c {:#010x}",
                bytes.len(),
                h.version.get(),
                h.dtype.get(),
                s.format.name,
                env.n_blocks(),
                s.dims,
                env.payload_bytes(),
                env.crc()
            );
            for (i, r) in env.records().enumerate() {
                println!(
                    "record {i} hash {:016x} fill {} payload {} bytes",
                    r.hash,
                    r.n_tokens,
                    r.payload.len()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("refused: {}: {e}", e.kind());
            ExitCode::from(refusal_exit_code(e.kind()))
        }
    }
}
