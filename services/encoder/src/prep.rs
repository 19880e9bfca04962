//! The preparing stage: takes queued items as they come, asks the cache in one round
//! trip what each needs (pinning those still to encode, so no slot is reused under
//! them), and preprocesses each on a pool of blocking threads (one item a thread, as many
//! at once as there are cores), handing the tower thread each input as soon as it is
//! ready. The next items are preprocessed while the tower runs the current batch.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use mmserve_arena::{ArenaMap, ArenaView};
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{EncodeItem, PinState, deadline};
use tokio::sync::{Semaphore, mpsc};

use crate::service::{ItemFailure, Shared};
use crate::tower::{Input, Preparer};

pub(crate) struct Job {
    pub(crate) item: EncodeItem,
}

/// What the preparing stage hands the tower: an item ready, or word that one of the
/// items it counted as [`Prep::preparing`] failed (so a tower waiting for it wakes).
pub(crate) type ToTower = Option<Prepared>;

/// An item ready for the tower: its input, and the arenas its rows go to.
pub(crate) struct Prepared {
    pub(crate) item: EncodeItem,
    pub(crate) input: Input,
    pub(crate) view: Arc<ArenaView>,
    /// Seconds its decoding and preprocessing took.
    pub(crate) preprocess_s: f64,
}

pub(crate) struct Prep {
    pub(crate) preparer: Arc<Preparer>,
    pub(crate) map: Arc<ArenaMap>,
    pub(crate) cache: Arc<CacheConnection>,
    pub(crate) shared: Arc<Shared>,
    /// Items preprocessed at once.
    pub(crate) threads: Arc<Semaphore>,
    pub(crate) max_batch: usize,
    pub(crate) timeout: Duration,
    /// Items pinned and not yet handed to the tower: while there are some, the tower
    /// waits for them before it runs (a burst's items make one batch, not one each).
    pub(crate) preparing: Arc<AtomicUsize>,
}

impl Prep {
    /// Runs until every sender of the queue is gone.
    pub(crate) async fn run(self, mut queue: mpsc::Receiver<Job>, out: mpsc::Sender<ToTower>) {
        let mut jobs = Vec::with_capacity(self.max_batch);
        while queue.recv_many(&mut jobs, self.max_batch).await > 0 {
            let items: Vec<EncodeItem> = jobs.drain(..).map(|j| j.item).collect();
            self.take(items, &out).await;
        }
    }

    async fn take(&self, items: Vec<EncodeItem>, out: &mpsc::Sender<ToTower>) {
        let t = self.timeout;
        let ids: Vec<u64> = items.iter().map(|i| i.id).collect();
        let states = match self.cache.call(|c| async move { c.pin_unready(deadline(t), ids).await }).await {
            Ok(s) if s.len() == items.len() => s,
            Ok(_) => return self.fail(&items, ItemFailure::Internal("the cache answered for other items".into())),
            Err(e) => return self.fail(&items, ItemFailure::Gone(e.to_string())),
        };
        let pinned = states.iter().filter(|s| **s == PinState::Pinned).count();
        self.preparing.fetch_add(pinned, Ordering::AcqRel);
        for (item, state) in items.into_iter().zip(states) {
            match state {
                PinState::Gone => {
                    let gone = "the item left the embed cache before it was encoded; retry the request";
                    self.shared.finish(item.id, Err(ItemFailure::Gone(gone.into())));
                }
                PinState::Ready => self.shared.finish(item.id, Ok(None)),
                PinState::Pinned => self.prepare(item, out).await,
            }
        }
    }

    /// Preprocesses one pinned item on a pool thread; the tower gets it when it is done.
    async fn prepare(&self, item: EncodeItem, out: &mpsc::Sender<ToTower>) {
        let view = match self.map.view(item.cache_instance, &self.cache, self.timeout).await {
            Ok(mapped) => mapped.view().clone(),
            Err(e) => return self.give_up(item, ItemFailure::Internal(e.to_string()), out).await,
        };
        let Ok(thread) = self.threads.clone().acquire_owned().await else {
            return self.give_up(item, ItemFailure::Internal("the preprocessing pool is closed".into()), out).await;
        };
        let (preparer, out, shared, cache, t, preparing) = (
            self.preparer.clone(),
            out.clone(),
            self.shared.clone(),
            self.cache.clone(),
            self.timeout,
            self.preparing.clone(),
        );
        tokio::spawn(async move {
            let job = {
                let view = view.clone();
                let (offset, len, bounds) = (item.data_offset, item.data_len, item.pixel_bounds);
                tokio::task::spawn_blocking(move || {
                    let _thread = thread;
                    let start = std::time::Instant::now();
                    let bytes = view.read_data(offset, len).map_err(|e| ItemFailure::Internal(e.to_string()))?;
                    let input = preparer.prepare(&bytes, bounds).map_err(ItemFailure::Bad)?;
                    Ok((input, start.elapsed().as_secs_f64()))
                })
            };
            let (item, failure) = match job.await {
                Ok(Ok((input, preprocess_s))) => {
                    preparing.fetch_sub(1, Ordering::AcqRel);
                    match out.send(Some(Prepared { item, input, view, preprocess_s })).await {
                        Ok(()) => return,
                        Err(mpsc::error::SendError(p)) => {
                            let p = p.expect("sent an item");
                            unpin(&cache, &[p.item.id], t).await;
                            return shared.finish(p.item.id, Err(ItemFailure::Internal("the tower stopped".into())));
                        }
                    }
                }
                Ok(Err(f)) => (item, f),
                Err(e) => (item, ItemFailure::Internal(format!("preprocessing: {e}"))),
            };
            unpin(&cache, &[item.id], t).await;
            shared.finish(item.id, Err(failure));
            preparing.fetch_sub(1, Ordering::AcqRel);
            let _ = out.send(None).await;
        });
    }

    async fn give_up(&self, item: EncodeItem, failure: ItemFailure, out: &mpsc::Sender<ToTower>) {
        unpin(&self.cache, &[item.id], self.timeout).await;
        self.shared.finish(item.id, Err(failure));
        self.preparing.fetch_sub(1, Ordering::AcqRel);
        let _ = out.send(None).await;
    }

    fn fail(&self, items: &[EncodeItem], failure: ItemFailure) {
        tracing::warn!(?failure, n = items.len(), "encoding failed");
        items.iter().for_each(|i| self.shared.finish(i.id, Err(failure.clone())));
    }
}

/// Releases the encoder's pins (a broken connection releases them by itself).
pub(crate) async fn unpin(cache: &CacheConnection, ids: &[u64], t: Duration) {
    let ids = ids.to_vec();
    if let Err(e) = cache.call(|c| async move { c.encoded(deadline(t), Vec::new(), ids).await }).await {
        tracing::warn!("releasing the encoder's pins: {e}");
    }
}
