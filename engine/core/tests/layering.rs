//! The core is sans-IO by construction: its normal dependency tree holds no async runtime, RPC,
//! HTTP, CLI or JSON crate. `.ci/run` runs the same check.

use std::process::Command;

const FORBIDDEN: [&str; 8] = [
    "tokio",
    "tonic",
    "prost",
    "hyper",
    "axum",
    "clap",
    "serde_json",
    "http",
];

#[test]
fn core_has_no_io_dependencies() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "-p",
            "tl-engine-core",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(crates.contains(&"kvwire"), "{tree}");
    for bad in FORBIDDEN {
        assert!(
            !crates
                .iter()
                .any(|c| *c == bad || c.starts_with(&format!("{bad}-"))),
            "tl-engine-core depends on {bad}:\n{tree}"
        );
    }
}
