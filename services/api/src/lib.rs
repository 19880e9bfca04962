//! The api service (its own process): the OpenAI-compatible HTTP front end.
//!
//! Only this crate knows OpenAI JSON ([`openai`]); every error becomes an HTTP
//! response in one place ([`error`]). A request's path is in [`generate`].

pub mod cpu;
pub mod dispatch;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod http;
pub mod load;
pub mod media;
pub mod openai;
pub mod prompt;
pub mod routes;
pub mod state;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mmserve_arena::ArenaMap;
use mmserve_config::{ModelConfig, ModelDir};
use mmserve_media::audio::{AudioLimits, WhisperFeatureExtractor};
use mmserve_media::{ImageLimits, ImageProcessor};
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{EncoderClient, EngineClient, deadline, transport};
use mmserve_text::{ChatTemplate, TextTokenizer};

use crate::fetch::FetchPolicy;
use crate::media::{MediaLimits, ModelMedia};
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
    #[command(flatten)]
    pub media: MediaArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Longest wait in line for embed-cache capacity, in seconds (then 503).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_WAIT_TIMEOUT_S", default_value_t = 30)]
    pub embed_cache_wait_timeout_s: u64,
    /// Longest wait for the next token of a running request, in seconds.
    #[arg(long, env = "MMSERVE_TOKEN_TIMEOUT_S", default_value_t = 120)]
    pub token_timeout_s: u64,
}

/// Limits and fetching rules for requests and their media (also flags of `serve`,
/// which hands them to the api process).
#[derive(Debug, Clone, clap::Args)]
pub struct MediaArgs {
    /// Largest request body in bytes (413 above it).
    #[arg(long, env = "MMSERVE_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Largest media item in bytes.
    #[arg(long, env = "MMSERVE_MAX_ITEM_BYTES", default_value_t = 20 << 20)]
    pub max_item_bytes: usize,
    /// Hosts image and audio URLs may be fetched from (comma-separated; `*.example.com`
    /// for subdomains). Without it (or --allow-all-media-domains) only data: URLs work.
    #[arg(long, env = "MMSERVE_ALLOWED_MEDIA_DOMAINS", value_delimiter = ',')]
    pub allowed_media_domains: Vec<String>,
    /// Fetch media from any host (loopback and private addresses stay refused).
    #[arg(long, env = "MMSERVE_ALLOW_ALL_MEDIA_DOMAINS")]
    pub allow_all_media_domains: bool,
    /// Also fetch from loopback, private, link-local and other reserved addresses.
    #[arg(long, env = "MMSERVE_ALLOW_PRIVATE_MEDIA_ADDRESSES")]
    pub allow_private_media_addresses: bool,
    /// Directory under which file: URLs may be read (symlinks resolved first).
    #[arg(long, env = "MMSERVE_ALLOWED_LOCAL_MEDIA_PATH")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// Longest fetch of one media URL, redirects included, in seconds.
    #[arg(long, env = "MMSERVE_MEDIA_FETCH_TIMEOUT_S", default_value_t = 10)]
    pub media_fetch_timeout_s: u64,
    /// Most redirects followed per media URL.
    #[arg(long, env = "MMSERVE_MEDIA_MAX_REDIRECTS", default_value_t = 3)]
    pub media_max_redirects: usize,
    /// Media items checked and hashed at once (0: twice the cores).
    #[arg(long, env = "MMSERVE_MEDIA_WORKERS", default_value_t = 0)]
    pub media_workers: usize,
    /// Most media items in one request.
    #[arg(long, env = "MMSERVE_MAX_ITEMS_PER_REQUEST", default_value_t = 16)]
    pub max_items_per_request: usize,
    /// Most pixels of one image, read from its header before decoding.
    #[arg(long, env = "MMSERVE_MAX_IMAGE_PIXELS", default_value_t = 178_956_970)]
    pub max_image_pixels: u64,
    /// Longest audio clip in seconds, read from the container header where it states a
    /// length, else counted while decoding. The model hears the first 30 s.
    #[arg(long, env = "MMSERVE_MAX_AUDIO_SECONDS", default_value_t = 600.0)]
    pub max_audio_seconds: f64,
}

