//! A small run of every phase of the benchmark tool: it must finish, report
//! every phase and move every row. No timing is asserted.

use std::process::Command;

/// Runs the tool on a small table (5 000 rows × 4 features in 3
/// partitions, 3 ranks, batches of 512, one repetition, the server in
/// process) with `args` after it, in a folder of its own: its standard
/// output and its JSON.
fn bench(name: &str, args: &[&str]) -> (String, serde_json::Value) {
    let dir = std::env::temp_dir().join(format!("flightdeck-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json = dir.join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_flightdeck-bench"))
        .args([
            "--rows",
            "5000",
            "--features",
            "4",
            "--partitions",
            "3",
            "--ranks",
            "3",
            "--batch-rows",
            "512",
            "--reps",
            "1",
            "--in-process",
        ])
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run flightdeck-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
        .expect("valid json");
    std::fs::remove_dir_all(&dir).expect("clean up");
    (stdout, doc)
}

/// The result of `phase` for `target` in a run's JSON.
fn result<'a>(doc: &'a serde_json::Value, phase: &str, target: &str) -> &'a serde_json::Value {
    doc["results"]
        .as_array()
        .expect("results")
        .iter()
        .find(|r| r["phase"] == phase && r["target"] == target)
        .unwrap_or_else(|| panic!("no {phase} {target}: {doc}"))
}

#[test]
fn every_phase_runs_and_reports() {
    let (stdout, doc) = bench("smoke", &["--writers", "2", "--baseline", "parquet"]);
    for phase in [
        "limit/tcp",
        "limit/memcpy",
        "e2e",
        "put",
        "get/none",
        "get/global",
        "get/block",
    ] {
        assert!(stdout.contains(phase), "table lacks {phase}:\n{stdout}");
    }
    // Every rank read its equal share: ceil(5000 / 3) * 3 rows.
    assert_eq!(result(&doc, "get/global", "flightdeck")["rows"], 5001);
    assert_eq!(result(&doc, "e2e", "parquet")["rows"], 5000);
    assert_eq!(
        result(&doc, "put", "flightdeck")["payload_bytes"],
        5000 * (4 * 4 + 8)
    );
    assert!(doc["ratios"]["e2e_vs_parquet"].as_f64().is_some());
}

/// The in-process `gather` phase reads every rank's shard in each order it
/// is given, on one thread a batch and more: every rank its equal share;
/// the `small` phase's short reads each bring their rows.
#[test]
fn the_gather_and_small_phases_read_what_they_say() {
    let args = ["--phases", "gather,small", "--shuffle", "none,global"];
    let (_, doc) = bench("gather", &[&args[..], &["--baseline", ""]].concat());
    for order in ["none", "global"] {
        let phase = format!("gather/{order}/threads-1");
        // ceil(5000 / 3) * 3 rows: every rank its equal share.
        assert_eq!(result(&doc, &phase, "flightdeck")["rows"], 5001, "{phase}");
    }
    let phases = doc["results"].as_array().expect("results");
    assert!(
        !phases.iter().any(|r| r["phase"]
            .as_str()
            .is_some_and(|p| p.starts_with("gather/block"))),
        "an order not asked for was read"
    );
    let small = result(&doc, "small/global", "flightdeck");
    // 200 reads of 16 rows each.
    assert_eq!(small["rows"], 3200);
    assert!(small["latency_p50_ms"].as_f64().is_some_and(|ms| ms > 0.0));
}

/// `h2d` needs a GPU: where the driver is missing it says so and fails,
/// before starting anything (where there is one it measures); unknown
/// phases are named.
#[test]
fn h2d_without_a_driver_and_unknown_phases_fail_clearly() {
    let run = |phases: &str| {
        Command::new(env!("CARGO_BIN_EXE_flightdeck-bench"))
            .args([
                "--rows",
                "100",
                "--phases",
                phases,
                "--baseline",
                "",
                "--in-process",
            ])
            .output()
            .expect("run flightdeck-bench")
    };
    let out = run("h2d");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if flightdeck_server::memory::device::CudaHost::probe().is_some() {
        // A machine with a CUDA driver and a device: it must measure.
        assert!(out.status.success(), "{stderr}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("h2d/arena"));
    } else {
        assert!(!out.status.success());
        assert!(stderr.contains("h2d needs a CUDA driver"), "{stderr}");
    }
    let out = run("put,sideways");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown phase 'sideways'"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Counts of nothing are refused before anything starts, naming the flag
/// (0 rows crashed the pyarrow baseline's block shuffle half-way through).
#[test]
fn zero_counts_are_refused_naming_the_flag() {
    for flag in [
        "--rows",
        "--partitions",
        "--writers",
        "--ranks",
        "--batch-rows",
        "--reps",
        "--members",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_flightdeck-bench"))
            .args([flag, "0", "--baseline", "", "--in-process"])
            .output()
            .expect("run flightdeck-bench");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} 0 ran: {stderr}");
        assert!(
            stderr.contains(&format!("invalid value '0' for '{flag}")),
            "{flag}: {stderr}"
        );
    }
}
