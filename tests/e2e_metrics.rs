//! `/metrics` after a few requests through `mmserve serve`: every series
//! `docs/metrics.md` documents is there, with the `model_name` label, and the
//! per-request histograms count exactly the requests that finished.

mod common;

use common::*;
use serde_json::{Value, json};

/// The series names in docs/metrics.md's table.
fn documented() -> Vec<String> {
    let doc = std::fs::read_to_string(repo().join("docs/metrics.md")).unwrap();
    doc.lines().filter_map(|l| l.strip_prefix("| `")?.split_once('`').map(|(name, _)| name.to_string())).collect()
}

/// The value of `series` (a full sample name, labels as written by the exporter).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

fn png(seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(40, 30, |x, y| image::Rgb([(x * 5) as u8 ^ seed, (y * 7) as u8, seed]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

#[tokio::test]
async fn every_documented_series_is_exported_and_histograms_count_the_requests() {
    let server = Server::start(&[]);
    let (a, b) = (data_url(&png(1)), data_url(&png(2)));
    // Five requests of 8 tokens each: two distinct images, the first again (an embed-cache
    // hit and a prefix-cache hit), once streamed, and one with text only.
    for (url, stream) in [(&a, false), (&b, false), (&a, false), (&a, true)] {
        let r = server.http.post(format!("{}/v1/chat/completions", server.url)).json(&image_request(url, stream));
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        if !stream {
            let v: Value = serde_json::from_str(&text).unwrap();
            if url == &a && v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0 {
                // Only the repeat may have a prefix hit; it must have one.
                assert_eq!(server.metric("mmserve_embed_cache_hits_total").await, 1, "{v}");
            }
        }
    }
    let text_only = json!({"model": "llava-tiny", "messages": [{"role": "user", "content": "Hello"}],
                           "max_tokens": 8, "ignore_eos": true});
    let (status, v) = server.chat(&text_only).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v}");
    // A bad request: counted as failed, in no histogram.
    let (status, _) = server.post_raw("{not json").await;
    assert_eq!(status, 400);

    let text = server.http.get(format!("{}/metrics", server.url)).send().await.unwrap().text().await.unwrap();
    let label = "{model_name=\"llava-tiny\"}";
    let names = documented();
    assert!(names.len() > 40, "{names:?}");
    for name in names {
        let present = text.lines().any(|l| {
            l.strip_prefix(&name).is_some_and(|rest| {
                rest.starts_with('{') || rest.starts_with("_bucket{") || rest.starts_with("_count{")
            })
        });
        assert!(present, "{name} is documented but not exported:\n{text}");
    }
    let per_request = [
        ("mmserve_time_to_first_token_seconds", 5.0),
        ("mmserve_time_per_output_token_seconds", 5.0),
        ("mmserve_inter_token_latency_seconds", 5.0 * 7.0),
        ("mmserve_e2e_request_latency_seconds", 5.0),
        ("mmserve_request_queue_time_seconds", 5.0),
        ("mmserve_request_prefill_time_seconds", 5.0),
        ("mmserve_request_decode_time_seconds", 5.0),
        ("mmserve_request_inference_time_seconds", 5.0),
        ("mmserve_request_prompt_tokens", 5.0),
        ("mmserve_request_generation_tokens", 5.0),
        ("mmserve_request_cached_tokens", 5.0),
        // Two distinct images were encoded; the repeats were cache hits.
        ("mmserve_encoder_preprocess_seconds", 2.0),
        ("mmserve_encoder_tower_seconds", 2.0),
    ];
    for (name, want) in per_request {
        assert_eq!(sample(&text, &format!("{name}_count{label}")), Some(want), "{name}:\n{text}");
    }
    assert_eq!(sample(&text, &format!("mmserve_request_generation_tokens_sum{label}")), Some(40.0));
    assert_eq!(
        sample(&text, "mmserve_request_success_total{model_name=\"llava-tiny\",finished_reason=\"length\"}"),
        Some(5.0),
        "{text}"
    );
    assert_eq!(sample(&text, &format!("mmserve_requests_total{label}")), Some(6.0));
    assert_eq!(sample(&text, &format!("mmserve_requests_failed_total{label}")), Some(1.0));
    assert_eq!(sample(&text, &format!("mmserve_generation_tokens_total{label}")), Some(40.0));
    let usage = sample(&text, &format!("mmserve_kv_cache_usage_perc{label}")).unwrap();
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert!(text.contains("mmserve_cache_config_info{model_name=\"llava-tiny\",block_size=\""), "{text}");
    server.stop();
}

/// Request ids and logs: `x-request-id` echoes the client's id (else the completion id),
/// error bodies carry it, one JSON access-log line per request names it with its counts,
/// the encoder's log line about a request's failure names it too, and a clean shutdown
/// logs no error.
#[tokio::test]
async fn request_ids_reach_responses_errors_and_every_services_logs() {
    let dir = tempfile_dir("request-ids");
    let log_path = dir.join("stderr.jsonl");
    let log = std::fs::File::create(&log_path).unwrap();
    let env = [("MMSERVE_LOG", "info"), ("MMSERVE_LOG_FORMAT", "json")];
    let server = Server::start_with(&llava_dir(), &[], &env, log.into());
    let url = format!("{}/v1/chat/completions", server.url);
    let body = image_request(&data_url(&fixture_png()), false);

    let r = server.http.post(&url).header("x-request-id", "client-id-7").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "client-id-7");
    let v: Value = r.json().await.unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");

    let r = server.http.post(&url).json(&body).send().await.unwrap();
    let header = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["id"], header.as_str(), "without a client id, the completion id");

    // A 400 from the api, and one from the encoder (a PNG whose header is fine and whose
    // data is not): both bodies name the request.
    let mut bad = body.clone();
    bad["temperature"] = json!(-1);
    let r = server.http.post(&url).header("x-request-id", "bad-param-1").json(&bad).send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["request_id"], "bad-param-1");
    let mut png = fixture_png();
    let keep = png.len() / 3;
    png.truncate(keep);
    let truncated = image_request(&data_url(&png), false);
    let r = server.http.post(&url).header("x-request-id", "bad-image-2").json(&truncated).send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["request_id"], "bad-image-2");
    // Unknown routes too.
    let r = server.http.get(format!("{}/v1/nothing", server.url)).header("x-request-id", "nowhere").send().await;
    let r = r.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["x-request-id"], "nowhere");
    server.stop();

    let lines: Vec<Value> = std::fs::read_to_string(&log_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}")))
        .collect();
    let access = |id: &str| {
        lines
            .iter()
            .find(|l| l["target"] == "mmserve::access" && l["fields"]["id"] == id)
            .unwrap_or_else(|| panic!("no access line for {id} in {lines:#?}"))
    };
    let ok = &access("client-id-7")["fields"];
    assert_eq!(ok["status"], 200, "{ok}");
    assert_eq!(ok["completion_tokens"], 8, "{ok}");
    assert_eq!(ok["image_tokens"], 16, "{ok}");
    assert_eq!(ok["prompt_tokens"], 45, "{ok}");
    assert_eq!(ok["finish_reason"], "length", "{ok}");
    assert_eq!(ok["embed_misses"], 1, "{ok}");
    assert!(ok["ttft_ms"].as_f64().unwrap() <= ok["latency_ms"].as_f64().unwrap(), "{ok}");
    assert!(ok["client"].as_str().unwrap().starts_with("127.0.0.1:"), "{ok}");
    assert_eq!(access(&header)["fields"]["embed_hits"], 1);
    assert_eq!(access("bad-param-1")["fields"]["status"], 400);
    // The encoder's own line about the failed item names the request.
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["request_id"] == "bad-image-2" && l["target"].as_str().unwrap().contains("encoder")),
        "{lines:#?}"
    );
    let errors: Vec<&Value> = lines.iter().filter(|l| l["level"] == "ERROR").collect();
    assert!(errors.is_empty(), "errors logged: {errors:#?}");
}

fn tempfile_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mmserve-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
