//! One item through the chat API: its bytes (a file, or a URL fetched here so that its
//! content can be keyed), a chat completion request with the item inline (a data URL
//! for images, `input_audio` for audio), and the answer made a record.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine as _;
use futures::StreamExt;
use md5::Digest;
use serde_json::{Value, json};

use super::inputs::Kind;

/// The run's sampling and prompt settings, as the requests carry them.
#[derive(Debug, Clone)]
pub struct Settings {
    pub model: String,
    pub prompt: Option<String>,
    pub system: Option<String>,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
}

/// Default prompts by modality.
const IMAGE_PROMPT: &str = "Describe the image in one sentence.";
const AUDIO_PROMPT: &str = "Describe the audio in one sentence.";

impl Settings {
    /// The prompt an item gets.
    pub fn prompt_for<'a>(&'a self, kind: Kind, own: Option<&'a str>) -> &'a str {
        own.or(self.prompt.as_deref()).unwrap_or(match kind {
            Kind::Image => IMAGE_PROMPT,
            Kind::Audio(_) => AUDIO_PROMPT,
        })
    }

    /// What must match for an earlier caption to stand for this run's: the model, the
    /// system prompt, the item's prompt and the sampling settings (hex of their md5).
    pub fn key(&self, prompt: &str) -> String {
        let s = json!({
            "model": self.model, "system": self.system, "prompt": prompt, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
        });
        hex(&md5::Md5::digest(s.to_string().as_bytes()))[..16].to_string()
    }

    /// Whether two requests for the same content give the same answer (greedy): then a
    /// duplicate in the same run reuses the first one's.
    pub fn deterministic(&self) -> bool {
        self.temperature == 0.0 || self.seed.is_some()
    }

    /// The chat completion request for an item.
    pub fn body(&self, kind: Kind, bytes: &[u8], prompt: &str) -> Value {
        let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
        let media = match kind {
            Kind::Image => {
                json!({"type": "image_url", "image_url": {"url": format!("data:{};base64,{b64}", mime(bytes))}})
            }
            Kind::Audio(format) => json!({"type": "input_audio", "input_audio": {"data": b64, "format": format}}),
        };
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": [media, {"type": "text", "text": prompt}]}));
        let mut body = json!({
            "model": self.model, "messages": messages, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
        });
        if let Some(seed) = self.seed {
            body["seed"] = json!(seed);
        }
        body
    }
}

fn mime(bytes: &[u8]) -> &'static str {
    match bytes.first() {
        Some(0x89) => "image/png",
        Some(0xff) => "image/jpeg",
        Some(b'G') => "image/gif",
        Some(b'B') => "image/bmp",
        _ => "image/webp",
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The content digest of an item (md5 of its bytes, as the server's cache keys it).
pub fn digest(bytes: &[u8]) -> String {
    hex(&md5::Md5::digest(bytes))
}

/// An item's bytes from a file, at most `max` of them.
pub async fn read_file(path: &Path, max: u64) -> anyhow::Result<Vec<u8>> {
    let meta = tokio::fs::metadata(path).await?;
    if !meta.is_file() {
        bail!("not a regular file");
    }
    if meta.len() > max {
        bail!("{} bytes, more than --max-item-bytes ({max})", meta.len());
    }
    Ok(tokio::fs::read(path).await?)
}

/// An item's bytes from a URL, at most `max` of them (counted as they arrive).
pub async fn fetch(http: &reqwest::Client, url: &str, max: u64) -> anyhow::Result<Vec<u8>> {
    let resp = http.get(url).send().await?;
    if !resp.status().is_success() {
        bail!("HTTP {}", resp.status());
    }
    if resp.content_length().is_some_and(|n| n > max) {
        bail!("more than --max-item-bytes ({max})");
    }
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if body.len() + chunk.len() > max as usize {
            bail!("more than --max-item-bytes ({max})");
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// What the server answered for one item.
#[derive(Debug, Clone)]
pub struct Answer {
    pub caption: String,
    pub finish_reason: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub latency: Duration,
}

/// POSTs a chat completion; an error status is an error with the server's message.
pub async fn complete(http: &reqwest::Client, base: &str, body: &Value) -> anyhow::Result<Answer> {
    let t0 = Instant::now();
    let resp = http.post(format!("{base}/v1/chat/completions")).json(body).send().await?;
    let status = resp.status();
    let v: Value = resp.json().await.context("the answer is not JSON")?;
    if !status.is_success() {
        let message = v["error"]["message"].as_str().map_or_else(|| v.to_string(), str::to_string);
        bail!("HTTP {}: {message}", status.as_u16());
    }
    let choice = &v["choices"][0];
    Ok(Answer {
        caption: choice["message"]["content"].as_str().context("no message content in the answer")?.to_string(),
        finish_reason: choice["finish_reason"].as_str().unwrap_or_default().to_string(),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        latency: t0.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            model: "m".into(),
            prompt: None,
            system: Some("Be brief.".into()),
            max_tokens: 16,
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
        }
    }

    #[test]
    fn the_key_changes_with_every_setting_and_the_prompt() {
        let s = settings();
        let base = s.key("p");
        assert_eq!(base, s.key("p"));
        assert_ne!(base, s.key("q"));
        assert_ne!(base, Settings { max_tokens: 17, ..s.clone() }.key("p"));
        assert_ne!(base, Settings { system: None, ..s.clone() }.key("p"));
        assert_ne!(base, Settings { seed: Some(1), ..s.clone() }.key("p"));
        assert_ne!(base, Settings { model: "n".into(), ..s }.key("p"));
    }

    #[test]
    fn the_request_carries_the_item_inline() {
        let s = settings();
        let b = s.body(Kind::Image, b"\x89PNG....", "What is it?");
        let parts = &b["messages"][1]["content"];
        assert!(parts[0]["image_url"]["url"].as_str().unwrap().starts_with("data:image/png;base64,"));
        assert_eq!(parts[1]["text"], "What is it?");
        assert_eq!(b["messages"][0]["content"], "Be brief.");
        let a = s.body(Kind::Audio("wav"), b"RIFF", s.prompt_for(Kind::Audio("wav"), None));
        assert_eq!(a["messages"][1]["content"][0]["input_audio"]["format"], "wav");
        assert_eq!(a["messages"][1]["content"][1]["text"], AUDIO_PROMPT);
    }
}
