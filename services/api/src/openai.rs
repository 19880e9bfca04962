//! OpenAI chat-completion JSON: what clients send and what they get back. Only this
//! crate knows these shapes.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ApiError;

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
    /// vLLM's: keep only the prompt's last k tokens (-1: the context); media items are
    /// never split.
    #[serde(default)]
    pub truncate_prompt_tokens: Option<i64>,
    /// OpenAI's function tools and the choice among them (see `tools.rs`).
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// `false`: at most one tool call.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// `/v1/completions`: the prompt as given, instead of `messages` and the template.
    #[serde(skip)]
    pub raw_prompt: Option<RawPrompt>,
    /// Every other field: refused when it is one mmserve does not implement
    /// ([`UNSUPPORTED`]), else logged and ignored, as vLLM does.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// Fields of OpenAI's chat completion request that mmserve does not implement: a request
/// with one is refused (400, naming it) rather than answered as if it were honoured.
pub const UNSUPPORTED: &[&str] =
    &["functions", "function_call", "audio", "modalities", "prediction", "web_search_options", "reasoning_effort"];

/// The fields that ask for structured output: OpenAI's `response_format`, vLLM's
/// `structured_outputs` and its older `guided_*` spellings.
const CONSTRAINT_FIELDS: &[&str] =
    &["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"];

