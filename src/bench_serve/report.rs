//! A run's figures as `vllm bench serve` computes, prints and saves them: the same JSON
//! field names (`completed`, `request_throughput`, `mean_ttft_ms`, `p99_tpot_ms`, `ttfts`,
//! `itls`, …), so scripts written for vLLM's results read ours.

use serde_json::{Map, Value, json};

use super::client::Outcome;

/// The four latency metrics, as vLLM names them.
pub const METRICS: [&str; 4] = ["ttft", "tpot", "itl", "e2el"];

/// The `p`-th percentile of `xs` by linear interpolation between closest ranks (numpy's
/// default, as vLLM computes it); NaN for none.
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (p / 100.0).clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() { f64::NAN } else { xs.iter().sum::<f64>() / xs.len() as f64 }
}

fn std(xs: &[f64]) -> f64 {
    let m = mean(xs);
    if xs.is_empty() { f64::NAN } else { (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / xs.len() as f64).sqrt() }
}

/// vLLM's key for a percentile: `p99`, `p99.9`.
pub fn pkey(p: f64) -> String {
    if p.fract() == 0.0 { format!("p{}", p as u64) } else { format!("p{p}") }
}

/// Each metric's samples in seconds over the successful requests: TTFT and latency per
/// request, TPOT per request of more than one token, every ITL gap.
pub fn samples(outcomes: &[Outcome]) -> [Vec<f64>; 4] {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let ttft = ok.iter().map(|o| o.ttft).collect();
    let tpot = ok.iter().filter_map(|o| o.tpot()).collect();
    let itl = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let e2el = ok.iter().map(|o| o.latency).collect();
    [ttft, tpot, itl, e2el]
}

/// Whether a successful request met every `metric:ms` limit (vLLM's goodput: its TTFT,
/// its own TPOT, its latency).
pub fn meets(o: &Outcome, limits: &[(String, f64)]) -> bool {
    let tpot = o.tpot().unwrap_or(0.0);
    o.ok()
        && limits.iter().all(|(k, ms)| {
            let v = match k.as_str() {
                "ttft" => o.ttft,
                "tpot" => tpot,
                _ => o.latency,
            };
            v * 1e3 <= *ms
        })
}

/// The figures of a run of `duration` seconds, with the per-request lists.
pub fn summarize(outcomes: &[Outcome], duration: f64, percentiles: &[f64]) -> Map<String, Value> {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let input: u64 = ok.iter().map(|o| o.input_len).sum();
    let output: u64 = ok.iter().map(|o| o.output_len).sum();
    let mut m = Map::new();
    let put = |m: &mut Map<String, Value>, k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put(&mut m, "duration", json!(duration));
    put(&mut m, "completed", json!(ok.len()));
    put(&mut m, "failed", json!(outcomes.len() - ok.len()));
    put(&mut m, "total_input_tokens", json!(input));
    put(&mut m, "total_output_tokens", json!(output));
    put(&mut m, "request_throughput", json!(ok.len() as f64 / duration));
    put(&mut m, "output_throughput", json!(output as f64 / duration));
    put(&mut m, "total_token_throughput", json!((input + output) as f64 / duration));
    for (name, xs) in METRICS.iter().zip(samples(outcomes)) {
        let ms: Vec<f64> = xs.iter().map(|x| x * 1e3).collect();
        put(&mut m, &format!("mean_{name}_ms"), json!(finite(mean(&ms))));
        put(&mut m, &format!("median_{name}_ms"), json!(finite(percentile(&ms, 50.0))));
        put(&mut m, &format!("std_{name}_ms"), json!(finite(std(&ms))));
        for &p in percentiles {
            put(&mut m, &format!("{}_{name}_ms", pkey(p)), json!(finite(percentile(&ms, p))));
        }
    }
    put(&mut m, "input_lens", json!(outcomes.iter().map(|o| o.input_len).collect::<Vec<_>>()));
    put(&mut m, "output_lens", json!(outcomes.iter().map(|o| o.output_len).collect::<Vec<_>>()));
    put(&mut m, "ttfts", json!(outcomes.iter().map(|o| o.ttft).collect::<Vec<_>>()));
    put(&mut m, "itls", json!(outcomes.iter().map(|o| o.itl.clone()).collect::<Vec<_>>()));
    put(&mut m, "e2els", json!(outcomes.iter().map(|o| o.latency).collect::<Vec<_>>()));
    put(&mut m, "generated_texts", json!(outcomes.iter().map(|o| o.text.clone()).collect::<Vec<_>>()));
    put(&mut m, "errors", json!(outcomes.iter().map(|o| o.error.clone()).collect::<Vec<_>>()));
    m
}

