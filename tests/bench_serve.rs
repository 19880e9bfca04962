//! `mmserve bench serve` against a real `mmserve serve` with the tiny LLaVA: a short run at
//! a fixed rate accounts for every request, saves vLLM's fields with percentiles that
//! match its own per-request timings, and sends the same load for the same seed; failures
//! are counted and reported, not hidden; sweeps and `bench compare` work.

mod common;

use std::process::Command;

use common::cache::temp_dir;
use common::*;
use serde_json::Value;

fn bench(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["bench", "serve", "--disable-tqdm", "--ignore-eos"])
        .args(args)
        .env("MMSERVE_LOG", "warn")
        .output()
        .expect("running mmserve bench serve");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn read(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// numpy's percentile, written again for the test.
fn percentile(xs: &[f64], p: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = p / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn a_run_accounts_for_every_request_and_saves_vllms_fields() {
    let dir = temp_dir("bench-serve");
    let (a, b) = (dir.join("a.json"), dir.join("b.json"));
    let model = llava_dir();
    let run = |out: &std::path::Path| {
        let (ok, text) = bench(&[
            "--serve-model",
            model.to_str().unwrap(),
            "--dataset-name",
            "random-mm",
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--random-mm-base-items-per-request",
            "2",
            "--random-mm-bucket-config",
            "{(64, 96, 1): 0.5, (336, 336, 1): 0.5}",
            "--num-prompts",
            "12",
            "--request-rate",
            "40",
            "--num-warmups",
            "2",
            "--seed",
            "5",
            "--metric-percentiles",
            "50,99",
            "--save-result",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{text}");
        assert!(text.contains("Serving Benchmark Result") && text.contains("P99 TTFT (ms):"), "{text}");
        read(out)
    };
    let r = run(&a);
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(12), Some(0)), "{r}");
    for key in [
        "date",
        "backend",
        "model_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "total_input_tokens",
        "total_output_tokens",
        "dataset_digest",
        "server",
    ] {
        assert!(r.get(key).is_some(), "no {key} in {r}");
    }
    assert_eq!(r["model_id"], "llava-tiny");
    assert_eq!(r["server"]["models"]["data"][0]["id"], "llava-tiny");
    for list in ["ttfts", "itls", "input_lens", "output_lens", "e2els", "errors", "generated_texts"] {
        assert_eq!(r[list].as_array().map(Vec::len), Some(12), "{list}");
    }
    assert!(r["output_lens"].as_array().unwrap().iter().all(|n| n == 6), "ignore_eos: 6 each");
    assert_eq!(r["total_output_tokens"], 72);
    // The saved percentiles are those of the saved timings.
    let ttfts: Vec<f64> = floats(&r["ttfts"]).iter().map(|t| t * 1e3).collect();
    for (key, p) in [("median_ttft_ms", 50.0), ("p50_ttft_ms", 50.0), ("p99_ttft_ms", 99.0)] {
        let got = r[key].as_f64().unwrap();
        assert!((got - percentile(&ttfts, p)).abs() < 1e-9, "{key}: {got}");
    }
    let mean = ttfts.iter().sum::<f64>() / 12.0;
    assert!((r["mean_ttft_ms"].as_f64().unwrap() - mean).abs() < 1e-9);
    let tpots: Vec<f64> = (0..12).map(|i| (floats(&r["e2els"])[i] - floats(&r["ttfts"])[i]) / 5.0 * 1e3).collect();
    assert!((r["p99_tpot_ms"].as_f64().unwrap() - percentile(&tpots, 99.0)).abs() < 1e-9);
    let itls: Vec<f64> = r["itls"].as_array().unwrap().iter().flat_map(floats).map(|t| t * 1e3).collect();
    assert!((r["median_itl_ms"].as_f64().unwrap() - percentile(&itls, 50.0)).abs() < 1e-9);
    // The same seed, the same load: the same requests, so the same prompt token counts.
    let again = run(&b);
    assert_eq!(again["dataset_digest"], r["dataset_digest"]);
    assert_eq!(again["input_lens"], r["input_lens"]);
    // Two results side by side.
    let out = Command::new(env!("CARGO_BIN_EXE_mmserve")).args(["bench", "compare"]).args([&a, &b]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("request_throughput") && text.contains("B/A"), "{text}");
}

#[tokio::test]
async fn failures_are_counted_and_sweeps_find_the_rate() {
    let server = Server::start(&[]);
    let dir = temp_dir("bench-serve-fail");
    let out = dir.join("fail.json");
    // A model the server does not serve: every request fails, and the run says so.
    let (ok, text) = bench(&[
        "--base-url",
        &server.url,
        "--model",
        "no-such-model",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--num-prompts",
        "5",
        "--save-result",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("Failed requests:                        5") && text.contains("failure: HTTP 404"), "{text}");
    let r = read(&out);
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(0), Some(5)));
    assert!(r["errors"].as_array().unwrap().iter().all(|e| e.as_str().unwrap().starts_with("HTTP 404")), "{r}");
    assert!(r["mean_ttft_ms"].is_null(), "no successful request, no figure");

    // A sweep of two rates on the completions endpoint, with an SLO every rate meets.
    let sweep = dir.join("sweep.json");
    let (ok, text) = bench(&[
        "--base-url",
        &format!("{}/v1", server.url),
        "--endpoint",
        "completions",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--num-prompts",
        "6",
        "--sweep",
        "20,40",
        "--max-concurrency",
        "2",
        "--slo",
        "ttft_p99=60000,tpot_p99=60000",
        "--goodput",
        "ttft:60000",
        "e2el:0.000001",
        "--save-result",
        sweep.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("highest rate meeting the SLO: 40 requests/s"), "{text}");
    let runs = read(&sweep);
    let runs = runs.as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r["completed"] == 6 && r["slo_met"] == true && r["backend"] == "openai"), "{runs:?}");
    // No request finishes within a nanosecond: goodput 0 (and it is reported).
    assert!(runs.iter().all(|r| r["request_goodput"] == 0.0), "{runs:?}");
    assert!(text.contains("Request goodput (req/s):"), "{text}");
    // Bad flags are refused before anything is sent.
    let (ok, text) = bench(&["--base-url", &server.url, "--slo", "latency_p99=5"]);
    assert!(!ok && text.contains("--slo"), "{text}");
    server.stop();
}
