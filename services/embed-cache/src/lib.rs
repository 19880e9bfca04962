//! The embed-cache service (its own process).
//!
//! Owns the item records ([`state`]), the arena's slot accounting ([`slots`]) and every
//! shared-memory segment of item data and embeddings. Serves `EmbedCache` over tarpc.

mod service;
pub mod slots;
pub mod state;

use std::path::PathBuf;

pub use service::CacheService;

/// Flags of `mmserve embed-cache`.
#[derive(Debug, Clone, clap::Args)]
pub struct CacheArgs {
    /// Unix socket to serve on.
    #[arg(long, env = "MMSERVE_CACHE_SOCKET")]
    pub socket: PathBuf,
    /// Prefix of every shared-memory segment this service creates.
    #[arg(long, env = "MMSERVE_SHM_PREFIX")]
    pub shm_prefix: String,
    /// Width of one embedding row (the LLM's hidden size), in f32 values.
    #[arg(long, env = "MMSERVE_EMBED_DIM")]
    pub embed_dim: u32,
    /// Embedding slots in the arena (one slot holds one row).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_SLOTS", default_value_t = 65536)]
    pub embed_cache_slots: u64,
    /// Maximum number of items held.
    #[arg(long, env = "MMSERVE_EMBED_CACHE_ITEMS", default_value_t = 4096)]
    pub embed_cache_items: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CacheServiceError {
    #[error("binding {path}: {source}")]
    Bind { path: PathBuf, source: std::io::Error },
    #[error("the arena of {slots} slots × {dim} values does not fit in memory")]
    ArenaSize { slots: u64, dim: u32 },
    #[error(transparent)]
    Shm(#[from] mmserve_shm::ShmError),
}

/// Runs the service until `shutdown` resolves, then unlinks every segment it created.
pub async fn run(args: CacheArgs, shutdown: impl Future<Output = ()>) -> Result<(), CacheServiceError> {
    let service = CacheService::new(&args)?;
    let listener = mmserve_protocol::transport::bind(&args.socket)
        .map_err(|source| CacheServiceError::Bind { path: args.socket.clone(), source })?;
    tracing::info!(
        slots = args.embed_cache_slots,
        items = args.embed_cache_items,
        arena = service.arena_name(),
        "embed-cache ready"
    );
    mmserve_protocol::ready::announce("embed-cache");
    let server = mmserve_protocol::EmbedCache::serve(service.clone());
    tokio::select! {
        _ = async move { mmserve_protocol::serve_unix!(listener, server) } => {}
        _ = shutdown => {}
    }
    service.shutdown();
    let _ = std::fs::remove_file(&args.socket);
    Ok(())
}
