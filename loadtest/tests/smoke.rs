//! The load tool itself, end to end on small batches: it starts its own nats-server and
//! database, runs the crew, and its one JSON line accounts for every incident.

use std::process::Command;

/// Run the tool with `args` and parse the JSON line it prints.
fn run(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_pitcrew-loadtest"))
        .args(args)
        .args(["--timeout", "120"])
        .output()
        .expect("the load tool starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "pitcrew-loadtest {args:?} failed: {stderr}");
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("not one JSON line ({e}): {line}\n{stderr}"))
}

/// Every incident ended once, as its scenario dictates, and each stage of the resolving
/// path has one latency per run that passed it.
fn accounts_for(report: &serde_json::Value, incidents: u64, resolved: u64) {
    assert_eq!(report["completed"], incidents, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    assert_eq!(report["outcomes"]["resolved"], resolved, "{report}");
    assert_eq!(report["outcomes"]["escalated"], incidents - resolved, "{report}");
    assert_eq!(report["e2e_ms"]["n"], incidents, "{report}");
    for stage in ["intake", "diagnose", "plan", "evaluate"] {
        assert_eq!(report["stage_ms"][stage]["n"], incidents, "{stage}: {report}");
    }
    for stage in ["approval", "execute", "verify"] {
        assert_eq!(report["stage_ms"][stage]["n"], resolved, "{stage}: {report}");
    }
    assert!(report["completed_per_second"].as_f64().unwrap_or(0.0) > 0.0, "{report}");
}

#[test]
fn runs_kept_in_flight_with_http_checks_all_end_and_are_counted() {
    let report = run(&["--incidents", "20", "--in-flight", "4", "--check", "http", "--no-evidence"]);
    accounts_for(&report, 20, 16);
    assert_eq!(report["check"], "http");
    assert_eq!(report["in_flight"], 4);
    assert!(report["steady_per_second"].as_f64().unwrap_or(0.0) > 0.0, "{report}");
    assert!(report["llm_bound"].is_null(), "no model, no bound: {report}");
}

#[test]
fn a_simulated_model_is_called_twice_a_run() {
    let report = run(&["--incidents", "10", "--llm-latency-ms", "50"]);
    accounts_for(&report, 10, 8);
    // Diagnosis and plan, once each a run: the refused plans escalate without a retry.
    assert_eq!(report["llm_calls"], 20, "{report}");
    assert_eq!(report["evidence_commands"], false, "{report}");
    // Ten runs at once, 2 x 50 ms of model time each: at most 100 runs a second.
    let bound = &report["llm_bound"];
    assert_eq!(bound["in_flight"], 10, "{report}");
    assert_eq!(bound["model_seconds_per_run"], 0.1, "{report}");
    assert_eq!(bound["per_second"], 100.0, "{report}");
    let reached = bound["reached"].as_f64().unwrap_or(0.0);
    let expected = report["completed_per_second"].as_f64().unwrap_or(0.0) / 100.0;
    assert!((reached - expected).abs() < 0.002 && reached > 0.0, "{report}");
}