/// JSON has no NaN: a metric without samples is null.
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// The result as vLLM prints it.
pub fn print(m: &Map<String, Value>, percentiles: &[f64], max_concurrency: Option<usize>) {
    let f = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let line = |label: &str, v: String| println!("{label:<40}{v:<10}");
    println!("{:=^50}", " Serving Benchmark Result ");
    line("Successful requests:", format!("{}", f("completed")));
    line("Failed requests:", format!("{}", f("failed")));
    if let Some(c) = max_concurrency {
        line("Maximum request concurrency:", c.to_string());
    }
    line("Benchmark duration (s):", format!("{:.2}", f("duration")));
    line("Total input tokens:", format!("{}", f("total_input_tokens")));
    line("Total generated tokens:", format!("{}", f("total_output_tokens")));
    line("Request throughput (req/s):", format!("{:.2}", f("request_throughput")));
    if m.contains_key("request_goodput") {
        line("Request goodput (req/s):", format!("{:.2}", f("request_goodput")));
    }
    line("Output token throughput (tok/s):", format!("{:.2}", f("output_throughput")));
    line("Total token throughput (tok/s):", format!("{:.2}", f("total_token_throughput")));
    for (name, title) in METRICS.iter().zip([
        "Time to First Token",
        "Time per Output Token (excl. 1st token)",
        "Inter-token Latency",
        "End-to-end Latency",
    ]) {
        println!("{:-^50}", format!(" {title} "));
        let up = name.to_uppercase();
        line(&format!("Mean {up} (ms):"), format!("{:.2}", f(&format!("mean_{name}_ms"))));
        line(&format!("Median {up} (ms):"), format!("{:.2}", f(&format!("median_{name}_ms"))));
        for &p in percentiles {
            let k = pkey(p);
            line(&format!("P{} {up} (ms):", &k[1..]), format!("{:.2}", f(&format!("{k}_{name}_ms"))));
        }
    }
    println!("{}", "=".repeat(50));
    if let Some(errors) = m.get("errors").and_then(Value::as_array) {
        let failed: Vec<&str> = errors.iter().filter_map(Value::as_str).filter(|e| !e.is_empty()).collect();
        for e in failed.iter().take(3) {
            println!("failure: {e}");
        }
        if failed.len() > 3 {
            println!("… and {} more failures", failed.len() - 3);
        }
    }
}

/// The figures `bench compare` sets side by side.
const COMPARED: &[&str] = &[
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
];

/// Two saved results side by side, with B's value over A's.
pub fn compare(a: &Value, b: &Value) -> String {
    let mut out = String::new();
    let label = |v: &Value| {
        let model = v["model_id"].as_str().unwrap_or("?");
        let url = v["base_url"].as_str().unwrap_or("?");
        format!("{model} at {url}")
    };
    out.push_str(&format!("A: {}\nB: {}\n", label(a), label(b)));
    out.push_str(&format!("{:<26}{:>14}{:>14}{:>10}\n", "", "A", "B", "B/A"));
    for k in COMPARED {
        let (x, y) = (a[*k].as_f64(), b[*k].as_f64());
        let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        let ratio = match (x, y) {
            (Some(x), Some(y)) if x != 0.0 => format!("{:.3}", y / x),
            _ => "-".into(),
        };
        out.push_str(&format!("{k:<26}{:>14}{:>14}{ratio:>10}\n", show(x), show(y)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_as_numpy_does() {
        let xs = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&xs, 50.0), 2.5);
        assert_eq!(percentile(&xs, 0.0), 1.0);
        assert_eq!(percentile(&xs, 100.0), 4.0);
        assert!((percentile(&xs, 99.0) - 3.97).abs() < 1e-12);
        assert!(percentile(&[], 50.0).is_nan());
        assert_eq!((pkey(99.0), pkey(99.9)), ("p99".to_string(), "p99.9".to_string()));
    }

    #[test]
    fn the_summary_counts_what_succeeded() {
        let ok = |ttft: f64, latency: f64, n: u64| Outcome {
            ttft,
            latency,
            output_len: n,
            input_len: 10,
            itl: vec![(latency - ttft) / (n - 1) as f64; n as usize - 1],
            ..Default::default()
        };
        let failed = Outcome { error: "HTTP 500: boom".into(), ..Default::default() };
        let m = summarize(&[ok(0.1, 0.5, 5), ok(0.3, 0.7, 3), failed], 2.0, &[99.0]);
        assert_eq!((m["completed"].as_u64(), m["failed"].as_u64()), (Some(2), Some(1)));
        assert_eq!(m["total_output_tokens"], 8);
        assert!((m["request_throughput"].as_f64().unwrap() - 1.0).abs() < 1e-12);
        assert!((m["mean_ttft_ms"].as_f64().unwrap() - 200.0).abs() < 1e-9);
        assert!((m["mean_tpot_ms"].as_f64().unwrap() - 150.0).abs() < 1e-9, "100 and 200 ms");
        assert_eq!(m["errors"][2], "HTTP 500: boom");
        let limits = [("ttft".to_string(), 150.0), ("tpot".to_string(), 150.0)];
        let (a, b) = (ok(0.1, 0.5, 5), ok(0.3, 0.7, 3));
        assert!(meets(&a, &limits) && !meets(&b, &limits), "TPOT 100 ms passes, TTFT 300 ms fails");
        let c = compare(&json!({"request_throughput": 2.0}), &json!({"request_throughput": 3.0}));
        assert!(c.contains("1.500"), "{c}");
    }
}
