//! Media built to hurt the server, through `mmserve serve`: audio with absurd sample rates
//! or lengths, parts whose declared type or format lies, and `file:` URLs naming FIFOs,
//! oversized files and links out of the allowed directory. Each is a quick 400 that says
//! why, and the server goes on serving.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::wav::wav16;
use common::*;
use serde_json::{Value, json};

fn audio_dir() -> PathBuf {
    repo().join("assets/models/qwen2-audio-tiny")
}

/// `seconds` of a 440 Hz tone at `rate`.
fn tone(seconds: f64, rate: u32) -> Vec<i16> {
    let n = (seconds * f64::from(rate)) as usize;
    (0..n).map(|i| ((i as f64 * 440.0 / f64::from(rate) * std::f64::consts::TAU).sin() * 8000.0) as i16).collect()
}

fn ask(part: Value) -> Value {
    json!({
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
        "max_tokens": 2,
        "temperature": 0,
    })
}

fn input_audio(bytes: &[u8], format: &str) -> Value {
    json!({"type": "input_audio", "input_audio": {"data": b64(bytes), "format": format}})
}

fn image_url(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// A 400 within `within`, whose message holds every one of `says`; returns the error object.
async fn refused(server: &Server, part: Value, says: &[&str], within: Duration) -> Value {
    let started = Instant::now();
    let (status, body) = server.chat(&ask(part)).await;
    assert_eq!(status, 400, "{says:?}: {body}");
    assert!(started.elapsed() < within, "{says:?}: took {:?}", started.elapsed());
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    for s in says {
        assert!(msg.contains(s), "{msg:?} should mention {s:?}");
    }
    body["error"].clone()
}

#[tokio::test]
async fn hostile_audio_is_refused_quickly_and_sane_audio_still_works() {
    let server = Server::start_model(&audio_dir(), &[]);
    let fast = Duration::from_secs(5);
    // 600 samples claiming 1 Hz would be resampled into 600 s of 16 kHz audio.
    for rate in [1, 0, 3999] {
        let wav = wav16(&tone(600.0 / 8000.0, 8000), rate, None);
        refused(&server, input_audio(&wav, "wav"), &[&format!(" {rate} Hz"), "minimum is 4000 Hz"], fast).await;
    }
    // A header claiming 590 s at 192 kHz (226 MB of samples), 1 s present.
    let claims = wav16(&tone(1.0, 192_000), 192_000, Some(590 * 192_000 * 2));
    refused(&server, input_audio(&claims, "wav"), &["truncated"], fast).await;
    // A format we do not decode, named with the field and the formats we take.
    let wav = wav16(&tone(1.5, 16_000), 16_000, None);
    let err = refused(&server, input_audio(&wav, "xyz"), &["`format`", "\"xyz\"", "wav, mp3, flac"], fast).await;
    assert_eq!(err["param"], "input_audio.format");
    // An audio_url data: URL must declare audio/* when it declares a type.
    let url = format!("data:image/png;base64,{}", b64(&wav));
    let err =
        refused(&server, json!({"type": "audio_url", "audio_url": {"url": url}}), &["invalid MIME type"], fast).await;
    assert_eq!(err["param"], "audio_url");
    assert_eq!(server.metric("mmserve_embed_cache_items").await, 0, "a refused clip reached the cache");

    // Twelve 30 s clips are 9,000 audio tokens, more than the context of 8,192: refused
    // from their headers' lengths, with the message of that check.
    let long = b64(&wav16(&tone(30.0, 8000), 8000, None));
    let mut parts: Vec<Value> =
        (0..12).map(|_| json!({"type": "input_audio", "input_audio": {"data": long, "format": "wav"}})).collect();
    parts.push(json!({"type": "text", "text": "What are they?"}));
    let (status, body) = server.chat(&json!({"messages": [{"role": "user", "content": parts}], "max_tokens": 2})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("text and media take more than"), "{body}");

    // 4 and 8 kHz, declared as audio: fine. A 45 s clip: its first 30 s are heard (750 tokens).
    for (seconds, rate, tokens) in [(1.5, 4000, 37), (1.5, 8000, 37), (45.0, 16_000, 750)] {
        let wav = wav16(&tone(seconds, rate), rate, None);
        let url = format!("data:audio/wav;base64,{}", b64(&wav));
        for part in [input_audio(&wav, "WAV"), json!({"type": "audio_url", "audio_url": {"url": url}})] {
            let (status, body) = server.chat(&ask(part)).await;
            assert_eq!(status, 200, "{seconds} s at {rate} Hz: {body}");
            assert_eq!(body["usage"]["prompt_tokens_details"]["audio_tokens"], tokens, "{seconds} s at {rate} Hz");
        }
    }
    server.stop();
}

/// `mkfifo` at `path`.
fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "{}", std::io::Error::last_os_error());
}

#[tokio::test]
async fn hostile_images_and_files_are_refused_quickly() {
    let dir = common::cache::temp_dir("hostile-files");
    let outside = common::cache::temp_dir("hostile-outside");
    std::fs::copy(llava_dir().join("input.png"), dir.join("cat.png")).unwrap();
    std::fs::create_dir(dir.join("sub")).unwrap();
    std::os::unix::fs::symlink("../cat.png", dir.join("sub/cat.png")).unwrap();
    std::os::unix::fs::symlink("../".repeat(12) + outside.to_str().unwrap(), dir.join("away")).unwrap();
    std::fs::copy(llava_dir().join("input.png"), outside.join("secret.png")).unwrap();
    mkfifo(&dir.join("pipe.png"));
    std::fs::File::create(dir.join("huge.png")).unwrap().set_len(200 << 20).unwrap(); // sparse
    let root = dir.canonicalize().unwrap();
    let server = Server::start(&[
        "--allowed-local-media-path",
        root.to_str().unwrap(),
        "--max-item-bytes",
        "20000",
        "--media-fetch-timeout-s",
        "3",
    ]);
    let file = |name: &str| image_url(&format!("file://{}/{name}", root.display()));
    let fast = Duration::from_secs(2);
    refused(&server, file("pipe.png"), &["a FIFO", "not a regular file"], fast).await;
    refused(&server, file("huge.png"), &["limit of 20000 bytes (--max-item-bytes)"], fast).await;
    refused(&server, file("sub"), &["a directory"], fast).await;
    refused(&server, file("away/secret.png"), &["outside the allowed local media path"], fast).await;
    // An image part whose data: URL declares another type.
    let png = std::fs::read(llava_dir().join("input.png")).unwrap();
    for mime in ["audio/wav", "application/octet-stream", "text/plain"] {
        let url = format!("data:{mime};base64,{}", b64(&png));
        let err = refused(&server, image_url(&url), &["invalid MIME type", mime, "image/*"], fast).await;
        assert_eq!(err["param"], "image_url");
    }
    // What is allowed works: a file, a link that stays inside, a typed and an untyped data: URL.
    let want = ids(&reference()["generated_ids"]);
    for part in [
        file("cat.png"),
        file("sub/cat.png"),
        image_url(&data_url(&png)),
        image_url(&format!("data:;base64,{}", b64(&png))),
    ] {
        let mut req = image_request("", false);
        req["messages"][0]["content"][0] = part.clone();
        let (status, body) = server.chat(&req).await;
        assert_eq!(status, 200, "{part}: {body}");
        assert_eq!(ids(&body["choices"][0]["token_ids"]), want, "{part}");
    }
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();
}