/// How prompts are read (also flags of `serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct PromptArgs {
    /// How special tokens' spellings in messages' text are read: `parse` (as special
    /// tokens, as transformers and vLLM do) or `text` (as plain text: a client cannot
    /// write the chat template's control tokens or media tags).
    #[arg(long, env = "MMSERVE_SPECIAL_TOKENS_IN_CONTENT", value_enum, default_value = "parse")]
    pub special_tokens_in_content: prompt::SpecialTokens,
}

impl PromptArgs {
    pub fn to_args(&self) -> Vec<String> {
        let v = clap::ValueEnum::to_possible_value(&self.special_tokens_in_content).expect("no skipped values");
        vec![format!("--special-tokens-in-content={}", v.get_name())]
    }
}

/// Bounds on the load one api process takes (also flags of `serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Most requests waiting for their first token (fetching media, waiting for the
    /// cache, the encoder or the engine); beyond it new requests get 429 with Retry-After.
    #[arg(long, env = "MMSERVE_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// Most prompt tokens of the requests waiting for their first token (0: 256 times
    /// the model's context); beyond it new requests get 429 with Retry-After.
    #[arg(long, env = "MMSERVE_MAX_QUEUED_PROMPT_TOKENS", default_value_t = 0)]
    pub max_queued_prompt_tokens: u64,
    /// Most open HTTP connections; more wait in the listen backlog.
    #[arg(long, env = "MMSERVE_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (also the idle limit of a
    /// kept-alive connection); then the connection is closed.
    #[arg(long, env = "MMSERVE_HEADER_READ_TIMEOUT_S", default_value_t = 10)]
    pub header_read_timeout_s: u64,
    /// Seconds a client has to send a request's body; then 408.
    #[arg(long, env = "MMSERVE_BODY_READ_TIMEOUT_S", default_value_t = 60)]
    pub body_read_timeout_s: u64,
}

impl LoadArgs {
    pub fn to_args(&self) -> Vec<String> {
        vec![
            format!("--max-queued-requests={}", self.max_queued_requests),
            format!("--max-queued-prompt-tokens={}", self.max_queued_prompt_tokens),
            format!("--max-connections={}", self.max_connections),
            format!("--header-read-timeout-s={}", self.header_read_timeout_s),
            format!("--body-read-timeout-s={}", self.body_read_timeout_s),
        ]
    }
}

