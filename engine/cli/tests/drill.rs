//! `tl drill` as processes: a gateway, one prefill and two decode engines under streaming load,
//! one decode engine killed (or hung) at T/3 and back at 2T/3. Nothing may be lost or failed,
//! every request's tokens equal a colocated run, and both pools go back to baseline.

mod common;

use serde_json::Value;

fn args(fault: &str) -> [&str; 8] {
    [
        "--clients",
        "4",
        "--seconds",
        "6",
        "--fault",
        fault,
        "--stall-ms",
        "800",
    ]
}

fn drill(fault: &str) -> Value {
    let v = common::drill(&args(fault));
    assert_eq!(v["mode"], "processes");
    v
}

/// Run again while the fault moved no stream (see the helper).
fn drill_with_streams_at_fault(fault: &str) -> Value {
    let v = common::drill_with_streams_at_fault(&args(fault));
    assert_eq!(v["mode"], "processes");
    v
}

fn check(v: &Value) {
    assert!(v["requests"].as_u64().unwrap() > 20, "{v}");
    assert_eq!(v["lost"], 0, "{v}");
    assert_eq!(v["failed"], 0, "{v}");
    assert_eq!(v["completed_equal"], v["requests"], "{v}");
    assert_eq!(v["prefill_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["survivor_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["rejoined"], true, "{v}");
    // The victim was chosen with streams in flight: they failed over.
    assert!(v["failovers"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(v["failovers_gave_up"], 0, "{v}");
    // Evicted after 3 missed beats: between 2 and 4 intervals after the fault (the last beat
    // was up to one interval before it).
    let beats = v["evicted_within_beats"].as_f64().unwrap();
    assert!((1.9..=4.5).contains(&beats), "{v}");
}

#[test]
fn drill_kill_decode_loses_nothing() {
    let v = drill_with_streams_at_fault("kill");
    check(&v);
    assert_eq!(v["fault"], "kill");
}

#[test]
fn stalled_decode_engine_fails_over() {
    let v = drill_with_streams_at_fault("sigstop");
    check(&v);
    // The hung engine's streams waited out the stall timeout before they moved.
    let gap = v["p50_max_gap_ms_in_flight_at_fault"].as_f64().unwrap();
    assert!(gap >= 800.0, "{v}");
}

#[test]
fn registry_restart_reregisters_and_frees_what_was_in_flight() {
    let v = drill("registry-restart");
    assert_eq!(v["lost"], 0, "{v}");
    // Only the clients connected to the killed gateway saw an error (their connection cut).
    for (cause, _) in v["failed_by_cause"].as_object().unwrap() {
        assert_eq!(cause, "gateway_restarted", "{v}");
    }
    assert!(v["completed_equal"].as_u64().unwrap() > 20, "{v}");
    // The engines beat to the new registry within 2 intervals.
    let beats = v["reregistered_within_beats"].as_f64().unwrap();
    assert!(beats <= 2.0, "{v}");
    // What the killed gateway had in flight on the engines was freed: streams cancelled when
    // their connection dropped, unclaimed handles by their lease.
    assert_eq!(v["prefill_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["survivor_pool_back_to_baseline"], true, "{v}");
    assert_eq!(v["restored_pool_back_to_baseline"], true, "{v}");
}

/// `tl drill --gateways 2`: two gateways over the registry on etcd, as processes.
fn fleet_drill(fault: &str) -> Value {
    common::etcd_installed();
    let v = common::drill(&[
        "--gateways",
        "2",
        "--clients",
        "4",
        "--seconds",
        "6",
        "--max-tokens",
        "48",
        "--fault",
        fault,
        "--stall-ms",
        "800",
    ]);
    assert_eq!(
        (v["drill"].as_str(), v["gateways"].as_u64()),
        (Some("gateways"), Some(2))
    );
    assert!(v["requests"].as_u64().unwrap() > 20, "{v}");
    assert!(v["non_streamed"].as_u64().unwrap() > 0, "{v}");
    for k in ["failed", "lost", "streams_cut_on_other_gateways"] {
        assert_eq!(v[k], 0, "{k}: {v}");
    }
    for id in ["P", "D1", "D2"] {
        assert_eq!(v["pools_back_to_baseline"][id], true, "{v}");
    }
    assert!(
        v["etcd_lists_every_engine_after_restore_ms"].is_number(),
        "{v}"
    );
    v
}

#[test]
fn killing_one_of_two_gateways_cuts_only_its_own_streams() {
    let v = fleet_drill("gateway-kill");
    // Every request that reached the other gateway completed; a cut stream was in flight on
    // the killed one when it died.
    assert_eq!(v["streams_cut_not_in_flight_at_fault"], 0, "{v}");
    let cut = v["streams_cut_on_killed_gateway"].as_u64().unwrap();
    let equal = v["completed_equal"].as_u64().unwrap();
    assert_eq!(equal + cut, v["requests"].as_u64().unwrap(), "{v}");
}

#[test]
fn etcd_down_leaves_the_gateways_routing_on_their_snapshot() {
    let v = fleet_drill("etcd-down");
    assert_eq!(v["survivors_listed_every_engine_throughout"], true, "{v}");
    assert_eq!(v["completed_equal"], v["requests"], "{v}");
}
