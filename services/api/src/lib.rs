//! The api service (its own process): the OpenAI-compatible HTTP front end.
//!
//! Only this crate knows OpenAI JSON ([`openai`]); every error becomes an HTTP
//! response in one place ([`error`]). A request's path is in [`generate`].

pub mod dispatch;
pub mod error;
pub mod generate;
pub mod media;
pub mod openai;
pub mod prompt;
pub mod routes;
pub mod state;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mmserve_config::{ModelConfig, ModelDir};
use mmserve_embed_cache::ArenaView;
use mmserve_media::{ClipImageProcessor, ImageLimits};
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{EncoderClient, EngineClient, deadline, transport};
use mmserve_text::{ChatTemplate, TextTokenizer};

use crate::media::MediaLimits;
use crate::state::{AppState, Timeouts};

/// Flags of `mmserve api`.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiArgs {
    #[arg(long, env = "MMSERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (announced on the readiness line).
    #[arg(long, env = "MMSERVE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Hugging Face model directory.
    #[arg(long, env = "MMSERVE_MODEL")]
    pub model: PathBuf,
    /// The name clients use in `model`; defaults to the directory's name.
    #[arg(long, env = "MMSERVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    #[arg(long, env = "MMSERVE_CACHE_SOCKET")]
    pub cache_socket: PathBuf,
    #[arg(long, env = "MMSERVE_ENCODER_SOCKET")]
    pub encoder_socket: PathBuf,
    #[arg(long, env = "MMSERVE_ENGINE_SOCKET")]
    pub engine_socket: PathBuf,
    /// Largest request body in bytes (413 above it).
    #[arg(long, env = "MMSERVE_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Largest media item in bytes.
    #[arg(long, env = "MMSERVE_MAX_ITEM_BYTES", default_value_t = 20 << 20)]
    pub max_item_bytes: usize,
    /// Most media items in one request.
    #[arg(long, env = "MMSERVE_MAX_ITEMS_PER_REQUEST", default_value_t = 16)]
    pub max_items_per_request: usize,
    /// Most pixels of one image, read from its header before decoding.
    #[arg(long, env = "MMSERVE_MAX_IMAGE_PIXELS", default_value_t = 178_956_970)]
    pub max_image_pixels: u64,
    /// Longest wait in line for embed-cache capacity, in seconds (then 503).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_WAIT_TIMEOUT_S", default_value_t = 30)]
    pub embed_cache_wait_timeout_s: u64,
    /// Longest wait for the next token of a running request, in seconds.
    #[arg(long, env = "MMSERVE_TOKEN_TIMEOUT_S", default_value_t = 120)]
    pub token_timeout_s: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiServiceError {
    #[error(transparent)]
    Config(#[from] mmserve_config::ConfigError),
    #[error(transparent)]
    Text(#[from] mmserve_text::TextError),
    #[error(transparent)]
    Media(#[from] mmserve_media::MediaError),
    #[error("the model directory has no preprocessor_config.json")]
    NoPreprocessor,
    #[error("connecting to {service}: {message}")]
    Connect { service: &'static str, message: String },
    #[error("listening on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

async fn connect<In, Out>(
    service: &'static str,
    path: &std::path::Path,
) -> Result<transport::UnixTransport<In, Out>, ApiServiceError>
where
    In: serde::de::DeserializeOwned,
    Out: serde::Serialize,
{
    transport::connect(path, CONNECT_TIMEOUT)
        .await
        .map_err(|e| ApiServiceError::Connect { service, message: e.to_string() })
}

/// Builds the shared state: the model's text side and clients of the three services.
pub async fn build_state(args: &ApiArgs) -> Result<Arc<AppState>, ApiServiceError> {
    let dir = ModelDir::open(&args.model)?;
    let ModelConfig::Llava(cfg) = &dir.config;
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let template = ChatTemplate::new(dir.chat_template()?.ok_or(mmserve_text::TextError::NoChatTemplate)?, &tokenizer)?;
    let pp = dir.optional_json("preprocessor_config.json")?.ok_or(ApiServiceError::NoPreprocessor)?;
    let processor = ClipImageProcessor::from_json(&pp)?;
    let name = args.served_model_name.clone().unwrap_or_else(|| dir.name.clone());
    let fingerprint = format!("{name};{}", processor.fingerprint());

    let cache = CacheConnection::connect(&args.cache_socket, CONNECT_TIMEOUT)
        .await
        .map_err(|e| ApiServiceError::Connect { service: "embed-cache", message: e.to_string() })?;
    let arena = cache
        .call(|c| async move { c.arena(deadline(CONNECT_TIMEOUT)).await })
        .await
        .map_err(|e| ApiServiceError::Connect { service: "embed-cache", message: e.to_string() })?;
    let arena = ArenaView::open(&arena)
        .map_err(|e| ApiServiceError::Connect { service: "embed-cache", message: e.to_string() })?;
    let encoder = EncoderClient::new(Default::default(), connect("encoder", &args.encoder_socket).await?).spawn();
    let engine = EngineClient::new(Default::default(), connect("engine", &args.engine_socket).await?).spawn();
    let info = engine
        .info(deadline(CONNECT_TIMEOUT))
        .await
        .map_err(|e| ApiServiceError::Connect { service: "engine", message: e.to_string() })?;

    let state = AppState::new(
        name,
        tokenizer,
        template,
        cfg.image_token_index,
        cfg.image_token_count() as u32,
        fingerprint,
        MediaLimits {
            max_item_bytes: args.max_item_bytes,
            max_items: args.max_items_per_request,
            image: ImageLimits { max_pixels: args.max_image_pixels },
        },
        info.max_model_len,
        (cache, encoder, engine),
        arena,
        Timeouts {
            rpc: Duration::from_secs(10),
            cache_wait: Duration::from_secs(args.embed_cache_wait_timeout_s),
            encode: Duration::from_secs(300),
            token: Duration::from_secs(args.token_timeout_s),
        },
    );
    Ok(Arc::new(state))
}

/// Serves HTTP until `shutdown` resolves.
pub async fn run(args: ApiArgs, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ApiServiceError> {
    let state = build_state(&args).await?;
    let dispatcher = state.dispatcher.clone();
    let (engine, client) = (state.engine.clone(), state.client_id);
    tokio::spawn(async move { dispatcher.run(engine, client).await });

    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ApiServiceError::Listen { addr: addr.clone(), source })?;
    let local: SocketAddr = listener.local_addr().map_err(|source| ApiServiceError::Listen { addr, source })?;
    mmserve_protocol::ready::announce_with("api", &format!("http://{local}"));
    let app = routes::router(state, args.max_body_bytes);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| ApiServiceError::Listen { addr: local.to_string(), source })
}
