//! Media items of a request: fetched ([`crate::fetch`]), checked from the header
//! (format, pixel limit) and keyed for the embed cache — the CPU work off the event
//! loop, on a bounded number of blocking threads. Full decoding and preprocessing happen
//! in the encoder, and only for cache misses (see ARCHITECTURE.md).

use std::sync::Arc;
use std::time::Duration;

use mmserve_media::{ImageLimits, image_dimensions};
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
}

/// Fetches, checks and keys one image.
pub async fn prepare_image(
    url: &str,
    limits: &MediaLimits,
    fingerprint: &str,
    token_num: u32,
) -> Result<MediaItem, ApiError> {
    let bytes = fetch(url, &limits.fetch, "image_url").await?;
    let wait = Duration::from_secs(30);
    let permit = tokio::time::timeout(wait, limits.cpu_slots.clone().acquire_owned())
        .await
        .map_err(|_| ApiError::Unavailable("too many images are being processed; try again".into()))?
        .map_err(|_| ApiError::Internal("the media pool is closed".into()))?;
    let (image, fingerprint) = (limits.image, fingerprint.to_string());
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let (w, h) = image_dimensions(&bytes).map_err(|e| ApiError::bad_param("image_url", e.to_string()))?;
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
        let digest = ItemDigest::compute(Modality::Image, &fingerprint, &bytes);
        Ok(MediaItem { bytes, digest, modality: Modality::Image, token_num })
    })
    .await
    .map_err(|e| ApiError::Internal(format!("media task: {e}")))?
}
