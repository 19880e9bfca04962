//! `mmserve caption` as a user runs it, against real servers: a folder of mixed files,
//! the same answers as the chat API, a crash (SIGKILL) and a resume, the OpenAI batch
//! format, the audio model, and the csv, sidecar and metadata formats.

mod common;

use std::collections::HashMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::cache::temp_dir;
use common::*;
use serde_json::{Value, json};

fn caption(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .arg("caption")
        .args(args)
        .args(["--quiet", "--max-tokens", "6"])
        .env("MMSERVE_LOG", "warn")
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("running mmserve caption")
}

fn records(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.is_empty() || text.ends_with('\n'), "a torn last line in {}", path.display());
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}"))).collect()
}

fn by_id(recs: &[Value]) -> HashMap<String, Value> {
    let mut m = HashMap::new();
    for r in recs {
        let id = r["custom_id"].as_str().or(r["id"].as_str()).unwrap().to_string();
        assert!(m.insert(id.clone(), r.clone()).is_none(), "{id} appears twice");
    }
    m
}

/// A `side`² picture with a pattern of its own, encoded as `format`.
fn picture(seed: u32, side: u32, format: image::ImageFormat) -> Vec<u8> {
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([(x * 7 + seed * 31) as u8, (y * 5 + seed * 17) as u8, ((x ^ y) + seed) as u8])
    });
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, format).unwrap();
    out.into_inner()
}

fn base_url(server: &Server) -> String {
    server.url.clone()
}

