//! The tower thread: takes whatever the preparing stage ([`crate::prep`]) has ready, up
//! to `--max-batch` items, runs the tower, writes the rows into the arena and tells the
//! cache in one round trip (rows ready, pins released).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use candle_core::Device;
use mmserve_arena::ArenaView;
use mmserve_ops::ArenaRows;
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{EncodeItem, ItemTiming, deadline};
use tokio::runtime::Handle;
use tokio::sync::mpsc;

use crate::prep::{Prepared, ToTower};
use crate::service::{ItemFailure, Shared};
use crate::tower::{Input, Tower};

pub(crate) struct Worker {
    pub(crate) tower: Tower,
    /// The embedding rows as the tower's device writes them (pinned and mapped on a
    /// GPU); declared before `arena` so it ends its registration before the unmap.
    pub(crate) rows: ArenaRows,
    pub(crate) arena: Arc<ArenaView>,
    pub(crate) cache: Arc<CacheConnection>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) max_batch: usize,
    pub(crate) timeout: Duration,
    /// See [`crate::prep::Prep::preparing`].
    pub(crate) preparing: Arc<AtomicUsize>,
}

/// `arena`'s embedding rows registered with `device` (a GPU then copies into them
/// directly); staged through host memory, with a warning, where that fails.
pub(crate) fn map_rows(arena: &ArenaView, device: &Device) -> Result<ArenaRows, mmserve_models::ModelError> {
    let r = arena.embed_rows();
    let dtype = mmserve_models::parse_dtype(r.dtype.name())?;
    // SAFETY: the region is `arena`'s mapping; the worker keeps the view alive for as
    // long as the rows (`rows` is replaced before `arena`, and drops first).
    let rows = unsafe { ArenaRows::new(r.ptr, r.slots, r.row_len, dtype, device)? };
    if let Some(why) = rows.mapping_error() {
        tracing::warn!(why, "the arena is not mapped for the device; rows are copied through host memory");
    }
    Ok(rows)
}

fn internal(e: impl std::fmt::Display) -> ItemFailure {
    ItemFailure::Internal(e.to_string())
}

impl Worker {
    /// Runs until the preparing stage is gone. A batch is what is prepared, plus what
    /// is still being prepared (up to `--max-batch`): the items of a burst share one
    /// forward, and the next burst is preprocessed while it runs.
    pub(crate) fn run(mut self, mut prepared: mpsc::Receiver<ToTower>, rt: Handle) {
        while let Some(first) = prepared.blocking_recv() {
            let mut batch: Vec<Prepared> = first.into_iter().collect();
            loop {
                while batch.len() < self.max_batch
                    && let Ok(p) = prepared.try_recv()
                {
                    batch.extend(p);
                }
                if batch.len() >= self.max_batch || self.preparing.load(Ordering::Acquire) == 0 {
                    break;
                }
                // Every item counted as preparing sends something: this wait ends.
                match prepared.blocking_recv() {
                    Some(p) => batch.extend(p),
                    None => break,
                }
            }
            if batch.is_empty() {
                continue;
            }
            // Normally one instance; after a cache restart, the old one's items first.
            while !batch.is_empty() {
                let instance = batch[0].view.info.instance;
                let (now, later): (Vec<Prepared>, Vec<Prepared>) =
                    batch.into_iter().partition(|p| p.view.info.instance == instance);
                self.encode(now, &rt);
                batch = later;
            }
        }
    }

    /// One tower forward for items of one cache instance; every pin is released after.
    fn encode(&mut self, batch: Vec<Prepared>, rt: &Handle) {
        let view = batch[0].view.clone();
        let preprocess: Vec<f64> = batch.iter().map(|p| p.preprocess_s).collect();
        let (items, inputs): (Vec<EncodeItem>, Vec<Input>) = batch.into_iter().map(|p| (p.item, p.input)).unzip();
        let ids: Vec<u64> = items.iter().map(|i| i.id).collect();
        let start = std::time::Instant::now();
        let result = self.remap(view).and_then(|()| self.run_tower(&items, inputs));
        let tower_s = start.elapsed().as_secs_f64();
        let ready = if result.is_ok() { ids.clone() } else { Vec::new() };
        let t = self.timeout;
        let told = rt.block_on(self.cache.call(|c| async move { c.encoded(deadline(t), ready, ids).await }));
        match (result, told) {
            (Ok(()), Ok(Ok(()))) => {
                let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
                stats.items_encoded += items.len() as u64;
                stats.batches += 1;
                stats.largest_batch = stats.largest_batch.max(items.len() as u64);
                drop(stats);
                for (item, preprocess_s) in items.iter().zip(preprocess) {
                    self.shared.finish(item.id, Ok(Some(ItemTiming { preprocess_s, tower_s })));
                }
            }
            (Err(f), _) => self.fail_all(&items, f),
            (Ok(()), Ok(Err(e))) => self.fail_all(&items, internal(e)),
            (Ok(()), Err(e)) => self.fail_all(&items, ItemFailure::Gone(e.to_string())),
        }
    }

    /// Registers `view`'s rows with the device if they are not the ones registered (the
    /// cache restarted).
    fn remap(&mut self, view: Arc<ArenaView>) -> Result<(), ItemFailure> {
        if view.info.instance == self.arena.info.instance {
            return Ok(());
        }
        self.rows = map_rows(&view, self.tower.device()).map_err(internal)?;
        self.arena = view;
        Ok(())
    }

    fn run_tower(&self, items: &[EncodeItem], inputs: Vec<Input>) -> Result<(), ItemFailure> {
        let rows = self.tower.run(inputs).map_err(internal)?;
        let width = self.arena.row_len();
        for (item, rows) in items.iter().zip(rows) {
            if rows.dims() != [item.token_num as usize, width] {
                return Err(internal(format!(
                    "the tower made rows {:?} for an item of {} tokens of {width}",
                    rows.dims(),
                    item.token_num
                )));
            }
            self.rows.write(item.start_index as usize, &rows).map_err(internal)?;
        }
        Ok(())
    }

    fn fail_all(&self, items: &[EncodeItem], failure: ItemFailure) {
        tracing::warn!(?failure, n = items.len(), "encoding failed");
        items.iter().for_each(|i| self.shared.finish(i.id, Err(failure.clone())));
    }
}