impl MediaArgs {
    /// The same settings as command-line flags, for a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--max-body-bytes={}", self.max_body_bytes),
            format!("--max-item-bytes={}", self.max_item_bytes),
            format!("--max-items-per-request={}", self.max_items_per_request),
            format!("--max-image-pixels={}", self.max_image_pixels),
            format!("--max-audio-seconds={}", self.max_audio_seconds),
            format!("--media-fetch-timeout-s={}", self.media_fetch_timeout_s),
            format!("--media-max-redirects={}", self.media_max_redirects),
            format!("--media-workers={}", self.media_workers),
        ];
        if !self.allowed_media_domains.is_empty() {
            a.push(format!("--allowed-media-domains={}", self.allowed_media_domains.join(",")));
        }
        if self.allow_all_media_domains {
            a.push("--allow-all-media-domains".into());
        }
        if self.allow_private_media_addresses {
            a.push("--allow-private-media-addresses".into());
        }
        if let Some(p) = &self.allowed_local_media_path {
            a.push(format!("--allowed-local-media-path={}", p.display()));
        }
        a
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiServiceError {
    #[error(transparent)]
    Config(#[from] mmserve_config::ConfigError),
    #[error(transparent)]
    Text(#[from] mmserve_text::TextError),
    #[error(transparent)]
    Media(#[from] mmserve_media::MediaError),
    #[error("preprocessor_config.json: {0}")]
    Audio(#[from] mmserve_media::audio::AudioError),
    #[error("the model directory has no preprocessor_config.json")]
    NoPreprocessor,
    #[error("connecting to {service}: {message}")]
    Connect { service: &'static str, message: String },
    #[error("--allowed-local-media-path {path}: {source}")]
    LocalPath { path: PathBuf, source: std::io::Error },
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
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let template = ChatTemplate::new(dir.chat_template()?.ok_or(mmserve_text::TextError::NoChatTemplate)?, &tokenizer)?;
    let pp = dir.optional_json("preprocessor_config.json")?.ok_or(ApiServiceError::NoPreprocessor)?;
    let (model_media, item_token) = match &dir.config {
        ModelConfig::Llava(cfg) => {
            let processor = ImageProcessor::from_json(&pp)?;
            (ModelMedia::Image { processor, model_tokens: cfg.image_token_count() as u32 }, cfg.image_token_index)
        }
        ModelConfig::Qwen2Audio(cfg) => {
            let fe = WhisperFeatureExtractor::from_json(&pp)?;
            (ModelMedia::Audio(fe), cfg.audio_token_index)
        }
    };
    let name = args.served_model_name.clone().unwrap_or_else(|| dir.name.clone());
    let local_root = match &args.media.allowed_local_media_path {
        Some(p) => {
            Some(std::fs::canonicalize(p).map_err(|e| ApiServiceError::LocalPath { path: p.clone(), source: e })?)
        }
        None => None,
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let workers = if args.media.media_workers == 0 { 2 * cores } else { args.media.media_workers };
    let fingerprint = format!("{name};{}", model_media.fingerprint());

    let cache = CacheConnection::connect(&args.cache_socket, CONNECT_TIMEOUT)
        .await
        .map_err(|e| ApiServiceError::Connect { service: "embed-cache", message: e.to_string() })?;
    let arena = ArenaMap::connect(&cache, CONNECT_TIMEOUT)
        .await
        .map_err(|e| ApiServiceError::Connect { service: "embed-cache", message: e.to_string() })?;
    let encoder = EncoderClient::new(Default::default(), connect("encoder", &args.encoder_socket).await?).spawn();
    let engine = EngineClient::new(Default::default(), connect("engine", &args.engine_socket).await?).spawn();
    let info = engine
        .info(deadline(CONNECT_TIMEOUT))
        .await
        .map_err(|e| ApiServiceError::Connect { service: "engine", message: e.to_string() })?;

    let queued_tokens = match args.load.max_queued_prompt_tokens {
        0 => info.max_model_len.saturating_mul(256),
        n => n,
    };
    let load = load::LoadGate::new(args.load.max_queued_requests.max(1), queued_tokens);
    let mut state = AppState::new(
        name,
        tokenizer,
        template,
        item_token,
        fingerprint,
        MediaLimits {
            max_items: args.media.max_items_per_request,
            image: ImageLimits { max_pixels: args.media.max_image_pixels },
            audio: AudioLimits { max_seconds: args.media.max_audio_seconds, ..Default::default() },
            fetch: FetchPolicy {
                allowed_domains: args.media.allowed_media_domains.clone(),
                allow_all_domains: args.media.allow_all_media_domains,
                allow_private_addresses: args.media.allow_private_media_addresses,
                local_root,
                max_bytes: args.media.max_item_bytes,
                timeout: Duration::from_secs(args.media.media_fetch_timeout_s),
                max_redirects: args.media.media_max_redirects,
            },
            cpu_slots: Arc::new(tokio::sync::Semaphore::new(workers)),
            model: model_media,
        },
        info.max_model_len,
        (cache, encoder, engine),
        arena,
        load,
        Timeouts {
            rpc: Duration::from_secs(10),
            cache_wait: Duration::from_secs(args.embed_cache_wait_timeout_s),
            encode: Duration::from_secs(300),
            token: Duration::from_secs(args.token_timeout_s),
            body: Duration::from_secs(args.load.body_read_timeout_s),
        },
    );
    if args.prompt.special_tokens_in_content == prompt::SpecialTokens::Text {
        let nonce = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8);
        state.literal_marks = Some(prompt::LiteralMarks::new(nonce));
    }
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
    let app = routes::router(state, args.media.max_body_bytes);
    let limits = http::HttpLimits {
        max_connections: args.load.max_connections,
        header_read_timeout: Duration::from_secs(args.load.header_read_timeout_s.max(1)),
    };
    http::serve(listener, app, limits, shutdown).await;
    Ok(())
}
