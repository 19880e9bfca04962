//! The tarpc face of the encoder: dedup against the cache and against items in flight,
//! then wait (with a timeout) for the worker to finish this request's items.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mmserve_arena::ArenaMap;
use mmserve_config::ModelDir;
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{EncodeItem, Encoder, EncoderError, EncoderStats, ItemTiming, deadline};
use tarpc::context::Context;
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::prep::{Job, Prep};
use crate::tower::Tower;
use crate::worker::{Worker, map_rows};
use crate::{EncoderArgs, EncoderServiceError};

/// Why an item could not be encoded.
#[derive(Debug, Clone)]
pub(crate) enum ItemFailure {
    /// The bytes are not a usable image: the client's fault.
    Bad(String),
    /// The item left the cache before it could be encoded (its requests are gone).
    Gone(String),
    Internal(String),
}

/// Result of one item, shared with every request waiting on it: its timing when the
/// tower ran it, `None` when it was ready already.
pub(crate) type ItemResult = Result<Option<ItemTiming>, ItemFailure>;

pub(crate) struct Shared {
    /// Items queued or being encoded → the requests waiting for them.
    pub(crate) inflight: Mutex<HashMap<u64, Vec<oneshot::Sender<ItemResult>>>>,
    pub(crate) stats: Mutex<EncoderStats>,
}

impl Shared {
    /// Completes an item for every waiter.
    pub(crate) fn finish(&self, id: u64, result: ItemResult) {
        let waiters = self.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        for w in waiters.into_iter().flatten() {
            let _ = w.send(result.clone());
        }
    }
}

#[derive(Clone)]
pub struct EncoderService {
    shared: Arc<Shared>,
    queue: mpsc::Sender<Job>,
    cache: Arc<CacheConnection>,
    timeout: Duration,
}

impl EncoderService {
    pub async fn start(args: &EncoderArgs, cache: Arc<CacheConnection>) -> Result<Self, EncoderServiceError> {
        let shared =
            Arc::new(Shared { inflight: Mutex::new(HashMap::new()), stats: Mutex::new(EncoderStats::default()) });
        let timeout = Duration::from_millis(args.timeout_ms);
        let dir = ModelDir::open(&args.model)?;
        let (tower, preparer) = Tower::load(&dir, &args.placement.resolve(&dir)?)?;
        let map = Arc::new(
            ArenaMap::connect(&cache, Duration::from_secs(args.connect_timeout_s.max(1)))
                .await
                .map_err(|e| EncoderServiceError::Cache(e.to_string()))?,
        );
        let arena = map.current();
        let rows = map_rows(&arena, tower.device()).map_err(|e| EncoderServiceError::Cache(e.to_string()))?;
        let max_batch = args.max_batch.max(1);
        let preparing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let worker = Worker {
            tower,
            rows,
            arena,
            cache: cache.clone(),
            shared: shared.clone(),
            max_batch,
            timeout,
            preparing: preparing.clone(),
        };
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = match args.prep_threads {
            0 if worker.tower.device().is_cpu() => (cores / 2).max(1),
            0 => cores,
            n => n,
        };
        let prep = Prep {
            preparer: Arc::new(preparer),
            map,
            cache: cache.clone(),
            shared: shared.clone(),
            threads: Arc::new(Semaphore::new(threads)),
            max_batch,
            timeout,
            preparing,
        };
        // Bounded: when the tower falls behind, `encode` calls wait here rather than
        // piling up without limit, and preprocessing runs at most two batches ahead.
        let (queue, rx) = mpsc::channel(max_batch * 8);
        let (prepared_tx, prepared_rx) = mpsc::channel(max_batch * 2);
        tokio::spawn(prep.run(rx, prepared_tx));
        let handle = tokio::runtime::Handle::current();
        mmserve_protocol::ready::spawn_vital("encoder-worker", move || worker.run(prepared_rx, handle))
            .expect("spawning the encoder worker thread");
        Ok(EncoderService { shared, queue, cache, timeout })
    }
}