#[tokio::test]
async fn a_folder_of_mixed_files_gives_one_record_each_and_the_chat_apis_captions() {
    let dir = temp_dir("caption-folder");
    let photos = dir.join("photos");
    std::fs::create_dir_all(photos.join("sub")).unwrap();
    std::fs::write(photos.join("a.png"), picture(1, 40, image::ImageFormat::Png)).unwrap();
    std::fs::write(photos.join("b.jpg"), picture(2, 50, image::ImageFormat::Jpeg)).unwrap();
    std::fs::write(photos.join("sub/c.bmp"), picture(3, 30, image::ImageFormat::Bmp)).unwrap();
    std::fs::write(photos.join("sub/a-again.png"), picture(1, 40, image::ImageFormat::Png)).unwrap();
    // A PNG signature and then nothing: media by content, but not decodable.
    std::fs::write(photos.join("broken.png"), b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR").unwrap();
    std::fs::write(photos.join("notes.md"), "not a picture").unwrap();
    let server = Server::start(&[]);
    let out = dir.join("captions.jsonl");
    let run = caption(&["--url", &base_url(&server), photos.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!run.status.success(), "the broken file must fail the run");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("1 items failed"), "{stderr}");
    let recs = by_id(&records(&out));
    assert_eq!(recs.len(), 6, "{recs:#?}");
    let rec = |name: &str| &recs[&photos.join(name).display().to_string()];
    assert!(rec("broken.png")["error"].as_str().unwrap().contains("HTTP 400"), "{}", rec("broken.png"));
    assert!(rec("notes.md")["not_media"].is_string() && rec("notes.md")["error"].is_null());
    // The duplicate is encoded once: three distinct pictures reached the encoder.
    assert_eq!(server.metric("mmserve_encoder_items_total").await, 3);
    assert_eq!(rec("a.png")["digest"], rec("sub/a-again.png")["digest"]);
    // Each caption is what the chat API answers for the same picture and settings.
    for name in ["a.png", "b.jpg", "sub/c.bmp"] {
        let bytes = std::fs::read(photos.join(name)).unwrap();
        let mime = if name.ends_with("jpg") { "image/jpeg" } else { "image/png" };
        let url = format!("data:{mime};base64,{}", b64(&bytes));
        let (status, v) = server
            .chat(&json!({
                "model": "llava-tiny", "max_tokens": 6, "temperature": 0.0, "top_p": 1.0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Describe the image in one sentence."}]}],
            }))
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(rec(name)["caption"], v["choices"][0]["message"]["content"], "{name}");
        assert_eq!(rec(name)["completion_tokens"], v["usage"]["completion_tokens"]);
    }
    // The same command again skips everything (the failed item too, unless retried).
    let again = caption(&["--url", &base_url(&server), photos.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(records(&out).len(), 6);
    let retry = caption(&[
        "--url",
        &base_url(&server),
        photos.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--retry-failed",
    ]);
    assert!(!retry.status.success());
    assert_eq!(by_id(&records(&out)).len(), 6, "a retried item replaces its record");
    // Another prompt does not reuse the old captions.
    let other = caption(&[
        "--url",
        &base_url(&server),
        photos.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--prompt",
        "What colours are there?",
    ]);
    assert!(!other.status.success());
    let recs = by_id(&records(&out));
    assert_ne!(recs[&photos.join("a.png").display().to_string()]["settings"], rec("a.png")["settings"]);
    server.stop();
}

#[tokio::test]
async fn a_killed_run_resumes_with_every_item_exactly_once() {
    let dir = temp_dir("caption-crash");
    let photos = dir.join("photos");
    std::fs::create_dir_all(&photos).unwrap();
    let n = 60;
    for i in 0..n {
        std::fs::write(photos.join(format!("p{i:02}.png")), picture(100 + i, 32, image::ImageFormat::Png)).unwrap();
    }
    let server = Server::start(&[]);
    let out = dir.join("captions.jsonl");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "caption".to_string(),
            "--url".into(),
            base_url(&server),
            photos.display().to_string(),
            "--out".into(),
            out.display().to_string(),
            "--concurrency".into(),
            "2".into(),
            "--max-tokens".into(),
            "64".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(args(&[]))
        .env("MMSERVE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once a few items are written, mid-run.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let lines = std::fs::read_to_string(&out).map(|t| t.lines().count()).unwrap_or(0);
        if lines >= 5 {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
        assert!(Instant::now() < deadline, "no records within 60 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = records(&out).len();
    assert!(before < n as usize, "the run finished before it was killed");
    // A torn last line, as a crash in the middle of a write would leave one.
    std::fs::OpenOptions::new().append(true).open(&out).unwrap().write_all(b"{\"id\": \"torn").unwrap();
    let resumed =
        Command::new(env!("CARGO_BIN_EXE_mmserve")).args(args(&[])).env("MMSERVE_LOG", "warn").output().unwrap();
    assert!(resumed.status.success(), "{:?}: {}", resumed.status, String::from_utf8_lossy(&resumed.stderr));
    let recs = by_id(&records(&out));
    assert_eq!(recs.len(), n as usize);
    assert!(recs.values().all(|r| r["error"].is_null() && r["caption"].is_string()));
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(stderr.contains(&format!("{} done, {before} skipped", n as usize - before)), "{stderr}");
    server.stop();
}

use std::io::Write;

#[tokio::test]
async fn a_batch_file_is_answered_in_the_openai_batch_format() {
    let dir = temp_dir("caption-batch");
    let server = Server::start(&[]);
    let req = |id: &str, text: &str| {
        json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "llava-tiny", "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "user", "content": text}]}})
        .to_string()
    };
    let bad_body = json!({"custom_id": "r-bad-body", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": "llava-tiny", "messages": "not a list"}});
    let lines = [
        req("r1", "Hello"),
        "{ this is not json".to_string(),
        req("r2", "Tell me a story"),
        json!({"custom_id": "r-emb", "method": "POST", "url": "/v1/embeddings", "body": {}}).to_string(),
        bad_body.to_string(),
    ];
    let input = dir.join("requests.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = dir.join("results.jsonl");
    let run = caption(&[
        "--url",
        &base_url(&server),
        "--batch-file",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!run.status.success(), "three bad lines must fail the run");
    let recs = by_id(&records(&out));
    assert_eq!(recs.len(), 5, "{recs:#?}");
    for id in ["r1", "r2"] {
        let r = &recs[id];
        assert_eq!(r["response"]["status_code"], 200, "{r}");
        assert!(r["id"].as_str().unwrap().starts_with("batch_req_"));
        assert!(r["response"]["body"]["choices"][0]["message"]["content"].is_string());
        assert!(r["error"].is_null());
    }
    assert_eq!(recs["line 2"]["error"]["code"], "invalid_request");
    assert!(recs["r-emb"]["error"]["message"].as_str().unwrap().contains("/v1/chat/completions"));
    assert_eq!(recs["r-bad-body"]["response"]["status_code"], 400, "{}", recs["r-bad-body"]);
    assert_eq!(recs["r-bad-body"]["response"]["body"]["error"]["type"], "invalid_request_error");
    // Resumed: the answered requests are not sent again.
    let requests = server.metric("mmserve_requests_total").await;
    let _ = caption(&[
        "--url",
        &base_url(&server),
        "--batch-file",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(server.metric("mmserve_requests_total").await, requests);
    assert_eq!(records(&out).len(), 5);
    server.stop();
}

#[test]
fn the_embedded_server_transcribes_a_folder_of_clips_into_sidecars_and_csv() {
    let dir = temp_dir("caption-audio");
    let clips = dir.join("clips");
    std::fs::create_dir_all(&clips).unwrap();
    let data = repo().join("crates/media/tests/data/audio");
    for name in ["pcm16.wav", "pcm16.flac", "chirp.mp3"] {
        std::fs::copy(data.join(name), clips.join(name)).unwrap();
    }
    let model = repo().join("assets/models/qwen2-audio-tiny");
    let transcribe = |format: &str, out: &Path| {
        let run = caption(&[
            clips.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "What is this sound?",
            "--format",
            format,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    };
    let out = dir.join("clips.jsonl");
    transcribe("sidecar", &out);
    let recs = records(&out);
    assert_eq!(recs.len(), 3);
    for r in &recs {
        assert_eq!(r["kind"], "audio", "{r}");
        let sidecar = PathBuf::from(r["path"].as_str().unwrap()).with_extension("txt");
        assert_eq!(std::fs::read_to_string(&sidecar).unwrap(), r["caption"].as_str().unwrap());
    }
    // A second run in another format: the sidecars are not taken as inputs.
    let csv = dir.join("clips.csv");
    transcribe("csv", &csv);
    let text = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<&str> = text.split("\r\n").filter(|l| !l.is_empty()).collect();
    assert_eq!(rows[0], "id,digest,caption,prompt_tokens,completion_tokens,finish_reason,latency_ms,error");
    assert_eq!(rows.len(), 4, "{text}");
}

#[tokio::test]
async fn metadata_is_written_for_the_folder_with_relative_names() {
    let dir = temp_dir("caption-metadata");
    let photos = dir.join("ds");
    std::fs::create_dir_all(photos.join("train")).unwrap();
    std::fs::write(photos.join("train/x.png"), picture(7, 36, image::ImageFormat::Png)).unwrap();
    std::fs::write(photos.join("y.jpg"), picture(8, 36, image::ImageFormat::Jpeg)).unwrap();
    let server = Server::start(&[]);
    let out = dir.join("journal.jsonl");
    let run = caption(&[
        "--url",
        &base_url(&server),
        photos.to_str().unwrap(),
        "--format",
        "metadata",
        "--metadata-column",
        "caption",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let meta = records(&photos.join("metadata.jsonl"));
    let names: Vec<&str> = meta.iter().map(|m| m["file_name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 2);
    assert!(names.contains(&"train/x.png") && names.contains(&"y.jpg"), "{names:?}");
    assert!(meta.iter().all(|m| m["caption"].is_string()));
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_of_paths_and_urls_and_jsonl_items_with_their_own_prompts() {
    let dir = temp_dir("caption-lists");
    let png = picture(9, 40, image::ImageFormat::Png);
    let local = dir.join("local.png");
    std::fs::write(&local, &png).unwrap();
    let web = common::http::start(png).await;
    let server = Server::start(&[]);
    let list = dir.join("inputs.txt");
    let lines = [
        format!("http://{web}/img.png"),
        format!("http://{web}/missing"),
        "# a comment".to_string(),
        local.display().to_string(),
        dir.join("nowhere.png").display().to_string(),
    ];
    std::fs::write(&list, lines.join("\n")).unwrap();
    let out = dir.join("out.jsonl");
    let run =
        caption(&["--url", &base_url(&server), "--input-list", list.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!run.status.success(), "two inputs cannot be read");
    let recs = by_id(&records(&out));
    assert_eq!(recs.len(), 4, "{recs:#?}");
    let url = format!("http://{web}/img.png");
    assert!(recs[&url]["caption"].is_string(), "{}", recs[&url]);
    assert_eq!(recs[&url]["digest"], recs[&local.display().to_string()]["digest"], "a URL is keyed by its content");
    assert!(recs[&format!("http://{web}/missing")]["error"].as_str().unwrap().contains("404"));
    assert!(recs[&dir.join("nowhere.png").display().to_string()]["error"].as_str().unwrap().contains("reading"));
    // jsonl items: ids of their own, and prompts of their own.
    let items = dir.join("items.jsonl");
    let jl = [
        json!({"id": "first", "image": local.display().to_string()}),
        json!({"id": "second", "image": local.display().to_string(), "prompt": "Name one colour."}),
    ];
    std::fs::write(&items, jl.iter().map(|v| v.to_string() + "\n").collect::<String>()).unwrap();
    let out = dir.join("items-out.jsonl");
    let run = caption(&[
        "--url",
        &base_url(&server),
        "--input-jsonl",
        items.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let recs = by_id(&records(&out));
    assert_ne!(recs["first"]["settings"], recs["second"]["settings"], "the prompt is part of the settings");
    assert!(recs["second"]["prompt_tokens"].as_u64() != recs["first"]["prompt_tokens"].as_u64());
    server.stop();
}

#[tokio::test]
async fn ctrl_c_stops_cleanly_and_says_how_to_resume() {
    let dir = temp_dir("caption-sigint");
    let photos = dir.join("photos");
    std::fs::create_dir_all(&photos).unwrap();
    for i in 0..40 {
        std::fs::write(photos.join(format!("q{i:02}.png")), picture(200 + i, 32, image::ImageFormat::Png)).unwrap();
    }
    let server = Server::start(&[]);
    let out = dir.join("captions.jsonl");
    let args = [
        "caption".to_string(),
        "--url".into(),
        base_url(&server),
        photos.display().to_string(),
        "--out".into(),
        out.display().to_string(),
        "--concurrency".into(),
        "1".into(),
        "--max-tokens".into(),
        "64".into(),
    ];
    let child = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(&args)
        .env("MMSERVE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&out).map(|t| t.lines().count()).unwrap_or(0) < 2 {
        assert!(Instant::now() < deadline, "no records within 60 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let stopped = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&stopped.stderr);
    assert!(!stopped.status.success());
    assert!(stderr.contains("interrupted") && stderr.contains("run the same command again"), "{stderr}");
    let before = records(&out).len();
    assert!(before < 40, "it ran to the end before the signal");
    let resumed = Command::new(env!("CARGO_BIN_EXE_mmserve")).args(&args).env("MMSERVE_LOG", "warn").output().unwrap();
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    assert_eq!(by_id(&records(&out)).len(), 40);
    server.stop();
}

#[tokio::test]
async fn the_client_sends_its_api_key() {
    let dir = temp_dir("caption-key");
    std::fs::write(dir.join("a.png"), picture(3, 30, image::ImageFormat::Png)).unwrap();
    let server = Server::start(&["--api-key", "k-caption"]);
    let out = dir.join("out.jsonl");
    let (path, outp) = (dir.join("a.png").display().to_string(), out.display().to_string());
    let refused = caption(&["--url", &base_url(&server), &path, "--out", &outp, "--served-model", "llava-tiny"]);
    assert!(!refused.status.success());
    assert!(records(&out)[0]["error"].as_str().unwrap().contains("401"));
    let ok = caption(&["--url", &base_url(&server), &path, "--out", &outp, "--api-key", "k-caption", "--retry-failed"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(by_id(&records(&out)).values().all(|r| r["caption"].is_string()));
    server.stop();
}
