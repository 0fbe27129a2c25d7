//! llama.cpp beside `tl bench model`, in the same run on the same cores: the prebuilt PyPI wheel
//! `xllamacpp` (checked by sha256) and the `gguf` package, installed into a folder of their own
//! under `target/`, drive `peer/llamacpp.py`. It writes one trained GGUF's weights as BF16, F32
//! and Q8_0 files, which both engines then load, and times llama.cpp on each.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::BenchError;

/// The llama.cpp build: its wheel and that wheel's sha256.
const XLLAMACPP: &str = "xllamacpp==2026.10.11549";
const XLLAMACPP_WHEEL: &str =
    "xllamacpp-2026.10.11549-cp310-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
const XLLAMACPP_SHA256: &str = "c54e7d13520ecc989c63dc99d55de3065e2f343a91f43f053d16b5e62077c261";
/// What the converter imports, pinned (gguf's other requirements are for its own scripts).
const CONVERTER: [&str; 4] = [
    "gguf==0.19.0",
    "numpy==2.4.6",
    "pyyaml==6.0.4",
    "tqdm==4.70.1",
];
/// The driver script, written next to the packages.
const SCRIPT: &str = include_str!("../../peer/llamacpp.py");
/// The marker a complete install leaves, holding what was installed.
const MARKER: &str = ".tl-fetched";

/// The weight types both engines are timed on.
pub const TYPES: [&str; 3] = ["BF16", "F32", "Q8_0"];

/// The peer's folder: `TL_PEER_DIR`, else `target/peer` beside the running binary's profile
/// folder (`target/release/tl` gives `target/peer`).
fn peer_dir() -> PathBuf {
    dir()
}

/// The peer's folder: `TL_PEER_DIR`, else `target/peer` beside the running binary's profile
/// folder.
#[must_use]
pub fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TL_PEER_DIR") {
        return PathBuf::from(d);
    }
    std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.parent()?.join("peer")))
        .unwrap_or_else(|| std::env::temp_dir().join("tl-peer"))
}

fn sha256_hex(path: &Path) -> std::io::Result<String> {
    let bytes = std::fs::read(path)?;
    Ok(ring::digest::digest(&ring::digest::SHA256, &bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn pip(args: &[&str], extra: &[&Path]) -> Result<(), BenchError> {
    let status = Command::new("python3")
        .args(["-m", "pip", "-q", "--disable-pip-version-check"])
        .args(args)
        .args(extra)
        .status()
        .map_err(|e| format!("llama.cpp's side needs python3 with pip: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`python3 -m pip {}` failed ({status})", args.join(" ")).into())
    }
}

/// The installed packages' folder (installed on first use) and the driver script in it.
fn install() -> Result<(PathBuf, PathBuf), BenchError> {
    let dir = peer_dir();
    let site = dir.join("site");
    let script = dir.join("llamacpp.py");
    let what = format!("{XLLAMACPP} {XLLAMACPP_SHA256} {}", CONVERTER.join(" "));
    let done = std::fs::read_to_string(site.join(MARKER)).is_ok_and(|m| m == what);
    if !done {
        eprintln!(
            "installing llama.cpp ({XLLAMACPP}) and gguf into {}",
            site.display()
        );
        let _ = std::fs::remove_dir_all(&site);
        let wheels = dir.join("wheels");
        std::fs::create_dir_all(&wheels)?;
        let wheel = wheels.join(XLLAMACPP_WHEEL);
        if !sha256_hex(&wheel).is_ok_and(|h| h == XLLAMACPP_SHA256) {
            pip(&["download", "--no-deps", XLLAMACPP, "-d"], &[&wheels])?;
        }
        let got = sha256_hex(&wheel)?;
        if got != XLLAMACPP_SHA256 {
            return Err(format!(
                "{XLLAMACPP_WHEEL}: sha256 {got}, expected {XLLAMACPP_SHA256}: not the pinned build"
            )
            .into());
        }
        let mut args = vec!["install", "--no-deps", "--no-warn-script-location"];
        args.extend(CONVERTER);
        args.push("--target");
        pip(&args, &[&site, &wheel])?;
        std::fs::write(site.join(MARKER), &what)?;
    }
    std::fs::write(&script, SCRIPT)?;
    Ok((site, script))
}

/// How long one converter or llama.cpp run may take before it is killed.
const PEER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(600);

/// Runs the driver script with `args` and returns its standard output; killed past
/// [`PEER_DEADLINE`]. Its output goes to files (a pipe nobody reads while waiting could fill
/// and stall it).
fn python(site: &Path, script: &Path, args: &[String]) -> Result<String, BenchError> {
    let dir = peer_dir();
    let (out_path, err_path) = (dir.join("last.stdout"), dir.join("last.stderr"));
    let mut child = Command::new("python3")
        .env("PYTHONPATH", site)
        .env("PYTHONNOUSERSITE", "1")
        .arg(script)
        .args(args)
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .spawn()?;
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > PEER_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "llamacpp.py {} did not finish within {} s",
                args.join(" "),
                PEER_DEADLINE.as_secs()
            )
            .into());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    if !status.success() {
        let err = std::fs::read_to_string(&err_path).unwrap_or_default();
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        return Err(format!(
            "llamacpp.py {} failed ({status}): {}",
            args.join(" "),
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )
        .into());
    }
    Ok(std::fs::read_to_string(&out_path)?)
}

