//! The engine service (its own process): router, worker and detokenizer in one loop.
//!
//! The tarpc face ([`service`]) turns `submit` / `abort` into commands on a bounded
//! channel; the model thread ([`model_loop`]) owns every running sequence and wires four
//! parts, one batched forward step at a time (new requests prefill in the same step in
//! which running ones decode): the [`scheduler`] plans (admission, chunked prefill,
//! preemption, KV blocks; pure), the [`runner`] executes the plan on the model, the
//! [`sampler`] chooses tokens (on the device or the host), and the [`output`] processor
//! detokenizes, matches stops and pushes events into the [`outbox`], from which each api
//! process long-polls its own.

pub mod admission;
mod inputs;
pub mod kv;
mod masks;
mod model_loop;
mod outbox;
mod output;
mod runner;
mod sampler;
pub mod scheduler;
mod service;
mod stops;

use std::path::PathBuf;
use std::time::Duration;

pub use service::EngineService;

/// Flags of `mmserve engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Unix socket to serve on.
    #[arg(long, env = "MMSERVE_ENGINE_SOCKET")]
    pub socket: PathBuf,
    /// The embed-cache service's socket (for the arena's location).
    #[arg(long, env = "MMSERVE_CACHE_SOCKET")]
    pub cache_socket: PathBuf,
    /// Hugging Face model directory.
    #[arg(long, env = "MMSERVE_MODEL")]
    pub model: PathBuf,
    /// Most sequences decoding at once.
    #[arg(long, env = "MMSERVE_MAX_RUNNING_REQUESTS", default_value_t = 32)]
    pub max_running_requests: usize,
    /// The context (prompt and output tokens) a request may take, at most the model's
    /// `max_position_embeddings` (its default).
    #[arg(long, env = "MMSERVE_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Longest connect to the embed cache (at start, and to map its arenas after a
    /// restart), first call included, in seconds.
    #[arg(long, env = "MMSERVE_CONNECT_TIMEOUT_S", default_value_t = 10)]
    pub connect_timeout_s: u64,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub placement: mmserve_models::PlacementArgs,
}

/// KV cache and scheduling flags (shared with `mmserve serve`, which passes them on).
#[derive(Debug, Clone, clap::Args)]
pub struct KvArgs {
    /// Bytes of the paged KV pool (K and V of every layer), e.g. `256MiB`.
    #[arg(long, env = "MMSERVE_KV_CACHE_MEMORY", default_value = "256MiB")]
    pub kv_cache_memory: mmserve_arena::ByteSize,
    /// Tokens per KV block.
    #[arg(long, env = "MMSERVE_BLOCK_SIZE", default_value_t = kv::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Most tokens computed in one step across the batch (prefill chunks plus decodes).
    #[arg(long, env = "MMSERVE_CHUNKED_PREFILL_SIZE", default_value_t = 512)]
    pub chunked_prefill_size: usize,
    /// Turn the prefix cache off (no KV blocks shared between requests).
    #[arg(long, env = "MMSERVE_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Output length (tokens) that admission assumes per request instead of its full
    /// `max_tokens`: admits more at once, preempting when the pool runs out anyway.
    /// Unset: the 90th percentile of recently finished requests' lengths while the pool
    /// is less than 85% used, the full `max_tokens` when it is busier.
    #[arg(long, env = "MMSERVE_EXPECTED_OUTPUT_TOKENS")]
    pub expected_output_tokens: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineServiceError {
    #[error(transparent)]
    Config(#[from] mmserve_config::ConfigError),
    #[error(transparent)]
    Model(#[from] mmserve_models::ModelError),
    #[error(transparent)]
    Text(#[from] mmserve_text::TextError),
    #[error("embed cache: {0}")]
    Cache(String),
    #[error("KV cache: {0}")]
    Kv(String),
    #[error(transparent)]
    Shm(#[from] mmserve_shm::ShmError),
    #[error("binding {path}: {source}")]
    Bind { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Grammar(#[from] mmserve_grammar::GrammarError),
    #[error("--max-model-len {asked} is more than the model's max_position_embeddings ({model}), or 0")]
    MaxModelLen { asked: usize, model: usize },
}

pub async fn run(args: EngineArgs, shutdown: impl Future<Output = ()>) -> Result<(), EngineServiceError> {
    let connect_timeout = Duration::from_secs(args.connect_timeout_s.max(1));
    let cache = mmserve_protocol::reconnect::CacheConnection::connect(&args.cache_socket, connect_timeout)
        .await
        .map_err(|e| EngineServiceError::Cache(e.to_string()))?;
    let arena = cache
        .call(|c| async move { c.arena(mmserve_protocol::deadline(connect_timeout)).await })
        .await
        .map_err(|e| EngineServiceError::Cache(e.to_string()))?;
    let service = EngineService::start(&args, arena, cache)?;
    let listener = mmserve_protocol::transport::bind(&args.socket)
        .map_err(|source| EngineServiceError::Bind { path: args.socket.clone(), source })?;
    mmserve_protocol::ready::announce("engine");
    let server = mmserve_protocol::Engine::serve(service.clone());
    tokio::select! {
        _ = async move { mmserve_protocol::serve_unix!(listener, server) } => {}
        _ = shutdown => {}
    }
    service.stop();
    let _ = std::fs::remove_file(&args.socket);
    Ok(())
}
