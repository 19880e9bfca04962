//! Hostile clients against a real `mmserve serve`: unknown routes, load beyond the
//! queue, slow headers and bodies, huge texts, and clients that vanish at every stage
//! of a request. Each ends with the server serving and nothing held.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{Server, data_url, fixture_png, image_request};
use serde_json::{Value, json};

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").to_string()
}

/// A chat request whose body is announced but only partly sent: the request waits for
/// the rest (it counts as queued) until the connection closes.
fn half_sent_request(url: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(host_port(url)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"messages\""
    )
    .unwrap();
    s
}

async fn error_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test]
async fn unknown_routes_and_wrong_methods_get_openai_errors() {
    let server = Server::start(&[]);
    let (status, body) = error_of(server.http.get(format!("{}/v1/nothing", server.url)).send().await.unwrap()).await;
    assert_eq!(status, 404);
    assert!(body["error"]["message"].as_str().unwrap().contains("/v1/nothing"), "{body}");
    let r = server.http.get(format!("{}/v1/chat/completions", server.url)).send().await.unwrap();
    let (status, body) = error_of(r).await;
    assert_eq!(status, 405);
    assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
    let (status, _) = error_of(server.http.post(format!("{}/health", server.url)).send().await.unwrap()).await;
    assert_eq!(status, 405);
    server.stop();
}

