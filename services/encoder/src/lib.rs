//! The encoder service (its own process).
//!
//! `encode` calls from any number of requests feed one queue. A preparing stage
//! ([`prep`]) pins the items still to encode and preprocesses them on all cores as they
//! come; the tower thread ([`worker`]) takes everything prepared (up to `--max-batch`
//! items), so items of concurrent requests share one tower forward, while the next ones
//! are preprocessed. Rows go straight into the arena slots the cache assigned; then the
//! items are marked ready. Items already ready, or in flight for another request, are
//! never encoded twice.

mod prep;
mod service;
mod tower;
mod worker;

use std::path::PathBuf;
use std::time::Duration;

use mmserve_protocol::reconnect::CacheConnection;

pub use service::EncoderService;

/// Flags of `mmserve encoder`.
#[derive(Debug, Clone, clap::Args)]
pub struct EncoderArgs {
    /// Unix socket to serve on.
    #[arg(long, env = "MMSERVE_ENCODER_SOCKET")]
    pub socket: PathBuf,
    /// The embed-cache service's socket.
    #[arg(long, env = "MMSERVE_CACHE_SOCKET")]
    pub cache_socket: PathBuf,
    /// Hugging Face model directory.
    #[arg(long, env = "MMSERVE_MODEL")]
    pub model: PathBuf,
    /// Most items in one tower forward.
    #[arg(long, env = "MMSERVE_ENCODER_MAX_BATCH", default_value_t = 32)]
    pub max_batch: usize,
    /// Items preprocessed at once, each on its own thread (0: every core when the tower
    /// runs on a GPU, half of them when it shares the CPU with the tower and the engine).
    #[arg(long, env = "MMSERVE_ENCODER_PREP_THREADS", default_value_t = 0)]
    pub prep_threads: usize,
    /// How long an item may wait for its raw data or its encoding, in milliseconds.
    #[arg(
        long = "encoder-timeout-ms",
        alias = "timeout-ms",
        env = "MMSERVE_ENCODER_TIMEOUT_MS",
        default_value_t = 120_000
    )]
    pub timeout_ms: u64,
    /// Longest connect to the embed cache at start, first call included, in seconds.
    #[arg(long, env = "MMSERVE_CONNECT_TIMEOUT_S", default_value_t = 10)]
    pub connect_timeout_s: u64,
    #[command(flatten)]
    pub placement: mmserve_models::PlacementArgs,
}

#[derive(Debug, thiserror::Error)]
pub enum EncoderServiceError {
    #[error(transparent)]
    Config(#[from] mmserve_config::ConfigError),
    #[error(transparent)]
    Model(#[from] mmserve_models::ModelError),
    #[error(transparent)]
    Media(#[from] mmserve_media::MediaError),
    #[error("model directory has no preprocessor_config.json")]
    NoPreprocessor,
    #[error("preprocessing makes {got}×{got} images but the vision tower takes {want}×{want}")]
    SizeMismatch { got: usize, want: usize },
    #[error("{0}")]
    Mismatch(String),
    #[error("preprocessor_config.json: {0}")]
    Audio(#[from] mmserve_media::audio::AudioError),
    #[error("connecting to the embed cache: {0}")]
    Cache(String),
    #[error(transparent)]
    Shm(#[from] mmserve_shm::ShmError),
    #[error("binding {path}: {source}")]
    Bind { path: PathBuf, source: std::io::Error },
}

/// Loads the model, connects to the cache, serves until `shutdown` resolves.
pub async fn run(args: EncoderArgs, shutdown: impl Future<Output = ()>) -> Result<(), EncoderServiceError> {
    let cache = CacheConnection::connect(&args.cache_socket, Duration::from_secs(args.connect_timeout_s.max(1)))
        .await
        .map_err(|e| EncoderServiceError::Cache(e.to_string()))?;
    let service = EncoderService::start(&args, std::sync::Arc::new(cache)).await?;
    let listener = mmserve_protocol::transport::bind(&args.socket)
        .map_err(|source| EncoderServiceError::Bind { path: args.socket.clone(), source })?;
    mmserve_protocol::ready::announce("encoder");
    let server = mmserve_protocol::Encoder::serve(service);
    tokio::select! {
        _ = async move { mmserve_protocol::serve_unix!(listener, server) } => {}
        _ = shutdown => {}
    }
    let _ = std::fs::remove_file(&args.socket);
    Ok(())
}
