//! `tl inspect` as a process: output on success, one `refused:` line and the exit code per kind.

use std::path::PathBuf;
use std::process::Command;

fn blob(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../parity/kv.wire.v1")
        .join(name)
}

fn tl(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tl"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn inspect_prints_the_worked_example() {
    let (code, out, err) = tl(&["inspect", blob("worked_example.bin").to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("n_blocks 1 B=2 L=1 H=1 D=2"), "{out}");
    assert!(
        out.contains("record 0 hash a91ab0c1027b9366 fill 2 payload 16 bytes"),
        "{out}"
    );
}

#[test]
fn inspect_exit_codes_follow_the_refusal_kind() {
    let cases: [(&str, &[&str], i32, &str); 5] = [
        ("refuse_r3_crc.bin", &[], 3, "refused: format: rule 3"),
        (
            "refuse_r8_hashed_partial.bin",
            &[],
            3,
            "refused: format: rule 8",
        ),
        ("refuse_r4_version.bin", &[], 4, "refused: version: rule 4"),
        (
            "refuse_r6_shape.bin",
            &["--shape", "4,2,1,8"],
            5,
            "refused: shape: rule 6",
        ),
        ("test_full.bin", &["--shape", "4,2,1,4"], 0, ""),
    ];
    for (file, extra, want, prefix) in cases {
        let path = blob(file);
        let mut args = vec!["inspect", path.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (code, _, err) = tl(&args);
        assert_eq!(code, want, "{file}: {err}");
        if want != 0 {
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(err.starts_with(prefix), "{file}: {err}");
        }
    }
    // Usage and I/O errors are 2.
    assert_eq!(tl(&["inspect"]).0, 2);
    assert_eq!(tl(&["inspect", "/definitely/not/here.bin"]).0, 2);
    assert_eq!(
        tl(&[
            "inspect",
            blob("test_full.bin").to_str().unwrap(),
            "--shape",
            "4,2,0,4"
        ])
        .0,
        2
    );
}
