//! What every handler shares: the model's text side, limits, service clients.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use mmserve_arena::{ArenaError, ArenaMap, ArenaView};
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{EncoderClient, EngineClient};
use mmserve_text::{ChatTemplate, TextTokenizer};

use crate::dispatch::Dispatcher;
use crate::error::ApiError;
use crate::load::LoadGate;
use crate::media::MediaLimits;
use crate::prompt::LiteralMarks;

pub struct AppState {
    /// The served model's name, in every response.
    pub model_name: String,
    /// Other names requests may use for it (`--served-model-name a,b,…` past the first).
    pub aliases: Vec<String>,
    pub tokenizer: TextTokenizer,
    pub template: ChatTemplate,
    /// The id the chat template writes for one media item (`<image>`, `<|AUDIO|>`).
    pub item_token: u32,
    /// The model takes M-RoPE positions (Qwen-VL): the api computes them per prompt.
    pub mrope: bool,
    /// Rows of the model's logits (token ids `logit_bias` may name).
    pub vocab: u64,
    /// Everything besides the bytes that changes an item's embedding.
    pub fingerprint: String,
    pub limits: MediaLimits,
    pub max_model_len: u64,
    pub cache: CacheConnection,
    /// The cache's arenas as last mapped (items' bytes are written through it).
    arena: ArenaMap,
    pub encoder: EncoderClient,
    pub engine: EngineClient,
    pub dispatcher: Arc<Dispatcher>,
    /// This api process's id at the engine (the high bits of its request ids).
    pub client_id: u64,
    next_request: AtomicU64,
    /// Renders `/metrics` (the process's recorder, see [`crate::metrics`]).
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    pub timeouts: Timeouts,
    pub load: Arc<LoadGate>,
    /// Set when clients' text is read as plain text (`--special-tokens-in-content text`).
    pub literal_marks: Option<LiteralMarks>,
    /// The model's structured-output compiler (constraints are checked here).
    pub grammars: Arc<mmserve_grammar::Grammars>,
    /// What happens to a prompt past the context (`--long-truncation-mode`).
    pub truncation: crate::truncate::TruncationMode,
    /// How the model's own tool calls are read (resolved against the chat template).
    pub tool_parser: crate::tools::ToolParser,
}

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Longest call to a sibling service.
    pub rpc: std::time::Duration,
    /// Longest check of one sibling service by `/health` and `/metrics`.
    pub health: std::time::Duration,
    /// Between keep-alive comments on a quiet event stream.
    pub sse_keep_alive: std::time::Duration,
    /// Longest wait in line for embed-cache capacity.
    pub cache_wait: std::time::Duration,
    pub encode: std::time::Duration,
    /// Longest wait for the next token of a running request.
    pub token: std::time::Duration,
    /// Longest wait for a request's body.
    pub body: std::time::Duration,
}

impl AppState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model_name: String,
        (tokenizer, grammars): (TextTokenizer, Arc<mmserve_grammar::Grammars>),
        template: ChatTemplate,
        item_token: u32,
        fingerprint: String,
        limits: MediaLimits,
        max_model_len: u64,
        clients: (CacheConnection, EncoderClient, EngineClient),
        (mrope, vocab): (bool, u64),
        arena: ArenaMap,
        load: Arc<LoadGate>,
        timeouts: Timeouts,
    ) -> Self {
        let client_id = u64::from(std::process::id());
        let metrics = crate::metrics::install(&model_name, max_model_len);
        AppState {
            model_name,
            tokenizer,
            template,
            item_token,
            mrope,
            vocab,
            fingerprint,
            limits,
            max_model_len,
            cache: clients.0,
            arena,
            encoder: clients.1,
            engine: clients.2,
            dispatcher: Arc::new(Dispatcher::default()),
            client_id,
            next_request: AtomicU64::new(1),
            metrics,
            timeouts,
            load,
            literal_marks: None,
            grammars,
            aliases: Vec::new(),
            truncation: crate::truncate::TruncationMode::None,
            tool_parser: crate::tools::ToolParser::None,
        }
    }

    /// The arenas of cache instance `instance`, mapped anew if the cache restarted.
    pub async fn arena_for(&self, instance: u64) -> Result<Arc<ArenaView>, ApiError> {
        let mapped = self.arena.view(instance, &self.cache, self.timeouts.rpc).await.map_err(|e| match e {
            ArenaError::Unavailable(e) => ApiError::from(e),
            ArenaError::Restarted => ApiError::Unavailable(e.to_string()),
            ArenaError::Shm(_) => ApiError::Internal(e.to_string()),
        })?;
        Ok(mapped.view().clone())
    }

    /// Whether requests may name the model `name`.
    pub fn serves(&self, name: &str) -> bool {
        name == self.model_name || self.aliases.iter().any(|a| a == name)
    }

    /// Unique at the engine: this process's id in the high bits.
    pub fn new_request_id(&self) -> u64 {
        (self.client_id << 40) | self.next_request.fetch_add(1, Ordering::Relaxed)
    }
}
