//! The worker thread: drains the queue into batches, preprocesses, runs the tower,
//! writes rows into the arena and marks items ready.

use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use mmserve_arena::{ArenaMap, ArenaView, Mapped};
use mmserve_config::ModelDir;
use mmserve_models::ArenaRows;
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{EncodeItem, deadline};
use tokio::runtime::Handle;
use tokio::sync::mpsc;

use crate::service::{ItemFailure, Shared};
use crate::tower::{Input, Tower};
use crate::{EncoderArgs, EncoderServiceError};

pub(crate) struct Job {
    pub(crate) item: EncodeItem,
}

pub(crate) struct Worker {
    tower: Tower,
    /// The embedding rows as the tower's device writes them (pinned and mapped on a
    /// GPU); declared before `arena` so it ends its registration before the unmap.
    rows: ArenaRows,
    arena: Arc<ArenaView>,
    map: ArenaMap,
    cache: Arc<CacheConnection>,
    shared: Arc<Shared>,
    max_batch: usize,
    timeout: Duration,
}

/// `arena`'s embedding rows registered with `device` (a GPU then copies into them
/// directly); staged through host memory, with a warning, where that fails.
fn map_rows(arena: &ArenaView, device: &Device) -> Result<ArenaRows, mmserve_models::ModelError> {
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
    pub(crate) async fn load(
        args: &EncoderArgs,
        cache: Arc<CacheConnection>,
        shared: Arc<Shared>,
    ) -> Result<Self, EncoderServiceError> {
        let dir = ModelDir::open(&args.model)?;
        let tower = Tower::load(&dir, &args.placement.resolve(&dir)?)?;
        let map = ArenaMap::connect(&cache, crate::CONNECT_TIMEOUT)
            .await
            .map_err(|e| EncoderServiceError::Cache(e.to_string()))?;
        let arena = map.current();
        let rows = map_rows(&arena, tower.device()).map_err(|e| EncoderServiceError::Cache(e.to_string()))?;
        Ok(Worker {
            tower,
            rows,
            arena,
            map,
            cache,
            shared,
            max_batch: args.max_batch.max(1),
            timeout: Duration::from_millis(args.timeout_ms),
        })
    }

    /// Runs until every sender of the queue is gone.
    pub(crate) fn run(mut self, mut rx: mpsc::Receiver<Job>, rt: Handle) {
        while let Some(first) = rx.blocking_recv() {
            let mut batch = vec![first.item];
            while batch.len() < self.max_batch {
                match rx.try_recv() {
                    Ok(job) => batch.push(job.item),
                    Err(_) => break,
                }
            }
            self.encode_batch(batch, &rt);
        }
    }

    /// Maps the arenas of `instance` if they are not the ones mapped (the cache restarted).
    fn ensure_instance(&mut self, instance: u64, rt: &Handle) -> Result<(), ItemFailure> {
        if self.arena.info.instance == instance {
            return Ok(());
        }
        let view = rt.block_on(self.map.view(instance, &self.cache, self.timeout)).map_err(internal)?;
        if let Mapped::New(arena) = view {
            self.rows = map_rows(&arena, self.tower.device()).map_err(internal)?;
            self.arena = arena;
        }
        Ok(())
    }

    fn encode_batch(&mut self, batch: Vec<EncodeItem>, rt: &Handle) {
        let mut current = Vec::with_capacity(batch.len());
        for item in batch {
            match self.ensure_instance(item.cache_instance, rt) {
                Ok(()) => current.push(item),
                Err(f) => self.shared.finish(item.id, Err(f)),
            }
        }
        let batch = current;
        if batch.is_empty() {
            return;
        }
        // Pin the items (a reference of the encoder's own), so none can be evicted and
        // its slots reused while its rows are being written.
        let t = self.timeout;
        let ids: Vec<u64> = batch.iter().map(|i| i.id).collect();
        let pinned = match rt.block_on(self.cache.call(|c| async move { c.pin(deadline(t), ids).await })) {
            Ok(p) => p,
            Err(e) => return self.fail_all(&batch, ItemFailure::Gone(e.to_string())),
        };
        let mut kept = Vec::with_capacity(batch.len());
        for (item, ok) in batch.into_iter().zip(pinned) {
            if ok {
                kept.push(item);
            } else {
                let gone = "the item left the embed cache before it was encoded; retry the request";
                self.shared.finish(item.id, Err(ItemFailure::Gone(gone.into())));
            }
        }
        if kept.is_empty() {
            return;
        }
        let pinned_ids: Vec<u64> = kept.iter().map(|i| i.id).collect();
        self.encode_pinned(kept, rt);
        if let Err(e) = rt.block_on(self.cache.call(|c| async move { c.release(deadline(t), pinned_ids).await })) {
            // A broken connection releases the pins by itself.
            tracing::warn!("releasing the encoder's pins: {e}");
        }
    }

    fn encode_pinned(&mut self, batch: Vec<EncodeItem>, rt: &Handle) {
        let t = self.timeout;
        let ids: Vec<u64> = batch.iter().map(|i| i.id).collect();
        let ready = match rt.block_on(self.cache.call(|c| async move { c.get_items_embed(deadline(t), ids).await })) {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return self.fail_all(&batch, internal(e)),
            Err(e) => return self.fail_all(&batch, ItemFailure::Gone(e.to_string())),
        };

        // Preprocess what still needs encoding; bad items fail alone.
        let mut todo = Vec::new();
        let mut inputs = Vec::new();
        for (item, ready) in batch.into_iter().zip(ready) {
            if ready {
                self.shared.finish(item.id, Ok(()));
                continue;
            }
            match self.preprocess(&item) {
                Ok(input) => {
                    inputs.push(input);
                    todo.push(item);
                }
                Err(f) => self.shared.finish(item.id, Err(f)),
            }
        }
        if todo.is_empty() {
            return;
        }
        if let Err(f) = self.run_tower(&todo, inputs) {
            return self.fail_all(&todo, f);
        }
        let ids: Vec<u64> = todo.iter().map(|i| i.id).collect();
        match rt.block_on(self.cache.call(|c| async move { c.set_items_embed(deadline(t), ids).await })) {
            Ok(Ok(())) => {
                let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
                stats.items_encoded += todo.len() as u64;
                stats.batches += 1;
                stats.largest_batch = stats.largest_batch.max(todo.len() as u64);
                drop(stats);
                todo.iter().for_each(|i| self.shared.finish(i.id, Ok(())));
            }
            Ok(Err(e)) => self.fail_all(&todo, internal(e)),
            Err(e) => self.fail_all(&todo, ItemFailure::Gone(e.to_string())),
        }
    }

    fn preprocess(&self, item: &EncodeItem) -> Result<Input, ItemFailure> {
        let bytes = self.arena.read_data(item.data_offset, item.data_len).map_err(internal)?;
        self.tower.prepare(&bytes).map_err(ItemFailure::Bad)
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
