//! End to end through real processes: `mmserve serve` with the tiny LLaVA fixture.

mod common;

use common::*;
use futures::StreamExt;
use serde_json::{Value, json};

/// Reads an SSE response: the `data:` payloads in order.
async fn sse(server: &Server, body: &Value) -> Vec<String> {
    let r = server.http.post(format!("{}/v1/chat/completions", server.url)).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    text.split("\n\n").filter_map(|f| f.strip_prefix("data: ")).map(str::to_string).collect()
}

#[tokio::test]
async fn greedy_tokens_match_transformers_streamed_and_not() {
    let reference = reference();
    let want_ids = ids(&reference["generated_ids"]);
    let want_text = reference["generated_text"].as_str().unwrap();
    let server = Server::start(&[]);
    let url = data_url(&fixture_png());

    let (status, body) = server.chat(&image_request(&url, false)).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["content"], want_text);
    assert_eq!(ids(&choice["token_ids"]), want_ids);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(body["usage"]["prompt_tokens"], 45);
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_eq!(body["usage"]["prompt_tokens_details"]["image_tokens"], 16);
    // The expanded prompt: the fixture's ids with the 16 image positions virtual.
    let prompt = ids(&body["prompt_token_ids"]);
    let expanded = ids(&reference["input_ids"]);
    assert_eq!(prompt.len(), expanded.len());
    for (got, want) in prompt.iter().zip(&expanded) {
        if *want == 1000 {
            assert!(*got >= 1 << 32, "image position holds a virtual id");
        } else {
            assert_eq!(got, want);
        }
    }

    let mut req = image_request(&url, true);
    req["stream_options"] = json!({"include_usage": true});
    let frames = sse(&server, &req).await;
    assert_eq!(frames.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = frames[..frames.len() - 1].iter().map(|f| serde_json::from_str(f).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, want_text);
    let streamed_ids: Vec<u64> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["token_ids"].as_array())
        .flatten()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(streamed_ids, want_ids);
    let finish: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, vec![&json!("length")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 8);

    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();
}

/// A second image: the fixture with its colours inverted.
fn inverted_png() -> Vec<u8> {
    let mut img = image::load_from_memory(&fixture_png()).unwrap().to_rgb8();
    img.pixels_mut().for_each(|p| p.0 = p.0.map(|c| 255 - c));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

async fn answer(server: &Server, url: &str) -> Vec<u64> {
    let (status, body) = server.chat(&image_request(url, false)).await;
    assert_eq!(status, 200, "{body}");
    ids(&body["choices"][0]["token_ids"])
}

#[tokio::test]
async fn repeated_image_is_encoded_once_and_concurrent_images_stay_apart() {
    let want = ids(&reference()["generated_ids"]);
    let (a, b) = (data_url(&fixture_png()), data_url(&inverted_png()));

    // Two different images at once: each gets its own embedding.
    let server = Server::start(&[]);
    let (got_a, got_b) = tokio::join!(answer(&server, &a), answer(&server, &b));
    assert_eq!(got_a, want);
    assert_ne!(got_a, got_b, "the two images must not share an embedding");
    assert_eq!(server.metric("mmserve_encoder_items_total").await, 2);

    // The same image again: a cache hit, not encoded again, same answer.
    assert_eq!(answer(&server, &a).await, want);
    assert_eq!(server.metric("mmserve_encoder_items_total").await, 2);
    assert_eq!(server.metric("mmserve_embed_cache_hits_total").await, 1);
    assert_eq!(server.metric("mmserve_embed_cache_misses_total").await, 2);
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();

    // What the second image gets alone, on a fresh server.
    let alone = Server::start(&[]);
    assert_eq!(answer(&alone, &b).await, got_b);
    alone.stop();
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_leaves_nothing_held() {
    let server = Server::start(&[]);
    let mut req = image_request(&data_url(&fixture_png()), true);
    req["max_tokens"] = json!(400);
    let r = server.http.post(format!("{}/v1/chat/completions", server.url)).json(&req).send().await.unwrap();
    let mut body = r.bytes_stream();
    // Wait until tokens flow, then hang up.
    let mut seen = String::new();
    while !seen.contains("\"content\":\"ame\"") {
        seen.push_str(&String::from_utf8_lossy(&body.next().await.unwrap().unwrap()));
    }
    assert_eq!(server.metric("mmserve_embed_cache_references").await, 1, "held while streaming");
    drop(body);
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    assert_eq!(server.metric_becomes("mmserve_num_requests_running", 0).await, 0, "the engine aborted it");
    assert!(server.metric("mmserve_generation_tokens_total").await < 400);
    server.stop();
}

#[tokio::test]
async fn malformed_requests_get_400_and_the_server_keeps_serving() {
    let server = Server::start(&[]);
    let png = data_url(&fixture_png());
    let text = |t: &str| json!({"type": "text", "text": t});
    let bad: Vec<(&str, Value)> = vec![
        ("empty messages", json!({"messages": []})),
        (
            "invalid base64",
            json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%notbase64"}}, text("hi")]}]}),
        ),
        (
            "undecodable image",
            json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}, text("hi")]}]}),
        ),
        ("wrong part type", json!({"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]})),
        (
            "audio to an image model",
            json!({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
        ),
        (
            "remote URL",
            json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]}]}),
        ),
        ("bad role", json!({"messages": [{"role": "wizard", "content": "hi"}]})),
        ("max_tokens too large", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000})),
        ("temperature out of range", json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 9})),
        // A good image plus a bad one: the good one must not stay referenced.
        (
            "one bad image of two",
            json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}]}]}),
        ),
    ];
    for (what, body) in &bad {
        let (status, err) = server.chat(body).await;
        assert_eq!(status, 400, "{what}: {err}");
        let e = &err["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {err}");
        assert_eq!(e["type"], "invalid_request_error", "{what}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{what}: {err}");
    }
    let (status, err) = server.post_raw("{\"messages\": [").await;
    assert_eq!(status, 400, "malformed JSON: {err}");
    let (status, err) = server.chat(&json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 404, "{err}");

    assert_eq!(server.metric("mmserve_embed_cache_references").await, 0);
    let (status, body) = server.chat(&image_request(&png, false)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body["choices"][0]["token_ids"]), ids(&reference()["generated_ids"]));
    server.stop();
}

