//! A client of the embed cache that survives the service restarting: a call that finds
//! the connection broken fails with a clear error (it never hangs: every call has a
//! deadline), and the next call connects afresh.
//!
//! The hot calls of an api process (`alloc` that need not wait, `release`,
//! `set_items_data`) are coalesced: one task sends whatever its concurrent requests
//! asked for while the previous call was in flight as one [`EmbedCache::batch`] call,
//! so the cache decides many requests per message and per lock pass.
//!
//! [`EmbedCache::batch`]: crate::EmbedCache::batch

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tarpc::client::RpcError;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::cache::{Allocation, CacheOp, CacheOpResult};
use crate::{AllocItem, CacheError, EmbedCacheClient, RpcFailure, deadline, transport};

/// How long one reconnection attempt may take.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline of one coalesced call (it never waits in the cache's line).
const BATCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Most operations in one coalesced call.
const MAX_BATCH: usize = 256;

type Reply = oneshot::Sender<Result<CacheOpResult, RpcFailure>>;

pub struct CacheConnection {
    link: Arc<Link>,
    ops: mpsc::Sender<(CacheOp, Reply)>,
}

struct Link {
    path: PathBuf,
    client: Mutex<Option<EmbedCacheClient>>,
}

impl CacheConnection {
    /// Connects now (failing if the cache is not there).
    pub async fn connect(path: &Path, timeout: Duration) -> std::io::Result<Self> {
        let client = Link::open(path, timeout).await?;
        let link = Arc::new(Link { path: path.to_path_buf(), client: Mutex::new(Some(client)) });
        let (ops, rx) = mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(coalesce(link.clone(), rx));
        Ok(CacheConnection { link, ops })
    }

    /// The current client, reconnecting first if the last call found the link broken.
    pub async fn client(&self) -> Result<EmbedCacheClient, RpcFailure> {
        self.link.client().await
    }

    /// Runs one call; a broken connection is dropped so the next call reconnects.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, RpcFailure>
    where
        F: FnOnce(EmbedCacheClient) -> Fut,
        Fut: Future<Output = Result<T, RpcError>>,
    {
        self.link.call(f).await
    }

    /// `alloc`: granted at once through the coalesced path when nobody waits in the
    /// cache's line, else a call of its own that waits up to `wait`.
    pub async fn alloc(
        &self,
        items: Vec<AllocItem>,
        wait: Duration,
        rpc_timeout: Duration,
    ) -> Result<Result<Allocation, CacheError>, RpcFailure> {
        match self.op(CacheOp::Alloc(items.clone())).await? {
            CacheOpResult::Allocated(a) => Ok(Ok(a)),
            CacheOpResult::Failed(e) => Ok(Err(e)),
            CacheOpResult::MustWait | CacheOpResult::Done => {
                let wait_ms = wait.as_millis() as u64;
                self.call(|c| async move { c.alloc(deadline(wait + rpc_timeout), items, wait_ms).await }).await
            }
        }
    }

    pub async fn release(&self, ids: Vec<u64>) -> Result<Result<(), CacheError>, RpcFailure> {
        self.done(CacheOp::Release(ids)).await
    }

    pub async fn set_items_data(&self, ids: Vec<u64>) -> Result<Result<(), CacheError>, RpcFailure> {
        self.done(CacheOp::SetData(ids)).await
    }

    async fn done(&self, op: CacheOp) -> Result<Result<(), CacheError>, RpcFailure> {
        Ok(match self.op(op).await? {
            CacheOpResult::Failed(e) => Err(e),
            _ => Ok(()),
        })
    }

    async fn op(&self, op: CacheOp) -> Result<CacheOpResult, RpcFailure> {
        let gone = || RpcFailure { service: "embed cache", reason: "the coalescing task ended".into() };
        let (tx, rx) = oneshot::channel();
        self.ops.send((op, tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

impl Link {
    async fn open(path: &Path, timeout: Duration) -> std::io::Result<EmbedCacheClient> {
        let t = transport::connect(path, timeout).await?;
        // One connection carries every request of an api process, waiting allocs
        // included: tarpc's default of 1000 in flight would block releases behind them.
        let mut config = tarpc::client::Config::default();
        config.max_in_flight_requests = 1 << 16;
        config.pending_request_buffer = 1 << 12;
        Ok(EmbedCacheClient::new(config, t).spawn())
    }

    async fn client(&self) -> Result<EmbedCacheClient, RpcFailure> {
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

    async fn call<T, F, Fut>(&self, f: F) -> Result<T, RpcFailure>
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

/// Sends what queued up while the previous call was in flight as one `batch` call;
/// ends when the connection is dropped.
async fn coalesce(link: Arc<Link>, mut rx: mpsc::Receiver<(CacheOp, Reply)>) {
    let mut queued = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut queued, MAX_BATCH).await > 0 {
        let (ops, replies): (Vec<CacheOp>, Vec<Reply>) = queued.drain(..).unzip();
        match link.call(|c| async move { c.batch(deadline(BATCH_TIMEOUT), ops).await }).await {
            Ok(results) if results.len() == replies.len() => {
                // A grant whose caller went away meanwhile would hold references until
                // the connection closes: give it back.
                let mut orphans = Vec::new();
                for (reply, r) in replies.into_iter().zip(results) {
                    if let Err(Ok(CacheOpResult::Allocated(a))) = reply.send(Ok(r)) {
                        orphans.extend(a.records.iter().map(|r| r.id));
                    }
                }
                if !orphans.is_empty() {
                    let _ = link.call(|c| async move { c.release(deadline(BATCH_TIMEOUT), orphans).await }).await;
                }
            }
            Ok(results) => {
                let reason = format!("{} results for {} operations", results.len(), replies.len());
                for reply in replies {
                    let _ = reply.send(Err(RpcFailure { service: "embed cache", reason: reason.clone() }));
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}
