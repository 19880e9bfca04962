//! The tarpc face of the cache: one mutex around the state (that mutex is what makes
//! each `alloc` all-or-nothing across every api process), a notification for data
//! readiness, and the arena segment.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mmserve_protocol::cache::ArenaInfo;
use mmserve_protocol::{AllocItem, CacheError, CacheStats, EmbedCache, ItemRecord};
use mmserve_shm::Segment;
use tarpc::context::Context;
use tokio::sync::Notify;

use crate::state::CacheState;
use crate::{CacheArgs, CacheServiceError};

#[derive(Clone)]
pub struct CacheService {
    state: Arc<Mutex<CacheState>>,
    data_ready: Arc<Notify>,
    arena: Arc<Mutex<Option<Segment>>>,
    info: ArenaInfo,
}

impl CacheService {
    pub fn new(args: &CacheArgs) -> Result<Self, CacheServiceError> {
        let bytes = args
            .embed_cache_slots
            .checked_mul(u64::from(args.embed_dim) * 4)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or(CacheServiceError::ArenaSize { slots: args.embed_cache_slots, dim: args.embed_dim })?;
        let name = format!("{}-arena", args.shm_prefix);
        let arena = Segment::create(&name, bytes)?;
        Ok(CacheService {
            state: Arc::new(Mutex::new(CacheState::new(
                args.shm_prefix.clone(),
                args.embed_cache_slots,
                args.embed_cache_items,
            ))),
            data_ready: Arc::new(Notify::new()),
            arena: Arc::new(Mutex::new(Some(arena))),
            info: ArenaInfo { segment: name, slots: args.embed_cache_slots, hidden: args.embed_dim },
        })
    }

    pub fn arena_name(&self) -> &str {
        &self.info.segment
    }

    fn with<T>(&self, f: impl FnOnce(&mut CacheState) -> T) -> T {
        // A panic while holding the lock is a bug; the state is still consistent enough
        // to keep serving (every mutation validates before it changes anything).
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// Unlinks every segment: item data and the arena.
    pub fn shutdown(&self) {
        self.with(|s| s.clear_all());
        self.arena.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

impl EmbedCache for CacheService {
    async fn alloc(self, _: Context, items: Vec<AllocItem>) -> Result<Vec<ItemRecord>, CacheError> {
        self.with(|s| s.alloc(&items))
    }

    async fn release(self, _: Context, ids: Vec<u64>) -> Result<(), CacheError> {
        self.with(|s| s.release(&ids))
    }

    async fn set_items_data(self, _: Context, ids: Vec<u64>) -> Result<(), CacheError> {
        self.with(|s| s.set_data_ready(&ids))?;
        self.data_ready.notify_waiters();
        Ok(())
    }

    async fn get_items_data(self, _: Context, ids: Vec<u64>) -> Result<Vec<bool>, CacheError> {
        self.with(|s| s.data_ready(&ids))
    }

    async fn wait_items_data(self, _: Context, ids: Vec<u64>, timeout_ms: u64) -> Result<(), CacheError> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            // Register for the notification before checking, so a wake-up between the
            // check and the wait is not lost.
            let notified = self.data_ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.with(|s| s.data_ready(&ids))?.iter().all(|&r| r) {
                return Ok(());
            }
            tokio::time::timeout_at(deadline, notified).await.map_err(|_| CacheError::Timeout(timeout_ms))?;
        }
    }

    async fn set_items_embed(self, _: Context, ids: Vec<u64>) -> Result<(), CacheError> {
        self.with(|s| s.set_embed_ready(&ids))
    }

    async fn get_items_embed(self, _: Context, ids: Vec<u64>) -> Result<Vec<bool>, CacheError> {
        self.with(|s| s.embed_ready(&ids))
    }

    async fn arena(self, _: Context) -> ArenaInfo {
        self.info.clone()
    }

    async fn stats(self, _: Context) -> CacheStats {
        self.with(|s| s.stats())
    }
}