#[tokio::test]
async fn health_and_models() {
    let server = Server::start(&[]);
    let r = server.http.get(format!("{}/health", server.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let models: Value =
        server.http.get(format!("{}/v1/models", server.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "llava-tiny");
    server.stop();
}

#[tokio::test]
async fn cache_limits_reach_the_client_as_400_and_503_with_a_shared_cache() {
    // A standalone cache with room for exactly one image (16 slots of 64 f32), shared by
    // the server and by this test, which fills it.
    let dir = common::cache::temp_dir("e2e-shared-cache");
    let socket = dir.join("cache.sock");
    let prefix = format!("mmserve-test-shared-{}", std::process::id());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["embed-cache", "--socket"])
        .arg(&socket)
        .args(["--shm-prefix", &prefix, "--embed-dim", "64", "--embed-cache-size", "4096"])
        .args(["--embed-cache-request-share", "1"])
        .env("MMSERVE_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut cache = common::cache::CacheProc::adopt(out, &socket, &prefix);
    let server =
        Server::start(&["--embed-cache-socket", socket.to_str().unwrap(), "--embed-cache-wait-timeout-s", "1"]);
    let (a, b) = (data_url(&fixture_png()), data_url(&inverted_png()));

    let mut two = image_request(&a, false);
    two["messages"][0]["content"]
        .as_array_mut()
        .unwrap()
        .insert(0, json!({"type": "image_url", "image_url": {"url": b}}));
    let (status, err) = server.chat(&two).await;
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("--embed-cache-size"), "{err}");

    // Another client holds the whole cache: the request waits its second, then 503.
    let holder = cache.client().await;
    let filler = mmserve_protocol::AllocItem {
        digest: mmserve_protocol::ItemDigest::compute(mmserve_protocol::Modality::Image, "filler", b"x"),
        modality: mmserve_protocol::Modality::Image,
        token_num: 16,
        data_len: 1,
    };
    let t = std::time::Duration::from_secs(5);
    let held = holder.alloc(mmserve_protocol::deadline(t), 0, vec![filler], 0).await.unwrap().unwrap();
    let (status, err) = server.chat(&image_request(&a, false)).await;
    assert_eq!(status, 503, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("full"), "{err}");
    assert_eq!(server.metric("mmserve_embed_cache_references").await, 1, "the refused request holds nothing");

    // Once released (without the filler's data ever written, it is dropped at once),
    // the request gets through and answers as always.
    holder.release(mmserve_protocol::deadline(t), vec![held.records[0].id]).await.unwrap().unwrap();
    let (status, body) = server.chat(&image_request(&a, false)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body["choices"][0]["token_ids"]), ids(&reference()["generated_ids"]));
    server.stop();
    drop(holder);
    cache.stop_in_place();
}

#[tokio::test]
async fn stop_strings_logprobs_n_and_seeds() {
    let server = Server::start(&[]);
    let url = data_url(&fixture_png());
    let base = image_request(&url, false); // greedy "amebject Librarybject Library…"
    let with = |f: &dyn Fn(&mut Value)| {
        let mut r = base.clone();
        f(&mut r);
        r
    };

    // A stop string inside one token, and one that spans two tokens ("bject" + " Library").
    for (stop, want) in [(json!("Library"), "amebject "), (json!(["zzz", "bject Lib"]), "ame")] {
        let (status, body) = server.chat(&with(&|r| r["stop"] = stop.clone())).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], want, "stop {stop}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }
    // The same through a stream: nothing of the stop string is ever sent.
    let frames = sse(
        &server,
        &with(&|r| {
            r["stream"] = json!(true);
            r["stop"] = json!("bject Lib");
        }),
    )
    .await;
    let text: String = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str::<Value>(f).unwrap())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "ame");

    // Log-probabilities: greedy picks the top one.
    let (status, body) = server
        .chat(&with(&|r| {
            r["logprobs"] = json!(true);
            r["top_logprobs"] = json!(3);
        }))
        .await;
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 8);
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["logprob"], entry["logprob"], "greedy samples the most likely token");
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
    }

    // n choices with a seed: reproducible, and different from each other.
    let sampled = with(&|r| {
        r["n"] = json!(3);
        r["temperature"] = json!(1.0);
        r["seed"] = json!(42);
        r["max_tokens"] = json!(12);
    });
    let (s1, b1) = server.chat(&sampled).await;
    let (s2, b2) = server.chat(&sampled).await;
    assert_eq!((s1, s2), (200, 200), "{b1}");
    let choices = |b: &Value| -> Vec<Vec<u64>> {
        b["choices"].as_array().unwrap().iter().map(|c| ids(&c["token_ids"])).collect()
    };
    assert_eq!(choices(&b1).len(), 3);
    assert_eq!(choices(&b1), choices(&b2), "same seed, same choices");
    assert_ne!(choices(&b1)[0], choices(&b1)[1], "choices sample differently");
    assert_eq!(b1["usage"]["completion_tokens"], 36);

    // Streamed with n = 2: both choices finish, then [DONE].
    let frames = sse(
        &server,
        &with(&|r| {
            r["stream"] = json!(true);
            r["n"] = json!(2);
        }),
    )
    .await;
    let finishes = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str::<Value>(f).unwrap())
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .map(|c| c["choices"][0]["index"].as_u64().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(finishes.len(), 2, "{frames:?}");

    for (field, value) in [("top_logprobs", json!(21)), ("n", json!(0)), ("stop", json!([1])), ("min_p", json!(2))] {
        let (status, body) = server
            .chat(&with(&|r| {
                r[field] = value.clone();
                r["logprobs"] = json!(true);
            }))
            .await;
        assert_eq!(status, 400, "{field}: {body}");
        assert_eq!(body["error"]["param"], field);
    }
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();
}