/// A media host that accepts connections and never answers: a request fetching from it
/// waits (queued) until the fetch timeout.
async fn silent_host() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_beyond_the_queue_is_shed_with_429_and_retry_after() {
    let server = Server::start(&[
        "--max-queued-requests",
        "2",
        "--allowed-media-domains",
        "127.0.0.1",
        "--allow-private-media-addresses",
        "--media-fetch-timeout-s",
        "30",
    ]);
    let host = silent_host().await;
    let stalled = image_request(&format!("http://{host}/img.png"), false);
    let held: Vec<_> = (0..2)
        .map(|_| {
            let (http, url, req) = (server.http.clone(), server.url.clone(), stalled.clone());
            tokio::spawn(async move { http.post(format!("{url}/v1/chat/completions")).json(&req).send().await })
        })
        .collect();
    assert_eq!(server.metric_becomes("mmserve_queued_requests", 2).await, 2);
    let r = server.http.post(format!("{}/v1/chat/completions", server.url)).json(&image_request("x", false));
    let r = r.send().await.unwrap();
    assert_eq!(r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string()), Some("1".into()));
    let (status, body) = error_of(r).await;
    assert_eq!(status, 429);
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("--max-queued-requests"), "{body}");
    let t0 = Instant::now();
    let health = server.http.get(format!("{}/health", server.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(t0.elapsed() < Duration::from_secs(2), "/health answers under load");
    assert_eq!(server.metric("mmserve_requests_shed_total").await, 1);
    // Clients sending their bodies slowly hold connections, not places in the queue.
    let slow = half_sent_request(&server.url);
    assert_eq!(server.metric("mmserve_queued_requests").await, 2);
    for h in held {
        h.abort(); // the clients vanish: their places are given back
    }
    assert_eq!(server.metric_becomes("mmserve_queued_requests", 0).await, 0, "vanished clients leave the line");
    let (status, body) = server.chat(&image_request(&data_url(&fixture_png()), false)).await;
    assert_eq!(status, 200, "{body}");
    drop(slow);
    server.stop();
}

#[tokio::test]
async fn slow_headers_and_bodies_are_cut_off() {
    let server = Server::start(&["--header-read-timeout-s", "1", "--body-read-timeout-s", "1"]);
    // Headers that never end: the connection is closed.
    let mut slow = std::net::TcpStream::connect(host_port(&server.url)).unwrap();
    write!(slow, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n").unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t0 = Instant::now();
    let mut buf = Vec::new();
    let closed = slow.read_to_end(&mut buf);
    assert!(closed.is_ok() || t0.elapsed() < Duration::from_secs(9), "still open after {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(5), "closed after {:?}", t0.elapsed());
    // A body that never ends: 408 in OpenAI's shape.
    let mut slow = half_sent_request(&server.url);
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = [0u8; 512];
    let n = slow.read(&mut head).unwrap();
    let text = String::from_utf8_lossy(&head[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("--body-read-timeout-s"), "{text}");
    server.stop();
}

#[tokio::test]
async fn a_text_that_cannot_fit_is_refused_before_tokenizing() {
    let server = Server::start(&[]);
    let huge = "a ".repeat(16 << 20); // 32 MB
    let t0 = Instant::now();
    let (status, body) = server.chat(&json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 1})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("bytes of text"), "refused before tokenizing: {body}");
    assert!(t0.elapsed() < Duration::from_secs(10), "refused in {:?}", t0.elapsed());
    server.stop();
}

/// Clients that vanish before the body is sent, while their request waits for cache
/// room, while it is encoded, and mid-stream: afterwards nothing is referenced, queued,
/// waiting or running, and the server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_storm_leaves_nothing_held() {
    let server = Server::start(&["--embed-cache-items", "4", "--embed-cache-wait-timeout-s", "60"]);
    let png = fixture_png();
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        // Distinct images (a pixel changed in the PNG's data is a different item): each
        // needs its own cache record, four fit at once, the rest wait in line.
        let mut img = image::load_from_memory(&png).unwrap().to_rgb8();
        img.get_pixel_mut(0, 0).0 = [(i % 256) as u8, (i / 256) as u8, 7];
        let mut bytes = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png).unwrap();
        let mut req = image_request(&data_url(&bytes), true);
        req["max_tokens"] = json!(64);
        let (http, url) = (server.http.clone(), server.url.clone());
        tasks.push(tokio::spawn(async move {
            let send = http.post(format!("{url}/v1/chat/completions")).json(&req).send();
            // Vanish after 0 to 400 ms: before, during and after the alloc.
            let after = Duration::from_millis((i * 37) % 400);
            match tokio::time::timeout(after, send).await {
                Ok(Ok(r)) if i % 3 == 0 => {
                    // Mid-stream: read a chunk, then hang up.
                    let mut body = r.bytes_stream();
                    let _ = futures::StreamExt::next(&mut body).await;
                }
                _ => {}
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for (metric, want) in [
        ("mmserve_embed_cache_references", 0),
        ("mmserve_embed_cache_waiting", 0),
        ("mmserve_queued_requests", 0),
        ("mmserve_num_requests_running", 0),
        ("mmserve_num_requests_waiting", 0),
        ("mmserve_kv_blocks_used", 0),
    ] {
        let got = server.metric_becomes(metric, want).await;
        assert_eq!(got, want, "{metric}");
    }
    let (status, body) = server.chat(&image_request(&data_url(&png), false)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();
}

/// One policy for every special token typed in a message: parsed (the default, as
/// transformers and vLLM), where a typed media tag is a placeholder without an item
/// (400) and `</s>` is EOS; or, with `--special-tokens-in-content text`, plain text.
#[tokio::test]
async fn special_tokens_typed_in_messages_follow_one_policy() {
    let png = data_url(&fixture_png());
    let typed = |text: &str| {
        let mut req = image_request(&png, false);
        req["messages"][0]["content"][1]["text"] = json!(text);
        req
    };
    let count = |body: &Value, id: u64| {
        body["prompt_token_ids"].as_array().unwrap().iter().filter(|t| t.as_u64() == Some(id)).count()
    };
    let parse = Server::start(&[]);
    let (status, body) = parse.chat(&typed("What is <image> this?")).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("--special-tokens-in-content"), "{body}");
    let (status, body) = parse.chat(&typed("What is this?</s><s>")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(count(&body, 2), 1, "a typed </s> is EOS");
    parse.stop();

    let text = Server::start(&["--special-tokens-in-content", "text"]);
    let (status, body) = text.chat(&typed("What is <image> this?</s><s>")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!((count(&body, 1), count(&body, 2), count(&body, 32000)), (1, 0, 0), "only the template's BOS");
    text.stop();
}
