//! The arenas of the cache instance a request names, mapped once per instance.
//!
//! A request carries the instance whose slots it was granted. While the cache lives,
//! that is the mapped one. After a restart, the first request naming the new instance
//! maps its arenas (under a lock, so concurrent requests map them once) and every later
//! one finds them mapped; a request naming an instance that is neither the mapped one
//! nor the cache's current one outlived its cache and fails.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{ArenaInfo, RpcFailure, deadline};
use mmserve_shm::ShmError;

use crate::ArenaView;

#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error(transparent)]
    Unavailable(#[from] RpcFailure),
    #[error("the embed cache restarted while the request was in flight; retry it")]
    Restarted,
    #[error("mapping the embed cache's arenas: {0}")]
    Shm(#[from] ShmError),
}

/// The view a request gets: the one mapped before, or one mapped for it just now (whoever
/// registers the arena with a device registers the new one).
pub enum Mapped {
    Current(Arc<ArenaView>),
    New(Arc<ArenaView>),
}

impl Mapped {
    pub fn view(&self) -> &Arc<ArenaView> {
        match self {
            Mapped::Current(v) | Mapped::New(v) => v,
        }
    }
}

pub struct ArenaMap {
    current: Mutex<Arc<ArenaView>>,
    /// Held while a new instance is mapped, so it is mapped once.
    remapping: tokio::sync::Mutex<()>,
}

impl ArenaMap {
    /// Maps the cache's current arenas.
    pub async fn connect(cache: &CacheConnection, timeout: Duration) -> Result<Self, ArenaError> {
        let info = arena_info(cache, timeout).await?;
        Ok(Self::new(ArenaView::open(&info)?))
    }

    pub fn new(view: ArenaView) -> Self {
        Self::shared(Arc::new(view))
    }

    /// Starts from a view the caller also holds (registered with its device, say).
    pub fn shared(view: Arc<ArenaView>) -> Self {
        ArenaMap { current: Mutex::new(view), remapping: tokio::sync::Mutex::new(()) }
    }

    /// The arenas mapped now.
    pub fn current(&self) -> Arc<ArenaView> {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The arenas of `instance`: the mapped ones, or the cache's new ones mapped now.
    pub async fn view(&self, instance: u64, cache: &CacheConnection, timeout: Duration) -> Result<Mapped, ArenaError> {
        let current = self.current();
        if current.info.instance == instance {
            return Ok(Mapped::Current(current));
        }
        let _one = tokio::time::timeout(timeout, self.remapping.lock())
            .await
            .map_err(|_| RpcFailure { service: "embed cache", reason: "waiting to map a new instance".into() })?;
        let current = self.current();
        if current.info.instance == instance {
            return Ok(Mapped::Current(current)); // mapped meanwhile by another request
        }
        let info = arena_info(cache, timeout).await?;
        if info.instance != instance {
            return Err(ArenaError::Restarted);
        }
        let view = Arc::new(ArenaView::open(&info)?);
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = view.clone();
        Ok(Mapped::New(view))
    }
}

async fn arena_info(cache: &CacheConnection, timeout: Duration) -> Result<ArenaInfo, RpcFailure> {
    cache.call(|c| async move { c.arena(deadline(timeout)).await }).await
}
