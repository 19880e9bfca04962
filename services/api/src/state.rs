//! What every handler shares: the model's text side, limits, service clients.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use mmserve_protocol::{EmbedCacheClient, EncoderClient, EngineClient};
use mmserve_text::{ChatTemplate, TextTokenizer};

use crate::dispatch::Dispatcher;
use crate::media::MediaLimits;

pub struct AppState {
    pub model_name: String,
    pub tokenizer: TextTokenizer,
    pub template: ChatTemplate,
    /// The id the chat template writes for one image.
    pub image_token: u32,
    pub tokens_per_image: u32,
    /// Everything besides the bytes that changes an image's embedding.
    pub fingerprint: String,
    pub limits: MediaLimits,
    pub max_model_len: u64,
    pub cache: EmbedCacheClient,
    pub encoder: EncoderClient,
    pub engine: EngineClient,
    pub dispatcher: Arc<Dispatcher>,
    /// This api process's id at the engine (the high bits of its request ids).
    pub client_id: u64,
    next_request: AtomicU64,
    pub metrics: Metrics,
    pub timeouts: Timeouts,
}

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub rpc: std::time::Duration,
    pub encode: std::time::Duration,
    /// Longest wait for the next token of a running request.
    pub token: std::time::Duration,
}

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
}

impl Metrics {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

impl AppState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model_name: String,
        tokenizer: TextTokenizer,
        template: ChatTemplate,
        image_token: u32,
        tokens_per_image: u32,
        fingerprint: String,
        limits: MediaLimits,
        max_model_len: u64,
        clients: (EmbedCacheClient, EncoderClient, EngineClient),
        timeouts: Timeouts,
    ) -> Self {
        let client_id = u64::from(std::process::id());
        AppState {
            model_name,
            tokenizer,
            template,
            image_token,
            tokens_per_image,
            fingerprint,
            limits,
            max_model_len,
            cache: clients.0,
            encoder: clients.1,
            engine: clients.2,
            dispatcher: Arc::new(Dispatcher::default()),
            client_id,
            next_request: AtomicU64::new(1),
            metrics: Metrics::default(),
            timeouts,
        }
    }

    /// Unique at the engine: this process's id in the high bits.
    pub fn new_request_id(&self) -> u64 {
        (self.client_id << 40) | self.next_request.fetch_add(1, Ordering::Relaxed)
    }
}
