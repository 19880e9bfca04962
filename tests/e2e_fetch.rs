//! Fetching image_url over HTTP and from files: what the operator allows works, and
//! everything else is refused with a 400 that says why.

mod common;

use common::*;
use serde_json::{Value, json};

fn question(url: &str) -> Value {
    image_request(url, false)
}

async fn refused(server: &Server, url: &str, says: &str) {
    let (status, body) = server.chat(&question(url)).await;
    assert_eq!(status, 400, "{url}: {body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(says), "{url}: {msg:?} should mention {says:?}");
}

#[tokio::test]
async fn allowed_fetches_work_and_the_rest_is_refused() {
    let http = common::http::start(fixture_png()).await;
    let want = ids(&reference()["generated_ids"]);
    let media_dir = common::cache::temp_dir("fetch-files");
    std::fs::copy(llava_dir().join("input.png"), media_dir.join("cat.png")).unwrap();
    std::os::unix::fs::symlink(llava_dir().join("config.json"), media_dir.join("escape.png")).unwrap();
    let media = media_dir.canonicalize().unwrap();

    let server = Server::start(&[
        "--allowed-media-domains",
        "127.0.0.1,*.example.invalid",
        "--allow-private-media-addresses",
        "--allowed-local-media-path",
        media.to_str().unwrap(),
        "--max-item-bytes",
        "100000",
        "--media-fetch-timeout-s",
        "1",
    ]);
    let base = format!("http://{http}");
    for url in [format!("{base}/img.png"), format!("{base}/redirect"), format!("file://{}/cat.png", media.display())] {
        let (status, body) = server.chat(&question(&url)).await;
        assert_eq!(status, 200, "{url}: {body}");
        assert_eq!(ids(&body["choices"][0]["token_ids"]), want, "{url}");
    }
    refused(&server, &format!("{base}/loop"), "redirects").await;
    refused(&server, &format!("{base}/missing"), "404").await;
    refused(&server, &format!("{base}/big"), "limit of 100000 bytes").await;
    refused(&server, &format!("{base}/slow"), "longer than 1 s").await;
    refused(&server, &format!("{base}/to-metadata"), "not allowed").await;
    refused(&server, &format!("http://localhost:{}/img.png", http.port()), "not allowed").await;
    refused(&server, &format!("file://{}/escape.png", media.display()), "outside").await;
    refused(&server, "file:///etc/passwd", "outside").await;
    refused(&server, &format!("file://{}/../../etc/hostname", media.display()), "outside").await;
    refused(&server, "ftp://example.com/x.png", "scheme").await;
    assert_eq!(server.metric("mmserve_embed_cache_references").await, 0);
    server.stop();

    // Defaults: no remote fetching, and private addresses stay refused even when a
    // host is allowed.
    let strict = Server::start(&["--allowed-media-domains", "127.0.0.1"]);
    refused(&strict, &format!("{base}/img.png"), "loopback, private or otherwise reserved").await;
    refused(&strict, "http://[::1]/img.png", "not allowed").await;
    refused(&strict, &format!("file://{}/cat.png", media.display()), "file: URLs are not allowed").await;
    strict.stop();
}

#[tokio::test]
async fn oversized_and_bomb_images_are_refused_before_decoding() {
    let server = Server::start(&["--max-item-bytes", "5000", "--max-body-bytes", "20000"]);
    // The fixture PNG is 11 KB: over the byte limit.
    refused(&server, &data_url(&fixture_png()), "limit of 5000 bytes").await;
    // A PNG header claiming 100000×100000 pixels, a few dozen bytes long.
    refused(&server, &data_url(&bomb_png()), "pixels").await;
    // Too many images in one request.
    let url = data_url(&bomb_png());
    let content: Vec<Value> = (0..17).map(|_| json!({"type": "image_url", "image_url": {"url": url}})).collect();
    let (status, body) = server.chat(&json!({"messages": [{"role": "user", "content": content}]})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("limit is 16"), "{body}");
    // A body over --max-body-bytes: 413, in OpenAI's shape.
    let big = "x".repeat(30_000);
    let (status, body) = server.chat(&json!({"messages": [{"role": "user", "content": big}]})).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "payload_too_large");
    server.stop();
}

/// Signature, IHDR for 100000×100000 RGB, an empty IDAT and IEND, CRCs correct.
fn bomb_png() -> Vec<u8> {
    fn chunk(kind: &[u8], data: &[u8]) -> Vec<u8> {
        let mut c = (data.len() as u32).to_be_bytes().to_vec();
        c.extend_from_slice(kind);
        c.extend_from_slice(data);
        let mut crc = 0xffff_ffffu32;
        for &b in kind.iter().chain(data) {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
            }
        }
        c.extend_from_slice(&(!crc).to_be_bytes());
        c
    }
    let mut ihdr = 100_000u32.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&100_000u32.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    png.extend(chunk(b"IDAT", &[]));
    png.extend(chunk(b"IEND", &[]));
    png
}