impl EncoderService {
    async fn encode_inner(&self, todo: Vec<EncodeItem>) -> Result<Vec<ItemTiming>, EncoderError> {
        let cache_err = |e: mmserve_protocol::CacheError| match e {
            mmserve_protocol::CacheError::Timeout(ms) => EncoderError::Timeout(ms),
            other => EncoderError::Unavailable(other.to_string()),
        };
        let t = self.timeout;
        if todo.is_empty() {
            return Ok(Vec::new());
        }
        // The request that created an item may still be writing its bytes: wait here, so
        // the worker only ever gets items it can read. (Items whose embeddings are ready
        // meanwhile are found so by the preparing stage and not encoded again.)
        let ids: Vec<u64> = todo.iter().map(|i| i.id).collect();
        let timeout_ms = t.as_millis() as u64;
        self.cache
            .call(|c| async move { c.wait_items_data(deadline(t + Duration::from_secs(1)), ids, timeout_ms).await })
            .await
            .map_err(|e| EncoderError::Unavailable(e.to_string()))?
            .map_err(cache_err)?;

        // (the item's result, whether this call queued it: only then are its timings ours)
        let mut waits = Vec::with_capacity(todo.len());
        for item in todo {
            let (tx, rx) = oneshot::channel();
            let Some(tx) = self.join_inflight(item.id, tx) else {
                waits.push((rx, false));
                continue;
            };
            // Reserve room in the queue before registering, so that nothing can be
            // cancelled between registering an item and queueing its job.
            let permit = self.queue.reserve().await.map_err(|_| EncoderError::Internal("the worker stopped".into()))?;
            let mut inflight = self.shared.inflight.lock().unwrap_or_else(|p| p.into_inner());
            let waiters = inflight.entry(item.id).or_default();
            waiters.push(tx);
            let queued = waiters.len() == 1;
            if queued {
                permit.send(Job { item });
            }
            waits.push((rx, queued));
        }
        let mut timings = Vec::new();
        for (rx, queued) in waits {
            match rx.await {
                Ok(Ok(timing)) => timings.extend(timing.filter(|_| queued)),
                Ok(Err(ItemFailure::Bad(message))) => return Err(EncoderError::BadItem { index: 0, message }),
                Ok(Err(ItemFailure::Gone(message))) => return Err(EncoderError::Unavailable(message)),
                Ok(Err(ItemFailure::Internal(message))) => return Err(EncoderError::Internal(message)),
                Err(_) => return Err(EncoderError::Internal("the encoder worker dropped an item".into())),
            }
        }
        Ok(timings)
    }
}

impl EncoderService {
    /// Adds `tx` to the waiters of an item already in flight; gives it back if the item
    /// is not in flight.
    fn join_inflight(&self, id: u64, tx: oneshot::Sender<ItemResult>) -> Option<oneshot::Sender<ItemResult>> {
        let mut inflight = self.shared.inflight.lock().unwrap_or_else(|p| p.into_inner());
        match inflight.get_mut(&id) {
            Some(waiters) => {
                waiters.push(tx);
                None
            }
            None => Some(tx),
        }
    }
}

impl Encoder for EncoderService {
    async fn encode(
        self,
        _: Context,
        request_id: String,
        items: Vec<EncodeItem>,
    ) -> Result<Vec<ItemTiming>, EncoderError> {
        let timeout_ms = self.timeout.as_millis() as u64;
        let n = items.len();
        let result = tokio::time::timeout(self.timeout, self.encode_inner(items))
            .await
            .map_err(|_| EncoderError::Timeout(timeout_ms))?;
        if let Err(e) = &result {
            tracing::warn!(request_id, items = n, "encoding failed: {e}");
        }
        result
    }

    async fn stats(self, _: Context) -> EncoderStats {
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
