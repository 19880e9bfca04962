//! One request sent and timed as `vllm bench serve` times it: time to first token (the
//! first chunk with text), each gap between text chunks (ITL), end-to-end latency, and
//! token counts from the server's `usage`.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use super::dataset::{BenchRequest, Media};

/// Which OpenAI endpoint the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Endpoint {
    /// `/v1/chat/completions` (vLLM's `openai-chat` backend): text and media.
    Chat,
    /// `/v1/completions` (vLLM's `openai` backend): text only.
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }

    /// vLLM's name for the backend.
    pub fn backend(self) -> &'static str {
        match self {
            Endpoint::Chat => "openai-chat",
            Endpoint::Completions => "openai",
        }
    }
}

/// How every request is sent.
#[derive(Debug, Clone)]
pub struct Sender {
    pub http: reqwest::Client,
    pub url: String,
    pub model: String,
    pub endpoint: Endpoint,
    pub stream: bool,
    pub ignore_eos: bool,
    pub temperature: f32,
    /// Merged into every body (`--extra-body`).
    pub extra: serde_json::Map<String, Value>,
}

/// What one request gave.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Empty on success, else the first line of what went wrong.
    pub error: String,
    /// Seconds from sending to the first text (the whole latency without streaming).
    pub ttft: f64,
    /// Seconds between text chunks.
    pub itl: Vec<f64>,
    /// Seconds from sending to the last chunk.
    pub latency: f64,
    pub input_len: u64,
    pub output_len: u64,
    pub text: String,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.error.is_empty()
    }

    /// Seconds per output token after the first (vLLM's TPOT), for more than one token.
    pub fn tpot(&self) -> Option<f64> {
        (self.output_len > 1).then(|| (self.latency - self.ttft) / (self.output_len - 1) as f64)
    }
}

impl Sender {
    fn body(&self, r: &BenchRequest) -> Result<Value, String> {
        let mut body = match self.endpoint {
            Endpoint::Chat => {
                let mut parts: Vec<Value> = r
                    .media
                    .iter()
                    .map(|m| match m {
                        Media::Image(url) => json!({"type": "image_url", "image_url": {"url": url}}),
                        Media::Audio(url) => json!({"type": "audio_url", "audio_url": {"url": url}}),
                    })
                    .collect();
                parts.push(json!({"type": "text", "text": r.prompt}));
                json!({"messages": [{"role": "user", "content": parts}]})
            }
            Endpoint::Completions if r.media.is_empty() => json!({"prompt": r.prompt}),
            Endpoint::Completions => return Err("the completions endpoint takes no media".into()),
        };
        body["model"] = json!(self.model);
        body["max_tokens"] = json!(r.output_len);
        body["temperature"] = json!(self.temperature);
        body["stream"] = json!(self.stream);
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        for (k, v) in &self.extra {
            body[k] = v.clone();
        }
        Ok(body)
    }

    /// Sends `r` and times it; never fails (a failure is the outcome's error).
    pub async fn send(&self, r: &BenchRequest) -> Outcome {
        let t0 = Instant::now();
        let mut out = Outcome::default();
        if let Err(e) = self.exchange(r, t0, &mut out).await {
            out.error = e.lines().next().unwrap_or("failed").to_string();
        }
        out
    }

    async fn exchange(&self, r: &BenchRequest, t0: Instant, out: &mut Outcome) -> Result<(), String> {
        let body = self.body(r)?;
        let resp = self
            .http
            .post(format!("{}{}", self.url, self.endpoint.path()))
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("sending: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            let why = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                .unwrap_or(text);
            return Err(format!("HTTP {}: {why}", status.as_u16()));
        }
        if !self.stream {
            let v: Value = resp.json().await.map_err(|e| format!("reading the answer: {e}"))?;
            out.latency = t0.elapsed().as_secs_f64();
            out.ttft = out.latency;
            out.text = choice_text(&v["choices"][0], false).to_string();
            usage(&v, out);
            return Ok(());
        }
        let mut last = t0;
        let mut chunks = 0u64;
        let mut buf = String::new();
        let mut stream = resp.bytes_stream();
        while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(|e| format!("reading the stream: {e}"))?;
            buf.push_str(&String::from_utf8_lossy(&bytes));
            while let Some(end) = buf.find("\n\n") {
                let frame: String = buf.drain(..end + 2).collect();
                let Some(data) = frame.trim().strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data).map_err(|e| format!("a stream chunk: {e}"))?;
                if v.get("error").is_some() {
                    return Err(format!("in the stream: {}", v["error"]["message"].as_str().unwrap_or("error")));
                }
                usage(&v, out);
                let text = choice_text(&v["choices"][0], true);
                if text.is_empty() {
                    continue;
                }
                let now = Instant::now();
                if chunks == 0 {
                    out.ttft = (now - t0).as_secs_f64();
                } else {
                    out.itl.push((now - last).as_secs_f64());
                }
                last = now;
                chunks += 1;
                out.text.push_str(text);
            }
        }
        if chunks == 0 {
            return Err("no text came back".into());
        }
        out.latency = (last - t0).as_secs_f64();
        if out.output_len == 0 {
            out.output_len = chunks; // a server without usage: a chunk a token
        }
        Ok(())
    }
}

fn choice_text(choice: &Value, stream: bool) -> &str {
    let t = if stream { &choice["delta"]["content"] } else { &choice["message"]["content"] };
    t.as_str().or_else(|| choice["text"].as_str()).unwrap_or("")
}

fn usage(v: &Value, out: &mut Outcome) {
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        out.input_len = u["prompt_tokens"].as_u64().unwrap_or(out.input_len);
        out.output_len = u["completion_tokens"].as_u64().unwrap_or(out.output_len);
    }
}

/// The client every request shares: connections kept, each request bounded.
pub fn http(timeout: Duration) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder().timeout(timeout).pool_max_idle_per_host(4096).tcp_nodelay(true).build()?)
}
