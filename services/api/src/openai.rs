//! OpenAI chat-completion JSON: what clients send and what they get back. Only this
//! crate knows these shapes.

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub stop: Option<Value>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u8>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    // Extensions (vLLM's names).
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub min_tokens: Option<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
    /// Adds `token_ids` to each choice (and `prompt_token_ids` to the response).
    #[serde(default)]
    pub return_token_ids: bool,
    /// Token id (as a string, OpenAI's form) → a bias from -100 to 100 added to its logit.
    #[serde(default)]
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    /// vLLM's per-request preprocessing settings (Qwen-VL: `min_pixels`, `max_pixels`).
    #[serde(default)]
    pub mm_processor_kwargs: Option<serde_json::Map<String, Value>>,
    /// Every other field: refused when it is one mmserve does not implement
    /// ([`UNSUPPORTED`]), else logged and ignored, as vLLM does.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// Fields of OpenAI's chat completion request that mmserve does not implement: a request
/// with one is refused (400, naming it) rather than answered as if it were honoured.
pub const UNSUPPORTED: &[&str] = &[
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
];

/// Fields OpenAI clients send that change nothing here (metadata), accepted quietly.
const NO_EFFECT: &[&str] = &["user", "store", "metadata", "service_tier"];

impl ChatRequest {
    /// Refuses what is not implemented; returns the unknown fields (to be logged).
    pub fn unsupported(&self) -> Result<Vec<&str>, &str> {
        let mut unknown = Vec::new();
        for (key, value) in &self.other {
            if value.is_null() || NO_EFFECT.contains(&key.as_str()) {
                continue;
            }
            if UNSUPPORTED.contains(&key.as_str()) {
                return Err(key);
            }
            unknown.push(key.as_str());
        }
        Ok(unknown)
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

/// A content part after validation.
#[derive(Debug)]
pub enum Part {
    Text(String),
    ImageUrl(String),
    Audio(AudioSource),
}

/// Where an audio item's bytes are.
#[derive(Debug, Clone)]
pub enum AudioSource {
    /// OpenAI's `input_audio`: base64 bytes and the container format (`wav`, `mp3`, …).
    Inline { data: String, format: Option<String> },
    /// `audio_url` (vLLM's extension): a `data:`, `http(s)://` or `file://` URL.
    Url(String),
}

/// Parses one content part; anything but `text`, `image_url`, `input_audio` and
/// `audio_url` is refused by name.
pub fn parse_part(v: &Value, at: &str) -> Result<Part, String> {
    let kind =
        v.get("type").and_then(Value::as_str).ok_or_else(|| format!("{at}: a content part needs a string `type`"))?;
    match kind {
        "text" => v
            .get("text")
            .and_then(Value::as_str)
            .map(|t| Part::Text(t.to_string()))
            .ok_or_else(|| format!("{at}: a text part needs a string `text`")),
        "image_url" => {
            let url = match v.get("image_url") {
                Some(Value::String(s)) => Some(s.as_str()),
                Some(obj) => obj.get("url").and_then(Value::as_str),
                None => None,
            };
            url.map(|u| Part::ImageUrl(u.to_string()))
                .ok_or_else(|| format!("{at}: an image_url part needs `image_url.url`"))
        }
        "input_audio" => {
            let obj = v.get("input_audio").ok_or_else(|| format!("{at}: an input_audio part needs `input_audio`"))?;
            let data = obj
                .get("data")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("{at}: input_audio needs base64 `data`"))?;
            let format = obj.get("format").and_then(Value::as_str).map(str::to_string);
            Ok(Part::Audio(AudioSource::Inline { data: data.to_string(), format }))
        }
        "audio_url" => {
            let url = match v.get("audio_url") {
                Some(Value::String(s)) => Some(s.as_str()),
                Some(obj) => obj.get("url").and_then(Value::as_str),
                None => None,
            };
            url.map(|u| Part::Audio(AudioSource::Url(u.to_string())))
                .ok_or_else(|| format!("{at}: an audio_url part needs `audio_url.url`"))
        }
        other => Err(format!(
            "{at}: unsupported content part type {other:?} (supported: text, image_url, input_audio, audio_url)"
        )),
    }
}

#[derive(Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    pub prompt_tokens_details: PromptDetails,
}

#[derive(Debug, Serialize)]
pub struct PromptDetails {
    /// Prompt tokens whose keys and values came from the prefix cache (OpenAI's field).
    pub cached_tokens: u64,
    pub image_tokens: u64,
    pub audio_tokens: u64,
}

#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u64>>,
}

#[derive(Debug, Serialize)]
pub struct Choice {
    pub index: u32,
    pub message: AssistantMessage,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<Logprobs>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// OpenAI's `logprobs` object of a choice (or of a chunk's choice).
#[derive(Debug, Default, Serialize)]
pub struct Logprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<Logprobs>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}
