//! A client of the embed cache that survives the service restarting: a call that finds
//! the connection broken fails with a clear error (it never hangs: every call has a
//! deadline), and the next call connects afresh.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tarpc::client::RpcError;
use tokio::sync::Mutex;

use crate::{EmbedCacheClient, RpcFailure, transport};

/// How long one reconnection attempt may take.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(2);

pub struct CacheConnection {
    path: PathBuf,
    client: Mutex<Option<EmbedCacheClient>>,
}

impl CacheConnection {
    /// Connects now (failing if the cache is not there).
    pub async fn connect(path: &Path, timeout: Duration) -> std::io::Result<Self> {
        let client = Self::open(path, timeout).await?;
        Ok(CacheConnection { path: path.to_path_buf(), client: Mutex::new(Some(client)) })
    }

    async fn open(path: &Path, timeout: Duration) -> std::io::Result<EmbedCacheClient> {
        let t = transport::connect(path, timeout).await?;
        // One connection carries every request of an api process, waiting allocs
        // included: tarpc's default of 1000 in flight would block releases behind them.
        let mut config = tarpc::client::Config::default();
        config.max_in_flight_requests = 1 << 16;
        config.pending_request_buffer = 1 << 12;
        Ok(EmbedCacheClient::new(config, t).spawn())
    }

    /// The current client, reconnecting first if the last call found the link broken.
    pub async fn client(&self) -> Result<EmbedCacheClient, RpcFailure> {
        let mut guard = self.client.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let c = Self::open(&self.path, RECONNECT_TIMEOUT)
            .await
            .map_err(|e| RpcFailure { service: "embed cache", reason: format!("reconnecting: {e}") })?;
        *guard = Some(c.clone());
        Ok(c)
    }

    /// Runs one call; a broken connection is dropped so the next call reconnects.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, RpcFailure>
    where
        F: FnOnce(EmbedCacheClient) -> Fut,
        Fut: Future<Output = Result<T, RpcError>>,
    {
        let client = self.client().await?;
        match f(client).await {
            Ok(v) => Ok(v),
            Err(e) => {
                if matches!(e, RpcError::Shutdown | RpcError::Send(_) | RpcError::Channel(_)) {
                    self.client.lock().await.take();
                }
                Err(RpcFailure::new("embed cache", e))
            }
        }
    }
}
