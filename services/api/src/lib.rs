//! The api service (its own process): the OpenAI-compatible HTTP front end.
//!
//! Only this crate knows OpenAI JSON ([`openai`]); every error becomes an HTTP
//! response in one place ([`error`]). A request's path is in [`generate`].

pub mod access;
pub mod auth;
pub mod cpu;
pub mod dispatch;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod http;
pub mod load;
pub mod media;
pub mod metrics;
pub mod openai;
pub mod prompt;
pub mod routes;
pub mod state;
pub mod tokens;
pub mod tools;
pub mod truncate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mmserve_arena::{ArenaMap, ByteSize};
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
    /// The names clients may use in `model` (comma-separated); responses carry the
    /// first. Default: the directory's name (or the hub id given as `--model`).
    #[arg(long, env = "MMSERVE_SERVED_MODEL_NAME", value_delimiter = ',')]
    pub served_model_name: Vec<String>,
    /// A chat template to use instead of the model's: a file, or the template itself
    /// (text with `{{` or `{%`).
    #[arg(long, env = "MMSERVE_CHAT_TEMPLATE")]
    pub chat_template: Option<String>,
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
    #[command(flatten)]
    pub timeouts: TimeoutArgs,
    /// Keys a client must send as `Authorization: Bearer <key>` on `/v1/*` (several:
    /// comma-separated); `/health` and `/metrics` stay open. Without one, no key is asked.
    #[arg(long, env = "MMSERVE_API_KEY", value_delimiter = ',', hide_env_values = true)]
    pub api_key: Vec<String>,
    /// A prompt past the context: refused (`none`), or cut at the start (`head`) or in the
    /// middle (`center`) to leave room for `max_tokens` (without it, an eighth of the
    /// context); media items are never split (a cut inside one is refused).
    #[arg(long, env = "MMSERVE_LONG_TRUNCATION_MODE", value_enum, default_value = "none")]
    pub long_truncation_mode: truncate::TruncationMode,
    /// `/metrics` asks for a key too (with `--api-key`).
    #[arg(long, env = "MMSERVE_PROTECT_METRICS")]
    pub protect_metrics: bool,
    /// Origins a browser page may call the API from (CORS; comma-separated, `*` for any);
    /// preflight requests are answered. None: no CORS headers, so browsers allow only
    /// same-origin pages.
    #[arg(long, env = "MMSERVE_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
}

/// Every wait of the api process, in seconds.
#[derive(Debug, Clone, clap::Args)]
pub struct TimeoutArgs {
    /// Longest wait in line for embed-cache capacity (then 503).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_WAIT_TIMEOUT_S", default_value_t = 30)]
    pub embed_cache_wait_timeout_s: u64,
    /// Longest wait for the next token of a running request (then 503).
    #[arg(long, env = "MMSERVE_TOKEN_TIMEOUT_S", default_value_t = 120)]
    pub token_timeout_s: u64,
    /// Longest wait for a request's media to be encoded (the encoder's own limit per
    /// item is `--encoder-timeout-ms`).
    #[arg(long, env = "MMSERVE_ENCODE_TIMEOUT_S", default_value_t = 300)]
    pub encode_timeout_s: u64,
    /// Longest connect to a sibling service at start, first call included.
    #[arg(long, env = "MMSERVE_CONNECT_TIMEOUT_S", default_value_t = 10)]
    pub connect_timeout_s: u64,
    /// Longest call to the embed cache or the engine.
    #[arg(long, env = "MMSERVE_RPC_TIMEOUT_S", default_value_t = 10)]
    pub rpc_timeout_s: u64,
    /// Longest wait for a place in the CPU pool (media checks, prompt rendering); then 503.
    #[arg(long, env = "MMSERVE_CPU_WAIT_TIMEOUT_S", default_value_t = 30)]
    pub cpu_wait_timeout_s: u64,
    /// Longest check of one sibling service by `/health` and `/metrics`.
    #[arg(long, env = "MMSERVE_HEALTH_TIMEOUT_S", default_value_t = 2)]
    pub health_timeout_s: u64,
    /// Longest long poll for the engine's events (a token is forwarded as soon as it
    /// exists; this only bounds an idle poll).
    #[arg(long, env = "MMSERVE_ENGINE_POLL_S", default_value_t = 5)]
    pub engine_poll_s: u64,
    /// Between keep-alive comments on a quiet event stream.
    #[arg(long, env = "MMSERVE_SSE_KEEP_ALIVE_S", default_value_t = 15)]
    pub sse_keep_alive_s: u64,
    /// How long open connections get to finish their requests at shutdown.
    #[arg(long, env = "MMSERVE_SHUTDOWN_GRACE_S", default_value_t = 5)]
    pub shutdown_grace_s: u64,
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s.max(1))
}

