//! The drill across hosts of the project's own: each engine in a Linux network namespace on its
//! own address, the prefill engine reaching each decode engine over a veth link of their own.
//! Cutting that link mid-load cuts pushes in flight: both sides must free what they took, the
//! requests move to the other decode engine, and nothing is lost. Needs root and `ip netns`;
//! elsewhere the test says why it did not run.

mod common;

use std::process::Command;

use serde_json::Value;

/// Why namespaces cannot be made here, if they cannot.
fn unavailable() -> Option<String> {
    let probe = format!("tlprobe{}", std::process::id());
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Err(e) => Some(format!("`ip` cannot run: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "`ip netns add` fails: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(_) => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).status();
            None
        }
    }
}

fn args(fault: &str) -> [&str; 7] {
    [
        "--netns",
        "--clients",
        "4",
        "--seconds",
        "6",
        "--fault",
        fault,
    ]
}

#[test]
fn netns_partition_mid_push_frees_both_sides() {
    if let Some(why) = unavailable() {
        // Where namespaces cannot be made (not root, no `ip`), the drill refuses at once and
        // says why, with nothing left behind; the drill across hosts is `.ci/run`'s (root).
        eprintln!("netns_partition_mid_push_frees_both_sides: no namespaces here ({why})");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tl"))
            .arg("drill")
            .args(args("partition"))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "the drill ran without namespaces: {said}"
        );
        assert!(said.contains("network namespaces"), "{said}");
        return;
    }
    // The link between the prefill engine and one decode engine is cut at T/3, mended at 2T/3.
    let v = common::drill(&args("partition"));
    assert_eq!(v["mode"], "netns");
    assert_eq!(v["lost"], 0, "{v}");
    assert_eq!(v["failed"], 0, "{v}");
    assert_eq!(v["completed_equal"], v["requests"], "{v}");
    // Pushes toward the cut engine failed and their requests went to the other one; or, when
    // the cut fell between a push's writes and was mended within its deadline, the push waited
    // it out (TCP retransmits once the link is back): a request then took about the cut's
    // length, and still finished equal (asserted above). Seen once in CI: no retry, and the
    // cut's p99 TTFT 2,076 ms for a 2 s cut.
    let cut_ms = v["seconds"].as_f64().unwrap() * 1000.0 / 3.0;
    let retried = v["prefill_retried_on_another_decode"].as_u64().unwrap();
    let waited = v["p99_ttft_ms"]["during"].as_f64().unwrap() >= 0.9 * cut_ms;
    assert!(retried >= 1 || waited, "{v}");
    // Both sides of every cut push freed what they took.
    assert_eq!(v["prefill_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["restored_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["survivor_pool_back_to_baseline"], true, "{v}");
    // Only the KV path was cut: the engine kept beating and took traffic again.
    assert_eq!(v["evicted_after_ms"], Value::Null, "{v}");
    assert_eq!(v["rejoined"], true, "{v}");

    // The same hosts, a decode engine killed: its streams fail over. Run again if the kill
    // landed when no stream was on the victim (seen once in CI: 0 in flight, 0 failovers).
    let v = common::drill_with_streams_at_fault(&args("kill"));
    assert_eq!(v["lost"], 0, "{v}");
    assert_eq!(v["failed"], 0, "{v}");
    assert!(v["failovers"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(v["prefill_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["survivor_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["rejoined"], true, "{v}");
}
