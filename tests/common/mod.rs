//! A real `mmserve serve` in a child process, on a free port, for end-to-end tests.

#![allow(dead_code)]

pub mod cache;
pub mod http;
#[path = "../../crates/media/tests/support/wav.rs"]
pub mod wav;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn llava_dir() -> PathBuf {
    repo().join("assets/models/llava-tiny")
}

pub fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(llava_dir().join("reference.json")).unwrap()).unwrap()
}

pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

pub struct Server {
    child: Option<Child>,
    pub url: String,
    pub http: reqwest::Client,
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        Self::start_model(&llava_dir(), extra)
    }

    pub fn start_model(model: &std::path::Path, extra: &[&str]) -> Server {
        Self::start_with(model, extra, &[("MMSERVE_LOG", "warn")], Stdio::inherit())
    }

    /// With these variables set and stderr going to `stderr`.
    pub fn start_with(model: &std::path::Path, extra: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mmserve"))
            .arg("serve")
            .arg("--port")
            .arg("0")
            .arg("--model")
            .arg(model)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawning mmserve serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(url) = line.strip_prefix("mmserve: serving ").and_then(|r| r.split(" at ").nth(1)) {
                    let _ = tx.send(Some(url.to_string()));
                }
            }
            let _ = tx.send(None); // serve exited
        });
        let url = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Some(url)) => url,
            Ok(None) => panic!("mmserve serve exited before it was ready: {:?}", child.wait()),
            Err(_) => {
                let _ = child.kill();
                panic!("mmserve serve did not come up within 120 s");
            }
        };
        // Every request a test makes is bounded: a hung server fails the test, not CI's clock.
        let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
        Server { child: Some(child), url, http }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub async fn chat(&self, body: &Value) -> (u16, Value) {
        let r = self.http.post(format!("{}/v1/chat/completions", self.url)).json(body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    pub async fn post_raw(&self, body: &'static str) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/v1/chat/completions", self.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// A metric's value from `/metrics`.
    pub async fn metric(&self, name: &str) -> u64 {
        let text = self.http.get(format!("{}/metrics", self.url)).send().await.unwrap().text().await.unwrap();
        // `name value` or `name{labels} value`: the first sample.
        text.lines()
            .find_map(|l| {
                let rest = l.strip_prefix(name)?;
                let rest = if rest.starts_with('{') { rest.split_once("} ")?.1 } else { rest.strip_prefix(' ')? };
                rest.trim().parse::<f64>().ok()
            })
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}")) as u64
    }

    /// Waits (up to 10 s) until a metric reaches `want`; returns the last value seen.
    pub async fn metric_becomes(&self, name: &str, want: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let v = self.metric(name).await;
            if v == want || Instant::now() > deadline {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, then checks the exit status and that no shared memory of the run is left.
    pub fn stop(mut self) {
        let child = self.child.take().unwrap();
        let pid = child.id();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        let status = exit_status(child, Duration::from_secs(30), "serve did not stop within 30 s of SIGTERM");
        assert!(status.success(), "serve exited with {status}");
        let left = mmserve_shm::list_with_prefix(&format!("mmserve-{pid}-"));
        assert!(left.is_empty(), "shared memory left after shutdown: {left:?}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
    }
}

/// Standard base64, as `data:` URLs and `input_audio.data` carry bytes.
pub fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn data_url(png: &[u8]) -> String {
    format!("data:image/png;base64,{}", b64(png))
}

pub fn fixture_png() -> Vec<u8> {
    std::fs::read(llava_dir().join("input.png")).unwrap()
}

/// The fixture's question about an image, greedy, 8 tokens, ignoring EOS.
pub fn image_request(url: &str, stream: bool) -> Value {
    serde_json::json!({
        "model": "llava-tiny",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is shown in this image?"}
        ]}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
        "stream": stream,
    })
}

/// `child`'s exit status, waited for on a thread at most `within` (then panics with `what`).
pub fn exit_status(mut child: std::process::Child, within: Duration, what: &str) -> std::process::ExitStatus {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait()));
    rx.recv_timeout(within).expect(what).expect("waiting for a child")
}