/// Limits and fetching rules for requests and their media (also flags of `serve`,
/// which hands them to the api process).
#[derive(Debug, Clone, clap::Args)]
pub struct MediaArgs {
    /// Largest request body (413 above it), e.g. `64MiB`.
    #[arg(long, env = "MMSERVE_MAX_BODY_BYTES", default_value = "64MiB")]
    pub max_body_bytes: ByteSize,
    /// Largest media item, e.g. `20MiB`.
    #[arg(long, env = "MMSERVE_MAX_ITEM_BYTES", default_value = "20MiB")]
    pub max_item_bytes: ByteSize,
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
    /// The largest `min_pixels` or `max_pixels` a request's `mm_processor_kwargs` may set
    /// (Qwen-VL's dynamic resolution: an image's tokens grow with them); 0: the
    /// preprocessor config's `max_pixels`.
    #[arg(long, env = "MMSERVE_MM_MAX_PIXELS", default_value_t = 0)]
    pub mm_max_pixels: u64,
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
    /// How the model's own tool calls are read (`tool_choice: "auto"`): `hermes`
    /// (`<tool_call>{…}</tool_call>`, Qwen2 and Qwen2.5), `none`, or `auto` (hermes when
    /// the chat template writes `<tool_call>`, else none).
    #[arg(long, env = "MMSERVE_TOOL_CALL_PARSER", value_enum, default_value = "auto")]
    pub tool_call_parser: tools::ToolParser,
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
    #[error("--allowed-origins: {0}")]
    Origins(String),
    #[error("--chat-template {0}")]
    ChatTemplate(String),
    #[error(transparent)]
    Grammar(#[from] mmserve_grammar::GrammarError),
}

/// `--chat-template`'s value: a file's text, or the template given inline.
fn chat_template_arg(given: &str) -> Result<String, ApiServiceError> {
    let path = std::path::Path::new(given);
    if path.is_file() {
        return std::fs::read_to_string(path).map_err(|e| ApiServiceError::ChatTemplate(format!("{given}: {e}")));
    }
    if given.contains("{{") || given.contains("{%") {
        return Ok(given.to_string());
    }
    Err(ApiServiceError::ChatTemplate(format!("{given:?}: no such file (and not a template: no `{{{{` or `{{%`)")))
}

async fn connect<In, Out>(
    service: &'static str,
    path: &std::path::Path,
    timeout: Duration,
) -> Result<transport::UnixTransport<In, Out>, ApiServiceError>
where
    In: serde::de::DeserializeOwned,
    Out: serde::Serialize,
{
    transport::connect(path, timeout).await.map_err(|e| ApiServiceError::Connect { service, message: e.to_string() })
}

/// Builds the shared state: the model's text side and clients of the three services.
pub async fn build_state(args: &ApiArgs) -> Result<Arc<AppState>, ApiServiceError> {
    let dir = ModelDir::open(&args.model)?;
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let source = match &args.chat_template {
        Some(given) => chat_template_arg(given)?,
        None => dir.chat_template()?.ok_or(mmserve_text::TextError::NoChatTemplate)?,
    };
    let tool_parser = args.prompt.tool_call_parser.resolve(&source);
    let template = ChatTemplate::new(source, &tokenizer)?;
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
        // Each image's token count comes from its size (dynamic resolution).
        ModelConfig::Qwen2Vl(cfg) => {
            let processor = ImageProcessor::from_json(&pp)?;
            (ModelMedia::Image { processor, model_tokens: 0 }, cfg.image_token_id)
        }
    };
    let mrope = !dir.config.text().mrope_section.is_empty();
    let names: Vec<String> =
        args.served_model_name.iter().map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect();
    let name = names.first().cloned().unwrap_or_else(|| dir.name.clone());
    let local_root = match &args.media.allowed_local_media_path {
        Some(p) => {
            Some(std::fs::canonicalize(p).map_err(|e| ApiServiceError::LocalPath { path: p.clone(), source: e })?)
        }
        None => None,
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let workers = if args.media.media_workers == 0 { 2 * cores } else { args.media.media_workers };
    let fingerprint = format!("{name};{}", model_media.fingerprint());
    let t = &args.timeouts;
    let connect_timeout = secs(t.connect_timeout_s);

    let cache = CacheConnection::connect(&args.cache_socket, connect_timeout)
        .await
        .map_err(|e| ApiServiceError::Connect { service: "embed-cache", message: e.to_string() })?;
    let arena = ArenaMap::connect(&cache, connect_timeout)
        .await
        .map_err(|e| ApiServiceError::Connect { service: "embed-cache", message: e.to_string() })?;
    let encoder =
        EncoderClient::new(Default::default(), connect("encoder", &args.encoder_socket, connect_timeout).await?)
            .spawn();
    let engine =
        EngineClient::new(Default::default(), connect("engine", &args.engine_socket, connect_timeout).await?).spawn();
    let info = engine
        .info(deadline(connect_timeout))
        .await
        .map_err(|e| ApiServiceError::Connect { service: "engine", message: e.to_string() })?;

    let queued_tokens = match args.load.max_queued_prompt_tokens {
        0 => info.max_model_len.saturating_mul(256),
        n => n,
    };
    let load = load::LoadGate::new(args.load.max_queued_requests.max(1), queued_tokens);
    let eos = tokenizer.eos_ids().first().copied().unwrap_or_default();
    let grammars = Arc::new(mmserve_grammar::Grammars::new(&dir, eos)?);
    let mut state = AppState::new(
        name,
        (tokenizer, grammars),
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
                max_bytes: args.media.max_item_bytes.0.min(usize::MAX as u64) as usize,
                timeout: Duration::from_secs(args.media.media_fetch_timeout_s),
                max_redirects: args.media.media_max_redirects,
            },
            cpu: cpu::Pool::new(workers, secs(t.cpu_wait_timeout_s)),
            kwargs_max_pixels: match args.media.mm_max_pixels {
                0 => model_media.pixel_bounds().map_or(0, |(_, max)| max),
                n => n,
            },
            model: model_media,
        },
        info.max_model_len,
        (cache, encoder, engine),
        (mrope, dir.config.vocab_size() as u64),
        arena,
        load,
        Timeouts {
            rpc: secs(t.rpc_timeout_s),
            health: secs(t.health_timeout_s),
            sse_keep_alive: secs(t.sse_keep_alive_s),
            cache_wait: secs(t.embed_cache_wait_timeout_s),
            encode: secs(t.encode_timeout_s),
            token: secs(t.token_timeout_s),
            body: secs(args.load.body_read_timeout_s),
        },
    );
    if args.prompt.special_tokens_in_content == prompt::SpecialTokens::Text {
        let nonce = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8);
        state.literal_marks = Some(prompt::LiteralMarks::new(nonce));
    }
    state.truncation = args.long_truncation_mode;
    state.tool_parser = tool_parser;
    state.aliases = names.into_iter().skip(1).collect();
    Ok(Arc::new(state))
}

