//! The embed-cache service (its own process, or shared by several servers).
//!
//! Owns the item records ([`state`]), the slot and page accounting ([`slots`]), both
//! shared-memory arenas (embeddings and raw item bytes), the fair wait for capacity
//! ([`service`]) and the authenticated admin listener ([`admin`]).

pub mod admin;
mod service;
pub mod slots;
pub mod state;

use std::path::PathBuf;
use std::time::Duration;

use mmserve_protocol::ArenaDtype;

use mmserve_arena::ByteSize;
pub use service::CacheService;

/// Flags of `mmserve embed-cache` (and the cache flags of `mmserve serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct CacheArgs {
    /// Unix socket to serve on.
    #[arg(long, env = "MMSERVE_CACHE_SOCKET")]
    pub socket: PathBuf,
    /// Prefix of every shared-memory segment of this instance (default: unique per start).
    #[arg(long, env = "MMSERVE_SHM_PREFIX")]
    pub shm_prefix: Option<String>,
    /// Width of one embedding row (the LLM's hidden size), in values.
    #[arg(long, env = "MMSERVE_EMBED_DIM")]
    pub embed_dim: u32,
    /// Element type of the arena: the LLM's dtype (`float32`, `bfloat16`, `float16`).
    #[arg(long, env = "MMSERVE_EMBED_DTYPE", default_value = "float32")]
    pub embed_dtype: ArenaDtype,
    #[command(flatten)]
    pub capacity: CapacityArgs,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub admin_limits: AdminLimitArgs,
}

/// Bounds of the admin listener.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminLimitArgs {
    /// Admin connections served at once; a new one beyond it takes the place of the
    /// oldest that has not authenticated yet (a flood without the token evicts itself).
    #[arg(long, env = "MMSERVE_ADMIN_MAX_CONNECTIONS", default_value_t = 64)]
    pub admin_max_connections: usize,
    /// Seconds a new admin connection has to make an authenticated call before it is closed.
    #[arg(long, env = "MMSERVE_ADMIN_AUTH_TIMEOUT_S", default_value_t = 5.0)]
    pub admin_auth_timeout_s: f64,
    /// Seconds an authenticated admin connection may stay idle.
    #[arg(long, env = "MMSERVE_ADMIN_IDLE_TIMEOUT_S", default_value_t = 300.0)]
    pub admin_idle_timeout_s: f64,
    /// Seconds a connection beyond the cap waits for the place of the unauthenticated one
    /// it evicted (then it is closed).
    #[arg(long, env = "MMSERVE_ADMIN_EVICTION_WAIT_S", default_value_t = 1.0)]
    pub admin_eviction_wait_s: f64,
}

impl AdminLimitArgs {
    fn limits(&self) -> Result<admin::AdminLimits, CacheServiceError> {
        if self.admin_max_connections == 0 {
            return Err(CacheServiceError::Capacity("--admin-max-connections must be positive".into()));
        }
        Ok(admin::AdminLimits {
            max_connections: self.admin_max_connections,
            auth_timeout: positive_secs(self.admin_auth_timeout_s, "--admin-auth-timeout-s")?,
            idle_timeout: positive_secs(self.admin_idle_timeout_s, "--admin-idle-timeout-s")?,
            eviction_wait: positive_secs(self.admin_eviction_wait_s, "--admin-eviction-wait-s")?,
        })
    }
}

/// How much the cache holds.
#[derive(Debug, Clone, clap::Args)]
pub struct CapacityArgs {
    /// Bytes of the embedding arena; slots = size / (hidden × dtype size).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_SIZE", default_value = "1GiB")]
    pub embed_cache_size: ByteSize,
    /// Bytes of raw media kept in shared memory.
    #[arg(long, env = "MMSERVE_EMBED_CACHE_DATA_SIZE", default_value = "256MiB")]
    pub embed_cache_data_size: ByteSize,
    /// Most items held.
    #[arg(long, env = "MMSERVE_EMBED_CACHE_ITEMS", default_value_t = 4096)]
    pub embed_cache_items: u64,
    /// Largest fraction of the slots one request may use (more is refused with 400).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_REQUEST_SHARE", default_value_t = 0.5)]
    pub embed_cache_request_share: f64,
    /// Seconds a new item's uploader has to write its bytes; past it the item is
    /// abandoned (requests waiting for it fail, the next request starts afresh).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_DATA_TIMEOUT_S", default_value_t = 30.0)]
    pub embed_cache_data_timeout_s: f64,
}

