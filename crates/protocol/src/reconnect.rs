//! A client of the embed cache that survives the service restarting: a call that finds
//! the connection broken fails with a clear error (it never hangs: every call has a
//! deadline), and the next call connects afresh.
//!
//! The hot calls of an api process (`alloc` that need not wait, a lease's release,
//! `set_items_data`) are coalesced: one task sends whatever its concurrent requests
//! asked for while the previous call was in flight as one [`EmbedCache::batch`] call,
//! so the cache decides many requests per message and per lock pass.
//!
//! [`EmbedCache::batch`]: crate::EmbedCache::batch

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tarpc::client::RpcError;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::cache::{Allocation, CacheOp, CacheOpResult};
use crate::{AllocItem, CacheError, EmbedCacheClient, RpcFailure, deadline, transport};

/// Most operations in one coalesced call.
const MAX_BATCH: usize = 256;
/// How often a lease's release is sent before it is given up (the connection is then
/// likely broken, and the cache releases everything of a closed connection).
const RELEASE_TRIES: u32 = 5;
/// Pause before sending failed releases again.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

type Reply = oneshot::Sender<Result<CacheOpResult, RpcFailure>>;

pub struct CacheConnection {
    link: Arc<Link>,
    /// Unbounded so that a [`Lease`]'s drop can always queue its release; the callers
    /// (requests) are bounded upstream. One FIFO: a lease's release follows its alloc.
    ops: mpsc::UnboundedSender<(CacheOp, Option<Reply>)>,
    next_lease: AtomicU64,
}

/// One request's reservation at the cache: what is granted under it belongs to it, and
/// dropping it gives all of that back, whether or not the grant reached the caller (its
/// client may vanish while the alloc is in flight). If the alloc may still be on its
/// way, the cache refuses it when it arrives.
pub struct Lease {
    id: u64,
    ops: mpsc::UnboundedSender<(CacheOp, Option<Reply>)>,
    state: LeaseState,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum LeaseState {
    /// Nothing asked, or the cache answered that nothing is held.
    Empty,
    /// An alloc was sent and its outcome is unknown: it may arrive at the cache up to
    /// this long from now.
    InFlight(Duration),
    Held,
}

impl Lease {
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let linger_ms = match self.state {
            LeaseState::Empty => return,
            LeaseState::Held => 0,
            LeaseState::InFlight(d) => d.as_millis() as u64,
        };
        // If the coalescing task is gone, so is the connection, and the cache released
        // everything it held.
        let _ = self.ops.send((CacheOp::ReleaseLease { lease: self.id, linger_ms }, None));
    }
}

struct Link {
    path: PathBuf,
    client: Mutex<Option<EmbedCacheClient>>,
    /// Longest (re)connection, and deadline of one coalesced call (which never waits in
    /// the cache's line).
    timeout: Duration,
}

impl CacheConnection {
    /// Connects now (failing if the cache is not there). `timeout` bounds this and every
    /// later reconnection, and each coalesced call.
    pub async fn connect(path: &Path, timeout: Duration) -> std::io::Result<Self> {
        let client = Link::open(path, timeout).await?;
        let link = Arc::new(Link { path: path.to_path_buf(), client: Mutex::new(Some(client)), timeout });
        let (ops, rx) = mpsc::unbounded_channel();
        tokio::spawn(coalesce(link.clone(), rx));
        Ok(CacheConnection { link, ops, next_lease: AtomicU64::new(1) })
    }

