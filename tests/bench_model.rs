//! `mmserve bench model` as a user runs it, on the CPU with the tiny LLaVA fixture.

use serde_json::Value;

/// `--repeats 0` (one run each, as the GPU profiling scripts ask) times that run instead
/// of taking the median of nothing, and every row comes out as JSON.
#[test]
fn bench_model_with_no_repeats_times_the_single_run() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["bench", "model", "--model", "assets/models/llava-tiny", "--device", "cpu", "--json"])
        .args(["--batches", "1", "--prompt", "8", "--output", "2", "--prefill", "16", "--images", "1"])
        .args(["--repeats", "0"])
        .env("MMSERVE_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench model failed: {stderr}");
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for key in ["prefill_tokens", "vision_batch"] {
        let row = rows.iter().find(|r| r.get(key).is_some()).unwrap_or_else(|| panic!("no {key} row: {rows:?}"));
        let secs = row["seconds"].as_f64().unwrap_or(f64::NAN);
        assert!(secs > 0.0, "{key}: {row}");
        assert!(row["host_issue_ms"].as_f64().is_some_and(|t| t > 0.0 && t <= secs * 1e3 + 1e-6), "{key}: {row}");
    }
    assert!(rows.iter().any(|r| r.get("decode_batch").is_some()), "no decode row: {rows:?}");
}