/// A field the server does not implement is refused with a 400 naming it, never answered
/// as if it were honoured; metadata fields and unknown extras are accepted.
#[tokio::test]
async fn unimplemented_fields_are_refused_by_name() {
    let server = Server::start(&[]);
    let base = json!({"model": "llava-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    for (field, value) in [
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
        ("prediction", json!({"type": "content", "content": "x"})),
    ] {
        let mut body = base.clone();
        body[field] = value;
        let (status, v) = server.chat(&body).await;
        assert_eq!(status, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(field));
    }
    let mut body = base.clone();
    body["user"] = json!("someone");
    body["a_field_nobody_knows"] = json!(1);
    body["tools"] = Value::Null;
    let (status, v) = server.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    server.stop();
}

/// `logit_bias` as OpenAI defines it: +100 makes a token certain under greedy decoding,
/// -100 removes it; malformed biases are a 400 naming the field.
#[tokio::test]
async fn logit_bias_moves_the_choice_and_bad_biases_are_refused() {
    let server = Server::start(&[]);
    let body = |bias: Value| {
        json!({"model": "llava-tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4,
               "temperature": 0, "ignore_eos": true, "return_token_ids": true, "logit_bias": bias})
    };
    let (status, v) = server.chat(&body(json!({"42": 100}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(&v["choices"][0]["token_ids"]), [42, 42, 42, 42]);
    let (_, plain) = server.chat(&body(Value::Null)).await;
    let first = ids(&plain["choices"][0]["token_ids"])[0];
    let (_, banned) = server.chat(&body(json!({first.to_string(): -100}))).await;
    assert_ne!(ids(&banned["choices"][0]["token_ids"])[0], first, "a -100 bias removes the greedy choice");
    for bad in [json!({"abc": 1}), json!({"42": 101}), json!({"99999999": 1})] {
        let (status, v) = server.chat(&body(bad.clone())).await;
        assert_eq!(status, 400, "{bad}: {v}");
        assert_eq!(v["error"]["param"], "logit_bias", "{v}");
    }
    // CLIP's fixed size takes no mm_processor_kwargs: refused, not ignored.
    let mut kwargs = body(Value::Null);
    kwargs["mm_processor_kwargs"] = json!({"max_pixels": 1000});
    let (status, v) = server.chat(&kwargs).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "mm_processor_kwargs", "{v}");
    server.stop();
}

/// `--api-key`: `/v1/*` needs one of the keys as a bearer token (401 in OpenAI's shape
/// otherwise); `/health` stays open.
#[tokio::test]
async fn api_keys_guard_the_v1_routes() {
    let server = Server::start(&["--api-key", "k1,second-key"]);
    let url = format!("{}/v1/chat/completions", server.url);
    let body = json!({"model": "llava-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let send = |key: Option<&str>| {
        let mut r = server.http.post(&url).json(&body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    for key in [None, Some("k2"), Some("k1x"), Some("")] {
        let r = send(key).await.unwrap();
        assert_eq!(r.status(), 401, "{key:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
    }
    for key in ["k1", "second-key"] {
        assert_eq!(send(Some(key)).await.unwrap().status(), 200, "{key}");
    }
    let models = server.http.get(format!("{}/v1/models", server.url)).send().await.unwrap();
    assert_eq!(models.status(), 401);
    let health = server.http.get(format!("{}/health", server.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let metrics = server.http.get(format!("{}/metrics", server.url)).send().await.unwrap();
    assert_eq!(metrics.status(), 200, "open unless --protect-metrics");
    assert!(send(Some("k1")).await.unwrap().headers().get("access-control-allow-origin").is_none(), "no CORS");
    server.stop();
}

/// `--protect-metrics` puts `/metrics` behind the keys; `--allowed-origins` answers
/// browsers' preflights and marks responses (401s included) for the allowed origins only.
#[tokio::test]
async fn metrics_protection_and_cors() {
    let server = Server::start(&[
        "--api-key",
        "k1",
        "--protect-metrics",
        "--allowed-origins",
        "https://app.example,http://localhost:3000",
    ]);
    let metrics = format!("{}/metrics", server.url);
    assert_eq!(server.http.get(&metrics).send().await.unwrap().status(), 401);
    assert_eq!(server.http.get(&metrics).bearer_auth("k1").send().await.unwrap().status(), 200);

    let url = format!("{}/v1/chat/completions", server.url);
    let preflight = |origin: &'static str| {
        server
            .http
            .request(reqwest::Method::OPTIONS, &url)
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization, content-type")
            .send()
    };
    let r = preflight("https://app.example").await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(r.headers()["access-control-allow-origin"], "https://app.example");
    let methods = r.headers()["access-control-allow-methods"].to_str().unwrap().to_ascii_uppercase();
    assert!(methods.contains("POST"), "{methods}");
    let r = preflight("https://elsewhere.example").await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none(), "an origin not allowed");

    let body = json!({"model": "llava-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let r = server.http.post(&url).header("origin", "http://localhost:3000").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["access-control-allow-origin"], "http://localhost:3000");
    let r = server.http.post(&url).header("origin", "http://localhost:3000").bearer_auth("k1").json(&body);
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["access-control-allow-origin"], "http://localhost:3000");
    let exposed = r.headers()["access-control-expose-headers"].to_str().unwrap();
    assert!(exposed.contains("x-request-id"), "{exposed}");
    server.stop();
}