/// Serves HTTP until `shutdown` resolves.
pub async fn run(args: ApiArgs, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ApiServiceError> {
    let state = build_state(&args).await?;
    let dispatcher = state.dispatcher.clone();
    let closing = state.dispatcher.clone();
    let shutdown = async move {
        shutdown.await;
        closing.close();
    };
    let (engine, client) = (state.engine.clone(), state.client_id);
    let (poll, rpc) = (secs(args.timeouts.engine_poll_s), secs(args.timeouts.rpc_timeout_s));
    tokio::spawn(async move { dispatcher.run(engine, client, poll, rpc).await });

    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ApiServiceError::Listen { addr: addr.clone(), source })?;
    let local: SocketAddr = listener.local_addr().map_err(|source| ApiServiceError::Listen { addr, source })?;
    mmserve_protocol::ready::announce_with("api", &format!("http://{local}"));
    let cors = routes::cors(&args.allowed_origins).map_err(ApiServiceError::Origins)?;
    let app = routes::router(
        state,
        args.media.max_body_bytes.0.min(usize::MAX as u64) as usize,
        routes::Access { keys: auth::ApiKeys::new(&args.api_key), protect_metrics: args.protect_metrics, cors },
    );
    let limits = http::HttpLimits {
        max_connections: args.load.max_connections,
        header_read_timeout: secs(args.load.header_read_timeout_s),
        shutdown_grace: secs(args.timeouts.shutdown_grace_s),
    };
    http::serve(listener, app, limits, shutdown).await;
    Ok(())
}
