//! Media items of a request: fetched ([`crate::fetch`]), checked from the header
//! (format, pixel limit) and keyed for the embed cache — the CPU work off the event
//! loop, on a bounded number of blocking threads. Full decoding and preprocessing happen
//! in the encoder, and only for cache misses (see ARCHITECTURE.md).

use std::sync::Arc;
use std::time::Duration;

use mmserve_media::{ImageLimits, ImageProcessor, image_header};
use mmserve_protocol::{ItemDigest, Modality};
use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::fetch::{FetchPolicy, fetch};

/// An item ready for the cache: its bytes and key.
pub struct MediaItem {
    pub bytes: Vec<u8>,
    pub digest: ItemDigest,
    pub modality: Modality,
    pub token_num: u32,
}

/// Limits checked before any expensive work.
#[derive(Debug, Clone)]
pub struct MediaLimits {
    pub max_items: usize,
    pub image: ImageLimits,
    pub fetch: FetchPolicy,
    /// Items being checked and hashed at once; a burst of large images queues here.
    pub cpu_slots: Arc<Semaphore>,
    /// The model's image processor: size checks and, where it decides, token counts.
    pub processor: ImageProcessor,
}

/// Fetches, checks and keys one image; `model_tokens` is the count when the model
/// fixes it (LLaVA), otherwise the processor computes it from the header (Qwen2-VL).
pub async fn prepare_image(
    url: &str,
    limits: &MediaLimits,
    fingerprint: &str,
    model_tokens: u32,
) -> Result<MediaItem, ApiError> {
    let bytes = fetch(url, &limits.fetch, "image_url").await?;
    let wait = Duration::from_secs(30);
    let permit = tokio::time::timeout(wait, limits.cpu_slots.clone().acquire_owned())
        .await
        .map_err(|_| ApiError::Unavailable("too many images are being processed; try again".into()))?
        .map_err(|_| ApiError::Internal("the media pool is closed".into()))?;
    let (image, fingerprint, processor) = (limits.image, fingerprint.to_string(), limits.processor.clone());
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let bad = |e: mmserve_media::MediaError| ApiError::bad_param("image_url", e.to_string());
        let header = image_header(&bytes).map_err(bad)?;
        let (w, h) = (header.width, header.height);
        if u64::from(w) * u64::from(h) > image.max_pixels {
            return Err(ApiError::bad_param(
                "image_url",
                format!(
                    "the image is {w}×{h}, more than the limit of {} pixels (--max-image-pixels)",
                    image.max_pixels
                ),
            ));
        }
        if w == 0 || h == 0 {
            return Err(ApiError::bad_param("image_url", "the image has no pixels"));
        }
        let token_num = match processor.num_tokens(w, h).map_err(bad)? {
            Some(n) => u32::try_from(n).map_err(|_| ApiError::bad_param("image_url", "the image is too large"))?,
            None => model_tokens,
        };
        let digest = ItemDigest::compute(Modality::Image, &fingerprint, &bytes);
        Ok(MediaItem { bytes, digest, modality: Modality::Image, token_num })
    })
    .await
    .map_err(|e| ApiError::Internal(format!("media task: {e}")))?
}
