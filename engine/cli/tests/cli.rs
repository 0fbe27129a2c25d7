//! `tl inspect` as a process: output on success, one `refused:` line and the exit code per kind.

use std::path::PathBuf;
use std::process::Command;

fn blob(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../parity/kv.wire.v1")
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

#[test]
fn generate_prints_tokens_and_seed() {
    let (code, out, err) = tl(&[
        "generate",
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "12",
        "--temperature",
        "0.8",
        "--seed",
        "42",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["seed"], 42);
    let tokens: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(tokens.len(), 12);
    assert!(out.starts_with("{\"tokens\":["), "{out}");
    // The same request again gives the same tokens; without a seed the engine picks and reports one.
    let (_, again, _) = tl(&[
        "generate",
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "12",
        "--temperature",
        "0.8",
        "--seed",
        "42",
    ]);
    assert_eq!(again, out);
    let (code, picked, _) = tl(&["generate", "--prompt-tokens", "1,2,3", "--max-tokens", "2"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(picked.trim()).unwrap();
    assert!(v["seed"].is_u64());
}

#[test]
fn generate_refuses_bad_config_and_parameters() {
    let dir = std::env::temp_dir().join(format!("tl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[pool]\nn_blocks = 8\nbogus = 1\n").unwrap();
    let (code, _, err) = tl(&[
        "generate",
        "--config",
        bad.to_str().unwrap(),
        "--prompt-tokens",
        "1",
        "--max-tokens",
        "1",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("bogus"), "{err}");
    let good = dir.join("good.toml");
    std::fs::write(&good, "[pool]\nn_blocks = 8\nblock_tokens = 2\n").unwrap();
    let (code, out, err) = tl(&[
        "generate",
        "--config",
        good.to_str().unwrap(),
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "3",
        "--seed",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"seed\":1"));
    assert_eq!(
        tl(&[
            "generate",
            "--prompt-tokens",
            "1",
            "--max-tokens",
            "1",
            "--temperature",
            "-1"
        ])
        .0,
        2
    );
    assert_eq!(
        tl(&["generate", "--prompt-tokens", "999", "--max-tokens", "1"]).0,
        1
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn demo_runs_and_every_request_matches() {
    let (code, out, err) = tl(&["demo"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("3 workers registered"), "{out}");
    assert!(
        out.contains("totals: 7 requests, 7 equal to colocated"),
        "{out}"
    );
    assert!(!out.contains(" NO"), "{out}");
    assert!(out.contains("prefix hit"), "{out}");
}

/// `tl demo --trace`: one request's spans from every part of the path, gathered by the demo's
/// own OTLP receiver, printed as a waterfall under the right processes.
#[test]
fn demo_trace_prints_the_waterfall() {
    let (code, out, err) = tl(&["demo", "--trace", "--max-tokens", "4"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let tail = &out[out
        .find("trace ")
        .unwrap_or_else(|| panic!("no waterfall: {out}"))..];
    let line = |name: &str| {
        tail.lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line in {tail}"))
            .to_owned()
    };
    assert!(line("POST /v1/completions [server]").contains(" gw "));
    assert!(line("route").contains(" gw "));
    assert!(line("EngineControl/Prefill [server]").contains(" prefill-0 "));
    assert!(line("engine.prefill").contains(" prefill-0 "));
    assert!(line("kv.transfer [client]").contains(" prefill-0 "));
    assert!(line("kv.transfer [server]").contains(" decode-"));
    assert!(line("EngineControl/Generate [server]").contains(" decode-"));
    assert!(line("engine.decode").contains(" decode-"));
    // Nesting: the decode side's transfer span sits deeper than the prefill side's.
    let indent = |l: String| l.len() - l.trim_start().len();
    assert!(indent(line("kv.transfer [server]")) > indent(line("kv.transfer [client]")));
    assert!(indent(line("engine.decode")) > indent(line("EngineControl/Generate [server]")));
    assert!(tail.contains('#'), "no bars: {tail}");
}

/// `tl generate --model DIR --prompt TEXT --chat` on a checkpoint `tl model init` wrote: the
/// prompt goes through the checkpoint's tokenizer and chat template, generation stops at its
/// EOS (the last token, left out of the text), and `--ignore-eos` goes on past it with the
/// same tokens up to there.
#[test]
fn generate_on_a_checkpoint_stops_at_eos_unless_ignored() {
    let dir = std::env::temp_dir().join(format!("tl-cli-ckpt-{}", std::process::id()));
    let (code, _, err) = tl(&["model", "init", "--dir", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    let run = |seed: u64, extra: &[&str]| -> serde_json::Value {
        let seed = seed.to_string();
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "Hi there",
            "--chat",
            "--max-tokens",
            "300",
            "--temperature",
            "1.0",
            "--seed",
            &seed,
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = tl(&args);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(out.trim()).unwrap()
    };
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    // The byte tokenizer's EOS is 257; one in ~260 tokens is it, so some seed stops early.
    let (seed, stopped) = (0..40)
        .map(|s| (s, run(s, &[])))
        .find(|(_, v)| ids(v).len() < 300)
        .expect("no seed of 40 met EOS in 300 tokens");
    let stopped_ids = ids(&stopped);
    assert_eq!(*stopped_ids.last().unwrap(), 257, "{stopped}");
    assert!(!stopped_ids[..stopped_ids.len() - 1].contains(&257));
    let text = stopped["text"].as_str().unwrap();
    assert!(!text.contains("<|im_end|>"), "{text}");
    let on = run(seed, &["--ignore-eos"]);
    let on_ids = ids(&on);
    assert_eq!(on_ids.len(), 300);
    assert_eq!(&on_ids[..stopped_ids.len()], &stopped_ids[..]);
    // A chat without a template (the fake model) is a usage error.
    let (code, _, err) = tl(&["generate", "--prompt", "x", "--chat", "--max-tokens", "1"]);
    assert_eq!(code, 2, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `tl bench ttft` times colocated, serial and pipelined once per round and reports each round's
/// ratio; the headline ratio is their median, and the first token matches colocated.
#[test]
fn ttft_bench_reports_one_ratio_per_round_and_their_median() {
    let (code, out, err) = tl(&[
        "bench",
        "ttft",
        "--json",
        "--blocks",
        "1",
        "--repeat",
        "3",
        "--single-pushes",
        "1",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let row = &v["rows"][0];
    assert_eq!(row["blocks"], 1);
    assert_eq!(row["first_token_equal"], true, "{row}");
    let mut rounds: Vec<f64> = row["ttft_ratio_rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_f64().unwrap())
        .collect();
    assert_eq!(rounds.len(), 3, "{row}");
    assert!(rounds.iter().all(|r| r.is_finite() && *r > 0.0), "{row}");
    rounds.sort_by(f64::total_cmp);
    assert_eq!(row["ttft_ratio"].as_f64().unwrap(), rounds[1], "{row}");
    for key in [
        "colocated_ttft_ms",
        "prefill_rpc_serial_ms",
        "prefill_rpc_pipelined_ms",
    ] {
        assert!(row[key].as_f64().unwrap() > 0.0, "{key}: {row}");
    }
}

/// More rounds than the prompt has distinct token shifts is refused before any engine starts.
#[test]
fn ttft_bench_refuses_more_rounds_than_distinct_prompts() {
    let (code, out, err) = tl(&["bench", "ttft", "--json", "--blocks", "1", "--repeat", "86"]);
    assert_ne!(code, 0, "{out}\n{err}");
    assert!(
        format!("{out}{err}").contains("at most 85 rounds"),
        "{out}\n{err}"
    );
}