impl ChatRequest {
    /// The output constraint the request asks for (at most one) and the field that asked;
    /// `Err((field, why))` for a malformed one. (The constraint itself is checked by
    /// compiling it.)
    pub fn constraint(&self) -> Result<Option<(&'static str, mmserve_protocol::Constraint)>, (String, String)> {
        use mmserve_protocol::Constraint;
        let given: Vec<(&'static str, &Value)> = CONSTRAINT_FIELDS
            .iter()
            .filter_map(|&k| self.other.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
            .collect();
        let bad = |field: &str, why: &str| (field.to_string(), why.to_string());
        let schema_text = |field: &str, v: &Value| -> Result<String, (String, String)> {
            match v {
                Value::Object(_) => Ok(v.to_string()),
                Value::String(s) => Ok(s.clone()),
                _ => Err(bad(field, "a JSON schema must be an object (or its text)")),
            }
        };
        let string = |field: &str, v: &Value| -> Result<String, (String, String)> {
            v.as_str().map(str::to_string).ok_or_else(|| bad(field, "must be a string"))
        };
        let choice = |field: &str, v: &Value| -> Result<Vec<String>, (String, String)> {
            let list = v.as_array().ok_or_else(|| bad(field, "must be a list of strings"))?;
            list.iter()
                .map(|o| o.as_str().map(str::to_string).ok_or_else(|| bad(field, "must be a list of strings")))
                .collect()
        };
        let mut found = Vec::new();
        for (field, v) in given {
            let c = match field {
                "response_format" => match v.get("type").and_then(Value::as_str) {
                    Some("text") => None,
                    Some("json_object") => Some(Constraint::JsonObject),
                    Some("json_schema") => {
                        let schema = v
                            .get("json_schema")
                            .and_then(|j| j.get("schema"))
                            .ok_or_else(|| bad(field, "json_schema needs `json_schema.schema`"))?;
                        Some(Constraint::JsonSchema(schema_text(field, schema)?))
                    }
                    _ => return Err(bad(field, "response_format.type must be text, json_object or json_schema")),
                },
                "structured_outputs" => {
                    let obj = v.as_object().ok_or_else(|| bad(field, "must be an object"))?;
                    let mut parts = Vec::new();
                    for (k, x) in obj.iter().filter(|(_, x)| !x.is_null()) {
                        let f = format!("structured_outputs.{k}");
                        parts.push(match k.as_str() {
                            "json" => Constraint::JsonSchema(schema_text(&f, x)?),
                            "json_object" if x.as_bool() == Some(true) => Constraint::JsonObject,
                            "regex" => Constraint::Regex(string(&f, x)?),
                            "choice" => Constraint::Choice(choice(&f, x)?),
                            "grammar" => Constraint::Lark(string(&f, x)?),
                            _ => {
                                return Err(bad(
                                    &f,
                                    &format!("`{f}` is not supported (json, json_object, regex, choice, grammar)"),
                                ));
                            }
                        });
                    }
                    if parts.len() > 1 {
                        return Err(bad(field, "give one of json, json_object, regex, choice and grammar"));
                    }
                    parts.pop()
                }
                "guided_json" => Some(Constraint::JsonSchema(schema_text(field, v)?)),
                "guided_regex" => Some(Constraint::Regex(string(field, v)?)),
                "guided_choice" => Some(Constraint::Choice(choice(field, v)?)),
                _ => Some(Constraint::Lark(string(field, v)?)),
            };
            found.extend(c.map(|c| (field, c)));
        }
        match found.len() {
            0 | 1 => Ok(found.pop()),
            _ => Err(bad(found[1].0, "one structured-output constraint per request")),
        }
    }
}

/// Fields OpenAI clients send that change nothing here (metadata), accepted quietly.
const NO_EFFECT: &[&str] = &["user", "store", "metadata", "service_tier"];

impl ChatRequest {
    /// Refuses what is not implemented; returns the unknown fields (to be logged).
    pub fn unsupported(&self) -> Result<Vec<&str>, &str> {
        let mut unknown = Vec::new();
        for (key, value) in &self.other {
            if value.is_null() || NO_EFFECT.contains(&key.as_str()) || CONSTRAINT_FIELDS.contains(&key.as_str()) {
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

/// A completion request's prompt: text (tokenized as is, with the tokenizer's special
/// tokens such as BOS) or token ids.
#[derive(Debug, Clone)]
pub enum RawPrompt {
    Text(String),
    Ids(Vec<u32>),
}

/// The most `logprobs` a completion request may ask for (OpenAI's limit is 5; vLLM's 20).
const MAX_COMPLETION_LOGPROBS: u64 = 20;

impl ChatRequest {
    /// `/v1/completions`' body as a chat request over a raw prompt: `prompt` (a string,
    /// token ids, or a list of one of either), `logprobs` as a count of alternatives,
    /// `max_tokens` 16 unless given (OpenAI's default). `echo`, `suffix` and `best_of`
    /// other than `n` are refused by name; every other field is the chat request's.
    pub fn from_completion(body: Value) -> Result<Self, ApiError> {
        let Value::Object(mut body) = body else {
            return Err(ApiError::bad("invalid completion request: the body must be a JSON object"));
        };
        let bad = |param: &str, message: &str| ApiError::bad_param(param, message.to_string());
        let prompt = body.remove("prompt").ok_or_else(|| bad("prompt", "a completion request needs a `prompt`"))?;
        let ids = |v: &Vec<Value>| -> Option<Vec<u32>> {
            v.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
        };
        let raw = match &prompt {
            Value::String(s) => RawPrompt::Text(s.clone()),
            Value::Array(a) if a.is_empty() => return Err(bad("prompt", "the prompt is empty")),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                RawPrompt::Text(a[0].as_str().unwrap_or_default().into())
            }
            Value::Array(a) if a.len() == 1 && a[0].is_array() => match &a[0] {
                Value::Array(inner) if !inner.is_empty() => {
                    RawPrompt::Ids(ids(inner).ok_or_else(|| bad("prompt", "token ids must be integers"))?)
                }
                _ => return Err(bad("prompt", "the prompt is empty")),
            },
            Value::Array(a) if a.iter().all(Value::is_number) => {
                RawPrompt::Ids(ids(a).ok_or_else(|| bad("prompt", "token ids must be integers"))?)
            }
            Value::Array(_) => {
                return Err(bad("prompt", "one prompt per request: a string, token ids, or a list of one of either"));
            }
            _ => return Err(bad("prompt", "the prompt must be a string or token ids")),
        };
        if body.get("echo").is_some_and(|v| v.as_bool() == Some(true)) {
            return Err(bad("echo", "`echo` is not supported by this server"));
        }
        body.remove("echo");
        if body.get("suffix").is_some_and(|v| !v.is_null() && v.as_str() != Some("")) {
            return Err(bad("suffix", "`suffix` is not supported by this server"));
        }
        body.remove("suffix");
        let n = body.get("n").and_then(Value::as_u64).unwrap_or(1);
        if let Some(best_of) = body.remove("best_of").filter(|v| !v.is_null())
            && best_of.as_u64() != Some(n)
        {
            return Err(bad("best_of", "`best_of` other than `n` is not supported by this server"));
        }
        match body.remove("logprobs") {
            None | Some(Value::Null) => {}
            Some(v) => {
                let k = v
                    .as_u64()
                    .filter(|&k| k <= MAX_COMPLETION_LOGPROBS)
                    .ok_or_else(|| bad("logprobs", "`logprobs` must be an integer from 0 to 20"))?;
                body.insert("logprobs".into(), Value::Bool(true));
                body.insert("top_logprobs".into(), k.into());
            }
        }
        for field in ["messages", "tools", "tool_choice"] {
            if body.get(field).is_some_and(|v| !v.is_null()) {
                return Err(bad(field, &format!("a completion request has a `prompt`, not `{field}`")));
            }
        }
        body.insert("messages".into(), Value::Array(Vec::new()));
        if !body.contains_key("max_tokens") && !body.contains_key("max_completion_tokens") {
            body.insert("max_tokens".into(), 16.into());
        }
        let mut req: ChatRequest = serde_json::from_value(Value::Object(body))
            .map_err(|e| ApiError::bad(format!("invalid completion request: {e}")))?;
        req.raw_prompt = Some(raw);
        Ok(req)
    }
}

/// `/v1/completions`' response from the chat response built for it.
pub fn text_completion(c: ChatCompletion) -> Value {
    let choices: Vec<Value> = c
        .choices
        .into_iter()
        .map(|ch| {
            completion_choice(
                ch.index,
                ch.message.content.unwrap_or_default(),
                ch.logprobs,
                ch.finish_reason,
                ch.token_ids,
                0,
            )
        })
        .collect();
    let mut v = serde_json::json!({
        "id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
        "choices": choices, "usage": c.usage,
    });
    if let Some(ids) = c.prompt_token_ids {
        v["prompt_token_ids"] = ids.into();
    }
    v
}

/// A completion stream's chunk from the chat chunk built for it; `offset`: characters of
/// the choice's text before this chunk (the logprobs' `text_offset` counts from there).
pub fn text_completion_chunk(c: ChatChunk, offset: usize) -> Value {
    let choices: Vec<Value> = c
        .choices
        .into_iter()
        .map(|ch| {
            let text = ch.delta.content.unwrap_or_default();
            completion_choice(ch.index, text, ch.logprobs, ch.finish_reason, ch.token_ids, offset)
        })
        .collect();
    let mut v = serde_json::json!({
        "id": c.id, "object": "text_completion", "created": c.created, "model": c.model, "choices": choices,
    });
    if let Some(usage) = c.usage {
        v["usage"] = serde_json::to_value(usage).unwrap_or_default();
    }
    v
}

/// One choice of a completion (or of a stream's chunk); `offset`: characters of the
/// choice's text before `text`.
fn completion_choice(
    index: u32,
    text: String,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
    token_ids: Option<Vec<u32>>,
    offset: usize,
) -> Value {
    let mut v = serde_json::json!({
        "index": index,
        "text": text,
        "logprobs": logprobs.map(|l| completion_logprobs(&l, offset)),
        "finish_reason": finish_reason,
    });
    if let Some(ids) = token_ids {
        v["token_ids"] = ids.into();
    }
    v
}

/// The legacy completions' logprobs: parallel lists of tokens, their logprobs, the top
/// alternatives as `{token: logprob}`, and each token's character offset in the text.
fn completion_logprobs(l: &Logprobs, mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(l.content.len());
    for t in &l.content {
        text_offset.push(offset);
        offset += t.token.chars().count();
    }
    serde_json::json!({
        "tokens": l.content.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": l.content.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": l.content.iter().map(|t| {
            t.top_logprobs.iter().map(|a| (a.token.clone(), Value::from(a.logprob))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
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
    /// An assistant message's calls (OpenAI's form: `arguments` as JSON text).
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A `tool` message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
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
            // OpenAI's `detail` picks a resolution for its own models; the models served
            // here see every image at the resolution their processor gives it, so it is
            // taken (when valid) and changes nothing.
            if let Some(detail) = v.get("image_url").and_then(|o| o.get("detail")).filter(|d| !d.is_null())
                && !matches!(detail.as_str(), Some("auto" | "low" | "high"))
            {
                return Err(format!("{at}: image_url.detail must be \"auto\", \"low\" or \"high\", got {detail}"));
            }
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
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<crate::tools::ToolCall>>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<crate::tools::CallDelta>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_detail_is_taken_when_valid() {
        for detail in [json_detail("auto"), json_detail("low"), json_detail("high"), Value::Null] {
            let part = serde_json::json!({"type": "image_url", "image_url": {"url": "data:,", "detail": detail}});
            assert!(matches!(parse_part(&part, "p"), Ok(Part::ImageUrl(_))), "{part}");
        }
        let part = serde_json::json!({"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}});
        assert!(parse_part(&part, "p").unwrap_err().contains("image_url.detail"));
    }

    fn json_detail(s: &str) -> Value {
        Value::String(s.into())
    }
}
