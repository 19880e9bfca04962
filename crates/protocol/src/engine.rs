//! The engine service: generation requests in, token events out.

use serde::{Deserialize, Serialize};

/// A media item's place in the prompt: the virtual id range and its arena rows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ItemSpan {
    pub token_id: u64,
    pub token_num: u32,
    pub start_index: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SamplingParams {
    pub max_tokens: u32,
    /// Stop tokens (EOS, `stop_token_ids`) are not allowed before this many tokens.
    pub min_tokens: u32,
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 means off.
    pub top_k: u32,
    /// Keep tokens whose probability is at least `min_p` × the largest; 0 means off.
    pub min_p: f32,
    /// HF's multiplicative penalty over prompt and output tokens; 1 means off.
    pub repetition_penalty: f32,
    /// OpenAI's additive penalties over output tokens.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    /// Stop strings, matched on the detokenized text (also across token boundaries);
    /// the returned text excludes them.
    pub stop: Vec<String>,
    /// `Some(k)`: report the sampled token's log-probability and the `k` most likely.
    pub logprobs: Option<u8>,
    pub skip_special_tokens: bool,
    /// OpenAI's `logit_bias`: added to these tokens' logits before sampling.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// What the output must match, enforced token by token while decoding.
    #[serde(default)]
    pub constraint: Option<Constraint>,
}

/// A structured-output constraint (`response_format`, vLLM's `structured_outputs`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Constraint {
    /// A JSON value matching this JSON schema (its text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            min_tokens: 0,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            logprobs: None,
            skip_special_tokens: true,
            logit_bias: Vec::new(),
            constraint: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Unique per engine; chosen by the api.
    pub id: u64,
    /// The api process whose `next_events` receives this request's events.
    pub client: u64,
    /// Text ids below the vocabulary size; virtual ids (≥ `VIRTUAL_TOKEN_BASE`) inside `items`.
    pub prompt_ids: Vec<u64>,
    pub items: Vec<ItemSpan>,
    /// The cache instance whose arena holds the items' rows.
    pub cache_instance: u64,
    pub params: SamplingParams,
    /// Choice `i > 0` of a request with `n` choices: the id of choice 0, whose prompt
    /// (the same ids) it shares. The engine prefills the prompt once and forks it.
    pub sibling_of: Option<u64>,
    /// Qwen-VL's multimodal rotary positions of the prompt (computed where the prompt is
    /// built); `None` for models whose positions are the token indexes.
    pub positions: Option<MropePrompt>,
    /// The client-facing request id (`x-request-id`), for the engine's log lines.
    pub request_id: String,
}

/// A prompt's M-RoPE positions: temporal, height and width ids per prompt token, and
/// the offset of every later position (`p + delta` in all three).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MropePrompt {
    pub streams: [Vec<i64>; 3],
    pub delta: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// EOS or a stop token.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Aborted by the api (client gone).
    Abort,
    /// The engine failed this request; the message says why.
    Error(String),
    /// A passing condition stopped this request (the embed cache restarted): retry it.
    Retry(String),
}

/// Log-probabilities (under the model, before sampling settings) of one step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
}

/// One step's news for one request: a token and its text, and/or the end.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OutputEvent {
    pub request_id: u64,
    pub token_id: Option<u32>,
    pub logprobs: Option<TokenLogprobs>,
    /// Newly complete text (never half a UTF-8 character); may be empty.
    pub text: String,
    pub finish: Option<FinishReason>,
    /// On the event that ends a request after a token: where its time in the engine went.
    pub timing: Option<RequestTiming>,
}

/// A finished request's time in the engine (vLLM's queue, prefill and decode intervals)
/// and its prompt tokens served from the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestTiming {
    /// From arrival in the engine to its first scheduled step.
    pub queued_s: f64,
    /// From its first scheduled step to its first token.
    pub prefill_s: f64,
    /// From its first token to its last.
    pub decode_s: f64,
    /// Prompt tokens whose keys and values came from the prefix cache (or, for a choice
    /// forked from a sibling, from the sibling's prompt).
    pub cached_tokens: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineInfo {
    pub vocab_size: u64,
    pub max_model_len: u64,
    pub running: u64,
    pub waiting: u64,
    /// Prompt tokens whose KV came from the prefix cache, since start.
    pub prefix_cache_hit_tokens: u64,
    /// Requests preempted (KV pool exhausted; recomputed later), since start.
    pub preemptions: u64,
    /// KV blocks held by running sequences, and in the whole pool.
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    /// Tokens a KV block holds.
    pub kv_block_size: u64,
    /// Prompt tokens computed (prefilled, or recomputed after a preemption), since start.
    pub prefill_tokens: u64,
    /// Choices that started from a sibling's prefilled prompt (fork), since start.
    pub forks: u64,
    /// Model steps since start, and the time spent in them: `schedule_seconds` in the
    /// scheduler (admission, planning, block reservation), `step_seconds` in all.
    pub steps: u64,
    pub schedule_seconds: f64,
    pub step_seconds: f64,
}

#[derive(Debug, Clone, thiserror::Error, Serialize, Deserialize)]
pub enum EngineError {
    #[error("the prompt has {prompt} tokens and asks for {max_tokens} more; the model's context is {limit}")]
    TooLong { prompt: u64, max_tokens: u64, limit: u64 },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("request id {0} is already running")]
    DuplicateId(u64),
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// A passing condition (queue full, the embed cache restarting): retrying may work.
    #[error("{0}")]
    Unavailable(String),
}

#[tarpc::service]
pub trait Engine {
    async fn info() -> EngineInfo;
    /// One request's choices (`n` of them; choice `i > 0` has `sibling_of` set),
    /// submitted at once so that they share one prefill of the prompt.
    async fn submit(choices: Vec<GenerateRequest>) -> Result<(), EngineError>;
    /// Stops a request within one step and frees what it holds; its last event says `Abort`.
    async fn abort(request_id: u64);
    /// Long poll: the events queued for `client`, waiting up to `max_wait_ms` for the
    /// first one (woken by a notification, not by polling).
    async fn next_events(client: u64, max_wait_ms: u64) -> Vec<OutputEvent>;
}