/// The peer, ready: its packages installed and `source` written as each of [`TYPES`].
#[derive(Debug)]
pub struct Peer {
    site: PathBuf,
    script: PathBuf,
    /// The GGUF file of each type, in [`TYPES`]' order.
    pub files: Vec<PathBuf>,
}

impl Peer {
    /// Where its Python packages are installed (a `PYTHONPATH`).
    #[must_use]
    pub fn site(&self) -> &Path {
        &self.site
    }

    /// Installs the peer (once) and converts `source` (once per type).
    ///
    /// # Errors
    /// No Python with pip, no PyPI, a wheel that is not the pinned one, a failed conversion.
    pub fn prepare(source: &Path) -> Result<Self, BenchError> {
        let (site, script) = install()?;
        let stem = source
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        let models = peer_dir().join("models");
        std::fs::create_dir_all(&models)?;
        let mut files = Vec::new();
        for t in TYPES {
            let file = models.join(format!("{stem}.{t}.gguf"));
            let marker = models.join(format!("{stem}.{t}.done"));
            let from = format!("{} {}", source.display(), sha256_hex(source)?);
            if !(file.is_file() && std::fs::read_to_string(&marker).is_ok_and(|m| m == from)) {
                let part = models.join(format!("{stem}.{t}.gguf.part"));
                python(
                    &site,
                    &script,
                    &[
                        "convert".into(),
                        source.display().to_string(),
                        part.display().to_string(),
                        t.into(),
                    ],
                )?;
                std::fs::rename(&part, &file)?;
                std::fs::write(&marker, &from)?;
            }
            files.push(file);
        }
        Ok(Self {
            site,
            script,
            files,
        })
    }

    /// llama.cpp's prefill tokens/s on a `prompt`-token prompt and decode tokens/s over `steps`
    /// tokens, on `threads` threads, for `file`.
    ///
    /// # Errors
    /// When llama.cpp fails to load or run it.
    pub fn time(
        &self,
        file: &Path,
        threads: usize,
        prompt: usize,
        steps: u32,
    ) -> Result<serde_json::Value, BenchError> {
        let out = python(
            &self.site,
            &self.script,
            &[
                "bench".into(),
                file.display().to_string(),
                threads.to_string(),
                prompt.to_string(),
                steps.to_string(),
            ],
        )?;
        let line = out
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .ok_or("llamacpp.py printed no figures")?;
        Ok(serde_json::from_str(line)?)
    }
}