    /// A new lease: the holder of one request's references.
    pub fn lease(&self) -> Lease {
        Lease { id: self.next_lease.fetch_add(1, Ordering::Relaxed), ops: self.ops.clone(), state: LeaseState::Empty }
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

    /// `alloc` under `lease` (one per lease): granted at once through the coalesced
    /// path when nobody waits in the cache's line, else a call of its own that waits up
    /// to `wait`. What is granted belongs to the lease, even if this future is dropped.
    pub async fn alloc(
        &self,
        lease: &mut Lease,
        items: Vec<AllocItem>,
        wait: Duration,
        rpc_timeout: Duration,
    ) -> Result<Result<Allocation, CacheError>, RpcFailure> {
        // Until the answer is in, the alloc may still reach the cache (the wait, plus
        // the deadline of the call, plus one coalesced call queued ahead of it).
        lease.state = LeaseState::InFlight(wait + rpc_timeout + self.link.timeout);
        let lease_id = lease.id;
        let outcome = match self.op(CacheOp::Alloc { lease: lease_id, items: items.clone() }).await {
            Ok(CacheOpResult::Allocated(a)) => Ok(Ok(a)),
            Ok(CacheOpResult::Failed(e)) => Ok(Err(e)),
            Ok(_) => {
                let wait_ms = wait.as_millis() as u64;
                self.call(|c| async move { c.alloc(deadline(wait + rpc_timeout), lease_id, items, wait_ms).await })
                    .await
            }
            Err(e) => Err(e),
        };
        match &outcome {
            Ok(Ok(_)) => lease.state = LeaseState::Held,
            Ok(Err(_)) => lease.state = LeaseState::Empty,
            // The call failed in transport: it may or may not have been granted.
            Err(_) => {}
        }
        outcome
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
        self.ops.send((op, Some(tx))).map_err(|_| gone())?;
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
        let c = Self::open(&self.path, self.timeout)
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
/// ends when the connection is dropped. A grant whose caller went away meanwhile is
/// given back by the caller's [`Lease`], whose release is queued behind it. A lease's
/// release whose call failed (its deadline passed: the cache was stalled) is sent again
/// with the next call, a few times: it is idempotent, and nobody else would send it.
async fn coalesce(link: Arc<Link>, mut rx: mpsc::UnboundedReceiver<(CacheOp, Option<Reply>)>) {
    let mut queued = Vec::with_capacity(MAX_BATCH);
    // Releases whose call failed: (lease, linger_ms, tries so far).
    let mut retry: Vec<(u64, u64, u32)> = Vec::new();
    loop {
        if retry.is_empty() {
            if rx.recv_many(&mut queued, MAX_BATCH).await == 0 {
                return;
            }
        } else {
            tokio::time::sleep(RETRY_PAUSE).await;
            while queued.len() < MAX_BATCH
                && let Ok(op) = rx.try_recv()
            {
                queued.push(op);
            }
        }
        // Who waits for each operation's result: a caller, or nobody (a lease's release,
        // kept here so that it can be sent again).
        let mut ops = Vec::with_capacity(retry.len() + queued.len());
        let mut owners: Vec<Result<Reply, (u64, u64, u32)>> = Vec::with_capacity(ops.capacity());
        for (lease, linger_ms, tries) in retry.drain(..) {
            ops.push(CacheOp::ReleaseLease { lease, linger_ms });
            owners.push(Err((lease, linger_ms, tries)));
        }
        for (op, reply) in queued.drain(..) {
            owners.push(match (&op, reply) {
                (_, Some(reply)) => Ok(reply),
                (&CacheOp::ReleaseLease { lease, linger_ms }, None) => Err((lease, linger_ms, 0)),
                (_, None) => continue, // only releases are sent without a reply
            });
            ops.push(op);
        }
        let n = ops.len();
        let t = link.timeout;
        let outcome = link.call(|c| async move { c.batch(deadline(t), ops).await }).await;
        let results: Vec<Result<CacheOpResult, RpcFailure>> = match outcome {
            Ok(results) if results.len() == n => results.into_iter().map(Ok).collect(),
            Ok(results) => {
                let reason = format!("{} results for {n} operations", results.len());
                vec![Err(RpcFailure { service: "embed cache", reason }); n]
            }
            Err(e) => vec![Err(e); n],
        };
        for (owner, r) in owners.into_iter().zip(results) {
            match (owner, r) {
                (Ok(reply), r) => drop(reply.send(r)),
                (Err(_), Ok(_)) => {}
                (Err((lease, linger_ms, tries)), Err(e)) if tries + 1 < RELEASE_TRIES => {
                    tracing::warn!("releasing a lease (try {}): {e}; trying again", tries + 1);
                    retry.push((lease, linger_ms, tries + 1));
                }
                (Err(_), Err(e)) => tracing::error!("releasing a lease failed {RELEASE_TRIES} times: {e}; giving up"),
            }
        }
    }
}