/// The admin listener.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminArgs {
    /// Address of the admin listener (loopback unless you mean otherwise; port 0 picks one).
    #[arg(long, env = "MMSERVE_ADMIN_ADDR", default_value = "127.0.0.1:8001")]
    pub admin_addr: String,
    /// Token every admin call must carry. Without a token (here or in a file) the admin
    /// listener stays off.
    #[arg(long, env = "MMSERVE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// File holding the admin token (first line).
    #[arg(long, env = "MMSERVE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
}

impl AdminArgs {
    /// The token from the flag, the variable or the file.
    pub fn token(&self) -> Result<Option<String>, CacheServiceError> {
        if let Some(t) = &self.admin_token {
            if t.trim().is_empty() {
                return Err(CacheServiceError::EmptyToken(PathBuf::from("--admin-token / MMSERVE_ADMIN_TOKEN")));
            }
            return Ok(Some(t.clone()));
        }
        let Some(path) = &self.admin_token_file else { return Ok(None) };
        let text = std::fs::read_to_string(path)
            .map_err(|source| CacheServiceError::TokenFile { path: path.clone(), source })?;
        let token = text.lines().next().unwrap_or("").trim().to_string();
        if token.is_empty() {
            return Err(CacheServiceError::EmptyToken(path.clone()));
        }
        Ok(Some(token))
    }
}

/// A positive duration from a flag given in seconds.
pub(crate) fn positive_secs(v: f64, flag: &str) -> Result<Duration, CacheServiceError> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| CacheServiceError::Capacity(format!("{flag} must be positive")))
}

#[derive(Debug, thiserror::Error)]
pub enum CacheServiceError {
    #[error("binding {path}: {source}")]
    Bind { path: String, source: std::io::Error },
    #[error("invalid capacity: {0}")]
    Capacity(String),
    #[error(transparent)]
    Shm(#[from] mmserve_shm::ShmError),
    #[error("reading the admin token from {path}: {source}")]
    TokenFile { path: PathBuf, source: std::io::Error },
    #[error("the admin token from {0} is empty")]
    EmptyToken(PathBuf),
}

/// Runs the service until `shutdown` resolves, then unlinks every segment it created.
pub async fn run(args: CacheArgs, shutdown: impl Future<Output = ()>) -> Result<(), CacheServiceError> {
    let removed = mmserve_shm::sweep_dead_instances();
    if removed > 0 {
        tracing::info!("removed {removed} shared-memory segments of dead cache instances");
    }
    let service = CacheService::new(&args)?;
    let info = service.info().clone();
    let listener = mmserve_protocol::transport::bind(&args.socket)
        .map_err(|source| CacheServiceError::Bind { path: args.socket.display().to_string(), source })?;
    let admin_limits = args.admin_limits.limits()?;
    let admin = match args.admin.token()? {
        Some(token) => {
            let bind_err = |source| CacheServiceError::Bind { path: args.admin.admin_addr.clone(), source };
            let listener = admin::bind(&args.admin.admin_addr).map_err(bind_err)?;
            let addr = listener.local_addr().map_err(bind_err)?.to_string();
            Some((listener, token, addr))
        }
        None => {
            tracing::info!("no admin token given: the admin listener is off");
            None
        }
    };
    tracing::info!(
        slots = info.slots,
        hidden = info.hidden,
        items = args.capacity.embed_cache_items,
        data = %args.capacity.embed_cache_data_size,
        "embed cache: {} slots of {} {} values ({}), arena {}",
        info.slots,
        info.hidden,
        info.dtype,
        args.capacity.embed_cache_size,
        info.embed_segment
    );
    let admin_addr = admin.as_ref().map(|a| a.2.clone()).unwrap_or_default();
    mmserve_protocol::ready::announce_with("embed-cache", &admin_addr);
    if let Some((listener, token, _)) = admin {
        let bind_err = |source| CacheServiceError::Bind { path: args.admin.admin_addr.clone(), source };
        admin::spawn(listener, service.clone(), token, admin_limits).map_err(bind_err)?;
    }
    tokio::select! {
        _ = service.clone().run_listener(listener) => {}
        _ = shutdown => {}
    }
    service.shutdown();
    let _ = std::fs::remove_file(&args.socket);
    Ok(())
}
