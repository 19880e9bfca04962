//! Media items of a request: fetched ([`crate::fetch`]), checked and keyed for the embed
//! cache — the CPU work off the event loop, on a bounded number of blocking threads.
//!
//! Images are checked from the header only (format, pixel limit); full decoding and
//! preprocessing happen in the encoder, for cache misses only. Audio is decoded here
//! (16 kHz mono, truncated to the extractor's 30 s window), because its token count
//! depends on the exact number of samples; the encoder receives those samples and
//! computes the log-mel features (see ARCHITECTURE.md).

use std::sync::Arc;
use std::time::Duration;

use mmserve_media::audio::{AudioLimits, WhisperFeatureExtractor, decode_audio};
use mmserve_media::{ImageLimits, ImageProcessor, image_header};
use mmserve_protocol::{ItemDigest, Modality};
use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::fetch::{FetchPolicy, base64_payload, fetch};
use crate::openai::AudioSource;
use crate::prompt::ItemSource;

/// An item ready for the cache: the bytes the encoder reads, and its key.
pub struct MediaItem {
    /// Images: the file as sent. Audio: 16 kHz mono `f32` samples, little-endian.
    pub bytes: Vec<u8>,
    pub digest: ItemDigest,
    pub modality: Modality,
    pub token_num: u32,
}

/// What the served model takes, with what prepares it.
#[derive(Debug, Clone)]
pub enum ModelMedia {
    /// `model_tokens`: the token count when the model fixes it (LLaVA); otherwise the
    /// processor computes it from the header (Qwen2-VL).
    Image {
        processor: ImageProcessor,
        model_tokens: u32,
    },
    Audio(WhisperFeatureExtractor),
}

impl ModelMedia {
    pub fn modality(&self) -> Modality {
        match self {
            ModelMedia::Image { .. } => Modality::Image,
            ModelMedia::Audio(_) => Modality::Audio,
        }
    }

    /// Everything besides the bytes that changes an item's embedding (the model name is
    /// added by the caller).
    pub fn fingerprint(&self) -> String {
        match self {
            ModelMedia::Image { processor, .. } => processor.fingerprint(),
            ModelMedia::Audio(fe) => fe.fingerprint(),
        }
    }
}

/// Limits checked before any expensive work.
#[derive(Debug, Clone)]
pub struct MediaLimits {
    pub max_items: usize,
    pub image: ImageLimits,
    pub audio: AudioLimits,
    pub fetch: FetchPolicy,
    /// Items being checked and hashed at once; a burst of large items queues here.
    pub cpu_slots: Arc<Semaphore>,
    pub model: ModelMedia,
}

/// The name a client used for an item's part, for error messages.
fn param(src: &ItemSource) -> &'static str {
    match src {
        ItemSource::Image(_) => "image_url",
        ItemSource::Audio(AudioSource::Inline { .. }) => "input_audio",
        ItemSource::Audio(AudioSource::Url(_)) => "audio_url",
    }
}

/// Refuses an item the model cannot take, naming what it takes.
pub fn check_kind(src: &ItemSource, model: &ModelMedia, model_name: &str) -> Result<(), ApiError> {
    let (sent, takes) = match (src, model) {
        (ItemSource::Image(_), ModelMedia::Image { .. }) | (ItemSource::Audio(_), ModelMedia::Audio(_)) => {
            return Ok(());
        }
        (ItemSource::Image(_), ModelMedia::Audio(_)) => ("images", "audio"),
        (ItemSource::Audio(_), ModelMedia::Image { .. }) => ("audio", "images"),
    };
    Err(ApiError::bad_param(param(src), format!("model {model_name} accepts text and {takes}, not {sent}")))
}

/// Fetches, checks and keys one item.
pub async fn prepare(src: &ItemSource, limits: &MediaLimits, fingerprint: &str) -> Result<MediaItem, ApiError> {
    let p = param(src);
    let (bytes, hint) = match src {
        ItemSource::Image(url) | ItemSource::Audio(AudioSource::Url(url)) => {
            (fetch(url, &limits.fetch, p).await?, None)
        }
        ItemSource::Audio(AudioSource::Inline { data, format }) => {
            (base64_payload(data, limits.fetch.max_bytes, p)?, format.clone())
        }
    };
    let wait = Duration::from_secs(30);
    let permit = tokio::time::timeout(wait, limits.cpu_slots.clone().acquire_owned())
        .await
        .map_err(|_| ApiError::Unavailable("too many media items are being processed; try again".into()))?
        .map_err(|_| ApiError::Internal("the media pool is closed".into()))?;
    let (limits, fingerprint) = (limits.clone(), fingerprint.to_string());
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        match &limits.model {
            ModelMedia::Image { processor, model_tokens } => {
                check_image(bytes, &limits.image, processor, *model_tokens, &fingerprint)
            }
            ModelMedia::Audio(fe) => audio(bytes, hint.as_deref(), &limits.audio, fe, &fingerprint, p),
        }
    })
    .await
    .map_err(|e| ApiError::Internal(format!("media task: {e}")))?
}

fn check_image(
    bytes: Vec<u8>,
    limits: &ImageLimits,
    processor: &ImageProcessor,
    model_tokens: u32,
    fingerprint: &str,
) -> Result<MediaItem, ApiError> {
    let bad = |e: mmserve_media::MediaError| ApiError::bad_param("image_url", e.to_string());
    let header = image_header(&bytes).map_err(bad)?;
    let (w, h) = (header.width, header.height);
    if u64::from(w) * u64::from(h) > limits.max_pixels {
        return Err(ApiError::bad_param(
            "image_url",
            format!("the image is {w}×{h}, more than the limit of {} pixels (--max-image-pixels)", limits.max_pixels),
        ));
    }
    if w == 0 || h == 0 {
        return Err(ApiError::bad_param("image_url", "the image has no pixels"));
    }
    let token_num = match processor.num_tokens(w, h).map_err(bad)? {
        Some(n) => u32::try_from(n).map_err(|_| ApiError::bad_param("image_url", "the image is too large"))?,
        None => model_tokens,
    };
    let digest = ItemDigest::compute(Modality::Image, fingerprint, &bytes);
    Ok(MediaItem { bytes, digest, modality: Modality::Image, token_num })
}

fn audio(
    bytes: Vec<u8>,
    hint: Option<&str>,
    limits: &AudioLimits,
    fe: &WhisperFeatureExtractor,
    fingerprint: &str,
    param: &str,
) -> Result<MediaItem, ApiError> {
    use mmserve_media::audio::AudioError;
    let bad = |e: AudioError| match e {
        AudioError::TooLong { .. } => ApiError::bad_param(param, format!("{e} (--max-audio-seconds)")),
        e => ApiError::bad_param(param, e.to_string()),
    };
    let wave = decode_audio(&bytes, hint, limits).map_err(bad)?;
    // The model sees the first 30 s (transformers truncates likewise).
    let used = &wave.samples[..wave.samples.len().min(fe.n_samples)];
    let token_num = fe.qwen2_audio_tokens_for(used.len()).map_err(bad)?;
    let digest = ItemDigest::compute(Modality::Audio, fingerprint, &bytes);
    let pcm: Vec<u8> = used.iter().flat_map(|s| s.to_le_bytes()).collect();
    Ok(MediaItem { bytes: pcm, digest, modality: Modality::Audio, token_num: token_num as u32 })
}
