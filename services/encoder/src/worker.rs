//! The worker thread: drains the queue into batches, preprocesses, runs the tower,
//! writes rows into the arena and marks items ready.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use mmserve_config::ModelDir;
use mmserve_media::{ClipImageProcessor, ImageLimits, decode_image};
use mmserve_models::LlavaVision;
use mmserve_protocol::{EmbedCacheClient, EncodeItem, deadline};
use mmserve_shm::Segment;
use tokio::runtime::Handle;
use tokio::sync::mpsc;

use crate::service::{ItemFailure, Shared};
use crate::{EncoderArgs, EncoderServiceError};

pub(crate) struct Job {
    pub(crate) item: EncodeItem,
}

pub(crate) struct Worker {
    vision: LlavaVision,
    processor: ClipImageProcessor,
    limits: ImageLimits,
    arena: Segment,
    hidden: usize,
    cache: EmbedCacheClient,
    shared: Arc<Shared>,
    max_batch: usize,
    timeout: Duration,
}

impl Worker {
    pub(crate) async fn load(
        args: &EncoderArgs,
        cache: EmbedCacheClient,
        shared: Arc<Shared>,
    ) -> Result<Self, EncoderServiceError> {
        let dir = ModelDir::open(&args.model)?;
        let pp = dir.optional_json("preprocessor_config.json")?.ok_or(EncoderServiceError::NoPreprocessor)?;
        let processor = ClipImageProcessor::from_json(&pp)?;
        let vision = LlavaVision::load(&dir, &Device::Cpu, DType::F32)?;
        let (h, w) = processor.output_size();
        if h != vision.image_size() || w != vision.image_size() {
            return Err(EncoderServiceError::SizeMismatch { got: h.max(w), want: vision.image_size() });
        }
        let info = cache
            .arena(deadline(crate::CONNECT_TIMEOUT))
            .await
            .map_err(|e| EncoderServiceError::Cache(e.to_string()))?;
        let hidden = info.hidden as usize;
        let arena = Segment::open(&info.segment, info.slots as usize * hidden * 4)?;
        Ok(Worker {
            vision,
            processor,
            limits: ImageLimits::default(),
            arena,
            hidden,
            cache,
            shared,
            max_batch: args.max_batch.max(1),
            timeout: Duration::from_millis(args.timeout_ms),
        })
    }

    /// Runs until every sender of the queue is gone.
    pub(crate) fn run(self, mut rx: mpsc::Receiver<Job>, rt: Handle) {
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

    fn encode_batch(&self, batch: Vec<EncodeItem>, rt: &Handle) {
        let ids: Vec<u64> = batch.iter().map(|i| i.id).collect();
        let timeout_ms = self.timeout.as_millis() as u64;
        // The request that created an item may still be writing its bytes.
        let waited = rt.block_on(self.cache.wait_items_data(
            deadline(self.timeout + Duration::from_secs(1)),
            ids.clone(),
            timeout_ms,
        ));
        let ready = match waited {
            Ok(Ok(())) => rt.block_on(self.cache.get_items_embed(deadline(self.timeout), ids.clone())),
            Ok(Err(e)) => return self.fail_all(&batch, ItemFailure::Internal(format!("item data: {e}"))),
            Err(e) => return self.fail_all(&batch, ItemFailure::Internal(format!("embed cache: {e}"))),
        };
        let ready = match ready {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return self.fail_all(&batch, ItemFailure::Internal(e.to_string())),
            Err(e) => return self.fail_all(&batch, ItemFailure::Internal(format!("embed cache: {e}"))),
        };

        // Preprocess what still needs encoding; bad items fail alone.
        let mut todo = Vec::new();
        let mut pixels = Vec::new();
        for (item, ready) in batch.into_iter().zip(ready) {
            if ready {
                self.shared.finish(item.id, Ok(()));
                continue;
            }
            match self.preprocess(&item) {
                Ok(p) => {
                    pixels.extend_from_slice(&p);
                    todo.push(item);
                }
                Err(f) => self.shared.finish(item.id, Err(f)),
            }
        }
        if todo.is_empty() {
            return;
        }
        match self.run_tower(&todo, pixels) {
            Ok(()) => {
                let ids: Vec<u64> = todo.iter().map(|i| i.id).collect();
                match rt.block_on(self.cache.set_items_embed(deadline(self.timeout), ids)) {
                    Ok(Ok(())) => {
                        let mut stats = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
                        stats.items_encoded += todo.len() as u64;
                        stats.batches += 1;
                        stats.largest_batch = stats.largest_batch.max(todo.len() as u64);
                        drop(stats);
                        todo.iter().for_each(|i| self.shared.finish(i.id, Ok(())));
                    }
                    Ok(Err(e)) => self.fail_all(&todo, ItemFailure::Internal(e.to_string())),
                    Err(e) => self.fail_all(&todo, ItemFailure::Internal(format!("embed cache: {e}"))),
                }
            }
            Err(f) => self.fail_all(&todo, f),
        }
    }

    fn preprocess(&self, item: &EncodeItem) -> Result<Vec<f32>, ItemFailure> {
        let seg = Segment::open(&item.data_segment, item.data_len as usize)
            .map_err(|e| ItemFailure::Internal(e.to_string()))?;
        let mut bytes = vec![0u8; item.data_len as usize];
        seg.read(0, &mut bytes).map_err(|e| ItemFailure::Internal(e.to_string()))?;
        let img = decode_image(&bytes, &self.limits).map_err(|e| ItemFailure::Bad(e.to_string()))?;
        self.processor.preprocess(&img).map_err(|e| ItemFailure::Bad(e.to_string()))
    }

    fn run_tower(&self, items: &[EncodeItem], pixels: Vec<f32>) -> Result<(), ItemFailure> {
        let internal = |e: &dyn std::fmt::Display| ItemFailure::Internal(e.to_string());
        let s = self.vision.image_size();
        let input = Tensor::from_vec(pixels, (items.len(), 3, s, s), &Device::Cpu).map_err(|e| internal(&e))?;
        let out = self.vision.encode(&input).map_err(|e| internal(&e))?;
        let rows = out.to_dtype(DType::F32).and_then(|t| t.to_vec3::<f32>()).map_err(|e| internal(&e))?;
        for (item, rows) in items.iter().zip(rows) {
            if rows.len() != item.token_num as usize {
                return Err(ItemFailure::Internal(format!(
                    "the tower made {} rows for an item of {} tokens",
                    rows.len(),
                    item.token_num
                )));
            }
            let flat: Vec<f32> = rows.into_iter().flatten().collect();
            if flat.len() != item.token_num as usize * self.hidden {
                return Err(ItemFailure::Internal("embedding width differs from the arena's".into()));
            }
            let offset = item.start_index as usize * self.hidden * 4;
            self.arena.write_f32(offset, &flat).map_err(|e| internal(&e))?;
        }
        Ok(())
    }

    fn fail_all(&self, items: &[EncodeItem], failure: ItemFailure) {
        tracing::warn!(?failure, n = items.len(), "encoding failed");
        items.iter().for_each(|i| self.shared.finish(i.id, Err(failure.clone())));
    }
}
